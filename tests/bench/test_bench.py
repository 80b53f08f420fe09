"""`mars bench`: metrics on known strings, prompt loading, aggregation, the run on
tiny models, the JSON contract, llama.cpp peers through a fake binary, bad input."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from mars_local import bench as B
from mars_local.core.errors import MarsError

from helpers import benchmark_script, invoke, run_python

ROW_KEYS = {
    "category", "method", "theta", "k", "tokens_per_second", "speedup_vs_plain", "acceptance_rate",
    "mean_accepted_length", "relaxed_share", "token_agreement", "quality_recovery", "nll_ratio",
}


# ------------------------------------------------------------------ metrics
def test_extract_answer_takes_the_number_after_the_last_answer():
    assert B.extract_answer("Answer: 3 ... no wait. Answer: 15") == 15
    assert B.extract_answer("so the total is **Answer:** $1,200.") == 1200
    assert B.extract_answer("answer: -4.5 apples") == -4.5
    assert B.extract_answer("The answer is 15") is None
    assert B.extract_answer("Answer: none") is None


def test_score_exact_and_contains():
    assert B.score_exact("5 + 10 = 15.\nAnswer: 15", "15") == 1.0
    assert B.score_exact("Answer: 15.0", "15") == 1.0
    assert B.score_exact("Answer: 14", "15") == 0.0
    assert B.score_exact("15", "15") == 0.0  # no "Answer:"
    assert B.score_contains("It was built by CLARA VOSS in 1874.", "Clara Voss") == 1.0
    assert B.score_contains("It was built by Clara.", "Clara Voss") == 0.0


def test_rouge_l_on_known_strings():
    assert B.score_rouge_l("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert B.score_rouge_l("dogs bark loudly", "the cat sat on the mat") == 0.0
    # LCS "the cat on the mat" = 5 of 6 tokens on both sides: P = R = F = 5/6
    assert B.score_rouge_l("the cat is on the mat", "the cat sat on the mat") == pytest.approx(5 / 6)


def test_chrf_on_known_strings():
    ref = "La bibliothèque ouvre à neuf heures du matin."
    assert B.score_chrf(ref, ref) == pytest.approx(1.0)
    close = B.score_chrf("La bibliothèque ouvre à neuf heures.", ref)
    far = B.score_chrf("Der Hund schläft.", ref)
    assert 0.0 <= far < close < 1.0
    import sacrebleu

    assert close == pytest.approx(sacrebleu.sentence_chrf("La bibliothèque ouvre à neuf heures.", [ref]).score / 100)


def test_task_score_dispatch():
    assert B.task_score(None, "anything", "x") is None
    assert B.task_score("exact", "Answer: 2", None) is None
    assert B.task_score("exact", "Answer: 2", "2") == 1.0
    assert B.task_score("exact_contains", "PARIS", "Paris") == 1.0
    with pytest.raises(MarsError):
        B.task_score("bleu", "a", "b")


# ------------------------------------------------------------------ prompts
def test_builtin_prompt_set_loads():
    ps = B.load_prompts()
    cats = [p.category for p in ps]
    assert len(ps) == 48 and set(cats) == {"chat", "code", "math", "summarization", "translation", "rag"}
    assert all(cats.count(c) == 8 for c in set(cats))
    metric = {p.category: p.metric for p in ps}
    assert metric == {"chat": None, "code": None, "math": "exact", "summarization": "rougeL",
                      "translation": "chrf", "rag": "exact_contains"}
    assert all(p.messages and p.messages[-1]["role"] == "user" for p in ps)
    assert all(p.reference for p in ps if p.metric)


def test_category_filter_and_quick_subset():
    ps = B.load_prompts(categories=["rag", "math"])
    assert [p.category for p in ps] == ["rag"] * 8 + ["math"] * 8
    q = B.quick_subset(B.load_prompts(), 1)
    assert len(q) == 6 and len({p.category for p in q}) == 6
    with pytest.raises(MarsError, match="unknown category 'poetry'"):
        B.load_prompts(categories=["poetry"])


def test_user_prompt_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(
        '{"id": "a", "prompt": "Hello there"}\n\n'
        '{"id": "b", "category": "qa", "messages": [{"role": "user", "content": "Hi?"}], "reference": 42, "metric": "exact"}\n'
        '{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}\n'
    )
    a, b, c = B.load_prompts([f])
    assert (a.id, a.category, a.text, a.messages, a.scored) == ("a", "mine", "Hello there", None, False)
    assert (b.category, b.reference, b.metric, b.scored) == ("qa", "42", "exact", True)
    assert (c.id, c.messages) == ("81", ({"role": "user", "content": "Write a poem."},))


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "JSON object"),
        ('{"prompt": "no id"}', "missing 'id'"),
        ('{"id": "x"}', "exactly one of"),
        ('{"id": "x", "prompt": "p", "messages": [{"role": "user", "content": "c"}]}', "exactly one of"),
        ('{"id": "x", "messages": [{"role": "user"}]}', "'messages'"),
        ('{"id": "x", "prompt": "  "}', "non-empty"),
        ('{"id": "x", "prompt": "p", "metric": "bleu"}', "unknown metric"),
        ('{"id": "x", "prompt": "p", "reference": ["a"]}', "reference"),
        ('{"id": "x", "prompt": "p"}\n{"id": "x", "prompt": "q"}', "duplicate id"),
    ],
)
def test_malformed_prompt_lines(tmp_path, line, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(MarsError, match=needle) as e:
        B.load_prompts([f])
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_unreadable_prompt_file(tmp_path):
    with pytest.raises(MarsError, match="cannot read prompts file"):
        B.load_prompts([tmp_path / "missing.jsonl"])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(MarsError, match="no prompts"):
        B.load_prompts([tmp_path / "empty.jsonl"])


# -------------------------------------------------------------- aggregation
def _s(tokens, t, text="", score=None, nll=None, **kw):
    return B.Sample(text=text, tokens=tokens, n_generated=len(tokens), time_decode_s=t, score=score, nll_sum=nll, **kw)


def test_summarize_on_known_samples():
    prompts = [
        B.BenchPrompt("m1", "math", text="q", reference="1", metric="exact"),
        B.BenchPrompt("m2", "math", text="q", reference="2", metric="exact"),
        B.BenchPrompt("c1", "chat", text="q"),
    ]
    plain = B.RunConfig("plain", "none", None, 0)
    mars = B.RunConfig("mars", "ngram", 0.9, 4)
    stats = dict(time_target_s=0.1, time_draft_s=0.01, time_verify_s=0.01)
    samples = {
        plain: [_s([1, 2, 3, 4], 1.0, score=1.0, nll=4.0, n_rounds=4, n_drafted=0, n_accepted=0, n_relaxed=0, **stats),
                _s([5, 6, 7, 8], 1.0, score=1.0, nll=4.0, n_rounds=4, n_drafted=0, n_accepted=0, n_relaxed=0, **stats),
                _s([9, 9], 1.0, nll=2.0, n_rounds=2, n_drafted=0, n_accepted=0, n_relaxed=0, **stats)],
        mars: [_s([1, 2, 3, 4], 0.5, score=1.0, nll=4.0, n_rounds=2, n_drafted=4, n_accepted=2, n_relaxed=1, **stats),
               _s([5, 0, 7, 8], 0.5, score=0.0, nll=8.0, n_rounds=2, n_drafted=4, n_accepted=2, n_relaxed=0, **stats),
               _s([9, 9], 2.0, nll=2.0, n_rounds=2, n_drafted=2, n_accepted=0, n_relaxed=0, **stats)],
    }
    rows = {(r["method"], r["category"]): r for r in B.summarize(prompts, [plain, mars], samples)}
    assert len(rows) == 2 * 3
    p, m = rows["plain", "all"], rows["mars", "math"]
    assert p["speedup_vs_plain"] == 1.0 and p["acceptance_rate"] is None and p["relaxed_share"] is None
    assert p["mean_accepted_length"] == 1.0 and p["token_agreement"] == 1.0 and p["nll_ratio"] == 1.0
    assert m["tokens_per_second"] == pytest.approx(8.0) and m["speedup_vs_plain"] == pytest.approx(2.0)
    assert m["acceptance_rate"] == 0.5 and m["mean_accepted_length"] == 2.0 and m["relaxed_share"] == 0.25
    assert m["token_agreement"] == pytest.approx(5 / 8)  # 4 + 1 equal positions before divergence, of 8
    assert m["quality_recovery"] == pytest.approx(0.5)
    assert m["nll_ratio"] == pytest.approx((12 / 8) / (8 / 8))
    c = rows["mars", "chat"]
    assert c["quality_recovery"] is None and c["speedup_vs_plain"] == pytest.approx(0.5)
    a = rows["mars", "all"]
    assert a["tokens_per_second"] == pytest.approx(10 / 3.0) and a["speedup_vs_plain"] == pytest.approx((10 / 3) / (10 / 3))
    assert a["quality_recovery"] == pytest.approx(0.5)


def test_rounds_give_each_ratio_to_llama_cpp_a_median_and_a_range():
    """With repeats, each round's rate and its ratio to llama.cpp's best speculative rate of the
    same round; a ratio whose rounds fall on both sides of 1.0 is marked not separable."""
    prompts = [B.BenchPrompt("c1", "chat", text="q"), B.BenchPrompt("c2", "chat", text="q")]
    plain = B.RunConfig("plain", "none", None, 0)
    mars = B.RunConfig("mars", "model", 0.9, "adaptive")
    strict = B.RunConfig("strict", "model", None, "adaptive")
    k4, k8 = B.RunConfig(B.PEER_SPEC, "model", None, 4), B.RunConfig(B.PEER_SPEC, "model", None, 8)
    secs = {  # decode seconds of 10 tokens per prompt, per round (llama.cpp's k = 8 is fast in round 2)
        plain: [1.0, 1.5, 1.0], mars: [0.4, 0.45, 0.45], strict: [0.5, 0.8, 0.5], k4: [0.5, 0.75, 0.55], k8: [0.6, 0.5, 0.6]}
    rounds = {r: [[_s(list(range(10)), t), _s(list(range(10)), t)] for t in ts] for r, ts in secs.items()}
    fastest = {r: [min((js[i] for js in rounds[r]), key=lambda x: x.time_decode_s) for i in range(2)] for r in rounds}
    runs = [plain, mars, strict, k4, k8]
    rows = {(r["method"], r["k"]): r for r in B.summarize(prompts, runs, fastest, rounds=rounds) if r["category"] == "all"}
    m, st = rows["mars", "adaptive"], rows["strict", "adaptive"]
    assert m["tokens_per_second_rounds"] == pytest.approx([25.0, 20 / 0.9, 20 / 0.9])
    assert m["tokens_per_second_median"] == pytest.approx(20 / 0.9)
    best = [20 / 1.0, 20 / 1.0, 20 / 1.1]  # llama.cpp's best rate per round: k = 4, k = 8, k = 4
    assert m["vs_llama_spec_rounds"] == pytest.approx([25 / best[0], (20 / 0.9) / best[1], (20 / 0.9) / best[2]])
    assert m["vs_llama_spec_median"] == pytest.approx((20 / 0.9) / best[2]) and m["vs_llama_spec_separable"]
    assert st["vs_llama_spec_rounds"] == pytest.approx([1.0, 12.5 / 20, 20 / best[2]])  # 1.0, 0.63, 1.1
    assert not st["vs_llama_spec_separable"]  # on both sides of 1.0: no figure
    import io

    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=400).print(B.render_tables(list(rows.values()))[0])
    lines = {line.split()[1]: line for line in out.getvalue().splitlines() if line.split()[1:2] in (["mars"], ["strict"])}
    assert "1.22 (1.11–1.25)" in lines["mars"] and "~" not in lines["mars"]
    assert "1.00 (0.62–1.10) ~" in lines["strict"]  # its cell is marked


# ------------------------------------------------------------ llama.cpp stats
SPEC_OUT = """
encoded   25 tokens in    0.031 seconds, speed:  806.452 t/s
decoded   64 tokens in    0.450 seconds, speed:  142.222 t/s

n_draft   = 8
n_predict = 64
n_drafted = 40
n_accept  = 30
accept    = 75.000%

target:
llama_perf_context_print: prompt eval time =      20.00 ms /    25 tokens (    0.80 ms per token,  1250.00 tokens per second)
llama_perf_context_print:        eval time =     400.00 ms /    20 runs   (   20.00 ms per token,    50.00 tokens per second)
"""

COMPLETION_OUT = """
llama_perf_sampler_print:    sampling time =       5.00 ms /    89 runs   (    0.06 ms per token, 17800.00 tokens per second)
llama_perf_context_print:        load time =     100.00 ms
llama_perf_context_print: prompt eval time =      30.00 ms /    25 tokens (    1.20 ms per token,   833.33 tokens per second)
llama_perf_context_print:        eval time =     630.00 ms /    63 runs   (   10.00 ms per token,   100.00 tokens per second)
"""


def test_parse_llama_cpp_stats():
    s = B.parse_llama_cpp_stats(SPEC_OUT)
    # the target's prompt: "encoded" (speculative-simple) wins over the perf print
    assert s == {"n_generated": 64, "time_decode_s": 0.45, "n_drafted": 40, "n_accepted": 30,
                 "n_prefill": 25, "time_prefill_s": 0.031}
    c = B.parse_llama_cpp_stats(COMPLETION_OUT)
    assert c == {"n_generated": 63, "time_decode_s": 0.63, "n_prefill": 25, "time_prefill_s": 0.03}
    old = B.parse_llama_cpp_stats("decoded 10 tokens in 0.1 seconds, speed: 100 t/s\nn_drafted = 8\naccept = 50.000%")
    assert old["n_accepted"] == 4
    assert B.parse_llama_cpp_stats("nothing useful") == {}


# -------------------------------------------------------- runs on tiny models
@pytest.fixture(scope="module")
def tiny_prompts(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    lines = [
        {"id": "r1", "category": "raw", "prompt": "the a the a the a", "reference": "the", "metric": "exact_contains"},
        {"id": "r2", "category": "raw", "prompt": "hello world hello world"},
        {"id": "c1", "category": "chat", "messages": [{"role": "user", "content": "hello the world"}]},
    ]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return B.load_prompts([f])


def test_target_scorer_matches_a_full_forward(tiny_target):
    from mars_local import Engine

    prompt, gen = [1, 300, 301, 302], [303, 304, 300, 305, 306]
    scorer = B.TargetScorer(target=tiny_target, n_ctx=256, n_batch=2)  # chunked rows
    try:
        got = scorer.nll(prompt, gen)
        again = scorer.nll(prompt, gen)  # prompt cached, result unchanged
    finally:
        scorer.close()
    with Engine(tiny_target, n_ctx=256) as eng:  # one forward of every row
        z = np.asarray(eng.logits(prompt + gen[:-1], n_rows=len(gen)), dtype=np.float64)
    logp = z - z.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    want = -logp[np.arange(len(gen)), gen]
    assert np.allclose(got, want, atol=1e-4) and np.allclose(got, again, atol=1e-5)
    assert np.all(got > 0)


def test_run_bench_on_tiny_models(tiny_target, tiny_draft, tiny_prompts):
    s = B.BenchSettings(target=tiny_target, draft=tiny_draft, drafters=("ngram", "model"), thetas=(0.9, 0.95),
                        draft_max=3, max_tokens=12, n_ctx=512, peers=True)
    res = B.run_bench(tiny_prompts, s)
    runs = B.plan_runs(s)
    # plain + per drafter (2 strict + 2 θ × 2 modes) + the llama-cpp-python peer
    assert len(runs) == 1 + 2 * (2 + 4) + 1 and res.runs == runs
    assert len(res.rows) == len(runs) * 3  # categories raw, chat and all
    plain = res.samples[runs[0]]
    for r in runs:
        if r.method == "strict":  # greedy strict is lossless
            assert [x.tokens for x in res.samples[r]] == [x.tokens for x in plain]
    by = {(B.RunConfig(r["method"], r["drafter"], r["theta"], r["k"]), r["category"]): r for r in res.rows}
    for r in runs:
        row = by[r, "all"]
        assert set(ROW_KEYS) <= set(row)
        if r.method in ("plain", "strict"):
            assert row["token_agreement"] == 1.0 and row["nll_ratio"] == pytest.approx(1.0)
        assert row["tokens_per_second"] > 0
    assert by[runs[0], "all"]["speedup_vs_plain"] == 1.0
    assert by[runs[0], "raw"]["quality_recovery"] in (1.0, None)
    peer = by[B.RunConfig(B.PEER_LCP, "ngram", None, 3), "all"]
    assert peer["token_agreement"] is not None and peer["nll_ratio"] is not None
    drafted = [by[r, "all"]["acceptance_rate"] for r in runs if r.method == "strict" and r.k == 3]
    assert all(a is not None for a in drafted)


def test_sampling_run_leaves_out_adaptive_mars(tiny_target):
    s = B.BenchSettings(target=tiny_target, thetas=(0.9,), draft_max=2, temperature=0.8, seed=3, peers=False)
    ks = [(r.method, r.k) for r in B.plan_runs(s)]
    assert ("mars", "adaptive") not in ks and ("strict", "adaptive") in ks and ("mars", 2) in ks


def test_fixed_k_sweep_and_repeats(tiny_target, tiny_prompts):
    s = B.BenchSettings(target=tiny_target, thetas=(0.9,), draft_max=3, fixed_ks=(1, 3), repeats=2,
                        max_tokens=8, n_ctx=512, peers=False)
    runs = B.plan_runs(s)
    assert [(r.method, r.k) for r in runs] == [
        ("plain", 0), ("strict", 1), ("strict", 3), ("strict", "adaptive"), ("mars", 1), ("mars", 3), ("mars", "adaptive")]
    calls = []
    res = B.run_bench(tiny_prompts, s, lambda done, total, label: calls.append((done, total)))
    assert calls[-1] == (len(runs) * len(tiny_prompts) * 2,) * 2  # every configuration twice per prompt
    rows = {(r["method"], r["k"], r["category"]): r for r in res.rows}
    for method in ("strict", "mars"):
        row = rows[method, "adaptive", "all"]
        best = max(rows[m, k, "all"]["tokens_per_second"] for m, k in [("plain", 0), (method, 1), (method, 3)])
        assert row["vs_best_fixed"] == pytest.approx(row["tokens_per_second"] / best)
        assert rows[method, 1, "all"]["vs_best_fixed"] is None


def test_repeats_keep_the_fastest_generation(tiny_target, tiny_prompts, monkeypatch):
    s = B.BenchSettings(target=tiny_target, thetas=(0.9,), draft_max=2, adaptive_modes=(False,), repeats=3,
                        max_tokens=6, n_ctx=512, peers=False)
    from mars_local.bench import runner as bench_runner

    seen = []
    orig = bench_runner._engine_sample

    def slow_then_fast(out):  # the decode time of each generation, made up: 3, 2, 1, 3, 2, 1, ...
        smp = orig(out)
        smp.time_decode_s = 3.0 - len(seen) % 3
        seen.append(smp.time_decode_s)
        return smp

    monkeypatch.setattr(bench_runner, "_engine_sample", slow_then_fast)
    res = B.run_bench(tiny_prompts[:1], s)
    assert all(x.time_decode_s == 1.0 for r in res.runs for x in res.samples[r])


def test_settings_validation(tiny_target):
    for bad, needle in [
        (dict(fixed_ks=(0,)), "fixed draft length"), (dict(draft_max=2, fixed_ks=(3,)), "fixed draft length"),
        (dict(repeats=0), "repeat"),
        (dict(thetas=(1.5,)), "theta"), (dict(thetas=(0.0,)), "theta"), (dict(thetas=()), "θ"),
        (dict(drafters=("model",)), "draft model"), (dict(drafters=("magic",)), "one of ngram, model, mtp"),
        (dict(draft_max=0), "draft-max"), (dict(max_tokens=0), "tokens"), (dict(temperature=-1.0), "temperature"),
    ]:
        with pytest.raises(MarsError, match=needle):
            B.BenchSettings(target=tiny_target, **bad).validate()


# --------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_quick_json_contract(tiny_target, tiny_draft, tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    r = invoke("bench", "--quick", "-m", tiny_target, "-md", tiny_draft, "-c", 1024, "--json", out, "--plot", png)
    assert r.exit_code == 0, r.output
    assert "speedup" in r.stdout and "mars" in r.stdout
    data = json.loads(out.read_text())
    rows = data["runs"]
    cats = {"chat", "code", "math", "summarization", "translation", "rag"}
    configs = {}
    for row in rows:
        assert ROW_KEYS <= set(row), set(ROW_KEYS) - set(row)
        assert row["method"] in ("plain", "strict", "mars", B.PEER_LCP)
        assert row["k"] == "adaptive" or isinstance(row["k"], int)
        assert row["category"] in cats | {"all"}
        configs.setdefault((row["method"], row["drafter"], row["theta"], row["k"]), []).append(row["category"])
    # plain, then per drafter (ngram, model): strict ×2 + one θ × 2 k modes, then the peer
    assert len(configs) == 1 + 2 * 4 + 1
    for cfg, seen in configs.items():
        assert seen.count("all") == 1 and set(seen) == cats | {"all"}, cfg
    plain = [row for row in rows if row["method"] == "plain"]
    assert all(row["speedup_vs_plain"] == 1.0 for row in plain)
    assert {row["theta"] for row in rows if row["method"] == "mars"} == {0.9}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["meta"]["max_tokens"] == 16 and data["meta"]["n_prompts"] == 6
    assert "format_json" not in data["meta"] and not any("grammar" in row for row in rows)  # without --format-json


FAKE = r'''#!{python}
import sys
from pathlib import Path
args = sys.argv[1:]
if "--help" in args:
    print("-m, --model FNAME\n--spec-type TYPE  none,draft-simple,draft-eagle3,draft-mtp,ngram-simple\n--spec-draft-n-max N\n--no-escape\n"
          "-no-cnv, --no-conversation\n--no-display-prompt\n--spec-ngram-simple-size-n N")
    sys.exit(0)
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\n")
if {fail}:
    print("error: failed to load model", file=sys.stderr)
    sys.exit(1)
n = int(args[args.index("-n") + 1])
print("generated text")
if {spec}:
    print("encoded   20 tokens in    0.010 seconds, speed: 2000.000 t/s", file=sys.stderr)
    k = int(args[args.index("--spec-draft-n-max") + 1])
    secs = 0.25 if k == 2 else 0.5  # k = 2 is this fake's best draft length
    print("decoded %4d tokens in    %.3f seconds, speed: %8.3f t/s" % (n, secs, n / secs), file=sys.stderr)
    print("n_draft   = 4\nn_predict = %d\nn_drafted = 20\nn_accept  = 15\naccept    = 75.000%%" % n, file=sys.stderr)
else:
    print("llama_perf_context_print: prompt eval time =  10.00 ms /  20 tokens (0.50 ms per token, 2000.00 tokens per second)", file=sys.stderr)
    print("llama_perf_context_print:        eval time = 1000.00 ms / %5d runs   (66.67 ms per token, 15.00 tokens per second)" % (n - 1), file=sys.stderr)
'''


def _fake_bin(d, fail=False):
    d.mkdir(parents=True, exist_ok=True)
    log = d / "calls.log"
    for name, spec in (("llama-speculative-simple", True), ("llama-completion", False)):
        p = d / name
        p.write_text(FAKE.format(python=sys.executable, log=str(log), spec=spec, fail=fail))
        p.chmod(0o755)
    return log


def test_llama_cpp_peers_with_a_fake_binary(tiny_target, tmp_path):
    log = _fake_bin(tmp_path / "bin")
    out = tmp_path / "b.json"
    r = invoke("bench", "--quick", "-m", tiny_target, "--categories", "math,rag", "--no-peers",
               "--llama-cpp-bin", tmp_path / "bin", "--json", out)
    assert r.exit_code == 0, r.output
    rows = {(row["method"], row["category"]): row for row in json.loads(out.read_text())["runs"]}
    spec = rows[B.PEER_SPEC, "all"]
    assert spec["tokens_per_second"] == pytest.approx(32.0)  # 16 tokens in 0.5 s per prompt
    assert spec["acceptance_rate"] == pytest.approx(0.75) and spec["drafter"] == "ngram"
    assert spec["speedup_vs_plain"] == pytest.approx(32.0 / rows["plain", "all"]["tokens_per_second"])
    comp = rows[B.PEER_COMPLETION, "all"]
    assert comp["tokens_per_second"] == pytest.approx(15.0) and comp["acceptance_rate"] is None
    assert comp["quality_recovery"] is None and comp["token_agreement"] is None
    calls = log.read_text().splitlines()
    assert len(calls) == 4  # 2 prompts × 2 binaries
    spec_call = next(c for c in calls if "--spec-type" in c).split()
    assert spec_call[spec_call.index("-m") + 1] == str(tiny_target)
    assert spec_call[spec_call.index("-n") + 1] == "16" and spec_call[spec_call.index("--temp") + 1] == "0"
    assert spec_call[spec_call.index("--spec-type") + 1] == "ngram-simple"
    assert spec_call[spec_call.index("--spec-draft-n-max") + 1] == "8"
    comp_call = next(c for c in calls if "--spec-type" not in c)
    assert "-no-cnv" in comp_call and "-f" in comp_call


def test_mtp_drafting_is_benchmarked_against_llama_cpp_draft_mtp(tiny_dir, tmp_path):
    """--drafter mtp: our strict and MARS rows draft with the target's MTP layers, and
    llama-speculative-simple is run with --spec-type draft-mtp on the same file (no -md)."""
    from tinymodels import make_tiny_mimo2

    model = make_tiny_mimo2(tiny_dir / "mimo2-bench.gguf", seed=5)
    log = _fake_bin(tmp_path / "bin")
    out = tmp_path / "b.json"
    r = invoke("bench", "--quick", "-m", model, "--drafter", "mtp", "--categories", "math", "--no-peers",
               "--llama-cpp-bin", tmp_path / "bin", "--json", out)
    assert r.exit_code == 0, r.output
    runs = json.loads(out.read_text())["runs"]
    ours = [row for row in runs if row["method"] in ("strict", "mars") and row["category"] == "all"]
    assert ours and all(row["drafter"] == "mtp" for row in ours)
    assert any(row["acceptance_rate"] for row in ours)  # the MTP head drafted, and was right at times
    spec_call = next(c for c in log.read_text().splitlines() if "--spec-type" in c).split()
    assert spec_call[spec_call.index("--spec-type") + 1] == "draft-mtp" and "-md" not in spec_call


def test_eagle3_drafting_is_benchmarked_against_llama_cpp_draft_eagle3(tiny_dir, tmp_path):
    """--drafter eagle3 -md HEAD: our rows draft with the EAGLE-3 head, and llama-speculative-simple
    is run with --spec-type draft-eagle3 and the head as its draft model."""
    from tinymodels import make_tiny_eagle3, make_tiny_llama

    target = make_tiny_llama(tiny_dir / "eagle-bench-target.gguf", seed=11, n_layer=3, block_scale=0.05)
    head = make_tiny_eagle3(tiny_dir / "eagle3-bench-head.gguf", seed=11)
    log = _fake_bin(tmp_path / "bin")
    out = tmp_path / "b.json"
    r = invoke("bench", "--quick", "-m", target, "-md", head, "--drafter", "eagle3", "--categories", "math",
               "--no-peers", "--llama-cpp-bin", tmp_path / "bin", "--json", out)
    assert r.exit_code == 0, r.output
    ours = [row for row in json.loads(out.read_text())["runs"]
            if row["method"] in ("strict", "mars") and row["category"] == "all"]
    assert ours and all(row["drafter"] == "eagle3" for row in ours) and any(row["acceptance_rate"] for row in ours)
    spec_call = next(c for c in log.read_text().splitlines() if "--spec-type" in c).split()
    assert spec_call[spec_call.index("--spec-type") + 1] == "draft-eagle3"
    assert spec_call[spec_call.index("-md") + 1] == str(head)


def test_llama_cpp_draft_length_sweep_and_the_best_speculative_row(tiny_target, tmp_path):
    """--peer-k runs llama-speculative-simple at each k; every row is also given
    relative to its best one, and prefill speeds sit beside llama.cpp's."""
    log = _fake_bin(tmp_path / "bin")
    out = tmp_path / "b.json"
    r = invoke("bench", "-m", tiny_target, "--categories", "math", "--per-category", "2", "-n", "8", "--no-peers",
               "--thetas", "0.9", "--peer-k", "2,4", "--llama-cpp-bin", tmp_path / "bin", "--json", out)
    assert r.exit_code == 0, r.output
    rows = {(row["method"], row["k"], row["category"]): row for row in json.loads(out.read_text())["runs"]}
    assert rows[B.PEER_SPEC, 2, "all"]["n_prompts"] == 2
    assert rows[B.PEER_SPEC, 2, "all"]["vs_llama_spec"] == pytest.approx(1.0)
    assert rows[B.PEER_SPEC, 4, "all"]["vs_llama_spec"] == pytest.approx(0.5)
    plain = rows["plain", 0, "all"]
    assert plain["vs_llama_spec"] == pytest.approx(plain["tokens_per_second"] / 32.0)  # 8 tokens in 0.25 s
    assert plain["prefill_tokens_per_second"] > 0  # the plain engine prefills whole prompts
    assert rows[B.PEER_COMPLETION, 0, "all"]["prefill_tokens_per_second"] == pytest.approx(2000.0)
    assert rows[B.PEER_SPEC, 4, "all"]["prefill_tokens_per_second"] == pytest.approx(2000.0)
    ks = sorted(c.split()[c.split().index("--spec-draft-n-max") + 1] for c in log.read_text().splitlines()
                if "--spec-type" in c)
    assert ks == ["2", "2", "4", "4"]
    bad = invoke("bench", "-m", tiny_target, "--peer-k", "0,4", "--llama-cpp-bin", tmp_path / "bin")
    assert bad.exit_code == 2 and "1..64" in bad.output
    bad = invoke("bench", "-m", tiny_target, "--per-category", "0")
    assert bad.exit_code == 2 and "--per-category" in bad.output


def test_llama_cpp_binary_failure_is_one_line(tiny_target, tmp_path):
    _fake_bin(tmp_path / "bin", fail=True)
    r = invoke("bench", "--quick", "-m", tiny_target, "--categories", "rag", "--no-peers",
               "--llama-cpp-bin", tmp_path / "bin")
    assert r.exit_code == 2
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("error:") and "failed to load model" in err[-1]


@pytest.fixture(scope="module")
def bad_bench(tiny_target, tmp_path_factory):
    d = tmp_path_factory.mktemp("badbench")
    (d / "broken.jsonl").write_text('{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": \n')
    (d / "latin1.jsonl").write_bytes(b'{"id": "a", "prompt": "caf\xe9"}\n')
    (d / "bin").mkdir()
    (d / "half").mkdir()
    (d / "half" / "llama-completion").write_text("#!/bin/sh\n")
    (d / "half" / "llama-completion").chmod(0o755)
    t = str(tiny_target)
    return {
        "missing prompts file": (["--prompts", d / "nope.jsonl"], "cannot read prompts file"),
        "undecodable prompts file": (["--prompts", d / "latin1.jsonl"], "cannot read prompts file"),
        "malformed JSONL": (["--prompts", d / "broken.jsonl"], "broken.jsonl:2"),
        "unknown category": (["--categories", "poetry"], "unknown category"),
        "theta too big": (["--thetas", "0.9,1.5"], "theta"),
        "theta zero": (["--thetas", "0"], "theta"),
        "theta not a number": (["--thetas", "abc"], "not a number"),
        "draft model missing": (["--drafter", "model"], "draft model"),
        "bad drafter": (["--drafter", "none"], "one of ngram, model, mtp"),
        "pair and model": (["--pair", "smollm2-135m"], "exclusive"),
        "unknown pair": (["--pair", "no-such-pair", "-m", None], "unknown model"),
        "no binaries": (["--llama-cpp-bin", d / "bin"], "llama-speculative-simple"),
        "one binary missing": (["--llama-cpp-bin", d / "half"], "llama-speculative-simple not found"),
        "not a folder": (["--llama-cpp-bin", d / "nope"], "not a directory"),
        "zero tokens": (["-n", "0"], "tokens"),
        "zero k": (["--draft-max", "0"], "draft-max"),
        "fixed k not a number": (["--fixed-k", "1,x"], "whole number"),
        "fixed k above draft max": (["--draft-max", "2", "--fixed-k", "4"], "fixed draft length"),
        "zero repeats": (["--repeat", "0"], "repeat"),
        "bad json dir": (["--json", d / "no" / "b.json"], "no such directory"),
        "json is a directory": (["--json", d], "is a directory"),
        "plot is a directory": (["--plot", d], "is a directory"),
        "plot name too long": (["--plot", d / ("p" * 300 + ".png")], "--plot"),
    }, t


BAD = [
    "missing prompts file", "undecodable prompts file", "malformed JSONL", "unknown category", "theta too big",
    "theta zero", "theta not a number", "draft model missing", "bad drafter", "pair and model", "unknown pair",
    "no binaries", "one binary missing", "not a folder", "zero tokens", "zero k", "bad json dir",
    "fixed k not a number", "fixed k above draft max", "zero repeats", "json is a directory", "plot is a directory",
    "plot name too long",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_bench_input_is_one_line_and_exit_2(bad_bench, case):
    cases, target = bad_bench
    extra, needle = cases[case]
    args = ["bench", "--quick", "--no-peers"]
    if None in extra:  # no -m for this case
        extra = [a for a in extra if a is not None and a != "-m"]
    else:
        args += ["-m", target]
    r = invoke(*args, *extra)
    assert r.exit_code == 2, (r.exit_code, r.output)
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), r.stderr
    assert needle.lower() in err[0].lower(), err[0]
    assert "Traceback" not in r.output and r.stdout == ""


def test_thetas_parse():
    from mars_local.cli.bench import parse_thetas

    assert parse_thetas("0.85, 0.9,0.95,0.9") == (0.85, 0.9, 0.95)
    assert parse_thetas("1") == (1.0,)
    assert math.isclose(parse_thetas(".5")[0], 0.5)


def test_report_script_renders_markdown(tmp_path, capsys):
    report = benchmark_script("report")
    base = dict(acceptance_rate=None, mean_accepted_length=1.0, relaxed_share=None, token_agreement=1.0,
                nll_ratio=1.0, vs_best_fixed=None)
    runs = []
    for cat, q in (("rag", 1.0), ("all", 1.0)):
        runs.append(dict(base, category=cat, method="plain", drafter="none", theta=None, k=0,
                         tokens_per_second=100.0, speedup_vs_plain=1.0, quality_recovery=q))
        runs.append(dict(base, category=cat, method="mars", drafter="ngram", theta=0.9, k="adaptive",
                         tokens_per_second=98.0, speedup_vs_plain=0.98, quality_recovery=0.99, vs_best_fixed=0.98,
                         acceptance_rate=0.5, relaxed_share=0.1))
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"runs": runs, "meta": {"model": "m", "n_prompts": 1, "max_tokens": 8}}))
    assert report.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "| mars ngram θ=0.9 k=adaptive | 98.0 | 0.98× | 50% | 1.00 | 10% | 100% | 0.990 | 1.000 | 0.98× |" in out
    assert "| mars ngram θ=0.9 k=adaptive | 0.98 / 0.99 | 0.98 |" in out
    assert "best fixed k in hindsight" in out and "| mars ngram θ=0.9 k=adaptive | 0.98 | 0.98 |" in out
    assert "llama.cpp spec" not in out  # no llama.cpp rows, no head-to-head table
    for r in runs:  # with llama.cpp's speculative row: the head-to-head table first
        r.update(vs_llama_spec=r["tokens_per_second"] / 80.0, time_decode_s=2.0, time_target_s=1.5,
                 time_draft_s=0.3, time_verify_s=0.1, prefill_tokens_per_second=250.0)
    f.write_text(json.dumps({"runs": runs, "meta": {"model": "m", "n_prompts": 1, "max_tokens": 8}}))
    assert report.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "| mars ngram θ=0.9 k=adaptive | 98.00 | 1.23× | 0.98× | 50% | 1.00 | 75%/15%/5%/5% | 250.0 |" in out
    assert report.main([str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("error:")


# ------------------------------------------------- without the bench extra
BENCH_EXTRA = ["rouge_score", "rouge_score.rouge_scorer", "sacrebleu", "sacrebleu.metrics", "matplotlib",
               "matplotlib.backends.backend_agg", "matplotlib.figure", "matplotlib.lines"]


@pytest.fixture
def no_bench_extra(monkeypatch):
    """rouge-score, sacrebleu and matplotlib made unimportable (None in sys.modules)."""
    from mars_local.bench import metrics

    for name in BENCH_EXTRA:
        monkeypatch.setitem(sys.modules, name, None)
    metrics._rouge.cache_clear()
    metrics._chrf.cache_clear()
    yield
    metrics._rouge.cache_clear()
    metrics._chrf.cache_clear()


def test_metrics_without_the_bench_extra_are_a_one_line_hint(no_bench_extra):
    assert B.task_score("exact", "Answer: 2", "2") == 1.0 and B.task_score("exact_contains", "PARIS", "Paris") == 1.0
    assert B.unavailable_metrics(["exact", "exact_contains", None]) == {}
    for metric, fn in (("rougeL", B.score_rouge_l), ("chrf", B.score_chrf)):
        with pytest.raises(MarsError, match=r"mars-local\[bench\]") as e:
            fn("a b", "a b")
        assert "\n" not in str(e.value)
        missing = B.unavailable_metrics(["exact", metric])
        assert list(missing) == [metric] and "mars-local[bench]" in missing[metric]
    with pytest.raises(MarsError, match=r"matplotlib; install mars-local\[bench\]"):
        B.check_plot()


def test_cli_bench_without_the_bench_extra(no_bench_extra, tiny_target, tmp_path):
    ok = invoke("bench", "--quick", "-m", tiny_target, "--categories", "math,rag", "--no-peers")
    assert ok.exit_code == 0 and "not scored" not in ok.stderr, ok.output
    # summaries are timed but not scored: one warning, a result without a quality score
    out = tmp_path / "b.json"
    r = invoke("bench", "--quick", "-m", tiny_target, "--no-peers", "--categories", "summarization", "--json", out)
    assert r.exit_code == 0, r.output
    assert "warning: rougeL prompts are timed but not scored" in r.stderr and "mars-local[bench]" in r.stderr
    doc = json.loads(out.read_text())
    assert any("not scored" in n for n in doc["meta"]["notes"])
    assert doc["runs"] and all(row["task_score"] is None for row in doc["runs"]), doc["runs"]
    r = invoke("bench", "--quick", "-m", tiny_target, "--no-peers", "--categories", "math", "--plot", tmp_path / "b.png")
    assert r.exit_code == 2, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "mars-local[bench]" in err[0], r.stderr


def test_the_cli_does_not_import_the_bench_extra():
    code = ("import sys, mars_local.cli.main, mars_local.bench; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'rouge_score', 'sacrebleu', 'matplotlib'}))")
    r = run_python(code, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


# ------------------------------------------------------------ --format-json (the JSON grammar's cost)
def test_format_json_adds_plain_and_one_mars_row_per_drafter(tiny_target, tiny_draft):
    base = dict(target=tiny_target, draft=tiny_draft, drafters=("ngram", "model"), thetas=(0.85, 0.9, 0.95),
                draft_max=4, peers=False)
    without = B.plan_runs(B.BenchSettings(**base))
    assert all(r.grammar is None and "+json" not in r.label for r in without)
    runs = B.plan_runs(B.BenchSettings(**base, format_json=True))
    assert [r for r in runs if r.grammar is None] == without  # the other rows unchanged, in their order
    assert [r.label for r in runs if r.grammar] == [
        "plain +json", "mars ngram θ=0.9 k=adaptive +json", "mars model θ=0.9 k=adaptive +json"]
    assert runs[0] == B.RunConfig("plain", "none", None, 0) and runs[1].label == "plain +json"
    # each +json row follows its drafter's block
    assert runs.index(B.RunConfig("mars", "ngram", 0.9, "adaptive", "json")) < runs.index(
        B.RunConfig("strict", "model", None, 4))


def test_format_json_row_theta_and_k(tiny_target):
    s = B.BenchSettings(target=tiny_target, thetas=(0.8, 0.95), draft_max=3, fixed_ks=(1, 3), peers=False,
                        format_json=True)
    assert [r.label for r in B.plan_runs(s) if r.grammar] == ["plain +json", "mars ngram θ=0.8 k=adaptive +json"]
    s = B.BenchSettings(target=tiny_target, thetas=(0.9,), draft_max=3, fixed_ks=(1, 2), temperature=0.7, seed=1,
                        peers=False, format_json=True)  # sampling: no adaptive MARS, so the largest fixed k
    assert [r.label for r in B.plan_runs(s) if r.grammar] == ["plain +json", "mars ngram θ=0.9 k=2 +json"]


def test_summarize_and_tables_with_json_rows():
    prompts = [B.BenchPrompt("c1", "chat", text="q")]
    plain, pj = B.RunConfig("plain", "none", None, 0), B.RunConfig("plain", "none", None, 0, "json")
    fixed = B.RunConfig("mars", "ngram", 0.9, 4)
    ad, adj = B.RunConfig("mars", "ngram", 0.9, "adaptive"), B.RunConfig("mars", "ngram", 0.9, "adaptive", "json")
    samples = {plain: [_s([1] * 8, 1.0, n_rounds=8)], pj: [_s([2] * 8, 2.0, n_rounds=8)],
               fixed: [_s([1] * 8, 0.5, n_rounds=4)], ad: [_s([1] * 8, 0.25, n_rounds=2)],
               adj: [_s([2] * 8, 1.0, n_rounds=4)]}
    runs = [plain, pj, fixed, ad, adj]
    rows = {B.row_label(r): r for r in B.summarize(prompts, runs, samples) if r["category"] == "all"}
    assert list(rows) == [r.label for r in runs]
    assert "grammar" not in rows["plain"] and "grammar" not in rows["mars ngram θ=0.9 k=adaptive"]
    j = rows["mars ngram θ=0.9 k=adaptive +json"]
    assert j["grammar"] == "json" and j["mean_accepted_length"] == 2.0 and j["tokens_per_second"] == 8.0
    assert j["speedup_vs_plain"] == 1.0  # 8 tok/s over unconstrained plain's 8
    assert j["vs_best_fixed"] == pytest.approx(8.0 / 4.0)  # over plain +json (4 tok/s), not the unconstrained rows
    assert rows["mars ngram θ=0.9 k=adaptive"]["vs_best_fixed"] == pytest.approx(32.0 / 16.0)
    from rich.console import Console

    console = Console(width=400, record=True)
    for t in B.render_tables(list(rows.values())):
        console.print(t)
    text = console.export_text()
    assert "mars +json" in text and "plain +json" in text and "mars ngram θ=0.9 k=adaptive +json" in text


def test_cli_format_json_reaches_the_settings(tiny_target, monkeypatch):
    seen = []

    def fake_run(prompts, settings, progress=None):
        seen.append(settings)
        raise MarsError("stopped by the test")

    monkeypatch.setattr(B, "run_bench", fake_run)
    for extra, want in [([], False), (["--format-json"], True)]:
        r = invoke("bench", "--quick", "--no-peers", "-m", tiny_target, *extra)
        assert r.exit_code == 2 and "stopped by the test" in r.stderr
        assert seen[-1].format_json is want
    n = [int(x.split("×")[1].split()[0]) for x in r.stderr.splitlines() if "configurations" in x]
    assert n == [len(B.plan_runs(seen[-1]))] and n[0] == len(B.plan_runs(seen[0])) + 2


def test_run_bench_format_json_on_tiny_models(tiny_target, tiny_prompts):
    s = B.BenchSettings(target=tiny_target, thetas=(0.9,), draft_max=3, max_tokens=8, n_ctx=512, peers=False,
                        format_json=True)
    res = B.run_bench(tiny_prompts, s)
    json_runs = [r for r in res.runs if r.grammar]
    assert [r.label for r in json_runs] == ["plain +json", "mars ngram θ=0.9 k=adaptive +json"]
    for r in json_runs:  # the JSON grammar's root is an object
        assert all(smp.text.startswith("{") for smp in res.samples[r]), [smp.text for smp in res.samples[r]]
    unconstrained = res.samples[res.runs[0]]
    assert any(not smp.text.startswith("{") for smp in unconstrained)  # so the grammar did something
    rows = {B.row_label(r): r for r in res.rows if r["category"] == "all"}
    assert rows["plain +json"]["grammar"] == "json" and rows["plain +json"]["tokens_per_second"] > 0
    assert rows["mars ngram θ=0.9 k=adaptive +json"]["mean_accepted_length"] > 0
    assert res.to_dict()["meta"]["format_json"] is True

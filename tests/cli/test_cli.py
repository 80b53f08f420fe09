"""`mars run`: the JSON contract and every bad-input path (one line, exit 2)."""

from __future__ import annotations

import json

import pytest

from mars_local import GenerateConfig, MarsError
from mars_local.models.registry import bench_drafters, choose_models
from mars_local.core.stats import SpecStats

from helpers import invoke, mars


# ------------------------------------------------ with the fake engine (no model)
def test_run_json_is_one_object_with_every_stats_field(fake_engine):
    fake_engine.reply = "the answer"
    r = invoke("run", "hello world", "-m", "fake.gguf", "-n", 12, "--json")
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1  # one JSON object and nothing else on stdout
    obj = json.loads(lines[0])
    assert obj["text"] == "the answer" and obj["tokens"] == list(b"the answer")
    assert set(obj["stats"]) == set(SpecStats().to_dict())
    assert obj["stats"]["n_generated"] == 10 and obj["stats"]["stop_reason"] == "eog"
    assert fake_engine.calls[0][0] == "hello world" and fake_engine.closed


def test_run_streams_text_and_prints_stats(fake_engine):
    fake_engine.reply = "streamed"
    r = invoke("run", "hello", "-m", "fake.gguf", "-n", 8, "--stats")
    assert r.exit_code == 0, r.output
    assert r.stdout == "streamed\n"
    assert "model:                fake.gguf (drafter: none)" in r.stderr
    assert "eval count:           8 token(s)" in r.stderr and "stop reason:          eog" in r.stderr
    assert invoke("run", "hello", "-m", "fake.gguf", "--verbose").exit_code == 2  # --stats has no alias --verbose
    assert "eval count:" in invoke("run", "hello", "-m", "fake.gguf", "-v").stderr


def test_run_reads_the_prompt_from_stdin(fake_engine):
    assert invoke("run", "-", "-m", "fake.gguf", "--json", input="hello world").exit_code == 0
    assert invoke("run", "-m", "fake.gguf", "--json", input="from a pipe").exit_code == 0
    assert [c[0] for c in fake_engine.calls] == ["hello world", "from a pipe"]


def test_run_stops_at_n_tokens(fake_engine):
    fake_engine.reply = "a long answer"
    obj = json.loads(invoke("run", "hi", "-m", "fake.gguf", "-n", 4, "--json").stdout)
    assert obj["text"] == "a lo" and obj["stats"]["stop_reason"] == "length"
    assert fake_engine.calls[0][1].max_tokens == 4


def test_llama_cpp_flag_aliases(fake_engine, tmp_path):
    draft = tmp_path / "d.gguf"
    r = invoke(
        "run", "hello", "--model", "t.gguf", "--model-draft", draft, "--spec-draft-n-max", 2,
        "--spec-draft-n-min", 1, "--spec-draft-p-min", 0.25, "-ngl", 0, "-ngld", "all", "-t", 1, "-c", 256,
        "-s", 3, "--temp", 0.5, "--top-k", 10, "--top-p", 0.9, "--min-p", 0.01, "-n", 8, "--json",
    )
    assert r.exit_code == 0, r.output
    opened = fake_engine.opened[0]
    assert (str(opened["target"]), opened["draft"], opened["drafter"]) == ("t.gguf", draft, "model")
    assert (opened["n_gpu_layers"], opened["n_gpu_layers_draft"], opened["n_threads"], opened["n_ctx"]) == (0, -1, 1, 256)
    cfg = fake_engine.calls[0][1]
    assert (cfg.draft_max, cfg.draft_min, cfg.draft_p_min, cfg.max_tokens) == (2, 1, 0.25, 8)
    s = cfg.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed) == (0.5, 10, 0.9, 0.01, 3)


def test_a_registry_pair_brings_its_drafter_theta_and_k(fake_engine):
    """No -m: the default pair (the bundled model, drafter ngram); flags override its θ and k."""
    assert invoke("run", "hi", "--json").exit_code == 0
    assert invoke("run", "hi", "--theta", "0.5", "--draft-max", "3", "--json").exit_code == 0
    assert invoke("run", "hi", "--no-draft", "--json").exit_code == 0
    from mars_local.models.registry import load_registry

    pair = load_registry().get("smollm2-135m")
    assert [o["drafter"] for o in fake_engine.opened] == [pair.drafter, pair.drafter, "none"]
    (_, a), (_, b), _ = fake_engine.calls
    from mars_local.core.config import GenerateConfig

    theta = GenerateConfig.theta if pair.theta is None else pair.theta  # the pair overrides only what it names
    assert (a.theta, a.draft_max) == (theta, pair.draft_max) and (b.theta, b.draft_max) == (0.5, 3)


# What the CLI, the chat session, batch and the server use of an engine: the fake must offer it too.
ENGINE_SURFACE = ("n_ctx", "n_ctx_requested", "n_ctx_train", "n_threads", "has_chat_template", "eog_ids",
                  "chat_prompt", "tokenize", "piece", "stream", "generate", "close")


def test_the_fake_and_the_real_engine_offer_what_the_cli_uses(tiny_target):
    from mars_local import Engine

    from fake_engine import FakeEngine

    fake = FakeEngine()
    assert [n for n in ENGINE_SURFACE if not hasattr(fake, n)] == []
    with Engine(tiny_target, n_ctx=256) as eng:
        assert [n for n in ENGINE_SURFACE if not hasattr(eng, n)] == []
        with eng.stream("hello", GenerateConfig.make(max_tokens=2)) as stream:
            list(stream)
        assert stream.stats.n_generated == 2


# ------------------------------------------ model resolution (run and bench, one function)
def test_choose_models_for_a_file(tmp_path):
    t, d = str(tmp_path / "t.gguf"), str(tmp_path / "d.gguf")
    c = choose_models(t)
    assert (str(c.target), c.draft, c.drafter, c.label, c.pair, c.overrides) == (t, None, "none", t, None, {})
    c = choose_models(t, d)
    assert (str(c.draft), c.drafter) == (d, "model")
    c = choose_models(t, d, drafter="eagle3")  # -md is the EAGLE-3 head then
    assert (str(c.draft), c.drafter) == (d, "eagle3")
    assert choose_models(t, drafter="ngram").drafter == "ngram" and choose_models(t, no_draft=True).drafter == "none"
    for kw, needle in ((dict(model_draft=d, no_draft=True), "--no-draft contradicts"),
                       (dict(drafter="ngram", no_draft=True), "--no-draft contradicts"),
                       (dict(model_draft=d, drafter="ngram"), "contradicts --drafter ngram"),
                       (dict(drafter="model"), "needs a draft model"),
                       (dict(drafter="eagle3"), r"needs the target's EAGLE-3 head \(-md HEAD.gguf\)"),
                       (dict(drafter="magic"), "drafter must be one of model, ngram, mtp, eagle3, none")):
        with pytest.raises(MarsError, match=needle):
            choose_models(t, **kw)


def test_choose_models_for_a_pair_and_the_bench_drafters(tmp_path):
    from mars_local.models.registry import load_registry

    pair = load_registry().get("smollm2-135m")  # the default pair: n-gram drafter, no draft model
    for c in (choose_models(), choose_models("smollm2-135m"), choose_models(pair="smollm2-135m")):
        assert (c.label, c.pair, c.drafter, c.draft) == ("smollm2-135m", pair, pair.drafter, None)
        named = {"theta": pair.theta, "draft_max": pair.draft_max}
        assert c.overrides == {k: v for k, v in named.items() if v is not None}
        assert bench_drafters(c, None) == ("ngram",)
    d = tmp_path / "d.gguf"
    with_draft = choose_models(model_draft=str(d))
    assert (with_draft.drafter, with_draft.draft) == ("model", d)
    assert bench_drafters(with_draft, None) == ("ngram", "model")  # the pair's drafter and -md's
    assert bench_drafters(choose_models(str(d)), None) == ("ngram",)  # a file: n-gram (plain always runs)
    assert bench_drafters(with_draft, "model") == ("model",)
    with pytest.raises(MarsError, match="exclusive"):
        choose_models("smollm2-135m", pair="smollm2-135m")
    with pytest.raises(MarsError, match="unknown model"):
        choose_models(pair="no-such-pair")


# ------------------------------------------------------- end to end (tiny models)
def test_run_json_contract(tiny_target, tiny_draft):
    r = invoke("run", "hello world", "-m", tiny_target, "-md", tiny_draft, "-n", 12, "--json", "--verify", "strict")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert set(obj) == {"text", "tokens", "stats"} and set(obj["stats"]) == set(SpecStats().to_dict())
    assert len(obj["tokens"]) == obj["stats"]["n_generated"] <= 12


def test_run_strict_json_equals_no_draft(tiny_target, tiny_draft):
    a = invoke("run", "the a the", "-m", tiny_target, "--no-draft", "-n", 24, "--json")
    b = invoke("run", "the a the", "-m", tiny_target, "-md", tiny_draft, "--verify", "strict", "-n", 24, "--json")
    c = invoke("run", "the a the", "-m", tiny_target, "--drafter", "ngram", "--verify", "strict", "-n", 24,
               "--draft-max", 3, "--json")
    toks = [json.loads(r.stdout)["tokens"] for r in (a, b, c)]
    assert toks[0] == toks[1] == toks[2]


@pytest.fixture(scope="module")
def bad_cases(tiny_target, tiny_draft, tiny_other_vocab, not_gguf, truncated_gguf, tmp_path_factory):
    missing = tmp_path_factory.mktemp("bad") / "missing.gguf"
    t, d = str(tiny_target), str(tiny_draft)
    return {
        "missing file": (["run", "hi", "-m", missing], "not found"),
        "not a GGUF": (["run", "hi", "-m", not_gguf], "not a GGUF"),
        "truncated GGUF": (["run", "hi", "-m", truncated_gguf], "cannot load"),
        "vocab mismatch": (["run", "hi", "-m", t, "-md", tiny_other_vocab], "tokenizer"),
        "prompt too long": (["run", "hello " * 400, "-m", t, "-c", 64], "context"),
        "theta too big": (["run", "hi", "-m", t, "-md", d, "--theta", "1.5"], "theta"),
        "theta zero": (["run", "hi", "-m", t, "--theta", "0"], "theta"),
        "theta not a number": (["run", "hi", "-m", t, "--theta", "abc"], "--theta"),
        "negative k": (["run", "hi", "-m", t, "--draft-max", "-2"], "draft-max"),
        "negative temperature": (["run", "hi", "-m", t, "--temp", "-1"], "--temp must be a finite number"),
        "zero tokens": (["run", "hi", "-m", t, "-n", "0"], "tokens"),
        "bad verify": (["run", "hi", "-m", t, "--verify", "loose"], "verify"),
        "bad drafter": (["run", "hi", "-m", t, "--drafter", "magic"], "drafter"),
        "draft without model": (["run", "hi", "-m", t, "--drafter", "model"], "draft model"),
        "contradiction": (["run", "hi", "-m", t, "--no-draft", "-md", d], "contradicts"),
        "unknown option": (["run", "hi", "--bogus"], "bogus"),
        "bad gpu layers": (["run", "hi", "-m", t, "-ngl", "many"], "-ngl"),
        "empty prompt": (["run", "   ", "-m", t], "empty"),
        "unknown registry name": (["run", "hi", "-m", "no-such-model"], "not found"),
    }


CASES = [
    "missing file", "not a GGUF", "truncated GGUF", "vocab mismatch", "prompt too long", "theta too big",
    "theta zero", "theta not a number", "negative k", "negative temperature", "zero tokens", "bad verify",
    "bad drafter", "draft without model", "contradiction", "unknown option", "bad gpu layers", "empty prompt",
    "unknown registry name",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(bad_cases, case):
    args, needle = bad_cases[case]
    r = invoke(*args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), r.stderr
    assert needle.lower() in err[0].lower()
    assert "Traceback" not in r.output
    assert r.stdout == ""


def test_real_entry_point_has_no_traceback(not_gguf):
    """The installed console script path (python -m mars_local) behaves the same."""
    p = mars("run", "hi", "-m", not_gguf, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error:")
    assert p.stdout == ""


def test_stats_after_a_stop_inside_the_prompt_do_not_call_its_rest_cached():
    """--stats after a Ctrl-C inside the prompt (which stops it mid-chunk): the part of the prompt
    not evaluated was not "reused from cache" either."""
    from types import SimpleNamespace

    from mars_local.cli.render import format_stats
    from mars_local.core.stats import SpecStats

    choice = SimpleNamespace(label="m", drafter="none")
    stopped = SpecStats(n_prompt=300, n_prompt_evaluated=128, stop_reason="interrupted")
    assert "300 token(s) (128 evaluated before the interruption)" in format_stats(stopped, choice)
    ended = SpecStats(n_prompt=300, n_prompt_evaluated=128, n_generated=3, stop_reason="eog")
    assert "300 token(s) (128 evaluated, rest reused from cache)" in format_stats(ended, choice)

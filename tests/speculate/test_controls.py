"""Generation controls inside speculative windows, on tiny random models and SmolLM2:
stop strings, penalties, ignore-eos, -n -1, grammars, logprobs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from scipy.stats import chisquare

from mars_local import Engine, MarsError
from mars_local.speculate.controls import Controls, apply_penalties
from mars_local.core.config import GenerateConfig
from mars_local.speculate.grammar import GrammarState, grammar_from_json_schema, json_grammar
from mars_local.core.sampling import SamplingParams, probabilities
from tinymodels import make_tiny_llama

PROMPTS = ["hello world the", "the a the a the a", "hello hello world world", "w1 w2 w3 w1 w2"]
PENALTIES = [dict(repeat_penalty=1.5), dict(frequency_penalty=0.8), dict(presence_penalty=1.2),
             dict(repeat_penalty=1.3, repeat_last_n=4, frequency_penalty=0.3, presence_penalty=0.2)]


# ------------------------------------------------------------------ penalties
@pytest.mark.parametrize("pen", PENALTIES)
def test_plain_decoding_applies_llama_cpp_penalties(plain, pen):
    """Plain greedy with a penalty == argmax of the penalized row, one forward per token (reference loop)."""
    cfg = GenerateConfig(**pen)
    toks = plain.tokenize(PROMPTS[1])
    want = []
    for _ in range(12):
        row = plain.logits(toks + want)[-1].copy()
        apply_penalties(row, toks + want, cfg)
        want.append(int(row.argmax()))
        if want[-1] in plain.eog_ids:
            want.pop()
            break
    got = plain.generate(toks, max_tokens=len(want) or 1, **pen)
    assert got.tokens == want
    assert plain.generate(toks, max_tokens=12).tokens != want[:12] or not pen  # the penalty changes the output


@pytest.mark.parametrize("pen", PENALTIES)
def test_strict_greedy_with_penalties_equals_plain_greedy(plain, spec, ngram, pen):
    accepted = 0
    for prompt in PROMPTS:
        ref = plain.generate(prompt, max_tokens=40, **pen)
        for eng in (spec, ngram):
            for adaptive in (False, True):
                out = eng.generate(prompt, max_tokens=40, verify="strict", draft_max=4, adaptive=adaptive, **pen)
                assert out.tokens == ref.tokens, (prompt, eng.drafter_kind, adaptive, pen)
                accepted += out.stats.n_accepted
    assert accepted > 0  # windows of several rows were verified, not just single tokens


@pytest.mark.slow
def test_strict_greedy_with_penalties_on_smollm2(smollm2, smollm2_f16):
    pen = dict(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1)
    prompt = "List the colours of the rainbow, then list them again in reverse order:"
    with Engine(smollm2) as plain_eng, Engine(smollm2, smollm2_f16) as eng:
        ref = plain_eng.generate(prompt, max_tokens=48, **pen)
        assert ref.tokens != plain_eng.generate(prompt, max_tokens=48).tokens  # the penalties matter here
        # a fixed k: the adaptive controller's choice depends on this CPU's measured costs
        # (on an AVX2 CPU it found the F16 draft not worth drafting), and this test is about
        # penalties inside verify windows, so windows must be verified on every machine
        out = eng.generate(prompt, max_tokens=48, verify="strict", draft_max=6, adaptive=False, **pen)
    assert out.tokens == ref.tokens and out.stats.n_accepted > 0


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_strict_sampling_with_penalties_keeps_the_second_tokens_distribution(tiny_target, tiny_draft, draft_sampling):
    """The 2nd token (row 1 of a window: its history holds draft d_0) ~ the penalized p given the 1st."""
    pen = dict(repeat_penalty=1.8, presence_penalty=1.0)
    sp = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    cfg = GenerateConfig(**pen)
    params = SamplingParams(**sp)
    with Engine(tiny_target, tiny_draft) as eng:
        toks = eng.tokenize(PROMPTS[1])
        row0 = eng.logits(toks)[0].copy()
        apply_penalties(row0, toks, cfg)
        first = int(row0.argmax())  # the most likely first token: condition on it
        row1 = eng.logits(toks + [first])[0].copy()
        apply_penalties(row1, toks + [first], cfg)
        p = probabilities(row1, params)
        counts = np.zeros(len(p), dtype=np.int64)
        for seed in range(2500):
            out = eng.generate(toks, max_tokens=2, verify="strict", draft_max=3, adaptive=False,
                               draft_sampling=draft_sampling, seed=seed, **sp, **pen)
            if len(out.tokens) == 2 and out.tokens[0] == first:
                counts[out.tokens[1]] += 1
    n = counts.sum()
    assert n >= 200
    keep = p * n >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep] * n, p[~keep].sum() * n)
    assert chisquare(obs, exp).pvalue > 1e-3


# ------------------------------------------------------------------ EOG and length
@pytest.fixture(scope="module")
def eager_eos(tiny_dir, plain):
    """The tiny target with its first greedy token declared end-of-generation: it stops at once."""
    first = plain.generate(PROMPTS[0], max_tokens=1).tokens[0]
    return make_tiny_llama(tiny_dir / "eager-eos.gguf", seed=0, eos_id=first)


def test_ignore_eos_generates_exactly_n_tokens(eager_eos):
    with Engine(eager_eos, drafter="ngram") as eng:
        stopped = eng.generate(PROMPTS[0], max_tokens=20)
        assert stopped.tokens == [] and stopped.stats.stop_reason == "eog"
        out = eng.generate(PROMPTS[0], max_tokens=20, ignore_eos=True, verify="mars")
    assert len(out.tokens) == 20 and out.stats.stop_reason == "length"
    assert not set(out.tokens) & set(eng.eog_ids)


def test_unlimited_stops_at_eog_or_a_full_context(eager_eos, tiny_target):
    with Engine(eager_eos) as eng:
        assert eng.generate(PROMPTS[0], max_tokens=-1).stats.stop_reason == "eog"
    with Engine(tiny_target, drafter="ngram", n_ctx=64) as eng:
        out = eng.generate(PROMPTS[0], max_tokens=-1, ignore_eos=True)
        n_prompt, n_ctx = len(eng.tokenize(PROMPTS[0])), eng.n_ctx
    assert out.stats.stop_reason == "context"
    assert n_prompt + len(out.tokens) == n_ctx + 1  # the cache full; the last token needs no forward


# ------------------------------------------------------------------ stop strings
def test_stop_string_split_over_two_windows_is_cut_exactly(spec):
    """A stop string that starts in one verify window and ends in the next: the
    output ends right before it and no streamed chunk shows any of it."""
    kw = dict(max_tokens=60, verify="strict", draft_max=3, adaptive=False)
    chunks = list(spec.stream(PROMPTS[0], **kw))
    texts = [c.text for c in chunks]
    full = "".join(texts)
    j = next(i for i in range(1, len(texts)) if len(texts[i - 1]) >= 2 and len(texts[i]) >= 2
             and full.find(texts[i - 1][-2:] + texts[i][:2]) == len("".join(texts[:i])) - 2)
    stop = texts[j - 1][-2:] + texts[j][:2]  # 2 characters of window j-1 and 2 of window j
    cut = full.find(stop)
    with spec.stream(PROMPTS[0], stop=[stop], **kw) as s:
        got = list(s)
    shown = "".join(c.text for c in got)
    assert shown == full[:cut] and s.stats.stop_reason == "stop"  # the chunks showed nothing of it
    assert sum(len(c.tokens) for c in got) < sum(len(c.tokens) for c in chunks)


@pytest.mark.slow
def test_stop_strings_on_smollm2_end_the_text_before_them(smollm2):
    with Engine(smollm2, drafter="ngram") as eng:
        full = eng.generate("Count from one to ten in words: one, two,", max_tokens=40).text
        stop = " five"
        assert stop in full
        out = eng.generate("Count from one to ten in words: one, two,", max_tokens=40, stop=[stop, "zzz"])
    assert out.text == full[: full.index(stop)] and out.stats.stop_reason == "stop"


# ------------------------------------------------------------------ grammar
ABC = 'root ::= ("a" | "b" | "c")+ "."'


def test_grammar_output_matches_and_strict_equals_plain(plain, spec, ngram):
    ref = plain.generate(PROMPTS[0], max_tokens=30, grammar=ABC)
    assert re.fullmatch(r"[abc]+\.?", ref.text), ref.text
    for eng in (spec, ngram):
        out = eng.generate(PROMPTS[0], max_tokens=30, grammar=ABC, verify="strict", draft_max=4)
        assert out.tokens == ref.tokens
    mars = spec.generate(PROMPTS[0], max_tokens=30, grammar=ABC, verify="mars", theta=0.5, draft_max=4)
    assert re.fullmatch(r"[abc]+\.?", mars.text), mars.text


def test_a_lazy_grammar_leaves_the_text_free_until_its_trigger_then_constrains_it(plain, spec, ngram):
    """grammar_triggers (tool_choice auto's calls): the output is the free output up to and including
    the first trigger word, then only what the grammar allows; strict speculation equals plain."""
    free = plain.generate(PROMPTS[0], max_tokens=40)
    word = next(ch for ch in free.text[3:] if ch.isalpha())  # a letter the free text writes, not first
    cut = free.text.index(word, 3) + 1
    lazy = dict(grammar=f'root ::= "{word}" [0-9] [0-9] "."', grammar_triggers=(word,))
    ref = plain.generate(PROMPTS[0], max_tokens=60, **lazy)
    assert ref.text[:cut] == free.text[:cut], (ref.text, free.text)
    assert re.fullmatch(r"[0-9]{2}\.", ref.text[cut:]), ref.text
    from mars_local.speculate.batched import Scheduler

    for eng in (spec, ngram):
        out = eng.generate(PROMPTS[0], max_tokens=60, verify="strict", draft_max=4, **lazy)
        assert out.tokens == ref.tokens
        sch = Scheduler(eng, 3)  # the many-sequences engine, beside two free sequences
        try:
            many = sch.generate_many([PROMPTS[1], PROMPTS[0], PROMPTS[2]], max_tokens=60, verify="strict", **lazy)
        finally:
            sch.close()
        assert many[1].tokens == ref.tokens
    absent = plain.generate(PROMPTS[0], max_tokens=40, grammar='root ::= "@@" [0-9]', grammar_triggers=("@@",))
    assert absent.tokens == free.tokens  # a trigger that never appears constrains nothing


def test_visible_special_shows_the_control_tokens_it_names_and_only_those(plain, spec):
    """A tool call's markers may be control tokens (Mistral's [TOOL_CALLS]): visible_special puts their
    text into the output (plain and speculative, streamed and whole); other control tokens stay out."""
    (start,) = plain.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert plain.piece(start) == b"" and plain.piece(start, special=True) == b"<|im_start|>"  # a control token
    forced = f'root ::= <[{start}]> "ab" <[{start}]> "."'
    for eng in (plain, spec):
        hidden = eng.generate(PROMPTS[0], max_tokens=10, grammar=forced, verify="strict")
        shown = eng.generate(PROMPTS[0], max_tokens=10, grammar=forced, verify="strict",
                             visible_special=("<|im_start|>", "[TOOL_CALLS]"))
        assert hidden.tokens == shown.tokens and hidden.tokens.count(start) == 2
        assert hidden.text == "ab." and shown.text == "<|im_start|>ab<|im_start|>."
        chunks = eng.stream(PROMPTS[0], max_tokens=10, grammar=forced, visible_special=("<|im_start|>",))
        assert "".join(c.text for c in chunks) == shown.text


def test_a_draft_token_the_grammar_forbids_is_rejected(tiny_target):
    """A drafter that proposes only tokens the grammar forbids (through the engine's drafter seam):
    they reach the verifier as -inf logits and are never accepted, relaxed (MARS, theta 0.1) or not."""
    from mars_local.speculate.drafters import Draft, Drafter

    with Engine(tiny_target, drafter="ngram") as probe:
        allowed = {t for t in range(probe.target.n_vocab) if re.fullmatch(rb"[abc.]*", probe.piece(t))}
        forbidden = [t for t in probe.tokenize("hello world the", add_special=False) if t not in allowed]
    assert forbidden

    class Forbidden(Drafter):
        def propose(self, tokens, k, extend=None):
            return Draft([forbidden[i % len(forbidden)] for i in range(k)])

    with Engine(tiny_target, drafter="ngram", drafter_factory=lambda cfg, seed, controls: Forbidden()) as eng:
        for verify in ("strict", "mars"):
            out = eng.generate(PROMPTS[0], max_tokens=30, grammar=ABC, verify=verify, theta=0.1, draft_max=4,
                               adaptive=False)
            assert re.fullmatch(r"[abc]+\.?", out.text), out.text
            assert out.stats.n_drafted > 0 and out.stats.n_accepted == 0  # proposed, never accepted


def test_grammar_state_after_a_rolled_back_window_equals_a_plain_walk(plain):
    """Walking a window (accepting drafts in a clone) leaves the committed state as it was."""
    model = plain.target
    committed = Controls(GenerateConfig(grammar=ABC), plain.eog_ids, GrammarState(model, ABC))
    fresh = GrammarState(model, ABC)
    a, b = (next(t for t in range(model.n_vocab) if plain.piece(t) == ch) for ch in (b"a", b"b"))
    rows = np.zeros((3, model.n_vocab), dtype=np.float32)
    committed.process_window([1], rows, [a, b])  # drafts a, b walked and dropped
    committed.commit([b])
    fresh.accept(b)
    r1, r2 = np.zeros(model.n_vocab, np.float32), np.zeros(model.n_vocab, np.float32)
    committed.grammar.mask(r1)
    fresh.mask(r2)
    assert np.array_equal(np.isfinite(r1), np.isfinite(r2))
    assert np.isfinite(rows[1][a])
    assert {plain.piece(int(t)) for t in np.flatnonzero(np.isfinite(rows[0]))} == {b"a", b"b", b"c"}
    committed.close()
    fresh.close()


def test_invalid_grammar_and_schema_are_one_line_errors(plain):
    with pytest.raises(MarsError, match="invalid GBNF grammar"):
        plain.generate("hi", grammar="root ::= (", max_tokens=2)
    with pytest.raises(MarsError, match="not valid JSON"):
        grammar_from_json_schema("{nope")
    assert plain.generate("hi", max_tokens=3).stats.n_generated >= 1  # the engine is still usable


@pytest.mark.slow
def test_a_grammar_that_matches_nothing_says_so(smollm2):
    # (the tiny models' byte tokens are partial UTF-8, which llama.cpp's grammar lets through)
    with Engine(smollm2, n_threads=2) as eng:
        with pytest.raises(MarsError, match="the grammar allows no token after the output so far"):
            eng.generate("hi", grammar="root ::= [^\\x00-\\U0010FFFF]", max_tokens=4)
        assert eng.generate("hi", max_tokens=3).stats.n_generated >= 1  # the engine is still usable


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_json_schema_output_with_sampling_and_speculation_always_parses(tiny_target, tiny_draft, draft_sampling):
    """100 generations at T = 1 with a draft model and MARS under a bounded JSON schema: every one
    ends (the finished document leaves only end-of-generation) and parses to what the schema says."""
    bounded = grammar_from_json_schema(PERSON)
    bad = []
    with Engine(tiny_target, tiny_draft) as eng:
        for seed in range(100):
            out = eng.generate("hello world", max_tokens=100, grammar=bounded, temperature=1.0, seed=seed,
                               verify="mars", theta=0.5, draft_max=4, draft_sampling=draft_sampling)
            try:
                doc = json.loads(out.text)
                # (maxLength is not checked: the random model's byte tokens make invalid UTF-8, replaced)
                assert set(doc) == {"name", "age"} and isinstance(doc["name"], str) and isinstance(doc["age"], int)
            except (ValueError, AssertionError):
                bad.append((seed, out.stats.stop_reason, out.text))
    assert not bad, bad[:3]


def test_schema_strings_exclude_control_characters():
    """JSON forbids raw control characters in strings; the converter's rule is tightened."""
    from mars_local.llama.json_schema import _JSON_CHAR, _LAX_CHAR

    gbnf = grammar_from_json_schema(PERSON)
    assert _JSON_CHAR in gbnf and _LAX_CHAR not in gbnf


@pytest.mark.slow
def test_format_json_on_smollm2_parses(smollm2):
    """--format json (any JSON value) on a real model at T = 1 with n-gram speculation and MARS."""
    ended = 0
    with Engine(smollm2, drafter="ngram") as eng:
        prompt = eng.chat_prompt([{"role": "user", "content": 'Reply with the JSON object {"ok": true} only.'}])
        for seed in range(6):
            out = eng.generate(prompt, max_tokens=60, grammar=json_grammar(), temperature=1.0, seed=seed,
                               verify="mars", draft_max=4)
            if out.stats.stop_reason == "eog":
                ended += 1
                json.loads(out.text)  # raises if not JSON
    assert ended >= 3  # a generation cut by -n is an unfinished document (as in llama.cpp)


# ------------------------------------------------------------------ logprobs
def test_logprobs_are_the_target_rows_log_softmax_without_extra_forwards(plain, spec):
    base = spec.generate(PROMPTS[0], max_tokens=12, verify="strict", draft_max=3, adaptive=False)
    out = spec.generate(PROMPTS[0], max_tokens=12, verify="strict", draft_max=3, adaptive=False, logprobs=3)
    assert out.tokens == base.tokens and out.stats.n_rounds == base.stats.n_rounds
    assert len(out.logprobs) == len(out.tokens)
    toks = plain.tokenize(PROMPTS[0])
    for i, lp in enumerate(out.logprobs):
        z = plain.logits(toks + out.tokens[:i])[-1].astype(np.float64)
        ls = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
        assert lp.token == out.tokens[i]
        assert lp.logprob == pytest.approx(ls[lp.token], abs=1e-4)
        assert [t for t, _ in lp.top] == list(np.argsort(-ls, kind="stable")[:3])
    assert base.logprobs is None and "logprobs" not in base.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ['{"name": "Al', "{", '{"a": [1, 2', ""])
def test_masking_only_the_best_candidates_keeps_the_rows_the_loop_reads(smollm2, prefix):
    """mask(row, need) gives the same best `need` allowed tokens and logits as the full mask
    (greedy strict 1, greedy MARS 2, top-k sampling k), and keeps only allowed tokens."""
    from mars_local.llama.runtime import Model

    model = Model(smollm2)
    g = GrammarState(model, json_grammar())
    for t in model.tokenize(prefix, add_special=False, parse_special=False):
        g.accept(t)
    rng = np.random.default_rng(len(prefix))
    shortcut = 0
    for trial in range(20):
        row = (rng.normal(size=model.n_vocab) * 3).astype(np.float32)
        full = row.copy()
        g.mask(full)
        for need in (1, 2, 40):
            fast = row.copy()
            g.mask(fast, need)
            assert np.all(np.isfinite(full[np.isfinite(fast)]))  # nothing forbidden kept
            best = lambda r: np.argsort(-r.astype(np.float64), kind="stable")[:need]  # noqa: E731
            n_allowed = int(np.isfinite(full).sum())
            k = min(need, n_allowed)
            assert np.array_equal(best(fast)[:k], best(full)[:k]) and np.array_equal(fast[best(fast)[:k]],
                                                                                     full[best(full)[:k]])
            shortcut += int(np.isfinite(fast).sum()) < n_allowed
    if prefix == '{"name": "Al':  # inside a string nearly everything is allowed: the shortcut is taken
        assert shortcut == 60
    g.close()
    model.close()


def test_rows_read_by_the_loop():
    from mars_local.speculate.controls import rows_read

    assert rows_read(GenerateConfig(verify="strict")) == 1 and rows_read(GenerateConfig()) == 2
    assert rows_read(GenerateConfig.make(temperature=1.0, top_k=40)) == 40
    assert rows_read(GenerateConfig.make(temperature=1.0, top_k=0)) == 0
    assert rows_read(GenerateConfig(logprobs=3)) == 0 and rows_read(GenerateConfig(ignore_eos=True)) == 0


def test_grammars_too_deep_for_llama_cpp_are_refused_before_it_parses_them(plain):
    from mars_local.speculate.grammar_check import MAX_GRAMMAR_DEPTH, check_grammar_text

    deep = "root ::= " + "(" * 40_000 + '"a"' + ")" * 40_000  # llama.cpp's parser would crash on it
    with pytest.raises(MarsError, match="nested deeper"):
        plain.generate("hi", grammar=deep, max_tokens=2)
    ok = "root ::= " + "(" * MAX_GRAMMAR_DEPTH + '"a"' + ")" * MAX_GRAMMAR_DEPTH
    assert plain.generate("hi", grammar=ok, max_tokens=1).text == "a"
    check_grammar_text('root ::= "((((" [(((] # ((((\n' + "(" * 10 + ")" * 10)  # quoted, classes, comments skipped
    check_grammar_text(json_grammar())


def test_a_waiting_lazy_grammar_forbids_a_token_that_would_set_it_off_with_text_it_does_not_allow(plain):
    """llama.cpp replays the rest of a triggering token's text into the grammar and throws where
    that rest is not allowed, which through its C API aborts the process (" hello" completes the
    trigger "h", then "ello" is not a digit).  Waiting for its trigger, the grammar forbids such a
    token (mask: -inf; try_accept: False, the state unchanged; accept: MarsError) and nothing else;
    after the trigger it constrains as before."""
    model = plain.target
    hello, x, h, five = (next(t for t in range(model.n_vocab) if plain.piece(t) == p) for p in (b" hello", b"x", b"h", b"5"))
    g = GrammarState(model, 'root ::= "h" [0-9]', triggers=("h",))
    assert g.triggered_by(hello) and g.triggered_by(h) and not g.triggered_by(x)
    row = np.zeros(model.n_vocab, dtype=np.float32)
    g.mask(row)
    assert not np.isfinite(row[hello]) and np.isfinite(row[h]) and np.isfinite(row[x])
    refused = {t for t in range(model.n_vocab) if not np.isfinite(row[t])}
    assert refused and all(b"h" in plain.piece(t, special=True) for t in refused)  # only triggering tokens
    best = np.zeros(model.n_vocab, dtype=np.float32)
    best[hello], best[x] = 9.0, 5.0
    g.mask(best, 1)  # greedy reads the best allowed token: not " hello"
    assert int(best.argmax()) == x and not np.isfinite(best[hello])
    ctl = Controls(GenerateConfig(grammar='root ::= "h" [0-9]'), plain.eog_ids, g)
    w = ctl.window([])
    free = np.zeros(model.n_vocab, dtype=np.float32)  # a row processed for its best token only may
    assert not w.push(hello, free)                      # leave it finite: the walk still stops there
    assert w.push(x, free) and len(w.history) == 1 and w.grammar.triggered_by(h)
    assert not g.try_accept(hello) and g.triggered_by(h)  # refused, still waiting
    with pytest.raises(MarsError, match="does not allow"):
        g.accept(hello)
    g.accept(h)  # the committed text sets it off: from now on only a digit
    assert not g.triggered_by(hello)
    row = np.zeros(model.n_vocab, dtype=np.float32)
    g.mask(row)
    assert np.isfinite(row[five]) and not np.isfinite(row[hello]) and not np.isfinite(row[x])
    bad = g.clone()
    assert not bad.try_accept(x) and not bad.try_accept(five)  # refused, and unusable after it
    with pytest.raises(MarsError, match="does not allow"):
        bad.accept(five)
    bad.close()
    assert g.try_accept(five)
    w.close()


def test_output_that_would_set_a_lazy_grammar_off_badly_takes_another_token(plain, spec, ngram):
    """The free output's own token at some position completes the trigger word and brings text the
    grammar refuses (llama.cpp would abort the process there): plain, speculative and batched
    decoding all take the best allowed token instead, and strict speculation still equals plain."""
    free = plain.generate(PROMPTS[0], max_tokens=40)
    pieces = [plain.piece(t).decode("utf-8", "replace") for t in free.tokens]
    for i, pc in enumerate(pieces):
        word = pc.strip()[:-1]
        before = "".join(pieces[:i])
        if word.isalpha() and pc[-1].isalpha() and word not in before:  # first written by token i, a letter after it
            break
    else:
        pytest.fail(f"no token of the free output fits: {pieces}")
    lazy = dict(grammar=f'root ::= "{word}" [0-9] [0-9] "."', grammar_triggers=(word,))
    ref = plain.generate(PROMPTS[0], max_tokens=60, **lazy)
    assert ref.tokens[:i] == free.tokens[:i] and ref.tokens[i] != free.tokens[i]
    cut = ref.text.find(word, len(before))
    assert cut < 0 or re.fullmatch(r"[0-9]{2}\.", ref.text[cut + len(word):]), ref.text
    from mars_local.speculate.batched import Scheduler

    for eng in (spec, ngram):
        assert eng.generate(PROMPTS[0], max_tokens=60, verify="strict", draft_max=4, **lazy).tokens == ref.tokens
        sch = Scheduler(eng, 3)
        try:
            many = sch.generate_many([PROMPTS[1], PROMPTS[0], PROMPTS[2]], max_tokens=60, verify="strict", **lazy)
        finally:
            sch.close()
        assert many[1].tokens == ref.tokens


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "minItems": 100_000_000, "items": {"type": "integer"}}, "minItems 100,000,000"),
    ({"type": "string", "maxLength": 1e300}, "maxLength 1e+300"),
    ({"type": "object", "properties": {"minItems": {"type": "string", "minLength": 200_001}}}, "minLength 200,001"),
    ({"type": "string", "pattern": "^a{3,100000000}$"}, "100,000,000 times"),
    ({"anyOf": [{"type": "integer"}, {"type": "array", "maxItems": float("inf")}]}, "maxItems inf"),
])
def test_a_schema_repeating_past_any_grammar_is_refused_before_it_is_spelled_out(monkeypatch, schema, named):
    """llama-cpp-python's converter writes every repetition out: minItems 1e8 made a 1.8 GB
    grammar (14 s and GBs of memory, mars serve's event loop blocked) before its size was
    checked.  Such a count is refused before the converter runs, for response formats, --json-schema
    and tools' parameters; a count within the bound still converts."""
    import llama_cpp.llama_grammar as lg

    from mars_local.chat.tool_grammar import tools_gbnf
    from mars_local.chat.tools import ToolChoice, parse_tools

    real = lg.json_schema_to_gbnf
    monkeypatch.setattr(lg, "json_schema_to_gbnf", lambda *a, **kw: pytest.fail("the converter ran"))
    with pytest.raises(MarsError, match=re.escape(named)):
        grammar_from_json_schema(schema)
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": schema}}}}])
    with pytest.raises(MarsError, match=re.escape(named)):
        tools_gbnf("hermes", tools, ToolChoice("required"), False)
    monkeypatch.setattr(lg, "json_schema_to_gbnf", real)
    assert "root ::=" in grammar_from_json_schema({"type": "array", "minItems": 100_000 // 20, "maxItems": 100_000 // 20,
                                                   "items": {"type": "integer"}})


@pytest.mark.parametrize("schema, key", [({"enum": []}, "enum"),
                                         ({"type": "object", "properties": {"a": {"anyOf": []}}}, "anyOf"),
                                         ({"type": "array", "items": {"oneOf": []}}, "oneOf")])
def test_a_schema_no_value_matches_is_named_not_a_gbnf_parse_error(schema, key):
    """An empty enum/anyOf/oneOf: the converter wrote a grammar llama.cpp could not parse, and the
    user read about GBNF ("expecting newline or end at ::= ...") for a JSON schema."""
    with pytest.raises(MarsError, match=f"^the JSON schema has an empty {key}: no value matches it$"):
        grammar_from_json_schema(schema)


def test_the_schema_bounds_read_schemas_not_data():
    """Counts inside data (a const, an enum's values, a default) are no repetition and pass; a
    property named like a data keyword is still a schema, its counts still bounded."""
    assert "root ::=" in grammar_from_json_schema({"const": {"maxLength": 200_000}})
    assert "root ::=" in grammar_from_json_schema({"enum": [{"minItems": 10 ** 9}, 1]})
    with pytest.raises(MarsError, match="minItems 100,000,000"):
        grammar_from_json_schema({"type": "object", "properties": {"default": {
            "type": "array", "minItems": 100_000_000, "items": {"type": "integer"}}}})

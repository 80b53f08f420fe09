"""The same script against tests/fake_engine.FakeEngine and the real Engine on a tiny model, so the
fake the CLI and server tests use cannot drift from what it stands for: limits and stop reasons,
stop strings (text cut before the string, the tokens through the one that completes it), chunks
that add up to the generation, the statistics' counts, and log probabilities' shape."""

from __future__ import annotations

import pytest

from fake_engine import FakeEngine
from mars_local import Engine, GenerateConfig

PROMPT = "once upon a time"


@pytest.fixture(params=["fake", "real"])
def engine(request, tiny_target):
    if request.param == "fake":
        yield FakeEngine(reply="the quick brown fox jumps over the lazy dog, then runs far away. " * 2, chunk=3)
        return
    with Engine(tiny_target, drafter="ngram", n_ctx=512, n_threads=2, learned=False) as eng:
        yield eng


def cfg(**kw) -> GenerateConfig:
    return GenerateConfig.make(**{"temperature": 0.0, "ignore_eos": True, **kw})


def test_max_tokens_is_exact_and_the_reason_is_length(engine):
    out = engine.generate(PROMPT, cfg(max_tokens=7))
    assert len(out.tokens) == 7 and out.stats.n_generated == 7 and out.stats.stop_reason == "length"
    assert len(out.kinds) == 7 and set(out.kinds) <= {"draft", "relaxed", "target"}
    assert out.stats.n_rounds >= 1 and out.stats.n_prompt > 0


def test_chunks_add_up_to_the_generation(engine):
    whole = engine.generate(PROMPT, cfg(max_tokens=20))
    with engine.stream(PROMPT, cfg(max_tokens=20)) as s:
        chunks = list(s)
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert all(len(c.kinds) == len(c.tokens) for c in chunks)
    assert s.stats.stop_reason == "length" and s.stats.n_generated == len(whole.tokens)


def test_a_stop_string_cuts_the_text_before_it(engine):
    full = engine.generate(PROMPT, cfg(max_tokens=40)).text
    stop = next(full[i:i + 3] for i in range(4, len(full) - 3) if full[i:i + 3].strip() == full[i:i + 3])
    out = engine.generate(PROMPT, cfg(max_tokens=40, stop=(stop,)))
    assert out.text == full[: full.index(stop)] and out.stats.stop_reason == "stop"
    assert len(out.tokens) < 40 and out.stats.n_generated == len(out.tokens)


def test_log_probabilities_name_each_emitted_token(engine):
    out = engine.generate(PROMPT, cfg(max_tokens=6, logprobs=2))
    assert len(out.logprobs) == len(out.tokens) == 6
    assert all(lp.token == t and len(lp.top) == 2 for lp, t in zip(out.logprobs, out.tokens))
    assert engine.generate(PROMPT, cfg(max_tokens=3)).logprobs is None


def test_a_closed_stream_says_interrupted(engine):
    s = engine.stream(PROMPT, cfg(max_tokens=30))
    next(s)
    s.close()
    assert s.stats.stop_reason == "interrupted"

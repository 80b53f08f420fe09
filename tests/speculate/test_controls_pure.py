"""Pure parts of the generation controls (no llama.cpp): stop strings, penalties, settings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mars_local.speculate.controls import StopScanner, apply_penalties
from mars_local.core.errors import MarsError
from mars_local.core.config import GenerateConfig


def feed_all(stops, pieces):
    s = StopScanner(stops)
    shown = [s.feed(p) for p in pieces]
    return shown, s


@pytest.mark.parametrize(
    "stops, pieces, shown, stopped",
    [
        (["END"], ["abc", "E", "N", "Dxyz"], ["abc", "", "", ""], True),  # split over three pieces
        (["END"], ["abcEN", "Q"], ["abc", "ENQ"], False),  # a false start is released
        (["\n\n"], ["a\n", "\nb"], ["a", ""], True),
        (["xy", "b"], ["aaxb"], ["aax"], True),  # the earliest stop wins
        (["stop"], ["nothing to ", "see"], ["nothing to ", "see"], False),
        ([], ["anything"], ["anything"], False),
    ],
)
def test_stop_scanner_table(stops, pieces, shown, stopped):
    got, s = feed_all(stops, pieces)
    assert got == shown and s.stopped == stopped


def test_stop_scanner_flush_releases_a_held_tail_only_without_a_stop():
    s = StopScanner(["END"])
    assert s.feed("abcEN") == "abc" and s.flush() == "EN"
    s = StopScanner(["END"])
    s.feed("xEND")
    assert s.flush() == "" and s.feed("more") == ""


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abAB\n", max_size=40),
    stop=st.text(alphabet="abAB\n", min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_stop_scanner_equals_cutting_the_whole_text(text, stop, cuts):
    """Whatever the piece boundaries: shown text == text cut before the first stop,
    and no prefix of the shown text ever contains the stop string."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    got, s = feed_all([stop], pieces)
    shown = "".join(got) + s.flush()
    i = text.find(stop)
    assert shown == (text if i < 0 else text[:i])
    assert stop not in "".join(got)


def reference_penalties(row, history, r, last_n, freq, pres):
    """llama.cpp's llama_sampler_penalties_apply, written out token by token."""
    out = row.astype(np.float32).copy()
    tail = history if last_n < 0 else history[-last_n:] if last_n else []
    counts = {}
    for t in tail:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        z = out[t]
        z = z * np.float32(r) if z <= 0 else z / np.float32(r)
        out[t] = np.float32(z) - (np.float32(c) * np.float32(freq) + np.float32(pres))
    return out


@pytest.mark.parametrize("r, last_n, freq, pres", [(1.3, 64, 0, 0), (1.0, 64, 0.5, 0), (1.0, 3, 0, 0.7),
                                                   (0.8, -1, 0.2, 0.1), (1.5, 0, 0, 0)])
def test_penalties_follow_llama_cpp(r, last_n, freq, pres):
    rng = np.random.default_rng(1)
    row = rng.normal(size=50).astype(np.float32)
    history = rng.integers(0, 50, size=30).tolist()
    cfg = GenerateConfig(repeat_penalty=r, repeat_last_n=last_n, frequency_penalty=freq, presence_penalty=pres)
    got = row.copy()
    apply_penalties(got, history, cfg)
    want = reference_penalties(row, history, r, last_n, freq, pres)
    assert np.array_equal(got, want)
    assert cfg.penalized == (last_n != 0)  # every case but the last changes something


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_tokens=0), "-1 for no limit"),
        (dict(max_tokens=-2), "-1 for no limit"),
        (dict(stop="END"), "sequence of non-empty strings"),
        (dict(stop=("",)), "sequence of non-empty strings"),
        (dict(repeat_penalty=0.0), "repeat-penalty"),
        (dict(repeat_penalty=float("nan")), "repeat-penalty"),
        (dict(presence_penalty=float("inf")), "presence-penalty"),
        (dict(repeat_last_n=-2), "repeat-last-n"),
        (dict(grammar="  "), "grammar is empty"),
        (dict(logprobs=21), "logprobs"),
    ],
)
def test_bad_control_settings_are_refused(kw, match):
    with pytest.raises(MarsError, match=match):
        GenerateConfig(**kw)


def test_unlimited_and_stop_list_are_normalised():
    cfg = GenerateConfig(max_tokens=-1, stop=["a", "b"])
    assert cfg.unlimited and cfg.stop == ("a", "b")


class _DeadEnd:
    """A grammar state that allows no token (what a GrammarState of a grammar matching nothing does)."""

    def clone(self):
        return self

    def mask(self, row, need=0):
        row[:] = -np.inf

    def try_accept(self, token):
        return True

    def close(self):
        pass


def test_a_verify_row_the_grammar_leaves_empty_is_the_grammars_error_not_the_targets():
    from mars_local.core.errors import MarsError
    from mars_local.speculate.controls import GRAMMAR_DEAD_END, Controls

    c = Controls(GenerateConfig(grammar="root ::= \"a\""), [0], _DeadEnd())
    with pytest.raises(MarsError) as exc:
        c.process_window([5, 6], np.zeros((3, 16), dtype=np.float32), [1, 2])
    assert str(exc.value) == GRAMMAR_DEAD_END and exc.value.field == "grammar"  # (a server answers 400)
    # without a grammar an all -inf row is left to the verify rule (the target's own message)
    rows = np.full((1, 16), -np.inf, dtype=np.float32)
    Controls(GenerateConfig(ignore_eos=True), [0]).process_window([5], rows, [])

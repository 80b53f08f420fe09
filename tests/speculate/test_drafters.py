"""Pure drafter logic (no llama.cpp): the n-gram index and the shared common-prefix helper."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mars_local.speculate.drafters import NgramDrafter
from mars_local.core.errors import MarsError
from mars_local.core.tokens import common_prefix_len


@pytest.mark.parametrize(
    "a, b, start, want",
    [
        ([1, 2, 3], [1, 2, 3], 0, 3),
        ([1, 2, 3], [1, 5, 3], 0, 1),
        ([1, 2], [1, 2, 3, 4], 0, 2),
        ([], [1], 0, 0),
        ([9, 2, 3], [1, 2, 4], 1, 2),  # the first `start` positions are taken as agreeing
        ([1, 2, 3], [1, 2], 5, 2),  # start beyond the shorter one: its length
    ],
)
def test_common_prefix_len(a, b, start, want):
    assert common_prefix_len(a, b, start) == want


def test_ngram_sizes_are_checked():
    with pytest.raises(MarsError, match="1 <= min <= max"):
        NgramDrafter(2, 3)


def test_ngram_proposes_the_continuation_of_the_longest_recent_match():
    d = NgramDrafter(3, 1)
    toks = [5, 6, 7, 8, 1, 6, 7]
    d.begin(toks)
    got = d.propose(toks, 4)
    assert got.tokens == [8, 1, 6, 7] and got.keys == [2, 3, 4, 5]
    assert d.propose(toks, 0).tokens == [] and d.propose([3], 2).tokens == []


def scan_lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, list[int]]:
    """Reference prompt lookup by a full scan: (longest matching n, up to k tokens after its most
    recent earlier occurrence), (0, []) without a match."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - 1 - n, -1, -1):  # windows ending before the last token
            if tokens[start : start + n] == tokens[-n:]:
                return n, tokens[start + n : start + n + k]
    return 0, []


@settings(max_examples=300, deadline=None)
@given(
    vocab=st.integers(2, 20),
    lo=st.integers(1, 2),
    extra=st.integers(0, 2),
    steps=st.lists(st.tuples(st.lists(st.integers(0, 19), min_size=1, max_size=3), st.integers(1, 5)), max_size=25),
    prompt=st.lists(st.integers(0, 19), min_size=2, max_size=40),
)
def test_ngram_index_equals_a_full_scan(vocab, lo, extra, steps, prompt):
    """The incremental index proposes what a scan of all committed tokens finds, with keys n, n+1, ..."""
    hi = lo + extra
    toks = [t % vocab for t in prompt]
    d = NgramDrafter(hi, lo)
    d.begin(toks)
    for new, k in [([], 3)] + steps:
        toks.extend(t % vocab for t in new)
        got = d.propose(toks, k)
        n, want = scan_lookup(toks, k, hi, lo)
        assert got.tokens == want
        assert (got.keys or []) == [min(n + i, hi + 2) for i in range(len(want))]

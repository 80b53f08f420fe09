"""Drafters: propose k tokens, then learn from what the target accepted.

Every drafter has the same two-method shape (as transformers'
``CandidateGenerator``):

``propose(tokens, k) -> Draft``
    ``tokens`` is every committed token (prompt + generated); the last one is
    not in the target's cache yet.  Returns at most ``k`` draft tokens and,
    when they were *sampled*, the distributions they were sampled from.
``observe(tokens, n_accepted)``
    called after verification with the new committed tokens, so the drafter
    can roll back or update its state.

``begin(tokens)`` prepares a new generation (a draft model evaluates the
prompt here, reusing whatever prefix its cache already holds).

A drafter declares what the loop may rely on (class attributes):

``cheap``
    proposing costs next to nothing beside a target forward (an n-gram
    lookup): the loop proposes the longest draft first and lets the adaptive
    controller cut it, knowing its keys.  A costly drafter (a draft model) is
    asked instead to stop as soon as drafting more would not pay
    (``propose(..., extend=...)``).
``gives_keys``
    each draft position carries an acceptance key (``Draft.keys``) that the
    adaptive controller learns acceptance rates by.

A drafter never owns the llama.cpp context it drafts in; the Engine does.
"""

from __future__ import annotations

import time

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .adaptive import confidence_key
from ..core.choices import DRAFT_SAMPLINGS, DrafterKind, DraftSampling, drafter_for
from ..core.defaults import DEFAULTS
from ..core.errors import MarsError
from ..core.sampling import SamplingParams, position_uniforms, probabilities, sample_from, top_probability
from ..core.tokens import common_prefix_len

__all__ = ["Draft", "Drafter", "NgramDrafter", "ModelDrafter", "HeadDrafter", "EMPTY_DRAFT", "Extend"]


def drafter_kind(drafter: DrafterKind | None, draft) -> DrafterKind:
    """The drafter asked for (default: the draft model when there is one), checked against ``draft``."""
    return drafter_for(drafter, bool(draft))  # the one rule: core.choices


@dataclass
class Draft:
    tokens: list[int]
    probs: np.ndarray | None = None  # (k, V) when the tokens were sampled
    keys: list[int] | None = None  # per-position acceptance keys (n-gram: match length)

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft([])

Extend = Callable[[Sequence[int | str]], bool]  # keys drafted so far -> draft one more?


class Drafter:
    """Base class: proposes nothing (plain decoding through the same loop)."""

    cheap: ClassVar[bool] = True
    gives_keys: ClassVar[bool] = False
    # (rows, seconds) of the last proposal's first evaluation: the tokens the draft cache
    # lacked plus the last one.  While drafting every round that is one or two rows; after
    # rounds decoded plainly it is the catch-up on them, a cost of resuming drafting that
    # the adaptive controller must not mistake for a cost per drafted token.
    catch_up: tuple[int, float] = (0, 0.0)

    def begin(self, tokens: list[int]) -> int:
        """Prepare for a generation; returns the number of tokens evaluated."""
        return 0

    def propose(self, tokens: list[int], k: int, extend: Extend | None = None) -> Draft:
        """At most ``k`` draft tokens after ``tokens``; a costly drafter stops
        early once ``extend(keys so far)`` is false (a cheap one ignores it)."""
        return EMPTY_DRAFT

    def observe(self, tokens: list[int], n_accepted: int) -> None:
        return None


class NgramDrafter(Drafter):
    """Prompt lookup: continue the most recent earlier occurrence of the last n tokens.

    Tries n = max_ngram down to min_ngram and proposes up to k tokens that
    followed the most recent match.  Deterministic (q is a point mass).
    Each draft position carries a key for the adaptive controller: the
    length of the context match behind it (n, then n+1, ... as the draft
    continues the match), capped at max_ngram + 2.
    """

    cheap = True
    gives_keys = True

    def __init__(self, max_ngram: int = DEFAULTS.ngram_max, min_ngram: int = DEFAULTS.ngram_min):
        if not (1 <= min_ngram <= max_ngram):
            raise MarsError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}..{max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # n-gram (a tuple) -> where its most recent continuation starts; kept
        # up to date as tokens are committed, so a lookup costs O(max_ngram).
        self._index: dict[tuple[int, ...], int] = {}
        self._upto, self._last = 1, None  # n-grams ending before _upto are indexed

    def begin(self, tokens: list[int]) -> int:
        self._index, self._upto, self._last = {}, 1, None
        return 0

    def _update(self, tokens: list[int]) -> None:
        """Index the n-grams ending at e for every new e < len(tokens) (their
        continuation tokens[e] exists).  ``tokens`` only grows during a
        generation; anything else (checked cheaply) rebuilds the index."""
        upto = self._upto
        if upto > len(tokens) or (upto > 1 and tokens[upto - 1] != self._last):
            self._index, upto = {}, 1
        index, lo, hi = self._index, self.min_ngram, self.max_ngram
        for e in range(upto, len(tokens)):
            for n in range(lo, min(hi, e) + 1):
                index[tuple(tokens[e - n : e])] = e
        self._upto = max(upto, len(tokens))
        self._last = tokens[self._upto - 1]

    def propose(self, tokens: list[int], k: int, extend: Extend | None = None) -> Draft:
        if k <= 0 or len(tokens) < 2:
            return EMPTY_DRAFT
        self._update(tokens)
        index, end = self._index, len(tokens)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            start = index.get(tuple(tokens[end - n :]))
            if start is not None:
                out = tokens[start : start + k]
                cap = self.max_ngram + 2
                return Draft(out, keys=[min(n + i, cap) for i in range(len(out))])
        return EMPTY_DRAFT


class ModelDrafter(Drafter):
    """A small GGUF model of the same tokenizer, drafting in a context of its
    own (which the Engine creates and frees; this drafter rolls it back).

    sampling="greedy" drafts the argmax (q is a point mass, the cheapest and
    usually the best-accepted choice); sampling="sample" draws from the draft's
    distribution under the same pipeline as the target and returns q.
    p_min stops the draft early when the draft's top-token probability falls
    below it; drafts shorter than n_min are dropped.
    """

    cheap = False
    gives_keys = True  # confidence keys, when proposing with ``extend``

    def __init__(
        self,
        context,
        sampling: DraftSampling = "greedy",
        params: SamplingParams | None = None,
        seed: int = 0,
        p_min: float = 0.0,
        n_min: int = 0,
        controls=None,
    ):
        if sampling not in DRAFT_SAMPLINGS:
            raise MarsError(f"draft sampling must be {' or '.join(DRAFT_SAMPLINGS)}, got {sampling!r}")
        self.ctx = context
        self.sampling = sampling
        self.params = params or SamplingParams()
        self.seed = seed
        self.p_min = p_min
        self.n_min = n_min
        self.controls = controls  # controls.Controls: the target's penalties/grammar on the draft's rows too
        self._base = 0

    def begin(self, tokens: list[int]) -> int:
        self._base = 0
        return self.ctx.sync(tokens[:-1])

    def propose(self, tokens: list[int], k: int, extend: Extend | None = None) -> Draft:
        """Up to ``k`` draft tokens.  With ``extend`` (the adaptive controller's
        :meth:`~mars_local.speculate.adaptive.AdaptiveK.extend`), each token gets a
        confidence key and drafting stops as soon as ``extend(keys)`` is false."""
        ctx = self.ctx
        self._base = ctx.n_past
        self.catch_up = (0, 0.0)
        if k <= 0:  # k fits: the draft context is as large as the target's, whose room bounds k (Run.draft_cap)
            return EMPTY_DRAFT
        pending = tokens[ctx.n_past :]
        t0 = time.perf_counter()
        row = ctx.eval(pending, 1)[0]  # pending tokens + last
        self.catch_up = (len(pending), time.perf_counter() - t0)
        sampled = self.sampling == "sample" and not self.params.greedy
        out: list[int] = []
        probs = []
        keys: list[str] | None = [] if extend is not None else None
        win = self.controls.window(tokens) if self.controls is not None else None
        try:
            while True:
                if win is not None:
                    # the target's controls at this position (penalties, grammar); a p_min cut needs the
                    # exact top probability, so the whole row is masked then (the adaptive controller's
                    # confidence keys are taken over the best allowed candidates: a heuristic, not exact)
                    win.apply(row, 0 if self.p_min > 0.0 else None)
                    if not np.isfinite(row.max()):
                        break  # nothing allowed here (a grammar that must end)
                p_top = top_probability(row) if (self.p_min > 0.0 or keys is not None) else 1.0
                if p_top < self.p_min:
                    break
                if sampled:  # the draw for a position is keyed by (seed, position)
                    q = probabilities(row, self.params)
                    tok = sample_from(q, position_uniforms(self.seed, len(tokens) + len(out), 1, stream=1)[0, 0])
                else:
                    tok = int(row.argmax())
                if win is not None and not win.push(tok, row):
                    break
                if sampled:
                    probs.append(q)
                out.append(tok)
                if keys is not None:
                    keys.append(confidence_key(p_top))
                if len(out) >= k or (extend is not None and not extend(keys)):
                    break
                row = ctx.eval([tok], 1)[0]
        finally:
            if win is not None:
                win.close()
        if len(out) < max(self.n_min, 1):
            return EMPTY_DRAFT
        return Draft(out, np.stack(probs) if sampled else None, keys)

    def observe(self, tokens: list[int], n_accepted: int) -> None:
        # the longest prefix of tokens[:-1] the cache holds: a draft trimmed after it was
        # evaluated can equal the target's next token, and the new last token is never cached
        keep = common_prefix_len(self.ctx.tokens, tokens, start=self._base)
        self.ctx.truncate(min(keep, len(tokens) - 1))


class HeadDrafter(ModelDrafter):
    """Drafts with a head that reads the target's own rows (the target's multi-token-prediction
    layers, or an EAGLE-3 head): the decisions of a draft model on the head's rows (``ctx``: a
    llama.mtp.MtpView).  Rows the head fed with its own hidden state (drafts) never stay in its
    cache after a round (the view keeps only rows the target fed): accepted ones are evaluated
    again, fed by the target's rows, in the decode that drafts the next round's first token."""

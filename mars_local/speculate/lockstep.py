"""A draft model's draft for one sequence of a batch, a token at a time, on rows the scheduler
decodes for every sequence at once (one draft forward per step)."""

from __future__ import annotations

import numpy as np

from ..core.sampling import position_uniforms, probabilities, sample_from, top_probability
from .adaptive import confidence_key
from .drafters import EMPTY_DRAFT, Draft

__all__ = ["DraftSteps"]


class DraftSteps:
    """One sequence's draft made a token at a time by the lockstep drafter: the decisions of
    :class:`~mars_local.speculate.drafters.ModelDrafter` (draft sampling, p_min, the target's
    controls on the draft's rows, confidence keys) on rows the scheduler decodes for all."""

    def __init__(self, s):
        d, run = s.run.drafter, s.run
        self.s, self.k = s, 0
        self.out: list[int] = []
        self.probs: list = []
        self.keys: list[str] = []
        self.sampled = d.sampling == "sample" and not d.params.greedy
        self.win = run.controls.window(run.tokens) if run.controls.active else None
        d._base = s.dview.n_past

    def push(self, row: np.ndarray) -> bool:
        """Decide the next draft token from ``row``; True to draft one more."""
        d, tokens = self.s.run.drafter, self.s.run.tokens
        row = np.array(row, dtype=np.float32)
        if len(self.out) >= min(self.k, self.s.dview.n_ctx - len(tokens) - 1):
            return False
        if self.win is not None:
            self.win.apply(row, 0 if d.p_min > 0.0 else None)
            if not np.isfinite(row.max()):
                return False
        p_top = top_probability(row)
        if p_top < d.p_min:
            return False
        if self.sampled:
            q = probabilities(row, d.params)
            tok = sample_from(q, position_uniforms(d.seed, len(tokens) + len(self.out), 1, stream=1)[0, 0])
        else:
            tok = int(row.argmax())
        if self.win is not None and not self.win.push(tok, row):
            return False
        if self.sampled:
            self.probs.append(q)
        self.out.append(tok)
        self.keys.append(confidence_key(p_top))
        return len(self.out) < self.k

    def draft(self) -> Draft:
        if self.win is not None:
            self.win.close()
        n_min = max(self.s.run.drafter.n_min, 1)
        if len(self.out) < n_min:
            return EMPTY_DRAFT
        return Draft(self.out, np.stack(self.probs) if self.sampled else None, self.keys)

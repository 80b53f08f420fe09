"""A draft model's draft for one sequence of a batch, a token at a time, on rows the scheduler
decodes for every sequence at once (one draft forward per step): :class:`DraftSteps`, and
:func:`draft_lockstep` drafting for all."""

from __future__ import annotations

import numpy as np

from ..core.sampling import position_uniforms, probabilities, sample_from, top_probability
from .adaptive import confidence_key
from .drafters import EMPTY_DRAFT, Draft

__all__ = ["DraftSteps", "draft_lockstep"]


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


def draft_lockstep(dmc, seqs, caps: list[int], guard) -> list[Draft]:
    """Every sequence's draft (at most ``caps[i]`` tokens), one decode of the draft context ``dmc``
    per step carrying one row of every sequence still drafting; ``guard(s, fn)`` runs one
    sequence's step, its failure ending that sequence only."""
    steps = [DraftSteps(s) for s in seqs]
    live = [st for st, cap in zip(steps, caps) if cap > 0 and st.s.run.cfg.draft_max > 0 and not st.s.done]
    for st, cap in zip(steps, caps):
        st.k = cap
    # catch up: the tokens the draft cache lacks, the last one included (any lengths: unified cache)
    windows = [(st.s.dview.seq_id, st.s.run.tokens[st.s.dview.n_past:]) for st in live]
    rows = dmc.decode_windows(windows, max_rows=dmc.n_batch, last_only=True) if live else []
    while live:
        nxt = []
        for st, z in zip(live, rows):
            if guard(st.s, lambda: st.push(z[0])):
                nxt.append(st)
        live = nxt
        if live:
            rows = dmc.decode_windows([(st.s.dview.seq_id, [st.out[-1]]) for st in live],
                                      max_rows=dmc.n_batch, last_only=True)
    return [st.draft() for st in steps]

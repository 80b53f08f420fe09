"""Quality by likelihood: the target's negative log-likelihood of a generated text."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TargetScorer:
    """Negative log-likelihood of generated tokens under the target at T = 1.

    Scores in ``context`` (a target :class:`~mars_local.runtime.Context`, e.g.
    ``Engine.ctx``: the prompt is then usually cached already) or in a context
    of its own on ``model``.  The context keeps the prompt, minus its last
    token, between outputs of the same prompt.
    """

    def __init__(self, model=None, n_ctx: int = 4096, n_batch: int = 512, n_threads: int | None = None,
                 context=None):
        from ..runtime import Context

        if (model is None) == (context is None):
            raise ValueError("give a model or a context")
        self._own = context is None
        self.ctx = context if context is not None else Context(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)

    def nll(self, prompt: Sequence[int], generated: Sequence[int]) -> np.ndarray:
        """Per-token NLL (nats) of ``generated`` following ``prompt``."""
        generated = [int(t) for t in generated]
        if not generated:
            return np.zeros(0)
        prompt = [int(t) for t in prompt]
        ctx = self.ctx
        ctx.sync(prompt[:-1])
        seq = [prompt[-1]] + generated[:-1]  # row i predicts generated[i]
        out = np.empty(len(generated))
        try:
            for i in range(0, len(seq), ctx.n_batch):
                chunk = seq[i : i + ctx.n_batch]
                z = np.asarray(ctx.eval(chunk, n_out=len(chunk)), dtype=np.float64)
                zmax = z.max(axis=1)
                lse = zmax + np.log(np.exp(z - zmax[:, None]).sum(axis=1))
                tgt = generated[i : i + len(chunk)]
                out[i : i + len(chunk)] = lse - z[np.arange(len(chunk)), tgt]
        finally:
            ctx.truncate(len(prompt) - 1)
        return out

    def close(self) -> None:
        if self._own:
            self.ctx.close()

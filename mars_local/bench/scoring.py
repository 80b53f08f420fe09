"""Quality by likelihood: the target's negative log-likelihood of a generated text."""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

import numpy as np


class TargetScorer:
    """Negative log-likelihood of generated tokens under the target at T = 1
    (:meth:`~mars_local.speculate.engine.Engine.score_nll`).

    Scores with ``engine`` (the bench's plain engine: its cache then usually
    holds the prompt already) or with an engine of its own on the GGUF
    ``target``.  The engine keeps the prompt, minus its last token, cached
    between outputs of the same prompt.
    """

    def __init__(self, engine=None, *, target: str | PathLike | None = None, n_ctx: int = 4096,
                 n_batch: int = 512, n_threads: int | None = None):
        if (engine is None) == (target is None):
            raise ValueError("give an engine or a target GGUF")
        self._own = engine is None
        if engine is None:
            from ..speculate.engine import Engine

            engine = Engine(target, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, learned=False)
        self.engine = engine

    def nll(self, prompt: Sequence[int], generated: Sequence[int]) -> np.ndarray:
        """Per-token NLL (nats) of ``generated`` following ``prompt``."""
        return self.engine.score_nll(prompt, generated)

    def close(self) -> None:
        if self._own:
            self.engine.close()

"""Is a model's forward batch-invariant?  (The condition for lossless strict greedy.)

Used by ``benchmarks/batch_invariance.py`` and the SmolLM2 tests.
"""

from __future__ import annotations

import os

import numpy as np

from .context import Context
from .runtime import Model, on_own_thread

__all__ = ["batch_invariance", "model_invariance"]


def batch_invariance(path: str | os.PathLike, windows=(2, 5, 9, 17), n: int = 48, exact_kernels: bool = True,
                     n_threads: int | None = None, prompt: str = "The history of the printing press begins",
                     n_gpu_layers: int | None = None) -> dict[int, tuple[int, float]]:
    """Does a position's logits row depend on how many rows its forward had?

    Strict greedy speculative output equals plain greedy output token for token
    only if it does not: plain decoding computes every position in a 1-row
    forward, speculation in (k+1)-row verify windows.  Decodes ``n`` tokens
    plainly, re-evaluates the same tokens in windows of each size, and returns
    {window: (rows that differ bit for bit, largest absolute difference)}.
    ``n_gpu_layers``: as :class:`Model` (None: every layer on a GPU build's GPU, as the engine loads
    a target).  On a GPU build, layers left on the CPU have their forwards of 32+ rows offloaded to
    the GPU by llama.cpp ("op offload"), so there a 33-row window of a CPU-resident layer runs GPU
    kernels.
    """
    m = Model(path, n_gpu_layers, exact_kernels=exact_kernels)
    try:
        return model_invariance(m, windows, n, n_threads, prompt)
    finally:
        m.close()


def model_invariance(m: Model, windows=(2, 5, 9, 17), n: int = 48, n_threads: int | None = None,
                     prompt: str = "The history of the printing press begins") -> dict[int, tuple[int, float]]:
    """:func:`batch_invariance` of a loaded model (a context of its own, closed after).

    It computes on a thread of its own (:func:`~mars_local.llama.runtime.on_own_thread`): the
    engine's loader calls it (the repack probe, ``mars_local.speculate.repack``) on the thread that
    loads the models, which in ``mars serve`` is not the thread that generates."""
    return on_own_thread(_model_invariance, m, windows, n, n_threads, prompt)


def _model_invariance(m: Model, windows, n: int, n_threads: int | None, prompt: str) -> dict[int, tuple[int, float]]:
    toks = m.tokenize(prompt)
    ctx = Context(m, n_ctx=max(256, len(toks) + n + 64), n_threads=n_threads)
    try:
        ctx.sync(toks[:-1])
        base = ctx.n_past
        seq, plain = [toks[-1]], []
        for _ in range(n):  # plain greedy: one row per forward
            row = ctx.eval([seq[-1]], 1)[0]
            plain.append(row.copy())
            seq.append(int(row.argmax()))
        out = {}
        for w in windows:
            ctx.truncate(base)
            differ, worst = 0, 0.0
            for s in range(0, n - w + 1, w):
                rows = ctx.eval(seq[s : s + w], w)
                for i in range(w):
                    if not np.array_equal(rows[i], plain[s + i]):
                        differ += 1
                        worst = max(worst, float(np.max(np.abs(rows[i] - plain[s + i]))))
            out[w] = (differ, worst)
        return out
    finally:
        ctx.close()

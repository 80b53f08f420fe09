"""The one sampling pipeline, applied identically to target (p) and draft (q).

Order (llama.cpp's default chain): top-k -> top-p -> min-p on the untempered
distribution, then temperature over what is left.  ``temperature == 0`` means
greedy (argmax) and no probability vector is ever built.

Probabilities are dense float64 rows over the whole vocabulary (zeros outside
the kept set): verification windows are at most a few dozen rows, and dense
rows keep the (p - q)+ residual a single vectorised subtraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import MarsError

__all__ = ["SamplingParams", "position_uniforms", "probabilities", "sample_from", "top_probability"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; defaults are llama.cpp's (temperature 0 = greedy).

    seed: None or a negative number picks a random seed; any other value makes
    a run reproducible.
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise MarsError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise MarsError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise MarsError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise MarsError(f"min-p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def seeded(self) -> bool:
        return self.seed is not None and self.seed >= 0

    def base_seed(self) -> int:
        """The run's seed: the user's, or a fresh random one."""
        if self.seeded:
            return int(self.seed)
        return int(np.random.SeedSequence().entropy % (1 << 63))

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed if self.seeded else None)


def position_uniforms(seed: int, start: int, n: int, stream: int = 0) -> np.ndarray:
    """(n, 2) uniforms for absolute token positions start .. start+n-1.

    Counter-based: the draws for a position depend only on (seed, position,
    stream), never on how positions were grouped into verify windows, so the
    same seed gives the same samples whatever draft lengths were chosen.
    """
    return np.stack([np.random.default_rng([seed, start + i, stream]).random(2) for i in range(n)])


def _softmax_rows(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Dense probability rows (n, V) after truncation and temperature.

    ``logits`` is (n, V) or (V,); it is not modified.
    """
    if params.greedy:
        raise ValueError("probabilities() is for temperature > 0")
    single = logits.ndim == 1
    z = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    n, vocab = z.shape
    k = params.top_k if 0 < params.top_k < vocab else vocab

    # Candidate set: the top-k ids per row (all ids when top-k is off), sorted
    # by descending logit so top-p is a prefix.
    if k < vocab:
        cand = np.argpartition(-z, k - 1, axis=1)[:, :k]
    else:
        cand = np.broadcast_to(np.arange(vocab), (n, vocab))
    cz = np.take_along_axis(z, cand, axis=1)
    order = np.argsort(-cz, axis=1, kind="stable")
    cand = np.take_along_axis(cand, order, axis=1)
    cz = np.take_along_axis(cz, order, axis=1)

    keep = np.ones(cz.shape, dtype=bool)
    if params.top_p < 1.0 or params.min_p > 0.0:
        p1 = _softmax_rows(cz)  # untempered, over the candidates
        if params.top_p < 1.0:
            before = np.cumsum(p1, axis=1) - p1  # mass of strictly better tokens
            keep &= before < params.top_p
        if params.min_p > 0.0:
            keep &= p1 >= params.min_p * p1[:, :1]
        keep[:, 0] = True  # always keep the best token

    zt = np.where(keep, cz / params.temperature, -np.inf)
    pt = _softmax_rows(zt)
    out = np.zeros((n, vocab), dtype=np.float64)
    np.put_along_axis(out, cand, pt, axis=1)
    return out[0] if single else out


def sample_from(p: np.ndarray, rng_or_u) -> int:
    """Draw one id from a probability row (need not be normalised) by inverse
    CDF, with a uniform in [0, 1) or a numpy Generator to draw one."""
    u = rng_or_u.random() if isinstance(rng_or_u, np.random.Generator) else float(rng_or_u)
    c = np.cumsum(p)
    total = c[-1]
    if not total > 0:
        return int(np.argmax(p))
    i = int(np.searchsorted(c, u * total, side="right"))
    return min(i, len(p) - 1)


def top_probability(logits_row: np.ndarray) -> float:
    """Softmax probability of the argmax token (untempered)."""
    z = logits_row.astype(np.float64, copy=False)
    return float(1.0 / np.exp(z - z.max()).sum())

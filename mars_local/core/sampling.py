"""The one sampling pipeline, applied identically to target (p) and draft (q).

Order (llama.cpp's default chain): top-k -> top-p -> min-p on the untempered
distribution, then temperature over what is left.  ``temperature == 0`` means
greedy (argmax) and no probability vector is ever built.

Probabilities are dense float64 rows over the whole vocabulary (zeros outside
the kept set): verification windows are at most a few dozen rows, and dense
rows keep the (p - q)+ residual a single vectorised subtraction.

Exact definition (the native kernel, mars_local/native.py, reproduces it bit
for bit, so both give the same tokens):

* rank order: logit descending, then token id ascending.  top-k keeps the
  first k ids in rank order, so among exactly equal logits at the k-th place
  the lowest ids are kept.
* untempered p1 = e / S1 over the top-k candidates, e = exp(z - max z); top-p
  keeps a token while the mass of the tokens before it in rank order,
  ``cumsum(p1) - p1``, is < top_p; min-p keeps p1 >= min_p * p1(top-1); the
  kept set is the longest rank-order prefix on which both hold (the top-1 is
  always kept).
* tempered p = e' / S2 over the kept set, e' = exp(z / T - max(z / T)).
* non-finite logits: -inf is probability 0.  A row whose largest logit is
  +inf puts all its mass on its +inf logits, shared equally (they are tied at
  the top, so top-k / top-p keep the lowest of their ids first): wherever the
  definition computes z - max z, a row with max z = +inf uses 0 for a +inf z
  and -inf for any other.  The same holds after temperature (z / T).  Rows
  with a NaN logit, or with no logit above -inf, have no distribution; the
  verifier refuses them (MarsError) and they are not defined here.
* every normaliser (S1, S2, and the CDF total in verification) is a sequential
  sum in ascending token-id order (``np.cumsum``, not numpy's pairwise
  ``sum``), and exp is ``exp_nonpositive`` below, built from IEEE basic
  operations only, because numpy's SIMD exp differs from libm's in the last
  bit for a few percent of inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .defaults import DEFAULTS, check

__all__ = [
    "SamplingParams",
    "exp_nonpositive",
    "position_uniforms",
    "probabilities",
    "sample_from",
    "top_k_ids",
    "top_probability",
]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; defaults are llama.cpp's (temperature 0 = greedy).

    seed: a negative number (the default, -1) or None picks a random seed; any
    other value makes a run reproducible.  Defaults and ranges: :mod:`.defaults`.
    """

    temperature: float = DEFAULTS.temperature
    top_k: int = DEFAULTS.top_k
    top_p: float = DEFAULTS.top_p
    min_p: float = DEFAULTS.min_p
    seed: int | None = DEFAULTS.seed

    def __post_init__(self) -> None:
        for name in ("temperature", "top_k", "top_p", "min_p", "seed"):  # the rules: core.defaults
            check(name, getattr(self, name))

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


# exp for x <= 0 from IEEE-754 basic operations only (no libm, no numpy SIMD
# exp), so that C code doing the same operations in the same order (without
# FMA contraction) gets the same bits: x = n ln2 + r, |r| <= ln2/2 (Cody-Waite
# with a two-part ln2), exp(r) by its Taylor polynomial of degree 13 in Horner
# form, then scaled by 2^n.  Accurate to about 1 ulp; exp(x) = 0 below -746.
_LOG2E = float.fromhex("0x1.71547652b82fep+0")
_LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_EXP_POLY = tuple(1.0 / math.factorial(i) for i in range(13, -1, -1))  # 1/13! .. 1/0!


def exp_nonpositive(x) -> np.ndarray:
    """exp(x) for x <= 0 (float64), reproducible bit for bit in C."""
    x = np.maximum(np.asarray(x, dtype=np.float64), -746.0)
    n = np.rint(x * _LOG2E)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = np.full_like(r, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p *= r
        p += c
    return np.ldexp(p, n.astype(np.int32))


def _seq_sum(e: np.ndarray) -> np.ndarray:
    """Row sums in index order, one addition at a time: (n, V) -> (n, 1)."""
    return np.cumsum(e, axis=-1)[:, -1:]


def top_k_ids(z: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the k best tokens of each row of ``z`` (n, V) in rank
    order (logit descending, id ascending): ties at the k-th place keep the
    lowest ids.  Returns (n, k)."""
    n, vocab = z.shape
    kth = np.partition(z, vocab - k, axis=1)[:, vocab - k]  # k-th largest logit
    out = np.empty((n, k), dtype=np.intp)
    for i in range(n):
        ids = np.flatnonzero(z[i] >= kth[i])
        if len(ids) > k:  # exact ties at the k-th place
            above = ids[z[i, ids] > kth[i]]
            ids = np.sort(np.concatenate([above, ids[z[i, ids] == kth[i]][: k - len(above)]]))
        out[i] = ids
    return out


def _shifted(z: np.ndarray, zmax: np.ndarray) -> np.ndarray:
    """z - zmax row by row ((n, m) and (n, 1)), except in rows whose maximum is
    +inf: there 0 for the +inf entries and -inf for the others, so that
    exp(z - zmax) puts equal mass on the +inf logits and none elsewhere."""
    inf = np.isposinf(zmax[:, 0])
    if not inf.any():
        return z - zmax
    with np.errstate(invalid="ignore"):
        d = z - zmax
    d[inf] = np.where(np.isposinf(z[inf]), 0.0, -np.inf)
    return d


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Dense probability rows (n, V) after truncation and temperature.

    ``logits`` is (n, V) or (V,); it is not modified.
    """
    if params.greedy:
        raise ValueError("probabilities() is for temperature > 0")
    single = logits.ndim == 1
    z = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    n, vocab = z.shape
    rows = np.arange(n)[:, None]

    # Candidates in id order: the top-k ids (all ids when top-k is off).
    if 0 < params.top_k < vocab:
        cand = top_k_ids(z, params.top_k)
        cz = z[rows, cand]
    else:
        cand = None
        cz = z
    top = cz.max(axis=1, keepdims=True)

    keep = None
    if params.top_p < 1.0 or params.min_p > 0.0:
        e = exp_nonpositive(_shifted(cz, top))
        p1 = e / _seq_sum(e)  # untempered, over the candidates
        order = np.argsort(-cz, axis=1, kind="stable")  # rank order (ids ascend within ties)
        pr = p1[rows, order]
        ok = np.ones(pr.shape, dtype=bool)
        if params.top_p < 1.0:
            before = np.cumsum(pr, axis=1) - pr  # mass of the tokens ranked before
            ok &= before < params.top_p
        if params.min_p > 0.0:
            ok &= pr >= params.min_p * pr[:, :1]
        ok[:, 0] = True  # always keep the best token
        keep = np.empty_like(ok)
        keep[rows, order] = np.logical_and.accumulate(ok, axis=1)  # a rank-order prefix

    zt = cz / params.temperature
    if keep is not None:
        zt = np.where(keep, zt, -np.inf)
    e = exp_nonpositive(_shifted(zt, zt.max(axis=1, keepdims=True)))
    pt = e / _seq_sum(e)
    if cand is None:
        out = pt
    else:
        out = np.zeros((n, vocab), dtype=np.float64)
        out[rows, cand] = pt
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

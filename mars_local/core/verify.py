"""Verification rules for speculative decoding: pure functions over arrays.

Nothing here imports llama.cpp; every rule takes the target's logits for one
verify window and the draft tokens, and returns which prefix is accepted and
the token the target adds after it.  ``mars_local.speculate.native.verify`` computes
exactly the same results with the C kernel our llama.cpp patch adds.

Glossary
--------
k               number of draft tokens in the window.
V               vocabulary size.
logits          (k+1, V) float array: row i holds the target's logits for the
                position of draft token i; row k is the "bonus" row, used
                when every draft token is accepted.  Raw logits (before
                temperature and truncation).
draft           (k,) int array of draft token ids d_0 .. d_{k-1}.
draft_probs     (k, V) float array q: the distribution each draft token was
                *sampled* from (same sampling pipeline as the target).  None
                when the drafter chose its tokens deterministically (greedy
                draft model, n-gram lookup): q is then a point mass on d_i.
p               target probabilities after the sampling pipeline.
t1, t2          target's top-1 / top-2 token ids (by logit) at a position.
z1, z2          their logits.
r               margin ratio z2 / z1 (MARS).  Scale-invariant, so it is the
                same before and after temperature.
theta           MARS threshold: a position is *undecided* when z1 > 0 and
                r > theta (default 0.9), and z2 > -inf.
accepted        the draft prefix d_0 .. d_{m-1} kept by the rule (m <= k).
relaxed         accepted positions that the strict rule would have rejected
                and that MARS accepted because the target was undecided.
correction      the target's token at position m when m < k.
bonus           the target's token at position k when all k are accepted.
EOG             end-of-generation tokens; MARS never relaxes them, in either
                direction (never accepts an EOG runner-up, never replaces an
                EOG top-1).
ties            every ranking (argmax, top-2, top-k, the top-p order) puts
                exactly equal logits in ascending id order.

Rules
-----
strict, T = 0   accept while d_i == argmax(logits_i); correction/bonus is the
                argmax.  Token-for-token identical to plain greedy decoding.
strict, T > 0   Leviathan/Chen rejection sampling: accept d_i with probability
                min(1, p(d_i) / q(d_i)) (q(d_i) = 0: 1 if p(d_i) > 0, else 0);
                on rejection sample from
                normalise((p - q)+).  With deterministic drafts q is a point
                mass, which gives: accept with probability p(d_i), else sample
                from p with d_i removed; implemented as sample-and-compare
                (draw x_i ~ p_i, accept iff d_i == x_i, emit x_i on rejection).
                Distribution-preserving.
mars, T = 0     the paper's rule (Algorithm 1): accept d_i if d_i == t1, or
                if d_i == t2 and the position is undecided; else emit t1.
mars, T > 0     at an undecided position a draft in {t1, t2} is accepted
                outright (as the released code does), provided the sampling
                pipeline did not truncate it away (p(d_i) > 0); everywhere else,
                and for any other draft token, the lossless strict rule above.
                (The released code's min(1, p/q) on deterministic drafts is
                not lossless and is deliberately not reproduced.)
max_relaxed     optional cap on relaxed accepts per window (None: no cap, the
                paper's behaviour).  The first relaxed accept beyond the cap
                is treated as a rejection.

Non-finite logits
-----------------
+inf            the argmax, and it takes all the mass: several +inf logits in
                a row share it equally (ties: lowest id first for argmax,
                top-2, top-k and the top-p order; see mars_local.core.sampling).
                z2/z1 is then 0 or NaN, so such a position is never undecided.
-inf            probability 0; never accepted, not even as an undecided
                runner-up (a position whose z2 is -inf is decided).
NaN, or no logit above -inf
                the row has no distribution: the window is refused with a
                MarsError ("the target produced NaN logits at draft position
                i") if the rule reaches row i, i.e. rows 0 .. m with m the
                first rejected position (k: the bonus row).  Rows after the
                first rejection are never looked at, here or natively.
q(d) = 0        (a sampled draft its own q says it could not draw) accepted
                iff p(d) > 0; a draft with p(d) = 0 is never accepted.

Uniform draws: the sampling rules take one pair of uniforms per window
position (the engine derives them from the seed and the absolute token
position), so strict and MARS runs with the same seed see the same draws, and
strict sampling with deterministic drafts reproduces plain sampling exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .defaults import DEFAULTS, check  # defaults and ranges (the allowed methods: core.choices)
from .errors import MarsError
from .sampling import SamplingParams, probabilities, sample_from

__all__ = [
    "VerifyConfig",
    "VerifyResult",
    "top2",
    "undecided_mask",
    "verify",
    "verify_greedy",
    "verify_sampling",
]

@dataclass(frozen=True)
class VerifyConfig:
    """Which rule to apply and its knobs (see the module glossary); defaults and ranges: :mod:`.defaults`."""

    method: str = DEFAULTS.verify
    theta: float = DEFAULTS.theta
    require_positive_top1: bool = DEFAULTS.require_positive_top1
    max_relaxed: int | None = DEFAULTS.max_relaxed
    eog_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check("verify", self.method)
        check("theta", self.theta)
        check("max_relaxed", self.max_relaxed)


@dataclass
class VerifyResult:
    """Outcome of one window: ``tokens`` = accepted drafts + correction/bonus."""

    n_accepted: int
    tokens: list[int]
    relaxed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def n_relaxed(self) -> int:
        return int(self.relaxed.sum())


def top2(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row: (t1, z1, t2, z2).  Ties go to the lowest id, like argmax.

    Finds the runner-up by masking the top-1 in place and restoring it, so no
    copy of the (n, V) block is made; ``logits`` is unchanged on return.
    """
    x = logits if logits.flags.writeable else logits.copy()
    rows = np.arange(x.shape[0])
    t1 = x.argmax(axis=1)
    z1 = x[rows, t1].copy()
    try:
        x[rows, t1] = -np.inf
        t2 = x.argmax(axis=1)
        z2 = x[rows, t2].copy()
    finally:
        x[rows, t1] = z1
    return t1, z1, t2, z2


def undecided_mask(t1, z1, t2, z2, cfg: VerifyConfig) -> np.ndarray:
    """Positions where MARS may relax: r = z2/z1 > theta, with the guards."""
    z1 = np.asarray(z1, dtype=np.float64)
    z2 = np.asarray(z2, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = z2 / z1
    mask = (ratio > cfg.theta) & (z2 > -np.inf)  # a -inf runner-up has probability 0
    if cfg.require_positive_top1:
        mask &= z1 > 0
    if cfg.eog_ids:
        eog = np.asarray(cfg.eog_ids)
        mask &= ~np.isin(t1, eog) & ~np.isin(t2, eog)
    return mask


def _unusable(zmax: np.ndarray) -> np.ndarray:
    """Rows with no distribution, given each row's max (NaN if any logit is):
    a NaN logit, or no logit above -inf."""
    return ~(zmax > -np.inf)


def _refuse(zmax: float, i: int) -> None:
    if np.isnan(zmax):
        raise MarsError(f"the target produced NaN logits at draft position {i}")
    raise MarsError(f"the target produced no finite logit at draft position {i} (all -inf)")


def _prefix(ok: np.ndarray, relaxed: np.ndarray, cap: int | None) -> int:
    """Length of the accepted prefix given per-position accept flags."""
    bad = np.flatnonzero(~ok)
    m = int(bad[0]) if bad.size else len(ok)
    if cap is not None:
        over = np.flatnonzero(np.cumsum(relaxed[:m]) > cap)
        if over.size:
            m = int(over[0])
    return m


def verify_greedy(logits: np.ndarray, draft: np.ndarray, cfg: VerifyConfig) -> VerifyResult:
    """Temperature 0: strict exact match, or the MARS paper rule."""
    draft = np.asarray(draft, dtype=np.int64)
    k = len(draft)
    if cfg.method == "strict":
        pred = logits.argmax(axis=1)  # numpy's argmax stops at the first NaN: z1 is NaN
        z1 = logits[np.arange(len(pred)), pred]
        bad = _unusable(z1)
        ok = (draft == pred[:k]) & ~bad[:k]
        m = _prefix(ok, np.zeros(k, dtype=bool), None)
        if bad[m]:
            _refuse(z1[m], m)
        return VerifyResult(m, [int(t) for t in draft[:m]] + [int(pred[m])], np.zeros(m, dtype=bool))
    t1, z1, t2, z2 = top2(logits)
    bad = _unusable(z1)
    exact = (draft == t1[:k]) & ~bad[:k]
    relaxed = ~exact & ~bad[:k] & (draft == t2[:k]) & undecided_mask(t1[:k], z1[:k], t2[:k], z2[:k], cfg)
    m = _prefix(exact | relaxed, relaxed, cfg.max_relaxed)
    if bad[m]:
        _refuse(z1[m], m)
    return VerifyResult(m, [int(t) for t in draft[:m]] + [int(t1[m])], relaxed[:m].copy())


def verify_sampling(
    logits: np.ndarray,
    draft: np.ndarray,
    cfg: VerifyConfig,
    params: SamplingParams,
    uniforms: np.ndarray,
    draft_probs: np.ndarray | None = None,
) -> VerifyResult:
    """Temperature > 0: lossless speculative sampling, with MARS relaxation if asked.

    ``uniforms`` is (k+1, 2): one pair per window position.
    Deterministic drafts use sample-and-compare: the target's token at
    position i is x_i = inverse-CDF(p_i, u_i0) and d_i is accepted iff d_i ==
    x_i (probability p(d_i), and on rejection x_i follows p with d_i removed:
    exactly the point-mass case of the (p - q)+ rule).  Since x_i does not
    depend on the draft, strict output equals plain sampling with the same
    uniforms, token for token.  Sampled drafts (draft_probs given) use the
    Leviathan/Chen coin u_i0 < min(1, p/q) and the residual drawn with u_i1.
    """
    draft = np.asarray(draft, dtype=np.int64)
    k = len(draft)
    zmax = logits.max(axis=1)  # NaN where a row has a NaN
    bad = _unusable(zmax)
    if bad.any():  # placeholder rows, so that nothing below trips on them; never used
        logits = logits.copy()
        logits[bad] = 0.0
    p = probabilities(logits, params)  # (k+1, V)
    rows = np.arange(k)
    p_d = p[rows, draft]
    if draft_probs is None:
        cdf = np.cumsum(p, axis=1)
        x = np.array([min(int(np.searchsorted(cdf[i], uniforms[i, 0] * cdf[i, -1], side="right")), p.shape[1] - 1)
                      for i in range(k + 1)])
        ok = draft == x[:k]
    else:
        q_d = draft_probs[rows, draft]
        with np.errstate(divide="ignore", invalid="ignore"):
            # q(d) = 0: accept iff p(d) > 0 (p(d) = 0 is never accepted)
            accept_prob = np.where(q_d > 0, np.minimum(1.0, p_d / q_d), np.where(p_d > 0, 1.0, 0.0))
        ok = uniforms[:k, 0] < accept_prob
    ok &= ~bad[:k]
    relaxed = np.zeros(k, dtype=bool)
    if cfg.method == "mars" and k:
        t1, z1, t2, z2 = top2(logits[:k])
        in_top2 = (draft == t1) | (draft == t2)
        relaxed = ~ok & ~bad[:k] & in_top2 & (p_d > 0) & undecided_mask(t1, z1, t2, z2, cfg)
        ok = ok | relaxed
    m = _prefix(ok, relaxed, cfg.max_relaxed if cfg.method == "mars" else None)
    if bad[m]:
        _refuse(zmax[m], m)
    if draft_probs is None:
        nxt = int(x[m])
    elif m < k:
        residual = np.maximum(p[m] - draft_probs[m], 0.0)
        if not residual.sum() > 0:  # only reachable through rounding
            residual = p[m]
        nxt = sample_from(residual, uniforms[m, 1])
    else:
        nxt = sample_from(p[k], uniforms[k, 0])
    return VerifyResult(m, [int(t) for t in draft[:m]] + [nxt], relaxed[:m].copy())


def verify(
    logits: np.ndarray,
    draft: np.ndarray,
    cfg: VerifyConfig,
    params: SamplingParams,
    rng: np.random.Generator | None = None,
    draft_probs: np.ndarray | None = None,
    uniforms: np.ndarray | None = None,
) -> VerifyResult:
    """Dispatch on the temperature: greedy rules at T = 0, sampling rules above.

    Sampling needs ``uniforms`` ((k+1, 2) in [0, 1)) or an ``rng`` to draw them.
    """
    if logits.ndim != 2 or logits.shape[0] != len(draft) + 1:
        raise ValueError(f"logits must be (k+1, V) for k={len(draft)} drafts, got {logits.shape}")
    if params.greedy:
        if len(draft) == 0:
            t = int(logits[0].argmax())  # the first NaN if there is one
            if not logits[0, t] > -np.inf:
                _refuse(logits[0, t], 0)
            return VerifyResult(0, [t])
        return verify_greedy(logits, draft, cfg)
    if uniforms is None:
        if rng is None:
            raise ValueError("sampling verification needs uniforms or an rng")
        uniforms = rng.random((len(draft) + 1, 2))
    return verify_sampling(logits, draft, cfg, params, uniforms, draft_probs)

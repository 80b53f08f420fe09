"""Adaptive draft length: pick k per round to maximise expected tokens per second.

The model (deliberately small):

* acceptance: draft tokens are accepted independently with probability a, so a
  window of k drafts yields on average 1 + a + a^2 + ... + a^k tokens (the
  accepted prefix plus the target's correction/bonus token).  a is estimated
  from decayed counts of accepted and rejected positions (a geometric model's
  maximum-likelihood estimate), with a weak prior.
* target cost: the wall time of a verify forward of w = k+1 rows, T(w) = t0 +
  t1*(w-1), fitted by least squares to decayed per-size averages; before two
  sizes have been seen, the slope comes from a prior (a CPU forward costs
  nearly k times one token, a GPU forward barely more than one).
* draft cost: c per drafted token (decayed average of draft time per token,
  the draft's catch-up of pending tokens included).

Each round the controller returns argmax_k E[tokens] / (T(k+1) + c*k) over
0..k_max.  k = 0 is plain decoding.  When plain decoding wins, a cheap drafter
(n-gram: no forward pass) keeps being observed for free ("shadow" drafts whose
first token is compared with the target's token: for a deterministic draft the
chance they agree is exactly the acceptance probability); an expensive drafter
is re-tried with a short window at exponentially spaced rounds, so probing
costs almost nothing when speculation does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AdaptiveK", "expected_tokens"]


def expected_tokens(a: float, k: int) -> float:
    """1 + a + ... + a^k: mean tokens per round with k drafts at acceptance a."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class AdaptiveK:
    k_max: int
    gpu: bool = False
    decay: float = 0.97
    prior_accept: float = 0.5
    prior_weight: float = 2.0
    probe_k: int = 2
    _acc: float = 0.0
    _rej: float = 0.0
    _time: dict = field(default_factory=dict)  # w -> [decayed sum of seconds, decayed count]
    _draft_time: float = 0.0
    _draft_tokens: float = 0.0
    _since_probe: int = 0
    _probe_every: int = 8

    # ------------------------------------------------------------ estimates
    @property
    def acceptance(self) -> float:
        w = self.prior_weight
        return (self._acc + w * self.prior_accept) / (self._acc + self._rej + w)

    def target_cost(self, w: int) -> float | None:
        """Predicted seconds for a verify forward of w rows (None: no data yet)."""
        pts = [(size, s / n) for size, (s, n) in self._time.items() if n > 0.05]
        if not pts:
            return None
        if len(pts) == 1:
            size, t = pts[0]
            # prior: per extra row a CPU pays ~80 % of a token, a GPU ~3 %
            slope = t * (0.03 if self.gpu else 0.8)
            t0 = t - slope * (size - 1)
            return max(t0 + slope * (w - 1), 1e-9)
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        sxx = sum((p[0] - mx) ** 2 for p in pts)
        slope = max(0.0, sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx) if sxx else 0.0
        t0 = my - slope * (mx - 1)
        if t0 <= 0:  # degenerate fit: fall back to the smallest size's average
            t0 = min(p[1] for p in pts)
        return max(t0 + slope * (w - 1), 1e-9)

    @property
    def draft_cost(self) -> float:
        return self._draft_time / self._draft_tokens if self._draft_tokens > 0 else 0.0

    def rate(self, k: int) -> float:
        """Expected tokens per second with k drafts (0 when costs are unknown)."""
        t = self.target_cost(k + 1)
        if t is None:
            return 0.0
        return expected_tokens(self.acceptance, k) / (t + self.draft_cost * k)

    # -------------------------------------------------------------- choice
    def choose(self, k_limit: int | None = None) -> int:
        """Draft length for the next round."""
        k_max = self.k_max if k_limit is None else min(self.k_max, k_limit)
        if k_max <= 0:
            return 0
        if 1 not in self._time:
            return 0  # first measure a plain forward
        best_k, best = 0, self.rate(0)
        for k in range(1, k_max + 1):
            r = self.rate(k)
            if r > best * 1.0001:
                best_k, best = k, r
        if best_k > 0:
            self._probe_every = 8
            self._since_probe = 0
            return best_k
        # Plain decoding looks best.  Re-try a short window now and then (at
        # exponentially growing intervals) so a better-than-assumed acceptance
        # or a cheaper-than-assumed window is noticed.
        self._since_probe += 1
        if self._since_probe >= self._probe_every:
            self._since_probe = 0
            self._probe_every = min(self._probe_every * 2, 256)
            return min(self.probe_k, k_max)
        return 0

    # ------------------------------------------------------------ feedback
    def _decay(self) -> None:
        d = self.decay
        self._acc *= d
        self._rej *= d
        for v in self._time.values():
            v[0] *= d
            v[1] *= d
        self._draft_time *= d
        self._draft_tokens *= d

    def observe(self, k: int, n_accepted: int, t_target: float, t_draft: float) -> None:
        """One verify round: k drafted, n_accepted kept, and what it cost."""
        self._decay()
        slot = self._time.setdefault(k + 1, [0.0, 0.0])
        slot[0] += t_target
        slot[1] += 1.0
        if k > 0:
            self._acc += n_accepted
            self._rej += 1.0 if n_accepted < k else 0.0
            self._draft_time += t_draft
            self._draft_tokens += k

    def observe_shadow(self, agreed: bool) -> None:
        """A free draft token compared with the target's token (k = 0 rounds)."""
        if agreed:
            self._acc += 1.0
        else:
            self._rej += 1.0

    def new_generation(self) -> None:
        """Keep the cost model, halve the weight of the old acceptance evidence."""
        self._acc *= 0.5
        self._rej *= 0.5
        self._since_probe = 0
        self._probe_every = 8

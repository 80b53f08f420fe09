"""Adaptive draft length: pick k per round to maximise expected tokens per second.

The model (deliberately small, three parts):

* acceptance — a chain: draft token i is accepted with probability a(key_i)
  given that tokens 0..i-1 were, so a window of k drafts yields on average
  1 + a(key_0) + a(key_0)a(key_1) + ... tokens (the accepted prefix plus the
  target's correction/bonus token).  The key is a feature the drafter gives
  for each draft position: for the n-gram drafter the length of the context
  match behind that token (the n-gram's n plus the draft tokens before it:
  a 3-token match is accepted far more often than a 1-token one), for a
  draft model none.  a(key) comes from decayed counts of accepted and
  rejected positions with that key (the geometric model's maximum-likelihood
  estimate), shrunk towards the estimate of the next shorter match (for a
  match length) or the pooled estimate of all keys.
* target cost — the wall time of a verify forward of w = k+1 rows: the
  decayed mean of the forwards of that size when there are some; otherwise
  a straight line through the measured sizes >= 2 (one row is its own case:
  on a CPU the second row costs far more than each row after it), and before
  that a prior (on a CPU a row costs ~half a token more, a GPU barely more
  than one token).
* draft cost — c per drafted token (decayed mean of the draft time per
  drafted token, a draft model's catch-up of pending tokens included).  An
  n-gram lookup is done every round anyway, so it costs nothing extra.

Each round the controller returns argmax_k E[tokens | k] / (T(k+1) + c*k)
over 0..k_max; k = 0 is plain decoding.  A draft model's tokens get a key
too once drafted: the bucket of the draft's own top-token probability
(:func:`confidence_key`; a confident draft is accepted far more often).  The
draft model drafts token by token and the controller says when to stop
(:meth:`AdaptiveK.extend`): with R the best expected rate of the round's
plan, drafting goes on while some longer window promises more than
R x its extra cost (E[tokens] - R*cost is what a round adds to a long run at
rate R), and :meth:`AdaptiveK.trim` drops trailing drafts not worth their
rows in the verify window.  A cheap drafter (n-gram) proposes
before the choice, so the keys of the actual draft are known, and its first
token is compared with the target's token for free when k = 0 ("shadow"
observation: for a deterministic draft, agreement is exactly acceptance).
When plain decoding wins, the most promising window is still tried now and
then, to measure how a draft model is accepted and what a window size not
yet seen costs (a cheap drafter is probed for the latter only); probes are
paid from a budget: what a probe is expected to lose against plain decoding
is taken from ``probe_start`` plain forwards' worth at the start plus
``probe_share`` (1 %) of the plain decoding time since, so however useless
the drafts are, probing cannot cost more than that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

__all__ = ["AdaptiveK", "expected_tokens", "confidence_key"]

POOL = "__pooled__"

# Buckets of a draft model's top-token probability: acceptance keys "p0".."p8".
CONFIDENCE_EDGES = (0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.98, 0.995)


def confidence_key(p_top: float) -> str:
    """Acceptance key of a draft-model token whose top-token probability is ``p_top``."""
    i = 0
    while i < len(CONFIDENCE_EDGES) and p_top >= CONFIDENCE_EDGES[i]:
        i += 1
    return f"p{i}"


def expected_tokens(a: float | Sequence[float], k: int | None = None) -> float:
    """Mean tokens per round: 1 + a + a^2 + ... + a^k for one acceptance a,
    or 1 + a_0 + a_0 a_1 + ... for per-position acceptances (k = their number)."""
    if isinstance(a, (int, float)):
        if k is None or k <= 0:
            return 1.0
        if a >= 1.0:
            return float(k + 1)
        return (1.0 - a ** (k + 1)) / (1.0 - a)
    total, run = 1.0, 1.0
    for ai in list(a)[: len(a) if k is None else k]:
        run *= ai
        total += run
    return total


@dataclass
class AdaptiveK:
    k_max: int
    gpu: bool = False
    decay: float = 0.98  # per observation of a key / of a window size
    prior_accept: float = 0.3
    prior_weight: float = 2.0
    probe_share: float = 0.01
    probe_start: float = 2.0  # initial budget and cap, in plain forwards
    _counts: dict = field(default_factory=dict)  # key -> [decayed accepted, decayed rejected]
    _time: dict = field(default_factory=dict)  # w -> [decayed sum of seconds, decayed count]
    _warm: set = field(default_factory=set)  # window sizes seen at least once (first one not timed)
    _draft: list = field(default_factory=lambda: [0.0, 0.0])  # [decayed draft seconds, decayed drafted tokens]
    _draft_at: int = 0  # _round when drafts were last timed
    _budget: float = 0.0  # seconds the next probe may cost beyond plain decoding
    _primed: bool = False
    _rate: float = 0.0  # expected tokens/s of the last plan (R in extend/trim)
    _keep: int = 0  # a probe's length: extend drafts and trim keeps at least this many
    _round: int = 0  # forwards timed so far
    _timed_at: dict = field(default_factory=dict)  # w -> _round when a forward of w rows was last timed
    n_probes: int = 0

    # ------------------------------------------------------------ estimates
    def acceptance(self, key: Hashable | None = None) -> float:
        """Estimated probability that a draft token with ``key`` is accepted."""
        acc, rej = self._counts.get(POOL, (0.0, 0.0))
        w = self.prior_weight
        pooled = (acc + w * self.prior_accept) / (acc + rej + w)
        if key is None:
            return pooled
        # An integer key (an n-gram match length) shrinks towards the next
        # shorter match: a longer match is at least as good a bet.
        prior = self.acceptance(key - 1) if isinstance(key, int) and key > 1 else pooled
        acc, rej = self._counts.get(key, (0.0, 0.0))
        return (acc + w * prior) / (acc + rej + w)

    def target_costs(self, w_max: int) -> list[float] | None:
        """Predicted seconds of a verify forward of w = 1..w_max rows (None: no data yet)."""
        # a size's weight fades with the forwards timed since it last was (see _time_forward)
        now, timed_at = self._round, self._timed_at
        aged = ((size, s / n, n * self.decay ** (now - timed_at.get(size, now))) for size, (s, n) in self._time.items()
                if n > 0)
        seen = {size: (t, n) for size, t, n in aged if n > 0.05 or size == 1}
        if 1 not in seen:
            return None
        t1 = seen[1][0]
        wide = sorted((size, t, n) for size, (t, n) in seen.items() if size >= 2)
        slope_prior = t1 * (0.03 if self.gpu else 0.5)
        if not wide:  # prior: the 2nd row costs 3/4 of a token on a CPU
            line = lambda w: t1 * (1.05 if self.gpu else 1.75) + slope_prior * (w - 2)  # noqa: E731
        elif len(wide) == 1:
            size, t, _ = wide[0]
            line = lambda w: t + slope_prior * (w - size)  # noqa: E731
        else:  # a line through the sizes >= 2, each weighted by its (decayed) number of forwards
            sw = sum(p[2] for p in wide)
            mx = sum(p[0] * p[2] for p in wide) / sw
            my = sum(p[1] * p[2] for p in wide) / sw
            sxx = sum(p[2] * (p[0] - mx) ** 2 for p in wide)
            slope = max(0.0, sum(p[2] * (p[0] - mx) * (p[1] - my) for p in wide) / sxx) if sxx > 0 else slope_prior
            line = lambda w: my + slope * (w - mx)  # noqa: E731
        # A size timed a few times is its own best estimate; one timed once or
        # twice (a calibration sample on a busy machine) leans on the line.
        out = [t1]
        for w in range(2, w_max + 1):
            if w in seen:
                t, n = seen[w]
                f = min(n, 3.0) / 3.0
                out.append(max(f * t + (1.0 - f) * max(line(w), t1), t1))
            else:
                out.append(max(line(w), t1))
        return out

    def target_cost(self, w: int) -> float | None:
        """Predicted seconds for a verify forward of w rows (None: no data yet)."""
        costs = self.target_costs(w)
        return None if costs is None else costs[w - 1]

    def acceptance_measured(self, n: int = 20) -> bool:
        """Whether acceptance is learned (``n`` draft tokens at least, decayed), here or in earlier runs."""
        acc, rej = self._counts.get(POOL, (0.0, 0.0))
        return acc + rej >= n

    @property
    def draft_cost(self) -> float:
        t, n = self._draft
        return t / n if n > 0 else 0.0

    def _plan(self, k_max: int, keys: Sequence[Hashable] | None) -> tuple[list[float], list[float]] | None:
        """(expected tokens, expected seconds) of a round with k = 0..k_max drafts.

        ``keys`` (one per draft position, at least k_max of them) are the keys
        of a draft already proposed by a cheap drafter; without them the draft
        is a draft model's, still to be made, and every position has key None
        (and costs ``draft_cost`` per token).  None when costs are unknown.
        """
        costs = self.target_costs(k_max + 1)
        if costs is None:
            return None
        c = 0.0 if keys is not None else self.draft_cost
        memo: dict = {}
        tokens, total, run = [1.0], 1.0, 1.0
        for k in range(1, k_max + 1):
            key = keys[k - 1] if keys is not None else None
            if key not in memo:
                memo[key] = self.acceptance(key)
            run *= memo[key]
            total += run
            tokens.append(total)
        return tokens, [t + c * k for k, t in enumerate(costs)]

    # -------------------------------------------------------------- choice
    def choose(self, k_limit: int | None = None, keys: Sequence[Hashable] | None = None) -> int:
        """Draft length for the next round.

        ``keys``: the keys of a cheap drafter's proposal (its length caps k).
        """
        k_max = self.k_max if k_limit is None else min(self.k_max, k_limit)
        if keys is not None:
            k_max = min(k_max, len(keys))
        if k_max <= 0 or 1 not in self._time:
            return 0  # nothing to draft, or first measure plain forwards
        tokens, costs = self._plan(k_max, keys)
        rates = [n / t for n, t in zip(tokens, costs)]
        plain = rates[0]
        best = max(rates[1:])
        k = rates.index(best, 1)
        self._rate, self._keep = max(best, plain), 0
        if best > plain * 1.0001:
            return k
        # Plain decoding looks best.  Probe the most promising window when the
        # budget covers what it is expected to lose against plain decoding.
        if keys is not None and self._time.get(k + 1, (0.0, 0.0))[1] >= 0.9:
            return 0  # a cheap drafter's acceptance is seen for free, and this window's cost is known
        # its expected time minus what plain decoding needs for its expected tokens; a draft token
        # counted at one plain forward at most: a draft cost learned in a busy spell (or a run on
        # a loaded machine) makes every probe look dearer than the budget ever holds, and the
        # draft's cost would never be measured again (learned at 340 ms a token for a draft of 15)
        c = 0.0 if keys is not None else self.draft_cost
        loss = costs[k] - k * max(0.0, c - costs[0]) - tokens[k] / plain
        if self._budget >= loss:
            self._budget -= max(loss, 0.0)
            self.n_probes += 1
            self._keep = k  # a probe is verified whole, or it would teach nothing
            return k
        return 0

    def _gains(self, keys: Sequence[Hashable], k_limit: int, draft_cost: float) -> list[float]:
        """E[tokens] - R * cost of a round stopped after j = 0..k_limit drafts, the
        first len(keys) of them drafted already (known keys), later ones at the
        pooled acceptance."""
        costs = self.target_costs(k_limit + 1)
        rate, a_next = self._rate, self.acceptance(None)
        out, total, run = [], 1.0, 1.0
        for j in range(k_limit + 1):
            if j:
                run *= self.acceptance(keys[j - 1]) if j <= len(keys) else a_next
                total += run
            out.append(total - rate * (costs[j] + draft_cost * j))
        return out

    def extend(self, keys: Sequence[Hashable], k_limit: int | None = None) -> bool:
        """After drafting ``len(keys)`` tokens: is drafting more expected to pay?"""
        k_limit = self.k_max if k_limit is None else min(k_limit, self.k_max)
        m = len(keys)
        if m >= k_limit:
            return False
        if m < self._keep or 1 not in self._time or self._rate <= 0.0:
            return True  # a probe's length, or nothing measured yet
        g = self._gains(keys, k_limit, self.draft_cost)
        return max(g[m + 1 :]) > g[m]

    def trim(self, keys: Sequence[Hashable]) -> int:
        """How many of the drafted tokens (with these keys) to verify: the drafting is
        paid for, so only each row's share of the verify window counts."""
        if not keys or 1 not in self._time or self._rate <= 0.0:
            return len(keys)
        g = self._gains(keys, len(keys), 0.0)
        return max(min(self._keep, len(keys)), max(range(len(g)), key=lambda j: (g[j], j)))

    def share_costs(self, other: "AdaptiveK") -> None:
        """Use (and update) ``other``'s window and draft timings: same target and
        drafter, another acceptance regime."""
        self._time, self._warm, self._draft = other._time, other._warm, other._draft

    def needs_calibration(self) -> bool:
        """True until a single row and at least two window sizes have been timed."""
        return 1 not in self._time or len(self._time) < 3

    # ------------------------------------------------------------ feedback
    def _time_forward(self, w: int, seconds: float) -> None:
        self._round += 1
        if w not in self._warm:  # llama.cpp builds a new graph for a new batch shape: slow once
            self._warm.add(w)
            return
        slot = self._time.setdefault(w, [0.0, 0.0])
        if slot[1] > 0.5:  # a stray slow forward (machine busy) counts at most 1.5x the mean
            seconds = min(seconds, 1.5 * slot[0] / slot[1])
        # Decay by the forwards timed since this size last was, not once: a window size
        # timed while the machine was busy and not since (plain decoding looked better)
        # must not outweigh a probe's fresh timing, or the controller stays plain for good
        age = self._round - self._timed_at.get(w, self._round - 1)
        self._timed_at[w] = self._round
        f = self.decay ** max(age, 1)
        slot[0] = slot[0] * f + seconds
        slot[1] = slot[1] * f + 1.0

    def _count(self, key: Hashable, accepted: bool) -> None:
        for kk in (POOL,) if key is None or key == POOL else (key, POOL):
            slot = self._counts.setdefault(kk, [0.0, 0.0])
            slot[0] *= self.decay
            slot[1] *= self.decay
            slot[0 if accepted else 1] += 1.0

    def observe(
        self, k: int, n_accepted: int, t_target: float, t_draft: float, keys: Sequence[Hashable] | None = None,
        drafted: int | None = None,
    ) -> None:
        """One verify round: k drafts verified (with these keys), n_accepted kept, and what it cost.

        ``drafted``: tokens a draft model made for the round (>= k: trimmed ones
        count), whose time ``t_draft`` was; default k without keys (a draft
        model), 0 with keys (a cheap drafter).  ``t_draft`` leaves out a draft
        model's catch-up on tokens decoded plainly since it last drafted
        (``run.catch_up_excess``): what keeping a draft model costs, owed
        whenever it drafts again, so it is held neither against drafting nor
        against a probe (from the probe budget, it would starve probing: the
        catch-up on N plain rounds costs a few % of their time, the budget
        grows by 1 %).  Counted as a cost per drafted token, it made drafting
        look many times dearer than it is (a probe after 50 plain rounds
        evaluates 50 rows to draft 2 tokens) and kept the controller from ever
        drafting again.
        """
        self._time_forward(k + 1, t_target)
        if drafted is None:
            drafted = k if keys is None else 0
        if drafted > 0:
            d = self._draft
            # decayed by the rounds since drafts were last timed (as forwards are): a fresh probe's
            # timing outweighs one made long ago
            f = self.decay ** max(self._round - self._draft_at, 1)
            if d[1] > 0.5:
                mean = d[0] / d[1]
                if t_draft < 0.5 * drafted * mean:
                    # a machine's noise only ever adds time: a draft this much cheaper than the figure
                    # means the figure is wrong (learned while the machine was busy), not this draft
                    f = 0.0
                else:  # as a forward's: a stray slow draft (machine busy) counts at most 1.5x the mean
                    t_draft = min(t_draft, 1.5 * drafted * mean)
            self._draft_at = self._round
            d[0], d[1] = d[0] * f + t_draft, d[1] * f + drafted
        if k > 0:
            for i in range(min(n_accepted + 1, k)):  # positions after the first rejection are unseen
                self._count(keys[i] if keys is not None else None, i < n_accepted)
        else:
            cap = self.probe_start * t_target
            if not self._primed:  # a young controller may look around a little more
                self._primed, self._budget = True, cap
            self._budget = min(self._budget + self.probe_share * t_target, cap)

    def observe_shadow(self, agreed: bool, key: Hashable | None = None) -> None:
        """A free draft token compared with the target's token (k = 0 rounds)."""
        self._count(key, agreed)

    def observe_forward(self, w: int, seconds: float) -> None:
        """A target forward of ``w`` rows that verified nothing (a calibration)."""
        self._time_forward(w, seconds)

    # --------------------------------------------------------- persistence
    def export_state(self) -> dict:
        """What this controller learned, as plain JSON-able data (see :mod:`mars_local.speculate.learned`)."""
        return {
            "time": {str(w): list(v) for w, v in self._time.items()},
            "draft": list(self._draft),
            "counts": [[k, v[0], v[1]] for k, v in self._counts.items()],
        }

    def import_state(self, state: dict, weight_cap: float = 20.0, time_cap: float = 5.0) -> None:
        """Start from an exported state; its weights are capped so that new
        observations soon outweigh it.  Malformed parts are ignored."""
        try:
            for w, (t, n) in (state.get("time") or {}).items():
                w, t, n = int(w), float(t), float(n)
                if w >= 1 and n > 0 and t > 0:
                    f = min(1.0, time_cap / n)
                    self._time[w] = [t * f, n * f]
            t, n = (float(x) for x in (state.get("draft") or (0.0, 0.0)))
            if n > 0 and t > 0:
                f = min(1.0, time_cap * 4 / n)
                self._draft[:] = [t * f, n * f]
            for key, acc, rej in state.get("counts") or ():
                acc, rej = float(acc), float(rej)
                if acc >= 0 and rej >= 0 and (acc + rej) > 0 and isinstance(key, (int, str)):
                    f = min(1.0, weight_cap / (acc + rej))
                    self._counts[key] = [acc * f, rej * f]
        except (TypeError, ValueError, AttributeError):
            pass

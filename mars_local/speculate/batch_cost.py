"""The round's draft length for many sequences, and what a forward of R rows costs (pure;
:mod:`.batched` uses it): the load-aware part of continuous batching."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core.defaults import SETTINGS
from .adaptive import AdaptiveK, expected_tokens

__all__ = ["choose_window", "plan_drafting", "isotonic", "drop_strays", "BatchCost", "DraftOrNot", "auto_parallel", "resolve_parallel",
           "MAX_ROWS"]

MAX_ROWS = SETTINGS["draft_max"].hi + 1  # rows one forward may carry exactly (llama.streams.MAX_INVARIANT_ROWS)
# what one calibration forward counts for against one of a real round: calibration times each
# size twice, back to back, once (on a GPU its first forwards of a shape can cost several times a
# round's, and a size the rounds never use again would keep that cost for good)
CALIBRATION_WEIGHT = 0.25
# what the first forward of a batch shape counts for on a CPU (BatchCost.first_weight)
CPU_FIRST_WEIGHT = 0.5
# what a forward timed by an earlier process counts for when the next one starts from it, in
# forwards: enough to plan by, little enough that the new process's own forwards soon decide
IMPORT_WEIGHT = 3.0


def isotonic(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in weighted least squares (pure; pool
    adjacent violators): a run of sizes whose costs fall as rows grow gets their weighted mean."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for v, w in zip(values, weights):
        w = max(float(w), 1e-12)
        blocks.append([v * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w2, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w2
            blocks[-1][2] += n
    out: list[float] = []
    for s, w, n in blocks:
        out.extend([s / w] * n)
    return out


def drop_strays(timed: Sequence[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """``timed``: (rows, mean seconds, weight) of the sizes timed, by rows; returns them without
    the strays (pure): a size timed less than once (a shape's first forward, a calibration's)
    whose cost lies outside what the sizes on either side, timed once or more, allow (more than
    the next wider one's, or less than the next narrower one's, after :func:`isotonic`).  A
    forward of fewer rows never costs more than one of more, so such a sample caught the machine
    busy; pooled, it would raise every size up to the wider one (on the Zen 4, one 5-row forward
    of 329 ms, kept in the learned state, put 5–8 rows of the F16 stand-in at 193 ms, where 5
    rows cost ~140).  Left out, the size is interpolated; it still counts as timed."""
    sure = [(r, m, c) for r, m, c in timed if c >= 1.0]
    if len(sure) < 2:
        return list(timed)
    fit = dict(zip((r for r, _, _ in sure), isotonic([m for _, m, _ in sure], [c for _, _, c in sure])))
    out = []
    for r, m, c in timed:
        if c < 1.0:
            lo = max((x for x in fit if x < r), default=None)
            hi = min((x for x in fit if x > r), default=None)
            if lo is not None and hi is not None and not fit[lo] <= m <= fit[hi]:
                continue
        out.append((r, m, c))
    return out


# ------------------------------------------------------------ the choice
def choose_window(accepts: Sequence[Sequence[float]], costs: Sequence[float], k_max: int, k_min: int = 0) -> int:
    """The round's draft length k (pure).

    ``accepts[i]``: the estimated acceptance of each token of sequence i's draft
    (its length caps what it can gain); ``costs[R - 1]``: seconds of one forward of
    R rows.  Returns argmax over k = k_min..k_max of sum_i E_i[tokens | k] / costs[n(k+1) - 1],
    where E_i is the expected accepted prefix of min(k, len) drafts plus one token
    (``k_min`` = 1: a round that drafted to find out what drafting delivers verifies a draft).
    """
    n = len(accepts)
    if n == 0:
        return 0
    k_min = min(k_min, k_max)
    best_k, best = k_min, -1.0
    for k in range(k_min, k_max + 1):
        rows = n * (k + 1)
        if rows > len(costs):
            break
        tokens = sum(expected_tokens(list(a[:k]), min(k, len(a))) if k and len(a) else 1.0 for a in accepts)
        rate = tokens / costs[rows - 1]
        if rate > best * 1.0001:
            best_k, best = k, rate
    return best_k


# the rate a plan's drafting must promise over plain rounds' before the plan drafts: near the
# break-even the plan's choice flips with noise, every flip brings DraftOrNot's trials back, and a
# trial of drafting pays a catch-up of every sequence (F16 stand-in on 2 cores, serving-like
# batches of 4 sequences: 0.94x plain rounds' rate without the margin, 1.04x with it;
# BENCHMARKS.md, run 23)
PLAN_MARGIN = 1.05


def plan_drafting(accepts: Sequence[Sequence[float]], costs: Sequence[float], per_token: float, k_room: int,
                  lags: Sequence[int] = (), remaining: Sequence[int] = (), row_s: float = 0.0,
                  margin: float = PLAN_MARGIN) -> tuple[int, int, float]:
    """A draft model's round, planned before it drafts (pure): ``(k, k_draft, switch_s)``.

    ``accepts[i]``: sequence i's estimated acceptance per draft position (k_room of them);
    ``costs[R - 1]``: seconds of a forward of R rows; ``per_token``: seconds per draft token
    (a draft decode per step, ``n * k`` tokens a round).  What a switch to drafting costs on top:
    sequence i's draft cache lags ``lags[i]`` tokens behind (its prompt, or the rounds it did not
    draft), caught up at ``row_s`` seconds per token before it can draft, a price paid once and
    spread over the rounds it has left (``remaining[i]`` tokens at most, at the expected tokens
    of a round), so a sequence near its end does not pay for a catch-up it cannot earn back.

    ``k``: the k of the best rate, 0 = plain rounds unless drafting's best rate is ``margin``
    times theirs or more; ``k_draft``: the best k >= 1 (what a round that drafts uses);
    ``switch_s``: the catch-up per round at ``k_draft``.
    """
    n = len(accepts)
    lags = list(lags) or [0] * n
    remaining = list(remaining) or [1 << 30] * n
    plain, best_draft = -1.0, (1, -1.0, 0.0)
    for k in range(0, k_room + 1):
        rows = n * (k + 1)
        if rows > len(costs):
            break
        per_seq = [expected_tokens(list(a[:k]), k) if k else 1.0 for a in accepts]
        switch = sum(lag * row_s / max(1.0, left / e) for lag, left, e in zip(lags, remaining, per_seq) if lag) if k else 0.0
        rate = sum(per_seq) / (costs[rows - 1] + per_token * n * k + switch)
        if not k:
            plain = rate
        elif rate > best_draft[1] * 1.0001:
            best_draft = (k, rate, switch)
    drafts = best_draft[1] > 0 and best_draft[1] >= plain * margin
    return best_draft[0] if drafts else 0, best_draft[0], best_draft[2]


@dataclass
class BatchCost:
    """Seconds of a target forward of R rows, R = 1..max_rows: decayed means of the
    forwards timed, a line through them elsewhere, a prior before any."""

    max_rows: int = MAX_ROWS
    decay: float = 0.95
    # the most rows one decode carries (llama.streams.MultiContext.max_rows: 16 on a GPU, or
    # n_batch if less): a forward of more rows is several decodes, and costs their sum where
    # not timed itself; None or max_rows and above: one decode
    split_rows: int | None = None
    # what the first forward of a batch shape counts for (0: not timed).  On a GPU it captures
    # a graph and costs several forwards; on a CPU it costs ~5 % more than the next, and a
    # shape a round uses once (a trial of drafting at a new k) must count: untimed, its cost
    # stays the lone curve's guess (measured on a Q4_K_M stand-in, 4 windows of 4 rows: 0.51 s
    # a forward against 0.18 s guessed), and a plan that keeps guessing low keeps trying it
    first_weight: float = 0.0
    _time: dict = field(default_factory=dict)  # rows -> [decayed seconds, decayed count]
    _warm: set = field(default_factory=set)

    def observe(self, rows: int, seconds: float, weight: float = 1.0) -> None:
        """A forward of ``rows`` rows took ``seconds`` (``weight``: what it counts for, 1 for a
        round's forward, CALIBRATION_WEIGHT for a calibration's)."""
        if rows not in self._warm:  # a new batch shape builds its graph once
            self._warm.add(rows)
            if self.first_weight <= 0.0:
                return
            weight *= self.first_weight
        slot = self._time.setdefault(rows, [0.0, 0.0])
        if slot[1] >= 1.0:  # a stall (another process, a page fault) counts at 1.5x the mean at most
            seconds = min(seconds, 1.5 * slot[0] / slot[1])
        slot[0] = slot[0] * self.decay + seconds * weight
        slot[1] = slot[1] * self.decay + weight

    def timed(self, rows: int) -> bool:
        """Whether a forward of ``rows`` rows was timed here (a calibration's counts too)."""
        return self._time.get(rows, (0.0, 0.0))[1] > 0.05

    def observed(self) -> bool:
        """Whether this process timed any forward (an imported state alone is not)."""
        return bool(self._warm)

    def export_state(self) -> dict:
        """The forwards timed, as JSON-able data (kept between processes: :class:`.Scheduler`).
        The draft's cost is not: one learned elsewhere is a prior the plan must not take for a
        measurement (:meth:`.Scheduler._plan_costly`), and timing it costs a catch-up's start."""
        return {"time": {str(r): list(v) for r, v in self._time.items()}}

    def import_state(self, state: dict, weight_cap: float = IMPORT_WEIGHT) -> None:
        """Start from an exported state, each shape's weight capped at ``weight_cap`` forwards:
        a shape timed in an earlier process needs no probe (:meth:`.Scheduler._probe_switch`),
        and this process's own forwards soon outweigh it.  Malformed parts are ignored."""
        try:
            for r, (t, c) in (state.get("time") or {}).items():
                r, t, c = int(r), float(t), float(c)
                if 1 <= r and t > 0 and c > 0:
                    f = min(1.0, weight_cap / c)
                    self._time[r] = [t * f, c * f]  # (not warm: this process builds its graph again)
        except (TypeError, ValueError, AttributeError):
            pass

    _draft: list = field(default_factory=lambda: [0.0, 0.0])  # decayed draft seconds, tokens

    def observe_draft(self, n_tokens: int, seconds: float) -> None:
        if n_tokens > 0:
            d = self._draft
            d[0], d[1] = d[0] * self.decay + seconds, d[1] * self.decay + n_tokens

    def draft_cost(self, prior: float = 0.0) -> float:
        t, n = self._draft
        return t / n if self.draft_measured else prior

    @property
    def draft_measured(self) -> bool:
        """Whether drafts were timed here (not a prior learned elsewhere)."""
        return self._draft[1] > 0.5

    def costs(self, prior: AdaptiveK | None = None, n_seqs: int | None = None) -> list[float]:
        """Seconds of a forward of R = 1..max_rows rows, never less than of fewer rows.  With
        ``prior`` (a controller that timed lone windows on this machine) its curve gives the
        shape, scaled to the batched forwards timed (their ratio to it, interpolated between the
        sizes timed); else a line through them.  The sizes timed are first made non-decreasing
        in rows by a fit weighted by how often (and how lately) each was timed (:func:`isotonic`):
        one slow sample of a size, all the plan knows of it early on, neither makes wider
        forwards look cheaper than it (the plan would draft where every forward costs more) nor,
        once wider sizes have been timed often for less, keeps every size above it dear (on a
        GPU, a slow calibration forward of 1 or 4 rows made plain rounds of 8 look dearer than
        drafting rounds of 64).  Before that fit, a size timed less than once that its
        neighbours, timed more, contradict is left out and interpolated (:func:`drop_strays`).
        With ``split_rows``,
        a round of more rows is several decodes of whole windows: ``n_seqs`` windows of R / n_seqs
        rows each where R is a multiple of it (what the plan asks for), else full decodes."""
        return list(np.maximum.accumulate(self._curve(prior, n_seqs)))

    def _curve(self, prior: AdaptiveK | None, n_seqs: int | None = None) -> list[float]:
        cap = self.split_rows
        if cap is None or cap >= self.max_rows:
            return self._one_decode_curve(prior)
        one = self._one_decode_curve(prior, upto=cap)  # (timed rounds of more rows were several decodes)
        out = list(one)
        for r in range(cap + 1, self.max_rows + 1):
            if self.timed(r):  # timed as it ran (several decodes)
                t, c = self._time[r]
                out[r - 1] = t / c
            elif n_seqs and r % n_seqs == 0:  # n_seqs windows of w rows, as many whole ones a decode as fit
                w = r // n_seqs
                per = max(1, cap // w)
                full, rest = divmod(n_seqs, per)
                out[r - 1] = full * one[per * w - 1] + (one[rest * w - 1] if rest else 0.0)
            else:  # whole decodes of ``cap`` rows and the rest
                q, m = divmod(r, cap)
                out[r - 1] = q * one[cap - 1] + (one[m - 1] if m else 0.0)
        return out

    def _one_decode_curve(self, prior: AdaptiveK | None, upto: int | None = None) -> list[float]:
        timed = drop_strays(sorted((r, t / c, c) for r, (t, c) in self._time.items()
                                   if self.timed(r) and (upto is None or r <= upto)))
        seen = dict(zip((r for r, _, _ in timed), isotonic([m for _, m, _ in timed], [c for _, _, c in timed])))
        lone = prior.target_costs(self.max_rows) if prior is not None else None
        if lone is not None:
            if not seen:
                return list(lone)
            xs = sorted(seen)
            ratios = [seen[x] / max(lone[x - 1], 1e-12) for x in xs]
            return [seen[r] if r in seen else lone[r - 1] * float(np.interp(r, xs, ratios))
                    for r in range(1, self.max_rows + 1)]
        if len(seen) < 2:
            t1 = seen.get(1) or next(iter(seen.values()), 1.0)
            return [t1 * (1.0 + 0.3 * (r - 1)) for r in range(1, self.max_rows + 1)]
        xs = sorted(seen)
        out = []
        for r in range(1, self.max_rows + 1):
            if r in seen:
                out.append(seen[r])
                continue
            lo = max((x for x in xs if x < r), default=None)
            hi = min((x for x in xs if x > r), default=None)
            if lo is None:
                lo, hi = xs[0], xs[1]
            elif hi is None:
                lo, hi = xs[-2], xs[-1]
            slope = max(0.0, (seen[hi] - seen[lo]) / (hi - lo))
            out.append(max(seen[lo] + slope * (r - lo), 1e-9))
        return out


class DraftOrNot:
    """Whether a round drafts, from what rounds really delivered (pure).

    The plan's cost model (forward costs, a draft model's cost per token) can be wrong in
    ways it cannot see, e.g. what its batched decodes really cost.  So the tokens per second
    of whole rounds (drafting included) are kept for drafting rounds and plain ones (decayed
    means); once both are known the better one is used, the other tried after ``explore``
    rounds, and after twice as many each time it loses again (up to 512).  Until then the
    plan decides, and a mode never tried is tried after ``explore`` rounds.  A trial of plain
    rounds costs nothing beyond its round (the draft caches fall one round behind, which the
    next drafting round's first evaluation carries anyway), so plain is tried sooner, after
    ``explore_plain`` rounds: the plan's cost of plain rounds is a guess until one has run
    (what a forward of n rows from n sequences costs, scaled from other shapes), and drafting
    it wrongly prefers must not go on for ``explore`` rounds twice before it is found out.

    Rates are kept per load (``n``: the sequences a round carries) and compared at the load of
    the round: a round of one sequence delivers fewer tokens per second than one of four, so
    drafting rounds timed while a server's first request ran alone (16 tok/s on the F16
    stand-in) made drafting look worse than plain rounds of four (28), and a server whose
    drafting rounds of four delivered 31 stayed plain (BENCHMARKS.md, run 30).

    A drafting round's time includes, while drafting goes on, the draft model's catch-up on
    prompts that joined (a recurring cost of drafting: :meth:`.Scheduler._round`).  What the
    rates leave out is the price of a switch to drafting: a draft model that skipped rounds
    catches up with every sequence's missed tokens first (at 8 sequences, a few plain rounds'
    time).  Hence these rules:

    * hysteresis: from plain rounds, drafting is taken up only where its rounds deliver
      ``enter`` (10 %) more; between the margins the current mode stays;
    * a trial of drafting, once drafting has been measured, only while the plan says drafting
      pays: the plan sees a change of load (its forward costs are per row count) and what
      drafting costs and delivers (learned from drafting rounds), so where it and the rates
      both say plain a trial would only pay a catch-up again;
    * the trials' gap starts again at ``explore`` when the plan changes its mind (the load or
      the acceptance changed), not when the rates cross near the break-even, where noise would
      bring a trial, and its catch-up, every ``explore`` rounds; nor for a mode whose rounds
      at this load lost by more than ``enter``: the plan flips with every wave of requests (its
      switch cost grows as sequences near their end), and on the F16 stand-in at 8 sequences
      each flip brought a trial of drafting that lost by 20 % again, with its catch-up of 8 prompts;
    * what a switch to drafting would cost now (``switch_s``: the catch-up spread over the
      rounds the sequences have left, :func:`plan_drafting`) is added to the drafting rounds'
      time before the rates are compared, and a plan made from measurements (``measured``:
      acceptance and draft cost learned, forward costs timed; or, acceptance not yet learned,
      drafting that would not pay even with every draft token accepted) is trusted: drafting
      it says does not pay is not tried even once;
    * one drafting round at a load is no rate, except where even its ceiling (every draft
      token accepted) is below plain rounds' rate there: drafting lost at that load whatever
      its luck (:meth:`_known`).

    What it measured is saved with the learned state (:meth:`export_state`) for ``mars doctor``
    to show; a new process does not start from it (:meth:`.Scheduler._load_learned` says why).
    """

    def __init__(self, decay: float = 0.9, explore: int = 16, margin: float = 1.03, enter: float = 1.10,
                 explore_plain: int = 4):
        self.decay, self.explore, self.margin, self.enter = decay, explore, margin, enter
        self.explore_plain = explore_plain
        # per load: {drafted: [tokens, seconds, rounds, decayed rounds]} (decayed sums)
        self._rates: dict = {}
        # per load: the tokens the latest drafting round would have delivered had every draft
        # token been accepted (its ceiling: with one drafting round measured, a sure loss is known)
        self._ceiling: dict = {}
        self._since = {True: 0, False: 0}
        self._planned, self._mode = None, None
        self._gap = self._first_gaps()  # mode tried -> rounds of the other mode before its next trial

    def export_state(self) -> dict:
        """The rates measured per load, as JSON-able data (``mars doctor`` shows them)."""
        return {"rates": [[n, drafted, *r] for n, by_mode in self._rates.items() for drafted, r in by_mode.items()]}

    def _first_gaps(self) -> dict[bool, int]:
        return {True: self.explore, False: min(self.explore_plain, self.explore)}

    def observe(self, drafted: bool, tokens: int, seconds: float, n: int | None = None,
                ceiling: int | None = None) -> None:
        """A round of ``n`` sequences (drafting or not) delivered ``tokens`` in ``seconds``;
        ``ceiling``: a drafting round's tokens had every draft token been accepted."""
        if drafted and ceiling is not None:
            self._ceiling[n] = max(int(ceiling), int(tokens))
        by_mode = self._rates.setdefault(n, {True: [0.0, 0.0, 0, 0.0], False: [0.0, 0.0, 0, 0.0]})
        r = by_mode[drafted]
        r[0], r[1], r[2] = r[0] * self.decay + tokens, r[1] * self.decay + seconds, r[2] + 1
        r[3] = r[3] * self.decay + 1.0

    def rate(self, drafted: bool, extra_s: float = 0.0, n: int | None = None) -> float | None:
        """Tokens per second of the rounds of ``n`` sequences that drafted (or not); ``extra_s``:
        seconds added to each."""
        t, sec, count, dn = self._rates.get(n, {}).get(drafted, (0.0, 0.0, 0, 0.0))
        # (one plain round is a measurement: n tokens in one forward; drafting rounds vary with acceptance)
        return t / (sec + extra_s * dn) if count >= (2 if drafted else 1) and sec > 0 else None

    def _known(self, n: int | None, switch_s: float) -> tuple[float | None, float | None]:
        """Drafting's and plain rounds' rates at load ``n`` as measured (None: not yet).  One
        drafting round is no rate (acceptance varies), but where even its ceiling (every draft
        token accepted) is below plain rounds' rate, drafting lost whatever its luck: that
        ceiling is drafting's rate.  A second losing trial at once, or at the next load, at 16
        sequences on the Q4_K_M stand-in, cost 4 s (BENCHMARKS.md, run 39)."""
        rd, rp = self.rate(True, switch_s, n), self.rate(False, 0.0, n)
        if rd is None and rp is not None and n in self._ceiling:
            t, sec, count, dn = self._rates[n][True]
            if count == 1 and sec > 0:
                top = self._ceiling[n] / (sec + switch_s * dn)
                rd = top if top < rp else None
        return rd, rp

    def _rates_at(self, n: int | None, switch_s: float) -> tuple[float | None, float | None]:
        """Drafting's and plain rounds' rates at load ``n`` (:meth:`_known`); where one is not
        known there, the ratio of the two at the nearest load where both are (as drafting's
        rate, plain's 1): a load first seen (a server's clients coming and going) is judged by
        what drafting did at a load like it, not by the plan alone (at 6 sequences on the F16
        stand-in the plan drafted where rounds of 8 had shown drafting 25 % behind)."""
        rd, rp = self._known(n, switch_s)
        if (rd is None or rp is None) and n is not None:
            both = [m for m in self._rates if m is not None and m != n and None not in self._known(m, 0.0)]
            if both:
                m = min(both, key=lambda m: (abs(m - n), -m))
                d, p = self._known(m, switch_s)
                return d / p, 1.0
        return rd, rp

    def peek(self, planned: bool, switch_s: float = 0.0, measured: bool = False, n: int | None = None) -> bool:
        """What :meth:`choose` would answer now, nothing changed."""
        held = copy.deepcopy(self.__dict__)
        try:
            return self.choose(planned, switch_s, measured, n)
        finally:
            self.__dict__ = held

    def choose(self, planned: bool, switch_s: float = 0.0, measured: bool = False, n: int | None = None) -> bool:
        """Draft this round of ``n`` sequences?  ``planned``: what the cost model says (``measured``:
        from measured inputs only); ``switch_s``: seconds per drafting round a switch to drafting
        costs now."""
        rd, rp = self._rates_at(n, switch_s)
        if planned != self._planned:  # the plan changed its mind: try the other again soon ...
            self._planned = planned
            first = self._first_gaps()
            for mode in (True, False):  # ... unless at this load that mode's rounds lost clearly
                lost = rd is not None and rp is not None and (rp > rd * self.enter if mode else rd > rp * self.enter)
                if not lost:
                    self._gap[mode] = first[mode]
        if rd is None or rp is None:
            pick = planned
        elif rd > rp * (self.margin if self._mode else self.enter):
            pick = True
        elif rp > rd * self.margin:
            pick = False
        else:  # near the break-even: no switch
            pick = planned if self._mode is None else self._mode
        self._mode = pick
        hopeless = not pick and not planned and (rd is not None or measured)  # a trial nobody expects to win
        if self._since[not pick] >= self._gap[not pick] and not hopeless:
            pick = not pick  # a trial (the mode stays)
            self._gap[pick] = min(2 * self._gap[pick], 512)
        self._since[pick] = 0
        self._since[not pick] += 1
        return pick


def _gpu_free_memory() -> int | None:
    """Bytes free on this machine's GPUs together (None: no GPU device known)."""
    from ..llama.rpc import local_gpu_devices

    try:
        gpus = local_gpu_devices()
    except Exception:  # noqa: BLE001 - (a build without the device API): the cap then
        return None
    free = sum(d.free for d in gpus)
    return free if gpus and free > 0 else None


def resolve_parallel(engine, parallel: int) -> int:
    """``--parallel`` as given (``mars batch``, ``mars serve``): 0 is :func:`auto_parallel`'s."""
    return auto_parallel(engine) if parallel == 0 else parallel


def auto_parallel(engine, n_ctx_seq: int | None = None, cap: int = 8) -> int:
    """The default --parallel: ``cap`` sequences (8: on a CPU a forward of 8 rows costs about
    3 single rows, and beyond 8 sequences the 64-row invariant bound leaves no room for
    drafts), fewer when their KV caches (target and draft) would take over half the free memory:
    the host's, or with the target's layers offloaded the GPUs' (after the models were loaded),
    where the KV cache of those layers lives."""
    from ..llama.context import available_memory, kv_cache_bytes

    n_ctx_seq = n_ctx_seq or engine.n_ctx
    per_seq = kv_cache_bytes(engine.target, n_ctx_seq)
    if engine.draft_model is not None:
        per_seq += kv_cache_bytes(engine.draft_model, n_ctx_seq)
    if engine.drafter_kind == "mtp":  # the target's hidden rows kept for the MTP layer (float32)
        per_seq += n_ctx_seq * engine.target.n_embd * 4
    elif engine.drafter_kind == "eagle3":  # the target's encoded features kept for the head (float32)
        per_seq += n_ctx_seq * engine.draft_model.n_embd * 4
    if engine.target.recurrent:  # its state, a snapshot per draft token and the checkpoints (llama/recurrent.py)
        from ..llama.recurrent import MAX_CHECKPOINTS, state_bytes

        per_seq += state_bytes(engine._ctx) * (1 + (engine.target.rollback_depth or 0) + MAX_CHECKPOINTS)
    avail = _gpu_free_memory() if engine.target.offloaded else available_memory()
    if avail is None or per_seq <= 0:
        return cap
    return max(1, min(cap, int(avail * 0.5 // per_seq)))

"""Many sequences at once: continuous batching of speculative decoding.

A :class:`Scheduler` runs up to ``n_parallel`` generations over one Engine's
models.  Each sequence keeps everything a lone generation has (its tokens,
drafter, controls, verify rule and θ, stop strings, statistics); what they
share is the target forward.  One round (:meth:`Scheduler.step`):

1. admit: a waiting request takes the lowest free sequence slot; a joining
   sequence's prompt is prefilled one ``n_batch`` chunk per round, in decodes
   of its own (never mixed with other sequences' windows), so a long prompt
   delays the others by one chunk per round, not by its whole length;
2. draft: every decoding sequence's drafter proposes (as in a lone round);
3. choose one window length for the round, load-aware (:func:`choose_window`):
   the k that maximises the expected tokens of all sequences per second of
   one forward of ``n * (k + 1)`` rows, with the cost of a forward of R rows
   learned from the forwards timed so far.  k = 0 is plain batched decoding;
   as sequences join k shrinks (rows cost more), and it grows again as they leave;
4. one target decode of every window (``[last, d_0 .. d_{k-1}]``, shorter drafts
   padded to the common length: padded rows are computed, never verified, and
   rolled back), at most 64 rows per decode (:mod:`mars_local.llama.streams`);
5. per sequence: controls, the verify rule on its own rows, rollback of its
   own cells, the new tokens emitted as a :class:`Chunk`; a finished sequence
   frees its slot at once.

Exactness: every sequence sits in its own KV stream and a window's rows are
computed exactly as a lone window's (see :mod:`mars_local.llama.streams`), so
strict greedy output of every sequence equals plain greedy decoding of its
prompt alone, whatever shares the batch.  Sampling draws are keyed by
(seed, position) as in a lone run.

Cancelling (:meth:`BatchStream.close`) removes a sequence before the next round;
an error in one sequence (e.g. its grammar) finishes it with stop_reason "error"
and the exception re-raised to its reader; the others go on.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import NamedTuple
from dataclasses import replace

import numpy as np

from ..core.config import GenerateConfig, Generation
from .run import Run as _Run
from ..core.errors import MarsError
from ..core.verify import verify
from ..core.stats import SpecStats
from ..core.tokens import common_prefix_len
from ..llama.abort import DecodeAborted
from ..llama.context import last_rides
from ..llama.eagle3 import open_eagle3
from ..llama.mtp import open_mtp
from ..llama.streams import MAX_INVARIANT_ROWS, MultiContext, exact_reuse
from . import native
from .batch_cost import CALIBRATION_WEIGHT, CPU_FIRST_WEIGHT, BatchCost, DraftOrNot, choose_window, plan_drafting
from .batch_stream import BatchStream, _Seq
from .lockstep import draft_lockstep
from .controls import Controls, StopScanner
from .drafters import EMPTY_DRAFT, Draft
from .grammar import GrammarState

__all__ = ["Scheduler", "BatchStream"]  # BatchStream: speculate/batch_stream.py

CALIBRATION_ROWS = (1, 4, 16, 64)
# Scheduler.warm_up times its forwards on top of (at most) this many tokens of this text
WARM_UP_TEXT = ("The history of the printing press begins in the fifteenth century, when movable type "
                "changed how books were made, sold and read across Europe.")
WARM_UP_TOKENS = 32
# the controllers are saved at most this often while sequences finish (Scheduler._save_learned)
SAVE_EVERY_S = 10.0
# a catch-up rate kept by an earlier process weighs this many tokens of catch-up here
CATCH_IMPORT_ROWS = 64.0


class _Plan(NamedTuple):
    """A round's plan before a draft model drafts (:meth:`Scheduler._plan_costly`)."""

    k: int  # the best k (0: plain rounds)
    k_draft: int  # the best k >= 1: what a round that drafts uses
    switch_s: float  # what catching the draft caches up costs per round at k_draft
    measured: bool  # made from measured inputs only (DraftOrNot trusts it: no trial against it)


class Scheduler:
    """Up to ``n_parallel`` generations at once over ``engine``'s models.

    ``n_ctx_seq``: tokens each sequence may hold (default: the engine's context,
    so a request that fits a lone run fits here); the KV cache holds
    ``n_parallel * n_ctx_seq`` cells per model.
    """

    def __init__(self, engine, n_parallel: int, n_ctx_seq: int | None = None):
        if n_parallel < 1:
            raise MarsError(f"--parallel must be >= 1, got {n_parallel}")
        self.eng = engine
        self.n_parallel = n_parallel
        n_seq_ctx = n_ctx_seq or engine.n_ctx
        opts = dict(n_batch=engine._ctx.n_batch, n_threads=engine.n_threads)
        self.mc = MultiContext(engine.target, n_parallel, n_seq_ctx, **opts)
        self.dmc = None
        if engine.drafter_kind == "model":
            self.dmc = MultiContext(engine.draft_model, n_parallel, n_seq_ctx, unified=True, **opts)
        elif engine.drafter_kind == "mtp":  # the target's MTP layers, one sequence per target sequence
            self.dmc = open_mtp(self.mc)
        elif engine.drafter_kind == "eagle3":  # the EAGLE-3 head, one sequence per target sequence
            self.dmc = open_eagle3(self.mc, engine.draft_model)
        # (split_rows: the exact bound, n_batch: one decode's rows; a GPU's first forward of a
        # shape captures its graph, a CPU's costs what the next does)
        self.cost = BatchCost(split_rows=self.mc.max_rows,
                              first_weight=0.0 if engine.target.offloaded else CPU_FIRST_WEIGHT)
        # the patched libllama's verify kernel when there is one (same results as numpy), chosen once
        self._verify_window = native.verify if native.available() else verify
        self.mode = DraftOrNot()  # a draft model's rounds: draft or not, from the rates delivered
        self._free = list(range(n_parallel))
        # per slot: how many of its cached tokens were a prompt prefilled as a lone run does (the
        # rest came from windows): a new prompt keeps what llama.streams.exact_reuse allows
        self._prompt_len = [0] * n_parallel
        # copying another slot's prefix moves a whole KV stream: worth it when prefilling the rows
        # it saves would take longer (prefill seconds per token as measured; memory at ~4 GB/s)
        from ..llama.context import kv_cache_bytes

        bandwidth = 1e11 if engine.target.offloaded else 4e9
        self._copy_s = kv_cache_bytes(engine.target, self.mc.n_ctx) / bandwidth
        self._prefill_rate = [0.0, 0.0]  # decayed prefill seconds, tokens
        self._catch = [0.0, 0.0]  # a draft model's catch-ups: decayed seconds, tokens
        self._draft_timed = False  # _calibrate_draft timed (or failed to time) the draft model
        self._drafted_last = False  # the last round with a draft model drafted (DraftOrNot said so)
        self._saved_at = time.perf_counter()  # the controllers last saved (_save_learned)
        # whether the target's chunks of more than the exact bound compute rows alike whatever
        # their length (llama.streams.exact_reuse): measured by warm_up, kept; None: not known
        self.wide_alike: bool | None = None
        self._load_learned()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._live: dict[int, _Seq] = {}  # slot -> sequence
        self.calibrated = False
        self.rounds = 0
        self.last_rows = 0  # rows of the latest target forward (metrics)
        self.last_k = 0

    # -------------------------------------------------------------- requests
    def submit(self, prompt: str | Sequence[int], config: GenerateConfig | None = None, **options) -> BatchStream:
        """Queue a generation; it joins at the next round with a free slot."""
        cfg = config if config is not None else GenerateConfig.make(**options)
        if config is not None and options:
            cfg = replace(cfg, **options)
        eng = self.eng
        tokens = eng._prompt_tokens(prompt)
        if len(tokens) >= self.mc.n_ctx:
            raise MarsError(f"the prompt is {len(tokens)} tokens but a sequence holds {self.mc.n_ctx}; "
                            "use a larger -c or a shorter prompt")
        seed = cfg.sampling.base_seed()
        ctrl = eng._controller(cfg)
        stats = SpecStats(n_prompt=len(tokens), adaptive=ctrl is not None)
        grammar = (GrammarState(eng.target, cfg.grammar, triggers=cfg.grammar_triggers)
                   if cfg.grammar is not None else None)
        controls = Controls(cfg, eng.target.eog_ids, grammar)
        run = _Run(tokens, cfg, cfg.verify_config(eng.target.eog_ids), seed, None, stats, ctrl,
                   controls=controls, stops=StopScanner(cfg.stop))
        seq = _Seq(run)
        self._waiting.append(seq)
        return BatchStream(self, seq)

    def generate_many(self, prompts: Sequence[str | Sequence[int]], config: GenerateConfig | None = None,
                      **options) -> list[Generation]:
        """Generate every prompt (at most n_parallel at a time); results in the prompts' order."""
        streams = [self.submit(p, config, **options) for p in prompts]
        while any(not s._seq.done for s in streams):
            self.step()
        return [s.result() for s in streams]

    @property
    def n_live(self) -> int:
        return len(self._live)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------ one round
    def step(self, after_prefill=None) -> bool:
        """One round for every live sequence; False when there was nothing to do.
        ``after_prefill()``, when given, is called between the joining sequences' prefill
        (whose first tokens may already be known) and the round, and after each joining
        sequence whose first token its prefill gave: a server hands that token to its client
        there, not after the other prompts' prefill or a round later."""
        self._admit()
        if not self._live:
            return False
        self._prefill(after_prefill)
        if after_prefill is not None:
            after_prefill()
        decoding = [s for s in self._live.values() if s.ready and not s.done]
        if decoding:
            self._round(decoding)
        for slot, s in list(self._live.items()):
            if s.done:
                self._release(slot, s)
        self.rounds += 1
        return True

    def _admit(self) -> None:
        joining = []  # the waiting requests that get a slot this round, in their order
        while self._waiting and len(joining) < len(self._free):
            s = self._waiting.popleft()
            if s.run.stop.is_set():  # (BatchStream.cancel while waiting: no slot, no prefix given up)
                self._cancel(s)
            elif not s.done:  # (cancelled while waiting)
                joining.append(s)
        for s, slot, kept in self._match(joining):
            self._free.remove(slot)
            s.view = self.mc.seq(slot)
            s.dview = self.dmc.seq(slot) if self.dmc is not None else None
            for v in (s.view, s.dview):  # its own prompt's chunks stop at BatchStream.cancel (llama/abort.py)
                if v is not None:
                    v.abort_check = s.run.stop.is_set
            s.t_start = time.perf_counter()
            self._live[slot] = s  # (from here on released as any live sequence: a failure below ends it only)
            self._guard(s, lambda: self._join(s, slot, kept))

    def _join(self, s: _Seq, slot: int, kept: int) -> None:
        """A sequence takes its slot: the cells its prompt can keep, its drafter, its prompt to prefill."""
        prompt = s.run.tokens[:-1]
        s.view.truncate(kept)  # the prefix its previous sequence left, as far as it is exact
        kept = s.view.n_past  # (a recurrent state may keep less: llama/recurrent.py)
        self._prompt_len[slot] = len(prompt)
        if s.dview is not None:  # the draft's numerics never change strict output: any common prefix
            s.dview.truncate(common_prefix_len(s.dview.tokens, prompt))
        s.run.drafter = self.eng._make_drafter(s.run.cfg, s.run.seed, s.run.controls)
        if s.dview is not None and hasattr(s.run.drafter, "ctx"):
            s.run.drafter.ctx = s.dview
        s.pending = list(prompt[kept:])

    def _match(self, joining: list[_Seq]) -> list[tuple[_Seq, int, int]]:
        """A free slot for each joining sequence, and the prefix of its prompt the slot's cells
        give exactly: the pair that keeps the most first, whichever request came first (two
        requests arriving together each get the slot holding their own prefix), then of the
        pairs that keep as much (none, or only a system prompt every slot holds) the slot holding
        the fewest other tokens: what a slot holds is lost, and a long conversation kept there
        is what its client's next request would otherwise prefill again."""
        held = {slot: len(self.mc.seq(slot).tokens) for slot in self._free}
        pairs = []  # (-kept, tokens lost besides, arrival, slot): the best pair first
        for i, s in enumerate(joining):
            for slot in self._free:
                m = self._reuse(slot, s.run.tokens[:-1])
                pairs.append((-m, held[slot] - m, i, slot))
        pairs.sort()
        out, taken, used = [], set(), set()
        for neg_m, _, i, slot in pairs:  # (keys never change as pairs are taken: one sorted pass)
            if i not in taken and slot not in used:
                out.append((joining[i], slot, -neg_m))
                taken.add(i)
                used.add(slot)
        return out

    def _reuse(self, slot: int, prompt: list[int]) -> int:
        """How many of ``prompt``'s tokens slot ``slot``'s cells give exactly (llama.streams.exact_reuse)."""
        view = self.mc.seq(slot)
        if not view.tokens:
            return 0
        return view.reachable(exact_reuse(view.tokens, self._prompt_len[slot], prompt, self.mc.n_batch,
                                          self.mc.invariant_rows,
                                          wide_alike=self.wide_alike is True and not self.eng.target.offloaded))

    def _longest_prefix(self, prompt: list[int], slots, floor: int) -> tuple[int | None, int]:
        """Of ``slots``, the first whose cells give the longest exact prefix of ``prompt`` longer
        than ``floor``, and its length; (None, floor) when none does."""
        best, n = None, floor
        for slot in slots:
            m = self._reuse(slot, prompt)
            if m > n:
                best, n = slot, m
        return best, n

    def _prefill(self, on_first=None) -> None:
        """Joining sequences' prompts, about n_batch rows per round in all, each chunk in a decode
        of its own and cut where a lone run cuts it (every n_batch tokens from the start).
        A prompt whose prefill has begun goes on first (its wait stays bounded), then the
        shortest (the mean time to first token is least so; a lone run's chunks whatever the
        order); a chunk that does not fit what is left of the budget waits for the next round.
        ``on_first()`` after each first token a prefill gave."""
        nb = budget = self.mc.n_batch
        order = sorted(self._live.values(), key=lambda s: (s.run.stats.n_prompt_evaluated == 0, len(s.pending)))
        for s in order:
            rides, first = False, None
            while s.pending and not s.done and budget > 0:
                self._share_prefix(s)
                pos = s.view.n_past
                cut = min((pos // nb + 1) * nb - pos, len(s.pending))  # a lone run's chunk ends there
                if cut > budget and budget < nb:  # (the first chunk of a round goes whatever its size)
                    break
                chunk, s.pending = s.pending[:cut], s.pending[cut:]
                budget -= len(chunk)
                # the last chunk: the prompt's last token rides in it when that is exact
                # (llama.context.last_rides), and the first token is known at once
                rides = (not s.pending and last_rides(len(chunk), nb, self.mc.invariant_rows)
                         and s.view.n_past + len(chunk) < s.view.n_ctx)
                rb = s.view._rollback  # (a recurrent target's chunk leaves a checkpoint: without the last token)
                rides = rides and not (rb is not None and rb.saves(len(chunk)))
                t0 = time.perf_counter()
                first = self._guard(s, lambda: s.view.eval(chunk + [s.run.tokens[-1]] if rides else chunk,
                                                           n_out=1 if rides else 0))
                first = None if first is None else first.copy()
                if s.done:  # (the chunk failed: the sequence ended with its error)
                    break
                r = self._prefill_rate
                r[0], r[1] = 0.9 * r[0] + time.perf_counter() - t0, 0.9 * r[1] + len(chunk)
                s.run.stats.n_prompt_evaluated += len(chunk)
            if not s.pending and not s.done and not s.ready:
                s.run.stats.time_prompt_target_s = time.perf_counter() - s.t_start
                if s.dview is None or s.run.drafter.cheap:
                    # a draft model catches up in its first lockstep draft instead (nothing while k = 0)
                    self._guard(s, lambda: s.run.drafter.begin(s.run.tokens))
                s.run.stats.time_prompt_s = time.perf_counter() - s.t_start
                s.ready = True
                if rides and first is not None:  # a round without a draft on the prompt's last row
                    self._guard(s, lambda: self._finish_round(s, EMPTY_DRAFT, first, 0.0, 0.0, from_prompt=True))
                    if on_first is not None:  # out to its client before the next prompt's prefill
                        on_first()
            if budget <= 0:
                return

    def _share_prefix(self, s: _Seq) -> None:
        """Before prefilling, take the longest exact prefix another slot holds (a shared system
        prompt: the sequence prefilled before it in this round, or one that has left) when
        copying it costs less than prefilling the rows it saves."""
        prompt, have = s.run.tokens[:-1], s.view.n_past
        best, n = self._longest_prefix(prompt, (i for i in range(self.n_parallel) if i != s.view.seq_id), have)
        rate = self._prefill_rate[0] / self._prefill_rate[1] if self._prefill_rate[1] > 0 else 0.0
        if best is None or n - have < 8 or (n - have) * rate <= self._copy_s:
            return
        if self.eng.target.recurrent and n != self.mc.seq(best).n_past:
            return  # a recurrent state is copied whole (llama/recurrent.py)
        self.mc.copy_prefix(best, s.view.seq_id, n)
        s.pending = list(prompt[n:])
        if s.dview is not None:
            src = self.dmc.seq(best)
            m = common_prefix_len(src.tokens, prompt)
            if m > s.dview.n_past:
                self.dmc.copy_prefix(best, s.dview.seq_id, m)

    def _calibrate(self, view, last: int) -> None:
        """Time forwards of a few row counts once, on top of a sequence's cells (``view``, whose
        last token is ``last``; rolled back after each): the round's choice needs the cost
        curve.  Row counts an earlier process timed (:meth:`_load_learned`) are not timed
        again: on the F16 stand-in the four took 3.6 s of a server's first request."""
        for rows in self._untimed():
            if not self._time_views([(view, last)], rows, CALIBRATION_WEIGHT):
                break
        self.calibrated = True

    def _untimed(self) -> list[int]:
        """The calibration's row counts not timed yet (here, or by an earlier process)."""
        return [r for r in CALIBRATION_ROWS if r <= self.mc.max_rows and not self.cost.timed(r)]

    def _time_windows(self, seqs: list[_Seq], w: int, weight: float, times: int = 2) -> bool:
        """Time a forward of a window of ``w`` rows on top of each of ``seqs``' cells (each
        sequence's last token repeated; rolled back after each forward): a round's shape.  The
        first forward of a shape builds its graph (BatchCost.observe weighs it).  False where a
        context has no room for it."""
        return self._time_views([(s.view, s.run.tokens[-1]) for s in seqs], w, weight, times)

    def _time_views(self, views: list, w: int, weight: float, times: int = 2) -> bool:
        """:meth:`_time_windows` over (SeqView, last token) pairs."""
        if any(v.n_past + w >= v.n_ctx for v, _ in views):
            return False
        bases = [(v, v.n_past, list(v.tokens)) for v, _ in views]
        windows = [(v.seq_id, [last] * w) for v, last in views]
        try:
            for _ in range(times):
                t0 = time.perf_counter()
                self.mc.decode_windows(windows)
                self.cost.observe(len(views) * w, time.perf_counter() - t0, weight)
                for v, base, _ in bases:
                    v.truncate(base)
        finally:  # (also where a decode failed after others had added their rows)
            for v, base, held in bases:
                v.truncate(base)
                v.sync(held)  # a recurrent target's state, dropped by a rollback it cannot make, again
        return True

    def warm_up(self, config: GenerateConfig | None = None) -> float:
        """Time the target's forwards once before any request, where the first round that
        plans a draft length would do it inside a request (:meth:`_calibrate`): the first
        request of a server that is new on this machine then does not wait for it (2.7 s of
        its time to the first token on the Q4_K_M stand-in at 4 sequences, BENCHMARKS.md run
        35).  ``config``: the requests' default settings (the controller they get).  The forwards
        run on top of a short text in a free sequence slot, which is then emptied, so every
        sequence still starts as a lone run does.  Returns the seconds spent (0 where nothing
        needed timing: no draft-length controller, lone windows timed here before, a
        recurrent target, or requests already live).  Call it from the thread that decodes."""
        if self._live or self.eng.target.recurrent:
            return 0.0
        t0, probed = time.perf_counter(), self.wide_alike is None
        if probed:
            self.wide_alike = self._probe_wide()
            if self.wide_alike is not None:  # kept at once, beside what earlier processes learned
                self.eng.controllers.keep_batch_state({**(self.eng.controllers.batch_state() or {}),
                                                       "wide_alike": self.wide_alike})
                self.eng.controllers.save()
        spent = time.perf_counter() - t0 if probed else 0.0
        if self.calibrated:
            return spent
        ctrl = self.eng._controller(config if config is not None else GenerateConfig.make())
        if ctrl is None or ctrl.target_costs(1) is not None or not self._untimed():
            self.calibrated = ctrl is not None  # (as the first round would decide)
            return spent
        view = self.mc.seq(self._free[0])
        text = self.eng._prompt_tokens(WARM_UP_TEXT)[:WARM_UP_TOKENS]
        try:
            view.eval(text, n_out=0)
            self._calibrate(view, text[-1])
        finally:
            view.clear()
        return time.perf_counter() - t0

    def _probe_wide(self) -> bool | None:
        """Whether this target's chunks of more than the exact bound compute every row alike
        whatever their length (None: not measured): the last row of one chunk of 2 × bound + 8
        rows, against the same tokens in two chunks of more than the bound each, bit for bit.
        Measured on this Zen 4 for the F16, Q4_K_M (repacked) and Q4_1 models, with chunks of
        69–385 rows: every row alike (a chunk of <= 64 rows differs: other kernels).  Then a
        chat's next turn keeps its conversation's cells (llama.streams.exact_reuse).  Not
        measured (None) with the target on a GPU, nor where a chunk of that size does not fit."""
        inv, view = self.mc.invariant_rows, self.mc.seq(self._free[0])
        n = 2 * inv + 8
        if n + 1 > min(self.mc.n_batch, view.n_ctx) or self.eng.target.offloaded:
            return None  # (a GPU's kernels are chosen by shape, e.g. split-K: two lengths prove little)
        text = self.eng._prompt_tokens(WARM_UP_TEXT)
        toks = (text * (n // max(1, len(text)) + 1))[:n]
        try:
            view.clear()
            one = view.eval(toks, n_out=1)[0].copy()
            view.clear()
            view.eval(toks[:inv + 1], n_out=0)
            two = view.eval(toks[inv + 1:], n_out=1)[0].copy()
        except Exception:  # noqa: BLE001 - not measured: reuse stays as without it
            return None
        finally:
            view.clear()
        return bool(np.array_equal(one, two))

    def _probe_switch(self, seqs: list[_Seq], k_room: int) -> _Plan:
        """The round's plan (:meth:`_plan_costly`), its drafting shape timed first where a switch
        to drafting would pay a catch-up of the draft caches (the sequences joined, or rounds
        went by, while it was idle) and that shape (every sequence's window of k + 1 rows) was
        never timed here.  Untimed, the plan's cost of it is the lone curve scaled by the shapes
        timed, which a few slow lone samples can put far off: measured on the Xeon, a Q4_K_M
        stand-in's 4 windows of 4 rows took 0.51 s a forward where the plan said 0.18, so the
        plan kept drafting paying and every trial of it paid its catch-up (a second of the draft
        reading 4 prompts).  A forward of that shape costs a round's forward; its catch-up, at 4
        sequences or more, several rounds'.  Plain rounds' shape (one row a sequence) is timed
        first where it was not: drafting is weighed against it.  Three probes a round at most."""
        plan = self._plan_costly(seqs, k_room)
        if self._drafted_last or self.eng.target.offloaded:  # (a GPU: a forward of 16 rows costs one row's)
            return plan
        for _ in range(3):
            # plain rounds' shape first (what drafting is weighed against), then drafting's
            w = next((w for w in (1, plan.k_draft + 1) if not self.cost.timed(len(seqs) * w)), None)
            if (w is None or not any(self._lag(s) for s in seqs)
                    or not self.mode.peek(plan.k > 0, plan.switch_s, plan.measured, len(seqs))):
                break  # (every shape timed, no catch-up to pay, or a round that stays plain: no probe)
            try:
                if not self._time_windows(seqs, w, 1.0, times=1 if self.cost.first_weight else 2):
                    break
            except Exception:  # noqa: BLE001 - then the trial measures it (a failing decode fails the round)
                break
            plan = self._plan_costly(seqs, k_room)
        return plan

    def _calibrate_draft(self, seqs: list[_Seq]) -> None:
        """Time a draft model's decodes once, as part of the catch-up they are: a draft step (one
        row of every lagging sequence: its next missed token, logits out) and a catch-up of up to
        32 of one sequence's missed tokens.  The plan then knows what drafting and switching to
        it cost here, and a trial of drafting at a load where the plan says it cannot pay (whose
        catch-up of every live prompt costs seconds at 8 sequences) is not needed to find out."""
        lag = [s for s in seqs if self._lag(s)]  # (3 tokens behind at least: two steps leave one to catch up)
        if not lag:  # nothing to time yet (a later round will be): the plan stays unmeasured till then
            return
        self._draft_timed = True  # (set before the decodes: a failing one is not retried every round)
        clock = time.perf_counter
        try:
            for _ in range(2):  # the first decode of a new shape builds its graph: the second is timed
                t0 = clock()
                self.dmc.decode_windows([(s.dview.seq_id, [s.run.tokens[s.dview.n_past]]) for s in lag],
                                        max_rows=self.dmc.n_batch, last_only=True)
                dt = clock() - t0
            self.cost.observe_draft(len(lag), dt)
            s = max(lag, key=self._lag)
            n = min(32, self._lag(s))
            if not n:
                return
            t0 = clock()
            self.dmc.extend([(s.dview.seq_id, s.run.tokens[s.dview.n_past:s.dview.n_past + n])])
            c = self._catch
            c[0], c[1] = c[0] + clock() - t0, c[1] + n
        except Exception:  # noqa: BLE001 - then the plan keeps its priors (a trial will measure)
            pass

    def _round(self, seqs: list[_Seq]) -> None:
        clock = time.perf_counter
        caps = [(s, self._draft_cap(s)) for s in seqs]
        seqs = [s for s, cap in caps if cap is not None]
        if not seqs:
            return
        prior = next((s.run.ctrl for s in seqs if s.run.ctrl is not None), None)
        if not self.calibrated and prior is not None:
            if prior.target_costs(1) is None:  # no lone windows timed yet on this machine
                self._calibrate(seqs[0].view, seqs[0].run.tokens[-1])
            self.calibrated = True
        # every window within the model's exact bound; a round of more rows than that takes
        # several decodes (a GPU's 16), the plan knowing their cost (BatchCost.split_rows)
        k_room = max(0, min(MAX_INVARIANT_ROWS // len(seqs), self.mc.max_rows) - 1)
        costly = [s for s in seqs if not s.run.drafter.cheap and s.run.ctrl is not None]
        drafting = None
        if costly and k_room > 0:  # plan before a draft model drafts: pooled acceptance, draft cost per token
            if not self.cost.draft_measured and self.eng.drafter_kind == "model" and not self._draft_timed:
                self._calibrate_draft(seqs)
            plan = self._probe_switch(seqs, k_room)
            drafting = self.mode.choose(plan.k > 0, plan.switch_s, plan.measured, len(seqs))
            k_room = min(k_room, plan.k_draft if drafting else 0)
        caps = [cap for _, cap in caps if cap is not None]
        t_catch = self._draft_prompts(seqs) if k_room > 0 else 0.0
        before = sum(s.run.generated for s in seqs)
        t0 = clock()
        drafts = self._draft_all(seqs, [min(c, k_room) for c in caps])
        t_draft = clock() - t0
        self.cost.observe_draft(sum(len(d) for d in drafts), t_draft)
        # a round DraftOrNot chose to draft verifies a draft: k = 0 would pay the draft (and a draft
        # model's catch-up) and leave drafting's rate unmeasured, so the same trial would come again
        k = self._choose_k(seqs, drafts, k_room, k_min=1 if drafting else 0)
        windows = []
        for s, d in zip(seqs, drafts):
            toks = [s.run.tokens[-1]] + d.tokens[:k]
            # padding: computed, rolled back, never verified; never past the sequence's own
            # context (its draft stays within it; another's longer one must not push it over)
            toks += [toks[-1]] * (min(k + 1, s.view.n_ctx - s.view.n_past) - len(toks))
            windows.append((s.view.seq_id, toks))
        gaps = self._gap_windows(windows, k + 1, prior)
        self.last_k, self.last_rows = k, sum(len(w) for _, w in windows) + sum(len(w) for _, w, _ in gaps)
        t1 = clock()
        try:
            rows = self.mc.decode_windows(windows + [(slot, w) for slot, w, _ in gaps])[:len(windows)]
        finally:
            for slot, _, base in gaps:  # (computed, never read: rolled back at once)
                self.mc.seq(slot).truncate(base)
        t_target = clock() - t1
        self.cost.observe(self.last_rows, t_target)
        drafts = [_cut(d, k) for d in drafts]
        for s, d, z in zip(seqs, drafts, rows):
            self._guard(s, lambda: self._finish_round(s, d, z, t_target / len(seqs), t_draft / len(seqs)))
        if drafting is not None:
            # while drafting goes on, a catch-up is the draft model reading joining prompts: a cost
            # of drafting rounds like their draft steps (on a CPU at 8 sequences a sixth of their
            # time).  After plain rounds it is the price of the switch, which the plan prices
            # (switch_s) before DraftOrNot compares rates: not counted twice.
            steady = drafting and self._drafted_last
            self.mode.observe(drafting, sum(s.run.generated for s in seqs) - before,
                              clock() - t0 + (t_catch if steady else 0.0), len(seqs),
                              ceiling=sum(len(d) + 1 for d in drafts))
        self._drafted_last = bool(drafting)  # (a round that did not plan drafting did not draft either)

    def _gap_windows(self, windows: list, w: int, prior) -> list[tuple[int, list[int], int]]:
        """Windows of ``w`` rows for the slots between the round's sequences that it does not
        carry (free, or a prompt still being prefilled): ``(slot, tokens, n_past)``, computed in
        the round's decode and rolled back at once, where one decode of them all costs less than
        what llama.cpp does without them.  With a KV stream per sequence it puts only sequences
        of consecutive ids in one micro-batch, so the round of slots {0, 2, 4, 6, 7} was four
        forwards over all weights: 452 ms on the F16 stand-in where slots 0-4 took 223, and a
        server whose clients come and go, or a batch's tail, leaves its sequences in such slots
        (BENCHMARKS.md, run 42).  Not for a recurrent target (its state cannot go back over a
        window) nor an MTP or EAGLE-3 drafter (they keep each row's hidden state)."""
        slots = sorted(slot for slot, _ in windows)
        taken = set(slots)
        gaps = [g for g in range(slots[0], slots[-1] + 1) if g not in taken]
        if (not gaps or self.eng.target.recurrent or self.eng.drafter_kind in ("mtp", "eagle3")
                or (len(slots) + len(gaps)) * w > self.mc.max_rows):
            return []
        run_rows, n = [], 1  # the micro-batches without them: a run of consecutive slots each
        for a, b in zip(slots, slots[1:]):
            if b == a + 1:
                n += 1
            else:
                run_rows.append(n * w)
                n = 1
        run_rows.append(n * w)
        costs = self.cost.costs(prior, len(slots))
        if costs[(len(slots) + len(gaps)) * w - 1] >= sum(costs[r - 1] for r in run_rows):
            return []
        out = []
        for g in gaps:
            v = self.mc.seq(g)
            if v.n_past + w >= v.n_ctx:
                return []  # (no room to compute it: the round goes as it would)
            out.append((g, [v.tokens[-1] if v.tokens else windows[0][1][0]] * w, v.n_past))
        return out

    def _plan_costly(self, seqs: list[_Seq], k_room: int) -> _Plan:
        """The round's k before a draft model drafts, every sequence at its pooled acceptance
        (:func:`plan_drafting`, :class:`_Plan`): whether every input of the plan was measured
        here (the draft's cost, forward costs; acceptance learned anywhere) rather than a prior:
        a draft cost learned in other runs can be far off (a busy machine, another load) and,
        trusted, would keep the scheduler from ever measuring it."""
        ctrls = [s.run.ctrl for s in seqs]
        prior = next(c for c in ctrls if c is not None)
        accepts = [[c.acceptance(None)] * k_room if c is not None else [1.0] * k_room for c in ctrls]
        per_token = self.cost.draft_cost(prior.draft_cost)  # per draft token (draft decodes are per sequence)
        t, rows = self._catch
        row_s = t / rows if rows > 0 else per_token / 4  # (a prefill row: a fraction of a decode's)
        lags = [self._lag(s) for s in seqs]
        remaining = [s.run.cfg.max_tokens - s.run.generated if not s.run.cfg.unlimited
                     else s.view.n_ctx - len(s.run.tokens) for s in seqs]
        costs = self.cost.costs(prior, len(seqs))
        k, k_draft, switch_s = plan_drafting(accepts, costs, per_token, k_room, lags, remaining, row_s)
        # (the draft's cost is the scheduler's own, timed in its batched decodes: the controller's
        # timing of lone drafts, which batched rounds never update, is not asked for)
        measured = self.cost.draft_measured and self.calibrated
        if measured and not prior.acceptance_measured() and k == 0:
            # acceptance is the plan's one prior: where drafting would not pay even with every
            # draft token accepted, no acceptance makes it pay, and a trial would only pay its
            # catch-up (at 16 sequences on the Q4_K_M stand-in, 2.4 s: BENCHMARKS.md, run 39).
            # (The shapes are judged by the cost curve as it is: timing the widest first cost
            # more than the trials it saved, ~1 s a 64-row probe there)
            top = plan_drafting([[1.0] * k_room] * len(seqs), costs, per_token, k_room, lags, remaining, row_s)[0]
            return _Plan(k, k_draft, switch_s, top == 0)
        return _Plan(k, k_draft, switch_s, measured and prior.acceptance_measured())

    def _lag(self, s: _Seq) -> int:
        """Tokens a draft model's cache must catch up on before the sequence drafts (0: none
        beyond what a drafting round's first evaluation carries)."""
        if s.dview is None or s.run.drafter.cheap:
            return 0
        lag = len(s.run.tokens) - 1 - s.dview.n_past
        return lag if lag > 2 else 0

    def _draft_prompts(self, seqs: list[_Seq]) -> float:
        """A draft model's cache that lags by more than a drafting round leaves (its prompt: the
        draft prefills lazily, when drafting is first planned; or the tokens of rounds that did
        not draft) is brought up to date before the round's draft is timed: drafting's cost per
        token and its rounds' rate are those of drafting every round (the catch-up is the price
        of switching, paid once).  Every lagging sequence catches up in the same decodes (a
        unified draft cache), so a switch costs one prefill of the rows missed, not one per
        sequence.  Returns the seconds it took (0 when no cache lagged)."""
        lag = [s for s in seqs if self._lag(s)]
        if not lag:
            return 0.0
        t0 = time.perf_counter()
        missed = [self._lag(s) for s in lag]
        try:  # (every draft context is a unified cache: a draft model's, an MTP layer's, an EAGLE-3 head's)
            self.dmc.extend([(s.dview.seq_id, s.run.tokens[s.dview.n_past:-1]) for s in lag])
        except Exception:  # noqa: BLE001 - then each sequence alone, a failure ending it only
            for s in lag:
                self._guard(s, lambda: s.dview.eval(s.run.tokens[s.dview.n_past:-1], n_out=0))
        dt = time.perf_counter() - t0
        c = self._catch
        c[0], c[1] = 0.9 * c[0] + dt, 0.9 * c[1] + sum(missed)
        for s, n in zip(lag, missed):
            if not s.run.generated:  # the draft's prompt: a share of the prefill, by rows
                s.run.stats.time_prompt_s += dt * n / sum(missed)
        return dt

    def _draft_all(self, seqs: list[_Seq], caps: list[int]) -> list[Draft]:
        """Every sequence's draft: cheap drafters propose on their own; draft models draft in
        lockstep, one draft decode per step carrying one row of every sequence still drafting."""
        drafts: list[Draft] = []
        lockstep = []
        for i, (s, cap) in enumerate(zip(seqs, caps)):
            if s.dview is not None and not s.run.drafter.cheap:
                lockstep.append(i)
                drafts.append(EMPTY_DRAFT)
            else:
                d = self._guard(s, lambda: self._propose(s, cap))
                drafts.append(d if d is not None else EMPTY_DRAFT)
        if lockstep:
            got = draft_lockstep(self.dmc, [seqs[i] for i in lockstep], [caps[i] for i in lockstep], self._guard)
            for i, d in zip(lockstep, got):
                drafts[i] = d
        return drafts

    def _propose(self, s: _Seq, k_cap: int) -> Draft:
        """Up to k_cap draft tokens (the round's k cuts them)."""
        run = s.run
        if k_cap <= 0 or run.cfg.draft_max == 0:
            return EMPTY_DRAFT
        d = run.drafter.propose(run.tokens, k_cap)
        return d if len(d) >= max(run.cfg.draft_min, 1) else EMPTY_DRAFT

    def _choose_k(self, seqs: list[_Seq], drafts: list[Draft], k_room: int, k_min: int = 0) -> int:
        longest = max((len(d) for d in drafts), default=0)
        if longest == 0:
            return 0
        fixed = [s.run.ctrl is None for s in seqs]
        if all(fixed):  # no controller (--no-adaptive): every draft as proposed
            return min(longest, k_room)
        accepts = []
        for s, d in zip(seqs, drafts):
            ctrl = s.run.ctrl
            keys = d.keys if d.keys is not None else [None] * len(d)
            accepts.append([ctrl.acceptance(key) for key in keys] if ctrl is not None else [1.0] * len(d))
        prior = next((s.run.ctrl for s in seqs if s.run.ctrl is not None), None)
        return choose_window(accepts, self.cost.costs(prior, len(seqs)), min(longest, k_room), k_min)

    def _finish_round(self, s: _Seq, d: Draft, z: np.ndarray, t_target: float, t_draft: float,
                      from_prompt: bool = False) -> None:
        """Verify one sequence's rows ``z`` of the round's decode and emit its tokens;
        ``from_prompt``: the first token, from the prompt's last row (no round)."""
        run, eng = s.run, self.eng
        logits = z[: len(d) + 1]
        base = s.view.n_past - z.shape[0]  # == len(tokens) - 1
        if run.controls.active:
            run.controls.process_window(run.tokens, logits, d.tokens)
        run.logits = logits
        res = eng._verify(run, self._verify_window, logits, d)
        s.view.truncate(base + 1 + res.n_accepted)
        run.tokens.extend(res.tokens)
        run.drafter.observe(run.tokens, res.n_accepted)
        if s.dview is not None and s.dview.n_past >= len(run.tokens):
            # a draft cut by the round's k may have run past the new last token: the
            # draft cache holds a prefix of tokens[:-1] (the drafter's invariant)
            s.dview.truncate(len(run.tokens) - 1)
        stats = run.stats
        stats.time_target_s += t_target
        stats.time_draft_s += t_draft
        if run.ctrl is not None:
            keys = d.keys if d.keys is not None else [None] * len(d)
            for i in range(min(res.n_accepted + 1, len(d))):
                run.ctrl.observe_shadow(i < res.n_accepted, keys[i])
        chunk = s.run.emit(s.view, self.eng.target, None if from_prompt else len(d), res)
        if chunk is not None:
            s.chunks.append(chunk)
        if stats.stop_reason in ("eog", "stop", "length", "context"):
            self._end(s)

    # ------------------------------------------------- per-sequence steps
    @property
    def _k_limit(self) -> int:
        """The longest draft: windows within the invariant bound, and (a recurrent target) whose
        rejection its state can roll back (llama/recurrent.py)."""
        return min(self.mc.max_rows - 1, self.eng.target.rollback_depth or MAX_INVARIANT_ROWS)

    def _draft_cap(self, s: _Seq) -> int | None:
        cap = s.run.draft_cap(s.view, self._k_limit)
        if cap is None:
            self._end(s)
        return cap

    def _end(self, s: _Seq) -> None:
        """Finish a sequence: the text held back (stop strings, split characters), final stats."""
        if s.done:
            return
        run = s.run
        try:
            tail = run.tail()
            if tail is not None:
                s.chunks.append(tail)
        finally:
            run.controls.close()
            run.stats.time_total_s = time.perf_counter() - s.t_start if s.t_start else 0.0
            s.done = True
            if run.ctrl is not None and time.perf_counter() - self._saved_at > SAVE_EVERY_S:
                self._save_learned()

    def _load_learned(self) -> None:
        """Start from what an earlier Scheduler of these models learned here (:meth:`_save_learned`):
        the batched shapes it timed (no calibration or probe forwards for them) and what its
        draft model's catch-ups cost per token, each at a few forwards' weight (this process's
        own soon outweigh them).  The rates its drafting and plain rounds delivered are kept for
        ``mars doctor`` but not started from: measured on a Zen 4 (BENCHMARKS.md, run 31), a
        server that took them up at 4 sequences, where the two modes are within noise of each
        other, kept drafting from its first round and delivered 0.92x its plain rounds by median
        where one finding out afresh delivered 1.02x."""
        state = self.eng.controllers.batch_state()
        if not state:
            return
        if isinstance(state.get("wide_alike"), bool) and not self.eng.target.offloaded:  # (_probe_wide)
            self.wide_alike = state["wide_alike"]
        self.cost.import_state(state.get("cost") or {})
        if self.dmc is not None and self.eng.drafter_kind == "model":
            try:
                t, rows = (float(x) for x in state.get("catch") or ())
                if t > 0 and rows > 0:
                    f = min(1.0, CATCH_IMPORT_ROWS / rows)
                    self._catch = [t * f, rows * f]
            except (TypeError, ValueError):
                pass

    def _save_learned(self) -> None:
        """Keep what the controllers learned (acceptance, from every sequence's rounds) and what
        the batched rounds did (:meth:`_load_learned`) for the next process, as a lone Engine
        does after each generation: a server restarted, or the next ``mars batch``, starts from
        it instead of trying drafting to find it out.  At most every SAVE_EVERY_S seconds while
        sequences finish, and on close."""
        self._saved_at = time.perf_counter()
        if self.rounds or self.cost.observed():  # (warm_up may have timed forwards before any round)
            self.eng.controllers.keep_batch_state({"cost": self.cost.export_state(), "mode": self.mode.export_state(),
                                                   "catch": list(self._catch), "wide_alike": self.wide_alike})
        self.eng.controllers.save()

    def _guard(self, s: _Seq, fn):
        """Run one sequence's step; its failure ends that sequence only."""
        if s.done:
            return None
        try:
            return fn()
        except DecodeAborted:  # (cancelled inside its prompt's chunk: what it evaluated before stays)
            self._cancel(s)
            return None
        except Exception as exc:  # noqa: BLE001 - reported to that sequence's reader
            s.run.stats.stop_reason = "error"
            s.error = exc
            self._end(s)
            return None

    def _cancel(self, s: _Seq) -> None:
        if not s.done:
            s.run.stats.stop_reason = s.run.stats.stop_reason or "interrupted"
            self._end(s)
        s.chunks.clear()
        for slot, live in list(self._live.items()):
            if live is s:
                self._release(slot, s)

    def _release(self, slot: int, s: _Seq) -> None:
        """Free the slot; its cells stay for the next sequence's prefix (after an error: cleared)."""
        if self._live.get(slot) is s:
            del self._live[slot]
            for v in (s.view, s.dview):
                if v is not None:
                    v.abort_check = None
            if s.error is not None:
                s.view.clear()
                if s.dview is not None:
                    s.dview.clear()
            else:  # committed tokens only (never a padded or unverified row)
                s.view.truncate(max(0, len(s.run.tokens) - 1))
                if s.dview is not None:
                    s.dview.truncate(min(s.dview.n_past, max(0, len(s.run.tokens) - 1)))
            self._free.append(slot)

    def close(self) -> None:
        for s in list(self._waiting) + list(self._live.values()):
            self._cancel(s)
        self._save_learned()  # (nothing is written where no controller was made)
        for mc in (self.mc, self.dmc):
            if mc is not None:
                mc.close()


def _cut(d: Draft, k: int) -> Draft:
    if len(d) <= k:
        return d
    if k == 0:
        return EMPTY_DRAFT
    return Draft(d.tokens[:k], d.probs[:k] if d.probs is not None else None,
                 d.keys[:k] if d.keys is not None else None)

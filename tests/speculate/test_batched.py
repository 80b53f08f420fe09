"""Many sequences at once (speculate/batched.py, llama/streams.py): exactness whatever shares
the batch, joins and leaves, isolation of per-request settings, and the round's load-aware k."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from mars_local import Engine
from mars_local.llama.context import MAX_INVARIANT_ROWS, Context, last_rides
from mars_local.core.errors import MarsError
from mars_local.llama.runtime import GPU_INVARIANT_ROWS, Model, invariant_rows
from mars_local.llama.streams import MultiContext, exact_reuse
from mars_local.speculate.adaptive import POOL
from mars_local.speculate.batch_cost import (CALIBRATION_WEIGHT, PLAN_MARGIN, BatchCost, DraftOrNot, choose_window,
                                              drop_strays, isotonic, plan_drafting)
from mars_local.speculate.batched import Scheduler

PROMPTS = [f"item {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 4) + "and" * (i % 3)
           for i in range(8)]


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_draft):
    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=512, n_threads=2, learned=False) as m, \
            Engine(tiny_target, drafter="ngram", n_ctx=512, n_threads=2, learned=False) as g:
        yield {"model": m, "ngram": g}


def plain(eng, prompt, n):
    return eng.generate(prompt, max_tokens=n, temperature=0, draft_max=0, ignore_eos=True).tokens


# --------------------------------------------------------- the round's k (pure)
@pytest.mark.parametrize("accepts, slope, k_max, expect", [
    ([[0.9] * 8], 0.1, 8, 8),                 # one sequence, cheap rows, good drafts: draft all
    ([[0.05] * 8], 0.5, 8, 0),                # bad drafts: plain decoding
    ([[0.8] * 8] * 8, 1.0, 7, 0),             # 8 sequences on compute-bound rows: plain batched decoding
    ([[0.8] * 8] * 2, 0.05, 8, 6),            # 2 sequences on a GPU-like curve: long windows (7 rows each)
    ([[0.9] * 2, [0.9] * 2], 0.1, 8, 2),      # drafts of 2 tokens: a longer window gains nothing
    ([[], []], 0.0, 8, 0),                    # nothing drafted
])
def test_choose_window(accepts, slope, k_max, expect):
    costs = [1.0 + slope * (r - 1) for r in range(1, 65)]
    assert choose_window(accepts, costs, k_max) == expect


@pytest.mark.parametrize("accepts, slope, k_max, expect", [
    ([[0.05] * 8], 0.5, 8, 1),                # bad drafts: the shortest draft, not none
    ([[0.8] * 8] * 8, 1.0, 7, 1),             # compute-bound rows: one draft token each
    ([[0.9] * 8], 0.1, 8, 8),                 # where drafting pays, the floor changes nothing
])
def test_choose_window_with_a_floor_of_one_draft_token(accepts, slope, k_max, expect):
    """A round DraftOrNot chose to draft (a trial of drafting) verifies at least one draft token."""
    costs = [1.0 + slope * (r - 1) for r in range(1, 65)]
    assert choose_window(accepts, costs, k_max, k_min=1) == expect


def test_a_round_chosen_to_draft_verifies_a_draft_even_where_the_cost_model_says_plain(engines):
    """DraftOrNot's trials of drafting must measure drafting: where the plan prefers plain rounds,
    a round it chose to draft used to draft (a draft model catching up first) and then verify
    nothing (k = 0), so drafting's rate was never measured and the wasted trial came back."""
    eng = engines["model"]
    sched = Scheduler(eng, 2)
    try:
        sched.calibrated = True
        sched.cost.costs = lambda prior=None, n_seqs=None: [1.0 + 2.0 * (r - 1) for r in range(1, 65)]  # rows dear: k = 0
        sched.mode.choose = lambda planned, *_: True  # every round a trial of drafting
        ks = []
        step = sched.step

        def recording_step(*a, **kw):
            sched.last_k = -1
            out = step(*a, **kw)
            if sched.last_k >= 0:
                ks.append(sched.last_k)
            return out

        sched.step = recording_step
        outs = sched.generate_many(PROMPTS[:2], max_tokens=12, temperature=0, ignore_eos=True, verify="strict")
    finally:
        sched.close()
    # (the last round has one token left to generate: no room for a draft)
    assert len(ks) > 2 and all(k >= 1 for k in ks[:-1]), str(ks)
    assert sum(o.stats.n_drafted for o in outs) > 0
    for p, o in zip(PROMPTS[:2], outs):  # and strict greedy stays exact
        assert o.tokens == plain(eng, p, 12)


def test_the_round_shrinks_k_as_sequences_join():
    costs = [1.0 + 0.25 * (r - 1) for r in range(1, 65)]  # a 2-core CPU: 8 rows cost ~3 rows
    ks = [choose_window([[0.7] * 8] * n, costs, 63 // n) for n in (1, 2, 4, 8, 16)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1] and ks[-1] == 0, ks


def test_batch_cost_interpolates_between_timed_row_counts():
    c = BatchCost(max_rows=8)
    for rows, t in ((2, 0.2), (2, 0.2), (6, 0.6), (6, 0.6)):  # the first of each shape is not timed
        c.observe(rows, t)
    got = c.costs()
    assert got[1] == pytest.approx(0.2) and got[5] == pytest.approx(0.6) and got[3] == pytest.approx(0.4)


def test_draft_or_not_follows_the_rates_rounds_delivered_and_keeps_trying_the_other():
    from mars_local.speculate.batch_cost import DraftOrNot

    m = DraftOrNot(explore=4)
    assert m.choose(False) is False and m.choose(True) is True  # nothing measured: the plan
    for _ in range(3):
        m.observe(True, 60, 1.0)   # drafting rounds: 60 tok/s
        m.observe(False, 45, 1.0)  # plain rounds: 45 tok/s
    picks = [m.choose(False) for _ in range(10)]  # the plan says plain; the rates say draft
    assert picks.count(True) >= 7 and False in picks  # mostly drafting, plain tried now and then
    for _ in range(20):
        m.observe(False, 90, 1.0)  # the load changed: plain rounds now deliver more
    assert [m.choose(True) for _ in range(5)].count(False) >= 3


def test_draft_or_not_tries_drafting_again_only_while_the_plan_says_it_pays():
    """Once drafting was measured and lost, a trial of it (a draft model catching up with every
    sequence) comes back only while the plan says drafting pays; a trial of plain rounds, which
    costs nothing to switch to, comes back whatever the plan says."""
    from mars_local.speculate.batch_cost import DraftOrNot

    m = DraftOrNot(explore=4)
    assert [m.choose(False) for _ in range(5)] == [False] * 4 + [True]  # never measured: tried once
    for _ in range(3):
        m.observe(True, 30, 1.0)   # drafting rounds: 30 tok/s
        m.observe(False, 45, 1.0)  # plain rounds: 45 tok/s
    assert True not in [m.choose(False) for _ in range(100)]  # the plan and the rates agree: no trials
    picks = [m.choose(True) for _ in range(40)]  # the plan says drafting pays now (e.g. the load fell)
    assert 1 <= picks.count(True) <= 4, picks  # tried, the rates still say plain: rarely
    for _ in range(3):
        m.observe(True, 90, 1.0)  # and drafting did pay
    assert [m.choose(False) for _ in range(10)].count(True) >= 7  # drafting, plain tried now and then
    assert False in [m.choose(False) for _ in range(40)]


@pytest.mark.parametrize("planned", [True, False])
def test_draft_or_not_keeps_its_mode_near_the_break_even(planned):
    """Drafting rounds 5 % better: below the 10 % a switch to drafting needs (a draft model's
    catch-up on every sequence), above the 3 % that keeps it; so whichever mode runs, stays."""
    from mars_local.speculate.batch_cost import DraftOrNot

    for start in (False, True):
        m = DraftOrNot(explore=1000, explore_plain=1000)
        m.choose(start)  # the plan's first word sets the mode
        for _ in range(3):
            m.observe(True, 42, 1.0)
            m.observe(False, 40, 1.0)
        assert [m.choose(planned) for _ in range(20)] == [start] * 20


class LonePrior:
    """A controller's lone window costs (AdaptiveK.target_costs): a concave CPU-like curve."""

    def target_costs(self, w_max):
        return [0.05 * r ** 0.6 for r in range(1, w_max + 1)]


def test_batch_cost_takes_the_lone_curves_shape_scaled_to_the_forwards_timed():
    c = BatchCost(max_rows=64)
    lone = LonePrior().target_costs(64)
    assert c.costs(LonePrior()) == lone  # nothing timed yet: the lone curve
    for rows, t in ((8, 0.0), (8, 2 * lone[7]), (32, 0.0), (32, 3 * lone[31])):
        c.observe(rows, t)
    got = c.costs(LonePrior())
    assert got[7] == pytest.approx(2 * lone[7]) and got[31] == pytest.approx(3 * lone[31])
    assert got[3] == pytest.approx(2 * lone[3]) and got[63] == pytest.approx(3 * lone[63])  # ratio held outside
    assert got[15] == pytest.approx(lone[15] * (2 + (16 - 8) / (32 - 8)))  # and interpolated between


def test_one_slow_forward_makes_no_wider_forward_look_cheaper():
    """A stall on the first timed forward of 3 rows (all the plan knows of that size): wider
    forwards, scaled from other sizes, must not look cheaper than it (the plan would draft at
    6 rows to flee a 3-row cost that is noise), and the sizes timed as often as it pull it
    down (their weighted mean); a later stall counts at 1.5x the mean."""
    c = BatchCost(max_rows=64)
    lone = LonePrior().target_costs(64)
    for rows in (1, 4, 16, 64):  # the calibration: a ratio of 1 to the lone curve
        c.observe(rows, 0.0)
        c.observe(rows, lone[rows - 1])
    c.observe(3, 0.0)
    c.observe(3, 30 * lone[2])  # one forward of 3 rows on a busy machine
    got = c.costs(LonePrior())
    assert lone[2] < got[2] < 30 * lone[2]
    assert all(b >= a for a, b in zip(got, got[1:])) and got[5] >= got[2]
    c2 = BatchCost(max_rows=8)
    c2.observe(2, 0.0)
    c2.observe(2, 0.1)
    c2.observe(2, 10.0)  # a stall
    t, n = c2._time[2]
    assert t / n == pytest.approx((0.1 * c2.decay + 0.15) / (c2.decay + 1))


@pytest.mark.parametrize("timed, kept", [
    # a first forward (weight < 1) above its wider neighbour's cost: a stall, left out
    ([(4, 0.097, 3.0), (5, 0.329, 0.5), (6, 0.181, 3.0), (8, 0.174, 3.0)], [4, 6, 8]),
    # below its narrower neighbour's: left out too
    ([(2, 0.10, 3.0), (3, 0.05, 0.5), (4, 0.12, 3.0)], [2, 4]),
    # between them: kept
    ([(4, 0.097, 3.0), (5, 0.14, 0.5), (8, 0.174, 3.0)], [4, 5, 8]),
    # timed once or more: kept whatever it says (isotonic pools it)
    ([(4, 0.097, 3.0), (5, 0.329, 1.0), (8, 0.174, 3.0)], [4, 5, 8]),
    # not between two sizes timed once or more: kept (nothing to contradict it)
    ([(1, 0.073, 0.5), (4, 0.097, 0.5), (8, 0.035, 3.0), (16, 0.044, 3.0)], [1, 4, 8, 16]),
    ([(8, 0.1, 3.0), (16, 0.2, 3.0), (24, 0.9, 0.5)], [8, 16, 24]),
    ([(8, 0.1, 3.0), (9, 0.9, 0.5)], [8, 9]),
])
def test_a_size_timed_less_than_once_is_left_out_where_its_neighbours_contradict_it(timed, kept):
    assert [r for r, _, _ in drop_strays(timed)] == kept


def test_one_stray_first_forward_kept_from_an_earlier_process_does_not_raise_its_neighbours():
    """The Zen 4's learned F16 state: 4, 6, 7 and 8 rows timed in many rounds, 5 rows once, a
    first forward at 329 ms (half weight).  Pooled, it held 5-8 rows at 193 ms, where a 5-row
    forward costs ~140: now 5 rows are interpolated between 4 and 6, and 6-8 keep their own fit.
    The build before fails it: 0.193 for 5 rows."""
    c = BatchCost(max_rows=16, first_weight=0.5)
    c.import_state({"time": {"4": [0.0967 * 3, 3.0], "5": [0.3294 * 0.5, 0.5], "6": [0.181 * 3, 3.0],
                             "7": [0.2008 * 3, 3.0], "8": [0.1738 * 3, 3.0]}})
    got = c.costs()
    assert got[4] == pytest.approx((0.0967 + 0.181) / 2)  # 5 rows: between 4 and 6
    assert got[5] == pytest.approx(0.181)
    assert got[6] == got[7] == pytest.approx((0.2008 + 0.1738) / 2)  # 7 and 8 pooled, as before
    assert c.timed(5)  # still timed: no probe of it comes back


@pytest.mark.parametrize("values, weights, want", [
    ([1, 2, 3], [1, 1, 1], [1, 2, 3]),  # already non-decreasing: kept
    ([3, 1], [1, 1], [2, 2]),  # a violation: the mean
    ([3, 1], [1, 3], [1.5, 1.5]),  # weighted
    ([5, 1, 1, 4], [1, 1, 2, 1], [2, 2, 2, 4]),  # pooled back until it holds
    ([2, 1, 3, 2], [1, 1, 1, 1], [1.5, 1.5, 2.5, 2.5]),
    ([], [], []),
])
def test_isotonic_is_the_weighted_pool_of_adjacent_violators(values, weights, want):
    assert isotonic(values, weights) == pytest.approx(want)


def test_slow_calibration_forwards_do_not_keep_often_timed_wider_ones_dear():
    """The H200's serving profile: calibration timed 1 and 4 rows at 73 and 97 ms (the first
    forwards of those shapes), rounds then timed 8 rows at 35 ms and 16 at 44 ms, again and
    again.  A running maximum held 8 and 16 rows at 97 ms (plain rounds looked 2.8x dearer than
    they were, and the plan drafted 64-row rounds); the weighted fit keeps them near what the
    rounds paid."""
    c = BatchCost(max_rows=64, split_rows=16)
    for rows, ms in ((1, 73.0), (4, 97.0)):
        c.observe(rows, 0.0, CALIBRATION_WEIGHT)
        c.observe(rows, ms / 1e3, CALIBRATION_WEIGHT)
    for rows, ms in ((8, 34.6), (16, 44.1)):
        c.observe(rows, 0.0)
        for _ in range(4):
            c.observe(rows, ms / 1e3)
    got = c.costs(n_seqs=8)
    assert all(b >= a for a, b in zip(got, got[1:]))
    assert got[7] < 0.050 and got[15] < 0.050  # was 0.097
    plan = plan_drafting([[0.9] * 7] * 8, got, per_token=0.9e-3, k_room=7)
    assert plan[0] == 1  # a window of 2 rows a sequence: 16 rows, one decode (was 7: four decodes)


def test_a_forward_beyond_the_split_costs_its_whole_decodes():
    """A GPU's exact bound (16 rows a decode): a round of more rows is several decodes, and the
    plan prices it so where it was not timed; a size that was timed keeps its own cost."""
    c = BatchCost(max_rows=64, split_rows=16)
    for rows, t in ((1, 1.0), (4, 1.2), (16, 2.0), (40, 4.5)):
        c.observe(rows, 0.0)  # (the first of each shape is not timed)
        c.observe(rows, t)
    got = c.costs()
    assert got[15] == pytest.approx(2.0) and got[16] == pytest.approx(2.0 + 1.0)  # 16 + 1 row
    assert got[31] == pytest.approx(4.0) and got[35] == pytest.approx(4.0 + 1.2)  # 2 x 16, 2 x 16 + 4
    assert got[39] == pytest.approx(max(4.5, got[38]))  # timed (running maximum still holds)
    assert got[63] == pytest.approx(8.0)
    line = lambda r: 1.2 + (r - 4) * 0.8 / 12  # noqa: E731 - one decode of r rows: the line through 4 and 16
    # what the plan asks for: n windows of w rows, whole windows a decode (decode_windows packs so)
    assert c.costs(n_seqs=4)[35] == pytest.approx(4 * line(9))  # 4 windows of 9: one a decode
    assert c.costs(n_seqs=3)[26] == pytest.approx(3 * line(9))
    assert c.costs(n_seqs=5)[29] == pytest.approx(2 * line(12) + line(6))  # 2 + 2 + 1 windows of 6
    assert c.costs(n_seqs=8)[31] == pytest.approx(4.0)  # 8 windows of 4: two full decodes of 16
    assert c.costs(n_seqs=8)[39] == pytest.approx(max(4.5, c.costs(n_seqs=8)[38]))  # timed: as it ran
    plain = BatchCost(max_rows=64)
    for rows, t in ((1, 1.0), (4, 1.2), (16, 2.0)):
        plain.observe(rows, 0.0)
        plain.observe(rows, t)
    assert plain.costs()[31] == pytest.approx(2.0 + 16 * (0.8 / 12))  # one decode: the line through 4, 16


def test_invariant_rows_bound_a_gpu_placement_only_when_decoding_exactly():
    assert invariant_rows(offloaded=True, exact_kernels=True) == GPU_INVARIANT_ROWS == 16
    assert invariant_rows(offloaded=True, exact_kernels=False) == MAX_INVARIANT_ROWS  # --fast-kernels
    assert invariant_rows(offloaded=False, exact_kernels=True) == MAX_INVARIANT_ROWS  # our CPU kernels
    assert invariant_rows(offloaded=False, exact_kernels=False) == MAX_INVARIANT_ROWS


def test_a_target_with_a_small_exact_bound_decodes_every_round_within_it(tiny_target, tiny_draft):
    """What a GPU's bound does, on the CPU with a bound of 4 rows: every target decode of the
    scheduler (windows, calibration) and every lone verify window stays within it, rounds of
    more rows are split into several decodes, and strict greedy still equals plain greedy."""
    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=512, n_threads=2, learned=False) as eng:
        want = [plain(eng, p, 20) for p in PROMPTS[:3]]
        eng.target.invariant_rows = 4
        assert eng._k_limit == 3
        lone = eng.generate(PROMPTS[0], max_tokens=20, temperature=0, verify="strict", draft_max=8,
                            adaptive=False, ignore_eos=True)
        assert lone.tokens == want[0] and 0 < lone.stats.n_drafted <= 3 * lone.stats.n_rounds
        sch = Scheduler(eng, 3)
        assert sch.cost.split_rows == 4 and sch._k_limit == 3
        sch.mode.choose = lambda planned, *_: True  # every round drafts (exactness of verified drafts)
        rows, asked, inside = [], [], [False]
        real_decode, real_windows = sch.mc._decode, sch.mc.decode_windows

        def decode(parts):  # a llama_decode call: its rows, when it evaluates windows
            if inside[0]:
                rows.append(sum(len(t) for _, t, _ in parts))
            return real_decode(parts)

        def windows(ws, *a, **kw):  # what a round (or the calibration) asks for at once
            asked.append(sum(len(t) for _, t in ws))
            inside[0] = True
            try:
                return real_windows(ws, *a, **kw)
            finally:
                inside[0] = False

        sch.mc._decode, sch.mc.decode_windows = decode, windows
        try:
            streams = [sch.submit(p, max_tokens=20, temperature=0, verify="strict", ignore_eos=True)
                       for p in PROMPTS[:3]]
            got = [[t for c in st for t in c.tokens] for st in streams]
        finally:
            sch.close()
    assert got == want
    assert sum(st.stats.n_drafted for st in streams) > 0
    assert max(asked) > 4  # rounds of more rows than the bound happened...
    assert rows and max(rows) <= 4  # ...and no decode of windows carried more than it


# ------------------------------------------- exact reuse of the cells a slot keeps (pure)
def toks(n, start=0):
    return list(range(start, start + n))


@pytest.mark.parametrize("cached, old_prompt, new, expect", [
    (toks(60), 39, toks(39) + [999], 39),           # short prompts: every row invariant, the common prefix
    (toks(60), 30, toks(55) + [999] * 5, 55),       # old rows past its prompt came from windows: invariant too
    (toks(100), 100, toks(100), 100),                # the same chunk of > 64 rows, same tokens
    (toks(120), 120, toks(90) + [999] * 10, 0),      # chunks of > 64 rows that end elsewhere: not the same rows
    (toks(120), 120, toks(40) + [999] * 10, 0),      # a new chunk of <= 64 rows, old rows from one of > 64
    (toks(80), 30, toks(60) + [999] * 10, 0),        # a new chunk of 70 rows (> 64) over invariant old rows
    (toks(600), 600, toks(550) + [999] * 50, 512),   # whole n_batch chunks kept, the differing one not
    (toks(600), 600, toks(530) + [999] * 10, 512),   # a new last chunk of 28 rows over an old one of 88
    ([], 0, toks(10), 0),
])
def test_exact_reuse_keeps_only_rows_computed_by_the_same_kernels(cached, old_prompt, new, expect):
    assert exact_reuse(cached, old_prompt, new, 512) == expect
    if expect == 0 or len(new) <= 64:  # (wide_alike changes only what wide chunks keep)
        return
    assert exact_reuse(cached, old_prompt, new, 512, wide_alike=True) >= expect


@pytest.mark.parametrize("cached, old_prompt, new, expect", [
    # a chat's next turn: the old prompt (276, one wide chunk) and its answer (windows), then more:
    # the old prompt's rows but the last 65, computed again with the new tokens in a wide decode
    (toks(300), 276, toks(300) + [999] * 45, 276),      # a 345-row chunk: 276 kept, 69 rows again
    (toks(300), 276, toks(290) + [999] * 10, 235),      # a 300-row chunk: 235 kept, 65 again
    (toks(120), 120, toks(90) + [999] * 10, 35),         # chunks of > 64 rows that end elsewhere
    (toks(600), 600, toks(600) + [999] * 10, 545),       # a whole chunk, then 98 rows: 33 of them kept
    (toks(120), 120, toks(40) + [999] * 10, 0),          # a new chunk of <= 64 rows: not from a wide one
    (toks(80), 30, toks(60) + [999] * 10, 0),            # a new wide chunk over invariant old rows
    (toks(300), 276, toks(276) + [999] * 10, 221),       # 10 new tokens: 65 rows again (a wide decode)
])
def test_exact_reuse_of_wide_chunks_where_they_compute_rows_alike(cached, old_prompt, new, expect):
    """``wide_alike`` (measured per model): rows of a wide chunk (> 64 rows) are kept from any wide
    chunk, the new chunk's last 65 rows at least computed again so that its decode stays wide."""
    got = exact_reuse(cached, old_prompt, new, 512, wide_alike=True)
    assert got == expect
    assert exact_reuse(cached, old_prompt, new, 512, wide_alike=False) <= got


# ---------------------- the prompt's last token rides in its last chunk (pure), the first token at once
@pytest.mark.parametrize("n_rest, n_batch, expect", [
    (0, 512, False),    # nothing to evaluate (the whole prompt was cached): no chunk to ride in
    (1, 512, True),
    (63, 512, True),    # 63 + 1 rows: still computed as lone rows
    (64, 512, False),   # 65 rows would take other kernels than the lone run's
    (100, 512, False),
    (522, 512, True),   # a whole chunk of 512, then a last chunk of 10
    (1024, 512, False),  # the last chunk is a whole one of 512
    (127, 64, True),    # chunks of 64 and 63
    (8, 8, False),      # 8 + 1 tokens would be one decode of more than n_batch (llama.cpp aborts)
    (15, 8, True),      # chunks of 8 and 7, the last token riding in the second
    (128, 64, False),
])
def test_the_last_token_rides_only_where_every_row_stays_a_lone_row(n_rest, n_batch, expect):
    assert MAX_INVARIANT_ROWS == 64
    assert last_rides(n_rest, n_batch) is expect


def test_a_short_prompt_joining_with_a_long_one_has_its_first_token_before_the_long_prefill(engines):
    """Two prompts join at once: the shorter is prefilled first and its first token handed out
    (after_prefill) before the longer one's prefill starts; both stay exact."""
    eng = engines["ngram"]
    long_p, short_p = PROMPTS[3] * 2, PROMPTS[0]
    assert len(eng.tokenize(long_p)) > 3 * len(eng.tokenize(short_p))
    want = [plain(eng, p, 6) for p in (long_p, short_p)]
    sch = Scheduler(eng, 2)
    try:
        a = sch.submit(long_p, max_tokens=6, temperature=0, verify="strict", ignore_eos=True)  # slot 0
        b = sch.submit(short_p, max_tokens=6, temperature=0, verify="strict", ignore_eos=True)
        seen = []
        sch.step(after_prefill=lambda: seen.append((len(a._seq.chunks), len(b._seq.chunks), a._seq.ready)))
        assert seen[0] == (0, 1, False)  # b's first token out while a's prompt waits
        assert seen[-1] == (0, 1, True)  # then a's prefill, before the round (its first token comes
        # from the round: its last chunk is over 64 rows, where the last token cannot ride)
        got = [[t for c in st for t in c.tokens] for st in (a, b)]
    finally:
        sch.close()
    assert got == want


def test_prefill_takes_about_n_batch_rows_a_round_and_a_begun_prompt_goes_on_first(tiny_target):
    """n_batch 64, prompts of ~20, ~30 and ~150 tokens joining at once: the two short ones are
    prefilled in the first round and the long one's first chunk (64 rows, more than is left)
    waits; from then on the begun long prompt goes first; no round prefills more than 64 rows
    (one lone-run chunk may fill a round alone); every output equals plain greedy alone."""
    with Engine(tiny_target, drafter="none", n_ctx=512, n_batch=64, n_threads=2, learned=False) as eng:
        prompts = [(eng.tokenize(PROMPTS[3]) * 5)[:150], eng.tokenize(PROMPTS[1])[:20], eng.tokenize(PROMPTS[2])[:30]]
        want = [plain(eng, p, 4) for p in prompts]
        sch = Scheduler(eng, 3)
        try:
            streams = [sch.submit(p, max_tokens=4, temperature=0, ignore_eos=True) for p in prompts]
            per_round, before = [], 0
            while any(not st._seq.done for st in streams):
                sch.step()
                now = sum(st.stats.n_prompt_evaluated for st in streams)
                per_round.append(now - before)
                before = now
            got = [[t for c in st for t in c.tokens] for st in streams]
            evaluated = [st.stats.n_prompt_evaluated for st in streams]
        finally:
            sch.close()
    assert got == want
    assert per_round[0] == evaluated[1] + evaluated[2] and all(r <= 64 for r in per_round), per_round
    assert sum(per_round) == sum(evaluated)


def test_a_short_prompt_joining_later_does_not_hold_back_a_begun_long_one(tiny_target):
    """A long prompt whose prefill has begun keeps its chunk a round when a short one joins
    (shortest-first alone would let a stream of short joiners starve it)."""
    with Engine(tiny_target, drafter="none", n_ctx=512, n_batch=64, n_threads=2, learned=False) as eng:
        long_p, short_p = (eng.tokenize(PROMPTS[3]) * 5)[:200], eng.tokenize(PROMPTS[1])[:20]
        sch = Scheduler(eng, 2)
        try:
            a = sch.submit(long_p, max_tokens=2, temperature=0, ignore_eos=True)
            sch.step()
            assert a.stats.n_prompt_evaluated == 64
            b = sch.submit(short_p, max_tokens=2, temperature=0, ignore_eos=True)
            sch.step()
            assert (a.stats.n_prompt_evaluated, b.stats.n_prompt_evaluated) == (128, 0)
            outs = [[t for c in st for t in c.tokens] for st in (a, b)]
        finally:
            sch.close()
        assert outs == [plain(eng, long_p, 2), plain(eng, short_p, 2)]


def test_rounds_of_more_rows_than_n_batch_are_split_not_aborted(tiny_target, tiny_draft):
    """n_batch 8 (the Python API's), 4 sequences drafting: a round of 4 windows of up to 8 rows
    is more than one llama_decode may take (llama.cpp aborts the process on it): it is split
    into decodes of at most 8 rows, prompts' last tokens ride only within 8, output exact."""
    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=512, n_batch=8, n_threads=2, learned=False) as eng:
        want = [plain(eng, p, 12) for p in PROMPTS[:4]]
        sch = Scheduler(eng, 4)
        assert sch.mc.max_rows == 8 and sch._k_limit == 7 and sch.cost.split_rows == 8
        sch.mode.choose = lambda planned, *_: True  # every round drafts
        try:
            outs = sch.generate_many(PROMPTS[:4], max_tokens=12, temperature=0, ignore_eos=True, verify="strict")
        finally:
            sch.close()
    assert [o.tokens for o in outs] == want
    assert sum(o.stats.n_drafted for o in outs) > 0


def test_a_joining_sequence_has_its_first_token_before_the_round(engines):
    """The first token is sampled from the prompt's own last row, handed out between the prefill
    and the round (where a server delivers it: time to first token), and the rest stays exact."""
    eng = engines["model"]
    want = plain(eng, PROMPTS[4], 12)
    sch = Scheduler(eng, 2)
    try:
        st = sch.submit(PROMPTS[4], max_tokens=12, temperature=0, verify="strict", ignore_eos=True)
        seen = []
        sch.step(after_prefill=lambda: seen.append((list(st.take()), st.stats.n_rounds)))
        assert [(t, n) for chunks, n in seen for c in chunks for t in c.tokens] == [(want[0], 0)]
        assert st.stats.first_from_prompt
        got = want[:1] + [t for c in st for t in c.tokens]
    finally:
        sch.close()
    assert got == want


def test_a_slot_keeps_its_prefix_for_the_next_sequence_and_stays_exact(engines):
    """A finished sequence's cells stay in its slot, and a sequence joining with one that shares
    its beginning copies that prefix: each prefills only the rest, and its strict greedy tokens
    still equal a fresh lone run's."""
    eng = engines["model"]
    system = "system: be brief. user: "
    prompts = [system + q for q in ("name a colour", "count to three", "say hello", "name a fruit")]
    want = [plain(eng, p, 20) for p in prompts]
    sch = Scheduler(eng, 2)
    try:
        first = [sch.submit(p, max_tokens=20, temperature=0, verify="strict", ignore_eos=True) for p in prompts[:2]]
        got = [s.result().tokens for s in first]
        later = [sch.submit(p, max_tokens=20, temperature=0, verify="strict", ignore_eos=True) for p in prompts[2:]]
        got += [s.result().tokens for s in later]
        shared = len(eng.tokenize(system)) - 1
        # the second of two joining together copies the first's prefix (llama_memory_seq_cp); later
        # ones keep what their slot holds
        assert all(s.stats.n_prompt_evaluated < s.stats.n_prompt - shared for s in first[1:] + later), \
            [(s.stats.n_prompt, s.stats.n_prompt_evaluated) for s in first + later]
    finally:
        sch.close()
    assert got == want


# ------------------------------------------------------- per-sequence streams
@pytest.mark.parametrize("target", ["tiny_target", pytest.param("smollm2_q4km", marks=pytest.mark.slow)])
def test_windows_of_many_sequences_equal_lone_windows_bit_for_bit(request, target):
    m = Model(request.getfixturevalue(target), 0, exact_kernels=True)
    rng = random.Random(0)
    mc = MultiContext(m, 5, 256, n_threads=2)
    lone = [Context(m, 256, n_threads=2) for _ in range(5)]
    for s in range(5):
        toks = [rng.randrange(m.n_vocab) for _ in range(rng.randint(2, 30))]
        assert np.array_equal(mc.seq(s).eval(toks, 1), lone[s].eval(toks, 1))
    for _ in range(12):
        wins = [(s, [rng.randrange(m.n_vocab) for _ in range(rng.randint(1, 12))]) for s in range(5)]
        for (s, w), rows in zip(wins, mc.decode_windows(wins)):
            assert np.array_equal(rows, lone[s].eval(w, len(w))), s
            keep = mc.seq(s).n_past - rng.randint(0, len(w) - 1)
            mc.seq(s).truncate(keep)
            lone[s].truncate(keep)
    assert mc.n_decodes > 5  # windows over 64 rows were split
    mc.close()
    for c in lone:
        c.close()


def test_extend_packs_several_sequences_catch_up_into_full_decodes(tiny_target):
    """A unified cache's catch-up on several sequences: decodes of n_batch rows (a part split
    where the room ends), each sequence holding its tokens, the next row as a lone cache's."""
    m = Model(tiny_target, 0)
    rng = random.Random(1)
    mc = MultiContext(m, 4, 256, n_batch=32, n_threads=2, unified=True)
    parts = [(s, [rng.randrange(m.n_vocab) for _ in range(n)]) for s, n in ((0, 20), (2, 30), (3, 9))]
    before = mc.n_decodes
    mc.extend(parts)
    assert mc.n_decodes - before == 2  # 59 rows in decodes of 32 (one sequence split across two)
    assert [mc.seq(s).tokens for s in range(4)] == [parts[0][1], [], parts[1][1], parts[2][1]]
    for s, toks in parts:
        lone = Context(m, 256, n_threads=2)
        want = lone.eval(toks + [7], 1).copy()
        lone.close()
        got = mc.seq(s).eval([7], 1)
        assert np.allclose(got, want, atol=1e-3), s  # unified cells: not bit for bit, the same values
    with pytest.raises(MarsError, match="context is full"):
        mc.extend([(1, [5] * 10), (0, [5] * 300)])
    assert mc.seq(1).tokens == []  # nothing decoded for a request refused up front
    mc.close()
    streams = MultiContext(m, 2, 64, n_threads=2)
    with pytest.raises(ValueError):
        streams.extend([(0, [1, 2])])  # per-sequence streams: one sequence per decode, not packed
    streams.close()


def test_a_draft_model_catches_up_on_every_sequence_in_one_decode(engines):
    """Switching to drafting after plain rounds: the draft model catches up on every sequence's
    missed tokens in shared decodes, not one decode per sequence, and strict output stays exact."""
    eng = engines["model"]
    sched = Scheduler(eng, 4)
    try:
        sched.calibrated = sched._draft_timed = True
        rounds = [0]
        sched.mode.choose = lambda planned, *_: rounds[0] >= 6  # plain rounds, then a switch to drafting
        catch_ups = []
        extend = sched.dmc.extend

        def counting_extend(parts):
            n = sched.dmc.n_decodes
            extend(parts)
            catch_ups.append((len(parts), sched.dmc.n_decodes - n))

        sched.dmc.extend = counting_extend
        step = sched.step

        def counting_step(*a, **kw):
            out = step(*a, **kw)
            rounds[0] += 1
            return out

        sched.step = counting_step
        outs = sched.generate_many(PROMPTS[:4], max_tokens=16, temperature=0, ignore_eos=True, verify="strict")
    finally:
        sched.close()
    assert catch_ups and catch_ups[0] == (4, 1), catch_ups  # four sequences' prompts and rounds: one decode
    assert sum(o.stats.n_drafted for o in outs) > 0
    for p, o in zip(PROMPTS[:4], outs):
        assert o.tokens == plain(eng, p, 16)


# ------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", ["model", "ngram"])
@pytest.mark.parametrize("n_parallel, n_prompts", [(1, 2), (3, 5), (8, 8)])
def test_strict_greedy_of_every_sequence_equals_plain_greedy_alone(engines, kind, n_parallel, n_prompts):
    eng = engines[kind]
    lengths = [12 + 7 * i for i in range(n_prompts)]  # different lengths: sequences leave at different rounds
    want = [plain(eng, p, n) for p, n in zip(PROMPTS, lengths)]
    with_spec = Scheduler(eng, n_parallel)
    # every round drafts (the tiny draft's acceptance would have the plan decode plainly): exactness
    # is what is tested here, of rounds that verify drafts
    with_spec.mode.choose = lambda planned, *_: True
    try:
        streams = [with_spec.submit(p, max_tokens=n, temperature=0, verify="strict", ignore_eos=True)
                   for p, n in zip(PROMPTS, lengths)]
        got = [[t for c in s for t in c.tokens] for s in streams]
    finally:
        with_spec.close()
    assert got == want
    assert sum(s.stats.n_accepted for s in streams) > 0 or kind == "ngram"  # the tiny draft agrees often


def test_a_sequence_joining_mid_generation_and_one_leaving_early(engines):
    eng = engines["model"]
    want = [plain(eng, p, 30) for p in PROMPTS[:3]]
    sch = Scheduler(eng, 3)
    try:
        a = sch.submit(PROMPTS[0], max_tokens=30, temperature=0, verify="strict", ignore_eos=True)
        leaver = sch.submit(PROMPTS[5], max_tokens=200, temperature=0, verify="strict", ignore_eos=True)
        for _ in range(4):
            sch.step()
        b = sch.submit(PROMPTS[1], max_tokens=30, temperature=0, verify="strict", ignore_eos=True)
        sch.step()
        next(leaver)
        leaver.close()  # its client went away: the slot is free at once
        assert sch.n_live == 2 and leaver.stats.stop_reason == "interrupted"
        c = sch.submit(PROMPTS[2], max_tokens=30, temperature=0, verify="strict", ignore_eos=True)
        got = [[t for ch in s for t in ch.tokens] for s in (a, b, c)]
    finally:
        sch.close()
    assert got == want


def test_stop_strings_and_limits_stay_with_their_request(engines):
    eng = engines["ngram"]
    alone = eng.generate(PROMPTS[1], max_tokens=40, temperature=0, verify="strict", ignore_eos=True)
    stop = alone.text[10:14]
    assert stop.strip()
    sch = Scheduler(eng, 4)
    try:
        outs = sch.generate_many(PROMPTS[:4], max_tokens=40, temperature=0, verify="strict", ignore_eos=True)
        s1 = sch.submit(PROMPTS[1], max_tokens=40, temperature=0, verify="strict", ignore_eos=True, stop=[stop])
        s2 = sch.submit(PROMPTS[1], max_tokens=7, temperature=0, verify="strict", ignore_eos=True)
        t1, t2 = "".join(c.text for c in s1), [t for c in s2 for t in c.tokens]
    finally:
        sch.close()
    assert outs[1].text == alone.text
    assert t1 == alone.text[: alone.text.index(stop)] and s1.stats.stop_reason == "stop"
    assert t2 == alone.tokens[:7] and s2.stats.stop_reason == "length"


def test_a_prompt_too_long_for_a_sequence_is_one_clear_error(engines):
    from mars_local import MarsError

    sch = Scheduler(engines["ngram"], 2, n_ctx_seq=64)
    try:
        with pytest.raises(MarsError, match="a sequence holds"):
            per_seq = sch.mc.n_ctx  # llama.cpp rounds 64 up to 256
            assert per_seq + 10 < engines["ngram"].n_ctx
            sch.submit([5] * (per_seq + 10), max_tokens=4)  # fits the engine's context, not a sequence's
        assert len(sch.generate_many(["hi"], max_tokens=3, temperature=0, ignore_eos=True)[0].tokens) == 3
    finally:
        sch.close()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["smollm2_q4km", "smollm2_f16"])
def test_strict_greedy_of_8_sequences_on_smollm2_equals_plain_alone(request, smollm2, target):
    """Real weights (a K-quant, whose kernels change above 64 rows, and F16), the bundled
    Q4_1 as draft, 8 sequences: every sequence's tokens equal its lone plain greedy tokens."""
    path = request.getfixturevalue(target)
    prompts = [f"Question {i}: list {i + 2} animals and what they eat." for i in range(8)]
    with Engine(path, smollm2, drafter="model", n_ctx=512, n_threads=2, learned=False) as eng:
        want = [eng.generate(p, max_tokens=24 + 3 * i, temperature=0, draft_max=0).tokens
                for i, p in enumerate(prompts)]
        sch = Scheduler(eng, 8)
        try:
            streams = [sch.submit(p, max_tokens=24 + 3 * i, temperature=0, verify="strict", draft_max=8,
                                  adaptive=False) for i, p in enumerate(prompts)]
            got = [[t for c in s for t in c.tokens] for s in streams]
        finally:
            sch.close()
    assert got == want
    assert sum(s.stats.n_accepted for s in streams) > 0


@pytest.mark.slow
@pytest.mark.parametrize("draft_max", [0, 4])
def test_sequences_left_in_scattered_slots_decode_in_one_micro_batch_and_stay_exact(smollm2_f16, smollm2,
                                                                                     draft_max):
    """Short and long answers alternate, so once the short ones end the long ones sit in slots 1, 3,
    5, 7.  llama.cpp puts only consecutive streams in one micro-batch: those rounds were 4 forwards.
    The free slots between them get a window too (rolled back), and every sequence's tokens still
    equal its lone plain greedy tokens."""
    prompts = [f"Question {i}: list {i + 2} animals and what they eat." for i in range(8)]
    lengths = [6 if i % 2 == 0 else 30 for i in range(8)]
    with Engine(smollm2_f16, smollm2, drafter="model", n_ctx=512, n_threads=2, learned=False) as eng:
        want = [eng.generate(p, max_tokens=n, temperature=0, draft_max=0).tokens for p, n in zip(prompts, lengths)]
        sch = Scheduler(eng, 8)
        filled = []
        real = sch._gap_windows

        def spy(windows, w, prior):
            out = real(windows, w, prior)
            filled.append(([slot for slot, _ in windows], [slot for slot, _, _ in out]))
            return out

        sch._gap_windows = spy
        try:
            streams = [sch.submit(p, max_tokens=n, temperature=0, verify="strict", draft_max=draft_max,
                                  adaptive=False) for p, n in zip(prompts, lengths)]
            got = [[t for c in s for t in c.tokens] for s in streams]
            cached = [list(sch.mc.seq(i).tokens) for i in range(0, 8, 2)]
            held = [list(eng._prompt_tokens(prompts[i])) + got[i] for i in range(0, 8, 2)]
        finally:
            sch.close()
    assert got == want
    assert ([1, 3, 5, 7], [2, 4, 6]) in [(sorted(a), b) for a, b in filled]
    # the short answers' slots hold what they held when they ended (the gap rows were rolled back)
    assert cached == [h[:-1] for h in held]


def _two_sample_p(a: list, b: list) -> float:
    """Chi-square two-sample test of two lists of outcomes (rare outcomes pooled)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    common = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rows = [[ca[k] for k in common] + [sum(v for k, v in ca.items() if k not in common)],
            [cb[k] for k in common] + [sum(v for k, v in cb.items() if k not in common)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return float(chi2_contingency(rows)[1])


@pytest.mark.slow
@pytest.mark.parametrize("verify", ["strict", "mars"])
def test_sampling_in_a_batch_has_the_lone_distribution(engines, verify):
    """T = 1, fixed k: 300 seeds alone and 300 seeds sharing batches of 6; the 2nd and 3rd tokens
    (drawn through verification) have the same distribution (two-sample chi-square)."""
    eng = engines["model"]
    kw = dict(max_tokens=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, verify=verify, draft_max=4,
              adaptive=False, ignore_eos=True)
    seeds = range(300)
    lone = [tuple(eng.generate(PROMPTS[2], seed=s, **kw).tokens[1:]) for s in seeds]
    sch = Scheduler(eng, 6)
    try:
        streams = [sch.submit(PROMPTS[2], seed=1000 + s, **kw) for s in seeds]
        batched = [tuple([t for c in st for t in c.tokens][1:]) for st in streams]
    finally:
        sch.close()
    for pos in (0, 1):
        p = _two_sample_p([x[pos] for x in lone], [x[pos] for x in batched])
        assert p > 1e-3, (pos, p)


@pytest.mark.slow
def test_reused_prefixes_long_and_short_stay_exact_on_smollm2(smollm2, smollm2_q4km):
    """Real K-quant weights (rows of chunks over 64 differ from invariant ones): prompts sharing a
    long beginning (chunks of over 64 rows) and a short one, two slots reused in turn; every
    sequence's strict greedy tokens equal a fresh lone run's, and short prefixes were reused.
    Submitted in pairs, so that each pair finds both slots free and picks its prefixes."""
    long_sys = "You are a meticulous assistant. " * 12
    prompts = [s + q for q in ("Name a colour.", "Count to three.", "Say hello.") for s in (long_sys, "Be brief. ")]
    with Engine(smollm2_q4km, smollm2, drafter="model", n_ctx=512, n_threads=2, learned=False) as eng:
        want = [plain(eng, p, 16) for p in prompts]
        sch = Scheduler(eng, 2)
        try:
            streams, got = [], []
            for pair in (prompts[0:2], prompts[2:4], prompts[4:6]):
                streams += [sch.submit(p, max_tokens=16, temperature=0, verify="strict", ignore_eos=True)
                            for p in pair]
                got += [s.result().tokens for s in streams[-2:]]
        finally:
            sch.close()
    assert got == want
    assert any(s.stats.n_prompt_evaluated < s.stats.n_prompt - 3 for s in streams[2:])


# ------------------------------------------------- what a switch to drafting costs
CPU_ROWS = [0.09 * (1.0 + 0.25 * (r - 1)) for r in range(1, 65)]  # a row costs a quarter of one more


@pytest.mark.parametrize("n, lags, remaining, drafts", [
    (2, [0, 0], [40, 40], True),          # caught up: drafting pays at 2 sequences
    (2, [60, 60], [400, 400], True),      # a prompt to catch up on, spread over many rounds: still pays
    (2, [60, 60], [6, 6], False),         # the same catch-up, 6 tokens left: it cannot be earned back
    (2, [10, 0], [6, 40], True),          # a short catch-up of a sequence near its end: still pays
])
def test_a_plan_spreads_the_catch_up_over_the_rounds_left(n, lags, remaining, drafts):
    k, k_draft, switch = plan_drafting([[0.85] * 8] * n, CPU_ROWS, 0.005, 8, lags, remaining, 0.004)
    assert (k > 0) is drafts and k_draft >= 1
    assert (switch > 0) is any(lags)


@pytest.mark.parametrize("gain, k", [(1.03, 0), (1.049, 0), (1.06, 1), (1.5, 1)])
def test_a_plan_drafts_only_where_drafting_promises_a_margin_over_plain_rounds(gain, k):
    """Near the break-even the plan's choice would flip with noise (each flip bringing trials of
    drafting, and their catch-ups, back): drafting must promise PLAN_MARGIN (5 %) more."""
    assert PLAN_MARGIN == 1.05
    costs = [1.0, 1.5 / gain, 3.0]  # one sequence: plain 1 token / 1 s; k = 1: 1.5 tokens / (1.5 / gain) s
    got = plan_drafting([[0.5]], costs, per_token=0.0, k_room=1)
    assert got[0] == k and got[1] == 1  # the best k >= 1 is what a drafting round uses either way


def test_plain_rounds_are_tried_soon_where_the_plan_prefers_drafting():
    """The plan's cost of plain rounds at n sequences is scaled from other shapes until one runs;
    a trial of plain costs nothing to switch to, so it comes after 4 drafting rounds (not 16),
    and once plain is measured better the rates decide."""
    m = DraftOrNot()
    picks = []
    for _ in range(12):
        picks.append(m.choose(True))
        m.observe(picks[-1], 4, 0.25 if picks[-1] else 0.15)  # drafting: 16 tok/s; plain: 27
    assert picks[:5] == [True] * 4 + [False]  # the plan's word, then a trial of plain
    assert picks.count(False) >= 2 and picks[-1] is False  # measured twice: plain from then on


def test_a_switch_cost_takes_away_a_rate_lead_that_a_catch_up_would_eat():
    def measured(switch_s):
        m = DraftOrNot(explore=1000)
        for _ in range(4):
            m.observe(True, 12, 1.0)   # drafting rounds: 12 tok/s (measured while caught up)
            m.observe(False, 10, 1.0)  # plain rounds: 10 tok/s
        m._mode = False  # decoding plainly now: the draft caches lag
        return m.choose(True, switch_s)
    assert measured(0.0) is True           # 1.2x: worth the switch
    assert measured(0.5) is False          # a catch-up of half a round's time per round: 0.8x


def test_a_plan_made_from_measurements_is_not_tried_against():
    """A plan from measured inputs that says drafting does not pay is trusted: no trial of
    drafting (its catch-up of every live prompt is the cost); a plan from priors is tried once."""
    for measured, want in ((True, [False] * 40), (False, [False] * 4 + [True])):
        m = DraftOrNot(explore=4)
        got = []
        for _ in range(len(want)):
            got.append(m.choose(False, 0.0, measured))
            m.observe(got[-1], 4, 1.0)
        assert got == want


def test_the_draft_model_is_timed_once_as_part_of_its_catch_up(engines):
    """The scheduler times a draft step and a catch-up on its first round (the plan's draft
    costs measured here, not learned elsewhere): the decodes evaluate real missed tokens (the
    draft caches advance), nothing is rolled back, and strict output stays exact."""
    eng = engines["model"]
    want = [plain(eng, p, 12) for p in PROMPTS[:3]]
    sched = Scheduler(eng, 3)
    try:
        sched.calibrated = True
        seen = []
        cal = sched._calibrate_draft

        def spy(seqs):
            before = [s.dview.n_past for s in seqs]
            cal(seqs)
            seen.append((before, [s.dview.n_past for s in seqs], [list(s.dview.tokens) for s in seqs],
                         [s.run.tokens for s in seqs]))

        sched._calibrate_draft = spy
        outs = sched.generate_many(PROMPTS[:3], max_tokens=12, temperature=0, ignore_eos=True, verify="strict")
        assert len(seen) == 1  # once per scheduler
        before, after, cached, tokens = seen[0]
        assert sum(after) - sum(before) >= 2 * 3 + 1  # two draft steps of every sequence, and a catch-up
        for c, t in zip(cached, tokens):
            assert c == t[:len(c)] and len(c) < len(t)  # real tokens: a prefix of tokens[:-1]
        assert sched.cost.draft_measured and sched._catch[1] > 0
    finally:
        sched.close()
    assert [o.tokens for o in outs] == want


def test_a_catch_up_while_drafting_counts_in_the_drafting_rounds_rate_and_a_switch_does_not(engines):
    """A prompt joining while drafting goes on has the draft model read it before the round:
    that catch-up is a cost of drafting (CPU, 8 sequences: a sixth of a drafting round), so the
    round's time DraftOrNot compares includes it.  The first drafting round's catch-up (a
    switch, priced by the plan) is not counted there twice."""
    eng = engines["model"]
    want = [plain(eng, p, 12) for p in PROMPTS[:3]]
    sched = Scheduler(eng, 2)
    pause = 0.3
    try:
        sched.calibrated = True
        sched.mode.choose = lambda planned, *_: True  # every round drafts
        extend = sched.dmc.extend

        def slow_extend(parts):  # every catch-up of the draft cache (and the draft's calibration)
            extend(parts)
            time.sleep(pause)

        sched.dmc.extend = slow_extend
        seen = []
        observe = sched.mode.observe

        def spy(drafted, tokens, seconds, n=None, ceiling=None):
            seen.append((drafted, seconds))
            observe(drafted, tokens, seconds, n, ceiling)

        sched.mode.observe = spy
        outs = sched.generate_many(PROMPTS[:3], max_tokens=12, temperature=0, ignore_eos=True, verify="strict")
    finally:
        sched.close()
    assert seen and all(d for d, _ in seen)
    assert seen[0][1] < pause  # the switch: the two first prompts' catch-up
    assert sum(sec >= pause for _, sec in seen[1:]) == 1  # the third prompt, joining while drafting
    assert [o.tokens for o in outs] == want


def test_a_calibration_with_nothing_to_time_is_made_again_later(engines):
    """No sequence lagging (nothing to time without rolling back): the calibration is not
    counted as done, so a later round times the draft model rather than the plan staying on
    priors (and trying drafting blind) for the scheduler's life."""
    sched = Scheduler(engines["model"], 2)
    try:
        sched._calibrate_draft([])
        assert not sched._draft_timed and not sched.cost.draft_measured
        outs = sched.generate_many(PROMPTS[:2], max_tokens=6, temperature=0, ignore_eos=True, verify="strict")
        assert sched._draft_timed and sched.cost.draft_measured
    finally:
        sched.close()
    assert all(len(o.tokens) == 6 for o in outs)


@pytest.mark.parametrize("ctrl_timed_a_draft", [True, False])
def test_where_measured_acceptance_says_drafting_cannot_pay_no_round_drafts(engines, ctrl_timed_a_draft):
    """Acceptance learned (poor), the draft's cost and the forwards timed: the plan says plain at
    every round and no trial of drafting (nor its catch-up) is made; before, one came after
    16 plain rounds.  The draft's cost the plan uses is the scheduler's own (timed in batched
    decodes): a controller that never timed a lone draft (a request on a server whose rounds were
    plain) must not make the plan look unmeasured, as it did (a trial's catch-up of 4 prompts
    took 1.4 s on the Q4_K_M stand-in, BENCHMARKS.md run 23)."""
    eng = engines["model"]
    sched = Scheduler(eng, 3)
    try:
        extends = []
        sched.dmc.extend = (lambda f: lambda parts: (extends.append(len(parts)), f(parts)))(sched.dmc.extend)
        streams = [sched.submit(p, max_tokens=40, temperature=0, ignore_eos=True, verify="strict") for p in PROMPTS[:3]]
        for s in streams:
            ctrl = s._seq.run.ctrl
            ctrl._counts[POOL] = [1.0, 39.0]  # 2.5 % of 40 draft tokens accepted, learned (a gain no
            # timing noise between the tiny models' forwards and drafts can make pay)
            ctrl._draft[:] = [0.01, 1.0] if ctrl_timed_a_draft else [0.0, 0.0]
        while any(not s._seq.done for s in streams):
            sched.step()
        outs = [s.result() for s in streams]
    finally:
        sched.close()
    assert sched.rounds > 30
    assert sum(o.stats.n_drafted for o in outs) == 0
    assert extends == [1]  # the calibration's catch-up only


@pytest.mark.parametrize("first_weight", [0.0, 0.5])
def test_a_shapes_first_forward_counts_only_where_it_costs_what_the_next_does(first_weight):
    """A GPU's first forward of a shape captures its graph (not timed); a CPU's costs about what
    the next does, and a shape a round uses once (a trial of drafting at a new k) must count, or
    the plan keeps the lone curve's guess for it (on the Xeon 0.18 s for 0.51 s) and keeps
    trying it."""
    c = BatchCost(max_rows=8, first_weight=first_weight)
    for rows, t in ((2, 0.2), (6, 0.6)):
        c.observe(rows, t)
    assert c.timed(2) == c.timed(6) == (first_weight > 0)
    if first_weight:
        got = c.costs()
        assert got[1] == pytest.approx(0.2) and got[5] == pytest.approx(0.6)
        c.observe(6, 0.9)  # a second forward outweighs the first
        assert 0.75 < c.costs()[5] < 0.9


def test_draft_or_not_peek_answers_as_choose_and_changes_nothing():
    rng = random.Random(3)
    a, b = DraftOrNot(explore=4), DraftOrNot(explore=4)
    for i in range(200):
        planned, measured = rng.random() < 0.5, rng.random() < 0.3
        if i % 7 == 0:
            drafted, tokens = rng.random() < 0.5, rng.randint(1, 20)
            for m in (a, b):
                m.observe(drafted, tokens, 1.0)
        peeked = [a.peek(planned, 0.0, measured) for _ in range(3)]
        got = a.choose(planned, 0.0, measured)
        assert peeked == [got] * 3 and got == b.choose(planned, 0.0, measured)


def test_a_mars_regime_never_learned_starts_from_strict_acceptance(tmp_path):
    """MARS accepts every draft strict verification does: where the store has the pair's strict
    acceptance and no MARS one, the MARS controller starts from it (measured, so a batch's plan
    need not try drafting to find it out); a MARS acceptance of its own is taken as it is."""
    from mars_local.speculate.controllers import Controllers
    from mars_local.speculate.learned import LearnedStore

    keys = {"costs": None, "draft": None, "drafter": "D", "target": "T"}
    store = LearnedStore(tmp_path / "learned.json")
    store.put("accept|T|D|strict/None/True", {"counts": [[POOL, 27.0, 3.0]]})
    ctrls = Controllers(store, keys, gpu=False)
    mars = ctrls.get(("mars", 0.9, True), 8)
    strict = ctrls.get(("strict", None, True), 8)
    assert mars.acceptance_measured() and mars.acceptance(None) > 0.8
    assert mars.acceptance(None) == pytest.approx(strict.acceptance(None))
    assert not ctrls.get(("strict", None, False), 8).acceptance_measured()  # sampling: another pair of counts
    store.put("accept|T|D|mars/0.9/True", {"counts": [[POOL, 5.0, 15.0]]})
    assert Controllers(store, keys, gpu=False).get(("mars", 0.9, True), 8).acceptance(None) < 0.4


def test_the_scheduler_keeps_what_its_rounds_learned_for_the_next_process(tiny_target, tiny_draft, tmp_path):
    """A lone Engine saves its controllers after each generation; the scheduler (a server, `mars
    batch`) saves them too, so a restarted server starts from the acceptance its rounds learned."""
    from mars_local.speculate.learned import LearnedStore

    path = tmp_path / "learned.json"
    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=256, n_threads=2, learned=LearnedStore(path)) as eng:
        sched = Scheduler(eng, 2)
        try:
            sched.mode.choose = lambda planned, *_: True  # every round drafts (acceptance to learn)
            sched.generate_many(PROMPTS[:2], max_tokens=12, temperature=0, ignore_eos=True, verify="strict")
        finally:
            sched.close()
    accept = [v for k, v in LearnedStore(path).entries().items() if k.startswith("accept|") and k.endswith("strict/None/True")]
    assert len(accept) == 1
    pooled = dict((key, (acc, rej)) for key, acc, rej in accept[0]["counts"])[POOL]
    assert sum(pooled) >= 2  # the rounds' draft tokens, judged


def test_a_switch_to_drafting_times_its_shapes_before_the_draft_catches_up(engines):
    """Before a switch to drafting makes the draft model read what it missed (prompts joined,
    rounds went by), the plan's shapes never timed here are: plain rounds' (one row a sequence)
    and drafting's (k + 1 rows each).  The probes roll back what they add: every sequence's
    cells and tokens are as before, and strict output stays exact."""
    eng = engines["model"]
    want = [plain(eng, p, 10) for p in PROMPTS[:3]]
    sched = Scheduler(eng, 3)
    events = []
    try:
        sched.calibrated = True
        sched.mode.choose = lambda planned, *_: True  # every round drafts
        probe, catch = sched._time_windows, sched._draft_prompts

        def spy_probe(seqs, w, weight, times=2):
            before = [(s.view.n_past, list(s.view.tokens)) for s in seqs]
            ok = probe(seqs, w, weight, times)
            assert [(s.view.n_past, list(s.view.tokens)) for s in seqs] == before
            events.append(("probe", (len(seqs), w)))
            return ok

        def spy_catch(seqs):
            lagging = any(sched._lag(s) for s in seqs)
            dt = catch(seqs)
            if lagging:
                events.append(("catch", None))
            return dt

        sched._time_windows, sched._draft_prompts = spy_probe, spy_catch
        outs = sched.generate_many(PROMPTS[:3], max_tokens=10, temperature=0, ignore_eos=True, verify="strict")
    finally:
        sched.close()
    first_catch = events.index(("catch", None))
    probed = [shape for what, shape in events[:first_catch] if what == "probe"]
    assert probed and probed[0][1] == 1 and any(w > 1 for _, w in probed)  # plain rounds' shape first, then drafting's
    assert all(sched.cost.timed(n * w) for n, w in probed)
    assert [o.tokens for o in outs] == want


def test_draft_or_not_compares_rates_at_the_rounds_load():
    """Drafting rounds timed while one request ran alone deliver fewer tokens a second than
    rounds of four, whatever the mode: compared with plain rounds of four they made drafting
    look worse, and a server whose drafting rounds of four beat its plain ones stayed plain."""
    m = DraftOrNot(explore=1000, explore_plain=1000)
    for _ in range(5):
        m.observe(True, 5, 0.3, n=1)     # drafting, one sequence: 17 tok/s
        m.observe(False, 4, 0.143, n=4)  # plain, four: 28 tok/s
        m.observe(True, 12, 0.38, n=4)   # drafting, four: 32 tok/s
    assert m.rate(True, n=4) == pytest.approx(12 / 0.38) and m.rate(False, n=1) is None
    m.choose(False, n=4)  # plain rounds so far: drafting must beat them by `enter`
    assert m.choose(True, n=4) is True
    assert m.choose(True, n=2) is True  # a load with no rates: the plan


def test_draft_or_not_judges_a_new_load_by_the_nearest_load_it_measured():
    """At a load never measured, the two modes' ratio at the nearest measured load decides, not
    the plan alone: at 6 sequences, rounds of 8 that showed drafting 25 % behind keep it plain."""
    m = DraftOrNot(explore=1000, explore_plain=1000)
    for _ in range(5):
        m.observe(True, 12, 0.5, n=8)   # 24 tok/s drafting
        m.observe(False, 8, 0.25, n=8)  # 32 tok/s plain
        m.observe(True, 12, 0.38, n=2)  # drafting wins at 2 (32 against 20)
        m.observe(False, 2, 0.1, n=2)
    assert m.choose(True, n=6) is False and m.choose(True, n=7) is False
    assert m.choose(False, n=3) is True  # nearer 2 than 8 (hysteresis: 1.6x beats `enter`)
    assert m.choose(True, n=None) is True  # no load given: the plan (nothing measured there)


def test_draft_or_not_saves_its_rates_per_load_for_doctor():
    """What the rounds measured per load goes into the learned state as JSON, and `mars doctor`
    reads drafting's rate against plain rounds' from it."""
    import json

    from mars_local.cli.models import _learned_summary

    m = DraftOrNot(explore=4)
    for _ in range(5):
        m.observe(True, 12, 0.5, n=8)   # 24 tok/s drafting
        m.observe(False, 8, 0.25, n=8)  # 32 tok/s plain
        m.observe(True, 6, 0.2, n=2)    # 30 tok/s drafting
        m.observe(False, 2, 0.1, n=2)   # 20 tok/s plain
    state = json.loads(json.dumps(m.export_state()))
    line = _learned_summary({"cost": {"time": {}}, "mode": state})
    assert line.endswith("drafting / plain rate per load 2: 1.50x, 8: 0.75x")


def test_batch_cost_state_goes_on_in_the_next_process_at_a_few_forwards_weight():
    """Shapes timed in an earlier process are timed here (no probe forward for them), at a few
    forwards' weight; the draft's cost is not kept (a prior the plan must not trust)."""
    import json

    old = BatchCost(first_weight=0.5)
    for _ in range(20):
        old.observe(8, 0.3)
        old.observe(40, 0.9)
    old.observe_draft(8, 0.08)
    new = BatchCost(first_weight=0.5)
    new.import_state(json.loads(json.dumps(old.export_state())))
    assert new.timed(8) and new.timed(40) and not new.timed(16)
    assert new.costs()[7] == pytest.approx(0.3) and new.costs()[39] == pytest.approx(0.9)
    assert new._time[8][1] <= 3.0 + 1e-9 and not new.draft_measured
    for _ in range(12):
        new.observe(8, 0.5)  # this machine is slower now: its own forwards decide
    assert new.costs()[7] > 0.45
    bad = BatchCost()
    bad.import_state({"time": {"x": [1, 1]}})
    bad.import_state({"time": [1, 2]})
    assert bad._time == {}


def test_a_restarted_scheduler_starts_from_its_predecessors_batch_shapes(tiny_target, tiny_draft, tmp_path):
    """A scheduler saves the batch shapes it timed (and the rates its rounds delivered, for
    `mars doctor`); the next one, on an Engine of the same models, starts with those shapes
    timed (no calibration or probe forwards for them) but finds out drafting's and plain
    rounds' rates afresh."""
    from mars_local.speculate.learned import LearnedStore

    path = tmp_path / "learned.json"
    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=256, n_threads=2, learned=LearnedStore(path)) as eng:
        sched = Scheduler(eng, 2)
        try:
            outs1 = sched.generate_many(PROMPTS[:2], max_tokens=8, temperature=0, ignore_eos=True, verify="strict")
        finally:
            sched.close()
    shapes = [r for r in sched.cost._time if sched.cost.timed(r)]
    assert shapes and sched.mode._rates
    entry = [v for k, v in LearnedStore(path).entries().items() if k.startswith("batch|")]
    assert len(entry) == 1 and entry[0]["cost"]["time"] and entry[0]["mode"]["rates"]
    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=256, n_threads=2, learned=LearnedStore(path)) as eng:
        sched2 = Scheduler(eng, 2)
        try:
            assert all(sched2.cost.timed(r) for r in shapes) and sched2.mode._rates == {}
            outs2 = sched2.generate_many(PROMPTS[:2], max_tokens=8, temperature=0, ignore_eos=True, verify="strict")
        finally:
            sched2.close()
    assert [o.tokens for o in outs2] == [o.tokens for o in outs1]
    with Engine(tiny_target, tiny_draft, drafter="model", n_ctx=256, n_threads=2, learned=False) as eng:
        sched3 = Scheduler(eng, 2)  # no store: nothing kept
        assert not any(sched3.cost.timed(r) for r in shapes)
        sched3.close()


def test_a_plan_that_changes_its_mind_does_not_bring_back_a_trial_that_lost_clearly_at_this_load():
    """The plan flips with every wave of requests (its switch cost grows as sequences near their
    end); each flip used to restart the trials' gap, so every wave at 8 sequences tried drafting
    again (and paid its catch-up) though its rounds there lost by 20 %.  The gap of a mode that
    lost by more than ``enter`` at this load survives the flip; near the break-even, or at a load
    not measured, it restarts."""
    m = DraftOrNot(explore=4)
    for _ in range(5):
        m.observe(True, 12, 0.5, n=8)   # 24 tok/s drafting
        m.observe(False, 8, 0.25, n=8)  # 32 tok/s plain
    picks = [m.choose(True, n=8) for _ in range(40)]
    gap = m._gap[True]
    assert gap >= 16 and picks.count(True) >= 2
    since = m._since[True]  # plain rounds since the last trial
    assert gap - since - 2 > 4  # (room to see a restarted gap's trial)
    m.choose(False, n=8)  # a wave's end: the plan says plain ...
    after = [m.choose(True, n=8) for _ in range(gap - since - 2)]  # ... and drafting again with the next wave
    assert not any(after) and m._gap[True] == gap
    near = DraftOrNot(explore=4)
    for _ in range(5):
        near.observe(True, 8.2, 0.25, n=8)  # drafting 2.5 % behind: within `enter`
        near.observe(False, 8, 0.24, n=8)
    for _ in range(40):
        near.choose(True, n=8)
    near.choose(False, n=8)
    assert near._gap[True] == 4  # restarted: a trial soon


def test_one_drafting_round_that_lost_even_at_its_ceiling_settles_the_load_and_its_neighbours():
    """One drafting round is no rate (its acceptance was luck), so a second trial came at once,
    and another at the next load (at 16 sequences on the Q4_K_M stand-in, 4 s).  Where even
    that round's ceiling (every draft token accepted) is below plain rounds' rate, drafting
    lost whatever its luck; a round whose ceiling beat plain settles nothing."""
    m = DraftOrNot(explore=4)
    for _ in range(3):
        m.observe(False, 16, 0.25, n=16)                 # plain: 64 tok/s
    m.observe(True, 30, 1.0, n=16, ceiling=32)           # drafting: 32 tok/s at best
    assert m._rates_at(16, 0.0) == (pytest.approx(32.0), pytest.approx(64.0))
    assert not any(m.choose(False, n=16) for _ in range(40))  # no trial came back
    assert not any(m.choose(False, n=15) for _ in range(40))  # nor at the next load
    lucky = DraftOrNot(explore=4)
    for _ in range(3):
        lucky.observe(False, 16, 0.25, n=16)
    lucky.observe(True, 30, 0.5, n=16, ceiling=64)       # 60 tok/s, 128 at best: not settled
    assert lucky._rates_at(16, 0.0)[0] is None
    assert lucky.choose(True, n=16) is True                # the plan decides, as before
    lucky.observe(True, 60, 0.5, n=16, ceiling=64)       # two rounds: a rate
    assert lucky._rates_at(16, 0.0)[0] == pytest.approx((30 * 0.9 + 60) / (0.5 * 0.9 + 0.5))  # (decayed sums)


def test_a_plan_that_drafting_cannot_win_at_any_acceptance_is_trusted_before_acceptance_is_learned(engines):
    """With the acceptance not yet learned (a prior), a plan saying plain rounds was not trusted,
    so DraftOrNot tried drafting anyway: at 16 sequences a catch-up of 16 prompts and a round of
    32 rows, 2.4 s, where drafting could not pay even with every draft token accepted.  Such a
    plan is trusted (once the draft's cost was measured); one where full acceptance would pay
    is not."""
    eng = engines["model"]
    sched = Scheduler(eng, 4)
    try:
        sched.calibrated = True
        sched.cost.observe_draft(8, 0.08)  # the draft's cost measured: 10 ms a token
        curve = [0.1 * r for r in range(1, 65)]  # every row a full row's cost: no window pays
        sched.cost.costs = lambda prior=None, n_seqs=None: curve
        for p in PROMPTS[:4]:  # (tokens enough to earn a draft cache's catch-up back)
            sched.submit(p, max_tokens=400, temperature=0, verify="strict")
        sched._admit()
        sched._prefill()
        seqs = list(sched._live.values())
        for s in seqs:
            s.run.ctrl.acceptance_measured = lambda n=20: False
        plan = sched._plan_costly(seqs, 3)
        assert plan.k == 0 and plan.measured
        assert sched.mode.peek(False, plan.switch_s, plan.measured, 4) is False
        curve[:] = [0.1 + 0.001 * r for r in range(1, 65)]  # rows almost free: full acceptance would pay
        plan = sched._plan_costly(seqs, 3)
        assert not plan.measured
        curve[:] = [0.1 * r for r in range(1, 65)]
        sched.cost._draft = [0.0, 0.0]  # the draft's cost not measured: nothing trusted
        assert not sched._plan_costly(seqs, 3).measured
    finally:
        sched.close()


def test_calibration_times_only_the_row_counts_not_kept_from_an_earlier_process(engines):
    """A server's first request timed forwards of 1, 4, 16 and 64 rows (3.6 s on the F16 stand-in)
    in every process; counts an earlier scheduler timed and kept are not timed again."""
    eng = engines["model"]
    sched = Scheduler(eng, 2)
    timed = []
    try:
        sched.cost.import_state({"time": {"1": [0.01, 1.0], "4": [0.02, 1.0], "16": [0.05, 1.0]}})
        probe = sched._time_views
        sched._time_views = lambda views, w, weight, times=2: (timed.append(w), probe(views, w, weight, times))[1]
        sched.submit(PROMPTS[0], max_tokens=4, temperature=0, ignore_eos=True)
        while sched.step():
            if sched._live:
                s = next(iter(sched._live.values()))
                sched._calibrate(s.view, s.run.tokens[-1])
                break
    finally:
        sched.close()
    assert timed == [64] and sched.cost.timed(64)


def test_warm_up_times_the_forwards_before_any_request_and_keeps_them(tiny_target, tiny_draft, tmp_path):
    """A new server's first request waited for the calibration (2.7 s of its time to the first
    token on the Q4_K_M stand-in at 4 sequences): warm_up times the same forwards before any
    request, in a slot it empties again, so that no round times them, every sequence stays
    exact, and a restarted scheduler (even one whose predecessor ran no round) finds them kept."""
    from mars_local.speculate.batched import CALIBRATION_ROWS
    from mars_local.speculate.learned import LearnedStore

    path = tmp_path / "learned.json"
    opts = dict(drafter="model", n_ctx=256, n_threads=2)
    for run in range(2):
        with Engine(tiny_target, tiny_draft, learned=LearnedStore(path), **opts) as eng:
            want = [plain(eng, p, 10) for p in PROMPTS[:3]]  # (draft_max=0: no controller, nothing timed)
            sched = Scheduler(eng, 3)
            calls = []
            try:
                spent = sched.warm_up()
                rows = [r for r in CALIBRATION_ROWS if r <= sched.mc.max_rows]
                assert sched.calibrated and all(sched.cost.timed(r) for r in rows)
                assert (spent > 0) == (run == 0)  # the second scheduler starts from the first's
                assert [sched.mc.seq(i).n_past for i in range(3)] == [0, 0, 0]
                assert sched.warm_up() == 0.0
                if run == 1:  # (the first closes without a round: what it timed is kept all the same)
                    real = sched._calibrate
                    sched._calibrate = lambda *a: (calls.append(a), real(*a))
                    outs = sched.generate_many(PROMPTS[:3], max_tokens=10, temperature=0, ignore_eos=True,
                                               verify="strict")
                    assert [o.tokens for o in outs] == want and calls == []
            finally:
                sched.close()
    with Engine(tiny_target, tiny_draft, learned=False, **opts) as eng:
        sched = Scheduler(eng, 2)
        try:  # timed and used in one process: exact
            assert sched.warm_up() > 0
            outs = sched.generate_many(PROMPTS[3:5], max_tokens=10, temperature=0, ignore_eos=True, verify="strict")
            assert [o.tokens for o in outs] == [plain(eng, p, 10) for p in PROMPTS[3:5]]
        finally:
            sched.close()
    with Engine(tiny_target, drafter="none", n_ctx=256, n_threads=2, learned=False) as eng:
        sched = Scheduler(eng, 2)
        try:  # no draft-length controller: nothing to plan, nothing timed; only the wide probe
            sched.warm_up()
            assert not sched.calibrated and not sched.cost.timed(1) and sched.wide_alike is not None
            assert sched.warm_up() == 0.0
        finally:
            sched.close()


def test_a_scheduler_that_timed_nothing_and_ran_no_round_leaves_the_kept_state_as_it_was(tiny_target, tiny_draft,
                                                                                         tmp_path):
    """A server started and stopped without a request, whose warm-up found every shape kept,
    must not write the state back: the imported shapes (capped at a few forwards' weight) would
    replace what was measured, and the rates `mars doctor` shows would be lost."""
    from mars_local.speculate.learned import LearnedStore

    path = tmp_path / "learned.json"
    opts = dict(drafter="model", n_ctx=256, n_threads=2)

    def kept():
        return [v for k, v in LearnedStore(path).entries().items() if k.startswith("batch|")]

    with Engine(tiny_target, tiny_draft, learned=LearnedStore(path), **opts) as eng:
        sched = Scheduler(eng, 2)
        try:
            sched.warm_up()
            sched.generate_many(PROMPTS[:2], max_tokens=8, temperature=0, ignore_eos=True, verify="strict")
        finally:
            sched.close()
    before = kept()
    assert len(before) == 1 and before[0]["mode"]["rates"]
    with Engine(tiny_target, tiny_draft, learned=LearnedStore(path), **opts) as eng:
        sched = Scheduler(eng, 2)
        try:
            assert sched.warm_up() == 0.0 and sched.calibrated and not sched.cost.observed()
        finally:
            sched.close()
    assert kept() == before


@pytest.mark.parametrize("together", [False, True])
def test_a_new_prompt_takes_the_slot_holding_least_and_a_conversation_keeps_its_own(engines, together):
    """Slots keep what their last sequence held for the next request's prefix. A prompt that
    shares nothing with any slot takes the one holding the fewest tokens (not the lowest: that
    was a long conversation's), and requests arriving together are matched to slots by the
    prefixes they keep, whichever came first; outputs stay exact."""
    eng = engines["model"]
    conv = eng.tokenize("user: tell me about the fox. assistant:")  # (all within one exact chunk)
    short, new = eng.tokenize("hi"), eng.tokenize("a different question")
    sch = Scheduler(eng, 2)
    try:
        first = [sch.submit(p, max_tokens=8, temperature=0, ignore_eos=True, verify="strict") for p in (conv, short)]
        convo = conv + first[0].result().tokens + eng.tokenize(" user: more")
        first[1].result()
        order = [(new, convo)] if together else [(new,), (convo,)]
        got = {}
        for wave in order:
            streams = [(tuple(p), sch.submit(p, max_tokens=8, temperature=0, ignore_eos=True, verify="strict")) for p in wave]
            for p, st in streams:
                got[p] = st.result()
    finally:
        sch.close()
    new, convo = tuple(new), tuple(convo)
    assert len(convo) < 64
    assert got[convo].stats.n_prompt_evaluated <= got[convo].stats.n_prompt - len(conv)
    for p in (new, convo):
        assert got[p].tokens == plain(eng, list(p), 8)


@pytest.mark.parametrize("offloaded", [False, True])
def test_auto_parallel_counts_the_memory_where_the_kv_cache_lives(tiny_target, tiny_draft, monkeypatch, offloaded):
    """The default --parallel: 8 sequences, fewer where their KV caches would take over half the
    free memory of the host, or with the target offloaded of the GPUs (the host's then says
    nothing: an 8 GB card under a 64 GB host must not be given 8 caches)."""
    from mars_local.llama import context, rpc
    from mars_local.speculate import batch_cost

    with Engine(tiny_target, draft=tiny_draft, n_ctx=256, n_threads=2, learned=False) as e:
        per_seq = context.kv_cache_bytes(e.target, 256) + context.kv_cache_bytes(e.draft_model, 256)
        monkeypatch.setattr(e.target, "offloaded", offloaded)
        host, gpu = (2 * 3 * per_seq, 1 << 40) if not offloaded else (1 << 40, 2 * 3 * per_seq)
        monkeypatch.setattr(context, "available_memory", lambda: host)
        gpus = [rpc.Device(1, "CUDA0", "", "gpu", gpu // 2, 1 << 34),
                rpc.Device(2, "CUDA1", "", "gpu", gpu - gpu // 2, 1 << 34),
                rpc.Device(3, "RPC0", "h:1", "gpu", 1 << 40, 1 << 40)]  # (a remote server's: not here)
        monkeypatch.setattr(rpc, "devices", lambda: gpus)
        assert batch_cost.auto_parallel(e) == 3
        monkeypatch.setattr(rpc, "devices", lambda: [])  # no device known: the cap
        assert batch_cost.auto_parallel(e) == (8 if offloaded else 3)


def test_a_sequence_at_the_end_of_its_context_shares_a_round_with_long_drafts(tiny_target):
    """A round pads every window to its k + 1 rows; a sequence with less room than that (its
    own draft kept within it) must not be padded past its context: the whole round failed
    ("the context is full") for every sequence sharing it.  Now it ends at its full context
    with the tokens of a lone run, and the sequence drafting alongside goes on."""
    from mars_local.speculate.drafters import Draft, Drafter

    class Long(Drafter):  # always k tokens (mostly rejected: the round still has k + 1 rows)
        def propose(self, tokens, k, extend=None):
            return Draft([7] * k, None)

    with Engine(tiny_target, drafter="ngram", n_ctx=256, n_threads=2, learned=False,
                drafter_factory=lambda cfg, seed, controls: Long()) as eng:
        assert eng.n_ctx == 256
        long = eng.tokenize("the quick brown fox jumps over the lazy dog " * 40)[:256 - 6]
        alone = eng.generate(long, max_tokens=-1, temperature=0, ignore_eos=True, draft_max=0)
        assert alone.stats.stop_reason == "context"
        sched = Scheduler(eng, 2)
        a = sched.submit(long, max_tokens=-1, temperature=0, ignore_eos=True, draft_max=0)
        b = sched.submit("item 1: and", max_tokens=24, temperature=0, ignore_eos=True, adaptive=False,
                         draft_max=12, verify="strict")
        while not (a.finished and b.finished):
            sched.step()
        ra, rb = a.result(), b.result()
        assert ra.stats.stop_reason == "context" and ra.tokens == alone.tokens
        assert rb.stats.n_drafted >= 12 and rb.tokens == plain(eng, "item 1: and", 24)


def test_the_prompts_time_is_set_only_once_its_prefill_has_ended(engines):
    """What the server's cached_tokens relies on: time_prompt_target_s stays 0 for a sequence
    closed before its prompt was evaluated (waiting for a slot, or between chunks), and is set
    for one whose prefill ended."""
    eng = engines["model"]
    sched = Scheduler(eng, 1)
    sched.mc.n_batch = 16  # (chunks of 16 rows: a 60-token prompt takes rounds)
    long = eng.tokenize("the quick brown fox jumps over the lazy dog " * 6)[:60]
    a = sched.submit(long, max_tokens=4, temperature=0, ignore_eos=True)
    b = sched.submit("item 1: and", max_tokens=4, temperature=0, ignore_eos=True)  # waits for a's slot
    sched.step()
    assert 0 < a.stats.n_prompt_evaluated < 59 and a.stats.time_prompt_target_s == 0
    a.close()
    b.close()
    sched.step()
    assert a.finished and b.finished and a.stats.time_prompt_target_s == 0 == b.stats.time_prompt_target_s
    c = sched.submit("item 2: and", max_tokens=4, temperature=0, ignore_eos=True)
    c.result()
    assert c.stats.time_prompt_target_s > 0 and c.stats.n_prompt_evaluated > 0


def test_a_sequence_that_fails_as_it_joins_ends_alone_and_frees_its_slot(tiny_target):
    """Its drafter cannot be made (here: a factory that fails for some requests): that sequence
    ends with the error, the others joining with it go on, and its slot is free again.  The
    slot was taken before the failure and never given back, and the requests popped with it
    were lost: after --parallel such failures nothing was admitted again."""
    from mars_local.speculate.drafters import Drafter

    def factory(cfg, seed, controls):
        if cfg.max_tokens == 5:
            raise MarsError("no drafter for you")
        return Drafter()

    with Engine(tiny_target, drafter="ngram", n_ctx=256, n_threads=2, learned=False,
                drafter_factory=factory) as eng:
        sched = Scheduler(eng, 2)
        bad = [sched.submit(f"bad {i}", max_tokens=5, temperature=0) for i in range(3)]
        good = [sched.submit(p, max_tokens=8, temperature=0, ignore_eos=True) for p in PROMPTS[:3]]
        for _ in range(200):
            if all(x.finished for x in bad + good):
                break
            sched.step()
        for x in bad:
            with pytest.raises(MarsError, match="no drafter"):
                x.result()
        assert [x.result().tokens for x in good] == [plain(eng, p, 8) for p in PROMPTS[:3]]
        assert sorted(sched._free) == [0, 1] and not sched._live


def test_a_timing_forward_that_fails_leaves_no_rows_behind(engines, monkeypatch):
    """Timing a round's shape (a probe before a switch to drafting) adds rows to live sequences'
    cells and rolls them back.  Where a decode failed after rows were added (a later group of a
    split forward), they stayed: the probe's error is swallowed and the round went on with
    cells past its tokens (its verify rows then read from the wrong positions)."""
    eng = engines["model"]
    sched = Scheduler(eng, 2)
    views = [sched.mc.seq(i) for i in range(2)]
    for v, p in zip(views, PROMPTS[:2]):
        v.eval(eng.tokenize(p), n_out=0)
    held = [(v.n_past, list(v.tokens)) for v in views]
    real = sched.mc.decode_windows

    def fails_after(windows, *a, **kw):
        real(windows, *a, **kw)
        raise RuntimeError("the second group failed")

    monkeypatch.setattr(sched.mc, "decode_windows", fails_after)
    with pytest.raises(RuntimeError):
        sched._time_views([(v, v.tokens[-1]) for v in views], 4, 1.0)
    assert [(v.n_past, list(v.tokens)) for v in views] == held
    sched.close()


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_a_chats_next_turn_keeps_its_conversation_and_stays_exact(engines, drafter):
    """A chat's next turn is its conversation so far plus a new message.  Batched, its prompt
    (over 64 tokens: one wide chunk) was evaluated again at every turn, as the old prompt's
    chunk ended elsewhere (10x the time to first token of a lone server on the Q4_K_M stand-in,
    BENCHMARKS.md run 36).  Where the warm-up measured that this target's wide chunks compute
    rows alike (as on every CPU build measured), the turn keeps all but the last 65 rows, and
    its strict greedy output still equals a lone run of the whole prompt from an empty cache."""
    from mars_local import GenerateConfig

    eng = engines[drafter]
    sched = Scheduler(eng, 2)
    sched.warm_up(GenerateConfig.make(verify="strict"))
    assert sched.wide_alike is not None  # measured (True on every CPU build measured so far)
    system = eng.tokenize("the quick brown fox jumps over the lazy dog " * 12)[:100]
    first = sched.submit(system, max_tokens=12, temperature=0, ignore_eos=True, verify="strict").result()
    turn = system + first.tokens + eng.tokenize(" and then the dog")[:6]
    second = sched.submit(turn, max_tokens=16, temperature=0, ignore_eos=True, verify="strict").result()
    if sched.wide_alike:
        assert second.stats.n_prompt_evaluated < len(turn) - 40  # the conversation's cells kept
    eng.reset()
    assert second.tokens == plain(eng, turn, 16)  # exactly a lone run's, from an empty cache
    cold = Scheduler(eng, 2)
    cold.wide_alike = False  # (not measured: the old rule)
    cold.submit(system, max_tokens=12, temperature=0, ignore_eos=True, verify="strict").result()
    again = cold.submit(turn, max_tokens=16, temperature=0, ignore_eos=True, verify="strict").result()
    assert again.stats.n_prompt_evaluated == len(turn) - 1 and again.tokens == second.tokens
    sched.close()
    cold.close()


def test_the_wide_chunk_probe_is_not_made_on_a_gpu_nor_where_the_chunk_does_not_fit(engines, monkeypatch):
    """A GPU's kernels are chosen by shape (two lengths prove little there), and a context or
    batch smaller than the probe's chunk cannot run it: not measured, reuse stays as without it."""
    eng = engines["ngram"]
    monkeypatch.setattr(eng.target, "offloaded", True)
    sched = Scheduler(eng, 2)
    assert sched._probe_wide() is None
    monkeypatch.undo()
    assert sched._probe_wide() is not None and [sched.mc.seq(i).n_past for i in range(2)] == [0, 0]
    sched.mc.n_batch = 64
    assert sched._probe_wide() is None
    sched.close()
    # a verdict kept by a CPU run of the same build and models is not taken up on a GPU either
    monkeypatch.setattr(eng.controllers, "batch_state", lambda: {"wide_alike": True})
    monkeypatch.setattr(eng.target, "offloaded", True)
    gpu = Scheduler(eng, 2)
    assert gpu.wide_alike is None
    gpu.wide_alike = True  # (however it got there, reuse on a GPU keeps the old rule)
    gpu.mc.seq(0).tokens = list(range(300))
    gpu._prompt_len[0] = 299
    assert gpu._reuse(0, list(range(305))) == 0
    monkeypatch.undo()
    gpu.mc.seq(0).tokens = []
    gpu.close()

"""The adaptive draft-length controller on simulated costs and acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from mars_local.speculate.adaptive import AdaptiveK, expected_tokens
from mars_local.speculate.run import catch_up_excess


@pytest.mark.parametrize(
    "a,k,want", [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 1, 1.5), (0.5, 2, 1.75), (0.9, 0, 1.0)]
)
def test_expected_tokens(a, k, want):
    assert expected_tokens(a, k) == pytest.approx(want)


def simulate(ctrl, cost, accept, rounds=600, draft_cost=0.0, seed=0, k_fixed=None):
    """Run the controller (or a fixed k) against a cost model; return tokens/s and ks."""
    rng = np.random.default_rng(seed)
    tokens, elapsed, ks = 0, 0.0, []
    for _ in range(rounds):
        k = k_fixed if k_fixed is not None else ctrl.choose(8)
        m = 0
        while m < k and rng.random() < accept:
            m += 1
        t_target = cost(k + 1) * rng.uniform(0.95, 1.05)
        t_draft = draft_cost * k
        if ctrl is not None and k_fixed is None:
            ctrl.observe(k, m, t_target, t_draft)
        tokens += m + 1
        elapsed += t_target + t_draft
        ks.append(k)
    return tokens / elapsed, ks


def cpu(w):  # a linear CPU cost
    return 0.0061 + 0.0032 * (w - 1)


def cpu_measured(w):  # SmolLM2-135M on 2 cores: the 2nd row costs 0.71 of a token, each next 0.41
    return 0.0076 if w == 1 else 0.0076 * (1.71 + 0.41 * (w - 2))


def gpu(w):  # a window costs barely more than one token
    return 0.010 + 0.0002 * (w - 1)


def best_fixed(cost, accept, draft_cost=0.0):
    return max(simulate(None, cost, accept, k_fixed=k, draft_cost=draft_cost)[0] for k in range(0, 9))


@pytest.mark.parametrize(
    "cost,accept,draft_cost",
    [(cpu, 0.2, 0.0), (cpu, 0.6, 0.0), (cpu, 0.95, 0.0), (gpu, 0.5, 0.001), (gpu, 0.85, 0.001), (cpu, 0.9, 0.002),
     (cpu_measured, 0.5, 0.0), (cpu_measured, 0.9, 0.0)],
)
def test_adaptive_is_close_to_the_best_fixed_k(cost, accept, draft_cost):
    rate, _ = simulate(AdaptiveK(k_max=8, gpu=cost is gpu), cost, accept, draft_cost=draft_cost)
    assert rate >= 0.95 * best_fixed(cost, accept, draft_cost)


def test_never_much_slower_than_plain_when_drafts_are_useless():
    plain, _ = simulate(None, cpu, 0.0, k_fixed=0)
    rate, ks = simulate(AdaptiveK(k_max=8), cpu, 0.05)
    assert rate >= 0.97 * plain
    assert np.mean(np.array(ks) > 0) < 0.05  # probes are rare


def test_speculates_long_windows_when_they_are_cheap():
    _, ks = simulate(AdaptiveK(k_max=8, gpu=True), gpu, 0.9, draft_cost=0.0005)
    assert np.mean(ks[100:]) > 5


def test_shadow_observations_raise_the_acceptance_estimate():
    ctrl = AdaptiveK(k_max=4)
    before = ctrl.acceptance()
    for _ in range(30):
        ctrl.observe_shadow(True)
    assert ctrl.acceptance() > before and ctrl.acceptance() > 0.9
    for _ in range(60):
        ctrl.observe_shadow(False)
    assert ctrl.acceptance() < 0.5


def test_keys_are_estimated_separately_and_longer_matches_inherit():
    ctrl = AdaptiveK(k_max=4)
    for _ in range(40):
        ctrl.observe_shadow(False, key=1)
        ctrl.observe_shadow(True, key=3)
    assert ctrl.acceptance(1) < 0.1 and ctrl.acceptance(3) > 0.9
    # an unseen longer match starts from the shorter one's estimate
    assert ctrl.acceptance(4) == pytest.approx(ctrl.acceptance(3))
    # a rejection is counted at its position only; later positions are unseen
    ctrl.observe(3, 1, 0.01, 0.0, keys=[3, 4, 5])
    assert ctrl._counts[4][1] == 1.0 and 5 not in ctrl._counts


# n-gram-like drafts: a match of length n (0: none, no draft) whose i-th token
# carries key n+i; acceptance grows with the key.
MATCH = {0: 0.45, 1: 0.40, 2: 0.08, 3: 0.07}
ACCEPT = {1: 0.2, 2: 0.5, 3: 0.8, 4: 0.9, 5: 0.9}


def simulate_keyed(ctrl, rounds=3000, seed=0, k_fixed=None, k_of_match=None, cost=cpu_measured):
    rng = np.random.default_rng(seed)
    tokens, elapsed, ks = 0, 0.0, []
    for _ in range(rounds):
        n = int(rng.choice(list(MATCH), p=list(MATCH.values())))
        keys = [min(n + i, 5) for i in range(8)] if n else []
        if k_fixed is not None:
            k = k_fixed
        elif k_of_match is not None:
            k = k_of_match[n]
        else:
            k = ctrl.choose(8, keys)
        k = min(k, len(keys))
        m = 0
        while m < k and rng.random() < ACCEPT[keys[m]]:
            m += 1
        t = cost(k + 1) * rng.uniform(0.95, 1.05)
        if ctrl is not None:
            ctrl.observe(k, m, t, 0.0, keys[:k])
            if k == 0 and keys:
                ctrl.observe_shadow(rng.random() < ACCEPT[keys[0]], keys[0])
        tokens += m + 1
        elapsed += t
        ks.append((n, k))
    return tokens / elapsed, ks


def oracle_k(cost=cpu_measured):
    """The best k for each match length, knowing the true acceptance and cost."""
    best = {}
    for n in MATCH:
        acc = [ACCEPT[min(n + i, 5)] for i in range(8)] if n else []
        best[n] = max(range(len(acc) + 1), key=lambda k: expected_tokens(acc[:k]) / cost(k + 1))
    return best


def test_keyed_choice_is_close_to_the_oracle_and_beats_every_fixed_k():
    plain, _ = simulate_keyed(None, k_fixed=0)
    best_fixed_k = max(simulate_keyed(None, k_fixed=k)[0] for k in range(1, 9))
    oracle, _ = simulate_keyed(None, k_of_match=oracle_k())
    rate, ks = simulate_keyed(AdaptiveK(k_max=8))
    assert oracle > 1.02 * plain  # the regime rewards speculating on long matches only
    assert rate >= 0.98 * oracle
    assert rate > max(plain, best_fixed_k)
    ks = np.array(ks[500:])
    # speculates on long matches, not on 1-token matches
    assert ks[ks[:, 0] == 3, 1].mean() >= 3
    assert (ks[ks[:, 0] == 1, 1] > 0).mean() < 0.05


def test_first_forward_of_a_window_size_is_not_timed():
    ctrl = AdaptiveK(k_max=4)
    ctrl.observe(0, 0, 0.050, 0.0)  # graph build for a new batch shape: slow once
    assert ctrl.target_cost(1) is None
    ctrl.observe(0, 0, 0.010, 0.0)
    ctrl.observe(1, 1, 0.090, 0.0, keys=[3])
    assert ctrl.target_cost(1) == pytest.approx(0.010)
    assert ctrl.target_cost(2) == pytest.approx(0.0175)  # still the prior (1.75 tokens)
    ctrl.observe(1, 1, 0.016, 0.0, keys=[3])
    ctrl.observe(1, 1, 0.100, 0.0, keys=[3])  # a busy machine: clipped to 1.5x the mean
    assert ctrl.target_cost(2) < 0.021


def test_probes_of_a_cheap_drafter_stop_once_the_window_cost_is_known():
    ctrl = AdaptiveK(k_max=4, probe_start=100.0)  # a budget that never runs out
    ks = []
    for _ in range(200):
        k = ctrl.choose(4, [1, 2, 3, 4])
        m = 0
        ctrl.observe(k, m, 0.010 * (1 + 0.8 * k), 0.0, [1, 2, 3, 4][:k])
        if k == 0:
            ctrl.observe_shadow(False, 1)
        ks.append(k)
    assert 0 < sum(1 for k in ks if k) <= 4  # the warm-up forward plus two timed ones, at most one size more


def test_confidence_keys_are_ordered_buckets():
    from mars_local.speculate.adaptive import confidence_key

    keys = [confidence_key(p) for p in (0.05, 0.3, 0.5, 0.7, 0.85, 0.92, 0.97, 0.99, 0.999)]
    assert keys == [f"p{i}" for i in range(9)]


def _warm(ctrl, cost):
    for w in range(1, ctrl.k_max + 2):
        for _ in range(2):
            ctrl.observe_forward(w, cost(w))


def test_extend_drafts_on_while_confident_and_stops_on_an_unsure_token():
    """A draft model on a cheap-window target: confident tokens are worth
    verifying, an unsure one is not, and trim drops it."""
    ctrl = AdaptiveK(k_max=8, gpu=True)
    _warm(ctrl, gpu)
    for _ in range(300):
        ctrl.observe_shadow(True, key="p8")
        ctrl.observe_shadow(False, key="p0")
    ctrl.observe(0, 0, gpu(1), 0.0)
    assert ctrl.choose(8) > 0
    assert ctrl.extend(["p8"] * 3, 8)
    assert not ctrl.extend(["p8"] * 8, 8)  # the cap
    assert ctrl.trim(["p8", "p8", "p8", "p0"]) == 3
    # on a CPU-like curve where each row costs much more, a run of unsure tokens stops drafting
    cpu_ctrl = AdaptiveK(k_max=8)
    _warm(cpu_ctrl, cpu_measured)
    cpu_ctrl._counts = {k: list(v) for k, v in ctrl._counts.items()}
    cpu_ctrl.choose(8)
    assert not cpu_ctrl.extend(["p0", "p0"], 8)
    assert cpu_ctrl.trim(["p0", "p0"]) == 0


def simulate_confidence(ctrl, cost, rounds=800, seed=0, k_fixed=None, draft_cost=0.0012):
    """A draft model whose tokens are confident (accepted 95 %) or unsure (30 %);
    the controller starts as the engine starts it: window costs timed once."""
    rng = np.random.default_rng(seed)
    if ctrl is not None:
        for w in (1, 2, 3, 5, 9):
            for _ in range(2):
                ctrl.observe_forward(w, cost(w))
    tokens, elapsed = 0, 0.0
    for _ in range(rounds):
        conf = ["p8" if rng.random() < 0.75 else "p1" for _ in range(8)]
        acc = [rng.random() < (0.95 if c == "p8" else 0.3) for c in conf]
        if k_fixed is not None:
            k, drafted = k_fixed, k_fixed
        elif ctrl.choose(8) > 0:
            drafted = 1
            while drafted < 8 and ctrl.extend(conf[:drafted], 8):
                drafted += 1
            k = ctrl.trim(conf[:drafted])
        else:
            k = drafted = 0
        m = 0
        while m < k and acc[m]:
            m += 1
        t = cost(k + 1) * rng.uniform(0.97, 1.03)
        if ctrl is not None and k_fixed is None:
            ctrl.observe(k, m, t, draft_cost * drafted, conf[:k], drafted=drafted)
        tokens += m + 1
        elapsed += t + draft_cost * drafted
    return tokens / elapsed


@pytest.mark.parametrize("cost", [gpu, cpu_measured, lambda w: 0.125 * (1 + 0.2 * (w - 1))])
def test_confidence_stopping_beats_every_fixed_k(cost):
    best = max(simulate_confidence(None, cost, k_fixed=k) for k in range(0, 9))
    rate = simulate_confidence(AdaptiveK(k_max=8, gpu=cost is gpu), cost)
    assert rate >= 0.97 * best


def test_a_probe_is_verified_whole_so_acceptance_is_learned():
    """When plain decoding looks best (pessimistic prior, windows that cost
    more than their expected tokens) a probe still drafts and verifies its
    planned length; trim must not throw it away, or acceptance is never seen."""
    cost = lambda w: 0.085 * (1.0 if w == 1 else 1.5 + 0.35 * (w - 2))  # noqa: E731
    ctrl = AdaptiveK(k_max=8)
    for w in (1, 2, 3, 5, 9):
        for _ in range(2):
            ctrl.observe_forward(w, cost(w))
    ctrl._draft[:] = [0.012, 1.0]
    ctrl.observe(0, 0, cost(1), 0.0)  # primes the probe budget
    verified = 0
    for _ in range(40):
        k = ctrl.choose(8)
        if k:
            drafted = 1
            while ctrl.extend(["p5"] * drafted, 8):
                drafted += 1
            kept = ctrl.trim(["p5"] * drafted)
            assert kept >= k
            verified += kept
            ctrl.observe(kept, kept, cost(kept + 1), 0.012 * drafted, ["p5"] * kept, drafted=drafted)
        else:
            ctrl.observe(0, 0, cost(1), 0.0)
    assert verified > 0 and ctrl.acceptance("p5") > 0.5
    assert ctrl.choose(8) > 0  # having seen every probe accepted, it speculates


def test_regimes_share_window_and_draft_timings():
    """Strict and MARS controllers of one engine see the same target and draft:
    a draft cost learned by one is the other's (it was 0 for the second)."""
    a, b = AdaptiveK(k_max=4), AdaptiveK(k_max=4)
    b.share_costs(a)
    for _ in range(3):
        a.observe(0, 0, 0.010, 0.0)
        a.observe(2, 1, 0.014, 0.006, drafted=2)
    assert b.draft_cost == pytest.approx(a.draft_cost) == pytest.approx(0.003)
    assert b.target_cost(3) == a.target_cost(3)
    assert b.needs_calibration() and a.needs_calibration()  # sizes 1 and 3 only
    a.observe_forward(2, 0.012)
    a.observe_forward(2, 0.012)
    assert not b.needs_calibration()


def standin_cost(w):  # the K-quant stand-in on an AVX2 EPYC, 2 threads: windows cost ~2x a row
    return 0.1 if w == 1 else 0.1 * (1.67 + 0.34 * (w - 2))


def simulate_lagging_draft(ctrl, accept, rounds=300, seed=0, fold=False, busy=(), draft_row=0.0145, catch_row=0.0045):
    """A draft model that, like ModelDrafter, evaluates the tokens it lacks (one per plain
    round) in the first evaluation of its next draft: ``catch_row`` seconds per extra row.
    The engine splits that evaluation with ``catch_up_excess``; ``fold`` counts it all as
    drafting time instead.  Forwards of windows cost twice as much in the ``busy`` rounds.
    Returns each round's k."""
    rng = np.random.default_rng(seed)
    pending, ks = 1, []
    for r in range(rounds):
        k = ctrl.choose(8)
        m, t_draft, switch = 0, 0.0, 0.0
        if k:
            t_first = draft_row + catch_row * (pending - 1)
            t_draft = t_first + draft_row * (k - 1)
            switch = 0.0 if fold else catch_up_excess(pending, t_first)
            while m < k and rng.random() < accept:
                m += 1
        t_target = standin_cost(k + 1) * (2.0 if k and r in busy else 1.0) * rng.uniform(0.95, 1.05)
        ctrl.observe(k, m, t_target, t_draft - switch, drafted=k)
        pending = (2 if m == k else 1) if k else pending + 1
        ks.append(k)
    return ks


@pytest.mark.parametrize("rows,seconds,want", [(1, 0.01, 0.0), (2, 0.02, 0.0), (3, 0.03, 0.01), (50, 0.25, 0.24)])
def test_catch_up_excess_is_what_a_drafting_round_would_not_evaluate(rows, seconds, want):
    assert catch_up_excess(rows, seconds) == pytest.approx(want)


def test_a_draft_models_catch_up_is_not_taken_for_a_cost_per_drafted_token():
    """Windows that cost ~2x a row (the K-quant stand-in on 2 AVX2 cores), a draft accepted
    90 % (drafting pays 1.24x), and a busy minute in which windows cost twice as much, so
    that the controller decodes plainly for a while.  A probe made after plain rounds
    first catches the draft model up on them; counted as drafting time, 50 rows evaluated
    to draft 2 tokens made a draft token look 10-20x dearer than it is and the controller
    never drafted again (the K-quant stand-in's head-to-head: both adaptive rows decoded
    plainly where fixed k = 4 paid; 150 ms per drafted token learned, 15 ms true)."""
    trapped = 0
    for seed in range(8):
        ctrl = AdaptiveK(k_max=8)
        ks = simulate_lagging_draft(ctrl, 0.9, rounds=500, seed=seed, busy=range(50, 110))
        assert np.mean(np.array(ks[-200:]) > 0) > 0.9, seed
        assert ctrl.draft_cost < 0.025, seed
        before = AdaptiveK(k_max=8)  # the accounting before: the catch-up in the draft time
        ks = simulate_lagging_draft(before, 0.9, rounds=500, seed=seed, busy=range(50, 110), fold=True)
        trapped += np.mean(np.array(ks[-200:]) > 0) < 0.1 and before.draft_cost > 0.1
    assert trapped >= 2


def test_a_draft_cost_learned_far_too_high_is_measured_again():
    """A learned state that says a draft token costs 340 ms (learned on a loaded machine; the
    draft really costs 14.5 ms): a probe's price counts a draft token at one plain forward at
    most, so probes still come, their fresh timings outweigh the stale figure, and the
    controller drafts again.  (It stayed plain for good: every probe looked dearer than the
    probe budget, two plain forwards, could ever hold.)"""
    for seed in range(4):
        ctrl = AdaptiveK(k_max=8)
        ctrl.import_state({"draft": [6.8, 20.0], "counts": [["__pooled__", 18.0, 2.0]]})
        for w in (1, 2, 3, 5, 9):
            ctrl.observe_forward(w, standin_cost(w))
            ctrl.observe_forward(w, standin_cost(w))
        ks = simulate_lagging_draft(ctrl, 0.9, rounds=500, seed=seed)
        assert np.mean(np.array(ks[-200:]) > 0) > 0.9, seed
        assert ctrl.draft_cost < 0.025, seed


def test_one_draft_far_cheaper_than_the_learned_figure_replaces_it():
    """Noise only adds time: a probe that drafts at 15 ms a token against a learned 340 ms is
    the truth about the figure, which gives way at once (it took several probes, a few
    hundred rounds apart, to wear down)."""
    ctrl = AdaptiveK(k_max=8)
    ctrl.import_state({"draft": [6.8, 20.0]})
    ctrl.observe(2, 2, 0.15, 0.03)
    assert ctrl.draft_cost < 0.05


def test_a_stray_slow_draft_counts_at_most_half_again_the_mean():
    ctrl = AdaptiveK(k_max=8)
    for _ in range(10):
        ctrl.observe(2, 2, 0.1, 0.03)  # 15 ms a token
    ctrl.observe(2, 2, 0.1, 3.0)  # a draft while the machine was busy: 1.5 s a token
    assert ctrl.draft_cost < 0.02


def test_a_window_size_timed_while_the_machine_was_busy_gives_way_to_a_fresh_timing():
    """Twenty 5-row forwards timed at twice their cost, then 200 plain forwards: the next
    5-row forward (a probe) outweighs them, or the controller would keep believing the
    busy figure and stay plain."""
    ctrl = AdaptiveK(k_max=8)
    for w in (1, 2, 5):
        ctrl.observe_forward(w, standin_cost(w))  # warm-up forwards are not timed
    for _ in range(20):
        ctrl.observe_forward(5, 2 * standin_cost(5))
    for _ in range(200):
        ctrl.observe(0, 0, standin_cost(1), 0.0)
    ctrl.observe_forward(5, standin_cost(5))
    assert ctrl.target_cost(5) < 1.35 * standin_cost(5)

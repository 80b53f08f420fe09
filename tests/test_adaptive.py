"""The adaptive draft-length controller on simulated costs and acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from mars_local.adaptive import AdaptiveK, expected_tokens


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


def cpu(w):  # measured shape on a 2-core CPU: ~linear in the window
    return 0.0061 + 0.0032 * (w - 1)


def gpu(w):  # a window costs barely more than one token
    return 0.010 + 0.0002 * (w - 1)


def best_fixed(cost, accept, draft_cost=0.0):
    return max(simulate(None, cost, accept, k_fixed=k, draft_cost=draft_cost)[0] for k in range(0, 9))


@pytest.mark.parametrize(
    "cost,accept,draft_cost",
    [(cpu, 0.2, 0.0), (cpu, 0.6, 0.0), (cpu, 0.95, 0.0), (gpu, 0.5, 0.001), (gpu, 0.85, 0.001), (cpu, 0.9, 0.002)],
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
    before = ctrl.acceptance
    for _ in range(30):
        ctrl.observe_shadow(True)
    assert ctrl.acceptance > before and ctrl.acceptance > 0.9
    for _ in range(60):
        ctrl.observe_shadow(False)
    assert ctrl.acceptance < 0.5


def test_first_round_is_plain_and_limit_is_respected():
    ctrl = AdaptiveK(k_max=8, gpu=True)
    assert ctrl.choose() == 0
    for _ in range(20):
        ctrl.observe(0, 0, 0.01, 0.0)
        ctrl.observe_shadow(True)
    assert ctrl.choose(3) <= 3
    assert ctrl.choose(0) == 0

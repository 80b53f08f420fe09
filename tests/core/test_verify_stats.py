"""Whole-generation statistics of the sampling rules: chi-square tests.

tests/test_verify.py checks the first token of one k = 1 window.  Here a
synthetic target and drafter (bigram models over a 5-token vocabulary: the
logits after token a are TARGET[a], the drafter's DRAFTER[a]) are run through
the speculative loop the engine runs (draft k tokens, verify the window, keep
the accepted prefix plus the target's token, repeat), with k = 2 and 4,
drafts sampled from q != p (or chosen greedily), and the sampling pipeline
plain or truncated (top-k, top-p and min-p all on).  For the strict rule the
generated sequence must be distributed exactly as plain sampling from the
target's truncated p at each position, so two chi-square statistics are
compared with that law:

* the joint distribution of the first two generated tokens (25 cells);
* every bonus token (emitted when all k drafts were accepted) given the token
  before it: it must follow p(. | that token); one chi-square per previous
  token, summed.

Cells whose expected count is below 5 are pooled; a count in a cell of
expected count 0 (a token the pipeline truncated away) rejects outright.  The
test passes at p > 1e-3 for the real rule, and the same statistic must reject
(p < 1e-8) deliberately broken rules: the bonus token drawn from the wrong
row (the last draft's row, k - 1, instead of row k) or uniformly, and the
correction drawn from p instead of the residual (p - q)+.  Seeds are fixed,
so every run sees the same draws.

The loop here is a model of the engine's (a bigram "target" cannot be a
llama.cpp model): it keeps these tests pure, runs 3,000 generations per case
in a second, and lets a broken rule be swapped in.  The real loop is held to
the same law through its seams in tests/speculate: the first token
(test_engine.py) and the second, whose history holds a draft
(test_controls.py), of thousands of seeded generations on the tiny model.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2

from mars_local.core.sampling import SamplingParams, probabilities, sample_from
from mars_local.core.verify import VerifyConfig, VerifyResult, verify

V = 5
START = 0  # the prompt's last token
TARGET = (np.random.default_rng(2024).standard_normal((V, V)) * 1.5).astype(np.float32)
DRAFTER = (TARGET + np.random.default_rng(2025).standard_normal((V, V)) * 0.8).astype(np.float32)

PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
TRUNCATED = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05)
PIPELINES = {"plain": PLAIN, "truncated": TRUNCATED}
STRICT = VerifyConfig("strict")

N = 3000  # generations per test
P_PASS = 1e-3
P_BROKEN = 1e-8


def law(params: SamplingParams) -> np.ndarray:
    """P[a] = the target's p after token a (truncated, tempered)."""
    return probabilities(TARGET, params)


# ------------------------------------------------------------------ rules
def strict_rule(logits, draft, params, u, q) -> VerifyResult:
    return verify(logits, draft, STRICT, params, None, q, u)


def bonus_from_the_wrong_row(logits, draft, params, u, q) -> VerifyResult:
    """Broken: the bonus token is drawn from row k - 1 (the last draft's)."""
    res = strict_rule(logits, draft, params, u, q)
    k = len(draft)
    if res.n_accepted == k:
        res.tokens[-1] = sample_from(probabilities(logits[k - 1], params), u[k, 0])
    return res


def uniform_bonus(logits, draft, params, u, q) -> VerifyResult:
    """Broken: the bonus token is uniform over the vocabulary."""
    res = strict_rule(logits, draft, params, u, q)
    if res.n_accepted == len(draft):
        res.tokens[-1] = min(int(u[len(draft), 0] * V), V - 1)
    return res


def correction_from_p(logits, draft, params, u, q) -> VerifyResult:
    """Broken: a rejected sampled draft is replaced by a draw from p, not (p - q)+."""
    res = strict_rule(logits, draft, params, u, q)
    m = res.n_accepted
    if m < len(draft):
        res.tokens[-1] = sample_from(probabilities(logits[m], params), u[m, 1])
    return res


# ------------------------------------------------------------- the loop
def generate(rule, k: int, params: SamplingParams, sampled: bool, rng: np.random.Generator, q_law: np.ndarray):
    """One generation of at least 2 tokens after START; returns (the first two
    tokens, [(token before the bonus, bonus), ...]).  q_law[a]: the drafter's q
    after token a."""
    tokens: list[int] = []
    bonuses = []
    prev = START
    while len(tokens) < 2:
        draft, q, a = [], [], prev
        for _ in range(k):
            a = sample_from(q_law[a], rng.random()) if sampled else int(DRAFTER[a].argmax())
            draft.append(a)
            q.append(q_law[draft[-2] if len(draft) > 1 else prev])
        logits = TARGET[[prev] + draft]
        res = rule(logits, np.array(draft), params, rng.random((k + 1, 2)), np.stack(q) if sampled else None)
        if res.n_accepted == k:
            bonuses.append((draft[-1], res.tokens[-1]))
        tokens += res.tokens
        prev = tokens[-1]
    return tokens[:2], bonuses


def chisq(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, cells of expected < 5 pooled."""
    counts, expected = counts.ravel().astype(float), expected.ravel()
    if counts[expected == 0].sum() > 0:
        return np.inf, 1  # an impossible outcome happened
    small = (expected > 0) & (expected < 5)
    c = np.append(counts[expected >= 5], counts[small].sum())
    e = np.append(expected[expected >= 5], expected[small].sum())
    if e[-1] == 0:
        c, e = c[:-1], e[:-1]
    return float(((c - e) ** 2 / e).sum()), len(e) - 1


def p_value(rule, k: int, params: SamplingParams, sampled: bool = True, seed: int = 2) -> float:
    """p-value of the two statistics, summed, against plain sampling's law."""
    rng = np.random.default_rng([seed, k, int(sampled), int(params.top_k)])
    P = law(params)
    q_law = probabilities(DRAFTER, params)  # the drafter's q: same pipeline, other logits
    first_two = np.zeros((V, V))
    bonus = np.zeros((V, V))
    for _ in range(N):
        (a, b), bonuses = generate(rule, k, params, sampled, rng, q_law)
        first_two[a, b] += 1
        for prev, t in bonuses:
            bonus[prev, t] += 1
    stat, df = chisq(first_two, N * P[START][:, None] * P)
    for prev in range(V):
        if bonus[prev].sum():
            s, d = chisq(bonus[prev], bonus[prev].sum() * P[prev])
            stat, df = stat + s, df + d
    assert bonus.sum() >= 50, "too few bonus tokens for the test to see them"
    return float(chi2.sf(stat, df))


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "deterministic"])
def test_strict_generations_follow_plain_sampling(k, pipeline, sampled):
    assert p_value(strict_rule, k, PIPELINES[pipeline], sampled) > P_PASS


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("broken", [bonus_from_the_wrong_row, uniform_bonus, correction_from_p],
                         ids=lambda f: f.__name__)
def test_the_same_statistic_rejects_broken_rules(broken, k, pipeline):
    assert p_value(broken, k, PIPELINES[pipeline]) < P_BROKEN


def test_mars_is_visibly_lossy_where_the_target_is_undecided():
    """MARS accepts undecided runner-ups outright, so its generations do not
    follow plain sampling, and the statistic sees it (a sanity check of the
    statistic on a real, documented deviation)."""
    mars = VerifyConfig("mars", theta=0.5)  # TARGET rows have z1 > 0 and several r > 0.5

    def rule(logits, draft, params, u, q):
        return verify(logits, draft, mars, params, None, q, u)

    assert p_value(rule, 2, PLAIN, sampled=False) < P_BROKEN

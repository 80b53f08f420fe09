"""Verification rules on crafted logits: readable tables plus statistical tests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from mars_local.core.errors import MarsError
from mars_local.core.sampling import SamplingParams, position_uniforms, probabilities, sample_from
from mars_local.core.verify import VerifyConfig, top2, undecided_mask, verify

V = 8
EOS = 7
GREEDY = SamplingParams(temperature=0.0)


def row(top: dict[int, float], base: float = 1.0) -> np.ndarray:
    """A logits row of `base` everywhere except the given ids."""
    r = np.full(V, base, dtype=np.float32)
    for t, z in top.items():
        r[t] = z
    return r


def window(*rows) -> np.ndarray:
    return np.stack(rows).astype(np.float32)


STRICT = VerifyConfig("strict", eog_ids=(EOS,))
MARS = VerifyConfig("mars", theta=0.9, eog_ids=(EOS,))

# Each row: target top-1 = 3 with logit 10; the runner-up (id 4) decides the margin.
DECIDED = row({3: 10.0, 4: 5.0})  # r = 0.5
UNDECIDED = row({3: 10.0, 4: 9.5})  # r = 0.95 > 0.9
BORDER = row({3: 10.0, 4: 9.0})  # r = 0.9, not > 0.9
BONUS = row({6: 10.0, 5: 2.0})

# fmt: off
GREEDY_TABLE = [
    # name,                        rows,                          draft,   strict (m, tokens),  mars (m, tokens, relaxed)
    ("perfect match",              [DECIDED, DECIDED, BONUS],     [3, 3],  (2, [3, 3, 6]),      (2, [3, 3, 6], 0)),
    ("early mismatch",             [DECIDED, DECIDED, BONUS],     [5, 3],  (0, [3]),            (0, [3], 0)),
    ("top-2, decided",             [DECIDED, DECIDED, BONUS],     [4, 3],  (0, [3]),            (0, [3], 0)),
    ("top-2, undecided",           [UNDECIDED, DECIDED, BONUS],   [4, 3],  (0, [3]),            (2, [4, 3, 6], 1)),
    ("top-2 at ratio == theta",    [BORDER, DECIDED, BONUS],      [4, 3],  (0, [3]),            (0, [3], 0)),
    ("top-3, undecided",           [row({3: 10, 4: 9.5, 5: 9.4}), DECIDED, BONUS], [5, 3], (0, [3]), (0, [3], 0)),
    ("two relaxations chain",      [UNDECIDED, UNDECIDED, BONUS], [4, 4],  (0, [3]),            (2, [4, 4, 6], 2)),
    ("relaxed then mismatch",      [UNDECIDED, DECIDED, BONUS],   [4, 5],  (0, [3]),            (1, [4, 3], 1)),
    ("z1 <= 0 never relaxes",      [row({3: -1.0, 4: -1.05}, base=-5), DECIDED, BONUS], [4, 3], (0, [3]), (0, [3], 0)),
    ("EOS top-1 not replaced",     [row({EOS: 10.0, 4: 9.9}), DECIDED, BONUS], [4, 3], (0, [EOS]), (0, [EOS], 0)),
    ("EOS runner-up not accepted", [row({3: 10.0, EOS: 9.9}), DECIDED, BONUS], [EOS, 3], (0, [3]), (0, [3], 0)),
    ("empty draft = plain",        [BONUS],                       [],      (0, [6]),            (0, [6], 0)),
]
# fmt: on


@pytest.mark.parametrize("name,rows,draft,strict,mars", GREEDY_TABLE, ids=[r[0] for r in GREEDY_TABLE])
def test_greedy_table(name, rows, draft, strict, mars):
    logits = window(*rows)
    s = verify(logits, np.array(draft), STRICT, GREEDY)
    assert (s.n_accepted, s.tokens, s.n_relaxed) == (*strict, 0)
    m = verify(logits, np.array(draft), MARS, GREEDY)
    assert (m.n_accepted, m.tokens, m.n_relaxed) == mars


def test_tie_goes_to_lowest_id_and_counts_as_undecided():
    logits = window(row({3: 10.0, 4: 10.0}), BONUS)
    t1, z1, t2, z2 = top2(logits)
    assert (t1[0], t2[0]) == (3, 4)
    assert verify(logits, np.array([4]), STRICT, GREEDY).tokens == [3]
    assert verify(logits, np.array([4]), MARS, GREEDY).tokens == [4, 6]


def test_top2_leaves_input_unchanged():
    logits = np.random.default_rng(0).standard_normal((5, 100)).astype(np.float32)
    before = logits.copy()
    top2(logits)
    np.testing.assert_array_equal(logits, before)
    ro = before.copy()
    ro.flags.writeable = False
    t1, _, t2, _ = top2(ro)
    assert (t1 != t2).all()


def test_cap_on_relaxed_accepts():
    logits = window(UNDECIDED, UNDECIDED, UNDECIDED, BONUS)
    capped = VerifyConfig("mars", theta=0.9, max_relaxed=1)
    r = verify(logits, np.array([4, 4, 4]), capped, GREEDY)
    assert (r.n_accepted, r.tokens, r.n_relaxed) == (1, [4, 3], 1)
    zero = verify(logits, np.array([4, 4, 4]), VerifyConfig("mars", max_relaxed=0), GREEDY)
    assert zero.tokens == [3]


def test_guards_can_be_switched_off():
    neg = window(row({3: -1.0, 4: -1.05}, base=-5), BONUS)
    loose = VerifyConfig("mars", theta=0.9, require_positive_top1=False)
    # z2/z1 = 1.05 > 0.9 once the sign guard is off: the draft is accepted.
    assert verify(neg, np.array([4]), loose, GREEDY).tokens == [4, 6]


@pytest.mark.parametrize(
    "kw", [dict(theta=0.0), dict(theta=1.5), dict(theta=-0.1), dict(method="lenient"), dict(max_relaxed=-1)]
)
def test_bad_verify_config_is_refused(kw):
    with pytest.raises(MarsError):
        VerifyConfig(**kw)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(0, 6),
    vocab=st.integers(2, 40),
    scale=st.sampled_from([0.5, 3.0, 20.0]),
)
def test_mars_with_theta_one_equals_strict(seed, k, vocab, scale):
    """theta = 1 is above every observable ratio z2/z1 <= 1, so MARS == strict."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((k + 1, vocab)) * scale).astype(np.float32)
    draft = rng.integers(0, vocab, size=k)
    # make some drafts match the argmax so windows get past position 0
    hit = rng.random(k) < 0.6
    draft[hit] = logits[:k].argmax(axis=1)[hit]
    s = verify(logits, draft, VerifyConfig("strict"), GREEDY)
    m = verify(logits, draft, VerifyConfig("mars", theta=1.0), GREEDY)
    assert (m.n_accepted, m.tokens, m.n_relaxed) == (s.n_accepted, s.tokens, 0)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 6), theta=st.floats(0.5, 1.0))
def test_mars_greedy_accepts_a_superset_of_strict(seed, k, theta):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((k + 1, 12)) * 2 + 3).astype(np.float32)
    t1, z1, t2, z2 = top2(logits)
    draft = np.where(rng.random(k) < 0.5, t1[:k], t2[:k])
    s = verify(logits, draft, VerifyConfig("strict"), GREEDY)
    m = verify(logits, draft, VerifyConfig("mars", theta=theta), GREEDY)
    assert m.n_accepted >= s.n_accepted
    assert m.tokens[: s.n_accepted] == s.tokens[: s.n_accepted]
    # every relaxed position really was an undecided runner-up
    mask = undecided_mask(t1, z1, t2, z2, VerifyConfig("mars", theta=theta))
    for i in np.flatnonzero(m.relaxed):
        assert draft[i] == t2[i] and mask[i]


# ------------------------------------------------------------- sampling
def _first_token_counts(p_logits, q, draft_sampled: bool, n: int, cfg, params, seed=1234):
    """Run k=1 windows n times; count the first emitted token."""
    rng = np.random.default_rng(seed)
    vocab = p_logits.shape[1]
    counts = np.zeros(vocab, dtype=np.int64)
    for _ in range(n):
        if draft_sampled:
            d = rng.choice(vocab, p=q)
            res = verify(p_logits, np.array([d]), cfg, params, rng, draft_probs=q[None, :])
        else:
            d = int(np.argmax(q))
            res = verify(p_logits, np.array([d]), cfg, params, rng)
        counts[res.tokens[0]] += 1
    return counts


P_LOGITS = np.array([[2.0, 1.5, 1.0, 0.2, -0.5, 0.0], [0.0] * 6], dtype=np.float32)
Q = np.array([0.05, 0.5, 0.1, 0.2, 0.1, 0.05])
T1 = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampled", [True, False], ids=["sampled-q", "deterministic"])
def test_strict_sampling_preserves_the_target_distribution(draft_sampled):
    n = 20000
    counts = _first_token_counts(P_LOGITS, Q, draft_sampled, n, VerifyConfig("strict"), T1)
    p = probabilities(P_LOGITS[0], T1)
    res = chisquare(counts, p * n)
    assert res.pvalue > 1e-3, (counts, p * n)


def test_statistical_test_detects_a_biased_rule():
    """The same test rejects a rule that is not distribution-preserving:
    the released code's min(1, p/q) on a deterministic draft."""
    n = 20000
    rng = np.random.default_rng(7)
    p = probabilities(P_LOGITS[0], T1)
    d = int(np.argmax(Q))
    counts = np.zeros(6, dtype=np.int64)
    for _ in range(n):
        if rng.random() < min(1.0, p[d] / Q[d]):
            counts[d] += 1
        else:
            r = p.copy()
            r[d] = max(0.0, p[d] - Q[d])
            counts[rng.choice(6, p=r / r.sum())] += 1
    assert chisquare(counts, p * n).pvalue < 1e-6


@pytest.mark.slow
def test_truncated_sampling_preserves_the_truncated_distribution():
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05)
    n = 20000
    counts = _first_token_counts(P_LOGITS, Q, False, n, VerifyConfig("strict"), params)
    p = probabilities(P_LOGITS[0], params)
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], p[support] * n).pvalue > 1e-3


def test_mars_sampling_accepts_runner_up_outright_when_undecided():
    logits = window(row({3: 10.0, 4: 9.5}, base=0.0), BONUS)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    rng = np.random.default_rng(0)
    outs = [verify(logits, np.array([4]), MARS, params, rng) for _ in range(200)]
    assert all(o.n_accepted == 1 for o in outs)
    # strict accepts the runner-up only with probability p(4) ~ 0.38
    rng = np.random.default_rng(0)
    strict = [verify(logits, np.array([4]), STRICT, params, rng).n_accepted for _ in range(2000)]
    p4 = probabilities(logits[0], params)[4]
    assert abs(np.mean(strict) - p4) < 0.05
    # relaxed accepts are exactly those strict would have rejected (same draws)
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    for _ in range(200):
        a = verify(logits, np.array([4]), STRICT, params, rng_a)
        b = verify(logits, np.array([4]), MARS, params, rng_b)
        assert b.n_relaxed == (1 - a.n_accepted)


def test_mars_sampling_never_accepts_a_truncated_token():
    logits = window(row({3: 10.0, 4: 9.5}, base=0.0), BONUS)
    params = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)  # keeps only id 3
    rng = np.random.default_rng(0)
    for _ in range(50):
        r = verify(logits, np.array([4]), MARS, params, rng)
        assert r.n_accepted == 0 and r.tokens == [3]


@pytest.mark.slow
def test_mars_sampling_decided_positions_follow_strict_distribution():
    """Where the target is decided, MARS at T>0 is the lossless rule."""
    logits = np.array([[3.0, 1.5, 1.0, 0.2, -0.5, 0.0], [0.0] * 6], dtype=np.float32)  # r = 0.5
    n = 20000
    counts = _first_token_counts(logits, Q, True, n, VerifyConfig("mars"), T1)
    p = probabilities(logits[0], T1)
    assert chisquare(counts, p * n).pvalue > 1e-3


# ------------------------------------------- seeds, through the engine's API
# A synthetic target (a bigram model: the logits after token a are BIGRAM[a]) and
# a drafter that disagrees with it, driven by the loop the engine runs: the
# uniforms of every window come from SamplingParams.seed -> base_seed() ->
# position_uniforms(seed, absolute position, ...), and sampled drafts draw from
# stream 1, as mars_local.speculate.drafters does.
BIGRAM = np.random.default_rng(11).standard_normal((V, V)).astype(np.float32) * 2
DRAFT_BIGRAM = (BIGRAM + np.random.default_rng(12).standard_normal((V, V)) * 1.5).astype(np.float32)


def speculate(params: SamplingParams, cfg: VerifyConfig, n_tokens: int, ks, draft_sampling="greedy",
              prompt=(0,)) -> list[int]:
    """Generate n_tokens after ``prompt`` with verify windows of k = ks[round % len(ks)]
    drafts (k = 0 is plain sampling)."""
    seed = params.base_seed()  # the user's seed, or a fresh random one
    tokens = list(prompt)
    rnd = 0
    while len(tokens) - len(prompt) < n_tokens:
        k = ks[rnd % len(ks)]
        rnd += 1
        draft, probs, a = [], [], tokens[-1]
        for _ in range(k):
            if draft_sampling == "sample":
                q = probabilities(DRAFT_BIGRAM[a], params)
                u = position_uniforms(seed, len(tokens) + len(draft), 1, stream=1)[0, 0]
                a = sample_from(q, u)
                probs.append(q)
            else:
                a = int(DRAFT_BIGRAM[a].argmax())
            draft.append(a)
        logits = BIGRAM[[tokens[-1]] + draft]
        u = position_uniforms(seed, len(tokens), k + 1)
        res = verify(logits, np.array(draft, dtype=np.int64), cfg, params, None,
                     np.stack(probs) if probs else None, u)
        tokens += res.tokens
    return tokens[len(prompt):][:n_tokens]


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
@pytest.mark.parametrize("cfg", [STRICT, MARS], ids=["strict", "mars"])
def test_sampling_is_reproducible_with_a_seed(cfg, draft_sampling):
    """Same seed -> same tokens; another seed, or no seed, -> other tokens."""
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    run = lambda p: speculate(p, cfg, 60, (3, 1, 4), draft_sampling)  # noqa: E731
    a = run(params)
    assert run(params) == a
    assert run(replace(params, seed=43)) != a
    assert run(replace(params, seed=None)) != a  # an unseeded run draws a fresh seed
    assert run(replace(params, seed=None)) != run(replace(params, seed=None))


def test_strict_sampling_with_deterministic_drafts_is_plain_sampling_token_for_token():
    """The README's "same seed, same tokens" holds for deterministic drafts (any
    window lengths, k = 0 being plain sampling), not for sampled drafts: those
    give the same distribution (tests/test_verify_stats.py), not the same tokens."""
    for seed in range(5):
        params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        plain = speculate(params, STRICT, 40, (0,))
        assert speculate(params, STRICT, 40, (4, 2, 7)) == plain
    sampled = [speculate(replace(params, seed=s), STRICT, 40, (4,), "sample")
               for s in range(5)]
    plains = [speculate(replace(params, seed=s), STRICT, 40, (0,)) for s in range(5)]
    assert sampled != plains


def test_window_shape_is_checked():
    with pytest.raises(ValueError):
        verify(np.zeros((3, V), np.float32), np.array([1]), STRICT, GREEDY)


# ------------------------------------------- non-finite logits, q(d) = 0
INF, NAN = np.inf, np.nan
PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
TRUNCATED = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05)
U_SWEEP = [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.9999999999999999]


def test_issue_example_posinf_logit_takes_all_the_mass():
    """[[inf, 0, 0], [0, 1, 2]], draft [1], q [.2, .4, .4], u 0.5: p = [1, 0, 0],
    so the draft (p = 0) is rejected and the residual (p - q)+ is all on id 0."""
    logits = np.array([[INF, 0, 0], [0, 1, 2]], dtype=np.float32)
    q = np.array([[0.2, 0.4, 0.4]])
    u = np.full((2, 2), 0.5)
    np.testing.assert_array_equal(probabilities(logits[0], PLAIN), [1.0, 0.0, 0.0])
    for cfg in (STRICT, MARS):
        assert verify(logits, np.array([1]), cfg, PLAIN, None, q, u).tokens == [0]
        assert verify(logits, np.array([0]), cfg, PLAIN, None, q, u).tokens[0] == 0


@pytest.mark.parametrize("params", [PLAIN, TRUNCATED, SamplingParams(temperature=0.3, top_k=1, top_p=1.0, min_p=0.0),
                                    SamplingParams(temperature=2.0, top_k=0, top_p=0.4, min_p=0.0),
                                    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5)],
                         ids=["plain", "truncated", "top-k 1", "top-p", "min-p"])
def test_posinf_logits_share_the_mass_and_truncation_applies(params):
    """Several +inf logits share the mass equally (they are tied at the top);
    top-k / top-p / min-p then truncate as for any tie (lowest ids first)."""
    r = row({2: INF, 5: INF, 3: 50.0}, base=0.0)
    p = probabilities(r, params)
    if params.top_k == 1 or params.top_p <= 0.5:
        np.testing.assert_array_equal(p, np.eye(V)[2])  # the lowest +inf id only
    else:
        np.testing.assert_array_equal(np.flatnonzero(p), [2, 5])
        assert p[2] == p[5] == 0.5
    logits = window(r, BONUS)
    for cfg in (STRICT, MARS):
        for d in range(V):
            for u in U_SWEEP:
                res = verify(logits, np.array([d]), cfg, params, None, None, np.full((2, 2), u))
                assert p[res.tokens[0]] > 0 and res.n_relaxed == 0, (d, u, res)
                if d in (2, 5) and p[d] > 0:  # sample-and-compare: x = 2 for u < .5, 5 above
                    assert res.n_accepted == (d == (2 if u < p[2] else 5))


def test_posinf_is_the_argmax_and_never_undecided():
    for cfg in (STRICT, MARS):
        logits = window(row({1: INF, 4: 9.9}, base=0.0), BONUS)
        assert verify(logits, np.array([1]), cfg, GREEDY).tokens == [1, 6]
        assert verify(logits, np.array([4]), cfg, GREEDY).tokens == [1]  # ratio 9.9/inf = 0
        two = window(row({1: INF, 4: INF}, base=0.0), BONUS)
        assert verify(two, np.array([4]), cfg, GREEDY).tokens == [1]  # ratio inf/inf: decided


def test_neginf_is_probability_zero_and_never_accepted():
    # the runner-up of [-inf, -1, -inf, ...] is a -inf id; with the sign guard off,
    # z2/z1 = -inf/-1 = +inf > theta, but a -inf token is never accepted
    loose = VerifyConfig("mars", theta=0.9, require_positive_top1=False)
    logits = window(np.array([-INF, -1.0] + [-INF] * (V - 2), dtype=np.float32), BONUS)
    assert verify(logits, np.array([0]), loose, GREEDY).tokens == [1]
    for params in (PLAIN, TRUNCATED):
        for u in U_SWEEP:
            res = verify(logits, np.array([0]), loose, params, None, None, np.full((2, 2), u))
            assert res.tokens == [1]
    p = probabilities(row({0: -INF, 3: -INF, 5: 2.0}), PLAIN)
    assert p[0] == p[3] == 0.0 and p.sum() == pytest.approx(1.0)


BAD_ROWS = [
    ("NaN", row({3: 10.0, 5: NAN}), "NaN logits at draft position {i}"),
    ("all NaN", np.full(V, NAN, dtype=np.float32), "NaN logits at draft position {i}"),
    ("NaN and -inf", row({3: -INF, 5: NAN}, base=-INF), "NaN logits at draft position {i}"),
    ("all -inf", np.full(V, -INF, dtype=np.float32), "no finite logit at draft position {i}"),
]


@pytest.mark.parametrize("name,bad,msg", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
@pytest.mark.parametrize(
    "params,sampled",  # q is only used at T > 0
    [(GREEDY, False), (PLAIN, False), (PLAIN, True), (TRUNCATED, False), (TRUNCATED, True)],
    ids=["greedy", "plain", "plain-sampled-q", "truncated", "truncated-sampled-q"],
)
@pytest.mark.parametrize("cfg", [STRICT, MARS], ids=["strict", "mars"])
def test_a_row_without_a_distribution_is_refused_where_it_is_used(name, bad, msg, params, sampled, cfg):
    """A NaN logit (or no finite logit) in a row the rule reaches: MarsError naming
    the window position; in a row after the first rejection: ignored."""
    ok = DECIDED  # top-1 id 3 with p(3) > 0.98
    q = np.full((2, V), 1.0 / V) if sampled else None  # q(3) = 1/8 < p(3): accepted; q(5) > p(5)
    u = np.full((3, 2), 0.5)
    for i in range(3):  # the bad row at position 0, 1 (a draft row) or 2 (the bonus row)
        rows = [ok, ok, ok]
        rows[i] = bad
        with pytest.raises(MarsError, match=msg.format(i=i)):
            verify(window(*rows), np.array([3, 3]), cfg, params, None, q, u)
    # the bad row comes after a rejection: never looked at
    res = verify(window(ok, bad, ok), np.array([5, 3]), cfg, params, None, q, u)
    assert res.n_accepted == 0 and res.tokens == [3]
    # an empty draft: the row is the bonus row
    with pytest.raises(MarsError, match=msg.format(i=0)):
        verify(window(bad), np.array([], dtype=np.int64), cfg, params, None, None, u[:1])


@pytest.mark.parametrize("params", [PLAIN, TRUNCATED], ids=["plain", "truncated"])
def test_a_draft_with_zero_target_probability_is_never_accepted_even_if_q_is_zero(params):
    """q(d) = 0 used to mean "accept with probability 1" even where p(d) = 0."""
    logits = window(row({3: 10.0, 4: 9.5, 2: -INF}, base=0.0), BONUS)  # id 2: -inf; TRUNCATED keeps 3, 4 only
    p = probabilities(logits[0], params)
    q = np.full((1, V), 1.0 / (V - 2))
    q[0, 2] = q[0, 0] = 0.0
    for cfg in (STRICT, MARS):
        for d in range(V):
            for u in U_SWEEP:
                res = verify(logits, np.array([d]), cfg, params, None, q, np.full((2, 2), u))
                if p[d] == 0:
                    assert res.n_accepted == 0, (cfg.method, d, u)
                    assert p[res.tokens[0]] > 0
    # q(d) = 0 < p(d): d is accepted (min(1, p/q) = 1)
    full = window(row({3: 1.0, 4: 0.5}, base=0.0), BONUS)
    q = np.full((1, V), 1.0 / (V - 1))
    q[0, 4] = 0.0
    assert verify(full, np.array([4]), STRICT, PLAIN, None, q, np.full((2, 2), 0.999)).n_accepted == 1

"""The native verification kernel (patches/0001-mars-verify-kernel.patch) against
the numpy reference: same accepted length, same tokens, same relaxed flags.

CI always builds the patched llama-cpp-python, so a missing kernel is a
failure here, not a skip.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mars_local.speculate import native
from mars_local.speculate.engine import Engine
from mars_local.core.errors import MarsError
from mars_local.core.sampling import SamplingParams, probabilities, top_k_ids
from mars_local.core.verify import VerifyConfig, verify

PROPERTY = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def kernel_is_built():
    assert native.available(), (
        "libllama has no llama_mars_verify: llama-cpp-python was not built with patches/ "
        "(run `make install`, which applies patches/0001-mars-verify-kernel.patch)"
    )


def same(a, b) -> bool:
    return (a.n_accepted, a.tokens, a.relaxed.tolist()) == (b.n_accepted, b.tokens, b.relaxed.tolist())


def check(logits, draft, cfg, params, draft_probs=None, uniforms=None):
    """Both give the same result, or both refuse with the same MarsError (None)."""
    try:
        ref = verify(logits, draft, cfg, params, None, draft_probs, uniforms)
    except MarsError as e:
        with pytest.raises(MarsError) as got:
            native.verify(logits, draft, cfg, params, None, draft_probs, uniforms)
        assert str(got.value) == str(e)
        return None
    got = native.verify(logits, draft, cfg, params, None, draft_probs, uniforms)
    assert same(ref, got), (ref, got)
    assert got.relaxed.dtype == bool and len(got.relaxed) == got.n_accepted
    return got


# ----------------------------------------------------------------- strategies
@st.composite
def windows(draw):
    """(logits, draft): random logits of several shapes, with exact ties, rows
    whose top-1 is <= 0, flat (undecided) rows, some -inf entries, and
    non-finite extremes (+inf logits, one or several per row; a row with a NaN;
    a row that is all -inf); drafts mostly equal to the top-1 or top-2 so that
    windows get past position 0."""
    k = draw(st.integers(0, 6))
    vocab = draw(st.one_of(st.integers(1, 80), st.integers(100, 700)))
    style = draw(st.sampled_from(["normal", "ties", "nonpositive", "flat", "mixed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = k + 1
    if style == "normal":
        z = rng.standard_normal((n, vocab)) * draw(st.sampled_from([0.3, 3.0, 20.0]))
    elif style == "ties":
        z = rng.integers(-3, 4, (n, vocab)).astype(np.float64)
    elif style == "nonpositive":
        z = -np.abs(rng.standard_normal((n, vocab))) * 3 - draw(st.sampled_from([0.0, 0.5, 4.0]))
    elif style == "flat":
        z = 5.0 + rng.standard_normal((n, vocab)) * 0.05
    else:
        z = rng.standard_normal((n, vocab)) * 2
        z[rng.random((n, vocab)) < 0.3] = 1.5  # a tied plateau
        z[:, : vocab // 3] *= -1
    if draw(st.booleans()) and vocab > 1:
        z[rng.random((n, vocab)) < 0.2] = -np.inf
        z[np.isneginf(z).all(axis=1), 0] = 0.0  # keep one finite logit per row
    extreme = draw(st.sampled_from([None, None, None, "+inf", "+inf several", "nan", "nan row", "-inf row"]))
    row_at = rng.integers(0, n)
    if extreme == "+inf":
        rows = rng.random(n) < 0.5
        z[rows, rng.integers(0, vocab, rows.sum())] = np.inf
    elif extreme == "+inf several":
        z[rng.random((n, vocab)) < draw(st.sampled_from([0.02, 0.3]))] = np.inf
    elif extreme == "nan":
        z[row_at, rng.integers(0, vocab)] = np.nan
    elif extreme == "nan row":
        z[row_at] = np.nan
    elif extreme == "-inf row":
        z[row_at] = -np.inf
    logits = z.astype(np.float32)
    s = np.nan_to_num(logits.astype(np.float64), nan=0.0)
    rows = np.arange(n)
    t1 = s.argmax(axis=1)
    s[rows, t1] = -np.inf
    t2 = s.argmax(axis=1)
    pick = rng.random(k)
    draft = np.where(pick < 0.55, t1[:k], np.where(pick < 0.85, t2[:k], rng.integers(0, vocab, k)))
    return logits, draft.astype(np.int64)


@st.composite
def configs(draw, vocab: int):
    method = draw(st.sampled_from(["strict", "mars"]))
    theta = draw(st.one_of(st.sampled_from([0.5, 0.9, 1.0]), st.floats(0.01, 1.0)))
    eog = tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=3)))
    return VerifyConfig(
        method,
        theta=theta,
        require_positive_top1=draw(st.booleans()),
        max_relaxed=draw(st.one_of(st.none(), st.integers(0, 3))),
        eog_ids=eog,
    )


@st.composite
def sampling(draw, vocab: int, greedy: bool | None = None):
    if greedy is None:
        greedy = draw(st.booleans())
    temp = 0.0 if greedy else draw(st.one_of(st.sampled_from([1.0, 0.7]), st.floats(0.05, 3.0)))
    return SamplingParams(
        temperature=temp,
        top_k=draw(st.sampled_from([0, 1, 2, 3, 10, 40, vocab, vocab + 7])),
        top_p=draw(st.one_of(st.just(1.0), st.sampled_from([0.5, 0.95]), st.floats(0.01, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.sampled_from([0.05, 0.5]), st.floats(0.0, 0.9))),
    )


def uniforms_for(draw, k: int) -> np.ndarray:
    u = st.one_of(st.sampled_from([0.0, 0.5, 0.25, 0.9999999999999999]), st.floats(0.0, 1.0, exclude_max=True))
    return np.array(draw(st.lists(u, min_size=2 * (k + 1), max_size=2 * (k + 1))), dtype=np.float64).reshape(k + 1, 2)


# ------------------------------------------------------------- properties
@pytest.mark.slow
@PROPERTY
@given(data=st.data())
def test_greedy_matches_numpy(data):
    logits, draft = data.draw(windows())
    vocab = logits.shape[1]
    check(logits, draft, data.draw(configs(vocab)), data.draw(sampling(vocab, greedy=True)))


@pytest.mark.slow
@PROPERTY
@given(data=st.data())
def test_sampling_with_deterministic_drafts_matches_numpy(data):
    logits, draft = data.draw(windows())
    vocab, k = logits.shape[1], len(draft)
    params = data.draw(sampling(vocab, greedy=False))
    check(logits, draft, data.draw(configs(vocab)), params, uniforms=uniforms_for(data.draw, k))


@pytest.mark.slow
@PROPERTY
@given(data=st.data())
def test_sampling_with_sampled_drafts_matches_numpy(data):
    logits, draft = data.draw(windows())
    vocab, k = logits.shape[1], len(draft)
    params = data.draw(sampling(vocab, greedy=False))
    # q: the draft model's distribution (another truncation, noisy logits), possibly float32
    q_params = data.draw(sampling(vocab, greedy=False))
    noise = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).standard_normal((k, vocab))
    finite = np.where(np.isfinite(logits[:k]), logits[:k], 0.0)  # q itself is always a distribution
    q = probabilities((finite + noise).astype(np.float32), q_params) if k else np.zeros((0, vocab))
    if k and data.draw(st.booleans()):
        # the drafts really were drawn from q (q(d) > 0), as the engine's are
        draft = np.array([int(np.argmax(row)) for row in q], dtype=np.int64)
    if data.draw(st.booleans()):
        q = q.astype(np.float32)
    check(logits, draft, data.draw(configs(vocab)), params, draft_probs=q, uniforms=uniforms_for(data.draw, k))


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("temp", [0.0, 1.0], ids=["greedy", "T1"])
@pytest.mark.parametrize("method", ["strict", "mars"])
def test_large_vocabularies(vocab, temp, method):
    """Real vocabulary sizes, with drafts that the rules reject and (MARS) relax:
    each draft is the top-1, an undecided runner-up (z2 = 0.95 z1) or a random id."""
    rng = np.random.default_rng([vocab, int(temp), method == "mars"])
    cfg = VerifyConfig(method, theta=0.9, eog_ids=(0, 2))
    n_rejected = n_relaxed = n_accepted = 0
    for w in range(8):
        k = int(rng.integers(1, 9))
        top_k = (40, 0)[w % 2]
        params = SamplingParams(temperature=temp, top_k=top_k, top_p=0.95, min_p=0.05 if top_k else 0.0)
        logits = (rng.standard_normal((k + 1, vocab)) * 3).astype(np.float32)
        t1 = logits.argmax(axis=1)
        draft = t1[:k].copy()
        logits[np.arange(k), draft] += 5  # a confident top-1 (p ~ 0.9 at T = 1)
        for i, kind in enumerate(rng.choice(3, size=k, p=[0.45, 0.4, 0.15])):
            if kind == 1:  # an undecided runner-up
                z1 = logits[i, t1[i]]
                r = int(rng.integers(3, vocab))
                while r == t1[i]:
                    r = int(rng.integers(3, vocab))
                logits[i, r] = z1 * np.float32(0.95)
                draft[i] = r
            elif kind == 2:
                draft[i] = rng.integers(0, vocab)
        res = check(logits, draft, cfg, params, uniforms=rng.random((k + 1, 2)))
        n_rejected += res.n_accepted < k
        n_accepted += res.n_accepted
        n_relaxed += res.n_relaxed
    # the windows reached every branch: accepts, rejections and (MARS) relaxed accepts
    assert n_accepted > 0 and n_rejected > 0
    assert (n_relaxed > 0) == (method == "mars")


# ------------------------------------------------------- crafted cases
def test_tie_at_the_kth_place_keeps_the_lowest_ids():
    z = np.array([[0.0, 2.0, 1.0, 2.0, 1.0, 1.0, -1.0]])
    assert top_k_ids(z, 3).tolist() == [[1, 2, 3]]  # 2.0 (ids 1, 3), then the lowest 1.0 (id 2)
    p = probabilities(z[0].astype(np.float32), SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert np.flatnonzero(p).tolist() == [1, 2, 3]
    logits = np.stack([z[0], z[0]]).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    for d in range(7):
        for u in np.linspace(0, 0.999, 23):
            r = check(logits, np.array([d]), VerifyConfig("strict"), params, uniforms=np.array([[u, u], [u, 0.5]]))
            assert set(r.tokens) <= {1, 2, 3} | {d}


def test_top_p_with_tied_probabilities_is_a_rank_order_prefix():
    # four equal tokens: top-p 0.5 keeps the two lowest ids (mass before them 0, 0.25)
    logits = np.array([[3.0, -np.inf, 3.0, 3.0, 3.0], [0.0] * 5], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0)
    assert np.flatnonzero(probabilities(logits[0], params)).tolist() == [0, 2]
    for u in (0.0, 0.49, 0.5, 0.51, 0.9999999999999999):
        check(logits, np.array([2]), VerifyConfig("mars"), params, uniforms=np.array([[u, u], [u, u]]))


def test_greedy_strict_stops_at_the_first_mismatch():
    logits = np.zeros((4, 300), dtype=np.float32)
    logits[0, 7] = logits[1, 250] = logits[2, 9] = logits[3, 299] = 1.0
    r = check(logits, np.array([7, 251, 9]), VerifyConfig("strict"), SamplingParams())
    assert (r.n_accepted, r.tokens) == (1, [7, 250])


def test_mars_relaxes_an_undecided_runner_up_and_respects_the_cap():
    row = np.zeros(200, dtype=np.float32)
    row[130], row[131] = 10.0, 9.5  # r = 0.95
    logits = np.stack([row, row, row, row])
    for cap, m in ((None, 3), (0, 0), (1, 1), (2, 2)):
        r = check(logits, np.array([131, 131, 131]), VerifyConfig("mars", max_relaxed=cap), SamplingParams())
        assert r.n_accepted == m and r.relaxed.all()


def test_the_settings_of_sequences_verified_in_turn_never_leak_into_each_other():
    """A batch verifies its sequences in turn, each with its own settings: the kernel's cached
    parameter structs (one per settings object) must give each call its own rule and θ."""
    row = np.zeros(200, dtype=np.float32)
    row[130], row[131] = 10.0, 9.5  # r = 0.95: MARS with θ = 0.9 relaxes it, θ = 0.97 and strict do not
    logits = np.stack([row, row, row, row])
    draft = np.array([131, 131, 131])
    settings = [(VerifyConfig("strict"), 0), (VerifyConfig("mars"), 3), (VerifyConfig("mars", theta=0.97), 0),
                (VerifyConfig("mars", max_relaxed=1), 1)]
    sp = [SamplingParams() for _ in settings]
    for _ in range(3):
        for (cfg, want), p in zip(settings, sp):
            assert native.verify(logits, draft, cfg, p).n_accepted == want

def test_inputs_the_kernel_does_not_take_go_to_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50))
    draft = np.array([int(logits[0].argmax()), 3])
    cfg, greedy = VerifyConfig("mars"), SamplingParams()
    assert same(native.verify(logits, draft, cfg, greedy), verify(logits, draft, cfg, greedy))  # float64
    f32 = logits.astype(np.float32)
    bad = np.array([1, 50])  # outside the vocabulary
    assert same(native.verify(f32, bad, cfg, greedy), verify(f32, bad, cfg, greedy))
    hot = SamplingParams(temperature=1.0)
    with pytest.raises(IndexError):
        verify(f32, bad, cfg, hot, np.random.default_rng(0))
    with pytest.raises(IndexError):
        native.verify(f32, bad, cfg, hot, np.random.default_rng(0))
    with pytest.raises(ValueError):
        native.verify(f32[:2], draft, cfg, greedy)  # wrong window shape
    with pytest.raises(ValueError):
        native.verify(f32, draft, cfg, hot)  # sampling without uniforms or rng
    # an rng is consumed exactly as the reference consumes it
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    assert same(native.verify(f32, draft, cfg, hot, a), verify(f32, draft, cfg, hot, b))
    assert a.random() == b.random()
    # a strided (non-contiguous) float32 view
    wide = rng.standard_normal((3, 100)).astype(np.float32)
    view = wide[:, ::2]
    assert same(native.verify(view, draft, cfg, greedy), verify(view, draft, cfg, greedy))


def test_unpatched_library_falls_back_to_numpy(monkeypatch):
    monkeypatch.setattr(native, "_state", ())
    assert not native.available()
    logits = np.random.default_rng(1).standard_normal((2, 30)).astype(np.float32)
    draft = np.array([int(logits[0].argmax())])
    cfg, params = VerifyConfig("mars"), SamplingParams()
    assert same(native.verify(logits, draft, cfg, params), verify(logits, draft, cfg, params))


# ------------------------------------------------------------------ engine
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_uses_the_kernel_and_generates_what_numpy_generates(
    tiny_flat_target, tiny_flat_draft, monkeypatch, temperature
):
    opts = dict(max_tokens=40, verify="mars", theta=0.9, temperature=temperature, seed=3, adaptive=False, draft_max=4)
    with Engine(tiny_flat_target, draft=tiny_flat_draft) as eng:
        fast = eng.generate("hello world", **opts)
        assert fast.stats.verify_backend == "native"
        monkeypatch.setattr(native, "available", lambda: False)
        eng.reset()  # the same path: a fresh prompt whose first token comes from its own forward
        slow = eng.generate("hello world", **opts)
        assert slow.stats.verify_backend == "numpy"
    assert fast.tokens == slow.tokens and fast.kinds == slow.kinds
    assert fast.stats.n_relaxed == slow.stats.n_relaxed


# ------------------------------------------- non-finite logits, q(d) = 0
def test_issue_example_posinf_logit():
    """[[inf, 0, 0], [0, 1, 2]], draft [1], q [.2, .4, .4], u 0.5, T 1: numpy said
    [0], the kernel [1, 2]; the +inf logit takes all the mass, so [0]."""
    logits = np.array([[np.inf, 0, 0], [0, 1, 2]], dtype=np.float32)
    q = np.array([[0.2, 0.4, 0.4]])
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    for cfg in (VerifyConfig("strict"), VerifyConfig("mars")):
        r = check(logits, np.array([1]), cfg, params, draft_probs=q, uniforms=np.full((2, 2), 0.5))
        assert r.tokens == [0]


PIPELINES = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=3, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.3, top_k=0, top_p=0.6, min_p=0.0),
    SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1e-300, top_k=0, top_p=1.0, min_p=0.0),  # z / T overflows to +inf
]
PIPELINE_IDS = ["greedy", "plain", "top-k", "top-p", "min-p", "all", "tiny-T"]


def _extreme_rows(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(vocab)
    base = (rng.standard_normal(vocab) * 2).astype(np.float32)
    rows = {}
    r = base.copy(); r[vocab - 1] = np.inf; rows["+inf in the tail"] = r  # noqa: E702
    r = base.copy(); r[[5, 70 % vocab, 71 % vocab]] = np.inf; rows["three +inf"] = r  # noqa: E702
    r = base.copy(); r[::2] = -np.inf; rows["half -inf"] = r  # noqa: E702
    r = np.full(vocab, -np.inf, np.float32); r[[3, 100 % vocab]] = [-2.0, -2.5]; rows["-inf, negative top-2"] = r  # noqa: E702
    r = base.copy(); r[vocab // 2] = np.nan; rows["a NaN"] = r  # noqa: E702
    r = base.copy(); r[vocab - 1] = np.nan; rows["a NaN in the tail"] = r  # noqa: E702
    r = base.copy(); r[7] = np.nan; r[8] = np.inf; rows["NaN and +inf"] = r  # noqa: E702
    rows["all -inf"] = np.full(vocab, -np.inf, np.float32)
    return rows


@pytest.mark.parametrize("params", PIPELINES, ids=PIPELINE_IDS)
@pytest.mark.parametrize("method", ["strict", "mars"])
@pytest.mark.parametrize("vocab", [23, 200])
def test_non_finite_rows_match_numpy(params, method, vocab):
    """+inf, -inf and NaN rows at every window position, greedy and sampling,
    deterministic and sampled drafts: same tokens, or the same MarsError."""
    cfg = VerifyConfig(method, theta=0.9, require_positive_top1=False)
    rng = np.random.default_rng(7)
    finite = (rng.standard_normal((3, vocab)) * 2).astype(np.float32)
    q = probabilities(finite[:2] + 0.5, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    refused = 0
    for name, bad in _extreme_rows(vocab).items():
        for pos in range(3):
            logits = finite.copy()
            logits[pos] = bad
            for d in ({int(np.nan_to_num(logits[0], nan=-np.inf).argmax()), 3, 5, 70 % vocab, vocab - 1}):
                draft = np.array([d, int(finite[1].argmax())])
                for u in (0.0, 0.3, 0.5, 0.8, 0.9999999999999999):
                    uni = np.full((3, 2), u)
                    for probs in ((None,) if params.greedy else (None, q)):
                        r = check(logits, draft, cfg, params, draft_probs=probs, uniforms=uni)
                        if r is None:
                            refused += 1
                            assert "nan" in name.lower() or name == "all -inf"
    assert refused > 0


def test_posinf_never_emits_a_token_that_top_k_removed():
    logits = np.array([[np.inf, 0.0, 5.0, 3.0], [0.0, 0.0, 0.0, 1.0]], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
    for d in range(4):
        for u in np.linspace(0, 0.9999, 17):
            for probs in (None, np.array([[0.1, 0.2, 0.3, 0.4]])):
                r = check(logits, np.array([d]), VerifyConfig("mars"), params, draft_probs=probs,
                          uniforms=np.array([[u, u], [u, u]]))
                assert r.tokens[0] == 0 and r.n_accepted == (d == 0)


def test_nan_is_refused_with_the_window_position():
    logits = np.zeros((4, 300), dtype=np.float32)
    logits[:, 7] = 30.0  # p(7) = 1 - 1e-10: drafts of 7 are accepted
    logits[2, 150] = np.nan
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        for method in ("strict", "mars"):
            u = np.full((4, 2), 0.5)
            with pytest.raises(MarsError, match="the target produced NaN logits at draft position 2"):
                native.verify(logits, np.array([7, 7, 7]), VerifyConfig(method), params, None, None, u)
            # a NaN after the first rejection is not looked at
            r = native.verify(logits, np.array([7, 8, 7]), VerifyConfig(method), params, None, None, u)
            assert r.tokens == [7, 7]


def test_zero_q_never_accepts_a_draft_with_zero_target_probability():
    logits = np.array([[5.0, 4.9, 0.0, -np.inf, 1.0], [0.0] * 5], dtype=np.float32)
    q = np.array([[0.5, 0.5, 0.0, 0.0, 0.0]])
    for params in (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                   SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)):
        p = probabilities(logits[0], params)
        for cfg in (VerifyConfig("strict"), VerifyConfig("mars")):
            for d in (2, 3, 4):
                for u in (0.0, 0.5, 0.9999):
                    r = check(logits, np.array([d]), cfg, params, draft_probs=q, uniforms=np.full((2, 2), u))
                    assert r.n_accepted == (p[d] > 0)

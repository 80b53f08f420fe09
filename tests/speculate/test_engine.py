"""The speculative loop on tiny random GGUF models (load in milliseconds)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from mars_local import Engine, MarsError
from mars_local.llama.context import Context
from mars_local.llama.runtime import Model
from mars_local.core.sampling import SamplingParams, probabilities

PROMPTS = ["hello world", "the a the a the", "w1 w2 w3 w4 w5", "!", "hello the world a hello"]


def test_strict_greedy_equals_plain_greedy_token_for_token(plain, spec, ngram):
    rng = np.random.default_rng(0)
    accepted = 0
    for i in range(40):
        if i < len(PROMPTS):
            prompt = PROMPTS[i]
        else:  # random token prompts
            prompt = [1] + [int(t) for t in rng.integers(3, 384, size=int(rng.integers(1, 30)))]
        k = int(rng.integers(1, 9))
        ref = plain.generate(prompt, max_tokens=48, verify="strict")
        for eng in (spec, ngram):
            out = eng.generate(prompt, max_tokens=48, verify="strict", draft_max=k, adaptive=False)
            assert out.tokens == ref.tokens, (prompt, k, eng.drafter_kind)
            assert eng.generate(prompt, max_tokens=48, verify="strict", draft_max=k).tokens == ref.tokens
            assert out.text == ref.text
            assert out.stats.n_relaxed == 0
            accepted += out.stats.n_accepted
    assert accepted > 100  # the drafts were really exercised


def test_strict_sampling_equals_plain_sampling_for_the_same_seed(plain, spec, ngram):
    """Sample-and-compare on position-keyed draws: drafting never changes a seeded sample."""
    for seed in range(8):
        kw = dict(max_tokens=40, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        ref = plain.generate("hello world the", **kw)
        for eng in (spec, ngram):
            for adaptive in (False, True):
                out = eng.generate("hello world the", verify="strict", draft_max=4, adaptive=adaptive, **kw)
                assert out.tokens == ref.tokens, (seed, eng.drafter_kind, adaptive)


def test_adaptive_ngram_rounds_cut_the_proposed_draft_by_its_keys(plain, tiny_target):
    """The n-gram draft is proposed before the choice; the controller sees its
    match-length keys and the target verifies exactly the prefix it chose."""
    from mars_local.speculate.adaptive import AdaptiveK

    calls, observed = [], []

    class Half(AdaptiveK):  # given to the engine through its controller seam
        def choose(self, k_limit=None, keys=None):
            k = len(keys) // 2 if keys else 0  # half of whatever was proposed
            calls.append((list(keys) if keys is not None else None, k))
            return k

        def observe(self, k, n_accepted, t_target, t_draft, keys=None, **kw):
            observed.append((k, keys))
            return super().observe(k, n_accepted, t_target, t_draft, keys, **kw)

    prompt = "the a the a the a hello the a the"
    ref = plain.generate(prompt, max_tokens=40, verify="strict")
    with Engine(tiny_target, drafter="ngram", learned=False, controller=lambda cfg, k_max: Half(k_max=k_max)) as ngram:
        out = ngram.generate(prompt, max_tokens=40, verify="strict", draft_max=6)
        n_max = ngram.ngram_max
    assert out.tokens == ref.tokens  # still lossless
    ks = out.stats.k_per_round
    assert len(calls) >= len(ks) - 1 and any(k > 0 for k in ks)
    for (keys, k), used, (k_obs, keys_obs) in zip(calls, ks, observed):
        assert used == k == k_obs
        assert keys is not None and len(keys) <= 6
        if keys:  # match lengths, growing by one per draft position
            assert keys == [min(keys[0] + i, n_max + 2) for i in range(len(keys))]
            assert keys_obs == (keys[:k] if k else None)


def test_each_verification_rule_learns_its_own_acceptance_on_shared_costs(tiny_target):
    with Engine(tiny_target, drafter="ngram") as eng:
        eng.generate("the a the a the", max_tokens=20, verify="strict", draft_max=4)
        eng.generate("the a the a the", max_tokens=20, verify="mars", theta=0.9, draft_max=4)
        eng.generate("the a the a the", max_tokens=20, verify="mars", theta=0.8, draft_max=4)
        eng.generate("the a the a the", max_tokens=20, verify="strict", draft_max=4)
        ctrls = list(eng.controllers)
        assert len(ctrls) == 3
        ctrls[0].observe_forward(99, 1.0)  # a cost seen by one is seen by all ...
        ctrls[0].observe_forward(99, 1.0)  # (the first forward of a new size is not timed)
        ctrls[0].observe_shadow(True, "only-here")  # ... an acceptance only by its own regime
        states = [c.export_state() for c in ctrls]
        assert all(st["time"] == states[0]["time"] and "99" in st["time"] for st in states)
        assert [any(k == "only-here" for k, *_ in st["counts"]) for st in states] == [True, False, False]


def test_plain_decoding_is_one_token_per_round(plain):
    out = plain.generate("hello", max_tokens=20)
    s = out.stats
    assert s.first_from_prompt  # "hello": its last token rides in the prompt's one chunk
    assert s.n_generated == len(out.tokens) == s.n_rounds + 1
    assert s.n_drafted == 0 and s.mean_accepted_length == 1.0


def test_mars_with_theta_one_equals_strict(spec):
    for prompt in PROMPTS:
        a = spec.generate(prompt, max_tokens=40, verify="strict", adaptive=False)
        b = spec.generate(prompt, max_tokens=40, verify="mars", theta=1.0, adaptive=False)
        assert a.tokens == b.tokens and b.stats.n_relaxed == 0


def test_mars_accepts_more_on_an_undecided_target(tiny_flat_target, tiny_flat_draft):
    with Engine(tiny_flat_target, tiny_flat_draft) as eng:
        tot = {"strict": [0, 0], "mars": [0, 0]}
        relaxed = 0
        for prompt in PROMPTS:
            for method in tot:
                s = eng.generate(prompt, max_tokens=40, verify=method, theta=0.9, adaptive=False).stats
                tot[method][0] += s.n_generated
                tot[method][1] += s.n_rounds
                relaxed += s.n_relaxed if method == "mars" else 0
        mal = {m: g / r for m, (g, r) in tot.items()}
        assert relaxed > 0
        assert mal["mars"] > mal["strict"], mal


def test_stats_are_consistent(spec):
    out = spec.generate("hello world", max_tokens=50, verify="mars", draft_max=4, adaptive=False)
    s = out.stats
    assert s.n_generated == len(out.tokens)
    assert s.n_accepted <= s.n_drafted
    assert sum(s.per_position_drafted) == s.n_drafted
    assert sum(s.per_position_accepted) == s.n_accepted
    assert all(0 <= x <= 1 for x in s.per_position_acceptance)
    assert len(s.k_per_round) == s.n_rounds and max(s.k_per_round) <= 4
    assert s.time_total_s >= s.time_target_s + s.time_draft_s + s.time_verify_s
    assert s.stop_reason in ("length", "eog")
    d = out.to_dict()
    for key in (
        "n_generated", "n_rounds", "n_drafted", "n_accepted", "n_relaxed", "acceptance_rate",
        "mean_accepted_length", "per_position_acceptance", "time_target_s", "time_draft_s",
        "time_verify_s", "time_total_s", "tokens_per_second",
    ):
        assert key in d["stats"], key


def test_sampled_runs_are_reproducible_with_a_seed(spec):
    kw = dict(max_tokens=30, temperature=0.9, seed=123, verify="mars")
    a = spec.generate("hello world", **kw)
    b = spec.generate("hello world", **kw)
    c = spec.generate("hello world", **{**kw, "seed": 124})
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_strict_sampling_preserves_the_models_next_token_distribution(tiny_target, tiny_draft, draft_sampling):
    """First generated token of many seeded speculative runs ~ the target's p."""
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    prompt = "hello world"
    with Engine(tiny_target, tiny_draft) as eng:
        toks = eng.tokenize(prompt)
        p = probabilities(eng.logits(toks)[0], params)
        n = 1500
        counts = np.zeros(len(p), dtype=np.int64)
        eog = list(eng.eog_ids)
        for seed in range(n):
            out = eng.generate(toks, max_tokens=2, verify="strict", draft_max=3, draft_sampling=draft_sampling, adaptive=False,
                               temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
            counts[out.tokens[0] if out.tokens else eog[0]] += 1  # an EOG ends it: pool EOG ids
    p[eog[0]] = p[eog].sum()
    p[eog[1:]] = 0.0
    keep = p * n >= 5  # chi-square needs expected counts >= 5: pool the tail
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep] * n, p[~keep].sum() * n)
    assert chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("k, repeat", [(1, 6), (3, 6), (1, 1)])
def test_the_real_loop_keeps_the_law_of_the_first_two_tokens(tiny_target, k, repeat):
    """The whole-generation check of tests/core/test_verify_stats.py, through the real loop: a drafter
    given through the engine's seam samples k drafts from a fixed q != p (some outside p's support),
    and the first three tokens of 2,000 seeded generations must follow p(t1) p(t2 | t1) p(t3 | t1 t2),
    with the truncated pipeline (top-k 4, so 64 cells).  t1 comes from the prompt's last row: riding
    in its one chunk (a short prompt, repeat 1) or evaluated alone (a prompt too long for its last
    token to ride, repeat 6, and the whole prompt cached after the first generation); t2 is the
    first window's row 0, drawn through verification against draft d_0; k = 1: t3 is the bonus row
    after an accepted d_0 or the next round's row 0; k = 3: t3 is row 1 of a window whose history
    holds d_0."""
    from mars_local.speculate.drafters import Draft, Drafter

    params = dict(temperature=1.3, top_k=4, top_p=1.0, min_p=0.0)
    sp = SamplingParams(**params)
    with Engine(tiny_target, drafter="ngram") as eng:
        toks = eng.tokenize("hello world" * repeat)
        assert (len(toks) > 65) == (repeat > 1)  # over 64 rows in its last chunk: the last token cannot ride
        eog = list(eng.eog_ids)

        def law(z):  # the generations ignore end-of-generation tokens (so that each has two tokens)
            z = z.copy()
            z[eog] = -np.inf
            return probabilities(z, sp)

        p1 = law(eng.logits(toks)[0])
        first = np.flatnonzero(p1)
        p2 = {int(a): law(eng.logits(toks + [int(a)])[0]) for a in first}
        p3 = {(a, int(b)): law(eng.logits(toks + [a, int(b)])[0]) for a in p2 for b in np.flatnonzero(p2[a])}
    support = sorted(set(first) | {int(b) for row in p2.values() for b in np.flatnonzero(row)})
    q = np.zeros(len(p1))
    q[support] = 1.0
    q[support[0]] = 4.0  # q != p, and favours one token
    q[[5, 6, 7]] = 1.0  # tokens p never allows: always rejected
    q /= q.sum()

    class FromQ(Drafter):
        def __init__(self, seed):
            self.rng = np.random.default_rng(seed)

        def propose(self, tokens, k_, extend=None):
            return Draft([int(t) for t in self.rng.choice(len(q), size=k_, p=q)], np.tile(q, (k_, 1)))

    n, counts = 2000, {}
    with Engine(tiny_target, drafter="ngram", drafter_factory=lambda cfg, seed, controls: FromQ(seed)) as eng:
        for seed in range(n):
            if repeat == 1:
                eng.reset()  # else the whole prompt is cached and its last token has no chunk to ride in
            out = eng.generate(toks, max_tokens=k + 2, verify="strict", draft_max=k, adaptive=False, seed=seed,
                               ignore_eos=True, **params)
            t123 = tuple(out.tokens[:3])
            assert out.stats.first_from_prompt and out.stats.n_drafted >= k  # t1 from the prompt's row; a window of k drafts
            counts[t123] = counts.get(t123, 0) + 1
            accepted = out.stats.n_accepted if seed == 0 else accepted + out.stats.n_accepted
    cells = [(a, b, int(c)) for (a, b), row in p3.items() for c in np.flatnonzero(row)]
    assert sum(counts.get(c, 0) for c in cells) == n  # nothing outside the law's support
    exp = np.array([p1[a] * p2[a][b] * p3[a, b][c] * n for a, b, c in cells])
    obs = np.array([counts.get(c, 0) for c in cells])
    assert accepted > n // 10  # drafts were accepted, so the accept/bonus rows were exercised
    small = exp < 5.0  # cells too rare for the chi-square approximation are pooled into one
    obs = np.append(obs[~small], obs[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def test_the_first_token_comes_before_the_drafter_sees_the_prompt(tiny_target):
    """Time to first token: the prompt's last token rides in its last chunk, so the first chunk
    is yielded before the drafter begins (a draft model's prefill) and before any round; strict
    greedy output is still plain greedy's; a cached prompt (nothing to ride in) has its last token
    evaluated alone, its first token again before the drafter begins."""
    from mars_local.speculate.drafters import NgramDrafter

    events = []

    class Spy(NgramDrafter):
        def begin(self, tokens):
            events.append(("begin", len(tokens)))
            return super().begin(tokens)

    with Engine(tiny_target, drafter="ngram", drafter_factory=lambda cfg, seed, controls: Spy()) as eng:
        want = eng.generate("hello world hello", max_tokens=10, draft_max=0).tokens
        eng.reset()
        events.clear()
        stream = eng.stream("hello world hello", max_tokens=10, temperature=0, verify="strict", adaptive=False)
        first = next(stream)
        assert first.tokens == want[:1] and first.kinds == ["target"] and events == []
        assert stream.stats.first_from_prompt and stream.stats.n_rounds == 0
        rest = [t for c in stream for t in c.tokens]
        n_prompt = len(eng.tokenize("hello world hello"))
        assert first.tokens + rest == want and events == [("begin", n_prompt + 1)]
        # all cached: nothing to ride in, so the last token is evaluated alone, before the drafter
        events.clear()
        again = eng.stream("hello world hello", max_tokens=10, temperature=0, verify="strict", adaptive=False)
        first = next(again)
        assert first.tokens == want[:1] and events == [] and again.stats.first_from_prompt
        assert first.tokens + [t for c in again for t in c.tokens] == want and again.stats.n_prompt_evaluated == 0


def test_kv_rollback_matches_a_fresh_evaluation(tiny_target):
    """Hundreds of random accept/rollback cycles leave the cache exact."""
    model = Model(tiny_target)
    exact = dict(flash_attn=False, kv_type="f32")  # batching-independent numerics (~1e-5)
    ctx = Context(model, n_ctx=512, n_batch=64, **exact)
    rng = np.random.default_rng(0)
    committed = [1]
    for _ in range(300):
        base = len(committed)
        ctx.sync(committed[:-1])
        window = [committed[-1]] + [int(t) for t in rng.integers(3, 384, size=int(rng.integers(0, 9)))]
        ctx.eval(window, n_out=len(window))
        keep = int(rng.integers(1, len(window) + 1))  # last + keep-1 drafts accepted
        ctx.truncate(base - 1 + keep)
        committed = committed[:-1] + window[:keep] + [int(rng.integers(3, 384))]
        if len(committed) > 400:
            committed = committed[:50]
    ctx.sync(committed[:-1])
    assert ctx.tokens == committed[:-1]
    got = ctx.eval([committed[-1]], 1)[0].copy()
    fresh = Context(model, n_ctx=512, n_batch=64, **exact)
    want = fresh.eval(committed, 1)[0].copy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert int(got.argmax()) == int(want.argmax())
    fresh.close()
    ctx.close()
    model.close()


def test_a_model_closed_first_frees_its_contexts_first_and_once(tiny_target):
    """The garbage collector finalizes a reference cycle's objects (an engine never closed) in any
    order: a model freed before a context made from it frees that context first (a llama_context
    freed after its model is a use after free), and the context's own close then frees nothing
    twice; a context whose batch carries our token buffer (rows with input embeddings) keeps
    llama_batch_free off that buffer either way."""
    from mars_local.llama.streams import MultiContext

    model = Model(tiny_target)
    ctx = Context(model, n_ctx=64, n_batch=8)
    multi = MultiContext(model, 2, n_ctx_seq=32, n_batch=8, unified=True, n_embd_in=model.n_embd)
    gone = Context(model, n_ctx=64, n_batch=8)
    gone.close()
    assert len(model._owned) == 3 and [o.pending for o in model._owned] == [True, True, False]
    model.close()
    assert not ctx._free.pending and not multi._free.pending
    ctx.close()
    multi.close()
    assert ctx._ctx is None and multi._ctx is None
    model2 = Model(tiny_target)
    Context(model2, n_ctx=64, n_batch=8).close()
    Context(model2, n_ctx=64, n_batch=8).close()
    assert len(model2._owned) == 1  # the freed ones are dropped as new ones come
    model2.close()


def test_prompt_prefix_is_reused_across_generations(spec):
    spec.generate("hello world the a", max_tokens=4)
    out = spec.generate("hello world the a hello", max_tokens=4)
    s = out.stats
    assert s.n_prompt_evaluated < s.n_prompt
    # a prompt sharing nothing but BOS re-evaluates the rest
    other = spec.generate("!", max_tokens=4)
    assert other.stats.n_prompt_evaluated <= other.stats.n_prompt


def test_generation_stops_when_the_context_is_full(tiny_target):
    rng = np.random.default_rng(1)
    with Engine(tiny_target, n_ctx=64, drafter="ngram") as eng:
        reasons = set()
        for _ in range(8):
            prompt = [1] + [int(t) for t in rng.integers(3, 384, size=8)]
            out = eng.generate(prompt, max_tokens=5000)
            assert len(prompt) + len(out.tokens) <= eng.n_ctx + 1
            reasons.add(out.stats.stop_reason)
    assert "context" in reasons


def test_stop_at_end_of_generation(tiny_dir):
    """A model whose EOS is its favourite token stops at once and prints nothing of it."""
    from tinymodels import make_tiny_llama

    path = make_tiny_llama(tiny_dir / "eos-model.gguf", seed=0)
    with Engine(path) as probe:
        first = probe.generate("hello", max_tokens=1).tokens[0]
    eos_path = make_tiny_llama(tiny_dir / "eos-model2.gguf", seed=0, eos_id=first)
    with Engine(eos_path, drafter="ngram") as eng:
        out = eng.generate("hello", max_tokens=10)
    assert out.tokens == [] and out.stats.stop_reason == "eog"


@pytest.mark.parametrize(
    "kw",
    [
        dict(theta=0.0), dict(theta=1.2), dict(draft_max=-1), dict(temperature=-0.5), dict(max_tokens=0),
        dict(top_p=0.0), dict(min_p=1.0), dict(draft_min=9, draft_max=4), dict(verify="fuzzy"),
        dict(draft_p_min=2.0), dict(top_k=-1),
    ],
)
def test_invalid_settings_are_refused(spec, kw):
    with pytest.raises(MarsError):
        spec.generate("hello", **kw)


def test_bad_models_are_refused(tiny_target, tiny_other_vocab, not_gguf, truncated_gguf, tmp_path):
    with pytest.raises(MarsError, match="not found"):
        Engine(tmp_path / "missing.gguf")
    with pytest.raises(MarsError, match="not a GGUF"):
        Engine(not_gguf)
    with pytest.raises(MarsError, match="cannot load"):
        Engine(truncated_gguf)
    with pytest.raises(MarsError, match="tokenizer"):
        Engine(tiny_target, tiny_other_vocab)


def test_prompt_longer_than_the_context_is_refused(tiny_target):
    with Engine(tiny_target, n_ctx=32) as eng:
        with pytest.raises(MarsError, match="context"):
            eng.generate("hello " * 100, max_tokens=4)
        with pytest.raises(MarsError, match="outside the vocabulary"):
            eng.generate([1, 99999], max_tokens=4)


def test_recurrent_models_are_refused_for_drafting(tiny_target, tiny_draft, monkeypatch):
    """A cache that cannot be partially rolled back (Mamba, RWKV, hybrids) must not speculate."""
    from mars_local.llama import runtime

    monkeypatch.setattr(runtime.C, "llama_model_is_recurrent", lambda model: True)
    with pytest.raises(MarsError, match="recurrent"):
        Engine(tiny_target, drafter="ngram")
    with pytest.raises(MarsError, match="recurrent"):
        Engine(tiny_target, tiny_draft)
    with Engine(tiny_target) as plain:  # plain decoding still works
        assert plain.generate("hello", max_tokens=3).stats.n_generated >= 1


@pytest.mark.slow
def test_random_controller_choices_keep_the_draft_cache_behind_and_output_exact(plain, tiny_target, tiny_draft):
    """Regression (found by `mars bench --repeat 3` with a 65 % draft): a draft stopped by p_min has
    every token evaluated in the draft cache; trimmed by the controller and followed by a bonus token
    equal to the first trimmed draft, the committed tokens all matched the cache, which then held
    the new last token too, and the next draft evaluated nothing and crashed.  A controller choosing
    at random (k, when to stop, how many to verify), p_min on or off, resets and cached prompts: no
    crash, and strict output is plain output every time."""
    import random

    from mars_local.speculate.adaptive import AdaptiveK

    rng = random.Random(0)

    class Random(AdaptiveK):
        def choose(self, k_limit=None, keys=None):
            return rng.randint(0, k_limit or self.k_max)

        def extend(self, keys, k_limit=None):
            return rng.random() < 0.8

        def trim(self, keys):
            return rng.randint(0, len(keys))

    for draft in (tiny_target, tiny_draft):  # a draft that always agrees, and one that often does not
        with Engine(tiny_target, draft, learned=False, controller=lambda cfg, k_max: Random(k_max=k_max)) as spec:
            for _ in range(120):
                prompt = rng.choice(PROMPTS[:4])
                n = rng.randint(1, 30)
                if rng.random() < 0.2:
                    spec.reset()
                out = spec.generate(prompt, max_tokens=n, verify="strict", draft_max=rng.randint(1, 8),
                                    draft_p_min=rng.choice([0.0, 0.5]))
                assert out.tokens == plain.generate(prompt, max_tokens=n, verify="strict").tokens


def test_adaptive_draft_model_drafts_with_confidence_keys_and_stays_lossless(plain, tiny_target, tiny_draft):
    """With adaptive k a draft model drafts token by token, each token keyed by
    its confidence bucket; the controller's extend() decides when to stop and
    trim() how many to verify.  Output is still plain greedy output."""
    from mars_local.speculate.adaptive import AdaptiveK

    seen_keys, trims = [], []

    class ThreeThenTwo(AdaptiveK):  # given to the engine through its controller seam
        def choose(self, k_limit=None, keys=None):
            return 1

        def extend(self, keys, k_limit=None):
            seen_keys.append(list(keys))
            return len(keys) < 3  # draft exactly 3 tokens

        def trim(self, keys):
            trims.append(list(keys))
            return 2  # verify 2 of them

    with Engine(tiny_target, tiny_draft, learned=False,
                controller=lambda cfg, k_max: ThreeThenTwo(k_max=k_max)) as spec:
        for prompt in PROMPTS[:3]:
            ref = plain.generate(prompt, max_tokens=30, verify="strict")
            out = spec.generate(prompt, max_tokens=30, verify="strict", draft_max=6)
            assert out.tokens == ref.tokens
            assert set(out.stats.k_per_round) <= {0, 1, 2} and 2 in out.stats.k_per_round
    assert seen_keys and all(k and all(x.startswith("p") for x in k) for k in seen_keys)
    assert all(len(t) == 3 for t in trims if len(t) >= 3)


def test_a_draft_models_catch_up_after_plain_rounds_is_kept_out_of_its_draft_cost(tiny_target, tiny_draft):
    """A ModelDrafter evaluates the tokens decoded plainly since it last drafted in the first
    evaluation of its next draft; it reports that evaluation (rows, seconds), of which the
    loop keeps the share beyond a drafting round's two rows out of the drafting time."""
    from types import SimpleNamespace

    from mars_local.speculate.drafters import ModelDrafter
    from mars_local.speculate.run import Run, catch_up_excess

    m = Model(tiny_draft, 0)
    ctx = Context(m, n_ctx=256, n_threads=2)
    try:
        drafter = ModelDrafter(ctx)
        tokens = m.tokenize("hello world")
        drafter.begin(tokens)
        assert len(drafter.propose(tokens, 2)) == 2 and drafter.catch_up[0] == 1  # the last token alone
        drafter.observe(tokens, 0)
        tokens = tokens + [int(t) for t in np.arange(20, 50)]  # 30 tokens decoded plainly

        class Ctrl:  # draft 2, then stop; verify both
            def choose(self, k_cap):
                return 2

            def extend(self, keys, k_cap):
                return len(keys) < 2

            def trim(self, keys):
                return len(keys)

        run = Run(tokens=tokens, cfg=SimpleNamespace(draft_min=0), vcfg=None, seed=0, drafter=drafter,
                  stats=None, ctrl=Ctrl())
        draft, _, drafted = run.choose_draft(4)
        rows, seconds = drafter.catch_up
        assert (len(draft), drafted, rows) == (2, 2, 31) and seconds > 0
        assert catch_up_excess(rows, seconds) == pytest.approx(seconds * 29 / 31)
        tokens.extend(draft.tokens + [7])  # both accepted, then the target's token (the loop's commit)
        drafter.observe(tokens, 2)
        run.choose_draft(4)
        assert drafter.catch_up[0] == 2 and catch_up_excess(*drafter.catch_up) == 0.0  # a drafting round's
    finally:
        ctx.close()
        m.close()


def test_ctrl_c_during_the_prompt_keeps_what_the_prefill_did_in_the_stats(tiny_target, monkeypatch):
    """A Ctrl-C between prompt chunks: the statistics (mars run --stats) say how much of the
    prompt was evaluated and how long that took.  They said 0 evaluated in 0 ms, the rest
    "reused from cache", and counted the prefill's time as decoding."""
    from mars_local.llama.context import Context

    with Engine(tiny_target, drafter="ngram", n_ctx=512, n_batch=32, n_threads=2, learned=False) as eng:
        prompt = eng.tokenize("the quick brown fox jumps over the lazy dog " * 20)[:200]
        real, calls = Context._decode, []

        def third_chunk_interrupted(self, toks, n_out):
            calls.append(len(toks))
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real(self, toks, n_out)

        monkeypatch.setattr(Context, "_decode", third_chunk_interrupted)
        with pytest.raises(KeyboardInterrupt):
            eng.generate(prompt, max_tokens=4, temperature=0)
        s = eng.last_stats
        assert s.stop_reason == "interrupted" and s.n_prompt_evaluated == 64 and s.time_prompt_s > 0
        assert s.time_prompt_target_s == 0 and s.time_prompt_s <= s.time_total_s  # (the prompt never ended)

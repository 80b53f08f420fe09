"""Speculating on hybrid/recurrent targets (Qwen3.5's gated delta net layers): the target's state
rolled back through llama.cpp's per-token snapshots (llama/recurrent.py).  Tiny qwen35 models
written by the tests (tests/tinymodels.py), with and without an MTP layer."""

from __future__ import annotations

import numpy as np
import pytest

from head_checks import PROMPTS, mars_relaxes_only_the_runner_up, plain, sampling_has_the_plain_law, strict_equals_plain
from helpers import invoke
from mars_local import Engine
from mars_local.llama.context import Context
from mars_local.llama.recurrent import Rollback
from mars_local.llama.runtime import Model
from mars_local.speculate.batched import Scheduler


@pytest.fixture(scope="session")
def qwen35(tiny_dir):
    from tinymodels import make_tiny_qwen35

    return {n: make_tiny_qwen35(tiny_dir / f"qwen35-nextn{n}.gguf", n_nextn=n, seed=5) for n in (0, 1)}


@pytest.fixture(scope="session")
def qwen35_draft(tiny_dir, qwen35):
    """A llama draft with the qwen35 model's embeddings and output matrix and small blocks: both
    are close to the same bigram model, so the draft agrees with the target often, not always."""
    from tinymodels import make_tiny_llama

    return make_tiny_llama(tiny_dir / "qwen35-draft.gguf", seed=6, like=qwen35[0], block_scale=0.06)


@pytest.fixture(scope="module", params=["mtp", "model", "ngram"])
def eng(request, qwen35, qwen35_draft):
    kw = dict(n_ctx=512, n_threads=2, learned=False)
    if request.param == "mtp":
        e = Engine(qwen35[1], drafter="mtp", **kw)
    elif request.param == "model":
        e = Engine(qwen35[0], qwen35_draft, **kw)
    else:
        e = Engine(qwen35[0], drafter="ngram", **kw)
    with e:
        yield e


# ------------------------------------------------------------------ the bookkeeping (pure)
@pytest.mark.parametrize("last, pending, r, ok", [
    (9, False, 1, True), (9, False, 8, True), (9, False, 9, False),  # a whole decode: a stale snapshot
    (3, False, 2, True), (3, False, 3, False), (1, False, 1, False),
    (9, True, 1, False),  # single-use until the next decode
    (20, False, 9, False),  # deeper than the snapshots kept
    (9, False, 0, False),
])
def test_a_rollback_is_allowed_only_onto_a_kept_snapshot(last, pending, r, ok):
    rb = Rollback(8)
    rb.decoded(last)
    if pending:
        rb.rolled_back()
    assert rb.allows(r) is ok


def test_a_recurrent_context_keeps_less_where_its_state_cannot_go_back(qwen35):
    m = Model(qwen35[0], 0, exact_kernels=True)
    try:
        assert m.recurrent and m.rollback_depth == 8
        ctx = Context(m, n_ctx=256, n_batch=16, n_threads=2)
        toks = list(range(300, 340))
        ctx.eval(toks[:30], n_out=0)
        ctx.eval(toks[30:39], n_out=0)  # a 9-row window
        assert ctx.reachable(33) == 33 and ctx.reachable(30) == 0  # 6 back: kept; the whole window: not
        ctx.truncate(33)
        assert ctx.n_past == 33
        assert ctx.reachable(32) == 0  # a second rollback before a decode: not
        ctx.truncate(32)
        assert ctx.n_past == 0  # dropped whole: the next sync evaluates the prefix again
        assert ctx.sync(toks[:32]) == 32
        ctx.close()
    finally:
        m.close()


def test_rolled_back_state_gives_the_rows_of_a_run_that_never_went_further(qwen35):
    """Bit for bit: a window of 9 rows rolled back by 5 and extended gives the logits that a
    context which decoded only the kept tokens gives (the delta net's state and its conv state
    come from the snapshot, the attention layers' cells are cut)."""
    m = Model(qwen35[0], 0, exact_kernels=True)
    try:
        a, b = (Context(m, n_ctx=256, n_batch=16, n_threads=2) for _ in range(2))
        toks = [int(t) for t in np.random.default_rng(3).integers(300, 380, 40)]
        a.eval(toks[:20], n_out=0)
        a.eval(toks[20:29], n_out=0)
        a.truncate(24)
        za = a.eval(toks[24:30], n_out=6).copy()
        b.eval(toks[:20], n_out=0)
        for i in range(20, 30):  # one row at a time, as plain decoding
            zb = b.eval([toks[i]], n_out=1)
            if i >= 24:
                assert np.array_equal(za[i - 24], zb[0]), i
        a.close()
        b.close()
    finally:
        m.close()


# ------------------------------------------------------------------ lossless
@pytest.mark.parametrize("k", [1, 3, 8, None])
def test_strict_greedy_equals_plain_greedy(eng, k):
    strict_equals_plain(eng, k)


def test_drafts_are_capped_at_the_snapshots_kept(qwen35):
    with Engine(qwen35[1], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        want = plain(e, PROMPTS[2], 30)
        e.reset()
        out = e.generate(PROMPTS[2], max_tokens=30, temperature=0, verify="strict", draft_max=20,
                         adaptive=False, ignore_eos=True)
        assert out.tokens == want and 0 < out.stats.n_drafted <= 8 * out.stats.n_rounds


def test_exact_across_prompt_chunks_reuse_turns_and_a_limit_mid_window(qwen35):
    """n_batch 16: a prompt of several chunks, limits ending inside a window, generations that
    reuse the cache where the state reaches (a chat's next turn extends what it holds) and
    evaluate it again where it does not (another question after the same prefix)."""
    kw = dict(n_ctx=512, n_batch=16, n_threads=2, learned=False)
    with Engine(qwen35[1], drafter="mtp", **kw) as e, Engine(qwen35[1], **kw) as ref:
        g = dict(temperature=0, ignore_eos=True)
        long = PROMPTS[2] * 3
        for n in (40, 7, 13):
            assert e.generate(long, max_tokens=n, verify="strict", draft_max=8, adaptive=False, **g).tokens \
                == plain(ref, long, n)
        for prompt in (long + " hello", PROMPTS[0]):  # a prefix from several decodes ago: evaluated again
            out = e.generate(prompt, max_tokens=30, verify="strict", **g)
            assert out.tokens == plain(ref, prompt, 30)
        msgs, evaluated = [{"role": "user", "content": "hello world"}], []
        for turn in range(3):
            toks = e.chat_prompt(msgs)
            out = e.generate(toks, max_tokens=20, verify="strict", **g)
            assert out.tokens == plain(ref, toks, 20), turn
            evaluated.append(out.stats.n_prompt_evaluated < len(toks))
            msgs += [{"role": "assistant", "content": out.text}, {"role": "user", "content": f"and {turn}"}]
        assert evaluated[1:] == [True, True]  # each turn extends the cache: its state is reused


def test_mars_relaxes_only_the_runner_up_where_the_target_is_undecided(qwen35):
    with Engine(qwen35[1], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        mars_relaxes_only_the_runner_up(e, need_relaxed=False)


@pytest.mark.slow
def test_sampling_on_a_recurrent_target_has_the_plain_distribution(qwen35):
    with Engine(qwen35[1], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        sampling_has_the_plain_law(e)


@pytest.mark.parametrize("adaptive", [False, True], ids=["k3", "adaptive"])
def test_many_sequences_on_a_recurrent_target_stay_exact(eng, adaptive):
    """5 prompts on 3 slots (one leaving early, others joining into slots a state was dropped
    from): each sequence's strict greedy tokens equal plain greedy alone; k = 3: drafts accepted and
    rejected, so every sequence's state was rolled back within a shared decode."""
    prompts = [PROMPTS[i % 3] + " w%d" % i for i in range(5)]
    want = [plain(eng, p, 24) for p in prompts]
    opts = {} if adaptive else dict(draft_max=3, adaptive=False)
    sch = Scheduler(eng, 3)
    try:
        streams = [sch.submit(p, max_tokens=24 if i else 5, temperature=0, verify="strict", ignore_eos=True,
                              **opts) for i, p in enumerate(prompts)]
        got = [[t for c in st for t in c.tokens] for st in streams]
    finally:
        sch.close()
    assert got[0] == want[0][:5] and got[1:] == want[1:]
    if not adaptive:
        accepted = sum(st.stats.n_accepted for st in streams)
        assert 0 < accepted < sum(st.stats.n_drafted for st in streams)


def test_mars_run_speculates_on_a_recurrent_target(qwen35):
    import json

    args = ("run", "-m", qwen35[1], "-n", "24", "--temp", "0", "--verify", "strict", "--json", "hello world")
    r = invoke(*args, "--drafter", "mtp")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["stats"]["n_drafted"] > 0 and got["tokens"] == json.loads(invoke(*args, "--no-draft").stdout)["tokens"]

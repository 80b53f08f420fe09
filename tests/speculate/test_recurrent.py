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
        rb.rolled_back(0)
    assert rb.allows(r) is ok


def test_a_recurrent_context_keeps_what_a_snapshot_or_a_checkpoint_reaches(qwen35):
    m = Model(qwen35[0], 0, exact_kernels=True)
    try:
        assert m.recurrent and m.rollback_depth == 8
        ctx = Context(m, n_ctx=256, n_batch=16, n_threads=2)
        toks = list(range(300, 340))
        ctx.eval(toks[:30], n_out=0)  # prompt chunks of 16 and 14 rows: checkpoints after 16 and 30
        ctx.eval(toks[30:39], n_out=0)  # a 9-row window: snapshots
        assert [ctx.reachable(n) for n in (39, 33, 31, 30, 20, 15)] == [39, 33, 31, 30, 16, 0]
        ctx.truncate(33)  # 6 back: a snapshot
        assert ctx.n_past == 33
        assert ctx.reachable(32) == 30  # a second rollback before a decode: only a checkpoint
        ctx.truncate(32)
        assert ctx.n_past == 30
        ctx.truncate(10)  # before any checkpoint: dropped whole, the next sync evaluates it again
        assert ctx.n_past == 0 and ctx.sync(toks[:32]) == 32
        ctx.close()
    finally:
        m.close()


@pytest.mark.parametrize("keep", [24, 16], ids=["snapshot", "checkpoint"])
def test_rolled_back_state_gives_the_rows_of_a_run_that_never_went_further(qwen35, keep):
    """Bit for bit: 20 prompt tokens (chunks of 16 and 4) and a window of 9 rows, rolled back to
    24 tokens (a snapshot of the window) or to 16 (the first chunk's checkpoint), then extended one
    row at a time, give the logits of a context that decoded only the kept tokens (the delta net's
    state and its conv state restored, the attention layers' cells cut)."""
    m = Model(qwen35[0], 0, exact_kernels=True)
    try:
        a, b = (Context(m, n_ctx=256, n_batch=16, n_threads=2) for _ in range(2))
        toks = [int(t) for t in np.random.default_rng(3).integers(300, 380, 40)]
        a.eval(toks[:20], n_out=0)
        a.eval(toks[20:29], n_out=0)
        a.truncate(keep)
        assert a.n_past == keep
        b.eval(toks[:keep], n_out=0)
        for i in range(keep, 34):
            za, zb = a.eval([toks[i]], n_out=1).copy(), b.eval([toks[i]], n_out=1)
            assert np.array_equal(za, zb), i
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
    reuse the cache through a checkpoint (the same prompt again, another ending after the same
    prefix), a chat (each turn extends what the cache holds), and evaluate again what no
    checkpoint reaches."""
    kw = dict(n_ctx=512, n_batch=16, n_threads=2, learned=False)
    with Engine(qwen35[1], drafter="mtp", **kw) as e, Engine(qwen35[1], **kw) as ref:
        g = dict(temperature=0, ignore_eos=True)
        long = PROMPTS[2] * 3
        for n in (40, 7, 13):
            assert e.generate(long, max_tokens=n, verify="strict", draft_max=8, adaptive=False, **g).tokens \
                == plain(ref, long, n)
        for prompt, reused in ((long, True), (long + " hello", True), (PROMPTS[0], False)):
            out = e.generate(prompt, max_tokens=30, verify="strict", **g)
            assert out.tokens == plain(ref, prompt, 30)
            assert (out.stats.n_prompt_evaluated < len(e.tokenize(prompt)) - 4) is reused, prompt
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


def test_auto_parallel_counts_the_recurrent_states(qwen35, monkeypatch):
    """Each sequence of a recurrent target holds its state, 8 snapshots and 3 checkpoints: the
    default --parallel counts them against the free memory."""
    from mars_local.llama import context
    from mars_local.llama.recurrent import state_bytes
    from mars_local.speculate.batch_cost import auto_parallel

    with Engine(qwen35[0], drafter="ngram", n_ctx=256, n_threads=2, learned=False) as e:
        state = state_bytes(e._ctx)
        assert state > 0 and e._ctx.n_past == 0
        kv = context.kv_cache_bytes(e.target, 256)
        monkeypatch.setattr(context, "available_memory", lambda: 2 * 3 * (kv + 12 * state) + 1)
        assert auto_parallel(e) == 3
        monkeypatch.setattr(context, "available_memory", lambda: 2 * 3 * (kv + 11 * state))
        assert auto_parallel(e) == 2

"""Drafting with the target's own multi-token-prediction (nextn) layers (--drafter mtp): tiny mimo2
models written by the tests (tests/tinymodels.py), with 1 and 2 nextn layers."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import invoke, one_error_line
from mars_local import Engine, MarsError
from mars_local.llama.mtp import check_mtp_model, mtp_layers
from mars_local.speculate.batched import Scheduler

PROMPTS = ["hello world", "the a the hello", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 the end"]


@pytest.fixture(scope="session")
def mimo2(tiny_dir):
    from tinymodels import make_tiny_mimo2

    return {n: make_tiny_mimo2(tiny_dir / f"mimo2-nextn{n}.gguf", n_nextn=n, seed=5) for n in (1, 2)}


@pytest.fixture(scope="module", params=[1, 2], ids=["1-nextn", "2-nextn"])
def eng(request, mimo2):
    with Engine(mimo2[request.param], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        yield e


def plain(e, prompt, n, **kw):
    e.reset()
    return e.generate(prompt, max_tokens=n, temperature=0, draft_max=0, ignore_eos=True, **kw).tokens


# ------------------------------------------------------------------ what a file can draft with
def test_the_nextn_layers_are_read_from_the_header(mimo2, tiny_target):
    assert mtp_layers(mimo2[1]) == ("mimo2", 1) and mtp_layers(mimo2[2]) == ("mimo2", 2)
    assert check_mtp_model(mimo2[2]) == 2
    assert mtp_layers(tiny_target) == ("llama", 0)


def test_a_model_without_nextn_layers_is_one_clear_error(tiny_target):
    with pytest.raises(MarsError, match="no multi-token-prediction"):
        Engine(tiny_target, drafter="mtp")  # refused before llama.cpp loads it (an MTP context would abort)
    r = invoke("run", "-m", tiny_target, "--drafter", "mtp", "-n", "4", "hello")
    assert "no multi-token-prediction (nextn) layers" in one_error_line(r)


@pytest.mark.parametrize("arch, needle", [("qwen35", "recurrent layers"), ("llama", "cannot run the nextn layers")])
def test_architectures_whose_nextn_layers_cannot_draft_are_refused(tmp_path, arch, needle):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MarsError, match=needle):
        check_mtp_model(path)


# ------------------------------------------------------------------ lossless
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, None])
def test_strict_greedy_equals_plain_greedy(eng, k):
    """k fixed 1..8, and adaptive (None); drafts are accepted and rejected (rollback of both contexts)."""
    drafted = accepted = 0
    for prompt in PROMPTS:
        want = plain(eng, prompt, 40)
        eng.reset()
        opts = dict(adaptive=False, draft_max=k) if k else {}
        out = eng.generate(prompt, max_tokens=40, temperature=0, verify="strict", ignore_eos=True, **opts)
        assert out.tokens == want, (prompt, k)
        drafted += out.stats.n_drafted
        accepted += out.stats.n_accepted
    if k:
        assert 0 < accepted < drafted  # the MTP head drafts, some of it right, some wrong


def test_exact_across_prompt_chunks_prefix_reuse_turns_and_a_limit_mid_window(mimo2):
    """A prompt longer than n_batch (chunked), generations reusing the previous one's cache, a
    multi-turn chat, and max_tokens ending inside a window: strict == plain every time."""
    kw = dict(temperature=0, ignore_eos=True)
    with Engine(mimo2[1], drafter="mtp", n_ctx=512, n_batch=16, n_threads=2, learned=False) as e, \
            Engine(mimo2[1], n_ctx=512, n_batch=16, n_threads=2, learned=False) as ref:
        long = PROMPTS[2] * 3  # ~90 tokens: 6 chunks of 16
        for n in (40, 7, 13):  # 7 and 13 end inside a window of k = 8
            assert e.generate(long, max_tokens=n, verify="strict", draft_max=8, adaptive=False, **kw).tokens \
                == plain(ref, long, n)
        # the same and a longer prompt again, without reset: the cached prefix (and its MTP rows) reused
        for prompt in (long, long + " hello", PROMPTS[0]):
            out = e.generate(prompt, max_tokens=30, verify="strict", **kw)
            assert out.tokens == plain(ref, prompt, 30) and out.stats.n_prompt_evaluated < len(e.tokenize(prompt))
        msgs = [{"role": "user", "content": "hello world"}]
        for turn in range(3):
            toks = e.chat_prompt(msgs)
            out = e.generate(toks, max_tokens=20, verify="strict", **kw)
            assert out.tokens == plain(ref, toks, 20), turn
            msgs += [{"role": "assistant", "content": out.text}, {"role": "user", "content": f"and {turn}"}]


def test_mars_relaxes_only_the_runner_up_where_the_target_is_undecided(mimo2):
    theta = 0.9
    with Engine(mimo2[1], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        relaxed = 0
        for prompt in PROMPTS:
            e.reset()
            assert e.generate(prompt, max_tokens=30, temperature=0, verify="mars", theta=1.0, draft_max=4,
                              adaptive=False, ignore_eos=True).tokens == plain(e, prompt, 30)
            e.reset()
            out = e.generate(prompt, max_tokens=30, temperature=0, verify="mars", theta=theta, draft_max=4,
                             adaptive=False, ignore_eos=True)
            prefix = e.tokenize(prompt)
            for i, (tok, kind) in enumerate(zip(out.tokens, out.kinds)):
                z = e.logits(prefix + out.tokens[:i])[0]
                top2 = np.argsort(z)[::-1][:2]
                if kind == "relaxed":
                    relaxed += 1
                    assert tok == top2[1] and z[top2[0]] > 0 and z[top2[1]] / z[top2[0]] > theta, (prompt, i)
                else:
                    assert tok == top2[0], (prompt, i)  # every other token is the target's own greedy choice
    assert relaxed > 0


@pytest.mark.slow
def test_sampling_with_mtp_drafts_has_the_plain_distribution(mimo2):
    """T = 1: the 2nd and 3rd tokens of 400 seeded generations with MTP drafts (their probabilities
    from the MTP head, exact rejection sampling) follow the law of plain sampling (two-sample chi-square)."""
    from test_batched import _two_sample_p

    kw = dict(max_tokens=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
    with Engine(mimo2[1], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        base = [tuple(e.generate(PROMPTS[1], seed=s, draft_max=0, **kw).tokens[1:]) for s in range(400)]
        spec = [tuple(e.generate(PROMPTS[1], seed=10_000 + s, verify="strict", draft_max=2, adaptive=False,
                                 draft_sampling="sample", **kw).tokens[1:]) for s in range(400)]
        assert e.last_stats.n_drafted > 0
    for pos in (0, 1):
        assert _two_sample_p([x[pos] for x in base], [x[pos] for x in spec]) > 1e-3, pos


# ------------------------------------------------------------------ where users meet it
def test_mars_run_drafts_with_mtp(mimo2):
    import json

    args = ("run", "-m", mimo2[1], "-n", "24", "--temp", "0", "--verify", "strict", "--json", "hello world")
    r = invoke(*args, "--drafter", "mtp")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    ref = json.loads(invoke(*args, "--no-draft").stdout)
    assert got["stats"]["n_drafted"] > 0 and got["tokens"] == ref["tokens"]


@pytest.mark.parametrize("n_parallel, n_prompts", [(3, 5), (8, 8)])
def test_many_sequences_draft_with_mtp_and_stay_exact(mimo2, n_parallel, n_prompts):
    """The scheduler drafts every sequence with the MTP layers in lockstep (one MTP decode per
    step for all); each sequence's strict greedy tokens equal plain greedy alone, with a sequence
    leaving early and others joining, and drafts are accepted."""
    prompts = [PROMPTS[i % 3] + " w%d" % i for i in range(n_prompts)]
    with Engine(mimo2[2], drafter="mtp", n_ctx=512, n_threads=2, learned=False) as e:
        want = [plain(e, p, 24) for p in prompts]
        sch = Scheduler(e, n_parallel)
        try:
            streams = [sch.submit(p, max_tokens=24 if i else 5, temperature=0, verify="strict", ignore_eos=True)
                       for i, p in enumerate(prompts)]
            got = [[t for c in st for t in c.tokens] for st in streams]
        finally:
            sch.close()
    assert got[0] == want[0][:5] and got[1:] == want[1:]
    assert sum(st.stats.n_accepted for st in streams) > 0


def test_every_draft_is_the_one_a_fresh_mtp_context_makes_for_its_tokens(mimo2, monkeypatch):
    """Strict output is exact whatever the drafts are, so this checks the drafts themselves: each
    round's MTP draft (after prompt chunks, rollbacks of rejected drafts, accepted drafts evaluated
    again with the target's hidden rows, and prefix reuse) equals the greedy chain a fresh target
    and MTP context compute for the same tokens."""
    from mars_local.llama.context import Context
    from mars_local.llama.mtp import open_mtp
    from mars_local.llama.runtime import Model
    from mars_local.speculate.drafters import HeadDrafter

    seen = []
    propose = HeadDrafter.propose

    def recording(self, tokens, k, extend=None):
        d = propose(self, tokens, k, extend)
        seen.append((list(tokens), list(d.tokens)))
        return d

    monkeypatch.setattr(HeadDrafter, "propose", recording)
    with Engine(mimo2[1], drafter="mtp", n_ctx=512, n_batch=16, n_threads=2, learned=False) as e:
        for prompt in (PROMPTS[2] * 2, PROMPTS[2] * 2 + " hello"):  # the second reuses the first's prefix
            e.generate(prompt, max_tokens=40, temperature=0, verify="strict", draft_max=4, adaptive=False,
                       ignore_eos=True)
    assert len(seen) > 10 and any(len(d) == 4 for _, d in seen)
    m = Model(mimo2[1], 0, exact_kernels=True, load_mtp=True)
    try:
        for tokens, draft in seen[::3]:
            ctx = Context(m, n_ctx=512, n_batch=16, n_threads=2)
            owner = open_mtp(ctx)
            mtp = owner.seq(0)
            try:
                ctx.sync(tokens[:-1])
                row, chain = mtp.eval(tokens, 1)[0], []
                while len(chain) < len(draft):
                    chain.append(int(row.argmax()))
                    row = mtp.eval([chain[-1]], 1)[0]
                assert chain == draft, len(tokens)
            finally:
                owner.close()
                ctx.close()
    finally:
        m.close()


def test_the_mtp_layer_is_fed_the_target_hidden_row_of_the_position_before(tiny_dir, monkeypatch):
    """An MTP layer that reads only its hidden input (eh_proj = [0 | I], a near-identity block)
    predicts what the trunk predicted one position earlier: fed h_{p-1} at p, its first draft
    after a greedy token must be that token again (fed the wrong row, it would not be)."""
    from tinymodels import make_tiny_mimo2

    from mars_local.speculate.drafters import HeadDrafter

    path = make_tiny_mimo2(tiny_dir / "mimo2-reads-hidden.gguf", seed=5, mtp_reads="hidden", mtp_scale=0.001)
    seen = []
    propose = HeadDrafter.propose

    def recording(self, tokens, k, extend=None):
        d = propose(self, tokens, k, extend)
        seen.append((tokens[-1], d.tokens[0] if d.tokens else None))
        return d

    monkeypatch.setattr(HeadDrafter, "propose", recording)
    with Engine(path, drafter="mtp", n_ctx=512, n_batch=16, n_threads=2, learned=False) as e:
        for prompt in PROMPTS:
            e.generate(prompt * 2, max_tokens=30, temperature=0, verify="strict", draft_max=3, adaptive=False,
                       ignore_eos=True)
    assert len(seen) > 20
    assert sum(last == d0 for last, d0 in seen) >= 0.9 * len(seen), seen


def test_the_scheduler_feeds_each_sequence_its_own_hidden_rows(tiny_dir, monkeypatch):
    """As the lone feed test, for sequences drafting in lockstep: with the MTP layer that repeats
    the trunk's previous prediction, each sequence's first draft is its own last token."""
    from tinymodels import make_tiny_mimo2

    from mars_local.speculate.lockstep import DraftSteps

    path = make_tiny_mimo2(tiny_dir / "mimo2-reads-hidden.gguf", seed=5, mtp_reads="hidden", mtp_scale=0.001)
    seen = []
    draft = DraftSteps.draft

    def recording(self):
        d = draft(self)
        seen.append((self.s.run.tokens[-1], d.tokens[0] if d.tokens else None))
        return d

    monkeypatch.setattr(DraftSteps, "draft", recording)
    with Engine(path, drafter="mtp", n_ctx=512, n_batch=16, n_threads=2, learned=False) as e:
        sch = Scheduler(e, 4)
        try:
            streams = [sch.submit(p * 2 + f" w{i}", max_tokens=30, temperature=0, verify="strict", draft_max=3,
                                  adaptive=False, ignore_eos=True) for i, p in enumerate(PROMPTS * 2)]
            for st in streams:
                st.result()
        finally:
            sch.close()
    drafted = [(last, d0) for last, d0 in seen if d0 is not None]
    assert len(drafted) > 20
    assert sum(last == d0 for last, d0 in drafted) >= 0.9 * len(drafted), drafted

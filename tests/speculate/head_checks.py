"""The checks every drafter that reads the target's own rows must pass (its MTP layers:
test_mtp.py; an EAGLE-3 head: test_eagle3.py), each a function over engines the test opens."""

from __future__ import annotations

import numpy as np

from mars_local.speculate.batched import Scheduler
from mars_local.speculate.drafters import HeadDrafter

PROMPTS = ["hello world", "the a the hello", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 the end"]


def plain(e, prompt, n, **kw):
    e.reset()
    return e.generate(prompt, max_tokens=n, temperature=0, draft_max=0, ignore_eos=True, **kw).tokens


def record_drafts(monkeypatch) -> list:
    """(tokens, draft) of every proposal a HeadDrafter makes."""
    seen = []
    propose = HeadDrafter.propose

    def recording(self, tokens, k, extend=None):
        d = propose(self, tokens, k, extend)
        seen.append((list(tokens), list(d.tokens)))
        return d

    monkeypatch.setattr(HeadDrafter, "propose", recording)
    return seen


def every_draft_is_a_fresh_heads(e, model, open_head, monkeypatch) -> None:
    """Strict output is exact whatever the drafts are, so this checks the drafts themselves: each
    round's draft of ``e`` (n_batch 16; after prompt chunks, rejected drafts rolled back, accepted
    drafts evaluated again on the target's rows, and prefix reuse) equals the greedy chain that a
    fresh context of the target ``model`` and ``open_head(context)`` (its head's contexts)
    compute for the same tokens."""
    from mars_local.llama.context import Context

    seen = record_drafts(monkeypatch)
    for prompt in (PROMPTS[2] * 2, PROMPTS[2] * 2 + " hello"):  # the second reuses the first's prefix
        e.generate(prompt, max_tokens=40, temperature=0, verify="strict", draft_max=4, adaptive=False,
                   ignore_eos=True)
    assert len(seen) > 10 and any(len(d) == 4 for _, d in seen)
    for tokens, draft in seen[::3]:
        ctx = Context(model, n_ctx=512, n_batch=16, n_threads=2)
        owner = open_head(ctx)
        head = owner.seq(0)
        try:
            ctx.sync(tokens[:-1])
            row, chain = head.eval(tokens, 1)[0], []
            while len(chain) < len(draft):
                chain.append(int(row.argmax()))
                row = head.eval([chain[-1]], 1)[0]
            assert chain == draft, len(tokens)
        finally:
            owner.close()
            ctx.close()


def strict_equals_plain(eng, k) -> None:
    """k fixed (or adaptive: None): strict greedy == plain greedy on every prompt, and (k fixed)
    drafts both accepted and rejected (rollback of both contexts)."""
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
        assert 0 < accepted < drafted


def exact_across_chunks_reuse_and_turns(e, ref) -> None:
    """``e`` (the head drafting, n_batch 16) against plain ``ref``: a prompt of several chunks,
    max_tokens ending inside a window, generations reusing the cache (and the head's rows), and
    a multi-turn chat: strict == plain every time."""
    kw = dict(temperature=0, ignore_eos=True)
    long = PROMPTS[2] * 3  # ~90 tokens: 6 chunks of 16
    for n in (40, 7, 13):  # 7 and 13 end inside a window of k = 8
        assert e.generate(long, max_tokens=n, verify="strict", draft_max=8, adaptive=False, **kw).tokens \
            == plain(ref, long, n)
    for prompt in (long, long + " hello", PROMPTS[0]):  # no reset: the cached prefix reused
        out = e.generate(prompt, max_tokens=30, verify="strict", **kw)
        assert out.tokens == plain(ref, prompt, 30) and out.stats.n_prompt_evaluated < len(e.tokenize(prompt))
    msgs = [{"role": "user", "content": "hello world"}]
    for turn in range(3):
        toks = e.chat_prompt(msgs)
        out = e.generate(toks, max_tokens=20, verify="strict", **kw)
        assert out.tokens == plain(ref, toks, 20), turn
        msgs += [{"role": "assistant", "content": out.text}, {"role": "user", "content": f"and {turn}"}]


def mars_relaxes_only_the_runner_up(e, theta: float = 0.9, need_relaxed: bool = True) -> None:
    """θ = 1 is plain greedy; at θ every token is the target's greedy choice but where a draft
    equal to the runner-up was accepted with z2/z1 > θ, z1 > 0."""
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
                assert tok == top2[0], (prompt, i)
    assert relaxed > 0 or not need_relaxed


def sampling_has_the_plain_law(e) -> None:
    """T = 1: the 2nd and 3rd tokens of 400 seeded generations with the head's drafts (exact
    rejection sampling with its probabilities) follow plain sampling's law (chi-square)."""
    from test_batched import _two_sample_p

    kw = dict(max_tokens=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
    base = [tuple(e.generate(PROMPTS[1], seed=s, draft_max=0, **kw).tokens[1:]) for s in range(400)]
    spec = [tuple(e.generate(PROMPTS[1], seed=10_000 + s, verify="strict", draft_max=2, adaptive=False,
                             draft_sampling="sample", **kw).tokens[1:]) for s in range(400)]
    assert e.last_stats.n_drafted > 0
    for pos in (0, 1):
        assert _two_sample_p([x[pos] for x in base], [x[pos] for x in spec]) > 1e-3, pos


def many_sequences_stay_exact(e, n_parallel: int, n_prompts: int) -> None:
    """The scheduler drafts every sequence with the head in lockstep; each sequence's strict
    greedy tokens equal plain greedy alone, one leaving early and others joining."""
    prompts = [PROMPTS[i % 3] + " w%d" % i for i in range(n_prompts)]
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


def scheduler_first_drafts(e, monkeypatch) -> list[tuple[int, int]]:
    """(last token, first draft token) of every lockstep draft made after a token the target
    chose (not from a prompt's last token), over 6 sequences on 4 slots, k = 3."""
    from mars_local.speculate.lockstep import DraftSteps

    seen = []
    draft = DraftSteps.draft

    def recording(self):
        d = draft(self)
        run = self.s.run
        if len(run.tokens) > run.stats.n_prompt and d.tokens:
            seen.append((run.tokens[-1], d.tokens[0]))
        return d

    monkeypatch.setattr(DraftSteps, "draft", recording)
    sch = Scheduler(e, 4)
    try:
        streams = [sch.submit(p * 2 + f" w{i}", max_tokens=30, temperature=0, verify="strict", draft_max=3,
                              adaptive=False, ignore_eos=True) for i, p in enumerate(PROMPTS * 2)]
        for st in streams:
            st.result()
    finally:
        sch.close()
    return seen

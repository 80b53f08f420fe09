"""Drafting with an EAGLE-3 head (--drafter eagle3 -md HEAD.gguf): tiny llama targets and tiny eagle3
heads written by the tests (tests/tinymodels.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import invoke, one_error_line
from mars_local import Engine, MarsError
from mars_local.llama.eagle3 import check_eagle3_head
from head_checks import (PROMPTS, every_draft_is_a_fresh_heads, exact_across_chunks_reuse_and_turns,
                         many_sequences_stay_exact, mars_relaxes_only_the_runner_up, plain, record_drafts,
                         sampling_has_the_plain_law, scheduler_first_drafts, strict_equals_plain)

KW = dict(n_ctx=512, n_threads=2, learned=False)


@pytest.fixture(scope="session")
def pair(tiny_dir):
    """A target close to a bigram model and a head that predicts like it part of the time."""
    from tinymodels import make_tiny_eagle3, make_tiny_llama

    target = make_tiny_llama(tiny_dir / "eagle-target.gguf", seed=11, n_layer=3, block_scale=0.05)
    return target, make_tiny_eagle3(tiny_dir / "eagle3-head.gguf", seed=11)


@pytest.fixture(scope="session")
def mimo2_target(tiny_dir):
    """A target whose graph gives its last hidden row for every row (a model with MTP layers'
    graph): what a head reading layer id n_layer needs."""
    from tinymodels import make_tiny_mimo2

    return make_tiny_mimo2(tiny_dir / "eagle-mimo2-target.gguf", n_nextn=0, seed=5)


# ------------------------------------------------------------------ which head fits which target
def test_a_head_is_checked_against_its_target_before_anything_loads(pair, tiny_dir, tiny_target):
    from tinymodels import make_tiny_eagle3

    target, head = pair
    assert check_eagle3_head(head, target) == (0, 1, 2)
    with pytest.raises(MarsError, match="is not an EAGLE-3 head"):
        check_eagle3_head(tiny_target, target)
    wide = make_tiny_eagle3(tiny_dir / "eagle3-wide.gguf", target_embd=96)
    with pytest.raises(MarsError, match="made for a target of width 96"):
        check_eagle3_head(wide, target)
    deep = make_tiny_eagle3(tiny_dir / "eagle3-deep.gguf", target_layers=(0, 1, 7))
    with pytest.raises(MarsError, match=r"reads target layers \[0, 1, 7\]"):
        check_eagle3_head(deep, target)
    last = make_tiny_eagle3(tiny_dir / "eagle3-last.gguf", target_layers=(0, 1, 3))
    with pytest.raises(MarsError, match=r"last hidden row \(layer 3\).*not llama models"):
        check_eagle3_head(last, target)
    r = invoke("run", "-m", target, "-md", tiny_target, "--drafter", "eagle3", "-n", "4", "hello")
    assert "is not an EAGLE-3 head" in one_error_line(r)
    r = invoke("run", "-m", target, "--drafter", "eagle3", "-n", "4", "hello")
    assert "needs the target's EAGLE-3 head (-md HEAD.gguf)" in one_error_line(r)


def test_a_head_of_another_vocabulary_or_a_truncated_head_is_one_clear_line(pair, tiny_dir):
    from tinymodels import make_tiny_eagle3

    other = make_tiny_eagle3(tiny_dir / "eagle3-other-vocab.gguf", token_suffix="x")
    r = invoke("run", "-m", pair[0], "-md", other, "--drafter", "eagle3", "-n", "4", "hello")
    assert r.exit_code != 0 and "does not share the target's tokenizer" in one_error_line(r)
    cut = tiny_dir / "eagle3-truncated.gguf"
    cut.write_bytes(pair[1].read_bytes()[:5000])
    r = invoke("run", "-m", pair[0], "-md", cut, "--drafter", "eagle3", "-n", "4", "hello")
    assert r.exit_code != 0 and "truncated or corrupt" in one_error_line(r)


def test_a_target_whose_layer_inputs_llama_cpp_cannot_give_is_refused(tiny_dir, pair):
    import gguf

    path = tiny_dir / "gemma3-like.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_uint32("gemma3.embedding_length", 64)
    w.add_uint32("gemma3.block_count", 2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MarsError, match="cannot give an EAGLE-3 head the layer inputs of gemma3"):
        check_eagle3_head(pair[1], path)


# ------------------------------------------------------------------ lossless
@pytest.fixture(scope="module")
def eng(pair):
    with Engine(pair[0], pair[1], drafter="eagle3", **KW) as e:
        yield e


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, None])
def test_strict_greedy_equals_plain_greedy(eng, k):
    strict_equals_plain(eng, k)


def test_exact_across_prompt_chunks_prefix_reuse_turns_and_a_limit_mid_window(pair):
    with Engine(pair[0], pair[1], drafter="eagle3", n_batch=16, **KW) as e, Engine(pair[0], n_batch=16, **KW) as ref:
        exact_across_chunks_reuse_and_turns(e, ref)


def test_every_draft_is_the_one_a_fresh_head_makes_for_its_tokens(pair, monkeypatch):
    from mars_local.llama.eagle3 import open_eagle3
    from contextlib import closing

    from mars_local.llama.runtime import Model

    with Engine(pair[0], pair[1], drafter="eagle3", n_batch=16, **KW) as e, \
            closing(Model(pair[0], 0, exact_kernels=True)) as m, closing(Model(pair[1], 0)) as h:
        every_draft_is_a_fresh_heads(e, m, lambda ctx: open_eagle3(ctx, h), monkeypatch)


# ------------------------------------------------------------------ what the head is fed
def test_the_head_reads_the_target_last_hidden_row_of_its_position(mimo2_target, tiny_dir, monkeypatch):
    """A head whose fc passes the third feature (the target's last hidden row, layer id = n_layer)
    through and computes nothing else gives the target's own logits of the position it is fed:
    fed g_{p-1} beside t_p, its first draft after a greedy token is that token again."""
    from tinymodels import make_tiny_eagle3

    head = make_tiny_eagle3(tiny_dir / "eagle3-feature2.gguf", reads="feature2")
    seen = record_drafts(monkeypatch)
    assert check_eagle3_head(head, mimo2_target) == (0, 1, 2)  # 2: the last hidden row of a 2-layer trunk
    with Engine(mimo2_target, head, drafter="eagle3", n_batch=16, **KW) as e:
        for prompt in PROMPTS:
            e.generate(prompt * 2, max_tokens=30, temperature=0, verify="strict", draft_max=3, adaptive=False,
                       ignore_eos=True)
    firsts = [(t[-1], d[0]) for t, d in seen if d]
    assert len(firsts) > 20 and all(last == d0 for last, d0 in firsts), firsts


def test_the_head_reads_the_input_of_the_target_first_layer(pair, tiny_dir, monkeypatch):
    """fc passing the first feature (the input of layer 0: the token embedding of the position
    it is fed) through: the first draft beside t_p is the target's output matrix on the normed
    embedding of t_{p-1}, computed here with numpy from the target's weights."""
    import gguf
    from tinymodels import make_tiny_eagle3

    head = make_tiny_eagle3(tiny_dir / "eagle3-feature0.gguf", reads="feature0")
    weights = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(pair[0])).tensors}
    emb, out = weights["token_embd.weight"], weights["output.weight"]

    def predicted(tok: int) -> int:
        x = emb[tok] / np.sqrt(np.mean(emb[tok] ** 2) + 1e-5)
        return int(np.argmax(out @ x))

    seen = record_drafts(monkeypatch)
    with Engine(pair[0], head, drafter="eagle3", n_batch=16, **KW) as e:
        for prompt in PROMPTS:
            e.generate(prompt, max_tokens=20, temperature=0, verify="strict", draft_max=2, adaptive=False,
                       ignore_eos=True)
    firsts = [(t[-2], d[0]) for t, d in seen if d]
    assert len(firsts) > 10 and all(predicted(prev) == d0 for prev, d0 in firsts), firsts


def test_a_smaller_draft_vocabulary_maps_into_the_target_one(pair, tiny_dir, monkeypatch):
    """d2t: the head's logits cover the target vocabulary, -inf off its image; drafts are target
    ids in that image, and strict output stays exact."""
    from tinymodels import make_tiny_eagle3

    head = make_tiny_eagle3(tiny_dir / "eagle3-d2t.gguf", n_draft_vocab=100)
    image = set(range(0, 300, 3))
    seen = record_drafts(monkeypatch)
    with Engine(pair[0], head, drafter="eagle3", **KW) as e:
        for prompt in PROMPTS:
            want = plain(e, prompt, 30)
            e.reset()
            assert e.generate(prompt, max_tokens=30, temperature=0, verify="strict", draft_max=3, adaptive=False,
                              ignore_eos=True).tokens == want
    drafted = [t for _, d in seen for t in d]
    assert drafted and set(drafted) <= image


# ------------------------------------------------------------------ MARS, sampling
def test_mars_relaxes_only_the_runner_up_where_the_target_is_undecided(pair):
    with Engine(pair[0], pair[1], drafter="eagle3", **KW) as e:
        mars_relaxes_only_the_runner_up(e, need_relaxed=False)


@pytest.mark.slow
def test_sampling_with_eagle3_drafts_has_the_plain_distribution(pair):
    with Engine(pair[0], pair[1], drafter="eagle3", **KW) as e:
        sampling_has_the_plain_law(e)


# ------------------------------------------------------------------ where users meet it
def test_mars_run_drafts_with_an_eagle3_head(pair):
    args = ("run", "-m", pair[0], "-n", "24", "--temp", "0", "--verify", "strict", "--json", "hello world")
    r = invoke(*args, "-md", pair[1], "--drafter", "eagle3")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    ref = json.loads(invoke(*args, "--no-draft").stdout)
    assert got["stats"]["n_drafted"] > 0 and got["tokens"] == ref["tokens"]


@pytest.mark.parametrize("n_parallel, n_prompts", [(3, 5), (8, 8)])
def test_many_sequences_draft_with_the_head_and_stay_exact(pair, n_parallel, n_prompts):
    with Engine(pair[0], pair[1], drafter="eagle3", **KW) as e:
        many_sequences_stay_exact(e, n_parallel, n_prompts)


def test_the_scheduler_feeds_each_sequence_its_own_features(mimo2_target, tiny_dir, monkeypatch):
    """As the lone feed test, for sequences drafting in lockstep: each sequence's first draft
    after a token the target chose is that token, with the head that repeats the target's prediction."""
    from tinymodels import make_tiny_eagle3

    head = make_tiny_eagle3(tiny_dir / "eagle3-feature2.gguf", reads="feature2")
    with Engine(mimo2_target, head, drafter="eagle3", n_batch=16, **KW) as e:
        drafted = scheduler_first_drafts(e, monkeypatch)
    bad = [(i, x) for i, x in enumerate(drafted) if x[0] != x[1]]
    assert len(drafted) > 20 and not bad, bad

"""The cost-realistic stand-in target (benchmarks/make_standin.py): padded, yet the same model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mars_local.llama.context import Context
from mars_local.llama.runtime import Model

from helpers import benchmark_script

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _standin_module():
    return benchmark_script("make_standin")


@pytest.fixture(scope="module")
def padded40(smollm2_f16, tmp_path_factory) -> Path:
    return _standin_module().pad_model(smollm2_f16, tmp_path_factory.mktemp("standin") / "pad40.gguf", 40)


def _greedy(path: Path, prompt: str, n: int) -> tuple[list[int], np.ndarray]:
    m = Model(path, 0)
    ctx = Context(m, n_ctx=256, n_threads=2)
    try:
        toks = m.tokenize(prompt)
        ctx.sync(toks[:-1])
        out, last, first = [], toks[-1], None
        for _ in range(n):
            row = ctx.eval([last], 1)[0]
            if first is None:
                first = row.copy()
            last = int(row.argmax())
            out.append(last)
        return out, first
    finally:
        ctx.close()
        m.close()


def test_padded_model_has_more_blocks_and_the_same_greedy_tokens(smollm2_f16, padded40):
    import gguf

    r = gguf.GGUFReader(str(padded40))
    assert int(r.fields["llama.block_count"].contents()) == 40
    assert any(t.name == "blk.39.ffn_down.weight" and not np.any(t.data) for t in r.tensors)
    assert padded40.stat().st_size > smollm2_f16.stat().st_size * 1.2
    for prompt in ("The capital of France is", "def add(a, b):\n"):
        ref, ref_row = _greedy(smollm2_f16, prompt, 24)
        got, got_row = _greedy(padded40, prompt, 24)
        assert got == ref, prompt
        np.testing.assert_allclose(got_row, ref_row, rtol=0, atol=1e-3)


@pytest.fixture(scope="module")
def widened768(smollm2_f16, tmp_path_factory) -> Path:
    return _standin_module().widen_model(smollm2_f16, tmp_path_factory.mktemp("standin") / "w768.gguf", 768)


def test_widened_model_has_k_quant_depths_and_the_same_greedy_tokens(smollm2_f16, widened768):
    """The K-quant stand-in's base: SmolLM2 768 wide with 12 heads (3 inert), so that every
    matrix's depth is a multiple of 256 (Q4_K_M quantizes it to Q4_K/Q6_K, not Q5_0), and the
    same model: the same greedy tokens, first logits within F16 rounding (norms rescaled; a
    real head moved off its key/value group or unscaled norms move logits by whole units)."""
    import gguf

    r = gguf.GGUFReader(str(widened768))
    assert int(r.fields["llama.embedding_length"].contents()) == 768
    assert int(r.fields["llama.attention.head_count"].contents()) == 12
    matrices = [t for t in r.tensors if len(t.shape) == 2]
    assert matrices and all(int(t.shape[0]) % 256 == 0 for t in matrices)  # ne0: the dot products' depth
    q = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight").data.reshape(12, 64, 768)
    assert [h for h in range(12) if not np.any(q[h])] == [3, 7, 11]  # the inert head ends each kv group
    for prompt in ("The capital of France is", "def add(a, b):\n"):
        ref, ref_row = _greedy(smollm2_f16, prompt, 24)
        got, got_row = _greedy(widened768, prompt, 24)
        assert got == ref, prompt
        # activations are rounded to F16 after norms that now divide by another (equal) rms:
        # on an AVX2 EPYC max 0.034, mean 0.014
        diff = np.abs(got_row - ref_row)
        assert diff.max() < 0.1 and diff.mean() < 0.03, (diff.max(), diff.mean())


def test_widen_refuses_a_width_its_heads_cannot_fill(smollm2_f16, tmp_path):
    with pytest.raises(ValueError, match="cannot widen"):
        _standin_module().widen_model(smollm2_f16, tmp_path / "x.gguf", 700)
    assert not list(tmp_path.iterdir())


def test_pad_refuses_fewer_blocks_than_the_model_has(smollm2_f16, tmp_path):
    with pytest.raises(ValueError, match="cannot pad"):
        _standin_module().pad_model(smollm2_f16, tmp_path / "x.gguf", 10)
    assert not (tmp_path / "x.gguf").exists()


def test_the_mtp_standin_is_smollm2_written_as_mimo2_with_a_nextn_layer(smollm2_f16, tmp_path):
    """benchmarks/make_mtp_standin.py: the same model under mimo2's graph (q/k un-permuted for its
    NEOX rope): first logits within F16 noise of SmolLM2's and the same first greedy tokens; one
    nextn layer that --drafter mtp reads, and strict output with it equals plain."""
    import sys

    from mars_local import Engine
    from mars_local.llama.mtp import mtp_layers

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_mtp_standin import write_mimo2

    path = write_mimo2(smollm2_f16, tmp_path / "mimo2.gguf", 32, None)  # 2 inert blocks
    assert mtp_layers(path) == ("mimo2", 1)
    for prompt in ("The capital of France is", "def add(a, b):\n"):
        ref, ref_row = _greedy(smollm2_f16, prompt, 8)
        got, got_row = _greedy(path, prompt, 8)
        assert got == ref, prompt
        # NEOX rope on un-permuted rows sums in another order: F16 rounding.  On an AVX2-only EPYC
        # every logit moves by ~0.03 (max 0.053), a shift that is no change of the distribution, so
        # the rows are compared centred (there: max 0.027, mean 0.005); a wrong permutation moves
        # logits by whole units
        diff = np.abs((got_row - got_row.mean()) - (ref_row - ref_row.mean()))
        assert diff.max() < 0.15 and diff.mean() < 0.01, (diff.max(), diff.mean())
    with Engine(path, drafter="mtp", n_ctx=256, n_threads=2, learned=False) as e:
        want = e.generate("The capital of France is", max_tokens=16, temperature=0, draft_max=0).tokens
        e.reset()
        got = e.generate("The capital of France is", max_tokens=16, temperature=0, verify="strict", draft_max=2,
                         adaptive=False)
        assert got.tokens == want and got.stats.n_drafted > 0


def test_the_eagle3_standin_head_reads_the_padded_target_and_drafts_exactly(smollm2_f16, padded40, tmp_path):
    """benchmarks/make_eagle3_standin.py on a short fit: a head for the 40-block stand-in that reads
    layers (2, 15, 39) — the last one's input being SmolLM2's final hidden row — fits its target,
    drafts tokens that are accepted at times, and strict output with it equals plain."""
    import sys

    import gguf

    from mars_local import Engine
    from mars_local.llama.eagle3 import check_eagle3_head

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_eagle3_standin import collect, fit, write_head

    embd = np.asarray(next(t for t in gguf.GGUFReader(str(smollm2_f16)).tensors if t.name == "token_embd.weight").data)
    lin = fit(collect(padded40, 39, 24, 48, 2, log=lambda *_: None), embd, 1e-3, log=lambda *_: None)
    head = write_head(smollm2_f16, tmp_path / "head.gguf", (2, 15, 39), lin)
    assert check_eagle3_head(head, padded40) == (2, 15, 39)
    accepted = 0
    with Engine(padded40, head, drafter="eagle3", n_ctx=256, n_threads=2, learned=False) as e:
        for q in ("Name three colours.", "What is the capital of France?", "Write a haiku about rain."):
            prompt = e.chat_prompt([{"role": "user", "content": q}])
            want = e.generate(prompt, max_tokens=32, temperature=0, draft_max=0).tokens
            e.reset()
            got = e.generate(prompt, max_tokens=32, temperature=0, verify="strict", draft_max=1, adaptive=False)
            assert got.tokens == want and got.stats.n_drafted > 0, q
            accepted += got.stats.n_accepted
    assert accepted > 0  # a linear head accepts ~10 % (BENCHMARKS.md); a broken feed would accept none

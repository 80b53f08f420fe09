"""patches/0007: K-quant windows of 17-64 rows over matrices larger than a core's L2 cache.

The column kernels of patches/0004 and 0006 compute Q4_K/Q5_K/Q6_K verify windows (and a batched
round's rows) eight columns per weight row.  For a weight matrix over 1 MB, patches/0007 hands a
thread chunks of weight rows that hold all of a window's columns, and loops weight rows outer,
columns inner, so the weights are read from memory once per window instead of once per 16 columns.
That changes which columns each kernel call takes, which must never change a result: every row of a
window of 17, 24, 33 or 64 rows stays bit for bit the row computed alone.  SmolLM2's K-quant
matrices are all under 1 MB (its width is 576), so this test builds a random model whose are not.

patches/0008: Q5_K rows, one alone included, are summed in the order of llama.cpp's tiled K-quant
kernel, and Q5_K batches of 9+ rows take that kernel: a row alone and in windows of up to 8 rows
(the tiled-order column kernel) must equal the same row in a window of 9+ (the tiled kernel).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from conftest import requantize
from helpers import x86_avx2_build
from tinymodels import make_tiny_llama

pytestmark = pytest.mark.skipif(not x86_avx2_build(), reason="patches/0004 and 0006-0008 change x86 AVX2/AVX-512 code only")

L2_BYTES = 1 << 20  # patches/0007's threshold


@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory):
    """One block 1024 wide with a 2048-wide FFN: its FFN matrices are 1.7 MB in Q6_K, 1.2-1.4 MB in Q5_K/Q4_K."""
    path = tmp_path_factory.mktemp("wide") / "wide-f32.gguf"
    return make_tiny_llama(path, n_embd=1024, n_head=8, n_head_kv=4, n_ff=2048, n_layer=1, seed=7, block_scale=0.05)


@pytest.mark.parametrize("ftype", ["Q6_K", "Q5_K_M"])
def test_windows_over_large_k_quant_matrices_are_batch_invariant(wide_tiny, ftype):
    from mars_local.llama.invariance import batch_invariance

    model = requantize(wide_tiny, f"wide-tiny-{ftype}.gguf", f"LLAMA_FTYPE_MOSTLY_{ftype}")
    kquant = {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K}
    large = [t.name for t in gguf.GGUFReader(str(model)).tensors if t.tensor_type in kquant and t.n_bytes > L2_BYTES]
    assert any("ffn" in name for name in large), large  # the test covers patches/0007's path
    res = batch_invariance(model, windows=(2, 8, 9, 17, 24, 33, 64), n=64, n_threads=2, prompt="a b c d e f g h")
    assert {w: d for w, (d, _) in res.items()} == {w: 0 for w in res}, res
    assert all(np.isfinite(m) for _, m in res.values())

"""`llama.kernels`: which exact kernels a build runs per weight type (what `mars doctor` shows)."""

import pytest

from mars_local.llama.kernels import GRAPH_KEY_VAR, cpu_features, cuda_graph_cache, kernel_paths

ZEN4 = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
        "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |")
AVX2 = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 | OPENMP = 1 |"
NEON = "CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | OPENMP = 1 | REPACK = 1 |"


def test_cpu_features_reads_the_features_that_are_on():
    assert cpu_features("AVX = 1 | AVX2 = 1 | AVX512 = 0 | LLAMAFILE = 1") == {"AVX", "AVX2", "LLAMAFILE"}
    assert cpu_features("") == set()
    assert "AVX512_BF16" in cpu_features(ZEN4) and "AVX512" in cpu_features(ZEN4)


@pytest.mark.parametrize("info", [ZEN4, AVX2])
def test_x86_with_llamafile_names_the_tile_and_every_weight_family(info):
    paths = kernel_paths(info)
    assert set(paths) == {"F16, BF16, F32", "Q8_0, Q4_0, Q5_0, IQ4_NL", "Q4_1", "Q4_K, Q6_K", "Q5_K",
                          "Q2_K, Q3_K, Q5_1, other IQ", "repacked weights"}
    assert "eight rows per weight row" in paths["Q4_K, Q6_K"]
    assert "order of llama.cpp's tiled kernel" in paths["Q5_K"] and "patches/0008" in paths["Q5_K"]
    assert "8x1 tiles" in paths["F16, BF16, F32"] and "at most 2 KB" in paths["F16, BF16, F32"]
    assert "dot kernels up to 64 rows" in paths["Q2_K, Q3_K, Q5_1, other IQ"]
    assert "tinyBLAS at every batch size" in paths["Q4_1"] and "patches/0016" in paths["Q4_1"]
    assert "measured them exact" in paths["repacked weights"]


def test_q5_k_takes_the_tiled_order_only_with_fma():
    """patches/0008 mirrors the tiled kernel's fused float steps: an AVX2 build without FMA keeps Q5_K
    with Q4_K and Q6_K (the dot kernel's order)."""
    no_fma = AVX2.replace("FMA = 1 | ", "")
    assert "Q5_K" not in kernel_paths(no_fma) and "Q4_K, Q5_K, Q6_K" in kernel_paths(no_fma)


def test_q4_k_windows_take_the_column_kernel_only_where_it_is_built():
    """patches/0004 and 0006 are AVX2 code (AVX-512 builds compile it too); an AVX-only x86 build has no such kernel."""
    avx_only = AVX2.replace("AVX2 = 1 | ", "")
    assert "Q4_K, Q5_K, Q6_K" not in kernel_paths(avx_only) and "K-quants, Q4_1, Q5_1, other IQ" in kernel_paths(avx_only)
    assert "Q4_1" not in kernel_paths(avx_only)  # (patches/0016's Q4_1 tiles are AVX2 code too)


@pytest.mark.parametrize("info", [NEON, AVX2.replace("LLAMAFILE = 1", "LLAMAFILE = 0")])
def test_without_llamafile_every_type_takes_the_dot_kernels(info):
    paths = kernel_paths(info)
    assert list(paths) == ["all"] and "dot kernels for every batch of up to 64 rows" in paths["all"]


def test_an_arm_cpu_with_i8mm_names_the_mmla_kernel_kept_for_prompts():
    """patches/0009: the 2x2 mmla kernel sums in another order, so windows keep the dot kernel."""
    i8mm = kernel_paths(NEON.replace("DOTPROD = 1", "DOTPROD = 1 | MATMUL_INT8 = 1"))["all"]
    assert "mmla" in i8mm and "patches/0009" in i8mm
    assert "mmla" not in kernel_paths(NEON)["all"]


def test_a_gpu_backend_names_its_16_row_bound_and_what_is_not_guaranteed():
    paths = kernel_paths(ZEN4, backend="cuda")
    assert list(paths) == ["all"] and paths["all"].startswith("cuda")
    assert "within 16 rows" in paths["all"] and "not guaranteed on other GPUs" in paths["all"]


@pytest.mark.parametrize("value, says", [
    (None, "stock's"), ("", "stock's"), ("0", "stock's"), ("-3", "stock's"), ("yes", "stock's"),
    ("1", "one graph per forward shape (MARS_CUDA_GRAPH_KEY_PER_SHAPE=1)"),
    ("2", "one graph per forward shape (MARS_CUDA_GRAPH_KEY_PER_SHAPE=2)"),
    (" 8x", "captured once that shape has run 8 times"),  # read as the patch's atoi reads it
])
def test_the_cuda_graph_cache_is_described_as_patch_0015_reads_its_variable(value, says):
    env = {} if value is None else {GRAPH_KEY_VAR: value}
    text = cuda_graph_cache(env)
    assert text.startswith(says) if says == "stock's" else says in text
    if says == "stock's":
        assert "per forward shape" in text and "off by default" in text

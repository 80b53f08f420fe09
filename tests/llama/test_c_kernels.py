"""The kernels our patches add or change, called directly from C on random blocks.

Every CPU: a verify window's rows equal single rows through ggml's own mul_mat op
(``mulmat_window_check.c``: W times 2-64 rows against W times each row alone, bit for bit, for
every weight type mars-local loads).  It found patches/0009's case: on ARM with i8mm, ggml
took a 2x2 mmla kernel for even-sized batches of Q4_0/Q4_1/Q8_0/Q4_K/Q6_K, which sums in
another order than a decoding step's dot kernel (cross-built and run under qemu-user;
``scripts/arm_window_check.sh``).

patches/0005: the repacked Q4_K kernels of an x86 build are batch-invariant.

llama.cpp repacks Q4_K weights into interleaved blocks with a 1-row kernel (gemv: a decoding step)
and a 4-rows-at-a-time kernel (gemm: a verify window's rows).  Stock's two summed in different float
orders, and quantized a batch's activations with another sign rule, so a verify window's rows
differed from plain decoding's in the last bits and mars-local had to load Q4_K targets without
repacking (its slower, exact kernels).  ``repack_q4k_check.c`` calls the installed libggml-cpu's
kernels directly on random blocks: a row alone and in batches of 4-32 rows must agree bit for bit,
rows holding both +max and -max included.  (Whether a whole model is loaded repacked stays a
load-time measurement: speculate/repack.py and test_smollm2.py.)

patches/0006: the q6_K window kernel (eight columns per weight row) gives every column what the
1-row dot kernel gives it alone (``q6k_cols_check.c``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import x86_avx2_build

HERE = Path(__file__).resolve().parent

x86_only = pytest.mark.skipif(not x86_avx2_build(), reason="patches/0005 and 0006 change x86 AVX2/AVX-512 kernels only")


def _build(name: str, out: Path) -> Path:
    """``name``.c built against the installed llama-cpp-python's libraries and headers."""
    import llama_cpp

    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (the set-up contract's gcc) builds the kernel check"
    pkg = Path(llama_cpp.__file__).parent
    lib, include = pkg / "lib", pkg.parent / "include"  # (the wheel installs the headers beside the package)
    exe = out / name
    proc = subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / f"{name}.c"), f"-I{include}", f"-L{lib}",
                           f"-Wl,-rpath,{lib}", "-lllama", "-lggml", "-lggml-cpu", "-lggml-base", "-lm"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return exe


# every weight type the invariance tests cover, and the ones mars-local only loads (Q2_K, Q3_K, Q5_1)
WINDOW_TYPES = ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q2_K", "q3_K", "q4_K", "q5_K",
                "q6_K"]


@pytest.fixture(scope="module")
def window_checker(tmp_path_factory) -> Path:
    return _build("mulmat_window_check", tmp_path_factory.mktemp("windows"))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("wtype", WINDOW_TYPES)
def test_a_window_row_equals_the_row_alone_through_ggml_mul_mat(window_checker, wtype, threads):
    proc = subprocess.run([str(window_checker), wtype, str(threads)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"ok: {wtype},"), proc.stdout


@pytest.mark.parametrize("threads", [1, 3])
def test_q4_1_rows_and_prompts_in_every_tile_shape_equal_single_rows(window_checker, threads):
    """patches/0016 sends Q4_1 through tinyBLAS at every batch size: with 100 weight rows (not a
    multiple of the 8x1 or 4xN tiles, so one row takes the mixed tiles too) and prompts of 65-130
    rows, every row must still equal the row alone and the float product."""
    rows = ["2", "3", "5", "9", "17", "64", "65", "130"]
    proc = subprocess.run([str(window_checker), "q4_1", str(threads), "576", "100", *rows], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok: q4_1, windows of 2-130 rows"), proc.stdout


@pytest.fixture(scope="module")
def model_checker(tmp_path_factory) -> Path:
    return _build("model_window_check", tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize("model", ["smollm2", "smollm2_q4km"])
def test_a_whole_models_windows_equal_plain_decoding_through_libllama_alone(model_checker, model, request):
    """model_window_check.c: what scripts/arm_window_check.sh runs under qemu-user, here on this CPU
    (SmolLM2's Q4_1 and Q4_K_M: windows of 2-17 rows against one-row decoding, every logit)."""
    proc = subprocess.run([str(model_checker), str(request.getfixturevalue(model)), "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok: windows of 2-17 rows"), proc.stdout


@x86_only
def test_the_window_check_sees_a_prompt_take_another_kernel(window_checker):
    """The check can fail: a prompt's batch (65+ rows) takes llama.cpp's tiled K-quant kernel on
    x86, which sums in another order than the dot kernel of a decoding step."""
    proc = subprocess.run([str(window_checker), "q4_K", "2", "2048", "512", "65", "128"], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "q4_K, 65 rows:" in proc.stdout and "q4_K, 128 rows:" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    return _build("repack_q4k_check", tmp_path_factory.mktemp("repack"))


@x86_only
@pytest.mark.parametrize("rows", [4, 8, 16, 20, 32])
@pytest.mark.parametrize("ties", [0, 1])
def test_a_row_in_a_repacked_q4_k_batch_equals_the_row_alone(checker, rows, ties):
    for seed, cols in ((1, 8), (2, 16), (3, 24)):
        proc = subprocess.run([str(checker), str(seed), str(rows), str(cols), str(ties)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.startswith("ok:"), proc.stdout


@x86_only
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_q6_k_window_column_equals_the_column_alone(tmp_path, seed):
    proc = subprocess.run([str(_build("q6k_cols_check", tmp_path)), str(seed)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok:"), proc.stdout

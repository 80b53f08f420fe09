"""The x86 kernels our patches add or change, called directly from C on random blocks.

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

pytestmark = pytest.mark.skipif(not x86_avx2_build(), reason="patches/0005 and 0006 change x86 AVX2/AVX-512 kernels only")


def _build(name: str, out: Path) -> Path:
    """``name``.c built against the installed llama-cpp-python's ggml libraries."""
    import llama_cpp

    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (the set-up contract's gcc) builds the kernel check"
    lib = Path(llama_cpp.__file__).parent / "lib"
    exe = out / name
    subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / f"{name}.c"), f"-L{lib}", f"-Wl,-rpath,{lib}",
                    "-lggml-cpu", "-lggml-base", "-lm"], check=True, capture_output=True, text=True)
    return exe


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    return _build("repack_q4k_check", tmp_path_factory.mktemp("repack"))


@pytest.mark.parametrize("rows", [4, 8, 16, 20, 32])
@pytest.mark.parametrize("ties", [0, 1])
def test_a_row_in_a_repacked_q4_k_batch_equals_the_row_alone(checker, rows, ties):
    for seed, cols in ((1, 8), (2, 16), (3, 24)):
        proc = subprocess.run([str(checker), str(seed), str(rows), str(cols), str(ties)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.startswith("ok:"), proc.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_q6_k_window_column_equals_the_column_alone(tmp_path, seed):
    proc = subprocess.run([str(_build("q6k_cols_check", tmp_path)), str(seed)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok:"), proc.stdout

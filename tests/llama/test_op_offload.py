"""An exact target kept on the CPU of a GPU build: llama.cpp must not send its big forwards to the GPU.

llama.cpp offloads a forward of 32+ rows of CPU-resident weights to a GPU backend when there is one
("op offload"); the GPU's kernels sum otherwise than the CPU's single-row ones, so an exact target
loaded with no GPU layers on a CUDA build would make windows of 32-64 rows (8 sequences of 4 rows)
differ from lone rows.  Without a GPU here, the build is told it has one."""

from __future__ import annotations

import pytest

import mars_local.llama.runtime as runtime
from mars_local.llama.context import context_params
from mars_local.llama.runtime import Model


@pytest.mark.parametrize("gpu, n_gpu_layers, exact, want_cpu_exact", [
    (True, 0, True, True),     # a GPU build, the target kept on the CPU, exact: op offload off
    (True, 0, False, False),   # not exact (a draft, --fast-kernels): llama.cpp's default
    (False, 0, True, False),   # a CPU build: nothing to offload to
    (False, None, True, False),
    (True, None, True, False),  # every layer on the GPU: its kernels, not the CPU's (not guaranteed)
])
def test_op_offload_is_off_only_for_an_exact_model_left_on_the_cpu_of_a_gpu_build(
        monkeypatch, tiny_target, gpu, n_gpu_layers, exact, want_cpu_exact):
    monkeypatch.setattr(runtime, "gpu_offload_supported", lambda: gpu)
    m = Model(tiny_target, n_gpu_layers, exact_kernels=exact)
    try:
        assert m.cpu_exact_on_gpu_build is want_cpu_exact
        cp, _ = context_params(m, 256)
        assert cp.op_offload is (not want_cpu_exact)
    finally:
        m.close()

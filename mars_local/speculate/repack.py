"""Weight repacking for an exact target, decided by a measurement on this machine.

llama.cpp repacks quantized weights when it loads them (Q4_0, Q4_K, Q8_0, IQ4_NL, ... into
interleaved layouts with faster kernels: its CPU "extra buffer types").  Whether the repacked kernels
keep a row's result independent of how many rows share its forward (the condition for strict greedy
== plain greedy) depends on the weight type, on the CPU's kernels and on the build: on a Zen 4 the
repacked Q4_0 kernels do (one row 2.8x cheaper than without them) and the Q4_K ones do not
(BENCHMARKS.md).  A guess would be wrong somewhere, so an exact target is loaded repacked only where
a measurement says so: the first time a (model file, llama.cpp build) pair is loaded on the CPU, it is
loaded repacked and :func:`mars_local.llama.invariance.model_invariance` compares windows of 2, 5 and 9
rows with single rows, bit for bit; the verdict goes into the learned state (``mars doctor`` lists it,
``--reset-learned`` forgets it), and the model is loaded again without repacking if any row differed.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..llama.gguf_file import gguf_metadata
from ..llama.invariance import model_invariance
from ..llama.runtime import Model, build_fingerprint, gpu_offload_supported
from .learned import LearnedStore, file_fingerprint

__all__ = ["load_exact_target", "repack_key", "PROBE_WINDOWS"]

# general.file_type values whose weights llama.cpp never repacks: all F32, mostly F16, mostly BF16
FLOAT_FILE_TYPES = frozenset({0, 1, 32})
PROBE_WINDOWS = (2, 5, 9)  # a repacked gemv (< 4 rows), its gemm (4 rows at a time), and both mixed
PROBE_TOKENS = 9


def repack_key(path: str | os.PathLike) -> str:
    return f"repack|{file_fingerprint(path)}|{build_fingerprint()}"


def load_exact_target(path: str | os.PathLike, n_gpu_layers: int | None, store: LearnedStore | None, *,
                      n_threads: int | None = None, **model_kw) -> Model:
    """The target of exact decoding: repacked where this machine's measurement (made now, once per
    model and build, or remembered in ``store``) shows the repacked kernels batch-invariant, else not.
    Without a store, on a GPU or RPC placement, for MTP targets, recurrent targets or float weights:
    not repacked, no measurement.  ``model_kw`` go to :class:`Model`."""
    def exact() -> Model:
        return Model(path, n_gpu_layers, exact_kernels=True, **model_kw)

    offload = gpu_offload_supported() and n_gpu_layers != 0
    if store is None or offload or model_kw.get("devices") or model_kw.get("load_mtp"):
        return exact()
    if gguf_metadata(Path(path)).get("general.file_type") in FLOAT_FILE_TYPES:
        return exact()
    key = repack_key(path)
    known = store.get(key)
    if known is not None and isinstance(known.get("invariant"), bool):
        return Model(path, n_gpu_layers, exact_kernels=not known["invariant"], **model_kw)
    repacked = Model(path, n_gpu_layers, exact_kernels=False, **model_kw)
    if repacked.recurrent:  # the probe rolls whole windows back: a recurrent state cannot (llama/recurrent.py)
        repacked.close()
        store.put(key, {"invariant": False, "recurrent": True})  # not measured: kept as not repacked
        store.save()
        return exact()
    try:
        rows = model_invariance(repacked, PROBE_WINDOWS, PROBE_TOKENS, n_threads)
    except BaseException:
        repacked.close()
        raise
    invariant = all(differ == 0 for differ, _ in rows.values())
    store.put(key, {"invariant": invariant, "windows": {str(w): d for w, (d, _) in rows.items()}})
    store.save()
    if invariant:
        return repacked
    repacked.close()
    return exact()

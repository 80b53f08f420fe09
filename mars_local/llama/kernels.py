"""Which CPU kernels the exact build runs, per weight type (what `mars doctor` reports).

Strict greedy speculative output equals plain greedy output only if a row computed in a verify
window of k+1 rows is bit-identical to the same row computed alone (a plain decoding step).  Stock
llama.cpp sends those two through different kernels; our patches (patches/0002-0011, 0013-0014) choose, per
weight type, kernels whose summation order does not depend on the batch size.  What each choice
costs against stock llama.cpp is measured by ``benchmarks/kernel_costs.py`` (BENCHMARKS.md, one
table per CPU).  This module only *describes* the choice for a build, from llama.cpp's system-info
line; it loads nothing.
"""

from __future__ import annotations

import re

__all__ = ["cpu_features", "cuda_graph_cache", "kernel_paths"]

# patches/0015: how a CUDA build keeps the CUDA graphs its forwards are replayed from
GRAPH_KEY_VAR = "MARS_CUDA_GRAPH_KEY_PER_SHAPE"


def cpu_features(system_info: str) -> set[str]:
    """The features a ``llama_print_system_info`` line reports as on (``AVX512 = 1 | ...``)."""
    return {m.group(1).upper() for m in re.finditer(r"([A-Za-z0-9_]+)\s*=\s*1\b", system_info)}


def kernel_paths(system_info: str, backend: str = "cpu") -> dict[str, str]:
    """{weight types: the kernels one row and a verify window (2-64 rows) take} for this build."""
    feats = cpu_features(system_info)
    if backend != "cpu":
        return {"all": f"{backend} kernels for offloaded layers, verify windows and batched rounds kept "
                       "within 16 rows a forward (on an H200 windows and batches of up to 16-17 rows matched single rows bit for bit "
                       "and 32-33 did not; on an H100 8 batched sequences decoded so equalled plain greedy 8 of 8, "
                       "as one 32-row forward 7 of 8; a round of more rows takes several forwards; --fast-kernels lifts the "
                       "bound); not guaranteed on other GPUs: check one with benchmarks/batch_invariance.py. A "
                       "target loaded with -ngl 0 takes the CPU's exact kernels, its 32+-row forwards kept off the GPU"}
    x86 = bool(feats & {"AVX", "AVX2", "AVX512"})
    if not (x86 and "LLAMAFILE" in feats):
        mmla = ("; on this ARM CPU's i8mm, Q4_0, Q4_1, Q8_0, Q4_K and Q6_K batches of up to 64 rows keep the dot "
                "kernel too, the 2x2 mmla kernel (another summation order) only for prompts (patches/0009)"
                if "MATMUL_INT8" in feats else "")
        return {"all": "ggml's dot kernels for every batch of up to 64 rows (exact; a window of k+1 rows "
                       f"costs about k+1 single rows), tiled kernels above (prompts){mmla}"}
    cols = "AVX2" in feats or "AVX512" in feats  # the K-quant column kernels (patches/0004, 0006) are AVX2 code
    tiled_q5 = cols and "FMA" in feats  # patches/0008: the tiled kernel's float steps are fused
    return {
        "F16, BF16, F32": "tinyBLAS at every batch size (one row in 8x1 tiles, each prefetching the next "
                          "tile's rows, and windows of up to 17 rows over weight rows of at most 2 KB their next "
                          "row tile, patches/0013; windows and prompts in stock's tiles, the same sum per element)",
        "Q8_0, Q4_0, Q5_0, IQ4_NL": "tinyBLAS at every batch size (one accumulator per element whatever "
                                    "the tile; one row in 8x1 tiles and windows in 4xN tiles, each prefetching "
                                    "the next row tile, patches/0014)",
        **({"Q4_1": "tinyBLAS at every batch size, where stock has only its dot kernels: one row in 8x1 tiles, "
                    "each block's d*d'*dot and m*s summed as the dot kernel sums them, so every row is bit for bit "
                    "stock's (patches/0016)"} if cols else {}),
        **({("Q4_K, Q6_K" if tiled_q5 else "Q4_K, Q5_K, Q6_K"):
            "ggml's dot kernel for one row; windows of up to 64 rows eight rows per weight row (patches/0004, "
            "0006: each result summed as the dot kernel sums it alone; 0007: a large matrix read once), tiled above"}
           if cols else {}),
        **({"Q5_K": "every row summed in the order of llama.cpp's tiled kernel: one row and windows of up to 8 rows "
                    "eight rows per weight row, 9+ rows the tiled kernel itself, at stock's speed (patches/0008)"}
           if tiled_q5 else {}),
        ("Q2_K, Q3_K, Q5_1, other IQ" if cols else "K-quants, Q4_1, Q5_1, other IQ"): "ggml's dot kernels up to 64 rows (a 1-row step's kernel), tiled above",
        "repacked weights": "used for a quantized target only where its first load measured them exact on "
                            "this CPU and build (learned state below; e.g. Q4_0 on a Zen 4, and Q4_K: "
                            "patches/0005 makes its 1-row kernel sum as its batch kernel does)",
    }


def cuda_graph_cache(environ) -> str:
    """What ``MARS_CUDA_GRAPH_KEY_PER_SHAPE`` in ``environ`` asks of a CUDA build's graph cache
    (patches/0015), read as the patch reads it (C's atoi: leading digits, else 0)."""
    m = re.match(r"\s*([+-]?\d+)", environ.get(GRAPH_KEY_VAR, ""))
    n = int(m.group(1)) if m else 0
    if n <= 0:
        return (f"stock's: one graph for all of a context's forwards, which speculative rounds change the shape "
                f"of ({GRAPH_KEY_VAR}=1: one graph per forward shape; off by default, see README)")
    if n <= 2:
        return f"one graph per forward shape ({GRAPH_KEY_VAR}={n})"
    return f"one graph per forward shape, captured once that shape has run {n} times ({GRAPH_KEY_VAR}={n})"

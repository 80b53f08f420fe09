#!/usr/bin/env python3
"""What the exact (batch-invariant) build's kernels cost against stock llama.cpp, per weight type.

    .venv/bin/python benchmarks/kernel_costs.py [-t 2] [--types F16,BF16,Q8_0,Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K] [--rounds 2]

Runs llama.cpp's own ``llama-bench`` twice per round, interleaved: once as built stock
(``benchmarks/build_llama_tools.sh``, weight repacking on, as llama.cpp users get it) and once
against our patched ggml (the libraries of the installed llama-cpp-python, loaded through
LD_LIBRARY_PATH, ``--repack 0`` as mars-local runs them), on the same model, threads and tests:
one row (decoding, ``-n``), verify windows of w rows at a depth (``-p w -d D``), and a prompt.
Prints milliseconds per forward and exact / stock: the median over rounds of each run's mean, and the
ratio of the fastest repetitions over all rounds (robust on a shared machine, where noise only adds time).

The models are **wide stand-ins** (``.cache/wide/``, written on first use): random weights in the
shape of a 7B Llama (width 4096, FFN 11008, 32 heads, 8 KV heads) with 4 blocks, one file per
weight type.  Kernel costs depend on the matrices' shape as well as on their bytes: the padded
SmolLM2 stand-in (``make_standin.py``) is 576 wide, where per-row overheads that vanish at width
4096 dominate, so it misjudges which kernel is faster for real targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K")


def cache_dir() -> Path:
    return Path(os.environ.get("MARS_CACHE_DIR", ROOT / ".cache"))


def wide_models(types, n_layer: int = 4) -> dict[str, Path]:
    """The wide stand-in in each weight type (written once, then reused)."""
    import ctypes

    import llama_cpp

    sys.path.insert(0, str(ROOT / "tests"))
    from tinymodels import make_tiny_llama

    out = cache_dir() / "wide"
    out.mkdir(parents=True, exist_ok=True)
    paths = {t: out / f"wide{n_layer}-{t}.gguf" for t in types}
    missing = [t for t, p in paths.items() if not p.exists()]
    if not missing:
        return paths
    f32 = out / f"wide{n_layer}-F32.gguf"
    print(f"writing the wide stand-in ({n_layer} blocks of a 7B's shape) -> {out}", file=sys.stderr)
    make_tiny_llama(f32, n_vocab=384, n_embd=4096, n_head=32, n_head_kv=8, n_ff=11008, n_layer=n_layer,
                    block_scale=0.02)
    try:
        for t in missing:
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{t}")
            params.nthread = os.cpu_count() or 1
            tmp = paths[t].with_suffix(".part")
            if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
                raise SystemExit(f"error: quantizing the wide stand-in to {t} failed")
            tmp.replace(paths[t])
    finally:
        f32.unlink(missing_ok=True)
    return paths


def exact_lib_dir() -> Path:
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def bench(binary: Path, model: Path, threads: int, windows, prompt: int, depth: int, reps: int,
          exact_lib: Path | None, repack: bool = False, stock_lib: Path | None = None
          ) -> dict[str, tuple[float, float]]:
    """{test: (mean ms per forward, fastest repetition's ms per forward)} from one llama-bench run:
    our libraries with ``exact_lib``, else stock (``stock_lib``: stock libraries other than the
    binary's own, e.g. built for another ISA level)."""
    env = dict(os.environ)
    args = [str(binary), "-m", str(model), "-t", str(threads), "-r", str(reps), "-o", "json"]
    lib = exact_lib or stock_lib
    if lib:
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    if exact_lib:
        args += ["--repack", "1" if repack else "0"]
    out: dict[str, tuple[float, float]] = {}
    runs = [["-p", ",".join(str(w) for w in windows), "-n", "8", "-d", str(depth)],
            ["-p", str(prompt), "-n", "0"]]
    for extra in runs:
        proc = subprocess.run(args + extra, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"error: {binary.name} failed on {model.name}: {proc.stderr.strip()[-300:]}")
        for row in json.loads(proc.stdout):
            n_p, n_g = row["n_prompt"], row["n_gen"]
            per = n_g or 1
            ms = (row["avg_ns"] / 1e6 / per, min(row.get("samples_ns") or [row["avg_ns"]]) / 1e6 / per)
            if n_g:
                out["1 row (tg)"] = ms
            elif n_p == prompt and row.get("n_depth", 0) == 0:
                out[f"prompt {n_p}"] = ms
            else:
                out[f"{n_p} rows"] = ms
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (stock, exact, stock, ...)")
    ap.add_argument("--reps", type=int, default=2, help="llama-bench -r")
    ap.add_argument("--windows", default="2,5,9,17")
    ap.add_argument("--depth", type=int, default=150)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--llama-cpp-bin", type=Path, default=cache_dir() / "llama-bin")
    ap.add_argument("--exact-lib", type=Path, default=None,
                    help="the patched ggml/llama libraries (default: the installed llama-cpp-python's)")
    ap.add_argument("--stock-lib", type=Path, default=None,
                    help="stock ggml/llama libraries to load instead of the llama-bench build's own (the same "
                         "llama.cpp built for another ISA level, to compare with --exact-lib built alike)")
    ap.add_argument("--exact-repack", default="",
                    help="weight types (of --types) whose exact side loads repacked (as mars-local does where it "
                         "measured the repacked kernels exact on this machine: speculate/repack.py), e.g. Q4_0,Q4_K_M")
    ap.add_argument("--json", type=Path, help="write the raw figures here")
    a = ap.parse_args(argv)
    binary = a.llama_cpp_bin / "llama-bench"
    if not binary.exists():
        print(f"error: {binary} not found: run benchmarks/build_llama_tools.sh", file=sys.stderr)
        return 1
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    bad = [t for t in types if t not in TYPES]
    if bad:
        print(f"error: unknown weight type {bad[0]!r} (one of {', '.join(TYPES)})", file=sys.stderr)
        return 2
    windows = [int(w) for w in a.windows.split(",")]
    exact_lib = a.exact_lib or exact_lib_dir()
    repacked = {t.strip() for t in a.exact_repack.split(",") if t.strip()}
    if repacked - set(TYPES):
        print(f"error: --exact-repack: unknown weight type {sorted(repacked - set(TYPES))[0]!r} "
              f"(one of {', '.join(TYPES)})", file=sys.stderr)
        return 2
    models = wide_models(types, a.layers)
    # raw[type][side][test]: the mean ms of each round; best[...]: each round's fastest repetition
    raw: dict[str, dict[str, dict[str, list[float]]]] = {t: {"stock": {}, "exact": {}} for t in types}
    best: dict[str, dict[str, dict[str, list[float]]]] = {t: {"stock": {}, "exact": {}} for t in types}
    for r in range(a.rounds):
        for t in types:
            for side in ("stock", "exact"):
                res = bench(binary, models[t], a.threads, windows, a.prompt, a.depth, a.reps,
                            exact_lib if side == "exact" else None, t in repacked, a.stock_lib)
                for test, (mean, fastest) in res.items():
                    raw[t][side].setdefault(test, []).append(mean)
                    best[t][side].setdefault(test, []).append(fastest)
                print(f"round {r + 1} {t:7s} {side:5s} " + "  ".join(f"{k}: {v[0]:.1f}" for k, v in res.items()),
                      file=sys.stderr, flush=True)
    # Two ratios: the median over rounds of the mean ms (what a user sees on a busy machine), and the
    # fastest repetition over all rounds (the kernels' cost with the least interference from other load
    # on a shared machine: noise only ever adds time).
    print("\n| weights | test | stock ms | exact ms | exact / stock (median) | exact / stock (fastest) |\n"
          "|---|---|---:|---:|---:|---:|")
    for t in types:
        for test, st in raw[t]["stock"].items():
            ex = raw[t]["exact"].get(test)
            if not ex:
                continue
            s, e = statistics.median(st), statistics.median(ex)
            fs, fe = min(best[t]["stock"][test]), min(best[t]["exact"][test])
            print(f"| {t} | {test} | {s:.1f} | {e:.1f} | {e / s:.2f} | {fe / fs:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"threads": a.threads, "depth": a.depth, "exact_lib": str(exact_lib),
                                      "stock_lib": str(a.stock_lib) if a.stock_lib else None,
                                      "raw": raw, "fastest": best},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

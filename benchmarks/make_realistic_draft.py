#!/usr/bin/env python3
"""A draft of realistic acceptance for the stand-in head-to-heads.

The bundled Q4_1 SmolLM2 drafting for the SmolLM2 stand-ins is the target's own weights, so it
accepts 82-92 % (strict, k = 4) where real 0.5-1B drafts of 7-8B targets accept about 60-75 % at
small k.  This writes the F16 SmolLM2 with every matrix perturbed by Gaussian noise of ``sigma``
times its own standard deviation (fixed seed), quantized to Q4_1 like the bundled draft, and with
``--calibrate`` searches the sigma whose strict acceptance at k = 4 (fixed k, greedy) on the bench
prompts is closest to ``--target`` (default 0.65).  Acceptance is measured against the unpadded
F16 SmolLM2: the padded stand-ins compute the same logits.

    .venv/bin/python benchmarks/make_realistic_draft.py --calibrate          # search, then write
    .venv/bin/python benchmarks/make_realistic_draft.py --sigma 0.3           # write one sigma

Output: ``.cache/standin/SmolLM2-135M-draft-noise<sigma>-Q4_1.gguf`` (git-ignored).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_standin import CACHE, _copy_field, build, finish, quantize  # noqa: E402


def perturbed(src: Path, dst: Path, sigma: float, seed: int = 0) -> Path:
    """``src`` (F16) with every 2-D weight W replaced by W + sigma * std(W) * N(0, 1)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        _copy_field(w, field)
    rng = np.random.default_rng(seed)
    for t in r.tensors:
        data = np.asarray(t.data)
        if data.ndim == 2 and sigma > 0:
            x = data.astype(np.float32)
            x = x + rng.standard_normal(x.shape, dtype=np.float32) * (sigma * float(x.std()))
            data = x.astype(data.dtype)
        w.add_tensor(t.name, np.ascontiguousarray(data), raw_shape=list(t.data.shape), raw_dtype=t.tensor_type)
    return finish(w, tmp, dst)


def draft_path(sigma: float, cache: Path = CACHE) -> Path:
    return cache / f"SmolLM2-135M-draft-noise{sigma:g}-Q4_1.gguf"


def make(sigma: float, cache: Path = CACHE, threads: int = 2) -> Path:
    base = cache / "SmolLM2-135M-Instruct.F16.gguf"
    if not base.exists():
        build(blocks=30, kquant=False, cache=cache)
    out = draft_path(sigma, cache)
    if not out.exists():
        f16 = cache / f"draft-noise{sigma:g}-F16.gguf.part"
        perturbed(base, f16, sigma)
        quantize(f16, out, "LLAMA_FTYPE_MOSTLY_Q4_1", threads)
        f16.unlink()
    return out


def acceptance(draft: Path, cache: Path = CACHE, k: int = 4, n: int = 48, threads: int = 2,
               prompts: int = 12) -> float:
    """Strict greedy acceptance at fixed k of ``draft`` drafting for the F16 SmolLM2 (the stand-ins'
    logits), over the first ``prompts`` bench prompts."""
    from mars_local import Engine
    from mars_local.bench import load_prompts
    from mars_local.bench.runner import prompt_tokens

    target = cache / "SmolLM2-135M-Instruct.F16.gguf"
    drafted = accepted = 0
    with Engine(target, draft, n_ctx=2048, n_threads=threads, learned=False) as eng:
        for p in load_prompts(None)[:prompts]:
            out = eng.generate(prompt_tokens(eng, p), max_tokens=n, temperature=0, verify="strict",
                               draft_max=k, adaptive=False)
            drafted += out.stats.n_drafted
            accepted += out.stats.n_accepted
    return accepted / drafted if drafted else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sigma", type=float, default=None, help="noise scale (times each matrix's std)")
    ap.add_argument("--calibrate", action="store_true", help="search sigma for --target acceptance at k = 4")
    ap.add_argument("--target", type=float, default=0.65)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=CACHE)
    a = ap.parse_args(argv)
    if a.sigma is None and not a.calibrate:
        print("error: give --sigma S or --calibrate", file=sys.stderr)
        return 2
    a.cache.mkdir(parents=True, exist_ok=True)
    if a.sigma is not None:
        path = make(a.sigma, a.cache, a.threads)
        print(f"{path}: strict acceptance at k = 4: {acceptance(path, a.cache, threads=a.threads):.3f}")
        return 0
    lo, hi, best = 0.0, 1.0, None
    for _ in range(6):  # acceptance falls as sigma grows: bisect
        sigma = round((lo + hi) / 2, 4)
        path = make(sigma, a.cache, a.threads)
        acc = acceptance(path, a.cache, threads=a.threads)
        print(f"sigma {sigma:g}: strict acceptance at k = 4: {acc:.3f}", flush=True)
        if best is None or abs(acc - a.target) < abs(best[1] - a.target):
            if best is not None:
                best[2].unlink()
            best = (sigma, acc, path)
        else:
            path.unlink()
        if abs(acc - a.target) < 0.02:
            break
        lo, hi = (sigma, hi) if acc > a.target else (lo, sigma)
    print(f"chosen: sigma {best[0]:g} (acceptance {best[1]:.3f}): {best[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

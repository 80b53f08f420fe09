#!/usr/bin/env python3
"""Cost-realistic stand-in targets: SmolLM2-135M padded with inert transformer blocks.

Real 7B weights cannot be downloaded on the development machine, and every
figure on the 135M model alone is a regime where no speculation can pay (a
verify window of k+1 rows costs about k+1 tokens there).  A padded model has
the per-token cost of a much larger model and the logits of the small one:

* the F16 requantization of the bundled SmolLM2-135M-Instruct (Q4_1),
* plus extra transformer blocks that copy real blocks' tensors but have
  ``attn_output`` and ``ffn_down`` set to zero.  Such a block adds exactly 0 to
  the residual stream, so the padded model's logits equal the original's
  (greedy tokens are identical), while each token still pays for reading and
  multiplying the padded blocks' weights.

240 blocks in F16 is 1.76 GB and ~9x the Q4_1 draft's per-token cost: the
ratio of an 8B target to a 0.6B draft.  The Q4_K_M stand-in is the same
padded model through ``llama_model_quantize`` (what users actually run).

    .venv/bin/python benchmarks/make_standin.py            # F16 + Q4_K_M, 240 blocks
    .venv/bin/python benchmarks/make_standin.py --blocks 120 --no-kquant

Files go into the git-ignored cache (``.cache/standin/`` or $MARS_CACHE_DIR),
never into the repository; existing files are reused.  Needs the ``gguf``
package (installed with the test extras by ``make install``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MARS_CACHE_DIR", ROOT / ".cache")) / "standin"
INERT = ("attn_output.weight", "ffn_down.weight")  # zeroed: the block writes nothing to the residual


def _copy_field(writer, field) -> None:
    from gguf import GGUFValueType

    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=field.types[-1])
    else:
        writer.add_key_value(field.name, field.contents(), vtype)


def pad_model(src: str | os.PathLike, dst: str | os.PathLike, n_blocks: int) -> Path:
    """Write ``src`` with its block count raised to ``n_blocks`` (inert extra blocks).

    Every key is copied except the block count; block i >= n_orig copies the
    tensors of real block (i mod n_orig) with ``attn_output`` and ``ffn_down``
    zeroed.  Only llama-like architectures (blk.N.* tensors, one
    ``{arch}.block_count`` key) are supported.  Writes atomically.
    """
    import gguf

    src, dst = Path(src), Path(dst)
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    key = f"{arch}.block_count"
    n_orig = int(r.fields[key].contents())
    if n_blocks < n_orig:
        raise ValueError(f"{src.name} has {n_orig} blocks; cannot pad to {n_blocks}")
    blocks: dict[int, dict[str, object]] = {}
    others = []
    for t in r.tensors:
        if t.name.startswith("blk."):
            _, i, rest = t.name.split(".", 2)
            blocks.setdefault(int(i), {})[rest] = t
        else:
            others.append(t)

    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", key):
            continue
        _copy_field(w, field)
    w.add_key_value(key, n_blocks, gguf.GGUFValueType.UINT32)

    def add(name: str, t) -> None:
        data = t.data
        w.add_tensor(name, data, raw_shape=list(t.data.shape), raw_dtype=t.tensor_type)

    for t in others[:1]:  # token_embd first, as converters write it
        add(t.name, t)
    zeros_cache: dict[tuple, np.ndarray] = {}
    for i in range(n_blocks):
        src_block = blocks[i % n_orig]
        for rest, t in src_block.items():
            inert = i >= n_orig and rest in INERT
            if inert:
                k = (t.data.shape, t.data.dtype)
                if k not in zeros_cache:
                    zeros_cache[k] = np.zeros_like(t.data)
                w.add_tensor(f"blk.{i}.{rest}", zeros_cache[k], raw_shape=list(t.data.shape), raw_dtype=t.tensor_type)
            else:
                add(f"blk.{i}.{rest}", t)
    for t in others[1:]:
        add(t.name, t)
    return finish(w, tmp, dst)


def finish(w, tmp: Path, dst: Path) -> Path:
    """Write the GGUFWriter ``w`` (opened on ``tmp``) out and move it to ``dst`` atomically."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    return dst


def quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: str, threads: int = 2) -> Path:
    """``llama_model_quantize`` src -> dst (ftype e.g. "LLAMA_FTYPE_MOSTLY_F16"), atomically."""
    import llama_cpp

    import mars_local.llama.runtime  # noqa: F401  (routes llama.cpp's log away from the terminal)

    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.allow_requantize = True
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) failed with {rc}")
    shutil.move(tmp, dst)
    return dst


def bundled_model() -> Path:
    from mars_local.models.registry import load_registry, model_path

    reg = load_registry()
    return model_path(reg.get("smollm2-135m"), "target")


def standin_paths(blocks: int = 240, cache: Path = CACHE) -> dict[str, Path]:
    return {
        "f16": cache / f"smollm2-pad{blocks}-F16.gguf",
        "q4_k_m": cache / f"smollm2-pad{blocks}-Q4_K_M.gguf",
    }


def build(blocks: int = 240, kquant: bool = True, cache: Path = CACHE, log=print) -> dict[str, Path]:
    """Make (or reuse) the F16 and Q4_K_M stand-ins of ``blocks`` blocks."""
    cache.mkdir(parents=True, exist_ok=True)
    base_f16 = cache / "SmolLM2-135M-Instruct.F16.gguf"
    if not base_f16.exists():
        log(f"requantizing the bundled model to F16 -> {base_f16}")
        quantize(bundled_model(), base_f16, "LLAMA_FTYPE_MOSTLY_F16")
    paths = standin_paths(blocks, cache)
    if not paths["f16"].exists():
        log(f"padding to {blocks} blocks -> {paths['f16']}")
        pad_model(base_f16, paths["f16"], blocks)
    if kquant and not paths["q4_k_m"].exists():
        log(f"quantizing to Q4_K_M -> {paths['q4_k_m']}")
        quantize(paths["f16"], paths["q4_k_m"], "LLAMA_FTYPE_MOSTLY_Q4_K_M")
    if not kquant:
        paths.pop("q4_k_m")
    for name, p in paths.items():
        log(f"{name}: {p} ({p.stat().st_size / 1e9:.2f} GB)")
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=240, help="total transformer blocks (SmolLM2-135M has 30)")
    ap.add_argument("--no-kquant", action="store_true", help="skip the Q4_K_M stand-in")
    ap.add_argument("--cache", type=Path, default=CACHE, help="output folder (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.blocks < 30:
        print("error: --blocks must be at least 30 (the model's own blocks)", file=sys.stderr)
        return 2
    build(a.blocks, not a.no_kquant, a.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())

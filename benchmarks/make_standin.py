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

SmolLM2's width (576) is not a multiple of 256, so most of that "Q4_K_M" falls
back to Q5_0: it is not what a user's Q4_K_M runs.  The **K-quant stand-in**
(``--width 768``) is SmolLM2 widened first (``widen_model``: 768 wide, 12
heads of which 3 are inert, every matrix 768 or 1536 deep), so its Q4_K_M is
made of Q4_K and Q6_K tensors like a real 7B's, with the same logits as the
original up to rounding.  At 240 blocks a token costs what one of the narrow
Q4_K_M does (AVX2, -t 2, llama-bench tg16: 11.3 vs 11.1 tok/s): K-quant
kernels are cheaper per weight than the narrow file's Q5_0 ones.

    .venv/bin/python benchmarks/make_standin.py            # F16 + Q4_K_M, 240 blocks
    .venv/bin/python benchmarks/make_standin.py --blocks 120 --no-kquant
    .venv/bin/python benchmarks/make_standin.py --width 768   # the K-quant stand-in, 240 blocks

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


def widen_model(src: str | os.PathLike, dst: str | os.PathLike, width: int = 768) -> Path:
    """Write the llama-architecture ``src`` widened to ``width`` with the same function.

    The residual stream gains ``width - n_embd`` dimensions that stay zero: the token
    embedding gets zero columns, every matrix reading the stream zero input columns and
    every matrix writing it (``attn_output``, ``ffn_down``) zero output rows.  RMS norms
    average over the wider stream, so their weights are scaled by sqrt(n_embd / width) and
    the epsilon by n_embd / width: the normalized real dimensions are unchanged.  The head
    count grows to ``width / head_dim`` so that ``attn_output`` is ``width`` deep too; the
    added heads are inert (zero query rows, zero ``attn_output`` columns) and placed at the
    end of each key/value group, so every real head keeps its key/value head under
    grouped-query attention.  Writes atomically.
    """
    import gguf

    src, dst = Path(src), Path(dst)
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    kv = {name: field.contents() for name, field in r.fields.items() if not name.startswith("tokenizer.")}
    n_embd = int(kv[f"{arch}.embedding_length"])
    n_head = int(kv[f"{arch}.attention.head_count"])
    n_head_kv = int(kv.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = n_embd // n_head
    if width < n_embd or width % head_dim or (width // head_dim) % n_head_kv:
        raise ValueError(f"cannot widen {src.name} ({n_embd} wide, {n_head} heads of {head_dim}, "
                         f"{n_head_kv} kv heads) to {width}: need a multiple of {head_dim * n_head_kv}")
    n_head_new = width // head_dim
    group, group_new = n_head // n_head_kv, n_head_new // n_head_kv
    # real head h -> new head (h // group) * group_new + h % group
    head_map = [(h // group) * group_new + h % group for h in range(n_head)]
    norm_scale = np.float32(np.sqrt(n_embd / width))

    def pad_to(a: np.ndarray, axis: int, size: int) -> np.ndarray:
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, size - a.shape[axis])
        return np.pad(a, pad)

    def heads_to(a: np.ndarray, axis: int) -> np.ndarray:
        # a's `axis` holds n_head blocks of head_dim; spread them to their new places
        out_shape = list(a.shape)
        out_shape[axis] = n_head_new * head_dim
        out = np.zeros(out_shape, dtype=a.dtype)
        for h, nh in enumerate(head_map):
            src_sl = [slice(None)] * a.ndim
            dst_sl = [slice(None)] * a.ndim
            src_sl[axis] = slice(h * head_dim, (h + 1) * head_dim)
            dst_sl[axis] = slice(nh * head_dim, (nh + 1) * head_dim)
            out[tuple(dst_sl)] = a[tuple(src_sl)]
        return out

    def widened(name: str, a: np.ndarray) -> np.ndarray:
        # numpy shapes are GGUF's reversed: (rows = outputs, columns = inputs)
        if name.endswith("norm.weight"):
            return pad_to(a.astype(np.float32) * norm_scale, 0, width)
        rest = name.split(".", 2)[-1]
        if rest == "attn_q.weight":
            return heads_to(pad_to(a, 1, width), 0)
        if name in ("token_embd.weight", "output.weight") or rest in (
                "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight"):
            return pad_to(a, 1, width)  # reads the stream: zero input columns
        if rest == "attn_output.weight":
            return pad_to(heads_to(a, 1), 0, width)
        if rest == "ffn_down.weight":
            return pad_to(a, 0, width)
        raise ValueError(f"cannot widen {src.name}: tensor {name} of unknown role")

    for t in r.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ValueError(f"cannot widen {src.name}: {t.name} is {t.tensor_type.name} (F16/F32 only)")

    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    changed = {
        f"{arch}.embedding_length": width,
        f"{arch}.attention.head_count": n_head_new,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
    }
    eps_key = f"{arch}.attention.layer_norm_rms_epsilon"
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in changed or name == eps_key:
            continue
        _copy_field(w, field)
    for name, value in changed.items():
        w.add_key_value(name, value, gguf.GGUFValueType.UINT32)
    w.add_key_value(eps_key, float(kv[eps_key]) * n_embd / width, gguf.GGUFValueType.FLOAT32)
    for t in r.tensors:
        a = widened(t.name, np.asarray(t.data))
        w.add_tensor(t.name, np.ascontiguousarray(a), raw_shape=list(a.shape), raw_dtype=t.tensor_type)
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


NATIVE_WIDTH = 576  # SmolLM2-135M's embedding length
KQUANT_WIDTH, KQUANT_BLOCKS = 768, 240  # the K-quant stand-in


def standin_paths(blocks: int = 240, cache: Path = CACHE, width: int = NATIVE_WIDTH) -> dict[str, Path]:
    stem = f"smollm2-pad{blocks}" if width == NATIVE_WIDTH else f"smollm2-w{width}-pad{blocks}"
    return {
        "f16": cache / f"{stem}-F16.gguf",
        "q4_k_m": cache / f"{stem}-Q4_K_M.gguf",
    }


def build(blocks: int = 240, kquant: bool = True, cache: Path = CACHE, log=print,
          width: int = NATIVE_WIDTH, threads: int = 2) -> dict[str, Path]:
    """Make (or reuse) the F16 and Q4_K_M stand-ins of ``blocks`` blocks (``width`` wide)."""
    cache.mkdir(parents=True, exist_ok=True)
    base_f16 = cache / "SmolLM2-135M-Instruct.F16.gguf"
    if not base_f16.exists():
        log(f"requantizing the bundled model to F16 -> {base_f16}")
        quantize(bundled_model(), base_f16, "LLAMA_FTYPE_MOSTLY_F16", threads)
    if width != NATIVE_WIDTH:
        wide_f16 = cache / f"SmolLM2-135M-Instruct.w{width}.F16.gguf"
        if not wide_f16.exists():
            log(f"widening to {width} -> {wide_f16}")
            widen_model(base_f16, wide_f16, width)
        base_f16 = wide_f16
    paths = standin_paths(blocks, cache, width)
    if not paths["f16"].exists():
        log(f"padding to {blocks} blocks -> {paths['f16']}")
        pad_model(base_f16, paths["f16"], blocks)
    if kquant and not paths["q4_k_m"].exists():
        log(f"quantizing to Q4_K_M -> {paths['q4_k_m']}")
        quantize(paths["f16"], paths["q4_k_m"], "LLAMA_FTYPE_MOSTLY_Q4_K_M", threads)
    if not kquant:
        paths.pop("q4_k_m")
    for name, p in paths.items():
        log(f"{name}: {p} ({p.stat().st_size / 1e9:.2f} GB)")
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=240, help="total transformer blocks (SmolLM2-135M has 30)")
    ap.add_argument("--no-kquant", action="store_true", help="skip the Q4_K_M stand-in")
    ap.add_argument("--width", type=int, default=NATIVE_WIDTH,
                    help=f"widen SmolLM2 first (multiple of 192; {KQUANT_WIDTH} makes the K-quant stand-in, "
                         f"use it with --blocks {KQUANT_BLOCKS}; default: %(default)s, not widened)")
    ap.add_argument("--cache", type=Path, default=CACHE, help="output folder (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="quantization threads (default: %(default)s)")
    a = ap.parse_args(argv)
    if a.blocks < 30:
        print("error: --blocks must be at least 30 (the model's own blocks)", file=sys.stderr)
        return 2
    if a.width < NATIVE_WIDTH or a.width % 192:
        print(f"error: --width must be a multiple of 192 and at least {NATIVE_WIDTH}", file=sys.stderr)
        return 2
    if a.threads < 1:
        print("error: --threads must be at least 1", file=sys.stderr)
        return 2
    build(a.blocks, not a.no_kquant, a.cache, width=a.width, threads=a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

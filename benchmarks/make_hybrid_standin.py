"""A cost-realistic hybrid (recurrent) target: a random Qwen3.5-style model at a small real model's size.

No Qwen3.5 checkpoint can be downloaded here, and SmolLM2's weights cannot be carried into a qwen35
graph (gated attention with q/k norms, interleaved rope, gated delta-net layers), so this stand-in
is random: the tiny-model writer of the tests (``tests/tinymodels.make_tiny_qwen35``) at a 0.5B
model's shape — width 1536, FFN 4096, 24 layers of which every 4th is gated full attention and the
others gated delta-net layers (llama.cpp's recurrent memory), F16. Its trunk weights are small, so
it is close to a bigram model of its embeddings and its greedy text falls into loops: what it
measures is the *mechanics* of speculating on a recurrent target (n-gram drafts accepted often,
rolled back when not), at a realistic cost per forward, against llama.cpp's own speculation on the
same file — not the acceptance of a real model.

With ``--nextn 1`` it also carries an MTP (nextn) block whose eh_proj is [I | noise] (as the tiny
test models'), so the MTP head predicts from the token's embedding much as the near-bigram trunk does:
a file on which ``--drafter mtp`` and llama.cpp's ``--spec-type draft-mtp`` both run.

    .venv/bin/python benchmarks/make_hybrid_standin.py            # .cache/standin/hybrid-qwen35-F16.gguf
    .venv/bin/python benchmarks/make_hybrid_standin.py --nextn 1  # .cache/standin/hybrid-qwen35-mtp-F16.gguf
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tinymodels import make_tiny_qwen35  # noqa: E402

CACHE = ROOT / ".cache" / "standin"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--nextn", type=int, default=0, help="MTP (nextn) blocks after the trunk")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.out = args.out or CACHE / ("hybrid-qwen35-mtp-F16.gguf" if args.nextn else "hybrid-qwen35-F16.gguf")
    if args.out.exists():
        print(f"{args.out} exists")
        return 0
    import llama_cpp

    args.out.parent.mkdir(parents=True, exist_ok=True)
    f32 = args.out.with_suffix(".f32.tmp")
    print(f"writing a random qwen35, width {args.width}, {args.layers} layers ...", flush=True)
    make_tiny_qwen35(f32, n_embd=args.width, n_head=args.width // 128, n_head_kv=2, n_layer=args.layers,
                     full_attention_interval=4, n_ff=args.ffn, n_ctx=4096, seed=7, trunk_scale=0.012,
                     n_nextn=args.nextn)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
    params.nthread = os.cpu_count() or 1
    tmp = args.out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        print("quantizing failed", file=sys.stderr)
        return 1
    f32.unlink()
    tmp.rename(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

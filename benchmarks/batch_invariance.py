#!/usr/bin/env python3
"""Is the target's forward batch-invariant?  (The condition for lossless strict greedy.)

Strict greedy speculative output equals plain greedy output token for token
only if the logits of a position do not depend on how many rows the forward
that computed them had: plain decoding computes every position in a 1-row
forward, speculation in a (k+1)-row verify window.  This script decodes N
tokens plainly, then re-evaluates the same tokens in windows of each size and
compares the rows bit for bit.

    .venv/bin/python benchmarks/batch_invariance.py MODEL.gguf [--windows 2,5,9,17] [--fast-kernels] [-ngl N]

The model is loaded as the engine loads a target: on a GPU build every layer on the GPU
(-ngl N: N layers; -ngl 0: none, whose windows of 32+ rows llama.cpp still sends to the GPU).

Prints, per window size, how many rows differ and the largest difference.
Exit status 1 if any row differs.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--windows", default="2,5,9,17")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--fast-kernels", action="store_true", help="load the model with weight repacking on")
    ap.add_argument("-ngl", type=int, default=None, help="GPU layers (default: all on a GPU build, else none)")
    a = ap.parse_args(argv)
    from mars_local.llama.invariance import batch_invariance

    res = batch_invariance(a.model, tuple(int(x) for x in a.windows.split(",")), a.n, not a.fast_kernels, a.threads,
                           n_gpu_layers=a.ngl)
    bad = 0
    for w, (d, worst) in res.items():
        print(f"window {w:3d}: {d} row(s) differ from 1-row decoding, max |diff| {worst:.3g}")
        bad += d
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

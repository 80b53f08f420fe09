#!/usr/bin/env python3
"""Is the target's forward batch-invariant?  (The condition for lossless strict greedy.)

Strict greedy speculative output equals plain greedy output token for token
only if the logits of a position do not depend on how many rows the forward
that computed them had: plain decoding computes every position in a 1-row
forward, speculation in a (k+1)-row verify window.  This script decodes N
tokens plainly, then re-evaluates the same tokens in windows of each size and
compares the rows bit for bit.

    .venv/bin/python benchmarks/batch_invariance.py MODEL.gguf [--windows 2,5,9,17] [--fast-kernels]

Prints, per window size, how many rows differ and the largest difference.
Exit status 1 if any row differs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def check(model: str, windows=(2, 5, 9, 17), n: int = 48, exact: bool = True, threads: int | None = None,
          prompt: str = "The history of the printing press begins") -> dict[int, tuple[int, float]]:
    from mars_local.runtime import Context, Model

    m = Model(model, 0, exact_kernels=exact)
    ctx = Context(m, n_ctx=512, n_threads=threads)
    try:
        toks = m.tokenize(prompt)
        ctx.sync(toks[:-1])
        base = ctx.n_past
        seq = [toks[-1]]
        plain = []
        for _ in range(n):  # plain greedy: one row per forward
            row = ctx.eval([seq[-1]], 1)[0]
            plain.append(row.copy())
            seq.append(int(row.argmax()))
        out = {}
        for w in windows:
            ctx.truncate(base)
            diff_rows, worst = 0, 0.0
            for s in range(0, n - w + 1, w):
                rows = ctx.eval(seq[s : s + w], w)
                for i in range(w):
                    d = float(np.max(np.abs(rows[i] - plain[s + i])))
                    if not np.array_equal(rows[i], plain[s + i]):
                        diff_rows += 1
                    worst = max(worst, d)
            out[w] = (diff_rows, worst)
        return out
    finally:
        ctx.close()
        m.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--windows", default="2,5,9,17")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--fast-kernels", action="store_true", help="load the model with weight repacking on")
    a = ap.parse_args(argv)
    res = check(a.model, tuple(int(x) for x in a.windows.split(",")), a.n, not a.fast_kernels, a.threads)
    bad = 0
    for w, (d, worst) in res.items():
        print(f"window {w:3d}: {d} row(s) differ from 1-row decoding, max |diff| {worst:.3g}")
        bad += d
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What a batched target forward costs per shape: n sequences of w rows each, its first use in the
process against the uses after it (what the scheduler's cost curve learns, and what it leaves out:
:class:`mars_local.speculate.batch_cost.BatchCost` does not count a shape's first forward).

    .venv/bin/python benchmarks/shape_costs.py TARGET.gguf [--shapes 4x1,3x2,2x3,1x6] [--depth 45]
        [--reps 3] [-t 2] [--json OUT]

Each sequence of one MultiContext (as many as the largest shape has) first holds ``--depth`` tokens;
each forward is rolled back after it, so every shape runs at that depth.  The shapes are timed in the
order given, ``--reps`` forwards each (the first one printed apart), so a shape given twice shows
whether its cost moves with what ran before it.  Loaded as the exact target is (``--stock``: repacked
where llama.cpp repacks, stock kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"4x1,3x2" -> [(4, 1), (3, 2)]: sequences x rows per sequence."""
    out = []
    for part in text.split(","):
        n, _, w = part.strip().partition("x")
        if not (n.isdigit() and w.isdigit() and int(n) >= 1 and int(w) >= 1):
            raise ValueError(f"a shape is SEQUENCESxROWS, e.g. 3x2; got {part!r}")
        out.append((int(n), int(w)))
    return out


def shape_costs(path, shapes, reps: int = 3, threads: int | None = 2, depth: int = 45,
                exact: bool = True) -> list[dict]:
    """Per shape in order: {"seqs", "rows_each", "rows", "first_s", "median_s"} (the first forward
    of each entry, and the median of the ``reps`` - 1 after it; None when reps is 1)."""
    from mars_local.llama.runtime import Model
    from mars_local.llama.streams import MultiContext

    n_seq = max(n for n, _ in shapes)
    m = Model(path, None, exact_kernels=exact)
    try:
        mc = MultiContext(m, n_seq, n_ctx_seq=max(256, depth + max(w for _, w in shapes) + 8), n_threads=threads)
        try:
            vocab = m.n_vocab

            def toks(seed: int, k: int) -> list[int]:
                return [(seed * 104729 + i * 7919 + 13) % (vocab - 300) + 200 for i in range(k)]

            for s in range(n_seq):
                mc.seqs[s].eval(toks(s, depth), n_out=0)  # (chunked by n_batch)
            out = []
            for j, (n, w) in enumerate(shapes):
                times = []
                for r in range(reps):
                    t0 = time.perf_counter()
                    mc.decode_windows([(s, toks(1000 + 31 * j + r + s, w)) for s in range(n)], max_rows=n * w)
                    times.append(time.perf_counter() - t0)
                    for s in range(n):
                        mc.seqs[s].truncate(depth)
                out.append({"seqs": n, "rows_each": w, "rows": n * w, "first_s": times[0],
                            "median_s": statistics.median(times[1:]) if len(times) > 1 else None})
            return out
        finally:
            mc.close()
    finally:
        m.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--shapes", default="4x1,3x2,2x3,1x6,4x2", help="SEQUENCESxROWS, comma-separated, in order")
    ap.add_argument("--depth", type=int, default=45, help="tokens each sequence holds before every forward")
    ap.add_argument("--reps", type=int, default=3, help="forwards per shape (the first printed apart)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--stock", action="store_true", help="stock kernels (repacked where llama.cpp repacks)")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args(argv)
    try:
        shapes = parse_shapes(a.shapes)
    except ValueError as e:
        print(f"shape_costs: {e}", file=sys.stderr)
        return 2
    if a.reps < 1 or a.depth < 1:
        print("shape_costs: --reps and --depth must be at least 1", file=sys.stderr)
        return 2
    rows = shape_costs(a.model, shapes, a.reps, a.threads, a.depth, exact=not a.stock)
    for r in rows:
        after = f"{r['median_s'] * 1e3:7.1f} ms after" if r["median_s"] is not None else ""
        print(f"{r['seqs']}x{r['rows_each']} = {r['rows']:3d} rows: first {r['first_s'] * 1e3:7.1f} ms  {after}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "threads": a.threads, "depth": a.depth, "shapes": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

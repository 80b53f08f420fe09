#!/usr/bin/env python3
"""Where a speculative round's milliseconds go: forward cost per window size, and prefill speed.

    .venv/bin/python benchmarks/window_costs.py TARGET.gguf [-md DRAFT.gguf] [-t 2] [--windows 1,2,3,5,9,17]

For the target (and the draft, if given) it times a forward of w rows on top
of a 256-token context (half the prompt if shorter), the median of --reps forwards per size (the first of
each size, when llama.cpp builds the graph, is not counted), and prefill of a
--prompt-len token prompt in n_batch chunks.  Prints milliseconds and each
size's cost relative to one row: the curve the adaptive controller learns.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def forward_costs(path, windows, reps: int = 5, threads: int | None = 2, exact: bool = True,
                  prompt_len: int = 481, n_ctx: int = 1024, interleave: bool = False) -> dict:
    """``path``: a model file (loaded with repacking off where ``exact``), or a loaded Model (closed
    here).  ``interleave``: also time the sizes in turn (one forward of each size, ``reps``
    cycles), as rounds whose window changes from one to the next run them: a GPU backend
    replays a captured CUDA graph only for a forward shaped like the one before it, so a
    size repeated (the main figures) can cost less there than the same size between others."""
    from mars_local.llama.context import Context
    from mars_local.llama.runtime import Model

    m = path if isinstance(path, Model) else Model(path, None, exact_kernels=exact)
    ctx = Context(m, n_ctx=n_ctx, n_threads=threads)
    try:
        vocab = m.n_vocab
        toks = [(i * 7919 + 13) % (vocab - 300) + 200 for i in range(prompt_len)]
        ctx.sync(toks[:8])  # warm
        ctx.truncate(0)
        t0 = time.perf_counter()
        ctx.sync(toks)
        prefill = prompt_len / (time.perf_counter() - t0)
        base = min(256, prompt_len // 2)
        ctx.truncate(base)

        def forward(w: int) -> float:
            """Seconds of one forward of w rows on top of ``base`` cells, then rolled back."""
            t0 = time.perf_counter()
            ctx.eval(toks[:w], w)
            dt = time.perf_counter() - t0
            ctx.truncate(base)
            return dt

        out = {}
        for w in windows:
            forward(w)  # (the first of a size builds its graph: not counted)
            out[w] = statistics.median(forward(w) for _ in range(reps))
        result = {"prefill_tok_s": prefill, "forward_s": out}
        if interleave:
            turns = {w: [] for w in windows}
            for _ in range(reps):
                for w in windows:
                    turns[w].append(forward(w))
            result["interleaved_s"] = {w: statistics.median(ts) for w, ts in turns.items()}
        return result
    finally:
        ctx.close()
        m.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("-md", "--model-draft", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--windows", default="1,2,3,5,9,17")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=481)
    ap.add_argument("--fast-kernels", action="store_true", help="load the target with weight repacking on")
    ap.add_argument("--interleave", action="store_true",
                    help="also time the sizes in turn (each between others, as adaptive rounds run them)")
    a = ap.parse_args(argv)
    windows = [int(x) for x in a.windows.split(",")]
    for label, path, exact in (("target", a.target, not a.fast_kernels), ("draft", a.model_draft, False)):
        if path is None:
            continue
        r = forward_costs(path, windows, a.reps, a.threads, exact, a.prompt_len, interleave=a.interleave)
        one = r["forward_s"][windows[0]]
        print(f"{label}: {path}")
        print(f"  prefill {a.prompt_len} tokens: {r['prefill_tok_s']:.1f} tok/s")
        turns = r.get("interleaved_s", {})
        for w, t in r["forward_s"].items():
            between = f"   in turn: {turns[w] * 1e3:8.2f} ms" if w in turns else ""
            print(f"  w={w:3d}: {t * 1e3:8.2f} ms  {t / one:5.2f}x w={windows[0]}{between}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

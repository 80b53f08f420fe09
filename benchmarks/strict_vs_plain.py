#!/usr/bin/env python3
"""Does strict greedy speculation reproduce plain greedy decoding on this build, token for token?

    .venv/bin/python benchmarks/strict_vs_plain.py TARGET.gguf DRAFT.gguf [-n 64] [--draft-max 4,8]
        [--prompts 8] [--parallel 8] [-ngl N] [--json OUT.json]

For each of the first --prompts chat prompts of the bench set (rendered with the target's
chat template), it decodes -n tokens plainly (draft_max 0, one row per forward), then with
strict greedy speculation at each --draft-max (fixed k, windows of k+1 rows), alone and,
with --parallel P > 1, P prompts at a time in one batch (mars_local.Scheduler), and compares
each output with the plain one.  Per setting it prints how many prompts match and, for each
that does not, where the first token differs.

On the CPU with patches/0002-0004 every output must match (the tests hold it to that).  On a
GPU backend llama.cpp picks its matrix kernels by the number of rows in a forward, so a
window may sum in another order than a single row, and a near-tie can then flip: this script
measures how often that happens there.  Exit status 1 if any output differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("draft")
    ap.add_argument("-n", type=int, default=64, help="tokens per output (default 64)")
    ap.add_argument("--draft-max", default="4,8", help="fixed draft lengths k, a comma list (default 4,8)")
    ap.add_argument("--prompts", type=int, default=8, help="how many bench prompts, chat ones first (default 8)")
    ap.add_argument("--parallel", type=int, default=1, help="also decode the prompts P at a time in one batch")
    ap.add_argument("-ngl", type=int, default=None, help="GPU layers for both models (default: all on a GPU build)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--fast-kernels", action="store_true",
                    help="load the target as `--fast-kernels` does (on a GPU: forwards of any size, not 16 rows at most)")
    ap.add_argument("--json", default=None, metavar="OUT")
    a = ap.parse_args(argv)
    try:
        ks = [int(x) for x in a.draft_max.split(",")]
    except ValueError:
        print(f"error: --draft-max must be a comma list of integers, got {a.draft_max!r}", file=sys.stderr)
        return 2
    for p in (a.target, a.draft):
        if not Path(p).is_file():
            print(f"error: no such model file: {p}", file=sys.stderr)
            return 2

    from mars_local import Engine, Scheduler
    from mars_local.bench.prompts import load_prompts
    from mars_local.llama.runtime import backend_info

    # the chat prompts first, then the other categories' (all bench prompts are chats)
    every = sorted(load_prompts(), key=lambda p: p.category != "chat")
    prompts = [p.messages for p in every][: a.prompts]
    report = {"backend": backend_info(), "n": a.n, "fast_kernels": a.fast_kernels, "settings": []}
    bad = 0
    with Engine(a.target, draft=a.draft, n_ctx=2048, n_gpu_layers=a.ngl, n_gpu_layers_draft=a.ngl,
                n_threads=a.threads, learned=False, exact_kernels=not a.fast_kernels) as eng:
        toks = [eng.chat_prompt(m) for m in prompts]
        opts = dict(max_tokens=a.n, temperature=0, ignore_eos=True, verify="strict", adaptive=False)
        t0 = time.perf_counter()
        plain = [eng.generate(t, draft_max=0, **opts).tokens for t in toks]
        t_plain = time.perf_counter() - t0
        print(f"plain greedy: {len(toks)} prompts x {a.n} tokens in {t_plain:.2f} s")
        settings = [(k, 1) for k in ks] + ([(k, a.parallel) for k in ks] if a.parallel > 1 else [])
        for k, par in settings:
            t0 = time.perf_counter()
            if par == 1:
                outs = [eng.generate(t, draft_max=k, draft_min=k, **opts) for t in toks]
            else:
                sched = Scheduler(eng, par)
                try:
                    outs = sched.generate_many(toks, draft_max=k, draft_min=k, **opts)
                finally:
                    sched.close()
            dt = time.perf_counter() - t0
            diffs = [first_difference(o.tokens, p) for o, p in zip(outs, plain)]
            drafted = sum(o.stats.n_drafted for o in outs)
            accepted = sum(o.stats.n_accepted for o in outs)
            n_bad = sum(d is not None for d in diffs)
            bad += n_bad
            where = ", ".join(f"prompt {i}: token {d}" for i, d in enumerate(diffs) if d is not None)
            print(f"strict k={k} parallel={par}: {len(toks) - n_bad}/{len(toks)} equal to plain"
                  f"{' (' + where + ')' if where else ''}; accepted {accepted}/{drafted}; {dt:.2f} s")
            report["settings"].append({"draft_max": k, "parallel": par, "equal": len(toks) - n_bad,
                                       "prompts": len(toks), "first_difference": diffs,
                                       "drafted": drafted, "accepted": accepted, "seconds": dt})
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

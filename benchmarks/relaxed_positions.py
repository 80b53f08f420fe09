"""Where MARS relaxes: the target's top logit, the top-2 logit gap and p2/p1 at relaxed positions.

    .venv/bin/python benchmarks/relaxed_positions.py --theta 0.9 --draft-max 4

Generates with MARS (fixed k, n-gram drafter, greedy) on the built-in prompt set with the bundled
model (or -m), then re-scores each output with one teacher-forced forward of the target to read
the logits at the positions whose token was accepted only because of MARS.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from mars_local.bench import load_prompts
from mars_local.bench.runner import prompt_tokens
from mars_local.speculate.engine import Engine, GenerateConfig
from mars_local.core.errors import MarsError
from mars_local.models.registry import load_registry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: the bundled model)")
    ap.add_argument("--theta", type=float, default=0.9)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("-n", type=int, default=64, help="tokens per prompt")
    args = ap.parse_args(argv)
    try:
        target = args.model or load_registry().get("smollm2-135m").target.local_path()
        eng = Engine(target, None, drafter="ngram", n_ctx=4096)
    except MarsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = GenerateConfig(max_tokens=args.n, verify="mars", theta=args.theta, draft_max=args.draft_max, adaptive=False)
    rows, undecided, total = [], 0, 0
    for p in load_prompts():
        toks = prompt_tokens(eng, p)
        g = eng.generate(toks, cfg)
        if not g.tokens:
            continue
        eng.reset()  # the rows of one teacher-forced forward from scratch
        z = np.asarray(eng.logits(toks + g.tokens[:-1], n_rows=len(g.tokens)), dtype=np.float64)
        top2 = np.sort(z, axis=1)[:, -2:]
        total += len(g.tokens)
        undecided += int(np.sum((top2[:, 1] > 0) & (top2[:, 0] / top2[:, 1] > args.theta)))
        for i, kind in enumerate(g.kinds):
            if kind == "relaxed":
                z1, z2 = top2[i, 1], top2[i, 0]
                rows.append((z1, z1 - z2, np.exp(z2 - z1)))
    eng.close()
    print(f"relaxed positions: {len(rows)} of {total} generated tokens; "
          f"undecided (z2/z1 > {args.theta:g}) positions: {undecided / max(total, 1):.0%}")
    if rows:
        r = np.array(rows)
        print(f"top logit z1: median {np.median(r[:, 0]):.1f}; gap z1-z2: median {np.median(r[:, 1]):.2f}, "
              f"max {r[:, 1].max():.2f}")
        print(f"p2/p1: median {np.median(r[:, 2]):.2f}, min {r[:, 2].min():.3f}; extra NLL of the relaxed token "
              f"vs the top one: mean {np.mean(r[:, 1]):.2f} nats")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""How much speculation can add to batched decoding of N sequences, at best, on this machine.

    .venv/bin/python benchmarks/spec_bound.py TARGET.gguf -md DRAFT.gguf -t 2 [--clients 1,2,4,8,16]
        [--alphas 0.8,0.9,0.95] [--rounds 2] [--json out.json]

Measures (``window_costs.forward_costs``, through mars-local's own contexts, every row's logits
read, on a 256-token context) what one forward of R rows costs the target (R = 1..64) and the
draft (R = N: one batched draft step of N sequences), then computes for each N the best
speculative rate a round can reach against a plain batched round of the same N sequences:

* a plain round: one forward of N rows, N tokens;
* a speculative round: sequence i drafts k_i tokens (max k_i batched draft steps, the j-th over
  the sequences still drafting), one target forward of sum(k_i + 1) rows, and commits
  1 + a + a^2 + ... + a^k_i tokens, a being the probability that a draft token is accepted,
  independently at each position.

For each total row count R up to 64 the drafts are spread as evenly as possible over the N
sequences (the expected tokens are concave in k, so an even spread commits the most), and the best
R is kept.  What the bound leaves out costs the speculative round more than the plain one: the
draft's catch-up of accepted tokens, prompts joining, the loop, and acceptance that falls with k.
So where the best ratio stays below a target at an acceptance above the one measured, no draft
length controller can reach that target with this pair on this machine.  Costs are medians of
``--reps`` forwards, per round; the ratio is computed per round and its median printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from window_costs import forward_costs  # noqa: E402

TARGET_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


def interp(costs: dict[int, float], r: int) -> float:
    """Cost of r rows from the measured sizes (linear between neighbours)."""
    xs = sorted(costs)
    if r in costs:
        return costs[r]
    if r <= xs[0]:
        return costs[xs[0]] * r / xs[0]
    if r >= xs[-1]:
        return costs[xs[-1]] * r / xs[-1]
    hi = next(x for x in xs if x > r)
    lo = max(x for x in xs if x < r)
    return costs[lo] + (costs[hi] - costs[lo]) * (r - lo) / (hi - lo)


def expected_tokens(alpha: float, k: int) -> float:
    return sum(alpha**i for i in range(k + 1))


def best_round(n: int, alpha: float, target: dict[int, float], draft: dict[int, float], max_rows: int = 64):
    """(best tokens/s of a speculative round, its rows, plain tokens/s) for n sequences."""
    plain = n / interp(target, n)
    best = (0.0, n)
    for rows in range(n + 1, max_rows + 1):
        extra = rows - n  # draft tokens over all sequences
        q, r = divmod(extra, n)  # r sequences draft q + 1, the rest q
        tokens = r * expected_tokens(alpha, q + 1) + (n - r) * expected_tokens(alpha, q)
        steps = q * interp(draft, n) + (interp(draft, r) if r else 0.0)
        rate = tokens / (interp(target, rows) + steps)
        if rate > best[0]:
            best = (rate, rows)
    return best[0], best[1], plain


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("-md", "--model-draft", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--alphas", default="0.8,0.9,0.95")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    clients = [int(x) for x in a.clients.split(",")]
    alphas = [float(x) for x in a.alphas.split(",")]
    from mars_local.llama.runtime import Model
    from mars_local.speculate.learned import default_store
    from mars_local.speculate.repack import load_exact_target

    rounds = []
    for i in range(a.rounds):
        # both models as mars loads them: the target repacked where this machine measured that exact
        target = load_exact_target(a.target, None, default_store(), n_threads=a.threads)
        repacked = not target.exact_kernels
        t = forward_costs(target, TARGET_ROWS, reps=a.reps, threads=a.threads)["forward_s"]
        d = forward_costs(Model(a.model_draft), sorted(set(clients) | {1}), reps=a.reps, threads=a.threads)["forward_s"]
        rounds.append({"target_ms": {r: v * 1e3 for r, v in t.items()}, "draft_ms": {r: v * 1e3 for r, v in d.items()},
                       "target_repacked": repacked})
        print(f"round {i + 1}: target{' (repacked)' if repacked else ''} ms " + ", ".join(f"{r}:{v * 1e3:.0f}" for r, v in t.items()), flush=True)
        print(f"         draft ms " + ", ".join(f"{r}:{v * 1e3:.1f}" for r, v in d.items()), flush=True)
    table = []
    print(f"\n{'N':>3} {'alpha':>5}  plain tok/s  best spec tok/s (rows)  spec / plain, median (range)")
    for n in clients:
        for alpha in alphas:
            per = [best_round(n, alpha, r["target_ms"], r["draft_ms"]) for r in rounds]
            ratios = [s / p for s, _, p in per]
            med = statistics.median(ratios)
            table.append({"n": n, "alpha": alpha, "ratio_median": med, "ratios": ratios,
                          "plain_tok_s": [p * 1e3 for _, _, p in per], "spec_tok_s": [s * 1e3 for s, _, _ in per],
                          "rows": [r for _, r, _ in per]})
            print(f"{n:>3} {alpha:>5}  {statistics.median(p for _, _, p in per) * 1e3:11.1f}  "
                  f"{statistics.median(s for s, _, _ in per) * 1e3:15.1f} ({'/'.join(str(r) for _, r, _ in per)})"
                  f"  {med:.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"target": a.target, "draft": a.model_draft, "threads": a.threads,
                                            "rounds": rounds, "bound": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

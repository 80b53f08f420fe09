"""Time one verify window: the native kernel (llama_mars_verify) against numpy.

    python benchmarks/verify_kernel.py                 # Rich table
    python benchmarks/verify_kernel.py --json          # one JSON object, {"rows": [...]}
    python benchmarks/verify_kernel.py --method strict --rounds 15

Logits are N(0, 3^2) float32; in each draft row the draft token's logit is
set 4 above the row's maximum (a confident target that agrees with the
drafter: p(draft) ~ 0.9 at T = 1, so most windows are accepted in full and
both sides process every row); the bonus row is plain noise.
Sampling uses mars-local's defaults (top-k 40, top-p 0.95, min-p 0.05).
Each cell is the best (minimum) over --rounds rounds of the mean time per
call in a round (calls per round chosen so that a round takes about 20 ms);
native and numpy rounds alternate, so both see the same machine load.  Both
implementations get the same inputs and their results are checked to be equal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from mars_local.speculate import native
from mars_local.core.sampling import SamplingParams
from mars_local.core.verify import VerifyConfig, verify

VOCABS = (49152, 151936, 262144)
KS = (4, 8, 16)
TEMPERATURES = (0.0, 1.0)


def _calls_per_round(fn, budget_s: float = 0.02) -> int:
    t0 = time.perf_counter()
    fn()
    return max(1, int(budget_s / max(time.perf_counter() - t0, 1e-7)))


def time_pair(fa, fb, rounds: int) -> tuple[float, float]:
    """Best-of-rounds seconds per call of fa and fb, their rounds interleaved."""
    na, nb = _calls_per_round(fa), _calls_per_round(fb)
    ta, tb = [], []
    for _ in range(rounds):
        for fn, n, acc in ((fa, na, ta), (fb, nb, tb)):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            acc.append((time.perf_counter() - t0) / n)
    return min(ta), min(tb)


def window(vocab: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((k + 1, vocab), dtype=np.float32) * 3.0).astype(np.float32)
    draft = rng.integers(0, vocab, size=k)
    logits[np.arange(k), draft] = logits[:k].max(axis=1) + 4.0
    return logits, draft


def run(method: str, rounds: int, vocabs=VOCABS, ks=KS, temperatures=TEMPERATURES) -> list[dict]:
    cfg = VerifyConfig(method, theta=0.9, eog_ids=(0, 2))
    rows = []
    for vocab in vocabs:
        for k in ks:
            logits, draft = window(vocab, k, seed=vocab + k)
            for temp in temperatures:
                params = SamplingParams(temperature=temp)
                u = np.random.default_rng(k).random((k + 1, 2))
                a = verify(logits, draft, cfg, params, None, None, u)
                b = native.verify(logits, draft, cfg, params, None, None, u)
                if (a.n_accepted, a.tokens, a.relaxed.tolist()) != (b.n_accepted, b.tokens, b.relaxed.tolist()):
                    raise SystemExit(f"native and numpy disagree at V={vocab} k={k} T={temp}: {a} vs {b}")
                t_nat, t_np = time_pair(
                    lambda: native.verify(logits, draft, cfg, params, None, None, u),
                    lambda: verify(logits, draft, cfg, params, None, None, u),
                    rounds,
                )
                rows.append(
                    {
                        "vocab": vocab,
                        "k": k,
                        "temperature": temp,
                        "native_us": round(t_nat * 1e6, 1),
                        "numpy_us": round(t_np * 1e6, 1),
                        "speedup": round(t_np / t_nat, 2),
                        "accepted": a.n_accepted,
                    }
                )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--method", choices=("mars", "strict"), default="mars")
    ap.add_argument("--rounds", type=int, default=9, help="timing rounds per cell (the best is reported)")
    args = ap.parse_args(argv)
    if not native.available():
        print("the loaded libllama has no llama_mars_verify (build with patches/, `make install`)", file=sys.stderr)
        return 2
    rows = run(args.method, args.rounds)
    if args.json:
        print(json.dumps({"method": args.method, "rows": rows}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"verify window, {args.method}: native kernel vs numpy (best of {args.rounds} rounds)")
    for col in ("vocab", "k", "T", "accepted", "native µs", "numpy µs", "speedup"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["vocab"]), str(r["k"]), f"{r['temperature']:g}", str(r["accepted"]),
            f"{r['native_us']:.1f}", f"{r['numpy_us']:.1f}", f"{r['speedup']:.1f}x",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where a batched round's time goes: llama_decode (windows, prefill, draft) against the Python around it.

    .venv/bin/python benchmarks/round_profile.py TARGET.gguf [-md DRAFT.gguf] [--parallel 1,4,16] \\
        [-n 48] [--per-slot M] [--learned] [-t 2] [-ngl N] [--fast-kernels] [--verify strict|mars] [--fixed-k K]
        [--serve-prompts] [--json OUT]

For each N it decodes N bench prompts at once (``--per-slot M``: M x N prompts through N
slots, each joining as one finishes, as serving's clients send them) through one :class:`mars_local.Scheduler`
(greedy; plain rounds unless a draft is given), after a short warm-up batch, and splits the
wall time per round into: the target's decodes of windows (the rounds' forwards), its prefill
decodes (joining prompts), the draft model's decodes (its steps; "catch-up": its cache brought
up to date with a joining prompt or rounds that did not draft), and the rest (Python: verification,
bookkeeping, emission).  Each timed decode waits for its forward to finish
(llama_synchronize): a GPU backend's llama_decode returns once the forward is queued, and
without the wait the GPU's time would land in "rest", where the logits are read (as it did
in the H100 visit's profile, BENCHMARKS.md).  "tokens a round" is all sequences' tokens
over the rounds (N when every round is plain); "drafting": the rounds that verified a draft.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PARTS = ("windows", "prefill", "draft", "catch-up", "rest")


class DecodeClock:
    """Seconds spent in a MultiContext's llama_decode calls, split by what asked for them."""

    def __init__(self, sch) -> None:
        self.spent = dict.fromkeys(PARTS[:4], 0.0)
        self.drafting_rounds = 0  # rounds that verified a draft (k > 0)
        self.k_rounds: dict[int, int] = {}  # k -> rounds that verified it
        self._in_windows = self._in_catch_up = False
        self._wrap(sch.mc, lambda: "windows" if self._in_windows else "prefill")
        real_windows = sch.mc.decode_windows

        def windows(*a, **kw):
            self._in_windows = True
            try:
                return real_windows(*a, **kw)
            finally:
                self._in_windows = False

        sch.mc.decode_windows = windows
        if sch.dmc is not None:
            self._wrap(sch.dmc, lambda: "catch-up" if self._in_catch_up else "draft")
            real_catch_up = sch._draft_prompts

            def catch_up(*a, **kw):  # a draft cache brought up to date (a joining prompt, rounds not drafted)
                self._in_catch_up = True
                try:
                    return real_catch_up(*a, **kw)
                finally:
                    self._in_catch_up = False

            sch._draft_prompts = catch_up
        real_round = sch._round

        def round_(*a, **kw):
            out = real_round(*a, **kw)
            self.drafting_rounds += sch.last_k > 0
            self.k_rounds[sch.last_k] = self.k_rounds.get(sch.last_k, 0) + 1
            return out

        sch._round = round_

    def _wrap(self, mc, part) -> None:
        from mars_local.llama.backend import C

        real = mc._decode

        def decode(parts):
            t0 = time.perf_counter()
            try:
                return real(parts)
            finally:
                # a GPU backend's llama_decode returns once the forward is queued, and the wait
                # for it would be counted where its logits are read ("rest"): wait here instead
                C.llama_synchronize(mc._ctx)
                self.spent[part()] += time.perf_counter() - t0

        mc._decode = decode

    def reset(self) -> None:
        for k in self.spent:
            self.spent[k] = 0.0
        self.drafting_rounds = 0
        self.k_rounds = {}


def plan_seen(sch) -> dict:
    """What the scheduler's plan knew at the end: the target forwards it timed (ms by rows, the
    decayed means it chooses k from), a draft token's cost, and the rates of whole rounds that
    drafted and that did not at N sequences (tokens/s; DraftOrNot's)."""
    c = sch.cost
    timed = {r: round(1e3 * t / n, 2) for r, (t, n) in sorted(c._time.items()) if n > 0.05}
    rates = {name: sch.mode.rate(flag, 0.0, sch.n_parallel) for name, flag in (("drafting", True), ("plain", False))}
    return {"forward_ms": timed, "draft_token_ms": round(1e3 * c.draft_cost(), 3) if c.draft_measured else None,
            "round_rates": {k: None if v is None else round(v, 1) for k, v in rates.items()}}


def profile(eng, n_parallel: int, prompts: list, n: int, per_slot: int = 1, verify: str | None = None,
            fixed_k: int | None = None) -> dict:
    from mars_local import Scheduler

    sch = Scheduler(eng, n_parallel)
    try:
        clock = DecodeClock(sch)
        opts = {"verify": verify} if verify else {}
        if fixed_k is not None:  # every round drafts fixed_k tokens a sequence (no controller)
            opts.update(adaptive=False, draft_max=fixed_k)
        sch.generate_many(prompts[:n_parallel], max_tokens=8, temperature=0, ignore_eos=True, **opts)  # warm-up
        clock.reset()
        r0 = sch.rounds
        t0 = time.perf_counter()
        outs = sch.generate_many(prompts[n_parallel:(1 + per_slot) * n_parallel], max_tokens=n, temperature=0,
                                 ignore_eos=True, **opts)
        wall = time.perf_counter() - t0
        rounds = max(1, sch.rounds - r0)
        plan = plan_seen(sch)
    finally:
        sch.close()
    spent = dict(clock.spent, rest=max(0.0, wall - sum(clock.spent.values())))
    tokens = sum(len(o.tokens) for o in outs)
    return {"parallel": n_parallel, "per_slot": per_slot, "rounds": rounds, "tokens": tokens, "seconds": wall,
            "drafting_rounds": clock.drafting_rounds, "k_rounds": dict(sorted(clock.k_rounds.items())), "plan": plan,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "tokens_per_round": tokens / rounds,  # all sequences' (N a round when plain)
            "ms_per_round": {k: 1e3 * v / rounds for k, v in spent.items()},
            "wall_ms_per_round": 1e3 * wall / rounds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("-md", "--model-draft", default=None, help="a draft model (default: plain rounds)")
    ap.add_argument("--parallel", default="1,4,16", help="sequences decoded together, a comma list (default 1,4,16)")
    ap.add_argument("-n", type=int, default=48, help="tokens per sequence (default 48)")
    ap.add_argument("--per-slot", type=int, default=1,
                    help="prompts per sequence slot (default 1: N prompts joining together; 3: 3N prompts through N "
                         "slots, each joining as one finishes, as serving's clients send them)")
    ap.add_argument("--learned", action="store_true",
                    help="start from what earlier runs learned on this machine (the server's way; default: nothing)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-ngl", type=int, default=None, help="GPU layers (default: all on a GPU build)")
    ap.add_argument("--fast-kernels", action="store_true", help="load the target as `--fast-kernels` does")
    ap.add_argument("--verify", choices=("strict", "mars"), default=None,
                    help="the verification rule (default: mars-local's)")
    ap.add_argument("--fixed-k", type=int, default=None, metavar="K",
                    help="every round drafts K tokens a sequence (no draft-length controller; default: adaptive)")
    ap.add_argument("--serve-prompts", action="store_true",
                    help="the serving sweep's built-in prompts (mars_local.bench.serving) instead of the bench's")
    ap.add_argument("--json", default=None, metavar="OUT")
    a = ap.parse_args(argv)
    try:
        ns = [int(x) for x in a.parallel.split(",")]
        if not ns or min(ns) < 1 or a.n < 1 or a.per_slot < 1:
            raise ValueError
    except ValueError:
        print(f"error: --parallel must be a comma list of integers >= 1, -n and --per-slot >= 1, got "
              f"{a.parallel!r}, {a.n}, {a.per_slot}",
              file=sys.stderr)
        return 2
    from mars_local.speculate.batch_cost import MAX_ROWS

    if a.fixed_k is not None and not (1 <= a.fixed_k and (a.fixed_k + 1) * max(ns) <= MAX_ROWS):
        print(f"error: --fixed-k must be >= 1 with (K + 1) x N <= {MAX_ROWS} rows a round, got {a.fixed_k} "
              f"at N = {max(ns)}", file=sys.stderr)
        return 2
    for p in (a.target, a.model_draft):
        if p is not None and not Path(p).is_file():
            print(f"error: no such model file: {p}", file=sys.stderr)
            return 2

    from mars_local import Engine
    from mars_local.bench.prompts import load_prompts
    from mars_local.llama.runtime import backend_info

    drafter = "model" if a.model_draft else "none"
    rows = []
    with Engine(a.target, a.model_draft, drafter=drafter, n_ctx=1024, n_gpu_layers=a.ngl, n_gpu_layers_draft=a.ngl,
                n_threads=a.threads, learned=a.learned, exact_kernels=not a.fast_kernels) as eng:
        if a.serve_prompts:
            from mars_local.bench.serving import PROMPTS

            every = [eng.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
        else:
            every = [eng.chat_prompt(p.messages) for p in load_prompts()]
        need = (1 + a.per_slot) * max(ns)
        prompts = (every * (need // len(every) + 1))[:need]
        print("| N | rounds | drafting | tokens a round | tok/s | ms a round | windows | prefill | draft | "
              "catch-up | rest (Python) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n_par in ns:
            r = profile(eng, n_par, prompts, a.n, a.per_slot, a.verify, a.fixed_k)
            rows.append(r)
            ms = r["ms_per_round"]
            print(f"| {n_par} | {r['rounds']} | {r['drafting_rounds']} | {r['tokens_per_round']:.2f} | {r['tokens_per_s']:.1f} | "
                  f"{r['wall_ms_per_round']:.2f} | "
                  + " | ".join(f"{ms[k]:.2f}" for k in PARTS) + " |", flush=True)
            if r["drafting_rounds"]:
                print(f"    k: rounds {r['k_rounds']}; the plan at the end: {r['plan']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"backend": backend_info(), "target": a.target, "draft": a.model_draft,
                                            "n": a.n, "per_slot": a.per_slot, "learned": a.learned, "fixed_k": a.fixed_k,
                                            "fast_kernels": a.fast_kernels, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

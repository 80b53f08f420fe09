#!/usr/bin/env python3
"""Many sequences at once: aggregate tokens/s of the Scheduler at several --parallel values
against today's one-at-a-time loop, on the same prompts (issue 23).

    .venv/bin/python benchmarks/batch_bench.py -m .cache/standin/smollm2-pad240-F16.gguf \\
        -md SmolLM2-135M-Instruct.Q4_1.gguf --prompts 32 -n 48 -t 2 --parallel 1,2,4,8 [--plain]

Row "loop": Engine.generate on each prompt in turn (speculative, adaptive: what `mars batch`
did).  Rows "P=N": Scheduler(engine, N).generate_many over all prompts.  Greedy; with
``--verify strict`` (default) every sequence's tokens must equal the loop's (checked, printed).
``--plain`` adds the same rows with speculation off (draft_max=0).  The prompts are the
built-in bench prompts (chat ones through the chat template), cycled.  Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import time

from mars_local import Engine
from mars_local.bench.prompts import load_prompts
from mars_local.speculate.batched import Scheduler


def prompt_tokens(eng: Engine, n: int) -> list[list[int]]:
    ps = load_prompts()
    out = []
    for i in range(n):
        p = ps[i % len(ps)]
        out.append(eng.chat_prompt(list(p.messages)) if p.messages else eng.tokenize(p.text))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", required=True)
    ap.add_argument("-md", default=None)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-c", type=int, default=1024, help="context per sequence")
    ap.add_argument("--parallel", default="1,2,4,8")
    ap.add_argument("--verify", default="strict")
    ap.add_argument("--plain", action="store_true")
    a = ap.parse_args()
    drafter = "model" if a.md else "ngram"
    with Engine(a.m, a.md, drafter=drafter, n_ctx=a.c, n_threads=a.t) as eng:
        prompts = prompt_tokens(eng, a.prompts)
        modes = [("spec", {})] + ([("plain", {"draft_max": 0})] if a.plain else [])
        print(f"{a.m} + {a.md or 'n-gram'}: {len(prompts)} prompts x {a.n} tokens, -t {a.t}, verify {a.verify}")
        print(f"{'mode':6} {'row':6} {'tok/s':>7} {'ratio':>6} {'tau':>5} {'equal':>6} {'seconds':>8}")
        for mode, extra in modes:
            kw = dict(max_tokens=a.n, temperature=0, verify=a.verify, ignore_eos=True, **extra)
            t0 = time.perf_counter()
            ref = [eng.generate(p, **kw) for p in prompts]
            base = time.perf_counter() - t0
            n_tok = sum(len(g.tokens) for g in ref)
            tau = sum(g.stats.n_generated for g in ref) / max(1, sum(g.stats.n_rounds for g in ref))
            print(f"{mode:6} {'loop':6} {n_tok / base:7.1f} {1.0:6.2f} {tau:5.2f} {'-':>6} {base:8.1f}", flush=True)
            for p in [int(x) for x in a.parallel.split(",")]:
                sch = Scheduler(eng, p)
                try:
                    t0 = time.perf_counter()
                    outs = sch.generate_many(prompts, **kw)
                    dt = time.perf_counter() - t0
                finally:
                    sch.close()
                same = sum(o.tokens == g.tokens for o, g in zip(outs, ref))
                n_tok = sum(len(o.tokens) for o in outs)
                tau = sum(o.stats.n_generated for o in outs) / max(1, sum(o.stats.n_rounds for o in outs))
                print(f"{mode:6} {'P=' + str(p):6} {n_tok / dt:7.1f} {base / dt:6.2f} {tau:5.2f} "
                      f"{same:>3}/{len(outs):<2} {dt:8.1f}", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Is the load-aware draft length right?  N sequences at once through one Scheduler: its own choice
(adaptive) against every fixed k given (``--no-adaptive`` rounds of k drafts; k0: plain rounds), the
same prompts, two interleaved repetitions.

    .venv/bin/python benchmarks/batch_k_sweep.py TARGET.gguf DRAFT.gguf N adaptive,k0,k2,k4,k8

Prints tokens/s (the prefill of the 3N prompts of 48 tokens included) and rounds per configuration.
"""
import sys
import time
from mars_local import Engine, Scheduler
from mars_local.bench.prompts import load_prompts
if len(sys.argv) != 5:
    sys.exit(__doc__.split("\n\n")[1])
target, draft, n_par = sys.argv[1], sys.argv[2], int(sys.argv[3])
configs = sys.argv[4].split(",")  # "adaptive", "k0", "k2", "k4"...
with Engine(target, draft, drafter="model", n_ctx=1024, n_threads=2) as eng:
    every = [eng.chat_prompt(p.messages) for p in load_prompts()]
    prompts = (every * 4)[: 4 * n_par]
    sch = Scheduler(eng, n_par)
    sch.generate_many(prompts[:n_par], max_tokens=8, temperature=0, ignore_eos=True)  # warm-up
    for rep in range(2):
        for c in configs:
            kw = dict(max_tokens=48, temperature=0, ignore_eos=True)
            if c.startswith("k"):
                k = int(c[1:]); kw.update(adaptive=False, draft_max=max(k, 1))
                if k == 0: kw.update(draft_max=0)
            t0 = time.perf_counter(); r0 = sch.rounds
            outs = sch.generate_many(prompts[n_par:], **kw)
            dt = time.perf_counter() - t0
            toks = sum(len(o.tokens) for o in outs)
            print(f"N={n_par} {c:9s} rep {rep}: {toks/dt:6.1f} tok/s, rounds {sch.rounds-r0}, {dt:.1f}s", flush=True)
    sch.close()

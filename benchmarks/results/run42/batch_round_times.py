"""Run 42: each plain round's forward of a Scheduler(engine, 8) over the 32 bench prompts x 48 tokens, by its row
count and by whether a joining prompt's prefill ran in the same step (what the batch cost curve learns from).
From the root: .venv/bin/python benchmarks/results/run42/batch_round_times.py TARGET [--sequence]"""
import collections
import statistics
import sys
import time

sys.path.insert(0, '.')
sys.path.insert(0, 'benchmarks')
from batch_bench import prompt_tokens  # noqa: E402

from mars_local import Engine  # noqa: E402
from mars_local.speculate import batched as B  # noqa: E402

state = {'prefilled': 0.0}
times = collections.defaultdict(list)
orig_prefill = B.Scheduler._prefill


def prefill(self, *a, **kw):
    t0 = time.perf_counter()
    orig_prefill(self, *a, **kw)
    state['prefilled'] = time.perf_counter() - t0


B.Scheduler._prefill = prefill
orig_obs = B.BatchCost.observe


seq = []


def obs(self, rows, seconds, weight=1.0):
    times[(rows, state['prefilled'] > 0.01)].append(seconds)
    seq.append((rows, round(1000 * seconds), round(1000 * state['prefilled'])))
    return orig_obs(self, rows, seconds, weight)


B.BatchCost.observe = obs
with Engine(sys.argv[1], n_ctx=1024, n_threads=2) as eng:
    prompts = prompt_tokens(eng, 32)
    sch = B.Scheduler(eng, 8)
    try:
        sch.generate_many(prompts, max_tokens=48, temperature=0, ignore_eos=True, draft_max=0)
    finally:
        sch.close()
if '--sequence' in sys.argv:
    print('each round in order: (rows, forward ms, prefill ms in the step)')
    print(seq)
for (rows, pre), t in sorted(times.items()):
    print(f"{rows} rows, {'after a prefill in the step' if pre else 'no prefill in the step':28} n={len(t):3} "
          f"median {1000 * statistics.median(t):6.1f} ms  min {1000 * min(t):6.1f}  max {1000 * max(t):6.1f}")

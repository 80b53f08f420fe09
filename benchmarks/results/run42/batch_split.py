"""Run 42: where `mars batch --parallel 8`'s speculative run spends the seconds its plain run does not.
Scheduler(engine, 8).generate_many over the 32 bench prompts x 48 tokens, speculative and plain
(draft_max=0) alternated ROUNDS times in one process, with the scheduler's parts timed by wrapping them.
From the repository root, nothing else running:
.venv/bin/python benchmarks/results/run42/batch_split.py TARGET DRAFT [ROUNDS]"""
import collections
import sys
import time

sys.path.insert(0, '.')
sys.path.insert(0, 'benchmarks')
from batch_bench import prompt_tokens  # noqa: E402

from mars_local import Engine  # noqa: E402
from mars_local.speculate import batched as B  # noqa: E402

T, D = sys.argv[1:3]
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
acc = collections.defaultdict(float)
cnt = collections.defaultdict(int)


def wrap(name):
    orig = getattr(B.Scheduler, name)

    def f(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return orig(self, *a, **kw)
        finally:
            acc[name] += time.perf_counter() - t0
            cnt[name] += 1
    setattr(B.Scheduler, name, f)


for n in ('_calibrate', '_calibrate_draft', '_probe_switch', '_draft_prompts', '_draft_all', '_time_windows',
          '_prefill', '_round', 'warm_up', '_time_views'):
    wrap(n)
orig_round = B.Scheduler._round


def round_(self, seqs):
    orig_round(self, seqs)
    cnt['rounds drafted' if self._drafted_last else 'rounds plain'] += 1


B.Scheduler._round = round_
with Engine(T, D, drafter='model', n_ctx=1024, n_threads=2) as eng:
    prompts = prompt_tokens(eng, 32)
    ref = None
    for rnd in range(ROUNDS):
        for mode, extra in (('spec', {}), ('plain', {'draft_max': 0})):
            acc.clear()
            cnt.clear()
            sch = B.Scheduler(eng, 8)
            t0 = time.perf_counter()
            try:
                outs = sch.generate_many(prompts, max_tokens=48, temperature=0, verify='strict', ignore_eos=True, **extra)
            finally:
                sch.close()
            dt = time.perf_counter() - t0
            if ref is None:
                ref = [o.tokens for o in outs]
            same = sum(o.tokens == r for o, r in zip(outs, ref))
            n_tok = sum(len(o.tokens) for o in outs)
            parts = ' '.join(f"{k}={v:.2f}s/{cnt[k]}" for k, v in sorted(acc.items()))
            print(f"round {rnd + 1} {mode:5} {dt:6.1f} s {n_tok / dt:5.1f} tok/s same {same}/32 | "
                  f"drafted rounds {cnt['rounds drafted']} plain rounds {cnt['rounds plain']} | {parts}", flush=True)

"""Run 42: trace the batched scheduler's plan (plan_drafting: k, pooled acceptance, forward costs, predicted rates),
DraftOrNot's choices and the draft model's catch-ups over one Scheduler(engine, 8).generate_many of the 32 bench prompts
x 48 tokens.  From the root, MARS_STATE_DIR a copy of a state a batch run left:
.venv/bin/python benchmarks/results/run42/batch_plan_trace.py TARGET DRAFT"""
import sys, time
sys.path.insert(0, '.'); sys.path.insert(0, 'benchmarks')
from batch_bench import prompt_tokens
from mars_local import Engine
from mars_local.speculate import batched as B, batch_cost as BC
T, D = sys.argv[1:3]
orig = BC.DraftOrNot.choose
def choose(self, planned, switch_s=0.0, measured=False, n=None):
    rd, rp = self._rates_at(n, switch_s)
    pick = orig(self, planned, switch_s, measured, n)
    if pick or planned:
        print(f"n={n} planned={planned} measured={measured} switch={switch_s:.3f} rd={rd and round(rd,1)} rp={rp and round(rp,1)} gap={dict(self._gap)} since={dict(self._since)} -> {pick}", flush=True)
    return pick
BC.DraftOrNot.choose = choose
orig_dp = B.Scheduler._draft_prompts
def dp(self, seqs):
    t = orig_dp(self, seqs)
    if t: print(f"   catch-up {t:.2f}s over {len(seqs)} seqs", flush=True)
    return t
B.Scheduler._draft_prompts = dp
orig_pd = B.plan_drafting
seen = [0]
def pd(accepts, costs, per_token, k_room, lags=(), remaining=(), row_s=0.0, **kw):
    out = orig_pd(accepts, costs, per_token, k_room, lags, remaining, row_s, **kw)
    n = len(accepts)
    if out[0] > 0 and seen[0] < 12 and max(a[0] for a in accepts) < 1.0:
        seen[0] += 1
        k = out[1]
        from mars_local.speculate.adaptive import expected_tokens
        tok = sum(expected_tokens(list(a[:k]), k) for a in accepts)
        print(f"  plan n={n} k={out[0]} acc={accepts[0][0]:.3f} per_token={per_token*1000:.1f}ms rows={n*(k+1)} cost={costs[n*(k+1)-1]*1000:.0f}ms "
              f"plain cost({n})={costs[n-1]*1000:.0f}ms -> draft rate {tok/(costs[n*(k+1)-1]+per_token*n*k+out[2]):.1f} plain rate {n/costs[n-1]:.1f} switch {out[2]:.3f}", flush=True)
    return out
B.plan_drafting = pd
orig_obs = B.BatchCost.observe
def obs(self, rows, seconds, weight=1.0):
    if rows >= 16: print(f"    forward {rows} rows {seconds*1000:.0f} ms (w {weight})", flush=True)
    return orig_obs(self, rows, seconds, weight)
B.BatchCost.observe = obs
with Engine(T, D, drafter='model', n_ctx=1024, n_threads=2) as eng:
    prompts = prompt_tokens(eng, 32)
    sch = B.Scheduler(eng, 8)
    t0 = time.perf_counter()
    outs = sch.generate_many(prompts, max_tokens=48, temperature=0, verify='strict', ignore_eos=True)
    sch.close()
    print('total', round(time.perf_counter() - t0, 1))

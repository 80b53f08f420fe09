"""Run 42: replay the logged rounds of run 41 (benchmarks/results/run41/lookahead-keys-strict.json: 8 drafts each, their
confidence keys and accepted count) through the real AdaptiveK from an empty state, at this CPU's measured cost curves,
against a controller started from what a long replay learned (export_state/import_state). From the repository root:
.venv/bin/python benchmarks/results/run42/cold_start_replay.py"""
import json, sys, random
sys.path.insert(0, '.')
from mars_local.speculate.adaptive import AdaptiveK
from mars_local.speculate.controllers import CALIBRATION_WINDOWS
log = json.load(open('benchmarks/results/run41/lookahead-keys-strict.json'))
CURVES = {'w768': ([82,134,188,212,245,297,310,340,380], 11.6), 'F16': ([89,111,147,172,182,199,230,264,275], 11.5)}
def cost_of(costs):
    return lambda w: (costs[w-1] if w <= len(costs) else costs[-1] + (costs[-1]-costs[-2])*(w-len(costs))) / 1000
def replay(curve, n_tokens, ctrl=None, seed=0, kmax=8, **kw):
    costs, c = CURVES[curve]; c /= 1000; cost = cost_of(costs)
    if ctrl is None:
        ctrl = AdaptiveK(k_max=kmax, **kw)
        for w in sorted(set([x for x in CALIBRATION_WINDOWS if x <= kmax+1] + [kmax+1])):
            for _ in range(2): ctrl.observe_forward(w, cost(w))
    rng = random.Random(seed); order = list(range(len(log))); rng.shuffle(order)
    tok = tim = 0.0; i = 0; curve_out = []
    while tok < n_tokens:
        keys, n = log[order[i % len(log)]]; i += 1
        k = ctrl.choose(kmax)
        if k > 0:
            m = 1
            while m < len(keys) and ctrl.extend(keys[:m], kmax): m += 1
            v = min(ctrl.trim(keys[:m]), m)
            acc = min(n, v)
            ctrl.observe(v, acc, cost(v+1), c*m, keys[:v], drafted=m)
            tok += acc + 1; tim += cost(v+1) + c*m
        else:
            ctrl.observe(0, 0, cost(1), 0.0, None, drafted=0)
            tok += 1; tim += cost(1)
        curve_out.append((tok, tim))
    return tok/tim, ctrl, curve_out
if __name__ == '__main__':
    for curve in CURVES:
        plain = 1000/CURVES[curve][0][0]
        for N in (64, 128, 384, 2000):
            r = [replay(curve, N, seed=s)[0] for s in range(20)]
            _, warm, _ = replay(curve, 3000, seed=99)
            st = warm.export_state(); 
            rw = []
            for s in range(20):
                w = AdaptiveK(k_max=8); w.import_state(st); rw.append(replay(curve, N, ctrl=w, seed=s)[0])
            print(f"{curve} N={N}: cold {sum(r)/len(r)/plain:.3f}x plain, warm {sum(rw)/len(rw)/plain:.3f}x")

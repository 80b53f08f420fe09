"""Run 42: cold-start variants of the acceptance prior, on the logged draft and on weaker synthetic ones (per-key
acceptance scaled by 0.7 and 0.5, and a useless draft), tokens/s over plain after 64, 128 and 512 tokens.  From the root:
.venv/bin/python benchmarks/results/run42/cold_start_variants.py"""
import json, sys, random, collections
sys.path.insert(0, '.'); sys.path.insert(0, 'benchmarks/results/run42')
from mars_local.speculate.adaptive import AdaptiveK, POOL, CONFIDENCE_EDGES
import cold_start_replay as cold
log = cold.log
own = collections.defaultdict(lambda: [0, 0])
for keys, n in log:
    for i, k in enumerate(keys):
        if i > n: break
        own[k][0] += i < n; own[k][1] += 1
A = {k: v[0]/v[1] for k, v in own.items()}
def synth(scale, floor=None, seed=1):
    rng = random.Random(seed); out = []
    for keys, _ in log:
        n = 0
        for k in keys:
            a = floor if floor is not None else A[k] * scale
            if rng.random() < a: n += 1
            else: break
        out.append((keys, n))
    return out
LOGS = {'real': log, 'weak0.7': synth(0.7), 'weak0.5': synth(0.5), 'useless': synth(0, floor=0.03)}
MIDS = [0.1, 0.3, 0.5, 0.7, 0.85, 0.925, 0.965, 0.9875, 0.9975]
class KeyPrior(AdaptiveK):
    """a p-key's prior is the confidence bucket's mid (weight w) blended with pooled by pooled's evidence"""
    def acceptance(self, key=None):
        if not (isinstance(key, str) and key.startswith('p')):
            return super().acceptance(key)
        acc0, rej0 = self._counts.get(POOL, (0.0, 0.0)); n0 = acc0 + rej0
        pooled = super().acceptance(None)
        mid = MIDS[int(key[1:])]
        # the draft's own confidence as the prior while little is pooled; the pooled estimate later
        f = n0 / (n0 + 10.0)
        prior = f * pooled + (1 - f) * mid
        acc, rej = self._counts.get(key, (0.0, 0.0)); w = self.prior_weight
        return (acc + w * prior) / (acc + rej + w)
def run_variant(cls, kw, logname, N, seeds=20):
    cold.log = LOGS[logname]
    res = {}
    for curve in cold.CURVES:
        plain = 1000/cold.CURVES[curve][0][0]
        orig = cold.AdaptiveK; cold.AdaptiveK = cls
        r = [cold.replay(curve, N, seed=s, **kw)[0] for s in range(seeds)]
        cold.AdaptiveK = orig
        res[curve] = sum(r)/len(r)/plain
    cold.log = log
    return res
if __name__ == '__main__':
    variants = [('base', AdaptiveK, {}), ('prior0.5', AdaptiveK, {'prior_accept': 0.5}), ('prior0.7', AdaptiveK, {'prior_accept': 0.7}),
                ('keyprior', KeyPrior, {}), ('keyprior+0.5', KeyPrior, {'prior_accept': 0.5})]
    for logname in LOGS:
        for N in (64, 128, 512):
            print(logname, N, '  '.join(f"{name}: " + ' '.join(f"{c} {v:.3f}" for c, v in run_variant(cls, kw, logname, N).items()) for name, cls, kw in variants))

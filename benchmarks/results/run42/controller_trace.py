"""Run 42: trace the adaptive controller's rounds on the real engine (k, accepted, target and draft ms, pooled acceptance,
draft cost, probe budget), one bench prompt per category, 64 tokens.  From the root, MARS_STATE_DIR set:
.venv/bin/python benchmarks/results/run42/controller_trace.py TARGET DRAFT strict|mars OUT.json"""
import json, sys, time
sys.path.insert(0, '.')
from mars_local.speculate.engine import Engine
from mars_local.speculate import adaptive as A
from mars_local.core.config import GenerateConfig
T, D, verify, out = sys.argv[1:5]
log = []
orig = A.AdaptiveK.observe
def obs(self, k, n_acc, tt, td, keys=None, drafted=None):
    log.append(dict(k=k, acc=n_acc, tt=round(tt*1000, 1), td=round(td*1000, 1), drafted=drafted,
                    pooled=round(self.acceptance(), 3), dc=round(self.draft_cost*1000, 1), budget=round(self._budget*1000)))
    return orig(self, k, n_acc, tt, td, keys, drafted)
A.AdaptiveK.observe = obs
t0 = time.time()
eng = Engine(T, D, n_threads=2, n_ctx=2048)
res = []
for cat in ['chat', 'code', 'math', 'rag', 'summarization', 'translation']:
    p = json.loads(open(f'mars_local/bench/prompts/{cat}.jsonl').readline())
    toks = eng.chat_prompt(p['messages']) if p.get('messages') else eng.tokenize(p['text'])
    n0 = len(log); t1 = time.time()
    r = eng.generate(toks, GenerateConfig(max_tokens=64, verify=verify, theta=0.9, draft_max=16, adaptive=True))
    res.append(dict(cat=cat, rounds=len(log) - n0, wall=time.time() - t1, stats=str(getattr(r, 'stats', ''))[:300]))
    print(cat, len(log) - n0, round(time.time() - t1, 2), flush=True)
eng.close() if hasattr(eng, 'close') else None
json.dump(dict(log=log, res=res), open(out, 'w'), indent=0)

"""Run 41: log the confidence keys and acceptance of rounds forced to 8 drafts (strict, greedy, 135M F16 target,
sigma 0.044 draft, the 48 bench prompts x 96 tokens). .venv/bin/python benchmarks/results/run41/lookahead_keys.py strict"""
import json, sys, collections
sys.path.insert(0, '.')
from mars_local.speculate.engine import Engine
from mars_local.speculate import adaptive as A
from mars_local.core.config import GenerateConfig
T='.cache/standin/SmolLM2-135M-Instruct.F16.gguf'; D='.cache/standin/SmolLM2-135M-draft-noise0.044-Q4_1.gguf'
verify=sys.argv[1]
A.AdaptiveK.extend=lambda self, keys, k_limit=None: len(keys) < 8
A.AdaptiveK.trim=lambda self, keys: len(keys)
A.AdaptiveK.choose=lambda self, k_limit=None, keys=None: 8 if (k_limit is None or k_limit>=8) else k_limit
log=[]
orig=A.AdaptiveK.observe
def obs(self, k, n_acc, tt, td, keys=None, drafted=None):
    if keys: log.append((list(keys), n_acc))
    return orig(self, k, n_acc, tt, td, keys, drafted)
A.AdaptiveK.observe=obs
eng=Engine(T, D, n_threads=2, n_ctx=2048)
for cat in ['chat','code','math','rag','summarization','translation']:
  for line in open(f'mars_local/bench/prompts/{cat}.jsonl'):
    p=json.loads(line)
    toks=eng.chat_prompt(p['messages']) if p.get('messages') else eng.tokenize(p['text'])
    eng.generate(toks, GenerateConfig(max_tokens=96, verify=verify, theta=0.9, draft_max=8, adaptive=True))
json.dump(log, open(f'benchmarks/results/run41/lookahead-keys-{verify}.json','w'))
print(len(log))

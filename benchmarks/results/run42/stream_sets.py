"""Run 42: what a forward of one row per sequence costs by WHICH sequences (KV streams) it carries: the first n
of 8, the last n, or scattered, each sequence holding DEPTH tokens (as a batch's tail leaves them).
From the root: .venv/bin/python benchmarks/results/run42/stream_sets.py TARGET [DEPTH] [REPS]"""
import statistics
import sys
import time

sys.path.insert(0, '.')
from mars_local.llama.runtime import Model  # noqa: E402
from mars_local.llama.streams import MultiContext  # noqa: E402

path = sys.argv[1]
depth = int(sys.argv[2]) if len(sys.argv) > 2 else 150
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
sets = {'8 all': list(range(8)), '5 first': [0, 1, 2, 3, 4], '5 last': [3, 4, 5, 6, 7], '5 scattered': [0, 2, 4, 6, 7],
        '2 first': [0, 1], '2 scattered': [2, 6], '7 first': list(range(7)), '7 last': list(range(1, 8))}
m = Model(path, None, exact_kernels=True)
mc = MultiContext(m, 8, n_ctx_seq=depth + 64, n_threads=2)
vocab = m.n_vocab
toks = lambda seed, k: [(seed * 104729 + i * 7919 + 13) % (vocab - 300) + 200 for i in range(k)]  # noqa: E731
for s in range(8):
    mc.seqs[s].eval(toks(s, depth), n_out=0)
res = {name: [] for name in sets}
for r in range(reps):  # interleaved: every set once per repetition
    for name, seqs in sets.items():
        t0 = time.perf_counter()
        mc.decode_windows([(s, toks(1000 + r + s, 1)) for s in seqs], max_rows=len(seqs))
        res[name].append(time.perf_counter() - t0)
        for s in seqs:
            mc.seqs[s].truncate(depth)
for name, t in res.items():
    print(f"{name:12} first {1000 * t[0]:6.1f} ms, median of the rest {1000 * statistics.median(t[1:]):6.1f} ms")
mc.close()
m.close()

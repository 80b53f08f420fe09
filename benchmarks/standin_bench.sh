#!/usr/bin/env bash
# Head to head with llama.cpp where speculation can pay: the cost-realistic
# stand-in targets (SmolLM2 padded to 240 blocks, F16 and Q4_K_M, and the
# K-quant stand-in w768-Q4_K_M, SmolLM2 widened to 768 first so that its
# Q4_K_M is Q4_K/Q6_K; see make_standin.py) with the bundled Q4_1 SmolLM2 as draft, in one `mars bench`
# run per target: llama.cpp's llama-completion and llama-speculative-simple
# (k = 4, 8, 16; its best row is the reference), mars-local plain, strict and
# MARS θ = 0.9 with adaptive k and fixed k = 4, 8, 16, and the n-gram drafter.
#
#   benchmarks/standin_bench.sh                 (PER=1 prompt per category, N=64 tokens, T=2 threads)
#   PER=2 N=96 benchmarks/standin_bench.sh F16  (one target only)
#   benchmarks/standin_bench.sh w768-Q4_K_M     (the K-quant stand-in)
#
# Builds what is missing first (stand-ins into .cache/standin, llama.cpp's
# tools into .cache/llama-bin); writes benchmarks/results/standin-*.json and
# prints the tables.  About 15 minutes per target on 2 cores.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=.venv/bin/python
MARS=.venv/bin/mars
PER=${PER:-1}
N=${N:-64}
T=${T:-2}
BIN=${LLAMA_BIN:-.cache/llama-bin}
TARGETS=${*:-F16 Q4_K_M w768-Q4_K_M}

$PY benchmarks/make_standin.py
case " $TARGETS " in *" w768-"*) $PY benchmarks/make_standin.py --width 768 ;; esac
[ -x "$BIN/llama-speculative-simple" ] || benchmarks/build_llama_tools.sh "$BIN"
DRAFT=$($PY -c 'from mars_local.models.registry import load_registry, model_path; r = load_registry(); print(model_path(r.get("smollm2-135m"), "target"))')
mkdir -p benchmarks/results
for q in $TARGETS; do
    case $q in
        w768-*) target=.cache/standin/smollm2-w768-pad240-${q#w768-}.gguf ;;
        *) target=.cache/standin/smollm2-pad240-$q.gguf ;;
    esac
    echo "== $q stand-in, draft model"
    $MARS bench -m "$target" -md "$DRAFT" --drafter model --per-category "$PER" -n "$N" -t "$T" \
        --thetas 0.9 --draft-max 16 --fixed-k 4,8,16 --peer-k 4,8,16 --llama-cpp-bin "$BIN" --no-peers \
        --json "benchmarks/results/standin-$q-model.json"
    echo "== $q stand-in, n-gram drafter"
    $MARS bench -m "$target" --drafter ngram --per-category "$PER" -n "$N" -t "$T" \
        --thetas 0.9 --draft-max 8 --fixed-k 4 --peer-k 4 --llama-cpp-bin "$BIN" --no-peers \
        --json "benchmarks/results/standin-$q-ngram.json"
done

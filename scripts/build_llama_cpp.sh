#!/usr/bin/env bash
# Build llama-cpp-python (pinned) from its sdist with patches/ applied, and
# install the wheel into the given virtual environment.
#
#   scripts/build_llama_cpp.sh VENV
#
# The sdist comes from the package registry (pip download); the wheel is cached
# in .cache/wheels/<key>/ where <key> hashes the version, the patches, the
# Python version and CMAKE_ARGS, so a second `make install` is instant and a
# change to any patch or to CMAKE_ARGS rebuilds.  A patch that does not apply
# stops the build with an error.
set -euo pipefail

VENV=${1:?usage: build_llama_cpp.sh VENV}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MARS_CACHE_DIR:-$ROOT/.cache}
PY="$VENV/bin/python"

# Build options: ours first, then the user's CMAKE_ARGS (later -D wins), so
# CMAKE_ARGS="-DGGML_CUDA=on" or "-DGGML_METAL=on" select a GPU backend.
# Batch invariance (strict greedy speculative output == plain greedy output
# token for token) needs a 1-row decode and a (k+1)-row verify window to sum
# in the same order.  Stock llama.cpp serves batches of 2+ rows with
# llamafile's sgemm (tinyBLAS) and single rows with ggml's dot kernels, which
# differ in the last bits.  On x86, patches/0002 routes single rows of F32/F16/
# BF16 and Q8_0/Q4_0 weights through tinyBLAS too (other quantized types keep
# ggml's dot kernels up to 64 rows), so llamafile stays on (verify windows and
# prefill at stock speed: benchmarks/kernel_costs.py); on
# other CPUs it is turned off, leaving ggml's dot kernels for every batch size.
# patches/0003 keeps batches of up to 64 rows (every verify window) off the
# paths whose summation order differs from a single row's: the tiled K-quant
# matmul, the tiled flash attention and the split-KV attention of one row.
# patches/0004 computes Q4_K and Q5_K windows eight rows per weight row on x86 (AVX2 and
# up), each result summed exactly as ggml's 1-row dot kernel sums it; patches/0006 Q6_K windows
# the same way; patches/0007 reads a large matrix's weights once for windows of 17-64 rows;
# patches/0008 sums Q5_K rows in llama.cpp's tiled kernel's order, so Q5_K windows of 9+ rows
# take that kernel (stock's speed) and still match a lone row.  patches/0005 makes llama.cpp's
# repacked Q4_K kernels on x86 (1-row gemv, 4-row gemm) sum alike, so a Q4_K target can be
# loaded repacked where the load-time probe (speculate/repack.py) finds it exact.  patches/0009
# keeps ARM i8mm's 2x2 mmla kernel (another summation order) out of batches of up to 64 rows;
# patches/0010 gives one Q8_0/Q4_0/Q5_0/IQ4_NL row 8x1 tinyBLAS tiles on AVX2 builds too;
# patches/0011 reduces a Q5_K block's two integer sums together in 0008's tiled order.
# patches/0012 adds llama_sampler_try_accept: a grammar that refuses a token returns false
# instead of throwing through the C API (which aborts the process).
# patches/0013: one F16/BF16/F32 row's 8x1 tinyBLAS tiles, one contiguous run per thread, the next
# tile's rows prefetched into L2 (short rows read eight at a time defeated the hardware prefetchers).
case "$(uname -m)" in
    x86_64|amd64|i686|i386) LLAMAFILE=ON ;;
    *) LLAMAFILE=OFF ;;
esac
DEFAULT_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_LLAMAFILE=$LLAMAFILE -DGGML_RPC=ON"
export CMAKE_ARGS="$DEFAULT_ARGS ${CMAKE_ARGS:-}"

patches=$(ls "$ROOT"/patches/*.patch 2>/dev/null | sort || true)
key=$( { echo "$VERSION"; "$PY" -c 'import sys; print(sys.version)'; echo "$CMAKE_ARGS";
         for p in $patches; do sha256sum "$p" | cut -c1-64; done; } | sha256sum | cut -c1-16)
wheel_dir="$CACHE/wheels/$key"

# One build at a time per cache (a second `make` waits instead of deleting the
# first one's source tree under it).
mkdir -p "$CACHE"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE/.build.lock"
    flock 9
fi

installed_key=$(cat "$VENV/.llama-cpp-key" 2>/dev/null || true)
if [ "$installed_key" = "$key" ] && "$PY" -c 'import llama_cpp' 2>/dev/null; then
    echo "llama-cpp-python $VERSION already built and installed (key $key)"
    exit 0
fi

if ! ls "$wheel_dir"/*.whl >/dev/null 2>&1; then
    sdist="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        echo "==> downloading the llama-cpp-python $VERSION sdist"
        mkdir -p "$CACHE/sdist"
        "$PY" -m pip download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
    fi
    src="$CACHE/build/llama_cpp_python-$VERSION-$key"
    rm -rf "$src" && mkdir -p "$CACHE/build"
    tar -xzf "$sdist" -C "$CACHE/build"
    mv "$CACHE/build/llama_cpp_python-$VERSION" "$src"
    for p in $patches; do
        echo "==> applying $(basename "$p")"
        if ! patch -p1 --forward --batch --quiet -d "$src" < "$p"; then
            echo "error: patch $(basename "$p") does not apply to llama-cpp-python $VERSION" >&2
            exit 1
        fi
    done
    echo "==> building llama-cpp-python $VERSION (CMAKE_ARGS=$CMAKE_ARGS); this takes a few minutes"
    mkdir -p "$wheel_dir.tmp"
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)} \
        "$PY" -m pip wheel --quiet --no-deps -w "$wheel_dir.tmp" "$src"
    rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
    rm -rf "$src"
fi

"$PY" -m pip install --quiet --force-reinstall --no-deps "$wheel_dir"/*.whl
echo "$key" > "$VENV/.llama-cpp-key"
echo "llama-cpp-python $VERSION installed (key $key)"

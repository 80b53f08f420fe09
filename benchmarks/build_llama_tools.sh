#!/usr/bin/env bash
# Build llama.cpp's own command-line tools (llama-completion, llama-cli,
# llama-speculative-simple, llama-bench, llama-server, ggml-rpc-server) from the
# llama.cpp tree vendored in the pinned llama-cpp-python sdist, for
# `mars bench --llama-cpp-bin DIR` and benchmarks/serve_bench.py.
#
#   benchmarks/build_llama_tools.sh [OUT_DIR]     (default .cache/llama-bin)
#
# A stock build (llama.cpp's default flags, like a user's own build), so the
# peers are measured as people run them.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${MARS_CACHE_DIR:-$ROOT/.cache}
OUT=${1:-$CACHE/llama-bin}
SDIST="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    mkdir -p "$CACHE/sdist"
    python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
fi
SRC="$CACHE/llama-tools-src"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC" --strip-components=1 "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
cmake -S "$SRC/vendor/llama.cpp" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_RPC=ON ${CMAKE_ARGS:-} > /dev/null
targets="llama-completion llama-speculative-simple llama-bench llama-cli llama-server ggml-rpc-server"
avail=$(cmake --build "$SRC/build" --target help | sed -n 's/^\.\.\. \([a-z][a-z0-9-]*\).*/\1/p')
want=""
for t in $targets; do echo "$avail" | grep -qx "$t" && want="$want $t"; done
cmake --build "$SRC/build" -j "$(nproc)" --target $want
mkdir -p "$OUT"
for t in $want; do cp "$SRC/build/bin/$t" "$OUT/"; done
cp "$SRC"/build/bin/*.so* "$OUT/" 2>/dev/null || true
echo "built:$want -> $OUT"

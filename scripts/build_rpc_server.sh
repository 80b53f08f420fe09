#!/usr/bin/env bash
# Build llama.cpp's RPC server (ggml-rpc-server, "rpc-server") from the same
# patched llama.cpp tree as our llama-cpp-python wheel, so a target split
# across RPC servers computes with the same kernels as a local one.  Used by
# the RPC tests (`make test` builds it) and benchmarks/rpc_bench.py.
#
#   scripts/build_rpc_server.sh            -> .cache/rpc-server/current/ggml-rpc-server
#
# Cached under .cache/rpc-server/<key>/ (key: version, patches, flags); a
# second run is instant.
set -euo pipefail
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MARS_CACHE_DIR:-$ROOT/.cache}
case "$(uname -m)" in
    x86_64|amd64|i686|i386) LLAMAFILE=ON ;;
    *) LLAMAFILE=OFF ;;
esac
ARGS="-DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DGGML_LLAMAFILE=$LLAMAFILE -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON ${CMAKE_ARGS:-}"
patches=$(ls "$ROOT"/patches/*.patch 2>/dev/null | sort || true)
key=$( { echo "$VERSION"; echo "$ARGS"; for p in $patches; do sha256sum "$p" | cut -c1-64; done; } \
       | sha256sum | cut -c1-16)
out="$CACHE/rpc-server/$key"
if [ -x "$out/ggml-rpc-server" ]; then
    ln -sfn "$key" "$CACHE/rpc-server/current"
    echo "rpc-server already built ($out)"
    exit 0
fi
mkdir -p "$CACHE"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE/.rpc-build.lock"
    flock 9
fi
sdist="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    mkdir -p "$CACHE/sdist"
    python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/sdist"
fi
src="$CACHE/rpc-server/src-$key"
rm -rf "$src" && mkdir -p "$src"
tar -xzf "$sdist" -C "$src" --strip-components=1
for p in $patches; do
    if ! patch -p1 --forward --batch --quiet -d "$src" < "$p"; then
        echo "error: patch $(basename "$p") does not apply to llama.cpp in llama-cpp-python $VERSION" >&2
        exit 1
    fi
done
echo "==> building rpc-server (ggml-rpc-server) from the patched llama.cpp; a few minutes"
# shellcheck disable=SC2086
if ! { cmake -S "$src/vendor/llama.cpp" -B "$src/build" $ARGS &&
        cmake --build "$src/build" -j "$(nproc 2>/dev/null || echo 2)" --target ggml-rpc-server; } > "$src.log" 2>&1; then
    tail -n 30 "$src.log" >&2
    echo "error: building rpc-server failed (log: $src.log)" >&2
    exit 1
fi
rm -f "$src.log"
mkdir -p "$out.tmp"
cp "$src/build/bin/ggml-rpc-server" "$out.tmp/"
rm -rf "$out" && mv "$out.tmp" "$out"
ln -sfn "$key" "$CACHE/rpc-server/current"
rm -rf "$src"
echo "built $out/ggml-rpc-server"

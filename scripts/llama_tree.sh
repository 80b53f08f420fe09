#!/usr/bin/env bash
# Prints the path of an extracted llama-cpp-python sdist (pinned), preparing it on first use:
#
#   scripts/llama_tree.sh stock     llama.cpp as released          ($CACHE/trees/stock)
#   scripts/llama_tree.sh exact     with patches/ applied, as `make install` applies them
#                                   ($CACHE/trees/exact-<hash of the patches>: a patch change makes a new tree)
#
# For builds of the same tree with other flags than `make install`'s (benchmarks/build_isa_libs.sh,
# scripts/arm_window_check.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${MARS_CACHE_DIR:-$ROOT/.cache}
case "${1:-}" in
    stock) tree="$CACHE/trees/stock-$VERSION" ;;
    exact) tree="$CACHE/trees/exact-$VERSION-$(cat "$ROOT"/patches/*.patch | sha256sum | cut -c1-12)" ;;
    *) echo "usage: $0 stock|exact" >&2; exit 2 ;;
esac
if [ ! -f "$tree/.ready" ]; then
    SDIST="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
    if [ ! -f "$SDIST" ]; then
        mkdir -p "$CACHE/sdist"
        python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/sdist" >&2
    fi
    rm -rf "$tree" && mkdir -p "$tree"
    tar -xzf "$SDIST" -C "$tree" --strip-components=1
    if [ "$1" = exact ]; then
        for p in "$ROOT"/patches/*.patch; do patch -d "$tree" -p1 --forward --quiet < "$p" >&2; done
    fi
    touch "$tree/.ready"
fi
echo "$tree"

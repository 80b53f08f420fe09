#!/usr/bin/env bash
# Build llama.cpp's libraries twice for one x86 ISA level, stock and with our patches,
# to measure (and test) the exact build on a CPU level this machine can run but is not:
#
#   benchmarks/build_isa_libs.sh LEVEL [OUT_DIR]     (default .cache/isa/LEVEL)
#
# LEVEL: avx2 (AVX2, FMA, F16C: Haswell and later, Zen 1-3), avx512 (AVX-512F/BW/DQ/VL
# without VNNI or BF16: Skylake-X), avx512-vnni (with VNNI, without BF16: Ice Lake),
# native (this CPU, as `make install` builds).
#
# Writes OUT_DIR/stock and OUT_DIR/exact, each a complete set of shared libraries:
#   - tests and mars-local:  LLAMA_CPP_LIB_PATH=OUT_DIR/exact .venv/bin/python -m pytest tests/llama
#   - costs against stock:   benchmarks/kernel_costs.py --exact-lib OUT_DIR/exact --stock-lib OUT_DIR/stock
# (llama-bench from benchmarks/build_llama_tools.sh loads either through LD_LIBRARY_PATH.)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MARS_CACHE_DIR:-$ROOT/.cache}
LEVEL=${1:-}
OUT=${2:-$CACHE/isa/$LEVEL}
x86="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=OFF"
case "$LEVEL" in
    avx2) flags="$x86 -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF" ;;
    avx512) flags="$x86 -DGGML_AVX512=ON -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF" ;;
    avx512-vnni) flags="$x86 -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF" ;;
    native) flags="-DGGML_NATIVE=ON" ;;
    *) echo "usage: $0 avx2|avx512|avx512-vnni|native [OUT_DIR]" >&2; exit 2 ;;
esac
for side in stock exact; do
    SRC=$("$ROOT/scripts/llama_tree.sh" "$side")
    build="$SRC/build-$LEVEL"
    # shellcheck disable=SC2086
    cmake -S "$SRC/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DGGML_RPC=ON $flags > /dev/null
    cmake --build "$build" -j "$(nproc)" --target llama ggml-cpu ggml-rpc
    rm -rf "${OUT:?}/$side" && mkdir -p "$OUT/$side"
    cp -a "$build"/bin/lib*.so* "$OUT/$side/"
done
echo "built $LEVEL: $OUT/stock and $OUT/exact"

#!/usr/bin/env bash
# Is our patched ggml batch-invariant on ARM?  Cross-builds it for aarch64 (by default with
# dotprod and i8mm, the features of Graviton 3/4, Apple M2+ and Snapdragon X CPUs) and runs
# tests/llama/mulmat_window_check.c under qemu-user for every weight type: a verify window's
# rows (2-64) against single rows, bit for bit; then tests/llama/model_window_check.c on a small
# random model (512 wide, written by the venv's Python) in each weight type: a whole forward's
# windows of 2-17 rows (attention, norms, every matrix) against plain decoding.  A developer's
# check (no ARM machine needed; qemu's timings mean nothing, its results are the CPU's):
#
#   apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user
#   scripts/arm_window_check.sh [ARCH] [stock]      ARCH: default armv8.6-a+dotprod+i8mm+fp16
#
# "stock" checks llama.cpp as released instead (on i8mm, its even-sized windows of Q4_0, Q4_1,
# Q8_0, Q4_K and Q6_K differ: what patches/0009 fixes).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ARCH=${1:-armv8.6-a+dotprod+i8mm+fp16}
SIDE=${2:-exact}
for tool in aarch64-linux-gnu-gcc aarch64-linux-gnu-g++ qemu-aarch64; do
    command -v "$tool" > /dev/null || { echo "error: $tool not found (apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user)" >&2; exit 1; }
done
SRC=$("$ROOT/scripts/llama_tree.sh" "$SIDE")
build="$SRC/build-aarch64-${ARCH//+/-}"
mkdir -p "$build"
cat > "$build/toolchain.cmake" <<EOF
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
EOF
# as scripts/build_llama_cpp.sh builds for ARM: llamafile off
cmake -S "$SRC/vendor/llama.cpp" -B "$build" -DCMAKE_TOOLCHAIN_FILE="$build/toolchain.cmake" \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="$ARCH" \
    -DGGML_LLAMAFILE=OFF > "$build/configure.log" 2>&1 || { cat "$build/configure.log" >&2; exit 1; }
cmake --build "$build" -j "$(nproc)" --target llama ggml ggml-cpu > "$build/build.log" 2>&1 || { tail -30 "$build/build.log" >&2; exit 1; }
exe="$build/mulmat_window_check"
aarch64-linux-gnu-gcc -O2 -o "$exe" "$ROOT/tests/llama/mulmat_window_check.c" -I"$SRC/vendor/llama.cpp/ggml/include" \
    -L"$build/bin" -Wl,-rpath,"$build/bin" -lggml -lggml-cpu -lggml-base -lm
status=0
for t in f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl q2_K q3_K q4_K q5_K q6_K; do
    for threads in 1 2; do
        out=$(qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu "$exe" "$t" "$threads" 1024 128) || status=1
        printf '%s\n' "$out" | head -3
    done
done
if [ -x "$ROOT/.venv/bin/python" ]; then
    # the model in each weight type, written and cached as the tests write theirs (tests/conftest.py)
    if ! models=$("$ROOT/.venv/bin/python" - "$ROOT/tests" 2> "$build/models.log" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
from conftest import MODEL_CACHE, requantize
from tinymodels import make_tiny_llama
f32 = MODEL_CACHE / "tiny512-F32.gguf"
if not f32.exists():
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    make_tiny_llama(f32, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, n_layer=2, seed=3, block_scale=0.05)
for t in ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K"):
    requantize(f32, f"tiny512-{t}.gguf", f"LLAMA_FTYPE_MOSTLY_{t}")
print(MODEL_CACHE)
PY
    ); then
        tail -20 "$build/models.log" >&2
        exit 1
    fi
    mexe="$build/model_window_check"
    aarch64-linux-gnu-gcc -O2 -o "$mexe" "$ROOT/tests/llama/model_window_check.c" -I"$SRC/vendor/llama.cpp/include" \
        -I"$SRC/vendor/llama.cpp/ggml/include" -L"$build/bin" -Wl,-rpath,"$build/bin" -lllama -lggml -lggml-base -lm
    for t in F16 Q8_0 Q4_0 Q4_1 Q4_K_M Q5_K_M Q6_K; do
        out=$(qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu "$mexe" "$models/tiny512-$t.gguf" 2) || status=1
        printf '%s: %s\n' "$t" "$out" | head -4
    done
else
    echo "(no .venv: the model-level check needs 'make install' to write its models)"
fi
exit $status

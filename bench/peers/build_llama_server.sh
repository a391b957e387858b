#!/usr/bin/env bash
# Builds llama.cpp's server from the sources vendored in the llama-cpp-python sdist, for
# bench/engine.py's llama.cpp peer. Cached outside the repository (never a dependency of the
# project, never run by `make test`). A native build (-march=native) died with an illegal
# instruction on these VMs, so GGML_NATIVE is off and the instruction sets are the ones
# /proc/cpuinfo reports, less AMX: the Xeon VMs list amx_tile, yet ggml's AMX matmul dies on
# its first tile instruction (SIGILL at tilezero: the guest may not use the tile state).
#   bench/peers/build_llama_server.sh            # prints the server binary's path
set -euo pipefail
CACHE="${INFERSTACK_PEER_CACHE:-$HOME/.cache/inferstack/llamacpp}"
PIP="${PIP:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/pip}"  # absolute: the script cds below
BIN="$CACHE/build/bin/llama-server"
STAMP="$CACHE/build/.no-amx"  # a build from before AMX was turned off is rebuilt
if [[ -x "$BIN" && -e "$STAMP" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE"
cd "$CACHE"
ls llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
  "$PIP" download --no-binary :all: --no-deps llama-cpp-python -d . >&2
SDIST=$(ls llama_cpp_python-*.tar.gz | sort -V | tail -1)
SRC="$CACHE/src"
if [[ ! -d "$SRC" ]]; then
  mkdir -p "$SRC" && tar -xzf "$SDIST" -C "$SRC" --strip-components=1
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
AVX512=$(has avx512f)
cmake -S "$SRC/vendor/llama.cpp" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) \
  -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX512=$AVX512 \
  -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni) \
  -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DGGML_AMX_BF16=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$CACHE/build" --target llama-server -j "$(nproc)" >&2
touch "$STAMP"
echo "$BIN"

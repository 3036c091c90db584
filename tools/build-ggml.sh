#!/usr/bin/env bash
# Builds llama.cpp's ggml CPU backend and benchmarks/ggml_moe_step.cpp into build/ggml/,
# the peer of benchmarks/bench_ggml.py. ggml comes from the llama-cpp-python source
# distribution (it vendors llama.cpp) so that pip's index and mirrors are the only
# source needed. GGML_NATIVE=ON: the peer is built the way llama.cpp users build it.
# Idempotent: each stage is skipped when its output exists; delete build/ggml to redo.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/build/ggml"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-$(command -v python3)}"
JOBS="${JOBS:-$(nproc)}"

fail() { echo "build-ggml: $1 failed (log: $2)" >&2; exit 1; }
stage() { echo "build-ggml: $*"; }

mkdir -p "$OUT"
SDIST="$OUT/llama_cpp_python-$VERSION.tar.gz"
if [ -f "$SDIST" ]; then
    stage "sdist present: $SDIST"
else
    stage "downloading llama-cpp-python $VERSION source distribution"
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT" \
        >"$OUT/download.log" 2>&1 || fail "pip download" "$OUT/download.log"
fi

SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp/ggml"
if [ -f "$SRC/CMakeLists.txt" ]; then
    stage "sources unpacked: $SRC"
else
    stage "unpacking"
    tar -xzf "$SDIST" -C "$OUT" || fail "unpacking $SDIST" "(tar's output above)"
    [ -f "$SRC/CMakeLists.txt" ] || { echo "build-ggml: no vendored ggml at $SRC" >&2; exit 1; }
fi

# A tiny CMake project: ggml as a subdirectory (CPU backend only) plus our harness.
PROJ="$OUT/project"
mkdir -p "$PROJ"
cat >"$PROJ/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.14)
project(ggml_moe_step C CXX)
set(CMAKE_CXX_STANDARD 17)
set(GGML_NATIVE ON CACHE BOOL "" FORCE)
set(GGML_BLAS OFF CACHE BOOL "" FORCE)
set(GGML_CUDA OFF CACHE BOOL "" FORCE)
set(GGML_METAL OFF CACHE BOOL "" FORCE)
set(GGML_VULKAN OFF CACHE BOOL "" FORCE)
set(GGML_BACKEND_DL OFF CACHE BOOL "" FORCE)
set(GGML_BUILD_TESTS OFF CACHE BOOL "" FORCE)
set(GGML_BUILD_EXAMPLES OFF CACHE BOOL "" FORCE)
set(BUILD_SHARED_LIBS OFF CACHE BOOL "" FORCE)
add_subdirectory("$SRC" ggml)
add_executable(ggml_moe_step "$ROOT/benchmarks/ggml_moe_step.cpp")
target_link_libraries(ggml_moe_step PRIVATE ggml ggml-cpu)
CMAKE

BUILD="$OUT/cmake"
if [ -f "$BUILD/CMakeCache.txt" ]; then
    stage "configured: $BUILD"
else
    stage "configuring ggml (CPU backend, GGML_NATIVE=ON, Release)"
    cmake -S "$PROJ" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/configure.log" 2>&1 \
        || fail "cmake configure" "$OUT/configure.log"
fi

# make-style builds are incremental: a second run only relinks if the harness changed.
stage "building ggml + harness ($JOBS jobs)"
cmake --build "$BUILD" --target ggml_moe_step -j "$JOBS" >"$OUT/build.log" 2>&1 \
    || fail "build" "$OUT/build.log"
cp "$BUILD/ggml_moe_step" "$OUT/ggml_moe_step"
stage "done: $OUT/ggml_moe_step"

#!/usr/bin/env bash
# Developer build: compiles numa_moe/_native*.so into the source tree, so that
#   PYTHONPATH=.:cli python3 -m pytest tests
# runs against the working tree without reinstalling. Pass extra CMake flags after the
# script name, e.g. tools/dev-build.sh -DNUMA_MOE_SANITIZE=ON (use another build dir via BUILD_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${BUILD_DIR:-build/dev}
cmake -S . -B "$build_dir" -G Ninja -DNUMA_MOE_INPLACE=ON -DNUMA_MOE_TEST_HOOKS=ON \
  -DPython_EXECUTABLE="$(command -v python3)" \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" "$@" >/dev/null
cmake --build "$build_dir" -j 2

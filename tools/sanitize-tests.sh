#!/usr/bin/env bash
# The test suite against an AddressSanitizer + UndefinedBehaviorSanitizer build of the
# native extension:   bash tools/sanitize-tests.sh [pytest args]
# Builds into build/sanitize (a copy of the Python package beside the instrumented
# module), preloads the sanitizer runtimes into the interpreter, and fails on the first
# report. Leak checking is off: CPython and torch keep allocations alive at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=${PYTHON:-.venv/bin/python}
site=build/sanitize/site
rm -rf "$site" && mkdir -p "$site"
cp -r numa_moe cli/numa_moe_cli "$site"/
rm -f "$site"/numa_moe/_native*.so
cmake -S . -B build/sanitize/cmake -G Ninja -DCMAKE_BUILD_TYPE=Debug -DNUMA_MOE_SANITIZE=ON -DNUMA_MOE_TEST_HOOKS=ON \
  -DNUMA_MOE_OUTPUT_DIR="$PWD/$site/numa_moe" \
  -DPython_EXECUTABLE="$(command -v "$python")" \
  -Dpybind11_DIR="$("$python" -m pybind11 --cmakedir)" >/dev/null
cmake --build build/sanitize/cmake -j 2
asan=$(g++ -print-file-name=libasan.so)
ubsan=$(g++ -print-file-name=libubsan.so)
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export NUMA_MOE_SANITIZED=1
LD_PRELOAD="$asan:$ubsan" PYTHONPATH="$site" "$python" -P -m pytest -q -p no:cacheprovider \
  --ignore=tests/multinode -m "not slow" "$@" tests

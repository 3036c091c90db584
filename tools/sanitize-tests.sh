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
  -DPython_EXECUTABLE="$(realpath -s "$(command -v "$python")")" \
  -Dpybind11_DIR="$("$python" -m pybind11 --cmakedir)" >/dev/null
cmake --build build/sanitize/cmake -j 2
asan=$(g++ -print-file-name=libasan.so)
ubsan=$(g++ -print-file-name=libubsan.so)
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export NUMA_MOE_SANITIZED=1
# The .venv's editable install (a .pth file in site-packages) puts a finder for numa_moe
# ahead of sys.path, which would import the uninstrumented extension. python -S skips
# site-packages and its .pth files; the site-packages directory itself is put back by
# hand, after the instrumented copy.
purelib=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export PYTHONPATH="$PWD/$site:$purelib"
if ! "$python" -S -P -c 'import importlib.util, sys
sys.exit(not importlib.util.find_spec("numa_moe._native").origin.startswith(sys.argv[1]))' "$PWD/$site"; then
  echo "sanitize: numa_moe._native does not resolve to the instrumented build in $site" >&2
  exit 1
fi
LD_PRELOAD="$asan:$ubsan" "$python" -S -P -m pytest -q -p no:cacheprovider \
  --ignore=tests/multinode -m "not slow" "$@" tests

#!/usr/bin/env bash
# Developer build without an install: compiles numa_moe/_native*.so into the source tree,
# so that an interpreter without numa-moe installed runs the working tree directly:
#   PYTHONPATH=.:cli python3 -m pytest tests
# The .venv made by tools/setup.sh does not need this: its editable install already runs
# the working tree's Python, and `bash tools/setup.sh` rebuilds its extension after C++
# changes. Pass extra CMake flags after the script name, e.g.
# tools/dev-build.sh -DNUMA_MOE_SANITIZE=ON (use another build dir via BUILD_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
build_dir=${BUILD_DIR:-build/dev}
cmake -S . -B "$build_dir" -G Ninja -DNUMA_MOE_INPLACE=ON -DNUMA_MOE_TEST_HOOKS=ON \
  -DPython_EXECUTABLE="$(command -v "$python")" \
  -Dpybind11_DIR="$("$python" -m pybind11 --cmakedir)" "$@" >/dev/null
cmake --build "$build_dir" -j 2
# An interpreter with the editable install maps numa_moe._native to its own build, ahead
# of this one: say so rather than let a stale extension run silently.
imported=$(PYTHONPATH=.:cli "$python" -c 'import importlib.util
print(importlib.util.find_spec("numa_moe._native").origin)' 2>/dev/null || true)
if [[ -n $imported && $imported != "$PWD"/numa_moe/* ]]; then
  echo "dev-build: note: $python imports numa_moe._native from $imported, not from this" \
       "build; for that interpreter rebuild with bash tools/setup.sh" >&2
fi

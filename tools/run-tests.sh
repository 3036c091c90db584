#!/usr/bin/env bash
# Set-up (tools/setup.sh), a build of the benchmark programs, and the whole test suite:
# the single-node tiers here, the vLLM tier in its own venv (tools/run-vllm-tests.sh), the
# multinode tier on a real Linux kernel with 2, 3, 4 and 8 NUMA nodes (tools/numa-vm), then
# the AMX model's kernel tests on an emulated CPU without AVX-512 (tools/run-no-avx512.sh).
# Needs nothing outside this repository but apt and the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# The measurement programs of benchmarks/*.cpp (CMake option NUMA_MOE_BENCHMARKS), built
# once so that they keep compiling with the sources they include; they run by hand.
cmake -S . -B build/benchmarks -G Ninja -DNUMA_MOE_BENCHMARKS=ON -DPython_EXECUTABLE="$PWD/.venv/bin/python" \
  -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" >/dev/null
cmake --build build/benchmarks --target benchmarks -j 2
# -P keeps the working directory off the front of sys.path. numa_moe is the same either
# way: the editable install resolves it, from any directory, to these sources and the
# extension pip built, exactly as a user's `import numa_moe` does.
.venv/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. tests --ignore=tests/multinode "$@"
bash tools/run-vllm-tests.sh
bash tools/run-multinode.sh
bash tools/run-no-avx512.sh

#!/usr/bin/env bash
# Set-up (tools/setup.sh) and the whole test suite: the single-node tiers here, the vLLM
# tier in its own venv (tools/run-vllm-tests.sh), the multinode tier on a real Linux
# kernel with 2 and with 4 NUMA nodes (tools/numa-vm), then the AMX model's kernel tests
# on an emulated CPU without AVX-512 (tools/run-no-avx512.sh).
# Needs nothing outside this repository but apt and the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# -P keeps the working directory off the front of sys.path. numa_moe is the same either
# way: the editable install resolves it, from any directory, to these sources and the
# extension pip built, exactly as a user's `import numa_moe` does.
.venv/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. tests --ignore=tests/multinode "$@"
bash tools/run-vllm-tests.sh
bash tools/run-multinode.sh
bash tools/run-no-avx512.sh

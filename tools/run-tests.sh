#!/usr/bin/env bash
# Set-up (tools/setup.sh) and the whole test suite: the single-node tiers here, then the
# multinode tier on a real Linux kernel with 2 and with 4 NUMA nodes (numa-vm).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# Run from outside the source tree so the installed package (with its compiled
# extension) is the one imported, not the source directory.
.venv/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. tests --ignore=tests/multinode "$@"
bash tools/run-multinode.sh

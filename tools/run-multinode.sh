#!/usr/bin/env bash
# The multinode tier inside throw-away VMs with 2 and 4 NUMA nodes (../shared/tools/numa-vm).
# Correctness only: the guests are emulated, their timings mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
numa_vm=${NUMA_VM:-../shared/tools/numa-vm}
if [ ! -x "$numa_vm" ]; then
  echo "multinode: $numa_vm not found; the multinode tier needs the numa-vm tool" >&2
  exit 1
fi
for nodes in 2 4; do
  echo "== multinode tier on a ${nodes}-node VM"
  # python -P keeps the source tree (no compiled extension after `pip install .`) off sys.path.
  "$numa_vm" -n "$nodes" -c "$nodes" -m 1024 --timeout 600 -- \
    .venv/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. tests/multinode
done

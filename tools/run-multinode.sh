#!/usr/bin/env bash
# The multinode tier inside throw-away VMs with 2, 3, 4 and 8 NUMA nodes (tools/numa-vm), using
# this repository's .venv, which the guest sees read-only with the rest of the host.
# Correctness only: without KVM the guests are emulated and their timings mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  echo "multinode: .venv missing; run bash tools/setup.sh first" >&2
  exit 1
fi
# -P keeps the working directory off sys.path, as in tools/run-tests.sh. The 8 nodes are
# two sockets of four (distances 12 near, 32 far), as sub-NUMA clustering lays them out.
for layout in "2" "3" "4" "8 --sockets 2 --mem 512"; do
  read -r nodes vm_options <<<"$layout"
  echo "== multinode tier on a ${nodes}-node VM"
  # shellcheck disable=SC2086
  tools/numa-vm --nodes "$nodes" --cpus "$nodes" --mem 1024 $vm_options --timeout 900 -- \
    .venv/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. tests/multinode "$@"
done
echo "== doctor's checks on a 2-node VM with NUMA balancing on, transparent huge pages off, SMT"
tools/numa-vm --nodes 2 --cpus 4 --smt 2 --mem 1024 --thp never --append " numa_balancing=enable" --timeout 900 -- \
  .venv/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. tests/multinode/test_doctor_vm.py "$@"

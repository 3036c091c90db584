#!/usr/bin/env bash
# The multinode tier inside throw-away VMs with 2 and 4 NUMA nodes (tools/numa-vm), using
# this repository's .venv, which the guest sees read-only with the rest of the host.
# Correctness only: without KVM the guests are emulated and their timings mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  echo "multinode: .venv missing; run bash tools/setup.sh first" >&2
  exit 1
fi
for nodes in 2 4; do
  echo "== multinode tier on a ${nodes}-node VM"
  # -P keeps the working directory off sys.path, as in tools/run-tests.sh.
  tools/numa-vm --nodes "$nodes" --cpus "$nodes" --mem 1024 --timeout 900 -- \
    .venv/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. tests/multinode "$@"
done

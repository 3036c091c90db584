#!/usr/bin/env bash
# Both benchmarks on this machine, JSON into benchmarks/results/, then the tables and
# plots of docs/benchmarks.md (printed; the plots are written into docs/).
# Run on an otherwise idle machine: the figures are medians, but a busy neighbour still
# shifts them.
set -euo pipefail
cd "$(dirname "$0")/.."
# The installed package (tools/setup.sh) when there is one, else the developer build
# (tools/dev-build.sh) from the source tree.
if [ -x .venv/bin/numa-moe ]; then
  numa_moe=(.venv/bin/numa-moe); python=(.venv/bin/python -P)
else
  export PYTHONPATH=.:cli
  numa_moe=(python3 -m numa_moe_cli.main); python=(python3)
fi
mkdir -p benchmarks/results
"${numa_moe[@]}" bench kernels --repeats 20 --json benchmarks/results/kernels.json
"${numa_moe[@]}" bench kernels --repeats 20 --page 4k --json benchmarks/results/kernels-4k.json
"${numa_moe[@]}" bench layer --repeats 20 --json benchmarks/results/layer.json
"${python[@]}" benchmarks/report.py --kernels benchmarks/results/kernels.json --layer benchmarks/results/layer.json \
  --kernels-4k benchmarks/results/kernels-4k.json --out docs

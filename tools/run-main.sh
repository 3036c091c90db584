#!/usr/bin/env bash
# Set-up (tools/setup.sh) and the main job. Until the MoE layer lands this shows the
# topology and the segment table of a Mixtral-8x7B down projection.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/numa-moe topo
.venv/bin/numa-moe table --rows 4096 --cols 14336 --dtype bf16 --nodes 2 --page 4k

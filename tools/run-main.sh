#!/usr/bin/env bash
# Set-up (tools/setup.sh) and the main job: a NUMA-partitioned MoE FFN over the embedded
# default checkpoint (Qwen3-30B-A3B expert shapes, generated on first use into
# ~/.cache/numa-moe), in BF16 and in INT8 (quantized while loading), their steps side by
# side at the end. The second run splits the same machine into 2 virtual nodes, so the
# partitioned path (per-node segments + cross-node reduction) runs on a one-node host too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/numa-moe topo
.venv/bin/numa-moe run --tokens 1 --steps 20 --format bf16 --format int8 "$@"
.venv/bin/numa-moe run --tokens 16 --steps 10 --virtual-nodes 2 "$@"

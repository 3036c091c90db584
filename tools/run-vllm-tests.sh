#!/usr/bin/env bash
# The vLLM tier (tests/vllm_tier): sets up .venv-vllm (tools/setup-vllm.sh) and runs the tier
# in it. Tiny generated models, a few tokens, 1 GiB of KV cache; about 4 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-vllm.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
.venv-vllm/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. tests/vllm_tier "$@"

#!/usr/bin/env bash
# The kernel tests of the AMX software model on a CPU without AVX-512: a throw-away VM
# (tools/numa-vm) under QEMU's CPU emulation, whose `-cpu max` has AVX2 but no AVX-512, so
# that the model's AVX2 build (docs/kernels.md, "The emulated AMX build") runs where the
# development machine's CPU would hide it. Correctness only.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  echo "no-avx512: .venv missing; run bash tools/setup.sh first" >&2
  exit 1
fi
echo "== AMX model kernel tests on an emulated CPU without AVX-512"
tools/numa-vm --accel tcg --nodes 2 --cpus 2 --mem 1024 --timeout 1200 -- sh -c '
  if grep -q avx512 /proc/cpuinfo; then echo "no-avx512: the guest CPU has AVX-512" >&2; exit 1; fi
  exec .venv/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. -k amx_model "$@" \
    tests/test_kernels.py tests/test_kernels_quant.py tests/test_attention.py' sh "$@"

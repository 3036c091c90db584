#!/usr/bin/env bash
# The kernel tests of the AMX software model and of the avx512_emulated build on a CPU
# without AVX-512: a throw-away VM (tools/numa-vm) under QEMU's CPU emulation, whose
# `-cpu max` has AVX2 but no AVX-512, so that their AVX2 builds (docs/kernels.md, "The
# emulated AMX build", "The emulated AVX2 and AVX-512 builds") run where the development
# machine's CPU would hide them. Correctness only.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  echo "no-avx512: .venv missing; run bash tools/setup.sh first" >&2
  exit 1
fi
echo "== AMX model and avx512_emulated kernel tests on an emulated CPU without AVX-512"
tools/numa-vm --accel tcg --nodes 2 --cpus 2 --mem 1024 --timeout 1200 -- sh -c '
  if grep -q avx512 /proc/cpuinfo; then echo "no-avx512: the guest CPU has AVX-512" >&2; exit 1; fi
  exec .venv/bin/python -P -m pytest -q -p no:cacheprovider --rootdir=. -k "amx_model or avx512_emulated" "$@" \
    tests/test_kernels.py tests/test_kernels_quant.py tests/test_attention.py' sh "$@"

#!/usr/bin/env bash
# One-time set-up on a fresh Debian/Ubuntu machine: system packages, a virtual
# environment in .venv, the CPU build of torch, and numa-moe itself (its native
# extension is compiled by `pip install`). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=(libnuma1 numactl qemu-system-x86 busybox-static)
missing=()
for package in "${apt_packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing system packages: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch first, pinned to the CPU build: a bare `torch` requirement could resolve to a
# multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q ".[torch,test,plot,hf]"

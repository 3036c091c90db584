#!/usr/bin/env bash
# Set-up on a Debian/Ubuntu machine: system packages, a virtual environment in .venv,
# the CPU build of torch, and numa-moe itself as an editable install (its native
# extension is compiled by pip; the Python sources stay live). Safe to run again: each
# stage prints one line with its time and is skipped when it is already done, so a
# re-run on a finished install takes a second or two.
#
#   bash tools/setup.sh            set up (or bring up to date)
#   bash tools/setup.sh --digest   print the digest of numa-moe's build inputs and exit
#
# Each stage's full output goes to build/setup/<stage>.log; on failure its tail is shown.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly torch_version=2.13.0
readonly extras="torch,test,plot,hf"
# The venv serves the test suite too: build the test hooks (numa_moe._native.testing).
readonly test_hooks=ON
readonly apt_packages=(libnuma1 numactl qemu-system-x86 busybox-static)
readonly venv=.venv
readonly stamp=$venv/numa-moe-install.sha256
readonly log_dir=build/setup

# The digest of everything that changes what `pip install -e .` produces. The editable
# install reads numa_moe/ and cli/ Python sources in place, so their contents are not
# build inputs, but the set of module files is: the install records which modules exist.
build_inputs_digest() {
  {
    echo "extras=$extras test_hooks=$test_hooks python=$("$venv/bin/python" -c 'import sys; print(sys.version)' 2>/dev/null || true)"
    find native CMakeLists.txt pyproject.toml -type f ! -name '*.so' ! -path '*/__pycache__/*' -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum
    find numa_moe cli -name '*.py' ! -path '*/__pycache__/*' | LC_ALL=C sort
  } | sha256sum | cut -d' ' -f1
}

if [[ ${1:-} == --digest ]]; then
  build_inputs_digest
  exit 0
fi

mkdir -p "$log_dir"

# On these machines pip's configuration names local package mirrors that may be absent;
# pip then prints one harmless warning per mirror per request. They stay in the log but
# are never shown: anything else (real warnings, errors) is.
hide_mirror_noise() {
  grep -vE "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$" || true
}

seconds_since() {  # $1: an earlier $EPOCHREALTIME; prints the elapsed seconds, one decimal
  local now=${EPOCHREALTIME/./} then=${1/./}
  local tenths=$(( (now - then + 50000) / 100000 ))
  printf '%d.%d' $((tenths / 10)) $((tenths % 10))
}

# stage LOG NAME COMMAND...: runs COMMAND with its output in build/setup/LOG.log and
# prints `setup: NAME ... ok (T s)`; on failure prints the log's tail and exits.
stage() {
  local log=$log_dir/$1.log name=$2; shift 2
  local started=$EPOCHREALTIME status=0
  printf 'setup: %s ... ' "$name"
  "$@" >"$log" 2>&1 || status=$?
  if [[ $status -eq 0 ]]; then
    printf 'ok (%s s)\n' "$(seconds_since "$started")"
    # Warnings from a successful stage still matter (a deprecated option, a yanked pin).
    { grep -E '^(WARNING|DEPRECATION)' "$log" || true; } | hide_mirror_noise | sed 's/^/  /'
    return 0
  fi
  printf 'FAILED (%s s, exit %d)\n' "$(seconds_since "$started")" "$status"
  echo "---- last 60 lines of $log" >&2
  hide_mirror_noise <"$log" | tail -n 60 >&2
  echo "---- full log: $log" >&2
  exit "$status"
}

skip() {  # skip NAME WHY
  printf 'setup: %s ... already done (%s)\n' "$1" "$2"
}

# --------------------------------------------------------------------- system packages
install_system_packages() {
  local sudo_cmd=()
  [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "$@"
}
missing=()
for package in "${apt_packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  skip "system packages" "${apt_packages[*]}"
else
  stage apt "system packages" install_system_packages "${missing[@]}"
fi

# --------------------------------------------------------------------- virtual environment
if [[ -x $venv/bin/python ]]; then
  skip "virtual environment" "$venv"
else
  stage venv "virtual environment" python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)

# --------------------------------------------------------------------- torch
# Pinned and installed first, on its own: a bare `torch` requirement could resolve to a
# multi-GB CUDA build. The installed version is read from the package metadata, which is
# instant; `import torch` would cost seconds on every re-run.
installed_version() {  # $1: distribution name; prints its version without a +local part
  "$venv/bin/python" - "$1" <<'EOF' 2>/dev/null
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]).split("+")[0])
except metadata.PackageNotFoundError:
    pass
EOF
}
if [[ $(installed_version torch) == "$torch_version" ]]; then
  skip "torch $torch_version" "installed"
else
  stage torch "torch $torch_version" "${pip[@]}" install "torch==$torch_version"
fi

# --------------------------------------------------------------------- numa-moe
# Editable: `import numa_moe` then resolves to these sources and the extension pip built,
# from any working directory, the repository root included. The stamp records the digest
# of the build inputs at the last successful install; it lives in the venv so that a new
# venv always installs.
digest=$(build_inputs_digest)
if [[ -n $(installed_version numa-moe) && -f $stamp && $(<"$stamp") == "$digest" ]]; then
  skip "numa-moe (editable install, compiles the native extension)" "build inputs unchanged"
else
  rm -f "$stamp"
  stage numa-moe "numa-moe (editable install, compiles the native extension)" env NUMA_MOE_TEST_HOOKS=$test_hooks "${pip[@]}" install -e ".[$extras]"
  echo "$digest" >"$stamp"
fi

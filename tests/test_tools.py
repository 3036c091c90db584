"""The README commands and the scripts behind them: self-contained, and doing what the
docs say (set-up's skip digest, the VM runner's interface, importing from the root)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"

# Written split so that this file does not match itself.
OUTSIDE_PATHS = ("../" + "shared", "/work/" + "shared")


def _shipped_files() -> list[Path]:
    """Files a clone has: git's list when this is a checkout, else a walk of the tree."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                                capture_output=True).stdout.decode().split("\0")
        return [ROOT / name for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "__pycache__", ".hypothesis"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]


def _readme_python_block() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", readme, re.S)
    assert match, "README has no python example"
    return match.group(1)


def test_nothing_refers_outside_the_repository():
    offenders = []
    for path in _shipped_files():
        if path.suffix in {".png", ".so"} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{path.relative_to(ROOT)}: {p}" for p in OUTSIDE_PATHS if p in text]
    assert offenders == []


def test_readme_and_ci_run_the_same_test_command():
    assert "bash tools/run-tests.sh" in (ROOT / "README.md").read_text()
    assert "bash tools/run-tests.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("script", ["tools/run-tests.sh", "tools/run-main.sh",
                                    "tools/run-multinode.sh", "tools/run-no-avx512.sh",
                                    "tools/setup.sh", ".ci/run"])
def test_scripts_parse_and_name_only_existing_tools(script):
    path = ROOT / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    for named in re.findall(r"\btools/[\w-]+(?:\.[\w-]+)*", path.read_text()):
        assert (ROOT / named).is_file(), f"{script} runs {named}, which does not exist"


def test_vm_runner_help_and_errors():
    runner = ROOT / "tools" / "numa-vm"
    assert os.access(runner, os.X_OK)
    subprocess.run(["bash", "-n", str(runner)], check=True)
    shown = subprocess.run([str(runner), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0
    for option in ("--nodes", "--cpus", "--mem", "--timeout", "NUMA_MOE_VM_CACHE"):
        assert option in shown.stdout
    # Argument errors are reported before anything is started or downloaded.
    bad = subprocess.run([str(runner), "--nodes", "two", "--", "true"], capture_output=True, text=True)
    assert bad.returncode == 125 and "--nodes needs a positive integer" in bad.stderr
    unknown = subprocess.run([str(runner), "--no-such-option"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown option" in unknown.stderr


def test_vm_runner_says_what_is_missing(tmp_path):
    # A PATH with bash and the basic tools but no qemu-system-x86_64.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "realpath", "mktemp", "rm", "mkdir"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    env = dict(os.environ, PATH=str(bin_dir))
    result = subprocess.run([str(bin_dir / "bash"), str(ROOT / "tools" / "numa-vm"), "--", "true"],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 125
    assert "qemu-system-x86_64 not found" in result.stderr and "apt-get install qemu-system-x86" in result.stderr


def _digest(tree: Path) -> str:
    out = subprocess.run(["bash", "tools/setup.sh", "--digest"], cwd=tree, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", out)
    return out


def test_setup_reinstalls_exactly_when_build_inputs_change(tmp_path):
    """setup.sh skips the numa-moe install while this digest equals the stamped one."""
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "setup.sh", tmp_path / "tools" / "setup.sh")
    for name, text in {"native/kernels/k.cpp": "int k;\n", "CMakeLists.txt": "project(x)\n",
                       "pyproject.toml": "[project]\n", "numa_moe/__init__.py": "",
                       "numa_moe/moe.py": "x = 1\n", "cli/numa_moe_cli/main.py": ""}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    first = _digest(tmp_path)
    assert _digest(tmp_path) == first

    # Editable install: Python edits are live, build leftovers are not inputs.
    (tmp_path / "numa_moe/moe.py").write_text("x = 2\n")
    (tmp_path / "native/kernels/__pycache__").mkdir()
    (tmp_path / "native/kernels/__pycache__/junk.pyc").write_text("junk")
    (tmp_path / "numa_moe/_native.cpython-311-x86_64-linux-gnu.so").write_text("so")
    assert _digest(tmp_path) == first

    changes = [
        lambda: (tmp_path / "native/kernels/k.cpp").write_text("int k2;\n"),
        lambda: (tmp_path / "native/kernels/new.h").write_text("\n"),
        lambda: (tmp_path / "CMakeLists.txt").write_text("project(y)\n"),
        lambda: (tmp_path / "pyproject.toml").write_text("[project]\nname = 'y'\n"),
        lambda: (tmp_path / "numa_moe/new_module.py").write_text(""),  # the install lists modules
        lambda: (tmp_path / "cli/numa_moe_cli/main.py").rename(tmp_path / "cli/numa_moe_cli/cli.py"),
    ]
    seen = {first}
    for change in changes:
        change()
        now = _digest(tmp_path)
        assert now not in seen
        seen.add(now)


@pytest.mark.skipif(not VENV_PYTHON.exists(), reason="needs the .venv made by tools/setup.sh")
def test_readme_imports_work_from_the_repository_root():
    """README's Python example, its imports, run the way the README says: venv
    activated, in the repository root, where the source directory `numa_moe/` is the
    first thing on sys.path."""
    imports = [line for line in _readme_python_block().splitlines()
               if re.match(r"(from|import) ", line)]
    assert any("from numa_moe import MoELayer" in line for line in imports)
    check = "\n".join(imports + [
        "import numa_moe, numa_moe._native",
        "print(numa_moe.__file__)",
    ])
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONSAFEPATH"}}
    result = subprocess.run([str(VENV_PYTHON), "-c", check], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == ROOT / "numa_moe" / "__init__.py"


@pytest.mark.skipif(not VENV_PYTHON.exists(), reason="needs the .venv made by tools/setup.sh")
def test_cli_runs_from_the_repository_root():
    result = subprocess.run([str(ROOT / ".venv" / "bin" / "numa-moe"), "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "topo" in result.stdout

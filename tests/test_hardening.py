"""Hostile inputs at the file and CLI edges (issue 12): nothing of the user's is deleted,
no input exhausts the machine or hangs, and every refusal is a one-line error.

Everything that could allocate without bound or block forever on the code before the fix
runs in a subprocess under an address-space limit and a timeout, so a regression fails
the test instead of taking the machine down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from numa_moe.checkpoints.safetensors import read_safetensors_header
from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.files import CheckpointError
from numa_moe.checkpoints.synthetic import make_checkpoint
from numa_moe_cli.main import cli

# Address space a checker subprocess may use: imports need ~150 MB; the inputs below
# made the old code allocate tens of GB.
LIMIT_AS = 2 << 30
TIMEOUT = 60
_ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH="")

# Runs the CLI (argv) or a snippet under RLIMIT_AS; the exit status and output come back.
# Under AddressSanitizer (tools/sanitize-tests.sh) the limit is left out: ASan's shadow
# memory cannot live under one, and the code under test bounds its allocations anyway.
# SIGINT raises KeyboardInterrupt in the child as in a terminal, even when the suite was
# started with SIGINT ignored (a background job), which the child would inherit.
_PRELUDE = textwrap.dedent(f"""
    import os, resource, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("NUMA_MOE_SANITIZED") != "1":
        resource.setrlimit(resource.RLIMIT_AS, ({LIMIT_AS}, {LIMIT_AS}))
""")


def _limited(code: str, *args: str, cwd=None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", _PRELUDE + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=_ENV)


def _cli(*args: str, cwd=None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return _limited("from numa_moe_cli.main import cli\ncli(sys.argv[1:], prog_name='numa-moe')",
                    *map(str, args), cwd=cwd, timeout=timeout)


def _load(path) -> subprocess.CompletedProcess:
    """ExpertStore.load in a limited subprocess; prints the error type and message."""
    return _limited("""
        from numa_moe.files import CheckpointError
        from numa_moe.layer.store import ExpertStore
        try:
            ExpertStore.load(sys.argv[1], nodes=1, progress=False)
        except CheckpointError as err:
            print("CheckpointError:", err)
            sys.exit(3)
        """, str(path))


def _one_line_error(result, *needles: str, status=(1,)) -> None:
    """Exit 1 (or 2) with one 'Error: ...' line naming the problem, no traceback."""
    assert result.returncode in status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def _write_raw(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def _small(directory: Path) -> Path:
    return make_checkpoint(directory, "qwen3-30b-a3b", 1, 1, 0, hidden_size=64,
                           intermediate_size=32, progress=False)


# --------------------------------------------------------------------------- data loss

def test_make_checkpoint_keeps_files_it_did_not_write(tmp_path):
    ck = _small(tmp_path / "src")
    d = tmp_path / "d"
    d.mkdir()
    mine = d / "my-finetune.safetensors"
    mine.write_bytes((ck / "model.safetensors").read_bytes())
    result = CliRunner().invoke(cli, ["make-checkpoint", "--layers", "1", "--experts", "1", "-o", str(d),
                                      "--quiet"])
    assert result.exit_code == 1 and "my-finetune.safetensors" in result.output, result.output
    assert "--overwrite" in result.output
    assert mine.read_bytes() == (ck / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "src"]  # no temporary left
    # --overwrite does not make a directory of the user's replaceable either.
    result = CliRunner().invoke(cli, ["make-checkpoint", "--layers", "1", "--experts", "1", "-o", str(d),
                                      "--quiet", "--overwrite"])
    assert result.exit_code == 1 and "my-finetune.safetensors" in result.output, result.output
    assert mine.read_bytes() == (ck / "model.safetensors").read_bytes()
    mine.unlink()
    result = CliRunner().invoke(cli, ["make-checkpoint", "--layers", "1", "--experts", "1", "-o", str(d),
                                      "--quiet"])
    assert result.exit_code == 0 and open_checkpoint(d).dims.n_experts == 1, result.output
    # A previous output is replaced without --overwrite; so is an empty directory.
    result = CliRunner().invoke(cli, ["make-checkpoint", "--layers", "1", "--experts", "2", "-o", str(d),
                                      "--quiet"])
    assert result.exit_code == 0 and open_checkpoint(d).dims.n_experts == 2, result.output
    # A config.json that make-checkpoint did not write makes the directory not its own.
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not an earlier numa-moe output"):
        make_checkpoint(other, "qwen3-30b-a3b", 1, 1, progress=False)
    assert (other / "config.json").read_text() == "{}"


def _tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_interrupted_make_checkpoint_leaves_the_old_checkpoint_whole(tmp_path, monkeypatch):
    from numa_moe.checkpoints import synthetic

    d = _small(tmp_path / "d")
    before = _tree(d)
    calls = []

    def interrupted(plan, rng):
        calls.append(plan.name)
        if len(calls) > 3:
            raise KeyboardInterrupt
        yield from original(plan, rng)

    original = synthetic._random_bytes
    monkeypatch.setattr(synthetic, "_random_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_checkpoint(d, "qwen3-30b-a3b", 1, 4, 1, hidden_size=64, intermediate_size=32,
                        max_shard_bytes=20_000, progress=False)
    assert _tree(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


_SIGNAL_SELF = """
    import os, signal
    from numa_moe.checkpoints import synthetic
    original = synthetic._random_bytes
    calls = []
    def _bytes(plan, rng):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.{signal})
        yield from original(plan, rng)
    synthetic._random_bytes = _bytes
    from numa_moe_cli.main import cli
    cli(sys.argv[1:], prog_name="numa-moe")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_make_checkpoint_signalled_leaves_no_temporary(tmp_path, sig):
    d = _small(tmp_path / "d")
    before = _tree(d)
    result = _limited(_SIGNAL_SELF.format(signal=sig), "make-checkpoint", "--layers", "2",
                      "--experts", "4", "--shard-mb", "1", "-o", str(d), "--quiet")
    assert result.returncode != 0, result.stdout
    assert _tree(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"], list(tmp_path.iterdir())


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_tables_signalled_while_writing_leaves_no_temporary(tmp_path, sig):
    d = _small(tmp_path / "d")
    out = tmp_path / "out"
    out.mkdir()
    (out / "t.json").write_text("old")
    code = f"""
        import os, signal
        real_fsync = os.fsync
        def fsync(fd):
            os.kill(os.getpid(), signal.{sig})
            real_fsync(fd)
        os.fsync = fsync
        from numa_moe_cli.main import cli
        cli(sys.argv[1:], prog_name="numa-moe")
    """
    result = _limited(code, "tables", str(d), "-o", str(out / "t.json"), "--quiet")
    assert result.returncode != 0
    assert sorted(p.name for p in out.iterdir()) == ["t.json"]
    assert (out / "t.json").read_text() == "old"


# ----------------------------------------------------------------- unbounded memory

def _tiny_expert_dir(directory: Path, names_shapes, config=None) -> Path:
    """One safetensors file holding the given BF16 tensors (bytes 1), plus config.json."""
    directory.mkdir()
    header, offset = {}, 0
    for name, shape in names_shapes:
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    _write_raw(directory / "model.safetensors", header, b"\x01" * offset)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


_EXPERT = "model.layers.0.mlp.experts.{e}.{kind}_proj.weight"


def _one_expert(e: int = 0):
    return [(_EXPERT.format(e=e, kind=k), s) for k, s in (("gate", (2, 4)), ("up", (2, 4)), ("down", (4, 2)))]


@pytest.mark.parametrize("case", ["config_num_experts", "expert_id", "fused_zero_bytes"])
def test_tiny_checkpoint_cannot_exhaust_memory(tmp_path, case):
    if case == "config_num_experts":
        d = _tiny_expert_dir(tmp_path / "ck", _one_expert(), {"num_experts": 10**12})
        needle = "missing for expert(s) 1-999999999999"
    elif case == "expert_id":
        d = _tiny_expert_dir(tmp_path / "ck", _one_expert(999999999999))
        needle = "missing for expert(s) 0-999999999998"
    else:
        d = tmp_path / "ck"
        d.mkdir()
        _write_raw(d / "model.safetensors", {
            "model.layers.0.mlp.experts.gate_up_proj": {"dtype": "BF16", "shape": [2**40, 0, 64],
                                                        "data_offsets": [0, 0]},
            "model.layers.0.mlp.experts.down_proj": {"dtype": "BF16", "shape": [2**40, 64, 0],
                                                     "data_offsets": [0, 0]}})
        needle = "at least one element"
    assert (d / "model.safetensors").stat().st_size < 1000
    for command in (["inspect", d], ["tables", d, "-o", tmp_path / "t.json", "--quiet"]):
        _one_line_error(_cli(*command), needle)
    result = _load(d)
    assert result.returncode == 3 and needle in result.stdout, (result.stdout, result.stderr)


@pytest.mark.parametrize("args,needle", [
    (["table", "--rows", str(10**15), "--cols", str(10**15), "--nodes", "2"], "more than the"),
    (["table", "--rows", "4", "--cols", "8", "--nodes", str(10**9)], "at most 1024"),
    (["table", "--rows", "4", "--cols", "8", "--nodes", "1025"], "at most 1024"),
])
def test_table_sizes_are_bounded(args, needle):
    _one_line_error(_cli(*args), needle, status=(1, 2))


def test_table_of_many_rows_costs_one_period():
    # Allowed, and cheap: the work is bounded by the period, not by the rows.
    result = _cli("table", "--rows", str(10**15), "--cols", "4096", "--nodes", "2", "--json")
    assert result.returncode == 0, result.stderr
    weights = json.loads(result.stdout)["weights"]
    assert weights["table"]["rows"] == 10**15 and weights["balance"] == 1.0


@pytest.mark.parametrize("nodes", [str(10**8), "0,5000", "0,99999999999999"])
def test_tables_nodes_are_bounded(tmp_path, nodes):
    d = _small(tmp_path / "d")
    _one_line_error(_cli("tables", d, "--nodes", nodes, "-o", tmp_path / "t.json", "--quiet"),
                    "--nodes", "1024", status=(2,))
    assert not (tmp_path / "t.json").exists()


# ----------------------------------------------------------------------------- hangs

def test_fifos_are_refused_not_opened(tmp_path):
    d = _small(tmp_path / "d")
    for name in ("model.safetensors", "config.json"):
        fifo_dir = tmp_path / f"fifo-{name}"
        fifo_dir.mkdir()
        for p in d.iterdir():
            if p.name != name:
                (fifo_dir / p.name).write_bytes(p.read_bytes())
        os.mkfifo(fifo_dir / name)
        needle = f"{name}: is a FIFO"
        _one_line_error(_cli("inspect", fifo_dir, timeout=30), needle)
        _one_line_error(_cli("tables", fifo_dir, "-o", tmp_path / "t.json", "--quiet", timeout=30), needle)
        result = _load(fifo_dir)
        assert result.returncode == 3 and needle in result.stdout, (result.stdout, result.stderr)
    # Named directly, and as an index.
    os.mkfifo(tmp_path / "direct.safetensors")
    _one_line_error(_cli("inspect", tmp_path / "direct.safetensors", timeout=30), "is a FIFO")
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    os.mkfifo(index_dir / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match="index.json: is a FIFO"):
        open_checkpoint(index_dir)


# ------------------------------------------------------------------ integer overflow

@pytest.mark.parametrize("shape,data", [([2**62 + 1, 4], 8), ([2**64, 1], 2), ([2**63, 2**63], 0),
                                        ([2**31, 2**31, 2**2], 0)])
def test_header_shape_products_are_exact(tmp_path, shape, data):
    path = _write_raw(tmp_path / "m.safetensors",
                      {"t": {"dtype": "F16", "shape": shape, "data_offsets": [0, data]}}, b"\0" * data)
    with pytest.raises(CheckpointError, match=r"t'.*hold %d bytes but shape" % data):
        read_safetensors_header(path)


# --------------------------------------------------- one-line errors, not tracebacks

def test_deeply_nested_json_is_a_checkpoint_error(tmp_path):
    deep = b"[" * 200_000 + b"]" * 200_000
    _write_raw(tmp_path / "m.safetensors", b'{"a": ' + deep + b"}")
    with pytest.raises(CheckpointError, match="nested too deeply"):
        read_safetensors_header(tmp_path / "m.safetensors")
    d = _small(tmp_path / "d")
    (d / "config.json").write_bytes(deep)
    with pytest.raises(CheckpointError, match="config.json: config.json is nested too deeply"):
        open_checkpoint(d)
    _one_line_error(_cli("inspect", tmp_path / "m.safetensors"), "nested too deeply")


@pytest.mark.parametrize("value", [7, None, ["model.safetensors"], {"a": 1}, ""])
def test_index_weight_map_values_must_be_file_names(tmp_path, value):
    d = _small(tmp_path / "d")
    names = list(read_safetensors_header(d / "model.safetensors")[0])
    weight_map = {name: "model.safetensors" for name in names}
    weight_map[names[-1]] = value
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"weight_map\[.*\] is .*a shard file name"):
        open_checkpoint(d)
    _one_line_error(_cli("inspect", d), "weight_map")


def test_inspect_invalid_regex_is_a_message(tmp_path):
    d = _small(tmp_path / "d")
    result = CliRunner().invoke(cli, ["inspect", str(d), "--tensor", "("])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.output
    assert "'(' is not a valid regex" in result.output


@pytest.mark.parametrize("pattern,needle", [
    (r"(?P<layer>\d+)?.*\.experts\.(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight",
     "'layer' group took no part"),
    (r".*layers\.(?P<layer>\d+)\.mlp\.experts\.(?:0|(?P<expert>\d+))\.(?P<kind>gate_proj|up_proj|down_proj)\.weight",
     "'expert' group took no part"),
    (r"model\.(?P<layer>\w+)\.0\.mlp\.experts\.(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight",
     "layer 'layers'"),
])
def test_pattern_groups_that_do_not_give_a_number_are_messages(tmp_path, pattern, needle):
    d = _small(tmp_path / "d")
    result = CliRunner().invoke(cli, ["inspect", str(d), "--pattern", pattern,
                                      "--kinds", "gate_proj=gate,up_proj=up,down_proj=down"])
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1 and needle in result.output, result.output


def test_unwritable_outputs_are_one_line_errors(tmp_path):
    d = _small(tmp_path / "d")
    (tmp_path / "some-file").write_text("x")
    for target, needle in (("/proc/x.json", "/proc/x.json"),
                           (tmp_path / "some-file" / "x.json", "is not a directory"),
                           ("/dev/stdout", "/dev/stdout"),
                           (tmp_path, "is a directory")):
        _one_line_error(_cli("tables", d, "-o", target, "--quiet"), "-o", needle, status=(1, 2))
    assert (tmp_path / "some-file").read_text() == "x"
    _one_line_error(_cli("inspect", d, "--plot", "/dev/null"), "--plot", "character device")


def test_run_checks_its_json_path_before_the_job(tmp_path):
    d = _small(tmp_path / "d")
    result = _cli("run", d, "--steps", "1", "--json", tmp_path / "missing" / "r.json", timeout=120)
    _one_line_error(result, "--json", "does not exist")
    assert "step" not in result.stdout  # refused before the job ran
    result = _cli("run", d, "--steps", "1", "--json", tmp_path / "r.json", timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(json.loads((tmp_path / "r.json").read_text())["steps_ms"]) == 1


def test_run_into_a_closed_pipe_ends_quietly(tmp_path):
    d = _small(tmp_path / "d")
    process = subprocess.Popen(
        [sys.executable, "-P", "-c", "from numa_moe_cli.main import cli; cli(prog_name='numa-moe')",
         "run", str(d), "--steps", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_ENV)
    process.stdout.readline()
    process.stdout.close()  # what `| head -1` does
    _, err = process.communicate(timeout=120)
    assert process.returncode in (0, 1)
    assert b"Broken pipe" not in err and b"Traceback" not in err and b"Error" not in err, err


# ---------------------------------------------------------------------- consistency

def test_symlinks_out_of_the_directory_are_followed_in_both_modes(tmp_path):
    d = _small(tmp_path / "d")
    expected = open_checkpoint(d).summary()
    outside = tmp_path / "outside.safetensors"
    (d / "model.safetensors").rename(outside)
    (d / "model.safetensors").symlink_to(outside)
    assert open_checkpoint(d).dims.n_experts == expected["n_experts"]
    names = list(read_safetensors_header(outside)[0])
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "model.safetensors" for name in names}}))
    assert open_checkpoint(d).dims.n_experts == expected["n_experts"]
    # What the link names must be a regular file, wherever it is.
    outside.unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: is a symlink to .*outside"
                                              r".*does not exist \(a dangling link\)"):
        open_checkpoint(d)


def test_dev_zero_says_what_it_is(tmp_path):
    d = tmp_path / "z"
    d.mkdir()
    (d / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"symlink to '/dev/zero', which is a character device"):
        open_checkpoint(d)
    with pytest.raises(CheckpointError, match="/dev/zero: is a character device, not a regular file"):
        open_checkpoint("/dev/zero")
    _one_line_error(_cli("inspect", "/dev/zero"), "character device")


def test_tables_says_it_created_folders(tmp_path):
    d = _small(tmp_path / "d")
    target = tmp_path / "new" / "sub" / "t.json"
    result = _cli("tables", d, "-o", target, "--quiet")
    assert result.returncode == 0, result.stderr
    assert f"created folder {target.parent}" in result.stderr and target.exists()


def test_layer_numbers_too_long_for_an_int_are_messages(tmp_path):
    d = _tiny_expert_dir(tmp_path / "ck", _one_expert() + [
        ("model.layers." + "7" * 5000 + ".mlp.gate.weight", (1, 4)),
        ("model.layers." + "7" * 5000 + ".mlp.experts.0.gate_proj.weight", (2, 4))])
    with pytest.raises(CheckpointError, match="not a non-negative integer below 10"):
        open_checkpoint(d)


def test_index_found_in_a_directory_may_link_out_of_it(tmp_path):
    d = _small(tmp_path / "d")
    names = list(read_safetensors_header(d / "model.safetensors")[0])
    outside = tmp_path / "index.json"
    outside.write_text(json.dumps({"weight_map": {name: "model.safetensors" for name in names}}))
    (d / "model.safetensors.index.json").symlink_to(outside)
    assert open_checkpoint(d).files == (d / "model.safetensors",)


def test_make_checkpoint_through_a_symlink_keeps_the_link(tmp_path):
    real = _small(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    make_checkpoint(link, "qwen3-30b-a3b", 1, 2, 0, hidden_size=64, intermediate_size=32,
                    progress=False)
    assert link.is_symlink() and open_checkpoint(link).dims.n_experts == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]

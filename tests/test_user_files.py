"""Files as users keep and hand them over (issue 34): Hugging Face cache snapshots and
repo ids, outputs that must not destroy their sources, small files that claim huge
contents, and special files given to options.

Whatever could hang or allocate without bound on the code before the fix runs in a
subprocess under an address-space limit and a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import safetensors

from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.files import CheckpointError
from numa_moe.formats import KINDS
from numa_moe.checkpoints.synthetic import make_checkpoint

LIMIT_AS = 2 << 30
TIMEOUT = 60
H, I, E = 64, 32, 4
_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def run_limited(code: str, *args, env: dict | None = None, timeout: float = TIMEOUT):
    """``code`` in a fresh interpreter under RLIMIT_AS and a timeout (no address-space
    limit under AddressSanitizer, whose shadow memory cannot live under one)."""
    prelude = textwrap.dedent(f"""
        import os, resource, sys
        if os.environ.get("NUMA_MOE_SANITIZED") != "1":
            resource.setrlimit(resource.RLIMIT_AS, ({LIMIT_AS}, {LIMIT_AS}))
    """)
    full_env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH="",
                    **(env or {}))
    return subprocess.run([sys.executable, "-P", "-c", prelude + textwrap.dedent(code),
                           *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def cli(*args, env: dict | None = None, timeout: float = TIMEOUT):
    return run_limited("from numa_moe_cli.main import cli\ncli(sys.argv[1:], prog_name='numa-moe')",
                       *args, env=env, timeout=timeout)


def one_line_error(result, *needles: str) -> str:
    """Exit 1 with one 'Error: ...' line holding every needle, no traceback."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def _original(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors.deserialize(path.read_bytes()):
            out[name] = np.frombuffer(bytes(entry["data"]), dtype=np.uint16).reshape(entry["shape"])
    return out


@pytest.fixture
def source(tmp_path, rng):
    """A small sharded checkpoint (index + 2 shards + config.json)."""
    return make_checkpoint(tmp_path / "src", "qwen3-30b-a3b", 1, E, int(rng.integers(1 << 31)),
                           hidden_size=H, intermediate_size=I, progress=False,
                           max_shard_bytes=30_000)


# ------------------------------------------------------------- Hugging Face cache

def hub_cache(root: Path, repo_id: str, checkpoint: Path, revision: str = "0123abcd") -> Path:
    """A Hugging Face hub cache as the hub's tools lay it out: the files in
    ``blobs/<sha256>``, ``snapshots/<revision>/<name>`` relative links to them,
    ``refs/main`` naming the revision. Returns the snapshot directory."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for path in sorted(checkpoint.iterdir()):
        data = path.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


def test_checkpoint_in_a_hub_cache_loads_by_snapshot_path_and_by_repo_id(source, tmp_path,
                                                                         monkeypatch):
    import huggingface_hub.constants

    from numa_moe.layer.store import ExpertStore

    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "Org/Tiny-MoE", source)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    original = _original(source)
    for given in (snapshot, "Org/Tiny-MoE"):
        ck = open_checkpoint(given)
        assert (ck.dims.hidden_size, ck.dims.intermediate_size, ck.dims.n_experts) == (H, I, E)
        assert ck.root == snapshot and len(ck.files) == 2
        store = ExpertStore.load(given, nodes=1, progress=False)
        for kind in KINDS:
            stacked = np.concatenate([original[f"model.layers.0.mlp.experts.{e}.{_NAMES[kind]}.weight"]
                                      for e in range(E)])
            np.testing.assert_array_equal(store.weights(0, kind).view(np.uint16), stacked)


def test_cli_finds_a_repo_id_through_hf_hub_cache(source, tmp_path):
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "Org/Tiny-MoE", source)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    by_id = cli("inspect", "Org/Tiny-MoE", "--json", "--nodes", "1", "--touch", "none", env=env)
    assert by_id.returncode == 0, by_id.stderr
    report = json.loads(by_id.stdout)
    by_path = cli("inspect", snapshot, "--json", "--nodes", "1", "--touch", "none", env=env)
    assert by_path.returncode == 0, by_path.stderr
    assert report == json.loads(by_path.stdout)
    assert str(snapshot) in by_id.stdout
    tables = cli("tables", "Org/Tiny-MoE", "--nodes", "2", "-o", tmp_path / "t.json", "--quiet",
                 env=env)
    assert tables.returncode == 0, tables.stderr
    assert json.loads((tmp_path / "t.json").read_text())["checkpoint"] == str(snapshot.resolve())
    quantized = cli("quantize", "Org/Tiny-MoE", "--format", "int8", "--group", "32", "-o",
                    tmp_path / "q", "--quiet", env=env)
    assert quantized.returncode == 0, quantized.stderr
    assert open_checkpoint(tmp_path / "q").quant.fmt == "int8"
    # An id with no snapshot: where it looked and how to download; no network attempt
    # (the hub's endpoint is a closed port, so any request would fail differently).
    missing = cli("tables", "Org/Absent", "-o", tmp_path / "t.json", "--quiet",
                  env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"}, timeout=30)
    one_line_error(missing, "Org/Absent", "local cache", str(cache), "hf download Org/Absent")


def test_an_existing_path_wins_over_a_repo_id(source, tmp_path, monkeypatch):
    import huggingface_hub.constants

    other = make_checkpoint(tmp_path / "other", "qwen3-30b-a3b", 1, 2, 0, hidden_size=H,
                            intermediate_size=I, progress=False)
    hub_cache(tmp_path / "hub", "Org/Tiny-MoE", source)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "Org").mkdir()
    (tmp_path / "Org" / "Tiny-MoE").symlink_to(other)
    monkeypatch.chdir(tmp_path)
    assert open_checkpoint("Org/Tiny-MoE").dims.n_experts == 2  # the local directory
    (tmp_path / "Org" / "Tiny-MoE").unlink()
    assert open_checkpoint("Org/Tiny-MoE").dims.n_experts == E  # the cached snapshot


def test_links_that_are_not_regular_files_are_refused_naming_them(source, tmp_path):
    snapshot = hub_cache(tmp_path / "hub", "Org/Tiny-MoE", source)
    shard = next(p for p in sorted(snapshot.iterdir()) if p.name.endswith(".safetensors"))
    blob = shard.resolve()
    blob.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: is a symlink to '.*{blob.name}', "
                                              r"which does not exist \(a dangling link\)"):
        open_checkpoint(snapshot)
    blob.mkdir()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: is a symlink to .*which is a "
                                              "directory, not a regular file"):
        open_checkpoint(snapshot)
    blob.rmdir()
    os.mkfifo(blob)
    result = run_limited("""
        from numa_moe.files import CheckpointError
        from numa_moe.checkpoints.dispatch import open_checkpoint
        try:
            open_checkpoint(sys.argv[1])
        except CheckpointError as err:
            print(err)
    """, snapshot, timeout=30)
    assert f"{shard.name}: is a symlink to" in result.stdout
    assert "which is a FIFO (named pipe), not a regular file" in result.stdout, result


def test_quantize_copies_linked_files_of_a_snapshot(source, tmp_path):
    from numa_moe.checkpoints.quantize import quantize_checkpoint

    (source / "tokenizer.json").write_text('{"v": 1}')
    snapshot = hub_cache(tmp_path / "hub", "Org/Tiny-MoE", source)
    result = quantize_checkpoint(snapshot, tmp_path / "q", "int8", 32, progress=False)
    assert result.not_copied == ()
    out = tmp_path / "q"
    assert not any(p.is_symlink() for p in out.iterdir())
    assert (out / "tokenizer.json").read_text() == '{"v": 1}'
    assert open_checkpoint(out).quant.fmt == "int8"


# ------------------------------------------------------------------ outputs and sources

def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_quantize_into_the_parent_of_its_source_deletes_nothing(source, tmp_path):
    from click.testing import CliRunner

    from numa_moe_cli.main import cli as numa_moe

    (tmp_path / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    for out, overwrite in ((tmp_path, True), (tmp_path, False), (source, True), (source / "q", True),
                           (source / "q", False)):
        args = ["quantize", str(source), "--format", "int8", "--group", "32", "-o", str(out), "--quiet"]
        result = CliRunner().invoke(numa_moe, args + (["--overwrite"] if overwrite else []))
        assert result.exit_code == 1, result.output
        assert len(result.output.strip().splitlines()) == 1 and "source checkpoint" in result.output
        assert _tree(tmp_path) == before
    # the same through a link to the parent
    (tmp_path.parent / f"{tmp_path.name}-link").symlink_to(tmp_path)
    from numa_moe.checkpoints.quantize import quantize_checkpoint

    with pytest.raises(ValueError, match=f"lie inside {source}"):
        quantize_checkpoint(source, tmp_path.parent / f"{tmp_path.name}-link", "int8", 32,
                            overwrite=True, progress=False)
    (tmp_path.parent / f"{tmp_path.name}-link").unlink()
    assert _tree(tmp_path) == before


def test_quantize_output_may_not_contain_a_snapshots_blobs(source, tmp_path):
    from numa_moe.checkpoints.quantize import quantize_checkpoint

    snapshot = hub_cache(tmp_path / "hub", "Org/Tiny-MoE", source)
    repo = snapshot.parent.parent
    before = _tree(repo)
    with pytest.raises(ValueError, match="snapshots/0123abcd, a file or directory of the source"):
        quantize_checkpoint(snapshot, repo, "int8", 32, overwrite=True, progress=False)
    # the blobs the snapshot's links name are sources as well
    with pytest.raises(ValueError, match=r"blobs/[0-9a-f]{64}, a file or directory of the source"):
        quantize_checkpoint(snapshot, repo / "blobs", "int8", 32, overwrite=True, progress=False)
    assert _tree(repo) == before


def test_overwrite_replaces_only_an_earlier_output(source, tmp_path):
    from numa_moe.checkpoints.quantize import quantize_checkpoint

    out = tmp_path / "q"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"not an earlier numa-moe output .*mine\.txt.*with or "
                                         "without --overwrite"):
        quantize_checkpoint(source, out, "int8", 32, overwrite=True, progress=False)
    assert _tree(out) == {"mine.txt": b"mine"}
    (out / "mine.txt").unlink()
    quantize_checkpoint(source, out, "int8", 32, progress=False)
    with pytest.raises(ValueError, match="pass --overwrite to replace it"):
        quantize_checkpoint(source, out, "int4", 32, progress=False)
    quantize_checkpoint(source, out, "int4", 32, overwrite=True, progress=False)
    assert open_checkpoint(out).quant.fmt == "int4"
    # a file the user added to an earlier output makes it theirs
    (out / "README.md").write_text("my notes")
    with pytest.raises(ValueError, match="README.md"):
        quantize_checkpoint(source, out, "int8", 32, overwrite=True, progress=False)
    assert (out / "README.md").read_text() == "my notes"
    # make-checkpoint follows the same rule, --overwrite or not
    with pytest.raises(ValueError, match="README.md"):
        make_checkpoint(out, "qwen3-30b-a3b", 1, 1, hidden_size=H, intermediate_size=I,
                        progress=False, overwrite=True)
    assert (out / "README.md").read_text() == "my notes"


@pytest.mark.parametrize("command", ["tables", "inspect", "run"])
def test_file_outputs_may_not_replace_or_enter_the_checkpoint(source, tmp_path, command):
    before = _tree(source)
    shard = next(source.glob("*.safetensors"))
    for target in (shard, source / "config.json", source / "new.json"):
        if command == "tables":
            result = cli("tables", source, "-o", target, "--quiet")
        elif command == "inspect":
            result = cli("inspect", source, "--touch", "none", "--nodes", "1", "--plot", target)
        else:
            result = cli("run", source, "--json", target, "--steps", "2")
        one_line_error(result, f"cannot write", str(source))
        assert _tree(source) == before


# ------------------------------------------- small files that claim huge contents

def write_safetensors_raw(path: Path, tensors: dict, metadata: dict | None = None,
                          header_text: str | None = None) -> Path:
    """A safetensors file from ``{name: (dtype code, shape, bytes)}``, or from a header
    given as JSON text (to spell what json.dumps would not write) and no data."""
    if header_text is None:
        header, data, at = {}, b"", 0
        for name, (dtype, shape, raw) in tensors.items():
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
            data += raw
            at += len(raw)
        if metadata:
            header["__metadata__"] = metadata
        header_text = json.dumps(header)
    else:
        data = b""
    raw_header = header_text.encode()
    path.write_bytes(len(raw_header).to_bytes(8, "little") + raw_header + data)
    return path


def _gguf_header(kv_count: int, tensor_count: int = 0) -> bytes:
    import struct

    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count)


def _gguf_string(text: bytes) -> bytes:
    return len(text).to_bytes(8, "little") + text


# Opens a checkpoint in a child under run_limited and prints the seconds the open took and
# its error. The bound the tests put on those seconds is loose (5 s): the unbounded reader
# took 80-120 s on such files, so only a hang or a per-element parse exceeds it.
TIMED_OPEN = """
    import time
    from numa_moe.files import CheckpointError
    from numa_moe.checkpoints.dispatch import open_checkpoint
    start = time.perf_counter()
    try:
        open_checkpoint(sys.argv[1])
    except CheckpointError as err:
        print(f"{time.perf_counter() - start:.3f}", err)
"""


@pytest.mark.parametrize("case", ["keys", "tensors", "key length", "array length",
                                  "string length", "string array"])
def test_gguf_counts_beyond_the_file_fail_at_once(tmp_path, case):
    """A few MB that claim millions of entries: refused from the header, in well under a
    second and without the reader's per-entry objects (the address-space limit)."""
    import struct

    pad = bytes(3 << 20)
    key = _gguf_string(b"tokenizer.ggml.tokens")
    data, needles = {
        "keys": (_gguf_header(3_000_000) + pad, ["declares 3000000 metadata entries"]),
        "tensors": (_gguf_header(0, 3_000_000) + pad, ["declares 3000000 tensors"]),
        "key length": (_gguf_header(2) + struct.pack("<Q", 1 << 40) + pad,
                       ["key of metadata entry #0", f"string of {1 << 40} bytes"]),
        "array length": (_gguf_header(1) + key + struct.pack("<IIQ", 9, 4, 3_000_000) + pad,
                         ["metadata 'tokenizer.ggml.tokens'", "3000000 elements of at least 4 bytes"]),
        "string length": (_gguf_header(1) + key + struct.pack("<IQ", 8, 1 << 50) + pad,
                          ["metadata 'tokenizer.ggml.tokens'", f"string of {1 << 50} bytes"]),
        "string array": (_gguf_header(1) + key + struct.pack("<IIQ", 9, 8, 3_000_000) + pad,
                         ["tokenizer.ggml.tokens", "3000000 elements of at least 8 bytes"]),
    }[case]
    path = tmp_path / "claims.gguf"
    path.write_bytes(data)
    result = run_limited(TIMED_OPEN, path, timeout=60)
    assert result.returncode == 0 and result.stdout, result.stderr
    seconds, message = result.stdout.split(" ", 1)
    assert float(seconds) < 5, result.stdout
    for needle in needles:
        assert needle in message, (needle, message)


def test_gguf_metadata_arrays_that_really_hold_millions_of_elements_open_fast(tmp_path):
    """3 MB of metadata array elements, all present: opening a checkpoint reads only the
    scalar metadata, so the elements cost no per-element reader objects (the reader
    builds one view per element: tens of seconds and gigabytes for such a file)."""
    import struct

    n = 3_000_000
    body = (_gguf_string(b"tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 0, n) + bytes(n)
            + _gguf_string(b"general.architecture") + struct.pack("<I", 8) + _gguf_string(b"qwen3moe"))
    path = tmp_path / "vocab.gguf"
    path.write_bytes(_gguf_header(2) + body)
    result = run_limited(TIMED_OPEN, path, timeout=120)
    assert result.returncode == 0 and result.stdout, result.stderr
    seconds, message = result.stdout.split(" ", 1)
    assert "qwen3moe.expert_count is missing" in message
    assert float(seconds) < 5, result.stdout


def test_gguf_reader_failures_say_what_failed(tmp_path, monkeypatch):
    """The reader's own exceptions can carry no message (MemoryError(), KeyError(''));
    the error then names the exception type instead of printing ''."""
    import gguf

    path = tmp_path / "empty-meta.gguf"
    path.write_bytes(_gguf_header(0) + bytes(64))

    def fail(self, *args):
        raise KeyError("")

    monkeypatch.setattr(gguf.GGUFReader, "_build_tensor_info", fail)
    with pytest.raises(CheckpointError, match=r"not a readable GGUF file: .*KeyError") as info:
        open_checkpoint(path)
    assert not str(info.value).endswith("''")


def _fp8_checkpoint(directory: Path, block: list[int], scale_shape: tuple[int, int]) -> Path:
    directory.mkdir()
    tensors = {}
    for e in range(2):
        for kind, (rows, cols) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            name = f"model.layers.0.mlp.experts.{e}.{kind}_proj.weight"
            tensors[name] = ("F8_E4M3", (rows, cols), bytes(rows * cols))
            n = scale_shape[0] * scale_shape[1]
            tensors[name + "_scale_inv"] = ("F32", scale_shape,
                                            np.ones(n, dtype=np.float32).tobytes())
    write_safetensors_raw(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": block}}))
    return directory


def test_fp8_block_larger_than_the_weight_is_refused_before_allocating(tmp_path):
    huge = _fp8_checkpoint(tmp_path / "huge", [1 << 40, 1 << 40], (1, 1))
    with pytest.raises(CheckpointError, match=r"FP8 block 1099511627776 x 1099511627776 .*larger "
                                              r"than the weight's \[32, 64\]"):
        open_checkpoint(huge)
    for command in (["inspect", huge, "--touch", "none", "--nodes", "1"],
                    ["run", huge, "--steps", "2", "--virtual-nodes", "1"]):
        one_line_error(cli(*command), "FP8 block", "at most the dimension")
    # a block that tiles the weight, with scales of the wrong shape, is refused as well
    wrong = _fp8_checkpoint(tmp_path / "wrong", [16, 16], (1, 1))
    with pytest.raises(CheckpointError, match=r"expected \[2, 4\]: one scale per 16 x 16 block"):
        open_checkpoint(wrong)


def test_tensor_names_that_are_not_unicode_are_refused(tmp_path):
    good = '"model.layers.0.mlp.experts.0.gate_proj.weight": {"dtype": "F32", "shape": [0], ' \
           '"data_offsets": [0, 0]}'
    bad = '"model.layers.0.mlp.experts.1.gate_proj.weight\\ud800": {"dtype": "F32", ' \
          '"shape": [0], "data_offsets": [0, 0]}'
    directory = tmp_path / "ck"
    directory.mkdir()
    write_safetensors_raw(directory / "model.safetensors", {}, header_text="{" + good + ", " + bad + "}")
    with pytest.raises(CheckpointError, match=r"tensor #1 .*not valid Unicode"):
        open_checkpoint(directory)
    one_line_error(cli("inspect", directory, "--touch", "none", "--nodes", "1"),
                   "tensor #1", "not valid Unicode")


# ------------------------------------------------------------- odd files given to options

def _odd_file(tmp_path: Path, kind: str, name: str = "odd.json") -> Path:
    """A FIFO, /dev/zero (through a link with the name asked for), a JSON document
    nested 10**5 deep, or a valid-looking document over 1 MB."""
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        path.write_text(json.dumps({"schema": "x", "pad": "x" * (2 << 20)}))
    return path


_ODD = {"fifo": "FIFO (named pipe), not a regular file",
        "dev-zero": "character device, not a regular file",
        "deep": "nested too deeply (more than 100 levels)",
        "big": "larger than the"}


@pytest.mark.parametrize("kind", list(_ODD))
def test_simulate_machine_file_that_is_odd(tmp_path, kind):
    path = _odd_file(tmp_path, kind)
    result = cli("simulate", "--machine", path, "--like", "mixtral-8x7b", "--tokens", "1",
                 "--samples", "1", timeout=60)
    one_line_error(result, str(path), _ODD[kind])


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "deep"])
def test_simulate_trace_file_that_is_odd(tmp_path, kind):
    path = _odd_file(tmp_path, kind, "trace.json")
    result = cli("simulate", "--machine", "xeon-6430", "--like", "mixtral-8x7b", "--tokens", "1",
                 "--samples", "1", "--trace", path, timeout=60)
    one_line_error(result, str(path), _ODD[kind])


def test_npy_trace_whose_header_claims_more_than_the_file(tmp_path):
    path = tmp_path / "trace.npy"
    with open(path, "wb") as f:  # 64 GB claimed, 64 bytes present
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<i8", "fortran_order": False, "shape": (1, 4_000_000_000, 2)})
        f.write(bytes(64))
    result = cli("simulate", "--machine", "xeon-6430", "--like", "mixtral-8x7b", "--tokens", "1",
                 "--samples", "1", "--trace", path)
    one_line_error(result, str(path), "declares shape [1, 4000000000, 2]")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "deep"])
def test_segment_table_file_that_is_odd(tmp_path, kind):
    path = _odd_file(tmp_path, kind)
    result = run_limited("""
        from numa_moe.placement.segments import SegmentTable, SegmentTableFormatError
        try:
            SegmentTable.load(sys.argv[1])
        except SegmentTableFormatError as err:
            print(err)
    """, path, timeout=60)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert str(path) in result.stdout and _ODD[kind] in result.stdout, result.stdout


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "deep"])
def test_checkpoint_config_and_index_that_are_odd(source, kind):
    for name in ("config.json", "model.safetensors.index.json"):
        original = (source / name).read_bytes()
        (source / name).unlink()
        _odd_file(source, kind, name)
        result = cli("inspect", source, "--touch", "none", "--nodes", "1", timeout=60)
        one_line_error(result, name, _ODD[kind])
        (source / name).unlink()
        (source / name).write_bytes(original)

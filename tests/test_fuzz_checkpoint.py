"""Fuzzed safetensors headers, config.json and index files (issue 12).

The only outcomes allowed are a loaded checkpoint (whose tables can then be computed)
or the project's own error (``CheckpointError``; ``ValueError`` for tables). The body
runs in a subprocess under an address-space limit, so an input that makes the reader
allocate without bound fails the test (MemoryError) instead of taking the machine down,
and under a timeout; each example has a hypothesis deadline. Derandomized, so CI sees
the same examples on every run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

FUZZ = textwrap.dedent(r'''
    import json, os, resource, shutil, sys, tempfile
    if os.environ.get("NUMA_MOE_SANITIZED") != "1":  # ASan's shadow memory needs the address space
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    from hypothesis import HealthCheck, given, settings, strategies as st

    from numa_moe.files import CheckpointError
    from numa_moe.formats import DTYPE_BYTES
    from numa_moe.checkpoints.dispatch import open_checkpoint
    from numa_moe.layer.store import checkpoint_tables

    HUGE = [2**31, 2**32 + 1, 2**40, 2**62 + 1, 2**63, 2**64, 10**12, 999999999999, -1]
    ints = st.one_of(st.integers(0, 8), st.integers(0, 70), st.sampled_from(HUGE),
                     st.integers(-2**70, 2**70))
    ids = st.one_of(st.integers(0, 3), st.sampled_from([999999999999, 10**30, 2**64]))
    kinds = st.sampled_from(["gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"])
    names = st.one_of(
        st.builds("model.layers.{}.mlp.experts.{}.{}.weight".format, ids, ids, kinds),
        st.builds("model.layers.{}.block_sparse_moe.experts.{}.{}.weight".format, ids, ids, kinds),
        st.builds("model.layers.{}.mlp.experts.{}".format, ids,
                  st.sampled_from(["gate_up_proj", "down_proj"])),
        st.builds("model.layers.{}.mlp.gate.weight".format, ids),
        st.text(max_size=12))
    json_values = st.recursive(
        st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False), st.text(max_size=8)),
        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                st.dictionaries(st.text(max_size=6), inner, max_size=4)),
        max_leaves=12)
    shapes = st.lists(ints, min_size=0, max_size=4)
    dtypes = st.one_of(st.sampled_from(sorted(DTYPE_BYTES)), st.sampled_from(["bf16", "", "F128"]))


    @st.composite
    def entries(draw, offset):
        """A header entry: consistent offsets for its shape (most of the time) or junk."""
        if draw(st.integers(0, 9)) == 0:
            return draw(json_values), offset
        dtype, shape = draw(dtypes), draw(shapes)
        size = DTYPE_BYTES.get(dtype, 2)
        for d in shape:
            size *= d
        if draw(st.booleans()) and 0 <= size < 10**6:
            begin, end = offset, offset + size
        else:
            begin, end = draw(ints), draw(ints)
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        return entry, max(offset, end if isinstance(end, int) and 0 <= end < 10**6 else offset)


    @st.composite
    def safetensors_files(draw):
        header, offset = {}, 0
        for _ in range(draw(st.integers(0, 6))):
            entry, offset = draw(entries(offset))
            header[draw(names)] = entry
        if draw(st.booleans()):
            header["__metadata__"] = draw(json_values)
        raw = json.dumps(header).encode()
        mutation = draw(st.integers(0, 9))
        if mutation == 0:  # cut the header
            raw = raw[:draw(st.integers(0, len(raw)))]
        elif mutation == 1:  # nest it deeply
            depth = draw(st.sampled_from([10, 5000, 200_000]))
            raw = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
        length = len(raw) if draw(st.integers(0, 5)) else draw(ints)
        data = offset if draw(st.integers(0, 3)) else draw(st.integers(0, 4096))
        return (max(0, length) % 2**64).to_bytes(8, "little") + raw + b"\x01" * min(data, 10**6)


    @st.composite
    def plausible_files(draw):
        """A valid small checkpoint (per-expert or fused), then maybe one hostile edit."""
        L, E = draw(st.integers(1, 2)), draw(st.integers(1, 3))
        I, H = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        fused = draw(st.booleans())
        tensors = []
        for layer in range(L):
            if fused:
                tensors += [(f"model.layers.{layer}.mlp.experts.gate_up_proj", [E, 2 * I, H]),
                            (f"model.layers.{layer}.mlp.experts.down_proj", [E, H, I])]
            else:
                for e in range(E):
                    for kind, shape in (("gate", [I, H]), ("up", [I, H]), ("down", [H, I])):
                        tensors.append((f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight", shape))
        header, offset = {}, 0
        for name, shape in tensors:
            size = 2 * shape[0] * shape[1] * (shape[2] if len(shape) == 3 else 1)
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        if draw(st.booleans()):
            victim = header[draw(st.sampled_from(sorted(header)))]
            field = draw(st.sampled_from(["shape", "data_offsets", "dtype", "rename"]))
            if field == "shape":
                victim["shape"] = draw(shapes)
            elif field == "data_offsets":
                victim["data_offsets"] = [draw(ints), draw(ints)]
            elif field == "dtype":
                victim["dtype"] = draw(dtypes)
            else:
                header[draw(names)] = header.pop(next(iter(header)))
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        data = offset if draw(st.integers(0, 4)) else draw(st.integers(0, offset + 64))
        return len(raw).to_bytes(8, "little") + raw + b"\x01" * data


    configs = st.one_of(st.none(), st.fixed_dictionaries({}, optional={
        key: st.one_of(ints, json_values) for key in
        ("num_experts", "num_local_experts", "n_routed_experts", "hidden_size",
         "moe_intermediate_size", "intermediate_size", "num_experts_per_tok")}), json_values)
    shard_names = st.one_of(st.sampled_from(["model.safetensors", "b.safetensors", "../x.safetensors",
                                             "/etc/passwd", "missing.safetensors", ".", ""]),
                            json_values)


    def mostly_none(strategy):
        return st.one_of(st.none(), st.none(), strategy)


    @settings(max_examples=int(sys.argv[2]), deadline=5000, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(files=st.lists(st.one_of(plausible_files(), safetensors_files()), min_size=1, max_size=2),
           config=mostly_none(configs),
           index=mostly_none(st.one_of(st.dictionaries(names, shard_names, max_size=6), json_values)))
    def check(files, config, index):
        directory = tempfile.mkdtemp(dir=sys.argv[1])
        try:
            for name, raw in zip(["model.safetensors", "b.safetensors"], files):
                with open(os.path.join(directory, name), "wb") as f:
                    f.write(raw)
            if config is not None:
                with open(os.path.join(directory, "config.json"), "w") as f:
                    json.dump(config, f)
            if index is not None:
                document = {"weight_map": index} if isinstance(index, dict) and index else index
                with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
                    json.dump(document, f)
            try:
                ck = open_checkpoint(directory)
            except CheckpointError:
                return
            try:
                checkpoint_tables(ck, 2)
            except ValueError:
                pass
        finally:
            shutil.rmtree(directory)


    check()
    print("fuzz ok")
''')


def test_fuzzed_checkpoints_load_or_raise_checkpoint_error(tmp_path):
    started = time.monotonic()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH="")
    result = subprocess.run([sys.executable, "-P", "-c", FUZZ, str(tmp_path), "600"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and "fuzz ok" in result.stdout, result.stdout + result.stderr[-6000:]
    assert time.monotonic() - started < 60

"""ExpertStore with INT8 / INT4 experts: values and scales equal numa_moe.quant.quantize of
each source expert, buffers and tables as docs/quantization.md describes them, and the
per-node placement summary (remote weight and scale reads) against a byte-level reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import safetensors

from numa_moe.placement import memory
from numa_moe import quant as q
from numa_moe.files import CheckpointError
from numa_moe.formats import KINDS, scale_columns
from numa_moe.apps.placement_report import (inspect_checkpoint, placement_report, quant_node_summary,
                                       remote_scale_bytes)
from numa_moe.checkpoints.quantize import quantize_checkpoint
from numa_moe.placement.segments import SegmentTable
from numa_moe.layer.store import ExpertStore, buffer_shape, expert_rows, layer_tables
from numa_moe.checkpoints.synthetic import make_checkpoint

H, I, E, LAYERS = 256, 384, 3, 2
NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
SCALE_NP = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32,
            "e8m0": ml_dtypes.float8_e8m0fnu}


@pytest.fixture
def checkpoint_dir(tmp_path, rng):
    return make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", LAYERS, E, int(rng.integers(1 << 31)),
                           hidden_size=H, intermediate_size=I, progress=False, max_shard_bytes=200_000)


def _reference(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors.deserialize(path.read_bytes()):
            if entry["dtype"] == "BF16":
                out[name] = np.frombuffer(bytes(entry["data"]), dtype=ml_dtypes.bfloat16).reshape(entry["shape"])
    return out


def _check_store(store, reference, fmt, group, scale_dtype):
    assert (store.weight_format, store.group, store.scale_dtype) == (fmt, group, scale_dtype)
    assert store.quantized
    nodes = store.nodes
    expected_tables = layer_tables(store.dims, nodes, "4k", fmt, group, scale_dtype)
    for layer in store.layers:
        for kind in KINDS:
            rows, cols = buffer_shape(store.dims, kind)
            values, scales = store.weights(layer, kind), store.scales(layer, kind)
            assert values.dtype == (np.int8 if fmt == "int8" else np.uint8)
            assert values.shape == (rows, cols if fmt == "int8" else cols // 2)
            scale_cols = scale_columns(fmt, cols, group)  # int4-affine: the minimums too
            assert scales.dtype == SCALE_NP[scale_dtype] and scales.shape == (rows, scale_cols)
            assert not np.shares_memory(values, scales)
            table, scale_table = store.table(layer, kind), store.scale_table(layer, kind)
            # tables count weights (int4: elements, not bytes) and partition their buffer
            assert (table.rows, table.cols, table.fmt) == (rows, cols, fmt)
            assert (scale_table.rows, scale_table.cols, scale_table.fmt) == (rows, scale_cols, scale_dtype)
            table.check()
            scale_table.check()
            assert sum(table.bytes_per_node().values()) == values.nbytes
            assert sum(scale_table.bytes_per_node().values()) == scales.nbytes
            assert table == expected_tables[kind]
            assert scale_table == expected_tables[f"{kind}_scales"]
            for buf, t in ((values, table), (scales, scale_table)):
                pm = memory.page_map(buf)
                assert SegmentTable.from_page_map(t.rows, t.cols, t.fmt, pm.nodes, pm.page_bytes,
                                                  pm.offset_bytes, nodes=nodes) == t
        for e in range(E):
            views, scale_views = store.expert(layer, e), store.expert_scales(layer, e)
            for kind, view, sview in zip(KINDS, views, scale_views):
                w = reference[f"model.layers.{layer}.mlp.experts.{e}.{NAMES[kind]}.weight"]
                qm = q.quantize(w, fmt, group, scale_dtype)
                assert np.shares_memory(view, store.weights(layer, kind))
                assert np.shares_memory(sview, store.scales(layer, kind))
                np.testing.assert_array_equal(view, qm.q)
                np.testing.assert_array_equal(sview.view(np.uint8), qm.scales.view(np.uint8))
                start, stop = expert_rows(store.dims, kind, e)
                assert np.shares_memory(store.weights(layer, kind)[start:stop], view)
            tables = store.expert_scale_tables(layer, e)
            assert tables["down"] == store.scale_table(layer, "down").slice_rows(e * H, (e + 1) * H)


@pytest.mark.parametrize("fmt,group,scale_dtype", [("int8", 128, "fp16"), ("int4", 32, "bf16"),
                                                    ("int4", 64, "fp32"), ("mxfp4", 32, "e8m0"),
                                                    ("int4-affine", 32, "fp16")])
def test_float_checkpoint_quantized_while_loading(checkpoint_dir, fmt, group, scale_dtype):
    store = ExpertStore.load(checkpoint_dir, progress=False, weight_format=fmt, group=group,
                             scale_dtype=scale_dtype, threads=3)  # each expert matrix quantized on its own
    assert store.mismatches == []
    _check_store(store, _reference(checkpoint_dir), fmt, group, scale_dtype)


@pytest.mark.parametrize("fmt,group,scale_dtype", [("int8", 64, "fp32"), ("int4", 128, "fp16"),
                                                    ("mxfp4", 32, "e8m0"), ("int4-affine", 32, "bf16")])
def test_quantized_checkpoint_loads_as_it_is(checkpoint_dir, tmp_path, fmt, group, scale_dtype):
    quantize_checkpoint(checkpoint_dir, tmp_path / "q", fmt, group, scale_dtype, progress=False)
    store = ExpertStore.load(tmp_path / "q", progress=False, threads=3)
    _check_store(store, _reference(checkpoint_dir), fmt, group, scale_dtype)
    again = ExpertStore.load(tmp_path / "q", progress=False, weight_format=fmt, group=group,
                             scale_dtype=scale_dtype, layers=[1])
    for kind in KINDS:
        assert np.array_equal(again.weights(1, kind), store.weights(1, kind))
    with pytest.raises(ValueError, match=f"routed experts are {fmt}; the store loads a quantized "
                                         "checkpoint as it is"):
        ExpertStore.load(tmp_path / "q", progress=False, weight_format="bf16")
    with pytest.raises(ValueError, match="scales have group"):
        ExpertStore.load(tmp_path / "q", progress=False, group=64 if group == 32 else 32)


def test_bf16_store_is_unchanged_and_has_no_scales(checkpoint_dir):
    store = ExpertStore.load(checkpoint_dir, progress=False, layers=[0])
    assert (store.weight_format, store.group, store.scale_dtype) == ("bf16", None, None)
    assert not store.quantized
    assert store.scales(0, "gate") is None and store.scale_table(0, "up") is None
    assert store.expert_scales(0, 1) is None
    assert str(store.weights(0, "down").dtype) == "bfloat16"
    assert placement_report(store).per_node is None
    with pytest.raises(ValueError, match="group and scale_dtype apply to weight_format"):
        ExpertStore.load(checkpoint_dir, progress=False, group=64)
    with pytest.raises(ValueError, match="not to fp32"):
        ExpertStore.load(checkpoint_dir, progress=False, weight_format="fp32")


def test_group_must_divide_the_columns(tmp_path, rng):
    ck = make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 1, 2, 0, hidden_size=H,
                         intermediate_size=96, progress=False)
    with pytest.raises(ValueError, match="group 64 does not divide the 96 columns of the down"):
        ExpertStore.load(ck, progress=False, weight_format="int8", group=64)


def test_nan_weight_refused_while_quantizing(checkpoint_dir):
    from numa_moe.checkpoints.safetensors import Checkpoint
    from numa_moe.checkpoints.dispatch import open_checkpoint

    m = open_checkpoint(checkpoint_dir).layers[0].matrices["up"][1]
    with open(m.tensor.path, "r+b") as f:
        f.seek(m.file_offset + 2 * 3)
        f.write(np.array([np.nan], dtype=ml_dtypes.bfloat16).tobytes())
    with pytest.raises(CheckpointError, match=rf"{m.tensor.name}.*NaN or infinity"):
        ExpertStore.load(checkpoint_dir, progress=False, weight_format="int8")


# ------------------------------------------------------------------ remote scale bytes


def _per_byte_remote_scales(weight_table, group, scale_fmt, scale_nodes, page_bytes, offset):
    """Reference: every weight element of a node's segments -> its scale element -> that
    scale's bytes, looked up page by page; a scale counted once per node."""
    element = np.dtype(SCALE_NP[scale_fmt]).itemsize
    scale_cols = weight_table.cols // group
    out = {}
    for node, segs in weight_table.segments.items():
        needed = set()
        for s in segs:
            for i in range(s.nrows):
                r = s.row0 + i * s.row_stride
                for c in range(s.k0 // group, (s.k1 - 1) // group + 1):
                    needed.add(r * scale_cols + c)
        remote = total = 0
        for idx in needed:
            for b in range(idx * element, (idx + 1) * element):
                page_node = scale_nodes[(b + offset) // page_bytes]
                if page_node < 0:
                    continue
                total += 1
                remote += page_node != node
        out[node] = (remote, total)
    return out


@pytest.mark.parametrize("case", range(6))
def test_remote_scale_bytes_against_per_byte_reference(rng, case):
    fmt = ["int8", "int4"][case % 2]
    group = [32, 64, 128][case % 3]
    scale_fmt = ["fp16", "bf16", "fp32"][(case // 2) % 3]
    n = int(rng.integers(2, 5))
    rows, cols = int(rng.integers(8, 80)), group * int(rng.integers(1, 12))
    page = 256  # small pages: many page cuts inside rows and groups
    weight = SegmentTable.theoretical(rows, cols, fmt, page, n, phase=int(rng.integers(n)))
    element = np.dtype(SCALE_NP[scale_fmt]).itemsize
    offset = int(rng.integers(0, page // element)) * element
    n_pages = (offset + rows * cols // group * element - 1) // page + 1
    scale_nodes = rng.integers(-1, n, size=n_pages)  # random map, some pages not present
    got = remote_scale_bytes(weight, group, scale_fmt, scale_nodes, page, offset)
    assert got == _per_byte_remote_scales(weight, group, scale_fmt, scale_nodes, page, offset)


def test_node_summary_of_two_interleaved_buffers():
    """int8 rows of 1024 B on 4 KiB pages over 2 nodes: 4 rows per page, the node changes
    every 4 rows; the fp16 scales (64 B a row) change node every 64 rows, so half of the
    scales a node needs sit on the other node."""
    rows, cols, group = 256, 1024, 32
    weight = SegmentTable.theoretical(rows, cols, "int8", 4096, 2)
    scale = SegmentTable.theoretical(rows, cols // group, "fp16", 4096, 2)
    weight_map = (np.arange(rows * cols // 4096) % 2, 4096, 0)
    scale_map = (np.arange(rows * cols // group * 2 // 4096) % 2, 4096, 0)
    summary = quant_node_summary([(weight, weight_map, scale, scale_map)], group, "fp16", (0, 1))
    for node in (0, 1):
        assert summary[node] == {"weight_bytes": rows * cols // 2, "scale_bytes": rows * cols // group,
                                 "remote_weight_bytes": 0, "scale_bytes_needed": rows * cols // group,
                                 "remote_scale_bytes": rows * cols // group // 2}


def test_store_and_inspect_report_per_node_bytes(checkpoint_dir, tmp_path):
    quantize_checkpoint(checkpoint_dir, tmp_path / "q", "int4", 64, "fp16", progress=False)
    store = ExpertStore.load(tmp_path / "q", progress=False)
    report = placement_report(store)
    assert len(report.tensors) == LAYERS * 6
    per_node = report.per_node
    assert set(per_node) == set(store.nodes)
    weights = sum(store.weights(layer, k).nbytes for layer in store.layers for k in KINDS)
    scales = sum(store.scales(layer, k).nbytes for layer in store.layers for k in KINDS)
    assert sum(v["weight_bytes"] for v in per_node.values()) == weights
    assert sum(v["scale_bytes"] for v in per_node.values()) == scales
    assert all(v["remote_weight_bytes"] == 0 for v in per_node.values())
    assert "per node" in report.format_text() and "per_node" in report.to_dict()
    checkpoint_report = inspect_checkpoint(tmp_path / "q", touch="all")
    assert sum(v["weight_bytes"] for v in checkpoint_report.per_node.values()) == weights
    assert sum(v["scale_bytes"] for v in checkpoint_report.per_node.values()) == scales
    names = [t.name for t in checkpoint_report.tensors]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_scale" in names
    gate = checkpoint_report.tensors[names.index("model.layers.0.mlp.experts.0.gate_proj.weight")]
    assert (gate.rows, gate.cols, gate.fmt, gate.nbytes) == (I, H, "int4", I * H // 2)

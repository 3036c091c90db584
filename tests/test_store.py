"""ExpertStore: round trip against the safetensors library, views, tables, mismatch path."""

import hashlib
import re
import warnings

import numpy as np
import pytest
import safetensors

from numa_moe.placement import memory
from numa_moe.formats import KINDS
from numa_moe.placement.segments import SegmentTable
from numa_moe.layer.store import ExpertStore, PlacementMismatchWarning, buffer_shape, layer_tables
from numa_moe.checkpoints.synthetic import make_checkpoint

H, I, E, LAYERS = 64, 96, 5, 3


@pytest.fixture
def checkpoint_dir(tmp_path, rng):
    return make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", LAYERS, E, int(rng.integers(1 << 31)),
                           hidden_size=H, intermediate_size=I, progress=False, max_shard_bytes=60_000)


def _reference(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors.deserialize(path.read_bytes()):
            out[name] = np.frombuffer(bytes(entry["data"]), dtype=np.uint16).reshape(entry["shape"])
    return out


def _digest(directory):
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("threads", [1, 3])
def test_round_trip_bytes_equal_file(checkpoint_dir, threads):
    before = _digest(checkpoint_dir)
    store = ExpertStore.load(checkpoint_dir, progress=False, threads=threads)
    assert _digest(checkpoint_dir) == before  # never modified
    reference = _reference(checkpoint_dir)
    assert store.layers == tuple(range(LAYERS))
    assert (store.hidden_size, store.intermediate_size, store.n_experts, store.top_k) == (H, I, E, 8 if E >= 8 else E)
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    for layer in store.layers:
        for kind in KINDS:
            buf = store.weights(layer, kind)
            assert buf.shape == buffer_shape(store.dims, kind) and str(buf.dtype) == "bfloat16"
            stacked = np.concatenate([reference[f"model.layers.{layer}.mlp.experts.{e}.{names[kind]}.weight"]
                                      for e in range(E)])
            np.testing.assert_array_equal(buf.view(np.uint16), stacked)
        for e in range(E):
            gate, up, down = store.expert(layer, e)
            assert gate.shape == (I, H) and up.shape == (I, H) and down.shape == (H, I)
            assert np.shares_memory(gate, store.weights(layer, "gate"))
            np.testing.assert_array_equal(
                down.view(np.uint16), reference[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"])


def test_layers_subset_and_unknown_layer(checkpoint_dir):
    store = ExpertStore.load(checkpoint_dir, layers=[2, 0], progress=False)
    assert store.layers == (2, 0)
    with pytest.raises(KeyError, match=r"layer 1 is not loaded"):
        store.weights(1, "gate")
    with pytest.raises(ValueError, match=r"layer\(s\) \[7\] have no routed experts"):
        ExpertStore.load(checkpoint_dir, layers=[7], progress=False)
    with pytest.raises(ValueError, match="unknown matrix kind"):
        store.weights(0, "gate_proj")
    with pytest.raises(IndexError, match=f"holds {E} experts"):
        store.expert(0, E)


def test_tables_match_theory_and_page_map(checkpoint_dir):
    store = ExpertStore.load(checkpoint_dir, progress=False)
    assert store.mismatches == []
    nodes = store.nodes
    expected = layer_tables(store.dims, nodes, "4k", "bf16")
    for layer in store.layers:
        for kind in KINDS:
            table = store.table(layer, kind)
            assert table == expected[kind]
            buf = store.weights(layer, kind)
            pm = memory.page_map(buf)
            measured = SegmentTable.from_page_map(table.rows, table.cols, "bf16", pm.nodes, pm.page_bytes,
                                                  pm.offset_bytes, nodes=nodes)
            assert measured == table
        per_expert = store.expert_tables(layer, E - 1)
        assert per_expert["gate"] == table_slice(store, layer, "gate", (E - 1) * I, E * I)
        assert per_expert["down"].rows == H and per_expert["gate"].rows == I


def table_slice(store, layer, kind, start, stop):
    return store.table(layer, kind).slice_rows(start, stop)


def test_torch_views_share_memory(checkpoint_dir):
    torch = pytest.importorskip("torch")
    store = ExpertStore.load(checkpoint_dir, layers=[1], progress=False)
    t = store.torch_weights(1, "down")
    buf = store.weights(1, "down")
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == buf.shape
    assert t.data_ptr() == buf.__array_interface__["data"][0]


def test_mismatch_is_reported_and_measured_table_used(checkpoint_dir, monkeypatch):
    """The kernel claims a 2-node interleave but every page is on node 0: the store must warn,
    record the mismatch and use the measured (single-node) table."""
    real_info = memory.interleave_info

    def claimed(array):
        info = real_info(array)
        return type(info)((0, 1), info.page_bytes, 0, info.address, info.nbytes)

    monkeypatch.setattr(memory, "interleave_info", claimed)
    real_map = memory.page_map
    monkeypatch.setattr(memory, "page_map", lambda buf: type(real_map(buf))(
        np.zeros_like(real_map(buf).nodes), 4096, 0, real_map(buf).address))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = ExpertStore.load(checkpoint_dir, layers=[0], progress=False)
    messages = [str(w.message) for w in caught if w.category is PlacementMismatchWarning]
    assert len(messages) == 3
    assert re.match(r"layer 0 gate: measured page map differs.*nodes \[0, 1\]", messages[0])
    assert len(store.mismatches) == 3
    mismatch = store.mismatches[0]
    assert mismatch.theoretical.source == "theoretical" and mismatch.measured.source == "measured"
    table = store.table(0, "gate")
    assert table.source == "measured"
    rows, cols = buffer_shape(store.dims, "gate")
    assert table.bytes_per_node() == {0: rows * cols * 2, 1: 0}


def test_unmeasurable_map_falls_back_with_warning(checkpoint_dir, monkeypatch):
    def fail(buf):
        raise memory.PlacementError("move_pages", 1, "Operation not permitted")

    monkeypatch.setattr(memory, "page_map", fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = ExpertStore.load(checkpoint_dir, layers=[0], progress=False)
    assert any("page map not measurable" in str(w.message) for w in caught)
    assert store.layer(0).measured["down"] is False
    assert store.table(0, "down").source == "theoretical"


def test_only_bf16_fp16_fp32_load(tmp_path):
    from numa_moe.checkpoints.writer import TensorPlan, write_safetensors

    d = tmp_path / "i8"
    d.mkdir()
    plans = [TensorPlan(f"model.layers.0.mlp.experts.0.{k}_proj.weight", s, np.dtype(np.int8), 1)
             for k, s in (("gate", (4, 8)), ("up", (4, 8)), ("down", (8, 4)))]
    write_safetensors(d / "model.safetensors", plans, lambda p: [b"\1" * p.nbytes])
    with pytest.raises(ValueError, match="routed experts are I8"):
        ExpertStore.load(d, progress=False)


@pytest.mark.parametrize("n_virtual_nodes", [None, 3])
def test_layer_from_store_cuts_each_expert_where_the_store_puts_it(checkpoint_dir, n_virtual_nodes):
    """MoELayer.from_store takes its expert views and tables from the store's layout
    (expert_rows / expert_tables_of) on real and virtual topologies."""
    from numa_moe.layer.moe_layer import MoELayer
    from numa_moe.layer.store import expert_rows, expert_tables_of
    from numa_moe.placement.topology import Topology, current_topology

    store = ExpertStore.load(checkpoint_dir, layers=[1], progress=False)
    topology = current_topology() if n_virtual_nodes is None else Topology.virtual(n_virtual_nodes)
    layer = MoELayer.from_store(store, 1, topology=topology)
    if n_virtual_nodes is None:
        stacked = store.layer(1).tables
    else:
        stacked = layer_tables(store.dims, tuple(range(n_virtual_nodes)), store.page_bytes, "bf16")
    for e in range(E):
        assert layer.tables[e] == expert_tables_of(stacked, store.dims, e)
        for kind in KINDS:
            start, stop = expert_rows(store.dims, kind, e)
            np.testing.assert_array_equal(getattr(layer.experts[e], kind),
                                          store.weights(1, kind)[start:stop].view(np.uint16))
            assert layer.tables[e][kind].rows == stop - start

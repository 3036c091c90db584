"""INT8 / INT4 ExpertStore on a real kernel with >= 2 NUMA nodes (numa-vm; numpy + native only).

* every byte of every node's weight segments lies on a page the kernel reports on that
  node (move_pages of the real value buffers, checked here byte range by byte range):
  remote weight bytes 0;
* the scale buffers are one interleaved copy: the scale bytes each node's segments need
  that lie on another node's pages are measured from the real scale buffers, equal the
  count from the theoretical interleave, and are reported (record_property + print).
"""

import numpy as np
import pytest

from numa_moe.placement import memory
from numa_moe import quant as q
from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.formats import KINDS
from numa_moe.apps.placement_report import placement_report, quant_node_summary
from numa_moe.checkpoints.quantize import quantize_checkpoint
from numa_moe.placement.segments import SegmentTable
from numa_moe.layer.store import ExpertStore
from numa_moe.checkpoints.synthetic import make_checkpoint
from numa_moe.formats import NUMPY_DTYPES
from placement_reference import segment_bytes_on_wrong_node

H, I, E = 320, 192, 6  # int8 rows of 320 / 192 bytes, int4 of 160 / 96: pages cut rows
GROUP = 64
NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@pytest.fixture
def checkpoint_dir(tmp_path, rng):
    return make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 2, E, int(rng.integers(1 << 31)),
                           hidden_size=H, intermediate_size=I, progress=False)


def _theoretical_map(buffer, nodes):
    info = memory.interleave_info(buffer)
    pm = memory.page_map(buffer)
    pages = np.arange(len(pm.nodes))
    return (np.asarray(info.nodes)[(info.phase + pages * pm.page_bytes // info.page_bytes)
                                   % len(info.nodes)], pm.page_bytes, pm.offset_bytes)


@pytest.mark.parametrize("fmt,scale_dtype,from_file", [("int8", "fp16", False), ("int4", "bf16", False),
                                                        ("int4", "fp16", True)])
def test_quantized_weights_local_and_remote_scales_reported(checkpoint_dir, tmp_path, real_nodes,
                                                            record_property, fmt, scale_dtype,
                                                            from_file):
    nodes = tuple(real_nodes)
    if from_file:
        quantize_checkpoint(checkpoint_dir, tmp_path / "q", fmt, GROUP, scale_dtype, progress=False)
        store = ExpertStore.load(tmp_path / "q", nodes=nodes, page="4k", progress=False)
    else:
        store = ExpertStore.load(checkpoint_dir, nodes=nodes, page="4k", progress=False,
                                 weight_format=fmt, group=GROUP, scale_dtype=scale_dtype)
    assert store.mismatches == [], [m.reason for m in store.mismatches]
    assert (store.weight_format, store.group, store.scale_dtype) == (fmt, GROUP, scale_dtype)
    pairs, theory_pairs = [], []
    for layer in store.layers:
        for kind in KINDS:
            values, scales = store.weights(layer, kind), store.scales(layer, kind)
            table, scale_table = store.table(layer, kind), store.scale_table(layer, kind)
            assert table.nodes == tuple(sorted(nodes)) and table.fmt == fmt
            table.check()
            scale_table.check()
            pm = memory.page_map(values)
            assert SegmentTable.from_page_map(table.rows, table.cols, fmt, pm.nodes, pm.page_bytes,
                                              pm.offset_bytes, nodes=nodes) == table
            assert segment_bytes_on_wrong_node(table, np.asarray(pm.nodes), pm.page_bytes, pm.offset_bytes) == \
                {n: 0 for n in table.nodes}
            per_node = table.bytes_per_node()
            assert min(per_node.values()) > 0 and max(per_node.values()) - min(per_node.values()) <= 4096
            spm = memory.page_map(scales)
            assert SegmentTable.from_page_map(scale_table.rows, scale_table.cols, scale_dtype,
                                              spm.nodes, spm.page_bytes, spm.offset_bytes,
                                              nodes=nodes) == scale_table
            pairs.append((table, (np.asarray(pm.nodes), pm.page_bytes, pm.offset_bytes),
                          scale_table, (np.asarray(spm.nodes), spm.page_bytes, spm.offset_bytes)))
            theory_pairs.append((table, _theoretical_map(values, nodes), scale_table,
                                 _theoretical_map(scales, nodes)))
    # the values are those of the reference quantizer (two experts of the last layer)
    ck = open_checkpoint(checkpoint_dir)
    for e in (0, E - 1):
        for kind, view, sview in zip(KINDS, store.expert(1, e), store.expert_scales(1, e)):
            m = ck.layers[1].matrices[kind][e]
            w = np.empty((m.rows, m.cols), dtype=NUMPY_DTYPES[m.dtype])
            from numa_moe.checkpoints.safetensors import read_matrix_into

            read_matrix_into(m, w)
            expected = q.quantize(w, fmt, GROUP, scale_dtype)
            assert np.array_equal(view, expected.q)
            assert np.array_equal(sview.view(np.uint8), expected.scales.view(np.uint8))
    measured = quant_node_summary(pairs, GROUP, scale_dtype, nodes)
    assert measured == quant_node_summary(theory_pairs, GROUP, scale_dtype, nodes)
    report = placement_report(store)
    assert report.per_node == measured
    total_scales = sum(store.scales(layer, k).nbytes for layer in store.layers for k in KINDS)
    # the scales are small: with many nodes some hold no page of them
    scale_nodes = {int(n) for _, _, _, (page_nodes, _, _) in pairs for n in page_nodes}
    for node, v in measured.items():
        assert v["remote_weight_bytes"] == 0
        assert 0 <= v["remote_scale_bytes"] <= v["scale_bytes_needed"]
        assert v["weight_bytes"] > 0 and (v["scale_bytes"] > 0) == (node in scale_nodes)
    assert sum(v["scale_bytes"] for v in measured.values()) == total_scales
    # every scale is needed by at least one node
    assert sum(v["scale_bytes_needed"] for v in measured.values()) >= total_scales
    # one interleaved copy: with pages cutting rows, some scales are read across nodes
    assert sum(v["remote_scale_bytes"] for v in measured.values()) > 0
    summary = {n: (v["remote_scale_bytes"], v["scale_bytes_needed"]) for n, v in measured.items()}
    record_property("remote_scale_bytes", summary)
    print(f"{len(nodes)} nodes {fmt} g{GROUP} {scale_dtype}: remote scale bytes per node "
          f"(remote, needed) {summary}")

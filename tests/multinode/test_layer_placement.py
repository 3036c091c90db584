"""Multinode tier for the MoE layer (numpy + native only; run inside numa-vm with 2 and
4 nodes): weights interleaved over the real nodes, tables from the measured page map;
every segment a node's workers run lies on pages of that node, the workers are pinned to
that node's CPUs, and the layer's result matches a float64 reference."""

import ml_dtypes
import numpy as np

from numa_moe.placement import memory
from numa_moe.formats import KINDS
from numa_moe.layer.moe_layer import MoELayer
from numa_moe.placement.segments import SegmentTable
from numa_moe.placement.topology import Topology

E, H, I = 3, 1536, 256  # 3072-byte gate/up rows: pages split rows, strided segments


def _bf16(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)


def _reference(x, ids, w, gate_up, down):
    x64 = x.astype(np.float64)
    y = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g = gate_up[e, :I].astype(np.float64) @ x64[t]
            u = gate_up[e, I:].astype(np.float64) @ x64[t]
            y[t] += w[t, j] * (down[e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    return y


def _segment_pages(seg, row_bytes, base_offset, page_bytes=4096):
    row0, stride, nrows, k0, k1 = (int(v) for v in seg)
    pages = set()
    for j in range(nrows):
        start = base_offset + (row0 + j * stride) * row_bytes + 2 * k0
        end = base_offset + (row0 + j * stride) * row_bytes + 2 * k1
        pages.update(range(start // page_bytes, (end - 1) // page_bytes + 1))
    return pages


def test_layer_on_real_nodes(rng, real_nodes):
    topology = Topology.detect()
    gate_up = memory.interleaved_empty((E, 2 * I, H), "bfloat16", nodes=real_nodes)
    down = memory.interleaved_empty((E, H, I), "bfloat16", nodes=real_nodes)
    gate_up[...] = _bf16(rng, gate_up.shape, H ** -0.5)
    down[...] = _bf16(rng, down.shape, I ** -0.5)
    pm_gu, pm_d = memory.page_map(gate_up), memory.page_map(down)
    t_gu = SegmentTable.from_page_map(E * 2 * I, H, "bf16", pm_gu.nodes, pm_gu.page_bytes,
                                      offset_bytes=pm_gu.offset_bytes)
    t_d = SegmentTable.from_page_map(E * H, I, "bf16", pm_d.nodes, pm_d.page_bytes, offset_bytes=pm_d.offset_bytes)
    layer = MoELayer.from_stacked(gate_up, down, t_gu, t_d, topology=topology)
    assert layer.node_ids == tuple(topology.node_ids)

    # every segment handed to node n's workers lies on pages the kernel reports on node n
    page_nodes = {"gu": memory.page_nodes(gate_up), "d": memory.page_nodes(down)}
    for e in range(E):
        for kind in KINDS:
            buf, row_bytes, first_row = (("gu", 2 * H, e * 2 * I + (I if kind == "up" else 0)) if kind != "down"
                                         else ("d", 2 * I, e * H))
            table = layer.tables[e][kind]
            for node in table.nodes:
                for seg in table.node_array(node):
                    for page in _segment_pages(seg, row_bytes, first_row * row_bytes):
                        assert page_nodes[buf][page] == node, (e, kind, node, seg, page)

    # workers pinned to their node's CPUs
    for node_index, _, cpus in layer.pool.thread_affinity():
        assert set(cpus) <= set(topology.cpus_of(layer.node_ids[node_index]))

    x = _bf16(rng, (5, H), 1.0)
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(5)]).astype(np.int64)
    w = rng.random((5, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, w, out_dtype="float32")
    ref = _reference(x, ids, w, gate_up, down)
    assert np.all(np.isfinite(y))
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2
    stats = layer.last_stats()
    assert all(b > 0 for b in stats["node_bytes"])  # every node did its share

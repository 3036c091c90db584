"""Multinode tier for decode attention (numpy + native only; inside numa-vm with 2 and 4
nodes): a KV cache interleaved over the real nodes, its table from the measured page
map; V lies where K does, every node holds positions, and the split-and-merged result
matches the float64 reference."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

from numa_moe.layer import attention
from numa_moe.placement import memory
from numa_moe.placement.segments import SegmentTable
from numa_moe.placement.topology import Topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_reference import error_bound, reference_decode  # noqa: E402


def test_decode_on_real_nodes(rng, real_nodes):
    topology = Topology.detect()
    batch, kv_heads, group, capacity, head_dim = 2, 2, 4, 600, 128
    cache = attention.KVCache((batch, kv_heads, capacity, head_dim), topology=topology)
    assert cache.v_local, "V rows must lie on the nodes of their K rows"
    assert set(cache.table.bytes_per_node()) == set(real_nodes)
    pm = memory.page_map(cache.k)
    assert cache.table == SegmentTable.from_page_map(cache.rows, head_dim, "bf16", pm.nodes, pm.page_bytes,
                                                     offset_bytes=pm.offset_bytes)
    cache.k[...] = rng.standard_normal(cache.shape).astype(ml_dtypes.bfloat16)
    cache.v[...] = rng.standard_normal(cache.shape).astype(ml_dtypes.bfloat16)
    q = rng.standard_normal((batch, kv_heads * group, head_dim)).astype(ml_dtypes.bfloat16)
    lengths = [600, 257]
    per_node = cache.positions_per_node(lengths)
    assert min(per_node.values()) > 0 and sum(per_node.values()) == kv_heads * sum(lengths)
    out = cache.decode(q, lengths, out_dtype=np.float32)
    isa = attention.default_isa()
    assert np.abs(out - reference_decode(q, cache.k, cache.v, lengths)).max() <= error_bound(isa, cache.v)
    assert np.array_equal(out, cache.decode(q, lengths, out_dtype=np.float32))

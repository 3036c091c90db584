"""A GGUF file loaded into an ExpertStore on a real kernel with >= 2 NUMA nodes (numa-vm;
numpy + native + the gguf package only).

* the converted experts (Q8_0 -> int8 without loss, Q4_K -> int8 requantized) sit where
  the table says: every byte of every node's weight segments lies on a page the kernel
  reports on that node (move_pages of the real buffers), scales in their own interleaved
  buffer with an exact-partition table;
* the values equal the gguf package's own dequantization (Q8_0) and the file inspected in
  the page cache reports its pages and the cost of the conversion over the real nodes.
"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of numa-moe")

from numa_moe.placement import memory  # noqa: E402
from numa_moe import quant as q  # noqa: E402
from numa_moe.formats import KINDS  # noqa: E402
from numa_moe.apps.placement_report import inspect_checkpoint  # noqa: E402
from numa_moe.placement.segments import SegmentTable  # noqa: E402
from numa_moe.layer.store import ExpertStore  # noqa: E402
from placement_reference import segment_bytes_on_wrong_node  # noqa: E402

T = gguf.GGMLQuantizationType
E, H, I = 6, 512, 256  # int8 rows of 512 / 256 bytes: 8 / 16 rows a page


def _write(path, rng):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_embedding_length(H)
    w.add_expert_feed_forward_length(I)
    for kind, shape in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I))):
        name = f"blk.0.ffn_{kind}_exps.weight"
        if kind == "down":  # raw Q4_K blocks with finite fp16 d and dmin
            block, size = gguf.GGML_QUANT_SIZES[T.Q4_K]
            raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
            blocks = raw.reshape(-1, size)
            d = (rng.random(len(blocks)) * 0.02 + 0.001).astype(np.float16).view(np.uint8).reshape(-1, 2)
            blocks[:, 0:2] = d
            blocks[:, 2:4] = d
            w.add_tensor(name, raw, raw_dtype=T.Q4_K)
        else:
            x = rng.standard_normal(shape).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_experts_sit_where_the_table_says(tmp_path, rng, real_nodes):
    path = _write(tmp_path / "m.gguf", rng)
    nodes = tuple(real_nodes)
    store = ExpertStore.load(path, nodes=nodes, page="4k", progress=False)
    assert store.mismatches == [], [m.reason for m in store.mismatches]
    assert (store.weight_format, store.group, store.scale_dtype) == ("int8", 32, "fp16")
    for kind in KINDS:
        values, scales = store.weights(0, kind), store.scales(0, kind)
        table, scale_table = store.table(0, kind), store.scale_table(0, kind)
        table.check()
        scale_table.check()
        pm = memory.page_map(values)
        assert SegmentTable.from_page_map(table.rows, table.cols, "int8", pm.nodes, pm.page_bytes,
                                          pm.offset_bytes, nodes=nodes) == table
        assert segment_bytes_on_wrong_node(table, np.asarray(pm.nodes), pm.page_bytes,
                                           pm.offset_bytes) == {n: 0 for n in table.nodes}
        assert len(set(np.asarray(pm.nodes).tolist())) == len(nodes)
        spm = memory.page_map(scales)
        assert SegmentTable.from_page_map(scale_table.rows, scale_table.cols, "fp16", spm.nodes,
                                          spm.page_bytes, spm.offset_bytes, nodes=nodes) == scale_table
    reader = gguf.GGUFReader(str(path))
    gate = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_exps.weight")
    want = gguf.quants.dequantize(np.asarray(gate.data), T.Q8_0).reshape(E * I, H)
    got = q.dequantize(q.QuantizedMatrix("int8", 32, store.weights(0, "gate"), store.scales(0, "gate")))
    assert np.array_equal(got, want)

    report = inspect_checkpoint(path, nodes=nodes, touch="all")
    assert {t.name for t in report.tensors} == {f"blk.0.ffn_{k}_exps.weight" for k in KINDS}
    assert all(t.pages_not_present == 0 for t in report.tensors)
    c = report.conversion
    assert c["conversion"] == "GGUF Q4_K+Q8_0 -> int8, group 32, fp16 scales (requantized)"
    assert set(c["bytes_per_node"]) == {str(n) for n in nodes}
    assert c["loaded_bytes"] == sum(store.weights(0, k).nbytes + store.scales(0, k).nbytes for k in KINDS)

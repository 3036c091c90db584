"""The projection model's byte counts on a real kernel with >= 2 NUMA nodes (numa-vm).

What ``numa_moe.apps.simulate`` derives from the segment tables (per expert and node: bytes
read locally and remotely under the naive row split (b), bytes each node holds and
reads under the tables (c)) equals what the kernel's page map (move_pages) of the real
buffers says, for 4 KB and 2 MB pages, bf16 and int8 (with its fp32 scales), on every
node count the VM has. numpy + native only.
"""

from pathlib import Path

import numpy as np
import pytest

from numa_moe.placement import memory
from numa_moe.apps import simulate as sim
from numa_moe.placement.pages import page_bytes_of
from numa_moe.formats import weight_format
from numa_moe.placement.segments import SegmentTable, scale_shape
from numa_moe.layer.store import ExpertStore, buffer_shape
from numa_moe.checkpoints.synthetic import make_checkpoint

BASE = 4096
E = 8  # real Qwen3-30B-A3B expert shapes (H=2048, I=768), 8 of its 128 experts
DTYPES = {"bf16": np.uint16, "int8": np.int8, "fp32": np.float32}


def _thp_or_skip(page):
    if page == "2m" and "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        pytest.skip("transparent huge pages are off in this kernel")


def _check_buffer(workload, kind, buf, table, nodes):
    """Accounting from the table == counts from the buffer's page map."""
    n = len(nodes)
    acc = sim.layer_accounting(workload, n, {kind: table})
    base = kind.split("_")[0]
    per_expert = workload.intermediate if base in ("gate", "up") else workload.hidden
    page_nodes = memory.page_nodes(buf)
    assert (page_nodes >= 0).all()
    address = buf.__array_interface__["data"][0]
    row_bytes = table.row_bytes
    experts = np.arange(workload.n_experts)
    bounds = (np.arange(n + 1) * per_expert) // n
    r0 = (experts[:, None] * per_expert + bounds[None, :-1]).reshape(-1)
    r1 = (experts[:, None] * per_expert + bounds[None, 1:]).reshape(-1)
    measured_b = sim.page_bytes_in_rows(page_nodes, BASE, address % BASE, row_bytes, r0, r1, nodes)
    np.testing.assert_array_equal(acc.reads["b"], measured_b.reshape(workload.n_experts, n, n))
    measured_c = sim.page_bytes_in_rows(page_nodes, BASE, address % BASE, row_bytes, experts * per_expert,
                                        (experts + 1) * per_expert, nodes)
    np.testing.assert_array_equal(np.diagonal(acc.reads["c"], axis1=1, axis2=2), measured_c)
    assert (acc.reads["c"].sum(axis=0) - np.diag(np.diag(acc.reads["c"].sum(axis=0)))).sum() == 0
    return acc


@pytest.mark.parametrize("page", ["4k", "2m"])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_model_bytes_equal_page_map_bytes(real_nodes, page, fmt):
    _thp_or_skip(page)
    nodes = tuple(real_nodes)
    page_bytes = page_bytes_of(page)
    w = sim.workload_like("qwen3-30b-a3b", fmt, page, layers=1, experts=E)
    remote_b = 0
    for kind in ("gate", "up", "down"):
        rows, cols = buffer_shape(w.dims, kind)
        shapes = [(kind, rows, cols, fmt)]
        if fmt == "int8":
            shapes.append((f"{kind}_scales", *scale_shape(rows, cols, w.group), "fp32"))
        for name, r, c, f in shapes:
            row_bytes = weight_format(f).row_bytes(c)
            buf = memory.interleaved_empty((r, row_bytes // np.dtype(DTYPES[f]).itemsize), DTYPES[f],
                                           nodes=nodes, page=page)
            buf[...] = 1  # fault every page in
            info = memory.interleave_info(buf)
            assert info is not None and info.page_bytes == page_bytes
            table = SegmentTable.theoretical(r, c, f, page_bytes, info.nodes, phase=info.phase)
            acc = _check_buffer(w, name, buf, table, list(info.nodes))
            # and the table measured from the same map gives the same accounting
            measured = SegmentTable.from_page_map(r, c, f, memory.page_nodes(buf), BASE,
                                                  offset_bytes=buf.__array_interface__["data"][0] % BASE,
                                                  nodes=info.nodes)
            again = sim.layer_accounting(w, len(nodes), {name: measured})
            for p in ("a", "b", "c", "d"):
                np.testing.assert_array_equal(again.reads[p], acc.reads[p])
            reads_b = acc.reads["b"].sum(axis=0)
            remote_b += reads_b.sum() - np.trace(reads_b)
            del buf
    assert remote_b > 0  # the naive split does read across nodes here


def test_loaded_store_accounting_matches_its_pages(tmp_path, real_nodes):
    """The ExpertStore's own buffers and tables (as `numa-moe run` loads them)."""
    ck = make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 1, E, 3, progress=False)
    store = ExpertStore.load(ck, nodes=tuple(real_nodes), page="4k", progress=False)
    w = sim.workload_like("qwen3-30b-a3b", "bf16", "4k", layers=1, experts=E)
    layer = store.layers[0]
    for kind in ("gate", "up", "down"):
        table = store.table(layer, kind)
        _check_buffer(w, kind, store.weights(layer, kind), table, list(table.nodes))

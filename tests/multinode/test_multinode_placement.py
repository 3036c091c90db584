"""Placement against the real kernel on >= 2 NUMA nodes: the interleave rule, exactly,
for 4 KB and 2 MB pages at many phases and offsets; page migration; CPUs per node.

Expected nodes come from the kernel's rule written out here (not from numa_moe), so this
tier stands alone: an anonymous MPOL_INTERLEAVE mapping with 2 MiB-aligned vm_start puts
the page at address a on nodes[ilx % len(nodes)] (ascending node ids) with
ilx = a // page_bytes, truncated to 32 bits on kernels before 6.7 (offset_il_node's
`(unsigned int)n % nnodes`; 6.7+ interleave_nid uses the 64-bit ilx).
No torch in this file: the emulated guest takes 45 s to import it.
"""

import ctypes
import errno
import itertools
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from numa_moe.placement import memory
from numa_moe.placement.topology import Topology

BASE = 4096
HUGE = 2 << 20


def _truncating_kernel() -> bool:
    major, minor = (int("".join(c for c in x if c.isdigit()) or 0) for x in os.uname().release.split(".")[:2])
    return (major, minor) < (6, 7)


ILX_MASK = 0xFFFFFFFF if _truncating_kernel() else ~0


def expected_page_nodes(address: int, nbytes: int, nodes, page_bytes: int) -> np.ndarray:
    """Node of each 4 KB page covering [address, address+nbytes) by the interleave rule."""
    cycle = sorted(nodes)
    first = address // BASE
    last = (address + max(nbytes, 1) - 1) // BASE
    return np.array(
        [cycle[((p * BASE // page_bytes) & ILX_MASK) % len(cycle)] for p in range(first, last + 1)], dtype=np.int32
    )


def node_subsets(real_nodes):
    subsets = [tuple(real_nodes)]
    if len(real_nodes) >= 3:
        subsets += [tuple(real_nodes[1:]), (real_nodes[0], real_nodes[-1])]
    if len(real_nodes) >= 7:  # a non-power-of-two count beside the VM's 8
        subsets.append(tuple(real_nodes[:6]))
    return subsets


@pytest.mark.parametrize("dtype", ["bfloat16", np.float32, np.int8])
def test_interleave_4k_matches_rule_at_every_phase_and_offset(real_nodes, dtype, rng):
    for nodes in node_subsets(real_nodes):
        n = len(nodes)
        itemsize = memory.resolve_dtype(dtype).itemsize
        pages = 8 * n + int(rng.integers(1, 2 * n + 1))
        arr = memory.interleaved_empty(pages * BASE // itemsize, dtype, nodes=nodes, page="4k")
        whole = memory.page_nodes(arr)
        assert whole.shape == (pages,)
        address = arr.__array_interface__["data"][0]
        np.testing.assert_array_equal(whole, expected_page_nodes(address, arr.nbytes, nodes, BASE))
        # every node gets its share: the cycle really interleaves
        counts = {node: int(np.count_nonzero(whole == node)) for node in nodes}
        assert max(counts.values()) - min(counts.values()) <= 1, counts
        # views starting on each page of one cycle, at a page boundary and inside a page
        for start_page, inner in itertools.product(range(n + 1), (0, int(rng.integers(1, BASE // itemsize)) * itemsize)):
            start = (start_page * BASE + inner) // itemsize
            view = arr[start : start + int(rng.integers(1, 3 * n * BASE // itemsize))]
            info = memory.interleave_info(view)
            assert info is not None and info.nodes == tuple(sorted(nodes)) and info.page_bytes == BASE
            view_address = view.__array_interface__["data"][0]
            expect = expected_page_nodes(view_address, view.nbytes, nodes, BASE)
            got = memory.page_nodes(view)
            np.testing.assert_array_equal(got, expect)
            assert info.nodes[info.phase] == expect[0]
            by_phase = [info.nodes[(info.phase + p) % n] for p in range(len(expect))]
            np.testing.assert_array_equal(got, by_phase)
            pm = memory.page_map(view)
            assert pm.offset_bytes == view_address % BASE
            np.testing.assert_array_equal(pm.nodes, got)


def test_interleave_2m_matches_rule(real_nodes, rng):
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" in thp:
        pytest.skip("transparent huge pages are off in this kernel")
    for nodes in node_subsets(real_nodes):
        n = len(nodes)
        frames = 2 * n + 1
        arr = memory.interleaved_empty(frames * HUGE // 2, "bfloat16", nodes=nodes, page="2m")
        address = arr.__array_interface__["data"][0]
        assert address % HUGE == 0
        got = memory.page_nodes(arr)
        assert got.shape == (frames * HUGE // BASE,)
        np.testing.assert_array_equal(got, expected_page_nodes(address, arr.nbytes, nodes, HUGE))
        # runs of 512 same-node 4 KB pages
        assert all(len(set(got[f * 512 : (f + 1) * 512].tolist())) == 1 for f in range(frames))
        for start_frame in range(n + 1):
            offset = start_frame * HUGE + int(rng.integers(0, HUGE // 2)) * 2
            view = arr[offset // 2 : offset // 2 + HUGE]
            info = memory.interleave_info(view)
            assert info.page_bytes == HUGE
            expect = expected_page_nodes(view.__array_interface__["data"][0], view.nbytes, nodes, HUGE)
            np.testing.assert_array_equal(memory.page_nodes(view), expect)
            assert info.nodes[info.phase] == expect[0]


def test_4k_buffers_not_affected_by_numpy_or_thp_always(real_nodes):
    """numpy madvises its own large arrays HUGEPAGE and THP=always would do the same to any
    mapping; interleaved_empty(page='4k') sets NOHUGEPAGE, so the cycle stays per 4 KB."""
    arr = memory.interleaved_empty(16 << 20, np.uint8, page="4k")  # 16 MiB: 8 huge frames
    got = memory.page_nodes(arr)
    address = arr.__array_interface__["data"][0]
    np.testing.assert_array_equal(got, expected_page_nodes(address, arr.nbytes, real_nodes, BASE))
    counts = np.bincount(got, minlength=max(real_nodes) + 1)[list(real_nodes)]
    assert counts.max() - counts.min() <= 1


def test_migrate_pages_to_moves_pages(real_nodes, rng):
    arr = memory.interleaved_empty(32 * BASE // 4, np.float32, nodes=real_nodes, page="4k")
    arr[:] = rng.standard_normal(arr.shape).astype(np.float32)
    before = arr.copy()
    target = real_nodes[-1]
    result = memory.migrate_pages_to(arr, target)
    assert result.ok and result.moved_pages == 32 and result.requested_pages == 32
    np.testing.assert_array_equal(memory.page_nodes(arr), np.full(32, target))
    # a per-page pattern: reverse the interleave
    pattern = np.array([real_nodes[(len(real_nodes) - 1 - p) % len(real_nodes)] for p in range(32)], dtype=np.int32)
    result = memory.migrate_pages_to(arr, pattern)
    assert result.ok, result.failures
    np.testing.assert_array_equal(result.nodes, pattern)
    np.testing.assert_array_equal(memory.page_nodes(arr), pattern)
    np.testing.assert_array_equal(arr, before)  # contents survive the moves


def test_migrate_reports_pages_not_present(real_nodes):
    region = mmap.mmap(-1, 8 * BASE)  # never touched: no page present
    try:
        view = np.frombuffer(region, dtype=np.uint8)
        view[2 * BASE] = 1  # make exactly page 2 present
        result = memory.migrate_pages_to(view, real_nodes[-1])
        failed = {f.page_index: f.errno_name for f in result.failures}
        assert failed == {i: "ENOENT" for i in range(8) if i != 2}
        assert result.nodes[2] == real_nodes[-1]
        del view
    finally:
        region.close()


def test_mbind_rejects_node_outside_allowed(real_nodes):
    with pytest.raises(memory.PlacementError) as info:
        memory.interleaved_empty(1024, np.float32, nodes=[max(real_nodes) + 7])
    assert info.value.errno == errno.EINVAL and str(max(real_nodes) + 7) in str(info.value)


def _getcpu() -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    cpu, node = ctypes.c_uint(), ctypes.c_uint()
    if libc.getcpu(ctypes.byref(cpu), ctypes.byref(node)) != 0:
        raise OSError(ctypes.get_errno(), "getcpu")
    return cpu.value, node.value


def test_cpu_lists_per_node(real_nodes):
    topo = Topology.detect()
    assert not topo.is_virtual and len(topo.nodes) >= 2
    all_cpus = sorted(c for n in topo.nodes for c in n.cpus)
    assert len(all_cpus) == len(set(all_cpus)), "a CPU listed on two nodes"
    assert set(all_cpus) == set(range(os.cpu_count())), "online CPUs missing from the node lists"
    saved = os.sched_getaffinity(0)
    try:
        for node in topo.nodes:
            assert len(node.distances) == len(topo.nodes)
            assert node.distances[topo.node_ids.index(node.node_id)] == min(node.distances)
            for cpu in node.cpus:
                if cpu not in saved:
                    continue
                os.sched_setaffinity(0, {cpu})
                assert _getcpu() == (cpu, node.node_id)
    finally:
        os.sched_setaffinity(0, saved)

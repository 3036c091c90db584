"""numa_moe.placement.memory on the machine at hand (one node is enough): allocation, dtypes, torch
views, page maps of numpy/torch/mmap buffers, lifetime, error paths, and the pure
interleave-rule helpers. The exact multi-node placement is checked in tests/multinode."""

import errno
import gc
import mmap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from numa_moe import _native
from numa_moe.placement import memory
from numa_moe.placement.memory import PlacementError
from numa_moe.placement.topology import Topology

BASE = 4096
HUGE = 2 << 20
NODES = Topology.detect().allowed_nodes


def _addr(a):
    return a.__array_interface__["data"][0]


def _vm_flags(address):
    """VmFlags of the mapping holding `address`, read from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":") and len(head) >= 5:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError("address not mapped")


@pytest.mark.parametrize("dtype, np_dtype", [
    ("bfloat16", ml_dtypes.bfloat16), ("bf16", ml_dtypes.bfloat16), (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
    (np.float32, np.float32), ("float16", np.float16), (np.int8, np.int8), ("uint8", np.uint8),
])
def test_interleaved_empty_dtypes_and_contents(dtype, np_dtype, rng):
    shape = (int(rng.integers(1, 40)), int(rng.integers(1, 3000)))
    a = memory.interleaved_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(np_dtype) and a.flags.c_contiguous and a.flags.writeable
    assert _addr(a) % BASE == 0
    assert not np.any(a.view(np.uint8))  # fresh anonymous pages are zero
    values = rng.standard_normal(shape) * 50
    a[...] = values.astype(np_dtype)
    np.testing.assert_array_equal(a, values.astype(np_dtype))


def test_torch_dtypes_resolve():
    torch = pytest.importorskip("torch")
    assert memory.interleaved_empty(10, torch.bfloat16).dtype == np.dtype(ml_dtypes.bfloat16)
    assert memory.interleaved_empty(10, torch.float32).dtype == np.float32
    with pytest.raises(TypeError, match="complex64"):
        memory.interleaved_empty(10, torch.complex64)


def test_4k_and_2m_advice_and_alignment():
    a = memory.interleaved_empty(3 * HUGE, np.uint8, page="4k")
    flags = _vm_flags(_addr(a))
    assert "nh" in flags and "hg" not in flags  # NOHUGEPAGE: numpy's HUGEPAGE trap cannot apply
    info = memory.interleave_info(a)
    assert info.page_bytes == BASE and info.nodes == NODES and info.nbytes == a.nbytes and info.address == _addr(a)
    b = memory.interleaved_empty((3, HUGE // 4), np.float32, page="2m")
    assert _addr(b) % HUGE == 0
    assert "hg" in _vm_flags(_addr(b))
    info = memory.interleave_info(b[1])
    assert info.page_bytes == HUGE and info.address == _addr(b) + HUGE
    assert info.phase == memory.interleave_position(info.address // HUGE, len(NODES))
    assert np.all(memory.page_nodes(b) == NODES[0]) if len(NODES) == 1 else True


def test_mbind_policy_is_interleave_over_the_nodes():
    a = memory.interleaved_empty(10 * BASE, np.uint8)
    mode, nodes = _native.get_mempolicy(_addr(a))
    assert mode == _native.MPOL_INTERLEAVE and nodes == NODES
    assert memory.interleave_info(np.zeros(10)) is None  # default policy: no interleave


def test_zero_size_array():
    a = memory.interleaved_empty((0, 7), np.float32)
    assert a.shape == (0, 7)


def test_torch_view_is_zero_copy(rng):
    torch = pytest.importorskip("torch")
    a = memory.interleaved_empty((64, 96), "bfloat16")
    values = rng.standard_normal(a.shape).astype(np.float32)
    a[...] = values.astype(ml_dtypes.bfloat16)
    t = memory.as_torch(a)
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == a.shape and t.data_ptr() == _addr(a)
    np.testing.assert_array_equal(t.float().numpy(), a.astype(np.float32))
    t[3, 5] = 7.0
    assert float(a[3, 5]) == 7.0  # writes through the view land in the mapping
    f = memory.interleaved_empty(100, np.float32)
    tf = memory.as_torch(f)
    assert tf.dtype == torch.float32 and tf.data_ptr() == _addr(f)
    assert memory.interleave_info(t[1:]).address == _addr(a) + a.shape[1] * 2
    with pytest.raises(TypeError, match="numpy array"):
        memory.as_torch([1, 2])


def test_lifetime_unmaps_when_last_view_dies():
    gc.collect()
    live = _native.live_interleaved_mappings()
    a = memory.interleaved_empty((128, 1024), np.float32)
    address = _addr(a)
    view = a[5:9]
    assert _native.live_interleaved_mappings() == live + 1
    del a
    gc.collect()
    assert _native.live_interleaved_mappings() == live + 1  # the slice keeps it alive
    view[...] = 1.0
    del view
    gc.collect()
    assert _native.live_interleaved_mappings() == live
    assert memory.page_nodes(np.frombuffer(b"x", np.uint8)).size == 1
    status = _native.page_nodes(address, BASE)
    assert status[0] == -errno.EFAULT or status[0] == -errno.ENOENT  # unmapped now


def test_torch_view_keeps_mapping_alive():
    torch = pytest.importorskip("torch")
    gc.collect()
    live = _native.live_interleaved_mappings()
    a = memory.interleaved_empty(1000, "bfloat16")
    t = memory.as_torch(a)
    del a
    gc.collect()
    assert _native.live_interleaved_mappings() == live + 1
    t.fill_(2.0)
    assert float(t.float().sum()) == 2000.0
    del t
    gc.collect()
    assert _native.live_interleaved_mappings() == live


def test_page_nodes_numpy_torch_and_offsets():
    a = memory.interleaved_empty(5 * BASE + 100, np.uint8)
    assert memory.page_nodes(a).shape == (6,)
    assert set(memory.page_nodes(a).tolist()) <= set(NODES)
    view = a[BASE - 10 : BASE + 20]  # straddles two pages
    pm = memory.page_map(view)
    assert pm.nodes.shape == (2,) and pm.offset_bytes == BASE - 10 and pm.page_bytes == BASE
    assert pm.address == _addr(a) + BASE - 10
    strided = a[::BASE]  # spans pages 0..5 from the first to the last element
    assert memory.page_nodes(strided).shape == (6,)
    torch = pytest.importorskip("torch")
    t = memory.as_torch(a)
    np.testing.assert_array_equal(memory.page_nodes(t), memory.page_nodes(a))
    assert memory.page_nodes(t[BASE:2 * BASE]).shape == (1,)
    assert memory.page_nodes(torch.empty(0)).size == 0


def test_page_nodes_not_present_pages_are_enoent():
    region = mmap.mmap(-1, 6 * BASE)
    try:
        view = np.frombuffer(region, dtype=np.uint8)
        got = memory.page_nodes(region)
        np.testing.assert_array_equal(got, np.full(6, -errno.ENOENT))  # not node 0
        view[3 * BASE + 1] = 9
        got = memory.page_nodes(memoryview(region))
        assert got[3] in NODES and all(got[i] == -errno.ENOENT for i in (0, 1, 2, 4, 5))
        del view
    finally:
        region.close()


def test_page_nodes_mmapped_file(tmp_path, rng):
    path = tmp_path / "weights.bin"
    data = rng.integers(0, 255, 7 * BASE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        arr = np.frombuffer(m, dtype=np.uint8)
        assert int(arr[::BASE].astype(np.int64).sum()) == int(data[::BASE].astype(np.int64).sum())  # touch
        got = memory.page_nodes(m)
        assert got.shape == (7,) and set(got.tolist()) <= set(NODES)
        assert memory.interleave_info(m) is None or memory.interleave_info(m).nodes
        del arr


def test_migrate_pages_to_own_node_and_reports(rng):
    a = memory.interleaved_empty(8 * BASE // 4, np.float32)
    a[...] = rng.standard_normal(a.shape)
    before = a.copy()
    r = memory.migrate_pages_to(a, NODES[0])
    assert r.ok and r.moved_pages == r.requested_pages == 8
    np.testing.assert_array_equal(r.nodes, np.full(8, NODES[0]))
    np.testing.assert_array_equal(a, before)
    with pytest.raises(ValueError, match="3 target nodes for 8 pages"):
        memory.migrate_pages_to(a, [NODES[0]] * 3)
    with pytest.raises(PlacementError, match="node 4000") as info:
        memory.migrate_pages_to(a, 4000)
    assert info.value.call == "move_pages" and info.value.errno == errno.EINVAL
    region = mmap.mmap(-1, 4 * BASE)
    try:
        r = memory.migrate_pages_to(region, NODES[0])
        assert [(f.page_index, f.errno_name, f.errno) for f in r.failures] == [(i, "ENOENT", errno.ENOENT) for i in range(4)]
        assert not r.ok and r.moved_pages == 0
    finally:
        region.close()


@pytest.mark.parametrize("nodes, match", [([4000], "node 4000 does not exist"), ([-1], "node -1"), ([], "empty")])
def test_bad_nodes(nodes, match):
    with pytest.raises(PlacementError, match=match) as info:
        memory.interleaved_empty(100, np.float32, nodes=nodes)
    assert info.value.call == "mbind" and info.value.errno == errno.EINVAL
    assert isinstance(info.value, OSError)


def test_native_mbind_error_carries_errno():
    with pytest.raises(_native.SyscallError) as info:
        _native.InterleavedMapping(BASE, [1000], False, 1)
    assert info.value.errno == errno.EINVAL and info.value.call == "mbind" and "1000" in str(info.value)


def test_bad_dtype_page_shape():
    with pytest.raises(TypeError, match="unsupported dtype 'nonsense'"):
        memory.interleaved_empty(10, "nonsense")
    with pytest.raises(TypeError, match="object"):
        memory.interleaved_empty(10, object)
    with pytest.raises(ValueError, match="interleaved_empty: page must be '4k' or '2m', got '1g'"):
        memory.interleaved_empty(10, np.float32, page="1g")
    with pytest.raises(ValueError, match="non-negative"):
        memory.interleaved_empty((-1, 3), np.float32)
    with pytest.raises(TypeError, match="buffer-protocol"):
        memory.page_nodes("not a buffer")


def test_interleave_rule_helpers():
    # pre-6.7 kernels truncate the interleave index to 32 bits before `% n`
    assert memory.kernel_truncates_interleave_index("6.1.0-57-amd64")
    assert not memory.kernel_truncates_interleave_index("6.18.44-fc")
    assert not memory.kernel_truncates_interleave_index("7.0.1")
    ilx = (0x7FA93445E000 >> 12) + 1
    assert memory.interleave_position(ilx, 3, truncate_32=False) == ilx % 3
    assert memory.interleave_position(ilx, 3, truncate_32=True) == (ilx % 2**32) % 3
    assert memory.interleave_position(ilx, 3, truncate_32=True) != memory.interleave_position(ilx, 3, truncate_32=False)
    assert memory.interleave_position(ilx, 4, truncate_32=True) == memory.interleave_position(ilx, 4, truncate_32=False)
    # anonymous VMA: vm_pgoff = vm_start >> 12; the index is the page (or 2 MiB frame) number
    start = 0x7F0000200000
    assert memory.interleave_index(start + 5 * BASE + 7, start, start >> 12, BASE) == (start >> 12) + 5
    assert memory.interleave_index(start + 3 * HUGE + 9, start, start >> 12, HUGE) == (start >> 21) + 3
    # a VMA not aligned to 2 MiB shifts the huge-page index
    odd = start - BASE
    assert memory.interleave_index(start + HUGE, odd, odd >> 12, HUGE) == (odd >> 21) + 1


def test_resident_pages_of_a_file_mapping_without_touching(tmp_path):
    import mmap

    page = 4096
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng().integers(0, 255, 8 * page, dtype=np.uint8).tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 8 * page, prot=mmap.PROT_READ)
    try:
        view = np.frombuffer(mm, dtype=np.uint8)
        resident = memory.resident_pages(view)
        assert resident.dtype == bool and resident.shape == (8,)
        # just written, so the file sits in the page cache: mincore reports it resident
        # even though this process never touched the mapping.
        assert resident.all()
        assert (memory.page_nodes(view) < 0).all()  # not mapped into this process yet
        del view
    finally:
        mm.close()


def test_resident_pages_of_untouched_anonymous_memory():
    import mmap

    mm = mmap.mmap(-1, 4 * 4096)
    view = np.frombuffer(mm, dtype=np.uint8)
    assert not memory.resident_pages(view).any()
    view[4096] = 1
    assert memory.resident_pages(view).tolist() == [False, True, False, False]
    del view
    mm.close()


def test_zero_byte_buffers_cover_no_pages():
    torch = pytest.importorskip("torch")
    # page_nodes and page_map agree with resident_pages: zero bytes lie on zero pages
    # (a zero-byte numpy array still has a heap address, which used to count as 1 page).
    for buffer in (np.zeros(0, np.float32), np.zeros((4, 0), np.uint8), torch.zeros(0)):
        assert memory.page_nodes(buffer).shape == (0,)
        assert memory.resident_pages(buffer).shape == (0,)
        assert memory.page_map(buffer).nodes.shape == (0,)


def test_sizes_past_the_address_space_are_named():
    with pytest.raises(ValueError, match=r"interleaved_empty: .*bytes"):
        memory.interleaved_empty((1 << 40, 1 << 40), np.uint8)
    # a range that wraps around the end of the address space is an error, not zero pages
    with pytest.raises(ValueError, match="wraps"):
        _native.page_nodes((1 << 64) - 4096, 8192)
    with pytest.raises(ValueError, match="wraps"):
        _native.move_pages((1 << 64) - 4096, 8192, np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="wraps"):
        _native.resident_pages((1 << 64) - 4096, 8192)
    # the last page of the address space: counted, not a pointer walk that wraps to 0
    assert _native.page_nodes((1 << 64) - 4096, 4095).shape == (1,)

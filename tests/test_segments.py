"""Segment tables: paper periods, exact partition, node placement, measured maps, JSON.

The independent reference throughout is a per-element node map computed straight from
the byte address of each element (``_element_nodes``), not from the table code.
"""

import dataclasses
import json
import re
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numa_moe.placement import segments as sg
from numa_moe.formats import WEIGHT_FORMATS, nibble_packed
from numa_moe.placement.segments import (SCHEMA, Segment, SegmentTable, SegmentTableFormatError, period_rows, scale_shape, scales_table)

KIB = 1024
MIB = 1024 * 1024


# --------------------------------------------------------------------------- reference


def _interleave_map(n_pages, nodes, phase):
    nodes = np.asarray(nodes, dtype=np.int64)
    return nodes[(phase + np.arange(n_pages)) % len(nodes)]


def _n_pages(rows, cols, fmt, page_bytes, offset_bytes):
    row_bytes = cols * WEIGHT_FORMATS[fmt].bits_per_element // 8
    return (offset_bytes + rows * row_bytes - 1) // page_bytes + 1


def _element_nodes(rows, cols, fmt, page_bytes, offset_bytes, page_node):
    """Node of every element, from its byte address (element k of an int4 row is in
    byte k // 2 of the row)."""
    bits = WEIGHT_FORMATS[fmt].bits_per_element
    row_bytes = cols * bits // 8
    byte = (np.arange(rows)[:, None] * row_bytes
            + (np.arange(cols)[None, :] * bits) // 8)
    # The last byte of a multi-byte element must be on the same page as its first.
    last = byte + max(bits // 8, 1) - 1
    assert np.array_equal((offset_bytes + byte) // page_bytes,
                          (offset_bytes + last) // page_bytes)
    return np.asarray(page_node)[(offset_bytes + byte) // page_bytes]


def _table_nodes(table):
    """Per-element node from the table's segments; -1 uncovered; asserts no overlap."""
    owner = np.full((table.rows, table.cols), -1, dtype=np.int64)
    for node, segs in table.segments.items():
        for s in segs:
            rows = s.row0 + s.row_stride * np.arange(s.nrows)
            block = owner[rows, s.k0:s.k1]
            assert np.all(block == -1), f"segment {s} of node {node} overlaps another"
            owner[rows, s.k0:s.k1] = node
    return owner


def _assert_exact(table, page_node, offset_bytes=0):
    ref = _element_nodes(table.rows, table.cols, table.fmt, table.page_bytes, offset_bytes,
                         page_node)
    got = _table_nodes(table)
    assert np.all(got >= 0), "some element is not covered by any segment"
    np.testing.assert_array_equal(got, ref)
    table.check()
    # Canonical form: one-row segments have stride 1, strided ones use the period.
    for segs in table.segments.values():
        for s in segs:
            if s.nrows == 1:
                assert s.row_stride == 1
            else:
                assert s.row_stride == table.period_rows


# --------------------------------------------------------------------------- strategies


@st.composite
def matrices(draw, max_rows=40, max_cols=48):
    fmt = draw(st.sampled_from(sorted(WEIGHT_FORMATS)))
    elem = WEIGHT_FORMATS[fmt].element_bytes
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.integers(1, max_cols))
    if nibble_packed(fmt):
        cols = 2 * cols
    page_bytes = draw(st.sampled_from([p for p in (4, 8, 16, 32, 64, 128) if p >= elem]))
    offset_bytes = draw(st.integers(0, page_bytes // elem - 1)) * elem
    nodes = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True))
    phase = draw(st.integers(0, len(nodes) - 1))
    return dict(rows=rows, cols=cols, fmt=fmt, page_bytes=page_bytes,
                offset_bytes=offset_bytes, nodes=tuple(nodes), phase=phase)


def _random_map(draw, n_pages, nodes, allow_missing=True):
    if draw(st.booleans()):
        # Runs of same-node pages (folios / partly periodic) rather than pure noise.
        run = draw(st.integers(1, 6))
        base = draw(st.lists(st.sampled_from(nodes), min_size=n_pages // run + 1,
                             max_size=n_pages // run + 1))
        page_node = np.repeat(np.asarray(base), run)[:n_pages]
    else:
        page_node = np.asarray(draw(st.lists(st.sampled_from(nodes), min_size=n_pages,
                                             max_size=n_pages)))
    page_node = page_node.astype(np.int64)
    if allow_missing and draw(st.booleans()):
        holes = draw(st.lists(st.integers(0, n_pages - 1), max_size=3))
        page_node[holes] = -2  # -ENOENT from move_pages
    return page_node


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- invariants


@SETTINGS
@given(matrices())
def test_theoretical_is_an_exact_partition_on_the_right_nodes(m):
    table = SegmentTable.theoretical(m["rows"], m["cols"], m["fmt"], m["page_bytes"],
                                     m["nodes"], phase=m["phase"],
                                     offset_bytes=m["offset_bytes"])
    n_pages = _n_pages(m["rows"], m["cols"], m["fmt"], m["page_bytes"], m["offset_bytes"])
    _assert_exact(table, _interleave_map(n_pages, m["nodes"], m["phase"]), m["offset_bytes"])
    assert table.source == "theoretical"
    assert table.nodes == tuple(sorted(m["nodes"]))
    row_bytes = WEIGHT_FORMATS[m["fmt"]].row_bytes(m["cols"])
    formula = period_rows(row_bytes, m["page_bytes"], len(m["nodes"]))
    if table.period_rows is not None:
        # The detected period never exceeds the formula's, and equals it once the
        # matrix holds two full periods (Fine and Wilf) with >= 2 nodes.
        assert table.period_rows <= formula
        if len(m["nodes"]) >= 2 and m["rows"] >= 2 * formula:
            assert table.period_rows == formula
    else:
        assert all(s.nrows == 1 for segs in table.segments.values() for s in segs)


@SETTINGS
@given(matrices(), st.integers(0, 3))
def test_measured_map_of_interleave_equals_theoretical(m, extra_pages):
    n_pages = _n_pages(m["rows"], m["cols"], m["fmt"], m["page_bytes"], m["offset_bytes"])
    page_node = _interleave_map(n_pages + extra_pages, m["nodes"], m["phase"])
    theo = SegmentTable.theoretical(m["rows"], m["cols"], m["fmt"], m["page_bytes"],
                                    m["nodes"], phase=m["phase"],
                                    offset_bytes=m["offset_bytes"])
    measured = SegmentTable.from_page_map(m["rows"], m["cols"], m["fmt"], page_node,
                                          m["page_bytes"], offset_bytes=m["offset_bytes"],
                                          nodes=m["nodes"])
    assert measured == theo
    assert measured.source == "measured" and measured.pages_not_present == 0
    assert measured.to_dict()["segments"] == theo.to_dict()["segments"]


@SETTINGS
@given(matrices(max_rows=24), st.integers(1, 5), st.data())
def test_huge_pages_seen_through_small_page_map(m, log_ratio, data):
    """A 2 MB interleave measured as a 4 KB map (here scaled down: pages of P*2^j
    observed at P) gives the same layout as the theoretical table at the big page."""
    small = m["page_bytes"]
    big = small << log_ratio
    elem = WEIGHT_FORMATS[m["fmt"]].element_bytes
    offset_big = data.draw(st.integers(0, big // elem - 1)) * elem
    theo = SegmentTable.theoretical(m["rows"], m["cols"], m["fmt"], big, m["nodes"],
                                    phase=m["phase"], offset_bytes=offset_big)
    first_small_page = offset_big // small
    n_small = _n_pages(m["rows"], m["cols"], m["fmt"], small, offset_big % small)
    small_pages = first_small_page + np.arange(n_small)
    page_node = np.asarray(m["nodes"])[(m["phase"] + small_pages * small // big)
                                       % len(m["nodes"])]
    measured = SegmentTable.from_page_map(m["rows"], m["cols"], m["fmt"], page_node, small,
                                          offset_bytes=offset_big % small, nodes=m["nodes"])
    assert measured == theo
    _assert_exact(measured, page_node, offset_big % small)


@SETTINGS
@given(matrices(), st.data())
def test_measured_random_map_is_exact(m, data):
    n_pages = _n_pages(m["rows"], m["cols"], m["fmt"], m["page_bytes"], m["offset_bytes"])
    page_node = _random_map(data.draw, n_pages, list(m["nodes"]))
    table = SegmentTable.from_page_map(m["rows"], m["cols"], m["fmt"], page_node,
                                       m["page_bytes"], offset_bytes=m["offset_bytes"],
                                       nodes=m["nodes"])
    missing = page_node < 0
    assert table.pages_not_present == int(missing.sum())
    filled = np.where(missing, min(m["nodes"]), page_node)
    _assert_exact(table, filled, m["offset_bytes"])
    # Whatever the period, it is the smallest one that holds over the whole matrix.
    owner = _table_nodes(table)
    if table.period_rows is not None:
        p = table.period_rows
        np.testing.assert_array_equal(owner[p:], owner[:-p])
    # Runs are maximal same-node ranges, so equal node maps mean equal run lists: no
    # smaller shift may leave the map unchanged.
    for p in range(1, table.period_rows or table.rows // 2 + 1):
        assert not np.array_equal(owner[p:], owner[:-p])


@SETTINGS
@given(matrices(max_rows=60), st.data())
def test_slice_rows_equals_recomputation_on_the_submatrix(m, data):
    n_pages = _n_pages(m["rows"], m["cols"], m["fmt"], m["page_bytes"], m["offset_bytes"])
    if data.draw(st.booleans()):
        page_node = _interleave_map(n_pages, m["nodes"], m["phase"])
        table = SegmentTable.theoretical(m["rows"], m["cols"], m["fmt"], m["page_bytes"],
                                         m["nodes"], phase=m["phase"],
                                         offset_bytes=m["offset_bytes"])
    else:
        page_node = _random_map(data.draw, n_pages, list(m["nodes"]))
        table = SegmentTable.from_page_map(m["rows"], m["cols"], m["fmt"], page_node,
                                           m["page_bytes"], offset_bytes=m["offset_bytes"],
                                           nodes=m["nodes"])
    start = data.draw(st.integers(0, m["rows"] - 1))
    stop = data.draw(st.integers(start + 1, m["rows"]))
    sub = table.slice_rows(start, stop)
    row_bytes = WEIGHT_FORMATS[m["fmt"]].row_bytes(m["cols"])
    first_byte = m["offset_bytes"] + start * row_bytes
    own_map = page_node[first_byte // m["page_bytes"]:]
    again = SegmentTable.from_page_map(stop - start, m["cols"], m["fmt"], own_map,
                                       m["page_bytes"],
                                       offset_bytes=first_byte % m["page_bytes"],
                                       nodes=table.nodes)
    assert sub == again
    filled = np.where(own_map < 0, min(m["nodes"]), own_map)
    _assert_exact(sub, filled, first_byte % m["page_bytes"])


@SETTINGS
@given(matrices(), st.data())
def test_json_round_trip(m, data):
    if data.draw(st.booleans()):
        table = SegmentTable.theoretical(m["rows"], m["cols"], m["fmt"], m["page_bytes"],
                                         m["nodes"], phase=m["phase"],
                                         offset_bytes=m["offset_bytes"])
    else:
        n_pages = _n_pages(m["rows"], m["cols"], m["fmt"], m["page_bytes"],
                           m["offset_bytes"])
        table = SegmentTable.from_page_map(m["rows"], m["cols"], m["fmt"],
                                           _random_map(data.draw, n_pages, list(m["nodes"])),
                                           m["page_bytes"], offset_bytes=m["offset_bytes"],
                                           nodes=m["nodes"])
    back = SegmentTable.from_json(table.to_json())
    assert back == table
    assert SegmentTable.from_json(table.to_json(pretty=True)).to_dict() == table.to_dict()
    assert back.to_dict() == table.to_dict()
    assert (back.source, back.page_bytes, back.pages_not_present) == \
        (table.source, table.page_bytes, table.pages_not_present)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=200))
def test_smallest_period_matches_brute_force(seq):
    ids = np.asarray(seq, dtype=np.int64)
    n = len(ids)
    brute = next((p for p in range(1, n) if np.array_equal(ids[p:], ids[:n - p])), n)
    assert sg.smallest_period(ids) == brute


def test_smallest_period_long_near_periodic_sequence():
    """One odd entry at the end: many candidates survive the prefix filter, so the
    exact O(n) path runs; it must still answer 'no period' quickly."""
    ids = np.zeros(200_000, dtype=np.int64)
    ids[-1] = 1
    t0 = time.perf_counter()
    assert sg.smallest_period(ids) == len(ids)
    assert time.perf_counter() - t0 < 5.0
    ids2 = np.tile(np.array([3, 1, 4, 1, 5]), 40_000)
    assert sg.smallest_period(ids2) == 5


# --------------------------------------------------------------------------- paper check


# (K = cols, bits, page_bytes, nodes) -> T, derived by hand from
# T = page_bytes * N / gcd(row_bytes, page_bytes * N), row_bytes = K * bits / 8.
PAPER_PERIODS = [
    # 2 nodes, 4 KB, BF16 (the paper's T_x = 2048 N / gcd(K, 2048 N)), cycle 8192 B:
    (4096, 16, 4 * KIB, 2, 1),      # Mixtral gate/up: 8192 B rows = one cycle
    (14336, 16, 4 * KIB, 2, 2),     # Mixtral down: 28672 = 7 * 4096, gcd 4096 -> 2
    (2048, 16, 4 * KIB, 2, 2),      # Qwen3-30B gate/up: 4096 B, gcd 4096 -> 2
    (768, 16, 4 * KIB, 2, 16),      # Qwen3-30B down: 1536 = 3 * 512, gcd 512 -> 16
    # 4 nodes, 4 KB, BF16: cycle 16384 B
    (4096, 16, 4 * KIB, 4, 2),      # 8192 B: gcd 8192 -> 2
    (14336, 16, 4 * KIB, 4, 4),     # 28672: gcd 4096 -> 4
    (2048, 16, 4 * KIB, 4, 4),      # 4096: gcd 4096 -> 4
    (768, 16, 4 * KIB, 4, 32),      # 1536: gcd 512 -> 32
    # 2 nodes, 4 KB, INT8 (row_bytes = K), cycle 8192 B
    (4096, 8, 4 * KIB, 2, 2),       # 4096 -> 2
    (14336, 8, 4 * KIB, 2, 4),      # 14336 = 7 * 2048 -> 4
    (2048, 8, 4 * KIB, 2, 4),       # 2048 -> 4
    (768, 8, 4 * KIB, 2, 32),       # 768 = 3 * 256 -> 32
    # 2 nodes, 4 KB, INT4 (row_bytes = K / 2)
    (4096, 4, 4 * KIB, 2, 4),       # 2048 -> 4
    (14336, 4, 4 * KIB, 2, 8),      # 7168 = 7 * 1024 -> 8
    (2048, 4, 4 * KIB, 2, 8),       # 1024 -> 8
    (768, 4, 4 * KIB, 2, 64),       # 384 = 3 * 128 -> 64
    # 2 nodes, 2 MB huge pages, BF16: cycle 4 MiB = 4194304 B, T grows by 512x
    (4096, 16, 2 * MIB, 2, 512),    # 8192 -> 512
    (14336, 16, 2 * MIB, 2, 1024),  # 28672: gcd 4096 -> 1024
    (2048, 16, 2 * MIB, 2, 1024),   # 4096 -> 1024
    (768, 16, 2 * MIB, 2, 8192),    # 1536: gcd 512 -> 8192
]
_BITS_TO_FMT = {16: "bf16", 8: "int8", 4: "int4"}


@pytest.mark.parametrize("cols,bits,page_bytes,n_nodes,expected", PAPER_PERIODS)
def test_paper_periods(cols, bits, page_bytes, n_nodes, expected):
    fmt = _BITS_TO_FMT[bits]
    row_bytes = WEIGHT_FORMATS[fmt].row_bytes(cols)
    assert period_rows(row_bytes, page_bytes, n_nodes) == expected
    # The table of a matrix with a few periods of rows detects the same period.
    rows = 3 * expected
    table = SegmentTable.theoretical(rows, cols, fmt, page_bytes, n_nodes)
    assert table.period_rows == expected
    table.check()


@pytest.mark.parametrize("rows,cols,expected", [
    (14336, 4096, 1),   # Mixtral-8x7B w1/w3 [I, H]
    (4096, 14336, 2),   # Mixtral-8x7B w2 [H, I]
    (768, 2048, 2),     # Qwen3-30B-A3B gate/up
    (2048, 768, 16),    # Qwen3-30B-A3B down
])
def test_paper_model_shapes_bf16_two_nodes(rows, cols, expected):
    table = SegmentTable.theoretical(rows, cols, "bf16", 4 * KIB, (0, 1))
    assert table.period_rows == expected
    assert table.bytes_per_node() == {0: rows * cols, 1: rows * cols}  # bf16: 2 B, half each
    assert table.balance() == 1.0


def test_mixtral_down_two_nodes_segment_listing():
    # Row = 28672 B = 7 pages; row 0 is pages 0..6 (0,2,4,6 on node 0, 1,3,5 on node 1),
    # row 1 is pages 7..13 (7,9,11,13 on node 1): each page is 2048 bf16 elements.
    table = SegmentTable.theoretical(4096, 14336, "bf16", 4 * KIB, 2)
    ks = [(0, 2048), (2048, 4096), (4096, 6144), (6144, 8192), (8192, 10240),
          (10240, 12288), (12288, 14336)]
    even, odd = ks[0::2], ks[1::2]
    expect0 = [Segment(0, 2, 2048, *k) for k in even] + [Segment(1, 2, 2048, *k) for k in odd]
    expect1 = [Segment(0, 2, 2048, *k) for k in odd] + [Segment(1, 2, 2048, *k) for k in even]
    assert table.segments[0] == tuple(expect0)
    assert table.segments[1] == tuple(expect1)
    arr = table.node_array(0)
    assert arr.dtype == np.int64 and arr.shape == (7, 5) and arr.flags.c_contiguous
    np.testing.assert_array_equal(arr[0], [0, 2, 2048, 0, 2048])


def test_phase_swaps_nodes():
    a = SegmentTable.theoretical(4096, 14336, "bf16", 4 * KIB, (0, 1), phase=0)
    b = SegmentTable.theoretical(4096, 14336, "bf16", 4 * KIB, (0, 1), phase=1)
    assert a.segments[0] == b.segments[1] and a.segments[1] == b.segments[0]
    # Interleave order (1, 0) at phase 0 is the same as (0, 1) at phase 1.
    assert SegmentTable.theoretical(4096, 14336, "bf16", 4 * KIB, (1, 0)) == b


def test_offset_inside_first_page_by_hand():
    # K=4096 bf16 = 8192 B rows, matrix starting 2048 B into a page, 2 nodes: row 0 is
    # [2048, 10240) in page space: 1024 elements on page 0 (node 0), 2048 on page 1
    # (node 1), 1024 on page 2 (node 0); every row repeats that (T = 1).
    table = SegmentTable.theoretical(10, 4096, "bf16", 4 * KIB, 2, offset_bytes=2048)
    assert table.period_rows == 1
    assert table.segments[0] == (Segment(0, 1, 10, 0, 1024), Segment(0, 1, 10, 3072, 4096))
    assert table.segments[1] == (Segment(0, 1, 10, 1024, 3072),)


def test_int4_boundaries_are_whole_elements_from_bytes():
    # K=14336 int4 = 7168 B rows, 2 nodes, T = 8. Row 0: page 0 = bytes [0, 4096) =
    # elements [0, 8192) on node 0, then 3072 B = elements [8192, 14336) on node 1.
    table = SegmentTable.theoretical(64, 14336, "int4", 4 * KIB, 2)
    assert table.period_rows == 8
    row0 = sorted((s.k0, s.k1, n) for n, segs in table.segments.items()
                  for s in segs if s.row0 == 0)
    assert row0 == [(0, 8192, 0), (8192, 14336, 1)]
    # Not the bf16 table with another dtype: bf16 at the same K has T = 2.
    assert SegmentTable.theoretical(64, 14336, "bf16", 4 * KIB, 2).period_rows == 2
    assert table.bytes_per_node()[0] + table.bytes_per_node()[1] == 64 * 7168


def test_huge_pages_mixtral_down_whole_rows_mostly():
    # 2 MB pages: 2 MiB / 28672 B = 73.1 rows per folio, T = 1024 rows = 14 folios.
    table = SegmentTable.theoretical(4096, 14336, "bf16", 2 * MIB, 2)
    assert table.period_rows == 1024
    full_rows = sum(1 for segs in table.segments.values() for s in segs
                    if s.k0 == 0 and s.k1 == 14336)
    split = sum(1 for segs in table.segments.values() for s in segs
                if not (s.k0 == 0 and s.k1 == 14336))
    # Folio boundaries inside the period lie at k * 2 MiB, k = 1..13; k * 2097152 is a
    # multiple of 28672 = 7 * 4096 only for k = 7, so 12 boundaries split a row in two.
    assert full_rows == 1024 - 12 and split == 2 * 12
    assert table.balance() == pytest.approx(1.0)


def test_scales_have_their_own_table():
    # Mixtral down int8 with group 128 scales in fp32: scales are 4096 x 112 fp32 =
    # 448 B rows; T = 8192 / gcd(448, 8192) = 8192 / 64 = 128 rows.
    weights = SegmentTable.theoretical(4096, 14336, "int8", 4 * KIB, 2)
    scales = scales_table(4096, 14336, 128, "fp32", 4 * KIB, 2)
    assert scale_shape(4096, 14336, 128) == (4096, 112)
    assert weights.period_rows == 4
    assert scales.period_rows == 128
    assert (scales.rows, scales.cols, scales.fmt) == (4096, 112, "fp32")
    assert sum(scales.bytes_per_node().values()) == 4096 * 112 * 4
    # bf16 scales: 224 B rows -> gcd(224, 8192) = 32 -> T = 256.
    assert scales_table(4096, 14336, 128, "bf16", 4 * KIB, 2).period_rows == 256
    with pytest.raises(ValueError, match="multiple of the scale group"):
        scales_table(4096, 14336, 100, "fp32", 4 * KIB, 2)
    with pytest.raises(ValueError, match="scale dtype"):
        scales_table(4096, 14336, 128, "int8", 4 * KIB, 2)


def test_four_node_mixtral_down_balance_and_exactness():
    table = SegmentTable.theoretical(64, 14336, "bf16", 4 * KIB, 4, phase=3)
    assert table.period_rows == 4
    n_pages = _n_pages(64, 14336, "bf16", 4 * KIB, 0)
    _assert_exact(table, _interleave_map(n_pages, range(4), 3))
    # 64 rows * 7 pages = 448 pages, 112 per node.
    assert table.bytes_per_node() == {n: 112 * 4096 for n in range(4)}


# --------------------------------------------------------------------------- measured maps


def test_mixtral_down_measured_4k_and_2m_maps_build_fast():
    rows, cols = 4096, 14336  # 112 MiB bf16 = 28672 pages of 4 KB
    pages = np.arange(28672)
    t0 = time.perf_counter()
    t4k = SegmentTable.from_page_map(rows, cols, "bf16", (pages % 2).astype(np.int32), 4 * KIB)
    t_4k = time.perf_counter() - t0
    t0 = time.perf_counter()
    t2m = SegmentTable.from_page_map(rows, cols, "bf16", ((pages // 512) % 2).astype(np.int32),
                                     4 * KIB)
    t_2m = time.perf_counter() - t0
    assert t4k == SegmentTable.theoretical(rows, cols, "bf16", 4 * KIB, 2)
    assert t2m == SegmentTable.theoretical(rows, cols, "bf16", 2 * MIB, 2)
    assert t4k.period_rows == 2 and t2m.period_rows == 1024
    # Well under a second on a laptop; generous bound for a loaded CI box.
    assert t_4k < 1.0 and t_2m < 1.0, (t_4k, t_2m)


def test_moved_page_falls_back_to_explicit_segments():
    rows, cols = 4096, 14336
    page_node = np.arange(28672) % 2
    page_node[20000] = 1 - page_node[20000]  # e.g. NUMA balancing moved one page
    t0 = time.perf_counter()
    table = SegmentTable.from_page_map(rows, cols, "bf16", page_node, 4 * KIB)
    assert time.perf_counter() - t0 < 2.0
    assert table.period_rows is None
    assert all(s.nrows == 1 and s.row_stride == 1
               for segs in table.segments.values() for s in segs)
    table.check()
    # The row holding page 20000 (28672 B rows = 7 pages: row 2857) now has the moved
    # page merged with its neighbours.
    assert table.bytes_per_node() == {0: 14336 * 4096 - 4096, 1: 14336 * 4096 + 4096}


def test_pages_not_present_go_to_lowest_node_and_are_counted():
    page_node = np.array([1, -2, 1, 3, -2, 3], dtype=np.int32)
    table = SegmentTable.from_page_map(6, 4096, "int8", page_node, 4 * KIB)
    assert table.nodes == (1, 3)
    assert table.pages_not_present == 2
    _assert_exact(table, np.array([1, 1, 1, 3, 1, 3]))
    given = SegmentTable.from_page_map(6, 4096, "int8", page_node, 4 * KIB, nodes=(0, 1, 3))
    assert given.pages_not_present == 2
    assert given.bytes_per_node() == {0: 2 * 4096, 1: 2 * 4096, 3: 2 * 4096}


def test_stacked_experts_slice_across_periods():
    # Qwen3-30B down stacked as [E * 2048, 768] has T = 16 dividing 2048: every expert
    # slice is the same table. With 100 rows per expert the period spans experts.
    stacked = SegmentTable.theoretical(4 * 100, 768, "bf16", 4 * KIB, 2)
    assert stacked.period_rows == 16
    expert1 = stacked.slice_rows(100, 200)
    # Expert 1 starts at byte 100 * 1536 = 153600 = page 37 + 2048 B, and page 37 is on
    # node 1 (odd): its own theoretical table has phase 1, offset 2048.
    assert expert1 == SegmentTable.theoretical(100, 768, "bf16", 4 * KIB, 2, phase=1,
                                               offset_bytes=2048)
    assert expert1.rows == 100 and expert1.period_rows == 16
    assert stacked.slice_rows(0, 400) == stacked


# --------------------------------------------------------------------------- JSON files


def test_save_load_round_trip_and_atomic(tmp_path):
    table = SegmentTable.theoretical(4096, 14336, "bf16", 4 * KIB, 2)
    path = tmp_path / "down.json"
    table.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["down.json"]  # no temp left behind
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["version"] == 1
    loaded = SegmentTable.load(path)
    assert loaded == table and loaded.to_dict() == table.to_dict()
    table.save(path)  # overwrite in place
    assert SegmentTable.load(path) == table


def test_check_names_an_element_covered_twice(rng):
    """SegmentTable.check applies the kernels' partition rule (native/common/segment.hpp):
    an element covered twice is named by its row, its columns and the second node."""
    n_nodes = int(rng.integers(2, 5))
    table = SegmentTable.theoretical(int(rng.integers(8, 64)), 1024 * int(rng.integers(1, 8)), "bf16",
                                     4 * KIB, n_nodes)
    table.check()
    src, other = (int(n) for n in rng.choice(table.nodes, 2, replace=False))
    s = table.segments[src][int(rng.integers(len(table.segments[src])))]
    bad = dataclasses.replace(table, segments={**table.segments, other: table.segments[other] + (s,)})
    expected = f"row {s.row0} columns [{s.k0}, {s.k1}) are covered twice (again by node {max(src, other)})"
    with pytest.raises(ValueError, match=re.escape(expected)):
        bad.check()


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(schema="something/else"), "schema"),
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.pop("segments"), "missing"),
    (lambda d: d["segments"]["0"].pop(), "cover"),
    (lambda d: d["segments"]["0"].append([0, 1, 1, 0, 5]), "overlaps|cover"),
    (lambda d: d["segments"].update({"7": []}), "node 7"),
    (lambda d: d.update(fmt="int3"), "unknown weight format"),
    (lambda d: d["segments"]["1"].__setitem__(0, [0, 2, "x", 0, 1]), "5 integers"),
    (lambda d: d.update(bits_per_element=8), "bits_per_element"),
])
def test_load_rejects_bad_documents(tmp_path, mutate, match):
    data = SegmentTable.theoretical(8, 14336, "bf16", 4 * KIB, 2).to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SegmentTableFormatError, match=match) as info:
        SegmentTable.load(path)
    assert "bad.json" in str(info.value)


def test_load_corrupt_and_missing_files(tmp_path):
    path = tmp_path / "corrupt.json"
    path.write_text('{"schema": "numa-moe/segment-table", "vers')
    with pytest.raises(SegmentTableFormatError, match="corrupt.json.*not valid JSON"):
        SegmentTable.load(path)
    with pytest.raises(SegmentTableFormatError, match="absent.json: cannot read: No such file"):
        SegmentTable.load(tmp_path / "absent.json")


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,match", [
    (dict(rows=0), "rows must be > 0"),
    (dict(rows=-3), "rows must be > 0"),
    (dict(cols=0), "cols must be > 0"),
    (dict(fmt="int4", cols=4095), "whole number of bytes"),
    (dict(fmt="q5"), "unknown weight format"),
    (dict(page_bytes=3000), "power of two"),
    (dict(nodes=()), "nodes is empty"),
    (dict(nodes=(0, 1, 0)), "duplicate"),
    (dict(nodes=(0, -1)), "node id must be >= 0"),
    (dict(phase=2), "phase"),
    (dict(offset_bytes=4096), "offset_bytes=4096 must be < page_bytes"),
    (dict(offset_bytes=3), "split an element"),
])
def test_theoretical_bad_input(kwargs, match):
    args = dict(rows=16, cols=4096, fmt="bf16", page_bytes=4096, nodes=(0, 1))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        SegmentTable.theoretical(**args)


def test_from_page_map_bad_input():
    with pytest.raises(ValueError, match="page map too short: 15 pages"):
        SegmentTable.from_page_map(8, 4096, "bf16", np.zeros(15, np.int32), 4096)
    with pytest.raises(ValueError, match="1-d integer"):
        SegmentTable.from_page_map(8, 4096, "bf16", np.zeros(16, np.float32), 4096)
    with pytest.raises(ValueError, match="none of the 16 pages"):
        SegmentTable.from_page_map(8, 4096, "bf16", np.full(16, -2), 4096)
    with pytest.raises(ValueError, match=r"node\(s\) \[2\]"):
        SegmentTable.from_page_map(8, 4096, "bf16", np.arange(16) % 3, 4096, nodes=(0, 1))
    with pytest.raises(ValueError, match="whole number of bytes"):
        SegmentTable.from_page_map(8, 7, "int4", np.zeros(16, np.int32), 4096)


def test_queries_bad_input():
    table = SegmentTable.theoretical(16, 4096, "bf16", 4096, 2)
    with pytest.raises(ValueError, match="node 5 is not in this table"):
        table.node_array(5)
    for start, stop in [(3, 3), (5, 2), (0, 17)]:
        with pytest.raises(ValueError, match="slice_rows"):
            table.slice_rows(start, stop)
    with pytest.raises(ValueError, match="invalid segment"):
        Segment(0, 1, 0, 0, 5)
    with pytest.raises(ValueError, match="n_nodes must be > 0"):
        period_rows(8192, 4096, 0)


def test_node_array_empty_node_and_int4_bytes():
    # A tiny matrix entirely in page 0: node 1 gets nothing but still has an array.
    table = SegmentTable.theoretical(2, 64, "int4", 4096, (0, 1))
    assert table.node_array(1).shape == (0, 5)
    assert table.bytes_per_node() == {0: 64, 1: 0}
    assert table.balance() == 2.0


def test_pattern_ids_stay_exact_when_the_hash_collides(monkeypatch, rng):
    key = rng.integers(0, 3, size=(500, 6)).astype(np.int64)
    expect = np.unique(key, axis=0, return_inverse=True)[1].reshape(-1)
    # Every row hashes to the same value: the exact comparison must catch it.
    monkeypatch.setattr(sg, "_HASH_MULTIPLIERS", np.zeros(4096, dtype=np.uint64))
    got = sg._group_ids(key)
    same = got[:, None] == got[None, :]
    np.testing.assert_array_equal(same, expect[:, None] == expect[None, :])

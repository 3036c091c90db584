"""Periodic segment tables: which part of a row-major weight matrix lies on which NUMA node.

No system calls: the page map comes from ``numa_moe.placement.memory`` (or from the
interleave rule), this module only does the arithmetic, in numpy; ``SegmentTable.check``
applies the partition rule of the native kernels (``_native.check_partition``). See
docs/placement.md for the math, the worked examples and the JSON schema.

A matrix of ``rows`` x ``cols`` elements of a weight format is stored row-major, so row
``r`` occupies the bytes ``[r * row_bytes, (r + 1) * row_bytes)`` of its buffer. The
buffer starts ``offset_bytes`` into its first page; page ``p`` of the buffer (``p = 0``
holds the first byte) lies on some node. Under page interleaving that node is
``nodes[(phase + p) % N]`` and the row pattern repeats every

    T = page_bytes * N / gcd(row_bytes, page_bytes * N)      rows.

Each row class ``c = r mod T`` has a fixed list of element ranges ``[k0, k1)`` per node,
so a node's share of the matrix is a short list of strided segments
``Segment(row0=c, row_stride=T, nrows=ceil((rows - c) / T), k0, k1)``.

Canonical form (what makes two tables comparable): the table's ``period_rows`` is the
smallest ``p`` such that row ``r`` and row ``r + p`` have the same (k0, k1, node) runs for
every ``r + p < rows``, provided the pattern repeats at least twice in full
(``2 p <= rows``); otherwise it is ``None`` and the segments are explicit, one row each
(``nrows = 1``). Adjacent ranges of the same node inside a row are merged.
A segment with ``nrows == 1`` always has ``row_stride == 1``. Segments of a node are
sorted by ``(row0, k0)``. With the same canonical form everywhere, the table computed
from the interleave rule and the one detected from the measured map of the same buffer
are equal.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from numa_moe import _native
from numa_moe.files import read_json_file
from numa_moe.formats import SCALE_DTYPES, WeightFormat, positive_int, scale_columns, weight_format

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "period_rows",
    "smallest_period",
    "Segment",
    "SegmentTable",
    "SegmentTableFormatError",
    "scale_shape",
    "scales_table",
]

SCHEMA = "numa-moe/segment-table"
SCHEMA_VERSION = 1


class SegmentTableFormatError(ValueError):
    """A serialised segment table is not a valid ``numa-moe/segment-table`` document."""


# --------------------------------------------------------------------------- validation


def _non_negative_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


# The most NUMA nodes there can be: Linux's MAX_NUMNODES (CONFIG_NODES_SHIFT <= 10) and
# the virtual topology's limit. Node counts and ids are checked against it before any
# per-node structure is built.
MAX_NODES = 1024

# Entries (row classes plus pages of one period) a theoretical table may need to compute:
# the work is O(min(rows, 2 T) + pages of T rows), so a huge shape is refused up front
# instead of allocating until the machine runs out of memory (the limit costs ~1 GB and
# seconds). Real expert buffers need thousands.
MAX_TABLE_WORK = 1 << 22


def check_node_id(node) -> int:
    """A NUMA node id: an integer in [0, MAX_NODES)."""
    node = _non_negative_int(node, "node id")
    if node >= MAX_NODES:
        raise ValueError(f"node id {node} is not below {MAX_NODES} (the most nodes a Linux "
                         "machine or a virtual topology has)")
    return node


def _check_page_bytes(page_bytes, fmt: WeightFormat) -> int:
    page_bytes = positive_int(page_bytes, "page_bytes")
    if page_bytes & (page_bytes - 1):
        raise ValueError(f"page_bytes must be a power of two, got {page_bytes}")
    if page_bytes < fmt.element_bytes:
        raise ValueError(
            f"page_bytes={page_bytes} is smaller than one {fmt.name} element "
            f"({fmt.element_bytes} bytes)"
        )
    return page_bytes


def _check_offset(offset_bytes, page_bytes: int, fmt: WeightFormat) -> int:
    offset_bytes = _non_negative_int(offset_bytes, "offset_bytes")
    if offset_bytes >= page_bytes:
        raise ValueError(
            f"offset_bytes={offset_bytes} must be < page_bytes={page_bytes} "
            f"(it is where the matrix starts inside its first page)"
        )
    if offset_bytes % fmt.element_bytes:
        # A page boundary would then cut a {fmt} element in two.
        raise ValueError(
            f"offset_bytes={offset_bytes} is not a multiple of the {fmt.name} element "
            f"size ({fmt.element_bytes} bytes): a page boundary would split an element"
        )
    return offset_bytes


def _check_nodes(nodes) -> tuple[int, ...]:
    if isinstance(nodes, (int, np.integer)) and not isinstance(nodes, bool):
        # An int N is shorthand for nodes 0..N-1.
        count = positive_int(nodes, "number of nodes")
        if count > MAX_NODES:
            raise ValueError(f"number of nodes must be at most {MAX_NODES} (the most a Linux "
                             f"machine or a virtual topology has), got {count}")
        return tuple(range(count))
    try:
        values = tuple(nodes)
    except TypeError:
        raise ValueError(f"nodes must be a sequence of node ids, got {nodes!r}") from None
    if not values:
        raise ValueError("nodes is empty: give at least one NUMA node")
    out = []
    for node in values:
        out.append(check_node_id(node))
    if len(set(out)) != len(out):
        dup = sorted({n for n in out if out.count(n) > 1})
        raise ValueError(f"nodes {list(out)} has duplicate node ids {dup}")
    return tuple(out)


def period_rows(row_bytes: int, page_bytes: int, n_nodes: int) -> int:
    """Rows after which the page-interleave pattern of a row-major matrix repeats.

    ``T = page_bytes * n_nodes / gcd(row_bytes, page_bytes * n_nodes)``: the smallest
    ``T`` with ``T * row_bytes`` a multiple of one full cycle of pages over the nodes.
    With 4 KB pages and BF16 (``row_bytes = 2 K``) this is the paper's
    ``T_x = 2048 N / gcd(K, 2048 N)``.
    """
    row_bytes = positive_int(row_bytes, "row_bytes")
    page_bytes = positive_int(page_bytes, "page_bytes")
    n_nodes = positive_int(n_nodes, "n_nodes")
    cycle = page_bytes * n_nodes
    return cycle // math.gcd(row_bytes, cycle)


def scale_shape(rows: int, cols: int, group: int, fmt: str | None = None) -> tuple[int, int]:
    """Shape ``(rows, cols / group)`` of the group-scale tensor of a ``rows x cols`` weight
    (``(rows, 2 cols / group)`` for a format with minimums, ``formats.scale_columns``)."""
    rows = positive_int(rows, "rows")
    cols = positive_int(cols, "cols")
    group = positive_int(group, "group")
    if cols % group:
        raise ValueError(f"cols={cols} is not a multiple of the scale group size {group}")
    return rows, scale_columns(fmt, cols, group)


# --------------------------------------------------------------------------- segments


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows ``row0, row0 + row_stride, ...`` (``nrows`` of them), elements ``[k0, k1)``."""

    row0: int
    row_stride: int
    nrows: int
    k0: int
    k1: int

    def __post_init__(self):
        if self.row0 < 0 or self.row_stride < 1 or self.nrows < 1 or not 0 <= self.k0 < self.k1:
            raise ValueError(f"invalid segment {self!r}: need row0>=0, row_stride>=1, "
                             f"nrows>=1, 0<=k0<k1")

    @property
    def last_row(self) -> int:
        return self.row0 + (self.nrows - 1) * self.row_stride

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.row0, self.row_stride, self.nrows, self.k0, self.k1)


# Runs of a set of "row classes": parallel int64 arrays sorted by (cls, k0); every class
# 0..n-1 has at least one run and its runs tile [0, cols) without gaps or overlaps, with
# adjacent runs on different nodes.
@dataclass(frozen=True)
class _ClassRuns:
    cls: np.ndarray
    k0: np.ndarray
    k1: np.ndarray
    node: np.ndarray
    n_classes: int

    def offsets(self) -> np.ndarray:
        counts = np.bincount(self.cls, minlength=self.n_classes)
        return np.concatenate(([0], np.cumsum(counts))).astype(np.int64)


def _runs_from_page_nodes(rows: int, row_bytes: int, fmt: WeightFormat, page_bytes: int,
                          offset_bytes: int, page_node: np.ndarray) -> _ClassRuns:
    """Per-row (k0, k1, node) runs of a matrix whose pages lie on ``page_node`` (filled).

    Vectorised: the cut points of the matrix are the row boundaries and the bytes where
    the node changes between consecutive pages; runs of same-node pages (a 2 MB folio
    seen as 512 4 KB pages) collapse to one cut, so the cost is O(rows + node changes).
    """
    total_bytes = rows * row_bytes
    n_pages = (offset_bytes + total_bytes - 1) // page_bytes + 1
    page_node = page_node[:n_pages]
    change_pages = np.flatnonzero(page_node[1:] != page_node[:-1]) + 1
    change_bytes = change_pages.astype(np.int64) * page_bytes - offset_bytes
    run_nodes = page_node[np.concatenate(([0], change_pages))].astype(np.int64)
    row_bounds = np.arange(rows + 1, dtype=np.int64) * row_bytes
    cuts = _sorted_union(row_bounds, change_bytes)
    starts, ends = cuts[:-1], cuts[1:]
    row = starts // row_bytes
    node = run_nodes[np.searchsorted(change_bytes, starts, side="right")]
    row_start = row * row_bytes
    return _ClassRuns(row, fmt.elements_in(starts - row_start),
                      fmt.elements_in(ends - row_start), node, rows)


def _sorted_union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted distinct values of two int64 arrays (np.union1d is slow on millions)."""
    merged = np.concatenate((a, b))
    merged.sort(kind="stable")
    keep = np.ones(len(merged), dtype=bool)
    keep[1:] = merged[1:] != merged[:-1]
    return merged[keep]


# Odd 64-bit multipliers for the row-pattern hash (fixed: results must be reproducible).
_HASH_MULTIPLIERS = np.random.default_rng(0x6E756D61).integers(
    1, 2**63, size=4096, dtype=np.int64).astype(np.uint64) | np.uint64(1)


def _group_ids(key: np.ndarray) -> np.ndarray:
    """Exact ids of the rows of an int64 matrix: equal ids <=> equal rows.

    A multiplicative hash groups the rows (one int64 sort instead of a lexicographic
    sort of the whole matrix); every row is then compared with its group's first row,
    and on a collision the exact np.unique(axis=0) decides.
    """
    m, width = key.shape
    if width > len(_HASH_MULTIPLIERS) or m < 2:
        return np.unique(key, axis=0, return_inverse=True)[1].reshape(-1)
    with np.errstate(over="ignore"):
        h = (key.astype(np.uint64) * _HASH_MULTIPLIERS[:width]).sum(axis=1, dtype=np.uint64)
        h ^= h >> np.uint64(31)
    order = np.argsort(h, kind="stable")
    hs = h[order]
    new_group = np.ones(m, dtype=bool)
    new_group[1:] = hs[1:] != hs[:-1]
    group_of_sorted = np.cumsum(new_group) - 1
    first_of_group = order[np.flatnonzero(new_group)]
    ids = np.empty(m, dtype=np.int64)
    ids[order] = group_of_sorted
    if not np.array_equal(key, key[first_of_group[ids]]):
        return np.unique(key, axis=0, return_inverse=True)[1].reshape(-1)
    return ids


def _pattern_ids(runs: _ClassRuns) -> np.ndarray:
    """Exact integer id per class: equal ids <=> identical (k0, k1, node) run lists."""
    offsets = runs.offsets()
    counts = np.diff(offsets)
    ids = np.empty(runs.n_classes, dtype=np.int64)
    next_id = 0
    for count in np.unique(counts):
        members = np.flatnonzero(counts == count)
        idx = offsets[members][:, None] + np.arange(count)
        # k0 of each run is k1 of the previous one, so (k1, node) pairs identify the list.
        key = np.concatenate((runs.k1[idx], runs.node[idx]), axis=1)
        inverse = _group_ids(key)
        ids[members] = inverse + next_id
        next_id += int(inverse.max()) + 1
    return ids


def smallest_period(ids: np.ndarray) -> int:
    """Smallest p >= 1 with ids[r] == ids[r + p] for all r + p < len(ids) (len if none).
    The one period finder for row classes here and page maps in placement_report."""
    n = len(ids)
    if n <= 1:
        return n
    candidates = np.flatnonzero(ids[1:] == ids[0]) + 1
    # The smallest candidate, when a period, is the smallest period: one exact check
    # settles the common case (a periodic table, a single node) before any filtering.
    if len(candidates) and np.array_equal(ids[candidates[0]:], ids[: n - candidates[0]]):
        return int(candidates[0])
    # Cheap vectorised filtering on a short prefix before exact checks.
    j = 1
    while len(candidates) > 32 and j < min(n, 64):
        reach = candidates + j
        keep = reach >= n
        inside = ~keep
        keep[inside] = ids[reach[inside]] == ids[j]
        candidates = candidates[keep]
        j += 1
    # Every period survives the filter, so the first candidate that checks out is the
    # smallest; a few exact checks settle the common case (a truly periodic sequence).
    for p in candidates[:32]:
        p = int(p)
        if np.array_equal(ids[p:], ids[: n - p]):
            return p
    if len(candidates) <= 32:
        return n
    # Many near-periods survive the prefix test: the prefix function is exact and O(n).
    seq = ids.tolist()
    border = [0] * n
    k = 0
    for i in range(1, n):
        while k and seq[i] != seq[k]:
            k = border[k - 1]
        if seq[i] == seq[k]:
            k += 1
        border[i] = k
    return n - border[-1]


def _gather_class_runs(runs: _ClassRuns, classes: np.ndarray):
    """Runs of ``classes`` (in order), tagged with the position of the class in ``classes``."""
    offsets = runs.offsets()
    counts = offsets[classes + 1] - offsets[classes]
    position = np.repeat(np.arange(len(classes), dtype=np.int64), counts)
    first = np.repeat(offsets[classes], counts)
    idx = first + (np.arange(int(counts.sum()), dtype=np.int64)
                   - np.repeat(np.cumsum(counts) - counts, counts))
    return position, runs.k0[idx], runs.k1[idx], runs.node[idx]


def _compress(rows: int, runs: _ClassRuns, row_class: np.ndarray, nodes: tuple[int, ...]):
    """Canonical (period_rows, segments) of a matrix whose row r has the runs of class
    ``row_class[r]``."""
    class_ids = _pattern_ids(runs)
    period = smallest_period(class_ids[row_class])
    if 2 * period > rows:
        period = rows
    row0, k0, k1, node = _gather_class_runs(runs, row_class[:period])
    nrows = (rows - row0 + period - 1) // period
    stride = np.where(nrows == 1, 1, period)
    order = np.lexsort((k0, row0, node))
    columns = [a[order].tolist() for a in (node, row0, stride, nrows, k0, k1)]
    by_node: dict[int, list[Segment]] = {n: [] for n in nodes}
    for n, r0, st, nr, a, b in zip(*columns):
        by_node[n].append(Segment(r0, st, nr, a, b))
    segments = {n: tuple(by_node[n]) for n in sorted(nodes)}
    # A pattern that does not repeat at least twice in full is not worth calling
    # periodic (a single moved page would otherwise give e.g. p = rows - 1000).
    return (period if period < rows else None), segments


def _matrix_geometry(rows, cols, fmt, page_bytes, offset_bytes):
    rows = positive_int(rows, "rows")
    fmt = weight_format(fmt)
    row_bytes = fmt.row_bytes(cols)
    page_bytes = _check_page_bytes(page_bytes, fmt)
    offset_bytes = _check_offset(offset_bytes, page_bytes, fmt)
    n_pages = (offset_bytes + rows * row_bytes - 1) // page_bytes + 1
    return rows, int(cols), fmt, row_bytes, page_bytes, offset_bytes, n_pages


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class SegmentTable:
    """Which elements of a ``rows x cols`` row-major matrix lie on which node.

    ``segments[node]`` lists that node's strided segments; the segments of all nodes
    cover every element exactly once. ``==`` compares the layout (shape, format, nodes,
    period, segments); ``page_bytes``, ``source`` and ``pages_not_present`` say where
    the table came from and are not compared (a 2 MB interleave measured with a 4 KB
    map gives the same layout as the 2 MB theoretical table).
    """

    rows: int
    cols: int
    fmt: str
    page_bytes: int = field(compare=False)
    nodes: tuple[int, ...]
    period_rows: int | None
    segments: dict[int, tuple[Segment, ...]]
    source: str = field(default="theoretical", compare=False)
    # Pages of the matrix that were not present in the measured map and were assigned
    # to the lowest node (None when unknown, e.g. after slice_rows of a measured table).
    pages_not_present: int | None = field(default=0, compare=False)

    def __hash__(self):
        return hash((self.rows, self.cols, self.fmt, self.nodes, self.period_rows,
                     tuple(sorted(self.segments.items()))))

    # ----------------------------------------------------------------- constructors

    @classmethod
    def theoretical(cls, rows: int, cols: int, fmt: str | WeightFormat, page_bytes: int,
                    nodes: Sequence[int] | int, phase: int = 0,
                    offset_bytes: int = 0) -> "SegmentTable":
        """The table of a matrix in a buffer interleaved over ``nodes`` by ``page_bytes``.

        Page ``p`` of the buffer (``p = 0`` holds its first byte, which lies
        ``offset_bytes`` into that page) is on ``nodes[(phase + p) % len(nodes)]``.
        ``nodes`` may be a sequence of node ids (in interleave order) or a count N
        (nodes 0..N-1).
        """
        rows, cols, fmt, row_bytes, page_bytes, offset_bytes, _ = _matrix_geometry(
            rows, cols, fmt, page_bytes, offset_bytes)
        nodes = _check_nodes(nodes)
        if isinstance(phase, bool) or not isinstance(phase, (int, np.integer)) \
                or not 0 <= phase < len(nodes):
            raise ValueError(f"phase must be an integer in [0, {len(nodes)}) "
                             f"(an index into nodes), got {phase!r}")
        # Offset does not change the period: it shifts every row by the same bytes.
        period = period_rows(row_bytes, page_bytes, len(nodes))
        head_rows = min(rows, period)
        head_pages = (offset_bytes + head_rows * row_bytes - 1) // page_bytes + 1
        # Row r has the runs of class r % period, so the smallest period of the whole
        # sequence is that of its first 2 * period rows (Fine and Wilf): the work is
        # bounded by the period, not by rows.
        sampled_rows = min(rows, 2 * period)
        if sampled_rows + head_pages > MAX_TABLE_WORK:
            raise ValueError(
                f"a {rows} x {cols} {fmt.name} matrix over {len(nodes)} node(s) with "
                f"{page_bytes} B pages repeats every {period} rows of {row_bytes} B; its table "
                f"would take {sampled_rows + head_pages} row/page entries to compute, more "
                f"than the {MAX_TABLE_WORK} allowed")
        node_ids = np.asarray(nodes, dtype=np.int64)
        page_node = node_ids[(int(phase) + np.arange(head_pages, dtype=np.int64)) % len(nodes)]
        runs = _runs_from_page_nodes(head_rows, row_bytes, fmt, page_bytes, offset_bytes,
                                     page_node)
        row_class = np.arange(sampled_rows, dtype=np.int64) % period
        table_period, segments = _compress(rows, runs, row_class, nodes)
        return cls(rows, cols, fmt.name, page_bytes, tuple(sorted(nodes)), table_period,
                   segments, "theoretical", 0)

    @classmethod
    def from_page_map(cls, rows: int, cols: int, fmt: str | WeightFormat, page_nodes,
                      page_bytes: int, offset_bytes: int = 0,
                      nodes: Sequence[int] | int | None = None) -> "SegmentTable":
        """The table of a matrix from its measured page map.

        ``page_nodes[i]`` is the node of page ``i`` of the buffer (``i = 0`` holds the
        first byte, ``offset_bytes`` into that page), at ``page_bytes`` granularity (a
        2 MB interleave may be given as a 4 KB map). Negative entries (pages not
        present, -errno from move_pages) are assigned to the lowest node of ``nodes``
        (or of the nodes present in the map when ``nodes`` is None) and counted in
        ``pages_not_present``. Entries past the end of the matrix are ignored. The
        period is detected; a map that does not repeat gives explicit one-row segments.
        """
        rows, cols, fmt, row_bytes, page_bytes, offset_bytes, n_pages = _matrix_geometry(
            rows, cols, fmt, page_bytes, offset_bytes)
        page_node = np.asarray(page_nodes)
        if page_node.ndim != 1 or not np.issubdtype(page_node.dtype, np.integer):
            raise ValueError(f"page_nodes must be a 1-d integer array, got shape "
                             f"{page_node.shape} dtype {page_node.dtype}")
        if len(page_node) < n_pages:
            raise ValueError(
                f"page map too short: {len(page_node)} pages of {page_bytes} bytes, but "
                f"a {rows} x {cols} {fmt.name} matrix at offset {offset_bytes} spans "
                f"{n_pages} pages")
        page_node = page_node[:n_pages].astype(np.int64)
        missing = page_node < 0
        present_nodes = np.unique(page_node[~missing])
        if nodes is None:
            if len(present_nodes) == 0:
                raise ValueError(
                    f"none of the {n_pages} pages of the matrix is present (all negative "
                    f"in the page map) and no nodes were given: touch the buffer first "
                    f"or pass nodes=")
            nodes = tuple(int(n) for n in present_nodes)
        else:
            nodes = _check_nodes(nodes)
            foreign = np.setdiff1d(present_nodes, np.asarray(nodes, dtype=np.int64))
            if len(foreign):
                first = int(np.flatnonzero(page_node == foreign[0])[0])
                raise ValueError(
                    f"page map puts pages on node(s) {foreign.tolist()} (first: page "
                    f"{first}) outside the given nodes {list(nodes)}")
        n_missing = int(missing.sum())
        if n_missing:
            page_node[missing] = min(nodes)
        runs = _runs_from_page_nodes(rows, row_bytes, fmt, page_bytes, offset_bytes, page_node)
        table_period, segments = _compress(rows, runs, np.arange(rows, dtype=np.int64), nodes)
        return cls(rows, cols, fmt.name, page_bytes, tuple(sorted(nodes)), table_period,
                   segments, "measured", n_missing)

    # ----------------------------------------------------------------- queries

    @property
    def weight_format(self) -> WeightFormat:
        return weight_format(self.fmt)

    @property
    def row_bytes(self) -> int:
        return self.weight_format.row_bytes(self.cols)

    def node_array(self, node: int) -> np.ndarray:
        """Segments of ``node`` as a C-contiguous int64 array ``[n, 5]``
        (row0, row_stride, nrows, k0, k1), the layout native kernels take."""
        if node not in self.segments:
            raise ValueError(f"node {node!r} is not in this table (nodes {list(self.nodes)})")
        segs = self.segments[node]
        out = np.array([s.as_tuple() for s in segs], dtype=np.int64).reshape(len(segs), 5)
        return np.ascontiguousarray(out)

    def bytes_per_node(self) -> dict[int, int]:
        """Bytes of the matrix on each node (every node of the table, possibly 0)."""
        bits = self.weight_format.bits_per_element
        return {node: sum(s.nrows * (s.k1 - s.k0) for s in segs) * bits // 8
                for node, segs in self.segments.items()}

    def balance(self) -> float:
        """max / mean of bytes_per_node over the table's nodes (1.0 = perfectly even)."""
        per_node = self.bytes_per_node()
        mean = sum(per_node.values()) / len(per_node)
        return max(per_node.values()) / mean

    def segment_count(self) -> int:
        return sum(len(s) for s in self.segments.values())

    # ----------------------------------------------------------------- derived tables

    def _class_runs(self) -> tuple[_ClassRuns, int]:
        """(runs per row class, number of classes p): row r has the runs of class r % p."""
        p = self.period_rows or self.rows
        entries = [(s.row0, s.k0, s.k1, node)
                   for node, segs in self.segments.items() for s in segs]
        arr = np.array(entries, dtype=np.int64).reshape(-1, 4)
        arr = arr[np.lexsort((arr[:, 1], arr[:, 0]))]
        return _ClassRuns(arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy(),
                          arr[:, 3].copy(), p), p

    def slice_rows(self, start: int, stop: int) -> "SegmentTable":
        """The table of rows ``[start, stop)`` as a matrix of its own (rows from 0).

        E.g. one expert out of a stacked ``[E * I, H]`` buffer: the period of the stack
        may span experts; the result is the canonical table of the sub-matrix, equal to
        the one computed from the sub-matrix's own page map.
        """
        start = _non_negative_int(start, "start")
        stop = _non_negative_int(stop, "stop")
        if not start < stop <= self.rows:
            raise ValueError(f"slice_rows({start}, {stop}) is not a non-empty range inside "
                             f"the table's {self.rows} rows")
        runs, p = self._class_runs()
        n = stop - start
        # p-periodic as in theoretical(): 2 p rows decide the period of any length.
        row_class = (start + np.arange(min(n, 2 * p), dtype=np.int64)) % p
        table_period, segments = _compress(n, runs, row_class, self.nodes)
        missing = 0 if self.pages_not_present == 0 else None
        return SegmentTable(n, self.cols, self.fmt, self.page_bytes, self.nodes,
                            table_period, segments, self.source, missing)

    # ----------------------------------------------------------------- checks

    def check(self) -> None:
        """Raise ValueError unless the segments cover every element exactly once."""
        if not self.segments or set(self.segments) != set(self.nodes):
            raise ValueError(f"segments are keyed by {sorted(self.segments)}, "
                             f"nodes are {list(self.nodes)}")
        seg = np.array([s.as_tuple() for segs in self.segments.values() for s in segs],
                       dtype=np.int64).reshape(-1, 5)
        if not len(seg):
            raise ValueError("table has no segments")
        # The native partition rule (common/segment.hpp), the one the kernels apply; list
        # position = node id, so that its messages name the real nodes.
        by_node = [None] * (max(self.nodes) + 1)
        for node, segs in self.segments.items():
            by_node[node] = np.array([s.as_tuple() for s in segs], dtype=np.int64).reshape(-1, 5)
        _native.check_partition(by_node, self.rows, self.cols, "segment table")
        bits = self.weight_format.bits_per_element
        odd = (seg[:, 3] * bits % 8 != 0) | (seg[:, 4] * bits % 8 != 0)
        if np.any(odd):
            raise ValueError(f"segment {tuple(seg[np.argmax(odd)])} does not start and end "
                             f"on whole bytes of {self.fmt}")

    # ----------------------------------------------------------------- JSON

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "rows": self.rows,
            "cols": self.cols,
            "fmt": self.fmt,
            "bits_per_element": self.weight_format.bits_per_element,
            "page_bytes": self.page_bytes,
            "nodes": list(self.nodes),
            "period_rows": self.period_rows,
            "source": self.source,
            "pages_not_present": self.pages_not_present,
            "segments": {str(node): [list(s.as_tuple()) for s in segs]
                         for node, segs in self.segments.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "SegmentTable":
        """Inverse of :meth:`to_dict`; raises SegmentTableFormatError naming the problem."""
        def fail(msg):
            raise SegmentTableFormatError(f"not a valid {SCHEMA} document: {msg}")

        if not isinstance(data, Mapping):
            fail(f"expected a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            fail(f"schema is {data.get('schema')!r}, expected {SCHEMA!r}")
        if data.get("version") != SCHEMA_VERSION:
            fail(f"version {data.get('version')!r} is not supported (this reader "
                 f"understands version {SCHEMA_VERSION})")
        required = ("rows", "cols", "fmt", "page_bytes", "nodes", "period_rows", "source",
                    "segments")
        absent = [k for k in required if k not in data]
        if absent:
            fail(f"missing field(s) {absent}")
        try:
            fmt = weight_format(data["fmt"])
            if "bits_per_element" in data and data["bits_per_element"] != fmt.bits_per_element:
                fail(f"bits_per_element {data['bits_per_element']} does not match "
                     f"format {fmt.name} ({fmt.bits_per_element})")
            rows = positive_int(data["rows"], "rows")
            cols = positive_int(data["cols"], "cols")
            fmt.row_bytes(cols)
            page_bytes = _check_page_bytes(data["page_bytes"], fmt)
            nodes = _check_nodes(data["nodes"])
            period = data["period_rows"]
            if period is not None:
                period = positive_int(period, "period_rows")
            if data["source"] not in ("theoretical", "measured"):
                fail(f"source {data['source']!r} is neither 'theoretical' nor 'measured'")
            missing = data.get("pages_not_present", 0)
            if missing is not None:
                missing = _non_negative_int(missing, "pages_not_present")
            raw = data["segments"]
            if not isinstance(raw, Mapping):
                fail("segments must be an object keyed by node id")
            segments = {}
            for key, rows_of_node in raw.items():
                try:
                    node = int(key)
                except (TypeError, ValueError):
                    fail(f"segment key {key!r} is not a node id")
                if node not in nodes:
                    fail(f"segments given for node {node}, which is not in nodes {list(nodes)}")
                segs = []
                for item in rows_of_node:
                    if (not isinstance(item, (list, tuple)) or len(item) != 5
                            or not all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in item)):
                        fail(f"segment {item!r} of node {node} is not 5 integers "
                             f"[row0, row_stride, nrows, k0, k1]")
                    segs.append(Segment(*item))
                segments[node] = tuple(segs)
            for node in nodes:
                segments.setdefault(node, ())
            table = cls(rows, cols, fmt.name, page_bytes, tuple(sorted(nodes)), period,
                        {n: segments[n] for n in sorted(nodes)}, data["source"], missing)
            table.check()
        except SegmentTableFormatError:
            raise
        except ValueError as exc:
            fail(str(exc))
        if any(s.nrows > 1 and s.row_stride != period
               for segs in table.segments.values() for s in segs):
            fail(f"a multi-row segment has a stride other than period_rows={period}")
        return table

    def to_json(self, pretty: bool = False) -> str:
        """JSON text of :meth:`to_dict`; ``pretty`` puts each field and each segment on
        its own line (the form :meth:`save` writes)."""
        data = self.to_dict()
        if not pretty:
            return json.dumps(data, separators=(",", ":"))
        segments = data.pop("segments")
        lines = [f' {json.dumps(key)}: {json.dumps(value)},' for key, value in data.items()]
        node_blocks = []
        for node, segs in segments.items():
            body = ",\n".join(f"   {json.dumps(seg)}" for seg in segs)
            node_blocks.append(f'  {json.dumps(node)}: [\n{body}\n  ]' if segs
                               else f'  {json.dumps(node)}: []')
        lines.append(' "segments": {\n' + ",\n".join(node_blocks) + "\n }")
        return "{\n" + "\n".join(lines) + "\n}"

    @classmethod
    def from_json(cls, text: str) -> "SegmentTable":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SegmentTableFormatError(f"segment table is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON form atomically (temporary file in the same folder, then rename)."""
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".segment-table-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(self.to_json(pretty=True))
                out.write("\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SegmentTable":
        """Read a table written by :meth:`save`; SegmentTableFormatError names the file."""
        path = os.fspath(path)
        data = read_json_file(path, "segment table", error=SegmentTableFormatError)
        try:
            return cls.from_dict(data)
        except SegmentTableFormatError as exc:
            raise SegmentTableFormatError(f"{path}: {exc}") from None


# --------------------------------------------------------------------------- scales


def scales_table(rows: int, cols: int, group: int, scale_dtype: str | WeightFormat,
                 page_bytes: int, nodes: Sequence[int] | int, phase: int = 0,
                 offset_bytes: int = 0, fmt: str | None = None) -> SegmentTable:
    """Theoretical table of the group-scale tensor (``scale_shape(rows, cols, group, fmt)``
    of ``scale_dtype``) of a ``rows x cols`` weight of format ``fmt``. The scales are a
    separate buffer: ``phase`` and ``offset_bytes`` are those of the scale buffer, not of
    the weight. For a measured scale buffer use
    ``SegmentTable.from_page_map(*scale_shape(rows, cols, group, fmt), scale_dtype, ...)``.
    """
    fmt = weight_format(scale_dtype)
    if fmt.name not in SCALE_DTYPES:
        raise ValueError(f"scale dtype {fmt.name!r} is not one of {', '.join(SCALE_DTYPES)}")
    scale_rows, scale_cols = scale_shape(rows, cols, group, fmt)
    return SegmentTable.theoretical(scale_rows, scale_cols, fmt, page_bytes, nodes,
                                    phase=phase, offset_bytes=offset_bytes)

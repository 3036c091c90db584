"""Where the pages of expert weights really are, and what that costs a per-node split.

``inspect_checkpoint`` maps the checkpoint files the way safetensors does (a shared,
read-only mmap of each file) and measures the node of every page of every routed-expert
tensor (``memory.page_map``: move_pages(2) with no target). ``placement_report`` does
the same for the buffers of a loaded ``ExpertStore``. Per tensor it reports pages per
node, pages not present, whether the map is periodic (and the period in pages), and the
fraction of remote reads a per-node worker split would suffer:

* naive: node ``nodes[j]`` reads the contiguous rows ``[j R / N, (j + 1) R / N)``;
* table: each node reads its segments of the table built from this very map
  (``SegmentTable.from_page_map``): 0 for the present pages by construction, computed
  here byte by byte as a check, not assumed.

A checkpoint sitting in the page cache is typically on one node (the one that read it)
or in node-sized chunks: a naive split then reads (N - 1) / N of the bytes remotely.

INT8 / INT4 experts (docs/quantization.md, "Placement"): the group scales are one
interleaved copy, not replicated per node, so a node's workers read the scales their
weight segments need wherever those lie. The report adds per node: weight bytes, scale
bytes, the remote weight bytes of the table split (0 by construction) and the remote
scale bytes (``remote_scale_bytes``: the scale elements of the node's segments that sit
on another node's pages), measured from the maps of both buffers.
"""

from __future__ import annotations

import fnmatch
import mmap
import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.checkpoints.naming import NamingPattern
from numa_moe.checkpoints.safetensors import Checkpoint, TensorInfo
from numa_moe.files import open_checkpoint_file
from numa_moe.formats import DTYPE_BYTES, FLOAT_FORMATS, KINDS, MINIMUM_FORMATS, nibble_packed, scale_columns, weight_format
from numa_moe.placement.segments import SegmentTable, smallest_period

__all__ = [
    "TensorPlacement",
    "PlacementReport",
    "map_period",
    "remote_bytes",
    "table_byte_ranges",
    "analyse_map",
    "scale_byte_ranges",
    "remote_scale_bytes",
    "quant_node_summary",
    "inspect_checkpoint",
    "import_summary",
    "placement_report",
    "plot_placement",
]

BASE_PAGE_BYTES = 4096
# safetensors dtype -> weight format of the same width (for rows/bytes arithmetic only)
_FORMAT_OF_DTYPE = {**FLOAT_FORMATS, "I8": "int8", "U8": "int8", "F8_E4M3": "int8",
                    "F8_E5M2": "int8"}


@dataclass
class TensorPlacement:
    """The measured placement of one matrix (a tensor, or one buffer of a store)."""

    name: str
    rows: int
    cols: int
    fmt: str
    nbytes: int
    page_bytes: int
    worker_nodes: tuple[int, ...]
    pages_per_node: dict[int, int]
    pages_not_present: int
    n_pages: int
    period_pages: int | None  # None: not periodic (or not enough pages to tell)
    table_period_rows: int | None
    remote_fraction_naive: float | None  # of the bytes on present pages; None: none present
    remote_fraction_table: float | None
    table_bytes_per_node: dict[int, int]
    notes: list[str] = field(default_factory=list)
    page_nodes: np.ndarray | None = field(default=None, repr=False)

    @property
    def present_nodes(self) -> int:
        """How many nodes hold at least one of the present pages (0: none present)."""
        return len([n for n, c in self.pages_per_node.items() if c])

    @property
    def single_node(self) -> bool:
        return self.present_nodes == 1

    @property
    def periodic(self) -> bool:
        return self.period_pages is not None

    def to_dict(self, with_pages: bool = False) -> dict:
        out = {
            "name": self.name, "rows": self.rows, "cols": self.cols, "fmt": self.fmt,
            "nbytes": self.nbytes, "page_bytes": self.page_bytes,
            "worker_nodes": list(self.worker_nodes),
            "pages_per_node": {str(k): v for k, v in self.pages_per_node.items()},
            "pages_not_present": self.pages_not_present, "n_pages": self.n_pages,
            "single_node": self.single_node, "periodic": self.periodic,
            "period_pages": self.period_pages, "table_period_rows": self.table_period_rows,
            "remote_fraction_naive": self.remote_fraction_naive,
            "remote_fraction_table": self.remote_fraction_table,
            "table_bytes_per_node": {str(k): v for k, v in self.table_bytes_per_node.items()},
            "notes": list(self.notes),
        }
        if with_pages and self.page_nodes is not None:
            out["page_nodes"] = self.page_nodes.tolist()
        return out

    def line(self) -> str:
        nodes = " ".join(f"n{k}={v}" for k, v in sorted(self.pages_per_node.items()))
        if self.present_nodes == 0:
            shape = "not resident (no page present)"
        elif self.single_node:
            shape = "single node"
        elif self.periodic:
            shape = f"periodic, {self.period_pages} pages"
        else:
            shape = "not periodic"
        return (f"{self.name}  [{self.rows}, {self.cols}] {self.fmt}  pages {self.n_pages}: {nodes or '-'}"
                f"  not present {self.pages_not_present}  {shape}"
                f"  remote naive {_pct(self.remote_fraction_naive)}"
                f"  table {_pct(self.remote_fraction_table)}")


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


@dataclass
class PlacementReport:
    source: str
    worker_nodes: tuple[int, ...]
    tensors: list[TensorPlacement]
    notes: list[str] = field(default_factory=list)
    # int8/int4 only: per node {weight_bytes, scale_bytes, remote_weight_bytes,
    # scale_bytes_needed, remote_scale_bytes} over every expert buffer of the report
    per_node: dict[int, dict[str, int]] | None = None
    # GGUF / FP8 checkpoints: what loading them costs and loses (``import_summary``)
    conversion: dict | None = None

    def totals(self) -> dict:
        pages: dict[int, int] = {}
        for t in self.tensors:
            for node, count in t.pages_per_node.items():
                pages[node] = pages.get(node, 0) + count
        present = sum(t.nbytes * (1 - t.pages_not_present / max(t.n_pages, 1)) for t in self.tensors)

        def weighted(attr):
            values = [(getattr(t, attr), t.nbytes) for t in self.tensors if getattr(t, attr) is not None]
            weight = sum(w for _, w in values)
            return None if not weight else sum(v * w for v, w in values) / weight

        return {
            "tensors": len(self.tensors),
            "bytes": sum(t.nbytes for t in self.tensors),
            "pages_per_node": {str(k): v for k, v in sorted(pages.items())},
            "pages_not_present": sum(t.pages_not_present for t in self.tensors),
            "approx_present_bytes": int(present),
            "periodic_tensors": sum(t.periodic and t.present_nodes > 1 for t in self.tensors),
            "single_node_tensors": sum(t.single_node for t in self.tensors),
            "not_resident_tensors": sum(t.present_nodes == 0 for t in self.tensors),
            "remote_fraction_naive": weighted("remote_fraction_naive"),
            "remote_fraction_table": weighted("remote_fraction_table"),
        }

    def to_dict(self, with_pages: bool = False) -> dict:
        out = {"source": self.source, "worker_nodes": list(self.worker_nodes),
               "totals": self.totals(), "notes": list(self.notes),
               "tensors": [t.to_dict(with_pages) for t in self.tensors]}
        if self.per_node is not None:
            out["per_node"] = {str(n): dict(v) for n, v in self.per_node.items()}
        if self.conversion is not None:
            out["conversion"] = self.conversion
        return out

    def format_text(self, max_lines: int = 50) -> str:
        lines = [f"placement of {self.source} (worker nodes {list(self.worker_nodes)})"]
        lines += [f"  note: {n}" for n in self.notes]
        for t in self.tensors[:max_lines]:
            lines.append("  " + t.line())
        if len(self.tensors) > max_lines:
            lines.append(f"  ... {len(self.tensors) - max_lines} more tensors (use --json for all)")
        tot = self.totals()
        lines.append(
            f"total: {tot['tensors']} tensors, {tot['bytes'] / 2**20:.1f} MiB; pages per node "
            f"{tot['pages_per_node']}; not present {tot['pages_not_present']}; not resident "
            f"{tot['not_resident_tensors']}, single-node {tot['single_node_tensors']}, periodic multi-node "
            f"{tot['periodic_tensors']}; "
            f"remote reads: naive row split {_pct(tot['remote_fraction_naive'])}, table from the "
            f"map {_pct(tot['remote_fraction_table'])}")
        if self.per_node is not None:
            lines.append("per node (table split; scales are one interleaved copy, read where they lie):")
            for node, v in self.per_node.items():
                needed = v["scale_bytes_needed"]
                frac = _pct(v["remote_scale_bytes"] / needed if needed else None)
                lines.append(
                    f"  node {node}: weights {v['weight_bytes']} B, scales {v['scale_bytes']} B; "
                    f"remote reads: weights {v['remote_weight_bytes']} B, scales "
                    f"{v['remote_scale_bytes']} of {needed} B needed ({frac})")
        if self.conversion is not None:
            lines += _conversion_lines(self.conversion)
        return "\n".join(lines)


def _conversion_lines(c: dict) -> list[str]:
    def mib(n):
        return f"{n / 2**20:.2f} MiB"

    per_node = ", ".join(f"{n}: {mib(b)}" for n, b in c["bytes_per_node"].items())
    lines = [f"import: {c['conversion']}",
             f"  routed experts: {mib(c['file_bytes'])} in the file -> {mib(c['loaded_bytes'])} "
             f"in interleaved memory ({c['page_bytes'] // 1024} KiB pages"
             f"{'; values + scales' if c['group'] else ''}), "
             f"per node {per_node}"]
    for e in c["errors"]:
        lines.append(f"  error vs the file's own dequantized values, layer {e['layer']} expert "
                     f"{e['expert']} {e['kind']} ({e['source_type']}): relative {e['rel_fro']:.2e}, "
                     f"max abs {e['max_abs']:.3g} ({e['max_rel']:.2%} of max |w|)")
    return lines


# ------------------------------------------------------------------ pure map arithmetic


def map_period(page_nodes: np.ndarray) -> int | None:
    """Smallest p with ``page_nodes[i] == page_nodes[i + p]`` everywhere, if the map holds
    at least two whole periods (p <= n / 2); 1 for a uniform map; None otherwise."""
    nodes = np.asarray(page_nodes)
    if len(nodes) == 0:
        return None
    period = smallest_period(nodes)
    return period if period == 1 or 2 * period <= len(nodes) else None


def remote_bytes(starts: np.ndarray, ends: np.ndarray, worker_node: int, page_nodes: np.ndarray,
                 page_bytes: int, offset_bytes: int) -> tuple[int, int]:
    """(bytes on present pages of another node, bytes on present pages) in the byte
    ranges ``[starts, ends)`` of a matrix starting ``offset_bytes`` into page 0."""
    page_nodes = np.asarray(page_nodes)
    present = page_nodes >= 0
    remote = present & (page_nodes != worker_node)

    def upto(flags: np.ndarray, x: np.ndarray) -> np.ndarray:
        # flagged bytes in [0, x) counted from the start of page 0
        prefix = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
        padded = np.concatenate((flags, [False])).astype(np.int64)
        page = x // page_bytes
        return prefix[page] * page_bytes + padded[page] * (x - page * page_bytes)

    s = np.asarray(starts, dtype=np.int64) + offset_bytes
    e = np.asarray(ends, dtype=np.int64) + offset_bytes
    return (int((upto(remote, e) - upto(remote, s)).sum()),
            int((upto(present, e) - upto(present, s)).sum()))


def table_byte_ranges(table: SegmentTable, node: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``[starts, ends)`` (within the matrix) of ``node``'s segments, one per row."""
    seg = table.node_array(node)
    if len(seg) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    bits = weight_format(table.fmt).bits_per_element
    nrows = seg[:, 2]
    which = np.repeat(np.arange(len(seg)), nrows)
    step = np.arange(int(nrows.sum()), dtype=np.int64) - np.repeat(np.cumsum(nrows) - nrows, nrows)
    row = seg[which, 0] + step * seg[which, 1]
    base = row * table.row_bytes
    return base + seg[which, 3] * bits // 8, base + seg[which, 4] * bits // 8


def analyse_map(name: str, rows: int, cols: int, fmt: str, page_nodes: np.ndarray,
                page_bytes: int, offset_bytes: int, worker_nodes: Sequence[int],
                keep_pages: bool = True) -> tuple[TensorPlacement, SegmentTable]:
    """The placement summary of a ``rows x cols`` matrix whose pages lie on ``page_nodes``
    (``-errno`` for pages not present), and the table built from that map."""
    fmt = weight_format(fmt).name
    row_bytes = weight_format(fmt).row_bytes(cols)
    nbytes = rows * row_bytes
    n_pages = (offset_bytes + nbytes - 1) // page_bytes + 1
    page_nodes = np.asarray(page_nodes)[:n_pages].astype(np.int64)
    workers = tuple(int(n) for n in worker_nodes)
    present = page_nodes[page_nodes >= 0]
    counts = {int(n): int(c) for n, c in zip(*np.unique(present, return_counts=True))}
    pages_per_node = {n: counts.get(n, 0) for n in sorted(set(workers) | set(counts))}
    notes = []
    foreign = sorted(set(counts) - set(workers))
    if foreign:
        notes.append(f"pages on node(s) {foreign} outside the worker nodes: remote for every worker")
    table_nodes = tuple(sorted(set(workers) | set(counts)))
    table = SegmentTable.from_page_map(rows, cols, fmt, page_nodes, page_bytes, offset_bytes,
                                       nodes=table_nodes)

    # (a) contiguous row blocks, one per worker node
    n = len(workers)
    bounds = np.array([j * rows // n for j in range(n + 1)], dtype=np.int64) * row_bytes
    naive_remote = naive_present = 0
    for j, node in enumerate(workers):
        r, p = remote_bytes(bounds[j:j + 1], bounds[j + 1:j + 2], node, page_nodes, page_bytes,
                            offset_bytes)
        naive_remote, naive_present = naive_remote + r, naive_present + p
    # (b) each node reads its own segments of the table built from this map
    table_remote = table_present = 0
    for node in table.nodes:
        starts, ends = table_byte_ranges(table, node)
        r, p = remote_bytes(starts, ends, node, page_nodes, page_bytes, offset_bytes)
        table_remote, table_present = table_remote + r, table_present + p
    missing = int(np.count_nonzero(page_nodes < 0))
    if missing:
        notes.append(f"{missing} pages not present: not counted in the remote fractions; the "
                     f"table assigns them to node {min(table.nodes)}")
    placement = TensorPlacement(
        name=name, rows=rows, cols=cols, fmt=fmt, nbytes=nbytes, page_bytes=page_bytes,
        worker_nodes=workers, pages_per_node=pages_per_node, pages_not_present=missing,
        n_pages=n_pages, period_pages=map_period(page_nodes), table_period_rows=table.period_rows,
        remote_fraction_naive=naive_remote / naive_present if naive_present else None,
        remote_fraction_table=table_remote / table_present if table_present else None,
        table_bytes_per_node=table.bytes_per_node(), notes=notes,
        page_nodes=page_nodes if keep_pages else None)
    return placement, table


def scale_byte_ranges(weight_table: SegmentTable, node: int, group: int,
                      scale_dtype: str, fmt: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Byte ranges ``[starts, ends)`` (within the scale matrix ``scale_shape(rows, cols,
    group, fmt)``) of the scales ``node``'s segments of ``weight_table`` need: for a
    segment's row r and columns [k0, k1), scale columns [k0 // group, ceil(k1 / group)) of
    row r (and for a format with minimums the same columns of its minimums). A scale
    needed by two segments of the node in one row is counted once."""
    seg = weight_table.node_array(node)
    if len(seg) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    if weight_table.cols % group:
        raise ValueError(f"group {group} does not divide the table's {weight_table.cols} columns")
    element = weight_format(scale_dtype).bits_per_element // 8
    groups = weight_table.cols // group
    row_bytes = scale_columns(fmt, weight_table.cols, group) * element
    nrows = seg[:, 2]
    which = np.repeat(np.arange(len(seg)), nrows)
    step = np.arange(int(nrows.sum()), dtype=np.int64) - np.repeat(np.cumsum(nrows) - nrows, nrows)
    row = seg[which, 0] + step * seg[which, 1]
    starts = row * row_bytes + seg[which, 3] // group * element
    ends = row * row_bytes + -(-seg[which, 4] // group) * element
    if fmt in MINIMUM_FORMATS:  # the minimums of the same groups, after the row's scales
        starts = np.concatenate([starts, starts + groups * element])
        ends = np.concatenate([ends, ends + groups * element])
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    # the node's ranges do not nest, so only a neighbour can share a scale
    starts[1:] = np.maximum(starts[1:], ends[:-1])
    keep = starts < ends
    return starts[keep], ends[keep]


def remote_scale_bytes(weight_table: SegmentTable, group: int, scale_dtype: str,
                       scale_page_nodes: np.ndarray, page_bytes: int, offset_bytes: int = 0,
                       fmt: str | None = None) -> dict[int, tuple[int, int]]:
    """Per node of ``weight_table``: (scale bytes its segments need that lie on present
    pages of another node, scale bytes needed on present pages), given the page map of
    the scale buffer (``scale_page_nodes``, ``-errno`` for pages not present)."""
    out = {}
    for node in weight_table.nodes:
        starts, ends = scale_byte_ranges(weight_table, node, group, scale_dtype, fmt)
        out[node] = remote_bytes(starts, ends, node, scale_page_nodes, page_bytes, offset_bytes)
    return out


def quant_node_summary(pairs, group: int, scale_dtype: str, nodes,
                       fmt: str | None = None) -> dict[int, dict[str, int]]:
    """Per node totals over ``pairs`` of (weight table from its map, weight page map,
    scale table from its map, scale page map), each map a ``(page_nodes, page_bytes,
    offset_bytes)`` triple: weight and scale bytes on the node, the remote weight bytes
    of the node's own segments (0 by construction; computed) and the scale bytes its
    segments need, remote and in all."""
    keys = ("weight_bytes", "scale_bytes", "remote_weight_bytes", "scale_bytes_needed",
            "remote_scale_bytes")
    out = {int(n): dict.fromkeys(keys, 0) for n in nodes}
    for weight_table, weight_map, scale_table, scale_map in pairs:
        for node in weight_table.nodes:
            out.setdefault(node, dict.fromkeys(keys, 0))
        for node, b in weight_table.bytes_per_node().items():
            out[node]["weight_bytes"] += b
        for node, b in scale_table.bytes_per_node().items():
            out.setdefault(node, dict.fromkeys(keys, 0))["scale_bytes"] += b
        for node in weight_table.nodes:
            starts, ends = table_byte_ranges(weight_table, node)
            out[node]["remote_weight_bytes"] += remote_bytes(starts, ends, node, *weight_map)[0]
        for node, (remote, needed) in remote_scale_bytes(weight_table, group, scale_dtype,
                                                         *scale_map, fmt=fmt).items():
            out[node]["remote_scale_bytes"] += remote
            out[node]["scale_bytes_needed"] += needed
    return {n: out[n] for n in sorted(out)}


# ------------------------------------------------------------------ checkpoint mmap

def _matches(name: str, pattern: str | None) -> bool:
    if pattern is None:
        return True
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return re.search(pattern, name) is not None


def inspect_checkpoint(checkpoint: str | os.PathLike | Checkpoint, tensor: str | None = None,
                       nodes: Sequence[int] | int | None = None, touch: str = "resident",
                       include_all: bool = False, pattern: NamingPattern | None = None,
                       keep_pages: bool = True, weight_format: str | None = None,
                       group: int | None = None, scale_dtype: str | None = None) -> PlacementReport:
    """Page placement of the checkpoint's routed-expert tensors as they sit in memory now.

    Each file is mapped like safetensors maps it (MAP_SHARED, read-only). ``touch``:
    ``"resident"`` (default) maps the pages already in the page cache into this process
    by reading one byte of each (no disk I/O; mincore tells which), ``"all"`` reads every
    page as a loader would (disk I/O for pages not cached), ``"none"`` touches nothing
    (pages never mapped by this process then read as not present). ``tensor``: a glob
    (``*.experts.0.*``) or regex over tensor names; ``include_all``: every tensor of the
    files, not only the routed experts. ``nodes``: the worker nodes of the split (default:
    the machine's nodes). For a GGUF or FP8 checkpoint the report also holds
    ``import_summary`` of loading it as ``weight_format``/``group``/``scale_dtype``
    (default: the importer's own choice), in ``report.conversion``.
    """
    from numa_moe.placement import memory

    _check_inspect_request(touch, tensor)
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = open_checkpoint(checkpoint, pattern=pattern)
    workers = _worker_nodes(nodes)
    quant = checkpoint.quant
    # quantized: weight name -> its scale tensor's name; both are reported
    scale_of = {} if quant is None else {
        m.tensor.name: m.scales.tensor.name for m in checkpoint.expert_matrices()}
    chosen = _tensors_to_inspect(checkpoint, tensor, include_all, scale_of)
    if not chosen:
        raise ValueError(f"{checkpoint.root}: no tensor matches {tensor!r}"
                         + ("" if include_all else " among the routed experts"))
    notes = [f"touch={touch}: " + _TOUCH_NOTES[touch]]
    results = []
    maps: dict[str, tuple] = {}  # name -> (table from the map, (page_nodes, page_bytes, offset))
    by_file: dict = {}
    for entry in chosen:
        by_file.setdefault(entry.info.path, []).append(entry)
    for path, entries in by_file.items():
        for entry, placement, table, page_map in _measure_file(memory, path, entries, touch,
                                                               workers, keep_pages):
            results.append(placement)
            if quant is not None:
                maps[entry.name] = (table, page_map)
    order = {name: i for i, name in enumerate(checkpoint.tensors)}
    results.sort(key=lambda t: order[t.name])
    per_node = None
    if quant is not None:
        per_node, note = _quant_per_node(quant, scale_of, maps, workers)
        if note is not None:
            notes.append(note)
    conversion = None
    if checkpoint.importer is not None:
        conversion = import_summary(checkpoint, workers, weight_format, group, scale_dtype)
    elif weight_format is not None or group is not None or scale_dtype is not None:
        raise ValueError(f"{checkpoint.root}: a load format applies to GGUF and FP8 checkpoints "
                         f"(whose experts inspect converts); this one is {checkpoint.source_format}")
    return PlacementReport(str(checkpoint.root), workers, results, notes, per_node, conversion)


def import_summary(checkpoint: Checkpoint, nodes: Sequence[int], weight_format: str | None = None,
                   group: int | None = None, scale_dtype: str | None = None, page: str = "4k",
                   sample_experts: int = 1) -> dict:
    """What loading an imported (GGUF, FP8) checkpoint into an ExpertStore costs and loses:
    the conversion, the expert bytes in the file and in interleaved memory (from the
    theoretical tables of the store's buffers over ``nodes``), and the conversion error of
    the first ``sample_experts`` experts of the first MoE layer against the file's own
    dequantized values (``expert_import.measure_conversion``, one matrix at a time)."""
    from numa_moe.checkpoints.expert_import import measure_conversion
    from numa_moe.layer.store import checkpoint_tables, page_bytes_of

    importer = checkpoint.importer
    fmt = importer.resolve(checkpoint.root, checkpoint.dims, weight_format, group, scale_dtype)
    tables = checkpoint_tables(checkpoint, nodes, page, fmt.fmt, fmt.group, fmt.scale_dtype)
    per_node: dict[int, int] = {}
    for layer_tables in tables.values():
        for table in layer_tables.values():
            for node, nbytes in table.bytes_per_node().items():
                per_node[node] = per_node.get(node, 0) + nbytes
    first = checkpoint.layers[checkpoint.layer_ids[0]]
    sample = [first.matrices[kind][e] for e in range(min(sample_experts, first.n_experts))
              for kind in KINDS]
    errors = measure_conversion(checkpoint, fmt, sample)
    return {"conversion": importer.describe(fmt), "format": fmt.fmt, "group": fmt.group,
            "scale_dtype": fmt.scale_dtype, "exact": importer.exact(fmt),
            "file_bytes": sum(m.nbytes for m in checkpoint.expert_matrices()),
            "loaded_bytes": sum(per_node.values()), "page_bytes": page_bytes_of(page),
            "bytes_per_node": {str(n): b for n, b in sorted(per_node.items())},
            "errors": [e.to_dict() for e in errors]}


def _quant_per_node(quant, scale_of: dict[str, str], maps: dict[str, tuple],
                    workers: tuple[int, ...]) -> tuple[dict | None, str | None]:
    """The per-node weight/scale summary of the weight tensors measured with their scales,
    and the note that says so; (None, None) when no such pair was measured."""
    pairs = [(*maps[w], *maps[sc]) for w, sc in scale_of.items() if w in maps and sc in maps]
    if not pairs:
        return None, None
    return (quant_node_summary(pairs, quant.group, quant.scale_dtype, workers, quant.fmt),
            f"{quant.describe()}: per-node weight/scale bytes and remote reads below "
            f"({len(pairs)} weight tensor(s) with their scales)")


_TOUCH_NOTES = {
    "resident": "page-cache pages mapped by reading one byte each (no disk I/O)",
    "all": "every page read (disk I/O for pages not cached), as a loader would",
    "none": "nothing touched: pages this process never mapped read as not present"}


def _check_inspect_request(touch: str, tensor: str | None) -> None:
    if touch not in ("resident", "all", "none"):
        raise ValueError(f"touch must be 'resident', 'all' or 'none', got {touch!r}")
    if tensor is not None and not any(ch in tensor for ch in "*?["):
        try:
            re.compile(tensor)
        except re.error as err:
            raise ValueError(f"tensor pattern {tensor!r} is not a valid regex: {err}") from None


class _Inspected(NamedTuple):
    """A tensor to inspect, as one [rows, cols] matrix of ``fmt`` (a fused tensor is one
    [E * rows, cols] matrix, as it lies in the file)."""

    name: str
    info: TensorInfo
    rows: int
    cols: int
    fmt: str


def _tensors_to_inspect(checkpoint: Checkpoint, tensor: str | None, include_all: bool,
                        scale_of: dict[str, str]) -> list[_Inspected]:
    """The tensors ``tensor`` names among the routed experts and their scales (or among
    all tensors), in checkpoint order, leaving out empty ones and dtypes without a width."""
    expert_tensors = {m.tensor.name for m in checkpoint.expert_matrices()}
    scale_names = set(scale_of.values())
    chosen = []
    for name, info in checkpoint.tensors.items():
        if not include_all and name not in expert_tensors and name not in scale_names:
            continue
        if not _matches(name, tensor) or len(info.shape) < 1 or info.nbytes == 0:
            continue
        if info.dtype not in _FORMAT_OF_DTYPE:
            if info.dtype not in DTYPE_BYTES and len(info.shape) >= 2:
                # a block encoding (GGUF Q8_0, Q4_K, ...): its rows of blocks, as bytes
                rows = int(np.prod(info.shape[:-1]))
                chosen.append(_Inspected(name, info, rows, info.nbytes // rows, "int8"))
            continue
        cols = info.shape[-1]
        rows = info.nbytes // (cols * info.itemsize)
        fmt = _FORMAT_OF_DTYPE[info.dtype]
        if name in scale_of:
            fmt = checkpoint.quant.fmt
            cols = cols * 2 if nibble_packed(fmt) else cols
        chosen.append(_Inspected(name, info, rows, cols, fmt))
    return chosen


def _measure_file(memory, path, entries: list[_Inspected], touch: str,
                  workers: tuple[int, ...], keep_pages: bool) -> list[tuple]:
    """Map one file as safetensors does, touch its pages as ``touch`` says and measure
    each entry's pages: per entry, in file order, (entry, placement, table from its map,
    (page_nodes, page_bytes, offset_bytes))."""
    measured = []
    with os.fdopen(open_checkpoint_file(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        whole = np.frombuffer(mm, dtype=np.uint8)
        if touch == "resident":
            resident = memory.resident_pages(whole)
            idx = np.flatnonzero(resident) * BASE_PAGE_BYTES
            int(whole[idx].sum())  # reading maps the cached pages into this process
        elif touch == "all":
            int(whole[::BASE_PAGE_BYTES].sum())
        for entry in sorted(entries, key=lambda e: e.info.file_offset):
            view = whole[entry.info.file_offset:entry.info.file_offset + entry.info.nbytes]
            pm = memory.page_map(view)
            page_nodes = np.asarray(pm.nodes)
            placement, table = analyse_map(entry.name, entry.rows, entry.cols, entry.fmt,
                                           page_nodes, pm.page_bytes, pm.offset_bytes, workers,
                                           keep_pages=keep_pages)
            if entry.info.dtype not in DTYPE_BYTES:
                placement.fmt = f"{entry.info.dtype} bytes"  # rows of blocks, cols in bytes
            measured.append((entry, placement, table, (page_nodes, pm.page_bytes, pm.offset_bytes)))
            del view
        del whole
    finally:
        mm.close()
    return measured


def _worker_nodes(nodes) -> tuple[int, ...]:
    from numa_moe.layer.store import parse_nodes

    parsed = parse_nodes(nodes)
    if parsed is not None:
        return parsed
    from numa_moe.placement.topology import current_topology

    return tuple(current_topology().node_ids)


def placement_report(store, keep_pages: bool = True) -> PlacementReport:
    """The same report for the buffers of a loaded ``ExpertStore``, measured now.

    Besides the map itself, each buffer's note says whether the table the store uses
    still equals the table built from the map (pages can move after loading, e.g. with
    automatic NUMA balancing).
    """
    from numa_moe.placement import memory

    results = []
    quantized = getattr(store, "group", None) is not None
    pairs = []

    def measure(name, buffer, in_use):
        pm = memory.page_map(buffer)
        page_nodes = np.asarray(pm.nodes)
        placement, from_map = analyse_map(
            name, in_use.rows, in_use.cols, in_use.fmt, page_nodes, pm.page_bytes,
            pm.offset_bytes, store.nodes, keep_pages=keep_pages)
        if from_map == in_use:
            placement.notes.append(f"table in use ({in_use.source}) matches the map")
        else:
            placement.notes.append(f"table in use ({in_use.source}) NO LONGER matches the map")
        results.append(placement)
        return from_map, (page_nodes, pm.page_bytes, pm.offset_bytes)

    for layer in store.layers:
        for kind in KINDS:
            weights = measure(f"layer {layer} {kind}", store.weights(layer, kind),
                              store.table(layer, kind))
            if quantized:
                scales = measure(f"layer {layer} {kind} scales", store.scales(layer, kind),
                                 store.scale_table(layer, kind))
                pairs.append((*weights, *scales))
    notes = [f"{len(store.mismatches)} buffer(s) differed from the theoretical interleave at load"]
    per_node = None
    if quantized:
        per_node = quant_node_summary(pairs, store.group, store.scale_dtype, store.nodes,
                                      store.weight_format)
    return PlacementReport(repr(store), tuple(store.nodes), results, notes, per_node)


# ------------------------------------------------------------------ plot


def plot_placement(report: PlacementReport, path: str | os.PathLike, max_tensors: int = 48,
                   title: str | None = None, format: str | None = None) -> int:
    """One horizontal strip per tensor, each page coloured by its node (grey: not present);
    every strip is scaled to the full width (x: fraction of the tensor's pages).

    Returns the number of strips drawn. Needs matplotlib (``pip install numa-moe[plot]``).
    ``format`` (e.g. "png") when ``path``'s suffix does not name one.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError as err:
        raise RuntimeError("plotting needs matplotlib: pip install 'numa-moe[plot]' "
                           f"(or pip install matplotlib) ({err})") from err
    tensors = [t for t in report.tensors if t.page_nodes is not None][:max_tensors]
    if not tensors:
        raise ValueError("nothing to plot: the report holds no page maps (keep_pages=False?)")
    nodes = sorted({n for t in tensors for n in t.pages_per_node} | set(report.worker_nodes))
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#17becf"]
    colours = ["#d0d0d0"] + [palette[i % len(palette)] for i in range(len(nodes))]
    index_of = {n: i + 1 for i, n in enumerate(nodes)}
    height = max(2.0, 0.28 * len(tensors) + 1.2)
    fig, ax = plt.subplots(figsize=(10, height))
    for row, t in enumerate(tensors):
        codes = np.array([index_of.get(int(n), 0) if n >= 0 else 0 for n in t.page_nodes])
        ax.imshow(codes[None, :], aspect="auto", cmap=ListedColormap(colours), vmin=0,
                  vmax=len(colours) - 1, extent=(0, 1, row + 0.9, row + 0.1),
                  interpolation="nearest")
    ax.set_xlim(0, 1)
    ax.set_ylim(len(tensors), 0)
    ax.set_yticks([r + 0.5 for r in range(len(tensors))])
    ax.set_yticklabels([_short(t.name) for t in tensors], fontsize=7)
    # Each strip spans its own tensor, whatever its page count, so that tensors of
    # different sizes line up: the axis is the fraction of the tensor's pages.
    ax.set_xlabel("position in tensor (fraction of its pages, first page at 0)")
    handles = [Patch(color=colours[index_of[n]], label=f"node {n}") for n in nodes]
    handles.append(Patch(color=colours[0], label="not present"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
              fontsize=7, frameon=False, borderaxespad=0.2)
    ax.set_title(title or f"page placement: {_short(report.source, 50)}", fontsize=8, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=format)  # format: None = from the file name
    plt.close(fig)
    return len(tensors)


def _short(text: str, limit: int = 48) -> str:
    text = text.replace("model.layers.", "L").replace(".weight", "")
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


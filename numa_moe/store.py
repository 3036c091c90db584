"""Routed experts loaded into page-interleaved memory, with their segment tables.

Layout (the one ``numa-moe tables`` describes): per MoE layer one buffer per matrix
kind, experts stacked along rows so the interleave period runs across experts:

    gate  [E * I, H]     up  [E * I, H]     down  [E * H, I]

each allocated by ``memory.interleaved_empty`` (page-aligned start, the page cycle
starting at the buffer's ``phase``). Expert ``e`` of ``gate`` is rows ``[e*I, (e+1)*I)``,
of ``down`` rows ``[e*H, (e+1)*H)``. Quantised formats add one scale buffer per kind
(``scale_shape`` of the stacked matrix), with its own table.

Loading copies tensor by tensor straight from the file into the destination rows
(``os.preadv``), so extra memory is nil beyond the page cache; the checkpoint is opened
read-only. After the copy the real page map is measured and compared with the
theoretical table; on a mismatch (THP not granted, a policy not applied, pages moved)
a ``PlacementMismatchWarning`` is issued, recorded in ``store.mismatches``, and the
measured table is used.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from numa_moe.checkpoint import _short
from numa_moe.checkpoint import (KINDS, Checkpoint, ModelDims, NamingPattern, open_checkpoint_file,
                                 read_matrix_into)
from numa_moe.pages import PAGE_BYTES as PAGE_SIZES
from numa_moe.pages import page_bytes_of
from numa_moe.segments import MAX_NODES, SegmentTable, check_node_id, scale_shape, weight_format

__all__ = [
    "PAGE_SIZES",
    "page_bytes_of",
    "parse_nodes",
    "buffer_shape",
    "expert_rows",
    "expert_tables_of",
    "layer_tables",
    "checkpoint_tables",
    "PlacementMismatch",
    "PlacementMismatchWarning",
    "StoreLayer",
    "ExpertStore",
]

# safetensors dtype -> (numpy dtype name for the buffer, weight format of the table)
_STORE_DTYPES = {"BF16": ("bfloat16", "bf16"), "F16": ("float16", "fp16"),
                 "F32": ("float32", "fp32")}


def parse_nodes(nodes: int | str | Sequence[int] | None) -> tuple[int, ...] | None:
    """``2`` -> (0, 1); ``"0,2"`` -> (0, 2); a sequence is kept; None stays None."""
    if nodes is None:
        return None
    if isinstance(nodes, str):
        text = nodes.strip()
        try:
            if "," not in text:
                nodes = int(text)
            else:
                nodes = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"nodes must be a count N or a list of node ids such as 0,2; "
                             f"got {_short(nodes)}") from None
    if isinstance(nodes, (int, np.integer)) and not isinstance(nodes, bool):
        if nodes < 1:
            raise ValueError(f"number of nodes must be >= 1, got {nodes}")
        if nodes > MAX_NODES:
            raise ValueError(f"number of nodes must be at most {MAX_NODES} (the most a Linux "
                             f"machine or a virtual topology has), got {nodes}")
        return tuple(range(int(nodes)))
    return tuple(check_node_id(int(n)) for n in nodes)


def buffer_shape(dims: ModelDims, kind: str) -> tuple[int, int]:
    """Shape of the stacked buffer of one matrix kind: gate/up [E*I, H], down [E*H, I]."""
    E, I, H = dims.n_experts, dims.intermediate_size, dims.hidden_size
    if kind in ("gate", "up"):
        return E * I, H
    if kind == "down":
        return E * H, I
    raise ValueError(f"unknown matrix kind {kind!r}; expected one of {KINDS}")


def expert_rows(dims: ModelDims, kind: str, expert: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of expert ``expert`` inside the stacked buffer of ``kind``."""
    per_expert = dims.intermediate_size if kind in ("gate", "up") else dims.hidden_size
    return expert * per_expert, (expert + 1) * per_expert


def expert_tables_of(tables: Mapping[str, SegmentTable], dims: ModelDims,
                     expert: int) -> dict[str, SegmentTable]:
    """The tables of one expert's matrices, cut (``slice_rows``) from the tables of the
    stacked buffers at the rows ``expert_rows`` gives."""
    return {kind: tables[kind].slice_rows(*expert_rows(dims, kind, expert)) for kind in KINDS}


def layer_tables(dims: ModelDims, nodes: Sequence[int] | int, page: str | int = "4k",
                 fmt: str = "bf16", group: int | None = None, scale_fmt: str = "fp32",
                 phase: int = 0) -> dict[str, SegmentTable]:
    """Theoretical tables of one layer's buffers (and of their scales for int8/int4).

    Keys: ``gate``, ``up``, ``down`` and, for quantised formats, ``gate_scales``,
    ``up_scales``, ``down_scales`` (scales [rows, cols / group] of ``scale_fmt``, each
    in its own page-aligned buffer).
    """
    page_bytes = page_bytes_of(page)
    fmt_name = weight_format(fmt).name
    tables: dict[str, SegmentTable] = {}
    for kind in KINDS:
        rows, cols = buffer_shape(dims, kind)
        tables[kind] = SegmentTable.theoretical(rows, cols, fmt_name, page_bytes, nodes, phase=phase)
    if fmt_name in ("int8", "int4"):
        g = 128 if group is None else int(group)
        for kind in KINDS:
            rows, cols = buffer_shape(dims, kind)
            s_rows, s_cols = scale_shape(rows, cols, g)
            tables[f"{kind}_scales"] = SegmentTable.theoretical(s_rows, s_cols, scale_fmt,
                                                                page_bytes, nodes, phase=phase)
    return tables


def checkpoint_tables(checkpoint: Checkpoint, nodes: Sequence[int] | int, page: str | int = "4k",
                      fmt: str = "bf16", group: int | None = None, scale_fmt: str = "fp32",
                      layers: Iterable[int] | None = None, progress: bool = False
                      ) -> dict[int, dict[str, SegmentTable]]:
    """Tables of every MoE layer of a checkpoint, from its headers only.

    All MoE layers share one expert shape, so one computation serves every layer; the
    result still has an entry per layer since a loader allocates (and may measure) per
    layer.
    """
    from tqdm.auto import tqdm

    chosen = _choose_layers(checkpoint, layers)
    shared = layer_tables(checkpoint.dims, nodes, page, fmt, group, scale_fmt)
    out = {}
    # One computation serves every layer, so a rate would be meaningless: count the layers.
    counter = tqdm(chosen, desc="tables", disable=not progress,
                   bar_format="{desc}: {n_fmt}/{total_fmt} MoE layers |{bar}| [{elapsed}]")
    for layer in counter:
        out[layer] = dict(shared)
    return out


def _choose_layers(checkpoint: Checkpoint, layers: Iterable[int] | None) -> tuple[int, ...]:
    if layers is None:
        return checkpoint.layer_ids
    chosen = tuple(int(layer) for layer in layers)
    unknown = [layer for layer in chosen if layer not in checkpoint.layers]
    if unknown:
        raise ValueError(f"layer(s) {unknown} have no routed experts in {checkpoint.root}; "
                         f"MoE layers are {list(checkpoint.layer_ids)}")
    return chosen


class PlacementMismatchWarning(UserWarning):
    """The measured page map of a buffer differs from the theoretical interleave."""


@dataclass(frozen=True)
class PlacementMismatch:
    layer: int
    kind: str
    reason: str
    theoretical: SegmentTable | None
    measured: SegmentTable


@dataclass
class StoreLayer:
    """One layer's buffers (``weights[kind]``), the tables in use and the theoretical ones."""

    layer: int
    weights: dict[str, np.ndarray]
    tables: dict[str, SegmentTable]
    theoretical: dict[str, SegmentTable | None]
    measured: dict[str, bool] = field(default_factory=dict)

    @property
    def gate(self) -> np.ndarray:
        return self.weights["gate"]

    @property
    def up(self) -> np.ndarray:
        return self.weights["up"]

    @property
    def down(self) -> np.ndarray:
        return self.weights["down"]


class ExpertStore:
    """Routed experts of a checkpoint in interleaved memory. Build with ``ExpertStore.load``."""

    def __init__(self, checkpoint: Checkpoint, layers: dict[int, StoreLayer], nodes: tuple[int, ...],
                 page_bytes: int, mismatches: list[PlacementMismatch]):
        self.checkpoint = checkpoint
        self._layers = layers
        self.nodes = nodes
        self.page_bytes = page_bytes
        self.mismatches = mismatches

    # -------------------------------------------------------------- loading
    @classmethod
    def load(cls, checkpoint: str | os.PathLike | Checkpoint, nodes=None, page: str | int = "4k",
             layers: Iterable[int] | None = None, progress: bool = True,
             pattern: NamingPattern | None = None) -> "ExpertStore":
        """Copy the routed experts of ``checkpoint`` into interleaved buffers.

        ``nodes``: node ids (or a count N for 0..N-1) to interleave over; None = the
        memory layer's default (all allowed nodes). ``page``: "4k" or "2m".
        ``layers``: a subset of MoE layer ids (default all).
        """
        from numa_moe import memory
        from tqdm.auto import tqdm

        if not isinstance(checkpoint, Checkpoint):
            checkpoint = Checkpoint.open(checkpoint, pattern=pattern)
        page_bytes = page_bytes_of(page)
        node_list = parse_nodes(nodes)
        chosen = _choose_layers(checkpoint, layers)
        dims = checkpoint.dims
        if checkpoint.dtype not in _STORE_DTYPES:
            raise ValueError(f"{checkpoint.root}: routed experts are {checkpoint.dtype}; the store "
                             f"loads {', '.join(_STORE_DTYPES)} checkpoints")
        np_dtype, fmt = _STORE_DTYPES[checkpoint.dtype]
        total = sum(m.nbytes for layer in chosen for kind in KINDS
                    for m in checkpoint.layers[layer].matrices[kind])
        loaded: dict[int, StoreLayer] = {}
        mismatches: list[PlacementMismatch] = []
        fds: dict[Path, int] = {}
        used_nodes: tuple[int, ...] | None = None
        try:
            with tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                      desc="load experts") as bar:
                for layer in chosen:
                    source = checkpoint.layers[layer]
                    weights, tables, theoretical, measured = {}, {}, {}, {}
                    for kind in KINDS:
                        rows, cols = buffer_shape(dims, kind)
                        buffer = memory.interleaved_empty((rows, cols), np_dtype, nodes=node_list,
                                                          page=page)
                        for e, matrix in enumerate(source.matrices[kind]):
                            fd = fds.get(matrix.tensor.path)
                            if fd is None:
                                fd = fds[matrix.tensor.path] = open_checkpoint_file(matrix.tensor.path)
                            read_matrix_into(matrix, buffer[slice(*expert_rows(dims, kind, e))], fd)
                            bar.update(matrix.nbytes)
                        table, theory, was_measured, mismatch = _table_of(
                            memory, buffer, layer, kind, rows, cols, fmt, page_bytes)
                        if mismatch is not None:
                            mismatches.append(mismatch)
                            warnings.warn(f"layer {layer} {kind}: {mismatch.reason}; using the "
                                          "measured table", PlacementMismatchWarning, stacklevel=2)
                        used_nodes = used_nodes or table.nodes
                        weights[kind], tables[kind] = buffer, table
                        theoretical[kind], measured[kind] = theory, was_measured
                    loaded[layer] = StoreLayer(layer, weights, tables, theoretical, measured)
        finally:
            for fd in fds.values():
                os.close(fd)
        return cls(checkpoint, loaded, used_nodes or (), page_bytes, mismatches)

    # -------------------------------------------------------------- queries
    @property
    def dims(self) -> ModelDims:
        return self.checkpoint.dims

    @property
    def hidden_size(self) -> int:
        return self.dims.hidden_size

    @property
    def intermediate_size(self) -> int:
        return self.dims.intermediate_size

    @property
    def n_experts(self) -> int:
        return self.dims.n_experts

    @property
    def top_k(self) -> int | None:
        return self.dims.top_k

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self._layers)

    def layer(self, layer: int) -> StoreLayer:
        try:
            return self._layers[layer]
        except KeyError:
            raise KeyError(f"layer {layer} is not loaded; loaded layers: {list(self._layers)}") from None

    def weights(self, layer: int, kind: str) -> np.ndarray:
        """The stacked buffer of ``kind`` (gate/up [E*I, H], down [E*H, I])."""
        return self.layer(layer).weights[_check_kind(kind)]

    def torch_weights(self, layer: int, kind: str):
        """The same buffer as a zero-copy torch tensor (torch.bfloat16 for bf16)."""
        from numa_moe import memory

        return memory.as_torch(self.weights(layer, kind))

    def table(self, layer: int, kind: str) -> SegmentTable:
        """The table in use for the buffer (measured when it differed from theory)."""
        return self.layer(layer).tables[_check_kind(kind)]

    def expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Views (gate [I, H], up [I, H], down [H, I]) of one expert, no copy."""
        self._check_expert(expert)
        return tuple(self.weights(layer, kind)[slice(*expert_rows(self.dims, kind, expert))]
                     for kind in KINDS)

    def expert_tables(self, layer: int, expert: int) -> dict[str, SegmentTable]:
        """The tables of one expert's matrices (``SegmentTable.slice_rows`` of the stack)."""
        self._check_expert(expert)
        return expert_tables_of(self.layer(layer).tables, self.dims, expert)

    def _check_expert(self, expert: int) -> None:
        if not 0 <= expert < self.n_experts:
            raise IndexError(f"expert {expert} out of range: the store holds {self.n_experts} experts")

    def __repr__(self) -> str:
        return (f"ExpertStore({self.checkpoint.root}, layers={list(self._layers)}, "
                f"E={self.n_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
                f"nodes={list(self.nodes)}, page_bytes={self.page_bytes}, "
                f"mismatches={len(self.mismatches)})")


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown matrix kind {kind!r}; expected one of {KINDS}")
    return kind


def _table_of(memory, buffer: np.ndarray, layer: int, kind: str, rows: int, cols: int, fmt: str,
              page_bytes: int):
    """(table in use, theoretical table or None, measured?, mismatch or None) of a buffer."""
    info = memory.interleave_info(buffer)
    theory = None
    if info is not None:
        theory = SegmentTable.theoretical(rows, cols, fmt, info.page_bytes, info.nodes,
                                          phase=info.phase)
    try:
        page_map = memory.page_map(buffer)
    except OSError as err:
        if theory is None:
            raise
        warnings.warn(f"layer {layer} {kind}: page map not measurable ({err}); using the "
                      "theoretical table unchecked", PlacementMismatchWarning, stacklevel=3)
        return theory, theory, False, None
    measured = SegmentTable.from_page_map(rows, cols, fmt, page_map.nodes, page_map.page_bytes,
                                          page_map.offset_bytes,
                                          nodes=theory.nodes if theory is not None else None)
    if theory is None:
        reason = "buffer carries no interleave information"
        return measured, None, True, PlacementMismatch(layer, kind, reason, None, measured)
    if measured == theory and not measured.pages_not_present:
        return theory, theory, True, None
    reason = _mismatch_reason(theory, measured, page_map, info)
    return measured, theory, True, PlacementMismatch(layer, kind, reason, theory, measured)


def _mismatch_reason(theory: SegmentTable, measured: SegmentTable, page_map, info) -> str:
    nodes = np.asarray(page_map.nodes)
    n = len(info.nodes)
    base = page_map.page_bytes
    expected = np.asarray(info.nodes)[(info.phase + (np.arange(len(nodes)) * base) // info.page_bytes) % n]
    wrong = int(np.count_nonzero(nodes != expected))
    absent = int(np.count_nonzero(nodes < 0))
    return (f"measured page map differs from the interleave over nodes {list(info.nodes)} at "
            f"{info.page_bytes} B pages: {wrong} of {len(nodes)} pages elsewhere ({absent} not "
            f"present); theoretical period {theory.period_rows} rows, measured "
            f"{measured.period_rows}; bytes per node {measured.bytes_per_node()}")

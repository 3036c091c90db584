"""Routed experts loaded into page-interleaved memory, with their segment tables.

Layout (the one ``numa-moe tables`` describes): per MoE layer one buffer per matrix
kind, experts stacked along rows so the interleave period runs across experts:

    gate  [E * I, H]     up  [E * I, H]     down  [E * H, I]

each allocated by ``memory.interleaved_empty`` (page-aligned start, the page cycle
starting at the buffer's ``phase``). Expert ``e`` of ``gate`` is rows ``[e*I, (e+1)*I)``,
of ``down`` rows ``[e*H, (e+1)*H)``.

INT8 / INT4 / MXFP4 / IQ4_NL (docs/quantization.md): the value buffer of a kind is int8
``[rows, cols]`` or uint8 ``[rows, cols / 2]`` (int4, mxfp4, iq4nl: two weights per byte),
and each kind has a second interleaved buffer of group scales ``[rows, cols / group]``
(fp16, bf16 or fp32; e8m0 for mxfp4, one byte per scale), with its own table
(``scale_table``). Tables count columns in weights (elements), also for the 4-bit formats, as ``formats.WeightFormat``
does. A quantized checkpoint is copied as it is; a
float one is quantized while copying (``numa_moe.quant``, each expert matrix on its own);
GGUF and FP8 experts are converted by the checkpoint's ``importer``
(``numa_moe.checkpoints.expert_import``), each expert matrix on its own.

Loading copies tensor by tensor straight from the file into the destination rows
(``os.preadv``), so extra memory is nil beyond the page cache (a conversion holds one
expert matrix's temporaries per loading thread); the checkpoint is opened read-only. The
expert matrices of a kind are read and converted by several threads at once (numpy and
``preadv`` release the GIL; each matrix has its own rows, so the bytes are the same
whatever the thread count). After the copy the real page map is measured and compared with the
theoretical table; on a mismatch (THP not granted, a policy not applied, pages moved)
a ``PlacementMismatchWarning`` is issued, recorded in ``store.mismatches``, and the
measured table is used.
"""

from __future__ import annotations

import functools
import os
import warnings
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.checkpoints.expert_import import LoadFormat
from numa_moe.checkpoints.naming import NamingPattern
from numa_moe.checkpoints.safetensors import Checkpoint, ModelDims, read_matrix_into, read_scales_into
from numa_moe.files import OpenFiles, byte_progress, short
from numa_moe.formats import (FLOAT_FORMATS, KINDS, NUMPY_DTYPES, QUANT_DTYPES, QUANT_FORMATS,
                              SCALE_DTYPES, nibble_packed, positive_int, weight_format)
from numa_moe.placement.pages import PAGE_BYTES, page_bytes_of
from numa_moe.placement.segments import MAX_NODES, SegmentTable, check_node_id, scale_shape
from numa_moe.quant import check_arguments, scale_layout

__all__ = [
    "PAGE_BYTES",
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
    "MAX_LOAD_THREADS",
    "load_threads",
]


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
                             f"got {short(nodes)}") from None
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
                 fmt: str = "bf16", group: int | None = None, scale_dtype: str | None = None,
                 phase: int = 0) -> dict[str, SegmentTable]:
    """Theoretical tables of one layer's buffers (and of their scales for the quantized
    formats).

    Keys: ``gate``, ``up``, ``down`` and, for quantised formats, ``gate_scales``,
    ``up_scales``, ``down_scales`` (scales [rows, cols / group] of ``scale_dtype``, each
    in its own page-aligned buffer). ``group`` and ``scale_dtype`` default to the
    format's own (mxfp4: 32, e8m0), else to 128 and fp32.
    """
    page_bytes = page_bytes_of(page)
    fmt_name = weight_format(fmt).name
    tables: dict[str, SegmentTable] = {}
    for kind in KINDS:
        rows, cols = buffer_shape(dims, kind)
        tables[kind] = SegmentTable.theoretical(rows, cols, fmt_name, page_bytes, nodes, phase=phase)
    if fmt_name in QUANT_FORMATS:
        g, scale_dtype = scale_layout(fmt_name, None if group is None else int(group), scale_dtype,
                                      default_scale_dtype="fp32", any_group=True)
        for kind in KINDS:
            rows, cols = buffer_shape(dims, kind)
            s_rows, s_cols = scale_shape(rows, cols, g, fmt_name)
            tables[f"{kind}_scales"] = SegmentTable.theoretical(s_rows, s_cols, scale_dtype,
                                                                page_bytes, nodes, phase=phase)
    return tables


def checkpoint_tables(checkpoint: Checkpoint, nodes: Sequence[int] | int, page: str | int = "4k",
                      fmt: str = "bf16", group: int | None = None, scale_dtype: str | None = None,
                      layers: Iterable[int] | None = None, progress: bool = False
                      ) -> dict[int, dict[str, SegmentTable]]:
    """Tables of every MoE layer of a checkpoint, from its headers only.

    All MoE layers share one expert shape, so one computation serves every layer; the
    result still has an entry per layer since a loader allocates (and may measure) per
    layer.
    """
    from tqdm.auto import tqdm

    chosen = _choose_layers(checkpoint, layers)
    shared = layer_tables(checkpoint.dims, nodes, page, fmt, group, scale_dtype)
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
    """One layer's buffers (``weights[kind]``), the tables in use and the theoretical ones;
    for the quantized formats also the scale buffers (``scales[kind]``) and their tables."""

    layer: int
    weights: dict[str, np.ndarray]
    tables: dict[str, SegmentTable]
    theoretical: dict[str, SegmentTable | None]
    measured: dict[str, bool] = field(default_factory=dict)
    scales: dict[str, np.ndarray] = field(default_factory=dict)
    scale_tables: dict[str, SegmentTable] = field(default_factory=dict)
    scale_theoretical: dict[str, SegmentTable | None] = field(default_factory=dict)
    scale_measured: dict[str, bool] = field(default_factory=dict)
    # one (gate [I], up [I], down [H]) float32 tuple per expert, None when the experts
    # have no biases (as MoELayer(biases=) takes them)
    biases: list | None = None

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
                 page_bytes: int, mismatches: list[PlacementMismatch],
                 weight_format: str | None = None, group: int | None = None,
                 scale_dtype: str | None = None):
        self.checkpoint = checkpoint
        self._layers = layers
        self.nodes = nodes
        self.page_bytes = page_bytes
        self.mismatches = mismatches
        #: "bf16", "fp16", "fp32" (as in the file), "int8", "int4", "mxfp4" or "iq4nl"
        self.weight_format = weight_format or FLOAT_FORMATS[checkpoint.dtype]
        #: scale group size and scale dtype name ("fp16", "bf16", "fp32", "e8m0"); None
        #: for float formats
        self.group = group
        self.scale_dtype = scale_dtype

    # -------------------------------------------------------------- loading
    @classmethod
    def load(cls, checkpoint: str | os.PathLike | Checkpoint, nodes=None, page: str | int = "4k",
             layers: Iterable[int] | None = None, progress: bool = True,
             pattern: NamingPattern | None = None, weight_format: str | None = None,
             group: int | None = None, scale_dtype: str | None = None,
             threads: int | None = None) -> "ExpertStore":
        """Copy the routed experts of ``checkpoint`` into interleaved buffers.

        ``nodes``: node ids (or a count N for 0..N-1) to interleave over; None = the
        memory layer's default (all allowed nodes). ``page``: "4k" or "2m".
        ``layers``: a subset of MoE layer ids (default all).
        ``weight_format``: None keeps the file's format; "int8"/"int4"/"mxfp4"/"iq4nl"
        quantizes a BF16/F16/F32 checkpoint while copying (``group``, default 128, and
        ``scale_dtype``, default "fp16"; mxfp4 takes group 32 and e8m0 only, iq4nl group 32); a quantized checkpoint loads as it is (its own
        group and scale dtype; asking for others is refused, as is converting it). GGUF
        files and FP8 checkpoints are converted while copying, one expert matrix at a
        time, into what ``checkpoint.importer.resolve`` makes of the request (None: Q8_0
        -> int8, Q4_0 -> int4, MXFP4 -> mxfp4, IQ4_NL / IQ4_XS -> iq4nl without loss, K-quants -> int8/int4 group 32, FP8 ->
        bf16; docs/checkpoints.md, "Formats").
        ``threads``: how many expert matrices are read and converted at once (None: the
        CPUs this process may run on, at most ``MAX_LOAD_THREADS``); the bytes loaded are
        the same for every count.
        """
        from numa_moe.placement import memory

        if not isinstance(checkpoint, Checkpoint):
            checkpoint = open_checkpoint(checkpoint, pattern=pattern)
        page_bytes = page_bytes_of(page)
        node_list = parse_nodes(nodes)
        chosen = _choose_layers(checkpoint, layers)
        fmt, group, scale_dtype, quantize = _store_format(checkpoint, weight_format, group, scale_dtype)
        threads = load_threads(threads)
        total = sum(m.nbytes for layer in chosen for m in checkpoint.layers[layer].expert_matrices())
        loaded: dict[int, StoreLayer] = {}
        with (OpenFiles() as files, byte_progress(total, "load experts", progress) as bar,
              ThreadPoolExecutor(threads, thread_name_prefix="numa-moe-load") as pool):
            loader = _LayerLoader(memory, checkpoint, fmt, group, scale_dtype, quantize,
                                  node_list, page, page_bytes, files, bar, pool)
            for layer in chosen:
                loaded[layer] = loader.load(layer)
        return cls(checkpoint, loaded, loader.used_nodes or (), page_bytes, loader.mismatches,
                   fmt, group, scale_dtype)

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
        """The stacked buffer of ``kind`` (gate/up [E*I, H], down [E*H, I]); for int8 the
        int8 values of that shape, for int4 and mxfp4 the packed uint8 values [rows, cols / 2]."""
        return self.layer(layer).weights[_check_kind(kind)]

    @property
    def quantized(self) -> bool:
        return self.group is not None

    def scales(self, layer: int, kind: str) -> np.ndarray | None:
        """The stacked group scales of ``kind`` [rows, cols / group] (scale_dtype), None
        for float formats."""
        _check_kind(kind)
        return self.layer(layer).scales.get(kind) if self.quantized else None

    def scale_table(self, layer: int, kind: str) -> SegmentTable | None:
        """The table of the scale buffer of ``kind`` (None for float formats)."""
        _check_kind(kind)
        return self.layer(layer).scale_tables.get(kind) if self.quantized else None

    def expert_scales(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Views (gate [I, H/g], up [I, H/g], down [H, I/g]) of one expert's scales, no
        copy; None for float formats."""
        self._check_expert(expert)
        if not self.quantized:
            return None
        return tuple(self.scales(layer, kind)[slice(*expert_rows(self.dims, kind, expert))]
                     for kind in KINDS)

    def expert_scale_tables(self, layer: int, expert: int) -> dict[str, SegmentTable] | None:
        """The tables of one expert's scale matrices (None for float formats)."""
        self._check_expert(expert)
        if not self.quantized:
            return None
        return expert_tables_of(self.layer(layer).scale_tables, self.dims, expert)

    def torch_weights(self, layer: int, kind: str):
        """The same buffer as a zero-copy torch tensor (torch.bfloat16 for bf16)."""
        from numa_moe.placement import memory

        return memory.as_torch(self.weights(layer, kind))

    def table(self, layer: int, kind: str) -> SegmentTable:
        """The table in use for the buffer (measured when it differed from theory)."""
        return self.layer(layer).tables[_check_kind(kind)]

    def expert(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Views (gate [I, H], up [I, H], down [H, I]) of one expert's values, no copy
        (int4, mxfp4: uint8 [I, H/2], [I, H/2], [H, I/2])."""
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
                f"{self.weight_format}"
                + (f" g={self.group} {self.scale_dtype} scales" if self.quantized else "")
                + f", nodes={list(self.nodes)}, page_bytes={self.page_bytes}, "
                f"mismatches={len(self.mismatches)})")


class _LayerLoader:
    """The steps of ``ExpertStore.load`` for one layer: allocate each kind's interleaved
    buffers, copy (or quantize) the experts into them, and measure where their pages
    went. Collects the mismatches and the nodes the tables use."""

    # warnings.warn stacklevels, counted from the warning call: a mismatch names the line
    # that called ExpertStore.load (_placed, load, ExpertStore.load, its caller); a page
    # map that cannot be measured, the line in ExpertStore.load (_table_of, _placed, load,
    # ExpertStore.load).
    _MISMATCH_STACKLEVEL = 4
    _UNMEASURED_STACKLEVEL = 4

    def __init__(self, memory, checkpoint: Checkpoint, fmt: str, group: int | None,
                 scale_dtype: str | None, quantize: bool, nodes: tuple[int, ...] | None,
                 page: str | int, page_bytes: int, files: OpenFiles, bar, pool: ThreadPoolExecutor):
        self.memory = memory
        self.checkpoint = checkpoint
        self.dims = checkpoint.dims
        self.fmt, self.group, self.scale_dtype, self.quantize = fmt, group, scale_dtype, quantize
        self.value_dtype = _VALUE_DTYPES[fmt]
        self.importer = checkpoint.importer
        self.nodes, self.page, self.page_bytes = nodes, page, page_bytes
        self.files, self.bar, self.pool = files, bar, pool
        self.mismatches: list[PlacementMismatch] = []
        self.used_nodes: tuple[int, ...] | None = None

    def load(self, layer: int) -> StoreLayer:
        source = self.checkpoint.layers[layer]
        out = StoreLayer(layer, {}, {}, {}, {})
        for kind in KINDS:
            rows, cols = buffer_shape(self.dims, kind)
            buffer, scales = self._allocate(rows, cols)
            self._fill(kind, source.matrices[kind], buffer, scales)
            table, theory, was_measured = self._placed(buffer, layer, kind, rows, cols, self.fmt)
            self.used_nodes = self.used_nodes or table.nodes
            out.weights[kind], out.tables[kind] = buffer, table
            out.theoretical[kind], out.measured[kind] = theory, was_measured
            if scales is not None:
                s_rows, s_cols = scales.shape
                table, theory, was_measured = self._placed(scales, layer, f"{kind} scales",
                                                           s_rows, s_cols, self.scale_dtype)
                out.scales[kind], out.scale_tables[kind] = scales, table
                out.scale_theoretical[kind] = theory
                out.scale_measured[kind] = was_measured
        out.biases = self.checkpoint.expert_biases(layer, self.files)
        return out

    def _allocate(self, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The value buffer of a kind's stack and, when quantized, its scale buffer."""
        value_cols = cols // 2 if nibble_packed(self.fmt) else cols
        buffer = self.memory.interleaved_empty((rows, value_cols), self.value_dtype,
                                               nodes=self.nodes, page=self.page)
        scales = None
        if self.group is not None:
            scales = self.memory.interleaved_empty(scale_shape(rows, cols, self.group, self.fmt),
                                                   SCALE_DTYPES[self.scale_dtype],
                                                   nodes=self.nodes, page=self.page)
        return buffer, scales

    def _fill(self, kind: str, matrices, buffer: np.ndarray, scales: np.ndarray | None) -> None:
        """Each expert's matrix (and scales) into its rows of the stacked buffers, the
        matrices spread over the pool's threads. The files are opened here, in this thread;
        the progress bar counts a matrix when its copy is done. The first error stops the
        matrices not yet started and is raised once the running ones end."""
        jobs = []
        for e, matrix in enumerate(matrices):
            where = slice(*expert_rows(self.dims, kind, e))
            scale_fd = None
            if self.importer is None and not self.quantize and scales is not None:
                scale_fd = self.files.fd(matrix.scales.tensor.path)
            jobs.append((matrix, self.files.fd(matrix.tensor.path), scale_fd, buffer[where],
                         None if scales is None else scales[where]))
        pending = {self.pool.submit(self._fill_one, *job): job[0] for job in jobs}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    future.result()
                    self.bar.update(pending.pop(future).nbytes)
        finally:
            for future in pending:
                future.cancel()
            wait(pending)

    def _fill_one(self, matrix, fd: int, scale_fd: int | None, values: np.ndarray,
                  scales: np.ndarray | None) -> None:
        """One expert matrix (and its scales) into its rows ``values`` (``scales``)."""
        from numa_moe.checkpoints.quantize import quantize_expert

        if self.importer is not None:
            self.importer.read_into(matrix, fd, values, scales, LoadFormat(self.fmt, self.group, self.scale_dtype))
        elif self.quantize:
            quantize_expert(matrix, fd, self.fmt, self.group, self.scale_dtype, values, scales)
        else:
            read_matrix_into(matrix, values, fd)
            if scales is not None:
                read_scales_into(matrix, scales, scale_fd)

    def _placed(self, buffer: np.ndarray, layer: int, name: str, rows: int, cols: int,
                buffer_fmt: str) -> tuple[SegmentTable, SegmentTable | None, bool]:
        """(table in use, theoretical table, measured?) of a filled buffer; a mismatch is
        recorded and warned of."""
        table, theory, was_measured, mismatch = _table_of(
            self.memory, buffer, layer, name, rows, cols, buffer_fmt, self.page_bytes,
            stacklevel=self._UNMEASURED_STACKLEVEL)
        if mismatch is not None:
            self.mismatches.append(mismatch)
            warnings.warn(f"layer {layer} {name}: {mismatch.reason}; using the "
                          "measured table", PlacementMismatchWarning,
                          stacklevel=self._UNMEASURED_STACKLEVEL)
        return table, theory, was_measured


# The default number of loading threads at most: each holds one expert matrix's
# temporaries (a K-quant matrix dequantized to float32, 4 bytes a weight), and beyond this
# the file reads and page copies, not the conversions, bound a load.
MAX_LOAD_THREADS = 16


def load_threads(threads: int | None) -> int:
    """The loading threads of a request: ``threads`` when an integer >= 1, else (None) the
    CPUs this process may run on, at most ``MAX_LOAD_THREADS``."""
    if threads is None:
        return min(len(os.sched_getaffinity(0)), MAX_LOAD_THREADS)
    return positive_int(threads, "threads")


# store format -> numpy dtype of its value buffers
_VALUE_DTYPES = {**{fmt: NUMPY_DTYPES[code] for code, fmt in FLOAT_FORMATS.items()},
                 **{fmt: NUMPY_DTYPES[code] for fmt, code in QUANT_DTYPES.items()}}


def _store_format(checkpoint: Checkpoint, weight_format: str | None, group: int | None,
                  scale_dtype: str | None) -> tuple[str, int | None, str | None, bool]:
    """(format, group, scale dtype, quantize while copying?) of a load request."""
    check_arguments(**{name: value for name, value in (("group", group), ("scale_dtype", scale_dtype))
                       if value is not None})  # None: the checkpoint's, or the default
    root = checkpoint.root
    if checkpoint.importer is not None:
        # GGUF, FP8: converted while copying, in the format the importer resolves
        fmt = checkpoint.importer.resolve(root, checkpoint.dims, weight_format, group, scale_dtype)
        return fmt.fmt, fmt.group, fmt.scale_dtype, False
    quant = checkpoint.quant
    wanted = None if weight_format is None else _format_name(weight_format)
    if quant is not None:
        if wanted is not None and wanted != quant.fmt:
            raise ValueError(f"{root}: routed experts are {quant.fmt}; the store loads a quantized "
                             f"checkpoint as it is (weight_format None or {quant.fmt!r}), it does not "
                             f"convert it to {wanted}")
        for name, asked, have in (("group", group, quant.group),
                                  ("scale_dtype", scale_dtype, quant.scale_dtype)):
            if asked is not None and asked != have:
                raise ValueError(f"{root}: the checkpoint's scales have {name} {have!r}, not "
                                 f"{asked!r}; a quantized checkpoint loads as it is")
        return quant.fmt, quant.group, quant.scale_dtype, False
    if checkpoint.dtype not in FLOAT_FORMATS:
        raise ValueError(f"{root}: routed experts are {checkpoint.dtype}; the store loads "
                         f"{', '.join(FLOAT_FORMATS)} checkpoints and numa-moe quantized ones")
    own = FLOAT_FORMATS[checkpoint.dtype]
    if wanted in (None, own):
        if group is not None or scale_dtype is not None:
            raise ValueError(f"group and scale_dtype apply to weight_format "
                             f"{'/'.join(map(repr, QUANT_FORMATS))}, not {own}")
        return own, None, None, False
    if wanted not in QUANT_FORMATS:
        raise ValueError(f"{root}: routed experts are {checkpoint.dtype}; the store loads them as "
                         f"{own} or quantizes them to {'/'.join(QUANT_FORMATS)}, not to {wanted}")
    group, scale_dtype = scale_layout(wanted, group, scale_dtype)
    d = checkpoint.dims
    for kind, cols in (("gate/up", d.hidden_size), ("down", d.intermediate_size)):
        if cols % group:
            raise ValueError(f"{root}: group {group} does not divide the {cols} columns of the "
                             f"{kind} matrices")
    return wanted, group, scale_dtype, True


def _format_name(fmt: str) -> str:
    return weight_format(fmt).name


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown matrix kind {kind!r}; expected one of {KINDS}")
    return kind


def _table_of(memory, buffer: np.ndarray, layer: int, kind: str, rows: int, cols: int, fmt: str,
              page_bytes: int, stacklevel: int):
    """(table in use, theoretical table or None, measured?, mismatch or None) of a buffer."""
    info = memory.interleave_info(buffer)
    theory = None
    if info is not None:
        theory = _theoretical_table(rows, cols, fmt, info.page_bytes, tuple(info.nodes), info.phase)
    try:
        page_map = memory.page_map(buffer)
    except OSError as err:
        if theory is None:
            raise
        warnings.warn(f"layer {layer} {kind}: page map not measurable ({err}); using the "
                      "theoretical table unchecked", PlacementMismatchWarning, stacklevel=stacklevel)
        return theory, theory, False, None
    if theory is not None and page_map.offset_bytes == 0 \
            and np.array_equal(page_map.nodes, _interleave_page_nodes(page_map, info)):
        # The map is the interleave page for page, so its table is the theoretical one
        # (tests/test_segments.py: the measured map of an interleave equals it): the
        # common case skips building the table from the map.
        return theory, theory, True, None
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


@functools.lru_cache(maxsize=256)
def _theoretical_table(rows: int, cols: int, fmt: str, page_bytes: int, nodes: tuple[int, ...],
                       phase: int) -> SegmentTable:
    """SegmentTable.theoretical, once per geometry: every layer of a model has the same
    buffer shapes, and a table is never changed once built."""
    return SegmentTable.theoretical(rows, cols, fmt, page_bytes, nodes, phase=phase)


def _interleave_page_nodes(page_map, info) -> np.ndarray:
    """The node of each page of ``page_map`` that the buffer's interleave puts it on."""
    pages = np.arange(len(page_map.nodes)) * page_map.page_bytes // info.page_bytes
    return np.asarray(info.nodes)[(info.phase + pages) % len(info.nodes)]


def _mismatch_reason(theory: SegmentTable, measured: SegmentTable, page_map, info) -> str:
    nodes = np.asarray(page_map.nodes)
    expected = _interleave_page_nodes(page_map, info)
    wrong = int(np.count_nonzero(nodes != expected))
    absent = int(np.count_nonzero(nodes < 0))
    return (f"measured page map differs from the interleave over nodes {list(info.nodes)} at "
            f"{info.page_bytes} B pages: {wrong} of {len(nodes)} pages elsewhere ({absent} not "
            f"present); theoretical period {theory.period_rows} rows, measured "
            f"{measured.period_rows}; bytes per node {measured.bytes_per_node()}")

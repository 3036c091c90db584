"""Projection model: what one MoE layer step costs on a multi-socket machine.

Pure functions over the project's own placement artifacts (segment tables, page maps):
nothing in the package imports this module; the ``numa-moe simulate`` command is a thin
shell over it. See docs/simulate.md for the model, the machine-file schema and the
validation.

The pieces:

* :class:`Machine`: nodes, cores per node, the read bandwidth of every (reading node,
  memory node) pair, per-core compute peaks per ISA and weight format, and the kernel's
  efficiency (fraction of the read bandwidth it achieves). Built-in files live in
  ``numa_moe/apps/machines/*.json``; :func:`load_machine` reads a name or a path and refuses a
  bad file with a one-line :class:`MachineFormatError`.
* :class:`Workload`: expert shapes (from ``synthetic.MODEL_SPECS`` or a checkpoint's
  headers), weight format, page size, layers.
* Routing: uniform top-k, Zipf-skewed top-k, or a recorded trace (expert ids per token
  per layer, see ``integrations.hf.record_routing``): :func:`route_counts`.
* Accounting (:func:`layer_accounting`): per policy, per expert, the bytes each node
  reads from each node's memory. For the interleaved policies (b) and (c) the numbers are
  counted from the tables the project builds for those shapes, formats and page sizes
  (``store.layer_tables``: the stacked ``[E*I, H]`` / ``[E*H, I]`` buffers, scales
  included for int8/int4), never from a closed formula.
* Time model (:func:`simulate`): per node ``max(memory, memory-controller, compute)``,
  slowest node decides, plus the cross-node reduction and a fixed per-layer overhead.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from numa_moe.files import CheckpointError, open_checkpoint_file, read_json_file
from numa_moe.formats import scale_columns, weight_format
from numa_moe.placement.pages import page_name
from numa_moe.placement.segments import SegmentTable

__all__ = [
    "MACHINE_SCHEMA", "MachineFormatError", "Machine", "machine_from_dict", "load_machine",
    "builtin_machines", "Workload", "workload_like", "workload_from_checkpoint", "Routing",
    "load_trace", "route_counts", "POLICIES", "POLICY_NAMES", "LayerAccounting",
    "layer_accounting", "table_bytes_in_rows", "page_bytes_in_rows", "simulate",
    "PolicyResult", "format_report", "measure_machine", "plot_report", "paper_comparison",
    "format_paper_comparison", "validate_run",
]

MACHINE_SCHEMA = "numa-moe/machine"
MACHINE_VERSION = 1
MACHINES_DIR = Path(__file__).parent / "machines"
# A machine file is a few kB (some numbers per node); this is ample, and bounds what a
# wrong path (a log, a checkpoint) costs to read.
MACHINE_FILE_LIMIT = 1 << 20
FORMATS = ("bf16", "int8", "int4")
# formats a workload may take: mxfp4, iq4nl and int4-affine run in the integer kernels at
# the int4 peak (their codebooks' values are multiplied as integers, docs/kernels.md);
# group 32, mxfp4 with e8m0 scales
WORKLOAD_FORMATS = (*FORMATS, "mxfp4", "iq4nl", "int4-affine")
_PEAK_OF = {"mxfp4": "int4", "iq4nl": "int4", "int4-affine": "int4"}

POLICIES = ("a", "b", "c", "d", "e")
POLICY_NAMES = {
    "a": "first touch (all on node 0)",
    "b": "interleaved, naive row split",
    "c": "interleaved, segment tables",
    "d": "per-node shards (TP split)",
    "e": "full replica per node",
}


class MachineFormatError(ValueError):
    """A machine description is not a valid ``numa-moe/machine`` document."""


# --------------------------------------------------------------------------- machine


@dataclass(frozen=True)
class Machine:
    name: str
    nodes: int
    cores_per_node: int
    read_gbps: tuple[tuple[float, ...], ...]  # [reading node][memory node], GB/s
    peak_gflops_per_core: Mapping[str, Mapping[str, float]]  # isa -> format -> GFLOP/s
    isa: str
    kernel_efficiency: float = 1.0   # fraction of read bandwidth the kernel reaches
    compute_efficiency: float = 0.5  # fraction of the ISA peak at compute-bound sizes
    layer_overhead_us: float = 0.0   # fixed cost of one layer step (calls, barriers)
    description: str = ""
    source: str = ""

    def peak(self, fmt: str, isa: str | None = None) -> float:
        isa = isa or self.isa
        fmt = _PEAK_OF.get(fmt, fmt)
        try:
            return float(self.peak_gflops_per_core[isa][fmt])
        except KeyError:
            raise ValueError(f"machine {self.name!r} has no {fmt} peak for isa {isa!r} "
                             f"(peak_gflops_per_core has {sorted(self.peak_gflops_per_core)})") from None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["read_gbps"] = [list(r) for r in self.read_gbps]
        data["peak_gflops_per_core"] = {k: dict(v) for k, v in self.peak_gflops_per_core.items()}
        return {"schema": MACHINE_SCHEMA, "version": MACHINE_VERSION, **data}


def _number(value, what: str, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MachineFormatError(f"{where}{what} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise MachineFormatError(f"{where}{what} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def machine_from_dict(data, where: str = "") -> Machine:
    """A :class:`Machine` from its JSON form; MachineFormatError (one line) otherwise."""
    where = f"{where}: " if where else ""
    if not isinstance(data, Mapping):
        raise MachineFormatError(f"{where}a machine file must hold a JSON object, got {type(data).__name__}")
    if data.get("schema", MACHINE_SCHEMA) != MACHINE_SCHEMA:
        raise MachineFormatError(f"{where}schema is {data.get('schema')!r}, expected {MACHINE_SCHEMA!r}")
    if data.get("version", MACHINE_VERSION) != MACHINE_VERSION:
        raise MachineFormatError(f"{where}version {data.get('version')!r} is not supported (expected {MACHINE_VERSION})")
    required = ("name", "nodes", "cores_per_node", "read_gbps", "peak_gflops_per_core", "isa")
    missing = [k for k in required if k not in data]
    if missing:
        raise MachineFormatError(f"{where}missing key(s) {', '.join(missing)} (required: {', '.join(required)})")
    known = set(required) | {"schema", "version", "kernel_efficiency", "compute_efficiency",
                             "layer_overhead_us", "description", "source"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise MachineFormatError(f"{where}unknown key(s) {', '.join(unknown)}")
    nodes = data["nodes"]
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= 64:
        raise MachineFormatError(f"{where}nodes must be an integer in 1..64, got {nodes!r}")
    cores = data["cores_per_node"]
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise MachineFormatError(f"{where}cores_per_node must be a positive integer, got {cores!r}")
    matrix = data["read_gbps"]
    if (not isinstance(matrix, list) or len(matrix) != nodes
            or not all(isinstance(row, list) and len(row) == nodes for row in matrix)):
        raise MachineFormatError(f"{where}read_gbps must be a {nodes} x {nodes} matrix (one row per "
                                 f"reading node, one column per memory node), got {json.dumps(matrix)[:80]}")
    read = tuple(tuple(_number(v, f"read_gbps[{i}][{j}]", where) for j, v in enumerate(row))
                 for i, row in enumerate(matrix))
    peaks = data["peak_gflops_per_core"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise MachineFormatError(f"{where}peak_gflops_per_core must be an object isa -> {{format: GFLOP/s}}")
    clean = {}
    for isa, per_fmt in peaks.items():
        if not isinstance(per_fmt, Mapping) or not per_fmt:
            raise MachineFormatError(f"{where}peak_gflops_per_core[{isa!r}] must be an object format -> GFLOP/s")
        for fmt in per_fmt:
            if fmt not in FORMATS:
                raise MachineFormatError(f"{where}peak_gflops_per_core[{isa!r}] has format {fmt!r}; "
                                         f"known: {', '.join(FORMATS)}")
        clean[isa] = {fmt: _number(v, f"peak_gflops_per_core[{isa!r}][{fmt!r}]", where)
                      for fmt, v in per_fmt.items()}
    isa = data["isa"]
    if isa not in clean:
        raise MachineFormatError(f"{where}isa {isa!r} has no entry in peak_gflops_per_core ({', '.join(clean)})")
    kernel_eff = _number(data.get("kernel_efficiency", 1.0), "kernel_efficiency", where)
    compute_eff = _number(data.get("compute_efficiency", 0.5), "compute_efficiency", where)
    for value, what in ((kernel_eff, "kernel_efficiency"), (compute_eff, "compute_efficiency")):
        if value > 1:
            raise MachineFormatError(f"{where}{what} is a fraction in (0, 1], got {value}")
    overhead = _number(data.get("layer_overhead_us", 0.0), "layer_overhead_us", where, positive=False)
    for key in ("name", "description", "source"):
        if not isinstance(data.get(key, ""), str):
            raise MachineFormatError(f"{where}{key} must be a string")
    return Machine(data["name"], nodes, cores, read, clean, isa, kernel_eff, compute_eff, overhead,
                   data.get("description", ""), data.get("source", ""))


def builtin_machines() -> list[str]:
    return sorted(p.stem for p in MACHINES_DIR.glob("*.json"))


def load_machine(name_or_path: str | Path) -> Machine:
    """A built-in machine by name (``xeon-6430``) or a machine file by path."""
    text = str(name_or_path)
    path = Path(text)
    if not path.exists():
        builtin = MACHINES_DIR / f"{text}.json"
        if not builtin.exists():
            raise MachineFormatError(f"no machine file {text!r} and no built-in machine of that name "
                                     f"(built-in: {', '.join(builtin_machines())})")
        path = builtin
    data = read_json_file(path, "machine file", MACHINE_FILE_LIMIT, MachineFormatError)
    return machine_from_dict(data, str(path))


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    name: str
    hidden: int
    intermediate: int
    n_experts: int
    top_k: int
    layers: int
    fmt: str = "bf16"
    page: str = "4k"
    group: int | None = None        # scale group: 128 for int8/int4, mxfp4's and iq4nl's own 32
    scale_dtype: str | None = None  # scale dtype: fp32 for int8/int4/iq4nl, mxfp4's own e8m0

    def __post_init__(self):
        if self.fmt not in WORKLOAD_FORMATS:
            raise ValueError(f"weight format must be one of {', '.join(WORKLOAD_FORMATS)}, got {self.fmt!r}")
        if self.fmt != "bf16":
            from numa_moe.quant import scale_layout

            group, scale_dtype = scale_layout(self.fmt, self.group, self.scale_dtype,
                                              default_scale_dtype="fp32", any_group=True)
            object.__setattr__(self, "group", group)
            object.__setattr__(self, "scale_dtype", scale_dtype)
        page_name(self.page)
        for key in ("hidden", "intermediate", "n_experts", "top_k", "layers"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds the {self.n_experts} experts")

    @property
    def dims(self):
        from numa_moe.checkpoints.safetensors import ModelDims

        return ModelDims(self.hidden, self.intermediate, self.n_experts, self.top_k)

    def expert_bytes(self) -> int:
        """Weight bytes of one expert (gate, up, down), scales included for the quantized formats."""
        bits = weight_format(self.fmt).bits_per_element
        total = 3 * self.hidden * self.intermediate * bits // 8
        if self.fmt != "bf16":
            sbits = weight_format(self.scale_dtype).bits_per_element
            total += (2 * self.intermediate * scale_columns(self.fmt, self.hidden, self.group)
                      + self.hidden * scale_columns(self.fmt, self.intermediate, self.group)) * sbits // 8
        return total


def workload_like(like: str, fmt: str = "bf16", page: str = "4k", layers: int | None = None,
                  experts: int | None = None) -> Workload:
    """The routed experts of a published model (synthetic.MODEL_SPECS), all its layers."""
    from numa_moe.checkpoints.synthetic import MODEL_SPECS

    if like not in MODEL_SPECS:
        raise ValueError(f"unknown model {like!r}; known: {', '.join(MODEL_SPECS)}")
    s = MODEL_SPECS[like]
    return Workload(like, s.hidden_size, s.moe_intermediate_size, experts or s.n_experts, s.top_k,
                    layers or s.n_layers, fmt, page_name(page))


def workload_from_checkpoint(path, fmt: str = "bf16", page: str = "4k", layers: int | None = None) -> Workload:
    """Expert shapes and MoE layer count from a checkpoint's headers (no weights read)."""
    from numa_moe.checkpoints.safetensors import Checkpoint
    from numa_moe.checkpoints.dispatch import open_checkpoint

    ckpt = open_checkpoint(path)
    d = ckpt.dims
    return Workload(Path(path).name, d.hidden_size, d.intermediate_size, d.n_experts, int(d.top_k or 2),
                    layers or len(ckpt.layer_ids), fmt, page_name(page))


# --------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class Routing:
    """``uniform`` top-k, ``zipf`` (expert popularity ~ 1/rank^s, a seeded permutation of
    ranks per layer), or ``trace`` (ids[layer][token][k] recorded from a model)."""

    kind: str = "uniform"
    zipf_s: float = 1.0
    trace: np.ndarray | None = None  # int64 [layers, tokens, k]

    def describe(self) -> str:
        if self.kind == "zipf":
            return f"zipf s={self.zipf_s:g}"
        if self.kind == "trace":
            return f"trace ({self.trace.shape[0]} layer(s) x {self.trace.shape[1]} tokens, top-{self.trace.shape[2]})"
        return "uniform"


def load_trace(path) -> np.ndarray:
    """A routing trace: JSON ``{"ids": [[[e, ...] per token] per layer]}`` (what
    ``integrations.hf.record_routing`` saves) or a .npy int array [layers, tokens, k]."""
    path = Path(path)
    try:
        if path.suffix == ".npy":
            ids = _load_npy(path)
        else:
            data = read_json_file(path, "routing trace")
            ids = np.asarray(data["ids"] if isinstance(data, Mapping) else data)
    except CheckpointError:
        raise  # names the file and what is wrong with it
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a routing trace ({exc})") from None
    if ids.ndim != 3 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0:
        raise ValueError(f"{path}: a routing trace is non-negative integer ids [layers][tokens][k], got "
                         f"shape {ids.shape} of {ids.dtype}")
    return ids.astype(np.int64)


def _load_npy(path: Path) -> np.ndarray:
    """A .npy array read from a regular file whose header's shape fits in its bytes
    (``np.load`` would allocate what the header claims before reading)."""
    fd = open_checkpoint_file(path)
    with os.fdopen(fd, "rb") as f:
        version = np.lib.format.read_magic(f)
        header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                  else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = header(f)
        if dtype.hasobject:
            raise ValueError("an object array (pickled data) is not a routing trace")
        left = os.fstat(f.fileno()).st_size - f.tell()
        need = math.prod(shape) * dtype.itemsize
        if need > left:
            raise ValueError(f"its header declares shape {list(shape)} of {dtype} ({need} bytes) "
                             f"but {left} bytes follow")
        ids = np.frombuffer(f.read(need), dtype=dtype).reshape(shape, order="F" if fortran else "C")
    return ids


def route_counts(routing: Routing, rng: np.random.Generator, tokens: int, n_experts: int, top_k: int,
                 layer: int) -> np.ndarray:
    """Tokens per expert (int array [n_experts]) of one layer step."""
    if routing.kind == "trace":
        trace = routing.trace
        if trace.max() >= n_experts:
            raise ValueError(f"the routing trace names expert {int(trace.max())}, the workload has {n_experts}")
        lt = trace[layer % trace.shape[0]]
        start = int(rng.integers(0, lt.shape[0]))
        rows = lt[(start + np.arange(tokens)) % lt.shape[0]]
        return np.bincount(rows.reshape(-1), minlength=n_experts)
    if routing.kind == "zipf":
        perm = np.random.default_rng(1000 + layer).permutation(n_experts)
        logp = -routing.zipf_s * np.log(perm + 1.0)
    elif routing.kind == "uniform":
        logp = np.zeros(n_experts)
    else:
        raise ValueError(f"unknown routing {routing.kind!r}")
    gumbel = rng.gumbel(size=(tokens, n_experts))
    ids = np.argpartition(-(logp + gumbel), top_k - 1, axis=1)[:, :top_k]  # k distinct, weighted
    return np.bincount(ids.reshape(-1), minlength=n_experts)


# --------------------------------------------------------------------------- byte counting


def _class_prefix(table: SegmentTable, touched: bool = False) -> tuple[int, np.ndarray]:
    """(p, prefix [p + 1, nodes]): row r of the matrix is row class r % p (p the table's
    period, or all rows when the segments are explicit); prefix[c] sums, per node, the
    bytes (or, with ``touched``, the rows the node holds any of) of classes below c."""
    p = table.period_rows or table.rows
    bits = table.weight_format.bits_per_element
    per_class = np.zeros((p, len(table.nodes)), dtype=np.int64)
    for i, node in enumerate(table.nodes):
        segs = table.segments[node]
        if not segs:
            continue
        arr = np.array([(s.row0, s.k1 - s.k0) for s in segs], dtype=np.int64)
        if touched:
            per_class[np.unique(arr[:, 0]), i] = 1
        else:
            np.add.at(per_class[:, i], arr[:, 0], arr[:, 1] * bits // 8)
    prefix = np.zeros((p + 1, len(table.nodes)), dtype=np.int64)
    np.cumsum(per_class, axis=0, out=prefix[1:])
    return p, prefix


def _range_sums(p: int, prefix: np.ndarray, r0, r1) -> np.ndarray:
    r0 = np.atleast_1d(np.asarray(r0, dtype=np.int64))
    r1 = np.atleast_1d(np.asarray(r1, dtype=np.int64))

    def below(r):  # sum over rows [0, r)
        return (r // p)[:, None] * prefix[-1][None] + prefix[r % p]

    return below(r1) - below(r0)


def table_bytes_in_rows(table: SegmentTable, r0, r1) -> np.ndarray:
    """[M, nodes]: bytes of rows [r0[m], r1[m]) of the table's matrix on each node (in the
    order of ``table.nodes``), counted from the table's segments (canonical form: a
    segment of class c covers rows c, c + p, ... to the end)."""
    return _range_sums(*_class_prefix(table), r0, r1)


def table_rows_touched(table: SegmentTable, r0, r1) -> np.ndarray:
    """[M, nodes]: rows of [r0, r1) of which each node holds at least one element."""
    return _range_sums(*_class_prefix(table, touched=True), r0, r1)


def page_bytes_in_rows(page_nodes: np.ndarray, page_bytes: int, offset_bytes: int, row_bytes: int,
                       r0, r1, nodes: Sequence[int]) -> np.ndarray:
    """[M, nodes]: bytes of rows [r0, r1) on each node, counted from a page map (node of
    each page, page 0 holding the matrix's first byte at ``offset_bytes``): the
    independent check of :func:`table_bytes_in_rows` on real buffers."""
    page_nodes = np.asarray(page_nodes, dtype=np.int64)
    out = np.zeros((len(r0), len(nodes)), dtype=np.int64)
    index = {n: i for i, n in enumerate(nodes)}
    for m, (a, b) in enumerate(zip(r0, r1)):
        start, end = offset_bytes + a * row_bytes, offset_bytes + b * row_bytes
        p0, p1 = start // page_bytes, (end - 1) // page_bytes
        pages = np.arange(p0, p1 + 1)
        lo = np.maximum(pages * page_bytes, start)
        hi = np.minimum((pages + 1) * page_bytes, end)
        per = np.bincount([index[int(n)] for n in page_nodes[pages]], weights=hi - lo, minlength=len(nodes))
        out[m] = per.astype(np.int64)
    return out


# --------------------------------------------------------------------------- accounting


@dataclass
class LayerAccounting:
    """Per policy: ``reads[p]`` [E, N, N] bytes expert e makes node i read from node j's
    memory; ``reduce[p]`` [E] bytes crossing nodes per token routed to e;
    ``footprint[p]`` [N] bytes one layer keeps on each node. Policy (e) reads whole local
    experts, assigned per step (``expert_bytes``)."""

    workload: Workload
    nodes: int
    reads: dict[str, np.ndarray]
    reduce: dict[str, np.ndarray]
    footprint: dict[str, np.ndarray]
    expert_bytes: int
    tables: dict[str, SegmentTable] = field(repr=False, default_factory=dict)


def _split(total: int, n: int) -> np.ndarray:
    return (np.arange(n + 1, dtype=np.int64) * total) // n


def layer_accounting(workload: Workload, n_nodes: int, tables: Mapping[str, SegmentTable] | None = None
                     ) -> LayerAccounting:
    """Bytes per policy for one layer over ``n_nodes`` nodes. ``tables`` default to the
    theoretical tables of the stacked buffers (store.layer_tables, phase 0); give the
    tables of real buffers (ExpertStore.table, measured) to account for those instead."""
    from numa_moe.layer.store import buffer_shape, layer_tables

    w = workload
    N, E, H, I = n_nodes, w.n_experts, w.hidden, w.intermediate
    if tables is None:
        tables = layer_tables(w.dims, N, w.page, w.fmt, w.group, w.scale_dtype)
    kinds = [k for k in tables if k.split("_")[0] in ("gate", "up", "down")]
    reads = {p: np.zeros((E, N, N), dtype=np.int64) for p in ("a", "b", "c", "d")}
    reduce = {p: np.zeros(E, dtype=np.int64) for p in POLICIES}
    footprint = {p: np.zeros(N, dtype=np.int64) for p in POLICIES}
    experts = np.arange(E, dtype=np.int64)
    for kind in kinds:
        table = tables[kind]
        if tuple(table.nodes) != tuple(range(N)):
            table = _renumbered(table, N)
        base = kind.split("_")[0]
        per_expert = I if base in ("gate", "up") else H
        stacked_rows, _ = buffer_shape(w.dims, base)
        if table.rows != stacked_rows:
            raise ValueError(f"table {kind} has {table.rows} rows, the stacked buffer {stacked_rows}")
        row_bytes = table.row_bytes
        # (c): each node reads exactly its own segments of the expert's rows
        own = table_bytes_in_rows(table, experts * per_expert, (experts + 1) * per_expert)  # [E, N]
        reads["c"][:, np.arange(N), np.arange(N)] += own
        footprint["b"] += own.sum(axis=0)
        footprint["c"] += own.sum(axis=0)
        # (b) and (a): node i computes the rows of its even share of the expert
        bounds = _split(per_expert, N)
        r0 = (experts[:, None] * per_expert + bounds[None, :-1]).reshape(-1)
        r1 = (experts[:, None] * per_expert + bounds[None, 1:]).reshape(-1)
        split = table_bytes_in_rows(table, r0, r1).reshape(E, N, N)  # [E, reader, home]
        reads["b"] += split
        reads["a"][:, :, 0] += split.sum(axis=2)
        footprint["a"][0] += own.sum()
        # (d): a shard of every expert on every node, even split (rows of gate/up, k of down)
        shard = np.diff(bounds) * row_bytes if base in ("gate", "up") else \
            table.rows // E * (np.diff(_split(table.cols, N)) * table.weight_format.bits_per_element // 8)
        reads["d"][:, np.arange(N), np.arange(N)] += shard[None]
        footprint["d"] += E * shard
        footprint["e"] += own.sum()  # every node a full copy
        if N > 1 and kind in ("gate", "up", "down"):
            # (c): rows split across nodes leave fp32 partials that cross to be summed
            touched = table_rows_touched(table, experts * per_expert, (experts + 1) * per_expert)
            reduce["c"] += (touched.sum(axis=1) - per_expert) * 4
    if N > 1:
        reduce["a"][:] = reduce["b"][:] = (N - 1) * I * 4  # all-gather of the intermediate
        reduce["d"][:] = (N - 1) * H * 4                     # partial sums of the k-split down
    return LayerAccounting(w, N, reads, reduce, footprint, w.expert_bytes(), dict(tables))


def _renumbered(table: SegmentTable, n: int) -> SegmentTable:
    """The table with its nodes renamed 0..n-1 in order (machine nodes are positions)."""
    if len(table.nodes) != n:
        raise ValueError(f"table over nodes {list(table.nodes)} used on a {n}-node machine")
    mapping = {node: i for i, node in enumerate(table.nodes)}
    return SegmentTable(table.rows, table.cols, table.fmt, table.page_bytes, tuple(range(n)), table.period_rows,
                        {mapping[k]: v for k, v in table.segments.items()}, table.source, table.pages_not_present)


# --------------------------------------------------------------------------- time model


@dataclass
class PolicyResult:
    policy: str
    tokens: int
    step_ms: float
    tokens_per_s: float
    local_bytes: list[float]     # per node, per step (all layers)
    remote_bytes: list[float]
    reduction_bytes: float       # per step, crossing nodes
    footprint_bytes: list[float]  # per node, all layers
    slowest_node: int
    bound: str                   # what decided the slowest node: memory, controller, compute
    node_ms: list[float]


def _assign_replicas(counts: np.ndarray, expert_bytes: int, n: int) -> np.ndarray:
    """(e): whole active experts to nodes, longest first to the least loaded: [n] bytes."""
    load = np.zeros(n)
    for e in np.argsort(-counts, kind="stable"):
        if counts[e] == 0:
            break
        load[int(np.argmin(load))] += expert_bytes
    return load


def _layer_step(acc: LayerAccounting, machine: Machine, policy: str, counts: np.ndarray, isa: str | None):
    """(node times s, bytes [N, N], reduction bytes, bound per node) of one layer step."""
    N = acc.nodes
    w = acc.workload
    active = counts > 0
    flops_per_token_expert = 6.0 * w.hidden * w.intermediate
    bw = np.asarray(machine.read_gbps, dtype=float) * 1e9 * machine.kernel_efficiency
    if policy == "e":
        load = _assign_replicas(counts, acc.expert_bytes, N)
        reads = np.diag(load)
        # compute in proportion to the bytes (whole experts), good enough at decode sizes
        share = load / max(load.sum(), 1.0)
        flops = share * float(counts.sum()) * flops_per_token_expert
    else:
        per = acc.reads[policy][active]                        # [A, N, N]
        reads = per.sum(axis=0).astype(float)
        frac = per.sum(axis=2) / np.maximum(per.sum(axis=(1, 2))[:, None], 1)  # [A, N]
        flops = (frac * counts[active][:, None]).sum(axis=0) * flops_per_token_expert
    t_reader = (reads / bw).sum(axis=1)
    t_home = reads.sum(axis=0) / np.diag(bw)
    peak = machine.peak(w.fmt, isa) * 1e9 * machine.compute_efficiency * machine.cores_per_node
    t_compute = flops / peak
    stack = np.stack([t_reader, t_home, t_compute])
    node_t = stack.max(axis=0)
    bound = stack.argmax(axis=0)
    red = float((acc.reduce[policy] * counts).sum())
    return node_t, reads, red, bound


def _check_draws(tokens: Sequence[int], samples: int, seed: int, workload: Workload, routing: Routing) -> None:
    """Refuses token counts below 1, a seed numpy does not take, a Zipf exponent that is
    not a finite number >= 0 (it would turn every time into NaN) and draws that do not fit
    in memory (memory.check_fits), before any is drawn."""
    from numa_moe.placement import memory

    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if routing.kind == "zipf" and not 0 <= routing.zipf_s < math.inf:
        raise ValueError(f"zipf_s must be a finite number >= 0, got {routing.zipf_s!r}")

    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 1:
            raise ValueError(f"token counts must be integers >= 1, got {t!r}")
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 1:
        raise ValueError(f"samples must be an integer >= 1, got {samples!r}")
    t = int(max(tokens, default=1))
    # one draw: a trace's rows (token ids and their index), or uniform / Zipf's float64
    # Gumbel noise, its sum with the log-probabilities and the argpartition's int64 ids;
    # then every draw's counts per expert are kept
    per_token = 16 * workload.top_k if routing.kind == "trace" else 24 * workload.n_experts
    memory.check_fits(t * per_token + samples * workload.n_experts * 8,
                      f"routing {samples} draws of {t} tokens over {workload.n_experts} experts")


def simulate(machine: Machine, workload: Workload, tokens: Sequence[int], routing: Routing | None = None,
             policies: Sequence[str] = POLICIES, samples: int = 32, seed: int = 0, isa: str | None = None,
             accounting: LayerAccounting | None = None) -> dict:
    """Projected step time per policy and token count: ``{"results": [PolicyResult...]}``
    plus the inputs. Each layer step draws its routing; ``samples`` draws are averaged and
    scaled to ``workload.layers``."""
    routing = routing or Routing()
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; known: {', '.join(POLICIES)}")
    _check_draws(tokens, samples, seed, workload, routing)
    acc = accounting or layer_accounting(workload, machine.nodes)
    N = machine.nodes
    cross = [machine.read_gbps[i][j] for i in range(N) for j in range(N) if i != j]
    link_bps = (min(cross) if cross else machine.read_gbps[0][0]) * 1e9
    results = []
    for t in tokens:
        rng = np.random.default_rng(seed)
        draws = [route_counts(routing, rng, int(t), workload.n_experts, workload.top_k, s) for s in range(samples)]
        for p in policies:
            total_t, bytes_nn, red_total, node_sum = 0.0, np.zeros((N, N)), 0.0, np.zeros(N)
            bounds = np.zeros((N, 3))
            for counts in draws:
                node_t, reads, red, bound = _layer_step(acc, machine, p, counts, isa)
                red_t = red / N / link_bps if N > 1 else 0.0
                total_t += node_t.max() + red_t + machine.layer_overhead_us * 1e-6
                node_sum += node_t
                bytes_nn += reads
                red_total += red
                bounds[np.arange(N), bound] += 1
            scale = workload.layers / samples
            step_s = total_t * scale
            local = np.diag(bytes_nn) * scale
            remote = (bytes_nn.sum(axis=1) - np.diag(bytes_nn)) * scale
            slowest = int(np.argmax(node_sum))
            results.append(PolicyResult(
                p, int(t), step_s * 1e3, t / step_s, local.tolist(), remote.tolist(), red_total * scale,
                (acc.footprint[p] * workload.layers).astype(float).tolist(), slowest,
                ("memory", "controller", "compute")[int(np.argmax(bounds[slowest]))],
                (node_sum * scale * 1e3).tolist()))
    return {"machine": machine.to_dict(), "workload": asdict(workload), "routing": routing.describe(),
            "samples": samples, "seed": seed, "isa": isa or machine.isa, "results": results}


def report_dict(report: dict) -> dict:
    out = dict(report)
    out["results"] = [asdict(r) for r in report["results"]]
    return out


def speedups(report: dict) -> dict[int, dict[str, float]]:
    """Per token count: step time of every policy / step time of (c)."""
    by = {}
    for r in report["results"]:
        by.setdefault(r.tokens, {})[r.policy] = r.step_ms
    return {t: {p: ms / v["c"] for p, ms in v.items()} for t, v in by.items() if "c" in v}


def format_report(report: dict) -> str:
    m, w = report["machine"], report["workload"]
    gb = 1e9
    n = m["nodes"]
    local = ", ".join(f"{m['read_gbps'][i][i]:g}" for i in range(n))
    cross = [m["read_gbps"][i][j] for i in range(n) for j in range(n) if i != j]
    lines = [
        f"machine: {m['name']} ({n} node(s) x {m['cores_per_node']} cores, local {local} GB/s"
        + (f", cross {min(cross):g} GB/s" if cross else "")
        + f"; kernel at {m['kernel_efficiency']:.0%} of read bandwidth; isa {report['isa']})",
        f"workload: {w['name']} H={w['hidden']} I={w['intermediate']} E={w['n_experts']} top-{w['top_k']}, "
        f"{w['layers']} MoE layer(s), {w['fmt']}, {w['page']} pages; routing {report['routing']}, "
        f"mean of {report['samples']} draws per layer",
        "",
        f"{'tokens':>6}  {'policy':<32} {'step ms':>9} {'tok/s':>9} {'vs (c)':>7} {'local GB/node':>14} "
        f"{'remote GB/node':>15} {'reduce MB':>9} {'footprint GB/node':>18}  bound",
    ]
    ratios = speedups(report)
    for r in report["results"]:
        ratio = ratios.get(r.tokens, {}).get(r.policy)
        fp = r.footprint_bytes
        lines.append(
            f"{r.tokens:>6}  ({r.policy}) {POLICY_NAMES[r.policy]:<28} {r.step_ms:9.3f} {r.tokens_per_s:9.1f} "
            f"{(f'{ratio:.2f}x' if ratio else '-'):>7} {max(r.local_bytes) / gb:14.3f} {max(r.remote_bytes) / gb:15.3f} "
            f"{r.reduction_bytes / 1e6:9.2f} {f'{min(fp) / gb:.1f}-{max(fp) / gb:.1f}':>18}  "
            f"{r.bound} (node {r.slowest_node})")
    lines.append("")
    lines.append("local/remote GB/node: the busiest node's bytes per step (all layers); vs (c): step time over (c)'s; "
                 "bound: what decides the slowest node (its reads, its memory controller, or compute)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- plot


def plot_report(report: dict, path: str) -> None:
    """Left: step time per policy over token counts; right: per-node bytes stacked
    local/remote at the largest token count. Writes a PNG to ``path`` (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    policies = sorted({r.policy for r in results}, key=POLICIES.index)
    tokens = sorted({r.tokens for r in results})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in policies:
        rs = sorted((r for r in results if r.policy == p), key=lambda r: r.tokens)
        ax1.plot([r.tokens for r in rs], [r.step_ms for r in rs], marker="o", label=f"({p}) {POLICY_NAMES[p]}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tokens per step")
    ax1.set_ylabel("projected MoE step time, ms (all layers)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    last = tokens[-1]
    n = report["machine"]["nodes"]
    width = 0.8 / n
    for node in range(n):
        xs = np.arange(len(policies)) + node * width
        loc = [next(r for r in results if r.policy == p and r.tokens == last).local_bytes[node] / 1e9 for p in policies]
        rem = [next(r for r in results if r.policy == p and r.tokens == last).remote_bytes[node] / 1e9 for p in policies]
        ax2.bar(xs, loc, width * 0.85, color="tab:blue", edgecolor="white", label="local" if node == 0 else None)
        ax2.bar(xs, rem, width * 0.85, bottom=loc, color="tab:red", edgecolor="white",
                label="remote" if node == 0 else None)
    ax2.set_xticks(np.arange(len(policies)) + 0.4 - width / 2, [f"({p})" for p in policies])
    ax2.set_ylabel("GB read per step, per node")
    ax2.set_title(f"{last} token(s); one bar per node (0..{n - 1}) per policy", fontsize=10)
    ax2.legend(fontsize=8)
    w = report["workload"]
    fig.suptitle(f"{report['machine']['name']}: {w['name']} {w['fmt']} {w['page']} pages, routing {report['routing']}")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- measure


def machine_from_measurements(read, peaks: Mapping[str, Mapping[str, float]], threads: int, isa: str,
                              kernel_efficiency: float = 1.0, description: str = "") -> Machine:
    """This machine as the model describes one: the measured read matrix
    (benchmarking.machine.ReadMatrix) over the nodes that have both CPUs and memory, and
    the measured peaks (isa -> "bf16"/"int8" -> GFLOP/s on ``threads`` threads) per core;
    int4 kernels multiply at the int8 peak. ValueError when a node or a peak is missing."""
    nodes = [n for n in read.cpu_nodes if n in read.memory_nodes]
    if not nodes:
        raise ValueError("no node has both allowed CPUs and memory: nothing to describe")
    matrix = tuple(tuple(read.gbps[read.cpu_nodes.index(c)][read.memory_nodes.index(m)] for m in nodes)
                   for c in nodes)
    per_core = {name: {fmt: p[src] / threads for fmt, src in (("bf16", "bf16"), ("int8", "int8"), ("int4", "int8"))
                       if p.get(src, 0) > 0}
                for name, p in peaks.items()}
    if len(per_core.get(isa, {})) < 3:
        raise ValueError(f"no measured bf16 and int8 peak for isa {isa!r} (measured: {sorted(per_core)})")
    return Machine("this-machine", len(nodes), max(1, threads // len(nodes)), matrix, per_core, isa,
                   float(kernel_efficiency), 0.5, 0.0, description or f"measured (nodes {nodes})", "measured")


def measure_machine(read_mib: int = 256, tries: int = 5, kernel_efficiency: float | None = None,
                    echo=print) -> Machine:
    """A description of this machine: the read matrix of its real nodes with the project's
    native streaming read (benchmarking.machine.measure_read_matrix), the ISA peaks from the
    register-only loops, and the kernel efficiency from the expert FFN kernel against the
    streaming read of the same bytes (Qwen3-30B-A3B expert, 1 token; as ``bench kernels``
    measures it) unless given."""
    import statistics

    from numa_moe.apps.benchmarking import machine as measured, native_loops
    from numa_moe.apps.benchmarking.kernels import random_bf16_bits, random_weights
    from numa_moe.layer.kernels import default_isa
    from numa_moe.placement import topology as topo_mod

    topo = topo_mod.Topology.detect()
    threads = len(topo.allowed_cpus)
    read = measured.measure_read_matrix(topo, read_mib, tries, echo)
    peaks = measured.measure_peaks(threads, 0.05, 3, echo)
    isa = default_isa()
    if kernel_efficiency is None:
        rng = np.random.default_rng(0)
        H, I = 2048, 768
        copies = 12
        experts = [tuple(random_weights(rng, s, "4k") for s in ((I, H), (I, H), (H, I))) for _ in range(copies)]
        x = random_bf16_bits(rng, (1, H))
        index = np.arange(1, dtype=np.int64)
        native_loops.expert_ffn_vs_read(isa, x, index, experts, threads, copies)
        ours, read_s = native_loops.expert_ffn_vs_read(isa, x, index, experts, threads, 4 * copies)
        kernel_efficiency = min(1.0, statistics.median(read_s) / statistics.median(ours))
        echo(f"kernel efficiency: {kernel_efficiency:.2f} of the streaming read (median expert FFN call, "
             f"qwen3-30b-a3b shape, 1 token, isa {isa})")
    return machine_from_measurements(read, peaks, threads, isa, kernel_efficiency,
                                     f"measured by numa-moe simulate --measure (nodes {list(read.cpu_nodes)})")


# --------------------------------------------------------------------------- validation


@dataclass
class ValidationPoint:
    nodes: int            # 1 real node, or N virtual nodes
    tokens: int
    measured_ms: float    # median `numa-moe run` step
    predicted_ms: float
    read_gbps: float      # median streaming read measured right before
    kernel_efficiency: float

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1.0


def this_machine(read_gbps: float, nodes: int, threads: int, kernel_efficiency: float, isa: str,
                 peak_gflops_per_core: float = 50.0, layer_overhead_us: float = 0.0) -> Machine:
    """This single-socket machine seen as ``nodes`` (virtual) nodes: they share one memory,
    so every (reader, memory) pair gets ``read_gbps / nodes``."""
    share = read_gbps / nodes
    p = peak_gflops_per_core
    peaks = {isa: {"bf16": p, "int8": 2 * p, "int4": 2 * p}}
    return Machine(f"this machine ({nodes} node(s))", nodes, max(1, threads // nodes),
                   tuple(tuple(share for _ in range(nodes)) for _ in range(nodes)), peaks, isa,
                   min(1.0, kernel_efficiency), VALIDATION_COMPUTE_EFFICIENCY, layer_overhead_us, "", "measured")


# Fraction of the streaming read the layer step reaches on this VM at decode sizes, and
# where it comes from: docs/simulate.md ("Calibration"). Overridable per call.
DEFAULT_KERNEL_EFFICIENCY = 0.85
# Fraction of the register-only peak the expert kernel reaches at 32-128 tokens: below the
# avx512 prefill rows of docs/benchmarks.md (0.83-0.95 of the vdpbf16ps peak at 64-256
# tokens on Zen 4), since fewer tokens reach less.
VALIDATION_COMPUTE_EFFICIENCY = 0.7


def validate_run(checkpoint, tokens=(1, 2, 4), node_counts=(1, 2), steps: int = 7,
                 kernel_efficiency: float | None = None, echo=print) -> list[ValidationPoint]:
    """Predicted vs measured ``numa-moe run`` median step time on this machine, for each
    (nodes, tokens): 1 = the real node, N > 1 = N virtual nodes. Right before each run
    the read bandwidth of the loaded experts is measured (median of streaming reads) and
    the prediction uses it; ``kernel_efficiency`` defaults to DEFAULT_KERNEL_EFFICIENCY."""
    import statistics

    from numa_moe.apps import run as moe_run
    from numa_moe.apps.benchmarking import native_loops
    from numa_moe.layer.kernels import default_isa

    eff = DEFAULT_KERNEL_EFFICIENCY if kernel_efficiency is None else kernel_efficiency
    threads = native_loops.affinity_cpu_count()
    isa = default_isa()
    workload = workload_from_checkpoint(checkpoint)
    accounting = {n: layer_accounting(workload, n) for n in node_counts}
    peak = None
    if isa in native_loops.PEAK_INSTRUCTIONS:
        from numa_moe.apps.benchmarking.kernels import measure_peak_gflop_s

        peak = measure_peak_gflop_s(isa, threads, seconds=0.05, tries=3)
    peak_per_core = peak.best / threads if peak else 50.0
    echo(f"{isa} peak {peak_per_core * threads:.0f} GFLOP/s on {threads} threads (compute efficiency "
         f"{VALIDATION_COMPUTE_EFFICIENCY})")
    points = []
    for n in node_counts:
        for t in tokens:
            report = moe_run.run_job(checkpoint, tokens=t, steps=steps, virtual_nodes=n if n > 1 else None,
                                     echo=lambda s: None, progress=False)
            measured = statistics.median(report.steps_ms)
            # the run reads each step's experts right after the step (same pages, same
            # threads): each step is predicted at the bandwidth of its own moment, and the
            # prediction is that of the median step (memory bound: time ~ 1 / bandwidth)
            bw = report.ceiling.median_gbps
            ratios = []
            for rate, ms in zip(report.ceiling.rates_gbps, report.steps_ms):
                machine = this_machine(rate, n, threads, eff, isa, peak_per_core)
                step = simulate(machine, workload, [t], policies=["c"], samples=32, seed=len(ratios),
                                accounting=accounting[n])["results"][0].step_ms
                ratios.append(step / ms)
            pred = measured * statistics.median(ratios)
            point = ValidationPoint(n, t, measured, pred, bw, eff)
            points.append(point)
            echo(f"{n} node(s) {t:3d} token(s): measured {measured:8.3f} ms  predicted {pred:8.3f} ms  "
                 f"error {point.error:+6.1%}  (read {bw:.1f} GB/s)")
    return points


# --------------------------------------------------------------------------- paper comparison

PAPER_MACHINES = ("xeon-6430", "xeon-6448h", "xeon-max-9462")
PAPER_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
# What the paper states for each machine (HiNa-MoE, PACT 2026; see the paper card):
PAPER_NOTES = {
    "xeon-6430": "kernel 96% of local peak; local/cross 234/95 = 2.46",
    "xeon-6448h": "local/cross 158/32 = 4.94",
    "xeon-max-9462": "local/cross 425/89 = 4.78; 3.41x over IPEX",
}


def paper_comparison(tokens=(1, 4, 16), page: str = "4k", samples: int = 16) -> list[dict]:
    """Projected speedup of (c) over (b) and over (a) for the paper's expert shapes on its
    three machines: one row per (machine, model, tokens)."""
    rows = []
    for name in PAPER_MACHINES:
        machine = load_machine(name)
        for like in PAPER_MODELS:
            w = workload_like(like, "bf16", page)
            rep = simulate(machine, w, tokens, policies=["a", "b", "c"], samples=samples)
            ratios = speedups(rep)
            by = {(r.tokens, r.policy): r for r in rep["results"]}
            for t in tokens:
                c = by[t, "c"]
                rows.append({"machine": name, "model": like, "tokens": t, "c_ms": c.step_ms,
                             "c_over_b": ratios[t]["b"], "c_over_a": ratios[t]["a"],
                             "c_remote_bytes": sum(c.remote_bytes), "c_bound": c.bound,
                             "paper": PAPER_NOTES[name]})
    return rows


def format_paper_comparison(rows: list[dict]) -> str:
    lines = ["| machine | model | tokens | (c) step ms | (c) over (b) | (c) over (a) | paper |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['machine']} | {r['model']} | {r['tokens']} | {r['c_ms']:.2f} | {r['c_over_b']:.2f}x | "
                     f"{r['c_over_a']:.2f}x | {r['paper']} |")
    return "\n".join(lines)

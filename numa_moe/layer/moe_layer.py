"""The NUMA-partitioned MoE layer: per-node pinned workers, segment-driven execution,
cross-node reduction (native core in ``native/workers``).

``MoELayer`` holds one MoE layer's routed experts (gate, up ``[I, H]``, down ``[H, I]``
bf16, row-major as checkpoints store them) and, for every matrix, its segment table:
which part of the matrix lies on which NUMA node. ``forward(hidden, topk_ids,
topk_weights)`` computes

    y[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, j]

with each node's worker threads reading only the weight bytes on their own node. The
router stays with the caller.

Routing rule: a token that lists the same expert several times gets that expert once,
with the weights summed (the same sum the transformers loop computes with index_add_).

Kernel choice, per expert from its own token count and weight format: AMX (AMX-BF16, or
AMX-INT8 for int8 / int4 weights, when the CPU and OS allow it) from ``amx_min_tokens``
tokens (default: 1 for bf16, 5 for int8 and int4, where AMX-INT8 starts to read
faster than AVX-512-VNNI; docs/kernels.md), otherwise AVX-512 (BF16, or VNNI for integer weights),
AVX2, the scalar reference; never the AMX software model unless forced. ``isa=`` (or the environment variable ``NUMA_MOE_ISA``) forces one ISA.

Thread safety: one layer runs one forward at a time (a per-layer lock; its partial
buffers are reused between calls); layers sharing a worker pool are serialised by the
pool. Calling from several Python threads is safe, not parallel. A child made by fork()
can use the layers it inherits, even one another parent thread was running at the time.

This module imports torch only when torch tensors are used, so numpy-only programs (the
multinode test tier) can use it.
"""

from __future__ import annotations

import atexit
import itertools
import operator
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import ml_dtypes
import numpy as np

from numa_moe import _native
from numa_moe.layer import kernels
from numa_moe.placement.pages import page_bytes_of

__all__ = ["MoELayer", "worker_pool", "shutdown_pools", "topology_node_cpus", "MATRIX_KINDS"]

MATRIX_KINDS = ("gate", "up", "down")
OUT_DTYPES = ("bfloat16", "float32")  # of forward_numpy's (and the torch path's) output

# Held weakly: a pool lives while a layer (or another caller) holds it, so layers built
# over ever new topologies do not leave a pool of threads behind each; the pool's
# destructor stops its threads.
_pools: "weakref.WeakValueDictionary[tuple, _native.WorkerPool]" = weakref.WeakValueDictionary()
_pools_lock = threading.Lock()


def worker_pool(node_cpus: Sequence[Sequence[int]], pin: bool = True, spin_us: int = 50):
    """The worker pool for this list of per-node CPU lists, shared by every caller while
    one holds it (its threads start on first use and stop when the last holder drops it,
    or at interpreter exit)."""
    key = (tuple(tuple(int(c) for c in cpus) for cpus in node_cpus), bool(pin), int(spin_us))
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _native.WorkerPool([list(c) for c in key[0]], pin=pin, spin_us=spin_us)
            _pools[key] = pool
        return pool


@atexit.register
def shutdown_pools() -> None:
    """Stops every live pool's threads (registered with atexit; safe to call more than once)."""
    with _pools_lock:
        pools = list(_pools.values())
    for pool in pools:
        pool.shutdown()


def topology_node_cpus(topology) -> tuple[tuple[int, ...], list[list[int]]]:
    """(node ids, CPU list per node) of a Topology (numa_moe.placement.topology), restricted to the
    CPUs this process may use; a node without allowed CPUs borrows all allowed CPUs
    (virtual topologies on small machines share CPUs between nodes)."""
    allowed = set(getattr(topology, "allowed_cpus", ()) or os.sched_getaffinity(0))
    node_ids = tuple(topology.node_ids)
    node_cpus = []
    for node in node_ids:
        cpus = [c for c in topology.cpus_of(node) if c in allowed]
        node_cpus.append(cpus or sorted(allowed))
    return node_ids, node_cpus


def _default_topology():
    from numa_moe.placement.topology import current_topology

    return current_topology()


def _as_bf16_bits(array, what: str) -> np.ndarray:
    """A uint16 view of bf16 data (numpy bfloat16/uint16/int16 or a torch bf16 tensor)."""
    if _is_torch(array):
        import torch

        if array.dtype != torch.bfloat16:
            raise TypeError(f"{what}: expected torch.bfloat16, got {array.dtype}")
        if array.device.type != "cpu":
            raise ValueError(f"{what}: expected a CPU tensor, got device {array.device}")
        return array.detach().view(torch.int16).numpy().view(np.uint16)
    array = np.asarray(array)
    if array.dtype == np.float16 or array.dtype.itemsize != 2:
        raise TypeError(f"{what}: expected bf16 data (ml_dtypes.bfloat16 or uint16 bits), got dtype {array.dtype}")
    return array.view(np.uint16)


def _weight_operand(w, what: str):
    """(values, scales or None, format) of an expert matrix for the native layer: bf16
    bits, or a QuantizedMatrix's int8 / packed int4 values and its scales."""
    from numa_moe.quant import QuantizedMatrix

    if isinstance(w, QuantizedMatrix):
        return w.q, w.scales, w.fmt
    return _as_bf16_bits(w, what), None, "bf16"


def _matrix_shape(w, what: str) -> tuple[int, int]:
    from numa_moe.quant import QuantizedMatrix

    if isinstance(w, QuantizedMatrix):
        return w.shape
    rows, cols = _as_bf16_bits(w, what).shape
    return int(rows), int(cols)


def _is_torch(obj) -> bool:
    return type(obj).__module__.startswith("torch")


@dataclass(frozen=True)
class ExpertMatrices:
    """One expert's weights as uint16 (bf16 bit) views: gate, up [I, H], down [H, I]."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


_layer_ids = itertools.count(1)
_layers: "weakref.WeakValueDictionary[int, MoELayer]" = weakref.WeakValueDictionary()


def _amx_min_tokens(value) -> int:
    """MoELayer's amx_min_tokens as the native layer takes it: 0 for None (each weight
    format's default), else an integer >= 1."""
    if value is None:
        return 0
    try:
        if isinstance(value, bool):
            raise TypeError
        tokens = operator.index(value)
    except TypeError:
        raise ValueError(f"amx_min_tokens must be an integer >= 1 or None, got {value!r}") from None
    if tokens < 1:
        raise ValueError(f"amx_min_tokens must be an integer >= 1 or None, got {tokens}")
    return tokens


class MoELayer:
    """A NUMA-partitioned MoE layer (see the module docstring).

    The general constructor takes per-expert weights and per-expert tables; most users
    call ``from_store`` (an ExpertStore layer), ``from_tensors`` (torch tensors or numpy
    arrays, copied into interleaved memory) instead.

    experts: sequence of (gate [I, H], up [I, H], down [H, I]) bf16 arrays/tensors, or
        numa_moe.quant.QuantizedMatrix (int8 / int4 with group scales, all three alike).
    tables: per expert a mapping kind -> segment table (anything with ``nodes`` and
        ``node_array(node)``, e.g. numa_moe.placement.segments.SegmentTable), rows numbered from 0
        within the expert's matrix.
    topology: a numa_moe.placement.topology.Topology (default: current_topology()); its nodes must
        be the tables' nodes. node_cpus=(node_ids, cpu lists) may be given instead.
    """

    def __init__(self, experts, tables, *, topology=None, node_cpus=None, isa: str | None = None,
                 amx_min_tokens: int | None = None, pin: bool = True, verify_tables: bool = True, keep_alive=()):
        amx_min_tokens = _amx_min_tokens(amx_min_tokens)
        if node_cpus is None:
            topology = topology if topology is not None else _default_topology()
            node_ids, cpus = topology_node_cpus(topology)
        else:
            node_ids, cpus = tuple(node_cpus[0]), [list(c) for c in node_cpus[1]]
        if len(experts) == 0:
            raise ValueError("MoELayer needs at least one expert")
        if len(tables) != len(experts):
            raise ValueError(f"{len(experts)} experts but {len(tables)} table sets")
        self.topology = topology
        self.node_ids = tuple(int(n) for n in node_ids)
        self.pool = worker_pool(cpus, pin=pin)
        self._keep_alive = list(keep_alive)
        self._lock = threading.Lock()
        self.experts: list[ExpertMatrices] = []
        self.tables = [dict(t) for t in tables]
        self.intermediate, self.hidden = _matrix_shape(experts[0][0], "expert 0 gate")
        self.n_experts = len(experts)
        self._core = _native.MoELayerCore(self.pool, self.hidden, self.intermediate)
        self.weight_format = "bf16"
        for e, (weights, table_set) in enumerate(zip(experts, self.tables)):
            operands = [_weight_operand(w, f"expert {e} {kind}") for w, kind in zip(weights, MATRIX_KINDS)]
            mats = ExpertMatrices(*(values for values, _, _ in operands))
            segs = {}
            for kind in MATRIX_KINDS:
                if kind not in table_set:
                    raise ValueError(f"expert {e}: no table for its {kind} matrix")
                segs[kind] = self._node_arrays(table_set[kind], f"expert {e} {kind}")
            scales = [s for _, s, _ in operands]
            self._core.add_expert(mats.gate, mats.up, mats.down, segs["gate"], segs["up"], segs["down"],
                                  verify_partition=verify_tables, gate_scales=scales[0], up_scales=scales[1],
                                  down_scales=scales[2])
            self.weight_format = operands[0][2]
            self.experts.append(mats)
        self.isa = isa if isa is not None else kernels.forced_isa()
        self._core.set_isa(self.isa)
        self._core.set_amx_min_tokens(amx_min_tokens)
        self.layer_id = next(_layer_ids)
        self.forward_calls = 0  # forwards run, whichever front end called (eager, the op, numpy)
        self._stacked = None
        _layers[self.layer_id] = self

    # ---- construction helpers -------------------------------------------------------

    def _node_arrays(self, table, what: str) -> list[np.ndarray]:
        table_nodes = tuple(int(n) for n in table.nodes)
        extra = set(table_nodes) - set(self.node_ids)
        if extra:
            raise ValueError(f"{what}: its table places data on node(s) {sorted(extra)}, "
                             f"but the workers run on nodes {list(self.node_ids)}")
        arrays = []
        for node in self.node_ids:
            if node in table_nodes:
                arr = np.ascontiguousarray(table.node_array(node), dtype=np.int64)
            else:
                arr = np.zeros((0, 5), dtype=np.int64)
            arrays.append(arr.reshape(-1, 5))
        return arrays

    @classmethod
    def from_stacked(cls, gate_up, down, tables_gate_up, tables_down, **kwargs) -> "MoELayer":
        """From stacked buffers gate_up [E, 2I, H] (gate rows first, then up) and down
        [E, H, I] and the segment tables of the whole stacked matrices ([E*2I, H] and
        [E*H, I]); expert tables are their row slices."""
        gate_up_bits = _as_bf16_bits(gate_up, "gate_up")
        down_bits = _as_bf16_bits(down, "down")
        _check_stacked(gate_up_bits.shape, down_bits.shape)
        E, two_i, H = gate_up_bits.shape
        I = two_i // 2
        experts, tables = [], []
        for e in range(E):
            experts.append((gate_up_bits[e, :I], gate_up_bits[e, I:], down_bits[e]))
            tables.append({
                "gate": tables_gate_up.slice_rows(e * two_i, e * two_i + I),
                "up": tables_gate_up.slice_rows(e * two_i + I, (e + 1) * two_i),
                "down": tables_down.slice_rows(e * H, (e + 1) * H),
            })
        kwargs.setdefault("keep_alive", (gate_up, down))
        layer = cls(experts, tables, **kwargs)
        layer._stacked = (gate_up, down)
        return layer

    @classmethod
    def from_tensors(cls, gate_up=None, down=None, *, gate=None, up=None, topology=None, page: str = "4k",
                     tables: str = "measured", phase: int = 0, weight_format: str = "bf16", group: int = 128,
                     scale_dtype: str = "fp16", **kwargs) -> "MoELayer":
        """Copies the experts into memory interleaved over the topology's nodes and builds
        the tables.

        Weights: stacked ``gate_up`` [E, 2I, H] + ``down`` [E, H, I], or ``gate``/``up``
        [E, I, H] (stacked or lists of [I, H]) + ``down`` (stacked or a list of [H, I]).
        tables="measured": from the page map the kernel reports (numa_moe.placement.memory.page_map);
        tables="theoretical": from the interleave rule with the given phase (virtual
        topologies, where the memory is not really on those nodes). weight_format "int8" or
        "int4" quantizes the experts while copying (numa_moe.quant: group-wise symmetric,
        ``group`` columns per scale, scales in ``scale_dtype``)."""
        from numa_moe import quant
        from numa_moe.placement import memory
        from numa_moe.placement.segments import SegmentTable

        quant.check_arguments(weight_format=weight_format, group=group, scale_dtype=scale_dtype,
                              formats=("bf16", *quant.QUANT_FORMATS))
        if tables not in ("measured", "theoretical"):
            raise ValueError(f"tables must be 'measured' or 'theoretical', got {tables!r}")
        topology = topology if topology is not None else _default_topology()
        gate_up_np, down_np = _stack_inputs(gate_up, down, gate, up)
        E, two_i, H = gate_up_np.shape
        I = two_i // 2
        node_ids = tuple(topology.node_ids)
        alloc_nodes = None if topology.is_virtual else node_ids
        if weight_format != "bf16":
            return cls._from_quantized(gate_up_np, down_np, topology, alloc_nodes, page, tables, phase,
                                       weight_format, group, scale_dtype, **kwargs)
        dst_gate_up = memory.interleaved_empty((E, two_i, H), "bfloat16", nodes=alloc_nodes, page=page)
        dst_down = memory.interleaved_empty((E, H, I), "bfloat16", nodes=alloc_nodes, page=page)
        dst_gate_up.view(np.uint16)[...] = gate_up_np
        dst_down.view(np.uint16)[...] = down_np
        page_bytes = page_bytes_of(page)
        if tables == "measured" and not topology.is_virtual:
            t_gu = _measured_table(dst_gate_up, E * two_i, H, SegmentTable, memory)
            t_d = _measured_table(dst_down, E * H, I, SegmentTable, memory)
        else:
            t_gu = SegmentTable.theoretical(E * two_i, H, "bf16", page_bytes, node_ids, phase=phase)
            t_d = SegmentTable.theoretical(E * H, I, "bf16", page_bytes, node_ids, phase=phase)
        return cls.from_stacked(dst_gate_up, dst_down, t_gu, t_d, topology=topology, **kwargs)

    @classmethod
    def _from_quantized(cls, gate_up_bits, down_bits, topology, alloc_nodes, page, tables, phase, fmt, group,
                        scale_dtype, **kwargs) -> "MoELayer":
        """from_tensors for integer formats: each expert matrix quantized into interleaved
        value and scale buffers stacked like the bf16 ones; tables of the value buffers."""
        from numa_moe import quant
        from numa_moe.placement import memory
        from numa_moe.placement.segments import SegmentTable

        E, two_i, H = gate_up_bits.shape
        I = two_i // 2
        per_byte = 2 if fmt == "int4" else 1
        value_dtype = "uint8" if fmt == "int4" else "int8"

        def stacked(rows, cols):
            values = memory.interleaved_empty((E, rows, cols // per_byte), value_dtype, nodes=alloc_nodes, page=page)
            scales = memory.interleaved_empty((E, rows, cols // group), quant.SCALE_DTYPES[scale_dtype],
                                              nodes=alloc_nodes, page=page)
            return values, scales

        (gu_q, gu_s), (d_q, d_s) = stacked(two_i, H), stacked(H, I)
        for e in range(E):
            for src, values, scales in ((gate_up_bits[e], gu_q[e], gu_s[e]), (down_bits[e], d_q[e], d_s[e])):
                qm = quant.quantize(src.view(ml_dtypes.bfloat16), fmt, group, scale_dtype)
                values[...] = qm.q
                scales[...] = qm.scales
        page_bytes = page_bytes_of(page)

        def table(values, rows, cols):
            if tables == "measured" and not topology.is_virtual:
                return _measured_table(values, rows, cols, SegmentTable, memory, fmt)
            return SegmentTable.theoretical(rows, cols, fmt, page_bytes, tuple(topology.node_ids), phase=phase)

        t_gu, t_d = table(gu_q, E * two_i, H), table(d_q, E * H, I)
        experts, expert_tables = [], []
        for e in range(E):
            experts.append((quant.QuantizedMatrix(fmt, group, gu_q[e, :I], gu_s[e, :I]),
                            quant.QuantizedMatrix(fmt, group, gu_q[e, I:], gu_s[e, I:]),
                            quant.QuantizedMatrix(fmt, group, d_q[e], d_s[e])))
            expert_tables.append({"gate": t_gu.slice_rows(e * two_i, e * two_i + I),
                                  "up": t_gu.slice_rows(e * two_i + I, (e + 1) * two_i),
                                  "down": t_d.slice_rows(e * H, (e + 1) * H)})
        kwargs.setdefault("keep_alive", (gu_q, gu_s, d_q, d_s))
        return cls(experts, expert_tables, topology=topology, **kwargs)

    @classmethod
    def from_store(cls, store, layer: int, *, topology=None, **kwargs) -> "MoELayer":
        """From one layer of a loaded numa_moe.layer.store.ExpertStore: its interleaved buffers
        (no copy) and the tables it measured. Under a virtual topology (node ids the
        store's memory is not really on) the tables are the interleave rule over the
        virtual nodes instead, so the partitioned code path runs as it would on a real
        machine with that many nodes."""
        topology = topology if topology is not None else _default_topology()
        experts, tables, keep = store_layer_experts(store, layer, topology)
        kwargs.setdefault("keep_alive", keep)
        return cls(experts, tables, topology=topology, **kwargs)

    # ---- forward --------------------------------------------------------------------

    def forward(self, hidden, topk_ids, topk_weights):
        """hidden [T, H] bf16, topk_ids [T, k] int, topk_weights [T, k] float ->
        [T, H] bf16 (a torch tensor for torch input, a numpy bfloat16 array otherwise).
        With torch input the call goes through the custom op numa_moe::moe_forward while
        torch.compile traces it; in eager mode it runs the op's body directly (the
        dispatcher would add tens of microseconds per call and nothing else)."""
        if not _is_torch(hidden):
            return self.forward_numpy(hidden, topk_ids, topk_weights)
        import torch

        from numa_moe.layer import op as ops  # registers the op (torch.ops.numa_moe.moe_forward)

        # the op takes tensors only; routing from numpy or lists is converted (zero copy
        # for numpy) rather than failing inside the dispatcher
        topk_ids = topk_ids if _is_torch(topk_ids) else torch.as_tensor(np.asarray(topk_ids))
        topk_weights = topk_weights if _is_torch(topk_weights) else torch.as_tensor(np.asarray(topk_weights))
        if torch.compiler.is_compiling():
            check_cpu_tensors(hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights)
            return ops.moe_forward(hidden, topk_ids, topk_weights, self.layer_id)
        return self._forward_torch(hidden, topk_ids, topk_weights)

    __call__ = forward

    def forward_numpy(self, hidden, topk_ids, topk_weights, out_dtype="bfloat16") -> np.ndarray:
        # A decode step's Python work runs with cold caches (the experts' bytes streamed
        # through them since the last step), where every Python-level call costs
        # microseconds: the usual input (arrays already of the native dtypes) skips the
        # Python-level conversions; the native layer checks every input the same way.
        if not (type(hidden) is np.ndarray and hidden.dtype is _BF16 and out_dtype in OUT_DTYPES
                and _is_native_array(topk_ids, _INT64) and _is_native_array(topk_weights, _FLOAT32)):
            _check_out_dtype(out_dtype)
            hidden = self._check_hidden(np.asarray(hidden))
            topk_ids, topk_weights = self._check_routing(topk_ids, np.asarray(topk_weights))
        if out_dtype == "float32":
            out = np.empty(hidden.shape, dtype=np.float32)
            out_native = out
        else:
            out = np.empty(hidden.shape, dtype=_BF16)
            out_native = out.view(np.uint16)
        self._run(hidden.view(np.uint16), topk_ids, topk_weights, out_native)
        return out

    def _forward_torch(self, hidden, topk_ids, topk_weights, out_dtype="bfloat16"):
        import torch

        _check_out_dtype(out_dtype)
        if hidden.dtype != torch.bfloat16:
            raise TypeError(f"hidden: expected torch.bfloat16, got {hidden.dtype}")
        if not (hidden.is_cpu and topk_ids.is_cpu and topk_weights.is_cpu):
            check_cpu_tensors(hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights)
        if not topk_weights.dtype.is_floating_point:
            raise TypeError(f"topk_weights: expected a floating-point tensor, got {topk_weights.dtype}")
        # As few torch calls as the input allows (see forward_numpy): no detach without
        # autograd, no conversion of routing that is already int64 / float32 and contiguous.
        x = (hidden.detach() if hidden.requires_grad else hidden).view(torch.int16).numpy()
        if (topk_ids.dtype is torch.int64 and topk_weights.dtype is torch.float32 and not topk_weights.requires_grad
                and topk_ids.is_contiguous() and topk_weights.is_contiguous()):
            ids, weights = topk_ids.numpy(), topk_weights.numpy()
        else:
            weights = topk_weights.detach()
            ids, weights = self._check_routing(topk_ids, (weights if weights.dtype == torch.float32 else
                                                          weights.to(torch.float32)).numpy())
        out = torch.empty(tuple(x.shape), dtype=torch.float32 if out_dtype == "float32" else torch.bfloat16)
        self._run(x, ids, weights, out.numpy() if out_dtype == "float32" else out.view(torch.int16).numpy())
        return out

    def _check_hidden(self, x: np.ndarray, is_bits: bool = False) -> np.ndarray:
        # Shape and layout are checked natively (native/bindings/checks.cpp); here only
        # what the bf16 bit view needs.
        if not is_bits:
            if x.dtype.itemsize != 2 or x.dtype == np.float16:
                raise TypeError(f"hidden: expected bf16, got dtype {x.dtype}")
        return x

    def _check_routing(self, topk_ids, weights: np.ndarray):
        """(ids int64, weights float32), both C-contiguous; topk_ids: integers of any width
        (numpy, torch or nested lists). Shapes, id ranges and finite weights are checked
        natively, against this layer."""
        ids = kernels.as_index_array("topk_ids", topk_ids)
        if weights.dtype.kind != "f":
            raise TypeError(f"topk_weights: expected a floating dtype, got {weights.dtype}")
        if weights.dtype != np.float32 or not weights.flags.c_contiguous:
            weights = np.ascontiguousarray(weights, dtype=np.float32)
        return ids, weights

    def _run(self, x_bits, ids, weights, out) -> None:
        if not _thread_backend_checked:
            _check_thread_backend()
        with self._lock:
            self._core.forward(x_bits, ids, weights, out)
            self.forward_calls += 1

    # ---- introspection ---------------------------------------------------------------

    def stacked_weights(self):
        """(gate_up [E, 2I, H], down [E, H, I]), the bf16 buffers the layer computes from
        when it was built by from_stacked or from_tensors in bf16, else None. Writing new
        values into them changes the layer's weights in place: the segment tables say
        where the pages lie, not what they hold."""
        return self._stacked

    def last_stats(self) -> dict:
        """Measurements of the last forward: wall_ns, node_bytes (weight bytes read per
        node), thread_busy_ns (per worker thread), node_busy_ns (slowest thread per node),
        expert_isa."""
        stats = dict(self._core.last_stats())
        busy = stats["thread_busy_ns"]
        per_node, i = [], 0
        for n in range(self.pool.n_nodes):
            k = self.pool.threads_of(n)
            per_node.append(max(busy[i:i + k]) if k else 0)
            i += k
        stats["node_busy_ns"] = per_node
        stats["node_ids"] = list(self.node_ids)
        return stats

    def isa_for_tokens(self, m: int) -> str:
        return self._core.isa_for_tokens(int(m), self.weight_format) if self.isa is None else self.isa

    def weight_bytes(self) -> int:
        return self.n_experts * 3 * self.hidden * self.intermediate * 2

    def expert_weight_bytes_per_node(self, expert: int) -> dict[int, int]:
        total = np.zeros(len(self.node_ids), dtype=np.int64)
        for kind in MATRIX_KINDS:
            total += np.asarray(self._core.node_bytes(expert, kind), dtype=np.int64)
        return {node: int(b) for node, b in zip(self.node_ids, total)}

    def __repr__(self) -> str:
        return (f"MoELayer(experts={self.n_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"nodes={list(self.node_ids)}, threads={self.pool.n_threads}, isa={self.isa or 'auto'})")


_thread_backend_checked = False


def _check_thread_backend() -> None:
    """Warns once when torch is loaded but its OpenMP team cannot run the layer's jobs
    (another OpenMP runtime than libgomp): torch's threads then spin beside the layer's
    workers after every torch op, and a layer call after torch work takes up to twice as
    long unless torch's threads sleep at once (OMP_WAIT_POLICY=PASSIVE)."""
    global _thread_backend_checked
    _thread_backend_checked = True
    import sys
    import warnings

    backend = _native.thread_backend()
    if ("torch" in sys.modules and not backend.startswith("openmp")
            and os.environ.get("NUMA_MOE_THREADS") != "own" and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"):
        warnings.warn(f"numa-moe runs on {backend} although torch is loaded: torch's OpenMP threads will spin "
                      "beside its workers after each torch op; set OMP_WAIT_POLICY=PASSIVE before starting "
                      "Python (docs/architecture.md, 'Threads')", RuntimeWarning, stacklevel=3)


def check_cpu_tensors(**tensors) -> None:
    """Raises ValueError naming the first argument that is not a CPU tensor. The custom
    op's dispatcher picks the fake (meta) implementation when any input is a meta
    tensor, which would hand back an uninitialised CPU tensor for a CPU ``hidden``."""
    for name, tensor in tensors.items():
        device = getattr(tensor, "device", None)
        if device is not None and device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got device {device}")


def _reset_locks_in_child() -> None:
    """After fork() the child has only the forking thread: a lock that another thread of
    the parent held (a layer inside forward, a pool being made) would stay locked for
    good, so the child starts with fresh ones. The native pools restart their threads in
    the child by themselves."""
    global _pools_lock
    _pools_lock = threading.Lock()
    for layer in list(_layers.values()):
        layer._lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_locks_in_child)


def get_layer(layer_id: int) -> MoELayer:
    layer = _layers.get(int(layer_id))
    if layer is None:
        raise ValueError(f"no live MoELayer with id {layer_id}")
    return layer


# ---- helpers ------------------------------------------------------------------------

_BF16 = np.dtype(ml_dtypes.bfloat16)
_INT64 = np.dtype(np.int64)
_FLOAT32 = np.dtype(np.float32)


def _is_native_array(value, dtype: np.dtype) -> bool:
    """A C-contiguous numpy array of exactly ``dtype``: what the native layer takes as it is."""
    return type(value) is np.ndarray and value.dtype is dtype and value.flags.c_contiguous


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be 'bfloat16' or 'float32', got {out_dtype!r}")


def _check_stacked(gate_up_shape, down_shape) -> None:
    if len(gate_up_shape) != 3 or gate_up_shape[1] % 2:
        raise ValueError(f"gate_up: expected shape [E, 2I, H], got {list(gate_up_shape)}")
    E, two_i, H = gate_up_shape
    if E == 0 or two_i == 0 or H == 0:
        raise ValueError(f"gate_up: no experts or empty matrices, shape {list(gate_up_shape)}")
    if tuple(down_shape) != (E, H, two_i // 2):
        raise ValueError(f"down: expected shape [{E}, {H}, {two_i // 2}] to match gate_up "
                         f"{list(gate_up_shape)}, got {list(down_shape)}")


def _stack_inputs(gate_up, down, gate, up):
    def stack(parts, what):
        if isinstance(parts, (list, tuple)):
            arrays = [_as_bf16_bits(p, f"{what}[{i}]") for i, p in enumerate(parts)]
            for i, a in enumerate(arrays[1:], 1):
                if a.shape != arrays[0].shape:
                    raise ValueError(f"{what}[{i}] has shape {list(a.shape)} but {what}[0] has "
                                     f"{list(arrays[0].shape)}: all experts must share one shape")
            return np.stack(arrays)
        return _as_bf16_bits(parts, what)

    if down is None:
        raise ValueError("down weights are required")
    down_np = stack(down, "down")
    if gate_up is not None:
        if gate is not None or up is not None:
            raise ValueError("give either gate_up or gate + up, not both")
        gate_up_np = stack(gate_up, "gate_up")
    else:
        if gate is None or up is None:
            raise ValueError("give gate_up [E, 2I, H], or both gate and up")
        g, u = stack(gate, "gate"), stack(up, "up")
        if g.shape != u.shape or g.ndim != 3:
            raise ValueError(f"gate {list(g.shape)} and up {list(u.shape)} must both be [E, I, H]")
        gate_up_np = np.concatenate([g, u], axis=1)
    _check_stacked(gate_up_np.shape, down_np.shape)
    return gate_up_np, down_np


def _measured_table(buffer, rows, cols, SegmentTable, memory, fmt: str = "bf16"):
    pm = memory.page_map(buffer)
    return SegmentTable.from_page_map(rows, cols, fmt, pm.nodes, pm.page_bytes, offset_bytes=pm.offset_bytes)


def store_layer_experts(store, layer, topology):
    """(experts, tables, keep_alive) of one ExpertStore layer: the experts are views of
    the store's stacked buffers (with their scales, as numa_moe.quant.QuantizedMatrix, for
    an int8 / int4 store) and their tables row slices of the stack's tables, both cut
    where the store's layout (numa_moe.layer.store.expert_rows) puts each expert."""
    from numa_moe.quant import QuantizedMatrix
    from numa_moe.layer.store import expert_tables_of, layer_tables

    n_experts = store.n_experts
    experts = [tuple(store.expert(layer, e)) for e in range(n_experts)]
    if store.quantized:
        experts = [tuple(QuantizedMatrix(store.weight_format, store.group, values, scales)
                         for values, scales in zip(matrices, store.expert_scales(layer, e)))
                   for e, matrices in enumerate(experts)]
    node_ids = tuple(topology.node_ids)
    store_nodes = {int(n) for kind in MATRIX_KINDS for n in store.table(layer, kind).nodes}
    if not getattr(topology, "is_virtual", False):
        if not store_nodes <= set(node_ids):
            raise ValueError(f"layer {layer}: the store's memory is on nodes {sorted(store_nodes)}, "
                             f"the topology has nodes {list(node_ids)}")
        tables = [store.expert_tables(layer, e) for e in range(n_experts)]
    else:
        fmt = store.table(layer, "gate").fmt
        stacked = layer_tables(store.dims, node_ids, store.page_bytes, fmt, group=store.group,
                               scale_fmt=store.scale_dtype or "fp32")
        tables = [expert_tables_of(stacked, store.dims, e) for e in range(n_experts)]
    keep = tuple(store.weights(layer, kind) for kind in MATRIX_KINDS)
    if store.quantized:
        keep += tuple(store.scales(layer, kind) for kind in MATRIX_KINDS)
    return experts, tables, keep

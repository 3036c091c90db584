"""HF transformers attention implementation: decode steps through numa_moe.layer.attention.

    from numa_moe.integrations.hf_attention import use_numa_attention
    use_numa_attention(model)          # or register() and from_pretrained(..., attn_implementation="numa_moe")

``register()`` adds ``"numa_moe"`` to transformers' ``AttentionInterface`` (and SDPA's
mask function under the same name to ``AttentionMaskInterface``), so
``model.set_attn_implementation("numa_moe")`` or the config field selects it. A decode
step (one query per sequence, bf16 on the CPU, head size 64 / 128 / 256, no padding mask,
no softcap, no dropout) runs ``gqa_decode`` on the cache transformers keeps; everything
else, prefill included, runs transformers' SDPA implementation (prefill is a causal
GEMM that SDPA already does well; docs/attention.md has the measurements).
"""

from __future__ import annotations

import time

import torch

from numa_moe.layer import attention

ATTN_IMPLEMENTATION = "numa_moe"

# Seconds spent in decode steps of this implementation, when a caller sets it to a dict
# (numa_moe.apps.generate measures the share of the step).
timings: dict | None = None


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def decode_supported(query, key, value, attention_mask, dropout: float = 0.0, softcap=None) -> bool:
    """Whether a call is a decode step gqa_decode runs (else SDPA runs it)."""
    return (query.shape[2] == 1 and attention_mask is None and not dropout and softcap is None
            and query.dtype == key.dtype == value.dtype == torch.bfloat16
            and query.device.type == "cpu" and query.shape[-1] in attention.HEAD_DIMS
            and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0)


def numa_moe_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                               scaling: float | None = None, is_causal=None, sliding_window: int | None = None,
                               softcap=None, **kwargs):
    """The AttentionInterface function: query [B, Hq, q_len, D], key/value [B, Hkv, T, D]
    (the whole cache); returns ([B, q_len, Hq, D], None) as transformers' SDPA does."""
    if not decode_supported(query, key, value, attention_mask, dropout, softcap):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, sliding_window=sliding_window, softcap=softcap, **kwargs)
    start = time.perf_counter() if timings is not None else 0.0
    batch, q_heads, _, head_dim = query.shape
    q = query.reshape(batch, q_heads, head_dim)
    if not q.is_contiguous():
        q = q.contiguous()
    # transformers' cache concatenates along T: contiguous already, .contiguous() is free
    out = attention.gqa_decode(q, key.contiguous(), value.contiguous(), [key.shape[2]] * batch,
                               scale=scaling, window=int(sliding_window or 0))
    if timings is not None:
        timings["attention_s"] = timings.get("attention_s", 0.0) + time.perf_counter() - start
        timings["attention_calls"] = timings.get("attention_calls", 0) + 1
    return out.view(batch, 1, q_heads, head_dim), None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Registers the implementation (and SDPA's mask under the same name); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, numa_moe_attention_forward)
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(name, sdpa_mask)
    return name


def use_numa_attention(model) -> None:
    """Registers the implementation and selects it for every attention layer of model."""
    model.set_attn_implementation(register())

"""torch.library registration of the MoE layer: ``torch.ops.numa_moe.moe_forward``.

The op takes the layer by its integer id (``MoELayer.layer_id``, ``numa_moe.layer.registry``)
because custom ops only take tensors and scalars. The fake (meta) implementation gives
torch.compile / FX the output's shape and dtype without running anything.
"""

from __future__ import annotations

import torch

from numa_moe.arrays import check_cpu_tensors
from numa_moe.layer.registry import get_layer


@torch.library.custom_op("numa_moe::moe_forward", mutates_args=(), device_types="cpu")
def moe_forward(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                layer_id: int) -> torch.Tensor:
    """hidden [T, H] bf16, topk_ids [T, k], topk_weights [T, k] -> [T, H] bf16 through
    the MoELayer with this id."""
    return get_layer(layer_id).forward_torch(hidden, topk_ids, topk_weights)


@moe_forward.register_fake
def _(hidden, topk_ids, topk_weights, layer_id):
    devices = {t.device for t in (hidden, topk_ids, topk_weights)}
    if len(devices) > 1:
        # Reached with real CPU tensors when one input is on the meta device: running
        # nothing would return garbage, so say which input is elsewhere.
        check_cpu_tensors(hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights)
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)

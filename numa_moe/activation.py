"""The experts' gated activation, as data (the native kernels' ``Activation``,
native/kernels/kernel_api.hpp): for one expert, row and token, with the biases added,

    g = min(g, limit),  u = clamp(u, -limit, limit)
    act = g / (1 + exp(-alpha * g)) * (u + up_offset)

``SILU`` (the default: Mixtral, Qwen, DeepSeek, ...) is silu(g) * u; ``GPT_OSS`` is
gpt-oss's clamped SwiGLU (transformers' ``GptOssExperts``: alpha 1.702, limit 7, and the
``up + 1``). Pure Python; imports nothing of the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Activation", "SILU", "GPT_OSS", "ACTIVATIONS", "activation_named"]


@dataclass(frozen=True)
class Activation:
    """alpha: the sigmoid's slope; limit: gate clamped to <= limit and up to [-limit,
    limit] (inf: no clamp); up_offset: added to up after its clamp."""

    alpha: float = 1.0
    limit: float = math.inf
    up_offset: float = 0.0

    def __post_init__(self):
        for name in ("alpha", "limit", "up_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"activation {name} must be a number, got {value!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"activation alpha must be finite and > 0, got {self.alpha}")
        if not self.limit > 0:
            raise ValueError(f"activation limit must be > 0 (inf: no clamp), got {self.limit}")
        if not math.isfinite(self.up_offset):
            raise ValueError(f"activation up_offset must be finite, got {self.up_offset}")

    def native_args(self) -> dict[str, float]:
        """The keyword arguments of the native functions that take an activation."""
        return {"alpha": float(self.alpha), "limit": float(self.limit), "up_offset": float(self.up_offset)}


SILU = Activation()
GPT_OSS = Activation(alpha=1.702, limit=7.0, up_offset=1.0)
ACTIVATIONS = {"silu": SILU, "gpt-oss": GPT_OSS}


def activation_named(value) -> Activation:
    """``value`` as an Activation: None (silu), a name of ACTIVATIONS, or an Activation."""
    if value is None:
        return SILU
    if isinstance(value, Activation):
        return value
    if isinstance(value, str) and value.strip().lower() in ACTIVATIONS:
        return ACTIVATIONS[value.strip().lower()]
    raise ValueError(f"activation {value!r} is not one of {', '.join(ACTIVATIONS)} or an Activation")

"""Zero-copy views of the arrays users hand in, as the native code takes them: bf16 data
as its uint16 bits, integer input as C-contiguous int64, the output a kernel writes into.
Torch tensors and numpy arrays alike; torch is imported only when a tensor is given.

One converter for every entry point (kernels, the MoE layer, attention), so each input
is refused with the same message wherever it enters.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["BF16", "is_torch", "bf16_bits", "as_index_array", "as_float_vector", "is_bf16_dtype", "output_view",
           "check_cpu_tensors"]

BF16 = np.dtype(ml_dtypes.bfloat16)


def is_torch(value: Any) -> bool:
    """Whether ``value`` is a torch object (tensor or dtype), without importing torch."""
    return type(value).__module__.startswith("torch")


def bf16_bits(name: str, value: Any) -> np.ndarray:
    """A zero-copy uint16 view of bf16 data: a torch.bfloat16 CPU tensor, or a numpy array
    of ml_dtypes.bfloat16 or of the bits themselves (uint16 or int16). Anything else is a
    TypeError (the dtype) or ValueError (the device) naming ``name``. The layout is the
    caller's to check (the native checks refuse what is not C-contiguous; a stack of
    strided experts is copied into place)."""
    if is_torch(value):
        import torch

        if value.dtype != torch.bfloat16:
            raise TypeError(f"{name}: dtype {value.dtype}, expected torch.bfloat16")
        if value.device.type != "cpu":
            raise ValueError(f"{name}: tensor is on {value.device}, expected cpu")
        return value.detach().view(torch.int16).numpy().view(np.uint16)
    if isinstance(value, np.ndarray):
        if value.dtype == BF16 or value.dtype == np.int16:
            return value.view(np.uint16)
        if value.dtype == np.uint16:
            return value
        raise TypeError(f"{name}: dtype {value.dtype}, expected bf16 (ml_dtypes.bfloat16, or its uint16 bits)")
    raise TypeError(f"{name}: expected a torch tensor or numpy array, got {type(value).__name__}")


def as_index_array(name: str, value: Any) -> np.ndarray:
    """Integer input (token indices, expert ids, segments) as a C-contiguous int64 array.
    Other dtypes are refused, not cast: a cast would truncate a float index 0.5 to
    token 0, or read True as 1. Empty input may have any dtype (``[]`` reads as float64)."""
    if is_torch(value):
        dtype = value.dtype
        if dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
            raise TypeError(f"{name}: expected integers, got dtype {dtype}")
        value = value.detach().numpy()
    array = np.asarray(value)
    if array.dtype == np.int64 and array.flags.c_contiguous:
        return array
    if array.dtype.kind not in "iu" and array.size:
        raise TypeError(f"{name}: expected integers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.int64)


def as_float_vector(name: str, value: Any) -> np.ndarray | None:
    """A 1-D float input (a bias) as a C-contiguous float32 array, None staying None: numpy,
    ml_dtypes or torch floats (bf16 and fp16 widen exactly). Integers and other shapes are
    refused; the native code checks the length and that every value is finite."""
    if value is None:
        return None
    if is_torch(value):
        value = value.detach().float().cpu().numpy()
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D vector, got shape {array.shape}")
    if array.dtype.kind != "f" and array.dtype != BF16 and array.size:
        raise TypeError(f"{name}: expected floats, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.float32)


def is_bf16_dtype(dtype: Any) -> bool:
    """Whether an ``out_dtype`` (numpy, ml_dtypes, torch or a name) means bf16; float32
    means not; any other is a ValueError."""
    if is_torch(dtype) or "torch" in str(type(dtype)):
        import torch

        if dtype == torch.bfloat16:
            return True
        if dtype == torch.float32:
            return False
        raise ValueError(f"out_dtype: {dtype}, expected float32 or bfloat16")
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return True
    resolved = np.dtype(dtype)
    if resolved == BF16:
        return True
    if resolved == np.float32:
        return False
    raise ValueError(f"out_dtype: {dtype}, expected float32 or bfloat16")


def output_view(out: Any) -> np.ndarray:
    """The numpy view the native code writes into (float32, or uint16 bf16 bits)."""
    if is_torch(out):
        import torch

        if out.dtype == torch.float32:
            if not out.is_contiguous():
                raise ValueError("out: tensor must be contiguous")
            return out.detach().numpy()
        return bf16_bits("out", out)
    if isinstance(out, np.ndarray) and out.dtype == np.float32:
        return out
    return bf16_bits("out", out)


def check_cpu_tensors(**tensors) -> None:
    """Raises ValueError naming the first argument that is not a CPU tensor. The custom
    op's dispatcher picks the fake (meta) implementation when any input is a meta
    tensor, which would hand back an uninitialised CPU tensor for a CPU ``hidden``."""
    for name, tensor in tensors.items():
        device = getattr(tensor, "device", None)
        if device is not None and device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got device {device}")

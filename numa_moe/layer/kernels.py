"""Expert FFN kernels over row-major bf16 weights (AMX, AVX-512-BF16, AVX2, reference).

The native kernels (``numa_moe._native``) compute one expert's
``y = (silu(x Wg^T) * (x Wu^T)) Wd^T`` with ``Wg, Wu`` ``[I, H]`` and ``Wd`` ``[H, I]``
exactly as checkpoints store them. This module accepts torch tensors and numpy arrays
(``ml_dtypes.bfloat16`` or their ``uint16`` bit patterns) without copying, and checks
dtype, shape, contiguity and alignment before anything reaches native code.

The instruction set is chosen per call (``isa=``), else by ``NUMA_MOE_ISA``, else the
fastest available (amx > avx512 > avx2 > ref); ``amx_model`` (the AMX software model) is
only used when asked for, as are ``avx2_emulated`` and ``avx512_emulated`` (the AVX2 and
AVX-512 kernel sources over SIMDe's portable intrinsics, in test builds only).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from numa_moe import _native
from numa_moe.activation import activation_named
from numa_moe.arrays import BF16, as_float_vector, as_index_array, bf16_bits, is_bf16_dtype, is_torch, output_view
from numa_moe.quant import QuantizedMatrix

__all__ = [
    "ISAS",
    "EMULATED_ISAS",
    "available_isas",
    "tested_isas",
    "default_isa",
    "fastest_isa",
    "forced_isa",
    "isa_for_tokens",
    "expert_ffn",
    "matmul_segments",
    "silu_mul_pack",
    "combine_down",
    "store_down",
    "weight_operand",
]

ISAS = ("ref", "avx2", "avx512", "amx_model", "amx", "avx2_emulated", "avx512_emulated")
# The builds that run an ISA's kernel source without that ISA, for the tests: name ->
# (the ISA, what stands in for it). The emulated ones exist only in test builds
# (NUMA_MOE_TEST_HOOKS); the AMX model in every build.
EMULATED_ISAS = {
    "avx2_emulated": ("avx2", "SIMDe on baseline x86-64"),
    "avx512_emulated": ("avx512", "SIMDe on AVX2"),
    "amx_model": ("amx", "AMX model"),
}
ISA_ENV = "NUMA_MOE_ISA"


def available_isas(fmt: str = "bf16") -> tuple[str, ...]:
    """ISAs this CPU (and OS) can run for a weight format: ref first, each emulated build
    before its ISA, amx_model before amx."""
    return tuple(_native.kernel_isas(fmt))


def tested_isas(fmt: str = "bf16", available: Sequence[str] | None = None) -> tuple[str, ...]:
    """The ISAs the test suite runs the kernels of a weight format on: every one this CPU
    runs natively, the AMX model, and the emulated build of avx2 or avx512 where this CPU
    lacks it, so that every kernel source runs on every machine. `available` replaces
    ``available_isas(fmt)`` (the attention kernels have their own list)."""
    available = available_isas(fmt) if available is None else tuple(available)
    return tuple(isa for isa in available
                 if isa == "amx_model" or EMULATED_ISAS.get(isa, ("",))[0] not in available)


def default_isa() -> str:
    """The ISA used when none is given: ``NUMA_MOE_ISA`` if set, else the fastest."""
    try:
        return _native.default_kernel_isa()
    except RuntimeError as error:
        raise ValueError(str(error)) from None


def fastest_isa(fmt: str = "bf16") -> str:
    """The fastest ISA with kernels for a weight format on this machine (amx > avx512 >
    avx2 > ref; never ``amx_model``), ``NUMA_MOE_ISA`` not consulted."""
    return _native.fastest_kernel_isa(fmt)


def forced_isa() -> str | None:
    """The ISA ``NUMA_MOE_ISA`` forces (checked as ``default_isa`` checks it), or None when
    the variable is unset or empty: callers with a rule of their own (the MoE layer picks
    an ISA per expert) apply it only then."""
    if not os.environ.get(ISA_ENV):
        return None
    return default_isa()


def isa_for_tokens(m: int, fmt: str = "bf16", group: int | None = None) -> str:
    """The ISA an ``MoELayer`` without an ``isa`` of its own (and with the default
    ``amx_min_tokens``) runs an expert of `m` tokens with: ``NUMA_MOE_ISA`` if set, else
    AMX from the weight format's and group's crossover where this CPU runs it, else the
    fastest other (the crossovers: docs/kernels.md, "The per-expert rule"). group: the
    weights' columns per scale (None: the format's default)."""
    return forced_isa() or _native.kernel_isa_for_tokens(int(m), fmt, int(group or 0))


def _resolve_isa(isa: str | None, fmt: str = "bf16") -> str:
    """The ISA name to hand to native code, which refuses unknown and unavailable ones:
    the default, or for integer weights the fastest ISA that has kernels for them."""
    if isa is not None:
        return str(isa)
    if fmt == "bf16":
        return default_isa()
    return fastest_isa(fmt)


def weight_operand(name: str, w: Any) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(values, scales, format) of an expert matrix as the native code takes it: a bf16
    weight's uint16 view, no scales and "bf16"; or a numa_moe.quant.QuantizedMatrix's
    int8 / packed 4-bit values, its group scales and its format."""
    if isinstance(w, QuantizedMatrix):
        return w.q, w.scales, w.fmt
    return bf16_bits(name, w), None, "bf16"


def _index_array(token_index: Any, n_tokens: int) -> np.ndarray:
    if token_index is None:
        return np.arange(n_tokens, dtype=np.int64)
    return as_index_array("token_index", token_index)


def _segments_array(name: str, segments: Any) -> np.ndarray | None:
    if segments is None:
        return None
    if hasattr(segments, "node_array"):
        raise TypeError(f"{name}: pass SegmentTable.node_array(node), an int64 [n, 5] array")
    return as_index_array(name, segments)


def expert_ffn(
    x: Any,
    w_gate: Any,
    w_up: Any,
    w_down: Any,
    *,
    token_index: Any = None,
    isa: str | None = None,
    threads: int | None = None,
    out_dtype: Any = np.float32,
    out: Any = None,
    gate_segments: Any = None,
    up_segments: Any = None,
    down_segments: Any = None,
    activation: Any = None,
    gate_bias: Any = None,
    up_bias: Any = None,
    down_bias: Any = None,
):
    """``out = act(x[idx] Wg^T + gate_bias, x[idx] Wu^T + up_bias) Wd^T + down_bias`` for one
    expert (act: silu(g) * u, or the ``activation`` given: numa_moe.activation).

    x: ``[T, H]`` bf16; w_gate, w_up: ``[I, H]``; w_down: ``[H, I]`` (all bf16, row-major,
    torch or numpy; or all numa_moe.quant.QuantizedMatrix: int8 / int4 / mxfp4 / iq4nl with group scales,
    tokens then quantized per group of columns, docs/quantization.md). token_index: the
    rows of x to use (default all, in order). isa: default the ISA an MoE layer runs an
    expert of that many tokens with (isa_for_tokens).
    out_dtype: float32 or bfloat16 (numpy, ml_dtypes or torch dtype); out: optional
    preallocated ``[M, H]`` output of that dtype (same library as x). threads: worker
    threads (default: the CPUs in this process's affinity mask). *_segments: optional
    int64 ``[n, 5]`` segment lists restricting each matrix (default: whole matrix).
    activation: None (silu), "silu", "gpt-oss" or a numa_moe.activation.Activation;
    gate_bias, up_bias ``[I]`` and down_bias ``[H]``: optional 1-D floats.
    Returns the output (a torch tensor if x is one, else a numpy array).
    """
    use_torch = is_torch(x)
    x_u16 = bf16_bits("x", x)
    (wg, gate_scales, fmt), (wu, up_scales, _), (wd, down_scales, _) = (
        weight_operand(name, w) for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)))
    # Shapes, ranges and layouts are checked natively (native/bindings/checks.cpp); here
    # only what allocating the output needs.
    hidden = x_u16.shape[-1] if x_u16.ndim else 0
    index = _index_array(token_index, x_u16.shape[0] if x_u16.ndim else 0)
    m = index.shape[0] if index.ndim else 1
    want_bf16 = is_bf16_dtype(out_dtype)
    if out is None:
        if use_torch:
            import torch

            out = torch.empty((m, hidden), dtype=torch.bfloat16 if want_bf16 else torch.float32)
        else:
            out = np.empty((m, hidden), dtype=BF16 if want_bf16 else np.float32)
    out_native = output_view(out)
    if threads is None:
        threads = 0
    elif threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    _native.expert_ffn(
        str(isa) if isa is not None else isa_for_tokens(max(m, 1), fmt, getattr(w_gate, "group", None)),
        x_u16,
        index,
        wg,
        wu,
        wd,
        _segments_array("gate_segments", gate_segments),
        _segments_array("up_segments", up_segments),
        _segments_array("down_segments", down_segments),
        out_native,
        int(threads),
        gate_scales=gate_scales,
        up_scales=up_scales,
        down_scales=down_scales,
        gate_bias=as_float_vector("gate_bias", gate_bias),
        up_bias=as_float_vector("up_bias", up_bias),
        down_bias=as_float_vector("down_bias", down_bias),
        **activation_named(activation).native_args(),
        format=fmt,
    )
    return out


def matmul_segments(weight: Any, segments: Any, tokens: Any, out: np.ndarray, *, isa: str | None = None,
                    row_begin: int = 0, row_end: int | None = None) -> np.ndarray:
    # weight may be a numa_moe.quant.QuantizedMatrix (then tokens are quantized per its
    # groups of columns as the kernels do)
    """Low-level: ``out[r, t] += sum_{c in [k0, k1)} weight[r, c] * tokens[t, c]`` for the rows
    of every segment (int64 ``[n, 5]``: row0, row_stride, nrows, k0, k1) inside
    ``[row_begin, row_end)``. out: float32 ``[rows, >= M]`` (accumulated into)."""
    w, scales, fmt = weight_operand("weight", weight)
    x = bf16_bits("tokens", tokens)
    seg = _segments_array("segments", segments)
    _native.matmul_segments(_resolve_isa(isa, fmt), w, seg, x, out, int(row_begin), -1 if row_end is None else int(row_end),
                            scales=scales, format=fmt)
    return out


def silu_mul_pack(gate_parts, up_parts, i_begin: int, i_end: int, *, isa: str | None = None, activation: Any = None,
                  gate_bias: Any = None, up_bias: Any = None) -> np.ndarray:
    """Low-level: ``act[t, i] = bf16(act(g, u))`` with ``g = sum_p gate_parts[p][i, t] (+
    gate_bias[i])``, ``u`` likewise, for i in ``[i_begin, i_end)`` (act: silu(g) * u, or
    the ``activation`` given); returned as ``[M, I]`` ml_dtypes.bfloat16 (the ISA's packed
    layout unpacked; other columns 0)."""
    act = _native.silu_mul_pack(_resolve_isa(isa), list(gate_parts), list(up_parts), int(i_begin), int(i_end),
                                gate_bias=as_float_vector("gate_bias", gate_bias),
                                up_bias=as_float_vector("up_bias", up_bias),
                                **activation_named(activation).native_args())
    return act.view(BF16)


def combine_down(parts, h_begin: int, h_end: int, token_index, token_weight, y: np.ndarray, *,
                 isa: str | None = None, bias: Any = None) -> np.ndarray:
    """Low-level: ``y[token_index[t], h] += token_weight[t] * (sum_p parts[p][h, t] (+
    bias[h]))`` for h in ``[h_begin, h_end)``; parts are float32 ``[H, M]``, y float32
    ``[T, H]``."""
    index = as_index_array("token_index", token_index)
    weight = np.ascontiguousarray(token_weight, dtype=np.float32)
    _native.combine_down(_resolve_isa(isa), list(parts), int(h_begin), int(h_end), index, weight, y,
                         bias=as_float_vector("bias", bias))
    return y


def store_down(parts, h_begin: int, h_end: int, out: np.ndarray, *, isa: str | None = None,
               bias: Any = None) -> np.ndarray:
    """Low-level: ``out[t, h] = sum_p parts[p][h, t] (+ bias[h])`` for h in ``[h_begin, h_end)``, stored
    (not added) and rounded to bf16 when `out` is bfloat16 (else float32); parts are float32
    ``[H, M]``, out ``[M, H]``. The single-expert down epilogue of `expert_ffn`."""
    target = out.view(np.uint16) if out.dtype == BF16 else out
    _native.store_down(_resolve_isa(isa), list(parts), int(h_begin), int(h_end), target,
                       bias=as_float_vector("bias", bias))
    return out

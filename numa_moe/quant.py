"""Group-wise symmetric INT8 / INT4 expert weights: the format contract of
``docs/quantization.md``, in numpy.

    W[r, k] ~= s[r, k // g] * q[r, k]

per output row r, group size g in {32, 64, 128}. INT8 ``q`` lies in [-127, 127]; INT4
``q`` in [-8, 7], two per byte, the even column in the low nibble. Weights stay row-major
``[rows, cols]`` like the BF16 ones (``[rows, cols / 2]`` bytes for INT4); scales are
their own row-major tensor ``[rows, cols / g]`` in fp16, bf16 or fp32. llama.cpp's Q8_0
and Q4_0 blocks (32 weights, one fp16 scale) convert into this layout without loss
(``from_q8_0`` / ``from_q4_0``).

Pure numpy; the kernels and the checkpoint readers build on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from numa_moe.formats import DEFAULT_GROUP, GROUPS, QUANT_FORMATS, SCALE_DTYPES

__all__ = ["QuantizedMatrix", "check_arguments", "quantize", "dequantize", "pack_int4", "unpack_int4",
           "error_bound", "from_q8_0", "from_q4_0"]

# The largest |q| quantize() produces: symmetric, so INT4 leaves -8 unused (Q4_0 import
# may still bring it).
Q_MAX = {"int8": 127, "int4": 7}
Q_MIN = {"int8": -127, "int4": -8}
GGML_BLOCK = 32  # weights per Q8_0 / Q4_0 block


@dataclass(frozen=True)
class QuantizedMatrix:
    """A ``rows x cols`` weight in the contract's layout: ``q`` int8 ``[rows, cols]``
    (INT8) or uint8 ``[rows, cols / 2]`` (INT4, packed), ``scales`` ``[rows, cols / group]``."""

    fmt: str
    group: int
    q: np.ndarray
    scales: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.q.shape[0]
        return rows, self.q.shape[1] * (2 if self.fmt == "int4" else 1)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads: weights and scales."""
        return self.q.nbytes + self.scales.nbytes


_UNCHECKED = object()


def check_arguments(*, weight_format=_UNCHECKED, group=_UNCHECKED, scale_dtype=_UNCHECKED,
                    formats=QUANT_FORMATS) -> None:
    """The check of the quantization arguments every entry point that takes them makes
    (quantize, MoELayer.from_tensors, ExpertStore.load, the benchmarks), before it
    allocates: a ValueError naming the argument and its allowed values. Only the arguments
    given are checked; ``formats`` is what the caller's ``weight_format`` may be."""
    if weight_format is not _UNCHECKED and weight_format not in formats:
        raise ValueError(f"weight_format {weight_format!r} is not one of {', '.join(formats)}")
    if group is not _UNCHECKED and (isinstance(group, bool) or group not in GROUPS):
        raise ValueError(f"group {group!r} is not one of {', '.join(map(str, GROUPS))}")
    if scale_dtype is not _UNCHECKED and (not isinstance(scale_dtype, str) or scale_dtype not in SCALE_DTYPES):
        raise ValueError(f"scale_dtype {scale_dtype!r} is not one of {', '.join(SCALE_DTYPES)}")


def _check_layout(fmt: str, group: int, rows: int, cols: int) -> None:
    check_arguments(weight_format=fmt, group=group)
    if cols % group:
        raise ValueError(f"cols={cols} is not a multiple of the group size {group}")
    if rows < 1 or cols < 1:
        raise ValueError(f"a {rows} x {cols} matrix has no weights to quantize")


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7], ``[rows, cols]`` (cols even) -> uint8 ``[rows, cols / 2]``,
    column 2j in the low nibble of byte j and column 2j + 1 in the high one."""
    q = np.asarray(q)
    if q.ndim != 2 or q.shape[1] % 2:
        raise ValueError(f"int4 packing needs a 2-D array with an even column count, got shape {q.shape}")
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"int4 values must lie in [-8, 7], got [{q.min()}, {q.max()}]")
    nibbles = q.astype(np.uint8) & np.uint8(0x0F)
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 ``[rows, cols / 2]`` -> int8 ``[rows, cols]`` (sign-extended nibbles)."""
    packed = np.asarray(packed, dtype=np.uint8)
    q = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int8)
    q[:, 0::2] = ((packed & 0x0F).astype(np.int8) ^ 8) - 8
    q[:, 1::2] = ((packed >> 4).astype(np.int8) ^ 8) - 8
    return q


def quantize(w, fmt: str = "int8", group: int = DEFAULT_GROUP, scale_dtype: str = "fp16") -> QuantizedMatrix:
    """Group-wise symmetric quantization of a 2-D float weight (numpy, ml_dtypes or
    anything np.asarray takes). Each group's scale is its largest magnitude over Q_MAX,
    rounded to ``scale_dtype``; q is computed with that stored scale (round half to even,
    clipped), so dequantize() reproduces exactly what a kernel computes. An all-zero group
    gets scale 1 (never 0: zero scales are refused on load)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    rows, cols = w.shape
    _check_layout(fmt, group, rows, cols)
    check_arguments(scale_dtype=scale_dtype)
    dtype = SCALE_DTYPES[scale_dtype]
    w32 = w.astype(np.float32)
    if not np.all(np.isfinite(w32)):
        raise ValueError("the weight holds NaN or infinity")
    blocks = w32.reshape(rows, cols // group, group)
    amax = np.abs(blocks).max(axis=2)
    scales = (amax / Q_MAX[fmt]).astype(dtype)
    scales[scales.astype(np.float32) == 0] = 1  # all-zero (or underflowing) groups
    s32 = scales.astype(np.float32)[:, :, None]
    q = np.clip(np.rint(blocks / s32), Q_MIN[fmt], Q_MAX[fmt]).astype(np.int8).reshape(rows, cols)
    return QuantizedMatrix(fmt, group, pack_int4(q) if fmt == "int4" else q, scales)


def values(qm: QuantizedMatrix) -> np.ndarray:
    """The int8 q values ``[rows, cols]`` (INT4 unpacked)."""
    return unpack_int4(qm.q) if qm.fmt == "int4" else qm.q


def dequantize(qm: QuantizedMatrix) -> np.ndarray:
    """float32 ``[rows, cols]``: s[r, k // g] * q[r, k], each product in fp32."""
    q = values(qm).astype(np.float32)
    rows, cols = q.shape
    s32 = qm.scales.astype(np.float32)
    return (q.reshape(rows, cols // qm.group, qm.group) * s32[:, :, None]).reshape(rows, cols)


def error_bound(w, qm: QuantizedMatrix) -> np.ndarray:
    """Per-element bound on |w - dequantize(qm)| for quantize()'s output: half a scale
    step, plus what clipping loses when the stored scale rounded below amax / Q_MAX."""
    w32 = np.asarray(w).astype(np.float32)
    rows, cols = w32.shape
    s32 = qm.scales.astype(np.float32)[:, :, None]
    clipped = np.maximum(np.abs(w32.reshape(rows, cols // qm.group, qm.group)) - Q_MAX[qm.fmt] * s32, 0)
    return (s32 / 2 + clipped).reshape(rows, cols)


def _ggml_blocks(data, rows: int, cols: int, block_bytes: int, what: str) -> np.ndarray:
    if cols % GGML_BLOCK:
        raise ValueError(f"{what}: cols={cols} is not a multiple of its {GGML_BLOCK}-weight blocks")
    raw = np.frombuffer(memoryview(data), dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
    expected = rows * cols // GGML_BLOCK * block_bytes
    if raw.size != expected:
        raise ValueError(f"{what}: {raw.size} bytes for a {rows} x {cols} matrix, expected {expected}")
    return raw.reshape(rows, cols // GGML_BLOCK, block_bytes)


def from_q8_0(data, rows: int, cols: int) -> QuantizedMatrix:
    """llama.cpp Q8_0 (per 32 weights: fp16 d, then 32 int8 q; w = d * q) into the
    contract's INT8 layout with group 32 and fp16 scales, without loss."""
    blocks = _ggml_blocks(data, rows, cols, 2 + GGML_BLOCK, "Q8_0")
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(rows, cols // GGML_BLOCK)
    q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, cols)
    if q.size and q.min() < Q_MIN["int8"]:
        # llama.cpp's quantizer never writes -128; the contract's INT8 is symmetric.
        raise ValueError("Q8_0: a block holds q = -128, outside the contract's symmetric [-127, 127]")
    return QuantizedMatrix("int8", GGML_BLOCK, q, scales.copy())


def from_q4_0(data, rows: int, cols: int) -> QuantizedMatrix:
    """llama.cpp Q4_0 (per 32 weights: fp16 d, then 16 bytes; byte j holds weight j in
    its low nibble and weight j + 16 in its high one, each stored as q + 8) into the
    contract's INT4 layout (group 32, fp16 scales, adjacent columns per byte), without loss."""
    blocks = _ggml_blocks(data, rows, cols, 2 + GGML_BLOCK // 2, "Q4_0")
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(rows, cols // GGML_BLOCK)
    nibbles = blocks[:, :, 2:]
    q = np.empty((rows, cols // GGML_BLOCK, GGML_BLOCK), dtype=np.int8)
    q[:, :, :GGML_BLOCK // 2] = (nibbles & 0x0F).astype(np.int8) - 8
    q[:, :, GGML_BLOCK // 2:] = (nibbles >> 4).astype(np.int8) - 8
    return QuantizedMatrix("int4", GGML_BLOCK, pack_int4(q.reshape(rows, cols)), scales.copy())

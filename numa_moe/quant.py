"""Group-wise quantized expert weights: the format contract of ``docs/quantization.md``,
in numpy.

    W[r, k] ~= s[r, k // g] * q[r, k]

per output row r, group size g in {32, 64, 128}. INT8 ``q`` lies in [-127, 127]; INT4
``q`` in [-8, 7], two per byte, the even column in the low nibble. MXFP4 (the OCP
Microscaling format) packs its 4-bit e2m1 codes the same way, ``q`` being the e2m1 value
``E2M1[code]`` (0, +-0.5, ..., +-6), with the group fixed at 32 and power-of-two e8m0
scales. IQ4_NL ("iq4nl", llama.cpp's non-uniform 4-bit format) packs its codes the same
way too, ``q`` being ``IQ4_NL_VALUES[code]`` (-127 .. 113, no zero), group fixed at 32,
float scales that may be 0 (a block of zeros). INT4-AFFINE ("int4-affine", llama.cpp's
Q4_1 and Q4_K) packs unsigned codes ``q`` in [0, 15] the same way and adds a minimum per
group: ``W[r, k] ~= s[r, k // g] * q[r, k] + m[r, k // g]``, group fixed at 32, float
scales (0 for a group of equal weights) and minimums. Weights stay row-major ``[rows, cols]``
like the BF16 ones (``[rows, cols / 2]`` bytes for the 4-bit formats); scales are their
own row-major tensor ``[rows, cols / g]`` in fp16, bf16 or fp32 (e8m0 for MXFP4;
``[rows, 2 cols / g]`` for INT4-AFFINE: each row's scales, then its minimums).
llama.cpp's Q8_0, Q4_0, MXFP4, IQ4_NL and IQ4_XS blocks and gpt-oss's ``*_blocks`` /
``*_scales`` convert into this layout without loss (``from_q8_0``, ``from_q4_0``,
``from_gguf_mxfp4``, ``from_iq4_nl``, ``from_iq4_xs``, ``from_mxfp4_blocks``).

Pure numpy; the kernels and the checkpoint readers build on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from numa_moe.formats import (DEFAULT_GROUP, FIXED_GROUPS, FIXED_SCALE_DTYPES, GROUPS, MINIMUM_FORMATS, QUANT_FORMATS,
                              SCALE_DTYPES, ZERO_SCALE_FORMATS, nibble_packed)

__all__ = ["QuantizedMatrix", "check_arguments", "groups_for", "scale_dtypes_for", "zero_scales_allowed", "scale_layout", "quantize", "dequantize", "values",
           "pack_int4", "unpack_int4", "error_bound", "from_q8_0", "from_q4_0", "from_gguf_mxfp4",
           "from_iq4_nl", "from_iq4_xs", "from_q5_0", "from_mxfp4_blocks", "E2M1", "IQ4_NL_VALUES", "MX_BLOCK"]

# The largest q quantize() produces (and the smallest): symmetric, so INT4 leaves -8
# unused (Q4_0 import may still bring it); MXFP4's is e2m1's largest value; IQ4_NL's
# codebook ends.
Q_MAX = {"int8": 127, "int4": 7, "mxfp4": 6, "iq4nl": 113, "int4-affine": 15}
Q_MIN = {"int8": -127, "int4": -8, "mxfp4": -6, "iq4nl": -127, "int4-affine": 0}
GGML_BLOCK = 32  # weights per Q8_0 / Q4_0 / Q5_0 / IQ4_NL / MXFP4 block
MX_BLOCK = FIXED_GROUPS["mxfp4"]  # weights per MXFP4 scale (the OCP MX block)
# OCP e2m1: code -> value (bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
# IQ4_NL's codebook (ggml's kvalues_iq4nl): code -> the value its block's scale multiplies
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
# Values halfway between consecutive IQ4_NL codes (ascending), and the largest distance of
# a value in [-127, 113] to its nearest code
_IQ4_NL_MIDPOINTS = (IQ4_NL_VALUES[:-1].astype(np.float32) + IQ4_NL_VALUES[1:]) / 2
_IQ4_NL_HALF_GAP = float(np.diff(IQ4_NL_VALUES.astype(np.int32)).max()) / 2
# Magnitudes halfway between consecutive e2m1 codes 0..7, and whether a magnitude exactly
# there rounds up (to the even code: ties to even)
_E2M1_MIDPOINTS = (E2M1[:7] + E2M1[1:8]) / 2
_E2M1_TIE_UP = np.arange(1, 8) % 2 == 0
_E2M1_EMAX = 2  # exponent of e2m1's largest normal (6 = 1.5 * 2^2)
_E8M0_BIAS = 127
_E8M0_NAN = 0xFF


@dataclass(frozen=True)
class QuantizedMatrix:
    """A ``rows x cols`` weight in the contract's layout: ``q`` int8 ``[rows, cols]``
    (INT8) or uint8 ``[rows, cols / 2]`` (INT4, MXFP4, IQ4_NL and INT4-AFFINE, packed),
    ``scales`` ``[rows, cols / group]`` (e8m0 for MXFP4; INT4-AFFINE ``[rows, 2 cols /
    group]``, the scales then the minimums: ``group_scales`` and ``minimums``)."""

    fmt: str
    group: int
    q: np.ndarray
    scales: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.q.shape[0]
        return rows, self.q.shape[1] * (2 if nibble_packed(self.fmt) else 1)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads: weights and scales (and minimums)."""
        return self.q.nbytes + self.scales.nbytes

    @property
    def group_scales(self) -> np.ndarray:
        """``[rows, cols / group]``: the scales alone (without INT4-AFFINE's minimums)."""
        return self.scales[:, :self.shape[1] // self.group]

    @property
    def minimums(self) -> np.ndarray | None:
        """``[rows, cols / group]``: INT4-AFFINE's minimums; None for the other formats."""
        if self.fmt not in MINIMUM_FORMATS:
            return None
        return self.scales[:, self.shape[1] // self.group:]


_UNCHECKED = object()


def check_arguments(*, weight_format=_UNCHECKED, group=_UNCHECKED, scale_dtype=_UNCHECKED,
                    formats=QUANT_FORMATS) -> None:
    """The check of the quantization arguments every entry point that takes them makes
    (quantize, MoELayer.from_tensors, ExpertStore.load, the checkpoint readers, the
    benchmarks), before it allocates: a ValueError naming the argument and its allowed
    values. Only the arguments given are checked; ``formats`` is what the caller's
    ``weight_format`` may be. The one place of the rule tying formats to their groups and
    scales (``formats.FIXED_GROUPS``, ``FIXED_SCALE_DTYPES``): mxfp4 only with group 32 and
    e8m0 scales, e8m0 scales only with mxfp4, iq4nl only with group 32."""
    if weight_format is not _UNCHECKED and weight_format not in formats:
        raise ValueError(f"weight_format {weight_format!r} is not one of {', '.join(formats)}")
    if group is not _UNCHECKED and (isinstance(group, bool) or group not in GROUPS):
        raise ValueError(f"group {group!r} is not one of {', '.join(map(str, GROUPS))}")
    if scale_dtype is not _UNCHECKED and (not isinstance(scale_dtype, str) or scale_dtype not in SCALE_DTYPES):
        raise ValueError(f"scale_dtype {scale_dtype!r} is not one of {', '.join(SCALE_DTYPES)}")
    if not isinstance(weight_format, str):
        return
    fixed_group, fixed_dtype = FIXED_GROUPS.get(weight_format), FIXED_SCALE_DTYPES.get(weight_format)
    own = f"group {fixed_group}" + (f", {fixed_dtype} scales" if fixed_dtype else "")
    for name, given, wanted in (("group", group, fixed_group), ("scale_dtype", scale_dtype, fixed_dtype)):
        if wanted is not None and given is not _UNCHECKED and given != wanted:
            raise ValueError(f"weight_format {weight_format!r} takes {name} {wanted!r} only ({own}), not {given!r}")
    if fixed_dtype is None and scale_dtype is not _UNCHECKED:
        owners = [fmt for fmt, dtype in FIXED_SCALE_DTYPES.items() if dtype == scale_dtype]
        if owners:
            raise ValueError(f"scale_dtype {scale_dtype!r} belongs to weight_format "
                             f"{' / '.join(map(repr, owners))} only, not {weight_format!r}")


def groups_for(fmt: str) -> tuple[int, ...]:
    """The groups the quantized format ``fmt`` takes."""
    return (FIXED_GROUPS[fmt],) if fmt in FIXED_GROUPS else GROUPS


def scale_dtypes_for(fmt: str) -> tuple[str, ...]:
    """The scale dtypes the quantized format ``fmt`` takes."""
    if fmt in FIXED_SCALE_DTYPES:
        return (FIXED_SCALE_DTYPES[fmt],)
    return tuple(name for name in SCALE_DTYPES if name not in set(FIXED_SCALE_DTYPES.values()))


def zero_scales_allowed(fmt: str) -> bool:
    """Whether the quantized format ``fmt`` may have zero scales (``formats.ZERO_SCALE_FORMATS``:
    iq4nl, whose codebook has no zero); every other format's are never 0."""
    return fmt in ZERO_SCALE_FORMATS


def scale_layout(fmt: str, group: int | None = None, scale_dtype: str | None = None,
                 default_group: int = DEFAULT_GROUP, default_scale_dtype: str = "fp16",
                 any_group: bool = False) -> tuple[int, str]:
    """(group, scale dtype) of a request for the quantized format ``fmt``: those given,
    else the ones the format fixes (mxfp4: 32, e8m0; iq4nl: 32), else the defaults; checked
    (check_arguments). ``any_group``: a format without a fixed group may take any group
    (segment tables of shapes the kernels do not run)."""
    group = FIXED_GROUPS.get(fmt, default_group) if group is None else group
    scale_dtype = FIXED_SCALE_DTYPES.get(fmt, default_scale_dtype) if scale_dtype is None else scale_dtype
    checked = {"group": group} if fmt in FIXED_GROUPS or not any_group else {}
    check_arguments(weight_format=fmt, scale_dtype=scale_dtype, **checked)
    return group, scale_dtype


def _check_layout(fmt: str, group: int, scale_dtype: str, rows: int, cols: int) -> None:
    check_arguments(weight_format=fmt, group=group, scale_dtype=scale_dtype)
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


def quantize(w, fmt: str = "int8", group: int | None = None, scale_dtype: str | None = None) -> QuantizedMatrix:
    """Group-wise quantization of a 2-D float weight (numpy, ml_dtypes or anything
    np.asarray takes). ``group`` and ``scale_dtype`` default to the format's own (mxfp4:
    32 and e8m0; iq4nl: 32), else to DEFAULT_GROUP and fp16.

    int8 / int4: each group's scale is its largest magnitude over Q_MAX, rounded to
    ``scale_dtype``; q is computed with that stored scale (round half to even, clipped),
    so dequantize() reproduces exactly what a kernel computes. An all-zero group gets scale
    1 (never 0: zero scales are refused on load); a group whose scale rounds to infinity
    (fp16 from 65520) is refused.

    mxfp4 (OCP MX v1.0): each block of 32 shares the scale 2^(floor(log2(amax)) - 2), the
    exponent clamped to e8m0's range (an all-zero block gets 2^0), and every element
    becomes the nearest e2m1 value of w / scale, ties to even, saturating at +-6 (so
    magnitudes in (6, 8) x scale clip to 6, as the spec has it).

    int4-affine: each group's minimum is its smallest weight and its scale its range over
    15, both rounded to ``scale_dtype``; q is the nearest integer of (w - minimum) / scale,
    clipped to [0, 15] (0 where the scale is 0: a group of equal weights); a scale or
    minimum that rounds to infinity is refused.

    iq4nl: ggml's rule without its search over nearby scales: each block's scale is its
    largest-magnitude weight over -127 (so that weight takes the codebook's -127 end),
    rounded to ``scale_dtype``, and every element the nearest codebook value of w / scale
    (clipped to the codebook's ends); an all-zero block gets scale 0 (the codebook has no
    zero), and a block whose scale underflows ``scale_dtype`` the smallest one of its sign."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    rows, cols = w.shape
    check_arguments(weight_format=fmt)
    group, scale_dtype = scale_layout(fmt, group, scale_dtype)
    _check_layout(fmt, group, scale_dtype, rows, cols)
    w32 = w.astype(np.float32)
    if not np.all(np.isfinite(w32)):
        raise ValueError("the weight holds NaN or infinity")
    blocks = w32.reshape(rows, cols // group, group)
    amax = np.abs(blocks).max(axis=2)
    if fmt == "mxfp4":
        return _quantize_mxfp4(blocks, amax)
    if fmt == "iq4nl":
        return _quantize_iq4nl(blocks, scale_dtype)
    if fmt == "int4-affine":
        return _quantize_affine(blocks, scale_dtype)
    with np.errstate(over="ignore"):  # refused just below
        scales = (amax / Q_MAX[fmt]).astype(SCALE_DTYPES[scale_dtype])
    beyond = np.isinf(scales.astype(np.float32))
    if beyond.any():
        r, g = (int(i[0]) for i in np.nonzero(beyond))
        raise ValueError(f"the group's largest magnitude {float(amax[r, g]):f} needs a scale beyond its dtype's "
                         f"range (row {r}, group {g})")
    scales[scales.astype(np.float32) == 0] = 1  # all-zero (or underflowing) groups
    s32 = scales.astype(np.float32)[:, :, None]
    q = np.clip(np.rint(blocks / s32), Q_MIN[fmt], Q_MAX[fmt]).astype(np.int8).reshape(rows, cols)
    return QuantizedMatrix(fmt, group, pack_int4(q) if fmt == "int4" else q, scales)


def _quantize_mxfp4(blocks: np.ndarray, amax: np.ndarray) -> QuantizedMatrix:
    rows, n_blocks, group = blocks.shape
    # frexp: amax = m * 2^x with m in [0.5, 1), so floor(log2(amax)) = x - 1 exactly (a
    # float log2 may round up just below a power of two)
    _, exponent = np.frexp(amax)
    biased = np.where(amax > 0, exponent.astype(np.int64) - 1 - _E2M1_EMAX + _E8M0_BIAS, _E8M0_BIAS)
    biased = np.clip(biased, 0, _E8M0_NAN - 1).astype(np.uint8)
    scales = biased.view(ml_dtypes.float8_e8m0fnu)
    # dividing by a power of two is exact (the quotient stays far above fp32's subnormals
    # wherever it could round to a non-zero code)
    magnitude = np.abs(blocks) / scales.astype(np.float32)[:, :, None]
    codes = np.zeros(blocks.shape, dtype=np.uint8)
    for midpoint, tie_up in zip(_E2M1_MIDPOINTS, _E2M1_TIE_UP):
        codes += (magnitude > midpoint) | ((magnitude == midpoint) & tie_up)
    codes |= np.signbit(blocks).astype(np.uint8) << 3
    codes = codes.reshape(rows, n_blocks * group)
    return QuantizedMatrix("mxfp4", group, (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), scales)


def _quantize_iq4nl(blocks: np.ndarray, scale_dtype: str) -> QuantizedMatrix:
    rows, n_blocks, group = blocks.shape
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    dtype = SCALE_DTYPES[scale_dtype]
    scales = (extreme / np.float32(Q_MIN["iq4nl"])).astype(dtype)
    underflow = (scales.astype(np.float32) == 0) & (extreme != 0)
    smallest = np.array(1, np.uint32 if dtype.itemsize == 4 else np.uint16).view(dtype)  # the smallest subnormal
    scales[underflow] = np.where(extreme[underflow] > 0, -smallest, smallest)
    s32 = scales.astype(np.float32)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(s32 != 0, blocks / s32, 0)
    # searchsorted: a value on a midpoint takes the lower code (any nearest code is as good)
    codes = np.searchsorted(_IQ4_NL_MIDPOINTS, ratio).astype(np.uint8).reshape(rows, n_blocks * group)
    return QuantizedMatrix("iq4nl", group, (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), scales)


def _quantize_affine(blocks: np.ndarray, scale_dtype: str) -> QuantizedMatrix:
    rows, n_blocks, group = blocks.shape
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)
    dtype = SCALE_DTYPES[scale_dtype]
    with np.errstate(over="ignore", invalid="ignore"):  # refused just below
        minimums = lo.astype(dtype)
        scales = ((hi - lo) / np.float32(Q_MAX["int4-affine"])).astype(dtype)
    for name, values_, wanted in (("scale", scales, (hi - lo) / Q_MAX["int4-affine"]), ("minimum", minimums, lo)):
        beyond = ~np.isfinite(values_.astype(np.float32))
        if beyond.any():
            r, g = (int(i[0]) for i in np.nonzero(beyond))
            raise ValueError(f"the group's {name} {float(wanted[r, g]):g} is beyond its dtype's range "
                             f"(row {r}, group {g})")
    m32, s32 = minimums.astype(np.float32)[:, :, None], scales.astype(np.float32)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(s32 != 0, (blocks - m32) / s32, 0)
    q = np.clip(np.rint(ratio), 0, Q_MAX["int4-affine"]).astype(np.uint8).reshape(rows, n_blocks * group)
    return QuantizedMatrix("int4-affine", group, (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8),
                           np.concatenate([scales, minimums], axis=1))


def _unpack_codes(packed: np.ndarray) -> np.ndarray:
    """uint8 ``[rows, cols / 2]`` -> the 4-bit codes uint8 ``[rows, cols]``."""
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    return codes


def values(qm: QuantizedMatrix) -> np.ndarray:
    """The elements the scales multiply, ``[rows, cols]``: the int8 q values for int8 and
    int4 (unpacked); for mxfp4 the e2m1 values ``E2M1[code]`` as float32 (0, +-0.5, ...,
    +-6, exact); for iq4nl the int8 codebook values ``IQ4_NL_VALUES[code]``; for
    int4-affine the unsigned codes. dequantize() is values * scale (+ minimum) for every
    format."""
    if qm.fmt == "int4-affine":
        return _unpack_codes(qm.q)
    if qm.fmt == "mxfp4":
        return E2M1[_unpack_codes(qm.q)]
    if qm.fmt == "iq4nl":
        return IQ4_NL_VALUES[_unpack_codes(qm.q)]
    return unpack_int4(qm.q) if qm.fmt == "int4" else qm.q


def dequantize(qm: QuantizedMatrix) -> np.ndarray:
    """float32 ``[rows, cols]``: s[r, k // g] * q[r, k] (+ m[r, k // g] for int4-affine),
    each product and sum in fp32 (exact for mxfp4 while the product is in fp32's range;
    for llama.cpp's Q4_1 / Q4_K blocks the gguf package's values bit for bit)."""
    q = values(qm).astype(np.float32)
    rows, cols = q.shape
    s32 = qm.group_scales.astype(np.float32)
    w = q.reshape(rows, cols // qm.group, qm.group) * s32[:, :, None]
    if qm.minimums is not None:
        w = w + qm.minimums.astype(np.float32)[:, :, None]
    return w.reshape(rows, cols)


def error_bound(w, qm: QuantizedMatrix) -> np.ndarray:
    """Per-element bound on |w - dequantize(qm)| for quantize()'s output: half a step of
    the grid at w's magnitude (int8 / int4: half a scale; mxfp4: half the e2m1 spacing,
    0.25, 0.5 or 1 scale; iq4nl: half its codebook's widest gap, 12 scales; int4-affine:
    half a scale), plus what clipping loses beyond Q_MAX scales (iq4nl: beyond its
    codebook's ends; int4-affine: outside [m, m + 15 s])."""
    w32 = np.asarray(w).astype(np.float32)
    rows, cols = w32.shape
    s32 = qm.group_scales.astype(np.float32)[:, :, None]
    magnitude = np.abs(w32.reshape(rows, cols // qm.group, qm.group))
    if qm.minimums is not None:  # int4-affine: half a scale, plus what falls outside [m, m + 15 s]
        above = w32.reshape(magnitude.shape) - qm.minimums.astype(np.float32)[:, :, None]
        clipped = np.maximum(-above, 0) + np.maximum(above - Q_MAX[qm.fmt] * s32, 0)
        return (s32 / 2 + clipped).reshape(rows, cols)
    if qm.fmt == "iq4nl":
        s32 = np.abs(s32)
        ratio = w32.reshape(magnitude.shape) * np.sign(qm.scales.astype(np.float32))[:, :, None]
        clipped = (np.maximum(ratio - Q_MAX["iq4nl"] * s32, 0) + np.maximum(Q_MIN["iq4nl"] * s32 - ratio, 0))
        return (_IQ4_NL_HALF_GAP * s32 + clipped).reshape(rows, cols)
    if qm.fmt == "mxfp4":
        ratio = magnitude / s32
        half_step = np.where(ratio < 2, 0.25, np.where(ratio < 4, 0.5, 1.0)) * s32
    else:
        half_step = s32 / 2
    clipped = np.maximum(magnitude - Q_MAX[qm.fmt] * s32, 0)
    return (half_step + clipped).reshape(rows, cols)


def _ggml_blocks(data, rows: int, cols: int, block_bytes: int, what: str, block: int = GGML_BLOCK) -> np.ndarray:
    if cols % block:
        raise ValueError(f"{what}: cols={cols} is not a multiple of its {block}-weight blocks")
    raw = np.frombuffer(memoryview(data), dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
    expected = rows * cols // block * block_bytes
    if raw.size != expected:
        raise ValueError(f"{what}: {raw.size} bytes for a {rows} x {cols} matrix, expected {expected}")
    return raw.reshape(rows, cols // block, block_bytes)


def _ggml_nibbles_paired(nibbles: np.ndarray) -> np.ndarray:
    """The 16 code bytes of each ggml block of 32 (``[rows, blocks, 16]``: byte j holds
    weight j in its low nibble, weight j + 16 in its high one) re-paired as the contract
    packs nibbles, ``[rows, blocks * 16]``: byte i holds weights 2i and 2i + 1. Weights 2i
    and 2i + 1 are the low (i < 8) or the high (i >= 8) nibbles of bytes 2i mod 16 and
    2i + 1 mod 16, so each output byte is two masks and an or of an even and an odd input
    byte, on the packed bytes (no unpacking)."""
    rows, n_blocks, _ = nibbles.shape
    even, odd = nibbles[:, :, 0::2], nibbles[:, :, 1::2]
    paired = np.empty((rows, n_blocks, GGML_BLOCK // 2), dtype=np.uint8)
    np.bitwise_or(even & 0x0F, (odd & 0x0F) << 4, out=paired[:, :, :GGML_BLOCK // 4])
    np.bitwise_or(even >> 4, odd & 0xF0, out=paired[:, :, GGML_BLOCK // 4:])
    return paired.reshape(rows, n_blocks * GGML_BLOCK // 2)


def _ggml_nibble_codes(nibbles: np.ndarray) -> np.ndarray:
    """The 4-bit codes of ggml blocks of 32 (``[rows, blocks, 16]``: byte j holds weight j
    in its low nibble, weight j + 16 in its high one) in weight order, ``[rows, blocks,
    32]`` uint8."""
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)


def from_iq4_nl(data, rows: int, cols: int) -> QuantizedMatrix:
    """llama.cpp IQ4_NL (per 32 weights: fp16 d, then 16 bytes of codes in Q4_0's order;
    w = d * IQ4_NL_VALUES[code]) into the contract's IQ4_NL layout (group 32, fp16 scales,
    the codes re-paired like Q4_0's), without loss, at the file's own bytes."""
    blocks = _ggml_blocks(data, rows, cols, 2 + GGML_BLOCK // 2, "IQ4_NL")
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(rows, cols // GGML_BLOCK)
    return QuantizedMatrix("iq4nl", GGML_BLOCK, _ggml_nibbles_paired(blocks[:, :, 2:]), scales.copy())


def from_iq4_xs(data, rows: int, cols: int) -> QuantizedMatrix:
    """llama.cpp IQ4_XS (per 256 weights: fp16 d, a uint16 of the 8 sub-blocks' high scale
    bits (2 each), 4 bytes of their low scale bits (4 each, sub-block 2i in byte i's low
    nibble), then 8 x 16 bytes of IQ4_NL codes in Q4_0's order; sub-block ib of 32 weights
    has w = d * (ls - 32) * IQ4_NL_VALUES[code], ls its 6-bit scale) into the contract's
    IQ4_NL layout with group 32 and fp32 scales d * (ls - 32), without loss: the product of
    an fp16 and a 6-bit integer is exact in fp32 (17 significant bits), and so is each
    weight's one rounding, as ggml's. 1.18x the file's bytes (5 bits a weight against 4.25:
    the two-level scales flattened into one fp32 per 32)."""
    blocks = _ggml_blocks(data, rows, cols, 2 + 2 + 4 + 8 * GGML_BLOCK // 2, "IQ4_XS", block=8 * GGML_BLOCK)
    d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).astype(np.float32)  # [rows, n, 1]
    high = np.ascontiguousarray(blocks[:, :, 2:4]).view("<u2")  # [rows, n, 1]
    sub = np.arange(8)
    low = (blocks[:, :, 4 + sub // 2] >> (4 * (sub % 2)).astype(np.uint8)) & 0x0F
    ls = low.astype(np.int32) | (((high >> (2 * sub).astype(np.uint16)) & 3).astype(np.int32) << 4)
    scales = (d * (ls - 32).astype(np.float32)).reshape(rows, cols // GGML_BLOCK)
    codes = blocks[:, :, 8:].reshape(rows, cols // GGML_BLOCK, GGML_BLOCK // 2)
    return QuantizedMatrix("iq4nl", GGML_BLOCK, _ggml_nibbles_paired(codes), np.ascontiguousarray(scales))


def from_q5_0(data, rows: int, cols: int) -> QuantizedMatrix:
    """llama.cpp Q5_0 (per 32 weights: fp16 d, a little-endian uint32 whose bit j is weight
    j's fifth bit, then 16 bytes of the low four bits in Q4_0's order; w = d * (q - 16), q
    in [0, 31]) into the contract's INT8 layout (group 32, fp16 scales), without loss, at
    1.5x the file's bytes (8.5 bits a weight against 5.5)."""
    blocks = _ggml_blocks(data, rows, cols, 2 + 4 + GGML_BLOCK // 2, "Q5_0")
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(rows, cols // GGML_BLOCK)
    high = np.ascontiguousarray(blocks[:, :, 2:6]).view("<u4")  # [rows, blocks, 1]
    fifth = ((high >> np.arange(GGML_BLOCK, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    q = (_ggml_nibble_codes(blocks[:, :, 6:]) | fifth).astype(np.int8) - np.int8(16)
    return QuantizedMatrix("int8", GGML_BLOCK, q.reshape(rows, cols), scales.copy())


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
    packed = _ggml_nibbles_paired(blocks[:, :, 2:])
    packed ^= 0x88  # q + 8 -> q's two's complement nibble: (q + 8) ^ 8 = q mod 16, per nibble
    return QuantizedMatrix("int4", GGML_BLOCK, packed, scales.copy())



def _check_e8m0(scales: np.ndarray, what: str) -> None:
    bad = np.argwhere(scales.view(np.uint8) == _E8M0_NAN)
    if bad.size:
        r, b = (int(i) for i in bad[0])
        raise ValueError(f"{what}: scale byte 0xFF (NaN in e8m0) at row {r}, block {b} "
                         f"({len(bad)} such block(s))")


def from_gguf_mxfp4(data, rows: int, cols: int) -> QuantizedMatrix:
    """llama.cpp MXFP4 (per 32 weights: the e8m0 scale byte, then 16 bytes; byte j holds
    weight j in its low nibble and weight j + 16 in its high one, both e2m1 codes) into
    the contract's MXFP4 layout (group 32, e8m0 scales, adjacent columns per byte),
    without loss. A scale byte 0xFF (NaN) is a ValueError naming its row and block."""
    blocks = _ggml_blocks(data, rows, cols, 1 + GGML_BLOCK // 2, "MXFP4")
    scales = blocks[:, :, 0].copy().view(ml_dtypes.float8_e8m0fnu)
    _check_e8m0(scales, "MXFP4")
    return QuantizedMatrix("mxfp4", MX_BLOCK, _ggml_nibbles_paired(blocks[:, :, 1:]), scales)


def from_mxfp4_blocks(blocks, scales) -> QuantizedMatrix:
    """One matrix of gpt-oss's safetensors MXFP4 (``*_blocks`` uint8 ``[rows, cols / 32,
    16]``, the even element in the low nibble; ``*_scales`` uint8 or e8m0 ``[rows, cols /
    32]``) as the contract's MXFP4 layout: a reshape and a dtype view, no copy when the
    arrays are C-contiguous. Wrong dtypes or shapes and a scale byte 0xFF (NaN) are a
    ValueError."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or blocks.ndim != 3 or blocks.shape[2] != MX_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks must be uint8 [rows, cols / {MX_BLOCK}, {MX_BLOCK // 2}], "
                         f"got {blocks.dtype} {list(blocks.shape)}")
    rows, n_blocks, _ = blocks.shape
    if scales.dtype not in (np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e8m0fnu)) \
            or scales.shape != (rows, n_blocks):
        raise ValueError(f"MXFP4 scales must be uint8 or float8_e8m0fnu [{rows}, {n_blocks}] "
                         f"(one per block of {MX_BLOCK}), got {scales.dtype} {list(scales.shape)}")
    if rows < 1 or n_blocks < 1:
        raise ValueError(f"a {rows} x {n_blocks * MX_BLOCK} matrix has no weights")
    scales = scales.view(ml_dtypes.float8_e8m0fnu)
    _check_e8m0(scales, "MXFP4 scales")
    return QuantizedMatrix("mxfp4", MX_BLOCK, blocks.reshape(rows, n_blocks * MX_BLOCK // 2), scales)

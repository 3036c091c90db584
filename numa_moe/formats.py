"""The one table of what the package's bytes are: safetensors dtype codes and their numpy
dtypes, the weight formats of expert matrices (bits per element), the quantization
schemes, groups and scale dtypes. Every other module takes these names from here, so a
format is added in one place.

Pure numpy (and ml_dtypes for bf16 / fp8); imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = [
    "KINDS",
    "NUMPY_DTYPES",
    "DTYPE_BYTES",
    "FLOAT_FORMATS",
    "FLOAT_NUMPY",
    "FP8_DTYPES",
    "FP8_SCALE_CODES",
    "QUANT_FORMATS",
    "QUANT_DTYPES",
    "GROUPS",
    "DEFAULT_GROUP",
    "SCALE_DTYPE_CODES",
    "SCALE_DTYPES",
    "FIXED_GROUPS",
    "FIXED_SCALE_DTYPES",
    "ZERO_SCALE_FORMATS",
    "MINIMUM_FORMATS",
    "scale_columns",
    "WeightFormat",
    "WEIGHT_FORMATS",
    "weight_format",
    "nibble_packed",
    "positive_int",
]

# The three matrices of an expert FFN, in the order every list of them uses.
KINDS = ("gate", "up", "down")

# safetensors dtype code -> numpy dtype (what a tensor of that code is read and written as)
NUMPY_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
# safetensors dtype code -> bytes per element
DTYPE_BYTES = {code: dtype.itemsize for code, dtype in NUMPY_DTYPES.items()}

# safetensors dtype of float expert weights -> their weight format
FLOAT_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
# float weight format -> numpy dtype of its buffers
FLOAT_NUMPY = {fmt: NUMPY_DTYPES[code] for code, fmt in FLOAT_FORMATS.items()}
# safetensors dtypes of FP8 expert weights that come with block scales, and the dtypes
# those block scales may have
FP8_DTYPES = ("F8_E4M3",)
FP8_SCALE_CODES = ("F32", "BF16", "F16")

# Group-wise quantized weights (docs/quantization.md): the schemes (symmetric integers,
# the OCP MX e2m1 elements of "mxfp4", llama.cpp's IQ4_NL codebook "iq4nl"), the
# safetensors dtype of their values (the 4-bit ones two per byte), the group sizes and the
# dtypes of the group scales (name -> safetensors code, name -> numpy dtype; "e8m0" is the
# MX power-of-two scale).
QUANT_FORMATS = ("int8", "int4", "mxfp4", "iq4nl", "int4-affine")
QUANT_DTYPES = {"int8": "I8", "int4": "U8", "mxfp4": "U8", "iq4nl": "U8", "int4-affine": "U8"}
GROUPS = (32, 64, 128)
DEFAULT_GROUP = 128
SCALE_DTYPE_CODES = {"fp16": "F16", "bf16": "BF16", "fp32": "F32", "e8m0": "F8_E8M0"}
SCALE_DTYPES = {name: NUMPY_DTYPES[code] for name, code in SCALE_DTYPE_CODES.items()}
# Formats whose group the format itself fixes (its block): format -> group; and those
# whose scale dtype it fixes too: format -> scale dtype. Every other format takes any
# group of GROUPS, and any scale dtype not fixed by another (numa_moe.quant.check_arguments
# holds the rule).
FIXED_GROUPS = {"mxfp4": 32, "iq4nl": 32, "int4-affine": 32}
FIXED_SCALE_DTYPES = {"mxfp4": "e8m0"}
# Formats whose scales may be 0: iq4nl's codebook has no zero, so a block of zeros (ggml
# writes d = 0 for one) is a zero scale, and int4-affine's group of equal weights has
# scale 0. Every other format's scales are never 0.
ZERO_SCALE_FORMATS = ("iq4nl", "int4-affine")
# Formats with a minimum per group besides its scale (int4-affine: unsigned codes q in
# [0, 15], w = s * q + m, llama.cpp's Q4_1 and Q4_K). Their scales tensor holds each row's
# cols / group scales, then its cols / group minimums (scale_columns).
MINIMUM_FORMATS = ("int4-affine",)


def scale_columns(fmt: str, cols: int, group: int) -> int:
    """Columns of the scales tensor of a ``cols``-column matrix of the quantized format
    ``fmt``: one scale per group, and for MINIMUM_FORMATS one minimum per group after them."""
    return cols // group * (2 if fmt in MINIMUM_FORMATS else 1)


def positive_int(value, name: str) -> int:
    """``value`` as a Python int when it is an integer > 0, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return int(value)


@dataclass(frozen=True)
class WeightFormat:
    """How many bits one element of a weight (or scale) tensor takes in memory."""

    name: str
    bits_per_element: int

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` elements; a row must be a whole number of bytes."""
        cols = positive_int(cols, "cols")
        bits = cols * self.bits_per_element
        if bits % 8:
            raise ValueError(
                f"cols={cols} of {self.name} ({self.bits_per_element} bits per element) "
                f"is {bits} bits, not a whole number of bytes: rows must be whole bytes "
                f"(use an even number of columns for {self.name})"
            )
        return bits // 8

    @property
    def element_bytes(self) -> int:
        """Bytes an element occupies, rounded up (1 for sub-byte formats)."""
        return max(1, self.bits_per_element // 8)

    def elements_in(self, nbytes):
        """Elements held in ``nbytes`` bytes (works element-wise on numpy arrays)."""
        return nbytes * 8 // self.bits_per_element


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 16),
    "fp16": WeightFormat("fp16", 16),
    "fp32": WeightFormat("fp32", 32),
    "int8": WeightFormat("int8", 8),
    "int4": WeightFormat("int4", 4),
    "mxfp4": WeightFormat("mxfp4", 4),
    "iq4nl": WeightFormat("iq4nl", 4),
    "int4-affine": WeightFormat("int4-affine", 4),
    "e8m0": WeightFormat("e8m0", 8),
}

_FORMAT_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "f16": "fp16",
    "i8": "int8",
    "i4": "int4",
}


def weight_format(fmt: str | WeightFormat) -> WeightFormat:
    """The :class:`WeightFormat` named ``fmt`` (``"bf16"``, ``"int4"``, ... or an alias)."""
    if isinstance(fmt, WeightFormat):
        return fmt
    if not isinstance(fmt, str):
        raise ValueError(f"weight format must be a name such as 'bf16', got {fmt!r}")
    key = fmt.strip().lower()
    key = _FORMAT_ALIASES.get(key, key)
    try:
        return WEIGHT_FORMATS[key]
    except KeyError:
        raise ValueError(
            f"unknown weight format {fmt!r}; known: {', '.join(WEIGHT_FORMATS)}"
        ) from None


def nibble_packed(fmt: str | WeightFormat) -> bool:
    """Whether ``fmt`` stores two weights per byte (int4, mxfp4, iq4nl: the even column in
    the low nibble), so a row of ``cols`` weights is ``cols / 2`` bytes of uint8."""
    return weight_format(fmt).bits_per_element == 4

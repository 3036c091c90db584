"""The native group quantization (_native.quantize_groups, through
numa_moe.checkpoints.expert_import.quantize_into: every int8 / int4 conversion of a float
checkpoint, GGUF K-quant or FP8 expert, and MoELayer.from_tensors'): the same bytes as numa_moe.quant.quantize, the
numpy statement of the rule, on weights whose scales cover fp16's subnormals, ties and every
group and scale dtype; bad weights and arguments refused by name."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numa_moe import _native
from numa_moe import quant as q
from numa_moe.checkpoints.expert_import import LoadFormat, convert_float, quantize_into
from numa_moe.files import CheckpointError
from numa_moe.formats import SCALE_DTYPES


def weights(rng, rows, cols, group):
    """Rows of very different magnitudes (scales from fp16's subnormals to its top), an
    all-zero group, and groups whose values are ties of their own stored scale."""
    w = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-28, 13, size=(rows, 1)))
    w[0, :group] = 0
    if rows > 1:  # ties: amax = 127 s for an fp16 s, the others (n + 1/2) s
        s = float(np.float16(rng.uniform(0.01, 1)))
        w[1, :group] = (rng.integers(-127, 127, group) + 0.5) * s
        w[1, 0] = 127 * s
    return w.astype(np.float32)


def destinations(fmt, scale_dtype, rows, cols, group, pad=5):
    """values and scales whose rows lie further apart than their bytes, filled with 0x5A."""
    value_cols = cols if fmt == "int8" else cols // 2
    values = np.full((rows, value_cols + pad), 0x5A, np.int8 if fmt == "int8" else np.uint8)[:, :value_cols]
    dtype = np.dtype(SCALE_DTYPES[scale_dtype])
    scales = np.full((rows, (cols // group + pad) * dtype.itemsize), 0x5A, np.uint8).view(dtype)[:, :cols // group]
    return values, scales


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("scale_dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_native_quantization_equals_quant_quantize(rng, fmt, scale_dtype, group):
    rows, cols = 9, 3 * 128
    w = weights(rng, rows, cols, group)
    if scale_dtype == "fp16":
        w = np.clip(w, -60000 * q.Q_MAX[fmt], 60000 * q.Q_MAX[fmt])  # scales within fp16
    want = q.quantize(w, fmt, group, scale_dtype)
    values, scales = destinations(fmt, scale_dtype, rows, cols, group)
    _native.quantize_groups(w, fmt, group, scale_dtype, values, scales)
    np.testing.assert_array_equal(values, want.q)
    np.testing.assert_array_equal(scales.view(np.uint8), np.asarray(want.scales).view(np.uint8))
    assert values.base[:, values.shape[1]:].view(np.uint8).tolist() == [[0x5A] * 5] * rows  # nothing past the rows


def test_quantize_into_takes_the_other_formats_through_quant(rng):
    w = rng.standard_normal((4, 64)).astype(np.float32)
    want = q.quantize(w, "mxfp4")
    values = np.empty_like(want.q)
    scales = np.empty_like(want.scales)
    quantize_into(w, "mxfp4", 32, "e8m0", values, scales)
    np.testing.assert_array_equal(values, want.q)
    np.testing.assert_array_equal(scales.view(np.uint8), want.scales.view(np.uint8))
    bf16 = w.astype(ml_dtypes.bfloat16)  # a bf16 matrix: widened exactly before the native pass
    values, scales = destinations("int8", "fp16", 4, 64, 32)
    quantize_into(bf16, "int8", 32, "fp16", values, scales)
    np.testing.assert_array_equal(values, q.quantize(bf16, "int8", 32, "fp16").q)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_bad_weight_is_named(rng, bad):
    w = rng.standard_normal((4, 128)).astype(np.float32)
    w[2, 77] = bad
    values, scales = destinations("int8", "fp16", 4, 128, 32)
    with pytest.raises(ValueError, match=r"the weight holds NaN or infinity \(row 2, column 77\)"):
        _native.quantize_groups(w, "int8", 32, "fp16", values, scales)
    with pytest.raises(ValueError, match=r"the weight holds NaN or infinity \(row 2, column 77\)"):
        quantize_into(w, "int8", 32, "fp16", values, scales)
    with pytest.raises(CheckpointError, match=r"expert 3: the weight holds NaN or infinity \(row 2, column 77\); "
                                              "cannot quantize it"):
        convert_float(w, values, scales, LoadFormat("int8", 32, "fp16"), "expert 3")
    with pytest.raises(ValueError, match="NaN or infinity"):
        q.quantize(w, "int8", 32, "fp16")


def test_a_scale_beyond_fp16_is_refused_by_both(rng):
    w = rng.standard_normal((3, 64)).astype(np.float32)
    w[1, 40] = 65520 * 127  # its scale rounds to fp16 infinity
    values, scales = destinations("int8", "fp16", 3, 64, 32)
    message = r"needs a scale beyond its dtype's range \(row 1, group 1\)"
    with pytest.raises(ValueError, match=message):
        _native.quantize_groups(w, "int8", 32, "fp16", values, scales)
    with pytest.raises(ValueError, match=message):
        q.quantize(w, "int8", 32, "fp16")
    w[1, 40] = 65504 * 127  # the largest finite fp16 scale
    _native.quantize_groups(w, "int8", 32, "fp16", values, scales)
    np.testing.assert_array_equal(scales, q.quantize(w, "int8", 32, "fp16").scales)


def test_bad_arguments_are_refused(rng):
    w = rng.standard_normal((2, 64)).astype(np.float32)
    values, scales = destinations("int8", "fp16", 2, 64, 32)
    quantize = _native.quantize_groups
    with pytest.raises(ValueError, match="format 'mxfp4' is not one of int8, int4"):
        quantize(w, "mxfp4", 32, "fp16", values, scales)
    with pytest.raises(ValueError, match="scale dtype 'e8m0' is not one of fp16, bf16, fp32"):
        quantize(w, "int8", 32, "e8m0", values, scales)
    with pytest.raises(ValueError, match="group 16 is not one of 32, 64, 128"):
        quantize(w, "int8", 16, "fp16", values, scales)
    with pytest.raises(ValueError, match="cols a positive multiple of the group 128"):
        quantize(w, "int8", 128, "fp16", values, scales)
    with pytest.raises(ValueError, match="w: dtype float64, expected float32"):
        quantize(w.astype(np.float64), "int8", 32, "fp16", values, scales)
    with pytest.raises(ValueError, match=r"values: shape \(2, 32\), expected \[2, 64\]"):
        quantize(w, "int8", 32, "fp16", values[:, :32], scales)
    with pytest.raises(ValueError, match="scales: 4-byte elements, expected 2"):
        quantize(w, "int8", 32, "fp16", values, scales.astype(np.float32))
    scales.flags.writeable = False
    with pytest.raises(ValueError, match="scales: must be writable"):
        quantize(w, "int8", 32, "fp16", values, scales)

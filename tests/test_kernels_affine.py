"""INT4-AFFINE expert weights (unsigned 4-bit codes, a scale and a minimum per 32 columns,
llama.cpp's Q4_1 / Q4_K; docs/quantization.md) through every ISA's kernels, against a
float64 model built from the codes, scales and minimums, and equal to ref bit for bit:
the minimum terms (group_minimums.hpp) run after each ISA's own scale terms, on the token
group sums its operand writer took."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numa_moe import _native, quant
from numa_moe.layer import kernels

from test_kernels_mxfp4 import check_odd_segments, ffn_model, reference_matmul
from test_kernels_quant import FFN_BOUND

BF16 = np.dtype(ml_dtypes.bfloat16)
GROUP = 32
FMT = "int4-affine"
ISAS = kernels.tested_isas(FMT)
ALL_ISAS = kernels.available_isas(FMT)
SCALE_DTYPES = {"fp16": np.float16, "fp32": np.float32, "bf16": BF16}


def random_affine(rng, rows, cols, scale_dtype="fp16", magnitude=0.01, codes=None):
    """A QuantizedMatrix of random codes (every one of the 16, or those given), random
    scales (a few 0: groups of equal weights) and minimums of both signs, a few 0."""
    if codes is None:
        codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = rng.random((rows, cols // GROUP)) * magnitude
    scales[rng.random(scales.shape) < 0.05] = 0
    minimums = rng.standard_normal((rows, cols // GROUP)) * 8 * magnitude
    minimums[rng.random(minimums.shape) < 0.05] = 0
    both = np.concatenate([scales, minimums], axis=1).astype(SCALE_DTYPES[scale_dtype])
    return quant.QuantizedMatrix(FMT, GROUP, packed, both)


def dequantized(qm) -> np.ndarray:
    """float64 [rows, cols]: scale * code + minimum."""
    packed = np.asarray(qm.q)
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.float64)
    codes[:, 0::2], codes[:, 1::2] = packed & 0x0F, packed >> 4
    scale = np.repeat(qm.group_scales.astype(np.float64), GROUP, axis=1)
    minimum = np.repeat(qm.minimums.astype(np.float64), GROUP, axis=1)
    return codes * scale + minimum


def test_every_isa_has_int4_affine_kernels_where_it_has_int4_ones():
    assert kernels.available_isas(FMT) == kernels.available_isas("int4")
    assert ISAS == kernels.tested_isas("int4")


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("scale_dtype", sorted(SCALE_DTYPES))
def test_matmul_segments_on_odd_segments_and_token_counts(rng, isa, scale_dtype):
    """Strided segments that start and end on odd 32-column groups, a thread's row range
    cutting them, token counts across every kernel's switches: against the float64 model,
    and equal to ref bit for bit (test_kernels_mxfp4.check_odd_segments)."""
    qm = random_affine(rng, 77, 11 * GROUP, scale_dtype)
    check_odd_segments(rng, qm, dequantized(qm), isa)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("m", [1, 3, 4, 16, 40, 130])
def test_the_largest_codes_and_tokens_and_many_groups(rng, isa, m):
    """Codes 0 and 15 against tokens that quantize to +-127 (the largest u8 x s8 pairs and
    group sums), over more groups than the minimum terms convert at a time (256), with
    rows that the minimum terms' sets of four do not divide."""
    rows, cols = 23, 261 * GROUP
    codes = np.where(rng.random((rows, cols)) < 0.5, 0, 15).astype(np.uint8)
    qm = random_affine(rng, rows, cols, "fp32", magnitude=1.0, codes=codes)
    x = np.where(rng.random((m, cols)) < 0.5, -1.0, 1.0).astype(BF16)
    out = np.zeros((rows, m), np.float32)
    segments = np.array([[0, 1, rows, 0, 3 * GROUP], [0, 1, rows, 5 * GROUP, cols]], np.int64)
    kernels.matmul_segments(qm, segments, x, out, isa=isa)
    w64 = dequantized(qm)
    expected = reference_matmul(w64, x, np.arange(rows), 0, 3 * GROUP) + \
        reference_matmul(w64, x, np.arange(rows), 5 * GROUP, cols)
    err = np.abs(out - expected).max() / np.abs(expected).max()
    assert err < 1e-5, err
    ref_out = np.zeros_like(out)
    kernels.matmul_segments(qm, segments, x, ref_out, isa="ref")
    np.testing.assert_array_equal(out, ref_out)


@pytest.mark.parametrize("isa", [None, *ISAS])
@pytest.mark.parametrize(("threads", "m"), [(1, 5), (2, 1), (2, 17)])
def test_expert_ffn_matches_the_float64_model(rng, isa, threads, m):
    hidden, inter = 256, 192
    qms = [random_affine(rng, r, c, magnitude=0.3 / c) for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
    x = rng.standard_normal((9, hidden)).astype(BF16)
    index = rng.integers(0, len(x), m)
    out = np.full((m, hidden), np.nan, np.float32)
    kernels.expert_ffn(x, *qms, token_index=index, out=out, threads=threads, isa=isa)
    expected = ffn_model(x, [dequantized(qm) for qm in qms], index)
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < FFN_BOUND


@pytest.mark.parametrize("scale_dtype", sorted(SCALE_DTYPES))
def test_quantize_stays_within_its_bound(rng, scale_dtype):
    w = (rng.standard_normal((6, 4 * GROUP)) * rng.choice([1e-3, 1.0, 300.0], size=(6, 1))).astype(np.float32)
    w[0, :GROUP] = 0.25  # a group of equal weights: scale 0
    w[1, :GROUP] = rng.random(GROUP) + 5  # all above 0: the minimum carries the offset
    qm = quant.quantize(w, FMT, None, scale_dtype)
    assert (qm.group, qm.q.shape, qm.scales.shape) == (GROUP, (6, 2 * GROUP), (6, 8))
    assert qm.group_scales[0, 0] == 0 and qm.minimums[0, 0] == 0.25  # exact in every scale dtype
    got = quant.dequantize(qm)
    assert np.all(np.abs(got - w) <= quant.error_bound(w, qm) * (1 + 1e-6))
    np.testing.assert_array_equal(quant.values(qm), quant.values(qm).clip(0, 15))
    big = w.copy()
    big[0, GROUP] = -7e4  # below fp16's -65504, while the group's range over 15 still fits
    with pytest.raises(ValueError, match=r"the group's minimum -70000 is beyond its dtype's range \(row 0, group 1\)"):
        quant.quantize(big, FMT, None, "fp16")
    big[0, GROUP] = -1e6  # the range over 15 is beyond fp16 too: the scale is named first
    with pytest.raises(ValueError, match=r"the group's scale 66\d+\.?\d* is beyond its dtype's range \(row 0, group 1\)"):
        quant.quantize(big, FMT, None, "fp16")
    with pytest.raises(ValueError, match="weight_format 'int4-affine' takes group 32 only"):
        quant.quantize(w, FMT, 64)


def test_int4_affine_operands_get_clear_errors(rng):
    qm = random_affine(rng, 32, 128)
    x = rng.standard_normal((2, 128)).astype(BF16).view(np.uint16)
    out = np.zeros((32, 2), np.float32)
    seg = np.array([[0, 1, 32, 0, 128]], np.int64)

    def call(w, s, fmt=FMT):
        _native.matmul_segments("ref", w, seg, x, out, scales=s, format=fmt)

    scales = qm.scales.copy()
    scales[3, 6] = np.nan  # a minimum
    with pytest.raises(ValueError, match=r"weight_scales: entry 30 is not finite \(scales and minimums must be finite\)"):
        call(qm.q, scales)
    with pytest.raises(ValueError, match=r"group 64 .* is not one of 32 \(int4-affine's block\)"):
        call(qm.q, qm.scales[:, :4].copy())  # the scales alone read as scales and minimums of 64
    with pytest.raises(ValueError, match=r"shape \(32, 3\) does not give a group .*the scales, then the minimums"):
        call(qm.q, qm.scales[:, :3].copy())
    with pytest.raises(ValueError, match="weight: dtype int8 does not hold int4-affine weights"):
        call(qm.q.view(np.int8), qm.scales)
    assert np.all(out == 0)
    zero = qm.scales.copy()
    zero[0, :] = 0  # zero scales and minimums: a row of zeros
    call(qm.q, zero)
    assert np.all(out[0] == 0)

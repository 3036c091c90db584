"""IQ4_NL expert weights (llama.cpp's non-uniform 4-bit codebook, a float scale per 32
columns; docs/quantization.md) through every ISA's kernels, against a float64 model built
from the test's own copy of the codebook. Its values reach -127 and 113: AVX2 without
AVX-VNNI takes them with the sign trick (the biased values would overflow vpmaddubsw's
int16 pairs), so the tests put the codebook's ends against tokens at +-127."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numa_moe import _native, quant
from numa_moe.layer import kernels

from test_kernels_mxfp4 import check_odd_segments, ffn_model, reference_matmul
from test_kernels_quant import FFN_BOUND

BF16 = np.dtype(ml_dtypes.bfloat16)
CODEBOOK = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float64)
GROUP = 32
ISAS = kernels.tested_isas("iq4nl")
# As in test_kernels_mxfp4: the emulated builds this CPU has besides its native ones too
# (their codebook lookups and the AVX2 sign trick are code paths of their own).
ALL_ISAS = kernels.available_isas("iq4nl")
SCALE_DTYPES = {"fp16": np.float16, "fp32": np.float32, "bf16": BF16}


def random_iq4nl(rng, rows, cols, scale_dtype="fp16", magnitude=0.01, codes=None):
    """A QuantizedMatrix of random codes (every one of the 16, or those given) and random
    scales of both signs, a few of them 0 (a block of zeros: the codebook has no zero)."""
    if codes is None:
        codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = rng.standard_normal((rows, cols // GROUP)) * magnitude
    scales[rng.random(scales.shape) < 0.05] = 0
    return quant.QuantizedMatrix("iq4nl", GROUP, packed, scales.astype(SCALE_DTYPES[scale_dtype]))


def dequantized(qm) -> np.ndarray:
    """float64 [rows, cols]: scale * codebook[code]."""
    packed = np.asarray(qm.q)
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 0x0F, packed >> 4
    return CODEBOOK[codes] * np.repeat(qm.scales.astype(np.float64), GROUP, axis=1)


def test_every_isa_has_iq4nl_kernels_where_it_has_int4_ones():
    assert kernels.available_isas("iq4nl") == kernels.available_isas("int4")
    assert ISAS == kernels.tested_isas("int4")


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("scale_dtype", sorted(SCALE_DTYPES))
def test_matmul_segments_on_odd_segments_and_token_counts(rng, isa, scale_dtype):
    """Strided segments that start and end on odd 32-column groups (the half steps of
    kernels that read 64 columns at a time), a thread's row range cutting them, and token
    counts across every kernel's switches: against the float64 model, and equal to ref bit
    for bit."""
    qm = random_iq4nl(rng, 77, 11 * GROUP, scale_dtype)
    check_odd_segments(rng, qm, dequantized(qm), isa)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("m", [1, 2, 4, 16, 40])
def test_the_codebook_ends_against_the_largest_tokens(rng, isa, m):
    """Every weight at the codebook's ends (-127, 113) and tokens that quantize to +-127:
    the largest int16 pairs vpmaddubsw could form (2 x 127 x 127 with the sign trick) and
    int32 group sums, exact in every ISA."""
    rows, cols = 40, 6 * GROUP
    codes = np.where(rng.random((rows, cols)) < 0.5, 0, 15).astype(np.uint8)
    qm = random_iq4nl(rng, rows, cols, "fp32", magnitude=1.0, codes=codes)
    x = np.where(rng.random((m, cols)) < 0.5, -1.0, 1.0).astype(BF16)
    x[0] = np.where(codes[0] == 0, -1.0, 1.0)  # token 0 meets row 0 with every product at +127 * 127
    out = np.zeros((rows, m), np.float32)
    segments = np.array([[0, 1, rows, 0, 2 * GROUP], [0, 1, rows, 3 * GROUP, cols]], np.int64)
    kernels.matmul_segments(qm, segments, x, out, isa=isa)
    w64 = dequantized(qm)
    expected = reference_matmul(w64, x, np.arange(rows), 0, 2 * GROUP) + \
        reference_matmul(w64, x, np.arange(rows), 3 * GROUP, cols)
    err = np.abs(out - expected).max() / np.abs(expected).max()
    assert err < 1e-5, err
    ref_out = np.zeros_like(out)
    kernels.matmul_segments(qm, segments, x, ref_out, isa="ref")
    np.testing.assert_array_equal(out, ref_out)


@pytest.mark.parametrize("isa", [None, *ISAS])
@pytest.mark.parametrize(("threads", "m"), [(1, 5), (2, 1), (2, 17)])
def test_expert_ffn_matches_the_float64_model(rng, isa, threads, m):
    hidden, inter = 256, 192
    qms = [random_iq4nl(rng, r, c, magnitude=0.3 / c) for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
    x = rng.standard_normal((9, hidden)).astype(BF16)
    index = rng.integers(0, len(x), m)
    out = np.full((m, hidden), np.nan, np.float32)
    kernels.expert_ffn(x, *qms, token_index=index, out=out, threads=threads, isa=isa)
    expected = ffn_model(x, [dequantized(qm) for qm in qms], index)
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < FFN_BOUND


def test_iq4nl_operands_get_clear_errors(rng):
    qm = random_iq4nl(rng, 32, 128)
    x = rng.standard_normal((2, 128)).astype(BF16).view(np.uint16)
    out = np.zeros((32, 2), np.float32)
    seg = np.array([[0, 1, 32, 0, 128]], np.int64)

    def call(w, s, fmt="iq4nl"):
        _native.matmul_segments("ref", w, seg, x, out, scales=s, format=fmt)

    scales = qm.scales.copy()
    scales[3, 1] = np.inf
    with pytest.raises(ValueError, match=r"weight_scales: entry 13 is not finite \(scales must be finite\)"):
        call(qm.q, scales)
    with pytest.raises(ValueError, match="weight: dtype int8 does not hold iq4nl weights"):
        call(qm.q.view(np.int8), qm.scales)
    with pytest.raises(ValueError, match=r"group 64 .* is not one of 32 \(iq4nl's block\)"):
        call(qm.q, qm.scales[:, :2].copy())
    e8m0 = np.full(qm.scales.shape, 127, np.uint8).view(ml_dtypes.float8_e8m0fnu)
    with pytest.raises(ValueError, match="e8m0 scales go with mxfp4 weights only"):
        call(qm.q, e8m0)
    with pytest.raises(ValueError, match="format 'iq4' is not one of bf16, int8, int4, mxfp4, iq4nl"):
        call(qm.q, qm.scales, "iq4")
    with pytest.raises(ValueError, match="format 'iq4' is not one of"):
        call(qm.q, None, "iq4")
    with pytest.raises(ValueError, match="weight: iq4nl weights need their group scales"):
        call(qm.q, None)
    with pytest.raises(ValueError, match="weight: bf16 weights take no scales"):
        call(qm.q, qm.scales, "bf16")
    assert np.all(out == 0)
    # a zero scale is iq4nl's block of zeros; int4's scales are never 0
    zero = qm.scales.copy()
    zero[0, 0] = 0
    call(qm.q, zero)
    with pytest.raises(ValueError, match=r"entry 0 is zero \(scales must be finite and non-zero\)"):
        call(qm.q, zero, "int4")

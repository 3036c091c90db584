"""MXFP4 expert weights (OCP MX: e2m1 codes, an e8m0 scale per 32 columns;
docs/quantization.md) through every ISA's kernels, against a float64 model built from an
e2m1 decoder of the test's own: the kernels compute each group as an exact integer dot of
twice the e2m1 values times 2^(e - 128), which is the OCP element times the token value."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numa_moe import _native, quant
from numa_moe.layer import kernels

from test_kernels_quant import FFN_BOUND, covered_rows, quantize_tokens

BF16 = np.dtype(ml_dtypes.bfloat16)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
GROUP = 32
ISAS = kernels.tested_isas("mxfp4")
# The kernel tests below also run the emulated builds this CPU has besides its native ones
# (on an AVX2 CPU without AVX-VNNI, avx2_emulated is the AVX-VNNI build): their nibble
# lookups are code paths of their own.
ALL_ISAS = kernels.available_isas("mxfp4")


def random_mxfp4(rng, rows, cols, exponents=(118, 132)):
    """A QuantizedMatrix of random codes (every one of the 16) and random e8m0 scale bytes
    in [exponents[0], exponents[1])."""
    codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale_bytes = rng.integers(*exponents, (rows, cols // GROUP), dtype=np.uint8)
    return quant.QuantizedMatrix("mxfp4", GROUP, packed, scale_bytes.view(E8M0))


def dequantized(qm) -> np.ndarray:
    """float64 [rows, cols]: 2^(e - 127) * e2m1(code), the OCP definition."""
    packed = np.asarray(qm.q)
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 0x0F, packed >> 4
    exponents = qm.scales.view(np.uint8).astype(np.int64) - 127
    return E2M1[codes] * np.repeat(np.ldexp(1.0, exponents), GROUP, axis=1)


def reference_matmul(w64, x, rows, k0, k1) -> np.ndarray:
    """float64 [len(rows), m]: the weights against the quantized tokens (the token rule)."""
    x_q, x_s = quantize_tokens(x.astype(np.float32), GROUP)
    tokens = x_q * np.repeat(x_s.astype(np.float64), GROUP, axis=1)
    return w64[np.ix_(rows, np.arange(k0, k1))] @ tokens[:, k0:k1].T


def check_odd_segments(rng, qm, w64, isa):
    """matmul_segments of a rows x 11 * GROUP codebook matrix on strided segments that start
    and end on odd 32-column groups, a row range cutting them, and token counts across every
    kernel's switches (avx512: pairs to 3, row lanes to 16 in two passes, lanes from 17; AMX:
    tiles of 16 and 32): against the float64 weights w64, and equal to ref bit for bit."""
    rows, cols = w64.shape
    segments = np.array([[3, 7, 10, 32, 160], [1, 3, 9, 0, 352], [5, 1, 19, 96, 128], [0, 5, 15, 320, 352],
                         [2, 3, 25, 64, 288]], np.int64)
    row_begin, row_end = 4, 71
    covered = covered_rows(segments, rows, row_begin, row_end)
    for m in (1, 2, 3, 4, 5, 8, 12, 13, 16, 17, 33, 64):
        x = (rng.standard_normal((m, cols)) * rng.choice([1e-3, 1.0, 50.0], size=(m, 1))).astype(BF16)
        out = np.full((rows, m), np.nan, np.float32)
        out[covered] = rng.standard_normal((covered.sum(), m))
        start = out.copy()
        kernels.matmul_segments(qm, segments, x, out, isa=isa, row_begin=row_begin, row_end=row_end)
        assert np.all(np.isnan(out[~covered])), "rows outside the segments or the row range were written"
        expected = start.astype(np.float64)
        for row0, stride, nrows, k0, k1 in segments:
            rs = np.arange(row0, row0 + stride * nrows, stride)
            rs = rs[(rs >= row_begin) & (rs < row_end)]
            expected[rs] += reference_matmul(w64, x, rs, k0, k1)
        err = np.abs(out[covered] - expected[covered]).max() / np.abs(expected[covered]).max()
        assert err < 1e-5, (m, err)
        ref_out = start.copy()
        kernels.matmul_segments(qm, segments, x, ref_out, isa="ref", row_begin=row_begin, row_end=row_end)
        np.testing.assert_array_equal(out[covered], ref_out[covered], err_msg=f"m={m}")


def test_every_isa_has_mxfp4_kernels_where_it_has_int4_ones():
    assert kernels.available_isas("mxfp4") == kernels.available_isas("int4")
    assert ISAS == kernels.tested_isas("int4")


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_matmul_segments_on_odd_segments_and_token_counts(rng, isa):
    """Strided segments that start and end on odd 32-column groups (the half steps of
    kernels that read 64 columns at a time), a thread's row range cutting them, and token
    counts across every kernel's switches (avx512: pairs to 3, row lanes to 16 in two
    passes, lanes from 17; AMX: tiles of 16 and 32): against the float64 model, and equal
    to ref bit for bit."""
    qm = random_mxfp4(rng, 77, 11 * GROUP)
    check_odd_segments(rng, qm, dequantized(qm), isa)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("m", [1, 4, 16, 40])
def test_e8m0_scales_at_the_ends_of_their_range(rng, isa, m):
    """Scale bytes 0 (2^-127: the kernels' 2^-128 is an fp32 subnormal, which the SIMD
    decoders build on their own) and 1 against tokens near bf16's largest values, 254
    (2^127) against tiny tokens, and codes +-6 (12 in the integer codebook) against tokens
    at +-127: every product normal in fp32, so the result must match the float64 model."""
    rows, cols = 24, 4 * GROUP
    codes = np.where(rng.random((rows, cols)) < 0.5, 7, 15).astype(np.uint8)  # +6 and -6
    codes[:, ::3] = rng.integers(0, 16, codes[:, ::3].shape)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    low, high = rows // 2, rows // 2
    scale_bytes = np.concatenate([rng.choice(np.array([0, 1, 2], np.uint8), (low, cols // GROUP)),
                                  rng.choice(np.array([252, 253, 254], np.uint8), (high, cols // GROUP))])
    qm = quant.QuantizedMatrix("mxfp4", GROUP, packed, scale_bytes.view(E8M0))
    w64 = dequantized(qm)
    for magnitude, rs in ((1e30, np.arange(low)), (1e-30, np.arange(low, rows))):
        x = (rng.standard_normal((m, cols)) * magnitude).astype(BF16)
        x[0] = -magnitude  # one token's every value at -127 after quantization
        out = np.zeros((rows, m), np.float32)
        segments = np.array([[rs[0], 1, len(rs), 0, cols]], np.int64)
        kernels.matmul_segments(qm, segments, x, out, isa=isa)
        expected = reference_matmul(w64, x, rs, 0, cols)
        assert np.all(np.isfinite(expected)) and np.abs(expected).max() > 1e-20
        err = np.abs(out[rs] - expected).max() / np.abs(expected).max()
        assert err < 1e-5, (magnitude, err)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("m", [3, 4, 8])
def test_largest_codes_against_the_largest_tokens(rng, isa, m):
    """Codes +6 and -6 in runs (integer 12 and -12, the codebook's largest) against tokens
    whose every value is +127 or -127: the largest sums each kernel holds, among them
    avx2's group-32 sums in int16 (up to 8 x 24 x 127 = 24384 after their first
    reduction level, in blocks of 4 tokens; 3 tokens as 2 + 1): equal to the float64
    model and to ref bit for bit."""
    rows, cols = 16, 4 * GROUP
    codes = np.full((rows, cols), 7, np.uint8)  # +6
    codes[rows // 2:] = 15  # -6
    codes[1, GROUP:2 * GROUP] = rng.integers(0, 16, GROUP)  # one group of random codes
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale_bytes = rng.integers(120, 130, (rows, cols // GROUP), dtype=np.uint8)
    qm = quant.QuantizedMatrix("mxfp4", GROUP, packed, scale_bytes.view(E8M0))
    x = rng.standard_normal((m, cols)).astype(BF16)
    x[0], x[1] = 1.0, -1.0  # every value +127, every value -127
    x[m - 1] = np.where(np.arange(cols) < 2 * GROUP, 1.0, -1.0)
    segments = np.array([[0, 1, rows, 0, cols]], np.int64)
    start = rng.standard_normal((rows, m)).astype(np.float32)  # matmul_segments adds to out
    out = start.copy()
    kernels.matmul_segments(qm, segments, x, out, isa=isa)
    expected = start + reference_matmul(dequantized(qm), x, np.arange(rows), 0, cols)
    err = np.abs(out - expected).max() / np.abs(expected).max()
    assert err < 1e-5, err
    ref_out = start.copy()
    kernels.matmul_segments(qm, segments, x, ref_out, isa="ref")
    np.testing.assert_array_equal(out, ref_out)


def ffn_model(x, experts64, index):
    """float64 FFN of the weights given (w64 of gate, up, down) on the kernels' token rule:
    tokens quantized for gate / up, silu(g) * u in fp32 quantized again for down."""
    gate, up, down = experts64
    xs = x[index]
    g = reference_matmul(gate, xs, np.arange(gate.shape[0]), 0, gate.shape[1]).T
    u = reference_matmul(up, xs, np.arange(up.shape[0]), 0, up.shape[1]).T
    act = (g / (1 + np.exp(-g)) * u).astype(np.float32)
    return reference_matmul(down, act, np.arange(down.shape[0]), 0, down.shape[1]).T


@pytest.mark.parametrize("isa", [None, *ISAS])
@pytest.mark.parametrize(("threads", "m"), [(1, 5), (2, 1), (2, 17)])
def test_expert_ffn_matches_the_float64_model(rng, isa, threads, m):
    hidden, inter = 256, 192
    qms = [random_mxfp4(rng, r, c, exponents=(118, 124)) for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
    x = rng.standard_normal((9, hidden)).astype(BF16)
    index = rng.integers(0, len(x), m)
    out = np.full((m, hidden), np.nan, np.float32)
    kernels.expert_ffn(x, *qms, token_index=index, out=out, threads=threads, isa=isa)
    expected = ffn_model(x, [dequantized(qm) for qm in qms], index)
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < FFN_BOUND
    # the ISAs whose epilogues are the same code: avx2 uses ref's silu; AMX the AVX-512 one
    twin = {"avx2": "ref", "avx2_emulated": "ref",
            "amx_model": next((name for name in ("avx512", "avx512_emulated") if name in ISAS), None)}
    twin["amx"] = twin["amx_model"]
    if twin.get(isa):
        twin_out = np.full_like(out, np.nan)
        kernels.expert_ffn(x, *qms, token_index=index, out=twin_out, threads=threads, isa=twin[isa])
        np.testing.assert_array_equal(out, twin_out)


def test_mxfp4_operands_get_clear_errors(rng):
    qm = random_mxfp4(rng, 32, 128)
    x = rng.standard_normal((2, 128)).astype(BF16).view(np.uint16)
    out = np.zeros((32, 2), np.float32)
    seg = np.array([[0, 1, 32, 0, 128]], np.int64)
    call = lambda w, s: _native.matmul_segments("ref", w, seg, x, out, scales=s)  # noqa: E731
    scales = qm.scales.copy()
    scales.view(np.uint8)[3, 1] = 0xFF  # NaN in the OCP spec
    with pytest.raises(ValueError, match="weight_scales: entry 13 is not finite"):
        call(qm.q, scales)
    with pytest.raises(ValueError, match="e8m0 scales go with mxfp4 weights .*, not int8"):
        call(qm.q.view(np.int8), qm.scales)
    with pytest.raises(ValueError, match=r"group 64 .* is not one of 32 \(mxfp4's block\)"):
        call(qm.q, qm.scales[:, :2].copy())
    with pytest.raises(ValueError, match="expected float32, float16, bfloat16 or .mxfp4. float8_e8m0fnu"):
        call(qm.q, qm.scales.view(np.uint8))
    assert np.all(out == 0)

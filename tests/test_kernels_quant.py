"""Integer expert weights (int8, int4; docs/quantization.md) through every ISA that has
kernels for them, against independent references of the same quantized operands: exact
integer sums, then the weight and token scales."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numa_moe import _native, quant
from numa_moe.layer import kernels
from numa_moe.layer.moe_layer import MoELayer

BF16 = np.dtype(ml_dtypes.bfloat16)
FORMATS = ("int8", "int4")
# Every (format, ISA) pair the tests run here (kernels.tested_isas).
FORMAT_ISAS = [(fmt, isa) for fmt in FORMATS for isa in kernels.tested_isas(fmt)]
# FFN against ffn_reference, which computes g and u in float64 where the kernels sum in
# fp32: typically 1e-7 apart, but an activation on a rounding edge of the down
# projection's token quantization lands one int8 step apart now and then, about 2e-4 of
# the output each (measured: 1 call in 300 at 17 tokens; once 1.1e-3, several steps at
# once). A wrong block, scale or tile is off by 1e-2 and more.
FFN_BOUND = 3e-3


def quantize_tokens(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The token rule, restated: per token and block of the weights' group, s = amax / 127
    (fp32), q = round-half-even(x / s) clipped to [-127, 127] (0 for an all-zero block); a
    block holding a NaN or an infinity has s = NaN and q = 0."""
    x = x.astype(np.float32)
    m, k = x.shape
    blocks = x.reshape(m, k // block, block)
    finite = np.isfinite(blocks).all(axis=2)
    blocks = np.where(finite[:, :, None], blocks, np.float32(0))
    s = np.where(finite, np.abs(blocks).max(axis=2) / np.float32(127), np.float32(np.nan)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1))[:, :, None]
    q = np.where(s[:, :, None] > 0, np.clip(np.rint(blocks / safe), -127, 127), 0).astype(np.int64)
    return q.reshape(m, k), s


def reference_matmul(qm, x_q, x_s, rows, k0, k1) -> np.ndarray:
    """float64 [len(rows), m]: sum over groups of int dot * s_w * s_x."""
    w_q = quant.values(qm).astype(np.int64)
    w_s = qm.scales.astype(np.float64)
    g = qm.group
    out = np.zeros((len(rows), x_q.shape[0]))
    for c0 in range(k0, k1, g):
        dot = w_q[rows, c0:c0 + g] @ x_q[:, c0:c0 + g].T
        out += dot * w_s[rows, c0 // g][:, None] * x_s[:, c0 // g][None, :].astype(np.float64)
    return out


def check_whole_matrix(rng, qm, x, isa):
    """matmul_segments over the whole matrix on `isa`, added to random values already in
    out: against the float64 reference within fp32 rounding, and equal to ref bit for bit."""
    rows, cols = qm.scales.shape[0], x.shape[1]
    segments = np.array([[0, 1, rows, 0, cols]], np.int64)
    x_q, x_s = quantize_tokens(x.astype(np.float32), qm.group)
    expected = reference_matmul(qm, x_q, x_s, np.arange(rows), 0, cols)
    # values of the results' own size, so that adding to them rounds no worse than the sums
    start = (rng.standard_normal(expected.shape) * np.abs(expected).max()).astype(np.float32)
    out, ref_out = start.copy(), start.copy()
    kernels.matmul_segments(qm, segments, x, out, isa=isa)
    kernels.matmul_segments(qm, segments, x, ref_out, isa="ref")
    assert np.abs(out - start - expected).max() / np.abs(expected).max() < 1e-5
    np.testing.assert_array_equal(out, ref_out)


def covered_rows(segments, rows, row_begin=0, row_end=None) -> np.ndarray:
    """bool [rows]: the rows of the segments inside [row_begin, row_end), the rows a
    matmul_segments call may write."""
    covered = np.zeros(rows, bool)
    for row0, stride, nrows, _, _ in segments:
        covered[row0:row0 + stride * nrows:stride] = True
    covered[:row_begin] = False
    if row_end is not None:
        covered[row_end:] = False
    return covered


def random_qm(rng, rows, cols, fmt, group, scale_dtype="fp16"):
    w = rng.standard_normal((rows, cols)).astype(np.float32) * cols ** -0.5
    return w, quant.quantize(w, fmt, group, scale_dtype)


@pytest.mark.parametrize(("fmt", "isa"), FORMAT_ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 14, 15, 16, 17, 31, 32, 33, 64, 100, 256])
def test_matmul_segments_matches_the_integer_reference(rng, fmt, isa, m):
    rows, cols, group = 40, 256, 64
    _, qm = random_qm(rng, rows, cols, fmt, group, scale_dtype=str(rng.choice(sorted(quant.scale_dtypes_for(fmt)))))
    x = rng.standard_normal((m, cols)).astype(BF16)
    x[0, :group] = 0  # an all-zero block
    segments = np.array([[1, 3, 12, 64, 192], [0, 2, 20, 0, 64], [2, 5, 7, 192, 256]], np.int64)
    out = np.full((rows, m), np.nan, np.float32)
    covered = covered_rows(segments, rows)
    out[covered] = 0
    kernels.matmul_segments(qm, segments, x, out, isa=isa)
    x_q, x_s = quantize_tokens(x.astype(np.float32), group)
    expected = np.zeros((rows, m))
    for row0, stride, nrows, k0, k1 in segments:
        rs = np.arange(row0, row0 + stride * nrows, stride)
        expected[rs] += reference_matmul(qm, x_q, x_s, rs, k0, k1)
    assert np.all(np.isnan(out[~covered])), "rows outside the segments were written"
    err = np.abs(out[covered] - expected[covered]).max() / np.abs(expected[covered]).max()
    assert err < 1e-5, err


@pytest.mark.parametrize(("fmt", "isa"), FORMAT_ISAS)
@pytest.mark.parametrize("scale_dtype", sorted(quant.scale_dtypes_for("int8")))
@pytest.mark.parametrize("group", [32, 64, 128])
def test_matmul_segments_odd_segments_scales_and_groups(rng, fmt, isa, scale_dtype, group):
    """Odd row starts and strides, segments that start and end inside rows (on the group
    grid), a thread's row range cutting segments, many token counts (avx512: both sides of
    the row lanes' 5, 12 (int8) and 16 (int4, in two token passes) and of the lane
    kernel's 16-token lane groups, 16-row row-lane blocks cut; AMX: row and token tiles of
    16 and 32 cut, more than 16 groups per segment, and int8 at group 32 in passes of 8
    token tiles and a short last one). The avx512 and AMX kernels add the
    same fp32 terms in the same order as ref: equal bit for bit."""
    rows, cols = 77, 640
    _, qm = random_qm(rng, rows, cols, fmt, group, scale_dtype)
    units = np.array([[3, 7, 10, 1, 4], [1, 3, 9, 0, 5], [5, 1, 19, 1, 2], [0, 5, 15, 4, 5], [2, 3, 25, 1, 4]])
    segments = (units * np.array([1, 1, 1, 128, 128])).astype(np.int64)  # 5 x 128 columns
    segments[3, 3] = cols - group  # a last segment of one group
    row_begin, row_end = 4, 71
    covered = covered_rows(segments, rows, row_begin, row_end)
    for m in sorted({1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17, 31, 33, int(rng.integers(10, 64)), 64, 130}):
        x = (rng.standard_normal((m, cols)) * rng.choice([1e-3, 1.0, 50.0], size=(m, 1))).astype(BF16)
        out = np.full((rows, m), np.nan, np.float32)
        out[covered] = rng.standard_normal((covered.sum(), m))
        start = out.copy()
        kernels.matmul_segments(qm, segments, x, out, isa=isa, row_begin=row_begin, row_end=row_end)
        assert np.all(np.isnan(out[~covered])), "rows outside the segments or the row range were written"
        x_q, x_s = quantize_tokens(x.astype(np.float32), group)
        expected = start[covered].astype(np.float64)
        for row0, stride, nrows, k0, k1 in segments:
            rs = np.arange(row0, row0 + stride * nrows, stride)
            rs = rs[(rs >= row_begin) & (rs < row_end)]
            expected[np.searchsorted(np.flatnonzero(covered), rs)] += reference_matmul(qm, x_q, x_s, rs, k0, k1)
        err = np.abs(out[covered] - expected).max() / np.abs(expected).max()
        assert err < 1e-5, (m, err)
        if isa != "ref":
            ref_out = start.copy()
            kernels.matmul_segments(qm, segments, x, ref_out, isa="ref", row_begin=row_begin, row_end=row_end)
            np.testing.assert_array_equal(out[covered], ref_out[covered], err_msg=f"m={m}")


@pytest.mark.parametrize(("fmt", "isa"), FORMAT_ISAS)
@pytest.mark.parametrize("group", [32, 64])
def test_matmul_segments_on_odd_group_edges(rng, fmt, isa, group):
    """k an odd multiple of the group and segments that start and end on odd groups: the
    edges of kernels that step 64 or 128 columns at a time (avx2 int4 reads each 64
    columns' even, then odd token values, and k's last 32 columns as 16 + 16; the avx512
    pairs read each 128 columns' even, then odd ones, and a block cut by a segment or by k
    with masks), against the float64 reference and equal to ref bit for bit."""
    rows, cols = 21, 7 * group
    _, qm = random_qm(rng, rows, cols, fmt, group, scale_dtype=str(rng.choice(sorted(quant.scale_dtypes_for(fmt)))))
    units = np.array([[0, 1, 7, 0, 3], [0, 1, 7, 3, 7], [7, 1, 7, 1, 5], [7, 1, 7, 0, 1],
                      [7, 1, 7, 5, 7], [14, 1, 7, 0, 7]], np.int64)
    segments = units * np.array([1, 1, 1, group, group])
    for m in (1, 2, 3, 4, 5, 8, 9):
        x = rng.standard_normal((m, cols)).astype(BF16)
        start = rng.standard_normal((rows, m)).astype(np.float32)
        out, ref_out = start.copy(), start.copy()
        kernels.matmul_segments(qm, segments, x, out, isa=isa)
        kernels.matmul_segments(qm, segments, x, ref_out, isa="ref")
        x_q, x_s = quantize_tokens(x.astype(np.float32), group)
        expected = start.astype(np.float64)
        for row0, stride, nrows, k0, k1 in segments:
            rs = np.arange(row0, row0 + stride * nrows, stride)
            expected[rs] += reference_matmul(qm, x_q, x_s, rs, k0, k1)
        assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-5, m
        np.testing.assert_array_equal(out, ref_out, err_msg=f"m={m}")


@pytest.mark.parametrize(("fmt", "isa"), FORMAT_ISAS)
def test_matmul_segments_long_rows(rng, fmt, isa):
    """Segment spans over 4 KiB of weights a row (Mixtral's and DeepSeek-V3's shapes): the
    AMX kernel requests no lines ahead for them and, at <= 16 tokens, takes 16-row blocks
    (docs/kernels.md); strided segments of such rows, a thread's row range, token counts
    on both sides of 16 and 32. Equal to ref bit for bit, and to the float64 sums."""
    rows, group = 41, 128
    cols = 4224 if fmt == "int8" else 8448  # 4224 bytes a row either way
    _, qm = random_qm(rng, rows, cols, fmt, group)
    segments = np.array([[0, 2, 21, 0, cols], [1, 2, 20, 0, 2 * group], [1, 2, 20, 2 * group, cols]], np.int64)
    row_begin, row_end = 3, 40
    covered = np.zeros(rows, bool)
    covered[row_begin:row_end] = True
    for m in (1, 7, 16, 17, 33):
        x = rng.standard_normal((m, cols)).astype(BF16)
        start = rng.standard_normal((rows, m)).astype(np.float32)
        out, ref_out = start.copy(), start.copy()
        out[~covered] = ref_out[~covered] = np.nan
        kernels.matmul_segments(qm, segments, x, out, isa=isa, row_begin=row_begin, row_end=row_end)
        kernels.matmul_segments(qm, segments, x, ref_out, isa="ref", row_begin=row_begin, row_end=row_end)
        assert np.all(np.isnan(out[~covered])), "rows outside the thread's range were written"
        x_q, x_s = quantize_tokens(x.astype(np.float32), group)
        rs = np.arange(row_begin, row_end)
        expected = start[rs].astype(np.float64) + reference_matmul(qm, x_q, x_s, rs, 0, cols)
        assert np.abs(out[rs] - expected).max() / np.abs(expected).max() < 1e-5, m
        np.testing.assert_array_equal(out[covered], ref_out[covered], err_msg=f"m={m}")


@pytest.mark.parametrize(("fmt", "isa"), FORMAT_ISAS)
def test_matmul_segments_with_subnormal_fp16_scales(rng, fmt, isa):
    """Tiny weights: fp16 scales below 2^-14 are subnormal; kernels that convert fp16 with
    integer operations (avx2) must take them exactly, as ref does."""
    rows, cols, group = 24, 256, 32
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 3e-5  # int4: amax / 7 stays below 2^-14 = 6.1e-5
    qm = quant.quantize(w, fmt, group, "fp16")
    assert np.all(np.abs(qm.scales) < np.float16(2.0 ** -14)), "the scales must be fp16 subnormals"
    x = rng.standard_normal((5, cols)).astype(BF16)
    check_whole_matrix(rng, qm, x, isa)


@pytest.mark.parametrize(("fmt", "isa"), FORMAT_ISAS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_token_quantization_rounds_halves_as_the_reference(rng, fmt, isa, group):
    """Tokens whose x / s lies within 2^-10 of a half-integer, every such bf16 value for
    a few block maxima: 127 (s = 1: exact ties, to even), 100, and maxima in [1, 2) for
    which x * (1 / s) rounds to another integer than x / s for some x (a reciprocal
    shortcut would differ there). Every kernel's gather (each quantizes the tokens itself)
    must give ref's bytes: outputs equal bit for bit, and to the float64 sums of the
    restated token rule."""
    every_bf16 = np.arange(0, 0x7F80, dtype=np.uint16).view(BF16).astype(np.float32)
    every_bf16 = np.concatenate([every_bf16, -every_bf16])

    def near_halves(amax):
        s = np.float32(amax) / np.float32(127)
        x = every_bf16[np.abs(every_bf16) <= amax]
        frac = np.abs(x / s) % 1
        return x[np.abs(frac - 0.5) < 2.0 ** -10], s

    shortcut_differs = []
    for amax in np.arange(0x3F80, 0x4000, dtype=np.uint16).view(BF16).astype(np.float32):
        x, s = near_halves(amax)
        if np.any(np.rint(x / s) != np.rint(x * (np.float32(1) / s))):
            shortcut_differs.append(amax)
    assert len(shortcut_differs) >= 4, "the search must find maxima where the shortcut differs"
    blocks = []
    for amax in [127.0, 100.0, *shortcut_differs[:4]]:
        x, _ = near_halves(amax)
        rng.shuffle(x)
        for i in range(0, x.size, group - 1):
            chunk = x[i:i + group - 1]
            blocks.append(np.concatenate([[amax], chunk, np.zeros(group - 1 - chunk.size)]))
    cols = 4 * group
    tokens = np.concatenate(blocks)[: len(blocks) * group // cols * cols].reshape(-1, cols)
    _, qm = random_qm(rng, 16, cols, fmt, group)
    for m0 in range(0, tokens.shape[0], 37):  # several token counts, each through the gather
        check_whole_matrix(rng, qm, tokens[m0:m0 + 37].astype(BF16), isa)


@pytest.mark.parametrize("isa", kernels.tested_isas("int8"))
def test_int8_weights_at_minus_128(rng, isa):
    """quant.quantize writes [-127, 127], but an imported int8 block may hold -128: every
    kernel takes the full int8 range exactly (avx2's |w| * sign(x, w) pairs reach
    2 * 128 * 127 = 32512, still below the int16 limit; tokens at +-127 make the largest)."""
    rows, cols, group, m = 24, 256, 64, 6
    q = rng.integers(-128, 128, size=(rows, cols)).astype(np.int8)
    q[:, ::2] = -128  # every pair of products at its extreme
    scales = (rng.random((rows, cols // group)) + 0.5).astype(np.float16)
    qm = quant.QuantizedMatrix("int8", group, q, scales)
    x = rng.standard_normal((m, cols)).astype(BF16)
    x[0] = np.where(np.arange(cols) % 2 == 0, -1.0, 1.0)  # token 0: every value +-127
    check_whole_matrix(rng, qm, x, isa)


@pytest.mark.parametrize("isa", kernels.tested_isas("int4"))
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [7, 17])
def test_int4_weights_at_their_extremes(rng, isa, group, m):
    """Nibbles at -8 and 7 against tokens at +-127: the largest dots of every kernel's int4
    unpacking (AMX at groups of 128 multiplies each nibble by 16 and shifts the dots back;
    avx2 at group 32 sums 4-token blocks' first reduction level in int16, and takes 7 tokens
    as 4 + 2 + 1)."""
    rows, cols = 40, 256
    q = np.where(rng.random((rows, cols)) < 0.5, -8, 7).astype(np.int8)
    q[:8] = -8  # rows whose dots reach 8 * 127 * group
    scales = (rng.random((rows, cols // group)) + 0.5).astype(np.float16)
    qm = quant.QuantizedMatrix("int4", group, quant.pack_int4(q), scales)
    x = rng.standard_normal((m, cols)).astype(BF16)
    x[0] = -1.0  # token 0: every value -127
    x[1] = np.where(np.arange(cols) % 3 == 0, 1.0, -1.0)
    check_whole_matrix(rng, qm, x, isa)


def ffn_reference(x, qms, index):
    """float64 FFN on the same quantized operands: tokens quantized for gate/up, silu(g) * u
    (fp32, as the kernels compute it) quantized again for down."""
    gate, up, down = qms
    x_q, x_s = quantize_tokens(x[index].astype(np.float32), gate.group)
    rows_i = np.arange(gate.shape[0])
    g = reference_matmul(gate, x_q, x_s, rows_i, 0, gate.shape[1]).T
    u = reference_matmul(up, x_q, x_s, rows_i, 0, up.shape[1]).T
    act = (g / (1 + np.exp(-g)) * u).astype(np.float32)
    a_q, a_s = quantize_tokens(act, down.group)
    return reference_matmul(down, a_q, a_s, np.arange(down.shape[0]), 0, down.shape[1]).T


@pytest.mark.parametrize(("fmt", "isa"), [(fmt, None) for fmt in FORMATS] + FORMAT_ISAS)
@pytest.mark.parametrize(("threads", "m"), [(1, 5), (2, 5), (2, 1), (2, 17)])
@pytest.mark.parametrize(("group", "inter"), [(32, 192), (128, 384)])
def test_expert_ffn_matches_the_quantized_reference_and_the_float_model(rng, fmt, isa, threads, m, group, inter):
    """Group 128 with 2 threads: the silu rows split on whole groups (384 = 256 + 128)."""
    hidden = 256
    floats, qms = zip(*(random_qm(rng, r, c, fmt, group) for r, c in ((inter, hidden), (inter, hidden),
                                                                        (hidden, inter))))
    x = rng.standard_normal((9, hidden)).astype(BF16)
    index = np.array([3, 0, 8, 8, 1]) if m == 5 else rng.integers(0, len(x), m)
    out = np.full((len(index), hidden), np.nan, np.float32)
    kernels.expert_ffn(x, *qms, token_index=index, out=out, threads=threads, isa=isa)
    expected = ffn_reference(x, qms, index)
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < FFN_BOUND
    # and against the unquantized float model: the scheme's own error, not a kernel's
    xf = x[index].astype(np.float64)
    g, u = xf @ floats[0].T, xf @ floats[1].T
    float_out = (g / (1 + np.exp(-g)) * u) @ floats[2].T
    # over 150 seeds at m = 1 the largest was 0.025 (int8) and 0.274 (int4, group 128)
    bound = 0.04 if fmt == "int8" else 0.35
    assert np.linalg.norm(out - float_out) / np.linalg.norm(float_out) < bound
    avx512 = next((name for name in ("avx512", "avx512_emulated") if name in kernels.available_isas(fmt)), None)
    if isa in ("amx_model", "amx") and avx512:
        # the same token operand values (in another layout), the same silu and fp32 sums
        avx512_out = np.full_like(out, np.nan)
        kernels.expert_ffn(x, *qms, token_index=index, out=avx512_out, threads=threads, isa=avx512)
        np.testing.assert_array_equal(out, avx512_out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_ffn_without_an_isa_runs_what_the_layer_runs_for_its_token_count(rng, fmt, monkeypatch):
    qms = [random_qm(rng, r, c, fmt, 64)[1] for r, c in ((128, 64), (128, 64), (64, 128))]
    x = rng.standard_normal((16, 64)).astype(BF16)
    asked = []
    real = _native.expert_ffn
    monkeypatch.setattr(_native, "expert_ffn", lambda isa, *args, **kwargs: (asked.append(isa), real(isa, *args, **kwargs)))
    for m in (1, 16):
        out = np.full((m, 64), np.nan, np.float32)
        kernels.expert_ffn(x, *qms, token_index=np.arange(m), out=out)
        expected = ffn_reference(x, qms, np.arange(m))
        assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < FFN_BOUND
    assert asked == [kernels.isa_for_tokens(1, fmt), kernels.isa_for_tokens(16, fmt)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_is_the_default_for_integer_formats_where_it_runs_and_the_model_never(fmt):
    available = kernels.available_isas(fmt)
    assert "amx_model" in available or "avx2" not in kernels.available_isas(), "the model runs wherever avx2 does"
    expected = next(isa for isa in ("amx", "avx512", "avx2", "ref") if isa in available)
    assert kernels.fastest_isa(fmt) == expected
    # every ISA with bf16 kernels here has integer ones: avx2 covers CPUs without VNNI
    assert set(kernels.available_isas()) - {"avx512", "amx"} <= set(available)
    assert kernels.fastest_isa("bf16") == next(isa for isa in ("amx", "avx512", "avx2", "ref")
                                               if isa in kernels.available_isas())


# The default, and the builds the default never picks: AMX, the AMX model and the emulated ones.
LAYER_ISAS = [None] + [isa for isa in kernels.tested_isas("int8") if isa == "amx" or isa in kernels.EMULATED_ISAS]
# The per-expert rule's integer defaults (docs/kernels.md): AMX-INT8 from these token
# counts, per format and group.
AMX_MIN_TOKENS = {("int8", 32): 5, ("int8", 64): 5, ("int8", 128): 5,
                  ("int4", 32): 14, ("int4", 64): 7, ("int4", 128): 5,
                  ("mxfp4", 32): 14, ("iq4nl", 32): 14}


def default_integer_isa(fmt, m, group=64):
    """The per-expert rule, restated: AMX (where this CPU has it) from the format's and
    group's default token count, else the fastest of the others; never the model."""
    order = [isa for isa in ("amx", "avx512", "avx2", "ref") if isa in kernels.available_isas(fmt)]
    return order[1] if order[0] == "amx" and m < AMX_MIN_TOKENS[fmt, group] else order[0]


@pytest.mark.parametrize("fmt, group", sorted(AMX_MIN_TOKENS))
def test_the_amx_crossover_depends_on_format_and_group(fmt, group):
    for m in range(1, 20):
        assert kernels.isa_for_tokens(m, fmt, group) == default_integer_isa(fmt, m, group), (m, group)
    default = {"int8": 128, "int4": 128}.get(fmt, 32)
    assert kernels.isa_for_tokens(13, fmt) == default_integer_isa(fmt, 13, default)


def integer_layer(rng, fmt, n_nodes, group=64, **kwargs):
    """A 3-expert layer of random int8 / int4 experts (hidden 128, intermediate 192) on a
    virtual topology, and its experts."""
    from numa_moe.placement.segments import SegmentTable
    from numa_moe.placement.topology import Topology

    hidden, inter = 128, 192
    experts = [tuple(random_qm(rng, r, c, fmt, group)[1] for r, c in ((inter, hidden), (inter, hidden),
                                                                      (hidden, inter))) for _ in range(3)]
    topo = Topology.virtual(n_nodes)
    tables = [{kind: SegmentTable.theoretical(*qm.shape, fmt, 4096, topo.node_ids) for kind, qm in
               zip(("gate", "up", "down"), e)} for e in experts]
    return MoELayer(experts, tables, topology=topo, **kwargs), experts, tables


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_nodes", [1, 2, 3])
@pytest.mark.parametrize("isa", LAYER_ISAS)
def test_layer_with_integer_experts(rng, fmt, n_nodes, isa):
    layer, experts, tables = integer_layer(rng, fmt, n_nodes, isa=isa)
    hidden = layer.hidden
    # unforced: the per-expert rule (AMX from the format's default token count, where the
    # CPU has it; VNNI below), never the model
    assert layer.weight_format == fmt
    assert layer.isa_for_tokens(1) == (default_integer_isa(fmt, 1) if isa is None else isa)
    n_tokens = 4 if isa is None else 37  # AMX: more than a 32-token block for expert 1
    x = rng.standard_normal((n_tokens, hidden)).astype(BF16)
    ids = np.array([[0, 2], [1, 1], [2, 0], [1, 2]] + [[1, 0]] * (n_tokens - 4))
    w = rng.random((n_tokens, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, w, out_dtype="float32")
    if isa is not None:
        assert set(layer.last_stats()["expert_isa"]) == {isa}
    expected = np.zeros((n_tokens, hidden))
    for t in range(n_tokens):
        for j in range(2):  # a repeated expert counts with its summed weight: the same sum
            expected[t] += w[t, j] * ffn_reference(x, experts[ids[t, j]], [t])[0]
    assert np.linalg.norm(y - expected) / np.linalg.norm(expected) < FFN_BOUND
    if isa is not None and "avx512" in kernels.available_isas(fmt):
        # the same quantized operands and fp32 sums: equal to the avx512 layer bit for bit
        y_avx512 = MoELayer(experts, tables, topology=layer.topology, isa="avx512").forward_numpy(
            x, ids, w, out_dtype="float32")
        np.testing.assert_array_equal(y, y_avx512)


@pytest.mark.parametrize("fmt", FORMATS)
def test_integer_experts_take_amx_from_the_formats_default_token_count(rng, fmt):
    """Each expert of a step gets its kernels from its own token count: AMX-INT8 from the
    format's and group's crossover where the CPU has it, AVX-512-VNNI below; amx_min_tokens
    overrides the default; the output is the reference's either way."""
    layer, experts, _ = integer_layer(rng, fmt, 1)
    assert layer.weight_group == 64
    for m in range(1, 18):
        assert layer.isa_for_tokens(m) == default_integer_isa(fmt, m), m
        assert kernels.isa_for_tokens(m, fmt, 64) == layer.isa_for_tokens(m), m  # what bench kernels runs
    threshold = AMX_MIN_TOKENS[fmt, 64]
    n_tokens = threshold + 1  # expert 0: every token, expert 1: one, expert 2: threshold
    ids = np.array([[0, 1]] + [[0, 2]] * (n_tokens - 1))
    x = rng.standard_normal((n_tokens, layer.hidden)).astype(BF16)
    w = rng.random((n_tokens, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, w, out_dtype="float32")
    assert layer.last_stats()["expert_isa"] == [default_integer_isa(fmt, m) for m in (n_tokens, 1, threshold)]
    expected = np.array([sum(w[t, j] * ffn_reference(x, experts[ids[t, j]], [t])[0] for j in range(2))
                         for t in range(n_tokens)])
    assert np.linalg.norm(y - expected) / np.linalg.norm(expected) < FFN_BOUND
    always = integer_layer(rng, fmt, 1, amx_min_tokens=1)[0]
    assert always.isa_for_tokens(1) == kernels.fastest_isa(fmt)
    late = integer_layer(rng, fmt, 1, amx_min_tokens=100)[0]
    assert late.isa_for_tokens(99) == default_integer_isa(fmt, 1)


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_amx_min_tokens_must_be_a_positive_integer(rng, bad):
    with pytest.raises(ValueError, match="amx_min_tokens must be an integer >= 1 or None"):
        integer_layer(rng, "int8", 1, amx_min_tokens=bad)


def test_an_expert_with_two_group_sizes_is_refused(rng):
    """Tokens are quantized per group of the weights they meet, and the down projection's
    tokens come out of gate/up's epilogue: one group for all three matrices."""
    hidden, inter = 256, 128
    gate, up = (random_qm(rng, inter, hidden, "int8", 32)[1] for _ in range(2))
    down = random_qm(rng, hidden, inter, "int8", 64)[1]
    x = rng.standard_normal((2, hidden)).astype(BF16)
    out = np.full((2, hidden), np.nan, np.float32)
    with pytest.raises(ValueError, match="expert_ffn: gate, up and down must share one group, got 32, 32 and 64"):
        kernels.expert_ffn(x, gate, up, down, out=out)
    assert np.all(np.isnan(out))
    from numa_moe.placement.segments import SegmentTable
    from numa_moe.placement.topology import Topology

    topo = Topology.virtual(1)
    tables = {kind: SegmentTable.theoretical(*m.shape, "int8", 4096, topo.node_ids)
              for kind, m in zip(("gate", "up", "down"), (gate, up, down))}
    with pytest.raises(ValueError, match="expert 0: gate, up and down must share one group, got 32, 32 and 64"):
        MoELayer([(gate, up, down)], [tables], topology=topo)


def test_integer_weights_get_clear_errors(rng):
    _, qm = random_qm(rng, 32, 128, "int8", 32)
    x = rng.standard_normal((2, 128)).astype(BF16).view(np.uint16)
    out = np.zeros((32, 2), np.float32)
    seg = np.array([[0, 1, 32, 0, 128]], np.int64)
    call = lambda w, s, segments=seg: _native.matmul_segments("ref", w, segments, x, out, scales=s)  # noqa: E731
    with pytest.raises(ValueError, match="expected int8 .* or uint8"):
        call(qm.q.astype(np.int16), qm.scales)
    with pytest.raises(ValueError, match=r"weight_scales: shape \(32, 3\) does not give a group"):
        call(qm.q, qm.scales[:, :3].copy())
    with pytest.raises(ValueError, match="group 16 .* is not one of 32, 64, 128"):
        call(qm.q, np.ones((32, 8), np.float16))
    for bad, word in ((0.0, "zero"), (np.nan, "not finite"), (np.inf, "not finite")):
        scales = qm.scales.copy()
        scales[3, 1] = bad
        with pytest.raises(ValueError, match=f"weight_scales: entry 13 is {word}"):
            call(qm.q, scales)
    with pytest.raises(ValueError, match="cuts a 32-column block"):
        call(qm.q, qm.scales, np.array([[0, 1, 32, 0, 48]], np.int64))
    for isa in sorted({"ref", "avx2", "avx512", "amx_model", "amx"} - set(kernels.available_isas("int8"))):
        with pytest.raises(ValueError, match=f"isa '{isa}' is not available for int8 weights: .+"):
            _native.matmul_segments(isa, qm.q, seg, x, out, scales=qm.scales)


@pytest.mark.parametrize("fmt", ["int8", "int4-affine"])
@pytest.mark.parametrize("scale_dtype", ["fp32", "fp16", "bf16"])
def test_the_first_bad_scale_is_named_wherever_it_is(rng, fmt, scale_dtype):
    """Every scale is checked on each call, then the first bad one named by its flat entry:
    one at a random entry, at the last one (past the scan's vector steps) and the first of
    two, for each float scale dtype; zero is bad where the format has no minimums."""
    rows, cols = 40, 37 * 32
    qm = quant.quantize(rng.standard_normal((rows, cols)).astype(np.float32), fmt, 32, scale_dtype)
    x = rng.standard_normal((1, cols)).astype(BF16).view(np.uint16)
    out = np.zeros((rows, 1), np.float32)
    seg = np.array([[0, 1, rows, 0, cols]], np.int64)
    call = lambda s: _native.matmul_segments("ref", qm.q, seg, x, out, scales=s, format=fmt)  # noqa: E731
    size = qm.scales.size
    bad_values = [np.nan, np.inf, -np.inf] + ([0.0] if fmt == "int8" else [])
    for entries in ([int(rng.integers(size))], [size - 1], sorted(rng.choice(size, 2, replace=False).tolist())):
        scales = qm.scales.copy()
        for entry in entries:
            scales.reshape(-1)[entry] = bad_values[int(rng.integers(len(bad_values)))]
        with pytest.raises(ValueError, match=f"weight_scales: entry {entries[0]} is "):
            call(scales)
    if fmt != "int8":  # a zero scale or minimum is valid there
        scales = qm.scales.copy()
        scales.reshape(-1)[rng.choice(size, 5, replace=False)] = 0
        call(scales)



@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_nodes", [1, 2])
def test_layer_from_a_quantized_store(tmp_path, rng, fmt, n_nodes):
    from numa_moe.layer.store import ExpertStore
    from numa_moe.checkpoints.synthetic import make_checkpoint
    from numa_moe.placement.topology import Topology

    path = make_checkpoint(tmp_path / "ckpt", like="qwen3-30b-a3b", layers=1, experts=3, hidden_size=128,
                           intermediate_size=96, progress=False, weight_format=fmt, group=32)
    store = ExpertStore.load(path, nodes=1, progress=False)
    assert store.weight_format == fmt
    layer = MoELayer.from_store(store, store.layers[0], topology=Topology.virtual(n_nodes))
    assert layer.weight_format == fmt
    x = rng.standard_normal((3, 128)).astype(BF16)
    ids = np.array([[0, 2], [1, 0], [2, 1]])
    w = rng.random((3, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, w, out_dtype="float32")
    experts = [tuple(quant.QuantizedMatrix(fmt, 32, v, s) for v, s in
                     zip(store.expert(store.layers[0], e), store.expert_scales(store.layers[0], e)))
               for e in range(3)]
    expected = np.array([sum(w[t, j] * ffn_reference(x, experts[ids[t, j]], [t])[0] for j in range(2))
                         for t in range(3)])
    assert np.linalg.norm(y - expected) / np.linalg.norm(expected) < FFN_BOUND


AMX_RESIDENT_MIN_TOKENS = 32  # amx_quant.cpp's kResidentMinTokens (int8 at group 32)


def tile_rule_counts(rows, m, cols, group, fmt):
    """The tile instructions of the AMX integer tile rule (docs/kernels.md) for one segment
    of rows x cols, and the most tile configurations it loads.
    - int8 at group 32 from AMX_RESIDENT_MIN_TOKENS tokens: row blocks of 16, C tiles of 16
      tokens (the last m % 16 in a tile of their own); per tile and group two loads, one
      tdpbssd, one tilezero and one tilestored; per row block one configuration, two
      with a short last tile.
    - else: row blocks of 32 and token blocks of 32, A tiles a = ceil(rows / 16), B tiles
      b = ceil(tokens / 16); per K-column block (K = min(group, 64)) a + b loads and a * b
      tdpbssd, per group a * b tilezero and tilestored; A streamed (tileloadt1) when
      m <= 32 and the weights are int8 (int4 loads from its staging buffer); one
      configuration per token block shape."""
    n_groups = cols // group
    counts = dict(loads=0, stream_loads=0, stores=0, zeros=0, dpbssd=0)
    if fmt == "int8" and group == 32 and m >= AMX_RESIDENT_MIN_TOKENS:
        row_blocks = -(-rows // 16)
        tiles = -(-m // 16)
        counts.update(loads=2 * row_blocks * tiles * n_groups, stores=row_blocks * tiles * n_groups,
                      zeros=row_blocks * tiles * n_groups, dpbssd=row_blocks * tiles * n_groups)
        return counts, row_blocks * (2 if m % 16 else 1)
    n_blocks = cols // min(group, 64)
    for block_rows in [32] * (rows // 32) + ([rows % 32] if rows % 32 else []):
        for t0 in range(0, m, 32):
            a, b = -(-block_rows // 16), -(-min(32, m - t0) // 16)
            counts["loads"] += n_blocks * (a + b)
            counts["stream_loads"] += n_blocks * a if (m <= 32 and fmt == "int8") else 0
            counts["dpbssd"] += n_blocks * a * b
            for key in ("stores", "zeros"):
                counts[key] += n_groups * a * b
    return counts, 2 * (-(-m // 32))


@pytest.mark.skipif("amx_model" not in kernels.available_isas("int8"), reason="the AMX model needs AVX2 + FMA here")
@pytest.mark.skipif(not hasattr(_native, "testing"), reason="the extension was built without test hooks")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m", [1, 16, 17, 40, 160])
def test_amx_integer_kernel_does_the_tile_work_of_its_rule(rng, fmt, group, m):
    """Counted on the AMX model: one tdpbssd per C tile and K-column block (K = 64, or 32
    for groups of 32), one C tile store per group, no tile work beyond the rule (an extra or
    missing pass over a block would still pass the value tests only if it added zeros)."""
    rows, cols = 48, 256
    _, qm = random_qm(rng, rows, cols, fmt, group)
    x = rng.standard_normal((m, cols)).astype(BF16)
    out = np.zeros((rows, m), np.float32)
    segments = np.array([[0, 1, rows, 0, cols]], np.int64)
    _native.testing.amx_model_counts(reset=True)
    kernels.matmul_segments(qm, segments, x, out, isa="amx_model")
    counts = _native.testing.amx_model_counts(reset=True)
    expected, most_configs = tile_rule_counts(rows, m, cols, group, fmt)
    assert {key: counts[key] for key in expected} == expected
    assert counts["dpbf16ps"] == 0 and 1 <= counts["loadconfig"] <= most_configs
    x_q, x_s = quantize_tokens(x.astype(np.float32), group)
    expected_out = reference_matmul(qm, x_q, x_s, np.arange(rows), 0, cols)
    assert np.abs(out - expected_out).max() <= 1e-5 * np.abs(expected_out).max()

"""Every available kernel ISA against float64 numpy references of the same bf16 inputs.

Error bounds (relative Frobenius norm, ||got - ref||_F / ||ref||_F):
* matmul_segments: the only error is fp32 accumulation of exact bf16 x bf16 products
  (each product is exact in fp32: 8 + 8 significant bits). Summing k <= 640 terms in
  fp32 (blocked / lane-split) gives a relative error of order sqrt(k) * 2^-24 ~ 2e-6 on
  random data; 1e-5 leaves room without hiding a dropped term (one missing column of 640
  costs ~1/sqrt(640) ~ 4e-2).
* expert_ffn: the reference also rounds the activation silu(g) * u to bf16 (as the kernel
  must: it is the bf16 operand of the down projection). fp32 accumulation differences
  occasionally flip that rounding by one bf16 ulp (2^-8 relative) on single elements,
  which contributes well under 1e-3 in norm; fp32 output: bound 2e-3. bf16 output adds
  the final rounding, at most 2^-9 relative per element: bound 2e-3 + 2^-8.
Outputs are poisoned with NaN before every call, so an unwritten element fails.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numa_moe.layer import kernels

BF16 = np.dtype(ml_dtypes.bfloat16)
# Native ISAs, the AMX model, and the emulated builds of those this CPU lacks (kernels.tested_isas).
ISAS = kernels.tested_isas()
M_VALUES = (1, 2, 3, 4, 5, 8, 15, 16, 17, 24, 31, 32, 33, 40, 48, 64, 128)
MATMUL_TOL = 1e-5
FFN_TOL_F32 = 2e-3
FFN_TOL_BF16 = 2e-3 + 2.0**-8


def bf16(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(BF16)


def rel_fro(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    assert np.all(np.isfinite(got)), "non-finite values in the kernel output (unwritten or NaN)"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def ffn_reference(x, w_gate, w_up, w_down, index):
    """float64 FFN of the bf16 inputs, with the activation rounded to bf16 like the kernel."""
    xs = x.astype(np.float64)[index]
    g = xs @ w_gate.astype(np.float64).T
    u = xs @ w_up.astype(np.float64).T
    act = (g / (1.0 + np.exp(-g)) * u).astype(np.float32).astype(BF16).astype(np.float64)
    return act @ w_down.astype(np.float64).T


def random_expert(rng, hidden, inter, n_tokens):
    # Scales keep g, u and y O(1) so that the bf16 activation is in its normal range.
    x = bf16(rng.standard_normal((n_tokens, hidden)))
    w_gate = bf16(rng.standard_normal((inter, hidden)) / np.sqrt(hidden))
    w_up = bf16(rng.standard_normal((inter, hidden)) / np.sqrt(hidden))
    w_down = bf16(rng.standard_normal((hidden, inter)) / np.sqrt(inter))
    return x, w_gate, w_up, w_down


def test_isa_list_and_default():
    assert ISAS[0] == "ref"
    assert set(ISAS) <= set(kernels.ISAS)
    assert kernels.default_isa() in ISAS
    assert kernels.default_isa() != "amx_model"


def test_the_amx_model_runs_wherever_avx2_does():
    # Its AVX-512 epilogues are emulated on AVX2 (avx512_emulated.hpp), so the AMX source
    # is tested on every AVX2 CPU, for every weight format and for decode attention.
    from numa_moe.layer import attention
    if "avx2" not in ISAS:
        pytest.skip("this CPU (or OS) lacks AVX2 + FMA")
    for fmt in ("bf16", "int8", "int4"):
        assert "amx_model" in kernels.available_isas(fmt), fmt
    assert "amx_model" in attention.available_isas()


def test_default_isa_env_override(monkeypatch):
    monkeypatch.setenv("NUMA_MOE_ISA", "ref")
    assert kernels.default_isa() == "ref"
    monkeypatch.setenv("NUMA_MOE_ISA", "sse9")
    with pytest.raises(ValueError, match="sse9"):
        kernels.default_isa()


def test_forced_isa_is_the_environment_choice_or_none(monkeypatch):
    monkeypatch.delenv("NUMA_MOE_ISA", raising=False)
    assert kernels.forced_isa() is None
    monkeypatch.setenv("NUMA_MOE_ISA", "ref")
    assert kernels.forced_isa() == "ref"
    monkeypatch.setenv("NUMA_MOE_ISA", "sse9")
    with pytest.raises(ValueError, match="NUMA_MOE_ISA=sse9"):
        kernels.forced_isa()


def test_default_prefers_fastest(monkeypatch):
    monkeypatch.delenv("NUMA_MOE_ISA", raising=False)
    order = [isa for isa in ("amx", "avx512", "avx2", "ref") if isa in ISAS]
    assert kernels.default_isa() == order[0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", M_VALUES)
def test_expert_ffn_matches_reference(isa, m, rng):
    hidden, inter = 384, 640  # odd multiples of 128 (3 x 128, 5 x 128)
    x, wg, wu, wd = random_expert(rng, hidden, inter, n_tokens=m + 7)
    index = rng.choice(m + 7, size=m, replace=False)
    out = np.full((m, hidden), np.nan, dtype=np.float32)
    kernels.expert_ffn(x, wg, wu, wd, token_index=index, isa=isa, threads=2, out=out)
    assert rel_fro(out, ffn_reference(x, wg, wu, wd, index)) < FFN_TOL_F32


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("hidden,inter,m", [(96, 160, 3), (128, 32, 17), (224, 96, 33)])
def test_expert_ffn_small_shapes_bf16_out(isa, hidden, inter, m, rng):
    x, wg, wu, wd = random_expert(rng, hidden, inter, n_tokens=m)
    out = np.full((m, hidden), np.nan, dtype=BF16)
    kernels.expert_ffn(x, wg, wu, wd, isa=isa, threads=3, out=out)
    assert rel_fro(out, ffn_reference(x, wg, wu, wd, np.arange(m))) < FFN_TOL_BF16


def test_expert_ffn_torch_zero_copy_and_dtype(rng):
    torch = pytest.importorskip("torch")
    x, wg, wu, wd = random_expert(rng, 128, 96, n_tokens=5)
    as_torch = lambda a: torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)  # noqa: E731
    y = kernels.expert_ffn(as_torch(x), as_torch(wg), as_torch(wu), as_torch(wd), out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (5, 128)
    ref = ffn_reference(x, wg, wu, wd, np.arange(5))
    assert rel_fro(y.float().numpy(), ref) < FFN_TOL_BF16
    # The same FFN through torch's own bf16 F.linear lands within bf16 noise of ours.
    xt = as_torch(x)
    h = torch.nn.functional.silu(xt @ as_torch(wg).T) * (xt @ as_torch(wu).T)
    assert rel_fro((h @ as_torch(wd).T).float().numpy(), ref) < 2e-2


def test_expert_ffn_segments_split_equals_whole(rng):
    """Gate/up/down given as strided segment lists covering each matrix exactly once."""
    hidden, inter, m = 128, 96, 9
    x, wg, wu, wd = random_expert(rng, hidden, inter, n_tokens=m)
    gate = np.array([[0, 2, inter // 2, 0, 64], [0, 2, inter // 2, 64, hidden], [1, 2, inter // 2, 0, hidden]])
    down = np.array([[0, 1, 50, 0, inter], [50, 1, hidden - 50, 0, 40], [50, 1, hidden - 50, 40, inter]])
    for isa in ISAS:
        out = np.full((m, hidden), np.nan, dtype=np.float32)
        kernels.expert_ffn(x, wg, wu, wd, isa=isa, out=out, gate_segments=gate, up_segments=gate, down_segments=down)
        assert rel_fro(out, ffn_reference(x, wg, wu, wd, np.arange(m))) < FFN_TOL_F32, isa


def run_matmul(isa, weight, segments, tokens, row_begin=0, row_end=None, rng=None):
    """matmul_segments into an output whose covered rows start random and others NaN."""
    rows = weight.shape[0]
    covered = np.zeros(rows, dtype=bool)
    row_end_v = rows if row_end is None else row_end
    for row0, stride, nrows, k0, k1 in segments:
        r = row0 + stride * np.arange(nrows)
        covered[r[(r >= row_begin) & (r < row_end_v)]] = True
    m = tokens.shape[0]
    base = rng.standard_normal((rows, m)).astype(np.float32)
    out = np.where(covered[:, None], base, np.float32(np.nan)).astype(np.float32)
    kernels.matmul_segments(weight, np.asarray(segments, dtype=np.int64), tokens, out, isa=isa,
                            row_begin=row_begin, row_end=row_end)
    assert np.all(np.isnan(out[~covered])), "rows outside the segments/row range were written"
    return out, base, covered


def segment_reference(weight, segments, tokens, row_begin, row_end):
    w = weight.astype(np.float64)
    x = tokens.astype(np.float64)
    ref = np.zeros((weight.shape[0], tokens.shape[0]))
    for row0, stride, nrows, k0, k1 in segments:
        for r in row0 + stride * np.arange(nrows):
            if row_begin <= r < row_end:
                ref[r] += w[r, k0:k1] @ x[:, k0:k1].T
    return ref


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", (1, 4, 16, 17, 40))
def test_matmul_strided_segments_row_range_and_k_tails(isa, m, rng):
    rows, k = 70, 200
    weight = bf16(rng.standard_normal((rows, k)))
    tokens = bf16(rng.standard_normal((m, k)))
    # Strided classes, odd and unaligned k edges (k0 = 3, k1 = 131: split bf16 pairs,
    # tails that are not multiples of 32), a single-row segment, an empty column range.
    segments = [[0, 3, 24, 0, 3], [0, 3, 24, 3, 131], [0, 3, 24, 131, 200], [1, 3, 23, 0, 200],
                [2, 3, 22, 7, 64], [2, 3, 22, 64, 64], [5, 1, 1, 100, 101]]
    for row_begin, row_end in ((0, rows), (17, 53)):
        out, base, covered = run_matmul(isa, weight, segments, tokens, row_begin, row_end, rng)
        ref = segment_reference(weight, segments, tokens, row_begin, row_end)
        assert rel_fro(out[covered] - base[covered], ref[covered]) < MATMUL_TOL


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", (1, 4, 5, 9, 17, 40, 130))
def test_matmul_long_k_blocks(isa, m, rng):
    # k long enough that the token-lane kernels cut it into several k blocks (more than 32
    # tokens: M = 40, 130), with segment edges inside blocks and off the 32-column grid
    # (and off every column-block grid of the token-lane layouts: 2, 4, 8 columns).
    # Error bound: as MATMUL_TOL, with sqrt(2500 / 640) ~ 2x more accumulation error.
    rows, k = 29, 2500
    weight = bf16(rng.standard_normal((rows, k)))
    tokens = bf16(rng.standard_normal((m, k)))
    segments = [[0, 1, rows, 0, 1001], [0, 1, rows, 1001, 2500], [3, 2, 9, 17, 2483]]
    out, base, covered = run_matmul(isa, weight, segments, tokens, 0, rows, rng)
    ref = segment_reference(weight, segments, tokens, 0, rows)
    assert rel_fro(out[covered] - base[covered], ref[covered]) < 2 * MATMUL_TOL


@pytest.mark.parametrize("isa", ISAS)
def test_matmul_every_token_count_up_to_50_and_beyond(isa, rng):
    # Each token count selects its own register blocks and, for AVX-512, its own token
    # layout (dot product at 1-2 tokens, 4-, 8- or 16-token lanes, 1-4 token vectors per
    # block, padding tokens): sweep them all on a small matrix with split column pairs.
    # Above 50, counts whose token vectors split into unequal passes (5, 9, 10, 13, 14
    # vectors of 8 or 16 tokens) and a second token block (> 256 tokens).
    rows, k = 23, 136
    weight = bf16(rng.standard_normal((rows, k)))
    segments = [[0, 1, rows, 0, 67], [0, 1, rows, 67, 133], [1, 2, 11, 133, 136]]
    for m in [*range(1, 51), 66, 72, 80, 100, 150, 206, 222, 300]:
        tokens = bf16(rng.standard_normal((m, k)))
        out, base, covered = run_matmul(isa, weight, segments, tokens, 0, rows, rng)
        ref = segment_reference(weight, segments, tokens, 0, rows)
        assert rel_fro(out[covered] - base[covered], ref[covered]) < MATMUL_TOL, m


def test_matmul_is_an_accumulation(rng):
    weight = bf16(rng.standard_normal((40, 64)))
    tokens = bf16(rng.standard_normal((5, 64)))
    for isa in ISAS:
        out = np.zeros((40, 5), dtype=np.float32)
        seg = np.array([[0, 1, 40, 0, 64]])
        kernels.matmul_segments(weight, seg, tokens, out, isa=isa)
        kernels.matmul_segments(weight, seg, tokens, out, isa=isa)
        ref = 2 * segment_reference(weight, seg, tokens, 0, 40)
        assert rel_fro(out, ref) < MATMUL_TOL, isa


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", (2, 3, 19, 40, 64))
def test_silu_mul_pack_two_parts(isa, m, rng):
    # i_total not a multiple of 32 (nor even); m covers every AVX-512 token layout.
    inter = 96 + 7
    gate = [rng.standard_normal((inter, m)).astype(np.float32) for _ in range(2)]
    up = [rng.standard_normal((inter, m)).astype(np.float32) for _ in range(2)]
    act = kernels.silu_mul_pack(gate, up, 32, inter, isa=isa).astype(np.float64)
    g = (gate[0].astype(np.float64) + gate[1]).T
    u = (up[0].astype(np.float64) + up[1]).T
    ref = (g / (1 + np.exp(-g)) * u)[:, 32:]
    assert np.all(act[:, :32] == 0), "columns outside [i_begin, i_end) were written"
    # bf16 rounding of each element: |err| <= 2^-8 relative (plus fp32 exp error).
    np.testing.assert_allclose(act[:, 32:], ref, rtol=2.0**-8, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("m", [1, 5, 16, 21, 40])
def test_store_down_transposes_the_part_sum(isa, out_dtype, m, rng):
    hidden = 80 + 5
    parts = [rng.standard_normal((hidden, m)).astype(np.float32) for _ in range(3)]
    dtype = np.float32 if out_dtype == "float32" else ml_dtypes.bfloat16
    out0 = rng.standard_normal((m, hidden)).astype(dtype)  # what store_down must leave outside its range
    out = out0.copy()
    h_begin, h_end = 16, 77
    kernels.store_down(parts, h_begin, h_end, out, isa=isa)
    ref = sum(p.astype(np.float64) for p in parts).T[:, h_begin:h_end]
    # float32: the three-term fp32 sum; bf16: one rounding to nearest, at most 2^-8 relative
    # (half a unit of its 8-bit significand).
    rtol = 1e-6 if out_dtype == "float32" else 2.0**-8
    np.testing.assert_allclose(out[:, h_begin:h_end].astype(np.float64), ref, rtol=rtol, atol=1e-6)
    if out_dtype == "bfloat16":  # nearest even, as ml_dtypes rounds the fp32 sum
        fp32_sum = sum(parts).T[:, h_begin:h_end]
        assert np.array_equal(out[:, h_begin:h_end].view(np.uint16), fp32_sum.astype(dtype).view(np.uint16))
    untouched = np.ones(out.shape, dtype=bool)
    untouched[:, h_begin:h_end] = False
    assert np.array_equal(out[untouched].view(np.uint8), out0[untouched].view(np.uint8))


def test_store_down_names_a_wrong_output_shape(rng):
    parts = [rng.standard_normal((64, 4)).astype(np.float32)]
    with pytest.raises(ValueError, match=r"out: shape \(64, 4\), expected \(4, 64\)"):
        kernels.store_down(parts, 0, 64, np.zeros((64, 4), np.float32), isa="ref")


@pytest.mark.parametrize("isa", ISAS)
def test_combine_down_scatter_with_weights(isa, rng):
    hidden, m, n_tokens = 80 + 5, 21, 30
    parts = [rng.standard_normal((hidden, m)).astype(np.float32) for _ in range(3)]
    index = rng.choice(n_tokens, size=m, replace=False)
    weight = rng.random(m).astype(np.float32)
    y0 = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    y = y0.copy()
    h_begin, h_end = 16, 77
    kernels.combine_down(parts, h_begin, h_end, index, weight, y, isa=isa)
    ref = y0.astype(np.float64)
    ref[index, h_begin:h_end] += weight[:, None] * sum(p.astype(np.float64) for p in parts).T[:, h_begin:h_end]
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    untouched = np.ones(y.shape, dtype=bool)
    untouched[np.ix_(index, np.arange(h_begin, h_end))] = False
    assert np.array_equal(y[untouched], y0[untouched])

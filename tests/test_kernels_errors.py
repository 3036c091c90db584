"""Bad input gets a clear exception naming the problem, from Python and from the native
checks underneath it; the AMX software model faults where hardware would."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numa_moe import _bench, _native
from numa_moe.layer import kernels

BF16 = np.dtype(ml_dtypes.bfloat16)


def expert(rng, hidden=64, inter=32, tokens=4):
    x = rng.standard_normal((tokens, hidden)).astype(BF16)
    wg = rng.standard_normal((inter, hidden)).astype(BF16)
    wu = rng.standard_normal((inter, hidden)).astype(BF16)
    wd = rng.standard_normal((hidden, inter)).astype(BF16)
    return x, wg, wu, wd


def test_wrong_dtype(rng):
    x, wg, wu, wd = expert(rng)
    with pytest.raises(TypeError, match="w_gate: dtype float32"):
        kernels.expert_ffn(x, wg.astype(np.float32), wu, wd)


def test_wrong_shapes(rng):
    x, wg, wu, wd = expert(rng)
    with pytest.raises(ValueError, match="w_down: shape"):
        kernels.expert_ffn(x, wg, wu, wd.T.copy())
    with pytest.raises(ValueError, match="w_up: shape"):
        kernels.expert_ffn(x, wg, wu[:16], wd)
    with pytest.raises(ValueError, match="out: shape"):
        kernels.expert_ffn(x, wg, wu, wd, out=np.empty((3, 64), np.float32))


def test_not_contiguous(rng):
    x, wg, wu, wd = expert(rng)
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        kernels.expert_ffn(np.asfortranarray(x.view(np.uint16)), wg, wu, wd)


def test_misaligned(rng):
    raw = np.zeros(4 * 64 * 2 + 1, dtype=np.uint8)
    x = raw[1:].view(np.uint16).reshape(4, 64)  # odd address
    _, wg, wu, wd = expert(rng)
    with pytest.raises(ValueError, match="not aligned"):
        kernels.expert_ffn(x, wg, wu, wd)


def test_bad_token_index(rng):
    x, wg, wu, wd = expert(rng)
    with pytest.raises(ValueError, match="token_index"):
        kernels.expert_ffn(x, wg, wu, wd, token_index=[0, 4])


@pytest.mark.parametrize("index,dtype", [([0.5], "float64"), (np.array([1.0, 2.0], np.float32), "float32"),
                                         ([True, False], "bool"), (np.array([1 + 0j]), "complex128")])
def test_non_integer_token_index_is_refused_not_truncated(rng, index, dtype):
    x, wg, wu, wd = expert(rng)
    with pytest.raises(TypeError, match=f"token_index: expected integers, got dtype {dtype}"):
        kernels.expert_ffn(x, wg, wu, wd, token_index=index)


def test_non_integer_torch_token_index_is_refused(rng):
    torch = pytest.importorskip("torch")
    x, wg, wu, wd = expert(rng)
    for index in (torch.tensor([0.5]), torch.tensor([True]), torch.tensor([1.0], dtype=torch.bfloat16)):
        with pytest.raises(TypeError, match=f"token_index: expected integers, got dtype {index.dtype}"):
            kernels.expert_ffn(x, wg, wu, wd, token_index=index)


def test_integer_token_index_of_any_width_selects_the_same_rows(rng):
    torch = pytest.importorskip("torch")
    x, wg, wu, wd = expert(rng, tokens=6)
    rows = rng.integers(0, 6, 5)
    expected = kernels.expert_ffn(x, wg, wu, wd, token_index=rows.astype(np.int64), isa="ref", threads=1)
    for index in (rows.astype(np.uint8), rows.astype(np.int16), rows.astype(np.uint64), rows.tolist(),
                  torch.from_numpy(rows.astype(np.int32))):
        got = kernels.expert_ffn(x, wg, wu, wd, token_index=index, isa="ref", threads=1)
        np.testing.assert_array_equal(got, expected)
    assert kernels.expert_ffn(x, wg, wu, wd, token_index=[]).shape == (0, 64)


def test_combine_down_and_segments_refuse_non_integer_indices(rng):
    x, wg, wu, wd = expert(rng)
    parts = [np.zeros((64, 2), np.float32)]
    y = np.zeros((4, 64), np.float32)
    with pytest.raises(TypeError, match="token_index: expected integers, got dtype float64"):
        kernels.combine_down(parts, 0, 64, [0.0, 1.5], [1.0, 1.0], y, isa="ref")
    segments = np.array([[0, 1, 32, 0, 64]], dtype=np.float64)
    with pytest.raises(TypeError, match="gate_segments: expected integers, got dtype float64"):
        kernels.expert_ffn(x, wg, wu, wd, gate_segments=segments)


def test_bad_isa(rng):
    x, wg, wu, wd = expert(rng)
    with pytest.raises(ValueError, match="not one of"):
        kernels.expert_ffn(x, wg, wu, wd, isa="neon")
    if "amx" not in kernels.available_isas():
        with pytest.raises(ValueError, match="not available"):
            kernels.expert_ffn(x, wg, wu, wd, isa="amx")


def test_native_side_checks_segments(rng):
    weight = rng.standard_normal((8, 32)).astype(BF16).view(np.uint16)
    tokens = rng.standard_normal((2, 32)).astype(BF16).view(np.uint16)
    out = np.zeros((8, 2), np.float32)
    for bad, message in (([0, 1, 9, 0, 32], "rows outside"), ([0, 1, 8, 0, 33], "columns outside"),
                         ([0, 0, 3, 0, 32], "row_stride"), ([0, 1, -1, 0, 8], "negative nrows"),
                         # row0 + (nrows - 1) * row_stride overflows int64 to a small number
                         ([0, 2**62, 3, 0, 32], "rows outside"), ([8, 1, 1, 0, 32], "rows outside")):
        with pytest.raises(ValueError, match=message):
            _native.matmul_segments("ref", weight, np.array([bad], np.int64), tokens, out)
    with pytest.raises(ValueError, match=r"expected shape \[n, 5\]"):
        _native.matmul_segments("ref", weight, np.zeros((1, 4), np.int64), tokens, out)
    with pytest.raises(ValueError, match="out: dtype float64"):
        _native.matmul_segments("ref", weight, np.array([[0, 1, 8, 0, 32]]), tokens, np.zeros((8, 2)))


needs_model = pytest.mark.skipif("amx_model" not in kernels.available_isas(),
                                 reason="the AMX model build needs AVX2 + FMA on this CPU")


def tile_config(shapes):
    """64-byte palette-1 config from {tile: (rows, colsb)}."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb = cfg[16:48].view(np.uint16)
    for tile, (rows, cb) in shapes.items():
        cfg[48 + tile] = rows
        colsb[tile] = cb
    return cfg


@needs_model
def test_amx_model_tdpbf16ps_matches_definition(rng):
    rows, pairs, n = 5, 7, 3  # C 5 x 3, A 5 x 14 bf16, B 7 pair rows x 3 tokens
    a = rng.standard_normal((rows, 2 * pairs)).astype(BF16)
    b_plain = rng.standard_normal((2 * pairs, n)).astype(BF16)  # [k, n]
    c0 = rng.standard_normal((rows, n)).astype(np.float32)
    tiles = {name: np.zeros((16, 64), np.uint8) for name in "cab"}
    tiles["a"][:rows, : 4 * pairs] = a.view(np.uint8).reshape(rows, -1)
    b_pairs = b_plain.reshape(pairs, 2, n).transpose(0, 2, 1).reshape(pairs, 2 * n)  # B[k/2][2n + k%2]
    tiles["b"][:pairs, : 4 * n] = np.ascontiguousarray(b_pairs).view(np.uint8)
    tiles["c"][:rows, : 4 * n] = c0.view(np.uint8)
    cfg = tile_config({0: (rows, 4 * n), 1: (rows, 4 * pairs), 2: (pairs, 4 * n)})
    _native.testing.amx_model_tile_dot(cfg, False, tiles["c"], tiles["a"], tiles["b"])
    got = tiles["c"][:rows, : 4 * n].copy().view(np.float32)
    ref = c0 + a.astype(np.float64) @ b_plain.astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert not tiles["c"][rows:].any() and not tiles["c"][:, 4 * n:].any(), "store wrote outside the tile shape"


@needs_model
def test_amx_model_tdpbssd_int8(rng):
    rows, quads, n = 16, 16, 16
    a = rng.integers(-128, 128, (rows, 4 * quads), dtype=np.int8)
    b_plain = rng.integers(-128, 128, (4 * quads, n), dtype=np.int8)
    tiles = {name: np.zeros((16, 64), np.uint8) for name in "cab"}
    tiles["a"][:] = a.view(np.uint8)
    tiles["b"][:] = b_plain.reshape(quads, 4, n).transpose(0, 2, 1).reshape(quads, 4 * n).view(np.uint8)
    cfg = tile_config({0: (16, 64), 1: (16, 64), 2: (16, 64)})
    _native.testing.amx_model_tile_dot(cfg, True, tiles["c"], tiles["a"], tiles["b"])
    np.testing.assert_array_equal(tiles["c"].view(np.int32), a.astype(np.int32) @ b_plain.astype(np.int32))


@needs_model
def test_amx_model_tdpbssd_partial_tiles_accumulate_and_wrap(rng):
    """TDPBSSD as the SDM defines it, on the shapes the integer kernels configure (K = 64:
    A 64 bytes, B 16 quad rows; K = 32: A 32 bytes, B 8 quad rows; fewer rows and tokens):
    C += sum of sign-extended byte products, int32 wrapping; -128 at both operands; nothing
    outside the tile shape written."""
    for rows, quads, n in ((16, 8, 16), (5, 8, 3), (1, 8, 1), (11, 13, 7), (1, 16, 1), (7, 16, 5)):
        a = rng.integers(-128, 128, (rows, 4 * quads), dtype=np.int8)
        b_plain = rng.integers(-128, 128, (4 * quads, n), dtype=np.int8)
        a[0], b_plain[:, 0] = -128, -128  # the largest products: C[0, 0] must wrap
        c0 = rng.integers(-2**31, 2**31, (rows, n), dtype=np.int64)
        c0[0, 0] = 2**31 - 1  # wraps to negative
        tiles = {name: np.zeros((16, 64), np.uint8) for name in "cab"}
        tiles["a"][:rows, : 4 * quads] = a.view(np.uint8)
        b_quads = b_plain.reshape(quads, 4, n).transpose(0, 2, 1).reshape(quads, 4 * n)  # B[k/4][4n + k%4]
        tiles["b"][:quads, : 4 * n] = np.ascontiguousarray(b_quads).view(np.uint8)
        tiles["c"][:rows, : 4 * n] = c0.astype(np.int32).view(np.uint8)
        cfg = tile_config({0: (rows, 4 * n), 1: (rows, 4 * quads), 2: (quads, 4 * n)})
        _native.testing.amx_model_tile_dot(cfg, True, tiles["c"], tiles["a"], tiles["b"])
        exact = c0 + a.astype(np.int64) @ b_plain.astype(np.int64)
        wrapped = ((exact + 2**31) % 2**32 - 2**31).astype(np.int32)
        np.testing.assert_array_equal(tiles["c"][:rows, : 4 * n].copy().view(np.int32), wrapped)
        assert exact[0, 0] > 2**31 - 1 and wrapped[0, 0] < 0
        assert not tiles["c"][rows:].any() and not tiles["c"][:, 4 * n:].any(), "store wrote outside the tile shape"


@needs_model
@pytest.mark.parametrize(
    "shapes,palette,message",
    [({0: (17, 64), 1: (16, 64), 2: (16, 64)}, 1, "rows 17 > 16"),
     ({0: (16, 68), 1: (16, 64), 2: (16, 64)}, 1, "colsb 68 > 64"),
     ({0: (16, 64), 1: (16, 64), 2: (16, 64)}, 2, "palette 2"),
     ({0: (16, 64), 1: (16, 64), 2: (0, 64)}, 1, "rows == 0 xor colsb == 0"),
     ({0: (15, 64), 1: (16, 64), 2: (16, 64)}, 1, "dst.rows != src1.rows"),
     ({0: (16, 64), 1: (16, 60), 2: (16, 64)}, 1, "src1.colsb / 4 != src2.rows"),
     ({0: (16, 32), 1: (16, 64), 2: (16, 64)}, 1, "dst.colsb != src2.colsb")])
def test_amx_model_faults(shapes, palette, message):
    cfg = tile_config(shapes)
    cfg[0] = palette
    tiles = [np.zeros((16, 64), np.uint8) for _ in range(3)]
    with pytest.raises(RuntimeError, match=message.replace("/", "/").replace("(", r"\(")):
        _native.testing.amx_model_tile_dot(cfg, False, *tiles)


def test_stream_reads_refuse_strided_buffers(rng):
    strided = rng.standard_normal((64, 64)).astype(np.float32)[:, ::2]
    for call in (lambda b: _bench.stream_read(b, 1), lambda b: _bench.bench_stream_read(b, 1, 1)):
        with pytest.raises(ValueError, match="C-contiguous"):
            call([strided])
    # A contiguous buffer reads, and its checksum depends on its bytes.
    data = rng.integers(1, 255, size=4096, dtype=np.uint8)
    assert _bench.stream_read([data], 1) != _bench.stream_read([np.zeros_like(data)], 1)

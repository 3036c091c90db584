"""The INT8 / INT4 format contract (numa_moe.quant, docs/quantization.md): round trips
within the documented bound, the nibble order, and llama.cpp's Q8_0 / Q4_0 blocks
converted without loss against a decoder written from ggml's block definitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numa_moe import quant
from numa_moe.formats import scale_columns


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(quant.QUANT_FORMATS), data=st.data(), rows=st.integers(1, 6), groups=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-6, 3))
def test_round_trip_is_within_the_bound(fmt, data, rows, groups, seed, log_scale):
    group = data.draw(st.sampled_from(quant.groups_for(fmt)))
    scale_dtype = data.draw(st.sampled_from(sorted(quant.scale_dtypes_for(fmt))))
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, groups * group)) * 10.0 ** log_scale).astype(np.float32)
    w[0, :group] = 0  # an all-zero group
    qm = quant.quantize(w, fmt, group, scale_dtype)
    assert qm.shape == w.shape and qm.scales.shape == (rows, scale_columns(fmt, groups * group, group))
    assert np.all(np.isfinite(qm.scales.astype(np.float32)))  # int4-affine: its minimums too
    scales = qm.group_scales.astype(np.float32)
    if quant.zero_scales_allowed(fmt):  # iq4nl: the sign of the block's extreme, 0 for a block of zeros;
        # int4-affine: 0 for a group of equal weights
        assert np.array_equal(scales == 0, np.all(w.reshape(rows, groups, group) == 0, axis=2))
    else:
        assert np.all(scales > 0)
    q = quant.values(qm)
    assert q.min() >= quant.Q_MIN[fmt] and q.max() <= quant.Q_MAX[fmt]
    error = np.abs(w.astype(np.float64) - quant.dequantize(qm).astype(np.float64))
    assert np.all(error <= quant.error_bound(w, qm) * (1 + 1e-6) + 1e-30)
    assert np.all(quant.dequantize(qm)[0, :group] == 0)


def test_int8_error_is_small_relative_to_the_weights(rng):
    w = rng.standard_normal((64, 256)).astype(np.float32)
    rel = lambda qm: np.linalg.norm(w - quant.dequantize(qm)) / np.linalg.norm(w)  # noqa: E731
    assert rel(quant.quantize(w, "int8", 128)) < 0.01
    assert rel(quant.quantize(w, "int4", 32)) < 0.12


def test_int4_packs_the_even_column_into_the_low_nibble():
    q = np.array([[1, -2, 7, -8]], dtype=np.int8)
    packed = quant.pack_int4(q)
    assert packed.tolist() == [[0x01 | (0x0E << 4), 0x07 | (0x08 << 4)]]
    np.testing.assert_array_equal(quant.unpack_int4(packed), q)


def test_pack_unpack_are_inverse(rng):
    q = rng.integers(-8, 8, (5, 64)).astype(np.int8)
    np.testing.assert_array_equal(quant.unpack_int4(quant.pack_int4(q)), q)


@pytest.mark.parametrize("bad, message", [
    (dict(w=np.zeros((4, 100)), group=32), "not a multiple of the group size 32"),
    (dict(w=np.zeros((4, 96)), group=48), "group 48 is not one of"),
    (dict(w=np.zeros(96), group=32), "2-D"),
    (dict(w=np.full((2, 32), np.nan), group=32), "NaN"),
    (dict(w=np.zeros((2, 32)), group=32, fmt="int3"), "format 'int3'"),
    (dict(w=np.zeros((2, 32)), group=32, scale_dtype="fp8"), "scale_dtype 'fp8' is not one of fp16, bf16, fp32"),
])
def test_bad_input_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        quant.quantize(**bad)


def ggml_blocks(rng, rows, cols, q4):
    """Random Q8_0 / Q4_0 data and its dequantization per ggml's reference decoder:
    y = d * q in fp32 (Q4_0: q = nibble - 8, weights j and j + 16 share byte j)."""
    n_blocks = rows * cols // 32
    d = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16)
    out = np.empty((n_blocks, 32), np.float32)
    raw = bytearray()
    for b in range(n_blocks):
        raw += d[b].tobytes()
        if q4:
            nib = rng.integers(0, 16, 32).astype(np.uint8)
            raw += bytes((nib[:16] | (nib[16:] << 4)).astype(np.uint8))
            out[b] = (nib.astype(np.float32) - 8) * np.float32(d[b])
        else:
            q = rng.integers(-127, 128, 32).astype(np.int8)  # llama.cpp never writes -128
            raw += q.tobytes()
            out[b] = q.astype(np.float32) * np.float32(d[b])
    return bytes(raw), out.reshape(rows, cols)


@pytest.mark.parametrize("q4", [False, True], ids=["Q8_0", "Q4_0"])
def test_ggml_blocks_convert_without_loss(rng, q4):
    rows, cols = 3, 96
    raw, expected = ggml_blocks(rng, rows, cols, q4)
    qm = (quant.from_q4_0 if q4 else quant.from_q8_0)(raw, rows, cols)
    assert (qm.fmt, qm.group, qm.scales.dtype) == ("int4" if q4 else "int8", 32, np.float16)
    np.testing.assert_array_equal(quant.dequantize(qm).view(np.uint32), expected.view(np.uint32))


def test_iq4_nl_iq4_xs_and_q5_0_blocks_load_without_loss(rng):
    """IQ4_NL and IQ4_XS (hand-built blocks: the gguf package does not quantize them) as
    iq4nl, and Q5_0 (the package's quantizer) as int8, against the package's
    dequantization of the same bytes, element for element; a block count that does not
    match the matrix is refused."""
    gguf = pytest.importorskip("gguf")
    rows, cols = 5, 160
    d = (rng.standard_normal(rows * cols // 32) * 0.01).astype(np.float16)
    iq4 = np.concatenate([d.view(np.uint8).reshape(-1, 2),
                          rng.integers(0, 256, (rows * cols // 32, 16), dtype=np.uint8)], axis=1)
    q5 = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), gguf.GGMLQuantizationType.Q5_0)
    rows_xs, cols_xs = 3, 512  # IQ4_XS: blocks of 256
    xs = rng.integers(0, 256, (rows_xs * cols_xs // 256, 136), dtype=np.uint8)
    xs[:, :2] = (rng.random(len(xs)) * 0.02 + 0.001).astype(np.float16).view(np.uint8).reshape(-1, 2)
    T = gguf.GGMLQuantizationType
    for reader, raw, qtype, shape, fmt, scale_dtype in (
            (quant.from_iq4_nl, iq4, T.IQ4_NL, (rows, cols), "iq4nl", np.float16),
            (quant.from_q5_0, q5, T.Q5_0, (rows, cols), "int8", np.float16),
            (quant.from_iq4_xs, xs, T.IQ4_XS, (rows_xs, cols_xs), "iq4nl", np.float32)):
        rows, cols = shape
        qm = reader(raw.tobytes(), rows, cols)
        assert (qm.fmt, qm.group, qm.scales.dtype) == (fmt, 32, scale_dtype)
        theirs = np.asarray(gguf.quants.dequantize(raw.reshape(rows, -1), qtype), np.float32)
        np.testing.assert_array_equal(quant.dequantize(qm).view(np.uint32), theirs.view(np.uint32))
        with pytest.raises(ValueError, match=f"{qtype.name}: .* bytes for a {rows} x 256 matrix"):
            reader(raw.tobytes(), rows, 256)


def test_ggml_data_of_the_wrong_size_or_range_is_refused(rng):
    raw, _ = ggml_blocks(rng, 2, 64, q4=False)
    with pytest.raises(ValueError, match="Q8_0: 136 bytes for a 2 x 96 matrix, expected 204"):
        quant.from_q8_0(raw, 2, 96)
    bad = bytearray(raw)
    bad[2] = 0x80  # q = -128 in the first block
    with pytest.raises(ValueError, match="-128"):
        quant.from_q8_0(bytes(bad), 2, 64)

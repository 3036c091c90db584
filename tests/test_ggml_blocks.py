"""The loader's native conversion of llama.cpp blocks (_native.convert_ggml_blocks, used by
every exact GGUF import: Q8_0, Q5_0, Q4_0, IQ4_NL, MXFP4, IQ4_XS): the same bytes as
numa_moe.quant's numpy readers with the loader's zero-scale rule, the gguf package's values
element for element, and every bad block or argument refused by name. The K-quants'
dequantization (_native.dequantize_ggml_k_blocks: Q2_K .. Q6_K, the requantized imports)
against the gguf package's, bit for bit, and their one-pass requantization
(_native.requantize_ggml_k_blocks) against the package's values quantized by
numa_moe.quant."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numa_moe import _native
from numa_moe import quant as q

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
READERS = {"Q8_0": q.from_q8_0, "Q5_0": q.from_q5_0, "Q4_0": q.from_q4_0, "IQ4_NL": q.from_iq4_nl,
           "MXFP4": q.from_gguf_mxfp4, "IQ4_XS": q.from_iq4_xs}
BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18, "IQ4_NL": 18, "MXFP4": 17, "IQ4_XS": 136}
BLOCK_WEIGHTS = {"IQ4_XS": 256}


def random_blocks(rng, qtype, rows, cols):
    """Random raw blocks: random codes; fp16 scales of both signs with +0 and -0 among them
    (MXFP4: random e8m0 bytes but 0xFF); Q8_0 codes without -128."""
    blocks = rng.integers(0, 256, (rows * cols // BLOCK_WEIGHTS.get(qtype, 32), BLOCK_BYTES[qtype]), dtype=np.uint8)
    if qtype == "MXFP4":
        blocks[:, 0] = rng.integers(0, 255, len(blocks))
    else:
        d = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        d[::7] = 0
        d[3::7] = -0.0
        blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == "Q8_0":
        codes = blocks[:, 2:]
        codes[codes == 0x80] = 0x7F
    return blocks.reshape(-1)


def buffers(qtype, rows, cols, pad=3):
    """values and scales with rows further apart than their bytes (views into wider arrays),
    both filled with the byte 0x5A, so that an element the conversion leaves unwritten shows."""
    bytes_a_weight = qtype in ("Q8_0", "Q5_0")
    value_cols = cols if bytes_a_weight else cols // 2
    values = np.full((rows, value_cols + pad), 0x5A, np.int8 if bytes_a_weight else np.uint8)[:, :value_cols]
    scale_dtype = {"MXFP4": ml_dtypes.float8_e8m0fnu, "IQ4_XS": np.float32}.get(qtype, np.float16)
    scales = np.full((rows, (cols // 32 + pad) * np.dtype(scale_dtype).itemsize), 0x5A, np.uint8)
    scales = scales.view(scale_dtype)[:, :cols // 32]
    return values, scales


@pytest.mark.parametrize("qtype", list(READERS))
def test_native_conversion_equals_the_readers_and_the_package(rng, qtype):
    rows, cols = 7, 512
    raw = random_blocks(rng, qtype, rows, cols)
    values, scales = buffers(qtype, rows, cols)
    _native.convert_ggml_blocks(qtype, raw, rows, cols, values, scales)
    qm = READERS[qtype](raw, rows, cols)
    want_values, want_scales = np.array(qm.q), np.array(qm.scales)
    if not q.zero_scales_allowed(qm.fmt) and qtype != "MXFP4":  # the loader's rule: zeros under +-1
        zero = want_scales.astype(np.float32) == 0
        assert zero.any()
        want_values.reshape(rows, cols // 32, -1)[zero] = 0
        want_scales[zero] = np.copysign(1, want_scales[zero].astype(np.float32))
    np.testing.assert_array_equal(values.view(np.uint8), want_values.view(np.uint8))
    np.testing.assert_array_equal(scales.view(np.uint8), want_scales.view(np.uint8))
    with np.errstate(over="ignore"):  # e8m0 bytes up to 254: 2^127 x 6 is inf on both sides
        theirs = np.asarray(gguf.quants.dequantize(raw.reshape(rows, -1), T[qtype]), np.float32)
        ours = q.dequantize(q.QuantizedMatrix(qm.fmt, 32, values, scales))
    np.testing.assert_array_equal(ours, theirs)  # equal values (the sign of a zero aside)


@pytest.mark.parametrize("qtype, offset, byte, message", [
    ("Q8_0", 1, 0x7C, r"a NaN or infinite block scale \(row 2, block 3\)"),  # fp16 +inf's high byte
    ("Q4_0", 1, 0xFE, r"a NaN or infinite block scale \(row 2, block 3\)"),  # a negative NaN
    ("IQ4_NL", 1, 0xFC, r"a NaN or infinite block scale \(row 2, block 3\)"),
    ("IQ4_XS", 1, 0x7C, r"a NaN or infinite block scale \(row 2, block 3\)"),
    ("MXFP4", 0, 0xFF, r"scale byte 0xFF \(NaN in e8m0\) \(row 2, block 3\)"),
    ("Q5_0", 1, 0xFF, r"a NaN or infinite block scale \(row 2, block 3\)"),
    ("Q8_0", 9, 0x80, r"q = -128, outside the symmetric int8 \[-127, 127\] \(row 2, block 3\)")])
def test_a_bad_block_is_named(rng, qtype, offset, byte, message):
    rows, cols = 4, 1280
    raw = random_blocks(rng, qtype, rows, cols)
    at = (2 * (cols // BLOCK_WEIGHTS.get(qtype, 32)) + 3) * BLOCK_BYTES[qtype] + offset
    raw[at] = byte
    if offset == 1:
        raw[at - 1] = 0x00 if byte == 0x7C else 0x01  # exponent all ones: +inf, or a NaN
    values, scales = buffers(qtype, rows, cols)
    with pytest.raises(ValueError, match=message):
        _native.convert_ggml_blocks(qtype, raw, rows, cols, values, scales)


def test_bad_arguments_are_refused(rng):
    rows, cols = 2, 64
    raw = random_blocks(rng, "Q4_0", rows, cols)
    values, scales = buffers("Q4_0", rows, cols)
    convert = _native.convert_ggml_blocks
    with pytest.raises(ValueError, match="ggml type 'Q5_K' is not one of Q8_0, Q4_0, IQ4_NL, MXFP4, IQ4_XS, Q5_0, Q4_1, "
                                         "Q4_K"):
        convert("Q5_K", raw, rows, cols, values, scales)
    with pytest.raises(ValueError, match="cols a positive multiple of 32"):
        convert("Q4_0", raw, rows, 48, values, scales)
    with pytest.raises(ValueError, match="Q4_0: 72 bytes for a 2 x 96 matrix, expected 108"):
        convert("Q4_0", raw, rows, 96, values, scales)
    with pytest.raises(ValueError, match=r"values: shape \(2, 16\), expected \[2, 32\]"):
        convert("Q4_0", raw, rows, cols, values[:, :16], scales)
    with pytest.raises(ValueError, match="values: rows must be contiguous"):
        convert("Q4_0", raw, rows, cols, np.zeros((rows, 64), np.uint8)[:, ::2], scales)
    with pytest.raises(ValueError, match="scales: 4-byte elements, expected 2"):
        convert("Q4_0", raw, rows, cols, values, scales.astype(np.float32))
    values.flags.writeable = False
    with pytest.raises(ValueError, match="values: must be writable"):
        convert("Q4_0", raw, rows, cols, values, scales)


# ------------------------------------------------------------------ K-quants (dequantized)

K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# (byte offset of d, of dmin or None) in each type's 256-weight block
K_SUPER_SCALES = {"Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}


def random_k_blocks(rng, qtype, rows, cols):
    """Random K-quant blocks: random bytes, then finite fp16 d and dmin of both signs with
    +0, -0 and subnormals among them."""
    size = gguf.GGML_QUANT_SIZES[T[qtype]][1]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for at in K_SUPER_SCALES[qtype]:
        if at is None:
            continue
        d = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
        d[::5] = 0
        d[1::5] = -0.0
        d[2::5] = np.float16(3e-6) * rng.integers(-8, 8, len(d[2::5]))  # fp16 subnormals
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", K_QUANTS)
@pytest.mark.parametrize("rows, cols", [(1, 256), (5, 768), (3, 2048)])
def test_k_quants_dequantize_as_the_package_does(rng, qtype, rows, cols):
    raw = random_k_blocks(rng, qtype, rows, cols)
    out = np.full((rows, cols), np.nan, np.float32)
    _native.dequantize_ggml_k_blocks(qtype, raw, rows, cols, out)
    want = np.asarray(gguf.quants.dequantize(raw, T[qtype]), dtype=np.float32).reshape(rows, cols)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))  # bit for bit, signed zeros too


@pytest.mark.parametrize("qtype, scale", [(t, i) for t in K_QUANTS for i in range(2) if K_SUPER_SCALES[t][i] is not None])
@pytest.mark.parametrize("high_byte", [0x7C, 0xFE])  # +inf, a negative NaN
def test_a_k_quant_nan_or_infinite_super_scale_is_named(rng, qtype, scale, high_byte):
    rows, cols = 4, 1024
    raw = random_k_blocks(rng, qtype, rows, cols)
    size = gguf.GGML_QUANT_SIZES[T[qtype]][1]
    at = (2 * (cols // 256) + 3) * size + K_SUPER_SCALES[qtype][scale]
    raw[at:at + 2] = (0x00 if high_byte == 0x7C else 0x01, high_byte)
    name = ("d", "dmin")[scale]
    with pytest.raises(ValueError, match=rf"a NaN or infinite {name} \(row 2, block 3\)"):
        _native.dequantize_ggml_k_blocks(qtype, raw, rows, cols, np.empty((rows, cols), np.float32))


def test_k_quant_bad_arguments_are_refused(rng):
    rows, cols = 2, 512
    raw = random_k_blocks(rng, "Q4_K", rows, cols)
    out = np.empty((rows, cols), np.float32)
    dequantize = _native.dequantize_ggml_k_blocks
    with pytest.raises(ValueError, match="ggml type 'Q4_0' is not one of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"):
        dequantize("Q4_0", raw, rows, cols, out)
    with pytest.raises(ValueError, match="cols a positive multiple of 256"):
        dequantize("Q4_K", raw, rows, 384, out)
    with pytest.raises(ValueError, match="Q4_K: 576 bytes for a 2 x 768 matrix, expected 864"):
        dequantize("Q4_K", raw, rows, 768, np.empty((rows, 768), np.float32))
    with pytest.raises(ValueError, match=r"out: shape \(2, 256\), expected \(2, 512\)"):
        dequantize("Q4_K", raw, rows, cols, out[:, :256].copy())
    with pytest.raises(ValueError, match="out: dtype float64, expected float32"):
        dequantize("Q4_K", raw, rows, cols, np.zeros((rows, cols)))
    with pytest.raises(ValueError, match="out: must be C-contiguous"):
        dequantize("Q4_K", raw, rows, cols, np.empty((rows, 2 * cols), np.float32)[:, ::2])
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: must be writable"):
        dequantize("Q4_K", raw, rows, cols, out)


def group_destinations(fmt, scale_dtype, rows, cols, group):
    values = np.full((rows, cols if fmt == "int8" else cols // 2), 0x5A, np.uint8)
    scales = np.full((rows, cols // group), 0x5A, np.float32 if scale_dtype == "fp32" else np.uint16)
    return values, scales


@pytest.mark.parametrize("qtype", K_QUANTS)
@pytest.mark.parametrize("fmt, group, scale_dtype", [("int8", 32, "fp16"), ("int4", 32, "fp16"), ("int8", 128, "bf16"),
                                                     ("int4", 64, "fp32")])
def test_k_quants_requantize_as_the_package_and_quant_do(rng, qtype, fmt, group, scale_dtype):
    rows, cols = 5, 768
    raw = random_k_blocks(rng, qtype, rows, cols)
    values, scales = group_destinations(fmt, scale_dtype, rows, cols, group)
    _native.requantize_ggml_k_blocks(qtype, raw, rows, cols, fmt, group, scale_dtype, values, scales)
    want = q.quantize(np.asarray(gguf.quants.dequantize(raw, T[qtype]), dtype=np.float32).reshape(rows, cols),
                      fmt, group, scale_dtype)
    np.testing.assert_array_equal(values, want.q.view(np.uint8))
    np.testing.assert_array_equal(scales.view(np.uint8), want.scales.view(np.uint8))


def test_k_quant_requantization_names_the_row_of_a_bad_block_or_scale(rng):
    rows, cols = 4, 512
    raw = random_k_blocks(rng, "Q6_K", rows, cols)
    size = gguf.GGML_QUANT_SIZES[T.Q6_K][1]
    values, scales = group_destinations("int8", "fp16", rows, cols, 32)
    bad = raw.copy()
    at = (2 * (cols // 256) + 1) * size + K_SUPER_SCALES["Q6_K"][0]
    bad[at:at + 2] = (0x00, 0x7C)  # +inf d: row 2, block 1
    with pytest.raises(ValueError, match=r"a NaN or infinite d \(row 2, block 1\)"):
        _native.requantize_ggml_k_blocks("Q6_K", bad, rows, cols, "int8", 32, "fp16", values, scales)
    big = raw.copy()
    at = 3 * (cols // 256) * size + K_SUPER_SCALES["Q6_K"][0]
    big[at:at + 2] = np.array([60000], np.float16).view(np.uint8)  # row 3's first block: |w| up to 60000 * 128 * 32
    big[at - 16:at] = 0x7F  # its int8 sub-scales at their largest
    with pytest.raises(ValueError, match=r"needs a scale beyond its dtype's range \(row 3, group \d+\)"):
        _native.requantize_ggml_k_blocks("Q6_K", big, rows, cols, "int8", 32, "fp16", values, scales)


def test_k_quant_requantization_bad_arguments_are_refused(rng):
    rows, cols = 2, 512
    raw = random_k_blocks(rng, "Q4_K", rows, cols)
    values, scales = group_destinations("int8", "fp16", rows, cols, 32)
    requantize = _native.requantize_ggml_k_blocks
    with pytest.raises(ValueError, match="ggml type 'Q8_0' is not one of Q2_K"):
        requantize("Q8_0", raw, rows, cols, "int8", 32, "fp16", values, scales)
    with pytest.raises(ValueError, match="format 'mxfp4' is not one of int8, int4"):
        requantize("Q4_K", raw, rows, cols, "mxfp4", 32, "fp16", values, scales)
    with pytest.raises(ValueError, match="group 16 is not one of 32, 64, 128"):
        requantize("Q4_K", raw, rows, cols, "int8", 16, "fp16", values, scales)
    with pytest.raises(ValueError, match="scale dtype 'e8m0' is not one of fp16, bf16, fp32"):
        requantize("Q4_K", raw, rows, cols, "int8", 32, "e8m0", values, scales)
    with pytest.raises(ValueError, match="Q4_K: 576 bytes for a 1 x 512 matrix, expected 288"):
        requantize("Q4_K", raw, 1, cols, "int8", 32, "fp16", values[:1], scales[:1])
    with pytest.raises(ValueError, match="values"):
        requantize("Q4_K", raw, rows, cols, "int4", 32, "fp16", values, scales)  # int8-sized rows for int4
    with pytest.raises(ValueError, match="scales"):
        requantize("Q4_K", raw, rows, cols, "int8", 64, "fp16", values, scales)  # group 32's scale columns


@pytest.mark.parametrize("qtype, scale_dtype", [("Q4_1", np.float16), ("Q4_K", np.float32)])
@pytest.mark.parametrize("rows, cols", [(1, 256), (5, 768), (3, 2048)])
def test_q4_1_and_q4_k_convert_to_int4_affine_with_the_package_values(rng, qtype, scale_dtype, rows, cols):
    """The codes re-paired and the scales and minimums laid out for int4-affine (Q4_1: d and
    m as they are; Q4_K: d * sc and -(dmin * m) in fp32): dequantized, the gguf package's
    values bit for bit, signed zeros too."""
    if qtype == "Q4_1":
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        w[0, :32] = 0.5  # a block of equal weights: d = 0
        raw = gguf.quants.quantize(w, T.Q4_1).reshape(-1)
    else:
        raw = random_k_blocks(rng, qtype, rows, cols)
    values = np.full((rows, cols // 2), 0x5A, np.uint8)
    scales = np.full((rows, 2 * cols // 32), np.nan, scale_dtype)
    _native.convert_ggml_blocks(qtype, raw, rows, cols, values, scales)
    got = q.dequantize(q.QuantizedMatrix("int4-affine", 32, values, scales))
    want = np.asarray(gguf.quants.dequantize(raw, T[qtype]), dtype=np.float32).reshape(rows, cols)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype, at, what", [("Q4_1", 0, "block scale"), ("Q4_1", 2, "block minimum"),
                                             ("Q4_K", 0, "d"), ("Q4_K", 2, "dmin")])
def test_a_q4_1_or_q4_k_nan_scale_or_minimum_is_named(rng, qtype, at, what):
    rows, cols = 3, 512
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[T[qtype]]
    if qtype == "Q4_1":
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), T.Q4_1).reshape(-1)
    else:
        raw = random_k_blocks(rng, qtype, rows, cols)
    block = cols // block_weights + 1  # row 1, block 1
    raw[block * block_bytes + at:block * block_bytes + at + 2] = (0x01, 0x7C)  # a NaN
    values = np.empty((rows, cols // 2), np.uint8)
    scales = np.empty((rows, 2 * cols // 32), np.float16 if qtype == "Q4_1" else np.float32)
    with pytest.raises(ValueError, match=rf"a NaN or infinite {what} \(row 1, block 1\)"):
        _native.convert_ggml_blocks(qtype, raw, rows, cols, values, scales)
    with pytest.raises(ValueError, match=r"scales: shape"):
        _native.convert_ggml_blocks(qtype, raw, rows, cols, values, scales[:, :cols // 32].copy())

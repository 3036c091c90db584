"""The MXFP4 weight format (numa_moe.quant, docs/quantization.md): quantize() against the
OCP MX rule computed independently (ml_dtypes' e2m1 rounding) and against the ``gguf``
package's MXFP4 quantizer and dequantizer, llama.cpp's MXFP4 blocks and gpt-oss's
``*_blocks`` / ``*_scales`` converted without loss, and the one-line refusals."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of numa-moe "
                                          "(pyproject.toml); install it with tools/setup.sh")

from numa_moe import quant as q  # noqa: E402
from numa_moe.layer import kernels  # noqa: E402
from numa_moe.formats import NUMPY_DTYPES, SCALE_DTYPE_CODES, SCALE_DTYPES, nibble_packed  # noqa: E402

MXFP4 = gguf.GGMLQuantizationType.MXFP4
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def random_weight(rng, rows, cols):
    """Normal weights with a magnitude of their own per row (1e-30 to 1e30), and one
    all-zero block."""
    w = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-30, 30, (rows, 1))
    w = w.astype(np.float32)
    w[0, 32:64] = 0
    return w


def to_gguf_blocks(qm) -> np.ndarray:
    """The contract's MXFP4 matrix as llama.cpp's blocks (scale byte, then byte j = weight j
    low, weight j + 16 high), written from ggml's block_mxfp4, not from numa_moe."""
    rows, cols = qm.shape
    codes = np.empty((rows, cols), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = qm.q & 0x0F, qm.q >> 4
    codes = codes.reshape(rows, cols // 32, 32)
    qs = codes[:, :, :16] | (codes[:, :, 16:] << 4)
    blocks = np.concatenate([qm.scales.view(np.uint8)[:, :, None], qs], axis=2)
    return blocks.reshape(rows, cols // 32 * 17)


def e2m1_decode(code: int) -> float:
    """OCP e2m1 from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def test_formats_table_knows_mxfp4_and_e8m0():
    assert SCALE_DTYPE_CODES["e8m0"] == "F8_E8M0" and NUMPY_DTYPES["F8_E8M0"] == E8M0
    assert SCALE_DTYPES["e8m0"] == E8M0
    assert nibble_packed("mxfp4") and nibble_packed("int4") and not nibble_packed("int8")
    assert [e2m1_decode(c) for c in range(16)] == q.E2M1.tolist()


def test_quantize_follows_the_ocp_rule(rng):
    w = random_weight(rng, 24, 256)
    # ties between two e2m1 values, saturation, a block whose largest magnitude is an exact
    # power of two: row 1 holds them at scale 2^-3 (amax 4 * 2^-3 = 0.5)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.0], np.float32)
    w[1, :32] = np.concatenate([ties, -ties, 0.1 * ties, -0.1 * ties]) * 2.0 ** -3
    w[1, 32:64] = np.concatenate([[7.99, 6.5, 6.0, -7.0], np.zeros(28)]) * 2.0 ** 10
    qm = q.quantize(w, "mxfp4")
    assert (qm.fmt, qm.group, qm.scales.dtype, qm.q.dtype) == ("mxfp4", 32, E8M0, np.uint8)
    assert qm.q.shape == (24, 128) and qm.scales.shape == (24, 8)
    blocks = w.astype(np.float64).reshape(24, 8, 32)
    amax = np.abs(blocks).max(axis=2)
    # the spec's shared exponent; an all-zero block may have any scale
    exponent = np.array([[math.floor(math.log2(a)) - 2 if a else 0 for a in row] for row in amax])
    got_exponent = qm.scales.view(np.uint8).astype(np.int64) - 127
    assert np.array_equal(got_exponent[amax > 0], exponent[amax > 0])
    scale = 2.0 ** exponent[:, :, None]
    # ml_dtypes' float4_e2m1fn rounds to nearest even; clipped first: the spec saturates
    expected = np.clip(blocks / scale, -6, 6).astype(ml_dtypes.float4_e2m1fn)
    codes = np.empty((24, 256), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = qm.q & 0x0F, qm.q >> 4
    nonzero = np.repeat(amax > 0, 32, axis=1)
    assert np.array_equal(codes[nonzero], expected.view(np.uint8).reshape(24, 256)[nonzero])
    assert np.all(q.dequantize(qm)[~nonzero] == 0)
    assert q.dequantize(qm)[1, :8].tolist() == [v * 2.0 ** -3 for v in (0, 1, 1, 2, 2, 4, 4, 4)]
    assert q.dequantize(qm)[1, 32:36].tolist() == [v * 2.0 ** 10 for v in (6, 6, 6, -6)]


def test_quantize_and_dequantize_match_the_gguf_package(rng):
    w = random_weight(rng, 16, 512)
    qm = q.quantize(w, "mxfp4")
    blocks = to_gguf_blocks(qm)
    # the same bytes, dequantized by gguf: equal element for element
    theirs = gguf.quants.dequantize(blocks, MXFP4).reshape(w.shape)
    assert theirs.dtype == np.float32
    assert np.array_equal(q.dequantize(qm), theirs)
    # and read back into the contract's layout byte for byte
    back = q.from_gguf_mxfp4(blocks, *w.shape)
    assert np.array_equal(back.q, qm.q) and np.array_equal(back.scales.view(np.uint8), qm.scales.view(np.uint8))
    # gguf's own quantizer picks the same values, except where it cannot: it takes the
    # exponent from a float32 log2, which rounds up just below a power of two
    amax = np.abs(w.reshape(16, 16, 32)).max(axis=2)
    mantissa, _ = np.frexp(amax)
    usable = np.repeat((amax > 0) & (mantissa < 1 - 1e-6), 32, axis=1)
    mine = q.dequantize(qm)
    package = gguf.quants.dequantize(gguf.quants.quantize(w, MXFP4), MXFP4).reshape(w.shape)
    assert usable.mean() > 0.9
    assert np.array_equal(mine[usable], package[usable])


def test_error_bound_and_values(rng):
    w = random_weight(rng, 8, 128)
    qm = q.quantize(w, "mxfp4")
    values = q.values(qm)
    assert values.dtype == np.float32 and set(np.unique(np.abs(values))) <= set(q.E2M1[:8].tolist())
    error = np.abs(w.astype(np.float64) - q.dequantize(qm))
    bound = q.error_bound(w, qm)
    assert np.all(error <= bound)
    # the bound is tight: half the e2m1 step at the largest magnitudes is reached within 10%
    assert np.any(error > 0.9 * bound)


def test_from_gguf_mxfp4_matches_gguf_dequantize(rng):
    rows, cols = 12, 320
    raw = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = rng.integers(100, 150, (rows, cols // 32))  # scales well inside fp32's range
    raw[0, 0, 0], raw[1, 1, 0] = 0, 254  # the smallest and (with small codes) the largest scale
    raw[1, 1, 1:] &= 0x11  # codes 0 and 1: 2^127 * 0.5 stays finite
    qm = q.from_gguf_mxfp4(raw.tobytes(), rows, cols)
    assert (qm.fmt, qm.group, qm.shape, qm.scales.dtype) == ("mxfp4", 32, (rows, cols), E8M0)
    theirs = gguf.quants.dequantize(raw.reshape(rows, -1), MXFP4).reshape(rows, cols)
    assert np.array_equal(q.dequantize(qm), theirs)  # -0 and +0 are equal: ggml has no -0


def test_from_mxfp4_blocks_against_an_independent_decoder(rng):
    rows, cols = 6, 128
    blocks = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(90, 160, (rows, cols // 32), dtype=np.uint8)
    qm = q.from_mxfp4_blocks(blocks, scales)
    assert np.shares_memory(qm.q, blocks) and np.shares_memory(qm.scales, scales)  # no copy
    expected = np.empty((rows, cols))
    for r in range(rows):
        for c in range(cols):
            byte = int(blocks[r, c // 32, (c % 32) // 2])
            code = byte & 0x0F if c % 2 == 0 else byte >> 4
            expected[r, c] = e2m1_decode(code) * 2.0 ** (int(scales[r, c // 32]) - 127)
    assert np.array_equal(q.dequantize(qm), expected)
    # already e8m0 scales are taken as they are
    again = q.from_mxfp4_blocks(blocks, scales.view(E8M0))
    assert np.array_equal(again.scales.view(np.uint8), scales)


def test_nan_scale_byte_is_refused_naming_the_block(rng):
    raw = rng.integers(0, 127, (3, 4, 17), dtype=np.uint8)
    raw[1, 2, 0] = 0xFF
    with pytest.raises(ValueError, match=r"MXFP4: scale byte 0xFF \(NaN in e8m0\) at row 1, block 2"):
        q.from_gguf_mxfp4(raw.tobytes(), 3, 128)
    blocks = rng.integers(0, 256, (3, 4, 16), dtype=np.uint8)
    scales = np.full((3, 4), 127, np.uint8)
    scales[2, 3] = 0xFF
    with pytest.raises(ValueError, match=r"0xFF \(NaN in e8m0\) at row 2, block 3"):
        q.from_mxfp4_blocks(blocks, scales)


@pytest.mark.parametrize("call, message", [
    (lambda: q.from_gguf_mxfp4(bytes(17 * 3), 2, 48), "MXFP4: cols=48 is not a multiple of its 32-weight blocks"),
    (lambda: q.from_gguf_mxfp4(bytes(17 * 3), 2, 64), "MXFP4: 51 bytes for a 2 x 64 matrix, expected 68"),
    (lambda: q.from_mxfp4_blocks(np.zeros((2, 2, 8), np.uint8), np.zeros((2, 2), np.uint8)),
     r"MXFP4 blocks must be uint8 \[rows, cols / 32, 16\], got uint8 \[2, 2, 8\]"),
    (lambda: q.from_mxfp4_blocks(np.zeros((2, 2, 16), np.int8), np.zeros((2, 2), np.uint8)),
     "MXFP4 blocks must be uint8"),
    (lambda: q.from_mxfp4_blocks(np.zeros((2, 2, 16), np.uint8), np.zeros((2, 3), np.uint8)),
     r"MXFP4 scales must be uint8 or float8_e8m0fnu \[2, 2\] \(one per block of 32\), got uint8 \[2, 3\]"),
    (lambda: q.from_mxfp4_blocks(np.zeros((2, 2, 16), np.uint8), np.zeros((2, 2), np.float16)),
     "MXFP4 scales must be uint8 or float8_e8m0fnu"),
    (lambda: q.quantize(np.zeros((2, 48)), "mxfp4"), "cols=48 is not a multiple of the group size 32"),
    (lambda: q.quantize(np.zeros((2, 64)), "mxfp4", 64),
     r"weight_format 'mxfp4' takes group 32 only \(group 32, e8m0 scales\), not 64"),
    (lambda: q.quantize(np.zeros((2, 64)), "mxfp4", 32, "fp16"),
     r"weight_format 'mxfp4' takes scale_dtype 'e8m0' only \(group 32, e8m0 scales\), not 'fp16'"),
    (lambda: q.quantize(np.zeros((2, 64)), "int8", 32, "e8m0"),
     "scale_dtype 'e8m0' belongs to weight_format 'mxfp4' only, not 'int8'"),
    (lambda: q.check_arguments(weight_format="int4", scale_dtype="e8m0"),
     "scale_dtype 'e8m0' belongs to weight_format 'mxfp4' only, not 'int4'"),
])
def test_bad_input_one_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_scale_layout_fills_the_formats_own():
    assert q.scale_layout("mxfp4") == (32, "e8m0")
    assert q.scale_layout("int4") == (128, "fp16")
    assert q.scale_layout("int8", default_group=32) == (32, "fp16")
    assert q.groups_for("mxfp4") == (32,) and q.scale_dtypes_for("mxfp4") == ("e8m0",)
    assert "e8m0" not in q.scale_dtypes_for("int8")
    assert q.scale_layout("iq4nl") == (32, "fp16") and q.scale_layout("iq4nl", scale_dtype="fp32") == (32, "fp32")
    assert q.groups_for("iq4nl") == (32,) and "e8m0" not in q.scale_dtypes_for("iq4nl")
    with pytest.raises(ValueError, match="weight_format 'iq4nl' takes group 32 only"):
        q.scale_layout("iq4nl", group=64)
    with pytest.raises(ValueError, match="scale_dtype 'e8m0' belongs to weight_format 'mxfp4' only, not 'iq4nl'"):
        q.quantize(np.zeros((2, 32)), "iq4nl", scale_dtype="e8m0")


@pytest.mark.parametrize("n_nodes", [1, 2, 3])
@pytest.mark.parametrize("fmt", ["mxfp4", "iq4nl"])
def test_layer_on_codebook_experts_against_a_float64_loop(rng, n_nodes, fmt):
    """MoELayer.from_tensors(weight_format="mxfp4" or "iq4nl") against the float64 loop
    over the dequantized experts (numa_moe.quant, checked against gguf): the kernels' only
    other error is the int8 quantization of the tokens per block of 32 (docs/quantization.md)."""
    from moe_reference import moe_reference, random_bf16, rel_error
    from numa_moe.layer.moe_layer import MoELayer
    from numa_moe.placement.topology import Topology

    experts, inter, hidden, tokens = 4, 96, 128, 7
    gate_up = random_bf16(rng, (experts, 2 * inter, hidden), hidden ** -0.5)
    down = random_bf16(rng, (experts, hidden, inter), inter ** -0.5)
    layer = MoELayer.from_tensors(gate_up, down, topology=Topology.virtual(n_nodes), tables="theoretical",
                                  weight_format=fmt)
    assert layer.weight_format == fmt
    assert all(layer.isa_for_tokens(m) in kernels.available_isas(fmt) for m in (1, 16))
    deq = [[q.dequantize(q.quantize(m.astype(np.float32), fmt)) for m in mats]
           for mats in (gate_up[:, :inter], gate_up[:, inter:], down)]
    x = random_bf16(rng, (tokens, hidden))
    ids = np.stack([rng.choice(experts, 2, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, weights, out_dtype="float32")
    assert rel_error(y, moe_reference(x, ids, weights, *deq)) < 0.02

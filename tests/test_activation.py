"""The experts' activation and biases (numa_moe.activation; gpt-oss's clamped SwiGLU with
gate / up / down biases) through every ISA's epilogues, the single-expert path and the MoE
layer, against float64 references of the transformers formula (GptOssExperts):

    gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
    out = (up + 1) * gate * sigmoid(alpha * gate)
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from numa_moe import _native, quant
from numa_moe.activation import GPT_OSS, SILU, Activation, activation_named
from numa_moe.layer import kernels
from numa_moe.layer.moe_layer import MoELayer

from test_kernels_quant import FFN_BOUND, quantize_tokens

BF16 = np.dtype(ml_dtypes.bfloat16)
BF16_ISAS = kernels.tested_isas("bf16")
FORMATS = ("bf16", "int8", "mxfp4")
FORMAT_ISAS = [(fmt, isa) for fmt in FORMATS for isa in kernels.tested_isas(fmt)]


def activation64(g, u, act: Activation):
    """The transformers formula in float64 (limit inf and offset 0: silu(g) * u)."""
    g = np.minimum(np.asarray(g, np.float64), act.limit)
    u = np.clip(np.asarray(u, np.float64), -act.limit, act.limit)
    return (u + act.up_offset) * g / (1 + np.exp(-act.alpha * g))


def test_names_and_checks():
    assert activation_named(None) is SILU and activation_named("gpt-oss") is GPT_OSS
    assert activation_named(" SiLU ") is SILU
    assert GPT_OSS == Activation(alpha=1.702, limit=7.0, up_offset=1.0)
    for bad, match in (("relu", "not one of silu, gpt-oss"), (3, "not one of")):
        with pytest.raises(ValueError, match=match):
            activation_named(bad)
    for kwargs, match in (({"alpha": 0}, "alpha must be finite and > 0"), ({"alpha": math.nan}, "alpha"),
                          ({"limit": -1}, "limit must be > 0"), ({"limit": math.nan}, "limit"),
                          ({"up_offset": math.inf}, "up_offset must be finite"), ({"alpha": "1"}, "a number")):
        with pytest.raises(ValueError, match=match):
            Activation(**kwargs)


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("m", [1, 5, 16, 17])
@pytest.mark.parametrize("n_parts", [1, 3])
def test_the_clamped_swiglu_at_and_beyond_its_limits(rng, isa, m, n_parts):
    """Gate and up sums around and far past +-limit, negative and large gates, biases of
    both signs, summed over node parts: bf16 of the float64 formula (the kernels' exp is
    a polynomial on AVX-512: within a few fp32 ulps, well inside bf16 rounding)."""
    inter = 64
    special = np.array([-50, -8, -7.5, -7, -6.99, -1, -0.0, 0, 0.5, 6.99, 7, 7.01, 7.5, 12, 50], np.float32)
    g_total = rng.choice(special, (inter, m)) + rng.standard_normal((inter, m)).astype(np.float32) * 0.01
    u_total = rng.choice(special, (inter, m)) * rng.choice([1, -1], (inter, m))
    g_total[::5] = rng.standard_normal((len(g_total[::5]), m)) * 10
    gate_bias = (rng.standard_normal(inter) * 3).astype(np.float32)
    up_bias = (rng.standard_normal(inter) * 3).astype(np.float32)
    # node parts summing (in fp32, part order) to the totals less the biases
    gate_parts = [(g_total - gate_bias[:, None]).astype(np.float32)] + [np.zeros((inter, m), np.float32)] * (n_parts - 1)
    up_parts = [(u_total - up_bias[:, None]).astype(np.float32)] + [np.zeros((inter, m), np.float32)] * (n_parts - 1)
    act = kernels.silu_mul_pack(gate_parts, up_parts, 0, inter, isa=isa, activation=GPT_OSS,
                                gate_bias=gate_bias, up_bias=up_bias).astype(np.float64)
    g = (gate_parts[0] + gate_bias[:, None]).astype(np.float64)
    u = (up_parts[0] + up_bias[:, None]).astype(np.float64)
    expected = activation64(g, u, GPT_OSS).T
    np.testing.assert_allclose(act, expected, rtol=2 ** -8, atol=1e-30)
    assert np.abs(act).max() <= 8 * 7 * 1.01  # (7 + 1) * 7 at most: the clamps hold
    # silu (the default) keeps its values: no clamp, no offset
    silu = kernels.silu_mul_pack(gate_parts, up_parts, 0, inter, isa=isa).astype(np.float64)
    np.testing.assert_allclose(silu, activation64(gate_parts[0], up_parts[0], SILU).T, rtol=2 ** -8, atol=1e-30)


@pytest.mark.parametrize("isa", BF16_ISAS)
def test_nan_passes_through_the_clamps(isa):
    gate = np.full((32, 2), 1.0, np.float32)
    up = np.full((32, 2), 1.0, np.float32)
    gate[3, 0] = np.nan
    up[5, 1] = np.nan
    act = kernels.silu_mul_pack([gate], [up], 0, 32, isa=isa, activation=GPT_OSS).astype(np.float32)
    assert np.isnan(act[0, 3]) and np.isnan(act[1, 5])
    assert np.isfinite(np.delete(act.ravel(), [3, 32 + 5])).all()


@pytest.mark.parametrize("isa", BF16_ISAS)
def test_down_bias_in_combine_and_store(rng, isa):
    hidden, m, n_tokens = 48, 5, 7
    parts = [rng.standard_normal((hidden, m)).astype(np.float32) for _ in range(2)]
    bias = rng.standard_normal(hidden).astype(np.float32)
    index = rng.permutation(n_tokens)[:m]
    weight = rng.random(m).astype(np.float32)
    y = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    start = y.copy()
    kernels.combine_down(parts, 0, hidden, index, weight, y, isa=isa, bias=bias)
    down = (parts[0] + parts[1] + bias[:, None]).T.astype(np.float64)
    expected = start.astype(np.float64)
    expected[index] += weight[:, None] * down
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
    out = np.full((m, hidden), np.nan, np.float32)
    kernels.store_down(parts, 0, hidden, out, isa=isa, bias=bias)
    np.testing.assert_allclose(out, down, rtol=1e-6, atol=1e-6)


def random_expert(rng, fmt, hidden, inter):
    """(float weights, operands) of one expert in `fmt`: bf16 arrays, or quantized."""
    floats = [rng.standard_normal(shape).astype(np.float32) * shape[1] ** -0.5 * 2
              for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    if fmt == "bf16":
        return [f.astype(BF16).astype(np.float64) for f in floats], [f.astype(BF16) for f in floats]
    qms = [quant.quantize(f, fmt, 32, "e8m0" if fmt == "mxfp4" else "fp16") for f in floats]
    return [quant.dequantize(q).astype(np.float64) for q in qms], qms


def ffn64(x, weights, biases, act: Activation, quantized: bool):
    """float64 FFN of the (dequantized) weights, on the kernels' token rule where the
    weights are quantized: tokens quantized per 32 columns for gate / up, the activation
    (rounded to fp32) again for down."""
    gate, up, down = weights
    gate_bias, up_bias, down_bias = biases

    def matmul(w, tokens):
        if not quantized:
            return tokens.astype(np.float64) @ w.T
        q, s = quantize_tokens(tokens.astype(np.float32), 32)
        return (q * np.repeat(s.astype(np.float64), 32, axis=1)) @ w.T

    tokens = x.astype(np.float32)
    a = activation64(matmul(gate, tokens) + gate_bias, matmul(up, tokens) + up_bias, act)
    a = a.astype(np.float32) if quantized else a.astype(BF16).astype(np.float32)
    return matmul(down, a) + down_bias


@pytest.mark.parametrize(("fmt", "isa"), [(fmt, None) for fmt in FORMATS] + FORMAT_ISAS)
@pytest.mark.parametrize(("threads", "m"), [(1, 1), (2, 5), (2, 17)])
def test_expert_ffn_with_the_gpt_oss_block(rng, fmt, isa, threads, m):
    hidden, inter = 128, 96
    weights, operands = random_expert(rng, fmt, hidden, inter)
    biases = [(rng.standard_normal(n) * 2).astype(np.float32) for n in (inter, inter, hidden)]
    x = (rng.standard_normal((m + 2, hidden)) * 2).astype(BF16)
    index = rng.permutation(m + 2)[:m]
    out = np.full((m, hidden), np.nan, np.float32)
    kernels.expert_ffn(x, *operands, token_index=index, out=out, threads=threads, isa=isa, activation="gpt-oss",
                       gate_bias=biases[0], up_bias=biases[1], down_bias=biases[2])
    expected = ffn64(x[index], weights, biases, GPT_OSS, fmt != "bf16")
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < (FFN_BOUND if fmt != "bf16" else 1e-2)
    # the clamps bite: the same call without them differs
    unclamped = np.full_like(out, np.nan)
    kernels.expert_ffn(x, *operands, token_index=index, out=unclamped, threads=threads, isa=isa,
                       activation=Activation(alpha=1.702, up_offset=1.0), gate_bias=biases[0], up_bias=biases[1],
                       down_bias=biases[2])
    assert np.linalg.norm(unclamped - out) / np.linalg.norm(out) > 1e-2


def test_bias_checks(rng):
    _, operands = random_expert(rng, "bf16", 64, 32)
    x = rng.standard_normal((2, 64)).astype(BF16)
    out = np.zeros((2, 64), np.float32)
    call = lambda **kw: kernels.expert_ffn(x, *operands, out=out, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="gate_bias: length 31, expected 32"):
        call(gate_bias=np.zeros(31, np.float32))
    bad = np.zeros(64, np.float32)
    bad[9] = np.inf
    with pytest.raises(ValueError, match="down_bias: entry 9 is not finite"):
        call(down_bias=bad)
    with pytest.raises(ValueError, match=r"up_bias: expected a 1-D vector, got shape \(2, 16\)"):
        call(up_bias=np.zeros((2, 16), np.float32))
    with pytest.raises(TypeError, match="gate_bias: expected floats"):
        call(gate_bias=np.zeros(32, np.int32))
    with pytest.raises(ValueError, match="activation alpha must be finite and > 0"):
        _native.expert_ffn("ref", x.view(np.uint16), np.arange(2), operands[0].view(np.uint16),
                           operands[1].view(np.uint16), operands[2].view(np.uint16), None, None, None, out, 1,
                           alpha=-1.0)
    assert np.all(out == 0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_nodes", [1, 2])
def test_layer_with_gpt_oss_experts(rng, fmt, n_nodes):
    """A layer of biased experts with the clamped SwiGLU on virtual nodes (the node
    partials summed before the biases), against the float64 sum over the routed experts;
    the torch-facing forward gives the same bits, and a layer without biases differs."""
    from numa_moe.placement.segments import SegmentTable
    from numa_moe.placement.topology import Topology

    hidden, inter, n_experts = 128, 96, 4
    experts = [random_expert(rng, fmt, hidden, inter) for _ in range(n_experts)]
    biases = [tuple((rng.standard_normal(n) * 2).astype(np.float32) for n in (inter, inter, hidden))
              for _ in range(n_experts)]
    biases[2] = None  # an expert without biases
    topo = Topology.virtual(n_nodes)
    table_fmt = fmt if fmt != "bf16" else "bf16"
    tables = [{kind: SegmentTable.theoretical(*shape, table_fmt, 4096, topo.node_ids)
               for kind, shape in zip(("gate", "up", "down"), ((inter, hidden), (inter, hidden), (hidden, inter)))}
              for _ in range(n_experts)]
    layer = MoELayer([ops for _, ops in experts], tables, topology=topo, activation="gpt-oss", biases=biases)
    assert layer.activation == GPT_OSS
    n_tokens = 6
    x = (rng.standard_normal((n_tokens, hidden)) * 2).astype(BF16)
    ids = np.array([[0, 1], [2, 3], [1, 0], [3, 3], [0, 2], [1, 3]])
    w = rng.random((n_tokens, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, w, out_dtype="float32")
    zero = (np.zeros(inter), np.zeros(inter), np.zeros(hidden))
    expected = np.zeros((n_tokens, hidden))
    for t in range(n_tokens):
        for j in range(2):
            e = ids[t, j]
            expected[t] += w[t, j] * ffn64(x[[t]], experts[e][0], biases[e] or zero, GPT_OSS, fmt != "bf16")[0]
    assert np.linalg.norm(y - expected) / np.linalg.norm(expected) < (FFN_BOUND if fmt != "bf16" else 1e-2)
    plain = MoELayer([ops for _, ops in experts], tables, topology=topo, activation="gpt-oss")
    y_plain = plain.forward_numpy(x, ids, w, out_dtype="float32")
    assert np.linalg.norm(y_plain - y) / np.linalg.norm(y) > 1e-2


def test_layer_bias_arguments_are_checked(rng):
    from numa_moe.placement.segments import SegmentTable
    from numa_moe.placement.topology import Topology

    hidden, inter = 64, 32
    _, ops = random_expert(rng, "bf16", hidden, inter)
    topo = Topology.virtual(1)
    tables = [{kind: SegmentTable.theoretical(*shape, "bf16", 4096, topo.node_ids)
               for kind, shape in zip(("gate", "up", "down"), ((inter, hidden), (inter, hidden), (hidden, inter)))}]
    with pytest.raises(ValueError, match="biases: 2 entries for 1 experts"):
        MoELayer([ops], tables, topology=topo, biases=[None, None])
    with pytest.raises(ValueError, match=r"biases\[0\]: expected \(gate_bias, up_bias, down_bias\)"):
        MoELayer([ops], tables, topology=topo, biases=[(np.zeros(inter),)])
    with pytest.raises(ValueError, match="expert 0 down_bias: length 32, expected 64"):
        MoELayer([ops], tables, topology=topo, biases=[(None, None, np.zeros(inter))])
    with pytest.raises(ValueError, match="activation 'gelu' is not one of"):
        MoELayer([ops], tables, topology=topo, activation="gelu")

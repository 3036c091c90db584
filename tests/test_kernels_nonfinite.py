"""Tokens holding a NaN or an infinity (docs/quantization.md, "Non-finite activations"):
through integer experts on every ISA their rows come out NaN, whole, never a plausible
number; every other row of the same call is what it is without them, bit for bit; every
ISA's matmul_segments gives ref's bits (the NaNs included), every FFN those of the ISAs
sharing its gate/up epilogue. The bf16 layer propagates them too."""

from __future__ import annotations

import numpy as np
import pytest

from moe_reference import random_bf16
from numa_moe.layer import kernels
from numa_moe.layer.moe_layer import MoELayer
from test_kernels_quant import (BF16, FFN_BOUND, FORMAT_ISAS, FORMATS, ffn_reference, integer_layer, quantize_tokens,
                                random_qm, reference_matmul)

TOKEN_COUNTS = (1, 5, 17)
BAD_VALUES = (np.nan, np.inf, -np.inf)


def poison(rng, x, bad_rows):
    """x with 1 to 3 elements of each bad row set to NaN, +Inf or -Inf (cycling), at random
    columns: sometimes one group of the row, sometimes several."""
    bad_x = x.copy()
    for i, row in enumerate(bad_rows):
        cols = rng.choice(x.shape[1], size=int(rng.integers(1, 4)), replace=False)
        bad_x[row, cols] = BAD_VALUES[i % 3]
    return bad_x


def bad_rows_of(rng, n_rows):
    """At least one row, about a third of them, at random places (one of one row)."""
    n_bad = max(1, n_rows // 3)
    return np.sort(rng.choice(n_rows, size=n_bad, replace=False))


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def bitwise_peer(isa, fmt):
    """The ISA whose FFN output an ISA's equals bit for bit (None where this machine lacks
    it): every matmul_segments gives ref's bits, but the AVX-512 and AMX tables share a
    gate/up epilogue (silu) of their own; avx2 uses ref's. isa None: the per-expert rule,
    whose choices (AMX and AVX-512 where they run, else avx2 or ref) share one epilogue."""
    isa = isa or kernels.fastest_isa(fmt)
    if isa not in ("avx512", "avx512_emulated", "amx_model", "amx"):
        return "ref"
    tested = kernels.tested_isas(fmt)
    return next((peer for peer in ("avx512", "avx512_emulated") if peer in tested), None)


@pytest.mark.parametrize(("fmt", "isa"), FORMAT_ISAS)
@pytest.mark.parametrize("m", [*TOKEN_COUNTS, 33])
def test_matmul_segments_turns_a_non_finite_token_into_nan(rng, fmt, isa, m):
    rows, cols, group = 40, 256, 64
    _, qm = random_qm(rng, rows, cols, fmt, group)
    clean = rng.standard_normal((m, cols)).astype(BF16)
    bad = bad_rows_of(rng, m)
    x = poison(rng, clean, bad)
    good = np.setdiff1d(np.arange(m), bad)
    segments = np.array([[0, 1, rows, 0, cols]], np.int64)
    out = np.zeros((rows, m), np.float32)
    kernels.matmul_segments(qm, segments, x, out, isa=isa)
    assert np.all(np.isnan(out[:, bad])), "a token with a non-finite element must give NaN in every row"
    clean_out = np.zeros_like(out)
    kernels.matmul_segments(qm, segments, clean, clean_out, isa=isa)
    np.testing.assert_array_equal(bits(out[:, good]), bits(clean_out[:, good]))
    x_q, x_s = quantize_tokens(x.astype(np.float32), group)
    expected = reference_matmul(qm, x_q, x_s, np.arange(rows), 0, cols)
    assert np.all(np.isnan(expected[:, bad])) and np.all(np.isfinite(expected[:, good]))
    if good.size:
        assert np.abs(out[:, good] - expected[:, good]).max() / np.abs(expected[:, good]).max() < 1e-5
    ref_out = np.zeros_like(out)
    kernels.matmul_segments(qm, segments, x, ref_out, isa="ref")
    np.testing.assert_array_equal(bits(out), bits(ref_out))


@pytest.mark.parametrize(("fmt", "isa"), FORMAT_ISAS)
@pytest.mark.parametrize("m", TOKEN_COUNTS)
def test_expert_ffn_turns_a_non_finite_token_into_nan(rng, fmt, isa, m):
    """Two threads (the silu rows split on whole groups); each token index twice, so that a
    bad row of x reaches the kernels as two tokens."""
    hidden, inter, group = 256, 384, 128
    qms = [random_qm(rng, r, c, fmt, group)[1] for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
    n_x = max(1, (m + 1) // 2)
    clean = rng.standard_normal((n_x, hidden)).astype(BF16)
    bad_x = bad_rows_of(rng, n_x)
    x = poison(rng, clean, bad_x)
    index = rng.permutation(np.resize(np.arange(n_x), m))
    bad = np.isin(index, bad_x)

    def run(tokens, on):
        out = np.full((m, hidden), 7.0, np.float32)
        kernels.expert_ffn(tokens, *qms, token_index=index, out=out, threads=2, isa=on)
        return out

    out = run(x, isa)
    assert np.all(np.isnan(out[bad])), "a token with a non-finite element must give a NaN row"
    np.testing.assert_array_equal(bits(out[~bad]), bits(run(clean, isa)[~bad]))
    expected = ffn_reference(x, qms, index)
    assert np.all(np.isnan(expected[bad])) and np.all(np.isfinite(expected[~bad]))
    if np.any(~bad):
        assert np.linalg.norm(out[~bad] - expected[~bad]) / np.linalg.norm(expected[~bad]) < FFN_BOUND
    peer = bitwise_peer(isa, fmt)
    if peer is not None:
        np.testing.assert_array_equal(bits(out), bits(run(x, peer)), err_msg=f"against {peer}")


@pytest.mark.parametrize(("fmt", "isa"), FORMAT_ISAS)
def test_expert_ffn_turns_an_intermediate_overflow_into_nan(rng, fmt, isa):
    """A finite token so large that silu(g) * u overflows fp32: the down projection's token
    quantization meets the infinity (not the gather) and must give a NaN row as well."""
    hidden, inter, group, m = 256, 128, 64, 5
    qms = [random_qm(rng, r, c, fmt, group)[1] for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
    clean = rng.standard_normal((m, hidden)).astype(BF16)
    huge = clean.copy()
    huge[2] = (clean[2].astype(np.float32) * 1e25).astype(BF16)  # |g|, |u| ~ 1e25: g * u ~ 1e50
    assert np.all(np.isfinite(huge.astype(np.float32)))

    def run(tokens):
        out = np.full((m, hidden), 7.0, np.float32)
        kernels.expert_ffn(tokens, *qms, out=out, threads=2, isa=isa)
        return out

    out = run(huge)
    assert np.all(np.isnan(out[2]))
    others = np.arange(m) != 2
    np.testing.assert_array_equal(bits(out[others]), bits(run(clean)[others]))
    with np.errstate(over="ignore", invalid="ignore"):
        expected = ffn_reference(huge, qms, np.arange(m))
    assert np.all(np.isnan(expected[2]))
    assert np.linalg.norm(out[others] - expected[others]) / np.linalg.norm(expected[others]) < FFN_BOUND


def routing_through_shared_experts(rng, m, n_experts):
    """Top-2 ids and weights where every expert also serves other tokens (a bad token's
    expert does good tokens' work in the same token block and buffers)."""
    ids = np.stack([rng.choice(n_experts, 2, replace=False) for _ in range(m)]).astype(np.int64)
    return ids, rng.random((m, 2)).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n_nodes", [1, 2])
@pytest.mark.parametrize("m", [*TOKEN_COUNTS, 40])  # 40: experts with more than 16 tokens
def test_layer_turns_a_non_finite_token_into_nan_on_every_isa(rng, fmt, n_nodes, m):
    """Each ISA forced, on one node and on two virtual nodes (the cross-node reduction of
    gate/up and down partials); the per-expert default too. The bad rows' NaN must not
    reach another row through an expert's shared buffers, the reduction or the combine."""
    layer, experts, tables = integer_layer(rng, fmt, n_nodes)
    clean = rng.standard_normal((m, layer.hidden)).astype(BF16)
    bad = bad_rows_of(rng, m)
    x = poison(rng, clean, bad)
    good = np.setdiff1d(np.arange(m), bad)
    ids, w = routing_through_shared_experts(rng, m, len(experts))
    expected = np.array([sum(w[t, j] * ffn_reference(x, experts[ids[t, j]], [t])[0] for j in range(2))
                         for t in range(m)])
    assert np.all(np.isnan(expected[bad])) and np.all(np.isfinite(expected[good]))
    results = {}
    for isa in (None, *kernels.tested_isas(fmt)):
        forced = layer if isa is None else MoELayer(experts, tables, topology=layer.topology, isa=isa)
        y = forced.forward_numpy(x, ids, w, out_dtype="float32")
        assert np.all(np.isnan(y[bad])), f"isa={isa}: rows with a non-finite element must be NaN"
        y_clean = forced.forward_numpy(clean, ids, w, out_dtype="float32")
        np.testing.assert_array_equal(bits(y[good]), bits(y_clean[good]), err_msg=f"isa={isa}")
        if good.size:
            assert np.linalg.norm(y[good] - expected[good]) / np.linalg.norm(expected[good]) < FFN_BOUND, isa
        y_bf16 = forced.forward_numpy(x, ids, w).astype(np.float32)
        assert np.all(np.isnan(y_bf16[bad])), f"isa={isa}: bf16 output"
        results[isa] = y
    for isa, y in results.items():
        peer = bitwise_peer(isa, fmt)
        if peer is not None:
            np.testing.assert_array_equal(bits(y), bits(results[peer]), err_msg=f"isa={isa} against {peer}")


@pytest.mark.parametrize("n_nodes", [1, 2])
@pytest.mark.parametrize("m", TOKEN_COUNTS)
def test_bf16_layer_keeps_non_finite_tokens_to_their_rows(rng, n_nodes, m):
    from numa_moe.placement.segments import SegmentTable
    from numa_moe.placement.topology import Topology

    hidden, inter, n_experts = 128, 192, 3
    experts = [(random_bf16(rng, (inter, hidden), hidden ** -0.5), random_bf16(rng, (inter, hidden), hidden ** -0.5),
                random_bf16(rng, (hidden, inter), inter ** -0.5)) for _ in range(n_experts)]
    topo = Topology.virtual(n_nodes)
    tables = [{kind: SegmentTable.theoretical(*a.shape, "bf16", 4096, topo.node_ids)
               for kind, a in zip(("gate", "up", "down"), e)} for e in experts]
    clean = random_bf16(rng, (m, hidden))
    bad = bad_rows_of(rng, m)
    x = poison(rng, clean, bad)
    good = np.setdiff1d(np.arange(m), bad)
    ids, w = routing_through_shared_experts(rng, m, n_experts)
    for isa in kernels.tested_isas():
        layer = MoELayer(experts, tables, topology=topo, isa=isa)
        y = layer.forward_numpy(x, ids, w, out_dtype="float32")
        assert not np.any(np.isfinite(y[bad])), f"isa={isa}: rows with a non-finite element must stay non-finite"
        y_clean = layer.forward_numpy(clean, ids, w, out_dtype="float32")
        assert np.all(np.isfinite(y_clean))
        np.testing.assert_array_equal(bits(y[good]), bits(y_clean[good]), err_msg=f"isa={isa}")

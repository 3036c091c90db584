"""The large-M paths against float64 references, just below, at and above each threshold:
the pipeline's split of an expert by tokens (engine/pipeline.hpp, token_split_block: one
node, from kTokenBlock x 2 tokens a thread) and the AVX-512 token-lane kernel's token
blocks (above 256 tokens in one matmul_segments call). Odd and unaligned shapes, strided
segments, one expert taking every token, virtual topologies (which split rows, not
tokens), and the thread-count independence the fixed blocks keep."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe_reference import moe_reference, random_bf16, random_partition_table, rel_error, whole_matrix_table
from numa_moe import _native
from numa_moe.layer import kernels
from numa_moe.layer.moe_layer import MoELayer
from test_kernels import BF16, FFN_TOL_BF16, FFN_TOL_F32, MATMUL_TOL, ffn_reference, random_expert, rel_fro

CPUS = sorted(os.sched_getaffinity(0))
# Scalar and emulated ISAs are slow at these token counts: the fast ones take every case.
FAST_ISAS = [isa for isa in kernels.available_isas() if isa in ("avx512", "avx2", "amx")]
KERNEL_TOKEN_BLOCK = 256  # avx512_bf16.cpp, kLaneTokenBlock


def split_threshold(threads: int) -> int:
    """The fewest tokens an expert is split by tokens at, found through the rule itself."""
    m = 1
    while _native.token_split_block(m, threads, True) == 0:
        m += 1
    return m


def test_the_blocking_rule():
    block = _native.token_split_block(1 << 20, 1, True)
    assert block > 0 and block % 16 == 0
    for threads in (1, 2, 3, 8):
        first = split_threshold(threads)
        assert first == 2 * block * threads  # two blocks a thread at least, so threads share them evenly
        assert _native.token_split_block(first - 1, threads, True) == 0
        assert _native.token_split_block(first, threads, True) == block
        assert _native.token_split_block(first + 1, threads, True) == block
        # several nodes: rows are split whatever m is
        assert _native.token_split_block(1 << 20, threads, False) == 0
    # decode never splits by tokens
    assert all(_native.token_split_block(m, 1, True) == 0 for m in range(1, 17))


def _cases():
    cases = []
    for threads in (1, 2):
        first = 2 * _native.token_split_block(1 << 20, 1, True) * threads
        for m in (first - 1, first, first + 1, first + 3 * 128 + 37):
            cases.append((threads, m))
    return cases


@pytest.mark.parametrize("isa", FAST_ISAS)
@pytest.mark.parametrize("threads,m", _cases())
def test_expert_ffn_at_the_token_split_threshold(isa, threads, m, rng):
    # odd multiples of 2 (the MoE layer needs even sizes), off every 16/32 grid
    hidden, inter = 130, 94
    x, wg, wu, wd = random_expert(rng, hidden, inter, n_tokens=m + 5)
    index = rng.permutation(m + 5)[:m]
    out = np.full((m, hidden), np.nan, dtype=np.float32)
    kernels.expert_ffn(x, wg, wu, wd, token_index=index, isa=isa, threads=threads, out=out)
    assert rel_fro(out, ffn_reference(x, wg, wu, wd, index)) < FFN_TOL_F32


@pytest.mark.parametrize("isa", FAST_ISAS)
def test_expert_ffn_split_by_tokens_odd_shapes_and_bf16_out(isa, rng):
    hidden, inter, m = 129, 97, split_threshold(2) + 50
    x, wg, wu, wd = random_expert(rng, hidden, inter, n_tokens=m)
    out = np.full((m, hidden), np.nan, dtype=BF16)
    kernels.expert_ffn(x, wg, wu, wd, isa=isa, threads=2, out=out)
    assert rel_fro(out, ffn_reference(x, wg, wu, wd, np.arange(m))) < FFN_TOL_BF16


@pytest.mark.parametrize("isa", FAST_ISAS)
def test_expert_ffn_split_by_tokens_over_strided_segments(isa, rng):
    """The segments of a token-split expert: strided rows and column pieces with odd edges."""
    hidden, inter, m = 128, 96, split_threshold(2) + 17
    x, wg, wu, wd = random_expert(rng, hidden, inter, n_tokens=m)
    gate = np.array([[0, 2, inter // 2, 0, 63], [0, 2, inter // 2, 63, hidden], [1, 2, inter // 2, 0, hidden]])
    down = np.array([[0, 3, 43, 0, inter], [1, 3, 43, 0, 41], [1, 3, 43, 41, inter], [2, 3, 42, 0, inter]])
    out = np.full((m, hidden), np.nan, dtype=np.float32)
    kernels.expert_ffn(x, wg, wu, wd, isa=isa, threads=2, out=out, gate_segments=gate, up_segments=gate,
                       down_segments=down)
    assert rel_fro(out, ffn_reference(x, wg, wu, wd, np.arange(m))) < FFN_TOL_F32


def test_results_do_not_depend_on_the_thread_count(rng):
    """The token blocks are fixed by m alone: 1, 2 and 3 threads give the same bits."""
    hidden, inter, m = 128, 96, split_threshold(3) + 40
    x, wg, wu, wd = random_expert(rng, hidden, inter, n_tokens=m)
    outs = [kernels.expert_ffn(x, wg, wu, wd, threads=threads, out_dtype=np.float32) for threads in (1, 2, 3)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.skipif("avx512" not in kernels.available_isas(), reason="no AVX-512 on this CPU")
@pytest.mark.parametrize("m", [KERNEL_TOKEN_BLOCK - 1, KERNEL_TOKEN_BLOCK, KERNEL_TOKEN_BLOCK + 1,
                               2 * KERNEL_TOKEN_BLOCK + 41])
def test_lane_kernel_token_blocks(m, rng):
    """One matmul_segments call of more than kLaneTokenBlock tokens: strided segments, column
    edges off the 2P grid, a row range; rows outside it untouched."""
    rows, k = 70, 203
    w = random_bf16(rng, (rows, k), k ** -0.5)
    x = random_bf16(rng, (m, k), 1.0)
    segments = np.array([[0, 2, 35, 0, 101], [0, 2, 35, 101, k], [1, 2, 35, 3, 199]])
    row_begin, row_end = 5, 66
    out = rng.standard_normal((rows, m)).astype(np.float32)
    start = out.copy()
    kernels.matmul_segments(w, segments, x, out, isa="avx512", row_begin=row_begin, row_end=row_end)
    expected = start.astype(np.float64)
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    for row0, stride, nrows, k0, k1 in segments:
        for r in range(row0, row0 + stride * nrows, stride):
            if row_begin <= r < row_end:
                expected[r] += w64[r, k0:k1] @ x64[:, k0:k1].T
    assert rel_fro(out, expected) < MATMUL_TOL
    np.testing.assert_array_equal(out[:row_begin], start[:row_begin])
    np.testing.assert_array_equal(out[row_end:], start[row_end:])


def _layer(weights, n_nodes, rng, threads_per_node):
    gates, ups, downs = weights
    nodes = tuple(range(n_nodes))
    tables = []
    for e in range(len(gates)):
        tables.append({name: (whole_matrix_table(*w.shape) if n_nodes == 1 else
                              random_partition_table(*w.shape, nodes, rng))
                       for name, w in (("gate", gates[e]), ("up", ups[e]), ("down", downs[e]))})
    cpus = [[CPUS[(n * threads_per_node + i) % len(CPUS)] for i in range(threads_per_node)] for n in range(n_nodes)]
    return MoELayer(list(zip(gates, ups, downs)), tables, node_cpus=(nodes, cpus))


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_layer_with_one_expert_taking_every_token(offset, rng):
    """Top-2 routing where expert 2 is in every token's pair: it has T tokens, just below, at
    or above the split threshold of 2 threads; 1 node (split by tokens) and 2 virtual nodes
    (split by rows) against the float64 reference and each other."""
    hidden, inter, n_experts = 130, 98, 5
    weights = ([random_bf16(rng, (inter, hidden), hidden ** -0.5) for _ in range(n_experts)],
               [random_bf16(rng, (inter, hidden), hidden ** -0.5) for _ in range(n_experts)],
               [random_bf16(rng, (hidden, inter), inter ** -0.5) for _ in range(n_experts)])
    n_tokens = split_threshold(2) + offset
    x = random_bf16(rng, (n_tokens, hidden), 1.0)
    others = rng.choice([0, 1, 3, 4], size=n_tokens)
    ids = np.stack([np.full(n_tokens, 2), others], axis=1).astype(np.int64)
    w = rng.random((n_tokens, 2)).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    expected = moe_reference(x, ids, w, *weights)
    one_node = _layer(weights, 1, rng, threads_per_node=2)
    y1 = one_node.forward_numpy(x, ids, w, out_dtype="float32")
    assert rel_error(y1, expected) < 1e-2
    two_nodes = _layer(weights, 2, rng, threads_per_node=1)
    y2 = two_nodes.forward_numpy(x, ids, w, out_dtype="float32")
    assert rel_error(y2, expected) < 1e-2
    assert rel_error(y1, y2) < 2e-3


def test_layer_where_one_expert_takes_all_tokens_alone(rng):
    """Top-1 routing to a single expert well above the threshold, bf16 output, against the
    reference; several token-split blocks dealt to the threads."""
    hidden, inter, n_experts = 128, 96, 3
    weights = ([random_bf16(rng, (inter, hidden), hidden ** -0.5) for _ in range(n_experts)],
               [random_bf16(rng, (inter, hidden), hidden ** -0.5) for _ in range(n_experts)],
               [random_bf16(rng, (hidden, inter), inter ** -0.5) for _ in range(n_experts)])
    n_tokens = 3 * split_threshold(2) + 77
    x = random_bf16(rng, (n_tokens, hidden), 1.0)
    ids = np.full((n_tokens, 1), 1, dtype=np.int64)
    w = np.ones((n_tokens, 1), dtype=np.float32)
    layer = _layer(weights, 1, rng, threads_per_node=2)
    y = layer.forward_numpy(x, ids, w)
    assert rel_error(y, moe_reference(x, ids, w, *weights)) < 1e-2
    assert layer.last_stats()["n_active_experts"] == 1


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_integer_expert_split_by_tokens_matches_the_quantized_reference(fmt, rng):
    """int8 / int4 weights through the token split: each block quantizes its own tokens per
    group, which is per token, so the quantized reference of all tokens at once holds."""
    from test_kernels_quant import FFN_BOUND, ffn_reference as quantized_reference, random_qm

    hidden, inter, group = 256, 192, 64
    m = split_threshold(2) + 21
    qms = [random_qm(rng, r, c, fmt, group)[1] for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
    x = rng.standard_normal((m + 3, hidden)).astype(BF16)
    index = rng.permutation(m + 3)[:m]
    out = np.full((m, hidden), np.nan, np.float32)
    kernels.expert_ffn(x, *qms, token_index=index, out=out, threads=2)
    expected = quantized_reference(x, qms, index)
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < FFN_BOUND


@pytest.mark.parametrize("budget", [None, 1])
def test_layer_token_split_beside_row_split_on_strided_segments(budget, rng):
    """One node whose tables cut every matrix into strided segments, an expert above the
    split threshold beside small ones (the arena then holds only the split expert's down
    partial between the small experts' operands); with a budget of 1 byte every expert is
    a pool run of its own."""
    hidden, inter, n_experts = 128, 96, 4
    weights = ([random_bf16(rng, (inter, hidden), hidden ** -0.5) for _ in range(n_experts)],
               [random_bf16(rng, (inter, hidden), hidden ** -0.5) for _ in range(n_experts)],
               [random_bf16(rng, (hidden, inter), inter ** -0.5) for _ in range(n_experts)])
    gates, ups, downs = weights
    tables = [{name: random_partition_table(*w.shape, (0,), rng)
               for name, w in (("gate", gates[e]), ("up", ups[e]), ("down", downs[e]))} for e in range(n_experts)]
    layer = MoELayer(list(zip(gates, ups, downs)), tables, node_cpus=((0,), [[CPUS[0], CPUS[-1]]]))
    if budget is not None:
        layer._core.set_group_budget_bytes(budget)
    n_tokens = split_threshold(2) + 30
    x = random_bf16(rng, (n_tokens, hidden), 1.0)
    ids = np.stack([np.full(n_tokens, 3), rng.choice(3, size=n_tokens)], axis=1).astype(np.int64)
    w = rng.random((n_tokens, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, w, out_dtype="float32")
    assert rel_error(y, moe_reference(x, ids, w, *weights)) < 1e-2

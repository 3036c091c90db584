"""MoELayer against an independent float64 reference, on virtual topologies of 1-4
nodes with random and interleave-rule segment tables (numpy path; torch in
test_moe_torch.py)."""

import os

import numpy as np
import pytest

from moe_reference import (BF16, ExplicitTable, interleave_rule_table, moe_reference, random_bf16,
                           random_partition_table, rel_error, whole_matrix_table)
from numa_moe.layer.moe_layer import MoELayer

CPUS = sorted(os.sched_getaffinity(0))
H, I, E = 128, 96, 6
# bf16 inputs, fp32 accumulation, the activation rounded to bf16 before down and the
# output rounded to bf16: each rounding is <= 2^-9 relative, so against the float64
# reference the relative Frobenius error stays well below 1e-2.
TOL_REF = 1e-2


def node_cpus(n_nodes, threads_per_node=1):
    return (tuple(range(n_nodes)),
            [[CPUS[(n * threads_per_node + i) % len(CPUS)] for i in range(threads_per_node)] for n in range(n_nodes)])


def make_weights(rng, n_experts=E, hidden=H, inter=I):
    gates = [random_bf16(rng, (inter, hidden), hidden ** -0.5) for _ in range(n_experts)]
    ups = [random_bf16(rng, (inter, hidden), hidden ** -0.5) for _ in range(n_experts)]
    downs = [random_bf16(rng, (hidden, inter), inter ** -0.5) for _ in range(n_experts)]
    return gates, ups, downs


def make_layer(weights, n_nodes, rng=None, kind="random", threads_per_node=1, **kwargs):
    gates, ups, downs = weights
    nodes = tuple(range(n_nodes))
    tables = []
    for e in range(len(gates)):
        t = {}
        for name, w in (("gate", gates[e]), ("up", ups[e]), ("down", downs[e])):
            if kind == "whole":
                t[name] = whole_matrix_table(*w.shape)
            elif kind == "random":
                t[name] = random_partition_table(*w.shape, nodes, rng)
            else:
                t[name] = interleave_rule_table(*w.shape, nodes, page_bytes=kind, phase=e % n_nodes,
                                                offset_bytes=(e * 3 * 2 * H * I) % 4096)
        tables.append(t)
    return MoELayer(list(zip(gates, ups, downs)), tables, node_cpus=node_cpus(n_nodes, threads_per_node),
                    **kwargs)


def routing(rng, n_tokens, top_k, n_experts=E):
    ids = np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_tokens)]).astype(np.int64)
    w = rng.random((n_tokens, top_k)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("n_nodes", [1, 2, 3, 4])
def test_partitioned_layer_matches_reference_and_unpartitioned(rng, n_nodes):
    weights = make_weights(rng)
    x = random_bf16(rng, (7, H))
    ids, w = routing(rng, 7, 2)
    whole = make_layer(weights, 1, kind="whole")
    part = make_layer(weights, n_nodes, rng, kind="random", threads_per_node=len(CPUS))
    expected = moe_reference(x, ids, w, *weights)
    y_whole = whole.forward_numpy(x, ids, w, out_dtype="float32")
    y_part = part.forward_numpy(x, ids, w, out_dtype="float32")
    assert rel_error(y_whole, expected) < TOL_REF
    assert rel_error(y_part, expected) < TOL_REF
    # Only the fp32 summation order (and, rarely, a bf16 rounding of the activation)
    # differs between the partitioned and the single-node path.
    assert rel_error(y_part, y_whole) < 2e-3
    y_bf16 = part.forward_numpy(x, ids, w)
    assert y_bf16.dtype == BF16
    assert rel_error(y_bf16, expected) < TOL_REF


@pytest.mark.parametrize("hidden", [256, 272, 1024])
@pytest.mark.parametrize("n_nodes", [1, 2])
def test_layer_sum_rows_at_any_hidden_size(rng, hidden, n_nodes):
    """The layer's fp32 sum y has rows spread_row_bytes apart (one line more than the
    hidden size where that is a multiple of 1 KiB: 256 and 1024 fp32 columns, not 272);
    the combine writes and the output copy read them at that stride. Experts of 20+
    tokens fill whole 16 x 16 combine tiles."""
    weights = make_weights(rng, n_experts=3, hidden=hidden, inter=64)
    layer = make_layer(weights, n_nodes, rng, kind="random")
    T = 40
    x = random_bf16(rng, (T, hidden))
    ids, w = routing(rng, T, 2, n_experts=3)
    expected = moe_reference(x, ids, w, *weights)
    for out_dtype in ("float32", None):
        y = layer.forward_numpy(x, ids, w, **({"out_dtype": out_dtype} if out_dtype else {}))
        assert y.shape == (T, hidden)
        assert rel_error(y, expected) < TOL_REF, out_dtype


@pytest.mark.parametrize("n_nodes,page", [(2, 4096), (3, 4096), (4, 4096), (2, 2048)])
def test_interleave_rule_tables_with_phase(rng, n_nodes, page):
    weights = make_weights(rng)
    layer = make_layer(weights, n_nodes, kind=page)
    x = random_bf16(rng, (4, H))
    ids, w = routing(rng, 4, 3)
    assert rel_error(layer.forward_numpy(x, ids, w, out_dtype="float32"), moe_reference(x, ids, w, *weights)) < TOL_REF


def test_routing_corner_cases(rng):
    weights = make_weights(rng)
    layer = make_layer(weights, 3, rng, threads_per_node=2)
    T = 9
    x = random_bf16(rng, (T, H))
    # experts 1 and 4 get no token; expert 2 takes every token
    # every one of 0, 3, 5 appears (in random order), so exactly 4 experts are active
    ids = np.stack([np.full(T, 2), rng.permutation(np.resize([0, 3, 5], T))], axis=1).astype(np.int64)
    w = rng.random((T, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, w, out_dtype="float32")
    assert rel_error(y, moe_reference(x, ids, w, *weights)) < TOL_REF
    stats = layer.last_stats()
    assert stats["n_active_experts"] == 4
    # duplicate ids in a row: both listings count (weights summed)
    ids_dup = ids.copy()
    ids_dup[::2, 1] = 2
    y = layer.forward_numpy(x, ids_dup, w, out_dtype="float32")
    assert rel_error(y, moe_reference(x, ids_dup, w, *weights)) < TOL_REF
    assert layer.last_stats()["n_slots"] == T + (T - (T + 1) // 2)


def test_single_token_and_many_tokens(rng):
    weights = make_weights(rng)
    layer = make_layer(weights, 2, rng, threads_per_node=2)
    for T in (1, 40):
        x = random_bf16(rng, (T, H))
        ids, w = routing(rng, T, 4)
        assert rel_error(layer.forward_numpy(x, ids, w), moe_reference(x, ids, w, *weights)) < TOL_REF


def test_small_group_budget_splits_the_step_without_changing_the_result(rng):
    weights = make_weights(rng)
    layer = make_layer(weights, 2, rng)
    x = random_bf16(rng, (6, H))
    ids, w = routing(rng, 6, 3)
    y_one = layer.forward_numpy(x, ids, w, out_dtype="float32")
    layer._core.set_group_budget_bytes(1)  # one expert per pool run
    y_split = layer.forward_numpy(x, ids, w, out_dtype="float32")
    np.testing.assert_array_equal(y_split, y_one)


def test_one_node_combines_each_expert_after_its_down_projection_in_expert_order(rng):
    """On one node each thread combines an expert's down partial right after computing it
    (the fused epilogue): the sum must be the float64 reference's, and bit-identical with one
    thread, two threads, and one pool run per expert (y cleared by the first group, written
    out by the last)."""
    weights = make_weights(rng)
    x = random_bf16(rng, (24, H))
    ids, w = routing(rng, 24, 3)
    results = []
    tables_rng_state = rng.bit_generator.state
    for threads, budget in ((1, None), (2, None), (2, 1)):
        rng.bit_generator.state = tables_rng_state  # the same tables every time
        layer = make_layer(weights, 1, rng, threads_per_node=threads)
        if budget is not None:
            layer._core.set_group_budget_bytes(budget)
        results.append(layer.forward_numpy(x, ids, w, out_dtype="float32"))
    assert rel_error(results[0], moe_reference(x, ids, w, *weights)) < TOL_REF
    for y in results[1:]:
        np.testing.assert_array_equal(y, results[0])


def test_deterministic_and_independent_of_thread_count(rng):
    weights = make_weights(rng)
    tables_rng_state = rng.bit_generator.state
    one = make_layer(weights, 2, rng, threads_per_node=1)
    rng.bit_generator.state = tables_rng_state
    many = make_layer(weights, 2, rng, threads_per_node=max(2, len(CPUS)))
    x = random_bf16(rng, (5, H))
    ids, w = routing(rng, 5, 2)
    a = one.forward_numpy(x, ids, w, out_dtype="float32")
    b = one.forward_numpy(x, ids, w, out_dtype="float32")
    c = many.forward_numpy(x, ids, w, out_dtype="float32")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("n_nodes", [1, 2])
def test_the_same_bits_whichever_thread_claims_which_rows(rng, n_nodes):
    """A node's threads claim its row chunks in turn, so which thread computes which rows
    changes from call to call (here: one CPU shared with a busy process, which delays its
    thread at random); every chunk's result must not, nor the fused combine's order."""
    import subprocess
    import sys

    weights = make_weights(rng, inter=256)
    layer = make_layer(weights, n_nodes, rng, threads_per_node=2)
    x = random_bf16(rng, (7, H))
    ids, w = routing(rng, 7, 3)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(busy.pid, {CPUS[0]})
        first = layer.forward_numpy(x, ids, w, out_dtype="float32")
        for _ in range(30):
            np.testing.assert_array_equal(layer.forward_numpy(x, ids, w, out_dtype="float32"), first)
    finally:
        busy.kill()
        busy.wait()
    assert rel_error(first, moe_reference(x, ids, w, *weights)) < TOL_REF


def test_rows_are_split_over_a_nodes_threads_by_bytes(rng):
    weights = make_weights(rng, n_experts=1, inter=256)
    nodes = (0, 1)
    # node 0 holds columns [0, 32) of every row, node 1 the rest
    tables = [{k: ExplicitTable(nodes, {0: [(0, 1, w.shape[0], 0, 32)], 1: [(0, 1, w.shape[0], 32, w.shape[1])]})
               for k, w in zip(("gate", "up", "down"), (weights[0][0], weights[1][0], weights[2][0]))}]
    layer = MoELayer(list(zip(*weights)), tables, node_cpus=(nodes, [[CPUS[0]] * 2, [CPUS[-1]] * 2]))
    for node in (0, 1):
        ranges = layer._core.thread_rows(0, "gate")[node]
        assert ranges[0][0] == 0 and ranges[-1][1] == 256
        assert ranges[0][1] == ranges[1][0] == 128
    assert layer._core.node_bytes(0, "gate") == [256 * 32 * 2, 256 * (H - 32) * 2]
    x = random_bf16(rng, (3, H))
    ids = np.zeros((3, 1), dtype=np.int64)
    w = np.ones((3, 1), dtype=np.float32)
    assert rel_error(layer.forward_numpy(x, ids, w), moe_reference(x, ids, w, *weights)) < TOL_REF


def test_bad_tables_are_rejected(rng):
    weights = make_weights(rng, n_experts=1)
    nodes = (0, 1)
    gate, up, down = (w[0] for w in weights)
    good = {"gate": whole_matrix_table(*gate.shape), "up": whole_matrix_table(*up.shape),
            "down": whole_matrix_table(*down.shape)}
    cpus = (nodes, [[CPUS[0]], [CPUS[-1]]])
    overlap = dict(good, up=ExplicitTable(nodes, {0: [(0, 1, I, 0, H)], 1: [(5, 1, 1, 0, 64)]}))
    with pytest.raises(ValueError, match="row 5 columns \\[0, 64\\) are covered twice"):
        MoELayer([(gate, up, down)], [overlap], node_cpus=cpus)
    gap = dict(good, down=ExplicitTable(nodes, {0: [(0, 1, H, 0, I - 2)]}))
    with pytest.raises(ValueError, match=f"not covered"):
        MoELayer([(gate, up, down)], [gap], node_cpus=cpus)
    outside = dict(good, gate=ExplicitTable(nodes, {0: [(0, 1, I + 1, 0, H)]}))
    with pytest.raises(ValueError, match="lies outside"):
        MoELayer([(gate, up, down)], [outside], node_cpus=cpus)
    foreign = dict(good, gate=ExplicitTable((0, 7), {0: [(0, 1, I, 0, H)]}))
    with pytest.raises(ValueError, match="node\\(s\\) \\[7\\]"):
        MoELayer([(gate, up, down)], [foreign], node_cpus=cpus)


def test_bad_inputs_are_rejected(rng):
    weights = make_weights(rng, n_experts=3)
    layer = make_layer(weights, 2, rng)
    x = random_bf16(rng, (4, H))
    ids, w = routing(rng, 4, 2, n_experts=3)
    bad_ids = ids.copy()
    bad_ids[2, 1] = 3
    with pytest.raises(ValueError, match=r"topk_ids\[2, 1\] = 3 is out of range \[0, 3\)"):
        layer.forward_numpy(x, bad_ids, w)
    with pytest.raises(ValueError, match="hidden size is 128"):
        layer.forward_numpy(random_bf16(rng, (4, 64)), ids, w)
    with pytest.raises(TypeError, match="expected bf16"):
        layer.forward_numpy(x.astype(np.float32), ids, w)
    with pytest.raises(ValueError, match="contiguous"):
        layer.forward_numpy(random_bf16(rng, (H, 4)).T, ids, w)
    with pytest.raises(ValueError, match="shape"):
        layer.forward_numpy(x, ids[:3], w)
    with pytest.raises(TypeError, match="integer"):
        layer.forward_numpy(x, ids.astype(np.float32), w)
    with pytest.raises(ValueError, match="NaN"):
        layer.forward_numpy(x, ids, np.full_like(w, np.nan))
    # the native layer checks on its own too
    with pytest.raises(ValueError, match="out of range"):
        layer._core.forward(x.view(np.uint16), bad_ids, w, np.empty((4, H), np.float32))


def test_non_integer_topk_ids_are_refused_not_truncated(rng):
    weights = make_weights(rng, n_experts=3)
    layer = make_layer(weights, 2, rng)
    x = random_bf16(rng, (2, H))
    ids, w = routing(rng, 2, 2, n_experts=3)
    for bad, dtype in ((ids + 0.5, "float64"), ((ids + 0.25).tolist(), "float64"), (ids > 0, "bool")):
        with pytest.raises(TypeError, match=f"topk_ids: expected integers, got dtype {dtype}"):
            layer.forward_numpy(x, bad, w)
    expected = layer.forward_numpy(x, ids, w)
    for same in (ids.astype(np.uint8), ids.astype(np.int32), ids.tolist()):
        np.testing.assert_array_equal(layer.forward_numpy(x, same, w).view(np.uint16), expected.view(np.uint16))


def test_inputs_that_need_converting_give_the_direct_path_result(rng):
    """forward_numpy hands int64 / float32 C-contiguous routing and bfloat16 hidden states
    to the native layer as they are, and converts anything else first: both must give the
    same bits, and the reference's result."""
    weights = make_weights(rng, n_experts=3)
    layer = make_layer(weights, 2, rng)
    x = random_bf16(rng, (5, H))
    ids, w = routing(rng, 5, 2, n_experts=3)
    direct = layer.forward_numpy(x, ids, w)
    assert rel_error(direct, moe_reference(x, ids, w, *weights)) < TOL_REF
    wide_ids = np.zeros((5, 4), np.int64)
    wide_ids[:, ::2] = ids
    wide_w = np.zeros((5, 4), np.float32)
    wide_w[:, ::2] = w
    converted = ((x, wide_ids[:, ::2], w), (x, ids, wide_w[:, ::2]), (x, ids, w.astype(np.float64)),
                 (x.view(np.uint16), ids, w), (x, ids.astype(">i8"), w))
    for args in converted:
        np.testing.assert_array_equal(layer.forward_numpy(*args).view(np.uint16), direct.view(np.uint16))


def test_isa_rule_and_forcing(rng):
    weights = make_weights(rng, n_experts=2)
    layer = make_layer(weights, 1, kind="whole")
    assert layer._core.isa_for_tokens(1) in ("amx", "avx512", "avx2", "ref")
    forced = make_layer(weights, 1, kind="whole", isa="ref")
    x = random_bf16(rng, (2, H))
    ids = np.array([[0], [1]])
    w = np.ones((2, 1), np.float32)
    forced.forward_numpy(x, ids, w)
    assert forced.last_stats()["expert_isa"] == ["ref", "ref"]
    with pytest.raises(ValueError, match="unknown ISA"):
        make_layer(weights, 1, kind="whole", isa="sse9")


def test_isa_environment_variable_goes_through_the_kernels_rule(rng, monkeypatch):
    """The layer reads NUMA_MOE_ISA through numa_moe.layer.kernels, so a bad value is refused
    with the kernels' message naming the variable, and a good one forces every expert."""
    weights = make_weights(rng, n_experts=2)
    monkeypatch.setenv("NUMA_MOE_ISA", "sse9")
    with pytest.raises(ValueError, match="NUMA_MOE_ISA=sse9 is not one of"):
        make_layer(weights, 1, kind="whole")
    monkeypatch.setenv("NUMA_MOE_ISA", "ref")
    layer = make_layer(weights, 1, kind="whole")
    assert layer.isa == "ref" and layer.isa_for_tokens(64) == "ref"
    layer.forward_numpy(random_bf16(rng, (2, H)), np.array([[0], [1]]), np.ones((2, 1), np.float32))
    assert layer.last_stats()["expert_isa"] == ["ref", "ref"]
    monkeypatch.setenv("NUMA_MOE_ISA", "")
    assert make_layer(weights, 1, kind="whole").isa is None


def test_bad_constructor_inputs_name_the_problem(rng):
    gates, ups, downs = make_weights(rng, n_experts=2)
    stacked_gate_up = np.stack([np.concatenate([g, u]) for g, u in zip(gates, ups)])
    stacked_down = np.stack(downs)
    with pytest.raises(ValueError, match=r"no experts.*\[0, 192, 128\]"):
        MoELayer.from_tensors(stacked_gate_up[:0], stacked_down[:0], tables="theoretical",
                              node_cpus=node_cpus(1))
    with pytest.raises(ValueError, match=r"gate\[1\].*\[94, 128\].*gate\[0\].*\[96, 128\]"):
        MoELayer.from_tensors(gate=[gates[0], gates[1][:-2]], up=ups, down=downs, tables="theoretical",
                              node_cpus=node_cpus(1))
    layer = make_layer((gates, ups, downs), 1, kind="whole")
    ids, w = routing(rng, 2, 1, n_experts=2)
    with pytest.raises(ValueError, match="out_dtype"):
        layer.forward_numpy(random_bf16(rng, (2, H)), ids, w, out_dtype="float16")


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_every_output_element_is_written_into_a_poisoned_buffer(rng, out_dtype):
    # forward_numpy allocates with np.empty, whose leftovers could hide an unwritten
    # slice under a norm-wise error; here the native step writes into a NaN-filled
    # buffer, with more threads than the h ranges comfortably split into, and every
    # element is compared on its own. The bound is TOL_REF of the output's scale:
    # per element the bf16 roundings of the activation and output stay far below it.
    weights = make_weights(rng)
    layer = make_layer(weights, 3, rng, threads_per_node=3)
    T = 5
    x = random_bf16(rng, (T, H))
    ids, w = routing(rng, T, 3)
    ids[0, :] = ids[0, 0]  # a duplicate-only row
    expected = moe_reference(x, ids, w, *weights)
    scale = np.abs(expected).max()
    for k in (3, 0):
        if out_dtype == "float32":
            out = np.full((T, H), np.nan, np.float32)
        else:
            out = np.full((T, H), np.nan, np.float32).astype(BF16)
        layer._core.forward(x.view(np.uint16), np.ascontiguousarray(ids[:, :k]),
                            np.ascontiguousarray(w[:, :k]), out if out_dtype == "float32" else out.view(np.uint16))
        got = out.astype(np.float64)
        assert np.all(np.isfinite(got)), f"k={k}: unwritten elements at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
        want = expected if k else np.zeros_like(expected)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL_REF * scale)


def test_expert_weight_bytes_per_node_counts_each_nodes_segments(rng):
    weights = make_weights(rng, n_experts=2)
    layer = make_layer(weights, 3, rng)
    for e in range(2):
        expected = {n: 0 for n in range(3)}
        for kind in ("gate", "up", "down"):
            table = layer.tables[e][kind]
            for n in range(3):
                segs = np.asarray(table.node_array(n)).reshape(-1, 5) if n in table.nodes else np.zeros((0, 5))
                expected[n] += int((segs[:, 2] * (segs[:, 4] - segs[:, 3])).sum()) * 2
        got = layer.expert_weight_bytes_per_node(e)
        assert got == expected
        assert sum(got.values()) == 3 * H * I * 2

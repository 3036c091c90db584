"""GQA decode attention on every ISA this CPU runs (AMX through its software model where
the CPU lacks it) against the float64 reference: contexts 1 to 4097, group sizes 1 to 20,
batches of different lengths, sliding windows, paged caches, the cross-node split over
virtual topologies, and bad input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from attention_reference import error_bound, reference_decode
from numa_moe.layer import attention
from numa_moe.placement.topology import Topology

BF16 = np.dtype(ml_dtypes.bfloat16)
ISAS = attention.tested_isas()


def random_case(rng, batch, q_heads, kv_heads, capacity, head_dim, q_scale=1.0):
    q = (rng.standard_normal((batch, q_heads, head_dim)) * q_scale).astype(BF16)
    k = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(BF16)
    v = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(BF16)
    return q, k, v


def assert_close(out, ref, bound):
    err = np.abs(np.asarray(out, dtype=np.float64) - ref).max()
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"


def test_isas_listed():
    assert "ref" in ISAS
    assert attention.default_isa() in ISAS


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("context", [1, 7, 64, 1000, 4097])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_contexts_and_groups(rng, isa, context, group):
    kv_heads = 2
    q, k, v = random_case(rng, 2, kv_heads * group, kv_heads, context, 128)
    lengths = [context, max(1, context // 3)]  # one batch, different lengths
    out = attention.gqa_decode(q, k, v, lengths, isa=isa, out_dtype=np.float32)
    assert_close(out, reference_decode(q, k, v, lengths), error_bound(isa, v))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_head_dims_groups_beyond_a_tile(rng, isa, head_dim):
    # 20 queries per KV head: two query blocks (16 + 4); bf16 output
    q, k, v = random_case(rng, 3, 40, 2, 150, head_dim)
    lengths = [150, 33, 1]
    out = attention.gqa_decode(q, k, v, lengths, isa=isa)
    assert out.dtype == BF16
    assert_close(out, reference_decode(q, k, v, lengths), error_bound(isa, v, out_bf16=True))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", range(1, 17))
def test_every_group_size(rng, isa, group):
    # Every block width has its own code: avx512 pads the block to 1, 2, 4, 8 or 16 query
    # lanes for q.k and multiplies P.V in blocks of up to 8 queries. One thread, so that a
    # run spans several chunks (the prefetch of the next one); 333 and 70 end inside a
    # 16-row block and on an odd position; odd groups get scores of tens.
    head_dim = (64, 128, 256)[group % 3]
    q, k, v = random_case(rng, 2, 2 * group, 2, 333, head_dim, q_scale=4.0 if group % 2 else 1.0)
    lengths = [333, 70]
    out = attention.gqa_decode(q, k, v, lengths, isa=isa, threads=1, out_dtype=np.float32)
    assert_close(out, reference_decode(q, k, v, lengths), error_bound(isa, v))


@pytest.mark.parametrize("isa", ISAS)
def test_peaked_scores_window_and_empty_sequence(rng, isa):
    # large query norms: scores of tens, so the running max must be right
    q, k, v = random_case(rng, 4, 8, 2, 700, 128, q_scale=6.0)
    lengths = [700, 0, 65, 300]
    for window in (0, 1, 64, 129):
        out = attention.gqa_decode(q, k, v, lengths, isa=isa, window=window, out_dtype=np.float32)
        assert_close(out, reference_decode(q, k, v, lengths, window=window), error_bound(isa, v))
        assert not np.any(out[1])


@pytest.mark.parametrize("isa", ISAS)
def test_scale_and_threads(rng, isa):
    q, k, v = random_case(rng, 2, 8, 1, 500, 64)
    lengths = [500, 321]
    ref = reference_decode(q, k, v, lengths, scale=0.3)
    for threads in (1, 2, 3):
        out = attention.gqa_decode(q, k, v, lengths, isa=isa, scale=0.3, threads=threads, out_dtype=np.float32)
        assert_close(out, ref, error_bound(isa, v))


@pytest.mark.parametrize("threads", [2, 3])
def test_same_result_whichever_thread_takes_which_unit(rng, threads):
    # The participants claim units of work as they go, so which thread folds which
    # positions changes from call to call (3 threads on fewer CPUs race the most); each
    # unit has states of its own and the merge takes them in unit order, so the result
    # must not change by a bit.
    q, k, v = random_case(rng, 3, 16, 2, 3000, 128)
    lengths = [3000, 1700, 2222]
    first = attention.gqa_decode(q, k, v, lengths, threads=threads, out_dtype=np.float32)
    assert_close(first, reference_decode(q, k, v, lengths), error_bound(attention.default_isa(), v))
    for _ in range(10):
        assert np.array_equal(attention.gqa_decode(q, k, v, lengths, threads=threads, out_dtype=np.float32), first)


@pytest.mark.parametrize("isa", ISAS)
def test_paged_cache(rng, isa):
    batch, kv_heads, group, head_dim, block_size, max_blocks = 3, 2, 4, 128, 16, 20
    n_blocks = batch * max_blocks + 5
    q = rng.standard_normal((batch, kv_heads * group, head_dim)).astype(BF16)
    k = rng.standard_normal((n_blocks, kv_heads, block_size, head_dim)).astype(BF16)
    v = rng.standard_normal((n_blocks, kv_heads, block_size, head_dim)).astype(BF16)
    table = rng.permutation(n_blocks)[: batch * max_blocks].reshape(batch, max_blocks).astype(np.int64)
    lengths = [block_size * max_blocks, 1, 37]
    table[1, 1:] = -1  # unused entries are not read
    out = attention.gqa_decode(q, k, v, lengths, block_table=table, isa=isa, out_dtype=np.float32)
    assert_close(out, reference_decode(q, k, v, lengths, block_table=table), error_bound(isa, v))
    out_w = attention.gqa_decode(q, k, v, lengths, block_table=table, isa=isa, window=50, out_dtype=np.float32)
    assert_close(out_w, reference_decode(q, k, v, lengths, block_table=table, window=50), error_bound(isa, v))


def test_torch_tensors_match_sdpa(rng):
    torch = pytest.importorskip("torch")
    q, k, v = random_case(rng, 2, 32, 4, 300, 128)
    tq, tk, tv = (torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16) for a in (q, k, v))
    out = attention.gqa_decode(tq, tk, tv, [300, 300], out_dtype=torch.float32)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    expected = torch.nn.functional.scaled_dot_product_attention(
        tq.float().unsqueeze(2), tk.float(), tv.float(), enable_gqa=True).squeeze(2)
    assert torch.allclose(out, expected, atol=error_bound(attention.default_isa(), v) + 1e-5)


# ------------------------------------------------------------------ nodes


@pytest.mark.parametrize("n_nodes", [2, 4])
@pytest.mark.parametrize("isa", ["ref", attention.default_isa()])
def test_split_over_virtual_nodes(rng, n_nodes, isa):
    """Each virtual node's workers take the positions on its pages; the merged result is
    the reference's, deterministic, and every node got its share of the positions."""
    batch, kv_heads, group, capacity, head_dim = 2, 2, 4, 1000, 128
    cache = attention.KVCache((batch, kv_heads, capacity, head_dim), topology=Topology.virtual(n_nodes),
                              tables="theoretical", phase=1)
    assert cache.v_local and cache.pool.n_nodes == n_nodes
    q, k, v = random_case(rng, batch, kv_heads * group, kv_heads, capacity, head_dim)
    cache.k[...] = k
    cache.v[...] = v
    lengths = [1000, 411]
    out = cache.decode(q, lengths, isa=isa, out_dtype=np.float32)
    assert_close(out, reference_decode(q, k, v, lengths), error_bound(isa, v))
    again = cache.decode(q, lengths, isa=isa, out_dtype=np.float32)
    assert np.array_equal(out, again)
    per_node = cache.positions_per_node(lengths)
    assert sum(per_node.values()) == kv_heads * sum(lengths)
    assert min(per_node.values()) > 0
    # a paged cache on the same nodes
    paged = attention.KVCache((12, kv_heads, 128, head_dim), topology=Topology.virtual(n_nodes), tables="theoretical")
    paged.k[...] = rng.standard_normal(paged.shape).astype(BF16)
    paged.v[...] = rng.standard_normal(paged.shape).astype(BF16)
    table = rng.permutation(12)[:10].reshape(2, 5).astype(np.int64)
    out = paged.decode(q, [640, 300], block_table=table, isa=isa, out_dtype=np.float32)
    ref = reference_decode(q, paged.k, paged.v, [640, 300], block_table=table)
    assert_close(out, ref, error_bound(isa, paged.v))


def test_segments_that_split_rows_are_refused(rng):
    from numa_moe.layer.pools import topology_node_cpus, worker_pool
    from numa_moe.placement.segments import SegmentTable

    topology = Topology.virtual(2)
    pool = worker_pool(topology_node_cpus(topology)[1])
    q, k, v = random_case(rng, 1, 4, 1, 64, 128)
    # 48-byte offset into a page: rows straddle page edges
    table = SegmentTable.theoretical(64, 128, "bf16", 4096, (0, 1), offset_bytes=48)
    with pytest.raises(ValueError, match="part of a row"):
        attention.gqa_decode(q, k, v, [64], node_segments=[table.node_array(n) for n in (0, 1)], pool=pool)
    whole = SegmentTable.theoretical(64, 128, "bf16", 4096, (0, 1))
    with pytest.raises(ValueError, match="covered twice"):
        attention.gqa_decode(q, k, v, [64], node_segments=[whole.node_array(0), whole.node_array(0)], pool=pool)
    with pytest.raises(ValueError, match="not covered"):
        attention.gqa_decode(q, k, v, [64], node_segments=[whole.node_array(0), np.zeros((0, 5), np.int64)],
                             pool=pool)
    with pytest.raises(ValueError, match="worker pool has 1 node"):
        attention.gqa_decode(q, k, v, [64], node_segments=[whole.node_array(n) for n in (0, 1)], threads=1)


# ------------------------------------------------------------------ bad input


def test_bad_input_is_named(rng):
    q, k, v = random_case(rng, 2, 8, 2, 64, 128)
    lengths = [64, 10]
    cases = [
        (dict(q=q[:, :5].copy()), "not a multiple"),
        (dict(q=q[:, ::2]), "q: must be C-contiguous"),
        (dict(q=q.astype(np.float32)), "dtype"),
        (dict(k_cache=k[:, :, ::2]), "contiguous"),
        (dict(v_cache=v[:, :, :32].copy()), "differs from k_cache"),
        (dict(lengths=[65, 1]), r"lengths\[0\] = 65 is outside"),
        (dict(lengths=[1]), "one per sequence"),
        (dict(lengths=[1.5, 2]), "integers"),
        (dict(q=q[..., :96].copy(), k_cache=k[..., :96].copy(), v_cache=v[..., :96].copy()), "head size 96"),
        (dict(k_cache=k[:1].copy(), v_cache=v[:1].copy()), "one cache per sequence"),
        (dict(window=-1), "window"),
        (dict(scale=float("nan")), "scale"),
        *([(dict(isa="amx"), "not available for attention")] if "amx" not in ISAS else []),
        (dict(isa="sse"), "unknown ISA"),
        (dict(out=np.empty((2, 8, 64), np.float32)), "out: shape"),
        (dict(block_table=np.zeros((2, 4), np.int64), lengths=[64, 300]), "outside"),
        (dict(block_table=np.full((2, 1), 7, np.int64), lengths=[3, 3]), r"block_table\[0, 0\] = 7"),
    ]
    for change, message in cases:
        args = dict(q=q, k_cache=k, v_cache=v, lengths=lengths)
        args.update(change)
        with pytest.raises((ValueError, TypeError), match=message):  # case: change
            attention.gqa_decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("lengths"), **args)



def test_kv_cache_on_this_machine_measures_its_table(rng):
    """The default: interleaved over this machine's real nodes, the table measured from
    the page map (one node here: every position on it)."""
    cache = attention.KVCache((2, 2, 300, 64))
    assert cache.v_local
    assert cache.table.rows == 2 * 2 * 300 and cache.table.cols == 64
    cache.k[...] = rng.standard_normal(cache.shape).astype(BF16)
    cache.v[...] = rng.standard_normal(cache.shape).astype(BF16)
    q = rng.standard_normal((2, 8, 64)).astype(BF16)
    out = cache.decode(q, [300, 17], out_dtype=np.float32)
    isa = attention.default_isa()
    assert_close(out, reference_decode(q, cache.k, cache.v, [300, 17]), error_bound(isa, cache.v))
    assert sum(cache.positions_per_node([300, 17]).values()) == 2 * 317
    with pytest.raises(ValueError, match="head size 80"):
        attention.KVCache((1, 1, 8, 80))

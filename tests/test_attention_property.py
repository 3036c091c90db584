"""Property tests of the log-sum-exp merge of softmax states (the rule that joins the
per-node partial results of decode attention), and of the whole call on random shapes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_reference import error_bound, reference_decode
from numa_moe.layer import attention

BF16 = np.dtype(ml_dtypes.bfloat16)


@st.composite
def split_scores(draw):
    n = draw(st.integers(1, 200))
    d = draw(st.integers(1, 16))
    spread = draw(st.sampled_from([0.1, 1.0, 30.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    cuts = sorted(set(draw(st.lists(st.integers(0, n), max_size=6))))
    empties = draw(st.integers(0, 2))
    return n, d, spread, seed, cuts, empties


@settings(max_examples=60, deadline=None)
@given(split_scores())
def test_merge_of_any_split_is_the_whole_softmax(case):
    n, d, spread, seed, cuts, empties = case
    rng = np.random.default_rng(seed)
    s = rng.standard_normal(n) * spread
    v = rng.standard_normal((n, d))
    p = np.exp(s - s.max())
    expected = p @ v / p.sum()
    m, l, o = [], [], []
    for a, b in zip([0, *cuts], [*cuts, n]):
        if b <= a:  # an empty part: the state of a node without positions
            m.append(-np.inf), l.append(0.0), o.append(np.zeros(d))
            continue
        part_max = s[a:b].max()
        w = np.exp(s[a:b] - part_max)
        m.append(part_max), l.append(w.sum()), o.append(w @ v[a:b])
    for _ in range(empties):
        m.append(-np.inf), l.append(0.0), o.append(np.full(d, np.nan))  # never read
    merged = attention.merge_states(np.array(m), np.array(l), np.array(o))
    assert np.abs(merged - expected).max() <= 1e-5 * (np.abs(v).max() + 1)


def test_merge_of_nothing_is_zero():
    merged = attention.merge_states(np.array([-np.inf, -np.inf]), np.zeros(2), np.full((2, 4), np.nan))
    assert np.array_equal(merged, np.zeros(4, np.float32))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.sampled_from([1, 2, 3, 8, 17]), st.integers(1, 2), st.sampled_from([64, 128]),
       st.lists(st.integers(0, 300), min_size=3, max_size=3), st.integers(0, 2**32 - 1),
       st.sampled_from(attention.tested_isas()), st.integers(1, 3))
def test_random_shapes_equal_reference(batch, group, kv_heads, head_dim, lengths, seed, isa, threads):
    rng = np.random.default_rng(seed)
    lengths = lengths[:batch]
    capacity = max(lengths) or 1
    q = rng.standard_normal((batch, kv_heads * group, head_dim)).astype(BF16)
    k = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(BF16)
    v = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(BF16)
    out = attention.gqa_decode(q, k, v, lengths, isa=isa, threads=threads, out_dtype=np.float32)
    err = np.abs(out - reference_decode(q, k, v, lengths)).max()
    assert err <= error_bound(isa, v)

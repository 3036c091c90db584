"""Property test: any partition of a small matrix into strided segments (row classes
modulo a period x column intervals), restricted to a random row range, gives exactly the
reference product on every ISA (bound: see test_kernels.py, fp32 accumulation only)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from numa_moe.layer import kernels

BF16 = np.dtype(ml_dtypes.bfloat16)
MATMUL_TOL = 1e-5


@st.composite
def partitions(draw):
    rows = draw(st.integers(1, 48))
    k = draw(st.integers(1, 96))
    m = draw(st.integers(1, 36))
    period = draw(st.integers(1, 5))
    segments = []
    for row_class in range(min(period, rows)):
        nrows = (rows - row_class + period - 1) // period
        cuts = sorted(set(draw(st.lists(st.integers(1, k - 1), max_size=3)) if k > 1 else []))
        edges = [0, *cuts, k]
        segments += [[row_class, period, nrows, a, b] for a, b in zip(edges[:-1], edges[1:])]
    row_begin = draw(st.integers(0, rows - 1))
    row_end = draw(st.integers(row_begin + 1, rows))
    seed = draw(st.integers(0, 2**32 - 1))
    return rows, k, m, np.array(segments, dtype=np.int64), row_begin, row_end, seed


@settings(max_examples=30, deadline=None)
@given(partitions())
def test_random_segment_partitions_equal_reference(case):
    rows, k, m, segments, row_begin, row_end, seed = case
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((rows, k)).astype(np.float32).astype(BF16)
    tokens = rng.standard_normal((m, k)).astype(np.float32).astype(BF16)
    ref = np.zeros((rows, m))
    ref[row_begin:row_end] = weight.astype(np.float64)[row_begin:row_end] @ tokens.astype(np.float64).T
    for isa in kernels.tested_isas():
        out = np.full((rows, m), np.nan, dtype=np.float32)
        out[row_begin:row_end] = 0.0
        kernels.matmul_segments(weight, segments, tokens, out, isa=isa, row_begin=row_begin, row_end=row_end)
        assert np.all(np.isnan(out[:row_begin])) and np.all(np.isnan(out[row_end:])), isa
        got = out[row_begin:row_end].astype(np.float64)
        expected = ref[row_begin:row_end]
        err = np.linalg.norm(got - expected)
        assert err <= MATMUL_TOL * max(np.linalg.norm(expected), 1e-30), (isa, err)

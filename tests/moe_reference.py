"""Independent references for the MoE layer tests (float64 numpy), and explicit segment
tables built without numa_moe.placement.segments (so the layer is checked against its own source
of truth for placement)."""

from __future__ import annotations

import numpy as np
import ml_dtypes

BF16 = ml_dtypes.bfloat16


def random_bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(BF16)


def silu(x):
    # exp(-x) overflows to inf for x below about -709 (large random IQ4_XS experts): the
    # quotient is then -0, silu's limit, so the overflow is expected, not an error
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def moe_reference(x, ids, weights, gates, ups, downs):
    """y[t] = sum_j w[t,j] * down_e(silu(gate_e x_t) * up_e x_t), float64, duplicate
    experts in a row counted once per listing (transformers' index_add_ semantics)."""
    x64 = np.asarray(x, dtype=np.float64)
    y = np.zeros((x64.shape[0], downs[0].shape[0]), dtype=np.float64)
    for t in range(x64.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g = gates[e].astype(np.float64) @ x64[t]
            u = ups[e].astype(np.float64) @ x64[t]
            y[t] += float(weights[t, j]) * (downs[e].astype(np.float64) @ (silu(g) * u))
    return y


def rel_error(actual, expected):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert np.all(np.isfinite(actual)), "non-finite values in the result"
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


class ExplicitTable:
    """A minimal segment table: nodes + node_array(node) from explicit segment lists."""

    def __init__(self, nodes, segments):
        self.nodes = tuple(nodes)
        self._segments = {n: np.asarray(segments.get(n, []), dtype=np.int64).reshape(-1, 5) for n in self.nodes}

    def node_array(self, node):
        return np.ascontiguousarray(self._segments[node])


def whole_matrix_table(rows, cols, node=0):
    return ExplicitTable((node,), {node: [(0, 1, rows, 0, cols)]})


def random_partition_table(rows, cols, nodes, rng, period=None):
    """A random exact partition: row classes c = r mod P, each split at random even
    column cuts into pieces, each piece on a random node (strided segments)."""
    period = int(period or rng.integers(1, 5))
    segs = {n: [] for n in nodes}
    for c in range(min(period, rows)):
        cuts = sorted(set(int(v) * 2 for v in rng.integers(1, cols // 2, rng.integers(0, 4))))
        bounds = [0, *cuts, cols]
        nrows = (rows - c + period - 1) // period
        for k0, k1 in zip(bounds[:-1], bounds[1:]):
            segs[nodes[int(rng.integers(len(nodes)))]].append((c, period, nrows, k0, k1))
    return ExplicitTable(nodes, segs)


def interleave_rule_table(rows, cols, nodes, page_bytes, phase=0, offset_bytes=0):
    """The interleave rule (page p on nodes[(phase + p) % N]) applied element by element,
    emitted as one segment per (row, run): independent of numa_moe.placement.segments."""
    segs = {n: [] for n in nodes}
    row_bytes = cols * 2
    for r in range(rows):
        start = offset_bytes + r * row_bytes
        k = 0
        while k < cols:
            page = (start + 2 * k) // page_bytes
            next_k = min(cols, ((page + 1) * page_bytes - start) // 2)
            segs[nodes[(phase + page) % len(nodes)]].append((r, 1, 1, k, next_k))
            k = next_k
    return ExplicitTable(nodes, segs)

"""MoELayer lifetime: worker pools live as long as their layers."""

import gc
import os

import numpy as np

from moe_reference import random_bf16
from numa_moe.moe import MoELayer
from numa_moe.topology import Topology

H, I, E, TOP_K = 64, 32, 4, 2


def make_layer(rng, n_nodes):
    gate_up = random_bf16(rng, (E, 2 * I, H), H ** -0.5)
    down = random_bf16(rng, (E, H, I), I ** -0.5)
    return MoELayer.from_tensors(gate_up, down, topology=Topology.virtual(n_nodes), tables="theoretical")


def routing(rng, n_tokens):
    x = random_bf16(rng, (n_tokens, H))
    ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(n_tokens)]).astype(np.int64)
    weights = rng.random((n_tokens, TOP_K)).astype(np.float32)
    return x, ids, weights


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_layers_over_many_topologies_do_not_leave_threads_behind(rng):
    gc.collect()
    baseline = thread_count()
    x, ids, weights = routing(rng, 3)
    most = 0
    for n_nodes in range(1, 16):
        layer = make_layer(rng, n_nodes)
        layer(x, ids, weights)  # starts the pool's threads
        most = max(most, thread_count() - baseline)
        del layer
    gc.collect()
    assert most >= 1, "the layers' pools never started a thread: the test measures nothing"
    assert thread_count() - baseline <= 2, f"{thread_count() - baseline} threads left after the layers died"


def test_layers_over_one_topology_share_a_pool_while_one_lives(rng):
    first, second = make_layer(rng, 3), make_layer(rng, 3)
    assert first.pool is second.pool
    x, ids, weights = routing(rng, 5)
    expected = second(x, ids, weights)
    del first
    gc.collect()
    np.testing.assert_array_equal(second(x, ids, weights).view(np.uint16), expected.view(np.uint16))

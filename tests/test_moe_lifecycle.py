"""MoELayer lifetime: worker pools live as long as their layers, and a forked child can
use the layers it inherits even when another parent thread was inside one."""

import gc
import os
import signal
import threading
import time

import numpy as np

from moe_reference import random_bf16
from numa_moe.layer import pools
from numa_moe.layer.moe_layer import MoELayer
from numa_moe.placement.topology import Topology

H, I, E, TOP_K = 64, 32, 4, 2
CHILD_TIMEOUT_S = 20.0


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


def _child_exit_code(pid: int, timeout_s: float) -> int | None:
    """The child's exit code, or None after killing it when it has not ended in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _fork_and_run(work) -> int | None:
    """Forks; the child runs work() and exits 0 on success, 1 on an exception."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            work()
            code = 0
        finally:
            os._exit(code)
    return _child_exit_code(pid, CHILD_TIMEOUT_S)


def _while_held(lock, action):
    """Runs action() while another thread holds `lock`, then lets that thread go."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        return action()
    finally:
        release.set()
        holder.join()


def test_forked_child_runs_a_layer_another_thread_was_inside(rng):
    layer = make_layer(rng, 2)
    x, ids, weights = routing(rng, 6)
    expected = layer(x, ids, weights).view(np.uint16).copy()

    def child():
        assert np.array_equal(layer(x, ids, weights).view(np.uint16), expected)

    # MoELayer.__call__ holds layer._lock for the whole native forward
    code = _while_held(layer._lock, lambda: _fork_and_run(child))
    assert code is not None, "the child hung on the layer lock it inherited locked"
    assert code == 0
    np.testing.assert_array_equal(layer(x, ids, weights).view(np.uint16), expected)


def test_forked_child_makes_a_layer_while_another_thread_was_making_a_pool(rng):
    x, ids, weights = routing(rng, 2)
    code = _while_held(pools._pools_lock, lambda: _fork_and_run(lambda: make_layer(rng, 3)(x, ids, weights)))
    assert code is not None, "the child hung on the pool lock it inherited locked"
    assert code == 0


def test_forked_child_runs_a_layer_while_a_parent_thread_keeps_calling_it(rng):
    """No lock held on purpose: a thread calls the layer in a loop (the native forward
    running on the pool's threads) while the main thread forks several times."""
    layer = make_layer(rng, 2)
    x, ids, weights = routing(rng, 32)
    expected = layer(x, ids, weights).view(np.uint16).copy()
    stop = threading.Event()

    def keep_calling():
        while not stop.is_set():
            layer(x, ids, weights)

    def child():
        assert np.array_equal(layer(x, ids, weights).view(np.uint16), expected)

    caller = threading.Thread(target=keep_calling)
    caller.start()
    try:
        codes = []
        while len(codes) < 5 and codes.count(0) == len(codes):
            time.sleep(0.01)
            codes.append(_fork_and_run(child))
    finally:
        stop.set()
        caller.join()
    assert codes == [0] * 5, codes

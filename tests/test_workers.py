"""The native worker pool: pinning, persistence, barriers, fork, interruption."""

import os
import signal
import sys
import threading
import time

import pytest

from numa_moe import _native

CPUS = sorted(os.sched_getaffinity(0))


def make_pool(n_nodes, threads_per_node=1, **kwargs):
    node_cpus = [[CPUS[(n * threads_per_node + i) % len(CPUS)] for i in range(threads_per_node)]
                 for n in range(n_nodes)]
    return _native.WorkerPool(node_cpus, **kwargs), node_cpus


def test_threads_are_pinned_to_their_node_cpus():
    pool, node_cpus = make_pool(2, threads_per_node=len(CPUS))
    try:
        seen = pool.thread_affinity()
        assert len(seen) == pool.n_threads == 2 * len(CPUS)
        for node, local, cpus in seen:
            assert cpus == [node_cpus[node][local]]
    finally:
        pool.shutdown()


def test_unpinned_threads_keep_the_process_affinity():
    pool, _ = make_pool(2, pin=False)
    try:
        for _, _, cpus in pool.thread_affinity():
            assert cpus == CPUS
    finally:
        pool.shutdown()


def test_threads_start_lazily_once_and_restart_after_shutdown():
    pool, _ = make_pool(3)
    assert not pool.started and pool.start_count == 0
    for _ in range(20):
        _native.testing.barrier_check(pool, 3)
    assert pool.started and pool.start_count == 1
    pool.shutdown()
    assert not pool.started
    _native.testing.barrier_check(pool, 2)
    assert pool.start_count == 2
    pool.shutdown()


@pytest.mark.parametrize("n_nodes,threads", [(1, 1), (2, 2), (4, 2)])
def test_barrier_holds_every_thread(n_nodes, threads):
    pool, _ = make_pool(n_nodes, threads)
    try:
        increments, failures = _native.testing.barrier_check(pool, 200)
        assert increments == 200 * pool.n_threads
        assert failures == 0
    finally:
        pool.shutdown()


def test_bad_cpu_lists_are_rejected():
    with pytest.raises(ValueError, match="no CPUs"):
        _native.WorkerPool([[0], []])
    with pytest.raises(ValueError, match="invalid CPU"):
        _native.WorkerPool([[-3]])


def test_a_cpu_outside_the_allowed_set_is_refused_at_construction():
    outside = max(CPUS) + 1
    if outside >= 1024:
        pytest.skip("no CPU number outside the allowed set to try")
    for pin in (True, False):
        with pytest.raises(ValueError, match=rf"CPU\(s\) {outside} not in this process's allowed set"):
            _native.WorkerPool([[CPUS[0]], [outside]], pin=pin)
    with pytest.raises(ValueError, match=rf"CPU\(s\) {outside} not in"):
        _native.WorkerPool([[CPUS[0]]], caller_cpu=outside)


def test_forked_child_gets_fresh_threads():
    pool, _ = make_pool(2, 2)
    _native.testing.barrier_check(pool, 5)
    pid = os.fork()
    if pid == 0:  # child: the parent's threads do not exist here
        code = 1
        try:
            increments, failures = _native.testing.barrier_check(pool, 50)
            code = 0 if (increments == 50 * pool.n_threads and failures == 0 and pool.start_count == 2) else 2
            pool.shutdown()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    increments, failures = _native.testing.barrier_check(pool, 5)  # the parent's pool still works
    assert failures == 0
    pool.shutdown()


def test_keyboard_interrupt_during_a_call_returns_promptly_and_pool_survives(sigint_raises):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    pool, _ = make_pool(2, 2)
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        _native.testing.busy_job(pool, 30.0)
    elapsed = time.monotonic() - start
    timer.join()
    assert elapsed < 5.0
    assert _native.testing.busy_job(pool, 0.01)
    assert _native.testing.barrier_check(pool, 3)[1] == 0
    pool.shutdown()


def test_interpreter_exit_with_running_pool_is_clean(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(
        "from numa_moe import _native\n"
        "from numa_moe.layer.pools import worker_pool\n"
        "p = worker_pool([[0], [0]])\n"
        "_native.testing.barrier_check(p, 3)\n"
        "print('ok')\n")
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_bad_indices_and_segments_are_rejected_by_the_native_layer():
    import numpy as np

    pool, _ = make_pool(2)
    with pytest.raises(ValueError, match="node 5.*2 nodes"):
        pool.threads_of(5)
    with pytest.raises(ValueError, match="node -1"):
        pool.threads_of(-1)
    core = _native.MoELayerCore(pool, 64, 32)
    mat = lambda r, c: np.zeros((r, c), np.uint16)  # noqa: E731
    whole = lambda r, c: [np.array([[0, 1, r, 0, c]], np.int64), np.zeros((0, 5), np.int64)]  # noqa: E731
    core.add_expert(mat(32, 64), mat(32, 64), mat(64, 32), whole(32, 64), whole(32, 64), whole(64, 32))
    with pytest.raises(ValueError, match="kind 'gates'"):
        core.thread_rows(0, "gates")
    with pytest.raises(ValueError, match="kind 'Down'"):
        core.node_bytes(0, "Down")
    with pytest.raises(ValueError, match="expert 3.*1 expert"):
        core.thread_rows(3, "gate")
    with pytest.raises(ValueError, match="group budget"):
        core.set_group_budget_bytes(-1)
    # row0 + (nrows - 1) * row_stride overflows int64: must be "outside the matrix" even
    # without the partition check (which is all that caught it before)
    huge = [np.array([[0, 1 << 62, 3, 0, 64]], np.int64), np.zeros((0, 5), np.int64)]
    with pytest.raises(ValueError, match="lies outside the 32 x 64 matrix"):
        core.add_expert(mat(32, 64), mat(32, 64), mat(64, 32), huge, whole(32, 64), whole(64, 32),
                        verify_partition=False)


@pytest.mark.skipif(len(CPUS) < 2, reason="the joining caller needs a CPU of its own")
def test_joining_caller_is_a_participant_and_its_affinity_is_restored():
    # One worker on CPUS[1], the caller joins on CPUS[0]: the barrier counts both, the
    # caller runs its share on its CPU whichever CPU it was on, and keeps its own affinity.
    pool = _native.WorkerPool([[CPUS[1]]], caller_cpu=CPUS[0])
    before = os.sched_getaffinity(0)
    try:
        assert pool.n_threads == 1 and pool.participants == 2
        increments, failures = _native.testing.barrier_check(pool, 200)
        assert (increments, failures) == (400, 0)
        for _ in range(20):
            cpus, caller_affinity = _native.testing.participant_cpus(pool)
            assert cpus[0] == CPUS[1]
            # Moved only when it found itself on the worker's CPU.
            assert cpus[1] != CPUS[1]
            assert caller_affinity in ([CPUS[0]], sorted(before))
        assert os.sched_getaffinity(0) == before
    finally:
        pool.shutdown()


def test_caller_cpu_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="caller CPU"):
        _native.WorkerPool([[CPUS[0]]], caller_cpu=1 << 20)

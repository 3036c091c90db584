"""Faults in the native layer surface as Python exceptions, never as an abort or a hang:
a job that throws on any participant, thread creation that fails, pools that would pile
up, an expert_ffn call interrupted by Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from numa_moe import _native
from numa_moe.layer import kernels
from test_kernels import FFN_TOL_F32, ffn_reference, random_expert, rel_fro

testing = getattr(_native, "testing", None)
needs_hooks = pytest.mark.skipif(testing is None, reason="built without NUMA_MOE_TEST_HOOKS (tools/setup.sh turns it on)")
CPUS = sorted(os.sched_getaffinity(0))


@needs_hooks
@pytest.mark.parametrize("caller_joins", [False, True])
def test_a_job_that_throws_on_any_participant_raises_and_the_pool_stays_usable(caller_joins):
    if caller_joins and len(CPUS) < 2:
        pytest.skip("the joining caller needs a CPU of its own")
    workers = [[CPUS[-1]]] if caller_joins else [[CPUS[0]], [CPUS[-1]]]
    pool = _native.WorkerPool(workers, caller_cpu=CPUS[0] if caller_joins else -1)
    for thrower in range(pool.participants):
        for phase in (0, 2):
            with pytest.raises(RuntimeError, match=f"participant {thrower} failed in phase {phase}"):
                testing.throwing_job(pool, 3, phase, thrower)
            increments, failures = testing.barrier_check(pool, 3)
            assert (increments, failures) == (3 * pool.participants, 0)
    pool.shutdown()


def _run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.skipif(os.environ.get("NUMA_MOE_SANITIZED") == "1",
                    reason="AddressSanitizer's shadow memory cannot live under an address-space limit")
def test_failed_thread_creation_raises_instead_of_aborting():
    # 3 GiB of address space holds a few hundred 8 MiB thread stacks, not 5000.
    result = _run_python("""
        import resource
        from numa_moe import _native
        from numa_moe.placement.memory import interleaved_empty
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        a = interleaved_empty(64 << 20, "uint8", touch_threads=5000)
        assert a.size == 64 << 20 and a[::4096].sum() == 0
        pool = _native.WorkerPool([[0] * 5000], pin=False)
        try:
            pool.start()
        except RuntimeError as error:
            assert "creating worker thread" in str(error), error
            print("raised")
        pool.start.__doc__  # the pool object is still alive and usable as an object
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "raised" in result.stdout


def test_expert_ffn_keeps_one_process_pool_whatever_the_thread_counts(rng):
    def thread_count():
        return len(os.listdir("/proc/self/task"))

    x, wg, wu, wd = random_expert(rng, 64, 64, n_tokens=2)
    kernels.expert_ffn(x, wg, wu, wd, threads=2)
    before = thread_count()
    for threads in range(2, 40):
        kernels.expert_ffn(x, wg, wu, wd, threads=threads)
    kernels.expert_ffn(x, wg, wu, wd, threads=2)
    assert thread_count() <= before + 1, (before, thread_count())


def test_expert_ffn_results_do_not_depend_on_the_pool_it_ran_on(rng):
    x, wg, wu, wd = random_expert(rng, 256, 192, n_tokens=7)
    ref = ffn_reference(x, wg, wu, wd, np.arange(7))
    for threads in (1, 3, 2, 1, 5):
        out = np.full((7, 256), np.nan, np.float32)
        kernels.expert_ffn(x, wg, wu, wd, threads=threads, out=out)
        assert rel_fro(out, ref) < FFN_TOL_F32


def test_ctrl_c_interrupts_a_long_expert_ffn(rng, sigint_raises):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread")
    # The reference ISA on a large expert: many seconds per call.
    x, wg, wu, wd = random_expert(rng, 4096, 4096, n_tokens=64)
    start = time.perf_counter()
    kernels.expert_ffn(x, wg, wu, wd, isa="ref", threads=2, token_index=np.arange(2))
    one_call_2_tokens = time.perf_counter() - start
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        kernels.expert_ffn(x, wg, wu, wd, isa="ref", threads=2)  # 64 tokens: ~32x the 2-token call
    elapsed = time.perf_counter() - start
    timer.join()
    # Ctrl-C is seen between kernel calls of at most 1024 rows: a few 2-token calls' worth
    # at 64 tokens, against about 32 of them for the whole call.
    assert elapsed < 0.3 + max(2.0, 12 * one_call_2_tokens), (elapsed, one_call_2_tokens)

"""Whose threads run the pools' jobs: with torch loaded, the team of torch's own OpenMP
runtime (so torch's intra-op threads and numa-moe's workers are the same threads and
cannot compete for the CPUs), pinned per node; otherwise, or when asked, the pools' own."""

from __future__ import annotations

import os

import numpy as np
import pytest

from numa_moe import _native
from numa_moe.layer import kernels
from test_kernels import FFN_TOL_F32, ffn_reference, random_expert, rel_fro

torch = pytest.importorskip("torch")
testing = getattr(_native, "testing", None)
needs_hooks = pytest.mark.skipif(testing is None, reason="built without NUMA_MOE_TEST_HOOKS (tools/setup.sh turns it on)")
CPUS = sorted(os.sched_getaffinity(0))


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def warm_torch_team():
    torch.set_num_threads(len(CPUS))
    a = torch.randn(256, 256)
    (a @ a).sum()  # a parallel region: torch's OpenMP team exists from here on


@pytest.fixture(autouse=True)
def default_backend(monkeypatch):
    monkeypatch.delenv("NUMA_MOE_THREADS", raising=False)
    warm_torch_team()


def test_torch_loaded_means_its_openmp_team():
    assert _native.thread_backend().startswith("openmp (") and "libgomp" in _native.thread_backend()


def test_own_threads_when_asked(monkeypatch):
    monkeypatch.setenv("NUMA_MOE_THREADS", "own")
    assert _native.thread_backend() == "own threads (NUMA_MOE_THREADS=own)"


def node_layouts():
    one = [CPUS]                                  # 1 node, one participant per CPU
    two = [[c] for c in CPUS[:2]] if len(CPUS) >= 2 else None  # a virtual 2-node split
    return [pytest.param(one, id="1-node")] + ([pytest.param(two, id="2-virtual-nodes")] if two else [])


@needs_hooks
@pytest.mark.parametrize("node_cpus", node_layouts())
def test_a_run_is_torchs_team_pinned_per_node(node_cpus):
    pool = _native.WorkerPool(node_cpus)
    tids, affinity = testing.participant_threads(pool)
    team = testing.openmp_team_threads(pool.participants)
    assert sorted(tids) == sorted(team), "the participants are not the OpenMP team's threads"
    workers = [cpu for cpus in node_cpus for cpu in cpus]
    caller = tids.index(os.getpid())
    for index, (cpus, cpu) in enumerate(zip(affinity, workers)):
        if index == caller and len(node_cpus) == 1:
            # on one node the calling thread, already on its participant's CPU, is not moved
            assert cpus in ([cpu], CPUS)
        else:
            assert cpus == [cpu], "each participant runs pinned to its node's CPU"
    # torch's team is no bigger than the participants: no torch thread is left to spin
    # beside them while a layer call runs.
    assert set(testing.openmp_team_threads(torch.get_num_threads())) <= set(tids)
    assert not pool.started, "the pool's own threads were started although the team ran the job"
    # The calling thread plays one participant and gets its own affinity back.
    assert os.getpid() in tids and sorted(os.sched_getaffinity(0)) == CPUS


@needs_hooks
def test_own_threads_are_not_the_team(monkeypatch):
    monkeypatch.setenv("NUMA_MOE_THREADS", "own")
    pool = _native.WorkerPool([CPUS])
    tids, _ = testing.participant_threads(pool)
    assert pool.started and not set(tids) & set(testing.openmp_team_threads(len(CPUS)))
    pool.shutdown()


def test_no_thread_is_created_per_call_on_the_team(rng):
    x, wg, wu, wd = random_expert(rng, 256, 384, n_tokens=9)
    ref = ffn_reference(x, wg, wu, wd, np.arange(9))
    kernels.expert_ffn(x, wg, wu, wd, threads=len(CPUS))
    before = thread_ids()
    for _ in range(5):
        out = np.full((9, 256), np.nan, np.float32)
        kernels.expert_ffn(x, wg, wu, wd, threads=len(CPUS), out=out)
        assert rel_fro(out, ref) < FFN_TOL_F32
    assert thread_ids() == before


@needs_hooks
def test_errors_on_the_team_are_raised_and_the_team_keeps_working():
    pool = _native.WorkerPool([CPUS])
    for thrower in range(pool.participants):
        with pytest.raises(RuntimeError, match=f"participant {thrower} failed"):
            testing.throwing_job(pool, 3, 1, thrower)
        assert testing.barrier_check(pool, 3) == (3 * pool.participants, 0)
    assert not pool.started


@needs_hooks
def test_the_loader_is_asked_for_libgomp_only_after_it_loaded_something():
    """Without torch every run looked for libgomp with a dlopen that searched the file
    system (about 100 us a step here); now only a load since the last look makes it look
    again, and torch imported later is still found."""
    import subprocess
    import sys

    script = """
import numpy as np
from numa_moe import _native
from numa_moe.layer import kernels
from test_kernels import random_expert
x, wg, wu, wd = random_expert(np.random.default_rng(0), 128, 192, n_tokens=3)
kernels.expert_ffn(x, wg, wu, wd, threads=2)
before = _native.testing.openmp_lookups()
for _ in range(5):
    kernels.expert_ffn(x, wg, wu, wd, threads=2)
print(before, _native.testing.openmp_lookups(), _native.thread_backend().split()[0])
import torch
torch.set_num_threads(2)
(torch.randn(64, 64) @ torch.randn(64, 64)).sum()
kernels.expert_ffn(x, wg, wu, wd, threads=2)
print(_native.thread_backend().split()[0])
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    env.pop("NUMA_MOE_THREADS", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    before, after, backend = first.split()
    assert backend == "own" and int(before) >= 1 and int(after) == int(before)
    assert second == "openmp"


_NARROWED_CHILD = """
import os, sys, threading
cpus = sorted(os.sched_getaffinity(0))
backend, scope = sys.argv[1], sys.argv[2]
held = threading.Event()
if scope == "process":
    os.sched_setaffinity(0, cpus[:1])  # before any other thread exists: every thread inherits it
else:  # the main thread alone, as an OpenMP runtime bound to a CPU list pins its master thread
    threading.Thread(target=held.wait, daemon=True).start()
    os.sched_setaffinity(0, cpus[:1])
if backend == "own":
    os.environ["NUMA_MOE_THREADS"] = "own"
else:
    import torch
    torch.set_num_threads(2)
    (torch.ones(256, 256) @ torch.ones(256, 256)).sum()
from numa_moe import _native
from numa_moe.layer.pools import worker_pool
assert _native.thread_backend().startswith("own threads" if backend == "own" else "openmp"), _native.thread_backend()
try:
    worker_pool([[cpus[0]], [cpus[-1]]])
    print("accepted")
except ValueError as error:
    print("ValueError:", error)
"""


@pytest.mark.parametrize("backend", ["openmp", "own"])
def test_cpus_outside_the_allowed_set_are_refused_on_every_backend(monkeypatch, rng, backend):
    import subprocess
    import sys

    from moe_reference import moe_reference, random_bf16, rel_error, whole_matrix_table
    from numa_moe.layer.moe_layer import MoELayer
    from numa_moe.layer.pools import worker_pool

    if backend == "own":
        monkeypatch.setenv("NUMA_MOE_THREADS", "own")
    assert _native.thread_backend().startswith("openmp (" if backend == "openmp" else "own threads")
    H, I = 64, 64
    expert = (random_bf16(rng, (I, H)), random_bf16(rng, (I, H)), random_bf16(rng, (H, I)))
    tables = [{kind: whole_matrix_table(*w.shape) for kind, w in zip(("gate", "up", "down"), expert)}]
    missing = max(CPUS) + 1  # a CPU this machine does not have, or not this process
    message = rf"CPU\(s\) {missing} not in this process's allowed set"
    with pytest.raises(ValueError, match=message):
        MoELayer([expert], tables, node_cpus=((0,), [[missing]]))
    with pytest.raises(ValueError, match=message):
        worker_pool([[CPUS[0]], [missing]])
    with pytest.raises(ValueError, match=message):
        _native.WorkerPool([[missing]], pin=False)
    # CPUs of the mask make a working layer on this backend
    layer = MoELayer([expert], tables, node_cpus=((0,), [CPUS]))
    x = random_bf16(rng, (3, H))
    ids, weights = np.zeros((3, 1), np.int64), np.ones((3, 1), np.float32)
    out = layer.forward_numpy(x, ids, weights, out_dtype="float32")
    assert rel_error(out, moe_reference(x, ids, weights, *([w] for w in expert))) < 1e-2
    if len(CPUS) < 2:
        return
    # A CPU that exists but that no thread of the process may use is refused; one that
    # only the calling thread may not use is not.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for scope, expected in (("process", f"ValueError: WorkerPool: CPU(s) {CPUS[-1]} not in"), ("thread", "accepted")):
        result = subprocess.run([sys.executable, "-P", "-c", _NARROWED_CHILD, backend, scope], capture_output=True,
                                text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.startswith(expected), (scope, result.stdout)

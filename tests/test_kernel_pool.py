"""The kernels' process-wide worker pool: persistent threads, fork, concurrent callers,
and the benchmark's interleaved kernel / read measurement."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from numa_moe import _bench, _native
from numa_moe.layer import kernels
from test_kernels import FFN_TOL_F32, ffn_reference, random_expert, rel_fro

ISA = kernels.default_isa()


def run_ffn(rng, m=9, threads=2, hidden=256, inter=384):
    x, wg, wu, wd = random_expert(rng, hidden, inter, n_tokens=m)
    out = np.full((m, hidden), np.nan, dtype=np.float32)
    kernels.expert_ffn(x, wg, wu, wd, isa=ISA, threads=threads, out=out)
    return rel_fro(out, ffn_reference(x, wg, wu, wd, np.arange(m)))


def test_no_thread_creation_per_call(rng, monkeypatch):
    monkeypatch.setenv("NUMA_MOE_THREADS", "own")  # the pool's own threads (the OpenMP team: test_thread_backend.py)
    assert run_ffn(rng) < FFN_TOL_F32  # creates the 2-thread pool if not there yet
    before = _native.process_pool_start_count()
    assert before >= 1
    for _ in range(5):
        assert run_ffn(rng) < FFN_TOL_F32
    assert _native.process_pool_start_count() == before


def test_forked_child_runs_expert_ffn(rng):
    assert run_ffn(rng) < FFN_TOL_F32  # the parent's pool threads exist
    seed = int(rng.integers(1 << 31))
    pid = os.fork()
    if pid == 0:  # child: none of the parent's pool threads exist here
        code = 1
        try:
            err = run_ffn(np.random.default_rng(seed))
            code = 0 if err < FFN_TOL_F32 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert run_ffn(rng) < FFN_TOL_F32  # and the parent's pool still works


def test_concurrent_callers_get_correct_results(rng):
    seeds = [int(s) for s in rng.integers(1 << 31, size=4)]
    errors = [None] * len(seeds)

    def work(i):
        local = np.random.default_rng(seeds[i])
        errors[i] = max(run_ffn(local, m=int(local.integers(1, 40))) for _ in range(5))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e is not None and e < FFN_TOL_F32 for e in errors), errors


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts_other_than_the_cpus(rng, threads):
    assert run_ffn(rng, threads=threads) < FFN_TOL_F32


def test_bench_expert_ffn_vs_read_interleaves(rng):
    hidden, inter, m = 256, 128, 4
    x, *_ = random_expert(rng, hidden, inter, n_tokens=m)
    experts = [tuple(w.view(np.uint16) for w in random_expert(rng, hidden, inter, 1)[1:]) for _ in range(3)]
    ours, read = _bench.bench_expert_ffn_vs_read(ISA, x.view(np.uint16), np.arange(m, dtype=np.int64), experts, 2, 7)
    assert len(ours) == len(read) == 7
    assert all(t > 0 for t in ours) and all(t > 0 for t in read)
    with pytest.raises(ValueError, match="shapes do not match"):
        bad = [(experts[0][0], experts[0][1], experts[0][2][:, :64].copy())]
        _bench.bench_expert_ffn_vs_read(ISA, x.view(np.uint16), np.arange(m, dtype=np.int64), bad, 2, 1)

"""Ctrl-C and interpreter exit around long native calls: every long command stops on the
first SIGINT (exit status 130, one line, no traceback), and a daemon thread inside a
layer forward does not abort the interpreter's exit."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from numa_moe.checkpoints.synthetic import make_checkpoint

# SIGINT raises KeyboardInterrupt in the child as in a terminal, even when the suite was
# started with SIGINT ignored (a background job), which the child would inherit.
_ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
_CLI = textwrap.dedent("""
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    {setup}
    from numa_moe_cli.main import cli
    cli(sys.argv[1:], prog_name="numa-moe")
""")
# How long after the first Ctrl-C a command may take to end: the native loops poll every
# ~50 ms; the rest is unwinding and cleanup on a shared, busy machine.
STOP_SECONDS = 10


def _interrupt_cli(args, ready: str, setup: str = "", start_timeout: float = 300,
                   settle_seconds: float = 1.0) -> tuple[int, str, float]:
    """Runs the CLI, waits for a line containing `ready` on its stderr or stdout, lets it
    work `settle_seconds` more, sends one SIGINT; (exit status, stderr, seconds to exit)."""
    child = subprocess.Popen([sys.executable, "-P", "-c", _CLI.format(setup=setup), *map(str, args)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_ENV)
    seen = {"out": b"", "err": b""}
    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ, "out")
    selector.register(child.stderr, selectors.EVENT_READ, "err")

    def pump(deadline: float, until=None) -> bool:
        while time.monotonic() < deadline and selector.get_map():
            for key, _ in selector.select(timeout=0.1):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                seen[key.data] += chunk
            if until and until():
                return True
        return False

    try:
        started = pump(time.monotonic() + start_timeout, lambda: ready.encode() in seen["out"] + seen["err"])
        assert started, f"never printed {ready!r}: {seen}"
        pump(time.monotonic() + settle_seconds)
        assert child.poll() is None, f"ended before the interrupt: {seen}"
        child.send_signal(signal.SIGINT)
        sent = time.monotonic()
        pump(sent + STOP_SECONDS)
        try:
            status = child.wait(timeout=max(0.1, sent + STOP_SECONDS - time.monotonic()))
        except subprocess.TimeoutExpired:
            status = None
        elapsed = time.monotonic() - sent
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        selector.close()
    assert status is not None, f"still running {STOP_SECONDS} s after Ctrl-C: {seen['err'][-2000:]!r}"
    return status, seen["err"].decode(errors="replace"), elapsed


def _assert_interrupted(status: int, stderr: str, before: str) -> None:
    assert status == 130, (status, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    after = stderr[stderr.index(before) + len(before):] if before in stderr else stderr
    lines = [line for line in after.splitlines() if line.strip()]
    assert lines[-1:] == ["Interrupted."], stderr[-2000:]


def test_ctrl_c_stops_bench_kernels_inside_its_native_loop():
    # The first progress line names the expert copies; the (kernel, read) repetitions,
    # all in one native call, start right after they are made.
    status, stderr, _ = _interrupt_cli(
        ["bench", "kernels", "--shapes", "qwen3-30b-a3b", "--format", "int4", "--m", "1", "--no-torch",
         "--page", "4k", "--min-seconds", "0", "--repeats", str(2**31 - 1)], ready="copies", settle_seconds=3)
    _assert_interrupted(status, stderr, "copies")


_MARK_LAYER_REPEATS = """
from numa_moe.apps.benchmarking import layer as _layer
_settle = _layer.settle
def _marked():
    if not getattr(_marked, "done", False):
        _marked.done = True
        print("repeats started", file=sys.stderr, flush=True)
    _settle()
_layer.settle = _marked
"""


def test_ctrl_c_stops_bench_layer_during_its_repeats():
    # bench layer prints nothing before its first row: the child marks the first
    # repetition (settle() runs only inside the timed loop).
    status, stderr, _ = _interrupt_cli(
        ["bench", "layer", "--model", "qwen3-30b-a3b", "--tokens", "1", "--repeats", str(2**31 - 1)],
        ready="repeats started", setup=_MARK_LAYER_REPEATS, settle_seconds=2)
    _assert_interrupted(status, stderr, "repeats started")


def test_ctrl_c_stops_run_steps(tmp_path):
    ck = make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 1, 8, 0, hidden_size=256, intermediate_size=128,
                         progress=False)
    status, stderr, _ = _interrupt_cli(["run", str(ck), "--steps", str(2**31 - 1), "--virtual-nodes", "2"],
                                       ready="step   2:")
    _assert_interrupted(status, stderr, "")


_DAEMON_FORWARD = """
import os, sys, threading, time
import numpy as np
import ml_dtypes
if sys.argv[1] == "openmp":
    import torch  # loads its OpenMP runtime: the pools run on its team
else:
    os.environ["NUMA_MOE_THREADS"] = "own"
from numa_moe import _native
from numa_moe.layer.moe_layer import MoELayer
from numa_moe.placement.segments import SegmentTable

cpus = sorted(os.sched_getaffinity(0))
rng = np.random.default_rng(int(sys.argv[2]))
E, H, I = 8, 512, 256
def bf16(shape):
    return (rng.standard_normal(shape) * 0.05).astype(ml_dtypes.bfloat16)
experts = [(bf16((I, H)), bf16((I, H)), bf16((H, I))) for _ in range(E)]
def whole(rows, cols):
    return SegmentTable.theoretical(rows, cols, "bf16", 4096, (0,))
tables = [{"gate": whole(I, H), "up": whole(I, H), "down": whole(H, I)} for _ in range(E)]
layer = MoELayer(experts, tables, node_cpus=((0,), [cpus]))
x = bf16((16, H))
ids = rng.integers(0, E, (16, 2)).astype(np.int64)
w = np.full((16, 2), 0.5, np.float32)
assert _native.thread_backend().startswith("openmp" if sys.argv[1] == "openmp" else "own threads")
forwards = [0]
def loop():
    while True:
        layer(x, ids, w)
        forwards[0] += 1
threading.Thread(target=loop, daemon=True).start()
while forwards[0] < 3:
    time.sleep(0.001)
time.sleep(float(sys.argv[3]))
print("exiting", flush=True)
"""


@pytest.mark.parametrize("backend", ["own", "openmp"])
def test_exit_while_a_daemon_thread_runs_layer_forwards_is_clean(backend):
    # numpy inputs: with torch tensors the forward also calls torch ops, and a daemon
    # thread inside one of those at exit aborts in torch's own code (docs/architecture.md,
    # "Threads and interpreter exit"). A race (where the daemon thread is when the
    # interpreter exits): a few tries, at different moments.
    for attempt, delay in enumerate((0.0, 0.01, 0.05, 0.2)):
        result = subprocess.run([sys.executable, "-P", "-c", _DAEMON_FORWARD, backend, str(attempt), str(delay)],
                                capture_output=True, text=True, env=_ENV, timeout=120)
        assert "terminate called" not in result.stderr, result.stderr[-2000:]
        assert result.returncode == 0, (attempt, result.returncode, result.stderr[-2000:])
        assert result.stdout.strip() == "exiting", result.stdout

"""This machine's measured yardsticks beyond one node: the read bandwidth of every (CPU
node, memory node) pair and of all CPUs over memory interleaved on every node, and the
register-only peak of each ISA's kernels. numa_moe.apps.simulate describes a machine with them,
`numa-moe doctor` reports them.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from numa_moe.apps.benchmarking import native_loops
from numa_moe.apps.benchmarking.kernels import measure_peak_gflop_s
from numa_moe.placement import memory
from numa_moe.placement.topology import Topology

# Read size per cell: well past any L3, so that the read comes from memory.
READ_MIB = 256


@dataclass(frozen=True)
class ReadMatrix:
    """Streaming read GB/s by the CPUs of each node (rows) from memory bound to each node
    (columns), and by every allowed CPU from memory interleaved over all columns."""
    cpu_nodes: tuple[int, ...]
    memory_nodes: tuple[int, ...]
    gbps: tuple[tuple[float, ...], ...]
    interleaved_gbps: float

    def local(self, cpu_node: int) -> float | None:
        if cpu_node not in self.memory_nodes:
            return None
        return self.gbps[self.cpu_nodes.index(cpu_node)][self.memory_nodes.index(cpu_node)]

    def remote_ratio(self) -> float | None:
        """Median local read over median remote read; None with one node."""
        local, remote = [], []
        for i, c in enumerate(self.cpu_nodes):
            for j, m in enumerate(self.memory_nodes):
                (local if c == m else remote).append(self.gbps[i][j])
        if not local or not remote:
            return None
        return statistics.median(local) / statistics.median(remote)

    def one_node_share(self) -> float | None:
        """The best single node's local read as a fraction of the all-nodes read; None with
        one memory node."""
        if len(self.memory_nodes) < 2:
            return None
        locals_ = [v for v in (self.local(c) for c in self.cpu_nodes) if v is not None]
        if not locals_ or self.interleaved_gbps <= 0:
            return None
        return max(locals_) / self.interleaved_gbps


@contextmanager
def _on_cpus(cpus: Sequence[int]):
    """The calling thread (and the process pool made for it) on ``cpus`` for the block."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _read_gbps(buffer: np.ndarray, threads: int, tries: int) -> float:
    native_loops.stream_read([buffer], threads)  # warms the pool and the TLB
    rates = []
    for _ in range(tries):
        start = time.perf_counter()
        native_loops.stream_read([buffer], threads)
        rates.append(buffer.nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def measure_read_matrix(topo: Topology, read_mib: int = READ_MIB, tries: int = 5,
                        echo: Callable[[str], None] = print) -> ReadMatrix:
    """The read matrix of a real topology: for each node with allowed CPUs, its CPUs read
    a buffer bound to each allowed node with memory, then all allowed CPUs read one buffer
    interleaved over all of them. Median of ``tries`` reads each."""
    if topo.is_virtual:
        raise ValueError("the read matrix needs the real topology: virtual nodes share one memory")
    allowed = set(topo.allowed_cpus)
    cpu_nodes = tuple(n.node_id for n in topo.nodes if allowed & set(n.cpus))
    memory_nodes = tuple(n.node_id for n in topo.nodes
                         if n.memory_total_bytes > 0 and n.node_id in topo.allowed_nodes)
    nbytes = read_mib << 20
    memory.check_fits(nbytes * len(memory_nodes), f"the read matrix's {len(memory_nodes)} buffers of {read_mib} MiB")
    buffers = {}
    for m in memory_nodes:
        buffers[m] = memory.interleaved_empty(nbytes, np.uint8, nodes=[m], page="4k")
        buffers[m][:] = 1
    rows = []
    for c in cpu_nodes:
        cpus = sorted(allowed & set(topo.cpus_of(c)))
        with _on_cpus(cpus):
            rows.append(tuple(_read_gbps(buffers[m], len(cpus), tries) for m in memory_nodes))
        echo(f"read from node {c}'s {len(cpus)} CPU(s): "
             + "  ".join(f"node {m} {gbps:.1f} GB/s" for m, gbps in zip(memory_nodes, rows[-1])))
    buffers.clear()
    everywhere = memory.interleaved_empty(nbytes, np.uint8, nodes=list(memory_nodes), page="4k")
    everywhere[:] = 1
    interleaved = _read_gbps(everywhere, len(allowed), tries)
    echo(f"read by all {len(allowed)} CPU(s), memory interleaved over nodes {list(memory_nodes)}: "
         f"{interleaved:.1f} GB/s")
    return ReadMatrix(cpu_nodes, memory_nodes, tuple(rows), interleaved)


def measure_peaks(threads: int, seconds: float, tries: int,
                  echo: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """Each ISA's register-only peak for the bf16 and the integer kernels, GFLOP/s (int8
    operations for the integers) on ``threads`` threads; ISAs this CPU cannot run are left out."""
    peaks: dict[str, dict[str, float]] = {}
    for isa in native_loops.PEAK_INSTRUCTIONS:
        for weight_format in ("bf16", "int8"):
            try:
                y = measure_peak_gflop_s(isa, threads, seconds=seconds, tries=tries, weight_format=weight_format)
            except (ValueError, RuntimeError):
                continue
            if y is not None:
                peaks.setdefault(isa, {})[weight_format] = y.best
                echo(f"{isa} {weight_format} peak ({native_loops.peak_instruction(isa, weight_format)}): "
                     f"{y.best:.0f} GFLOP/s on {threads} thread(s)")
    return peaks

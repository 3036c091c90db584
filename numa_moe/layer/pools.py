"""The worker pools the layers run on: one per list of per-node CPU lists, shared by every
layer (MoE and attention) over the same CPUs, and the CPUs a topology gives each node."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Sequence

from numa_moe import _native
from numa_moe.placement.topology import current_topology

__all__ = ["worker_pool", "shutdown_pools", "topology_node_cpus", "default_topology"]

# Held weakly: a pool lives while a layer (or another caller) holds it, so layers built
# over ever new topologies do not leave a pool of threads behind each; the pool's
# destructor stops its threads.
_pools: "weakref.WeakValueDictionary[tuple, _native.WorkerPool]" = weakref.WeakValueDictionary()
_pools_lock = threading.Lock()


def worker_pool(node_cpus: Sequence[Sequence[int]], pin: bool = True, spin_us: int = 50):
    """The worker pool for this list of per-node CPU lists, shared by every caller while
    one holds it (its threads start on first use and stop when the last holder drops it,
    or at interpreter exit)."""
    key = (tuple(tuple(int(c) for c in cpus) for cpus in node_cpus), bool(pin), int(spin_us))
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _native.WorkerPool([list(c) for c in key[0]], pin=pin, spin_us=spin_us)
            _pools[key] = pool
        return pool


@atexit.register
def shutdown_pools() -> None:
    """Stops every live pool's threads (registered with atexit; safe to call more than once)."""
    with _pools_lock:
        pools = list(_pools.values())
    for pool in pools:
        pool.shutdown()


def topology_node_cpus(topology) -> tuple[tuple[int, ...], list[list[int]]]:
    """(node ids, CPU list per node) of a Topology (numa_moe.placement.topology), restricted
    to the CPUs this process may use; a node without allowed CPUs borrows all allowed CPUs
    (virtual topologies on small machines share CPUs between nodes)."""
    allowed = set(getattr(topology, "allowed_cpus", ()) or os.sched_getaffinity(0))
    node_ids = tuple(topology.node_ids)
    node_cpus = []
    for node in node_ids:
        cpus = [c for c in topology.cpus_of(node) if c in allowed]
        node_cpus.append(cpus or sorted(allowed))
    return node_ids, node_cpus


def default_topology():
    """The topology a layer built without one runs on: this machine's (current_topology)."""
    return current_topology()


def _reset_lock_in_child() -> None:
    """After fork() the child has only the forking thread: the lock another thread of the
    parent held while making a pool would stay locked for good. The native pools restart
    their threads in the child by themselves."""
    global _pools_lock
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_in_child)

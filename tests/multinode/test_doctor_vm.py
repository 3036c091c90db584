"""`numa-moe doctor` on a real kernel with several nodes: the read matrix's shape and
labels (VM timings are not asserted) and the findings the kernel's own files produce.
tools/run-multinode.sh runs the tier on 2, 3, 4 and 8 nodes (the 8 as two sockets of
four, as SNC-4 / NPS4 lay them out), and this file once more with NUMA balancing on and
transparent huge pages off, and with two SMT threads per core."""

from __future__ import annotations

import os
from pathlib import Path

from numa_moe.apps import doctor_checks as dc
from numa_moe.apps.benchmarking.machine import measure_read_matrix
from numa_moe.placement.topology import Topology


def test_read_matrix_has_a_cell_per_cpu_node_and_memory_node(real_nodes):
    topo = Topology.detect()
    matrix = measure_read_matrix(topo, read_mib=8, tries=1, echo=lambda s: None)
    assert list(matrix.cpu_nodes) == [n.node_id for n in topo.nodes if n.cpus]
    assert list(matrix.memory_nodes) == real_nodes
    assert len(matrix.gbps) == len(matrix.cpu_nodes)
    assert all(len(row) == len(real_nodes) and min(row) > 0 for row in matrix.gbps)
    assert matrix.interleaved_gbps > 0 and matrix.remote_ratio() is not None


def test_sub_numa_layout_and_kernel_settings_as_the_guest_kernel_reports_them(real_nodes):
    topo = Topology.detect()
    host = dc.gather_host_facts()
    findings = {f.check: f for f in dc.diagnose(topo, host)}
    sockets = len(host.sockets)
    if len(real_nodes) > sockets:
        assert findings["sub-numa"].severity == "info"
        assert f"{sockets} socket(s) of {len(real_nodes) // sockets} nodes" in findings["sub-numa"].problem
    balancing = Path("/proc/sys/kernel/numa_balancing")
    assert ("numa-balancing" in findings) == (balancing.exists() and balancing.read_text().strip() != "0")
    thp_off = "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    huge = [f for f in dc.diagnose(topo, host, page="2m") if f.check == "huge-pages"]
    assert [f.severity for f in huge] == (["high"] if thp_off else [])
    assert "node-without-memory" not in findings and "node-without-cpus" not in findings


def test_a_process_bound_to_one_node_is_told_so(real_nodes):
    topo = Topology.detect()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, topo.cpus_of(real_nodes[0]))
    try:
        bound = Topology.detect()
    finally:
        os.sched_setaffinity(0, before)
    findings = {f.check: f for f in dc.diagnose(bound, dc.gather_host_facts())}
    assert "allowed-cpus" in findings and "AllowedCPUs=" in findings["allowed-cpus"].fix


def test_smt_siblings_of_the_guest_are_found():
    host = dc.gather_host_facts()
    topo = Topology.detect()
    smt = [f for f in dc.diagnose(topo, host) if f.check == "smt"]
    siblings = {Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
                for c in topo.allowed_cpus}
    shared = [s for s in siblings if "," in s or "-" in s]
    assert len(smt) == (1 if shared else 0)
    if shared:
        assert f"{len(shared)} core(s)" in smt[0].problem


def test_a_nearly_full_node_is_named(real_nodes):
    import numpy as np

    from numa_moe.placement import memory

    node = real_nodes[-1]
    free = Topology.detect().node(node).memory_free_bytes
    filler = memory.interleaved_empty(max(free - (96 << 20), 1 << 20), np.uint8, nodes=[node])  # touched: resident
    try:
        topo = Topology.detect()
        need = 128 << 20  # each node's share of the experts
        findings = [f for f in dc.diagnose(topo, dc.gather_host_facts(), bytes_per_node=need)
                    if f.check == "node-memory"]
        named = {int(f.problem.split()[1]) for f in findings}
        assert node in named
        assert all(topo.node(n).memory_free_bytes < need * dc.FREE_MEMORY_MARGIN for n in named)
    finally:
        del filler

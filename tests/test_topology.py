"""Topology detection (against sysfs/procfs read independently here), the virtual
topology, and `numa-moe topo`."""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from numa_moe.placement import topology as T
from numa_moe.placement.topology import Topology, current_topology, parse_cpulist, split_cpus


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == ()
    assert parse_cpulist("5") == (5,)
    assert parse_cpulist("0-6:2") == (0, 2, 4, 6)


def test_parse_thp_mode():
    assert T.parse_thp_mode("always [madvise] never") == "madvise"
    assert T.parse_thp_mode("[always] madvise never") == "always"
    assert T.parse_thp_mode("garbage") == "unavailable"


def test_memory_nodes_are_the_online_and_allowed_nodes_of_the_kernel():
    """The allocations' cheap node query (memory_nodes) against sysfs and procfs read here."""
    online, allowed = T.memory_nodes()
    node_dir = Path("/sys/devices/system/node")
    want_online = parse_cpulist((node_dir / "online").read_text()) if (node_dir / "online").exists() else (0,)
    assert online == want_online
    status = Path("/proc/self/status").read_text()
    mems = next(l.split(":")[1] for l in status.splitlines() if l.startswith("Mems_allowed_list"))
    assert allowed == tuple(n for n in online if n in set(parse_cpulist(mems)))
    assert allowed


def test_detect_matches_the_kernel():
    topo = Topology.detect()
    assert not topo.is_virtual
    assert topo.base_page_bytes == os.sysconf("SC_PAGE_SIZE")
    assert topo.allowed_cpus == tuple(sorted(os.sched_getaffinity(0)))
    node_dir = Path("/sys/devices/system/node")
    if node_dir.exists():
        online = parse_cpulist((node_dir / "online").read_text())
        assert topo.node_ids == online
        for node in topo.nodes:
            d = node_dir / f"node{node.node_id}"
            assert node.cpus == parse_cpulist((d / "cpulist").read_text())
            assert node.distances == tuple(int(x) for x in (d / "distance").read_text().split())
            total_kb = next(int(l.split()[-2]) for l in (d / "meminfo").read_text().splitlines() if "MemTotal" in l)
            # never below what the node's zones manage now (more when the kernel is still
            # initialising memory: test_node_memory_adds_up_to_proc_meminfo)
            assert node.memory_total_bytes >= total_kb * 1024
            assert 0 < node.memory_free_bytes <= node.memory_total_bytes
    status = Path("/proc/self/status").read_text()
    mems = next(l.split(":")[1] for l in status.splitlines() if l.startswith("Mems_allowed_list"))
    assert set(topo.allowed_nodes) == set(parse_cpulist(mems)) & set(topo.node_ids)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():
        assert f"[{topo.thp_mode}]" in thp.read_text()
    nb = Path("/proc/sys/kernel/numa_balancing")
    if nb.exists():
        assert topo.numa_balancing == (int(nb.read_text()) != 0)
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = set(next(l for l in cpuinfo.splitlines() if l.startswith("flags")).split(":")[1].split())
    for key, flag in [("avx2", "avx2"), ("avx512f", "avx512f"), ("avx512bw", "avx512bw"), ("avx512vl", "avx512vl"),
                      ("avx512_bf16", "avx512_bf16"), ("avx512_vnni", "avx512_vnni"), ("avx512_vbmi", "avx512vbmi"),
                      ("amx_tile", "amx_tile"),
                      ("amx_bf16", "amx_bf16"), ("amx_int8", "amx_int8"), ("fma", "fma"), ("f16c", "f16c"),
                      ("avx_vnni", "avx_vnni")]:
        assert topo.cpu_features[key] == (flag in flags), key
    if not topo.cpu_features["amx_tile"]:
        assert not topo.amx_permitted and "AMX" in topo.amx_reason
    assert all(n.cpus == topo.cpus_of(n.node_id) for n in topo.nodes)
    with pytest.raises(ValueError, match="no NUMA node 999"):
        topo.cpus_of(999)


def _proc_meminfo_bytes(key: str) -> int:
    line = next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def test_node_memory_adds_up_to_proc_meminfo():
    # A VM whose kernel initialises memory lazily showed 5.8 GiB in node0/meminfo while
    # /proc/meminfo said 23 GiB; the nodes' totals must add up to the machine's.
    topo = Topology.detect()
    machine_total = _proc_meminfo_bytes("MemTotal")
    assert sum(n.memory_total_bytes for n in topo.nodes) == pytest.approx(machine_total, rel=0.01)
    if len(topo.nodes) == 1:
        assert topo.nodes[0].memory_total_bytes == machine_total
        # free memory moves while the test runs; 2% of the machine is a wide margin
        assert topo.nodes[0].memory_free_bytes == pytest.approx(_proc_meminfo_bytes("MemFree"),
                                                                abs=0.02 * machine_total)


def test_reconcile_node_memory_shares_the_shortfall_by_unmanaged_pages():
    gib = 1 << 30
    # one node: the machine's figure
    assert T.reconcile_node_memory({0: 6 * gib}, 23 * gib, {0: 4_000_000}) == {0: 23 * gib}
    # two nodes: node 1 has three times node 0's pages not managed yet, so it gets 3/4
    out = T.reconcile_node_memory({0: 10 * gib, 1: 2 * gib}, 20 * gib, {0: 100, 1: 300})
    assert out == {0: 12 * gib, 1: 8 * gib}
    # no zoneinfo: even split, still adding up exactly
    out = T.reconcile_node_memory({0: 1000, 1: 1000}, 3001, {})
    assert sum(out.values()) == 3001 and abs(out[0] - out[1]) <= 1
    # figures that already add up (or more: hot-removed memory) are left alone
    assert T.reconcile_node_memory({0: 5, 1: 7}, 12, {0: 9}) == {0: 5, 1: 7}
    assert T.reconcile_node_memory({0: 5, 1: 7}, None, {}) == {0: 5, 1: 7}


def test_parse_zoneinfo_unmanaged_pages():
    text = """Node 0, zone      DMA
  pages free     3840
        spanned  4095
        present  3998
        managed  3840
Node 0, zone   Normal
        spanned  5505024
        present  5505024
        managed  950272
Node 1, zone   Normal
        present  100
        managed  100
"""
    assert T.parse_zoneinfo_unmanaged_pages(text) == {0: 158 + 5505024 - 950272, 1: 0}


@pytest.mark.parametrize("n_nodes", [1, 2, 3, 4, 8])
def test_virtual_topology_splits_cpus_and_memory(n_nodes):
    base = Topology.detect()
    v = Topology.virtual(n_nodes, base)
    assert v.is_virtual and v.kind == "virtual" and v.node_ids == tuple(range(n_nodes))
    assert v.allowed_nodes == v.node_ids and v.allowed_cpus == base.allowed_cpus
    cpus = [c for n in v.nodes for c in n.cpus]
    assert set(cpus) == set(base.allowed_cpus)  # every allowed CPU is used
    if len(base.allowed_cpus) >= n_nodes:
        assert sorted(cpus) == sorted(base.allowed_cpus) and not v.cpus_shared  # a partition
        sizes = [len(n.cpus) for n in v.nodes]
        assert max(sizes) - min(sizes) <= 1
    else:
        assert v.cpus_shared and all(len(n.cpus) == 1 for n in v.nodes)
        assert any("share CPUs" in w for w in v.warnings())
    total = sum(n.memory_total_bytes for n in base.nodes if n.node_id in base.allowed_nodes)
    assert all(n.memory_total_bytes == total // n_nodes for n in v.nodes)
    for i, n in enumerate(v.nodes):
        assert n.distances[i] == 10 and all(d == 20 for j, d in enumerate(n.distances) if j != i)
    assert any("virtual" in w for w in v.warnings())


def test_split_cpus_contiguous_and_shared():
    assert split_cpus((0, 1, 2, 3, 4), 2) == ((0, 1), (2, 3, 4))
    assert split_cpus((4, 5), 3) == ((4,), (5,), (4,))
    with pytest.raises(ValueError, match="n_nodes >= 1"):
        split_cpus((0,), 0)


def test_virtual_rejects_bad_counts():
    with pytest.raises(ValueError, match="1..1024"):
        Topology.virtual(0)
    with pytest.raises(TypeError, match="int"):
        Topology.virtual(2.0)


def test_current_topology_env(monkeypatch):
    monkeypatch.setenv("NUMA_MOE_VIRTUAL_NODES", "3")
    t = current_topology()
    assert t.is_virtual and len(t.nodes) == 3
    monkeypatch.setenv("NUMA_MOE_VIRTUAL_NODES", "three")
    with pytest.raises(ValueError, match="NUMA_MOE_VIRTUAL_NODES"):
        current_topology()
    monkeypatch.delenv("NUMA_MOE_VIRTUAL_NODES")
    assert not current_topology().is_virtual


def test_warnings_for_balancing_and_thp_always():
    base = Topology.detect()
    from dataclasses import replace

    w = replace(base, numa_balancing=True, thp_mode="always").warnings()
    assert any("balancing is on" in x for x in w)
    assert any("2 MB" in x for x in w)
    assert not any("balancing" in x for x in replace(base, numa_balancing=False).warnings())


def _cli(*args, env=None):
    from numa_moe_cli.main import cli

    return CliRunner().invoke(cli, list(args), env=env)


def test_cli_topo_human_and_json():
    r = _cli("topo")
    assert r.exit_code == 0, r.output
    topo = Topology.detect()
    assert f"{len(topo.nodes)} node(s)" in r.output and "transparent huge pages" in r.output and "AMX" in r.output
    gib = topo.nodes[0].memory_total_bytes / (1 << 30)
    assert f"memory total {gib:.1f} GiB, free " in r.output
    r = _cli("topo", "--json")
    data = json.loads(r.output)
    assert data["node_ids"] == list(topo.node_ids) and data["kind"] == "real"
    assert data["nodes"][0]["cpus"] == list(topo.nodes[0].cpus)
    r = _cli("topo", "--json", env={"NUMA_MOE_VIRTUAL_NODES": "4"})
    data = json.loads(r.output)
    assert data["kind"] == "virtual" and len(data["nodes"]) == 4
    assert any("virtual" in w for w in data["warnings"])
    r = _cli("topo", "--virtual", "2")
    assert "virtual node 1" in r.output


def test_cli_topo_bad_args_one_line():
    r = _cli("topo", env={"NUMA_MOE_VIRTUAL_NODES": "x"})
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert r.output.strip().count("\n") == 0 and "NUMA_MOE_VIRTUAL_NODES" in r.output
    r = _cli("topo", "--virtual", "0")
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_format_cpulist_is_the_inverse_of_parse_cpulist(rng):
    from numa_moe.placement.topology import format_cpulist

    assert format_cpulist([]) == "-" and format_cpulist([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    for _ in range(50):
        cpus = sorted(set(rng.integers(0, 64, int(rng.integers(1, 40))).tolist()))
        assert parse_cpulist(format_cpulist(cpus)) == tuple(cpus)

"""`numa-moe doctor`: each check against a configuration made to have its condition (and
a clean one that has none), the facts gathered from a written sysfs/procfs tree, and the
command end to end on this machine."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner
from numa_moe_cli.main import cli

from numa_moe.apps import doctor_checks as dc
from numa_moe.apps.simulate import load_machine
from numa_moe.placement.topology import NodeInfo, Topology

GIB = 1 << 30


def two_socket_topology(nodes_per_socket: int = 1, cpus_per_node: int = 4, **changes) -> Topology:
    """A clean real topology: sockets of `nodes_per_socket` nodes, 64 GiB per node, 50 free."""
    n = 2 * nodes_per_socket
    nodes = []
    for i in range(n):
        same_socket = lambda j: j // nodes_per_socket == i // nodes_per_socket  # noqa: E731
        distances = tuple(10 if j == i else (12 if same_socket(j) else 21) for j in range(n))
        nodes.append(NodeInfo(i, tuple(range(i * cpus_per_node, (i + 1) * cpus_per_node)), 64 * GIB, 50 * GIB,
                              distances))
    topo = Topology(tuple(nodes), 4096, 2 << 20, "madvise", False,
                    tuple(range(n * cpus_per_node)), tuple(range(n)), {"avx2": True}, False, False)
    return replace(topo, **changes)


def clean_host(topo: Topology, nodes_per_socket: int = 1, **changes) -> dc.HostFacts:
    packages = {c: node.node_id // nodes_per_socket for node in topo.nodes for c in node.cpus}
    host = dc.HostFacts(tuple(sorted(packages)), packages, (), {c: "performance" for c in packages},
                        0, 0, "GenuineIntel", {})
    return replace(host, **changes)


def checks_named(findings, name):
    return [f for f in findings if f.check == name]


def test_a_clean_configuration_has_no_finding():
    topo = two_socket_topology(nodes_per_socket=2)
    findings = dc.diagnose(topo, clean_host(topo, 2), bytes_per_node=10 * GIB,
                           table_summary={"matrices": 6, "matching": 6, "mismatches": 0})
    assert [f for f in findings if f.severity != "info"] == []
    # the sub-NUMA mode is reported, as a fact and not a problem
    (snc,) = checks_named(findings, "sub-numa")
    assert snc.severity == "info" and "SNC-2" in snc.problem and "12" in snc.problem and "21" in snc.problem


def test_sub_numa_off_on_two_sockets_and_the_amd_name():
    topo = two_socket_topology(nodes_per_socket=1)
    (f,) = checks_named(dc.diagnose(topo, clean_host(topo)), "sub-numa")
    assert f.severity == "low" and "SNC-2 or SNC-3" in f.fix
    amd = dc.diagnose(topo, clean_host(topo, vendor="AuthenticAMD"))
    assert "NPS2 or NPS4" in checks_named(amd, "sub-numa")[0].fix
    topo4 = two_socket_topology(nodes_per_socket=4)
    (nps,) = checks_named(dc.diagnose(topo4, clean_host(topo4, 4, vendor="AuthenticAMD")), "sub-numa")
    assert "NPS4" in nps.problem and "2 socket(s) of 4 nodes" in nps.problem


def test_nodes_without_memory_or_without_cpus():
    topo = two_socket_topology()
    nodes = (replace(topo.nodes[0], memory_total_bytes=0, memory_free_bytes=0),
             topo.nodes[1], NodeInfo(2, (), 128 * GIB, 120 * GIB, (20, 20, 10)))
    topo = replace(topo, nodes=nodes, allowed_nodes=(0, 1, 2))
    findings = dc.diagnose(topo, clean_host(two_socket_topology()))
    (no_memory,) = checks_named(findings, "node-without-memory")
    assert no_memory.severity == "high" and "node 0" in no_memory.problem
    (no_cpus,) = checks_named(findings, "node-without-cpus")
    assert "node 2" in no_cpus.problem and "--nodes 0,1" in no_cpus.fix
    assert findings[0].severity == "high"  # most costly first


def test_numa_balancing_on():
    topo = two_socket_topology(numa_balancing=True)
    (f,) = checks_named(dc.diagnose(topo, clean_host(topo)), "numa-balancing")
    assert f.fix == "`sudo sysctl kernel.numa_balancing=0` (persist in /etc/sysctl.d/)"


@pytest.mark.parametrize("thp, page, severity", [("never", "2m", "high"), ("always", "4k", "info"),
                                                  ("madvise", "2m", None), ("never", "4k", None)])
def test_huge_page_modes(thp, page, severity):
    topo = two_socket_topology(thp_mode=thp)
    found = checks_named(dc.diagnose(topo, clean_host(topo), page=page), "huge-pages")
    assert [f.severity for f in found] == ([severity] if severity else [])


def test_free_memory_per_node_against_the_experts():
    topo = two_socket_topology()
    nodes = (replace(topo.nodes[0], memory_free_bytes=8 * GIB), replace(topo.nodes[1], memory_free_bytes=10 * GIB))
    topo = replace(topo, nodes=nodes)
    findings = checks_named(dc.diagnose(topo, clean_host(topo), bytes_per_node=9.5 * GIB), "node-memory")
    assert [(f.severity, f.problem.split(" has")[0]) for f in findings] == [("high", "node 0"), ("medium", "node 1")]
    assert checks_named(dc.diagnose(topo, clean_host(topo), bytes_per_node=5 * GIB), "node-memory") == []


def test_swap_in_use():
    topo = two_socket_topology()
    (f,) = checks_named(dc.diagnose(topo, clean_host(topo, swap_total_bytes=8 * GIB, swap_free_bytes=6 * GIB)),
                        "swap")
    assert "2.0 GiB" in f.problem and "swapoff" in f.fix


def test_a_cpuset_or_membind_narrower_than_the_machine():
    topo = two_socket_topology(allowed_cpus=(0, 1, 2, 3), allowed_nodes=(0,))
    findings = dc.diagnose(topo, clean_host(two_socket_topology()))
    (cpus,) = checks_named(findings, "allowed-cpus")
    assert "CPUs 0-3 of 0-7" in cpus.problem and "AllowedCPUs=0-7" in cpus.fix
    (mems,) = checks_named(findings, "allowed-nodes")
    assert "nodes 0 of 0-1" in mems.problem


def test_smt_siblings_among_the_workers():
    topo = two_socket_topology()
    host = clean_host(topo, smt_siblings=((0, 4), (1, 5)))  # cpus 0/4 and 1/5 share cores
    (f,) = checks_named(dc.diagnose(topo, host), "smt")
    assert "2 core(s)" in f.problem and "taskset -c 0-3,6-7" in f.fix
    # siblings outside the allowed CPUs do not count
    narrow = replace(topo, allowed_cpus=(0, 1, 2, 3))
    assert checks_named(dc.diagnose(narrow, host), "smt") == []


def test_frequency_governor():
    topo = two_socket_topology()
    governors = {c: ("powersave" if c < 2 else "performance") for c in range(8)}
    (f,) = checks_named(dc.diagnose(topo, clean_host(topo, governors=governors)), "cpu-governor")
    assert "CPUs 0-1" in f.problem and "powersave" in f.problem


def test_amx_present_but_not_granted():
    features = {"amx_tile": True, "amx_bf16": True}
    topo = two_socket_topology(cpu_features=features, amx_reason="arch_prctl failed: EINVAL")
    (f,) = checks_named(dc.diagnose(topo, clean_host(topo)), "amx")
    assert f.severity == "high" and "EINVAL" in f.problem
    assert checks_named(dc.diagnose(replace(topo, amx_permitted=True), clean_host(topo)), "amx") == []


def test_openmp_settings_that_fight_the_pool():
    topo = two_socket_topology()
    env = {"OMP_PROC_BIND": "close", "GOMP_CPU_AFFINITY": "0-7", "OMP_NUM_THREADS": "4"}
    findings = dc.diagnose(topo, clean_host(topo, environment=env))
    (pin,) = checks_named(findings, "openmp-pinning")
    assert "unset OMP_PROC_BIND GOMP_CPU_AFFINITY" in pin.fix and "NUMA_MOE_THREADS=own" in pin.fix
    (threads,) = checks_named(findings, "openmp-threads")
    assert "4 of 8" in threads.problem


def test_pages_not_where_the_interleave_rule_puts_them():
    topo = two_socket_topology()
    (f,) = checks_named(dc.diagnose(topo, clean_host(topo), table_summary={"matrices": 6, "matching": 4,
                                                                           "mismatches": 2}), "placement")
    assert f.severity == "medium" and "2 of 6" in f.problem


def test_a_node_that_holds_up_the_step():
    topo = two_socket_topology(nodes_per_socket=2)
    host = clean_host(topo, 2)
    (f,) = checks_named(dc.diagnose(topo, host, node_busy_ms=[2.0, 2.1, 3.0, 1.9]), "imbalance")
    assert "node position 2" in f.problem and "3.00 ms" in f.problem
    assert checks_named(dc.diagnose(topo, host, node_busy_ms=[2.0, 2.1, 2.4, 1.9]), "imbalance") == []
    assert checks_named(dc.diagnose(topo, host, node_busy_ms=[5.0]), "imbalance") == []


def test_host_facts_from_a_written_sysfs_and_procfs(tmp_path):
    cpu = tmp_path / "sys/devices/system/cpu"
    for c, (package, siblings, governor) in enumerate([(0, "0,2", "performance"), (0, "1,3", "powersave"),
                                                       (0, "0,2", "performance"), (0, "1,3", None)]):
        (cpu / f"cpu{c}/topology").mkdir(parents=True)
        (cpu / f"cpu{c}/topology/physical_package_id").write_text(f"{package}\n")
        (cpu / f"cpu{c}/topology/thread_siblings_list").write_text(f"{siblings}\n")
        if governor:
            (cpu / f"cpu{c}/cpufreq").mkdir()
            (cpu / f"cpu{c}/cpufreq/scaling_governor").write_text(f"{governor}\n")
    (cpu / "online").write_text("0-3\n")
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 100 kB\nSwapTotal:     2048 kB\nSwapFree:      1024 kB\n")
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n")
    host = dc.gather_host_facts(tmp_path, {"OMP_PROC_BIND": "true", "PATH": "/bin"})
    assert host.online_cpus == (0, 1, 2, 3)
    assert host.smt_siblings == ((0, 2), (1, 3))
    assert dict(host.governors) == {0: "performance", 1: "powersave", 2: "performance"}
    assert (host.swap_total_bytes, host.swap_free_bytes) == (2 << 20, 1 << 20)
    assert host.vendor == "AuthenticAMD" and dict(host.environment) == {"OMP_PROC_BIND": "true"}
    assert host.sockets == (0,)


def _doctor(*args):
    return CliRunner().invoke(cli, ["doctor", *args])


def test_doctor_json_and_machine_file_on_this_machine(tmp_path):
    machine_file = tmp_path / "this.json"
    result = _doctor("--quick", "--json", "--write-machine", str(machine_file))
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    topo = Topology.detect()
    read = report["read"]
    with_cpus = [n.node_id for n in topo.nodes if set(n.cpus) & set(topo.allowed_cpus)]
    assert read["cpu_nodes"] == with_cpus
    assert len(read["gbps"]) == len(with_cpus) and all(len(r) == len(read["memory_nodes"]) for r in read["gbps"])
    assert all(v > 0 for r in read["gbps"] for v in r) and read["interleaved_gbps"] > 0
    assert "measuring reads" in result.stderr  # progress on stderr, the report alone on stdout
    machine = load_machine(machine_file)
    assert machine.nodes == len(with_cpus) and machine.read_gbps[0][0] == pytest.approx(read["gbps"][0][0])


def test_doctor_refuses_bad_arguments_in_one_line(tmp_path):
    both = _doctor(str(tmp_path), "--like", "qwen3-30b-a3b")
    assert both.exit_code == 2 and "not both" in both.stderr
    unknown = _doctor("--like", "no-such-model", "--quick")
    assert unknown.exit_code == 1 and "unknown model 'no-such-model'" in unknown.stderr
    assert "Traceback" not in unknown.stderr


def test_layer_step_beside_its_projection_on_virtual_nodes(tmp_path, monkeypatch):
    import math

    from numa_moe.apps import doctor
    from numa_moe.checkpoints.synthetic import make_checkpoint

    ck = make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 1, 8, 0, hidden_size=512, intermediate_size=256,
                         progress=False)
    monkeypatch.setenv("NUMA_MOE_VIRTUAL_NODES", "2")
    lines = []
    report = doctor.run_doctor(ck, quick=True, echo=lines.append)
    assert [s.tokens for s in report.steps] == list(doctor.STEP_TOKENS)
    for s in report.steps:
        assert s.measured_ms > 0 and math.isfinite(s.projected_ms) and s.projected_ms > 0
        assert len(s.node_busy_ms) == 2 and 0 < s.of_ceiling
    assert any("layer step at 16 token(s)" in line for line in lines)
    assert "placement" not in {f.check for f in report.findings}
    text = doctor.format_report(report)
    assert "layer step of" in text and "projected ms" in text
    json.dumps(report.to_dict(), default=str)  # the --json form serializes


def test_openmp_pinning_in_the_environment_reaches_the_report(monkeypatch):
    monkeypatch.setenv("OMP_PROC_BIND", "spread")
    result = _doctor("--quick", "--json")
    assert result.exit_code == 0, result.stderr
    findings = {f["check"]: f for f in json.loads(result.stdout)["findings"]}
    assert "OMP_PROC_BIND=spread" in findings["openmp-pinning"]["problem"]
    assert "unset OMP_PROC_BIND" in findings["openmp-pinning"]["fix"]

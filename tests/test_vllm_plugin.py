"""The parts of the vLLM plugin (numa_moe.integrations.vllm) that need no vLLM: its
settings, the worker CPU set it reads from vLLM's OpenMP variables, and the topology cut
down to those CPUs. The plugin inside a running vLLM is tests/vllm_tier (its own venv)."""

import os

import pytest

from numa_moe.integrations import vllm as plugin
from numa_moe.placement.topology import LOCAL_DISTANCE, REMOTE_DISTANCE, NodeInfo, Topology


def test_plugin_switch():
    assert plugin.plugin_enabled({})
    assert plugin.plugin_enabled({"NUMA_MOE_VLLM": "1"})
    for off in ("0", "false", "OFF", " no "):
        assert not plugin.plugin_enabled({"NUMA_MOE_VLLM": off})


def test_weight_format_settings():
    assert plugin.weight_format_from_env({}) == ("bf16", 128)
    assert plugin.weight_format_from_env({"NUMA_MOE_VLLM_WEIGHT_FORMAT": "INT4", "NUMA_MOE_VLLM_GROUP": "32"}) == ("int4", 32)
    with pytest.raises(ValueError, match="NUMA_MOE_VLLM_WEIGHT_FORMAT='fp8'"):
        plugin.weight_format_from_env({"NUMA_MOE_VLLM_WEIGHT_FORMAT": "fp8"})
    with pytest.raises(ValueError, match="NUMA_MOE_VLLM_GROUP='x'"):
        plugin.weight_format_from_env({"NUMA_MOE_VLLM_GROUP": "x"})
    with pytest.raises(ValueError, match="must be positive"):
        plugin.weight_format_from_env({"NUMA_MOE_VLLM_GROUP": "0"})
    for fmt in ("mxfp4", "iq4nl"):  # their own group
        assert plugin.weight_format_from_env({"NUMA_MOE_VLLM_WEIGHT_FORMAT": fmt}) == (fmt, 32)
        with pytest.raises(ValueError, match=f"NUMA_MOE_VLLM_GROUP=64: {fmt} takes group 32 only"):
            plugin.weight_format_from_env({"NUMA_MOE_VLLM_WEIGHT_FORMAT": fmt, "NUMA_MOE_VLLM_GROUP": "64"})


@pytest.mark.parametrize("environ, cpus", [
    # what vllm/utils/ompmultiprocessing.py writes for each OpenMP runtime
    ({"OMP_PLACES": "{0,1,2,5}", "OMP_PROC_BIND": "true"}, (0, 1, 2, 5)),
    ({"OMP_PLACES": "{4:4}"}, (4, 5, 6, 7)),
    ({"OMP_PLACES": "{0},{2},{3}"}, (0, 2, 3)),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[8,9,10,12]", "OMP_PLACES": "{0}"}, (8, 9, 10, 12)),
    ({"GOMP_CPU_AFFINITY": "3 4 5 9"}, (3, 4, 5, 9)),
    ({"GOMP_CPU_AFFINITY": "0-3 8"}, (0, 1, 2, 3, 8)),
    ({}, None),
    ({"OMP_PLACES": "cores"}, None),  # an abstract place name: vLLM never writes one
])
def test_openmp_bound_cpus(environ, cpus):
    assert plugin.openmp_bound_cpus(environ) == cpus


def test_openmp_bound_cpus_rejects_unreadable_values():
    with pytest.raises(ValueError, match="OMP_PLACES"):
        plugin.openmp_bound_cpus({"OMP_PLACES": "{0,x}"})
    with pytest.raises(ValueError, match="GOMP_CPU_AFFINITY"):
        plugin.openmp_bound_cpus({"GOMP_CPU_AFFINITY": "0 a"})


def four_node_topology():
    base = Topology.detect()
    nodes = tuple(NodeInfo(node_id=n, cpus=tuple(range(4 * n, 4 * n + 4)), memory_total_bytes=1 << 30,
                           memory_free_bytes=1 << 29,
                           distances=tuple(LOCAL_DISTANCE if m == n else REMOTE_DISTANCE + m for m in range(4)))
                  for n in range(4))
    from dataclasses import replace

    return replace(base, nodes=nodes, allowed_cpus=tuple(range(16)), allowed_nodes=(0, 1, 2, 3), is_virtual=True)


def test_topology_restricted_to_one_node_of_cpus():
    """TP > 1: vLLM binds each rank to CPUs of one node; the layer keeps that node only."""
    topo = four_node_topology().restricted_to_cpus([9, 10, 11])
    assert topo.node_ids == (2,)
    assert topo.cpus_of(2) == (9, 10, 11)
    assert topo.allowed_cpus == (9, 10, 11)
    assert topo.allowed_nodes == (2,)
    assert topo.nodes[0].distances == (LOCAL_DISTANCE,)


def test_topology_restricted_across_nodes():
    """TP = 1 bound across the machine: every node with a bound CPU, the distances between them."""
    topo = four_node_topology().restricted_to_cpus([1, 2, 3, 13, 14, 15])
    assert topo.node_ids == (0, 3)
    assert topo.cpus_of(0) == (1, 2, 3) and topo.cpus_of(3) == (13, 14, 15)
    assert topo.nodes[0].distances == (LOCAL_DISTANCE, REMOTE_DISTANCE + 3)
    assert topo.nodes[1].distances == (REMOTE_DISTANCE + 0, LOCAL_DISTANCE)
    with pytest.raises(ValueError, match="none of CPUs"):
        four_node_topology().restricted_to_cpus([99])


def test_worker_topology_follows_the_binding():
    base = four_node_topology()
    assert plugin.worker_topology({"OMP_PLACES": "{4,5}"}, base=base).node_ids == (1,)
    # no binding: the process's own affinity (on this machine, its real CPUs)
    real = Topology.detect()
    assert plugin.worker_topology({}, base=real).allowed_cpus == tuple(sorted(os.sched_getaffinity(0)))


def test_serve_check_comparison():
    """vllm_check.compare: equal runs, a divergence at a near-tie of the stock run, and one
    away from a tie (the verdict serve-check and the vLLM tier rely on)."""
    from numa_moe.integrations.vllm_check import TIE_LOGPROB, RunResult, compare, max_logprob_difference

    def run(tokens, logprobs):
        return RunResult(tokens=tokens, logprobs=logprobs, workers=[])

    steps = [[-1.0, -3.0], [-0.5, -0.5 - TIE_LOGPROB / 2], [-2.0, -4.0]]
    stock = run([[5, 6, 7]], [steps])
    same = compare(stock, run([[5, 6, 7]], [[[-1.01, -3.0], [-0.5, -0.6], [-2.0, -4.0]]]))
    assert same.equal and same.matched == [3] and same.gaps == [None]
    # chosen-token logprobs -1.01 at every step against -1.0, -0.5, -2.0
    assert abs(max_logprob_difference(stock, run([[5, 6, 7]], [[[-1.01, -3.0]] * 3]), same) - 0.99) < 1e-9
    at_tie = compare(stock, run([[5, 9, 7]], [steps]))
    assert not at_tie.equal and at_tie.ties_only and at_tie.matched == [1]
    away = compare(stock, run([[8, 6, 7]], [steps]))
    assert not away.equal and not away.ties_only and away.gaps == [2.0]

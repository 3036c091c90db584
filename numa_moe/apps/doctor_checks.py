"""What this machine's configuration costs a MoE layer that streams weights per node, and
the exact change that removes the cost: one :class:`Finding` per condition.

The checks are pure functions of a :class:`Topology` and the :class:`HostFacts` gathered
from sysfs, procfs and the environment (``gather_host_facts``), so every condition can be
made in a test by writing the facts, without the machine that has it.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from numa_moe.placement.topology import Topology, format_cpulist, parse_cpulist

SEVERITIES = ("high", "medium", "low", "info")
# OpenMP settings that pin or size torch's team, the threads numa-moe's workers run on.
OPENMP_PINNING = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
OPENMP_VARIABLES = ("OMP_NUM_THREADS", *OPENMP_PINNING, "OMP_WAIT_POLICY")
# Below this share of a node's free memory the kernel reclaims and may swap under the load.
FREE_MEMORY_MARGIN = 1.1
# A node busy this many times the median node's time holds up every step.
BUSY_IMBALANCE = 1.25


@dataclass(frozen=True)
class Finding:
    severity: str  # one of SEVERITIES, most costly first
    check: str     # a short stable name, e.g. "numa-balancing"
    problem: str   # the condition on this machine
    cost: str      # what it costs the layer step
    fix: str       # the exact command or setting that removes it

    def line(self) -> str:
        return f"[{self.severity}] {self.problem}: {self.cost}. Fix: {self.fix}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HostFacts:
    """What the checks need beyond the topology."""
    online_cpus: tuple[int, ...]
    cpu_packages: Mapping[int, int]              # cpu -> physical package (socket)
    smt_siblings: tuple[tuple[int, ...], ...]    # each core's hardware threads, cores with 2+
    governors: Mapping[int, str]                 # cpu -> cpufreq governor, where readable
    swap_total_bytes: int
    swap_free_bytes: int
    vendor: str                                  # "GenuineIntel", "AuthenticAMD", ...
    environment: Mapping[str, str] = field(default_factory=dict)  # the OPENMP_VARIABLES set

    @property
    def sockets(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.cpu_packages.values())))


# --------------------------------------------------------------------------- gathering


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def gather_host_facts(root: Path | str = "/", environ: Mapping[str, str] | None = None) -> HostFacts:
    """The host facts under ``root`` (a copy of /sys and /proc in tests)."""
    root = Path(root)
    cpu_dir = root / "sys/devices/system/cpu"
    online = parse_cpulist(_read(cpu_dir / "online") or "") or tuple(range(os.cpu_count() or 1))
    packages, siblings, governors = {}, set(), {}
    for cpu in online:
        topo = cpu_dir / f"cpu{cpu}/topology"
        package = _read(topo / "physical_package_id")
        if package is not None and package.strip().lstrip("-").isdigit():
            packages[cpu] = int(package)
        threads = parse_cpulist(_read(topo / "thread_siblings_list") or "")
        if len(threads) > 1:
            siblings.add(threads)
        governor = _read(cpu_dir / f"cpu{cpu}/cpufreq/scaling_governor")
        if governor:
            governors[cpu] = governor.strip()
    meminfo = _read(root / "proc/meminfo") or ""
    cpuinfo = _read(root / "proc/cpuinfo") or ""
    vendor = re.search(r"vendor_id\s*:\s*(\S+)", cpuinfo)
    env = os.environ if environ is None else environ
    return HostFacts(online, packages, tuple(sorted(siblings)), governors,
                     _meminfo_bytes(meminfo, "SwapTotal"), _meminfo_bytes(meminfo, "SwapFree"),
                     vendor.group(1) if vendor else "unknown",
                     {k: env[k] for k in OPENMP_VARIABLES if k in env})


def _meminfo_bytes(text: str, key: str) -> int:
    m = re.search(rf"^{key}:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


# --------------------------------------------------------------------------- checks


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def check_nodes(topo: Topology, host: HostFacts) -> list[Finding]:
    """Nodes that have CPUs but no memory, or memory but no CPUs."""
    out = []
    for node in topo.nodes:
        if node.cpus and node.memory_total_bytes == 0:
            out.append(Finding(
                "high", "node-without-memory", f"node {node.node_id} has CPUs {format_cpulist(node.cpus)} but no memory",
                "its workers read every weight from another node's memory, at the remote rate",
                "populate the node's memory channels, or leave its CPUs out: "
                f"`taskset -c <the other nodes' CPUs> numa-moe ...`"))
        elif not node.cpus and node.memory_total_bytes > 0:
            out.append(Finding(
                "medium", "node-without-cpus",
                f"node {node.node_id} has {_gib(node.memory_total_bytes)} of memory but no CPUs (CXL or HBM in flat mode)",
                "weights interleaved onto it are read remotely by every worker",
                "interleave over the nodes with CPUs only: `numa-moe run --nodes "
                f"{','.join(str(n.node_id) for n in topo.nodes if n.cpus)} ...`"))
    return out


def check_sub_numa(topo: Topology, host: HostFacts) -> list[Finding]:
    """The sub-NUMA mode (Intel SNC, AMD NPS) from nodes per socket and the distances."""
    if topo.is_virtual or not host.cpu_packages:
        return []
    per_socket: dict[int, set[int]] = {}
    for node in topo.nodes:
        for cpu in node.cpus:
            if cpu in host.cpu_packages:
                per_socket.setdefault(host.cpu_packages[cpu], set()).add(node.node_id)
    if not per_socket:
        return []
    sockets = len(per_socket)
    nodes_per_socket = max(len(v) for v in per_socket.values())
    mode = f"SNC-{nodes_per_socket}" if host.vendor == "GenuineIntel" else f"NPS{nodes_per_socket}"
    distances = sorted({d for node in topo.nodes for d in node.distances})
    if nodes_per_socket > 1:
        near_far = " / ".join(str(d) for d in distances)
        return [Finding(
            "info", "sub-numa", f"{sockets} socket(s) of {nodes_per_socket} nodes each ({mode}; distances {near_far})",
            f"each node's workers read the nearest 1/{nodes_per_socket} of the socket's memory controllers; numa-moe's tables "
            "place every expert over any number of nodes from one copy: nothing to lose here",
            "nothing to change")]
    if sockets > 1:
        name = "SNC-2 or SNC-3" if host.vendor == "GenuineIntel" else "NPS2 or NPS4"
        return [Finding(
            "low", "sub-numa", f"{sockets} sockets, one node each (sub-NUMA clustering off)",
            "each worker reads from all of its socket's memory controllers, farther on average than in a "
            "sub-NUMA mode",
            f"try {name} in the BIOS and compare `numa-moe doctor` in both modes")]
    return []


def check_numa_balancing(topo: Topology, host: HostFacts) -> list[Finding]:
    if not topo.numa_balancing:
        return []
    return [Finding(
        "medium", "numa-balancing", "automatic NUMA balancing is on",
        "the kernel unmaps pages to sample accesses (hinting faults on the activations and torch's "
        "memory) and migrates default-policy pages; numa-moe's interleaved weights are exempt",
        "`sudo sysctl kernel.numa_balancing=0` (persist in /etc/sysctl.d/)")]


def check_huge_pages(topo: Topology, host: HostFacts, page: str = "4k") -> list[Finding]:
    if page == "2m" and topo.thp_mode in ("never", "unavailable"):
        return [Finding(
            "high", "huge-pages", f"2 MB pages asked for but transparent huge pages are '{topo.thp_mode}'",
            "the experts cannot be placed with --page 2m",
            "`echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled`")]
    if topo.thp_mode == "always" and page == "4k":
        return [Finding(
            "info", "huge-pages", "transparent huge pages are 'always'",
            "numa-moe's 4 KB tables are unaffected (its buffers opt out with MADV_NOHUGEPAGE); other "
            "memory comes in 2 MB pages",
            "nothing to change; --page 2m uses them for the experts too (period 2 MB)")]
    return []


def check_memory(topo: Topology, host: HostFacts, bytes_per_node: float | None) -> list[Finding]:
    """Free memory per node against the experts' bytes per node; swap."""
    out = []
    if bytes_per_node:
        for node in topo.nodes:
            if node.memory_total_bytes == 0 or node.node_id not in topo.allowed_nodes:
                continue
            free = node.memory_free_bytes
            if free < bytes_per_node * FREE_MEMORY_MARGIN:
                severity = "high" if free < bytes_per_node else "medium"
                out.append(Finding(
                    severity, "node-memory",
                    f"node {node.node_id} has {_gib(free)} free for the {_gib(bytes_per_node)} of experts it holds",
                    "the kernel places the rest on another node (remote reads) or swaps" if free < bytes_per_node
                    else "less than 10% headroom: page cache and activations push pages to other nodes",
                    "free memory on that node (`sync; echo 3 | sudo tee /proc/sys/vm/drop_caches` drops the "
                    "page cache), or load fewer layers or a smaller format (--format int4)"))
    used = host.swap_total_bytes - host.swap_free_bytes
    if used > 0:
        out.append(Finding(
            "low", "swap", f"{_gib(used)} of swap in use",
            "an expert page swapped out turns a step's streaming read into a disk read",
            "`sudo swapoff -a`, or `sudo sysctl vm.swappiness=1`"))
    return out


def check_allowed(topo: Topology, host: HostFacts) -> list[Finding]:
    """A cpuset, taskset or numactl wrapper narrower than the machine."""
    if topo.is_virtual:
        return []
    out = []
    machine_cpus = set(host.online_cpus)
    allowed = set(topo.allowed_cpus)
    if allowed < machine_cpus:
        out.append(Finding(
            "medium", "allowed-cpus",
            f"this process may run on CPUs {format_cpulist(sorted(allowed))} of {format_cpulist(sorted(machine_cpus))}",
            f"{len(machine_cpus) - len(allowed)} CPUs do not read weights (a cgroup cpuset, taskset or numactl)",
            "run without the wrapper, or widen the cgroup: `sudo systemctl set-property <unit> AllowedCPUs="
            f"{format_cpulist(sorted(machine_cpus))}`"))
    with_memory = {n.node_id for n in topo.nodes if n.memory_total_bytes > 0}
    if set(topo.allowed_nodes) < with_memory:
        out.append(Finding(
            "medium", "allowed-nodes",
            f"this process may allocate on nodes {format_cpulist(topo.allowed_nodes)} of {format_cpulist(sorted(with_memory))}",
            "weights cannot be interleaved over every node: the other nodes' workers read remotely",
            "run without `numactl --membind`/`--cpunodebind`, or widen the cgroup's cpuset.mems"))
    return out


def check_smt(topo: Topology, host: HostFacts) -> list[Finding]:
    allowed = set(topo.allowed_cpus)
    shared = [tuple(c for c in group if c in allowed) for group in host.smt_siblings]
    shared = [g for g in shared if len(g) > 1]
    if not shared:
        return []
    one_per_core = sorted((allowed - {c for g in shared for c in g}) | {g[0] for g in shared})
    return [Finding(
        "low", "smt", f"{len(shared)} core(s) run two or more workers (SMT siblings, e.g. {format_cpulist(shared[0])})",
        "siblings share one core's load ports and caches: a streaming read gains little from the second "
        "thread and a barrier waits for the slower one",
        f"measure with one worker per core: `taskset -c {format_cpulist(one_per_core)} numa-moe ...`")]


def check_governor(topo: Topology, host: HostFacts) -> list[Finding]:
    slow = sorted(c for c, g in host.governors.items() if c in topo.allowed_cpus and g != "performance")
    if not slow:
        return []
    kinds = sorted({host.governors[c] for c in slow})
    return [Finding(
        "low", "cpu-governor", f"CPUs {format_cpulist(slow)} use the {'/'.join(kinds)} frequency governor",
        "cores clock down between steps and ramp up inside the next one",
        "`sudo cpupower frequency-set -g performance`")]


def check_amx(topo: Topology, host: HostFacts) -> list[Finding]:
    if not topo.cpu_features.get("amx_tile") or topo.amx_permitted:
        return []
    return [Finding(
        "high", "amx", f"the CPU has AMX but Linux does not grant it ({topo.amx_reason or 'no reason given'})",
        "prefill and batched decode run on AVX-512 at a fraction of the AMX peak",
        "a kernel >= 5.16 (it grants AMX through arch_prctl); in a VM, a hypervisor that passes AMX's "
        "XSAVE state (QEMU >= 7.1, `-cpu host`)")]


def check_openmp(topo: Topology, host: HostFacts) -> list[Finding]:
    out = []
    pinning = [k for k in OPENMP_PINNING if k in host.environment]
    if pinning:
        settings = " ".join(f"{k}={host.environment[k]}" for k in pinning)
        out.append(Finding(
            "medium", "openmp-pinning", f"{settings} is set",
            "numa-moe runs its workers on torch's OpenMP team and pins them per node; the OpenMP runtime "
            "pins the same threads to its own places, so the two move them between calls",
            f"`unset {' '.join(pinning)}`, or keep them and give numa-moe its own threads: `NUMA_MOE_THREADS=own`"))
    threads = host.environment.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit() and 0 < int(threads) < len(topo.allowed_cpus):
        out.append(Finding(
            "low", "openmp-threads", f"OMP_NUM_THREADS={threads} of {len(topo.allowed_cpus)} allowed CPUs",
            "torch's own operators (attention, router) run on fewer threads; numa-moe's experts still use "
            "every allowed CPU",
            "`unset OMP_NUM_THREADS` unless the application shares the machine on purpose"))
    return out


def check_placement(table_summary: Mapping | None) -> list[Finding]:
    """The loaded checkpoint's measured page placement against its segment tables."""
    if not table_summary or not table_summary.get("mismatches"):
        return []
    moved, total = int(table_summary["mismatches"]), int(table_summary["matrices"])
    return [Finding(
        "medium", "placement", f"{moved} of {total} expert matrices did not land on the nodes the interleave "
        "rule gives (a node ran out of memory, or a policy overrode the interleave)",
        "their tables follow the pages as measured, so reads stay local, but the nodes' shares are unequal "
        "and the step waits for the largest",
        "free memory on every node (see node-memory), run without `numactl --membind/--preferred`, "
        "then load again")]


def check_balance(node_busy_ms: Sequence[float] | None) -> list[Finding]:
    """One node's measured busy time in the layer step well above the others'."""
    if not node_busy_ms or len(node_busy_ms) < 2:
        return []
    typical = sorted(node_busy_ms)[len(node_busy_ms) // 2]
    slowest = max(range(len(node_busy_ms)), key=lambda i: node_busy_ms[i])
    if typical <= 0 or node_busy_ms[slowest] < BUSY_IMBALANCE * typical:
        return []
    return [Finding(
        "medium", "imbalance", f"node position {slowest} was busy {node_busy_ms[slowest]:.2f} ms in the layer step, "
        f"the median node {typical:.2f} ms",
        "every step waits for the slowest node",
        "look for other work on that node's CPUs (`top`, `numastat -p <pid>`) and for a node-memory "
        "finding; then measure again")]


def diagnose(topo: Topology, host: HostFacts, *, bytes_per_node: float | None = None, page: str = "4k",
             table_summary: Mapping | None = None, node_busy_ms: Sequence[float] | None = None) -> list[Finding]:
    """Every finding on this configuration, most costly first; with a measured layer step,
    its table summary and per-node busy times."""
    findings = (check_amx(topo, host) + check_nodes(topo, host) + check_placement(table_summary)
                + check_balance(node_busy_ms)
                + check_memory(topo, host, bytes_per_node) + check_allowed(topo, host)
                + check_numa_balancing(topo, host) + check_openmp(topo, host) + check_huge_pages(topo, host, page)
                + check_smt(topo, host) + check_governor(topo, host) + check_sub_numa(topo, host))
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))

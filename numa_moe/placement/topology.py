"""The machine as placement sees it: NUMA nodes, their CPUs and memory, page sizes,
transparent huge page mode, automatic NUMA balancing, what this process may use, and
CPU features. One immutable :class:`Topology` value.

Sources: sysfs (``/sys/devices/system/node``), procfs (node memory is reconciled with
``/proc/meminfo``: see reconcile_node_memory), ``os.sched_getaffinity``,
``get_mempolicy(MPOL_F_MEMS_ALLOWED)``, py-libnuma for distances when sysfs lacks them,
psutil when the kernel has no NUMA sysfs at all, and cpuid (native) for CPU features.

A *virtual* topology (:meth:`Topology.virtual`, or ``NUMA_MOE_VIRTUAL_NODES=N`` for
:func:`current_topology`) splits the allowed CPUs into N logical nodes so multi-node
code paths run on a one-node machine. It changes nothing in the kernel: memory placed
"on virtual node 2" is wherever the kernel put it.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

NODE_SYSFS = Path("/sys/devices/system/node")
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
NUMA_BALANCING = Path("/proc/sys/kernel/numa_balancing")
PROC_MEMINFO = Path("/proc/meminfo")
PROC_ZONEINFO = Path("/proc/zoneinfo")
VIRTUAL_NODES_ENV = "NUMA_MOE_VIRTUAL_NODES"

LOCAL_DISTANCE = 10
REMOTE_DISTANCE = 20


@dataclass(frozen=True)
class NodeInfo:
    node_id: int
    cpus: tuple[int, ...]
    memory_total_bytes: int
    memory_free_bytes: int
    distances: tuple[int, ...]  # to every node of the topology, in node_ids order


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NodeInfo, ...]
    base_page_bytes: int
    huge_page_bytes: int
    thp_mode: str  # "always" | "madvise" | "never" | "unavailable"
    numa_balancing: bool | None  # None: the kernel has no NUMA balancing knob
    allowed_cpus: tuple[int, ...]
    allowed_nodes: tuple[int, ...]
    cpu_features: dict[str, bool] = field(hash=False)
    amx_permitted: bool
    is_virtual: bool
    # Why AMX is not usable (empty when it is), and (virtual only) whether some logical
    # nodes share CPUs because there are fewer allowed CPUs than nodes.
    amx_reason: str = ""
    cpus_shared: bool = False

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(n.node_id for n in self.nodes)

    def node(self, node_id: int) -> NodeInfo:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        kind = "virtual " if self.is_virtual else ""
        raise ValueError(f"no {kind}NUMA node {node_id}; nodes are {list(self.node_ids)}")

    def cpus_of(self, node_id: int) -> tuple[int, ...]:
        return self.node(node_id).cpus

    @property
    def kind(self) -> str:
        return "virtual" if self.is_virtual else "real"

    @classmethod
    def detect(cls) -> Topology:
        return _detect()

    @classmethod
    def virtual(cls, n_nodes: int, base: Topology | None = None) -> Topology:
        return _virtual(n_nodes, base if base is not None else cls.detect())

    def restricted_to_cpus(self, cpus) -> Topology:
        """This topology cut down to the nodes that hold some of ``cpus``, each with only
        those CPUs: what a process bound to ``cpus`` by someone else (a serving engine's
        worker) may use. Raises ValueError when no node holds any of them."""
        wanted = {int(c) for c in cpus}
        keep = [i for i, n in enumerate(self.nodes) if wanted & set(n.cpus)]
        if not keep:
            raise ValueError(f"none of CPUs {sorted(wanted)} belongs to a node of this topology "
                             f"(nodes {list(self.node_ids)})")
        nodes = tuple(replace(self.nodes[i], cpus=tuple(c for c in self.nodes[i].cpus if c in wanted),
                              distances=tuple(self.nodes[i].distances[j] for j in keep)) for i in keep)
        node_ids = {n.node_id for n in nodes}
        return replace(self, nodes=nodes,
                       allowed_cpus=tuple(sorted(c for n in nodes for c in n.cpus)),
                       allowed_nodes=tuple(n for n in self.allowed_nodes if n in node_ids) or tuple(sorted(node_ids)))

    def warnings(self) -> tuple[str, ...]:
        """What a user placing weights must know about this machine."""
        out = []
        if self.is_virtual:
            out.append(
                f"virtual topology in use: {len(self.nodes)} logical nodes over the allowed "
                "CPUs; memory is not really split (the kernel sees the real nodes)"
            )
            if self.cpus_shared:
                out.append("virtual nodes share CPUs: fewer allowed CPUs than virtual nodes")
        if self.numa_balancing:
            out.append(
                "automatic NUMA balancing is on: pages of default-policy memory may move under "
                "a segment table (interleaved buffers are exempt); turn it off with "
                "`sysctl kernel.numa_balancing=0`"
            )
        if self.thp_mode == "always":
            out.append(
                "transparent huge pages are 'always': memory not advised otherwise interleaves "
                f"per {self.huge_page_bytes // (1 << 20)} MB page, not per "
                f"{self.base_page_bytes // 1024} KB page"
            )
        if not self.is_virtual and len(self.nodes) < 2:
            out.append("one NUMA node: placement is trivially local (use a virtual topology, or tools/numa-vm for a VM with several nodes, to test multi-node paths)")
        return tuple(out)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind
        d["node_ids"] = list(self.node_ids)
        d["warnings"] = list(self.warnings())
        return d


def current_topology() -> Topology:
    """The detected topology, or a virtual one with N nodes when NUMA_MOE_VIRTUAL_NODES=N."""
    value = os.environ.get(VIRTUAL_NODES_ENV, "").strip()
    if not value:
        return Topology.detect()
    try:
        n_nodes = int(value)
    except ValueError:
        raise ValueError(f"{VIRTUAL_NODES_ENV}={value!r} is not an integer node count") from None
    return Topology.virtual(n_nodes)


# ---------------------------------------------------------------------------- parsing


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Linux list format ("0-3,8,10-11") to a sorted tuple of ints."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            stride = 1
            if ":" in hi:  # "0-15:2" (rare)
                hi, s = hi.split(":", 1)
                stride = int(s.split("/")[0])
            out.update(range(int(lo), int(hi) + 1, stride))
        else:
            out.add(int(part))
    return tuple(sorted(out))


def format_cpulist(cpus) -> str:
    """A set of ints in Linux list format (0-3,8), the inverse of parse_cpulist; "-" when empty."""
    out, cpus, i = [], sorted(cpus), 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out) or "-"


def parse_thp_mode(text: str) -> str:
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else "unavailable"


def _parse_meminfo_kb(text: str, key: str) -> int | None:
    m = re.search(rf"{key}:\s+(\d+)\s*kB", text)
    return int(m.group(1)) * 1024 if m else None


def parse_zoneinfo_unmanaged_pages(text: str) -> dict[int, int]:
    """Pages per node that are present but not (yet) managed by the page allocator:
    sum over the node's zones of ``present - managed`` in /proc/zoneinfo."""
    out: dict[int, int] = {}
    node = None
    present = None
    for line in text.splitlines():
        head = re.match(r"Node\s+(\d+),\s+zone", line)
        if head:
            node, present = int(head.group(1)), None
            out.setdefault(node, 0)
            continue
        fields = line.split()
        if node is None or len(fields) != 2 or not fields[1].isdigit():
            continue
        if fields[0] == "present":
            present = int(fields[1])
        elif fields[0] == "managed" and present is not None:
            out[node] += max(present - int(fields[1]), 0)
            present = None
    return out


def reconcile_node_memory(node_bytes: dict[int, int], machine_bytes: int | None,
                          unmanaged_pages: dict[int, int]) -> dict[int, int]:
    """Per-node byte counts (MemTotal or MemFree of the nodes' sysfs meminfo) made to add
    up to the machine's figure (the same key of /proc/meminfo).

    A node's meminfo counts the pages its zones manage now. A kernel that initialises
    memory lazily (deferred struct-page init, seen in VMs) hands pages to the zones as it
    goes, while /proc/meminfo counts them all from boot: a 23 GiB VM read 5.8 GiB for
    its only node. The shortfall belongs to the pages present but not managed yet, so it
    is shared out in proportion to each node's count of those (evenly when zoneinfo says
    nothing). Node figures that already add up are returned unchanged."""
    total = sum(node_bytes.values())
    if machine_bytes is None or not node_bytes or machine_bytes <= total:
        return dict(node_bytes)
    shortfall = machine_bytes - total
    weights = {node: unmanaged_pages.get(node, 0) for node in node_bytes}
    if sum(weights.values()) == 0:
        weights = {node: 1 for node in node_bytes}
    weight_sum = sum(weights.values())
    out = {node: value + shortfall * weights[node] // weight_sum for node, value in node_bytes.items()}
    # integer division leaves a few bytes over: give them to the first node
    first = next(iter(out))
    out[first] += machine_bytes - sum(out.values())
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


# ---------------------------------------------------------------------------- detection


def _native():
    from numa_moe import _native

    return _native


def _node_dirs() -> list[int]:
    online = _read(NODE_SYSFS / "online")
    if online is not None:
        return list(parse_cpulist(online))
    if NODE_SYSFS.is_dir():
        return sorted(int(p.name[4:]) for p in NODE_SYSFS.glob("node[0-9]*"))
    return []


def _libnuma_distance(a: int, b: int) -> int | None:
    try:
        from numa import info

        d = int(info.numa_distance(a, b))
        return d if d > 0 else None
    except Exception:  # py-libnuma missing, or libnuma.so.1 not loadable
        return None


def _detect_nodes() -> tuple[NodeInfo, ...]:
    node_ids = _node_dirs()
    if not node_ids:
        import psutil

        vm = psutil.virtual_memory()
        cpus = tuple(range(os.cpu_count() or 1))
        return (NodeInfo(0, cpus, int(vm.total), int(vm.free), (LOCAL_DISTANCE,)),)
    nodes = []
    for nid in node_ids:
        d = NODE_SYSFS / f"node{nid}"
        cpus = parse_cpulist(_read(d / "cpulist") or "")
        meminfo = _read(d / "meminfo") or ""
        total = _parse_meminfo_kb(meminfo, "MemTotal") or 0
        free = _parse_meminfo_kb(meminfo, "MemFree") or 0
        distance_text = _read(d / "distance")
        if distance_text:
            # sysfs lists distances to every *possible* online node, in id order.
            row = [int(x) for x in distance_text.split()]
            distances = tuple(row[i] if i < len(row) else REMOTE_DISTANCE for i in range(len(node_ids)))
        else:
            distances = tuple(
                _libnuma_distance(nid, other) or (LOCAL_DISTANCE if other == nid else REMOTE_DISTANCE)
                for other in node_ids
            )
        nodes.append(NodeInfo(nid, cpus, total, free, distances))
    return _with_machine_memory(tuple(nodes))


def _with_machine_memory(nodes: tuple[NodeInfo, ...]) -> tuple[NodeInfo, ...]:
    """The nodes with total and free memory reconciled with /proc/meminfo (see
    reconcile_node_memory)."""
    machine = _read(PROC_MEMINFO) or ""
    unmanaged = parse_zoneinfo_unmanaged_pages(_read(PROC_ZONEINFO) or "")
    totals = reconcile_node_memory({n.node_id: n.memory_total_bytes for n in nodes},
                                   _parse_meminfo_kb(machine, "MemTotal"), unmanaged)
    frees = reconcile_node_memory({n.node_id: n.memory_free_bytes for n in nodes},
                                  _parse_meminfo_kb(machine, "MemFree"), unmanaged)
    return tuple(replace(n, memory_total_bytes=totals[n.node_id], memory_free_bytes=frees[n.node_id])
                 for n in nodes)


def _mems_allowed(node_ids: tuple[int, ...]) -> tuple[int, ...]:
    try:
        allowed = set(_native().mems_allowed())
    except OSError:
        status = _read(Path("/proc/self/status")) or ""
        m = re.search(r"Mems_allowed_list:\s*(\S+)", status)
        allowed = set(parse_cpulist(m.group(1))) if m else set(node_ids)
    return tuple(n for n in node_ids if n in allowed)


def memory_nodes() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(online node ids, those this process may allocate on), read afresh at each call: the
    part of ``Topology.detect()`` an allocation checks its nodes against, without the per-node
    memory, distances and CPU features detect() reads too (which cost a loader about 1 ms a
    buffer)."""
    node_ids = tuple(_node_dirs()) or (0,)
    return node_ids, _mems_allowed(node_ids)


def _huge_page_bytes() -> int:
    text = _read(THP_PMD_SIZE)
    if text and text.strip().isdigit():
        return int(text)
    meminfo = _read(Path("/proc/meminfo")) or ""
    return _parse_meminfo_kb(meminfo, "Hugepagesize") or 2 << 20


def _detect() -> Topology:
    native = _native()
    nodes = _detect_nodes()
    thp_text = _read(THP_ENABLED)
    balancing_text = _read(NUMA_BALANCING)
    granted, reason = native.request_amx_permission()
    return Topology(
        nodes=nodes,
        base_page_bytes=int(native.base_page_bytes()),
        huge_page_bytes=_huge_page_bytes(),
        thp_mode=parse_thp_mode(thp_text) if thp_text else "unavailable",
        numa_balancing=(int(balancing_text.strip()) != 0) if balancing_text else None,
        allowed_cpus=tuple(sorted(os.sched_getaffinity(0))),
        allowed_nodes=_mems_allowed(tuple(n.node_id for n in nodes)),
        cpu_features=dict(native.cpu_features()),
        amx_permitted=bool(granted),
        is_virtual=False,
        amx_reason=reason,
    )


def split_cpus(cpus: tuple[int, ...], n_nodes: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous split of `cpus` into n_nodes groups (sizes differ by at most one).

    With fewer CPUs than nodes, node i gets cpus[i % len(cpus)]: logical nodes then share
    CPUs, which keeps every node runnable."""
    if n_nodes < 1:
        raise ValueError(f"virtual topology needs n_nodes >= 1, got {n_nodes}")
    if not cpus:
        raise ValueError("virtual topology needs at least one allowed CPU")
    if len(cpus) < n_nodes:
        return tuple((cpus[i % len(cpus)],) for i in range(n_nodes))
    groups = []
    for i in range(n_nodes):
        lo = len(cpus) * i // n_nodes
        hi = len(cpus) * (i + 1) // n_nodes
        groups.append(tuple(cpus[lo:hi]))
    return tuple(groups)


def _virtual(n_nodes: int, base: Topology) -> Topology:
    if not isinstance(n_nodes, int) or isinstance(n_nodes, bool):
        raise TypeError(f"virtual topology: n_nodes must be an int, got {type(n_nodes).__name__}")
    if n_nodes < 1 or n_nodes > 1024:
        raise ValueError(f"virtual topology: n_nodes must be in 1..1024, got {n_nodes}")
    groups = split_cpus(base.allowed_cpus, n_nodes)
    allowed = set(base.allowed_nodes)
    real = [n for n in base.nodes if n.node_id in allowed] or list(base.nodes)
    total = sum(n.memory_total_bytes for n in real)
    free = sum(n.memory_free_bytes for n in real)
    nodes = tuple(
        NodeInfo(
            node_id=i,
            cpus=groups[i],
            memory_total_bytes=total // n_nodes,
            memory_free_bytes=free // n_nodes,
            distances=tuple(LOCAL_DISTANCE if j == i else REMOTE_DISTANCE for j in range(n_nodes)),
        )
        for i in range(n_nodes)
    )
    return replace(
        base,
        nodes=nodes,
        allowed_nodes=tuple(range(n_nodes)),
        is_virtual=True,
        cpus_shared=len(base.allowed_cpus) < n_nodes,
    )

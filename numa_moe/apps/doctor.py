"""`numa-moe doctor`: where this machine stands for weight streaming per node, measured
with the project's own native loops, and what to change (numa_moe.apps.doctor_checks).

Measured: the read bandwidth of every (CPU node, memory node) pair and of all CPUs over
memory interleaved on all nodes; the register-only peak of each ISA's kernels; with a
checkpoint (or a model ``like``), the layer step at 1 and 16 tokens against its read
ceiling beside the step that numa_moe.apps.simulate projects from the measured matrix.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from numa_moe.apps import doctor_checks, simulate
from numa_moe.apps.benchmarking.machine import READ_MIB, ReadMatrix, measure_peaks, measure_read_matrix
from numa_moe.apps.doctor_checks import Finding, HostFacts
from numa_moe.placement.topology import Topology

QUICK_READ_MIB = 64
# Experts of a --like checkpoint: enough that 16 tokens of top-8 routing touch fresh ones,
# few enough that every published shape fits in a desktop's memory.
LIKE_EXPERTS = 32
STEP_TOKENS = (1, 16)


@dataclass
class StepPoint:
    tokens: int
    measured_ms: float
    read_ceiling_ms: float   # the step's weight bytes at the in-run read ceiling
    projected_ms: float      # numa_moe.apps.simulate on the measured matrix, policy (c)
    node_busy_ms: list[float]

    @property
    def of_ceiling(self) -> float:
        return self.read_ceiling_ms / self.measured_ms


@dataclass
class DoctorReport:
    topology: dict
    host: dict
    read: ReadMatrix
    peaks_gflops: dict[str, dict[str, float]]  # isa -> weight format -> GFLOP/s (all threads)
    steps: list[StepPoint] = field(default_factory=list)
    checkpoint: str | None = None
    findings: list[Finding] = field(default_factory=list)
    machine: simulate.Machine | None = None  # for numa_moe.apps.simulate, None when it cannot be described
    machine_problem: str = ""                 # why machine is None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["machine"] = None if self.machine is None else self.machine.to_dict()
        out["findings"] = [f.to_dict() for f in self.findings]
        out["read"]["remote_ratio"] = self.read.remote_ratio()
        out["read"]["one_node_share"] = self.read.one_node_share()
        for point, d in zip(self.steps, out["steps"]):
            d["of_ceiling"] = point.of_ceiling
        return out


def measure_steps(checkpoint, machine: simulate.Machine | None, tokens: Sequence[int], steps: int,
                  page: str = "4k", echo: Callable[[str], None] = print) -> tuple[list[StepPoint], dict]:
    """The layer step of ``checkpoint`` at each token count (numa-moe run's job) and, with
    a machine, its projection; returns the points and the store's table summary."""
    from numa_moe.apps import run as moe_run

    points, tables = [], {}
    for t in tokens:
        echo(f"layer step at {t} token(s) ...")
        report = moe_run.run_job(checkpoint, tokens=t, steps=steps, page=page, echo=lambda s: None, progress=False)
        tables = report.tables
        measured = statistics.median(report.steps_ms)
        ceiling_ms = report.weight_bytes_per_step / (report.ceiling.gbps * 1e9) * 1e3
        projected = float("nan")
        if machine is not None:
            workload = simulate.workload_from_checkpoint(report.checkpoint, fmt=report.weight_format, page=page)
            result = simulate.simulate(machine, workload, [t], policies=["c"], samples=32)["results"][0]
            projected = result.step_ms
        points.append(StepPoint(t, measured, ceiling_ms, projected, report.node_busy_ms))
        echo(f"  measured {measured:.3f} ms, {ceiling_ms / measured:.0%} of the read ceiling; "
             f"projected {projected:.3f} ms")
    return points, tables


def like_checkpoint(like: str, experts: int = LIKE_EXPERTS, echo: Callable[[str], None] = print):
    """A generated checkpoint of ``like``'s expert shapes, one layer of at most ``experts``
    experts, in numa-moe's cache (made on first use)."""
    from numa_moe.apps.run import default_checkpoint_dir
    from numa_moe.checkpoints.synthetic import MODEL_SPECS, make_checkpoint

    if like not in MODEL_SPECS:
        raise ValueError(f"unknown model {like!r}; known: {', '.join(MODEL_SPECS)}")
    n = min(experts, MODEL_SPECS[like].n_experts)
    path = default_checkpoint_dir(like, 1).with_name(f"{like}-1-e{n}")
    if not (path / "config.json").exists():
        echo(f"generating a {like}-shaped checkpoint (1 layer, {n} experts) into {path}")
        make_checkpoint(path, like, 1, n, 0, progress=False, overwrite=True)
    return path


def expert_bytes_per_node(checkpoint, n_nodes: int) -> float:
    """The experts' bytes each node holds once interleaved over ``n_nodes`` (pages split evenly)."""
    workload = simulate.workload_from_checkpoint(checkpoint)
    return workload.expert_bytes() * workload.n_experts * workload.layers / max(1, n_nodes)


def run_doctor(checkpoint=None, *, quick: bool = False, steps: int = 5, page: str = "4k",
               topology: Topology | None = None, host: HostFacts | None = None,
               echo: Callable[[str], None] = print) -> DoctorReport:
    """Measures this machine (and the checkpoint's layer step), then checks its
    configuration; every stage prints one progress line through ``echo``."""
    topo = topology or Topology.detect()
    host = host or doctor_checks.gather_host_facts()
    threads = len(topo.allowed_cpus)
    echo(f"doctor: {len(topo.nodes)} node(s), {threads} allowed CPU(s); measuring reads "
         f"({QUICK_READ_MIB if quick else READ_MIB} MiB per cell) ...")
    read = measure_read_matrix(topo, QUICK_READ_MIB if quick else READ_MIB, 3 if quick else 5, echo)
    echo("doctor: measuring the kernels' peaks ...")
    peaks = measure_peaks(threads, 0.03 if quick else 0.1, 2 if quick else 5, echo)
    from numa_moe.layer.kernels import default_isa

    isa = default_isa()
    machine, machine_problem = None, ""
    try:
        machine = simulate.machine_from_measurements(
            read, peaks, threads, isa, simulate.DEFAULT_KERNEL_EFFICIENCY,
            f"measured by numa-moe doctor (nodes {list(read.cpu_nodes)})")
    except ValueError as error:
        machine_problem = str(error)
        echo(f"doctor: no projection: {error}")
    points, tables, per_node = [], None, None
    if checkpoint is not None:
        points, tables = measure_steps(checkpoint, machine, STEP_TOKENS, 3 if quick else steps, page, echo)
        per_node = expert_bytes_per_node(checkpoint, len(read.memory_nodes))
    busy = points[-1].node_busy_ms if points else None
    findings = doctor_checks.diagnose(topo, host, bytes_per_node=per_node, page=page, table_summary=tables,
                                      node_busy_ms=busy)
    return DoctorReport(topo.to_dict(), asdict(host), read, peaks, points,
                        None if checkpoint is None else str(checkpoint), findings, machine, machine_problem)


def format_report(report: DoctorReport) -> str:
    read = report.read
    lines = ["read bandwidth, GB/s (rows: the CPUs of a node; columns: memory bound to a node)",
             "         " + "".join(f"{'mem ' + str(m):>10}" for m in read.memory_nodes)]
    for c, row in zip(read.cpu_nodes, read.gbps):
        lines.append(f"cpus {c:<4}" + "".join(f"{v:>10.1f}" for v in row))
    lines.append(f"all CPUs, interleaved over every node: {read.interleaved_gbps:.1f} GB/s")
    ratio, share = read.remote_ratio(), read.one_node_share()
    if ratio is not None:
        lines.append(f"local / remote read: {ratio:.2f}")
    if share is not None:
        lines.append(f"one node's local read is {share:.0%} of the all-nodes read")
    for isa, p in report.peaks_gflops.items():
        lines.append(f"peak {isa}: " + ", ".join(f"{f} {v:.0f} GFLOP/s" for f, v in p.items()))
    if report.steps:
        lines.append(f"layer step of {report.checkpoint}:")
        lines.append(f"{'tokens':>8} {'measured ms':>12} {'of read':>8} {'projected ms':>13} {'node busy ms':>14}")
        for s in report.steps:
            busy = " ".join(f"{b:.2f}" for b in s.node_busy_ms)
            lines.append(f"{s.tokens:>8} {s.measured_ms:>12.3f} {s.of_ceiling:>8.0%} {s.projected_ms:>13.3f} {busy:>14}")
    if report.findings:
        lines.append(f"findings ({len(report.findings)}, most costly first):")
        lines.extend(f"  {f.line()}" for f in report.findings)
    else:
        lines.append("findings: none: nothing here costs the layer step")
    return "\n".join(lines)

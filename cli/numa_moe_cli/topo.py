"""`numa-moe topo`: the machine as placement sees it, with the warnings a user needs."""

from __future__ import annotations

import json

import click

from numa_moe.placement.topology import format_cpulist

_FEATURES = [
    ("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("avx_vnni", "AVX-VNNI"), ("avx512f", "AVX512F"), ("avx512bw", "AVX512BW"),
    ("avx512vl", "AVX512VL"), ("avx512_bf16", "AVX512_BF16"), ("avx512_vnni", "AVX512_VNNI"),
    ("avx512_vbmi", "AVX512_VBMI"), ("amx_tile", "AMX-TILE"), ("amx_bf16", "AMX-BF16"), ("amx_int8", "AMX-INT8"),
]


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def render(topo) -> str:
    kind = "virtual" if topo.is_virtual else "real"
    lines = [f"NUMA topology ({kind}): {len(topo.nodes)} node(s)"]
    for node in topo.nodes:
        label = "virtual node" if topo.is_virtual else "node"
        lines.append(
            f"  {label} {node.node_id}: cpus {format_cpulist(node.cpus)}  memory total {_gib(node.memory_total_bytes)},"
            f" free {_gib(node.memory_free_bytes)}  distances {' '.join(map(str, node.distances))}"
        )
    lines.append(f"pages: base {topo.base_page_bytes // 1024} KB, huge {topo.huge_page_bytes // (1 << 20)} MB;"
                 f" transparent huge pages: {topo.thp_mode}")
    balancing = {True: "on", False: "off", None: "not available"}[topo.numa_balancing]
    lines.append(f"automatic NUMA balancing: {balancing}")
    lines.append(f"allowed cpus: {format_cpulist(topo.allowed_cpus)}; allowed nodes: {format_cpulist(topo.allowed_nodes)}")
    present = [name for key, name in _FEATURES if topo.cpu_features.get(key)]
    lines.append(f"cpu features: {' '.join(present) or 'none of interest'}")
    amx = "granted by Linux" if topo.amx_permitted else f"not usable ({topo.amx_reason})"
    lines.append(f"AMX: {amx}")
    lines.append("worker threads: the OpenMP team of torch once torch is loaded (libgomp), else numa-moe's own "
                 "pinned threads (NUMA_MOE_THREADS=own forces them)")
    for warning in topo.warnings():
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


@click.command("topo")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--virtual", "virtual_nodes", type=click.IntRange(1, 1024), default=None,
              help="Show a virtual topology with N logical nodes (also: NUMA_MOE_VIRTUAL_NODES=N).")
def topo(as_json: bool, virtual_nodes: int | None) -> None:
    """Nodes, CPUs, memory, distances, page sizes, THP and NUMA balancing, CPU features."""
    from numa_moe.placement.topology import Topology, current_topology

    try:
        t = Topology.virtual(virtual_nodes) if virtual_nodes else current_topology()
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(t.to_dict(), indent=2))
    else:
        click.echo(render(t))

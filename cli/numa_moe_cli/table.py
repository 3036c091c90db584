"""``numa-moe table``: the periodic segment table of one weight matrix (and its scales)."""

from __future__ import annotations

import json

import click

from numa_moe_cli.options import page_option

from numa_moe.placement.pages import page_bytes_of

from numa_moe.formats import SCALE_DTYPES, WEIGHT_FORMATS
from numa_moe.placement.segments import SegmentTable, period_rows, scale_shape, scales_table


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _summary(table: SegmentTable, page_bytes: int, n_nodes: int, phase: int,
             offset_bytes: int) -> dict:
    return {
        "period_rows_formula": period_rows(table.row_bytes, page_bytes, n_nodes),
        "row_bytes": table.row_bytes,
        "phase": phase,
        "offset_bytes": offset_bytes,
        "bytes_per_node": {str(n): b for n, b in table.bytes_per_node().items()},
        "balance": table.balance(),
        "table": table.to_dict(),
    }


def _print_table(title: str, table: SegmentTable, page_label: str, phase: int,
                 offset_bytes: int, max_segments: int | None) -> None:
    n_nodes = len(table.nodes)
    cycle = table.page_bytes * n_nodes
    formula = period_rows(table.row_bytes, table.page_bytes, n_nodes)
    click.echo(f"{title}: {table.rows} x {table.cols} {table.fmt}, {table.row_bytes} B per "
               f"row, {page_label} pages, {n_nodes} node(s) {list(table.nodes)}, "
               f"phase {phase}, offset {offset_bytes} B")
    click.echo(f"  period: T = {table.page_bytes} * {n_nodes} / gcd({table.row_bytes}, "
               f"{cycle}) = {formula} rows")
    if table.period_rows is None:
        click.echo(f"  the matrix holds fewer than two periods: explicit one-row segments "
                   f"({table.segment_count()} in all)")
    elif table.period_rows != formula:
        click.echo(f"  smallest period in this matrix: {table.period_rows} rows")
    per_node = table.bytes_per_node()
    total = sum(per_node.values())
    for node, segs in table.segments.items():
        share = 100.0 * per_node[node] / total
        click.echo(f"  node {node}: {len(segs)} segment(s), {per_node[node]} B "
                   f"({_human_bytes(per_node[node])}, {share:.1f}%)")
        shown = segs if max_segments is None else segs[:max_segments]
        if shown:
            click.echo(f"    {'row0':>8} {'stride':>7} {'nrows':>7} {'k0':>8} {'k1':>8}")
        for s in shown:
            click.echo(f"    {s.row0:>8} {s.row_stride:>7} {s.nrows:>7} {s.k0:>8} {s.k1:>8}")
        if len(shown) < len(segs):
            click.echo(f"    ... {len(segs) - len(shown)} more (--all to list them)")
    click.echo(f"  balance (max/mean bytes per node): {table.balance():.4f}")


@click.command("table", short_help="One matrix from its shape: its segment table.")
@click.option("--rows", type=click.IntRange(min=1), required=True,
              help="Rows of the weight matrix (output features).")
@click.option("--cols", type=click.IntRange(min=1), required=True,
              help="Columns K of the weight matrix (input features, contiguous in memory).")
@click.option("--dtype", type=click.Choice(sorted(WEIGHT_FORMATS)), default="bf16",
              show_default=True, help="Element format of the weights.")
@click.option("--group", type=click.IntRange(min=1), default=None,
              help="Scale group size along K: also show the table of the rows x cols/group "
                   "scale tensor (a separate buffer).")
@click.option("--scale-dtype", type=click.Choice(list(SCALE_DTYPES)), default="fp32",
              show_default=True, help="Element format of the group scales.")
@click.option("--nodes", "n_nodes", type=click.IntRange(min=1), required=True,
              help="Number of NUMA nodes the buffer is interleaved over (nodes 0..N-1).")
@page_option()
@click.option("--phase", type=click.IntRange(min=0), default=0, show_default=True,
              help="Index of the node holding the buffer's first page.")
@click.option("--offset-bytes", type=click.IntRange(min=0), default=0, show_default=True,
              help="Where the matrix starts inside its first page.")
@click.option("--scale-phase", type=click.IntRange(min=0), default=0, show_default=True,
              help="Phase of the scale buffer.")
@click.option("--all", "show_all", is_flag=True, help="List every segment (default: 16 per node).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")
def table(rows, cols, dtype, group, scale_dtype, n_nodes, page, phase, offset_bytes,
          scale_phase, show_all, as_json):
    """One matrix from its shape: its periodic segment table in interleaved memory.

    For a ROWS x COLS weight matrix (no checkpoint needed; `numa-moe tables` does every
    expert tensor of a checkpoint).

    Prints the period T = page*N / gcd(row_bytes, page*N), each node's strided segments
    (row0, row_stride, nrows, k0, k1 in elements), the bytes on each node and the
    balance; with --group, the same for the group-scale tensor.
    """
    page_bytes = page_bytes_of(page)
    if phase >= n_nodes:
        raise click.BadParameter(f"{phase} is not below --nodes {n_nodes}", param_hint="--phase")
    if scale_phase >= n_nodes:
        raise click.BadParameter(f"{scale_phase} is not below --nodes {n_nodes}",
                                 param_hint="--scale-phase")
    try:
        weights = SegmentTable.theoretical(rows, cols, dtype, page_bytes, n_nodes, phase=phase,
                                           offset_bytes=offset_bytes)
        scales = None
        if group is not None:
            scale_shape(rows, cols, group, dtype)
            scales = scales_table(rows, cols, group, scale_dtype, page_bytes, n_nodes,
                                  phase=scale_phase, fmt=dtype)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    if as_json:
        out = {"weights": _summary(weights, page_bytes, n_nodes, phase, offset_bytes)}
        if scales is not None:
            out["scales"] = _summary(scales, page_bytes, n_nodes, scale_phase, 0)
            out["scales"]["group"] = group
        click.echo(json.dumps(out))
        return
    limit = None if show_all else 16
    _print_table("weights", weights, page, phase, offset_bytes, limit)
    if scales is not None:
        click.echo()
        _print_table(f"scales (group {group})", scales, page, scale_phase, 0, limit)

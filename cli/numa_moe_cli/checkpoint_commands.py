"""``numa-moe make-checkpoint``, ``quantize``, ``tables`` and ``inspect``: thin shells over
the package."""

from __future__ import annotations

import json
from pathlib import Path

import click

from numa_moe_cli.options import (QUANT_FORMAT_CHOICES, WEIGHT_FORMAT_CHOICES, check_apart, check_output, output_file,
                                  page_option, write_output)

_MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "qwen3-235b", "qwen2-57b-a14b", "gpt-oss-20b",
           "gpt-oss-120b")


def _pattern_options(fn):
    fn = click.option("--kinds", "kinds", default=None, metavar="NAME=KIND,...",
                      help="With --pattern: map the kind group's text to gate/up/down/gate_up, "
                           "e.g. w1=gate,w3=up,w2=down.")(fn)
    fn = click.option("--pattern", default=None, metavar="REGEX",
                      help="Naming pattern of routed-expert tensors: a regex with named groups "
                           "layer, kind and (unless fused 3-D) expert. See docs/checkpoints.md.")(fn)
    return fn


def _naming(pattern: str | None, kinds: str | None):
    from numa_moe.checkpoints.naming import NamingPattern, parse_kind_map

    if pattern is None:
        if kinds is not None:
            raise click.UsageError("--kinds needs --pattern")
        return None
    if kinds is None:
        raise click.UsageError("--pattern needs --kinds (e.g. --kinds w1=gate,w3=up,w2=down)")
    return NamingPattern("custom", pattern, parse_kind_map(kinds))


def _open(path: str, pattern: str | None, kinds: str | None):
    from numa_moe.checkpoints.safetensors import Checkpoint
    from numa_moe.checkpoints.dispatch import open_checkpoint
    from numa_moe.files import CheckpointError

    try:
        return open_checkpoint(path, pattern=_naming(pattern, kinds))
    except CheckpointError as err:
        raise click.ClickException(str(err)) from None


@click.command("make-checkpoint")
@click.option("--like", "like", type=click.Choice(_MODELS), default="qwen3-30b-a3b", show_default=True,
              help="Model whose expert shapes, tensor names and config keys are reproduced.")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="MoE layers to generate (default per model, see docs/checkpoints.md).")
@click.option("--experts", type=click.IntRange(min=1), default=None,
              help="Routed experts per layer (default per model; at most the real count).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--fused", is_flag=True, help="Write fused 3-D expert tensors (gate_up_proj, down_proj).")
@click.option("--shared/--no-shared", default=True, show_default=True,
              help="Include the model's shared expert(s) (Qwen2-MoE, DeepSeek-V3).")
@click.option("--shard-mb", type=click.IntRange(min=1), default=512, show_default=True,
              help="Shard the output above this many MiB per file.")
@click.option("-o", "--output", "output", required=True, type=click.Path(file_okay=False),
              help="Output directory.")
@click.option("--overwrite", is_flag=True,
              help="Accepted for compatibility; changes nothing. OUTPUT may be new, empty or an "
                   "earlier numa-moe output (replaced whole); a directory holding anything else "
                   "is refused.")
@click.option("--format", "fmt", type=click.Choice(WEIGHT_FORMAT_CHOICES), default=None,
              help="Routed experts in bf16, or quantized as by `numa-moe quantize` [default: bf16; "
                   "gpt-oss: mxfp4, the released layout; bf16 is transformers' layout].")
@click.option("--group", type=click.Choice(["32", "64", "128"]), default=None,
              help="Scale group size (quantized formats) [default: 128; mxfp4, iq4nl, int4-affine: 32].")
@click.option("--scale-dtype", type=click.Choice(["fp16", "bf16", "fp32", "e8m0"]), default=None,
              help="Element type of the group scales (quantized formats) [default: fp16; mxfp4: e8m0].")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def make_checkpoint_command(like, layers, experts, seed, fused, shared, shard_mb, output, overwrite,
                            fmt, group, scale_dtype, quiet):
    """Generate a small safetensors checkpoint with a real model's expert shapes."""
    from numa_moe.checkpoints.safetensors import Checkpoint
    from numa_moe.checkpoints.dispatch import open_checkpoint
    from numa_moe.checkpoints.synthetic import make_checkpoint

    try:
        out = make_checkpoint(output, like, layers, experts, seed, fused=fused, shared=shared,
                              max_shard_bytes=shard_mb << 20, progress=not quiet,
                              overwrite=overwrite, weight_format=fmt,
                              group=None if group is None else int(group), scale_dtype=scale_dtype)
    except ValueError as err:
        raise click.ClickException(str(err)) from None
    except OSError as err:
        raise click.ClickException(f"cannot write {output}: {err.strerror or err}") from None
    ck = open_checkpoint(out)
    size = sum(f.stat().st_size for f in ck.files)
    d = ck.dims
    fmt = ck.source_format if ck.quant is None else ck.quant.describe()
    click.echo(f"wrote {out}: {len(ck.files)} file(s), {size / 2**20:.1f} MiB; {like}: "
               f"{len(ck.layers)} MoE layer(s) x {d.n_experts} experts, H={d.hidden_size}, "
               f"I={d.intermediate_size}, top-k={d.top_k}, {fmt}, naming {', '.join(ck.naming)}")


@click.command("tables", short_help="Every expert tensor of a checkpoint: its segment tables.")
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.option("--nodes", default="2", show_default=True,
              help="Interleave nodes: a count N (nodes 0..N-1) or a list such as 0,2.")
@page_option()
@click.option("--format", "fmt", type=click.Choice(WEIGHT_FORMAT_CHOICES), default=None,
              help="Weight format of the loaded experts [default: the checkpoint's when it is "
                   "quantized, else bf16].")
@click.option("--group", type=click.IntRange(min=1), default=None,
              help="Scale group size (elements along k) for the quantized formats [default: the "
                   "checkpoint's when quantized, else 128; mxfp4, iq4nl, int4-affine: 32].")
@click.option("--scale-dtype", "--scale-format", "scale_dtype",
              type=click.Choice(["fp16", "bf16", "fp32", "e8m0"]), default=None,
              help="Element format of the group scales (quantized formats only) [default: the "
                   "checkpoint's when quantized, else fp32; mxfp4: e8m0].")
@click.option("--layers", default=None, help="Comma-separated MoE layer ids (default all).")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="JSON file to write the tables to (missing folders are created, and said so).")
@_pattern_options
@click.option("--quiet", is_flag=True, help="No progress bar.")
def tables_command(checkpoint, nodes, page, fmt, group, scale_dtype, layers, output, pattern,
                   kinds, quiet):
    """Every expert tensor of a checkpoint: the segment tables of its routed-expert buffers.

    Read from the checkpoint's headers only (`numa-moe table` does one matrix from its shape).

    CHECKPOINT: a file or directory, or a Hugging Face repo id (ORG/NAME) whose snapshot
    is in the local cache (nothing is downloaded).
    """
    from numa_moe.layer.store import buffer_shape, checkpoint_tables, page_bytes_of, parse_nodes
    from numa_moe.formats import QUANT_FORMATS
    from numa_moe.quant import scale_layout

    if group is not None and fmt == "bf16":
        raise click.UsageError("--group applies to the quantized --format values only")
    check_output(output, "-o", create_parents=True)
    ck = _open(checkpoint, pattern, kinds)
    check_apart(output, "-o", ck.sources)
    quant = ck.quant
    if ck.importer is not None:
        # GGUF / FP8: the tables of the buffers the store converts them into
        try:
            load = ck.importer.resolve(ck.root, ck.dims, fmt, group, scale_dtype)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
        fmt, group, scale_dtype = load.fmt, load.group, load.scale_dtype
    elif fmt is None:
        fmt = quant.fmt if quant is not None else "bf16"
        if group is not None and fmt == "bf16":
            raise click.UsageError("--group applies to the quantized --format values only")
    if quant is not None and fmt == quant.fmt:
        group = group or quant.group
        scale_dtype = scale_dtype or quant.scale_dtype
    if fmt in QUANT_FORMATS:
        try:
            group, scale_dtype = scale_layout(fmt, group, scale_dtype, default_scale_dtype="fp32",
                                              any_group=True)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
    try:
        node_ids = parse_nodes(nodes)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--nodes") from None
    try:
        layer_ids = None if layers is None else [int(x) for x in layers.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected layer ids such as 0,3, got {layers!r}",
                                 param_hint="--layers") from None
    try:
        tables = checkpoint_tables(ck, node_ids, page, fmt, group, scale_dtype, layer_ids,
                                   progress=not quiet)
    except ValueError as err:
        raise click.ClickException(str(err)) from None
    d = ck.dims
    document = {
        "schema": "numa-moe/checkpoint-tables",
        "version": 1,
        "checkpoint": str(Path(ck.root).resolve()),
        "naming": list(ck.naming),
        "checkpoint_dtype": ck.dtype,
        "source_format": ck.source_format,
        "format": fmt,
        "group": group if fmt in QUANT_FORMATS else None,
        "scale_format": scale_dtype if fmt in QUANT_FORMATS else None,
        "nodes": list(node_ids),
        "page_bytes": page_bytes_of(page),
        "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
        "n_experts": d.n_experts, "top_k": d.top_k, "sources": d.sources,
        "layout": {kind: {"shape": list(buffer_shape(d, kind)),
                          "expert_rows": buffer_shape(d, kind)[0] // d.n_experts}
                   for kind in ("gate", "up", "down")},
        "layers": {str(layer): {name: t.to_dict() for name, t in per_layer.items()}
                   for layer, per_layer in tables.items()},
    }
    write_output(output, json.dumps(document, indent=1) + "\n", "-o", create_parents=True)
    click.echo(f"{ck.root}: {len(tables)} MoE layer(s), E={d.n_experts} H={d.hidden_size} "
               f"I={d.intermediate_size}; {fmt}, {page} pages, nodes {list(node_ids)}")
    click.echo(f"{'layer':>5}  {'buffer':<12} {'shape':>16}  {'period':>7}  {'segs':>5}  "
               f"{'balance':>7}  bytes per node")
    for layer, per_layer in tables.items():
        for name, t in per_layer.items():
            per_node = ", ".join(f"{n}: {b / 2**20:.2f} MiB" for n, b in t.bytes_per_node().items())
            period = "-" if t.period_rows is None else str(t.period_rows)
            click.echo(f"{layer:>5}  {name:<12} {f'[{t.rows}, {t.cols}]':>16}  {period:>7}  "
                       f"{t.segment_count():>5}  {t.balance():>7.3f}  {per_node}")
    click.echo(f"wrote {output}")


@click.command("inspect")
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.option("--tensor", "tensor", default=None, metavar="PATTERN",
              help="Only tensors whose name matches this glob (*.experts.0.*) or regex.")
@click.option("--all-tensors", is_flag=True, help="Every tensor, not only the routed experts.")
@click.option("--nodes", default=None,
              help="Worker nodes of the split: count N or list 0,2 (default: the machine's nodes).")
@click.option("--touch", type=click.Choice(["resident", "all", "none"]), default="resident",
              show_default=True,
              help="resident: map the pages already cached (no I/O); all: read every page like a "
                   "loader; none: touch nothing.")
@click.option("--plot", "plot", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG: one strip per tensor coloured by node (needs matplotlib).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--pages", is_flag=True, help="With --json: include the per-page node lists.")
@click.option("--format", "fmt", type=click.Choice(WEIGHT_FORMAT_CHOICES), default=None,
              help="GGUF / FP8 only: the format to report the load of (its cost and its error "
                   "against the file's own values) [default: what the store loads by default].")
@click.option("--group", type=click.Choice(["32", "64", "128"]), default=None,
              help="GGUF / FP8 with a quantized --format: scale group size [default: 32].")
@click.option("--scale-dtype", type=click.Choice(["fp16", "bf16", "fp32", "e8m0"]), default=None,
              help="GGUF / FP8 with a quantized --format: element type of the scales "
                   "[default: fp16; mxfp4: e8m0].")
@_pattern_options
def inspect_command(checkpoint, tensor, all_tensors, nodes, touch, plot, as_json, pages, fmt,
                    group, scale_dtype, pattern, kinds):
    """Where the checkpoint's expert pages sit in memory now, and the cost of a naive split.

    CHECKPOINT: a file or directory, or a Hugging Face repo id (ORG/NAME) whose snapshot
    is in the local cache (nothing is downloaded).
    """
    from numa_moe.apps.placement_report import inspect_checkpoint, plot_placement

    if pages and not as_json:
        raise click.UsageError("--pages needs --json (the text report has no per-page lists)")
    if plot:
        check_output(plot, "--plot")
    ck = _open(checkpoint, pattern, kinds)
    if plot:
        check_apart(plot, "--plot", ck.sources)
    try:
        report = inspect_checkpoint(ck, tensor=tensor, nodes=nodes, touch=touch,
                                    include_all=all_tensors, weight_format=fmt,
                                    group=None if group is None else int(group),
                                    scale_dtype=scale_dtype)
    except ValueError as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps(report.to_dict(with_pages=pages), indent=1))
    else:
        click.echo(report.format_text())
    if plot:
        try:
            with output_file(plot, "--plot") as tmp:
                drawn = plot_placement(report, tmp, format="png")
        except RuntimeError as err:
            raise click.ClickException(f"cannot write the plot {plot}: {err}") from None
        click.echo(f"wrote {plot} ({drawn} of {len(report.tensors)} tensors)", err=as_json)


@click.command("quantize")
@click.argument("checkpoint", metavar="CHECKPOINT")
@click.option("--format", "fmt", type=click.Choice(QUANT_FORMAT_CHOICES), required=True,
              help="Weight format of the quantized routed experts.")
@click.option("--group", type=click.Choice(["32", "64", "128"]), default=None,
              help="Scale group size (weights along a row sharing one scale) [default: 128; "
                   "mxfp4, iq4nl, int4-affine: 32, their only group].")
@click.option("--scale-dtype", type=click.Choice(["fp16", "bf16", "fp32", "e8m0"]), default=None,
              help="Element type of the group scales [default: fp16; mxfp4: e8m0, its only "
                   "scale type].")
@click.option("-o", "--output", "output", required=True, type=click.Path(file_okay=False),
              help="Output directory (new or empty), apart from the checkpoint's files.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUTPUT when it holds an earlier numa-moe output (make-checkpoint or "
                   "quantize, nothing else; replaced whole, atomically). A directory holding "
                   "anything else is refused, with or without --overwrite.")
@_pattern_options
@click.option("--quiet", is_flag=True, help="No progress bar.")
def quantize_command(checkpoint, fmt, group, scale_dtype, output, overwrite, pattern, kinds, quiet):
    """Quantize a BF16/F16/F32 checkpoint's routed experts to INT8, INT4 or MXFP4.

    Only routed-expert weights change (values I8/U8 plus a .weight_scale tensor each; see
    docs/quantization.md, "Checkpoints"); everything else is copied. OUTPUT is built in a
    temporary sibling directory and swapped in whole.

    CHECKPOINT: a file or directory, or a Hugging Face repo id (ORG/NAME) whose snapshot
    is in the local cache (nothing is downloaded).
    """
    from numa_moe.files import CheckpointError
    from numa_moe.checkpoints.quantize import quantize_checkpoint

    ck = _open(checkpoint, pattern, kinds)
    try:
        result = quantize_checkpoint(ck, output, fmt, None if group is None else int(group),
                                     scale_dtype, overwrite=overwrite, progress=not quiet)
    except (ValueError, CheckpointError) as err:
        raise click.ClickException(str(err)) from None
    except OSError as err:
        raise click.ClickException(f"cannot write {output}: {err.strerror or err}") from None

    def mib(n):
        return f"{n / 2**20:.2f} MiB"

    click.echo(f"wrote {result.output}: {fmt}, group {result.group}, {result.scale_dtype} scales; "
               f"{result.tensors_quantized} expert tensor(s) quantized")
    click.echo(f"bytes before {result.bytes_before} ({mib(result.bytes_before)}), after "
               f"{result.bytes_after} ({mib(result.bytes_after)}); routed experts "
               f"{mib(result.expert_bytes_before)} -> {mib(result.expert_bytes_after)} "
               f"(values + scales, {result.expert_bytes_after / result.expert_bytes_before:.3f}x)")
    if result.not_copied:
        click.echo(f"not copied: {', '.join(result.not_copied)}")

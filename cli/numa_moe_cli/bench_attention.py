"""``numa-moe bench attention``: GQA decode attention against PyTorch's SDPA and the read
ceiling of the KV bytes (see numa_moe.apps.benchmarking.attention)."""

from __future__ import annotations

import json

import click

from numa_moe_cli.options import check_output, isa_option, write_output, wrote

SHAPES = ("qwen3-30b-a3b", "llama-8/1")  # numa_moe.apps.benchmarking.attention.ATTENTION_SHAPES


@click.command("attention")
@click.option("--shape", "shapes", multiple=True, type=click.Choice(SHAPES),
              help="head shapes: qwen3-30b-a3b (32 query / 4 KV heads) or llama-8/1 (8 query heads on one KV "
                   "head); default both")
@click.option("--context", "-T", "contexts", multiple=True, type=click.IntRange(1),
              help="cached positions per sequence (default: 512, 4096, 32768)")
@click.option("--batch", "-b", "batches", multiple=True, type=click.IntRange(1), help="sequences (default: 1, 8)")
@click.option("--repeats", "-r", default=10, show_default=True, type=click.IntRange(1),
              help="calls per case (medians are reported)")
@isa_option("the fastest (amx > avx512 > avx2 > ref)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the rows as JSON to this file.")
def attention_command(shapes, contexts, batches, repeats, isa, json_path):
    """ms per decode-attention call: ours, torch SDPA (enable_gqa) and the read ceiling of
    the K and V bytes, all in one run."""
    from numa_moe.layer import attention
    from numa_moe.apps.benchmarking.attention import bench_attention

    if isa is not None and isa not in attention.available_isas():
        raise click.UsageError(f"--isa {isa} is not available here (available: "
                               f"{', '.join(attention.available_isas())})")
    if json_path:
        check_output(json_path, "--json")
    try:
        rows = bench_attention(shapes or SHAPES, contexts or (512, 4096, 32768), batches or (1, 8),
                               repeats=repeats, isa=isa, echo=click.echo)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if json_path:
        write_output(json_path, json.dumps(rows, indent=2), "--json")
        wrote(json_path)

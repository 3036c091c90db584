"""``numa-moe bench layer``: the MoE layer against the transformers-style torch loop and
the read ceiling (see numa_moe.apps.benchmarking.layer)."""

from __future__ import annotations

import json

import click

from numa_moe_cli.options import WEIGHT_FORMAT_CHOICES, check_output, isa_option, write_output, wrote


@click.command("layer")
@click.option("--like", "--model", "models", multiple=True,
              type=click.Choice(["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b"]),
              help="published models whose layer shapes to run, as --like of run and simulate "
                   "(default: qwen3-30b-a3b and mixtral-8x7b; --model is the same option)")
@click.option("--tokens", "-t", "tokens", multiple=True, type=click.IntRange(1), help="token counts (default: 1, 16)")
@click.option("--repeats", "-r", default=20, show_default=True, type=click.IntRange(1),
              help="random routings per case (medians are reported)")
@click.option("--virtual-nodes", default=2, show_default=True, type=int,
              help="node count of the partitioned path compared with 1 node: 2 to 1024 (the most NUMA nodes "
                   "a Linux kernel supports)")
@isa_option("chosen per expert from its token count")
@click.option("--app", is_flag=True,
              help="Call the layer as an application does: after torch work (a router and an attention-sized "
                   "matmul) before every call, against back-to-back calls; then the HF-patched Qwen3-MoE block "
                   "and the fixed cost of a tiny layer and expert_ffn call (token counts default to 1, 4, 16).")
@click.option("--format", "weight_formats", type=click.Choice(WEIGHT_FORMAT_CHOICES), multiple=True,
              help="Expert weight formats to run (repeatable): int8 / int4 / mxfp4 / iq4nl / int4-affine quantize the random "
                   "experts once (fp16 scales; mxfp4 e8m0 per 32, iq4nl and int4-affine per 32; docs/quantization.md) "
                   "and add their 1-node step, bytes read and "
                   "ratio to the "
                   "bf16 step to each case. bf16 always runs, as the baseline (and the torch loop is bf16 only).")
@click.option("--group", type=click.Choice(["32", "64", "128"]), default="128", show_default=True,
              help="columns per scale of the int8 / int4 experts (mxfp4, iq4nl, int4-affine: always 32)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the rows as JSON to this file.")
def layer_command(models, tokens, repeats, virtual_nodes, isa, app, weight_formats, group, json_path):
    """ms per MoE layer: ours on 1 node and on a virtual N-node topology, the torch loop,
    and the read ceiling of the weights touched, all in one run (--app: the layer as an
    application calls it)."""
    models = models or ("qwen3-30b-a3b", "mixtral-8x7b")
    if json_path:
        check_output(json_path, "--json")  # before the benchmark, not after it
    if app and weight_formats and set(weight_formats) != {"bf16"}:
        raise click.UsageError("--app runs bf16 experts only: give --format without --app")
    try:
        if app:
            from numa_moe.apps.benchmarking.app import bench_app

            rows = bench_app(models, tokens or (1, 4, 16), repeats=repeats, isa=isa, echo=click.echo)
        else:
            from numa_moe.apps.benchmarking.layer import bench_layer

            rows = bench_layer(models, tokens or (1, 16), repeats=repeats, virtual_nodes=virtual_nodes, isa=isa,
                               echo=click.echo, formats=weight_formats or ("bf16",), group=int(group))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if json_path:
        write_output(json_path, json.dumps(rows, indent=2), "--json")
        wrote(json_path)

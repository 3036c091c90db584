"""`numa-moe bench ...`: benchmarks (a group, so that more sub-commands can join it)."""

from __future__ import annotations

import click

from numa_moe_cli.options import PAGES, WEIGHT_FORMAT_CHOICES, check_output, isa_option, output_file, wrote


@click.group()
def bench():
    """Benchmarks against the PyTorch baseline and the machine's ceilings."""


def _int_list(text: str) -> list[int]:
    try:
        return [int(value) for value in text.split(",") if value]
    except ValueError:
        raise click.BadParameter(f"expected a comma list of integers, got {text!r}") from None


@bench.command("kernels")
@click.option("--shapes", default=None, help="Comma list of expert shapes (default: all). "
              "Known: mixtral-8x7b, qwen3-30b-a3b, deepseek-v3, qwen3-235b.")
@click.option("--m", "m_values", default="1,2,4,8,16,32,128", show_default=True, help="Comma list of token counts.")
@click.option("--repeats", default=20, show_default=True, help="Timed calls per point at least (median reported).")
@click.option("--min-seconds", default=0.25, show_default=True, type=float,
              help="... and enough calls per point to span this long (small experts); 0 to 3600.")
@click.option("--threads", default=None, type=int,
              help="Threads: 1 to the CPUs in the affinity mask, or 0 for all of them (the default).")
@isa_option("at each token count the ISA the MoE layer runs an expert of that many tokens with (NUMA_MOE_ISA, "
            "else AMX from the format's crossover, else the fastest other; the table's isa column)")
@click.option("--no-torch", is_flag=True, help="Skip the torch F.linear baseline.")
@click.option("--page", type=click.Choice(PAGES), default="2m", show_default=True,
              help="Page size of the weight copies. The default is 2m (transparent huge pages), unlike the "
                   "placement commands' 4k: this measures the kernels as a serving host would run them, "
                   "and 4 KB pages alone moved the read ceiling by up to 2x on the development VMs "
                   "(docs/benchmarks.md).")
@click.option("--format", "weight_format", type=click.Choice(WEIGHT_FORMAT_CHOICES), default="bf16",
              show_default=True, help="Expert weight format: int8 / int4 run quantized experts (docs/quantization.md; "
                                      "the bytes read count the scales) against PyTorch's own low-bit kernels "
                                      "(aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu); mxfp4 (e8m0 "
                                      "scales per 32), iq4nl and int4-affine (fp16 per 32) without torch, which "
                                      "has no CPU kernel for them.")
@click.option("--group", type=click.Choice(["32", "64", "128"]), default="128", show_default=True,
              help="Columns per scale of int8 / int4 (mxfp4, iq4nl, int4-affine: always 32).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Also write the results as JSON to this file.")
def kernels_command(shapes, m_values, repeats, min_seconds, threads, isa, no_torch, page, weight_format, group,
                    json_path):
    """Expert FFN: our kernel vs torch vs a streaming read of the same weights."""
    from numa_moe.apps.benchmarking import kernels as kernel_bench
    from numa_moe.placement.memory import PlacementError

    if json_path:
        check_output(json_path, "--json")  # before the benchmark, not after it
    try:
        result = kernel_bench.run(shapes=shapes.split(",") if shapes else None, m_values=_int_list(m_values),
                                  repeats=repeats, threads=threads, isa=isa, with_torch=not no_torch,
                                  page=page, min_seconds=min_seconds, progress=lambda line: click.echo(line, err=True),
                                  table=click.echo, weight_format=weight_format, group=int(group))
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    except PlacementError as error:
        hint = " (--page 4k runs without them)" if page == "2m" else ""
        raise click.ClickException(f"{error}{hint}") from None
    if json_path:
        with output_file(json_path, "--json") as tmp:
            kernel_bench.to_json(result, tmp)
        wrote(json_path)


# `numa-moe bench layer` lives in its own module (MoE layer owner).
from numa_moe_cli.bench_layer import layer_command  # noqa: E402

bench.add_command(layer_command, "layer")

# `numa-moe bench attention` likewise (decode attention owner).
from numa_moe_cli.bench_attention import attention_command  # noqa: E402

bench.add_command(attention_command, "attention")

"""``numa-moe simulate``: the projected cost of a MoE layer step on a multi-socket machine
(see numa_moe.apps.simulate and docs/simulate.md)."""

from __future__ import annotations

import json
import os

import click

from numa_moe_cli.options import (WEIGHT_FORMAT_CHOICES, check_apart, check_output, output_file, page_option,
                                  write_output, wrote)


def _tokens(ctx, param, value):
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated token counts such as 1,4,16, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"token counts must be >= 1, got {value!r}")
    return out


def _policies(ctx, param, value):
    from numa_moe.apps.simulate import POLICIES

    out = [v.strip().lower() for v in value.split(",") if v.strip()]
    bad = [p for p in out if p not in POLICIES]
    if bad or not out:
        raise click.BadParameter(f"policies are letters from {','.join(POLICIES)}, got {value!r}")
    return out


@click.command("simulate", short_help="Projected layer-step cost per placement policy on a multi-socket machine.")
@click.argument("checkpoint", required=False, type=click.Path(exists=True, file_okay=False))
@click.option("--machine", "machine_name", default=None,
              help="Built-in machine (xeon-6430, xeon-6448h, xeon-max-9462) or a machine JSON file.")
@click.option("--measure", is_flag=True, help="Describe this machine by measuring it (read bandwidth of every "
              "CPU node from every memory node, cores, ISA peaks, kernel efficiency) instead of --machine.")
@click.option("--save-machine", type=click.Path(dir_okay=False), default=None,
              help="Write the machine description used (e.g. the measured one) to this JSON file.")
@click.option("--like", default=None, help="Expert shapes of a published model (synthetic.MODEL_SPECS), "
              "e.g. mixtral-8x7b, qwen3-30b-a3b, deepseek-v3; instead of CHECKPOINT.")
@click.option("--format", "fmt", type=click.Choice(WEIGHT_FORMAT_CHOICES), default="bf16", show_default=True,
              help="Weight format: changes the bytes (tables recomputed, scales included) and the compute peak "
                   "(mxfp4: group 32, e8m0 scales, the int4 peak, gpt-oss's released format; iq4nl: group 32, the int4 "
                   "peak).")
@page_option()
@click.option("--tokens", "-t", default="1,4,16", show_default=True, callback=_tokens,
              help="Comma-separated tokens per step.")
@click.option("--routing", type=click.Choice(["uniform", "zipf", "trace"]), default="uniform", show_default=True,
              help="Routing distribution: uniform top-k, Zipf-skewed top-k (--zipf-s), or a recorded --trace.")
@click.option("--zipf-s", type=click.FloatRange(min=0), default=1.0, show_default=True, help="Zipf exponent.")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Routing trace file (JSON from integrations.hf.record_routing, or .npy [layers, tokens, k]).")
@click.option("--layers", type=click.IntRange(1), default=None,
              help="MoE layers per step (default: the model's, or the checkpoint's).")
@click.option("--policies", default="a,b,c,d,e", show_default=True, callback=_policies,
              help="Policies to compare: a first touch, b interleaved naive split, c segment tables, "
                   "d per-node shards, e full replicas.")
@click.option("--samples", type=click.IntRange(1), default=32, show_default=True,
              help="Routing draws per token count.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the routing draws.")
@click.option("--isa", default=None, help="ISA whose peak is used (default: the machine's).")
@click.option("--validate", is_flag=True,
              help="Instead of a projection: predicted vs measured `numa-moe run` step time on this machine "
                   "(1 node and 2 virtual nodes, the --tokens given) on a generated Qwen3-30B-A3B-shaped "
                   "checkpoint (1 layer, 16 experts) or CHECKPOINT.")
@click.option("--steps", type=click.IntRange(2), default=9, show_default=True, help="With --validate: steps per run.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the report as JSON to this file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: step time per policy over tokens, per-node bytes local/remote.")
def simulate_command(checkpoint, machine_name, measure, save_machine, like, fmt, page, tokens,
                     routing, zipf_s, trace_path, layers, policies, samples, seed, isa, validate, steps, json_path,
                     plot_path):
    """Project the cost of one MoE step (all layers) on a multi-socket machine, for each
    placement policy side by side: bytes each node reads locally and across nodes (for
    the interleaved policies counted from the segment tables this project builds),
    memory footprint, reduction traffic, the slowest node's time, step time and tokens/s.
    """
    from numa_moe.apps import simulate as sim

    if validate:
        return _validate(checkpoint, tokens, steps, json_path)
    if measure == (machine_name is not None):
        raise click.UsageError("give --machine NAME|FILE or --measure (one of them)")
    if (checkpoint is None) == (like is None):
        raise click.UsageError("give a CHECKPOINT or --like MODEL (one of them)")
    if routing == "trace" and not trace_path:
        raise click.UsageError("--routing trace needs --trace FILE")
    if trace_path and routing != "trace":
        routing = "trace"
    inputs = [p for p in (checkpoint, machine_name, trace_path) if p and os.path.lexists(p)]
    for path, option in ((json_path, "--json"), (plot_path, "--plot"), (save_machine, "--save-machine")):
        if path:
            check_output(path, option)
            check_apart(path, option, inputs)
    try:
        if measure:
            machine = sim.measure_machine(echo=lambda s: click.echo(s, err=True))
        else:
            machine = sim.load_machine(machine_name)
        if like is not None:
            workload = sim.workload_like(like, fmt, page, layers)
        else:
            workload = sim.workload_from_checkpoint(checkpoint, fmt, page, layers)
        trace = sim.load_trace(trace_path) if trace_path else None
        report = sim.simulate(machine, workload, tokens, sim.Routing(routing, zipf_s, trace), policies,
                              samples=samples, seed=seed, isa=isa)
    except ValueError as exc:  # MachineFormatError included
        raise click.ClickException(str(exc)) from None
    click.echo(sim.format_report(report))
    if save_machine:
        write_output(save_machine, json.dumps(machine.to_dict(), indent=2) + "\n", "--save-machine")
        wrote(save_machine, "machine description")
    if json_path:
        write_output(json_path, json.dumps(sim.report_dict(report), indent=2) + "\n", "--json")
        wrote(json_path)
    if plot_path:
        with output_file(plot_path, "--plot") as tmp:
            sim.plot_report(report, tmp)
        wrote(plot_path, "plot")


def _validate(checkpoint, tokens, steps, json_path):
    from dataclasses import asdict

    from numa_moe.apps import simulate as sim
    if json_path:
        check_output(json_path, "--json")
    path = checkpoint
    if path is None:
        from numa_moe.apps.run import default_checkpoint_dir
        from numa_moe.checkpoints.synthetic import make_checkpoint

        path = default_checkpoint_dir("qwen3-30b-a3b", 1).with_name("qwen3-30b-a3b-1-e16")
        if not (path / "config.json").exists():
            click.echo(f"generating a Qwen3-30B-A3B-shaped checkpoint (1 layer, 16 experts) into {path}", err=True)
            make_checkpoint(path, "qwen3-30b-a3b", 1, 16, 0, progress=False, overwrite=True)
    click.echo(f"predicted (policy c, kernel efficiency {sim.DEFAULT_KERNEL_EFFICIENCY}) vs measured `numa-moe run` "
               f"median step, {steps} steps per point; checkpoint {path}")
    try:
        points = sim.validate_run(path, tokens=tokens, node_counts=(1, 2), steps=steps, echo=click.echo)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    errors = sorted(abs(p.error) for p in points)
    click.echo(f"|error|: median {errors[len(errors) // 2]:.1%}, max {errors[-1]:.1%} over {len(points)} points")
    if json_path:
        write_output(json_path, json.dumps([{**asdict(p), "error": p.error} for p in points], indent=2) + "\n",
                     "--json")
        wrote(json_path)

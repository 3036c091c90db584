"""``numa-moe run``: the main job (see numa_moe.apps.run.run_job)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click

from numa_moe_cli.options import (WEIGHT_FORMAT_CHOICES, check_apart, check_output, isa_option, page_option,
                                  write_output, wrote)


@click.command("run")
@click.argument("checkpoint", required=False)
@click.option("--tokens", "-t", default=1, show_default=True, type=click.IntRange(1), help="tokens per step")
@click.option("--steps", "-s", default=10, show_default=True, type=click.IntRange(1), help="decode-like steps")
@click.option("--nodes", type=click.IntRange(1), default=None,
              help="interleave over real nodes 0..N-1 (default: all allowed nodes)")
@click.option("--virtual-nodes", type=click.IntRange(1), default=None,
              help="simulate N nodes on this machine (tables from the interleave rule)")
@isa_option("chosen per expert from its token count")
@page_option()
@click.option("--seed", default=0, show_default=True, type=int, help="seed of the inputs and the random routing")
@click.option("--format", "weight_formats", type=click.Choice(WEIGHT_FORMAT_CHOICES), multiple=True,
              help="Expert weight format: int8 / int4 / mxfp4 / iq4nl / int4-affine quantize a BF16 checkpoint "
                   "while loading (group 128, fp16 scales; mxfp4: group 32, e8m0 scales; iq4nl, int4-affine: group "
                   "32; docs/quantization.md); GGUF and FP8 experts are converted to "
                   "it (group 32; docs/checkpoints.md). Default: the checkpoint's own. Given "
                   "more than once, the job runs once per format and ends with their steps side by side.")
@click.option("--like", default=None, metavar="MODEL",
              help="Without CHECKPOINT: generate (once, into the cache) a checkpoint of this model's "
                   "expert shapes, e.g. gpt-oss-120b (MXFP4, biases, its activation), qwen3-30b-a3b.")
@click.option("--layers", type=click.IntRange(1), default=None,
              help="With --like: MoE layers of the generated checkpoint (default per model).")
@click.option("--experts", type=click.IntRange(1), default=None,
              help="With --like: routed experts per layer (default per model).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the report as JSON to this file.")
def run_command(checkpoint, tokens, steps, nodes, virtual_nodes, isa, page, seed, weight_formats, like, layers,
                experts, json_path):
    """Load a checkpoint's routed experts interleaved and run decode-like MoE steps.

    CHECKPOINT (a path, or a Hugging Face repo id in the local cache) defaults to the
    generated embedded checkpoint (Qwen3-30B-A3B shapes), generated into ~/.cache/numa-moe
    on first use. Prints per-step time, effective
    weight bandwidth against the read ceiling measured in the same run, and the per-node
    work balance; step 1 is checked against the torch reference (exit status 1 if wrong).
    """
    from numa_moe.apps.run import run_job

    if nodes is not None and virtual_nodes is not None:
        raise click.UsageError("give --nodes or --virtual-nodes, not both")
    if checkpoint is not None and (like, layers, experts) != (None, None, None):
        raise click.UsageError("--like, --layers and --experts generate a checkpoint: give them or CHECKPOINT")
    if json_path:
        check_output(json_path, "--json")  # before the job, not after it
        if checkpoint is not None:
            from numa_moe.checkpoints.safetensors import resolve_checkpoint_path
            from numa_moe.files import CheckpointError

            try:
                check_apart(json_path, "--json", [resolve_checkpoint_path(checkpoint)])
            except CheckpointError as err:
                raise click.ClickException(str(err)) from None
    from numa_moe.apps.run import format_side_by_side

    reports = []
    try:
        for weight_format in weight_formats or (None,):
            reports.append(run_job(checkpoint, tokens=tokens, steps=steps, nodes=nodes, virtual_nodes=virtual_nodes,
                                   isa=isa, page=page, seed=seed, weight_format=weight_format, echo=click.echo,
                                   progress=sys.stderr.isatty(), like=like, layers=layers, experts=experts))
    except BrokenPipeError:
        raise  # stdout closed (| head): the entry point ends quietly
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    except RuntimeError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if len(reports) > 1:
        click.echo(format_side_by_side(reports))
    if json_path:
        data = asdict(reports[0]) if len(reports) == 1 else [asdict(r) for r in reports]
        write_output(json_path, json.dumps(data, indent=2), "--json")
        wrote(json_path)

"""``numa-moe doctor``: this machine measured for weight streaming per node, and what to
change (see numa_moe.apps.doctor)."""

from __future__ import annotations

import json

import click

from numa_moe_cli.options import check_output, page_option, write_output, wrote


@click.command("doctor", short_help="This machine measured per NUMA node, and what to change.")
@click.argument("checkpoint", required=False)
@click.option("--like", default=None, help="Measure the layer step on a generated checkpoint of this model's "
              "expert shapes (one layer, at most 32 experts), e.g. qwen3-30b-a3b; instead of CHECKPOINT.")
@click.option("--quick", is_flag=True, help="Smaller reads, fewer tries and steps: a first look in seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON (progress goes to stderr).")
@click.option("--write-machine", type=click.Path(dir_okay=False), default=None,
              help="Write the measured machine to this file, for `numa-moe simulate --machine FILE`.")
@page_option()
def doctor_command(checkpoint, like, quick, as_json, write_machine, page):
    """Measure the read bandwidth of every CPU node from every memory node, the kernels'
    peaks and, with CHECKPOINT or --like, the layer step at 1 and 16 tokens beside its
    projection from the measured bandwidths; then list what in this machine's configuration
    costs the layer step, most costly first, each with the exact fix."""
    from numa_moe.apps import doctor

    if checkpoint is not None and like is not None:
        raise click.UsageError("give a CHECKPOINT or --like MODEL, not both")
    if write_machine:
        check_output(write_machine, "--write-machine")
    progress = (lambda s: click.echo(s, err=True)) if as_json else click.echo
    try:
        if like is not None:
            checkpoint = doctor.like_checkpoint(like, echo=progress)
        report = doctor.run_doctor(checkpoint, quick=quick, page=page, echo=progress)
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        click.echo(doctor.format_report(report))
    if write_machine:
        if report.machine is None:
            raise click.ClickException("no machine to write: " + report.machine_problem)
        write_output(write_machine, json.dumps(report.machine.to_dict(), indent=2) + "\n", "--write-machine")
        wrote(write_machine, "machine description")

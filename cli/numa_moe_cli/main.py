"""Entry point of the ``numa-moe`` command.

Each sub-command lives in its own module and only calls the package API; this file
only assembles the group.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

import click

from numa_moe import __version__

# (module, attribute) of each sub-command; imported lazily so that `numa-moe topo`
# does not pay for torch.
_COMMANDS = {
    "topo": ("topo", "topo"),
    "table": ("table", "table"),
    "make-checkpoint": ("checkpoint_commands", "make_checkpoint_command"),
    "tables": ("checkpoint_commands", "tables_command"),
    "inspect": ("checkpoint_commands", "inspect_command"),
    "quantize": ("checkpoint_commands", "quantize_command"),
    "bench": ("bench", "bench"),
    "run": ("run", "run_command"),
    "generate": ("generate", "generate_command"),
    "simulate": ("simulate", "simulate_command"),
    "doctor": ("doctor", "doctor_command"),
    "serve-check": ("serve_check", "serve_check_command"),
}


def _terminate(signum, frame):
    # SIGTERM as an exception, like SIGINT's KeyboardInterrupt: cleanup handlers run (no
    # temporary file or directory is left behind) and the exit status is the usual 143.
    raise SystemExit(128 + signum)


class _LazyGroup(click.Group):
    def main(self, *args, **kwargs):
        """click's main, plus: SIGTERM runs the cleanup handlers, and a closed stdout
        (``numa-moe ... | head``) ends the command quietly (the Python docs' recipe)."""
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            return super().main(*args, **kwargs)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(1)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def invoke(self, ctx):
        """Ctrl-C ends a command with one line and the shell's status for SIGINT (130),
        after its cleanup handlers ran (click's own handling would exit 1)."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            ctx.exit(128 + signal.SIGINT)

    def list_commands(self, ctx):
        return sorted(_COMMANDS)

    def get_command(self, ctx, name):
        target = _COMMANDS.get(name)
        if target is None:
            return None
        module_name, attribute = target
        module = importlib.import_module(f"numa_moe_cli.{module_name}")
        return getattr(module, attribute)


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="numa-moe")
def cli():
    """NUMA-aware placement toolkit and CPU kernels for Mixture-of-Experts inference."""


if __name__ == "__main__":  # pragma: no cover
    cli()

"""Entry point of the ``numa-moe`` command.

Each sub-command lives in its own module and only calls the package API; this file
only assembles the group.
"""

from __future__ import annotations

import importlib

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
    "bench": ("bench", "bench"),
    "run": ("run", "run_command"),
}


class _LazyGroup(click.Group):
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

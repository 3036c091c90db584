"""Consistency of the `numa-moe` command line: choices for enumerated options, help on
every option, one page-size story, and every file writer saying where it wrote."""

import json

import click
import pytest
from click.testing import CliRunner

from numa_moe.layer import kernels
from numa_moe_cli import options
from numa_moe_cli.main import cli


def _commands(group: click.Group, ctx: click.Context, prefix=()):
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            yield from _commands(command, ctx, prefix + (name,))
        else:
            yield prefix + (name,), command


ALL_COMMANDS = list(_commands(cli, click.Context(cli)))


def test_every_command_is_walked():
    names = {" ".join(path) for path, _ in ALL_COMMANDS}
    assert {"topo", "table", "tables", "inspect", "make-checkpoint", "run", "bench kernels",
            "bench layer"} <= names


@pytest.mark.parametrize("path, command", ALL_COMMANDS, ids=[" ".join(p) for p, _ in ALL_COMMANDS])
def test_every_option_has_help(path, command):
    missing = [param.opts[0] for param in command.params
               if isinstance(param, click.Option) and not (param.help or "").strip()]
    assert not missing, f"numa-moe {' '.join(path)}: options without help: {missing}"


def test_the_cli_knows_the_same_isas_as_the_kernels():
    assert options.ISAS == kernels.ISAS


@pytest.mark.parametrize("path", [("bench", "kernels"), ("bench", "layer"), ("run",)])
def test_isa_is_a_choice_explained_in_help(path):
    result = CliRunner().invoke(cli, [*path, "--isa", "foo"])
    assert result.exit_code == 2 and "'foo' is not one of" in result.output, result.output
    text = " ".join(CliRunner().invoke(cli, [*path, "--help"]).output.split())
    assert "amx_model (the AMX kernel source run on a software model of the AMX instructions, for testing; slow)" \
        in text


@pytest.mark.parametrize("path", [("table",), ("tables",), ("run",), ("bench", "kernels")])
def test_page_default_is_the_same_or_explained(path):
    command = dict(ALL_COMMANDS)[path]
    page = next(p for p in command.params if p.name == "page")
    if page.default != options.DEFAULT_PAGE:
        # a command that departs from the common default says so, and why, in its help
        assert "default" in page.help.lower() and options.DEFAULT_PAGE in page.help
        assert "placement commands' 4k" in page.help
    else:
        assert "hence the default" in page.help


def test_table_and_tables_say_their_difference_in_the_command_list():
    listing = CliRunner().invoke(cli, ["--help"]).output
    lines = {line.split()[0]: line for line in listing.splitlines() if line.startswith("  ")}
    assert "One matrix from its shape" in lines["table"]
    assert "Every expert tensor of a checkpoint" in lines["tables"]
    assert "..." not in lines["table"] and "..." not in lines["tables"]  # not cut short


def test_bench_layer_json_says_where_it_wrote(tmp_path, monkeypatch):
    from numa_moe.apps.benchmarking import layer as layer_bench

    monkeypatch.setattr(layer_bench, "bench_layer", lambda *args, **kwargs: [{"model": "tiny"}])
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(cli, ["bench", "layer", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == [{"model": "tiny"}]
    assert f"wrote {out}" in result.stderr


def test_run_json_says_where_it_wrote(tmp_path):
    pytest.importorskip("torch")
    from numa_moe.checkpoints.synthetic import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "ckpt", like="qwen3-30b-a3b", layers=1, experts=4, hidden_size=256,
                                 intermediate_size=128, progress=False)
    out = tmp_path / "report.json"
    result = CliRunner().invoke(cli, ["run", str(checkpoint), "--steps", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stderr and json.loads(out.read_text())["steps_ms"]


def test_tables_progress_counts_layers_without_a_rate(tmp_path):
    from numa_moe.checkpoints.synthetic import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "ckpt", like="qwen3-30b-a3b", layers=3, experts=2, hidden_size=256,
                                 intermediate_size=128, progress=False)
    result = CliRunner().invoke(cli, ["tables", str(checkpoint), "-o", str(tmp_path / "t.json")])
    assert result.exit_code == 0, result.output
    assert "3/3 MoE layers" in result.stderr
    assert "/s" not in result.stderr  # one computation serves every layer: no rate to show

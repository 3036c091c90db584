"""`numa-moe bench kernels` is wired into the CLI group and validates its options."""

from click.testing import CliRunner

from numa_moe_cli.main import cli


def test_bench_group_lists_kernels():
    result = CliRunner().invoke(cli, ["bench", "--help"])
    assert result.exit_code == 0 and "kernels" in result.output


def test_bench_kernels_rejects_unknown_shape():
    result = CliRunner().invoke(cli, ["bench", "kernels", "--shapes", "gpt-5", "--no-torch"])
    assert result.exit_code != 0 and "unknown shape 'gpt-5'" in result.output

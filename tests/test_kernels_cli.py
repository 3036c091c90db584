"""`numa-moe bench kernels` is wired into the CLI group and validates its options."""

import pytest
from click.testing import CliRunner

from numa_moe_cli.main import cli


def test_bench_group_lists_kernels():
    result = CliRunner().invoke(cli, ["bench", "--help"])
    assert result.exit_code == 0 and "kernels" in result.output


def test_bench_kernels_rejects_unknown_shape():
    result = CliRunner().invoke(cli, ["bench", "kernels", "--shapes", "gpt-5", "--no-torch"])
    assert result.exit_code != 0 and "unknown shape 'gpt-5'" in result.output


def test_bench_kernels_rejects_unknown_page_size():
    result = CliRunner().invoke(cli, ["bench", "kernels", "--page", "1g", "--no-torch"])
    assert result.exit_code != 0 and "'1g' is not one of '4k', '2m'" in result.output


def test_bench_kernels_names_missing_huge_pages(monkeypatch):
    from numa_moe.placement import memory

    monkeypatch.setattr(memory, "_thp_mode", lambda: "never")
    result = CliRunner().invoke(cli, ["bench", "kernels", "--shapes", "qwen3-30b-a3b", "--m", "1", "--no-torch",
                                      "--page", "2m"])
    assert result.exit_code != 0 and "needs transparent huge pages, but THP is 'never'" in result.output
    assert "--page 4k runs without them" in result.output


def test_bench_kernels_refuses_an_isa_this_cpu_lacks_before_allocating(monkeypatch):
    from numa_moe.layer import kernels
    from numa_moe.apps.benchmarking import kernels as kernel_bench

    monkeypatch.setattr(kernels, "available_isas", lambda: ("ref", "avx2"))
    monkeypatch.setattr(kernel_bench, "random_weights", lambda *a: pytest.fail("allocated before the check"))
    result = CliRunner().invoke(cli, ["bench", "kernels", "--isa", "amx", "--no-torch"])
    assert result.exit_code == 1 and "isa 'amx' is not available on this CPU (available: ref, avx2)" in result.output

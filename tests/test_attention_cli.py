"""`numa-moe bench attention` and `numa-moe generate`: thin shells that print their
tables (tiny cases; the figures themselves are docs/benchmarks.md's)."""

import json

import pytest
from click.testing import CliRunner

from numa_moe_cli.main import cli

pytest.importorskip("torch")


def test_bench_attention_prints_a_row(tmp_path):
    path = tmp_path / "rows.json"
    result = CliRunner().invoke(cli, ["bench", "attention", "--shape", "llama-8/1", "-T", "100", "-b", "2", "-r", "1",
                                      "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "sdpa" in result.output and "read" in result.output
    (row,) = json.loads(path.read_text())
    assert row["batch"] == 2 and row["context"] == 100 and row["ours_ms"] > 0
    assert row["max_abs_diff_vs_sdpa"] < 2e-2  # same inputs as SDPA: the kernel is checked on every row


def test_bench_attention_refuses_an_unavailable_isa():
    from numa_moe.layer import attention

    if "amx" in attention.available_isas():
        pytest.skip("this CPU runs every ISA (amx included): none to refuse")
    result = CliRunner().invoke(cli, ["bench", "attention", "--isa", "amx", "-T", "64", "-r", "1"])
    assert result.exit_code == 2 and "not available here" in result.output


def test_generate_prints_both_runs():
    result = CliRunner().invoke(cli, ["generate", "--layers", "1", "--tokens", "2", "--experts", "2", "--vocab", "64",
                                      "--prompt", "2"])
    assert result.exit_code == 0, result.output
    assert "transformers (sdpa)" in result.output and "numa-moe experts + attention" in result.output
    assert "greedy tokens:" in result.output

"""`numa-moe table` through click's CliRunner: paper periods, JSON output, one-line errors."""

import json

import pytest
from click.testing import CliRunner

from numa_moe.placement.segments import SegmentTable
from numa_moe_cli.main import cli


def _run(*args):
    return CliRunner().invoke(cli, ["table", *args])


@pytest.mark.parametrize("rows,cols,expected", [
    (14336, 4096, 1), (4096, 14336, 2), (768, 2048, 2), (2048, 768, 16),
])
def test_reproduces_paper_periods(rows, cols, expected):
    result = _run("--rows", str(rows), "--cols", str(cols), "--dtype", "bf16",
                  "--nodes", "2", "--page", "4k")
    assert result.exit_code == 0, result.output
    assert f"= {expected} rows" in result.output
    assert "balance (max/mean bytes per node): 1.0000" in result.output


def test_mixtral_down_listing_human_readable():
    result = _run("--rows", "4096", "--cols", "14336", "--nodes", "2")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "T = 4096 * 2 / gcd(28672, 8192) = 2 rows" in out
    assert out.count("node 0: 7 segment(s), 58720256 B") == 1
    assert out.count("node 1: 7 segment(s), 58720256 B") == 1
    # The first listed segment of node 0: row class 0, every other row, page 0.
    lines = out.splitlines()
    first = lines[lines.index(next(l for l in lines if "node 0:" in l)) + 2].split()
    assert first == ["0", "2", "2048", "0", "2048"]


def test_json_output_matches_api_and_loads_back():
    result = _run("--rows", "4096", "--cols", "14336", "--dtype", "int4", "--group", "128",
                  "--scale-dtype", "bf16", "--nodes", "4", "--page", "4k", "--phase", "1",
                  "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    weights = SegmentTable.from_dict(data["weights"]["table"])
    assert weights == SegmentTable.theoretical(4096, 14336, "int4", 4096, 4, phase=1)
    # int4 K=14336: 7168 B rows, 4 nodes: 16384 / gcd(7168, 16384) = 16384 / 1024 = 16.
    assert data["weights"]["period_rows_formula"] == 16 and weights.period_rows == 16
    scales = SegmentTable.from_dict(data["scales"]["table"])
    # bf16 scales 4096 x 112: 224 B rows, 16384 / gcd(224, 16384) = 16384 / 32 = 512.
    assert (scales.rows, scales.cols, scales.fmt) == (4096, 112, "bf16")
    assert data["scales"]["period_rows_formula"] == 512 and data["scales"]["group"] == 128
    assert sum(data["scales"]["bytes_per_node"].values()) == 4096 * 112 * 2
    assert data["weights"]["balance"] == pytest.approx(weights.balance())


def test_huge_pages_and_offset():
    result = _run("--rows", "4096", "--cols", "14336", "--nodes", "2", "--page", "2m",
                  "--offset-bytes", "4096", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)["weights"]
    assert data["period_rows_formula"] == 1024
    assert SegmentTable.from_dict(data["table"]) == SegmentTable.theoretical(
        4096, 14336, "bf16", 2 * 1024 * 1024, 2, offset_bytes=4096)


def test_small_matrix_is_explicit_and_listing_is_truncated():
    # 2000 rows of 1536 B = 2.9 MiB: one 2 MB boundary (row 1365), T = 8192 > rows.
    result = _run("--rows", "2000", "--cols", "768", "--nodes", "2", "--page", "2m")
    assert result.exit_code == 0, result.output
    assert "explicit one-row segments" in result.output
    assert "more (--all to list them)" in result.output
    full = _run("--rows", "2000", "--cols", "768", "--nodes", "2", "--page", "2m", "--all")
    assert "more (--all" not in full.output
    assert len(full.output.splitlines()) > len(result.output.splitlines())


@pytest.mark.parametrize("args,message", [
    (["--rows", "0", "--cols", "8", "--nodes", "2"], "--rows"),
    (["--rows", "4", "--cols", "7", "--dtype", "int4", "--nodes", "2"], "whole number of bytes"),
    (["--rows", "4", "--cols", "8", "--dtype", "int5", "--nodes", "2"], "--dtype"),
    (["--rows", "4", "--cols", "8", "--nodes", "2", "--page", "1g"], "--page"),
    (["--rows", "4", "--cols", "8", "--nodes", "2", "--phase", "2"], "--phase"),
    (["--rows", "4", "--cols", "8", "--nodes", "0"], "--nodes"),
    (["--rows", "4", "--cols", "8", "--nodes", "2", "--offset-bytes", "3"], "split an element"),
    (["--rows", "4", "--cols", "8", "--nodes", "2", "--offset-bytes", "4096"], "offset_bytes"),
    (["--rows", "4", "--cols", "100", "--nodes", "2", "--group", "64"], "scale group"),
    (["--rows", "4", "--cols", "8"], "--nodes"),
])
def test_bad_arguments_give_one_line_error(args, message):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    errors = [l for l in result.output.splitlines() if l.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], result.output

"""The kernel benchmark's weight copies and one small run of it (numa_moe/apps/benchmarking/kernels.py)."""

import numpy as np
import pytest

from numa_moe.layer import kernels
from numa_moe.placement import memory
from numa_moe.apps.benchmarking import kernels as kernel_bench
from numa_moe.apps.benchmarking import native_loops


@pytest.mark.parametrize("page", ["4k", "2m"])
def test_random_weights_are_the_random_bits_on_the_asked_page_size(page):
    if page == "2m" and memory._thp_mode() in ("never", "unavailable"):
        pytest.skip("transparent huge pages are off on this machine, so page='2m' cannot be asked for")
    shape = (96, 160)
    weights = kernel_bench.random_weights(np.random.default_rng(7), shape, page)
    expected = kernel_bench.random_bf16_bits(np.random.default_rng(7), shape)
    assert weights.shape == shape and weights.dtype == np.uint16 and weights.flags.c_contiguous
    np.testing.assert_array_equal(weights, expected)
    # finite bf16 values with 2^-7 <= |v| < 2^-5: biased exponent 120 or 121, never zero
    exponent = (weights >> 7) & 0xFF
    assert set(np.unique(exponent)) == {127 - 7, 127 - 6}


@pytest.mark.parametrize("repeats, copies, pair_seconds, min_seconds, expected", [
    (20, 14, 0.0007, 0.25, 358),   # a small expert: the time floor decides
    (20, 2, 0.020, 0.25, 20),      # a large one: the repeat count does
    (20, 40, 0.020, 0.25, 40),     # one pass over the copies at least
    (20, 14, 0.0007, 0.0, 20),     # no time floor
    (5, 2, 0.0, 0.25, 5),          # a zero estimate never divides
])
def test_repetitions_take_the_largest_floor(repeats, copies, pair_seconds, min_seconds, expected):
    assert kernel_bench.repetitions(repeats, copies, pair_seconds, min_seconds) == expected


def test_run_rejects_an_unknown_page_size():
    with pytest.raises(ValueError, match="page must be '4k' or '2m', got '1g'"):
        kernel_bench.run(shapes=["qwen3-30b-a3b"], m_values=[1], repeats=1, with_torch=False, page="1g",
                         progress=lambda line: None)


def test_run_rejects_a_negative_time_floor():
    with pytest.raises(ValueError, match=r"min_seconds must be a finite number of seconds in 0\.\.3600, got -1"):
        kernel_bench.run(shapes=["qwen3-30b-a3b"], m_values=[1], repeats=1, with_torch=False, min_seconds=-1,
                         progress=lambda line: None)


def test_small_run_reports_its_page_size_and_consistent_ratios():
    lines = []
    result = kernel_bench.run(shapes=["qwen3-30b-a3b"], m_values=[2], repeats=3, with_torch=False, page="4k",
                              min_seconds=0.0, progress=lines.append)
    assert result.page == "4k" and any("4k pages" in line for line in lines)
    (row,) = result.rows
    assert row.m == 2 and row.ours_ms > 0 and row.read_ms > 0
    assert row.repetitions >= 3 and result.min_seconds == 0.0
    assert row.fraction_of_read == pytest.approx(row.read_ms / row.ours_ms)
    assert row.target_metric == "read" and row.target == 0.90
    assert "pages=4k" in kernel_bench.format_table(result).splitlines()[0]


def _row(m, ours, read_s, peak, hidden=2048, inter=768):
    return kernel_bench.make_row("qwen3-30b-a3b", hidden, inter, m, "avx512", 2, 3 * hidden * inter * 2, ours,
                                 read_s, None, peak)


def test_a_row_measures_against_the_fastest_read():
    # the reads drifted: the fastest (1.0 ms) is the ceiling, not the median (1.6 ms)
    row = _row(1, [1.25, 1.25, 1.25], [1.6, 1.0, 1.7, 1.6, 1.6], 500.0)
    assert row.read_ms == pytest.approx(1000.0) and row.read_median_ms == pytest.approx(1600.0)
    assert row.fraction_of_read == pytest.approx(0.8) and not row.measurement_problem


def test_the_roofline_is_the_slower_of_the_read_and_the_flops_at_the_peak():
    # M = 1: the read decides; M = 256 at 500 GFLOP/s: 2 * 256 * 3 * 2048 * 768 flops take
    # 4.83 ms against a 1 ms read, so the compute time decides
    row = _row(1, [1.25, 1.25], [1.0, 1.2], 500.0)
    assert row.fraction_of_roofline == pytest.approx(0.8)
    flops = 2.0 * 256 * 3 * 2048 * 768
    row = _row(256, [0.01, 0.01], [0.001], 500.0)
    assert row.fraction_of_roofline == pytest.approx(flops / 500e9 / 0.01)
    assert row.fraction_of_roofline == pytest.approx(row.fraction_of_peak)
    line = kernel_bench.format_row(row)
    assert f"{row.fraction_of_roofline:.2f}" in line.split()
    assert "/roof" in kernel_bench._HEADER
    # no peak loop: the memory time alone
    row = _row(256, [0.01], [0.001], None)
    assert row.fraction_of_roofline == pytest.approx(0.1)


def test_rows_rescored_against_a_higher_peak():
    row = _row(256, [0.01, 0.01], [0.001], 500.0)
    again = kernel_bench.rescore(row, 1000.0)
    assert again.fraction_of_peak == pytest.approx(row.fraction_of_peak / 2)
    assert again.fraction_of_roofline == pytest.approx(row.fraction_of_roofline / 2)
    assert again.target_value == again.fraction_of_peak and row.fraction_of_peak == pytest.approx(row.target_value)
    # memory-bound: a higher peak leaves the roofline at the read
    row = _row(16, [1.25], [1.0], 500.0)
    assert kernel_bench.rescore(row, 1000.0).fraction_of_roofline == pytest.approx(0.8)
    result = kernel_bench.Result(isa="avx512", threads=2, repeats=1, page="2m", min_seconds=0.0,
                                 peaks_gflop_s={"avx512": 500.0}, l3_bytes=1, rows=[row],
                                 peaks_end_gflop_s={"avx512": 1000.0}, rescored_rows=[kernel_bench.rescore(row, 1000.0)])
    table = kernel_bench.format_table(result)
    assert "against the best peak of the run, the end one (avx512: 1000 GFLOP/s, start 500)" in table
    assert "  qwen3-30b-a3b M=16: /peak 0.00 /roof 0.80 max(mem,compute) 0.80>=0.80" in table.splitlines()


def test_a_fraction_above_one_is_marked_as_a_measurement_problem():
    row = _row(2, [1.0, 1.0, 1.0], [1.08, 1.1, 1.2], 500.0)
    assert row.fraction_of_read == pytest.approx(1.08) and row.measurement_problem
    line = kernel_bench.format_row(row)
    assert " 1.08! " in line and "read 1.08!>=0.90" in line


def test_every_target_cell_states_its_threshold_or_that_there_is_none():
    assert kernel_bench.target_cell(_row(1, [1.0], [0.95], 500.0)) == "read 0.95>=0.90"
    assert kernel_bench.target_cell(_row(16, [1.0], [0.5], 500.0)).endswith(">=0.80")
    assert kernel_bench.target_cell(_row(32, [1.0], [0.25], 500.0)).endswith(" (no target)")
    assert kernel_bench.target_cell(_row(128, [1.0], [0.05], 500.0)).endswith(">=0.70")
    # no peak loop for the ISA that ran: no fraction of a peak, and the M >= 128 target says why
    row = _row(128, [1.0], [0.05], None)
    assert row.fraction_of_peak is None and kernel_bench.target_cell(row) == "peak - (no peak loop)"
    assert "     - " in kernel_bench.format_row(row)


def test_the_peak_is_measured_with_the_loop_of_the_isa_that_ran(monkeypatch):
    calls = []

    def fake_peak_flops(isa, iterations, threads, weight_format="bf16"):
        calls.append(isa)
        return 1e9 * iterations
    monkeypatch.setitem(native_loops.PEAK_INSTRUCTIONS, "amx", "tdpbf16ps")
    monkeypatch.setattr(native_loops, "peak_flops", fake_peak_flops)
    peak = kernel_bench.measure_peak_gflop_s("amx", threads=2, seconds=0.0, tries=3)
    assert set(calls) == {"amx"} and len(calls) == 3 and peak.samples == 3
    assert kernel_bench.measure_peak_gflop_s("ref", threads=2) is None
    assert kernel_bench.measure_peak_gflop_s("amx_model", threads=2) is None


def test_a_run_on_an_isa_without_a_peak_loop_divides_by_no_other_peak():
    # before: every ISA was divided by the avx512 vdpbf16ps peak
    result = kernel_bench.run(shapes=["qwen3-30b-a3b"], m_values=[1, 2], repeats=2, isa="ref", with_torch=False,
                              page="4k", min_seconds=0.0, progress=lambda line: None)
    assert result.peaks_gflop_s == {"ref": None} and result.peak_instructions == {"ref": None}
    assert all(row.fraction_of_peak is None for row in result.rows)
    assert "no peak loop for isa ref" in kernel_bench.format_table(result).splitlines()[0]


def test_a_peak_that_moves_between_start_and_end_warns_that_the_machine_is_busy(monkeypatch):
    from numa_moe.apps.benchmarking.yardsticks import Yardstick

    peaks = iter([Yardstick.from_samples([470.0]), Yardstick.from_samples([350.0])])
    monkeypatch.setattr(kernel_bench, "measure_peak_gflop_s", lambda isa, threads, **_: next(peaks))
    lines = []
    isa = kernels.fastest_isa()
    result = kernel_bench.run(shapes=["qwen3-30b-a3b"], m_values=[1], repeats=2, isa=isa, with_torch=False,
                              page="4k", min_seconds=0.0, progress=lambda line: None, table=lines.append)
    assert result.peaks_end_gflop_s == {isa: 350.0}
    assert any(f"{native_loops.peak_instruction(isa)} peak moved 26%" in w and "machine is busy" in w for w in result.warnings)
    assert lines[-1] == result.warnings[-1]  # printed after the table


def test_bench_kernels_prints_the_table_once_header_first():
    from click.testing import CliRunner

    from numa_moe_cli.main import cli

    result = CliRunner().invoke(cli, ["bench", "kernels", "--shapes", "qwen3-30b-a3b", "--m", "1,2", "--repeats", "2",
                                      "--min-seconds", "0", "--no-torch", "--page", "4k"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()  # stdout and stderr as a terminal shows them
    header = [i for i, line in enumerate(lines) if line.startswith("shape ")]
    rows = [i for i, line in enumerate(lines) if line.startswith("qwen3-30b-a3b ")]
    assert len(header) == 1 and len(rows) == 2 and header[0] < rows[0]
    # status lines stay off the table
    assert f"{native_loops.peak_instruction(kernels.isa_for_tokens(1))} peak" in result.stderr


def test_the_native_peak_loops_are_the_ones_named():
    runnable = set(native_loops.PEAK_INSTRUCTIONS) & set(kernels.available_isas())
    for isa in runnable:
        assert native_loops.peak_flops(isa, 1000, 1) > 0, isa
    # the integer kernels' instruction (vpmaddubsw, vpdpbusd, tdpbssd): 14 x 64, 24 x 128 and 4 x 32768
    # operations a round
    for isa in set(native_loops.INTEGER_PEAK_INSTRUCTIONS) & set(kernels.available_isas("int8")):
        expected = {"avx2": 1000 * 14 * 64, "avx512": 1000 * 24 * 128, "amx": 1000 * 4 * 32768}[isa]
        assert native_loops.peak_flops(isa, 1000, 1, "int8") == expected, isa
    # an ISA without a loop is refused by the harness, so measure_peak_gflop_s must not ask
    with pytest.raises(ValueError, match="no peak loop"):
        native_loops.peak_flops("ref", 1000, 1)


@pytest.mark.parametrize("fmt,group", [("int8", 128), ("int4", 32)])
def test_integer_runs_count_the_scales_and_compare_with_torchs_low_bit_kernels(monkeypatch, fmt, group):
    pytest.importorskip("torch")
    monkeypatch.setitem(kernel_bench.SHAPES, "tiny", (256, 128))
    monkeypatch.setattr(kernel_bench, "MAX_ROTATION_BYTES", 2 << 20)  # a few copies are enough here
    result = kernel_bench.run(shapes=["tiny"], m_values=[1, 3], repeats=3, min_seconds=0.0, page="4k",
                              weight_format=fmt, group=group, progress=lambda line: None)
    elements = 3 * 256 * 128
    assert result.rows[0].weight_bytes == elements * (1 if fmt == "int8" else 0.5) + elements // group * 2
    for row in result.rows:
        assert row.ours_ms > 0 and row.torch_ms > 0 and row.speedup_vs_torch > 0
        assert row.target_metric == "read" and row.target == 0.85
    header = kernel_bench.format_table(result).splitlines()[0]
    assert f"weights={fmt} (group {group})" in header
    # the copies carry their scales, which the kernel and the read both stream
    copies = kernel_bench.expert_copies(np.random.default_rng(0), 256, 128, 2, "4k", fmt, group)
    assert len(copies) == 2 and all(len(c) == 6 for c in copies)
    assert sum(a.nbytes for a in copies[0]) == result.rows[0].weight_bytes


def test_isa_for_tokens_refuses_what_names_no_expert():
    with pytest.raises(ValueError, match="tokens must be >= 1, got 0"):
        kernels.isa_for_tokens(0, "int8")
    with pytest.raises(ValueError, match="format 'int3' is not one of bf16, int8, int4"):
        kernels.isa_for_tokens(1, "int3")
    with pytest.raises(ValueError, match="group 48 is not one of 32, 64, 128 for int4 weights"):
        kernels.isa_for_tokens(1, "int4", 48)
    with pytest.raises(ValueError, match=r"group 64 is not one of 32 \(mxfp4's block\) for mxfp4 weights"):
        kernels.isa_for_tokens(1, "mxfp4", 64)


def test_isa_for_tokens_follows_numa_moe_isa(monkeypatch):
    monkeypatch.setenv("NUMA_MOE_ISA", "ref")
    assert kernels.isa_for_tokens(64, "int4") == "ref"


def test_without_an_isa_each_m_runs_what_the_layer_runs_and_is_scored_against_its_own_peak(monkeypatch):
    """Default kernels: the layer's per-M choice (for int4 on an AMX CPU VNNI at one token,
    AMX from 8), each row against the peak of the ISA that ran it, measured at both ends."""
    monkeypatch.setitem(kernel_bench.SHAPES, "tiny", (256, 128))
    monkeypatch.setattr(kernel_bench, "MAX_ROTATION_BYTES", 2 << 20)
    measured = []
    real_peak = kernel_bench.measure_peak_gflop_s

    def peak(isa, threads, **kwargs):
        measured.append(isa)
        return real_peak(isa, threads, seconds=0.01, tries=1, **kwargs)

    monkeypatch.setattr(kernel_bench, "measure_peak_gflop_s", peak)
    lines, status = [], []
    result = kernel_bench.run(shapes=["tiny"], m_values=[1, 8], repeats=2, min_seconds=0.0, page="4k",
                              with_torch=False, weight_format="int4", progress=status.append, table=lines.append)
    expected = {m: kernels.isa_for_tokens(m, "int4") for m in (1, 8)}
    assert result.isa == kernel_bench.AUTO_ISA and [row.isa for row in result.rows] == [expected[1], expected[8]]
    with_loop = [isa for isa in dict.fromkeys(expected.values()) if native_loops.peak_instruction(isa, "int4")]
    assert measured == list(dict.fromkeys(expected.values())) + with_loop  # at the start, then the end
    for row in result.rows:
        peak_of_isa = result.peaks_gflop_s[row.isa]
        assert row.fraction_of_peak == (pytest.approx(row.gflop_s / peak_of_isa) if peak_of_isa else None)
        assert f" {row.isa} " in kernel_bench.format_row(row)
    assert lines[0].startswith("isa=auto (each M the ISA the MoE layer runs it with)")
    by_isa = {}
    for m in (1, 8):
        by_isa.setdefault(expected[m], []).append(str(m))
    described = "; ".join(f"{isa} at M = {', '.join(ms)}" for isa, ms in by_isa.items())
    assert f"isa auto ({described});" in status[0]


def test_mxfp4_runs_count_its_one_byte_scales_and_have_no_torch_column(monkeypatch):
    """mxfp4: e8m0 scales of 32 columns whatever --group says, one byte each; torch has no
    MXFP4 CPU kernel, so the run says so and leaves its column empty."""
    monkeypatch.setitem(kernel_bench.SHAPES, "tiny", (256, 128))
    monkeypatch.setattr(kernel_bench, "MAX_ROTATION_BYTES", 2 << 20)
    status = []
    result = kernel_bench.run(shapes=["tiny"], m_values=[1, 5], repeats=3, min_seconds=0.0, page="4k",
                              weight_format="mxfp4", group=128, progress=status.append)
    elements = 3 * 256 * 128
    assert result.group == 32
    assert result.rows[0].weight_bytes == elements // 2 + elements // 32
    assert any("torch has no CPU kernel for mxfp4" in line for line in status)
    for row in result.rows:
        assert row.ours_ms > 0 and row.torch_ms is None and row.speedup_vs_torch is None
    copies = kernel_bench.expert_copies(np.random.default_rng(0), 256, 128, 2, "4k", "mxfp4", 128)
    assert copies[0][3].dtype.name == "float8_e8m0fnu"
    assert sum(a.nbytes for a in copies[0]) == result.rows[0].weight_bytes

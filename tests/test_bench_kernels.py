"""The kernel benchmark's weight copies and one small run of it (numa_moe/benchmarking/kernels.py)."""

import numpy as np
import pytest

from numa_moe import memory
from numa_moe.benchmarking import kernels as kernel_bench


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
    with pytest.raises(ValueError, match="min_seconds must be >= 0, got -1"):
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

"""Read ceilings and compute peaks measured in the run (numa_moe/apps/benchmarking/yardsticks.py):
best of the samples, a busy warning when they move, and fractions above 1 flagged."""

import pytest

from numa_moe.apps.benchmarking.yardsticks import (
    MEASUREMENT_MARK,
    Yardstick,
    busy_warning,
    is_measurement_problem,
    percent_of,
    ratio_cell,
)


def test_the_ceiling_is_the_best_sample_not_the_median():
    # a neighbour slowed most reads: the median (30) would be a ceiling the work beats
    yardstick = Yardstick.from_samples([30.0, 29.0, 48.0, 31.0, 30.5, 47.0, 30.0, 46.0])
    assert yardstick.best == 48.0 and yardstick.samples == 8


def test_windows_in_run_order_decide_whether_the_machine_was_busy():
    steady = Yardstick.from_samples([40, 35, 41, 39, 40, 30, 41, 40])  # one slow read per window is no drift
    assert steady.window_bests == (40, 41, 40, 41) and not steady.busy
    assert busy_warning("read ceiling", steady, "GB/s") is None
    # the second half of the run read at most 30 GB/s against 41 before: moved 27%
    drifted = Yardstick.from_samples([40, 41, 39, 40, 30, 29, 30, 28])
    assert drifted.spread == pytest.approx(1 - 30 / 41) and drifted.busy
    warning = busy_warning("read ceiling", drifted, "GB/s")
    assert warning.startswith("warning: the read ceiling moved 27% within this run (30.0 to 41.0 GB/s)")
    assert "machine is busy" in warning


def test_busy_threshold_is_twenty_percent():
    assert not Yardstick.from_windows([Yardstick.from_samples([100.0]), Yardstick.from_samples([81.0])]).busy
    assert Yardstick.from_windows([Yardstick.from_samples([100.0]), Yardstick.from_samples([79.0])]).busy


def test_from_windows_keeps_each_yardstick_as_a_window():
    start, end = Yardstick.from_samples([460, 465, 450]), Yardstick.from_samples([350, 360])
    both = Yardstick.from_windows([start, end])
    assert both.best == 465 and both.window_bests == (465, 360) and both.samples == 5 and both.busy


@pytest.mark.parametrize("bad", [[], [0.0], [1.0, float("nan")], [-2.0]])
def test_samples_must_be_positive_rates(bad):
    with pytest.raises(ValueError, match="positive finite samples"):
        Yardstick.from_samples(bad)


def test_fractions_above_one_are_flagged_not_printed_as_results():
    assert ratio_cell(0.93) == "  0.93" and ratio_cell(1.0) == "  1.00"
    assert ratio_cell(1.08) == f" 1.08{MEASUREMENT_MARK}" and ratio_cell(None) == "     -"
    assert is_measurement_problem(1.16) and not is_measurement_problem(1.0) and not is_measurement_problem(None)
    assert percent_of(0.93, "it") == "at 93% of it"
    text = percent_of(1.08, "it")
    assert "measurement problem, not a result" in text and "at 108%" not in text

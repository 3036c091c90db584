"""Yardsticks measured in the run they judge: the read ceiling (GB/s) and the compute
peak (GFLOP/s), and how figures against them are printed.

A yardstick is the *best* of several samples taken interleaved with the work: another
tenant of the machine can only slow a sample down, and a yardstick that reads low
flatters every fraction of it. Its samples, in run order, are cut into windows; when the
best of one window falls more than BUSY_SPREAD below the best of the run, the yardstick
moved within the run and the machine was busy. A fraction above 1 of a ceiling or peak is
not a result: the yardstick measured below what the work achieved, so it is printed as a
measurement problem.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

BUSY_SPREAD = 0.20  # a yardstick whose windows differ more than this: the machine is busy
WINDOWS = 4          # windows the samples of one yardstick are cut into
MEASUREMENT_MARK = "!"
MEASUREMENT_NOTE = (f"{MEASUREMENT_MARK} above 1.00: the yardstick measured below what the work achieved; "
                    "a measurement problem, not a result")


@dataclass(frozen=True)
class Yardstick:
    best: float                       # the highest rate of all samples (GB/s or GFLOP/s)
    window_bests: tuple[float, ...]   # the highest rate of each window, in run order
    samples: int

    @property
    def spread(self) -> float:
        """How far the slowest window's best fell below the best: 0.25 = 25% lower."""
        return 1.0 - min(self.window_bests) / self.best

    @property
    def busy(self) -> bool:
        return self.spread > BUSY_SPREAD

    @classmethod
    def from_samples(cls, rates: Sequence[float], windows: int = WINDOWS) -> "Yardstick":
        """`rates` in run order (higher is better), cut into up to `windows` windows."""
        rates = [float(r) for r in rates]
        if not rates or not all(math.isfinite(r) and r > 0 for r in rates):
            raise ValueError(f"a yardstick needs positive finite samples, got {rates!r}")
        chunks = np.array_split(np.asarray(rates), min(windows, len(rates)))
        return cls(max(rates), tuple(float(c.max()) for c in chunks), len(rates))

    @classmethod
    def from_windows(cls, yardsticks: Sequence["Yardstick"]) -> "Yardstick":
        """One yardstick over several measured in turn (e.g. one per benchmark point),
        each of them a window."""
        if not yardsticks:
            raise ValueError("no yardsticks to combine")
        return cls(max(y.best for y in yardsticks), tuple(y.best for y in yardsticks),
                   sum(y.samples for y in yardsticks))


def busy_warning(what: str, yardstick: Yardstick, unit: str) -> str | None:
    """A warning line when `yardstick` moved more than BUSY_SPREAD within the run."""
    if not yardstick.busy:
        return None
    return (f"warning: the {what} moved {yardstick.spread:.0%} within this run ({min(yardstick.window_bests):.1f} "
            f"to {yardstick.best:.1f} {unit}): the machine is busy, so fractions of it are uncertain")


def is_measurement_problem(fraction: float | None) -> bool:
    return fraction is not None and math.isfinite(fraction) and fraction > 1.0


def ratio_cell(fraction: float | None, width: int = 6) -> str:
    """A fraction of a yardstick for a table column: '0.93', '1.08!' when above 1
    (MEASUREMENT_NOTE explains the mark), '-' when there is no yardstick."""
    if fraction is None or not math.isfinite(fraction):
        return f"{'-':>{width}}"
    mark = MEASUREMENT_MARK if is_measurement_problem(fraction) else ""
    return f"{f'{fraction:.2f}{mark}':>{width}}"


def percent_of(fraction: float, what: str) -> str:
    """'at 93% of it' for a sentence, or the measurement problem when above 100%."""
    if is_measurement_problem(fraction):
        return (f"measured above {what} ({fraction:.0%}): a measurement problem, not a result "
                f"({what} read below what the work achieved)")
    return f"at {fraction:.0%} of {what}"


# Each timed call starts from the same state, so that the order of the engines within a
# repetition does not matter:
# - caches: the touched experts of a Qwen3 decode step (75 MB) are not much larger than
#   an L3, so whatever runs second would find part of them cached; a read of a buffer
#   twice the L3 size evicts them first;
# - spinning threads: every engine timed (worker pools, the kernel pool behind the
#   streaming read, torch's OpenMP team) keeps its threads spinning for a moment after a
#   call; on a machine with few cores they would steal the CPUs of the next engine, which
#   no application using one engine sees, so a short pause lets them sleep.
SETTLE_SECONDS = 0.005
_EVICTION_BUFFER: list[np.ndarray] = []


def l3_bytes() -> int:
    """Size of the largest cache (sysfs), or 32 MiB when unknown."""
    import glob

    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip()
            value = int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        except (OSError, ValueError):
            continue
        best = max(best, value)
    return best or 32 << 20


def evict_caches() -> None:
    """Streams a buffer twice the largest cache (single-threaded numpy), so that what
    runs next finds its data in DRAM."""
    if not _EVICTION_BUFFER:
        _EVICTION_BUFFER.append(np.ones(2 * l3_bytes(), dtype=np.uint8))
    int(_EVICTION_BUFFER[0][::64].sum())


def settle() -> None:
    """Evicts the caches and lets spinning threads sleep (see above)."""
    evict_caches()
    time.sleep(SETTLE_SECONDS)

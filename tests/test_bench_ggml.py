"""benchmarks/bench_ggml.py's pure helpers (the side-by-side run itself needs the ggml
build and is a measurement, not a test)."""

import importlib.util
import statistics
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_ggml.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ggml", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summarize_is_median_and_relative_range(bench, rng):
    samples = list(rng.uniform(1.0, 5.0, size=7))
    med, spread = bench.summarize(samples)
    assert med == statistics.median(samples)
    assert spread == pytest.approx((max(samples) - min(samples)) / med)


def test_table_ratio_and_reduced_experts(bench, rng):
    ours, theirs = rng.uniform(1, 10, size=2)
    row = {"shape": "deepseek-v3", "model_experts": 256, "experts": 16, "tokens": 4, "format": "int4",
           "ggml_type": "q4_0", "ours_ms": ours, "ours_spread": 0.1, "ggml_ms": theirs, "ggml_spread": 0.2}
    line = bench.format_table([row], "CPU X", 2).splitlines()[-1]
    assert "(E=16/256)" in line and "int4/q4_0" in line
    assert float(line.split()[-1]) == pytest.approx(theirs / ours, abs=0.005)
    full = dict(row, experts=256)
    assert "E=" not in bench.format_table([full], "CPU X", 2).splitlines()[-1]


def test_shapes_fit_the_memory_budget_and_the_block_size(bench):
    for name, (model_e, top_k, hidden, inter, experts) in bench.SHAPES.items():
        assert top_k <= experts <= model_e
        assert hidden % bench.GROUP == 0 and inter % bench.GROUP == 0
        assert experts * 3 * hidden * inter * 2 <= 3 << 30, name  # BF16 copy of one side

"""The main job (numa-moe run) and bench layer on small generated checkpoints/shapes."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from numa_moe_cli.main import cli  # noqa: E402


@pytest.fixture
def small_checkpoint(tmp_path):
    from numa_moe.checkpoints.synthetic import make_checkpoint

    return make_checkpoint(tmp_path / "ckpt", like="qwen3-30b-a3b", layers=2, experts=6, hidden_size=256,
                           intermediate_size=128, progress=False)


@pytest.mark.parametrize("extra", [[], ["--virtual-nodes", "3"]])
def test_run_reports_steps_bandwidth_and_balance(small_checkpoint, tmp_path, extra):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(cli, ["run", str(small_checkpoint), "--tokens", "3", "--steps", "3",
                                      "--json", str(out), *extra])
    assert result.exit_code == 0, result.output
    assert "vs torch reference" in result.output and "[ok]" in result.output
    assert "read ceiling" in result.output and "per-node work balance" in result.output
    report = json.loads(out.read_text())
    assert len(report["steps_ms"]) == 3 and report["reference_rel_error"] < 1e-2
    n_nodes = 3 if extra else 1
    assert len(report["node_bytes"]) == n_nodes
    # bytes per node add up to the weights of the experts touched per step (<= all of them)
    assert 0 < sum(report["node_bytes"]) <= 2 * 6 * 3 * 256 * 128 * 2
    if extra:
        assert all(b > 0 for b in report["node_bytes"])
    # the ceiling: one read of each step's experts, interleaved with the steps; the best
    assert report["ceiling"]["samples"] == 3 and report["ceiling"]["gbps"] > 0
    # per-node busy times are medians like the step time, so never above it
    assert all(busy <= np.median(report["steps_ms"]) for busy in report["node_busy_ms"])
    assert "busy: the node's slowest worker, median over steps" in result.output


def _report(effective_gbps, ceiling_gbps, busy=False, node_busy_ms=(1.0,)):
    from numa_moe.apps.run import ReadCeiling, RunReport

    ceiling = ReadCeiling(ceiling_gbps, "native streaming read, 2 pinned threads", samples=10,
                          spread=0.3 if busy else 0.05, busy=busy)
    return RunReport("ckpt", "1 real", 2, 1, 8, [16.2, 16.0, 16.5], 1e-3, 150_000_000, effective_gbps, ceiling,
                     list(range(len(node_busy_ms))), [75_000_000] * len(node_busy_ms), list(node_busy_ms))


def test_run_report_flags_a_layer_above_its_ceiling():
    from numa_moe.apps.run import format_run_report

    text = format_run_report(_report(effective_gbps=10.8, ceiling_gbps=10.0))
    assert "measurement problem, not a result" in text and "108% of it" not in text
    assert "layer at 93% of it" in format_run_report(_report(effective_gbps=9.3, ceiling_gbps=10.0))


def test_run_report_warns_when_the_ceiling_moved():
    from numa_moe.apps.run import format_run_report

    assert "machine is busy" in format_run_report(_report(9.0, 10.0, busy=True))
    assert "machine is busy" not in format_run_report(_report(9.0, 10.0, busy=False))


def test_node_busy_is_the_median_over_steps():
    from numa_moe.apps.run import median_node_busy_ms

    # a slow first step (warm-up) lifted a mean above the median step time
    steps_ms = [40.0, 16.0, 16.2, 16.1]
    busy = median_node_busy_ms([[39.0, 38.0], [15.0, 14.0], [15.5, 14.5], [15.2, 14.1]])
    assert busy == pytest.approx([15.35, 14.3])
    assert all(b <= np.median(steps_ms) for b in busy)


def test_bench_layer_row_flags_ours_above_the_read():
    from numa_moe.apps.benchmarking.layer import format_bench_row

    row = {"model": "qwen3-30b-a3b", "tokens": 1, "touched_mb": 75.5, "1 node ms": 2.5, "2 virtual nodes ms": 2.6,
           "torch loop ms": 7.0, "ceiling_ms": 2.9, "ceiling_gbps": 26.0, "rel_error_vs_fp32": 2e-3}
    line = format_bench_row(row, 2)
    assert "measurement problem, not a result" in line and "116% of it" not in line
    assert "roofline -" in line
    row.update(compute_ms=2.0, roofline_ms=2.9)
    assert "roofline   2.900 ms (memory), ours 1.16! of it" in format_bench_row(row, 2)
    row.update(compute_ms=3.2, roofline_ms=3.2)
    assert "(compute)" in format_bench_row(row, 2)
    row["ceiling_ms"] = 2.4
    assert "ours at 96% of the read" in format_bench_row(row, 2)


def test_run_rejects_conflicting_options(small_checkpoint):
    result = CliRunner().invoke(cli, ["run", str(small_checkpoint), "--nodes", "1", "--virtual-nodes", "2"])
    assert result.exit_code != 0 and "not both" in result.output
    result = CliRunner().invoke(cli, ["run", str(small_checkpoint), "--nodes", "64"])
    assert result.exit_code != 0 and "--virtual-nodes" in result.output


def test_bench_layer_small_shapes(monkeypatch):
    from numa_moe.apps.benchmarking import layer as layer_bench

    monkeypatch.setitem(layer_bench.BENCH_MODELS, "tiny", (6, 2, 256, 128))
    rows = layer_bench.bench_layer(models=("tiny",), tokens=(1, 4), repeats=2, echo=lambda s: None)
    assert [r["tokens"] for r in rows] == [1, 4]
    for r in rows:
        assert r["rel_error_vs_fp32"] < 1e-2
        assert r["1 node ms"] > 0 and r["2 virtual nodes ms"] > 0 and r["torch loop ms"] > 0
        assert r["ceiling_ms"] > 0 and np.isfinite(r["ceiling_gbps"])
        assert r["measurement_problem"] == (r["ceiling_ms"] > r["1 node ms"])
        # the roofline: the slower of the read and the routed flops at the in-run peak
        (peak,) = [p for p in r["peaks_gflop_s"].values()]
        if peak is None:
            assert r["compute_ms"] is None and r["roofline_ms"] == pytest.approx(r["ceiling_ms"])
        else:
            assert r["compute_ms"] == pytest.approx(2 * 3 * 256 * 128 * 2 * r["tokens"] / (peak * 1e9) * 1e3)
            assert r["roofline_ms"] == pytest.approx(max(r["ceiling_ms"], r["compute_ms"]))
        assert r["of_roofline"] == pytest.approx(r["roofline_ms"] / r["1 node ms"])


def test_bench_layer_cli_with_integer_formats(monkeypatch, tmp_path):
    """--format int8 --format int4: one line per format under each bf16 line, the same
    run; integer experts read fewer bytes (values + scales) than bf16, int4 fewest."""
    from numa_moe.apps.benchmarking import layer as layer_bench

    monkeypatch.setitem(layer_bench.BENCH_MODELS, "qwen3-30b-a3b", (6, 2, 256, 128))
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(cli, ["bench", "layer", "--like", "qwen3-30b-a3b", "-t", "1", "-t", "3", "-r", "2",
                                      "--format", "int8", "--format", "int4", "--group", "64", "--json", str(out)])
    assert result.exit_code == 0, result.output
    lines = [line.split() for line in result.output.splitlines() if " T=" in line and not line.startswith("warning")]
    assert [(words[0], words[1]) for words in lines] == [("qwen3-30b-a3b", "T=1"), ("int8", "T=1"), ("int4", "T=1"),
                                                         ("qwen3-30b-a3b", "T=3"), ("int8", "T=3"), ("int4", "T=3")]
    assert all("the bf16 step (group 64)" in " ".join(words) for words in lines if words[0] != "qwen3-30b-a3b")
    rows = json.loads(out.read_text())
    for row in rows:
        formats = row["formats"]
        assert list(formats) == ["bf16", "int8", "int4"]
        bf16, int8, int4 = (formats[f] for f in ("bf16", "int8", "int4"))
        assert bf16["read_mb"] == pytest.approx(row["touched_mb"])
        assert int4["read_mb"] < int8["read_mb"] < 0.6 * bf16["read_mb"]
        for entry in formats.values():
            assert entry["step_ms"] > 0 and entry["ceiling_ms"] > 0
            assert entry["bf16_step_ratio"] == pytest.approx(row["1 node ms"] / entry["step_ms"])
        # the quantized layers compute the same layer: errors of their formats, not garbage
        assert int8["rel_error_vs_fp32"] < 0.05 and int4["rel_error_vs_fp32"] < 0.4
    result = CliRunner().invoke(cli, ["bench", "layer", "--app", "--format", "int8"])
    assert result.exit_code != 0 and "--app runs bf16 experts only" in result.output
    with pytest.raises(ValueError, match="weight_format 'fp8' is not one of bf16, int8, int4"):
        layer_bench.bench_layer(models=("qwen3-30b-a3b",), formats=("int8", "fp8"), echo=lambda s: None)


def test_bench_layer_runs_mxfp4_with_its_own_group(monkeypatch):
    """--format mxfp4 beside int4 at --group 64: mxfp4 keeps its 32-column e8m0 blocks,
    and reads about as many bytes as int4 (4 bits a weight; a byte per 32 against two
    per 64)."""
    from numa_moe.apps.benchmarking import layer as layer_bench

    monkeypatch.setitem(layer_bench.BENCH_MODELS, "tiny", (6, 2, 256, 128))
    rows = layer_bench.bench_layer(models=("tiny",), tokens=(1,), repeats=2, echo=lambda s: None,
                                   formats=("int4", "mxfp4"), group=64)
    formats = rows[0]["formats"]
    assert formats["int4"]["group"] == 64 and formats["mxfp4"]["group"] == 32
    assert formats["mxfp4"]["read_mb"] == pytest.approx(formats["int4"]["read_mb"], rel=0.02)
    assert formats["mxfp4"]["step_ms"] > 0 and formats["mxfp4"]["rel_error_vs_fp32"] < 0.4


def test_run_refuses_a_non_bf16_checkpoint_with_a_message(tmp_path):
    # the store loads F32 experts, the MoE layer runs bf16 only: one line, not a traceback
    import json as json_module

    from numa_moe.checkpoints.writer import TensorPlan, write_safetensors

    directory = tmp_path / "f32"
    directory.mkdir()
    H, I, E = 64, 32, 2
    plans = [TensorPlan(f"model.layers.0.mlp.experts.{e}.{k}_proj.weight", s, np.dtype(np.float32), s[-1])
             for e in range(E) for k, s in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))]
    write_safetensors(directory / "model.safetensors", plans, lambda p: [b"\0" * p.nbytes])
    (directory / "config.json").write_text(json_module.dumps({"hidden_size": H, "num_experts": E}))
    result = CliRunner().invoke(cli, ["run", str(directory), "--steps", "1"])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.output
    assert "F32" in result.output and "BF16" in result.output


def test_bench_layer_app_mode_on_small_shapes(monkeypatch):
    torch = pytest.importorskip("torch")
    from numa_moe.apps.benchmarking import app, layer as layer_bench

    monkeypatch.setitem(layer_bench.BENCH_MODELS, "tiny", (6, 2, 256, 128))
    monkeypatch.setattr(app, "hf_block_row", lambda repeats, rng: None)  # a 1.2 GB block is not for a unit test
    lines = []
    result = app.bench_app(models=("tiny",), tokens=(1, 3), repeats=3, echo=lines.append)
    assert [row["tokens"] for row in result["app"]] == [1, 3]
    for row in result["app"]:
        assert all(row[key] > 0 for key in ("back_to_back_ms", "app_ms", "torch_in_app_ms", "torch_alone_ms"))
    overhead = result["overhead"]
    assert 0 < overhead["layer_native_us"] and 0 < overhead["expert_ffn_us"]
    assert overhead["thread_backend"] == _native_backend()
    assert lines[0].startswith("threads: ") and any("after torch work" in line for line in lines)
    assert torch.get_num_threads() >= 1


def _native_backend():
    from numa_moe import _native

    return _native.thread_backend()


def test_run_in_two_formats_ends_side_by_side(tmp_path):
    from click.testing import CliRunner

    from numa_moe.checkpoints.synthetic import make_checkpoint
    from numa_moe_cli.main import cli

    path = make_checkpoint(tmp_path / "ckpt", like="qwen3-30b-a3b", layers=1, experts=4, hidden_size=128,
                           intermediate_size=256, progress=False)
    result = CliRunner().invoke(cli, ["run", str(path), "--steps", "2", "--format", "bf16", "--format", "int8",
                                      "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert result.output.count("vs torch reference") == 2 and result.output.count("[ok]") == 2
    assert "int8 experts (group 128)" in result.output
    assert "weight formats side by side" in result.output and "the bf16 step" in result.output
    reports = json.loads((tmp_path / "r.json").read_text())
    assert [r["weight_format"] for r in reports] == ["bf16", "int8"]
    assert reports[1]["weight_bytes_per_step"] < 0.6 * reports[0]["weight_bytes_per_step"]

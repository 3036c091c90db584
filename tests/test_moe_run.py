"""The main job (numa-moe run) and bench layer on small generated checkpoints/shapes."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from numa_moe_cli.main import cli  # noqa: E402


@pytest.fixture
def small_checkpoint(tmp_path):
    from numa_moe.synthetic import make_checkpoint

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


def test_run_rejects_conflicting_options(small_checkpoint):
    result = CliRunner().invoke(cli, ["run", str(small_checkpoint), "--nodes", "1", "--virtual-nodes", "2"])
    assert result.exit_code != 0 and "not both" in result.output
    result = CliRunner().invoke(cli, ["run", str(small_checkpoint), "--nodes", "64"])
    assert result.exit_code != 0 and "--virtual-nodes" in result.output


def test_bench_layer_small_shapes(monkeypatch):
    from numa_moe.benchmarking import layer as layer_bench

    monkeypatch.setitem(layer_bench.BENCH_MODELS, "tiny", (6, 2, 256, 128))
    rows = layer_bench.bench_layer(models=("tiny",), tokens=(1, 4), repeats=2, echo=lambda s: None)
    assert [r["tokens"] for r in rows] == [1, 4]
    for r in rows:
        assert r["rel_error_vs_fp32"] < 1e-2
        assert r["1 node ms"] > 0 and r["2 virtual nodes ms"] > 0 and r["torch loop ms"] > 0
        assert r["ceiling_ms"] > 0 and np.isfinite(r["ceiling_gbps"])


def test_run_refuses_a_non_bf16_checkpoint_with_a_message(tmp_path):
    # the store loads F32 experts, the MoE layer runs bf16 only: one line, not a traceback
    import json as json_module

    from numa_moe.synthetic import TensorPlan, write_safetensors

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

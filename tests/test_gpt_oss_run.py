"""numa-moe run on gpt-oss checkpoints: the layer with the checkpoint's biases and
activation against run's torch reference, and that reference against transformers'
GptOssExperts."""

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from numa_moe.apps.run import TOLERANCE, run_job, torch_moe_loop
from numa_moe.checkpoints.synthetic import make_checkpoint

transformers = pytest.importorskip("transformers")


def test_reference_loop_is_transformers_gpt_oss_experts(rng):
    E, H, I, T, k = 6, 32, 48, 11, 3
    config = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                       num_experts_per_tok=k, num_hidden_layers=1)
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(config).float()
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.from_numpy(rng.standard_normal((E, H, 2 * I)) * 2).float())
        experts.gate_up_proj_bias.copy_(torch.from_numpy(rng.standard_normal((E, 2 * I)) * 3).float())
        experts.down_proj.copy_(torch.from_numpy(rng.standard_normal((E, I, H)) / I ** 0.5).float())
        experts.down_proj_bias.copy_(torch.from_numpy(rng.standard_normal((E, H))).float())
    x = torch.from_numpy(rng.standard_normal((T, H))).float()
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:k] for _ in range(T)]))
    weights = torch.softmax(torch.from_numpy(rng.standard_normal((T, k))).float(), dim=1)
    with torch.no_grad():
        expected = experts(x, ids, weights)
        gu = experts.gate_up_proj
        gate_up = torch.cat([gu[..., 0::2], gu[..., 1::2]], dim=-1).transpose(1, 2)   # [E, 2I, H] gate rows first
        b = experts.gate_up_proj_bias
        biases = [(b[e, 0::2], b[e, 1::2], experts.down_proj_bias[e]) for e in range(E)]
        got = torch_moe_loop(x, ids, weights, gate_up, experts.down_proj.transpose(1, 2),
                             compute_dtype=torch.float32, biases=biases, activation="gpt-oss")
        silu = torch_moe_loop(x, ids, weights, gate_up, experts.down_proj.transpose(1, 2),
                              compute_dtype=torch.float32, biases=biases)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(silu, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_run_on_a_gpt_oss_checkpoint(tmp_path, rng, fmt):
    path = make_checkpoint(tmp_path / fmt, "gpt-oss-20b", layers=2, experts=6, seed=int(rng.integers(1 << 30)),
                           hidden_size=128, intermediate_size=96, weight_format=fmt, progress=False)
    report = run_job(path, tokens=5, steps=2, virtual_nodes=2, echo=lambda *_: None, progress=False)
    assert report.weight_format == fmt
    assert report.reference_rel_error <= TOLERANCE[fmt], report.reference_rel_error


def test_cli_run_like_gpt_oss_120b(tmp_path, monkeypatch):
    from numa_moe_cli.main import cli

    monkeypatch.setenv("NUMA_MOE_CACHE", str(tmp_path))
    result = CliRunner().invoke(cli, ["run", "--like", "gpt-oss-120b", "--layers", "1", "--experts", "4",
                                      "--steps", "2", "--tokens", "2", "--virtual-nodes", "2"])
    assert result.exit_code == 0, result.output
    assert "E=4 H=2880 I=2880, mxfp4 experts" in result.output
    assert "[ok]" in result.output
    assert (tmp_path / "gpt-oss-120b-1-e4" / "config.json").exists()

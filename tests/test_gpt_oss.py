"""gpt-oss checkpoints: the released MXFP4 layout and transformers' BF16 one, written by
make-checkpoint, loaded by the store (weights against a decoder of the test's own, element
for element), their biases and activation; run and simulate --like gpt-oss-120b."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from numa_moe.activation import GPT_OSS
from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.checkpoints.synthetic import make_checkpoint
from numa_moe.files import CheckpointError
from numa_moe.layer.store import ExpertStore

# OCP e2m1, written out here apart from the package's table
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def decode_packed(packed: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """float64 [rows, cols] of nibble-packed e2m1 codes (low nibble = even column) and e8m0
    exponent bytes, one per 32 columns, element by element."""
    packed = np.asarray(packed, dtype=np.uint8)
    exponents = np.asarray(exponents).view(np.uint8)
    rows, half = packed.shape
    out = np.empty((rows, 2 * half))
    for r in range(rows):
        for j in range(half):
            byte = int(packed[r, j])
            for c, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                out[r, c] = _E2M1[code] * 2.0 ** (int(exponents[r, c // 32]) - 127)
    return out


def _tensors(path) -> dict:
    return load_file(str(path / "model.safetensors"))


@pytest.fixture
def mxfp4_checkpoint(tmp_path, rng):
    seed = int(rng.integers(1 << 30))
    return make_checkpoint(tmp_path / "mx", "gpt-oss-120b", layers=2, experts=3, seed=seed,
                           hidden_size=64, intermediate_size=96, progress=False)


def test_make_checkpoint_writes_the_released_mxfp4_layout(mxfp4_checkpoint):
    t = _tensors(mxfp4_checkpoint)
    config = json.loads((mxfp4_checkpoint / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["num_local_experts"] == 3
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    p = "model.layers.1.mlp."
    expected = {p + "experts.gate_up_proj_blocks": ((3, 192, 2, 16), torch.uint8),
                p + "experts.gate_up_proj_scales": ((3, 192, 2), torch.uint8),
                p + "experts.gate_up_proj_bias": ((3, 192), torch.bfloat16),
                p + "experts.down_proj_blocks": ((3, 64, 3, 16), torch.uint8),
                p + "experts.down_proj_scales": ((3, 64, 3), torch.uint8),
                p + "experts.down_proj_bias": ((3, 64), torch.bfloat16),
                p + "router.weight": ((3, 64), torch.bfloat16),
                p + "router.bias": ((3,), torch.bfloat16)}
    for name, (shape, dtype) in expected.items():
        assert tuple(t[name].shape) == shape and t[name].dtype == dtype, name
    assert (t[p + "experts.gate_up_proj_scales"] != 0xFF).all()


def test_mxfp4_experts_load_exactly_with_gate_and_up_interleaved(mxfp4_checkpoint):
    t = _tensors(mxfp4_checkpoint)
    store = ExpertStore.load(mxfp4_checkpoint, nodes=1, progress=False)
    assert (store.weight_format, store.group, store.scale_dtype) == ("mxfp4", 32, "e8m0")
    for layer in (0, 1):
        blocks = t[f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks"].numpy()
        scales = t[f"model.layers.{layer}.mlp.experts.gate_up_proj_scales"].numpy()
        d_blocks = t[f"model.layers.{layer}.mlp.experts.down_proj_blocks"].numpy()
        d_scales = t[f"model.layers.{layer}.mlp.experts.down_proj_scales"].numpy()
        loaded = store.layer(layer)
        for e in range(3):
            gate_up = decode_packed(blocks[e].reshape(192, 32), scales[e])   # [2I, H], rows interleaved
            down = decode_packed(d_blocks[e].reshape(64, 48), d_scales[e])
            rows = {"gate": slice(e * 96, (e + 1) * 96), "up": slice(e * 96, (e + 1) * 96),
                    "down": slice(e * 64, (e + 1) * 64)}
            want = {"gate": gate_up[0::2], "up": gate_up[1::2], "down": down}
            for kind, w in want.items():
                got = decode_packed(loaded.weights[kind][rows[kind]], loaded.scales[kind][rows[kind]])
                np.testing.assert_array_equal(got, w, err_msg=f"layer {layer} expert {e} {kind}")


def test_biases_and_activation_come_from_the_checkpoint(mxfp4_checkpoint):
    t = _tensors(mxfp4_checkpoint)
    ck = open_checkpoint(mxfp4_checkpoint)
    assert ck.activation == GPT_OSS and ck.dims.top_k == 3 and ck.weight_format == "mxfp4"
    biases = ck.expert_biases(1)
    gate_up_b = t["model.layers.1.mlp.experts.gate_up_proj_bias"].float().numpy()
    down_b = t["model.layers.1.mlp.experts.down_proj_bias"].float().numpy()
    assert len(biases) == 3
    for e, (g, u, d) in enumerate(biases):
        assert g.dtype == u.dtype == d.dtype == np.float32
        np.testing.assert_array_equal(g, gate_up_b[e, 0::2])
        np.testing.assert_array_equal(u, gate_up_b[e, 1::2])
        np.testing.assert_array_equal(d, down_b[e])
    store = ExpertStore.load(ck, nodes=1, progress=False)
    for e in range(3):
        for got, want in zip(store.layer(1).biases[e], biases[e]):
            np.testing.assert_array_equal(got, want)


def test_bf16_layout_is_transposed_into_the_store(tmp_path, rng):
    out = make_checkpoint(tmp_path / "bf", "gpt-oss-20b", layers=1, experts=2, seed=int(rng.integers(1 << 30)),
                          hidden_size=64, intermediate_size=96, weight_format="bf16", progress=False)
    t = _tensors(out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    gate_up = t["model.layers.0.mlp.experts.gate_up_proj"]   # [E, H, 2I]
    down = t["model.layers.0.mlp.experts.down_proj"]         # [E, I, H]
    assert tuple(gate_up.shape) == (2, 64, 192) and tuple(down.shape) == (2, 96, 64)
    store = ExpertStore.load(out, nodes=1, progress=False)
    assert store.weight_format == "bf16"
    loaded = store.layer(0)
    as_f32 = lambda a: np.asarray(a).astype(np.float32)  # noqa: E731
    for e in range(2):
        np.testing.assert_array_equal(as_f32(loaded.gate[e * 96:(e + 1) * 96]),
                                      gate_up[e][:, 0::2].float().T.numpy())
        np.testing.assert_array_equal(as_f32(loaded.up[e * 96:(e + 1) * 96]),
                                      gate_up[e][:, 1::2].float().T.numpy())
        np.testing.assert_array_equal(as_f32(loaded.down[e * 64:(e + 1) * 64]), down[e].float().T.numpy())


def test_mxfp4_dequantized_into_bf16_on_request(mxfp4_checkpoint):
    t = _tensors(mxfp4_checkpoint)
    store = ExpertStore.load(mxfp4_checkpoint, nodes=1, progress=False, weight_format="bf16")
    blocks = t["model.layers.0.mlp.experts.gate_up_proj_blocks"].numpy()
    scales = t["model.layers.0.mlp.experts.gate_up_proj_scales"].numpy()
    want = decode_packed(blocks[2].reshape(192, 32), scales[2])[1::2]
    got = np.asarray(store.layer(0).up[2 * 96:3 * 96]).astype(np.float64)
    np.testing.assert_array_equal(got, want)


def _rewrite(path, name, value):
    t = _tensors(path)
    t[name] = value
    save_file(t, str(path / "model.safetensors"))


def test_bad_gpt_oss_checkpoints_are_refused(mxfp4_checkpoint):
    name = "model.layers.0.mlp.experts.down_proj_scales"
    good = _tensors(mxfp4_checkpoint)[name].clone()
    scales = good.clone()
    scales[1, 5, 2] = 0xFF
    _rewrite(mxfp4_checkpoint, name, scales)
    with pytest.raises(CheckpointError, match=r"down_proj_blocks.*expert 1 down.*0xFF"):
        ExpertStore.load(mxfp4_checkpoint, nodes=1, progress=False)
    _rewrite(mxfp4_checkpoint, name, scales[:, :, :2].contiguous())
    with pytest.raises(CheckpointError, match=r"down_proj_scales.*shape \[3, 64, 2\], expected \[3, 64, 3\]"):
        open_checkpoint(mxfp4_checkpoint)
    _rewrite(mxfp4_checkpoint, name, good)
    t = _tensors(mxfp4_checkpoint)
    del t["model.layers.1.mlp.experts.gate_up_proj_bias"]
    save_file(t, str(mxfp4_checkpoint / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layer 1: tensor .*gate_up_proj_bias is missing"):
        open_checkpoint(mxfp4_checkpoint)


def test_make_checkpoint_refuses_other_formats_for_gpt_oss(tmp_path):
    with pytest.raises(ValueError, match="mxfp4 or bf16"):
        make_checkpoint(tmp_path / "x", "gpt-oss-20b", weight_format="int8", progress=False)


def test_cli_make_checkpoint_like_gpt_oss_real_shapes(tmp_path):
    from numa_moe_cli.main import cli

    result = CliRunner().invoke(cli, ["make-checkpoint", "--like", "gpt-oss-120b", "--experts", "4",
                                      "--quiet", "-o", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    assert "x 4 experts, H=2880, I=2880, top-k=4" in result.output and "gpt-oss MXFP4" in result.output
    t = _tensors(tmp_path / "ck")
    assert tuple(t["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape) == (4, 5760, 90, 16)


def test_cli_simulate_like_gpt_oss_120b():
    from numa_moe_cli.main import cli

    result = CliRunner().invoke(cli, ["simulate", "--like", "gpt-oss-120b", "--machine", "xeon-6430",
                                      "--layers", "2", "--samples", "2", "--tokens", "1,4"])
    assert result.exit_code == 0, result.output
    assert "gpt-oss-120b H=2880 I=2880 E=128 top-4, 2 MoE layer(s)" in result.output


def test_run_refuses_like_beside_a_checkpoint(mxfp4_checkpoint):
    from numa_moe_cli.main import cli

    result = CliRunner().invoke(cli, ["run", str(mxfp4_checkpoint), "--like", "gpt-oss-20b"])
    assert result.exit_code == 2 and "give them or CHECKPOINT" in result.output


def test_simulate_mxfp4_counts_the_e8m0_scales():
    from numa_moe.apps.simulate import workload_like

    w = workload_like("gpt-oss-120b", "mxfp4")
    assert (w.group, w.scale_dtype) == (32, "e8m0")
    # 4 bits a weight plus one byte per 32: 4.25 bits
    assert w.expert_bytes() == 3 * 2880 * 2880 * 17 // 32
    with pytest.raises(ValueError, match="takes group 32 only"):
        type(w)("x", 64, 64, 4, 2, 1, "mxfp4", group=64)


def test_cli_simulate_gpt_oss_in_mxfp4():
    from numa_moe_cli.main import cli

    result = CliRunner().invoke(cli, ["simulate", "--like", "gpt-oss-120b", "--machine", "xeon-6430",
                                      "--format", "mxfp4", "--samples", "2", "--tokens", "1", "--layers", "2"])
    assert result.exit_code == 0, result.output
    assert "E=128 top-4, 2 MoE layer(s), mxfp4, 4k pages" in result.output


def test_store_gate_and_up_are_transformers_gate_and_up(mxfp4_checkpoint):
    """transformers' own MXFP4 conversion (the one GptOssForCausalLM loads the released
    checkpoint with) gives gate_up_proj [E, H, 2I]; its [..., ::2] / [..., 1::2] are the
    store's gate / up, its down_proj [E, I, H] the store's down transposed."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    t = _tensors(mxfp4_checkpoint)
    p = "model.layers.1.mlp.experts."
    gate_up = mxfp4.convert_moe_packed_tensors(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"],
                                               dtype=torch.float32)
    down = mxfp4.convert_moe_packed_tensors(t[p + "down_proj_blocks"], t[p + "down_proj_scales"],
                                            dtype=torch.float32)
    assert tuple(gate_up.shape) == (3, 64, 192) and tuple(down.shape) == (3, 96, 64)
    store = ExpertStore.load(mxfp4_checkpoint, nodes=1, progress=False, weight_format="bf16")
    loaded = store.layer(1)
    as_f32 = lambda a: np.asarray(a).astype(np.float32)  # noqa: E731
    for e in range(3):
        np.testing.assert_array_equal(as_f32(loaded.gate[e * 96:(e + 1) * 96]), gate_up[e][:, 0::2].T.numpy())
        np.testing.assert_array_equal(as_f32(loaded.up[e * 96:(e + 1) * 96]), gate_up[e][:, 1::2].T.numpy())
        np.testing.assert_array_equal(as_f32(loaded.down[e * 64:(e + 1) * 64]), down[e].T.numpy())


def test_activation_follows_config_json(mxfp4_checkpoint):
    path = mxfp4_checkpoint / "config.json"
    config = json.loads(path.read_text())
    config["swiglu_limit"] = 5.5
    path.write_text(json.dumps(config))
    act = open_checkpoint(mxfp4_checkpoint).activation
    assert (act.alpha, act.limit, act.up_offset) == (GPT_OSS.alpha, 5.5, 1.0)
    config["swiglu_limit"] = -1
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="swiglu_alpha / swiglu_limit: activation limit must be > 0"):
        open_checkpoint(mxfp4_checkpoint)

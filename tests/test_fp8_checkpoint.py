"""FP8 (DeepSeek-V3 style) checkpoints: tiny files written with torch's float8_e4m3fn and
128 x 128 block scales; the BF16 import equals torch's own dequantization bit for bit,
INT8 stays within numa_moe.quant.error_bound of it, and missing or mis-shaped scales are
one-line errors when the headers are read. The native pass (_native.dequantize_fp8_blocks)
on every e4m3 code against torch, and NaN weight bytes named; its one-pass requantization
(_native.requantize_fp8_blocks) against torch's products quantized by numa_moe.quant."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="FP8 test checkpoints are written with torch's float8_e4m3fn")
from safetensors.torch import save_file  # noqa: E402

from numa_moe import quant as q  # noqa: E402
from numa_moe.checkpoints.dispatch import open_checkpoint  # noqa: E402
from numa_moe.files import CheckpointError  # noqa: E402
from numa_moe.formats import KINDS  # noqa: E402
from numa_moe.layer.store import ExpertStore, expert_rows  # noqa: E402

E, H, I = 3, 256, 192  # I is not a multiple of 128: the last block of a row is partial
NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def write_fp8(directory, seed, block=(128, 128), config_block=(128, 128), drop=None, reshape=None):
    """A one-layer FP8 checkpoint: per expert and kind an F8_E4M3 weight and its F32
    ``weight_scale_inv`` [ceil(rows / b0), ceil(cols / b1)]; ``drop`` / ``reshape`` name a
    scale tensor to leave out or to write with one block row too few."""
    g = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for e in range(E):
        for kind, (rows, cols) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            name = f"model.layers.0.mlp.experts.{e}.{NAMES[kind]}.weight"
            w = (torch.randn(rows, cols, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            s = torch.rand(math.ceil(rows / block[0]), math.ceil(cols / block[1]), generator=g) * 1e-3 + 1e-4
            tensors[name] = w
            if name + "_scale_inv" == drop:
                continue
            tensors[name + "_scale_inv"] = s[:-1] if name + "_scale_inv" == reshape else s
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E, "num_experts_per_tok": 2,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                      "weight_block_size": list(config_block)}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory, tensors


def torch_dequantized(tensors, name, block=(128, 128)):
    """torch's own dequantization: w.to(float32) * scale_inv broadcast over its blocks."""
    w, s = tensors[name], tensors[name + "_scale_inv"]
    expanded = s.repeat_interleave(block[0], 0)[:w.shape[0]].repeat_interleave(block[1], 1)[:, :w.shape[1]]
    return w.to(torch.float32) * expanded


def test_bf16_import_equals_torch_dequantization(tmp_path, rng):
    path, tensors = write_fp8(tmp_path / "ck", int(rng.integers(1 << 31)))
    ck = open_checkpoint(path)
    assert ck.source_format == "FP8 e4m3 (block 128 x 128)" and ck.weight_format == "bf16"
    store = ExpertStore.load(ck, progress=False)
    assert store.weight_format == "bf16" and not store.quantized
    for kind in KINDS:
        loaded = store.torch_weights(0, kind)
        for e in range(E):
            want = torch_dequantized(tensors, f"model.layers.0.mlp.experts.{e}.{NAMES[kind]}.weight")
            got = loaded[slice(*expert_rows(store.dims, kind, e))]
            assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16)), (kind, e)


@pytest.mark.parametrize("group", [32, 64])
def test_int8_import_within_the_quantization_bound(tmp_path, rng, group):
    path, tensors = write_fp8(tmp_path / "ck", int(rng.integers(1 << 31)))
    store = ExpertStore.load(path, progress=False, weight_format="int8", group=group)
    assert (store.weight_format, store.group, store.scale_dtype) == ("int8", group, "fp16")
    for kind in KINDS:
        for e in range(E):
            want = torch_dequantized(tensors, f"model.layers.0.mlp.experts.{e}.{NAMES[kind]}.weight").numpy()
            values, scales = (x[{"gate": 0, "up": 1, "down": 2}[kind]] for x in
                              (store.expert(0, e), store.expert_scales(0, e)))
            qm = q.QuantizedMatrix("int8", group, values, scales)
            got = q.dequantize(qm)
            assert np.all(np.abs(got - want) <= q.error_bound(want, qm) * (1 + 1e-6))
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.01


def test_inspect_reports_the_conversion(tmp_path, rng):
    from numa_moe.apps.placement_report import inspect_checkpoint

    path, _ = write_fp8(tmp_path / "ck", int(rng.integers(1 << 31)))
    report = inspect_checkpoint(path, nodes=2, weight_format="int8", group=64)
    c = report.conversion
    assert c["conversion"] == "FP8 e4m3 (block 128 x 128) -> int8, group 64, fp16 scales (requantized)"
    assert c["file_bytes"] == E * 3 * I * H
    assert c["loaded_bytes"] == E * 3 * I * H + E * 3 * I * H // 64 * 2
    assert all(0 < e["rel_fro"] < 0.01 for e in c["errors"])
    assert "import: FP8 e4m3" in report.format_text()
    bf16 = inspect_checkpoint(path, nodes=1).conversion
    assert bf16["exact"] and bf16["format"] == "bf16"
    # bf16 rounding of the float32 product: at most half an ulp of bf16 (2**-8 relative)
    assert all(e["max_rel"] <= 2 ** -8 for e in bf16["errors"])


def test_missing_scale_tensor(tmp_path):
    name = "model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"
    path, _ = write_fp8(tmp_path / "ck", 1, drop=name)
    with pytest.raises(CheckpointError, match=f"scale tensor '{name}' is missing") as info:
        open_checkpoint(path)
    assert "\n" not in str(info.value)


def test_misshaped_scale_tensor(tmp_path):
    name = "model.layers.0.mlp.experts.2.down_proj.weight_scale_inv"
    path, _ = write_fp8(tmp_path / "ck", 2, reshape=name)
    with pytest.raises(CheckpointError, match=r"has shape \[1, 2\], expected \[2, 2\]: one scale per "
                                              r"128 x 128 block") as info:
        open_checkpoint(path)
    assert name in str(info.value) and "\n" not in str(info.value)


def test_block_size_from_the_config_must_match_the_scales(tmp_path):
    path, _ = write_fp8(tmp_path / "ck", 3, config_block=(64, 64))
    with pytest.raises(CheckpointError, match="one scale per 64 x 64 block"):
        open_checkpoint(path)


def test_every_e4m3_code_dequantizes_as_torch_does(rng):
    """The native pass on every finite e4m3 byte (subnormals, both zeros, the largest 448),
    partial blocks on both axes, scales of random magnitude: torch's products bit for bit,
    in float32 and rounded to bf16, into rows further apart than their elements."""
    from numa_moe import _native

    rows, cols, block = 130, 300, (64, 128)
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
    w = rng.permutation(np.resize(codes, rows * cols)).reshape(rows, cols)
    scales = (rng.random((3, 3)) * np.exp(rng.uniform(-20, 20, (3, 3)))).astype(np.float32)
    tw = torch.from_numpy(w).view(torch.float8_e4m3fn)
    ts = torch.from_numpy(scales).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    want = tw.to(torch.float32) * ts
    out = np.full((rows, cols + 7), np.nan, np.float32)[:, :cols]
    _native.dequantize_fp8_blocks(w, scales, *block, out)
    np.testing.assert_array_equal(out.view(np.uint32), want.numpy().view(np.uint32))
    out16 = np.full((rows, cols + 3), 0x7FC1, np.uint16)[:, :cols]  # a NaN: what stays unwritten shows
    _native.dequantize_fp8_blocks(w, scales, *block, out16)
    np.testing.assert_array_equal(out16, want.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_a_nan_weight_is_named(tmp_path, rng, byte):
    from numa_moe import _native

    w = rng.integers(0, 0x7E, (4, 256), dtype=np.uint8)
    w[2, 200] = byte
    scales = np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match=rf"a NaN weight \(byte 0x{byte:02X}\) \(row 2, column 200\)"):
        _native.dequantize_fp8_blocks(w, scales, 128, 128, np.empty((4, 256), np.float32))
    path, tensors = write_fp8(tmp_path / "ck", int(rng.integers(1 << 31)))
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    bad = tensors[name].view(torch.uint8).clone()
    bad[5, 17] = byte
    tensors[name] = bad.view(torch.float8_e4m3fn)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name}.*expert 1 up\): a NaN weight \(byte 0x{byte:02X}\) "
                                              r"\(row 5, column 17\)"):
        ExpertStore.load(path, progress=False)


def test_fp8_bad_arguments_are_refused():
    from numa_moe import _native

    w = np.zeros((4, 256), np.uint8)
    scales = np.ones((1, 2), np.float32)
    out = np.empty((4, 256), np.float32)
    fp8 = _native.dequantize_fp8_blocks
    with pytest.raises(ValueError, match=r"scales: shape \(1, 2\), expected \(2, 2\) for a 4 x 256 matrix in "
                                         "blocks of 2 x 128"):
        fp8(w, scales, 2, 128, out)
    with pytest.raises(ValueError, match="block 0 x 128: both sides must be positive"):
        fp8(w, scales, 0, 128, out)
    with pytest.raises(ValueError, match="w: expected e4m3 bytes"):
        fp8(w.view(np.uint16), scales, 128, 128, out)
    with pytest.raises(ValueError, match="scales: dtype float64, expected float32"):
        fp8(w, scales.astype(np.float64), 128, 128, out)
    with pytest.raises(ValueError, match="out: expected float32 or bfloat16 elements"):
        fp8(w, scales, 128, 128, np.zeros((4, 256), np.float16))
    with pytest.raises(ValueError, match=r"out: shape \(4, 128\), expected \[4, 256\]"):
        fp8(w, scales, 128, 128, out[:, :128])
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: must be writable"):
        fp8(w, scales, 128, 128, out)


@pytest.mark.parametrize("fmt, group, scale_dtype", [("int8", 32, "fp16"), ("int4", 32, "bf16"), ("int8", 64, "fp32")])
def test_requantization_equals_torch_products_quantized(rng, fmt, group, scale_dtype):
    """Partial blocks on both axes: the bytes of quant.quantize over torch's float32
    products, into rows further apart than their elements."""
    from numa_moe import _native

    rows, cols, block = 130, 320, (64, 128)
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
    w = rng.permutation(np.resize(codes, rows * cols)).reshape(rows, cols)
    scales = (rng.random((3, 3)) * 1e-3).astype(np.float32)
    tw = torch.from_numpy(w).view(torch.float8_e4m3fn)
    ts = torch.from_numpy(scales).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    want = q.quantize((tw.to(torch.float32) * ts).numpy(), fmt, group, scale_dtype)
    value_cols = cols if fmt == "int8" else cols // 2
    values = np.full((rows, value_cols + 5), 0x5A, np.uint8)[:, :value_cols]
    out_scales = np.full((rows, cols // group), 0x5A, np.float32 if scale_dtype == "fp32" else np.uint16)
    _native.requantize_fp8_blocks(w, scales, *block, fmt, group, scale_dtype, values, out_scales)
    np.testing.assert_array_equal(values, want.q.view(np.uint8))
    np.testing.assert_array_equal(out_scales.view(np.uint8), want.scales.view(np.uint8))


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_a_nan_weight_is_named_when_requantized(tmp_path, rng, byte):
    from numa_moe import _native

    w = rng.integers(0, 0x7E, (4, 256), dtype=np.uint8)
    w[3, 33] = byte
    values, out_scales = np.empty((4, 256), np.uint8), np.empty((4, 8), np.uint16)
    with pytest.raises(ValueError, match=rf"a NaN weight \(byte 0x{byte:02X}\) \(row 3, column 33\)"):
        _native.requantize_fp8_blocks(w, np.ones((1, 2), np.float32), 128, 128, "int8", 32, "fp16", values,
                                      out_scales)
    path, tensors = write_fp8(tmp_path / "ck", int(rng.integers(1 << 31)))
    name = "model.layers.0.mlp.experts.2.down_proj.weight"
    bad = tensors[name].view(torch.uint8).clone()
    bad[7, 100] = byte
    tensors[name] = bad.view(torch.float8_e4m3fn)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name}.*expert 2 down\): a NaN weight \(byte 0x{byte:02X}\) "
                                              r"\(row 7, column 100\)"):
        ExpertStore.load(path, progress=False, weight_format="int8")


def test_a_product_beyond_the_scale_dtype_is_named_when_requantized():
    from numa_moe import _native

    w = np.zeros((3, 128), np.uint8)
    w[2, 70] = 0x7E  # 448
    values, out_scales = np.empty((3, 128), np.uint8), np.empty((3, 4), np.uint16)
    with pytest.raises(ValueError, match=r"needs a scale beyond its dtype's range \(row 2, group 2\)"):
        _native.requantize_fp8_blocks(w, np.full((1, 1), 1e5, np.float32), 128, 128, "int8", 32, "fp16", values,
                                      out_scales)


def test_fp8_requantization_bad_arguments_are_refused():
    from numa_moe import _native

    w = np.zeros((4, 256), np.uint8)
    scales = np.ones((1, 2), np.float32)
    values, out_scales = np.empty((4, 256), np.uint8), np.empty((4, 8), np.uint16)
    requantize = _native.requantize_fp8_blocks
    with pytest.raises(ValueError, match=r"scales: shape \(1, 2\), expected \(2, 2\)"):
        requantize(w, scales, 2, 128, "int8", 32, "fp16", values, out_scales)
    with pytest.raises(ValueError, match="block 128 x 0: both sides must be positive"):
        requantize(w, scales, 128, 0, "int8", 32, "fp16", values, out_scales)
    with pytest.raises(ValueError, match="format 'bf16' is not one of int8, int4"):
        requantize(w, scales, 128, 128, "bf16", 32, "fp16", values, out_scales)
    with pytest.raises(ValueError, match="group 48 is not one of 32, 64, 128"):
        requantize(w, scales, 128, 128, "int8", 48, "fp16", values, out_scales)
    with pytest.raises(ValueError, match="values"):
        requantize(w, scales, 128, 128, "int4", 32, "fp16", values, out_scales)
    with pytest.raises(ValueError, match="scales"):
        requantize(w, scales, 128, 128, "int8", 32, "fp32", values, out_scales)

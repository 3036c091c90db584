"""Reading quantized checkpoints (docs/quantization.md, "Checkpoints"): what the reader
reports, and a one-line CheckpointError for each way such a file can be wrong."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numa_moe import quant as q
from numa_moe.checkpoints.safetensors import scale_tensor_name
from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.files import CheckpointError
from numa_moe.layer.store import ExpertStore
from numa_moe.checkpoints.writer import TensorPlan, write_safetensors

H, I, E = 128, 64, 2
NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _experts(rng, fmt="int8", group=32, scale_dtype="fp16", layers=1):
    """name -> array of a quantized checkpoint (values + scales), and the float weights."""
    tensors, floats = {}, {}
    for layer in range(layers):
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = rng.standard_normal((E, H)).astype(
            ml_dtypes.bfloat16)
        for e in range(E):
            for kind, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                name = f"model.layers.{layer}.mlp.experts.{e}.{NAMES[kind]}.weight"
                w = rng.standard_normal(shape).astype(np.float32)
                qm = q.quantize(w, fmt, group, scale_dtype)
                tensors[name], tensors[scale_tensor_name(name)] = qm.q, qm.scales
                floats[name] = w
    return tensors, floats


def _meta(fmt="int8", group=32, scale_dtype="fp16"):
    return {"format": "pt", "numa_moe.quant": fmt, "numa_moe.group": str(group),
            "numa_moe.scale_dtype": scale_dtype}


def _write(path, tensors, metadata):
    plans = [TensorPlan(name, a.shape, a.dtype, 1) for name, a in tensors.items()]
    write_safetensors(path, plans, lambda p: [np.ascontiguousarray(tensors[p.name]).tobytes()],
                      metadata=metadata)


def _error(path, match):
    with pytest.raises(CheckpointError, match=match) as info:
        open_checkpoint(path)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("fmt,scale_dtype", [("int8", "fp16"), ("int4", "bf16"), ("int4", "fp32")])
def test_quantized_checkpoint_is_recognised_and_reported(tmp_path, rng, fmt, scale_dtype):
    tensors, _ = _experts(rng, fmt, 64, scale_dtype, layers=2)
    _write(tmp_path / "model.safetensors", tensors, _meta(fmt, 64, scale_dtype))
    ck = open_checkpoint(tmp_path)
    assert ck.quant.fmt == fmt and ck.quant.group == 64 and ck.quant.scale_dtype == scale_dtype
    assert ck.weight_format == fmt and ck.dtype == ("I8" if fmt == "int8" else "U8")
    summary = ck.summary()
    assert summary["weight_format"] == fmt
    assert summary["quant"] == {"format": fmt, "group": 64, "scale_dtype": scale_dtype}
    assert (ck.dims.hidden_size, ck.dims.intermediate_size, ck.dims.n_experts) == (H, I, E)
    m = ck.layers[1].matrices["down"][1]
    assert (m.rows, m.cols, m.quant) == (H, I, fmt)
    assert m.nbytes == H * I // (2 if fmt == "int4" else 1)
    assert m.scales.tensor.name == "model.layers.1.mlp.experts.1.down_proj.weight_scale"
    assert (m.scales.rows, m.scales.cols) == (H, I // 64)
    ck.check_scales()


def test_float_checkpoint_reports_no_quantization(tmp_path, rng):
    from numa_moe.checkpoints.synthetic import make_checkpoint

    ck = open_checkpoint(make_checkpoint(tmp_path / "ck", "qwen3-30b-a3b", 1, 2, 0, hidden_size=H,
                                         intermediate_size=I, progress=False))
    assert ck.quant is None and ck.weight_format == "bf16" and ck.summary()["quant"] is None
    assert ck.layers[0].matrices["gate"][0].scales is None


def test_missing_scales(tmp_path, rng):
    tensors, _ = _experts(rng)
    del tensors["model.layers.0.mlp.experts.1.up_proj.weight_scale"]
    _write(tmp_path / "model.safetensors", tensors, _meta())
    _error(tmp_path, r"experts\.1\.up_proj\.weight'?: missing scales: no tensor "
                     r"'model\.layers\.0\.mlp\.experts\.1\.up_proj\.weight_scale'")


def test_scale_shape_mismatch(tmp_path, rng):
    tensors, _ = _experts(rng)
    name = "model.layers.0.mlp.experts.0.down_proj.weight_scale"
    tensors[name] = np.ones((H, I // 64), dtype=np.float16)  # group 64 scales, metadata says 32
    _write(tmp_path / "model.safetensors", tensors, _meta())
    _error(tmp_path, rf"{name}' has shape \[{H}, 1\], expected \[{H}, 2\]")


def test_scale_dtype_mismatch(tmp_path, rng):
    tensors, _ = _experts(rng)
    name = "model.layers.0.mlp.experts.0.gate_proj.weight_scale"
    tensors[name] = tensors[name].astype(np.float32)
    _write(tmp_path / "model.safetensors", tensors, _meta())
    _error(tmp_path, rf"{name}' is F32 but the metadata says numa_moe.scale_dtype=fp16")


@pytest.mark.parametrize("bad,word", [(np.nan, "NaN"), (np.inf, "infinite"), (0.0, "zero")])
def test_nan_inf_zero_scales_refused_on_load(tmp_path, rng, bad, word):
    tensors, _ = _experts(rng)
    name = "model.layers.0.mlp.experts.1.down_proj.weight_scale"
    tensors[name] = tensors[name].copy()
    tensors[name][5, 1] = bad
    _write(tmp_path / "model.safetensors", tensors, _meta())
    ck = open_checkpoint(tmp_path)  # headers only: values are checked when read
    with pytest.raises(CheckpointError, match=rf"{name}'?: 1 NaN, infinite or zero scale\(s\) for layer 0 "
                                              rf"expert 1 down \(first: row 5, group 1 is {word}\)") as info:
        ExpertStore.load(ck, progress=False)
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="NaN, infinite or zero"):
        ck.check_scales()


def test_iq4nl_zero_scales_load_as_blocks_of_zeros(tmp_path, rng):
    """iq4nl's codebook has no zero, so its zero scale is a block of zeros: loaded, not
    refused (NaN still is), and the layer's values there are 0."""
    tensors, _ = _experts(rng, fmt="iq4nl", scale_dtype="fp32")
    name = "model.layers.0.mlp.experts.1.down_proj.weight_scale"
    tensors[name] = tensors[name].copy()
    tensors[name][5, 1] = 0
    _write(tmp_path / "model.safetensors", tensors, _meta("iq4nl", 32, "fp32"))
    ck = open_checkpoint(tmp_path)
    ck.check_scales()
    store = ExpertStore.load(ck, progress=False)
    assert store.weight_format == "iq4nl"
    down = q.QuantizedMatrix("iq4nl", 32, store.weights(0, "down")[H:2 * H], store.scales(0, "down")[H:2 * H])
    assert np.all(q.dequantize(down)[5, 32:64] == 0) and np.any(q.dequantize(down)[5, :32] != 0)
    tensors[name][5, 1] = np.nan
    _write(tmp_path / "model.safetensors", tensors, _meta("iq4nl", 32, "fp32"))
    with pytest.raises(CheckpointError, match=r"1 NaN, infinite or zero scale\(s\) .* is NaN\); scales must be finite$"):
        open_checkpoint(tmp_path).check_scales()


def test_unknown_scheme_in_metadata(tmp_path, rng):
    tensors, _ = _experts(rng)
    _write(tmp_path / "model.safetensors", tensors, _meta(fmt="int3"))
    _error(tmp_path, r"unknown quantization scheme numa_moe.quant='int3'; this reader knows int8, int4")


@pytest.mark.parametrize("key,value,match", [
    ("numa_moe.group", "100", r"numa_moe.group='100' is not one of 32, 64, 128"),
    ("numa_moe.group", "0x20", r"numa_moe.group='0x20' is not one of"),
    ("numa_moe.scale_dtype", "fp8", r"numa_moe.scale_dtype='fp8' is not one of fp16, bf16, fp32"),
    ("numa_moe.group", None, r"quantization metadata is incomplete: numa_moe.group missing"),
])
def test_bad_metadata_values(tmp_path, rng, key, value, match):
    tensors, _ = _experts(rng)
    meta = _meta()
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    _write(tmp_path / "model.safetensors", tensors, meta)
    _error(tmp_path, match)


def test_mixed_formats_float_expert_in_quantized_checkpoint(tmp_path, rng):
    tensors, floats = _experts(rng)
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    tensors[name] = floats[name].astype(ml_dtypes.bfloat16)
    _write(tmp_path / "model.safetensors", tensors, _meta())
    _error(tmp_path, rf"{name}'? is BF16 but the checkpoint is int8 \(I8 expert weights\): mixed formats")


def test_mixed_formats_int4_values_under_int8_metadata(tmp_path, rng):
    tensors, _ = _experts(rng, fmt="int4")
    _write(tmp_path / "model.safetensors", tensors, _meta(fmt="int8"))
    _error(tmp_path, r"is U8 but the checkpoint is int8 \(I8 expert weights\): mixed formats")


def test_mixed_formats_across_shards(tmp_path, rng):
    tensors, _ = _experts(rng, layers=2)
    first = {k: v for k, v in tensors.items() if ".layers.0." in k}
    second = {k: v for k, v in tensors.items() if ".layers.1." in k}
    _write(tmp_path / "a.safetensors", first, _meta(group=32))
    _write(tmp_path / "b.safetensors", second, _meta(group=64))
    _error(tmp_path, r"mixed formats: the files of the checkpoint declare different quantizations "
                     r"\(a.safetensors: int8, group 32, fp16 scales; b.safetensors: int8, group 64")
    # a shard of quantized experts that declares nothing
    _write(tmp_path / "b.safetensors", second, {"format": "pt"})
    _error(tmp_path, r"b.safetensors: tensor .*: mixed formats: the checkpoint is quantized "
                     r"\(int8, group 32, fp16 scales\) but this file carries no numa_moe.quant metadata")


def test_raw_int8_without_metadata_is_not_quantized(tmp_path, rng):
    tensors, _ = _experts(rng)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("_scale")}
    _write(tmp_path / "model.safetensors", tensors, {"format": "pt"})
    ck = open_checkpoint(tmp_path)
    assert ck.quant is None and ck.dtype == "I8"
    with pytest.raises(ValueError, match="routed experts are I8; the store loads"):
        ExpertStore.load(ck, progress=False)


@pytest.mark.parametrize("value", [["int8"], {"a": 1}, 8])
def test_metadata_of_the_wrong_type_is_one_line(tmp_path, rng, value):
    """safetensors metadata holds strings; a crafted header may hold anything."""
    import json

    tensors, _ = _experts(rng)
    codes = {np.dtype(np.int8): "I8", np.dtype(np.float16): "F16",
             np.dtype(ml_dtypes.bfloat16): "BF16"}
    header, offset, data = {"__metadata__": {**_meta(), "numa_moe.quant": value}}, 0, b""
    for name, a in tensors.items():
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        data += np.ascontiguousarray(a).tobytes()
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data)
    _error(tmp_path, "unknown quantization scheme")

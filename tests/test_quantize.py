"""numa-moe quantize / numa_moe.checkpoints.quantize: the checkpoint layout of docs/quantization.md,
round trip within numa_moe.quant.error_bound, atomic output, one-line refusals."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors
from click.testing import CliRunner

from numa_moe import quant as q
from numa_moe.checkpoints.safetensors import read_safetensors_header
from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.files import CheckpointError
from numa_moe.formats import KINDS
from numa_moe.checkpoints.quantize import quantize_checkpoint
from numa_moe.checkpoints.synthetic import make_checkpoint
from numa_moe_cli.main import cli

H, I, E = 256, 128, 3
SCALE_NP = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32,
            "e8m0": ml_dtypes.float8_e8m0fnu}
ST_DTYPE = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "I8": np.int8,
            "U8": np.uint8, "F8_E8M0": ml_dtypes.float8_e8m0fnu}


def _tensors(directory):
    out, meta = {}, {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors.deserialize(path.read_bytes()):
            out[name] = np.frombuffer(bytes(entry["data"]),
                                      dtype=ST_DTYPE.get(entry["dtype"], np.uint8)).reshape(entry["shape"])
        meta[path.name] = read_safetensors_header(path)[1]
    return out, meta


@pytest.fixture
def source(tmp_path, rng):
    # qwen2-57b: shared expert and router tensors that must pass through unchanged;
    # sharded so the index is rewritten.
    return make_checkpoint(tmp_path / "src", "qwen2-57b-a14b", 2, E, int(rng.integers(1 << 31)),
                           hidden_size=H, intermediate_size=I, progress=False,
                           max_shard_bytes=40_000)


@pytest.mark.parametrize("fmt,group,scale_dtype", [("int8", 128, "fp16"), ("int4", 32, "bf16"),
                                                    ("int4", 64, "fp32"), ("int8", 32, "fp32"),
                                                    ("mxfp4", 32, "e8m0"), ("iq4nl", 32, "fp16"),
                                                    ("iq4nl", 32, "fp32")])
def test_round_trip_within_the_bound_and_layout(source, tmp_path, fmt, group, scale_dtype):
    out = tmp_path / "q"
    result = quantize_checkpoint(source, out, fmt, group, scale_dtype, progress=False)
    before, _ = _tensors(source)
    after, meta = _tensors(out)
    ck = open_checkpoint(out)
    assert (ck.quant.fmt, ck.quant.group, ck.quant.scale_dtype) == (fmt, group, scale_dtype)
    assert ck.summary()["quant"] == {"format": fmt, "group": group, "scale_dtype": scale_dtype}
    for m in meta.values():
        assert (m["numa_moe.quant"], m["numa_moe.group"], m["numa_moe.scale_dtype"]) == \
            (fmt, str(group), scale_dtype)
        assert m["format"] == "pt"  # the source's metadata is kept
    experts = {m.tensor.name for m in open_checkpoint(source).expert_matrices()}
    assert result.tensors_quantized == len(experts) == 2 * E * 3
    for name, w in before.items():
        if name not in experts:  # router, shared expert: byte for byte
            assert after[name].dtype == w.dtype and np.array_equal(after[name].view(np.uint8),
                                                                   w.view(np.uint8)), name
            assert name.replace(".weight", "") + ".weight_scale" not in after
            continue
        values, scales = after[name], after[name[:-len(".weight")] + ".weight_scale"]
        rows, cols = w.shape
        assert values.dtype == (np.int8 if fmt == "int8" else np.uint8)
        assert values.shape == (rows, cols if fmt == "int8" else cols // 2)
        assert scales.shape == (rows, cols // group) and scales.dtype == SCALE_NP[scale_dtype]
        qm = q.QuantizedMatrix(fmt, group, values, scales)
        w32 = w.astype(np.float32)
        err = np.abs(w32 - q.dequantize(qm))
        # error_bound is exact arithmetic; the fp32 product s * q may land one ulp of w
        # beyond it (bf16 weights sit on exact half steps of fp32 scales).
        assert np.all(err <= q.error_bound(w, qm) * (1 + 1e-6) + np.spacing(np.abs(w32)))
        expected = q.quantize(w, fmt, group, scale_dtype)  # exactly the reference quantizer
        assert np.array_equal(values, expected.q) and np.array_equal(
            scales.view(np.uint8), expected.scales.view(np.uint8))
    # index names every tensor (scales beside their weights); config.json copied
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(after)
    for name, shard in index["weight_map"].items():
        assert name in read_safetensors_header(out / shard)[0]
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in after.values())
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert result.bytes_before == sum(p.stat().st_size for p in source.glob("*.safetensors"))
    assert result.bytes_after == sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert result.expert_bytes_after < result.expert_bytes_before


def test_cli_mxfp4_takes_its_own_group_and_e8m0_scales(source, tmp_path):
    """`quantize --format mxfp4` defaults to group 32 and e8m0 scales (F8_E8M0 in the
    file, which the safetensors package reads), and refuses any other group or scale type
    in one line."""
    out = tmp_path / "q"
    result = CliRunner().invoke(cli, ["quantize", str(source), "--format", "mxfp4", "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "mxfp4, group 32, e8m0 scales" in result.output
    ck = open_checkpoint(out)
    assert (ck.quant.fmt, ck.quant.group, ck.quant.scale_dtype) == ("mxfp4", 32, "e8m0")
    name = next(m.tensor.name for m in ck.expert_matrices())
    scale_name = name[:-len(".weight")] + ".weight_scale"
    codes = {tensor: entry["dtype"] for path in out.glob("*.safetensors")
             for tensor, entry in safetensors.deserialize(path.read_bytes())}
    assert codes[scale_name] == "F8_E8M0" and codes[name] == "U8"
    before, _ = _tensors(source)
    after, _ = _tensors(out)
    expected = q.quantize(before[name], "mxfp4")
    assert np.array_equal(after[name], expected.q)
    assert np.array_equal(after[scale_name].view(np.uint8), expected.scales.view(np.uint8))
    for extra, message in ((["--group", "64"], "weight_format 'mxfp4' takes group 32 only"),
                           (["--scale-dtype", "fp16"], "weight_format 'mxfp4' takes scale_dtype 'e8m0' only")):
        result = CliRunner().invoke(cli, ["quantize", str(source), "--format", "mxfp4", *extra,
                                          "-o", str(tmp_path / "bad"), "--quiet"])
        assert result.exit_code == 1 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(cli, ["quantize", str(source), "--format", "int4", "--scale-dtype", "e8m0",
                                      "-o", str(tmp_path / "bad"), "--quiet"])
    assert result.exit_code == 1 and "scale_dtype 'e8m0' belongs to weight_format 'mxfp4' only" in result.output
    assert not (tmp_path / "bad").exists()


def test_make_checkpoint_mxfp4_equals_quantizing_the_bf16_one(tmp_path, rng):
    seed = int(rng.integers(1 << 31))
    made = make_checkpoint(tmp_path / "made", "qwen3-30b-a3b", 1, E, seed, hidden_size=H,
                           intermediate_size=I, progress=False, weight_format="mxfp4")
    bf16 = make_checkpoint(tmp_path / "bf16", "qwen3-30b-a3b", 1, E, seed, hidden_size=H,
                           intermediate_size=I, progress=False)
    quantize_checkpoint(bf16, tmp_path / "q", "mxfp4", progress=False)
    ck = open_checkpoint(made)
    assert (ck.quant.fmt, ck.quant.group, ck.quant.scale_dtype) == ("mxfp4", 32, "e8m0")
    made_tensors, quantized_tensors = _tensors(made)[0], _tensors(tmp_path / "q")[0]
    assert made_tensors.keys() == quantized_tensors.keys()
    assert all(np.array_equal(made_tensors[n].view(np.uint8), quantized_tensors[n].view(np.uint8))
               for n in made_tensors)


def test_fused_experts_quantized_expert_by_expert(tmp_path, rng):
    src = make_checkpoint(tmp_path / "src", "qwen3-30b-a3b", 1, E, int(rng.integers(1 << 31)),
                          hidden_size=H, intermediate_size=I, progress=False, fused=True)
    out = tmp_path / "q"
    quantize_checkpoint(src, out, "int4", 64, "fp16", progress=False)
    before, _ = _tensors(src)
    after, _ = _tensors(out)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert after[name].shape == (E, 2 * I, H // 2)
    assert after[name + ".weight_scale"].shape == (E, 2 * I, H // 64)
    ck = open_checkpoint(out)
    for e in range(E):
        for kind, rows in (("gate", slice(0, I)), ("up", slice(I, 2 * I))):
            expected = q.quantize(before[name][e, rows], "int4", 64, "fp16")
            assert np.array_equal(after[name][e, rows], expected.q)
            assert np.array_equal(after[name + ".weight_scale"][e, rows], expected.scales)
            m = ck.layers[0].matrices[kind][e]
            assert (m.rows, m.cols, m.quant, m.nbytes) == (I, H, "int4", I * H // 2)
            assert (m.scales.rows, m.scales.cols) == (I, H // 64)


def test_cli_prints_bytes_and_refuses_a_non_empty_output(source, tmp_path):
    out = tmp_path / "q"
    result = CliRunner().invoke(cli, ["quantize", str(source), "--format", "int8", "-o", str(out),
                                      "--quiet"])
    assert result.exit_code == 0, result.output
    assert "bytes before" in result.output and "after" in result.output
    before = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    after = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert f"bytes before {before} " in result.output and f"after {after} " in result.output
    snapshot = {p.name: p.read_bytes() for p in out.iterdir()}
    result = CliRunner().invoke(cli, ["quantize", str(source), "--format", "int4", "--group", "32",
                                      "-o", str(out), "--quiet"])
    assert result.exit_code == 1 and "not empty" in result.output and "--overwrite" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == snapshot
    result = CliRunner().invoke(cli, ["quantize", str(source), "--format", "int4", "--group", "32",
                                      "-o", str(out), "--quiet", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert open_checkpoint(out).quant.fmt == "int4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "src"]  # no temporary left


def _one_line_error(args):
    result = CliRunner().invoke(cli, ["quantize", *args, "--quiet"])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def test_refuses_a_group_that_does_not_divide_cols(tmp_path, rng):
    src = make_checkpoint(tmp_path / "src", "qwen3-30b-a3b", 1, 2, int(rng.integers(1 << 31)),
                          hidden_size=H, intermediate_size=96, progress=False)
    line = _one_line_error([str(src), "--format", "int8", "--group", "64", "-o", str(tmp_path / "q")])
    assert "group 64 does not divide the 96 columns of the down matrices" in line
    assert not (tmp_path / "q").exists()


def test_refuses_odd_cols_for_int4(tmp_path, rng):
    src = make_checkpoint(tmp_path / "src", "qwen3-30b-a3b", 1, 2, int(rng.integers(1 << 31)),
                          hidden_size=H, intermediate_size=33, progress=False)
    with pytest.raises(ValueError, match="33 columns, an odd count"):
        quantize_checkpoint(src, tmp_path / "q", "int4", 32, progress=False)
    line = _one_line_error([str(src), "--format", "int4", "--group", "32", "-o", str(tmp_path / "q")])
    assert "odd count" in line


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_refuses_nan_inf_weights_and_leaves_output_as_it_was(source, tmp_path, bad):
    out = tmp_path / "q"
    quantize_checkpoint(source, out, "int8", progress=False)
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    ck = open_checkpoint(source)
    victim = ck.layers[1].matrices["down"][E - 1]  # late in the write: earlier shards done
    with open(victim.tensor.path, "r+b") as f:
        f.seek(victim.file_offset + 2 * 7)
        f.write(np.array([bad], dtype=ml_dtypes.bfloat16).tobytes())
    line = _one_line_error([str(source), "--format", "int8", "-o", str(out), "--overwrite"])
    assert victim.tensor.name in line and "NaN or infinity" in line
    # untouched: built aside, never swapped
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q", "src"]


def test_refuses_an_already_quantized_checkpoint(source, tmp_path):
    quantize_checkpoint(source, tmp_path / "q", "int8", progress=False)
    line = _one_line_error([str(tmp_path / "q"), "--format", "int4", "-o", str(tmp_path / "q2")])
    assert "already quantized (int8, group 128, fp16 scales)" in line
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "q3", "int8", progress=False)


def test_refuses_writing_into_the_source(source):
    with pytest.raises(ValueError, match="source checkpoint"):
        quantize_checkpoint(source, source, "int8", progress=False, overwrite=True)


def test_make_checkpoint_format(tmp_path, rng):
    """make-checkpoint --format int8/int4 = make-checkpoint then quantize."""
    seed = int(rng.integers(1 << 31))
    result = CliRunner().invoke(cli, ["make-checkpoint", "--layers", "1", "--experts", "2",
                                      "--seed", str(seed), "--format", "int4", "--group", "64",
                                      "-o", str(tmp_path / "q"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "int4, group 64, fp16 scales" in result.output
    src = make_checkpoint(tmp_path / "b", "qwen3-30b-a3b", 1, 2, seed, progress=False)
    quantize_checkpoint(src, tmp_path / "ref", "int4", 64, progress=False)
    assert _tensors(tmp_path / "q")[0].keys() == _tensors(tmp_path / "ref")[0].keys()
    for name, value in _tensors(tmp_path / "q")[0].items():
        assert np.array_equal(value.view(np.uint8), _tensors(tmp_path / "ref")[0][name].view(np.uint8))
    assert open_checkpoint(tmp_path / "q").dims.n_experts == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "q", "ref"]
    for kind in KINDS:
        assert open_checkpoint(tmp_path / "q").layers[0].matrices[kind][0].quant == "int4"


def test_other_files_copied_and_what_is_left_out_said(source, tmp_path):
    (source / "tokenizer.json").write_text('{"v": 1}')
    (source / "extra").mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("not the checkpoint's")
    (source / "link.txt").symlink_to(outside)
    result = CliRunner().invoke(cli, ["quantize", str(source), "--format", "int8", "-o",
                                      str(tmp_path / "q"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "not copied: extra/ (a directory)" in result.output
    out = tmp_path / "q"
    assert (out / "tokenizer.json").read_text() == '{"v": 1}'
    # a link is followed wherever it points, as for the shards: its content is copied
    assert not (out / "link.txt").is_symlink()
    assert (out / "link.txt").read_text() == "not the checkpoint's" and not (out / "extra").exists()


def test_single_file_checkpoint_may_write_beside_it(tmp_path, rng):
    src = make_checkpoint(tmp_path / "src", "qwen3-30b-a3b", 1, 2, int(rng.integers(1 << 31)),
                          hidden_size=H, intermediate_size=I, progress=False)
    result = quantize_checkpoint(src / "model.safetensors", src / "q", "int8", progress=False)
    assert sorted(p.name for p in (src / "q").iterdir()) == [".numa-moe-output.json", "config.json",
                                                             "model.safetensors"]
    assert open_checkpoint(src / "q").quant.fmt == "int8" and result.not_copied == ()
    with pytest.raises(ValueError, match="directory of the source checkpoint"):
        quantize_checkpoint(src / "model.safetensors", src, "int8", progress=False, overwrite=True)


def test_tables_of_a_quantized_checkpoint_default_to_its_format(source, tmp_path):
    from numa_moe.placement.segments import SegmentTable

    quantize_checkpoint(source, tmp_path / "q", "int4", 64, "bf16", progress=False)
    result = CliRunner().invoke(cli, ["tables", str(tmp_path / "q"), "--nodes", "2", "-o",
                                      str(tmp_path / "t.json"), "--quiet"])
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "t.json").read_text())
    assert (document["format"], document["group"], document["scale_format"]) == ("int4", 64, "bf16")
    assert SegmentTable.from_dict(document["layers"]["0"]["down"]) == SegmentTable.theoretical(
        E * H, I, "int4", 4096, 2)
    assert SegmentTable.from_dict(document["layers"]["0"]["gate_scales"]) == SegmentTable.theoretical(
        E * I, H // 64, "bf16", 4096, 2)

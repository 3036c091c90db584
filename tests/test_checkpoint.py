"""Reading checkpoints: naming schemes, sharding, config/shape inference, clear errors.

The reference reader is the safetensors library itself (``safetensors.deserialize``,
raw bytes per tensor), independent of numa_moe's header parser and writer.
"""

import json
import re
import shutil

import numpy as np
import pytest
import safetensors

from numa_moe.checkpoints.naming import NamingPattern, parse_kind_map
from numa_moe.checkpoints.safetensors import read_matrix_into, read_safetensors_header
from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.files import CheckpointError
from numa_moe.formats import KINDS
from numa_moe.checkpoints.synthetic import MODEL_SPECS, make_checkpoint
from numa_moe.checkpoints.writer import TensorPlan, write_safetensors

H, I, E, LAYERS = 64, 48, 4, 2


def _make(tmp_path, like, rng, **kwargs):
    kwargs.setdefault("layers", LAYERS)
    kwargs.setdefault("experts", E)
    return make_checkpoint(tmp_path / "ck", like, seed=int(rng.integers(1 << 31)), hidden_size=H,
                           intermediate_size=I, progress=False, **kwargs)


def _reference_tensors(directory):
    """name -> (dtype, shape, raw bytes), read by the safetensors library."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in safetensors.deserialize(path.read_bytes()):
            out[name] = (entry["dtype"], tuple(entry["shape"]), bytes(entry["data"]))
    return out


def _expert_bytes(reference, name, shape_index=None):
    dtype, shape, data = reference[name]
    arr = np.frombuffer(data, dtype=np.uint16).reshape(shape)
    return arr if shape_index is None else arr[shape_index]


NAMES = {
    "mixtral-8x7b": ("model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
                     "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
                     "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight"),
}
for _like in ("qwen3-30b-a3b", "qwen3-235b", "qwen2-57b-a14b", "deepseek-v3"):
    NAMES[_like] = tuple(f"model.layers.{{l}}.mlp.experts.{{e}}.{k}_proj.weight" for k in ("gate", "up", "down"))


# gpt-oss has layouts of its own (tests/test_gpt_oss.py)
@pytest.mark.parametrize("like", sorted(like for like, spec in MODEL_SPECS.items() if spec.naming != "gpt-oss"))
def test_naming_schemes_found_and_bytes_match_library(tmp_path, rng, like):
    directory = _make(tmp_path, like, rng)
    ck = open_checkpoint(directory)
    assert ck.layer_ids == tuple(range(LAYERS))
    d = ck.dims
    assert (d.hidden_size, d.intermediate_size, d.n_experts) == (H, I, E)
    assert d.top_k == min(MODEL_SPECS[like].top_k, E)
    assert d.sources["hidden_size"].startswith("config.json")
    assert ck.naming == (("mixtral",) if like == "mixtral-8x7b" else ("mlp.experts",))
    assert len(ck.router_tensors) == LAYERS
    shared = [t.name for t in ck.shared_tensors]
    if like == "deepseek-v3":
        assert shared and all(".mlp.shared_experts." in n for n in shared)
    elif like == "qwen2-57b-a14b":
        assert any("shared_expert_gate" in n for n in shared) and len(shared) == 4 * LAYERS
    else:
        assert shared == []
    reference = _reference_tensors(directory)
    for layer in ck.layer_ids:
        for e in range(E):
            for kind, pattern in zip(KINDS, NAMES[like]):
                m = ck.layers[layer].matrix(kind, e)
                assert m.tensor.name == pattern.format(l=layer, e=e)
                out = np.full((m.rows, m.cols), 0xFFFF, dtype=np.uint16)  # poisoned
                read_matrix_into(m, out)
                np.testing.assert_array_equal(out, _expert_bytes(reference, m.tensor.name))


@pytest.mark.parametrize("like", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_fused_tensors_split_into_experts(tmp_path, rng, like):
    directory = _make(tmp_path, like, rng, fused=True)
    ck = open_checkpoint(directory)
    assert ck.naming == ("fused",)
    assert (ck.dims.n_experts, ck.dims.intermediate_size, ck.dims.hidden_size) == (E, I, H)
    reference = _reference_tensors(directory)
    for layer in ck.layer_ids:
        gate_up = _expert_bytes(reference, f"model.layers.{layer}.mlp.experts.gate_up_proj")
        down = _expert_bytes(reference, f"model.layers.{layer}.mlp.experts.down_proj")
        assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I)
        for e in range(E):
            expected = {"gate": gate_up[e, :I], "up": gate_up[e, I:], "down": down[e]}
            for kind in KINDS:
                m = ck.layers[layer].matrix(kind, e)
                out = np.full((m.rows, m.cols), 0xFFFF, dtype=np.uint16)
                read_matrix_into(m, out)
                np.testing.assert_array_equal(out, expected[kind])


def test_sharded_equals_single_file(tmp_path, rng):
    seed = int(rng.integers(1 << 31))
    single = make_checkpoint(tmp_path / "one", "qwen3-30b-a3b", 2, E, seed, hidden_size=H,
                             intermediate_size=I, progress=False)
    sharded = make_checkpoint(tmp_path / "many", "qwen3-30b-a3b", 2, E, seed, hidden_size=H,
                              intermediate_size=I, progress=False, max_shard_bytes=40_000)
    assert (sharded / "model.safetensors.index.json").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    a, b = open_checkpoint(single), open_checkpoint(sharded)
    assert len(b.files) > 2 and len(a.files) == 1
    assert set(index["weight_map"]) == set(a.tensors) == set(b.tensors)
    ref_a, ref_b = _reference_tensors(single), _reference_tensors(sharded)
    assert ref_a == ref_b
    # matrices of one layer come from several files
    assert len({m.tensor.path for kind in KINDS for m in b.layers[0].matrices[kind]}) > 1
    # the index file itself can be given as the checkpoint path
    assert open_checkpoint(sharded / "model.safetensors.index.json").dims == b.dims


def test_header_parser_agrees_with_library(tmp_path, rng):
    directory = _make(tmp_path, "deepseek-v3", rng)
    path = directory / "model.safetensors"
    tensors, metadata = read_safetensors_header(path)
    raw = path.read_bytes()
    reference = dict(safetensors.deserialize(raw))
    assert set(tensors) == set(reference)
    for name, info in tensors.items():
        assert info.dtype == reference[name]["dtype"]
        assert list(info.shape) == reference[name]["shape"]
        assert raw[info.file_offset:info.file_offset + info.nbytes] == bytes(reference[name]["data"])


def test_no_config_infers_from_shapes(tmp_path, rng):
    directory = _make(tmp_path, "qwen3-30b-a3b", rng)
    (directory / "config.json").unlink()
    ck = open_checkpoint(directory)
    assert (ck.dims.hidden_size, ck.dims.intermediate_size, ck.dims.n_experts) == (H, I, E)
    assert ck.dims.top_k is None
    assert ck.dims.sources["hidden_size"] == "tensor shapes"
    assert any("inferred" in note for note in ck.notes)


def test_single_file_path(tmp_path, rng):
    directory = _make(tmp_path, "mixtral-8x7b", rng)
    ck = open_checkpoint(directory / "model.safetensors")
    assert ck.dims.n_experts == E and ck.config is not None


# ------------------------------------------------------------------ errors


def test_truncated_file(tmp_path, rng):
    directory = _make(tmp_path, "qwen3-30b-a3b", rng)
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*tensor '.*'.*truncated"):
        open_checkpoint(directory)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        open_checkpoint(directory)
    path.write_bytes(data[:200])  # cut inside the header
    with pytest.raises(CheckpointError, match=r"header length field"):
        open_checkpoint(directory)


def test_corrupted_header(tmp_path, rng):
    directory = _make(tmp_path, "qwen3-30b-a3b", rng)
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted safetensors header"):
        open_checkpoint(directory)


def test_bad_offsets_named(tmp_path):
    plans = [TensorPlan("model.layers.0.mlp.experts.0.gate_proj.weight", (4, 8), np.dtype(np.float32), 8)]
    path = tmp_path / "model.safetensors"
    write_safetensors(path, plans, lambda p: [b"\0" * p.nbytes])
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model.layers.0.mlp.experts.0.gate_proj.weight"]["shape"] = [4, 9]
    text = json.dumps(header, separators=(",", ":")).encode()  # same length as written
    text += b" " * (n - len(text))
    path.write_bytes(raw[:8] + text[:n] + raw[8 + n:])
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight'.*shape \[4, 9\]"):
        read_safetensors_header(path)


def _write_experts(tmp_path, names_shapes, config=None):
    directory = tmp_path / "custom"
    directory.mkdir(exist_ok=True)
    bf16 = np.dtype("bfloat16") if hasattr(np, "bfloat16") else None
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    plans = [TensorPlan(n, s, bf16, s[-1]) for n, s in names_shapes]
    write_safetensors(directory / "model.safetensors", plans, lambda p: [b"\x01" * p.nbytes])
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def _qwen_names(layers=1, experts=E, skip=(), shapes=None):
    out = []
    for layer in range(layers):
        for e in range(experts):
            for kind, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                if (layer, e, kind) in skip:
                    continue
                shape = (shapes or {}).get((layer, e, kind), shape)
                out.append((f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight", shape))
    return out


def test_missing_expert_tensor(tmp_path):
    directory = _write_experts(tmp_path, _qwen_names(skip={(0, 2, "up")}))
    with pytest.raises(CheckpointError, match=r"layer 0: incomplete.*up missing for expert\(s\) 2"):
        open_checkpoint(directory)


def test_config_expert_count_checked(tmp_path):
    directory = _write_experts(tmp_path, _qwen_names(), {"num_experts": E + 2, "hidden_size": H})
    with pytest.raises(CheckpointError, match=rf"missing for expert\(s\) {E}-{E + 1}.*num_experts={E + 2}"):
        open_checkpoint(directory)


def test_config_hidden_size_checked(tmp_path):
    directory = _write_experts(tmp_path, _qwen_names(), {"hidden_size": H + 1})
    with pytest.raises(CheckpointError, match=rf"config.json hidden_size={H + 1}.*hidden size {H}"):
        open_checkpoint(directory)


def test_mismatched_shape_named(tmp_path):
    directory = _write_experts(tmp_path, _qwen_names(shapes={(0, 3, "down"): (H, I + 2)}))
    with pytest.raises(CheckpointError,
                       match=rf"model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight'"
                             rf".*shape \[{H}, {I + 2}\], expected \[{H}, {I}\]"):
        open_checkpoint(directory)


def test_missing_shard_and_missing_tensor_in_shard(tmp_path, rng):
    directory = _make(tmp_path, "qwen3-30b-a3b", rng, max_shard_bytes=40_000)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.mlp.experts.9.up_proj.weight"] = "model-00001-of-00099.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"shard 'model-00001-of-00099.safetensors'.*does not exist"):
        open_checkpoint(directory)
    index["weight_map"]["model.layers.0.mlp.experts.9.up_proj.weight"] = "model-00001-of-" + \
        next(iter(index["weight_map"].values())).split("-of-")[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-\d+\.safetensors: missing tensor "
                                              r"'model\.layers\.0\.mlp\.experts\.9\.up_proj\.weight'"):
        open_checkpoint(directory)


def test_unknown_layout_lists_names_and_pattern_override(tmp_path):
    names = []
    for e in range(E):
        names += [(f"transformer.h.0.moe.expert_{e}.fc_in.weight", (I, H)),
                  (f"transformer.h.0.moe.expert_{e}.fc_gate.weight", (I, H)),
                  (f"transformer.h.0.moe.expert_{e}.fc_out.weight", (H, I))]
    directory = _write_experts(tmp_path, names + [("transformer.wte.weight", (10, H))])
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(directory)
    message = str(info.value)
    assert "no routed-expert tensors recognised" in message
    assert "transformer.h.N.moe.expert_N.fc_in.weight" in message and "x4" in message
    assert "--pattern" in message and "--kinds" in message and "docs/checkpoints.md" in message
    pattern = NamingPattern("custom", r"transformer\.h\.(?P<layer>\d+)\.moe\.expert_(?P<expert>\d+)"
                                      r"\.(?P<kind>fc_in|fc_gate|fc_out)\.weight",
                            parse_kind_map("fc_gate=gate, fc_in=up, fc_out=down"))
    ck = open_checkpoint(directory, pattern=pattern)
    assert ck.naming == ("custom",) and ck.dims.n_experts == E
    assert ck.layers[0].matrix("gate", 1).tensor.name == "transformer.h.0.moe.expert_1.fc_gate.weight"


def test_custom_fused_pattern(tmp_path):
    directory = _write_experts(tmp_path, [("blocks.3.ffn.w_in", (E, 2 * I, H)), ("blocks.3.ffn.w_out", (E, H, I))])
    pattern = NamingPattern("mine", r"blocks\.(?P<layer>\d+)\.ffn\.(?P<kind>w_in|w_out)",
                            {"w_in": "gate_up", "w_out": "down"})
    ck = open_checkpoint(directory, pattern=pattern)
    assert ck.layer_ids == (3,) and ck.layers[3].matrix("up", 2).file_offset == \
        ck.tensors["blocks.3.ffn.w_in"].file_offset + (2 * 2 * I * H + I * H) * 2


def test_bad_patterns_rejected():
    with pytest.raises(CheckpointError, match=r"named groups.*\['layer'\]"):
        NamingPattern("x", r"a\.(?P<kind>\w+)", {"w": "gate"})
    with pytest.raises(CheckpointError, match="kinds must map"):
        NamingPattern("x", r"(?P<layer>\d)\.(?P<kind>\w+)", {"w": "gates"})
    with pytest.raises(CheckpointError, match="not NAME=KIND"):
        parse_kind_map("w1:gate")


def test_read_matrix_into_checks_destination(tmp_path, rng):
    ck = open_checkpoint(_make(tmp_path, "qwen3-30b-a3b", rng))
    m = ck.layers[0].matrix("down", 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        read_matrix_into(m, np.zeros((m.cols, m.rows), dtype=np.uint16).T)
    with pytest.raises(ValueError, match=f"{m.nbytes} bytes"):
        read_matrix_into(m, np.zeros(m.rows * m.cols + 1, dtype=np.uint16))


def test_file_shrunk_after_header_read(tmp_path, rng):
    directory = _make(tmp_path, "qwen3-30b-a3b", rng)
    ck = open_checkpoint(directory)
    m = ck.layers[LAYERS - 1].matrix("down", E - 1)
    with open(m.tensor.path, "r+b") as f:
        f.truncate(m.file_offset + 10)
    with pytest.raises(CheckpointError, match=re.escape(m.tensor.name) + ".*changed since"):
        read_matrix_into(m, np.empty((m.rows, m.cols), dtype=np.uint16))


def test_make_checkpoint_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        make_checkpoint(tmp_path, "llama", progress=False)
    with pytest.raises(ValueError, match=r"experts must be in 1\.\.8"):
        make_checkpoint(tmp_path, "mixtral-8x7b", experts=9, progress=False)


def test_make_checkpoint_replaces_previous_shards(tmp_path, rng):
    directory = _make(tmp_path, "qwen3-30b-a3b", rng, max_shard_bytes=40_000)
    assert len(list(directory.glob("*.safetensors"))) > 1
    _make(tmp_path, "qwen3-30b-a3b", rng)
    assert [p.name for p in directory.glob("*.safetensors")] == ["model.safetensors"]
    assert not (directory / "model.safetensors.index.json").exists()
    shutil.rmtree(directory)


def test_layers_with_different_dtypes_rejected(tmp_path):
    # BF16 and F16 have the same size: loading an F16 layer into the store's bf16 buffers
    # would give silently wrong numbers, so the checkpoint must be refused up front.
    import ml_dtypes

    directory = tmp_path / "mixed"
    directory.mkdir()
    plans = []
    for layer, dtype in ((0, np.dtype(ml_dtypes.bfloat16)), (1, np.dtype(np.float16))):
        for name, shape in _qwen_names(layers=layer + 1)[layer * 3 * E:]:
            plans.append(TensorPlan(name, shape, dtype, shape[-1]))
    write_safetensors(directory / "model.safetensors", plans, lambda p: [b"\x01" * p.nbytes])
    with pytest.raises(CheckpointError, match=r"layer 1.*F16.*layer 0.*BF16"):
        open_checkpoint(directory)


@pytest.mark.parametrize("field,value", [("dtype", ["BF16"]), ("dtype", None), ("shape", "48"),
                                         ("shape", [4, 2.5]), ("shape", [True, 8]),
                                         ("data_offsets", [0, 64.0]), ("data_offsets", {"a": 1})])
def test_malformed_header_fields_named(tmp_path, field, value):
    # odd JSON types in a header entry: a CheckpointError naming the tensor, never a
    # TypeError from deep inside, nor a silently reinterpreted shape ("48" -> [4, 8])
    import ml_dtypes

    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    path = tmp_path / "model.safetensors"
    write_safetensors(path, [TensorPlan(name, (4, 8), np.dtype(ml_dtypes.bfloat16), 8)],
                      lambda p: [b"\0" * p.nbytes])
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header[name][field] = value
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match=re.escape(name)):
        read_safetensors_header(path)


@pytest.mark.parametrize("key,value", [("num_experts", "many"), ("num_experts", 0), ("hidden_size", [H]),
                                       ("num_experts_per_tok", "x"), ("moe_intermediate_size", 1.5)])
def test_bad_config_values_named(tmp_path, key, value):
    directory = _write_experts(tmp_path, _qwen_names(), {key: value})
    with pytest.raises(CheckpointError, match=rf"config\.json.*{key}"):
        open_checkpoint(directory)


def test_overlapping_tensors_refused(tmp_path):
    names = ["model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight"]
    plans = [TensorPlan(name, (4, 8), np.dtype(np.float32), 8) for name in names]
    path = tmp_path / "model.safetensors"
    write_safetensors(path, plans, lambda p: [b"\0" * p.nbytes])
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])  # both claim the same bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])
    with pytest.raises(CheckpointError, match="overlap"):
        read_safetensors_header(path)


def test_index_may_not_name_files_outside_the_checkpoint(tmp_path, rng):
    directory = _make(tmp_path, "qwen3-30b-a3b", rng, max_shard_bytes=40_000)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(directory / next(iter(index["weight_map"].values())), outside)
    index["weight_map"]["model.layers.0.mlp.experts.9.up_proj.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file name inside"):
        open_checkpoint(directory)

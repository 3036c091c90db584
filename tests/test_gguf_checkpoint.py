"""GGUF checkpoints: tiny MoE files written by the ``gguf`` package's own writer, loaded
into an ExpertStore and compared with the package's own dequantization (bit for bit for
Q8_0, Q4_0, MXFP4, Q5_0 (as int8), Q4_1 and Q4_K (as int4-affine) and the float types,
equal values for IQ4_NL and IQ4_XS (as iq4nl); within numa_moe.quant.error_bound for
requantized K-quants),
a MoELayer step against a float64 reference of the dequantized experts, the
commands, and malformed files (one-line errors)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf", reason="the gguf package is a dependency of numa-moe "
                                          "(pyproject.toml); install it with tools/setup.sh")

from gguf import GGMLQuantizationType as T  # noqa: E402

from moe_reference import moe_reference, random_bf16, rel_error  # noqa: E402
from numa_moe import quant as q  # noqa: E402
from numa_moe.checkpoints.dispatch import open_checkpoint  # noqa: E402
from numa_moe.files import CheckpointError  # noqa: E402
from numa_moe.formats import KINDS  # noqa: E402
from numa_moe.layer.store import ExpertStore  # noqa: E402

E, H, I = 4, 256, 512
ARCH = "qwen3moe"
SHAPES = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
RAW_BLOCKS = (*K_QUANTS, T.IQ4_NL, T.IQ4_XS)  # types the package dequantizes but does not quantize


def _random_blocks(rng, qtype, shape):
    """Random raw blocks of a K-quant (the package only dequantizes those) with finite,
    small fp16 super-block scales: d (and dmin) at the positions ggml's block structs
    put them."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    d = (rng.random(len(blocks)) * 0.02 + 0.001).astype(np.float16)
    if qtype == T.IQ4_NL:  # d of either sign (ggml's is the block's extreme over -127), a few 0, then the codes
        d = np.where(rng.random(len(blocks)) < 0.03, 0, d * rng.choice([-1, 1], len(blocks))).astype(np.float16)
    if qtype in (T.IQ4_NL, T.IQ4_XS):  # d, then (IQ4_XS) the sub-block scales and the codes
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    elif qtype == T.Q6_K:  # ql[128] qh[64] scales[16] d
        blocks[:, size - 2:] = d.view(np.uint8).reshape(-1, 2)
    else:  # Q4_K / Q5_K: d, dmin first
        dmin = (rng.random(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    return raw


def write_gguf(path, rng, types, layers=(0, 1), metadata=True, extra=None, shapes=None,
               dense_block=None, shared=False):
    """A tiny MoE GGUF: per MoE block the three fused expert tensors of ``types[kind]``
    (quantized by the package from random normal weights, or random raw K-quant blocks),
    a router, optional shared experts and a dense FFN block."""
    w = gguf.GGUFWriter(str(path), ARCH)
    if metadata:
        w.add_expert_count(E)
        w.add_expert_used_count(2)
        w.add_embedding_length(H)
        w.add_expert_feed_forward_length(I)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    for layer in layers:
        for kind in KINDS:
            shape = (shapes or SHAPES)[kind]
            qtype = types[kind]
            name = f"blk.{layer}.ffn_{kind}_exps.weight"
            if qtype in RAW_BLOCKS or qtype == T.Q8_1:
                w.add_tensor(name, _random_blocks(rng, qtype, shape) if qtype in RAW_BLOCKS else
                             rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 32 * 40),
                                          dtype=np.uint8), raw_dtype=qtype)
                continue
            x = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
            x[:, 0, :64] = 0  # all-zero blocks: ggml stores d = 0 for them
            if qtype == T.F32:
                w.add_tensor(name, x)
            elif qtype == T.F16:
                w.add_tensor(name, x.astype(np.float16))
            else:
                w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", rng.standard_normal((E, H)).astype(np.float32))
        if shared:
            for kind, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                w.add_tensor(f"blk.{layer}.ffn_{kind}_shexp.weight",
                             rng.standard_normal(shape).astype(np.float16))
    if dense_block is not None:
        for kind, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            w.add_tensor(f"blk.{dense_block}.ffn_{kind}.weight", rng.standard_normal(shape).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def package_dequantized(path):
    """name -> float32 [E, rows, cols]: the gguf package's own reader and dequantization."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)
            for t in reader.tensors if "_exps" in t.name}


def store_values(store, layer, kind):
    """The store's buffer of ``kind`` as float32 [E, rows, cols] (dequantized for int8/int4)."""
    values = store.weights(layer, kind)
    if store.quantized:
        full = q.dequantize(q.QuantizedMatrix(store.weight_format, store.group, values,
                                              store.scales(layer, kind)))
    else:
        full = values.astype(np.float32)
    return full.reshape(E, -1, full.shape[1])


def uniform(qtype):
    return dict.fromkeys(KINDS, qtype)


@pytest.mark.parametrize("qtype, loaded", [
    (T.Q8_0, ("int8", 32, "fp16")), (T.Q4_0, ("int4", 32, "fp16")), (T.MXFP4, ("mxfp4", 32, "e8m0")),
    (T.Q5_0, ("int8", 32, "fp16")), (T.Q4_1, ("int4-affine", 32, "fp16")), (T.Q4_K, ("int4-affine", 32, "fp32")),
    (T.BF16, ("bf16", None, None)), (T.F16, ("fp16", None, None)), (T.F32, ("fp32", None, None))],
    ids=lambda v: getattr(v, "name", None))
def test_lossless_types_load_bit_for_bit(tmp_path, rng, qtype, loaded):
    path = write_gguf(tmp_path / "m.gguf", rng, uniform(qtype))
    store = ExpertStore.load(path, progress=False)
    assert (store.weight_format, store.group, store.scale_dtype) == loaded
    assert store.checkpoint.importer.exact(store.checkpoint.importer.default())
    if store.quantized and not q.zero_scales_allowed(store.weight_format):
        # the contract's scales are never 0, also for all-zero blocks
        assert all(np.all(store.scales(layer, k).astype(np.float32) != 0) for layer in (0, 1) for k in KINDS)
    reference = package_dequantized(path)
    for layer in (0, 1):
        for kind in KINDS:
            got = store_values(store, layer, kind)
            want = reference[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert got.shape == want.shape
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (layer, kind)


@pytest.mark.parametrize("fmt, rel_bound", [("int8", 0.01), ("int4", 0.12)])
def test_k_quants_are_requantized_within_the_documented_bound(tmp_path, rng, fmt, rel_bound):
    types = {"gate": T.Q4_K, "up": T.Q5_K, "down": T.Q6_K}
    path = write_gguf(tmp_path / "k.gguf", rng, types, layers=(0,))
    ck = open_checkpoint(path)
    assert ck.source_format == "GGUF Q4_K+Q5_K+Q6_K"
    assert ck.importer.default().fmt == "int8"  # Q6_K has more than 4.5 bits a weight
    store = ExpertStore.load(ck, progress=False, weight_format=fmt)
    assert (store.weight_format, store.group, store.scale_dtype) == (fmt, 32, "fp16")
    reference = package_dequantized(path)
    for kind in KINDS:
        want = reference[f"blk.0.ffn_{kind}_exps.weight"]
        values, scales = store.weights(0, kind), store.scales(0, kind)
        qm = q.QuantizedMatrix(fmt, 32, values, scales)
        flat = want.reshape(-1, want.shape[-1])
        got = q.dequantize(qm)
        assert np.all(np.abs(got - flat) <= q.error_bound(flat, qm) * (1 + 1e-6)), kind
        rel = rel_error(got, flat)
        print(f"{types[kind].name} -> {fmt} g32: relative error {rel:.2e}, max "
              f"{np.abs(got - flat).max() / np.abs(flat).max():.2%} of max |w|")
        assert 0 < rel < rel_bound, kind


@pytest.mark.parametrize("qtype, scale_dtype, bytes_ratio", [(T.IQ4_NL, "fp16", 1.0), (T.IQ4_XS, "fp32", 20 / 17)],
                         ids=lambda v: getattr(v, "name", None))
def test_iq4_types_load_exactly_as_iq4nl(tmp_path, rng, qtype, scale_dtype, bytes_ratio):
    """IQ4_NL and IQ4_XS load by default as iq4nl, the codes re-paired and the scales as
    they are (IQ4_NL: its fp16 d of either sign; IQ4_XS: d * (ls - 32), exact in fp32;
    both with zero scales over non-zero codes, d = 0 or ls = 32, which iq4nl keeps): the
    package's values element for element, at the file's bytes (IQ4_XS: its two-level
    scales flattened, 20 bytes per 32 weights against 17)."""
    path = write_gguf(tmp_path / "iq4.gguf", rng, uniform(qtype), layers=(0,))
    ck = open_checkpoint(path)
    fmt = ck.importer.default()
    assert (fmt.fmt, fmt.group, fmt.scale_dtype) == ("iq4nl", 32, scale_dtype) and ck.importer.exact(fmt)
    assert ck.importer.describe(fmt) == f"GGUF {qtype.name} -> iq4nl, group 32, {scale_dtype} scales (exact)"
    store = ExpertStore.load(ck, progress=False)
    assert (store.weight_format, store.group, store.scale_dtype) == ("iq4nl", 32, scale_dtype)
    reference = package_dequantized(path)
    file_bytes = sum(m.nbytes for m in ck.expert_matrices())
    loaded = sum(store.weights(0, k).nbytes + store.scales(0, k).nbytes for k in KINDS)
    assert loaded == pytest.approx(bytes_ratio * file_bytes)
    zero_blocks = 0
    for kind in KINDS:
        got, want = store_values(store, 0, kind), reference[f"blk.0.ffn_{kind}_exps.weight"]
        np.testing.assert_array_equal(got, want, err_msg=kind)  # equal values (the sign of a zero aside)
        zero_blocks += int(np.sum(store.scales(0, kind).astype(np.float32) == 0))
    assert zero_blocks > 0, "no block with a zero scale: the case is untested"


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.Q8_0, T.BF16, T.F16],
                         ids=lambda t: t.name)
def test_dequantize_in_row_chunks_equals_the_package(tmp_path, rng, monkeypatch, qtype):
    """The importer dequantizes a matrix in chunks of rows with the type's own row
    dequantizer: the package's gguf.quants.dequantize of the same bytes, bit for bit, also
    where the chunks do not divide the rows (7 rows a chunk)."""
    from numa_moe.checkpoints import gguf as gguf_import

    monkeypatch.setattr(gguf_import, "DEQUANTIZE_CHUNK_WEIGHTS", 7 * H)
    path = write_gguf(tmp_path / "m.gguf", rng, uniform(qtype), layers=(0,))
    ck = open_checkpoint(path)
    reference = package_dequantized(path)
    with open(path, "rb") as f:
        for kind in KINDS:
            for e, matrix in enumerate(ck.layers[0].matrices[kind]):
                got = ck.importer.dequantize(matrix, f.fileno())
                want = reference[f"blk.0.ffn_{kind}_exps.weight"][e]
                assert got.dtype == np.float32 and got.shape == want.shape
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (kind, e)


@pytest.mark.parametrize("weight_format", [None, "int4"])
def test_loading_threads_give_the_same_bytes(tmp_path, rng, weight_format):
    """The expert matrices of a kind are converted on several threads, each into its own
    rows: one thread and more threads than experts load the same bytes (exact Q8_0, and the
    K-quants' dequantize-and-requantize path)."""
    path = write_gguf(tmp_path / "mix.gguf", rng, {"gate": T.Q8_0, "up": T.Q4_K, "down": T.Q6_K})
    stores = [ExpertStore.load(path, progress=False, weight_format=weight_format, threads=n) for n in (1, E + 1)]
    for layer in (0, 1):
        for kind in KINDS:
            for buffers in (lambda s: s.weights(layer, kind), lambda s: s.scales(layer, kind)):
                one, many = (buffers(s).view(np.uint8) for s in stores)
                assert np.array_equal(one, many), (layer, kind)
    with pytest.raises(ValueError, match="threads must be > 0"):
        ExpertStore.load(path, progress=False, threads=0)


def test_a_bad_expert_stops_a_threaded_load_with_its_name(tmp_path, rng):
    """A NaN block scale in one expert of a tensor: the load on several threads raises the
    error naming that expert (the other matrices' threads end first; nothing hangs)."""
    path = write_gguf(tmp_path / "q8.gguf", rng, uniform(T.Q8_0), layers=(0,))
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_up_exps.weight")
    block_bytes = gguf.GGML_QUANT_SIZES[T.Q8_0][1]
    expert = 2
    at = int(tensor.data_offset) + (expert * I * (H // 32) + 5) * block_bytes  # expert 2, row 0, block 5
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(np.array([np.nan], np.float16).tobytes())
    with pytest.raises(CheckpointError, match=rf"expert {expert} up, Q8_0\): a NaN or infinite block scale "
                                              r"\(row 0, block 5\)"):
        ExpertStore.load(path, progress=False, threads=E)


def test_requantizing_a_lossless_type_is_reported_as_such(tmp_path, rng):
    path = write_gguf(tmp_path / "q8.gguf", rng, uniform(T.Q8_0), layers=(0,))
    ck = open_checkpoint(path)
    fmt = ck.importer.resolve(path, ck.dims, "int4", None, None)
    assert not ck.importer.exact(fmt)
    assert ck.importer.describe(fmt) == "GGUF Q8_0 -> int4, group 32, fp16 scales (requantized)"
    with pytest.raises(ValueError, match="group 64 does not divide|not one of"):
        ck.importer.resolve(path, ck.dims, "int8", 48, None)


def test_dims_from_metadata_and_what_is_reported_apart(tmp_path, rng):
    path = write_gguf(tmp_path / "m.gguf", rng, uniform(T.Q8_0), layers=(1, 2), dense_block=0, shared=True)
    ck = open_checkpoint(path)
    assert (ck.dims.hidden_size, ck.dims.intermediate_size, ck.dims.n_experts, ck.dims.top_k) == (H, I, E, 2)
    assert ck.dims.sources["n_experts"] == f"GGUF {ARCH}.expert_count"
    assert ck.layer_ids == (1, 2)
    assert sorted(t.name for t in ck.router_tensors) == ["blk.1.ffn_gate_inp.weight", "blk.2.ffn_gate_inp.weight"]
    assert len(ck.shared_tensors) == 6 and all("_shexp" in t.name for t in ck.shared_tensors)
    assert any("dense FFN" in n and "0" in n for n in ck.notes)
    m = ck.layers[2].matrices["down"][3]
    assert (m.rows, m.cols, m.nbytes) == (H, I, H * I // 32 * 34)
    # the expert slices tile their tensor
    info = ck.tensors["blk.2.ffn_down_exps.weight"]
    assert m.file_offset == info.file_offset + 3 * m.nbytes and info.nbytes == E * m.nbytes


@pytest.mark.parametrize("types", [uniform(T.Q8_0), uniform(T.MXFP4), uniform(T.IQ4_NL), uniform(T.IQ4_XS),
                                   uniform(T.Q4_1), uniform(T.Q4_K), {"gate": T.Q4_K, "up": T.Q4_K, "down": T.Q6_K}],
                         ids=["Q8_0", "MXFP4", "IQ4_NL", "IQ4_XS", "Q4_1", "Q4_K", "Q4_K_M"])
def test_moe_layer_step_on_imported_experts(tmp_path, rng, types):
    from numa_moe.layer.moe_layer import MoELayer
    from numa_moe.placement.topology import Topology

    path = write_gguf(tmp_path / "m.gguf", rng, types, layers=(0,))
    store = ExpertStore.load(path, progress=False)
    layer = MoELayer.from_store(store, 0, topology=Topology.virtual(2))
    reference = package_dequantized(path)
    gates, ups, downs = (reference[f"blk.0.ffn_{k}_exps.weight"] for k in KINDS)
    tokens = 5
    x = random_bf16(rng, (tokens, H))
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, weights, out_dtype="float32")
    expected = moe_reference(x, ids, weights, gates, ups, downs)
    # int8 activations (blocks of 32) on top of the int8 weights; requantized K-quants add
    # their own error (< 1% relative, test above)
    exact = all(t in (T.Q8_0, T.MXFP4, T.IQ4_NL, T.IQ4_XS, T.Q4_1, T.Q4_K) for t in types.values())
    assert rel_error(y, expected) < (0.02 if exact else 0.03)


def test_gpt_oss_gguf_experts_take_their_biases_and_clamped_swiglu(tmp_path, rng):
    """A gpt-oss GGUF as llama.cpp's converter writes it: MXFP4 experts (gate and up already
    apart), F32 biases blk.L.ffn_*_exps.bias. The store loads the weights exactly and the
    biases as they are; the layer runs gpt-oss's activation with them, against a float64
    model of the gguf package's dequantized weights (transformers' GptOssExperts formula)."""
    from numa_moe.activation import GPT_OSS
    from numa_moe.layer.moe_layer import MoELayer
    from numa_moe.placement.topology import Topology
    from test_activation import activation64

    path = tmp_path / "gpt-oss.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_embedding_length(H)
    w.add_expert_feed_forward_length(I)
    biases = {}
    for kind in KINDS:
        x = (rng.standard_normal(SHAPES[kind]) / np.sqrt(SHAPES[kind][-1])).astype(np.float32)
        w.add_tensor(f"blk.0.ffn_{kind}_exps.weight", gguf.quants.quantize(x, T.MXFP4), raw_dtype=T.MXFP4)
        biases[kind] = rng.standard_normal((E, SHAPES[kind][1])).astype(np.float32)
        w.add_tensor(f"blk.0.ffn_{kind}_exps.bias", biases[kind])
    w.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((E, H)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    store = ExpertStore.load(path, progress=False)
    assert store.weight_format == "mxfp4" and store.checkpoint.activation == GPT_OSS
    loaded = store.checkpoint.expert_biases(0)
    for e in range(E):
        for kind, bias in zip(KINDS, loaded[e]):
            np.testing.assert_array_equal(bias, biases[kind][e])
    layer = MoELayer.from_store(store, 0, topology=Topology.virtual(2))
    assert layer.activation == GPT_OSS
    reference = package_dequantized(path)
    gates, ups, downs = (reference[f"blk.0.ffn_{k}_exps.weight"].astype(np.float64) for k in KINDS)
    tokens = 5
    x = random_bf16(rng, (tokens, H))
    ids = np.stack([rng.choice(E, 2, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, 2)).astype(np.float32)
    y = layer.forward_numpy(x, ids, weights, out_dtype="float32")
    xf = x.astype(np.float64)
    expected = np.zeros((tokens, H))
    for t in range(tokens):
        for j, e in enumerate(ids[t]):
            act = activation64(gates[e] @ xf[t] + biases["gate"][e], ups[e] @ xf[t] + biases["up"][e], GPT_OSS)
            expected[t] += weights[t, j] * (downs[e] @ act + biases["down"][e])
    assert rel_error(y, expected) < 0.02
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "gpt-oss")
    w.add_expert_count(E)
    w.add_embedding_length(H)
    w.add_expert_feed_forward_length(I)
    for kind in KINDS:
        w.add_tensor(f"blk.0.ffn_{kind}_exps.weight", np.zeros(SHAPES[kind], np.float16))
    w.add_tensor("blk.0.ffn_down_exps.bias", np.zeros((E, I), np.float32))  # I, not H
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"ffn_down_exps.bias'?: expert bias of ggml dims \[512, 4\], "
                                              r"expected \[256, 4\]"):
        open_checkpoint(bad)


def _cli(args):
    from numa_moe_cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def test_tables_and_inspect_take_a_gguf_file(tmp_path, rng):
    path = write_gguf(tmp_path / "m.gguf", rng, {"gate": T.Q4_K, "up": T.Q4_K, "down": T.Q6_K}, layers=(0,))
    out = tmp_path / "t.json"
    result = _cli(["tables", path, "--nodes", 2, "--quiet", "-o", out])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert (doc["format"], doc["group"], doc["scale_format"]) == ("int8", 32, "fp16")
    assert doc["source_format"] == "GGUF Q4_K+Q6_K"
    assert doc["layers"]["0"]["down_scales"]["cols"] == I // 32
    result = _cli(["inspect", path, "--nodes", 2, "--format", "int4", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    conversion = report["conversion"]
    assert conversion["conversion"] == "GGUF Q4_K+Q6_K -> int4, group 32, fp16 scales (requantized)"
    assert not conversion["exact"]
    assert conversion["loaded_bytes"] == 3 * E * I * H // 2 + 3 * E * I * H // 32 * 2
    assert {e["kind"] for e in conversion["errors"]} == set(KINDS)
    assert all(0 < e["rel_fro"] < 0.12 for e in conversion["errors"])
    tensors = {t["name"]: t for t in report["tensors"]}
    assert set(tensors) == {f"blk.0.ffn_{k}_exps.weight" for k in KINDS}
    down = tensors["blk.0.ffn_down_exps.weight"]  # rows of Q6_K blocks, measured as bytes
    assert (down["rows"], down["cols"], down["fmt"]) == (E * H, I // 256 * 210, "Q6_K bytes")
    text = _cli(["inspect", path, "--nodes", 2]).output
    assert "import: GGUF Q4_K+Q6_K -> int8, group 32, fp16 scales (requantized)" in text
    assert "error vs the file's own dequantized values, layer 0 expert 0 down (Q6_K)" in text


def test_tables_and_inspect_show_mxfp4_experts_as_loaded_exactly(tmp_path, rng):
    path = write_gguf(tmp_path / "mx.gguf", rng, uniform(T.MXFP4), layers=(0,))
    out = tmp_path / "t.json"
    result = _cli(["tables", path, "--nodes", 2, "--quiet", "-o", out])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert (doc["format"], doc["group"], doc["scale_format"]) == ("mxfp4", 32, "e8m0")
    assert doc["layers"]["0"]["down_scales"]["fmt"] == "e8m0"
    result = _cli(["inspect", path, "--nodes", 2, "--json"])
    assert result.exit_code == 0, result.output
    conversion = json.loads(result.output)["conversion"]
    assert conversion["conversion"] == "GGUF MXFP4 -> mxfp4, group 32, e8m0 scales (exact)"
    assert conversion["exact"] and all(e["max_abs"] == 0 for e in conversion["errors"])
    # the file's own bytes: 17 per 32 weights, as 16 bytes of values and 1 of scale
    assert conversion["loaded_bytes"] == conversion["file_bytes"] == 3 * E * I * H // 32 * 17
    requantized = json.loads(_cli(["inspect", path, "--nodes", 2, "--json", "--format", "int8"]).output)
    assert requantized["conversion"]["conversion"] == "GGUF MXFP4 -> int8, group 32, fp16 scales (requantized)"
    result = _cli(["inspect", path, "--nodes", 2, "--format", "mxfp4", "--group", 64])
    assert result.exit_code == 1 and "weight_format 'mxfp4' takes group 32 only" in result.output


@pytest.mark.parametrize("qtype, scale_dtype, block_bytes", [(T.Q4_1, "fp16", 20), (T.Q4_K, "fp32", 24)],
                         ids=["Q4_1", "Q4_K"])
def test_tables_and_inspect_show_q4_1_and_q4_k_experts_as_loaded_exactly(tmp_path, rng, qtype, scale_dtype,
                                                                          block_bytes):
    path = write_gguf(tmp_path / "q.gguf", rng, uniform(qtype), layers=(0,))
    out = tmp_path / "t.json"
    result = _cli(["tables", path, "--nodes", 2, "--quiet", "-o", out])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert (doc["format"], doc["group"], doc["scale_format"]) == ("int4-affine", 32, scale_dtype)
    down_scales = doc["layers"]["0"]["down_scales"]
    assert (down_scales["rows"], down_scales["cols"]) == (E * H, 2 * I // 32)  # the scales, then the minimums
    result = _cli(["inspect", path, "--nodes", 2, "--json"])
    assert result.exit_code == 0, result.output
    conversion = json.loads(result.output)["conversion"]
    assert conversion["conversion"] == f"GGUF {qtype.name} -> int4-affine, group 32, {scale_dtype} scales (exact)"
    assert conversion["exact"] and all(e["max_abs"] == 0 for e in conversion["errors"])
    # per 32 weights 16 bytes of codes and a scale and a minimum: Q4_1's own 20, Q4_K's 24 against its 18
    assert conversion["loaded_bytes"] == 3 * E * I * H // 32 * block_bytes
    assert conversion["file_bytes"] == 3 * E * I * H // 32 * (20 if qtype == T.Q4_1 else 18)


def test_run_takes_a_gguf_file(tmp_path, rng):
    path = write_gguf(tmp_path / "m.gguf", rng, {"gate": T.Q4_0, "up": T.Q4_0, "down": T.Q4_0}, layers=(0,))
    out = tmp_path / "report.json"
    result = _cli(["run", path, "--steps", 1, "--tokens", 2, "--json", out])
    assert result.exit_code == 0, result.output
    assert "import: GGUF Q4_0 -> int4, group 32, fp16 scales (exact)" in result.output
    assert "vs torch reference" in result.output and "[ok]" in result.output
    assert json.loads(out.read_text())["weight_format"] == "int4"


def test_run_takes_mxfp4_experts(tmp_path, rng):
    """An MXFP4 GGUF runs on its own bytes; a BF16 one runs --format mxfp4 (quantized while
    loading); both checked by run's step-1 comparison with the torch loop on the same
    (dequantized) weights."""
    path = write_gguf(tmp_path / "mx.gguf", rng, uniform(T.MXFP4), layers=(0,))
    result = _cli(["run", path, "--steps", 1, "--tokens", 3, "--json", tmp_path / "mx.json"])
    assert result.exit_code == 0, result.output
    assert "import: GGUF MXFP4 -> mxfp4, group 32, e8m0 scales (exact)" in result.output
    assert "mxfp4 experts (group 32)" in result.output and "[ok]" in result.output
    assert json.loads((tmp_path / "mx.json").read_text())["weight_format"] == "mxfp4"
    path = write_gguf(tmp_path / "bf.gguf", rng, uniform(T.BF16), layers=(0,))
    result = _cli(["run", path, "--steps", 1, "--format", "bf16", "--format", "mxfp4"])
    assert result.exit_code == 0, result.output
    assert "import: GGUF BF16 -> mxfp4, group 32, e8m0 scales (requantized)" in result.output
    assert result.output.count("[ok]") == 2


def test_quantize_refuses_a_gguf_file_and_points_to_loading_it(tmp_path, rng):
    path = write_gguf(tmp_path / "bf.gguf", rng, uniform(T.BF16), layers=(0,))
    result = _cli(["quantize", path, "--format", "int8", "--group", 32, "-o", tmp_path / "out", "--quiet"])
    assert result.exit_code == 1
    assert "a GGUF BF16 checkpoint; quantize writes safetensors from safetensors" in result.output
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- malformed files


def _one_line_error(path, match):
    with pytest.raises(CheckpointError, match=match) as info:
        open_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def _tensor_field_offset(path, name, part):
    """Byte offset of one part (3: dims, 4: type) of a tensor's info in the file."""
    reader = gguf.GGUFReader(str(path))
    field = next(t.field for t in reader.tensors if t.name == name)
    return field.offset + sum(int(p.nbytes) for p in field.parts[:part])


@pytest.fixture
def good_file(tmp_path, rng):
    return write_gguf(tmp_path / "good.gguf", rng, uniform(T.Q8_0), layers=(0,))


def test_truncated_files(tmp_path, good_file):
    data = good_file.read_bytes()
    reader = gguf.GGUFReader(str(good_file))
    cuts = {"magic": 3, "header": 20, "metadata": 60, "tensor infos": reader.data_offset - 10,
            "tensor data": len(data) - 100}
    for where, cut in cuts.items():
        path = tmp_path / f"cut-{where.replace(' ', '-')}.gguf"
        path.write_bytes(data[:cut])
        _one_line_error(path, "truncated|not a readable GGUF")


def test_unknown_tensor_type(tmp_path, good_file):
    data = bytearray(good_file.read_bytes())
    at = _tensor_field_offset(good_file, "blk.0.ffn_up_exps.weight", 4)
    data[at:at + 4] = (77).to_bytes(4, "little")
    path = tmp_path / "type.gguf"
    path.write_bytes(bytes(data))
    message = _one_line_error(path, "unknown tensor type")
    assert "blk.0.ffn_up_exps.weight" in message and "77" in message


def test_declared_sizes_beyond_the_bytes(tmp_path, good_file):
    data = bytearray(good_file.read_bytes())
    at = _tensor_field_offset(good_file, "blk.0.ffn_down_exps.weight", 3)
    data[at + 16:at + 24] = (1 << 40).to_bytes(8, "little")  # ne[2]: 2**40 experts
    path = tmp_path / "huge.gguf"
    path.write_bytes(bytes(data))
    _one_line_error(path, r"declares \d+ bytes .* file has only")


def test_huge_metadata_array_in_a_truncated_file_ends(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), ARCH)
    w.add_array("tokenizer.ggml.scores", [0.5] * 1000)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = bytearray((tmp_path / "a.gguf").read_bytes())
    length_at = data.index(b"tokenizer.ggml.scores") + len("tokenizer.ggml.scores") + 8
    data[length_at:length_at + 8] = (1 << 60).to_bytes(8, "little")  # 2**60 float32 elements
    path = tmp_path / "long.gguf"
    path.write_bytes(bytes(data))
    _one_line_error(path, "metadata arrays hold more than")
    # a length below the element bound, past the end of the file
    data[length_at:length_at + 8] = (100_000).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    _one_line_error(path, "truncated")


def _header(kv_count, tensor_count=0):
    return b"GGUF" + (3).to_bytes(4, "little") + tensor_count.to_bytes(8, "little") + kv_count.to_bytes(8, "little")


def _string(text):
    return len(text).to_bytes(8, "little") + text.encode()


def test_metadata_beyond_plausible_sizes_is_refused_before_it_costs_memory(tmp_path):
    from numa_moe.checkpoints.gguf import MAX_METADATA_ELEMENTS, MAX_TENSORS

    n = MAX_METADATA_ELEMENTS + 1  # uint8 elements: 4 MB of file, ~1 GB of reader views
    array = (9).to_bytes(4, "little") + (0).to_bytes(4, "little") + n.to_bytes(8, "little") + bytes(n)
    path = tmp_path / "big-array.gguf"
    path.write_bytes(_header(1) + _string("tokenizer.ggml.token_type") + array)
    _one_line_error(path, f"metadata arrays hold more than {MAX_METADATA_ELEMENTS} elements")
    path = tmp_path / "many-tensors.gguf"
    path.write_bytes(_header(0, MAX_TENSORS + 1) + bytes(64))
    _one_line_error(path, f"declares {MAX_TENSORS + 1} tensors")


def test_wrong_expert_dimension_order(tmp_path, rng):
    shapes = {**SHAPES, "gate": (I, E, H)}
    path = write_gguf(tmp_path / "order.gguf", rng, uniform(T.Q8_0), layers=(0,), shapes=shapes)
    message = _one_line_error(path, "wrong expert dimension order")
    assert "blk.0.ffn_gate_exps.weight" in message


def test_missing_metadata(tmp_path, rng):
    path = write_gguf(tmp_path / "meta.gguf", rng, uniform(T.Q8_0), layers=(0,), metadata=False,
                      extra={f"{ARCH}.embedding_length": H})
    _one_line_error(path, f"{ARCH}.expert_count is missing")


def test_type_the_package_cannot_read(tmp_path, rng):
    path = write_gguf(tmp_path / "q81.gguf", rng, {**uniform(T.Q8_0), "down": T.Q8_1}, layers=(0,))
    _one_line_error(path, "ggml type Q8_1 cannot be read: gguf .* has no dequantization for it; "
                          "supported expert types: BF16, F16, F32, Q8_0, Q4_0, MXFP4, .*Q4_K")


def test_not_a_gguf_file_and_a_pattern(tmp_path, good_file):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUX" + bytes(100))
    _one_line_error(path, "not a readable GGUF file")
    with pytest.raises(CheckpointError, match="naming pattern applies to safetensors"):
        from numa_moe.checkpoints.naming import NamingPattern

        open_checkpoint(good_file, pattern=NamingPattern("p", r"(?P<layer>\d+)(?P<kind>x)", {"x": "gate"}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_headers_give_checkpoint_errors_only(tmp_path_factory, data):
    """Random byte changes in the header, metadata and tensor list of a good file, or a
    cut anywhere: the file opens, or the error is a one-line CheckpointError."""
    path = _fuzz_source(tmp_path_factory)
    raw = bytearray(path.read_bytes())
    header_bytes = gguf.GGUFReader(str(path)).data_offset
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header_bytes - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))))
    bad = tmp_path_factory.mktemp("fuzz") / "f.gguf"
    bad.write_bytes(bytes(raw[:cut]))
    try:
        open_checkpoint(bad)
    except CheckpointError as err:
        assert "\n" not in str(err)


_FUZZ_SOURCE = {}


def _fuzz_source(factory):
    if "path" not in _FUZZ_SOURCE:
        rng = np.random.default_rng(7)
        _FUZZ_SOURCE["path"] = write_gguf(factory.mktemp("src") / "src.gguf", rng,
                                          {"gate": T.Q8_0, "up": T.Q4_0, "down": T.Q4_K}, layers=(0,))
    return _FUZZ_SOURCE["path"]

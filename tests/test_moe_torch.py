"""MoELayer over torch tensors and as the custom op numa_moe::moe_forward, against the
MoE loop the way transformers writes it (float32 on the same bf16 weights)."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from moe_reference import random_partition_table, rel_error  # noqa: E402
from numa_moe.layer.moe_layer import MoELayer  # noqa: E402

CPUS = sorted(os.sched_getaffinity(0))
H, I, E = 128, 64, 5


def transformers_moe_loop(x, ids, w, gate_up, down):
    """Mixtral/Qwen3-MoE experts loop (one_hot mask, torch.where, index_add_), float32."""
    final = torch.zeros(x.shape, dtype=torch.float32)
    mask = F.one_hot(ids, num_classes=gate_up.shape[0]).permute(2, 1, 0)
    for e in range(gate_up.shape[0]):
        idx, top_x = torch.where(mask[e])
        if top_x.numel() == 0:
            continue
        gate, up = F.linear(x[top_x].float(), gate_up[e].float()).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, down[e].float()) * w[top_x, idx, None].float()
        final.index_add_(0, top_x, out)
    return final


def make(rng, n_nodes=2):
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(torch.bfloat16)
    nodes = tuple(range(n_nodes))
    experts = [(gate_up[e, :I], gate_up[e, I:], down[e]) for e in range(E)]
    tables = [{k: random_partition_table(*m.shape, nodes, rng) for k, m in zip(("gate", "up", "down"), ex)}
              for ex in experts]
    layer = MoELayer(experts, tables, node_cpus=(nodes, [[CPUS[n % len(CPUS)]] for n in nodes]))
    return layer, gate_up, down


def routing(rng, T, k):
    ids = torch.from_numpy(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]))
    w = torch.softmax(torch.from_numpy(rng.standard_normal((T, k))).float(), dim=-1)
    return ids, w


def test_forward_on_torch_tensors_matches_transformers_loop(rng):
    layer, gate_up, down = make(rng)
    x = torch.from_numpy(rng.standard_normal((6, H))).to(torch.bfloat16)
    ids, w = routing(rng, 6, 2)
    y = layer(x, ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == (6, H)
    assert rel_error(y.float().numpy(), transformers_moe_loop(x, ids, w, gate_up, down).numpy()) < 1e-2
    # int32 ids and bf16 weights are accepted (converted)
    # routing given as numpy arrays or lists with torch hidden states: same result
    assert torch.equal(layer(x, ids.numpy(), w.numpy()), y)
    assert torch.equal(layer(x, ids.tolist(), w.tolist()), y)
    y2 = layer(x, ids.to(torch.int32), w.to(torch.bfloat16))
    assert rel_error(y2.float().numpy(), transformers_moe_loop(x, ids, w.to(torch.bfloat16), gate_up, down).numpy()) < 1e-2


def test_torch_inputs_that_need_converting_give_the_direct_path_result(rng):
    """Eager torch input already in the native dtypes (bf16 hidden, int64 ids, float32
    weights, contiguous, no autograd) goes to the native layer without conversions;
    anything else is converted first: the same bits either way."""
    layer, gate_up, down = make(rng)
    x = torch.from_numpy(rng.standard_normal((5, H))).to(torch.bfloat16)
    ids, w = routing(rng, 5, 2)
    direct = layer(x, ids, w)
    assert rel_error(direct.float().numpy(), transformers_moe_loop(x, ids, w, gate_up, down).numpy()) < 1e-2
    converted = ((x.clone().requires_grad_(True), ids, w), (x, ids.t().contiguous().t(), w),
                 (x, ids, w.t().contiguous().t()), (x, ids, w.clone().requires_grad_(True)), (x, ids, w.double()))
    for args in converted:
        assert not args[1].is_contiguous() or not args[2].is_contiguous() or any(a.requires_grad for a in args) \
            or args[2].dtype != torch.float32
        assert torch.equal(layer(*args).view(torch.int16), direct.view(torch.int16))


def test_duplicate_ids_follow_the_transformers_loop(rng):
    layer, gate_up, down = make(rng, 3)
    x = torch.from_numpy(rng.standard_normal((4, H))).to(torch.bfloat16)
    ids = torch.tensor([[1, 1], [2, 2], [0, 1], [4, 4]])
    w = torch.rand(4, 2)
    y = layer(x, ids, w)
    assert rel_error(y.float().numpy(), transformers_moe_loop(x, ids, w, gate_up, down).numpy()) < 1e-2


def test_custom_op_is_registered_and_passes_opcheck(rng):
    layer, gate_up, down = make(rng)
    x = torch.from_numpy(rng.standard_normal((3, H))).to(torch.bfloat16)
    ids, w = routing(rng, 3, 2)
    y = torch.ops.numa_moe.moe_forward(x, ids, w, layer.layer_id)
    assert rel_error(y.float().numpy(), transformers_moe_loop(x, ids, w, gate_up, down).numpy()) < 1e-2
    torch.library.opcheck(torch.ops.numa_moe.moe_forward.default, (x, ids, w, layer.layer_id),
                          test_utils=("test_schema", "test_faketensor"))


def test_composes_with_torch_compile(rng):
    layer, gate_up, down = make(rng)
    x = torch.from_numpy(rng.standard_normal((2, H))).to(torch.bfloat16)
    ids, w = routing(rng, 2, 2)

    def block(x, ids, w):
        return x + layer(x, ids, w)

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    expected = x.float() + transformers_moe_loop(x, ids, w, gate_up, down)
    assert rel_error(compiled(x, ids, w).float().numpy(), expected.numpy()) < 1e-2


def test_torch_input_errors(rng):
    layer, _, _ = make(rng)
    x = torch.from_numpy(rng.standard_normal((3, H))).to(torch.bfloat16)
    ids, w = routing(rng, 3, 2)
    with pytest.raises(TypeError, match="bfloat16"):
        layer(x.float(), ids, w)
    with pytest.raises(TypeError, match="integer"):
        layer(x, ids.float(), w)
    for dtype in (torch.complex64, torch.complex128, torch.bool):
        with pytest.raises(TypeError, match="integer"):
            layer(x, ids.to(dtype), w)
    with pytest.raises(ValueError, match="out of range"):
        layer(x, ids + E, w)
    with pytest.raises(ValueError, match="contiguous"):
        layer(torch.empty(H, 3, dtype=torch.bfloat16).t(), ids, w)


def test_inputs_on_other_devices_are_rejected(rng):
    # A meta tensor among the inputs used to send the op to its fake implementation,
    # which returned an uninitialised CPU tensor as the result.
    layer, _, _ = make(rng)
    x = torch.from_numpy(rng.standard_normal((3, H))).to(torch.bfloat16)
    ids, w = routing(rng, 3, 2)
    with pytest.raises(ValueError, match="topk_ids.*device meta"):
        layer(x, ids.to("meta"), w)
    with pytest.raises(ValueError, match="topk_weights.*device meta"):
        layer(x, ids, w.to("meta"))
    with pytest.raises(ValueError, match="topk_ids.*device meta"):
        torch.ops.numa_moe.moe_forward(x, ids.to("meta"), w, layer.layer_id)


def test_no_tokens_and_no_experts_per_token(rng):
    layer, gate_up, down = make(rng)
    x = torch.from_numpy(rng.standard_normal((4, H))).to(torch.bfloat16)
    ids, w = routing(rng, 4, 2)
    y = layer(x[:0], ids[:0], w[:0])
    assert y.shape == (0, H) and y.dtype == torch.bfloat16
    y = layer.forward_numpy(x[:0].view(torch.int16).numpy(), ids[:0].numpy(), w[:0].numpy())
    assert y.shape == (0, H)
    # k = 0: no expert contributes, the output is exactly zero
    y = layer(x, ids[:, :0], w[:, :0])
    assert y.shape == (4, H) and torch.equal(y.float(), torch.zeros(4, H))


def test_torch_path_takes_the_same_out_dtype_as_the_numpy_path(rng):
    layer, _, _ = make(rng)
    x = torch.from_numpy(rng.standard_normal((5, H))).to(torch.bfloat16)
    ids, w = routing(rng, 5, 2)
    x_np = x.view(torch.int16).numpy().view(np.uint16)
    for out_dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        y = layer.forward_torch(x, ids, w, out_dtype=out_dtype)
        assert y.dtype == torch_dtype
        y_np = layer.forward_numpy(x_np, ids.numpy(), w.numpy(), out_dtype=out_dtype)
        np.testing.assert_array_equal(y.view(torch.int16 if out_dtype == "bfloat16" else torch.int32).numpy(),
                                      y_np.view(np.int16 if out_dtype == "bfloat16" else np.int32))
    with pytest.raises(ValueError, match="out_dtype must be 'bfloat16' or 'float32', got 'fp16'"):
        layer.forward_torch(x, ids, w, out_dtype="fp16")

"""patch_moe on tiny random-initialised Mixtral and Qwen3-MoE models built from small
configs with the real module structure: same logits with and without the patch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'hf')")

from numa_moe.integrations.hf import find_expert_modules, patch_moe, unpatch_moe  # noqa: E402
from numa_moe.placement.topology import Topology  # noqa: E402


# Whole-model logits are compared on models whose only MoE block is the first one: a
# router after a patched block sees inputs that differ by bf16 rounding and may pick
# another expert on a near-tie, which is a legitimate, large logit change. Several MoE
# blocks are checked block by block (test_every_block_matches_its_original).
def qwen3_moe(seed, layers=2, mlp_only=(1,)):
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=list(mlp_only), max_position_embeddings=64, norm_topk_prob=True)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config)


def mixtral(seed, layers=1):
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config)


def prepare(model):
    model = model.to(torch.bfloat16).eval()
    # larger expert weights than the 0.02 init, so the experts move the logits visibly
    with torch.no_grad():
        for _, experts in find_expert_modules(model):
            H = experts.gate_up_proj.shape[-1]
            I = experts.down_proj.shape[-1]
            experts.gate_up_proj.normal_(0, H ** -0.5)
            experts.down_proj.normal_(0, I ** -0.5)
    return model


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("build,n_nodes", [(qwen3_moe, 1), (qwen3_moe, 3), (mixtral, 2)])
def test_patched_model_gives_the_same_logits(rng, build, n_nodes):
    model = prepare(build(int(rng.integers(1 << 30))))
    ids = torch.from_numpy(rng.integers(0, 96, (2, 7)))
    with torch.no_grad():
        expected = model(ids).logits.float()
        state_keys = sorted(model.state_dict())
        layers = patch_moe(model, topology=Topology.virtual(n_nodes))
        assert len(layers) == 1 and all(layer.pool.n_nodes == n_nodes for layer in layers)
        patched = model(ids).logits.float()
        assert sorted(model.state_dict()) == state_keys  # module tree untouched
        # the patch ran: every layer saw the 14 tokens
        assert all(layer.last_stats()["n_slots"] >= 14 for layer in layers)
        assert unpatch_moe(model) == 1
        # sensitivity: zeroing the experts moves the logits far more than the patch does
        for _, experts in find_expert_modules(model):
            experts.down_proj.zero_()
        no_experts = model(ids).logits.float()
    err = rel(patched, expected)
    assert err < 3e-2, err  # bf16 model: the torch loop rounds to bf16 at every step
    assert rel(no_experts, expected) > 10 * err


@pytest.mark.parametrize("build", [qwen3_moe, mixtral])
def test_every_block_matches_its_original(rng, build):
    model = prepare(build(int(rng.integers(1 << 30)), layers=3, **({"mlp_only": ()} if build is qwen3_moe else {})))
    blocks = [experts for _, experts in find_expert_modules(model)]
    assert len(blocks) == 3
    E = blocks[0].gate_up_proj.shape[0]
    x = torch.from_numpy(rng.standard_normal((9, 64))).to(torch.bfloat16)
    ids = torch.from_numpy(np.stack([rng.choice(E, 2, replace=False) for _ in range(9)]))
    w = torch.from_numpy(rng.random((9, 2))).float()
    with torch.no_grad():
        expected = [b(x, ids, w).float() for b in blocks]
        patch_moe(model, topology=Topology.virtual(2))
        got = [b(x, ids, w).float() for b in blocks]
    for a, b in zip(got, expected):
        assert rel(a, b) < 1e-2


def test_patch_moe_rejects_models_without_supported_blocks():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no supported MoE experts module"):
        patch_moe(model)


def test_release_weights_then_unpatch_is_refused(rng):
    # after release_weights=True the original forward has no weights left to run on: the
    # unpatched model would fail deep inside F.linear or return nonsense
    model = prepare(mixtral(int(rng.integers(1 << 30))))
    ids = torch.from_numpy(rng.integers(0, 96, (1, 5)))
    with torch.no_grad():
        expected = model(ids).logits.float()
        patch_moe(model, topology=Topology.virtual(1), release_weights=True)
        assert rel(model(ids).logits.float(), expected) < 3e-2
        with pytest.raises(ValueError, match="release_weights"):
            unpatch_moe(model)
        assert rel(model(ids).logits.float(), expected) < 3e-2  # still patched, still right


@pytest.mark.parametrize("build", [qwen3_moe, mixtral])
@pytest.mark.parametrize("fmt,max_error", [("int8", 0.05), ("int4", 0.35), ("mxfp4", 0.35)])
def test_quantized_patch_keeps_the_logits_within_the_scheme(rng, build, fmt, max_error):
    """INT8 / INT4 (group 32) and MXFP4 experts against the BF16 model: relative logit error and
    top-1 agreement over a prompt, printed (docs/quantization.md quotes them) and bounded
    by what the scheme allows on these tiny random models, not tighter."""
    model = prepare(build(int(rng.integers(1 << 30))))
    ids = torch.from_numpy(rng.integers(0, 96, (2, 16)))
    with torch.no_grad():
        expected = model(ids).logits.float()
        layers = patch_moe(model, weight_format=fmt, tables="theoretical", **({} if fmt == "mxfp4" else {"group": 32}))
        got = model(ids).logits.float()
    assert all(layer.weight_format == fmt for layer in layers)
    error = rel(got, expected)
    top1 = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
    print(f"{build.__name__} {fmt}: relative logit error {error:.4f}, top-1 agreement {top1:.3f}")
    assert 0 < error < max_error
    assert top1 >= (0.8 if fmt == "int8" else 0.4)

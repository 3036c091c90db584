"""patch_moe on a tiny random transformers GptOssForCausalLM (float32): its experts run in
numa-moe (gate / up de-interleaved, biases, the clamped SwiGLU) with the same logits and
greedy tokens as transformers' own GptOssExperts; numa-moe generate on a gpt-oss shape."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'hf')")

from numa_moe import quant  # noqa: E402
from numa_moe.integrations.hf import find_expert_modules, patch_moe, unpatch_moe  # noqa: E402
from numa_moe.placement.topology import Topology  # noqa: E402

VOCAB = 96


def gpt_oss(seed: int, top_k: int, layers: int = 2):
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=top_k,
        max_position_embeddings=64, sliding_window=8)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
        for _, experts in find_expert_modules(model):
            # gate / up pre-activations of a few units, so that both clamps (7) are reached
            experts.gate_up_proj.mul_(4.0)
            experts.gate_up_proj_bias.normal_(0.0, 1.0)
            experts.down_proj_bias.normal_(0.0, 0.5)
        for layer in model.model.layers:
            # router logits well apart, so that greedy decoding does not meet a near-tie
            # in the routing (test_greedy_tokens_equal)
            layer.mlp.router.weight.mul_(8.0)
    return model


def round_experts(model, fmt: str) -> None:
    """Expert weights replaced by values the numa-moe layer holds exactly: bf16 numbers, or
    MXFP4 ones (quantized per row of the store's layout, dequantized)."""
    with torch.no_grad():
        for _, experts in find_expert_modules(model):
            for param in (experts.gate_up_proj, experts.down_proj):
                w = param.data
                if fmt == "bf16":
                    param.copy_(w.to(torch.bfloat16).float())
                    continue
                rows = w.transpose(1, 2)  # [E, out, in]: the store's row-major matrices
                exact = np.stack([quant.dequantize(quant.quantize(r.numpy(), "mxfp4")) for r in rows])
                param.copy_(torch.from_numpy(exact).transpose(1, 2))


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


class RouterReplay:
    """Records every router's outputs, call after call, then, once ``replay`` is set, hands
    them back in the same order (one forward, or every step of a generate): a block of a
    patched model sees inputs that differ by the earlier blocks' rounding, and its router
    could pick another expert on a near-tie, a legitimate, large logit change that says
    nothing about the experts."""

    def __init__(self, model):
        self.routers = [layer.mlp.router for layer in model.model.layers]
        self.outputs = [[] for _ in self.routers]
        self.replayed = [0] * len(self.routers)
        self.replay = False
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i):
        def hook(module, args, output):
            if not self.replay:
                self.outputs[i].append(output)
                return None
            call = self.replayed[i]
            self.replayed[i] += 1
            return self.outputs[i][call] if call < len(self.outputs[i]) else None
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("fmt,top_k,n_nodes", [("bf16", 2, 1), ("bf16", 4, 2), ("mxfp4", 3, 1), ("mxfp4", 4, 3)])
def test_patched_gpt_oss_gives_the_same_logits(rng, fmt, top_k, n_nodes):
    model = gpt_oss(int(rng.integers(1 << 30)), top_k)
    round_experts(model, fmt)
    ids = torch.from_numpy(rng.integers(0, VOCAB, (2, 7)))
    replay = RouterReplay(model)
    with torch.no_grad():
        expected = model(ids).logits
        layers = patch_moe(model, topology=Topology.virtual(n_nodes), weight_format=fmt)
        assert len(layers) == 2
        replay.replay = True
        patched = model(ids).logits
        assert all(layer.last_stats()["n_slots"] >= 14 * top_k for layer in layers)
        assert unpatch_moe(model) == 2
        # sensitivity: without the biases the logits move far more than the patch moves them
        for _, experts in find_expert_modules(model):
            experts.gate_up_proj_bias.zero_()
            experts.down_proj_bias.zero_()
        no_bias = model(ids).logits
    replay.remove()
    err = rel(patched, expected)
    # the weights are exactly the model's; the layer rounds activations to bf16 (bf16
    # experts) or quantizes them per group of 32 to int8 (mxfp4 experts), in each of the
    # two layers (errors about 0.6% and 1.5-3% on these models)
    assert err < (1e-2 if fmt == "bf16" else 5e-2), err
    assert rel(no_bias, expected) > 10 * err


def test_gate_and_up_are_de_interleaved(rng):
    """Swapping gate and up columns changes the patched block's output as it changes
    transformers' (the patch reads the interleave, not the first half as gate)."""
    model = gpt_oss(int(rng.integers(1 << 30)), 2, layers=1)
    round_experts(model, "bf16")
    experts = find_expert_modules(model)[0][1]
    hidden = torch.from_numpy(rng.standard_normal((9, 64)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(0, 8, (9, 2)))
    weights = torch.softmax(torch.from_numpy(rng.standard_normal((9, 2)).astype(np.float32)), dim=1)
    with torch.no_grad():
        expected = experts(hidden, ids, weights)
        patch_moe(model, topology=Topology.virtual(1))
        got = experts(hidden, router_indices=ids, routing_weights=weights)
        unpatch_moe(model)
        E, H, two_i = experts.gate_up_proj.shape
        halves = experts.gate_up_proj.view(E, H, two_i // 2, 2)
        experts.gate_up_proj.copy_(torch.cat([halves[..., 0], halves[..., 1]], dim=-1))  # gate first
        not_interleaved = experts(hidden, ids, weights)
    assert rel(got, expected) < 1e-2
    assert rel(not_interleaved, expected) > 0.1


def test_greedy_tokens_equal(rng):
    """Greedy tokens of the patched model are the unpatched model's, up to the first
    step whose top two logits lie closer than the patch moves the logits (the layer
    rounds activations to bf16): there the two may part, and nowhere before. The routers'
    choices of the unpatched run are replayed (RouterReplay): a near-tie in a router
    flips an expert, which moved one seed's logits by 7% at its ninth step."""
    model = gpt_oss(int(rng.integers(1 << 30)), 4)
    round_experts(model, "bf16")
    prompt = torch.from_numpy(rng.integers(0, VOCAB, (1, 6)))
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    replay = RouterReplay(model)
    with torch.no_grad():
        base = model.generate(prompt, **kwargs)
        patch_moe(model, topology=Topology.virtual(2))
        replay.replay = True
        patched = model.generate(prompt, **kwargs)
    replay.remove()
    base_tokens, tokens = base.sequences[0, 6:].tolist(), patched.sequences[0, 6:].tolist()
    same = next((i for i, (a, b) in enumerate(zip(base_tokens, tokens)) if a != b), len(tokens))
    for step in range(min(same + 1, len(tokens))):  # the prefixes agree: these logits compare
        assert rel(patched.logits[step], base.logits[step]) < 5e-2, step  # one token: 0.5-2.5% here
    if same < len(tokens):
        top2 = torch.topk(base.logits[same][0], 2).values
        moved = float((patched.logits[same] - base.logits[same]).abs().max())
        assert float(top2[0] - top2[1]) <= 2 * moved, (same, base_tokens, tokens)


def test_generate_on_a_tiny_gpt_oss_shape():
    from numa_moe.apps.generate import run_generate

    report = run_generate("gpt-oss-20b", layers=2, tokens=4, experts=4, vocab=64, prompt_tokens=5, seed=3,
                          echo=lambda *_: None, hidden_size=64, intermediate_size=64, head_dim=16,
                          num_attention_heads=4, num_key_value_heads=2)
    assert report.baseline_attention == "eager" and report.experts == 4
    assert report.identical, report


def test_generate_refuses_sdpa_for_gpt_oss():
    from numa_moe.apps.generate import run_generate

    with pytest.raises(ValueError, match="eager only"):
        run_generate("gpt-oss-20b", layers=1, tokens=1, baseline_attention="sdpa", echo=lambda *_: None)

"""The "numa_moe" attention implementation in transformers: selected through the
AttentionInterface registry, decode steps run gqa_decode, everything else SDPA; greedy
tokens of tiny Qwen3-MoE and Mixtral models agree with the unpatched model."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'hf')")

from numa_moe.apps.generate import build_model, format_report, run_generate  # noqa: E402
from numa_moe.integrations import hf_attention  # noqa: E402

TINY = dict(hidden_size=128, moe_intermediate_size=64, intermediate_size=128, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64)


@pytest.fixture
def decode_calls():
    hf_attention.timings = {}
    yield hf_attention.timings
    hf_attention.timings = None


def greedy(model, prompt, n):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def test_registry_selects_it_and_decode_steps_run_ours(decode_calls):
    model = build_model("qwen3-30b-a3b", layers=2, experts=4, vocab=128, seed=3, **TINY)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    expected = greedy(model, prompt, 20)
    hf_attention.use_numa_attention(model)
    assert model.config._attn_implementation == "numa_moe"
    assert greedy(model, prompt, 20).tolist() == expected.tolist()
    # 19 decode steps (the first new token comes from the prefill) x 2 layers
    assert decode_calls["attention_calls"] == 19 * 2


def near_tie(report) -> bool:
    """The baseline's top two logits at the first divergence are within 2% of the top
    one: a flip that bf16 rounding of either run can cause."""
    return report.divergence_top2_gap <= 0.02 * max(1.0, abs(report.divergence_top1))


@pytest.mark.parametrize("like", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_generate_agrees_with_the_unpatched_model(like):
    lines = []
    report = run_generate(like, layers=2, tokens=16, experts=4, vocab=128, prompt_tokens=5, seed=5,
                          echo=lines.append, **TINY)
    assert report.baseline_tokens_per_s > 0 and report.patched_tokens_per_s > 0
    assert sum(report.shares.values()) == pytest.approx(1.0, abs=1e-6)
    assert report.shares["attention"] > 0 and report.shares["experts"] > 0
    assert report.identical or near_tie(report), format_report(report)
    assert "tokens/s" in format_report(report)


def test_prefill_and_unsupported_shapes_fall_back_to_sdpa(decode_calls):
    model = build_model("qwen3-30b-a3b", layers=1, experts=2, vocab=64, seed=0, **{**TINY, "head_dim": 32})
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(prompt).logits
        hf_attention.use_numa_attention(model)
        got = model(prompt).logits
    assert torch.equal(got, expected)  # prefill: SDPA itself
    greedy(model, prompt, 3)  # head size 32 has no kernels: decode falls back too
    assert decode_calls.get("attention_calls", 0) == 0


def test_decode_function_matches_sdpa_on_a_step(rng):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups = 4
    module.is_causal = True
    q = torch.randn(3, 8, 1, 128).to(torch.bfloat16)
    k, v = (torch.randn(3, 2, 300, 128).to(torch.bfloat16) for _ in range(2))
    ours, _ = hf_attention.numa_moe_attention_forward(module, q, k, v, None, scaling=0.1)
    theirs, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), None, scaling=0.1)
    assert ours.shape == theirs.shape == (3, 1, 8, 128)
    assert (ours.float() - theirs).abs().max() < 2e-2
    window, _ = hf_attention.numa_moe_attention_forward(module, q, k, v, None, scaling=0.1, sliding_window=10)
    last, _ = sdpa_attention_forward(module, q.float(), k[:, :, -10:].float(), v[:, :, -10:].float(), None,
                                     scaling=0.1)
    assert (window.float() - last).abs().max() < 2e-2

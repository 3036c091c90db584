"""A CPU decode loop with both kernels: transformers' own model of a published MoE shape
(random weights), run greedily once as transformers runs it and once with the routed
experts patched (numa_moe.integrations.hf.patch_moe) and decode attention through
numa_moe.layer.attention (numa_moe.integrations.hf_attention); tokens/s of both, whether the
greedy tokens agree (and, where they part, how close the baseline's top two logits were),
and where the patched step's time goes (experts, attention, the rest).

Shapes come from numa_moe.checkpoints.synthetic.MODEL_SPECS (hidden size, heads, head size, expert
width) with fewer layers and experts than the real model, and a small vocabulary so that
the LM head does not dominate; all of them are options.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["GenerateReport", "build_model", "run_generate", "format_report"]


@dataclass
class GenerateReport:
    like: str
    layers: int
    experts: int
    vocab: int
    prompt_tokens: int
    new_tokens: int
    baseline_attention: str
    attention_isa: str
    baseline_tokens_per_s: float
    patched_tokens_per_s: float
    identical: bool
    first_divergence: int | None = None  # index into the new tokens
    divergence_top2_gap: float | None = None  # baseline logits: top1 - top2 at that step
    divergence_top1: float | None = None
    shares: dict = field(default_factory=dict)  # patched run: experts / attention / rest, fractions
    baseline_shares: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.patched_tokens_per_s / self.baseline_tokens_per_s


def _torch():
    import torch

    return torch


def build_model(like: str = "qwen3-30b-a3b", layers: int = 4, experts: int | None = None, vocab: int = 4096,
                seed: int = 0, **overrides):
    """transformers' model of `like` with `layers` layers, `experts` routed experts (default
    the spec's default), `vocab` tokens, bf16, eval mode, random weights: matrices
    N(0, 1/fan_in), embeddings N(0, 1), so that every layer moves the hidden state and
    greedy decoding does not collapse onto one token."""
    torch = _torch()
    import transformers

    from numa_moe.placement import memory

    config = _model_config(like, layers, experts, vocab, seed, overrides)
    memory.check_fits(_weight_bytes(config), f"a {config['num_hidden_layers']}-layer {like} model")
    cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
    return model


# The context of the random models (max_position_embeddings): prompt and new tokens
# together stay within it.
MAX_POSITIONS = 32768


def _model_config(like: str, layers: int, experts: int | None, vocab: int, seed: int, overrides: dict) -> dict:
    """transformers config fields of build_model's model, checked: experts at most the
    real model's count, layers and vocabulary at least 1."""
    from numa_moe.checkpoints.synthetic import MODEL_SPECS, model_config

    if like not in MODEL_SPECS:
        raise ValueError(f"unknown model {like!r}; choose one of {', '.join(MODEL_SPECS)}")
    spec = MODEL_SPECS[like]
    if spec.model_type not in ("qwen3_moe", "mixtral", "gpt_oss"):
        raise ValueError(f"generate supports the qwen3_moe, mixtral and gpt_oss shapes, not {like} "
                         f"({spec.model_type})")
    experts = spec.default_experts if experts is None else experts
    if not 1 <= experts <= spec.n_experts:
        raise ValueError(f"experts must be in 1..{spec.n_experts} for {like} (the real model's count), "
                         f"got {experts}")
    for name, value in (("layers", layers), ("vocab", vocab)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    config = model_config(spec, layers, experts, spec.hidden_size, spec.moe_intermediate_size, seed, True)
    config.pop("numa_moe_synthetic")
    config.pop("architectures")
    config.pop("torch_dtype")
    config.pop("quantization_config", None)  # the model is built in bf16, its experts too
    config.update(vocab_size=vocab, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False)
    config.update(overrides)
    return config


def _weight_bytes(config: dict) -> int:
    """bf16 bytes of the model's weights: attention, routed experts and router per layer,
    embedding and LM head."""
    H, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or H // heads
    experts = config.get("num_experts") or config.get("num_local_experts")
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    per_layer = H * head_dim * 2 * (heads + kv_heads) + experts * (3 * H * inter + H)
    return 2 * (layers * per_layer + 2 * config["vocab_size"] * H)


def _run_bytes(config: dict, prompt_tokens: int, tokens: int, eager: bool) -> int:
    """What run_generate holds at most: the model, the patched copy of its experts, the
    bf16 KV cache of every position, the prefill's activations (and with eager attention
    its fp32 scores of one layer; SDPA does not hold them), and the logits of both runs
    (fp32)."""
    H, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or H // heads
    experts = config.get("num_experts") or config.get("num_local_experts")
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    positions = prompt_tokens + tokens
    weights = _weight_bytes(config)
    patched = layers * experts * 3 * H * inter * 2
    kv_cache = layers * 2 * kv_heads * head_dim * positions * 2
    prefill = prompt_tokens * (8 * H + 8 * config["vocab_size"] + (4 * heads * prompt_tokens if eager else 0))
    logits = 2 * tokens * config["vocab_size"] * 4
    return weights + patched + kv_cache + prefill + logits


class _StepClock:
    """Seconds in the experts modules (forward hooks) and in attention (a timed
    AttentionInterface entry) during a generate call."""

    def __init__(self, model, experts_modules):
        self.experts_s = 0.0
        self._starts = []
        self._handles = []
        for module in experts_modules:
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post))

    def _pre(self, module, args):
        self._starts.append(time.perf_counter())

    def _post(self, module, args, output):
        self.experts_s += time.perf_counter() - self._starts.pop()

    def remove(self):
        for h in self._handles:
            h.remove()


_timed_attention: dict = {}


def _timed_implementation(impl: str) -> str:
    """An AttentionInterface entry that runs transformers' `impl` ("sdpa" or "eager") and
    adds its seconds to _timed_attention; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"numa_moe_timed_{impl}"

    def forward(module, *args, **kwargs):
        fn = (sys.modules[type(module).__module__].eager_attention_forward if impl == "eager"
              else ALL_ATTENTION_FUNCTIONS[impl])
        start = time.perf_counter()
        result = fn(module, *args, **kwargs)
        _timed_attention["attention_s"] = _timed_attention.get("attention_s", 0.0) + time.perf_counter() - start
        return result

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


def _greedy(model, prompt, new_tokens: int):
    torch = _torch()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, prompt.shape[1]:].tolist(), out.logits


@contextmanager
def _shares(model, experts_modules, attention_timings: dict):
    clock = _StepClock(model, experts_modules)
    attention_timings.clear()
    result = {}
    start = time.perf_counter()
    try:
        yield result
    finally:
        total = time.perf_counter() - start
        clock.remove()
        attn = attention_timings.get("attention_s", 0.0)
        result.update(total_s=total, experts=clock.experts_s / total, attention=attn / total,
                      rest=max(0.0, 1.0 - (clock.experts_s + attn) / total))


def run_generate(like: str = "qwen3-30b-a3b", layers: int = 4, tokens: int = 64, experts: int | None = None,
                 vocab: int = 4096, prompt_tokens: int = 16, seed: int = 0, baseline_attention: str | None = None,
                 topology=None, isa: str | None = None, echo=print, **overrides) -> GenerateReport:
    """Greedy decoding of `tokens` new tokens after a random prompt, unpatched then
    patched (see the module docstring); the report of both. overrides: config fields
    (tiny models for tests: hidden_size=128, head_dim=64, ...). ``baseline_attention``
    defaults to "sdpa"; gpt-oss's attention (with sinks) runs transformers' eager
    implementation only, in both runs (numa-moe's decode attention has no sinks)."""
    from numa_moe.layer import attention
    from numa_moe.placement import memory

    from numa_moe.checkpoints.synthetic import MODEL_SPECS

    gpt_oss = like in MODEL_SPECS and MODEL_SPECS[like].model_type == "gpt_oss"
    if baseline_attention is None:
        baseline_attention = "eager" if gpt_oss else "sdpa"
    if baseline_attention not in ("sdpa", "eager"):
        raise ValueError(f"baseline attention must be sdpa or eager, got {baseline_attention!r}")
    if gpt_oss and baseline_attention != "eager":
        raise ValueError(f"{like}: transformers runs gpt-oss attention (with sinks) eager only, not "
                         f"{baseline_attention}")
    if isa is not None and isa not in attention.available_isas():
        raise ValueError(f"isa {isa!r} is not available here (available: "
                         f"{', '.join(attention.available_isas())})")
    for name, value in (("tokens", tokens), ("prompt_tokens", prompt_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    config = _model_config(like, layers, experts, vocab, seed, overrides)
    if prompt_tokens + tokens > config["max_position_embeddings"]:
        raise ValueError(f"prompt_tokens + tokens must be at most {config['max_position_embeddings']} (the "
                         f"model's context, max_position_embeddings), got {prompt_tokens} + {tokens}")
    memory.check_fits(_run_bytes(config, prompt_tokens, tokens, baseline_attention == "eager"),
                      f"greedy decoding of {tokens} tokens after a {prompt_tokens}-token prompt on a "
                      f"{layers}-layer {like} model with vocabulary {vocab}")
    torch = _torch()
    from numa_moe.integrations import hf_attention
    from numa_moe.integrations.hf import find_expert_modules, patch_moe

    model = build_model(like, layers, experts, vocab, seed, **overrides)
    experts_n = find_expert_modules(model)[0][1].gate_up_proj.shape[0]
    prompt = torch.randint(0, vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(seed))
    shapes = f"{like} shapes" + (f" with {overrides}" if overrides else "")
    echo(f"model: {shapes}, {layers} layers, {experts_n} experts, vocabulary {vocab}, random weights; "
         f"prompt {prompt_tokens} tokens, {tokens} new tokens, greedy")

    model.set_attn_implementation(_timed_implementation(baseline_attention))
    _greedy(model, prompt, 2)  # warm-up: first-call costs of torch
    with _shares(model, [m for _, m in find_expert_modules(model)], _timed_attention) as base_shares:
        base_tokens, base_logits = _greedy(model, prompt, tokens)
    base_tps = tokens / base_shares["total_s"]
    echo(f"transformers ({baseline_attention} attention): {base_tps:.2f} tokens/s")

    patch_moe(model, topology=topology)
    if gpt_oss:
        timings = _timed_attention  # transformers' eager attention stays, timed as in the baseline
    else:
        hf_attention.use_numa_attention(model)
        timings = {}
        hf_attention.timings = timings
    previous_isa = None
    try:
        if isa is not None:
            import os

            previous_isa = os.environ.get("NUMA_MOE_ISA")
            os.environ["NUMA_MOE_ISA"] = isa
        _greedy(model, prompt, 2)
        with _shares(model, [m for _, m in find_expert_modules(model)], timings) as shares:
            new_tokens, _ = _greedy(model, prompt, tokens)
    finally:
        hf_attention.timings = None
        if isa is not None:
            import os

            if previous_isa is None:
                os.environ.pop("NUMA_MOE_ISA", None)
            else:
                os.environ["NUMA_MOE_ISA"] = previous_isa
    tps = tokens / shares["total_s"]
    report = GenerateReport(like, layers, experts_n, vocab, prompt_tokens, tokens, baseline_attention,
                            "transformers eager" if gpt_oss else isa or attention.default_isa(), base_tps, tps,
                            new_tokens == base_tokens,
                            shares={k: shares[k] for k in ("experts", "attention", "rest")},
                            baseline_shares={k: base_shares[k] for k in ("experts", "attention", "rest")})
    if not report.identical:
        step = next(i for i, (a, b) in enumerate(zip(base_tokens, new_tokens)) if a != b)
        top2 = torch.topk(base_logits[step][0].float(), 2).values
        report.first_divergence = step
        report.divergence_top1 = float(top2[0])
        report.divergence_top2_gap = float(top2[0] - top2[1])
    return report


def format_report(r: GenerateReport) -> str:
    def pct(shares):
        return " · ".join(f"{k} {100 * shares[k]:.0f}%" for k in ("experts", "attention", "rest"))

    lines = [
        f"{'run':<34} {'tokens/s':>9}   share of the time",
        f"{'transformers (' + r.baseline_attention + ')':<34} {r.baseline_tokens_per_s:>9.2f}   {pct(r.baseline_shares)}",
        f"{'numa-moe experts + attention (' + r.attention_isa + ')':<34} {r.patched_tokens_per_s:>9.2f}   "
        f"{pct(r.shares)}",
        f"speed-up {r.speedup:.2f}x",
    ]
    if r.identical:
        lines.append(f"greedy tokens: identical ({r.new_tokens} of {r.new_tokens})")
    else:
        lines.append(f"greedy tokens: first divergence at new token {r.first_divergence}; the baseline's top two "
                     f"logits there differ by {r.divergence_top2_gap:.3g} (top logit {r.divergence_top1:.3g}): "
                     f"{'a near-tie that bf16 rounding can flip' if r.divergence_top2_gap <= 0.02 * max(1.0, abs(r.divergence_top1)) else 'NOT a near-tie'}")
    return "\n".join(lines)

"""Serve check: tiny MoE models through vLLM with and without the numa-moe plugin.

``make_tokenizer`` and ``make_model`` write a model directory vLLM loads offline (no hub):
a word-level tokenizer built with the ``tokenizers`` library, and a Qwen3-MoE, Mixtral or
DeepSeek-V2 config with seeded random bf16 weights (transformers' own initialisation, scaled up so
that greedy choices are not near-ties). ``generate`` runs vLLM's offline ``LLM`` on it in
a child process (vLLM loads its plugins once per process, so "with" and "without" need a
process each) and returns the greedy tokens, the top logprobs at each step and the
numa-moe layers' call counts from inside the worker. ``compare`` says where two runs
differ and whether the difference is a near-tie. ``serve_check`` does it all; the CLI's
``numa-moe serve-check`` prints it. Needs the vLLM venv (tools/setup-vllm.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v2", "gpt_oss")
MODES = ("eager", "compiled")
# Two runs whose top-2 logprobs at a step lie closer than this are at a tie there: bf16
# rounding in another kernel may pick either token, and the sequences part after it.
TIE_LOGPROB = 0.05


@dataclass(frozen=True)
class TinyShape:
    """A model's size; defaults make a model vLLM loads in seconds."""
    layers: int = 2
    hidden: int = 128
    intermediate: int = 64  # per expert
    experts: int = 8
    top_k: int = 2
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    vocab: int = 512
    init_std: float = 0.1  # transformers' initializer_range; larger spreads the logits


QWEN3_30B_A3B_4_LAYERS = TinyShape(layers=4, hidden=2048, intermediate=768, experts=128, top_k=8, heads=32,
                                   kv_heads=4, head_dim=128, vocab=4096, init_std=0.02)


def make_tokenizer(out_dir, vocab: int) -> None:
    """A word-level tokenizer over ``vocab`` ids: <unk>, <s>, </s>, then words t3 ... t{vocab-1}
    (whitespace-separated), saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"t{i}": i for i in range(3, vocab)})
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", model_max_length=4096)
    fast.save_pretrained(os.fspath(out_dir))


def make_model(out_dir, family: str = "qwen3_moe", shape: TinyShape = TinyShape(), seed: int = 0) -> Path:
    """Writes config, bf16 safetensors and tokenizer of a random ``family`` model; returns
    the directory."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    out = Path(out_dir)
    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                  num_experts_per_tok=shape.top_k, max_position_embeddings=4096, initializer_range=shape.init_std,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=shape.intermediate, num_experts=shape.experts,
                                             intermediate_size=4 * shape.hidden, norm_topk_prob=True,
                                             decoder_sparse_step=1, mlp_only_layers=[], **common)
        model_cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=shape.intermediate,
                                            num_local_experts=shape.experts, **common)
        model_cls = transformers.MixtralForCausalLM
    elif family == "gpt_oss":  # interleaved gate / up, expert biases, the clamped SwiGLU
        config = transformers.GptOssConfig(intermediate_size=shape.intermediate, num_local_experts=shape.experts,
                                           sliding_window=128, **common)
        model_cls = transformers.GptOssForCausalLM
    else:  # DeepSeek-V2: MLA attention, one shared expert beside the routed ones
        common.pop("head_dim")
        config = transformers.DeepseekV2Config(
            moe_intermediate_size=shape.intermediate, n_routed_experts=shape.experts, n_shared_experts=1,
            intermediate_size=4 * shape.hidden, first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=None,
            qk_nope_head_dim=shape.head_dim, qk_rope_head_dim=64, v_head_dim=shape.head_dim,
            topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
            **common)
        model_cls = transformers.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16: no fp32 copy of a large model
    try:
        model = model_cls(config)
    finally:
        torch.set_default_dtype(default_dtype)
    if family == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                experts = layer.mlp.experts
                # transformers starts the biases at zero, and small weights stay below the
                # clamp: biases of every sign and gate / up values past the limit 7
                experts.gate_up_proj.mul_(20)
                experts.gate_up_proj_bias.normal_(0.0, 1.0)
                experts.down_proj_bias.normal_(0.0, 0.5)
    model.save_pretrained(os.fspath(out), safe_serialization=True)
    make_tokenizer(out, shape.vocab)
    return out


def prompts(count: int, length: int = 8, vocab: int = 512, seed: int = 1) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(3, vocab)}" for _ in range(length)) for _ in range(count)]


# ---- the vLLM run (child process) --------------------------------------------------------

def _count_numa_moe_calls(model) -> dict:
    """Runs in vLLM's worker (LLM.apply_model): the numa-moe layers of the model and
    how often each ran; the experts class of every MoE layer."""
    from numa_moe.integrations.vllm import openmp_bound_cpus

    calls, experts, threads, shapes, isas = [], [], set(), set(), set()
    for module in model.modules():
        moe_layer = getattr(module, "numa_moe_layer", None)
        if moe_layer is not None:
            calls.append(int(moe_layer.forward_calls))
            isas.add(moe_layer.isa_for_tokens(1))
            threads.add(moe_layer.pool.n_threads)
            shapes.add((moe_layer.n_experts, moe_layer.intermediate, moe_layer.hidden))
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None:
            experts.append(type(kernel.fused_experts).__name__)
    bound = openmp_bound_cpus()
    # vLLM loads one of its kernel libraries by CPU (vllm._C, _C_AVX512, _C_AVX2); the import
    # of the latter two fails after the library is loaded, so the memory map is what tells
    maps = Path("/proc/self/maps")
    libraries = {Path(line.split()[-1]).name.split(".")[0] for line in maps.read_text().splitlines()
                 if "/vllm/_C" in line} if maps.exists() else set()
    return {"calls": calls, "experts": sorted(set(experts)), "pool_threads": sorted(threads),
            "layer_shapes": sorted(shapes), "layer_isas": sorted(isas), "vllm_kernel_libraries": sorted(libraries),
            "openmp_bound_cpus": list(bound) if bound else None, "cpu_count": os.cpu_count()}


def _probe_first_layer(model, tokens: int, seed: int) -> dict:
    """Runs in vLLM's worker: the first numa-moe experts of the model applied, as vLLM's
    modular kernel applies them, to random tokens and routing; returns inputs and output
    (lists) for a reference computed elsewhere, and how the layer holds its weights."""
    import torch

    for module in model.modules():
        if getattr(module, "numa_moe_layer", None) is not None:
            break
    else:
        return {}
    moe_layer = module.numa_moe_layer
    experts = module.quant_method.moe_kernel.fused_experts
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, moe_layer.hidden, generator=gen).to(torch.bfloat16)
    k = module.moe_config.experts_per_token
    ids = torch.stack([torch.randperm(moe_layer.n_experts, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, k, generator=gen, dtype=torch.float32)
    output = torch.empty_like(hidden)
    calls = moe_layer.forward_calls
    experts.apply(output, hidden, module.w13_weight, module.w2_weight, weights, ids, module.activation,
                  moe_layer.n_experts, None, None, None, None, None, None, False)
    stacked = moe_layer.stacked_weights()
    return {"prefix": getattr(module, "layer_name", ""), "hidden": hidden.float().tolist(), "ids": ids.tolist(),
            "weights": weights.tolist(), "output": output.float().tolist(), "ran": moe_layer.forward_calls - calls,
            "weight_format": moe_layer.weight_format, "vllm_w13_bytes": module.w13_weight.untyped_storage().nbytes(),
            "shares_weights": stacked is not None and module.w13_weight.data_ptr()
            == torch.from_numpy(stacked[0].view("int16")).data_ptr()}


def _zero_numa_moe_weights(model) -> int:
    """Runs in vLLM's worker: zeroes the bf16 expert buffers of every numa-moe layer (a
    reload must bring the values back); returns how many layers shared their buffers
    with vLLM's parameters."""
    import torch

    shared = 0
    for module in model.modules():
        moe_layer = getattr(module, "numa_moe_layer", None)
        if moe_layer is None or moe_layer.stacked_weights() is None:
            continue
        gate_up = moe_layer.stacked_weights()[0]
        shared += module.w13_weight.data_ptr() == torch.from_numpy(gate_up.view("int16")).data_ptr()
        for buffer in moe_layer.stacked_weights():
            buffer.view("uint16")[...] = 0
    return shared


def _hide_avx512_from_torch() -> None:
    """Makes torch.cpu report no AVX-512, AMX or AVX10 (what vLLM reads to choose its
    kernel library, vllm._C_AVX2 on a CPU without AVX-512, and its AMX experts). Reaches
    this process and those it forks, not spawned ones."""
    from types import MappingProxyType

    import torch.cpu

    capabilities = torch.cpu.get_capabilities()
    hidden = MappingProxyType({name: value for name, value in capabilities.items()
                               if not name.startswith(("avx512", "amx", "avx10"))})
    torch.cpu.get_capabilities = lambda: hidden


def _child_main(request_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    if request.get("without_avx512"):
        _hide_avx512_from_torch()
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], dtype=request.get("dtype", "bfloat16"), enforce_eager=request["mode"] == "eager",
              max_model_len=request.get("max_model_len", 256), max_num_seqs=request.get("max_num_seqs", 8),
              tensor_parallel_size=request.get("tensor_parallel_size", 1), seed=0, trust_remote_code=False)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], logprobs=2, ignore_eos=True)
    outputs = llm.generate(request["prompts"], params, use_tqdm=False)
    result = {"tokens": [], "logprobs": [], "prompt_tokens": []}
    for out in outputs:
        completion = out.outputs[0]
        result["prompt_tokens"].append(list(out.prompt_token_ids))
        result["tokens"].append(list(completion.token_ids))
        result["logprobs"].append([sorted((lp.logprob for lp in step.values()), reverse=True)
                                   for step in completion.logprobs])
    if request.get("reload"):
        result["shared_before_reload"] = llm.apply_model(_zero_numa_moe_weights)
        zeroed = llm.generate(request["prompts"], params, use_tqdm=False)
        result["tokens_zeroed"] = [list(out.outputs[0].token_ids) for out in zeroed]
        llm.collective_rpc("reload_weights", kwargs={"weights_path": request["model"]})
        reloaded = llm.generate(request["prompts"], params, use_tqdm=False)
        result["tokens_after_reload"] = [list(out.outputs[0].token_ids) for out in reloaded]
        result["shared_after_reload"] = llm.apply_model(_zero_numa_moe_weights)
    if request.get("timed_batches"):
        result["timings"] = _timed_decode(llm, request)
    result["workers"] = llm.apply_model(_count_numa_moe_calls)
    if request.get("probe_tokens"):
        from functools import partial

        result["probe"] = llm.apply_model(partial(_probe_first_layer, tokens=request["probe_tokens"], seed=3))
    Path(request["out"]).write_text(json.dumps(result))


_expert_seconds = [0.0]


def _time_experts(model) -> int:
    """Runs in vLLM's worker: wraps every MoE layer's experts apply() to add its wall time
    to _expert_seconds (eager mode: a compiled graph would not call the wrapper); returns
    how many layers it wrapped."""
    import time

    wrapped = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is None or "apply" in vars(kernel.fused_experts):
            continue
        experts = kernel.fused_experts
        inner = experts.apply

        def timed(*args, _inner=inner, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                _expert_seconds[0] += time.perf_counter() - start

        experts.apply = timed
        wrapped += 1
    return wrapped


def _take_expert_seconds(model) -> float:
    seconds, _expert_seconds[0] = _expert_seconds[0], 0.0
    return seconds


def _timed_decode(llm, request) -> dict:
    """Per batch size: decode tokens/s (the median of ``repeats`` generate() calls of
    ``timed_tokens`` new tokens per sequence after 8-word prompts, prefill included) and
    the share of that time spent in the experts' apply()."""
    import statistics
    import time

    from vllm import SamplingParams

    llm.apply_model(_time_experts)
    timings = {}
    params = SamplingParams(temperature=0.0, max_tokens=request["timed_tokens"], ignore_eos=True)
    for batch in request["timed_batches"]:
        batch_prompts = prompts(batch, vocab=request["vocab"], seed=7)
        llm.generate(batch_prompts, params, use_tqdm=False)  # warm-up
        llm.apply_model(_take_expert_seconds)
        seconds, shares = [], []
        for _ in range(request.get("repeats", 3)):
            start = time.perf_counter()
            llm.generate(batch_prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
            shares.append(sum(llm.apply_model(_take_expert_seconds)) / seconds[-1])
        timings[str(batch)] = {"tokens_per_s": batch * request["timed_tokens"] / statistics.median(seconds),
                               "expert_share": statistics.median(shares), "seconds": seconds}
    return timings


# generate(..., without_avx512=True): what a CPU with AVX2 and FMA but no AVX-512 runs, as
# far as software can force it on one with AVX-512. torch's own kernels (ATen's dispatch,
# oneDNN) and numa-moe's take the AVX2 path; vLLM's torch.cpu checks see no AVX-512
# (_hide_avx512_from_torch, in the child, hence engine and worker in that one process), so
# that vLLM loads vllm._C_AVX2 (its CPU kernels built for AVX2: attention, norms, the
# experts' grouped GEMM) and keeps off AMX.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "NUMA_MOE_ISA": "avx2",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class RunResult:
    tokens: list
    logprobs: list
    workers: list
    prompt_tokens: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    probe: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # the child's other results (reload checks)
    log: str = ""  # the child's whole output

    @property
    def chosen_logprobs(self) -> list:
        """Per prompt, the logprob of the token chosen at each step (greedy: the top one)."""
        return [[step[0] for step in steps] for steps in self.logprobs]


def generate(model_dir, prompt_list, *, plugin: bool, mode: str = "eager", max_tokens: int = 8, workdir=None,
             timeout_s: float = 600, extra_env: dict | None = None, name: str | None = None,
             without_avx512: bool = False, **request) -> RunResult:
    """One vLLM run in a child process of this interpreter (the vLLM venv's); ``request``
    adds child options (probe_tokens, timed_batches, ...). ``without_avx512``: the run
    takes the kernels of a CPU without AVX-512 (AVX2_ENV). Files go to ``workdir``
    (default: the model's directory) under ``name``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    workdir = Path(workdir if workdir is not None else model_dir)
    tag = name or f"{'plugin' if plugin else 'stock'}-{mode}"
    req_path, out_path = workdir / f"request-{tag}.json", workdir / f"result-{tag}.json"
    out_path.unlink(missing_ok=True)
    req_path.write_text(json.dumps(dict(request, model=os.fspath(model_dir), prompts=list(prompt_list), mode=mode,
                                        max_tokens=max_tokens, out=os.fspath(out_path),
                                        without_avx512=without_avx512)))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update({
        "NUMA_MOE_VLLM": "1" if plugin else "0",
        # apply_model sends a function to the worker process
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        # the compile cache's key does not see the plugin: never reuse a graph across modes
        "VLLM_DISABLE_COMPILE_CACHE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    })
    env.update(AVX2_ENV if without_avx512 else {})
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, "-m", "numa_moe.integrations.vllm_check", os.fspath(req_path)],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    log = proc.stdout + proc.stderr
    (workdir / f"log-{tag}.txt").write_text(log)
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"vLLM run ({tag}) failed with exit code {proc.returncode}; last output:\n{log[-6000:]}")
    data = json.loads(out_path.read_text())
    return RunResult(data["tokens"], data["logprobs"], data["workers"], data["prompt_tokens"],
                     data.get("timings", {}), data.get("probe", []),
                     {k: v for k, v in data.items() if k.endswith("reload") or k == "tokens_zeroed"}, log)


@dataclass
class Comparison:
    """Per prompt: the number of tokens that agree before the first difference (all when
    equal) and, at a difference, the stock run's top-2 logprob gap there."""
    matched: list
    gaps: list
    total: int

    @property
    def equal(self) -> bool:
        return all(m == self.total for m in self.matched)

    @property
    def ties_only(self) -> bool:
        """Every difference is at a near-tie (TIE_LOGPROB) of the stock run."""
        return all(g is None or g < TIE_LOGPROB for g in self.gaps)


def compare(stock: RunResult, plugin: RunResult) -> Comparison:
    matched, gaps = [], []
    total = len(stock.tokens[0]) if stock.tokens else 0
    for s_tokens, p_tokens, s_lps in zip(stock.tokens, plugin.tokens, stock.logprobs):
        n = next((i for i, (a, b) in enumerate(zip(s_tokens, p_tokens)) if a != b), min(len(s_tokens), len(p_tokens)))
        matched.append(n)
        gaps.append(None if n == total else (s_lps[n][0] - s_lps[n][1]))
    return Comparison(matched, gaps, total)


def max_logprob_difference(stock: RunResult, plugin: RunResult, comparison: Comparison) -> float:
    """Largest difference of the chosen token's logprob over the steps where both runs agree."""
    worst = 0.0
    for s_lps, p_lps, n in zip(stock.logprobs, plugin.logprobs, comparison.matched):
        for i in range(n):
            worst = max(worst, abs(s_lps[i][0] - p_lps[i][0]))
    return worst


def reference_logprobs(model_dir, run: RunResult, dtype: str = "float32") -> list:
    """Per prompt, the logprob of each token ``run`` generated, given the prompt and the
    tokens before it (teacher forcing: one forward pass per prompt), from transformers'
    implementation of the checkpoint with weights and arithmetic in ``dtype``: float32 is
    the reference of a bf16 run's logprobs; bfloat16 shows how far bf16 arithmetic alone
    moves them."""
    import torch
    import transformers

    if dtype not in ("float64", "float32", "bfloat16"):
        raise ValueError(f"dtype must be float64, float32 or bfloat16, got {dtype!r}")
    config = transformers.AutoConfig.from_pretrained(os.fspath(model_dir))
    if config.model_type == "deepseek_v2":
        # MLA gives every head its own key and value; transformers' attention would repeat
        # them num_attention_heads / num_key_value_heads times (vLLM reads no such count there)
        config.num_key_value_heads = config.num_attention_heads
    # transformers' plain attention and expert loops: its grouped-GEMM experts take no float64
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(model_dir), config=config, dtype=getattr(torch, dtype), attn_implementation="eager",
        experts_implementation="eager")
    model.eval()
    result = []
    with torch.no_grad():
        for prompt_tokens, tokens in zip(run.prompt_tokens, run.tokens):
            ids = torch.tensor([prompt_tokens + tokens[:-1]])
            logits = model(ids).logits[0, len(prompt_tokens) - 1:].double()
            chosen = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
            result.append(chosen.tolist())
    return result


def logprob_errors(logprobs: list, reference: list) -> list:
    """|logprobs - reference| at every step of every prompt (both: a list per prompt, such
    as RunResult.chosen_logprobs and reference_logprobs of that run), one flat list."""
    return [abs(value - ref) for values, refs in zip(logprobs, reference, strict=True)
            for value, ref in zip(values, refs, strict=True)]


def serve_check(workdir, families=FAMILIES, modes=("eager",), n_prompts: int = 4, max_tokens: int = 8,
                shape: TinyShape = TinyShape()) -> list[dict]:
    """Builds each family's tiny model under ``workdir`` and, per mode, runs vLLM without
    and with the plugin; one row per (family, mode)."""
    rows = []
    for family in families:
        model_dir = Path(workdir) / family
        if not (model_dir / "config.json").exists():
            make_model(model_dir, family, shape)
        prompt_list = prompts(n_prompts, vocab=shape.vocab)
        for mode in modes:
            stock = generate(model_dir, prompt_list, plugin=False, mode=mode, max_tokens=max_tokens)
            ours = generate(model_dir, prompt_list, plugin=True, mode=mode, max_tokens=max_tokens)
            cmp = compare(stock, ours)
            rows.append({"family": family, "mode": mode, "equal": cmp.equal, "ties_only": cmp.ties_only,
                         "matched": cmp.matched, "tokens": cmp.total,
                         "max_logprob_diff": max_logprob_difference(stock, ours, cmp),
                         "numa_moe_calls": sum(sum(w["calls"]) for w in ours.workers),
                         "numa_moe_layers": sum(len(w["calls"]) for w in ours.workers),
                         "stock_experts": sorted({e for w in stock.workers for e in w["experts"]}),
                         "plugin_experts": sorted({e for w in ours.workers for e in w["experts"]})})
    return rows


if __name__ == "__main__":
    # Through the module's own name: apply_model pickles _count_numa_moe_calls by reference.
    from numa_moe.integrations.vllm_check import _child_main as main

    main(sys.argv[1])

"""The vLLM tier: tiny generated Qwen3-MoE, Mixtral and DeepSeek-V2 models served by vLLM's CPU build
with and without the numa-moe plugin (numa_moe.integrations.vllm). Runs in .venv-vllm
(tools/run-vllm-tests.sh); each vLLM run is a child process (vLLM loads its plugins once
per process). Most runs keep vLLM's engine and worker in the child process itself
(VLLM_ENABLE_V1_MULTIPROCESSING=0: 35 s less a run on 2 cores); the first plugin run uses
vLLM's own worker process, with the OpenMP binding vLLM gives it."""

import ml_dtypes
import numpy as np
import pytest

# (this folder is not named "vllm": on sys.path it would pass for the package)
pytest.importorskip("vllm", reason="vLLM is not installed in this venv: the vLLM tier runs in .venv-vllm "
                                   "(bash tools/run-vllm-tests.sh)")

from numa_moe import quant  # noqa: E402
from numa_moe.integrations import vllm_check as vc  # noqa: E402

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
MAX_TOKENS = 8
N_PROMPTS = 4
SHAPE = vc.TinyShape()
# Logprobs are checked against an independent reference, not stock vLLM's: on a CPU without
# AVX-512 vLLM's own experts (vllm._C_AVX2) put one Mixtral logprob 0.31 off float32 where
# numa-moe's run is 0.01 off, so stock-vs-ours differences measure vLLM's error as much as
# ours (docs/serving.md, figures there). The reference: transformers' float32 run of the same
# checkpoint, teacher-forced on the tokens each run chose (vc.reference_logprobs). The scale:
# transformers' bf16 run on the same tokens against the same float32 run, what bf16
# arithmetic alone does to the model. Over the 32 steps, two statistics of |logprob -
# float32|: the median (the typical step) and the 90th percentile (the tail less its top
# three steps). Not the maximum: where a router's top-k is at a near-tie, any bf16 run may
# pick other experts than float32 does, and the logprob there moves by up to 1.1 (Mixtral,
# in transformers' own bf16 run as well); which steps that hits differs between kernels.
# Measured on Mixtral and Qwen3-MoE, stock and numa-moe, AVX-512 and the AVX2 kernels
# (vc.AVX2_ENV): each run's statistics at most 1.2x transformers' bf16 ones, numa-moe's at
# most stock's + 0.0001.
REFERENCE_FACTOR = 2  # each run's statistics within twice transformers' bf16 ones
OVER_STOCK_MARGIN = 0.5  # numa-moe's within stock's + half of transformers' bf16 ones
# transformers' DeepSeek-V2 is not vLLM's (both runs a median 0.38 off its float32 run, 0.01
# apart from each other), so that family is compared with stock vLLM as before: the tokens
# both chose, their logprobs within bf16 rounding of the expert sums in another order
# (measured: 0 on AVX-512, 0.021 on the AVX2 kernels)
REFERENCE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
LOGPROB_TOLERANCE = 0.05
# vLLM's own CPU experts: its portable grouped GEMM, or, where torch reports AMX tiles, the
# AMX subclass vLLM's oracle picks instead.
VLLM_CPU_EXPERTS = ("CPUUnquantizedExperts", "X86CPUUnquantizedExperts")


def ran_vllm_experts(workers) -> bool:
    """One worker whose MoE layers all ran one of vLLM's own CPU expert classes."""
    return len(workers) == 1 and len(workers[0]["experts"]) == 1 and workers[0]["experts"][0] in VLLM_CPU_EXPERTS


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    return {family: vc.make_model(root / family, family, SHAPE, seed=11) for family in vc.FAMILIES}


@pytest.fixture(scope="module")
def stock_run(models):
    """stock_run(family, mode): stock vLLM's run of the prompts, made once per module."""
    runs = {}

    def run(family, mode):
        if (family, mode) not in runs:
            runs[family, mode] = vc.generate(models[family], vc.prompts(N_PROMPTS, vocab=SHAPE.vocab), plugin=False,
                                             mode=mode, max_tokens=MAX_TOKENS, extra_env=IN_PROCESS)
        return runs[family, mode]

    return run


def expert_weights(model_dir, prefix):
    """float64 gate, up [E, I, H] and down [E, H, I] of the checkpoint's layer ``prefix``."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        def stack(name):
            return np.stack([f.get_tensor(f"{prefix}.{e}.{name}.weight").double().numpy() for e in range(SHAPE.experts)])

        return stack("gate_proj"), stack("up_proj"), stack("down_proj")


def moe_reference(hidden, ids, weights, gates, ups, downs):
    """y[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t), float64."""
    out = np.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            g, u = gates[e] @ hidden[t], ups[e] @ hidden[t]
            out[t] += w * (downs[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def check_probe(probe, model_dir, weight_format, tolerance, group=128):
    """The worker applied the layer's NumaMoEExperts to random tokens: its output against
    float64 on the checkpoint's weights (dequantized from numa-moe's own quantization
    for int8, whose activations are quantized too: hence its looser tolerance)."""
    assert probe["ran"] == 1, "the probe's apply() did not run numa-moe's layer"
    assert probe["weight_format"] == weight_format
    gates, ups, downs = expert_weights(model_dir, probe["prefix"])
    if weight_format != "bf16":
        gates, ups, downs = (np.stack([quant.dequantize(quant.quantize(m.astype(ml_dtypes.bfloat16), weight_format, group))
                                       .astype(np.float64) for m in mats]) for mats in (gates, ups, downs))
    hidden = np.array(probe["hidden"])
    expected = moe_reference(hidden, np.array(probe["ids"]), np.array(probe["weights"]), gates, ups, downs)
    actual = np.array(probe["output"])
    error = np.abs(actual - expected).max() / np.abs(expected).max()
    assert error < tolerance, f"{weight_format} experts in vLLM: relative error {error:.3g} against float64"


# (family, mode): the plugin run's extra checks. The Qwen3-MoE eager run uses vLLM's own
# worker process and probes a layer; the Mixtral one also zeroes and reloads the weights
# afterwards (test_weight_reload_lands_in_numa_moe_buffers), so no run starts an engine
# only for that.
PLUGIN_RUNS = {
    ("qwen3_moe", "eager"): dict(extra_env=None, probe_tokens=5),
    ("mixtral", "eager"): dict(extra_env=IN_PROCESS, reload=True),
    ("qwen3_moe", "compiled"): dict(extra_env=IN_PROCESS),
    ("deepseek_v2", "eager"): dict(extra_env=IN_PROCESS),  # MLA, a shared expert beside the routed ones
    ("gpt_oss", "eager"): dict(extra_env=IN_PROCESS),  # swigluoai: interleaved w13, biases
}


@pytest.fixture(scope="module")
def plugin_run(models):
    runs = {}

    def run(family, mode):
        if (family, mode) not in runs:
            runs[family, mode] = vc.generate(models[family], vc.prompts(N_PROMPTS, vocab=SHAPE.vocab), plugin=True,
                                             mode=mode, max_tokens=MAX_TOKENS, **PLUGIN_RUNS[family, mode])
        return runs[family, mode]

    return run


def reference_statistics(model_dir, run):
    """(median, 90th percentile) of |logprob - float32| over the run's steps, for the run and
    for transformers' bf16 run on the same tokens."""
    reference = vc.reference_logprobs(model_dir, run)
    bf16 = vc.reference_logprobs(model_dir, run, "bfloat16")

    def statistics(errors):
        return np.array([np.median(errors), np.quantile(errors, 0.9)])

    return statistics(vc.logprob_errors(run.chosen_logprobs, reference)), statistics(vc.logprob_errors(bf16, reference))


def check_logprobs(model_dir, family, stock, ours, comparison):
    """stock's and ours' logprobs against the float32 reference (REFERENCE_FACTOR,
    OVER_STOCK_MARGIN); a family without a reference against each other."""
    if family not in REFERENCE_FAMILIES:
        difference = vc.max_logprob_difference(stock, ours, comparison)
        assert difference < LOGPROB_TOLERANCE, f"logprobs of the tokens both chose differ by up to {difference:.4f}"
        return
    stock_error, stock_bf16 = reference_statistics(model_dir, stock)
    ours_error, ours_bf16 = reference_statistics(model_dir, ours)
    figures = (f"(median, 90th percentile) of |logprob - float32|: stock vLLM {stock_error.round(4)}, transformers "
               f"bf16 on its tokens {stock_bf16.round(4)}; numa-moe {ours_error.round(4)}, transformers bf16 on its "
               f"tokens {ours_bf16.round(4)}")
    assert np.all(stock_error <= REFERENCE_FACTOR * stock_bf16), f"stock vLLM off the float32 reference: {figures}"
    assert np.all(ours_error <= REFERENCE_FACTOR * ours_bf16), f"numa-moe off the float32 reference: {figures}"
    assert np.all(ours_error <= stock_error + OVER_STOCK_MARGIN * ours_bf16), f"numa-moe worse than stock: {figures}"


@pytest.mark.parametrize("family, mode", list(PLUGIN_RUNS))
def test_greedy_tokens_equal_stock_vllm(models, stock_run, plugin_run, family, mode):
    stock, ours = stock_run(family, mode), plugin_run(family, mode)

    # whose kernels ran: vLLM's in the stock run (the plugin is installed; NUMA_MOE_VLLM=0,
    # which generate(plugin=False) sets, switched it off), numa-moe's in every MoE layer of ours
    assert ran_vllm_experts(stock.workers), [w["experts"] for w in stock.workers]
    assert all(w["calls"] == [] for w in stock.workers)
    assert [w["experts"] for w in ours.workers] == [["NumaMoEExperts"]]
    calls = ours.workers[0]["calls"]
    assert len(calls) == SHAPE.layers and min(calls) >= MAX_TOKENS, f"numa-moe layer calls: {calls}"

    comparison = vc.compare(stock, ours)
    assert comparison.equal or comparison.ties_only, (
        f"greedy tokens differ away from a near-tie: matched {comparison.matched} of {comparison.total}, "
        f"stock top-2 gaps there {comparison.gaps}\nstock {stock.tokens}\nours  {ours.tokens}")
    assert sum(comparison.matched) >= N_PROMPTS * MAX_TOKENS // 2, f"too few tokens compared: {comparison.matched}"
    check_logprobs(models[family], family, stock, ours, comparison)
    if PLUGIN_RUNS[family, mode]["extra_env"] is None:
        # vLLM bound its worker's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND=auto leaves a
        # CPU to the front end): the layer's pool is that CPU set, not the whole node
        worker = ours.workers[0]
        assert worker["openmp_bound_cpus"], "vLLM set no OpenMP binding for its worker"
        assert worker["pool_threads"] == [len(worker["openmp_bound_cpus"])]
    if ours.probe:
        assert ours.probe[0]["shares_weights"], "vLLM's w13_weight is not numa-moe's buffer"
        check_probe(ours.probe[0], models[family], "bf16", 1e-2)


def test_greedy_tokens_on_avx2_kernels(models):
    """Mixtral, stock and with the plugin, on the kernels of a CPU with AVX2 but no AVX-512
    (vc.AVX2_ENV: numa-moe's AVX2 kernels, vLLM's vllm._C_AVX2, torch's AVX2 dispatch): the
    tokens agree as on the machine's own kernels, and each run's logprobs follow float32
    (there stock vLLM's and numa-moe's logprobs differ by 0.3 at one step: vLLM's experts)."""
    prompt_list = vc.prompts(N_PROMPTS, vocab=SHAPE.vocab)
    stock, ours = (vc.generate(models["mixtral"], prompt_list, plugin=plugin, mode="eager", max_tokens=MAX_TOKENS,
                               name=f"{'plugin' if plugin else 'stock'}-avx2", without_avx512=True)
                   for plugin in (False, True))
    for run in (stock, ours):
        assert [w["vllm_kernel_libraries"] for w in run.workers] == [["_C_AVX2"]]
    assert ran_vllm_experts(stock.workers), [w["experts"] for w in stock.workers]
    assert [w["experts"] for w in ours.workers] == [["NumaMoEExperts"]]
    assert [w["layer_isas"] for w in ours.workers] == [["avx2"]]

    comparison = vc.compare(stock, ours)
    assert comparison.equal or comparison.ties_only, (
        f"greedy tokens differ away from a near-tie: matched {comparison.matched}, stock top-2 gaps there "
        f"{comparison.gaps}\nstock {stock.tokens}\nours  {ours.tokens}")
    check_logprobs(models["mixtral"], "mixtral", stock, ours, comparison)


@pytest.mark.parametrize("weight_format", ["int8", "int4", "iq4nl"])
def test_quantized_experts_at_load(models, stock_run, weight_format):
    """NUMA_MOE_VLLM_WEIGHT_FORMAT=int8|int4|iq4nl: the layer holds integer experts, vLLM's bf16
    copies are released, the outputs follow float64 on the dequantized weights, and
    generation starts with stock vLLM's first tokens where the stock run's choice was clear."""
    prompt_list = vc.prompts(N_PROMPTS, vocab=SHAPE.vocab)
    stock = stock_run("qwen3_moe", "eager")
    # the tiny model's intermediate size is 64: groups of 32 columns per scale
    ours = vc.generate(models["qwen3_moe"], prompt_list, plugin=True, mode="eager", max_tokens=MAX_TOKENS,
                       extra_env={**IN_PROCESS, "NUMA_MOE_VLLM_WEIGHT_FORMAT": weight_format,
                                  "NUMA_MOE_VLLM_GROUP": "32"},
                       name=f"plugin-{weight_format}", probe_tokens=5)
    probe = ours.probe[0]
    assert probe["vllm_w13_bytes"] <= 2, "vLLM's bf16 expert weights were kept beside the int8 ones"
    check_probe(probe, models["qwen3_moe"], weight_format, 3e-2, group=32)
    if weight_format == "int8":  # int4's weight error moves the logits too far for this
        for s_tokens, o_tokens, s_lps in zip(stock.tokens, ours.tokens, stock.logprobs):
            if s_lps[0][0] - s_lps[0][1] > 0.2:
                assert o_tokens[0] == s_tokens[0]


def test_tensor_parallel_two_ranks(models, stock_run):
    """TP = 2 (vLLM's simulated two-node binding, VLLM_CPU_SIM_MULTI_NUMA=1, one CPU per
    rank here): each rank's layer holds half of every expert's intermediate rows and runs
    on its own rank's CPU; vLLM all-reduces; the tokens are stock vLLM's at TP = 1."""
    ours = vc.generate(models["qwen3_moe"], vc.prompts(N_PROMPTS, vocab=SHAPE.vocab), plugin=True, mode="eager",
                       max_tokens=MAX_TOKENS, name="plugin-tp2", tensor_parallel_size=2,
                       extra_env={"VLLM_CPU_SIM_MULTI_NUMA": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    assert len(ours.workers) == 2
    ranks_cpus = [tuple(w["openmp_bound_cpus"]) for w in ours.workers]
    assert len(set(ranks_cpus)) == 2, f"the ranks share CPUs: {ranks_cpus}"
    for worker in ours.workers:
        assert worker["experts"] == ["NumaMoEExperts"] and min(worker["calls"]) >= MAX_TOKENS
        assert worker["layer_shapes"] == [[SHAPE.experts, SHAPE.intermediate // 2, SHAPE.hidden]]
        assert worker["pool_threads"] == [len(worker["openmp_bound_cpus"])]
    comparison = vc.compare(stock_run("qwen3_moe", "eager"), ours)
    assert comparison.equal or comparison.ties_only, f"TP = 2 tokens {ours.tokens} (matched {comparison.matched})"


def test_weight_reload_lands_in_numa_moe_buffers(stock_run, plugin_run):
    """bf16: vLLM's w13/w2 parameters are numa-moe's buffers; zeroing them changes the
    output, and vLLM's reload_weights brings the checkpoint's values back into them."""
    ours = plugin_run("mixtral", "eager")
    assert ours.extra["shared_before_reload"] == [SHAPE.layers]
    assert ours.extra["tokens_zeroed"] != ours.tokens, "zeroing the experts changed nothing: not the buffers used"
    assert ours.extra["tokens_after_reload"] == ours.tokens == stock_run("mixtral", "eager").tokens
    assert ours.extra["shared_after_reload"] == [SHAPE.layers]


def test_unsupported_layer_falls_back_with_one_log_line(models):
    """float32 activations: numa-moe computes bf16 only, so vLLM's experts run and the
    plugin says why, once."""
    prompt_list = vc.prompts(2, vocab=SHAPE.vocab)
    run = vc.generate(models["mixtral"], prompt_list, plugin=True, mode="eager", max_tokens=2,
                      extra_env=IN_PROCESS, name="plugin-fp32", dtype="float32")
    assert ran_vllm_experts(run.workers), [w["experts"] for w in run.workers]
    lines = [line for line in run.log.splitlines() if "numa-moe: vLLM's own experts run" in line]
    assert len(lines) == 1 and "activation dtype torch.float32" in lines[0], run.log[-2000:]


def test_unsupported_reasons_name_the_problem():
    """The reasons the plugin logs when it leaves a layer to vLLM, on stand-ins of vLLM's
    FusedMoEConfig with one property changed at a time."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from numa_moe.integrations.vllm import unsupported_reason

    def config(**changes):
        fields = dict(activation=MoEActivation.SILU, in_dtype=torch.bfloat16, has_bias=False, use_ep=False,
                      swiglu_limit=None, swiglu_alpha=None, swiglu_beta=None, is_lora_enabled=False,
                      hidden_dim=2048, intermediate_size_per_partition=768)
        return SimpleNamespace(**{**fields, **changes})

    assert unsupported_reason(config()) is None
    assert unsupported_reason(config(), "int8", 128) is None
    assert unsupported_reason(config(activation=MoEActivation.SWIGLUOAI, has_bias=True)) is None
    assert "activation gelu" in unsupported_reason(config(activation=MoEActivation.GELU))
    assert "torch.float16" in unsupported_reason(config(in_dtype=torch.float16))
    assert "bias on a SiLU layer" in unsupported_reason(config(has_bias=True))
    assert "expert parallelism" in unsupported_reason(config(use_ep=True))
    assert "SwiGLU" in unsupported_reason(config(swiglu_limit=7.0))
    assert "LoRA" in unsupported_reason(config(is_lora_enabled=True))
    assert "intermediate size 96 not a multiple of the int4 group 64" in unsupported_reason(
        config(intermediate_size_per_partition=96), "int4", 64)

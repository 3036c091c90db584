"""Generated MoE checkpoints with the real models' expert shapes and tensor names.

``make_checkpoint`` writes a small safetensors checkpoint (plus ``config.json``) whose
routed experts have the hidden and intermediate sizes of a published model, under that
model's tensor names, filled with seeded random bf16 weights (normal / sqrt(fan_in)).
Only the number of layers and of routed experts is reduced, so that segment tables,
periods and kernel shapes are the real ones while the files stay small.

The files are written by ``numa_moe.checkpoints.writer``, one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from numa_moe.checkpoints.writer import (TensorPlan, building_directory, check_replaceable, real_output,
                                      write_safetensors)
from numa_moe.formats import NUMPY_DTYPES
from numa_moe.quant import MX_BLOCK

__all__ = [
    "ModelSpec",
    "MODEL_SPECS",
    "make_checkpoint",
    "checkpoint_plan",
    "model_config",
]

# One random block is generated at most this many elements at a time (memory bound).
_CHUNK_ELEMENTS = 1 << 23
_E8M0_BIAS = 127


@dataclass(frozen=True)
class ModelSpec:
    """Routed-expert shapes and naming of a published MoE model (from its config.json on
    the Hugging Face Hub)."""

    like: str
    model_type: str
    architecture: str
    # "mixtral" (block_sparse_moe.experts.E.w1/w2/w3), "mlp" (mlp.experts.E.*_proj) or
    # "gpt-oss" (mlp.experts.gate_up_proj_blocks ..., numa_moe.checkpoints.gpt_oss)
    naming: str
    hidden_size: int
    moe_intermediate_size: int
    n_experts: int
    top_k: int
    n_layers: int  # of the real model
    attention_heads: int
    kv_heads: int
    head_dim: int
    shared_kind: str | None = None  # "shared_expert" (Qwen2-MoE) or "shared_experts" (DeepSeek)
    shared_intermediate_size: int = 0
    default_layers: int = 1
    default_experts: int = 8
    extra_config: dict = field(default_factory=dict)


# config.json keys of openai/gpt-oss-20b and -120b beside the expert shapes
_GPT_OSS_CONFIG = {"swiglu_limit": 7.0, "sliding_window": 128, "rms_norm_eps": 1e-5,
                   "attention_bias": True, "vocab_size": 201088,
                   "quantization_config": {"quant_method": "mxfp4",
                                           "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                      "model.layers.*.mlp.router",
                                                                      "model.embed_tokens", "lm_head"]}}

MODEL_SPECS: dict[str, ModelSpec] = {
    spec.like: spec
    for spec in (
        ModelSpec("mixtral-8x7b", "mixtral", "MixtralForCausalLM", "mixtral", 4096, 14336, 8, 2, 32,
                  32, 8, 128, default_layers=1, default_experts=2,
                  extra_config={"intermediate_size": 14336}),
        ModelSpec("qwen3-30b-a3b", "qwen3_moe", "Qwen3MoeForCausalLM", "mlp", 2048, 768, 128, 8, 48,
                  32, 4, 128, default_layers=2, default_experts=16,
                  extra_config={"intermediate_size": 6144, "decoder_sparse_step": 1,
                                "norm_topk_prob": True}),
        ModelSpec("qwen3-235b", "qwen3_moe", "Qwen3MoeForCausalLM", "mlp", 4096, 1536, 128, 8, 94,
                  64, 4, 128, default_layers=1, default_experts=8,
                  extra_config={"intermediate_size": 12288, "decoder_sparse_step": 1,
                                "norm_topk_prob": True}),
        ModelSpec("qwen2-57b-a14b", "qwen2_moe", "Qwen2MoeForCausalLM", "mlp", 3584, 2560, 64, 8, 28,
                  28, 4, 128, shared_kind="shared_expert", shared_intermediate_size=20480,
                  default_layers=1, default_experts=4,
                  extra_config={"intermediate_size": 18944, "decoder_sparse_step": 1,
                                "norm_topk_prob": False}),
        ModelSpec("deepseek-v3", "deepseek_v3", "DeepseekV3ForCausalLM", "mlp", 7168, 2048, 256, 8, 61,
                  128, 128, 128, shared_kind="shared_experts", shared_intermediate_size=2048,
                  default_layers=1, default_experts=4,
                  extra_config={"intermediate_size": 18432, "n_shared_experts": 1,
                                "first_k_dense_replace": 0, "scoring_func": "sigmoid",
                                "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4}),
        ModelSpec("gpt-oss-20b", "gpt_oss", "GptOssForCausalLM", "gpt-oss", 2880, 2880, 32, 4, 24,
                  64, 8, 64, default_layers=1, default_experts=8, extra_config=_GPT_OSS_CONFIG),
        ModelSpec("gpt-oss-120b", "gpt_oss", "GptOssForCausalLM", "gpt-oss", 2880, 2880, 128, 4, 36,
                  64, 8, 64, default_layers=1, default_experts=8, extra_config=_GPT_OSS_CONFIG),
    )
}
# The released layout of gpt-oss: MXFP4 experts (group 32, e8m0 scales); "bf16" writes the
# layout transformers saves a dequantized GptOssForCausalLM in.
GPT_OSS_FORMATS = ("mxfp4", "bf16")


def _moe_prefix(spec: ModelSpec, layer: int) -> str:
    block = "block_sparse_moe" if spec.naming == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}"


def checkpoint_plan(spec: ModelSpec, n_layers: int, n_experts: int, hidden_size: int,
                    intermediate_size: int, fused: bool = False,
                    shared: bool = True, gpt_oss_format: str = "mxfp4") -> list[TensorPlan]:
    """Every tensor of the generated checkpoint, in file order."""
    bf16 = NUMPY_DTYPES["BF16"]
    H, I, E = hidden_size, intermediate_size, n_experts
    if spec.naming == "gpt-oss":
        return _gpt_oss_plan(n_layers, E, H, I, gpt_oss_format)
    plan: list[TensorPlan] = []
    for layer in range(n_layers):
        prefix = _moe_prefix(spec, layer)
        plan.append(TensorPlan(f"{prefix}.gate.weight", (E, H), bf16, H))
        if spec.like == "deepseek-v3":
            plan.append(TensorPlan(f"{prefix}.gate.e_score_correction_bias", (E,),
                                   np.dtype(np.float32), 1))
        if fused:
            # transformers >= 5 stores the experts of a layer as two 3-D parameters
            # (gate rows first, then up rows, in gate_up_proj).
            plan.append(TensorPlan(f"model.layers.{layer}.mlp.experts.gate_up_proj", (E, 2 * I, H),
                                   bf16, H))
            plan.append(TensorPlan(f"model.layers.{layer}.mlp.experts.down_proj", (E, H, I), bf16, I))
        else:
            names = (("w1", "w3", "w2") if spec.naming == "mixtral"
                     else ("gate_proj", "up_proj", "down_proj"))
            for e in range(E):
                base = f"{prefix}.experts.{e}"
                plan.append(TensorPlan(f"{base}.{names[0]}.weight", (I, H), bf16, H))
                plan.append(TensorPlan(f"{base}.{names[1]}.weight", (I, H), bf16, H))
                plan.append(TensorPlan(f"{base}.{names[2]}.weight", (H, I), bf16, I))
        if shared and spec.shared_kind:
            # Keeps the real ratio to the routed width when tests shrink the shapes.
            S = spec.shared_intermediate_size * I // spec.moe_intermediate_size
            base = f"model.layers.{layer}.mlp.{spec.shared_kind}"
            plan.append(TensorPlan(f"{base}.gate_proj.weight", (S, H), bf16, H))
            plan.append(TensorPlan(f"{base}.up_proj.weight", (S, H), bf16, H))
            plan.append(TensorPlan(f"{base}.down_proj.weight", (H, S), bf16, S))
            if spec.shared_kind == "shared_expert":
                plan.append(TensorPlan(f"model.layers.{layer}.mlp.shared_expert_gate.weight", (1, H),
                                       bf16, H))
    return plan


def _gpt_oss_plan(n_layers: int, E: int, H: int, I: int, fmt: str) -> list[TensorPlan]:
    """The expert and router tensors of gpt-oss (numa_moe.checkpoints.gpt_oss): MXFP4 as
    released (uint8 blocks and e8m0 scale bytes, gate and up rows interleaved), or BF16 as
    transformers saves GptOssExperts ([E, H, 2I] and [E, I, H], gate and up columns
    interleaved)."""
    bf16, u8 = NUMPY_DTYPES["BF16"], NUMPY_DTYPES["U8"]
    mx = MX_BLOCK
    plan: list[TensorPlan] = []
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}.mlp"
        plan.append(TensorPlan(f"{prefix}.router.weight", (E, H), bf16, H))
        plan.append(TensorPlan(f"{prefix}.router.bias", (E,), bf16, H))
        experts = f"{prefix}.experts"
        if fmt == "mxfp4":
            plan += [TensorPlan(f"{experts}.gate_up_proj_blocks", (E, 2 * I, H // mx, mx // 2), u8, H),
                     TensorPlan(f"{experts}.gate_up_proj_scales", (E, 2 * I, H // mx), u8, H)]
        else:
            plan.append(TensorPlan(f"{experts}.gate_up_proj", (E, H, 2 * I), bf16, H))
        plan.append(TensorPlan(f"{experts}.gate_up_proj_bias", (E, 2 * I), bf16, H))
        if fmt == "mxfp4":
            plan += [TensorPlan(f"{experts}.down_proj_blocks", (E, H, I // mx, mx // 2), u8, I),
                     TensorPlan(f"{experts}.down_proj_scales", (E, H, I // mx), u8, I)]
        else:
            plan.append(TensorPlan(f"{experts}.down_proj", (E, I, H), bf16, I))
        plan.append(TensorPlan(f"{experts}.down_proj_bias", (E, H), bf16, I))
    return plan


def model_config(spec: ModelSpec, n_layers: int, n_experts: int, hidden_size: int,
            intermediate_size: int, seed: int, fused: bool, gpt_oss_format: str = "mxfp4") -> dict:
    config = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": n_layers,
        "num_attention_heads": spec.attention_heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "num_experts_per_tok": min(spec.top_k, n_experts),
        "torch_dtype": "bfloat16",
    }
    config.update(spec.extra_config)
    if spec.model_type == "gpt_oss":
        config["num_local_experts"] = n_experts
        config["intermediate_size"] = intermediate_size
        if gpt_oss_format != "mxfp4":  # transformers drops it when it saves dequantized
            config.pop("quantization_config")
    elif spec.model_type == "mixtral":
        config["num_local_experts"] = n_experts
        config["intermediate_size"] = intermediate_size
    elif spec.model_type == "deepseek_v3":
        config["n_routed_experts"] = n_experts
        config["moe_intermediate_size"] = intermediate_size
        config["n_group"] = 1  # group-limited routing needs n_experts divisible by groups
        config["topk_group"] = 1
    else:
        config["num_experts"] = n_experts
        config["moe_intermediate_size"] = intermediate_size
        if spec.shared_kind == "shared_expert":
            config["shared_expert_intermediate_size"] = spec.shared_intermediate_size
    config["numa_moe_synthetic"] = {
        "like": spec.like, "seed": seed, "fused_experts": fused,
        "real_num_experts": spec.n_experts, "real_num_hidden_layers": spec.n_layers,
        "real_num_experts_per_tok": spec.top_k,
    }
    return config


def _random_bytes(plan: TensorPlan, rng: np.random.Generator) -> Iterable[bytes]:
    """The tensor's values in row-major chunks: normal(0, 1/sqrt(fan_in)) in its dtype;
    MXFP4 blocks (uint8) uniform e2m1 codes, their scales (uint8 ``*_scales``) e8m0 bytes
    around the power of two that puts the codes at that spread."""
    total = math.prod(plan.shape)
    scale = np.float32(1.0 / np.sqrt(plan.fan_in))
    done = 0
    if plan.dtype == np.uint8:
        # uniform codes have an RMS of about 3.2 (in e2m1 units)
        center = _E8M0_BIAS + round(math.log2(float(scale) / 3.2))
        while done < total:
            count = min(_CHUNK_ELEMENTS, total - done)
            if plan.name.endswith("_scales"):
                block = rng.integers(center - 1, center + 2, count, dtype=np.uint8)
            else:
                block = rng.integers(0, 256, count, dtype=np.uint8)
            yield block.tobytes()
            done += count
        return
    while done < total:
        count = min(_CHUNK_ELEMENTS, total - done)
        block = rng.standard_normal(count, dtype=np.float32)
        block *= scale
        yield block.astype(plan.dtype).tobytes()
        done += count


def _shards(plans: list[TensorPlan], max_shard_bytes: int) -> list[list[TensorPlan]]:
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for plan in plans:
        if shards[-1] and size + plan.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(plan)
        size += plan.nbytes
    return shards


def make_checkpoint(out_dir: str | os.PathLike, like: str = "qwen3-30b-a3b",
                    layers: int | None = None, experts: int | None = None, seed: int = 0,
                    *, hidden_size: int | None = None, intermediate_size: int | None = None,
                    fused: bool = False, shared: bool = True,
                    max_shard_bytes: int = 512 << 20, progress: bool = True,
                    overwrite: bool = False, weight_format: str | None = None,
                    group: int | None = None, scale_dtype: str | None = None) -> Path:
    """Write a generated checkpoint into ``out_dir`` and return the directory.

    ``out_dir`` must be new, empty or an earlier numa-moe output (``is_earlier_output``);
    anything else is refused, ``overwrite`` or not (it is accepted for compatibility and
    changes nothing: nothing the user wrote is ever replaced). The checkpoint is built in a temporary sibling directory and swapped in at the end, so an
    interrupted run leaves ``out_dir`` as it was.

    ``layers``/``experts`` default to the model's small defaults (``MODEL_SPECS``);
    ``hidden_size``/``intermediate_size`` override the real shapes (tests only).
    Output above ``max_shard_bytes`` is sharded with a ``model.safetensors.index.json``.
    gpt-oss models are written in their own layouts (``numa_moe.checkpoints.gpt_oss``):
    ``weight_format`` None or "mxfp4" the released MXFP4 one, "bf16" transformers' BF16 one
    (``fused`` and ``shared`` do not apply).
    Other models: ``weight_format`` None or "bf16" writes BF16;
    "int8"/"int4"/"mxfp4": the routed experts are then quantized
    (``numa_moe.checkpoints.quantize``, ``group``, ``scale_dtype``, by default the format's
    own or 128 and fp16); the result equals generating the
    BF16 checkpoint and quantizing it.
    """
    if like not in MODEL_SPECS:
        raise ValueError(f"unknown model {like!r}; choose one of {', '.join(MODEL_SPECS)}")
    spec = MODEL_SPECS[like]
    n_layers = spec.default_layers if layers is None else int(layers)
    n_experts = spec.default_experts if experts is None else int(experts)
    H = spec.hidden_size if hidden_size is None else int(hidden_size)
    I = spec.moe_intermediate_size if intermediate_size is None else int(intermediate_size)
    if not 1 <= n_layers <= spec.n_layers:
        raise ValueError(f"layers must be in 1..{spec.n_layers} for {like} (the real model's count), "
                         f"got {n_layers}")
    if not 1 <= n_experts <= spec.n_experts:
        raise ValueError(f"experts must be in 1..{spec.n_experts} for {like}, got {n_experts}")
    if H < 1 or I < 1:
        raise ValueError(f"hidden_size and intermediate_size must be >= 1, got {H}, {I}")
    given = Path(out_dir)
    if weight_format == "bf16":
        weight_format = None if spec.naming != "gpt-oss" else "bf16"
    if spec.naming == "gpt-oss":
        # gpt-oss has its own file layouts (the released MXFP4 one by default): written
        # directly, never by quantizing a BF16 checkpoint
        gpt_oss_format = "mxfp4" if weight_format is None else weight_format
        if gpt_oss_format not in GPT_OSS_FORMATS:
            raise ValueError(f"{like} checkpoints are written in {' or '.join(GPT_OSS_FORMATS)} "
                             f"(the released MXFP4 layout, or transformers' BF16 one), not "
                             f"{gpt_oss_format}; quantize while loading instead (--format of run)")
        if (group, scale_dtype) not in ((None, None), (MX_BLOCK, "e8m0")) and gpt_oss_format == "mxfp4" \
                or gpt_oss_format == "bf16" and (group, scale_dtype) != (None, None):
            raise ValueError(f"{like}: the released layout has MXFP4 group {MX_BLOCK} and e8m0 scales; "
                             "group and scale dtype take no other values")
        if gpt_oss_format == "mxfp4":
            for what, cols in (("hidden_size", H), ("intermediate_size", I)):
                if cols % MX_BLOCK:
                    raise ValueError(f"{what} {cols} is not a multiple of the MXFP4 block {MX_BLOCK}")
        _check_disk(given, checkpoint_plan(spec, n_layers, n_experts, H, I,
                                           gpt_oss_format=gpt_oss_format), quantized=False)
        check_replaceable(given, overwrite=True, command="make-checkpoint")
        with building_directory(given) as build:
            _write_checkpoint(build, spec, n_layers, n_experts, H, I, seed, True, False,
                              max_shard_bytes, progress, like, gpt_oss_format)
        return given
    _check_disk(given, checkpoint_plan(spec, n_layers, n_experts, H, I, fused=fused, shared=shared),
                quantized=weight_format is not None)
    check_replaceable(given, overwrite=True, command="make-checkpoint")
    if weight_format is not None:
        from numa_moe.checkpoints.quantize import quantize_checkpoint

        parent = real_output(given).absolute().parent
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{given.name}.", suffix=".bf16.tmp",
                                         dir=parent) as tmp:
            source = make_checkpoint(Path(tmp) / "bf16", like, layers, experts, seed,
                                     hidden_size=hidden_size, intermediate_size=intermediate_size,
                                     fused=fused, shared=shared, max_shard_bytes=max_shard_bytes,
                                     progress=progress)
            quantize_checkpoint(source, given, weight_format, group, scale_dtype, overwrite=True,
                                progress=progress)
        return given
    with building_directory(given) as build:
        _write_checkpoint(build, spec, n_layers, n_experts, H, I, seed, fused, shared,
                          max_shard_bytes, progress, like)
    return given


def _check_disk(out: Path, plans: list[TensorPlan], quantized: bool) -> None:
    """Refuses a checkpoint the output's file system has no room for, before writing: the
    tensors' bytes (for a quantized one also its BF16 source, written first beside it)."""
    needed = sum(plan.nbytes for plan in plans) * (2 if quantized else 1)
    folder = real_output(out).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ValueError(f"the checkpoint needs about {needed / 2**30:,.1f} GiB of disk; {folder} has "
                         f"{free / 2**30:,.1f} GiB free")


def _write_checkpoint(out: Path, spec: ModelSpec, n_layers: int, n_experts: int, H: int, I: int,
                      seed: int, fused: bool, shared: bool, max_shard_bytes: int, progress: bool,
                      like: str, gpt_oss_format: str = "mxfp4") -> None:
    plans = checkpoint_plan(spec, n_layers, n_experts, H, I, fused=fused, shared=shared,
                            gpt_oss_format=gpt_oss_format)
    # One generator per tensor, derived from (seed, tensor index): the values do not
    # depend on how the tensors are sharded.
    seeds = np.random.SeedSequence(seed).spawn(len(plans))
    rng_of = {plan.name: np.random.default_rng(s) for plan, s in zip(plans, seeds)}
    shards = _shards(plans, max_shard_bytes)
    total = sum(p.nbytes for p in plans)

    from tqdm.auto import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
              desc=f"make-checkpoint {like}") as bar:
        if len(shards) == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards):
            write_safetensors(out / name, shard, lambda p: _random_bytes(p, rng_of[p.name]),
                              on_bytes=bar.update)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {p.name: n for n, shard in zip(names, shards) for p in shard}}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = model_config(spec, n_layers, n_experts, H, I, seed, fused, gpt_oss_format)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

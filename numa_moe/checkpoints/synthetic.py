"""Generated MoE checkpoints with the real models' expert shapes and tensor names.

``make_checkpoint`` writes a small safetensors checkpoint (plus ``config.json``) whose
routed experts have the hidden and intermediate sizes of a published model, under that
model's tensor names, filled with seeded random bf16 weights (normal / sqrt(fan_in)).
Only the number of layers and of routed experts is reduced, so that segment tables,
periods and kernel shapes are the real ones while the files stay small.

The writer is self-contained (safetensors is a simple format: an 8-byte little-endian
header length, a JSON header, then the raw tensor bytes); it streams one tensor at a
time so memory stays at about one tensor. The reader side is tested against the
`safetensors` library itself.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

__all__ = [
    "ModelSpec",
    "MODEL_SPECS",
    "TensorPlan",
    "make_checkpoint",
    "write_safetensors",
    "checkpoint_plan",
    "building_directory",
    "check_replaceable",
    "is_earlier_output",
    "OUTPUT_MARKER",
    "NUMPY_DTYPES",
]

_DTYPE_CODES = {
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
    np.dtype(np.bool_): "BOOL",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
}
# safetensors dtype code -> numpy dtype (what a copied tensor is written as)
NUMPY_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

# One random block is generated at most this many elements at a time (memory bound).
_CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class ModelSpec:
    """Routed-expert shapes and naming of a published MoE model (from its config.json on
    the Hugging Face Hub)."""

    like: str
    model_type: str
    architecture: str
    naming: str  # "mixtral" (block_sparse_moe.experts.E.w1/w2/w3) or "mlp" (mlp.experts.E.*_proj)
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
    )
}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: name, shape, dtype and the fan-in that scales its values."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fan_in: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # exact: never wraps


def _moe_prefix(spec: ModelSpec, layer: int) -> str:
    block = "block_sparse_moe" if spec.naming == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}"


def checkpoint_plan(spec: ModelSpec, n_layers: int, n_experts: int, hidden_size: int,
                    intermediate_size: int, fused: bool = False,
                    shared: bool = True) -> list[TensorPlan]:
    """Every tensor of the generated checkpoint, in file order."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    H, I, E = hidden_size, intermediate_size, n_experts
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


def _config(spec: ModelSpec, n_layers: int, n_experts: int, hidden_size: int,
            intermediate_size: int, seed: int, fused: bool) -> dict:
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
    if spec.model_type == "mixtral":
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
    """The tensor's values in row-major chunks: normal(0, 1/sqrt(fan_in)) in its dtype."""
    total = math.prod(plan.shape)
    scale = np.float32(1.0 / np.sqrt(plan.fan_in))
    done = 0
    while done < total:
        count = min(_CHUNK_ELEMENTS, total - done)
        block = rng.standard_normal(count, dtype=np.float32)
        block *= scale
        yield block.astype(plan.dtype).tobytes()
        done += count


def write_safetensors(path: str | os.PathLike, plans: list[TensorPlan],
                      chunks: Callable[[TensorPlan], Iterable[bytes]],
                      metadata: dict | None = None, on_bytes: Callable[[int], None] | None = None
                      ) -> None:
    """Write a safetensors file tensor by tensor (header first, then the streamed data)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for plan in plans:
        header[plan.name] = {"dtype": _DTYPE_CODES[plan.dtype], "shape": list(plan.shape),
                             "data_offsets": [offset, offset + plan.nbytes]}
        offset += plan.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors does
    tmp = Path(str(path) + ".tmp")
    try:
        _write_safetensors_to(tmp, raw, plans, chunks, on_bytes)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_safetensors_to(tmp: Path, raw: bytes, plans: list[TensorPlan],
                          chunks: Callable[[TensorPlan], Iterable[bytes]],
                          on_bytes: Callable[[int], None] | None) -> None:
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for plan in plans:
            written = 0
            for chunk in chunks(plan):
                f.write(chunk)
                written += len(chunk)
                if on_bytes:
                    on_bytes(len(chunk))
            if written != plan.nbytes:
                raise RuntimeError(f"internal error: {plan.name} produced {written} bytes, "
                                   f"expected {plan.nbytes}")


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
                    group: int = 128, scale_dtype: str = "fp16") -> Path:
    """Write a generated checkpoint into ``out_dir`` and return the directory.

    ``out_dir`` must be new, empty or an earlier numa-moe output (``is_earlier_output``);
    anything else is refused, ``overwrite`` or not (it is accepted for compatibility and
    changes nothing: nothing the user wrote is ever replaced). The checkpoint is built in a temporary sibling directory and swapped in at the end, so an
    interrupted run leaves ``out_dir`` as it was.

    ``layers``/``experts`` default to the model's small defaults (``MODEL_SPECS``);
    ``hidden_size``/``intermediate_size`` override the real shapes (tests only).
    Output above ``max_shard_bytes`` is sharded with a ``model.safetensors.index.json``.
    ``weight_format`` "int8"/"int4": the routed experts are then quantized
    (``numa_moe.checkpoints.quantize``, ``group``, ``scale_dtype``); the result equals generating the
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
    _check_disk(given, checkpoint_plan(spec, n_layers, n_experts, H, I, fused=fused, shared=shared),
                quantized=weight_format is not None)
    check_replaceable(given, overwrite=True, command="make-checkpoint")
    if weight_format is not None:
        from numa_moe.checkpoints.quantize import quantize_checkpoint

        parent = _real_output(given).absolute().parent
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
    folder = _real_output(out).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ValueError(f"the checkpoint needs about {needed / 2**30:,.1f} GiB of disk; {folder} has "
                         f"{free / 2**30:,.1f} GiB free")


def _real_output(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    if out.is_symlink():  # build beside the directory it names; the link stays
        out = Path(os.path.realpath(out))
    return out


@contextmanager
def building_directory(out_dir: str | os.PathLike):
    """Build a directory atomically: yields a temporary sibling of ``out_dir`` to write
    into; when the block ends normally it is swapped in whole for ``out_dir`` (created or
    replaced), else removed. An interrupted run leaves ``out_dir`` as it was (the
    previous content or nothing, never a mix) and no temporary behind. A symlinked
    ``out_dir`` is built beside the directory it names; the link stays. The caller
    decides first whether ``out_dir`` may be replaced (``check_replaceable``). The build
    gets an ``OUTPUT_MARKER`` listing its files, which is what lets a later run tell an
    earlier output from a directory of the user's."""
    out = _real_output(out_dir)
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.absolute().parent))
    try:
        yield build
        _write_marker(build)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(build, 0o777 & ~umask)  # mkdtemp's 0700 would surprise a user sharing it
        _swap_in(build, out)
    finally:
        shutil.rmtree(build, ignore_errors=True)  # the new build, or the old checkpoint


# Every directory numa-moe builds (make-checkpoint, quantize) holds this file, listing
# the other files it wrote: a directory whose entries are exactly those is an earlier
# output and may be replaced; anything else may hold the user's files and never is.
OUTPUT_MARKER = ".numa-moe-output.json"
_MARKER_LIMIT = 1 << 20
# Files make_checkpoint wrote before outputs were marked: a directory holding only these,
# with a config.json that says it was generated, is an earlier output as well.
_OWN_FILE = re.compile(r"config\.json|model\.safetensors|model\.safetensors\.index\.json"
                       r"|model-\d{5}-of-\d{5}\.safetensors")


def _write_marker(build: Path) -> None:
    files = sorted(p.name for p in build.iterdir() if p.name != OUTPUT_MARKER)
    (build / OUTPUT_MARKER).write_text(json.dumps({"written_by": "numa-moe", "files": files},
                                                  indent=1) + "\n")


def is_earlier_output(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds exactly what an earlier make-checkpoint or quantize
    wrote: its ``OUTPUT_MARKER`` lists exactly its other entries (or, written before
    the marker existed, only make-checkpoint's file names and a generated config.json)."""
    from numa_moe.checkpoints.safetensors import CheckpointError, read_json_file

    directory = Path(directory)
    entries = sorted(p.name for p in directory.iterdir())
    if OUTPUT_MARKER in entries:
        try:
            marker = read_json_file(directory / OUTPUT_MARKER, "numa-moe output marker",
                                    _MARKER_LIMIT)
        except CheckpointError:
            return False
        listed = marker.get("files") if isinstance(marker, dict) else None
        return (isinstance(listed, list) and all(isinstance(n, str) for n in listed)
                and sorted(listed) == [n for n in entries if n != OUTPUT_MARKER])
    if not entries or not all(_OWN_FILE.fullmatch(name) for name in entries):
        return False
    try:
        config = read_json_file(directory / "config.json", "config.json", _MARKER_LIMIT)
    except CheckpointError:
        return False
    return isinstance(config, dict) and isinstance(config.get("numa_moe_synthetic"), dict)


def check_replaceable(out_dir: str | os.PathLike, overwrite: bool, command: str) -> None:
    """Refuse (ValueError, one line) to build ``out_dir`` over anything but nothing, an
    empty directory or an earlier numa-moe output (``is_earlier_output``); an earlier
    output is replaced only with ``overwrite``. A symlinked ``out_dir`` is judged by the
    directory it names (the one replaced)."""
    given = Path(out_dir)
    out = _real_output(given)
    if not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise ValueError(f"{given}: exists and is not a directory; the output must be a directory")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not is_earlier_output(out):
        shown = ", ".join(entries[:3]) + (" ..." if len(entries) > 3 else "")
        raise ValueError(f"{given}: not empty and not an earlier numa-moe output (it holds "
                         f"{shown}); refusing to replace it, with or without --overwrite. "
                         "Choose a new or empty directory")
    if not overwrite:
        raise ValueError(f"{given}: exists and is not empty (an earlier output of numa-moe); "
                         f"pass --overwrite to replace it, or choose a new or empty directory "
                         f"for {command}")


_RENAME_EXCHANGE = 2


def _swap_in(build: Path, out: Path) -> None:
    """Put ``build`` at ``out``; the previous ``out`` (if any) ends up at ``build``.

    One renameat2(RENAME_EXCHANGE) where Linux offers it, so ``out`` is never missing or
    half-written; elsewhere two renames, undone if the second one fails.
    """
    if not (out.exists() or out.is_symlink()):
        os.rename(build, out)
        build.mkdir()  # the caller removes it
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd = -100
        if renameat2(at_fdcwd, os.fsencode(build), at_fdcwd, os.fsencode(out), _RENAME_EXCHANGE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: no exchange here
            raise OSError(err, f"cannot swap {build} into {out}: {os.strerror(err)}")
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old.tmp", dir=build.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(build, out)
    except BaseException:
        os.rename(old, out)
        raise
    os.rename(old, build)


def _write_checkpoint(out: Path, spec: ModelSpec, n_layers: int, n_experts: int, H: int, I: int,
                      seed: int, fused: bool, shared: bool, max_shard_bytes: int, progress: bool,
                      like: str) -> None:
    plans = checkpoint_plan(spec, n_layers, n_experts, H, I, fused=fused, shared=shared)
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
    config = _config(spec, n_layers, n_experts, H, I, seed, fused)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

"""Quantize a BF16/F16/F32 checkpoint's routed experts to INT8, INT4, MXFP4 or IQ4_NL (``numa-moe quantize``).

Writes the checkpoint layout of docs/quantization.md ("Checkpoints"): every routed-expert
weight keeps its name and becomes ``I8 [rows, cols]`` (int8) or ``U8 [rows, cols / 2]``
(int4, mxfp4 and iq4nl, two weights per byte, the even column in the low nibble), followed in the same file
by its group scales ``<name without .weight>.weight_scale`` ``[rows, cols / group]`` in the
scale dtype; every file's ``__metadata__`` gains ``numa_moe.quant``, ``numa_moe.group``
and ``numa_moe.scale_dtype``. Every other tensor is copied byte for byte, shards keep
their names and tensors, the index is rewritten, and the other files of the directory
(config.json, tokenizer, ...) are copied.

Quantization is ``numa_moe.quant.quantize``, expert matrix by expert matrix (one matrix
in float32 at a time, also for fused 3-D tensors). The output is built in a temporary
sibling directory and swapped in whole (``writer.building_directory``, the helper
``make-checkpoint`` uses): an error or an interrupt leaves OUT as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from numa_moe import quant as q
from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.checkpoints.expert_import import quantize_into
from numa_moe.checkpoints.naming import NamingPattern
from numa_moe.checkpoints.safetensors import (QUANT_METADATA, Checkpoint, ExpertMatrix, TensorInfo, overlapping_source, read_matrix_into, read_safetensors_header, scale_tensor_name)
from numa_moe.checkpoints.writer import TensorPlan, building_directory, check_replaceable, write_safetensors
from numa_moe.files import CheckpointError, OpenFiles, byte_progress, open_checkpoint_file
from numa_moe.formats import FLOAT_FORMATS, GROUPS, NUMPY_DTYPES, QUANT_DTYPES, SCALE_DTYPES, nibble_packed, scale_columns

__all__ = ["QuantizeResult", "quantize_checkpoint", "quantize_expert", "FLOAT_DTYPES"]

FLOAT_DTYPES = tuple(FLOAT_FORMATS)
_COPY_CHUNK = 16 << 20


@dataclass(frozen=True)
class QuantizeResult:
    output: Path
    fmt: str
    group: int
    scale_dtype: str
    bytes_before: int  # all safetensors files
    bytes_after: int
    expert_bytes_before: int  # the routed-expert weights alone
    expert_bytes_after: int  # their values plus scales
    tensors_quantized: int
    not_copied: tuple[str, ...] = ()  # entries of the source directory left out, and why


def quantize_expert(matrix: ExpertMatrix, fd: int, fmt: str, group: int, scale_dtype: str,
                    values: np.ndarray | None = None, scales: np.ndarray | None = None) -> q.QuantizedMatrix:
    """Read one float expert matrix from its file and quantize it (numa_moe.quant's rule,
    expert_import.quantize_into) into ``values`` and ``scales`` (a store's rows; new arrays
    when None); NaN/Inf weights are a CheckpointError naming the tensor."""
    src = np.empty((matrix.rows, matrix.cols), dtype=NUMPY_DTYPES[matrix.dtype])
    read_matrix_into(matrix, src, fd)
    if values is None or scales is None:
        value_cols = matrix.cols // 2 if nibble_packed(fmt) else matrix.cols
        values = np.empty((matrix.rows, value_cols), dtype=NUMPY_DTYPES[QUANT_DTYPES[fmt]])
        scales = np.empty((matrix.rows, scale_columns(fmt, matrix.cols, group)), dtype=SCALE_DTYPES[scale_dtype])
    try:
        quantize_into(src, fmt, group, scale_dtype, values, scales)
    except ValueError as err:
        raise CheckpointError(f"{matrix.tensor.path}: tensor {matrix.tensor.name!r} (layer {matrix.layer} expert "
                              f"{matrix.expert} {matrix.kind}): {err}; cannot quantize it") from None
    return q.QuantizedMatrix(fmt, group, values, scales)


def _check_request(ck: Checkpoint, fmt: str, group: int, scale_dtype: str) -> None:
    q.check_arguments(weight_format=fmt, group=group, scale_dtype=scale_dtype)
    if ck.importer is not None:
        raise CheckpointError(f"{ck.root}: a {ck.importer.source} checkpoint; quantize writes "
                              "safetensors from safetensors. Load it directly instead: the store "
                              "converts its experts (ExpertStore.load(..., weight_format=...), "
                              "--format of run, tables and inspect)")
    if ck.quant is not None:
        raise CheckpointError(f"{ck.root}: already quantized ({ck.quant.describe()}); quantize "
                              "reads a BF16, F16 or F32 checkpoint")
    if ck.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{ck.root}: routed experts are {ck.dtype}; quantize reads "
                              f"{', '.join(FLOAT_DTYPES)} checkpoints")
    d = ck.dims
    for kind, cols in (("gate/up", d.hidden_size), ("down", d.intermediate_size)):
        if nibble_packed(fmt) and cols % 2:
            raise ValueError(f"{ck.root}: {kind} matrices have {cols} columns, an odd count: "
                             f"{fmt} packs two columns per byte and needs an even count")
        if cols % group:
            raise ValueError(f"{ck.root}: group {group} does not divide the {cols} columns of the "
                             f"{kind} matrices; choose a group from {', '.join(map(str, GROUPS))} "
                             f"that divides {cols}")


def _check_output(ck: Checkpoint, out: Path, overwrite: bool) -> None:
    source = overlapping_source(out, ck.sources)
    if source is not None:
        raise ValueError(f"{out}: would contain or lie inside {source}, a file or directory of "
                         "the source checkpoint; choose a directory apart from it")
    check_replaceable(out, overwrite, "quantize")


def quantize_checkpoint(checkpoint: str | os.PathLike | Checkpoint, output: str | os.PathLike,
                        fmt: str = "int8", group: int | None = None, scale_dtype: str | None = None,
                        overwrite: bool = False, progress: bool = True,
                        pattern: NamingPattern | None = None) -> QuantizeResult:
    """Write the quantized copy of ``checkpoint`` into the directory ``output``.
    ``group`` and ``scale_dtype`` default to the format's own (mxfp4: 32, e8m0; iq4nl: 32), else
    to 128 and fp16 (``numa_moe.quant.scale_layout``).

    Refuses (ValueError / CheckpointError, one line): an already quantized or non-float
    checkpoint, a group that does not divide the experts' columns, odd columns for int4,
    NaN/Inf weights, an ``output`` that contains or lies inside a file or directory of the
    source (links resolved), and an ``output`` that is not empty unless it holds exactly
    an earlier numa-moe output and ``overwrite`` is given
    (``writer.check_replaceable``).
    """
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, pattern=pattern)
    q.check_arguments(weight_format=fmt)
    group, scale_dtype = q.scale_layout(fmt, group, scale_dtype)
    _check_request(ck, fmt, group, scale_dtype)
    out = Path(output)
    _check_output(ck, out, overwrite)
    src_dir = ck.root if ck.root.is_dir() else ck.root.parent
    by_tensor = _matrices_by_tensor(ck)
    bytes_before = sum(p.stat().st_size for p in ck.files)
    expert_before = sum(m.nbytes for mats in by_tensor.values() for m in mats)
    total_in = sum(info.nbytes for info in ck.tensors.values())
    with OpenFiles() as files, building_directory(out) as build, \
            byte_progress(total_in, f"quantize {fmt}", progress) as bar:
        writer = _ShardWriter(ck, by_tensor, fmt, group, scale_dtype, files, bar)
        weight_map: dict[str, str] = {}
        for path in ck.files:
            for plan in writer.write(path, build):
                weight_map[plan.name] = path.name
        not_copied = _copy_other_files(ck, src_dir, build, weight_map)
    bytes_after = sum((out / p.name).stat().st_size for p in ck.files)
    return QuantizeResult(out, fmt, group, scale_dtype, bytes_before, bytes_after, expert_before,
                          writer.expert_bytes_after, len(by_tensor), tuple(not_copied))


def _matrices_by_tensor(ck: Checkpoint) -> dict[str, list[ExpertMatrix]]:
    """Tensor name -> its expert matrices (1, or E / 2E of a fused tensor), in file order."""
    by_tensor: dict[str, list[ExpertMatrix]] = {}
    for m in ck.expert_matrices():
        by_tensor.setdefault(m.tensor.name, []).append(m)
    for mats in by_tensor.values():
        mats.sort(key=lambda m: m.file_offset)
    return by_tensor


def _tensors_by_file(ck: Checkpoint) -> dict[Path, list[TensorInfo]]:
    """File -> its tensors, in file order."""
    by_file: dict[Path, list[TensorInfo]] = {}
    for info in ck.tensors.values():
        by_file.setdefault(info.path, []).append(info)
    return {path: sorted(infos, key=lambda t: t.file_offset) for path, infos in by_file.items()}


# What a planned tensor's bytes are: "copy" (the source tensor as it is), "values" (the
# quantized values of an expert tensor) or "scales" (their group scales).
_Source = tuple[str, TensorInfo]


def _shard_plans(path: Path, infos: list[TensorInfo], ck: Checkpoint,
                 by_tensor: dict[str, list[ExpertMatrix]], fmt: str, group: int,
                 scale_dtype: str) -> tuple[list[TensorPlan], dict[str, _Source]]:
    """The tensors of the quantized copy of one file, in order, and where each one's
    bytes come from: an expert tensor becomes its values followed by its scales, every
    other tensor is copied."""
    value_dtype = NUMPY_DTYPES[QUANT_DTYPES[fmt]]
    plans, sources = [], {}
    for info in infos:
        if info.name in by_tensor:
            cols = info.shape[-1]
            shape = (*info.shape[:-1], cols // 2 if nibble_packed(fmt) else cols)
            plan = TensorPlan(info.name, shape, value_dtype, 1)
            scale_name = scale_tensor_name(info.name)
            if scale_name in ck.tensors:
                raise CheckpointError(f"{path}: tensor {scale_name!r} already exists; "
                                      "it would collide with the scales of "
                                      f"{info.name!r}")
            scale_plan = TensorPlan(scale_name, (*info.shape[:-1], scale_columns(fmt, cols, group)),
                                    SCALE_DTYPES[scale_dtype], 1)
            plans += [plan, scale_plan]
            sources[plan.name] = ("values", info)
            sources[scale_plan.name] = ("scales", info)
        else:
            if info.dtype not in NUMPY_DTYPES:
                raise CheckpointError(f"{path}: tensor {info.name!r} has dtype "
                                      f"{info.dtype}, which cannot be copied")
            plan = TensorPlan(info.name, info.shape, NUMPY_DTYPES[info.dtype], 1)
            plans.append(plan)
            sources[plan.name] = ("copy", info)
    return plans, sources


def _quantized_metadata(metadata, fmt: str, group: int, scale_dtype: str) -> dict[str, str]:
    """A file's ``__metadata__`` (as strings) with the quantization keys added."""
    if not isinstance(metadata, dict) or not metadata:
        metadata = {"format": "pt"}
    metadata = {str(k): str(v) for k, v in metadata.items()}
    metadata.update(zip(QUANT_METADATA, (fmt, str(group), scale_dtype)))
    return metadata


class _ShardWriter:
    """Writes the quantized copy of the checkpoint's files, one file per ``write``.

    A values tensor is streamed expert by expert; the scales each expert yields are kept
    until the scales tensor that follows it is written."""

    def __init__(self, ck: Checkpoint, by_tensor: dict[str, list[ExpertMatrix]], fmt: str,
                 group: int, scale_dtype: str, files: OpenFiles, bar):
        self.ck, self.by_tensor = ck, by_tensor
        self.fmt, self.group, self.scale_dtype = fmt, group, scale_dtype
        self.files, self.bar = files, bar
        self.tensors_by_file = _tensors_by_file(ck)
        self.pending_scales: dict[str, list[bytes]] = {}
        self.expert_bytes_after = 0  # values plus scales of the expert tensors written

    def write(self, path: Path, build: Path) -> list[TensorPlan]:
        """Write the copy of ``path`` into ``build``; returns its tensors."""
        _, metadata = read_safetensors_header(path)
        plans, sources = _shard_plans(path, self.tensors_by_file.get(path, []), self.ck,
                                      self.by_tensor, self.fmt, self.group, self.scale_dtype)
        self.expert_bytes_after += sum(plan.nbytes for plan in plans
                                       if sources[plan.name][0] != "copy")
        write_safetensors(build / path.name, plans, lambda plan: self._chunks(*sources[plan.name]),
                          metadata=_quantized_metadata(metadata, self.fmt, self.group,
                                                       self.scale_dtype))
        return plans

    def _chunks(self, role: str, info: TensorInfo) -> Iterable[bytes]:
        if role == "copy":
            yield from _copy_bytes(info, self.files.fd(info.path), self.bar)
        elif role == "values":
            scales = self.pending_scales[info.name] = []
            for m in self.by_tensor[info.name]:
                qm = quantize_expert(m, self.files.fd(m.tensor.path), self.fmt, self.group,
                                     self.scale_dtype)
                scales.append(qm.scales.tobytes())
                self.bar.update(m.nbytes)
                yield qm.q.tobytes()
        else:
            yield from self.pending_scales.pop(info.name)


def _copy_bytes(info: TensorInfo, fd: int, bar) -> Iterable[bytes]:
    done = 0
    while done < info.nbytes:
        want = min(_COPY_CHUNK, info.nbytes - done)
        chunk = os.pread(fd, want, info.file_offset + done)
        if not chunk:
            raise CheckpointError(f"{info.path}: file ended while reading tensor {info.name!r}; it "
                                  "changed since its header was read")
        done += len(chunk)
        bar.update(len(chunk))
        yield chunk


def _copy_other_files(ck: Checkpoint, src_dir: Path, build: Path,
                      weight_map: dict[str, str]) -> list[str]:
    """The index (rewritten with the scale tensors) and every other regular file of the
    checkpoint directory (config.json, tokenizer, ...), copied as they are; returns what
    was left out (sub-directories, special files, dangling links). Links are followed,
    as for the shards (a Hugging Face snapshot is a directory of links into its blobs):
    the copy holds the files' contents. A checkpoint named by
    one file brings only that file and its directory's config.json."""
    shards = {p.name for p in ck.files}
    index_names = {"model.safetensors.index.json"} | {
        p.name for p in src_dir.glob("*.safetensors.index.json")}
    not_copied = []
    if ck.root.is_dir():
        others = []
        for p in sorted(src_dir.iterdir()):
            if p.name in shards or p.name.startswith("."):
                continue
            if p.is_dir():
                not_copied.append(f"{p.name}/ (a directory)")
            elif not p.is_file():
                not_copied.append(f"{p.name} (not a regular file)")
            else:
                others.append(p)
    else:
        others = [p for p in (src_dir / "config.json",) if p.is_file()]
        if ck.root.name.endswith(".json"):
            others.append(ck.root)
    for path in others:
        if path.name in index_names:
            with os.fdopen(open_checkpoint_file(path), "rb") as f:
                document = json.loads(f.read().decode("utf-8"))
            document["weight_map"] = dict(weight_map)
            meta = document.get("metadata") if isinstance(document.get("metadata"), dict) else {}
            meta["total_size"] = sum(_tensor_bytes(build / name) for name in set(weight_map.values()))
            document["metadata"] = meta
            (build / path.name).write_text(json.dumps(document, indent=2) + "\n")
        else:
            shutil.copy2(path, build / path.name)
    return not_copied


def _tensor_bytes(path: Path) -> int:
    tensors, _ = read_safetensors_header(path)
    return sum(t.nbytes for t in tensors.values())

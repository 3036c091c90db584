"""FP8 routed experts with block scales (DeepSeek-V3/R1 style safetensors).

Each expert weight is ``F8_E4M3`` (float8_e4m3fn) ``[rows, cols]``; beside it
``<name>_scale_inv`` (``...gate_proj.weight_scale_inv``; for a fused tensor without
``.weight``, ``<name>.weight_scale_inv``) holds one float per block of ``b0 x b1``
weights, ``[ceil(rows / b0), ceil(cols / b1)]`` (fused: ``[E, ...]``), with the block from
config.json ``quantization_config.weight_block_size`` (default 128 x 128). The weight is

    W[r, c] = float(w8[r, c]) * scale_inv[r // b0, c // b1]

computed in float32, as ``torch``'s ``w.to(float32) * scale`` does (natively, one pass a
matrix: ``native/formats/fp8_blocks.cpp``). Loading to bf16 rounds that product to nearest
even, exactly as ``.to(torch.bfloat16)``; int8/int4 quantize it (``numa_moe.quant``'s rule,
``expert_import.quantize_into``) with the group asked for. A NaN weight byte (0x7F, 0xFF)
is an error naming the tensor, row and column. Scale tensors are checked when the
checkpoint is opened (present, float, the right shape), their values (finite) when read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from numa_moe import _native
from numa_moe import quant as q
from numa_moe.checkpoints.expert_import import NATIVE_GROUP_FORMATS, ExpertImport, LoadFormat, convert_float
from numa_moe.checkpoints.safetensors import Checkpoint, ExpertLayer, ExpertMatrix, matrices_of, read_matrix_into
from numa_moe.files import CheckpointError, short
from numa_moe.formats import FP8_SCALE_CODES, NUMPY_DTYPES

__all__ = ["attach_fp8_scales", "FP8Import", "fp8_scale_name", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = (128, 128)


def fp8_scale_name(weight_name: str) -> str:
    """``...gate_proj.weight`` -> ``...gate_proj.weight_scale_inv``;
    ``...experts.gate_up_proj`` -> ``...experts.gate_up_proj.weight_scale_inv``."""
    base = weight_name[:-len(".weight")] if weight_name.endswith(".weight") else weight_name
    return base + ".weight_scale_inv"


def _block_size(checkpoint: Checkpoint) -> tuple[tuple[int, int], str]:
    config = checkpoint.config or {}
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or "weight_block_size" not in qc:
        return DEFAULT_BLOCK, "default (no quantization_config.weight_block_size)"
    block = qc["weight_block_size"]
    if not (isinstance(block, list) and len(block) == 2
            and all(type(b) is int and b >= 1 for b in block)):
        raise CheckpointError(f"{checkpoint.root}: config.json quantization_config.weight_block_size="
                              f"{short(block)} is not two positive integers")
    return (block[0], block[1]), "config.json quantization_config.weight_block_size"


def attach_fp8_scales(checkpoint: Checkpoint) -> None:
    """Give every FP8 expert matrix of ``checkpoint`` its block-scale matrix and set
    ``checkpoint.importer``; refuses a missing, non-float or mis-shaped scale tensor."""
    block, block_source = _block_size(checkpoint)
    b0, b1 = block
    layers = {}
    for layer_id, layer in checkpoint.layers.items():
        matrices = {}
        for kind, per_expert in layer.matrices.items():
            out = []
            by_tensor: dict[str, list[ExpertMatrix]] = {}
            for m in per_expert:
                by_tensor.setdefault(m.tensor.name, []).append(m)
            scales_of = {}
            for name, ms in by_tensor.items():
                info = ms[0].tensor
                scale = _scale_tensor(checkpoint, info, block, block_source)
                fused = len(info.shape) == 3
                expert = None if fused else str(ms[0].expert)
                if fused and kind in ("gate", "up") and (info.shape[1] // 2) % b0:
                    raise CheckpointError(
                        f"{info.path}: tensor {info.name!r}: fused gate_up rows {info.shape[1]} "
                        f"split into gate and up halves of {info.shape[1] // 2} rows, not whole "
                        f"{b0}-row scale blocks")
                fused_kind = "gate_up" if fused and kind in ("gate", "up") else kind
                for s in matrices_of(scale, layer_id, expert, fused_kind):
                    scales_of[(s.expert, s.kind)] = s
            for m in per_expert:
                out.append(replace(m, scales=scales_of[(m.expert, m.kind)]))
            matrices[kind] = tuple(out)
        layers[layer_id] = ExpertLayer(layer.layer, layer.hidden_size, layer.intermediate_size,
                                       layer.n_experts, layer.dtype, matrices, layer.router,
                                       layer.shared, layer.quant)
    checkpoint.layers = layers
    checkpoint.importer = FP8Import(block)
    checkpoint.notes.append(f"FP8 block scales {b0} x {b1} ({block_source})")


def _scale_tensor(checkpoint: Checkpoint, info, block: tuple[int, int], block_source: str):
    name = fp8_scale_name(info.name)
    where = f"{info.path}: tensor {short(info.name)}"
    *_, rows, cols = info.shape
    if block[0] > rows or block[1] > cols:
        # a block is a tile of the weight: larger than the weight is a corrupted config
        # (and a size such as 2**40 would make every expansion allocate terabytes)
        raise CheckpointError(f"{where}: FP8 block {block[0]} x {block[1]} ({block_source}) is "
                              f"larger than the weight's [{rows}, {cols}] rows and columns; a "
                              "block size must be at most the dimension it tiles")
    scale = checkpoint.tensors.get(name)
    if scale is None:
        raise CheckpointError(f"{where} is FP8 but its scale tensor {short(name)} is missing "
                              "(an FP8 expert weight needs its block scales)")
    *lead, rows, cols = info.shape
    shape = (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if scale.shape != shape:
        raise CheckpointError(f"{scale.path}: tensor {short(name)} has shape {list(scale.shape)}, "
                              f"expected {list(shape)}: one scale per {block[0]} x {block[1]} block "
                              f"of the FP8 weight {list(info.shape)}")
    if scale.dtype not in FP8_SCALE_CODES:
        raise CheckpointError(f"{scale.path}: tensor {short(name)} is {scale.dtype}; FP8 block "
                              f"scales are {', '.join(FP8_SCALE_CODES)}")
    return scale


@dataclass(frozen=True)
class FP8Import(ExpertImport):
    """FP8 e4m3 experts with block scales: bf16 by default, int8/int4 on request."""

    block: tuple[int, int] = DEFAULT_BLOCK
    float_formats = ("bf16",)

    @property
    def source(self) -> str:
        return f"FP8 e4m3 (block {self.block[0]} x {self.block[1]})"

    def default(self) -> LoadFormat:
        return LoadFormat("bf16")

    def exact(self, fmt: LoadFormat) -> bool:
        # bf16 equals torch's own dequantization bit for bit; int8/int4 are requantized
        return fmt.fmt == "bf16"

    def read_into(self, matrix: ExpertMatrix, fd: int, values: np.ndarray,
                  scales: np.ndarray | None, fmt: LoadFormat) -> None:
        if fmt.fmt == "bf16":  # the products rounded straight into the store's rows
            self._dequantize_into(matrix, fd, values)
            return
        if fmt.fmt in NATIVE_GROUP_FORMATS:
            # Dequantized and quantized a row at a time: the bytes of dequantize() then
            # quantize_into, without a float32 copy of the matrix (tests/test_fp8_checkpoint.py).
            w8, scale = self._read(matrix, fd)
            try:
                q.check_arguments(weight_format=fmt.fmt, group=fmt.group, scale_dtype=fmt.scale_dtype)
                _native.requantize_fp8_blocks(w8, scale, *self.block, fmt.fmt, fmt.group, fmt.scale_dtype,
                                              values, scales)
            except ValueError as err:
                raise CheckpointError(f"{_where(matrix)}: {err}") from None
            return
        convert_float(self.dequantize(matrix, fd), values, scales, fmt, _where(matrix))

    def dequantize(self, matrix: ExpertMatrix, fd: int) -> np.ndarray:
        out = np.empty((matrix.rows, matrix.cols), dtype=np.float32)
        self._dequantize_into(matrix, fd, out)
        return out

    def _read(self, matrix: ExpertMatrix, fd: int) -> tuple[np.ndarray, np.ndarray]:
        """The matrix's e4m3 bytes and its fp32 block scales, which must be finite."""
        s = matrix.scales
        w8 = np.empty((matrix.rows, matrix.cols), dtype=np.uint8)
        read_matrix_into(matrix, w8, fd)
        scale = np.empty((s.rows, s.cols), dtype=NUMPY_DTYPES[s.dtype])
        read_matrix_into(s, scale, fd if s.tensor.path == matrix.tensor.path else None)
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        if not np.all(np.isfinite(scale)):
            r, c = (int(i) for i in np.argwhere(~np.isfinite(scale))[0])
            raise CheckpointError(f"{s.tensor.path}: tensor {short(s.tensor.name)}: a NaN or "
                                  f"infinite block scale for layer {matrix.layer} expert "
                                  f"{matrix.expert} {matrix.kind} (block row {r}, column {c})")
        return w8, scale

    def _dequantize_into(self, matrix: ExpertMatrix, fd: int, out: np.ndarray) -> None:
        """The matrix times its block scales into ``out`` (float32, or bf16 rounded to
        nearest even) in one native pass (``_native.dequantize_fp8_blocks``: torch's
        ``w.to(float32) * scale`` bit for bit, tests/test_fp8_checkpoint.py)."""
        w8, scale = self._read(matrix, fd)
        try:
            _native.dequantize_fp8_blocks(w8, scale, *self.block, out)
        except ValueError as err:
            raise CheckpointError(f"{_where(matrix)}: {err}") from None


def _where(matrix: ExpertMatrix) -> str:
    return (f"{matrix.tensor.path}: tensor {matrix.tensor.name!r} (layer {matrix.layer} expert "
            f"{matrix.expert} {matrix.kind})")

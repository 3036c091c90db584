"""gpt-oss safetensors checkpoints (``config.json`` ``model_type`` "gpt_oss"): the
released MXFP4 layout and the BF16 one transformers saves, their biases and activation.

Per MoE layer L, under ``model.layers.L.mlp.experts.``:

* MXFP4 (as released): ``gate_up_proj_blocks`` uint8 [E, 2I, H / 32, 16] and
  ``gate_up_proj_scales`` uint8 [E, 2I, H / 32], ``down_proj_blocks`` [E, H, I / 32, 16]
  and ``down_proj_scales`` [E, H, I / 32]: rows are output features (row-major as the
  store holds them), the even element of a pair in the low nibble, one e8m0 scale per 32
  elements, so a row is the store's mxfp4 row as it is (``quant.from_mxfp4_blocks``).
* BF16 (a dequantized ``GptOssForCausalLM`` saved by transformers): ``gate_up_proj``
  [E, H, 2I] and ``down_proj`` [E, I, H], input features first (``x @ W``): each expert
  matrix is transposed into the store's row-major [I, H] / [H, I] while loading.

In both, gate and up alternate along the 2I axis (transformers' ``GptOssExperts``:
``gate_up[..., ::2]`` is the gate, ``[..., 1::2]`` the up): gate row i is gate_up row
2i, up row i is row 2i + 1 (MXFP4: rows of the blocks; BF16: columns of gate_up).
``gate_up_proj_bias`` [E, 2I] alternates the same way; ``down_proj_bias`` is [E, H].
The router (``mlp.router.weight`` [E, H], ``mlp.router.bias`` [E]) is reported apart.

Experts are converted one matrix at a time (``GptOssImport``, the store's importer):
MXFP4 loads as mxfp4 without loss (or dequantized into bf16 / requantized on request),
BF16 as bf16 (or quantized on request).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from numa_moe import quant as q
from numa_moe.activation import GPT_OSS, Activation
from numa_moe.checkpoints.expert_import import ExpertImport, LoadFormat, convert_float
from numa_moe.checkpoints.naming import NamingPattern
from numa_moe.checkpoints.safetensors import (Checkpoint, ExpertLayer, ExpertMatrix, ModelDims, TensorInfo,
                                              read_config, read_float_rows, read_matrix_into, read_tensors)
from numa_moe.files import CheckpointError, OpenFiles, short
from numa_moe.formats import KINDS, NUMPY_DTYPES

__all__ = ["is_gpt_oss", "open_gpt_oss", "GptOssImport", "MODEL_TYPE"]

MODEL_TYPE = "gpt_oss"
_MX = q.MX_BLOCK

_PREFIX = r"(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\."
_EXPERT = re.compile(_PREFIX + r"experts\.(?P<proj>gate_up_proj|down_proj)(?P<part>_blocks|_scales|_bias)?")
_ROUTER = re.compile(_PREFIX + r"router\.(?:weight|bias)")
_PARITY = {"gate": 0, "up": 1}


def is_gpt_oss(config: dict | None) -> bool:
    return isinstance(config, dict) and config.get("model_type") == MODEL_TYPE


def _config_int(config: dict, key: str, root: Path) -> int:
    value = config.get(key)
    if type(value) is not int or value < 1:
        raise CheckpointError(f"{root}: config.json {key}={short(value)} is not a positive integer "
                              "(a gpt-oss config names it)")
    return value


def _activation(config: dict, root: Path) -> Activation:
    """The clamped SwiGLU of config.json's ``swiglu_alpha`` / ``swiglu_limit`` (transformers'
    GptOssConfig defaults when absent: the released configs name only the limit)."""
    values = {}
    for key, field, default in (("swiglu_alpha", "alpha", GPT_OSS.alpha), ("swiglu_limit", "limit", GPT_OSS.limit)):
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{root}: config.json {key}={short(value)} is not a number")
        values[field] = float(value)
    try:
        return Activation(up_offset=GPT_OSS.up_offset, **values)
    except ValueError as err:
        raise CheckpointError(f"{root}: config.json swiglu_alpha / swiglu_limit: {err}") from None


def open_gpt_oss(root: Path, pattern: NamingPattern | None = None) -> Checkpoint:
    """A ``Checkpoint`` of the gpt-oss safetensors checkpoint at ``root`` (resolved), MXFP4
    or BF16 (module doc), with a ``GptOssImport`` as its importer."""
    if pattern is not None:
        raise CheckpointError(f"{root}: a naming pattern does not apply to a gpt-oss checkpoint "
                              "(its experts are found by the released names, docs/checkpoints.md)")
    files, tensors, metadata = read_tensors(root)
    config = read_config(root)
    if not is_gpt_oss(config):
        raise CheckpointError(f"{root}: config.json does not say model_type {MODEL_TYPE!r}")
    activation = _activation(config, root)
    H = _config_int(config, "hidden_size", root)
    I = _config_int(config, "intermediate_size", root)
    E = _config_int(config, "num_local_experts", root)
    top_k = _config_int(config, "num_experts_per_tok", root)
    parts: dict[int, dict[tuple[str, str], TensorInfo]] = defaultdict(dict)
    routers = []
    for name, info in tensors.items():
        if (match := _EXPERT.fullmatch(name)) is not None:
            parts[int(match.group("layer"))][(match.group("proj"), match.group("part") or "")] = info
        elif _ROUTER.fullmatch(name):
            routers.append(info)
    if not parts:
        raise CheckpointError(f"{root}: a gpt-oss config.json but no expert tensors "
                              "(model.layers.L.mlp.experts.gate_up_proj_blocks / gate_up_proj) among "
                              f"{len(tensors)} tensors")
    layouts = {"_blocks" if ("gate_up_proj", "_blocks") in p else "" for p in parts.values()}
    if len(layouts) > 1:
        raise CheckpointError(f"{root}: mixed formats: some layers hold MXFP4 experts "
                              "(gate_up_proj_blocks), others BF16 (gate_up_proj)")
    mxfp4 = layouts == {"_blocks"}
    layers, biases = {}, {}
    for layer in sorted(parts):
        found = parts[layer]
        shapes = _expected_shapes(mxfp4, E, H, I, root)
        for key, shape in shapes.items():
            info = found.get(key)
            if info is None:
                raise CheckpointError(f"{root}: layer {layer}: tensor model.layers.{layer}.mlp.experts."
                                      f"{key[0]}{key[1]} is missing")
            if info.shape != shape:
                raise CheckpointError(f"{info.path}: tensor {short(info.name)} has shape "
                                      f"{list(info.shape)}, expected {list(shape)} (E={E}, H={H}, "
                                      f"I={I} from config.json)")
            wanted = ("U8",) if key[1] in ("_blocks", "_scales") else ("BF16", "F16", "F32")
            if info.dtype not in wanted:
                raise CheckpointError(f"{info.path}: tensor {short(info.name)} is {info.dtype}, "
                                      f"expected {' or '.join(wanted)}")
        if not mxfp4 and found[("gate_up_proj", "")].dtype != found[("down_proj", "")].dtype:
            raise CheckpointError(f"{root}: layer {layer}: gate_up_proj and down_proj differ in dtype")
        matrices = {kind: tuple(_matrix(found, layer, e, kind, mxfp4, H, I) for e in range(E))
                    for kind in KINDS}
        dtype = "MXFP4" if mxfp4 else found[("gate_up_proj", "")].dtype
        router = next((r for r in routers if r.name.endswith("router.weight")
                       and _ROUTER.fullmatch(r.name).group("layer") == str(layer)), None)
        layers[layer] = ExpertLayer(layer, H, I, E, dtype, matrices, router)
        biases[layer] = (found[("gate_up_proj", "_bias")], found[("down_proj", "_bias")])
    sources = {"hidden_size": "config.json hidden_size",
               "intermediate_size": "config.json intermediate_size",
               "n_experts": "config.json num_local_experts",
               "top_k": "config.json num_experts_per_tok"}
    importer = GptOssImport(mxfp4, dtype, biases, activation)
    return Checkpoint(root=root, files=files, tensors=tensors, config=config, naming=("gpt-oss",),
                      layers=layers, dims=ModelDims(H, I, E, top_k, sources),
                      router_tensors=tuple(routers), file_metadata=metadata, importer=importer,
                      notes=[f"gpt-oss experts: {importer.source}, biases, clamped SwiGLU (alpha "
                             f"{activation.alpha:g}, limit {activation.limit:g})"])


def _expected_shapes(mxfp4: bool, E: int, H: int, I: int, root: Path) -> dict:
    if mxfp4:
        for what, cols in (("hidden_size", H), ("intermediate_size", I)):
            if cols % _MX:
                raise CheckpointError(f"{root}: config.json {what}={cols} is not a multiple of "
                                      f"the MXFP4 block {_MX}")
        return {("gate_up_proj", "_blocks"): (E, 2 * I, H // _MX, _MX // 2),
                ("gate_up_proj", "_scales"): (E, 2 * I, H // _MX),
                ("down_proj", "_blocks"): (E, H, I // _MX, _MX // 2),
                ("down_proj", "_scales"): (E, H, I // _MX),
                ("gate_up_proj", "_bias"): (E, 2 * I), ("down_proj", "_bias"): (E, H)}
    return {("gate_up_proj", ""): (E, H, 2 * I), ("down_proj", ""): (E, I, H),
            ("gate_up_proj", "_bias"): (E, 2 * I), ("down_proj", "_bias"): (E, H)}


def _slab(info: TensorInfo, e: int, rows: int, cols: int, stored: int, kind: str, layer: int,
          scales: ExpertMatrix | None = None, quant: str | None = None) -> ExpertMatrix:
    """Expert ``e``'s part of a 3-D or 4-D expert tensor; ``stored`` the bytes of the one
    matrix it stands for (half of a gate_up slab)."""
    per_expert = info.nbytes // info.shape[0]
    return ExpertMatrix(layer, e, kind, info, info.file_offset + e * per_expert, rows, cols,
                        quant=quant, scales=scales, stored_bytes=stored)


def _matrix(found, layer: int, e: int, kind: str, mxfp4: bool, H: int, I: int) -> ExpertMatrix:
    proj = "down_proj" if kind == "down" else "gate_up_proj"
    rows, cols = (H, I) if kind == "down" else (I, H)
    if mxfp4:
        scales = _slab(found[(proj, "_scales")], e, rows, cols // _MX, rows * cols // _MX, kind, layer)
        return _slab(found[(proj, "_blocks")], e, rows, cols, rows * cols // 2, kind, layer,
                     scales=scales, quant="mxfp4")
    info = found[(proj, "")]
    return _slab(info, e, rows, cols, rows * cols * info.itemsize, kind, layer)


def _read_slab(matrix: ExpertMatrix, fd: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """The whole per-expert slab a matrix lies in (both gate and up for gate_up)."""
    slab = np.empty(shape, dtype=dtype)
    read_matrix_into(ExpertMatrix(matrix.layer, matrix.expert, matrix.kind, matrix.tensor,
                                  matrix.file_offset, 1, 1, stored_bytes=slab.nbytes), slab, fd)
    return slab


def _where(matrix: ExpertMatrix) -> str:
    return (f"{matrix.tensor.path}: tensor {short(matrix.tensor.name)} (layer {matrix.layer} "
            f"expert {matrix.expert} {matrix.kind})")


@dataclass(frozen=True)
class GptOssImport(ExpertImport):
    """How gpt-oss experts become the store's formats (module doc)."""

    mxfp4: bool
    dtype: str
    # layer -> (gate_up_proj_bias, down_proj_bias)
    bias_tensors: dict
    activation: Activation = GPT_OSS

    @property
    def source(self) -> str:
        return f"gpt-oss {'MXFP4' if self.mxfp4 else self.dtype}"

    @property
    def float_formats(self) -> tuple[str, ...]:
        return ("bf16",)

    def default(self) -> LoadFormat:
        return LoadFormat("mxfp4", _MX, "e8m0") if self.mxfp4 else LoadFormat("bf16")

    def exact(self, fmt: LoadFormat) -> bool:
        if self.mxfp4:
            return fmt == self.default()
        return fmt.fmt == "bf16" and self.dtype == "BF16"

    def _mxfp4_of(self, matrix: ExpertMatrix, fd: int) -> q.QuantizedMatrix:
        """The matrix as the contract's MXFP4 (its rows of the slab: every other one for
        gate / up)."""
        s = matrix.scales
        total = 2 * matrix.rows if matrix.kind in _PARITY else matrix.rows
        blocks = _read_slab(matrix, fd, (total, matrix.cols // _MX, _MX // 2), np.uint8)
        scales = _read_slab(s, fd if s.tensor.path == matrix.tensor.path else None,
                            (total, matrix.cols // _MX), np.uint8)
        if matrix.kind in _PARITY:
            parity = _PARITY[matrix.kind]
            blocks, scales = blocks[parity::2], scales[parity::2]
        try:
            return q.from_mxfp4_blocks(np.ascontiguousarray(blocks), np.ascontiguousarray(scales))
        except ValueError as err:
            raise CheckpointError(f"{_where(matrix)}: {err}") from None

    def read_into(self, matrix: ExpertMatrix, fd: int, values: np.ndarray,
                  scales: np.ndarray | None, fmt: LoadFormat) -> None:
        if self.mxfp4 and fmt == self.default():
            qm = self._mxfp4_of(matrix, fd)
            values[...] = qm.q
            scales[...] = qm.scales
            return
        if not self.mxfp4 and fmt.fmt == "bf16" and self.dtype == "BF16":
            values[...] = self._transposed(matrix, fd)
            return
        convert_float(self.dequantize(matrix, fd), values, scales, fmt, _where(matrix))

    def _transposed(self, matrix: ExpertMatrix, fd: int) -> np.ndarray:
        """A BF16-layout matrix in the store's row-major shape, in the file's dtype."""
        dtype = NUMPY_DTYPES[matrix.dtype]
        if matrix.kind in _PARITY:
            slab = _read_slab(matrix, fd, (matrix.cols, 2 * matrix.rows), dtype)
            return slab[:, _PARITY[matrix.kind]::2].T
        return _read_slab(matrix, fd, (matrix.cols, matrix.rows), dtype).T

    def dequantize(self, matrix: ExpertMatrix, fd: int) -> np.ndarray:
        if self.mxfp4:
            return q.dequantize(self._mxfp4_of(matrix, fd))
        return self._transposed(matrix, fd).astype(np.float32)

    def biases(self, layer: ExpertLayer, files: OpenFiles | None = None):
        gate_up, down = self.bias_tensors[layer.layer]
        with OpenFiles() as own:
            opened = files or own
            both = [read_float_rows(t, opened) for t in (gate_up, down)]
        gate_up_b, down_b = both
        if not (np.all(np.isfinite(gate_up_b)) and np.all(np.isfinite(down_b))):
            raise CheckpointError(f"layer {layer.layer}: a NaN or infinite expert bias in "
                                  f"{short(gate_up.name)} or {short(down.name)}")
        return [(gate_up_b[e, 0::2].copy(), gate_up_b[e, 1::2].copy(), down_b[e].copy())
                for e in range(layer.n_experts)]

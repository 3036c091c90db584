"""Routed experts stored in an encoding the store does not hold as it is: GGUF
(``numa_moe.checkpoints.gguf``) and FP8 block-scaled safetensors
(``numa_moe.checkpoints.fp8``).

A ``Checkpoint`` of such a file carries an ``ExpertImport`` (``checkpoint.importer``):
it says which formats the experts can be loaded in (``resolve``), converts one expert
matrix at a time into the store's row-major buffers (``read_into``), and gives the file's
own dequantized values of a matrix (``dequantize``), the reference every conversion is
measured against (``measure_conversion``). The store, ``tables``, ``inspect`` and
``run`` use only this interface, so no command has a case per file format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numa_moe import _native, formats, quant as q
from numa_moe.files import CheckpointError, OpenFiles
from numa_moe.formats import FLOAT_NUMPY, NUMPY_DTYPES, QUANT_DTYPES, QUANT_FORMATS, SCALE_DTYPES, nibble_packed, scale_columns

__all__ = ["ExpertImport", "LoadFormat", "ConversionError", "measure_conversion",
           "check_group_divides"]

@dataclass(frozen=True)
class LoadFormat:
    """What the store holds: ``fmt`` (bf16/fp16/fp32/int8/int4/mxfp4) and, for the
    quantized formats, the group and the scale dtype name."""

    fmt: str
    group: int | None = None
    scale_dtype: str | None = None

    def describe(self) -> str:
        if self.group is None:
            return self.fmt
        return f"{self.fmt}, group {self.group}, {self.scale_dtype} scales"


def check_group_divides(root, group: int, hidden_size: int, intermediate_size: int) -> None:
    for kind, cols in (("gate/up", hidden_size), ("down", intermediate_size)):
        if cols % group:
            raise ValueError(f"{root}: group {group} does not divide the {cols} columns of the "
                             f"{kind} matrices")


class ExpertImport:
    """The interface a foreign expert encoding offers the store (see the module doc).

    Subclasses set ``source`` (a short name such as "GGUF Q4_K+Q6_K") and implement
    ``default``, ``exact``, ``read_into`` and ``dequantize``; ``resolve`` is shared."""

    source: str = ""
    #: float formats the experts load as besides the quantized ones (their own, or bf16)
    float_formats: tuple[str, ...] = ("bf16",)
    #: the experts' activation (numa_moe.activation.Activation), None for SiLU
    activation = None

    def biases(self, layer, files: OpenFiles | None = None):
        """One (gate [I], up [I], down [H]) float32 tuple per expert of ``layer`` (an
        ExpertLayer), None when the experts have no biases."""
        return None

    def default(self) -> LoadFormat:
        """The format loaded when none is asked for."""
        raise NotImplementedError

    def exact(self, fmt: LoadFormat) -> bool:
        """Whether every expert converts to ``fmt`` without loss."""
        raise NotImplementedError

    def read_into(self, matrix, fd: int, values: np.ndarray, scales: np.ndarray | None,
                  fmt: LoadFormat) -> None:
        """Convert one expert matrix into ``values`` (the store's rows of it) and, for
        the quantized formats, ``scales``."""
        raise NotImplementedError

    def dequantize(self, matrix, fd: int) -> np.ndarray:
        """The file's own values of one expert matrix, float32 ``[rows, cols]``."""
        raise NotImplementedError

    def resolve(self, root, dims, weight_format: str | None, group: int | None,
                scale_dtype: str | None) -> LoadFormat:
        """The format a load request means: None picks ``default()``'s parts; refuses
        (ValueError, one line) a format the experts cannot become, a group that does not
        divide the columns and group/scale options for a float format."""

        default = self.default()
        fmt = default.fmt if weight_format is None else formats.weight_format(weight_format).name
        allowed = (*self.float_formats, *QUANT_FORMATS)
        if fmt not in allowed:
            raise ValueError(f"{root}: {self.source} experts load as {', '.join(allowed)}, "
                             f"not {fmt}")
        if fmt not in QUANT_FORMATS:
            if group is not None or scale_dtype is not None:
                raise ValueError(f"group and scale_dtype apply to weight_format "
                                 f"{'/'.join(map(repr, QUANT_FORMATS))}, not {fmt}")
            return LoadFormat(fmt)
        if fmt == default.fmt:
            group = default.group if group is None else group
            scale_dtype = default.scale_dtype if scale_dtype is None else scale_dtype
        group, scale_dtype = q.scale_layout(fmt, group, scale_dtype, default_group=q.GGML_BLOCK)
        check_group_divides(root, group, dims.hidden_size, dims.intermediate_size)
        return LoadFormat(fmt, group, scale_dtype)

    def describe(self, fmt: LoadFormat) -> str:
        how = "exact" if self.exact(fmt) else "requantized" if fmt.group else "rounded"
        return f"{self.source} -> {fmt.describe()} ({how})"


def convert_float(w: np.ndarray, values: np.ndarray, scales: np.ndarray | None,
                  fmt: LoadFormat, where: str) -> None:
    """float32 values of one matrix into the store's rows: rounded to a float format
    (round to nearest even), or quantized (quantize_into); a weight the quantization
    refuses is a CheckpointError naming ``where``."""

    if fmt.group is None:
        values[...] = w.astype(FLOAT_NUMPY[fmt.fmt])
        return
    try:
        quantize_into(w, fmt.fmt, fmt.group, fmt.scale_dtype, values, scales)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}; cannot quantize it") from None


# The formats the native group quantization writes (quantize_into; the K-quant and FP8
# readers' one-pass requantization).
NATIVE_GROUP_FORMATS = ("int8", "int4")


def quantize_into(w, fmt: str, group: int, scale_dtype: str, values: np.ndarray, scales: np.ndarray) -> None:
    """``numa_moe.quant.quantize(w, fmt, group, scale_dtype)`` written into ``values`` and
    ``scales`` (an expert's rows of a stacked buffer: each row contiguous): int8 and int4
    in one native pass (``_native.quantize_groups``: the same bytes,
    tests/test_group_quant.py), the other formats through quant.quantize. A weight it
    refuses (NaN, infinity, a group whose scale is beyond its dtype) is a ValueError naming
    its row and column (or group)."""
    if fmt in NATIVE_GROUP_FORMATS:
        q.check_arguments(weight_format=fmt, group=group, scale_dtype=scale_dtype)
        _native.quantize_groups(np.ascontiguousarray(w, dtype=np.float32), fmt, group, scale_dtype, values, scales)
        return
    qm = q.quantize(w, fmt, group, scale_dtype)
    values[...] = qm.q
    scales[...] = qm.scales


@dataclass(frozen=True)
class ConversionError:
    """How far one converted expert matrix is from the file's own dequantized values:
    the relative Frobenius error, the largest absolute error, and that largest error over
    the matrix's largest magnitude."""

    layer: int
    expert: int
    kind: str
    source_type: str
    rel_fro: float
    max_abs: float
    max_rel: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _loaded_values(values: np.ndarray, scales: np.ndarray | None, fmt: LoadFormat) -> np.ndarray:
    if fmt.group is None:
        return values.astype(np.float32)
    return q.dequantize(q.QuantizedMatrix(fmt.fmt, fmt.group, values, scales))


def measure_conversion(checkpoint, fmt: LoadFormat, matrices) -> list[ConversionError]:
    """Convert ``matrices`` (ExpertMatrix of ``checkpoint``) as the store would and compare
    each with the file's own dequantization, in float64. One matrix in memory at a time."""

    importer = checkpoint.importer
    out = []
    with OpenFiles() as files:
        for m in matrices:
            fd = files.fd(m.tensor.path)
            value_cols = m.cols // 2 if nibble_packed(fmt.fmt) else m.cols
            value_dtype = NUMPY_DTYPES[QUANT_DTYPES[fmt.fmt]] if fmt.fmt in QUANT_DTYPES else FLOAT_NUMPY[fmt.fmt]
            values = np.empty((m.rows, value_cols), dtype=value_dtype)
            scales = None
            if fmt.group is not None:
                scales = np.empty((m.rows, scale_columns(fmt.fmt, m.cols, fmt.group)),
                                  dtype=SCALE_DTYPES[fmt.scale_dtype])
            importer.read_into(m, fd, values, scales, fmt)
            reference = importer.dequantize(m, fd).astype(np.float64)
            loaded = _loaded_values(values, scales, fmt).astype(np.float64)
            diff = np.abs(loaded - reference)
            norm = float(np.linalg.norm(reference))
            amax = float(np.abs(reference).max())
            err = float(np.linalg.norm(diff))
            out.append(ConversionError(m.layer, m.expert, m.kind, m.dtype,
                                       err / norm if norm else err, float(diff.max()),
                                       float(diff.max()) / amax if amax else float(diff.max())))
    return out

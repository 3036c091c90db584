"""The routed experts of a safetensors checkpoint, found from its headers alone.

A checkpoint is one ``*.safetensors`` file, a directory of them, or a sharded directory
with ``model.safetensors.index.json``. Only the headers are read here (8-byte
little-endian length + JSON, the safetensors format), never weight bytes, so tables for a
600 GB checkpoint are built in milliseconds; ``read_matrix_into`` is the one function
that reads weight bytes, straight into a caller's buffer.

Every routed-expert matrix (gate [I, H], up [I, H], down [H, I], row-major as nn.Linear
stores them) is a contiguous byte range of one file, also for fused 3-D tensors, so an
``ExpertMatrix`` is just (file, byte offset, rows, cols).

Naming schemes recognised (``BUILTIN_PATTERNS``):

* Mixtral: ``model.layers.L.block_sparse_moe.experts.E.w1/w3/w2.weight``
  (w1 = gate, w3 = up, w2 = down)
* Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3: ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``
* fused (transformers >= 5): ``model.layers.L.mlp.experts.gate_up_proj`` [E, 2I, H] (gate
  rows first) and ``...experts.down_proj`` [E, H, I]

Shared experts (``mlp.shared_expert(s).*``, not routed) and routers (``*.gate.weight``)
are reported apart. Any other layout: pass a ``NamingPattern`` (regex with named groups
``layer``, ``kind`` and, for one tensor per expert, ``expert``; plus a kind mapping).
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from numa_moe.checkpoints.naming import BUILTIN_PATTERNS, PATTERN_HELP, ROUTER_RE, SHARED_RE, NamingPattern
from numa_moe.files import CheckpointError, OpenFiles, open_checkpoint_file, parse_json, read_json_file, short
from numa_moe.formats import (DTYPE_BYTES, FLOAT_FORMATS, GROUPS, KINDS, NUMPY_DTYPES, QUANT_DTYPES,
                              SCALE_DTYPE_CODES, nibble_packed, scale_columns)
from numa_moe.quant import check_arguments, zero_scales_allowed

__all__ = [
    "TensorInfo",
    "ExpertMatrix",
    "ExpertLayer",
    "ModelDims",
    "Checkpoint",
    "read_safetensors_header",
    "resolve_checkpoint_path",
    "overlapping_source",
    "tensor_nbytes",
    "read_matrix_into",
    "read_float_rows",
    "read_scales_into",
    "scale_tensor_name",
    "QuantInfo",
    "QUANT_METADATA",
    "read_tensors",
    "read_config",
]

# A header this long is not a plausible safetensors header (the library's own limit is 100 MB).
_MAX_HEADER_BYTES = 100_000_000


# safetensors ``__metadata__`` keys of a quantized checkpoint (docs/quantization.md,
# "Checkpoints"): the scheme, the group size and the scale dtype, all strings.
QUANT_METADATA = ("numa_moe.quant", "numa_moe.group", "numa_moe.scale_dtype")


@dataclass(frozen=True)
class QuantInfo:
    """How a quantized checkpoint stores its routed experts: ``fmt`` (int8/int4/mxfp4/iq4nl),
    the group size and the scale dtype name (fp16/bf16/fp32; e8m0 for mxfp4)."""

    fmt: str
    group: int
    scale_dtype: str

    def describe(self) -> str:
        return f"{self.fmt}, group {self.group}, {self.scale_dtype} scales"


def scale_tensor_name(weight_name: str) -> str:
    """Name of the group-scale tensor of a quantized expert weight: the weight's name
    without a trailing ``.weight``, plus ``.weight_scale``
    (``...gate_proj.weight`` -> ``...gate_proj.weight_scale``,
    ``...experts.gate_up_proj`` -> ``...experts.gate_up_proj.weight_scale``)."""
    base = weight_name[:-len(".weight")] if weight_name.endswith(".weight") else weight_name
    return base + ".weight_scale"


def _quant_of_metadata(path: Path, metadata: dict) -> QuantInfo | None:
    """The QuantInfo a file's ``__metadata__`` declares, None when it declares none."""
    if not isinstance(metadata, dict) or not any(k in metadata for k in QUANT_METADATA):
        return None
    missing = [k for k in QUANT_METADATA if k not in metadata]
    if missing:
        raise CheckpointError(f"{path}: quantization metadata is incomplete: {', '.join(missing)} "
                              f"missing (a quantized file carries {', '.join(QUANT_METADATA)})")
    fmt, group, scale = (metadata[k] for k in QUANT_METADATA)
    if not isinstance(fmt, str) or fmt not in QUANT_DTYPES:
        raise CheckpointError(f"{path}: unknown quantization scheme numa_moe.quant={short(fmt)}; "
                              f"this reader knows {', '.join(QUANT_DTYPES)}")
    if not (isinstance(group, str) and group.isascii() and group.isdigit()) \
            or int(group) not in GROUPS:
        raise CheckpointError(f"{path}: numa_moe.group={short(group)} is not one of "
                              f"{', '.join(map(str, GROUPS))}")
    if not isinstance(scale, str) or scale not in SCALE_DTYPE_CODES:
        raise CheckpointError(f"{path}: numa_moe.scale_dtype={short(scale)} is not one of "
                              f"{', '.join(SCALE_DTYPE_CODES)}")
    try:
        check_arguments(weight_format=fmt, group=int(group), scale_dtype=scale)
    except ValueError as err:
        raise CheckpointError(f"{path}: quantization metadata: {err}") from None
    return QuantInfo(fmt, int(group), scale)


# ORG/NAME as the Hub spells repo ids (huggingface_hub.utils.validate_repo_id)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    """The path a checkpoint argument names: a path that exists (a dangling link
    included: opening it says what it is), else a Hugging Face repo id (``ORG/NAME``)
    whose snapshot is in the local Hugging Face cache (``HF_HUB_CACHE``, or
    ``HF_HOME/hub``, as ``huggingface_hub`` finds it). Never touches the network: an id
    not in the cache is a ``CheckpointError`` saying where it looked and how to download."""
    given = Path(path)
    if given.exists() or given.is_symlink():
        return given
    text = os.fspath(path)
    if not _REPO_ID.fullmatch(text) or ".." in text:
        raise CheckpointError(f"{given}: no such file or directory")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(text, local_files_only=True))
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{text}: no such file or directory, and no snapshot of the Hugging Face model "
            f"{text} in the local cache {constants.HF_HUB_CACHE} (set HF_HUB_CACHE or HF_HOME "
            f"to use another); download it with `hf download {text}` (or `huggingface-cli "
            f"download {text}`), or give the checkpoint's path") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{text}: cannot read the Hugging Face cache "
                              f"{constants.HF_HUB_CACHE}: {err}") from None


def overlapping_source(output: str | os.PathLike, sources) -> Path | None:
    """The first of ``sources`` that ``output`` (links resolved) is, contains or lies
    inside; None when it is apart from all of them. What a command writes (or replaces)
    must be apart from what it reads."""
    real = Path(os.path.realpath(output))
    for source in sources:
        source = Path(os.path.realpath(source))
        if real == source or source in real.parents or real in source.parents:
            return source
    return None


def tensor_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Exact byte size of a tensor (Python ints: a shape product never wraps)."""
    return math.prod(shape) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: ``file_offset`` is absolute within ``path``."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    file_offset: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict]:
    """Parse and check the header of a safetensors file; returns (tensors, metadata).

    Checks what a loader would trip over later: a file that is not a regular file, a
    truncated file, a corrupted or non-JSON header, a tensor name that is not valid
    Unicode (JSON escapes can spell lone surrogates), unknown dtypes, offsets that do not match the shape (computed
    exactly, never wrapping) or run past the end of the file.
    """
    path = Path(path)
    fd = open_checkpoint_file(path)
    try:
        with os.fdopen(fd, "rb") as f:
            file_bytes = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({file_bytes} bytes; "
                                      "the 8-byte header length is missing)")
            header_bytes = int.from_bytes(head, "little")
            if header_bytes > min(file_bytes - 8, _MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{path}: header length field says {header_bytes} bytes but the file holds "
                    f"{file_bytes - 8} bytes after it: truncated, or not a safetensors file")
            raw = f.read(header_bytes)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err}") from err
    header = parse_json(raw, path, "corrupted safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (a JSON object was expected)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_bytes
    data_bytes = file_bytes - data_start
    tensors: dict[str, TensorInfo] = {}
    for index, (name, entry) in enumerate(header.items()):
        if not _is_unicode(name):
            raise CheckpointError(f"{path}: the name of tensor #{index} in the header is not valid "
                                  f"Unicode ({short(name)}: a lone surrogate); corrupted "
                                  "safetensors header")
        where = f"{path}: tensor {name!r}"
        try:
            dtype = entry["dtype"]
            shape = _json_ints(entry["shape"])
            begin, end = _json_ints(entry["data_offsets"])
            if not isinstance(dtype, str):
                raise TypeError("dtype is not a string")
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{where}: malformed header entry {short(entry)}") from err
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{where}: unknown dtype {short(dtype)}")
        if any(d < 0 for d in shape):
            raise CheckpointError(f"{where}: negative dimension in shape {short(list(shape))}")
        expected = tensor_nbytes(shape, dtype)
        if end - begin != expected or begin < 0:
            raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes "
                                  f"but shape {short(list(shape))} {dtype} needs "
                                  f"{short(expected)}")
        if end > data_bytes:
            raise CheckpointError(f"{where}: data ends at byte {data_start + end} but the file has "
                                  f"only {file_bytes} bytes (truncated file?)")
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, expected)
    _check_no_overlap(path, tensors)
    return tensors, metadata


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_no_overlap(path: Path, tensors: dict) -> None:
    """Two tensors sharing bytes is a corrupted (or crafted) header: the safetensors
    library refuses it, and loading would hand one tensor's bytes to another."""
    spans = sorted((info.file_offset, info.file_offset + info.nbytes, name)
                   for name, info in tensors.items() if info.nbytes)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: tensors {first!r} and {second!r} overlap in the file "
                                  f"(corrupted safetensors header)")


def _json_ints(value) -> tuple[int, ...]:
    """A JSON list of integers, strictly: int("48") would read a string as a shape and
    int(2.5) would truncate, both turning a corrupted header into a plausible one."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise TypeError(f"expected a list of integers, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class ExpertMatrix:
    """One routed-expert matrix: ``rows x cols`` row-major at ``file_offset`` of ``tensor.path``.

    Quantized (``quant`` "int8", "int4", "mxfp4" or "iq4nl"): ``cols`` counts weights (elements), so an
    int4 or mxfp4 row holds ``cols / 2`` bytes; ``scales`` is the matrix's group-scale tensor
    ``[rows, cols / group]`` (itself an ExpertMatrix of the scale tensor)."""

    layer: int
    expert: int
    kind: str
    tensor: TensorInfo
    file_offset: int
    rows: int
    cols: int
    quant: str | None = None
    scales: "ExpertMatrix | None" = None
    # bytes of a matrix in a block encoding (GGUF Q8_0, Q4_K, ...), where a row is not
    # cols x an element size
    stored_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        if self.stored_bytes is not None:
            return self.stored_bytes
        if self.quant is not None and nibble_packed(self.quant):
            return self.rows * self.cols // 2
        return self.rows * self.cols * self.tensor.itemsize

    @property
    def dtype(self) -> str:
        return self.tensor.dtype


@dataclass(frozen=True)
class ExpertLayer:
    """The routed experts of one layer: ``matrices[kind][e]``, plus what is reported apart."""

    layer: int
    hidden_size: int
    intermediate_size: int
    n_experts: int
    dtype: str
    matrices: dict[str, tuple[ExpertMatrix, ...]]
    router: TensorInfo | None = None
    shared: tuple[TensorInfo, ...] = ()
    quant: QuantInfo | None = None

    def matrix(self, kind: str, expert: int) -> ExpertMatrix:
        return self.matrices[kind][expert]

    def expert_matrices(self):
        """Every matrix of the layer, kind by kind, expert by expert."""
        for kind in KINDS:
            yield from self.matrices[kind]


@dataclass(frozen=True)
class ModelDims:
    """Expert dimensions; ``sources`` says where each came from (config.json or shapes)."""

    hidden_size: int
    intermediate_size: int
    n_experts: int
    top_k: int | None
    sources: dict[str, str] = field(default_factory=dict)


def _config_value(config: dict, *keys: str):
    """(key, value) of the first of ``keys`` present in config.json, the value a positive
    int (a string or a float there is a broken config, not a number to coerce)."""
    for key in keys:
        value = config.get(key)
        if value is not None:
            if type(value) is not int or value < 1:
                raise CheckpointError(f"config.json {key}={value!r} is not a positive integer")
            return key, value
    return None, None


@dataclass
class Checkpoint:
    """A safetensors checkpoint's tensors (headers only) and its routed experts.

    Open with ``numa_moe.checkpoints.dispatch.open_checkpoint(path, pattern=None)``.
    """

    root: Path
    files: tuple[Path, ...]
    tensors: dict[str, TensorInfo]
    config: dict | None
    naming: tuple[str, ...] = ()
    layers: dict[int, ExpertLayer] = field(default_factory=dict)
    dims: ModelDims | None = None
    shared_tensors: tuple[TensorInfo, ...] = ()
    router_tensors: tuple[TensorInfo, ...] = ()
    notes: list[str] = field(default_factory=list)
    # safetensors __metadata__ of each file, and the quantization the files declare
    file_metadata: dict[Path, dict] = field(default_factory=dict)
    quant: QuantInfo | None = None
    # experts in an encoding the store converts while loading (GGUF, FP8 with block
    # scales): a numa_moe.checkpoints.expert_import.ExpertImport, else None
    importer: object | None = None

    # ---------------------------------------------------------------- opening
    @classmethod
    def from_safetensors(cls, root: Path, pattern: NamingPattern | None = None) -> "Checkpoint":
        """The experts of the safetensors checkpoint at ``root`` (a file, an index or a
        directory, already resolved); ``numa_moe.checkpoints.dispatch.open_checkpoint``
        is the way in that also reads GGUF and attaches FP8 block scales."""
        files, tensors, metadata = read_tensors(root)
        config = read_config(root)
        checkpoint = cls(root=root, files=files, tensors=tensors, config=config,
                         file_metadata=metadata)
        checkpoint.quant = _checkpoint_quant(metadata)
        checkpoint._find_experts(pattern)
        return checkpoint

    @property
    def sources(self) -> tuple[Path, ...]:
        """Every path this checkpoint is read from, links resolved: its root (the
        directory, or the file named), each file, and config.json. An output must not
        contain or lie inside any of them (``overlapping_source``)."""
        paths = [self.root, *self.files]
        if self.config is not None:
            paths.append((self.root if self.root.is_dir() else self.root.parent) / "config.json")
        return tuple(dict.fromkeys(Path(os.path.realpath(p)) for p in paths))

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.layers))

    @property
    def dtype(self) -> str:
        return next(iter(self.layers.values())).dtype

    @property
    def weight_format(self) -> str:
        """Format of the routed experts: "int8"/"int4"/"mxfp4"/"iq4nl" when quantized, else the float
        format of their dtype ("bf16", "fp16", "fp32"), else the safetensors dtype."""
        if self.quant is not None:
            return self.quant.fmt
        if self.importer is not None:
            return self.importer.default().fmt
        return FLOAT_FORMATS.get(self.dtype, self.dtype)

    @property
    def source_format(self) -> str:
        """What the routed experts are in the file: "safetensors BF16", "numa-moe int4",
        "GGUF Q4_K+Q6_K", "FP8 e4m3 (block 128 x 128)", ..."""
        if self.importer is not None:
            return self.importer.source
        if self.quant is not None:
            return f"numa-moe {self.quant.describe()}"
        return f"safetensors {self.dtype}"

    @property
    def activation(self):
        """The experts' activation (a numa_moe.activation.Activation: gpt-oss's clamped
        SwiGLU), None for SiLU (every layout but those whose importer says otherwise)."""
        return None if self.importer is None else self.importer.activation

    def expert_biases(self, layer: int, files: OpenFiles | None = None):
        """The biases of one layer's experts as ``MoELayer(biases=)`` takes them: one
        (gate [I], up [I], down [H]) float32 tuple per expert; None when the experts have
        none."""
        if self.importer is None:
            return None
        return self.importer.biases(self.layers[layer], files)

    def expert_matrices(self):
        """Every routed-expert matrix, layer by layer, kind by kind, expert by expert."""
        for layer in self.layer_ids:
            yield from self.layers[layer].expert_matrices()

    def check_scales(self) -> None:
        """Read every group-scale tensor of a quantized checkpoint and refuse NaN,
        infinite or zero scales (CheckpointError naming the tensor); a no-op otherwise."""
        if self.quant is None:
            return
        with OpenFiles() as files:
            for m in self.expert_matrices():
                s = m.scales
                fd = files.fd(s.tensor.path)
                read_scales_into(m, np.empty((s.rows, s.cols), dtype=NUMPY_DTYPES[s.dtype]), fd)

    # ------------------------------------------------------------ recognising
    def _find_experts(self, pattern: NamingPattern | None) -> None:
        patterns = (pattern,) if pattern is not None else BUILTIN_PATTERNS
        # (layer, expert, kind) -> (matrix sources); fused tensors give every expert at once
        found: dict[tuple[int, int, str], ExpertMatrix] = {}
        used: list[str] = []
        shared, routers = [], []
        for name, info in self.tensors.items():
            for pat in patterns:
                match = pat.compiled.fullmatch(name)
                if match is None:
                    continue
                raw_kind = match.group("kind")
                if raw_kind not in pat.kinds:
                    raise CheckpointError(f"{info.path}: tensor {short(name)}: kind "
                                          f"{short(raw_kind)} is not in the pattern's kind "
                                          f"mapping {pat.kinds}")
                layer_id = _group_int(match, "layer", pat, info)
                expert_id = None if pat.fused else _group_int(match, "expert", pat, info)
                matrices = matrices_of(info, layer_id, expert_id, pat.kinds[raw_kind])
                matrices = self._quantized(info, matrices, layer_id, expert_id, pat.kinds[raw_kind])
                for matrix in matrices:
                    key = (matrix.layer, matrix.expert, matrix.kind)
                    if key in found:
                        other = found[key].tensor
                        raise CheckpointError(
                            f"layer {key[0]} expert {key[1]} {key[2]} is given twice: by {other.name!r} "
                            f"({other.path}) and by {name!r} ({info.path})")
                    found[key] = matrix
                if pat.name not in used:
                    used.append(pat.name)
                break
            else:
                # A layer number too long to be one is not a shared expert or router.
                if SHARED_RE.fullmatch(name) and _short_layer(SHARED_RE, name):
                    shared.append(info)
                elif ROUTER_RE.fullmatch(name) and _short_layer(ROUTER_RE, name):
                    routers.append(info)
        self.shared_tensors = tuple(shared)
        self.router_tensors = tuple(routers)
        if not found:
            raise CheckpointError(self._unknown_layout_message(pattern))
        self.naming = tuple(used)
        self._assemble_layers(found)

    def _quantized(self, info: TensorInfo, matrices: list[ExpertMatrix], layer: int,
                   expert: int | None, kind: str) -> list[ExpertMatrix]:
        """The matrices of one expert tensor with their quantization and scales attached;
        unquantized checkpoints pass through (I8/U8 without metadata stay raw dtypes)."""
        quant = self.quant
        if quant is None:
            return matrices
        where = f"{info.path}: tensor {short(info.name)}"
        own = _quant_of_metadata(info.path, self.file_metadata.get(info.path, {}))
        if own is None:
            raise CheckpointError(f"{where}: mixed formats: the checkpoint is quantized "
                                  f"({quant.describe()}) but this file carries no numa_moe.quant "
                                  "metadata")
        expected = QUANT_DTYPES[quant.fmt]
        if info.dtype != expected:
            raise CheckpointError(f"{where} is {info.dtype} but the checkpoint is {quant.fmt} "
                                  f"({expected} expert weights): mixed formats are not supported")
        bytes_cols = info.shape[-1]
        cols = bytes_cols * 2 if nibble_packed(quant.fmt) else bytes_cols
        if cols % quant.group:
            raise CheckpointError(f"{where}: {cols} columns are not a multiple of the group "
                                  f"size {quant.group}")
        name = scale_tensor_name(info.name)
        scale = self.tensors.get(name)
        if scale is None:
            raise CheckpointError(f"{where}: missing scales: no tensor {short(name)} in the "
                                  "checkpoint (a quantized expert weight needs its group scales)")
        shape = (*info.shape[:-1], scale_columns(quant.fmt, cols, quant.group))
        if scale.shape != shape:
            raise CheckpointError(f"{scale.path}: tensor {short(name)} has shape "
                                  f"{list(scale.shape)}, expected {list(shape)} (the scales of "
                                  f"{list(info.shape)} {info.dtype} {quant.fmt} weights, group "
                                  f"{quant.group})")
        if scale.dtype != SCALE_DTYPE_CODES[quant.scale_dtype]:
            raise CheckpointError(f"{scale.path}: tensor {short(name)} is {scale.dtype} but the "
                                  f"metadata says numa_moe.scale_dtype={quant.scale_dtype} "
                                  f"({SCALE_DTYPE_CODES[quant.scale_dtype]})")
        scales = matrices_of(scale, layer, None if expert is None else str(expert), kind)
        return [replace(m, cols=cols, quant=quant.fmt, scales=s)
                for m, s in zip(matrices, scales, strict=True)]

    def _unknown_layout_message(self, pattern: NamingPattern | None) -> str:
        shapes: Counter = Counter()
        for info in self.tensors.values():
            shapes[(re.sub(r"\d+", "N", info.name), len(info.shape), info.dtype)] += 1
        listing = "\n".join(f"    {name}  ({ndim}-D {dtype}) x{count}"
                            for (name, ndim, dtype), count in shapes.most_common(15))
        tried = ([pattern.regex] if pattern else [p.regex for p in BUILTIN_PATTERNS])
        more = f"\n    ... and {len(shapes) - 15} more name forms" if len(shapes) > 15 else ""
        return (f"{self.root}: no routed-expert tensors recognised among {len(self.tensors)} tensors "
                f"in {len(self.files)} file(s).\nTensor names found (digits shown as N):\n{listing}{more}\n"
                "Patterns tried:\n" + "\n".join(f"    {r}" for r in tried) + "\n" + PATTERN_HELP)

    def _assemble_layers(self, found: dict[tuple[int, int, str], ExpertMatrix]) -> None:
        config = self.config or {}
        e_key, e_config = _config_value(config, "num_local_experts", "num_experts", "n_routed_experts")
        routers = {int(ROUTER_RE.fullmatch(t.name).group("layer")): t for t in self.router_tensors}
        shared_by_layer: dict[int, list[TensorInfo]] = defaultdict(list)
        for t in self.shared_tensors:
            shared_by_layer[int(SHARED_RE.fullmatch(t.name).group("layer"))].append(t)
        by_layer = _experts_by_layer(found)
        for layer in sorted(by_layer):
            kinds = by_layer[layer]
            all_experts = sorted(set().union(*(set(m) for m in kinds.values())))
            n_experts = int(e_config) if e_config is not None else all_experts[-1] + 1
            _check_complete(layer, kinds, n_experts, e_key, e_config)
            gate0 = _check_layer_matrices(layer, kinds, n_experts)
            if self.layers:
                _check_like_first_layer(layer, gate0, n_experts, self.layers[self.layer_ids[0]])
            self.layers[layer] = ExpertLayer(
                layer, gate0.cols, gate0.rows, n_experts, gate0.dtype,
                {kind: tuple(kinds[kind][e] for e in range(n_experts)) for kind in KINDS},
                routers.get(layer), tuple(shared_by_layer.get(layer, ())), self.quant)
        self.dims = self._model_dims(config, e_key)

    def _model_dims(self, config: dict, e_key: str | None) -> ModelDims:
        """The expert dimensions (those of the first layer: all layers share them) checked
        against config.json, with where each came from; notes what config.json lacks."""
        first = self.layers[self.layer_ids[0]]
        reference = first.matrices["gate"][0]
        H, I, E = first.hidden_size, first.intermediate_size, first.n_experts
        sources: dict[str, str] = {}
        sources["n_experts"] = f"config.json {e_key}" if e_key else "tensor names"
        h_key, h_config = _config_value(config, "hidden_size")
        if h_config is not None and int(h_config) != H:
            raise CheckpointError(f"config.json hidden_size={h_config} but {reference.tensor.name!r} "
                                  f"in {reference.tensor.path} has hidden size {H}")
        sources["hidden_size"] = "config.json hidden_size" if h_key else "tensor shapes"
        i_key, i_config = _config_value(config, "moe_intermediate_size", "intermediate_size")
        if i_config is not None and int(i_config) != I:
            raise CheckpointError(f"config.json {i_key}={i_config} but {reference.tensor.name!r} in "
                                  f"{reference.tensor.path} has expert intermediate size {I}")
        sources["intermediate_size"] = f"config.json {i_key}" if i_key else "tensor shapes"
        k_key, top_k = _config_value(config, "num_experts_per_tok")
        sources["top_k"] = "config.json num_experts_per_tok" if k_key else "unknown (not in shapes)"
        if self.config is None:
            self.notes.append("no config.json: hidden size, intermediate size and expert count "
                              "inferred from tensor shapes and names; top-k unknown")
        elif k_key is None:
            self.notes.append("config.json has no num_experts_per_tok: top-k unknown")
        return ModelDims(H, I, E, None if top_k is None else int(top_k), sources)

    # ---------------------------------------------------------------- summary
    def summary(self) -> dict:
        dims = self.dims
        return {
            "checkpoint": str(self.root),
            "files": [str(p) for p in self.files],
            "naming": list(self.naming),
            "dtype": self.dtype,
            "source_format": self.source_format,
            "weight_format": self.weight_format,
            "quant": None if self.quant is None else {
                "format": self.quant.fmt, "group": self.quant.group,
                "scale_dtype": self.quant.scale_dtype},
            "layers": list(self.layer_ids),
            "hidden_size": dims.hidden_size,
            "intermediate_size": dims.intermediate_size,
            "n_experts": dims.n_experts,
            "top_k": dims.top_k,
            "sources": dict(dims.sources),
            "shared_expert_tensors": [t.name for t in self.shared_tensors],
            "router_tensors": len(self.router_tensors),
            "notes": list(self.notes),
        }


def _experts_by_layer(found: dict[tuple[int, int, str], ExpertMatrix]
                      ) -> dict[int, dict[str, dict[int, ExpertMatrix]]]:
    """``found`` regrouped as layer -> kind -> expert -> matrix."""
    by_layer: dict[int, dict[str, dict[int, ExpertMatrix]]] = defaultdict(lambda: defaultdict(dict))
    for (layer, expert, kind), matrix in found.items():
        by_layer[layer][kind][expert] = matrix
    return by_layer


def _check_complete(layer: int, kinds: dict[str, dict[int, ExpertMatrix]], n_experts: int,
                    e_key: str | None, e_config) -> None:
    """Refuse a layer that lacks a kind of some expert below ``n_experts``, or has one
    beyond it."""
    # n_experts may be any count a config.json names: nothing is sized by it
    # until every expert is found present (so it is bounded by the tensors).
    problems = []
    for kind in KINDS:
        have = kinds.get(kind, {})
        missing = _absent(have, n_experts)
        extra = [e for e in have if e >= n_experts]
        if missing:
            problems.append(f"{kind} missing for expert(s) {missing}")
        if extra:
            problems.append(f"{kind} present for expert(s) {_ranges(extra)} beyond the "
                            f"{n_experts} experts of {e_key or 'the layer'}")
    if problems:
        example = next(iter(next(iter(kinds.values())).values())).tensor
        raise CheckpointError(
            f"layer {layer}: incomplete routed experts ({'; '.join(problems)}); "
            f"expected gate, up and down for experts 0..{n_experts - 1}"
            + (f" ({e_key}={e_config} in config.json)" if e_key else " (count inferred from names)")
            + f"; example tensor {example.name!r} in {example.path}")


def _check_layer_matrices(layer: int, kinds: dict[str, dict[int, ExpertMatrix]],
                          n_experts: int) -> ExpertMatrix:
    """Refuse a complete layer whose matrices differ in shape or dtype from its expert 0
    gate (gate/up [I, H], down [H, I]); returns that gate."""
    gate0 = kinds["gate"][0]
    I, H = gate0.rows, gate0.cols
    expected = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    for kind in KINDS:
        for e in range(n_experts):
            m = kinds[kind][e]
            if (m.rows, m.cols) != expected[kind]:
                raise CheckpointError(
                    f"{m.tensor.path}: tensor {m.tensor.name!r}: {kind} of layer {layer} expert {e} "
                    f"has shape [{m.rows}, {m.cols}], expected {list(expected[kind])} "
                    f"(I={I}, H={H} from {gate0.tensor.name!r})")
            if m.dtype != gate0.dtype:
                raise CheckpointError(
                    f"{m.tensor.path}: tensor {m.tensor.name!r} is {m.dtype} but "
                    f"{gate0.tensor.name!r} is {gate0.dtype}: one dtype per layer is required")
    return gate0


def _check_like_first_layer(layer: int, gate0: ExpertMatrix, n_experts: int,
                            first: ExpertLayer) -> None:
    """Refuse a layer whose expert shape or dtype differs from the first MoE layer's."""
    I, H = gate0.rows, gate0.cols
    if (I, H, n_experts) != (first.intermediate_size, first.hidden_size, first.n_experts):
        raise CheckpointError(
            f"layer {layer}: experts are {n_experts} x [{I}, {H}] but layer {first.layer} "
            f"has {first.n_experts} x [{first.intermediate_size}, {first.hidden_size}]: all MoE "
            f"layers must share one expert shape ({gate0.tensor.name!r} in {gate0.tensor.path})")
    if gate0.dtype != first.dtype:
        # The store allocates one buffer dtype for every layer; BF16 and F16 share a
        # size, so a mixed checkpoint would otherwise load as silently wrong numbers.
        raise CheckpointError(
            f"layer {layer}: experts are {gate0.dtype} ({gate0.tensor.name!r} in "
            f"{gate0.tensor.path}) but layer {first.layer} is {first.dtype}: "
            "all MoE layers must share one dtype")


def _group_int(match: re.Match, group: str, pat: NamingPattern, info: TensorInfo) -> int:
    """The layer or expert number a naming pattern's group matched, as a checked int."""
    text = match.group(group)
    if text is None:
        raise CheckpointError(f"{info.path}: tensor {short(info.name)} matches naming pattern "
                              f"{pat.name!r} but its {group!r} group took no part in the match; "
                              f"the group must always match a number")
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise CheckpointError(f"{info.path}: tensor {short(info.name)}: naming pattern "
                              f"{pat.name!r} read {group} {short(text)}, which is not a "
                              "non-negative integer below 10**18")
    return int(text)


def _short_layer(regex: re.Pattern, name: str) -> bool:
    return len(regex.fullmatch(name).group("layer")) <= 18


def _absent(present, n: int) -> str:
    """``_ranges`` of the ids in 0..n-1 not in ``present``, in time of len(present)
    (n may be a huge count from a config file)."""
    out, start = [], 0
    for value in sorted(v for v in set(present) if v < n) + [n]:
        if value > start:
            out.append(str(start) if value == start + 1 else f"{start}-{value - 1}")
        start = value + 1
    return ",".join(out)


def _ranges(values: list[int]) -> str:
    values = sorted(values)
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def matrices_of(info: TensorInfo, layer: int, expert: str | None, kind: str) -> list[ExpertMatrix]:
    """The expert matrices held by one tensor (one, or E of a fused 3-D tensor)."""
    if expert is not None:
        if len(info.shape) != 2 or kind == "gate_up":
            raise CheckpointError(f"{info.path}: tensor {info.name!r} has shape {list(info.shape)}; "
                                  f"a per-expert {kind} matrix must be 2-D")
        if 0 in info.shape:
            raise CheckpointError(f"{info.path}: tensor {info.name!r} has shape {list(info.shape)}; "
                                  "an expert matrix must have at least one element")
        return [ExpertMatrix(layer, int(expert), kind, info, info.file_offset, *info.shape)]
    if len(info.shape) != 3:
        raise CheckpointError(f"{info.path}: tensor {info.name!r} has shape {list(info.shape)}; a fused "
                              f"expert tensor must be 3-D [experts, rows, cols]")
    n_experts, rows, cols = info.shape
    if 0 in info.shape:
        # Also what bounds the expert count: E x rows x cols elements are bytes present.
        raise CheckpointError(f"{info.path}: tensor {info.name!r} has shape {list(info.shape)}; "
                              "a fused expert tensor must hold at least one element per expert")
    per_expert = rows * cols * info.itemsize
    if kind == "gate_up":
        if rows % 2:
            raise CheckpointError(f"{info.path}: tensor {info.name!r} has shape {list(info.shape)}; "
                                  "fused gate_up needs an even row count [E, 2I, H]")
        half = rows // 2
        return [ExpertMatrix(layer, e, k, info, info.file_offset + e * per_expert + i * half * cols * info.itemsize,
                             half, cols)
                for e in range(n_experts) for i, k in enumerate(("gate", "up"))]
    return [ExpertMatrix(layer, e, kind, info, info.file_offset + e * per_expert, rows, cols)
            for e in range(n_experts)]


def _checkpoint_quant(metadata: dict[Path, dict]) -> QuantInfo | None:
    """The one quantization the files declare (None: none does); several is refused."""
    declared: dict[QuantInfo, Path] = {}
    for path, meta in metadata.items():
        quant = _quant_of_metadata(path, meta)
        if quant is not None:
            declared.setdefault(quant, path)
    if len(declared) > 1:
        listing = "; ".join(f"{p.name}: {q.describe()}" for q, p in declared.items())
        raise CheckpointError(f"mixed formats: the files of the checkpoint declare different "
                              f"quantizations ({listing})")
    return next(iter(declared), None)


def read_config(root: Path) -> dict | None:
    """The ``config.json`` beside a safetensors checkpoint (``root`` a directory or one
    of its files), None when there is none."""
    config_path = (root if root.is_dir() else root.parent) / "config.json"
    if not (config_path.exists() or config_path.is_symlink()):
        return None
    config = read_json_file(config_path, "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: a JSON object was expected")
    return config


def read_tensors(root: Path) -> tuple[tuple[Path, ...], dict[str, TensorInfo], dict[Path, dict]]:
    """(files, tensors by name, each file's ``__metadata__``) of the safetensors checkpoint
    at ``root``: one file, an index, or a directory (sharded with an index, or not)."""
    if not root.is_dir():  # a file named on the command line (a FIFO or device is refused)
        if root.name.endswith(".json"):
            return _read_index(root)
        tensors, metadata = read_safetensors_header(root)
        return (root,), tensors, {root: metadata}
    index = root / "model.safetensors.index.json"
    if not (index.exists() or index.is_symlink()):
        candidates = sorted(root.glob("*.safetensors.index.json"))
        if len(candidates) == 1:
            index = candidates[0]
    if index.exists() or index.is_symlink():
        return _read_index(index)
    files = tuple(sorted(root.glob("*.safetensors")))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files and no model.safetensors.index.json")
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[Path, dict] = {}
    for path in files:
        header, metadata[path] = read_safetensors_header(path)
        for name, info in header.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].path} and {path}")
            tensors[name] = info
    return files, tensors, metadata


def _read_index(index: Path) -> tuple[tuple[Path, ...], dict[str, TensorInfo], dict[Path, dict]]:
    document = read_json_file(index, "safetensors index")
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: not a valid safetensors index (a JSON object with a "
                              f"\"weight_map\" object of tensor name -> shard file name was expected)")
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, filename in weight_map.items():
        if not isinstance(filename, str) or not filename:
            raise CheckpointError(f"{index}: weight_map[{short(name)}] is {short(filename)}; "
                                  "a shard file name (a string) was expected")
        by_file[filename].append(name)
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[Path, dict] = {}
    files = []
    for filename in sorted(by_file):
        path = index.parent / filename
        if "/" in filename or "\0" in filename or filename in (".", ".."):
            raise CheckpointError(f"{index}: shard {short(filename)} is not a file name inside "
                                  f"{index.parent} (an index may only name shards beside it)")
        if not (path.exists() or path.is_symlink()):
            raise CheckpointError(f"{index}: shard {filename!r} (holding e.g. tensor "
                                  f"{by_file[filename][0]!r}) does not exist")
        header, metadata[path] = read_safetensors_header(path)
        for name in by_file[filename]:
            if name not in header:
                raise CheckpointError(f"{path}: missing tensor {short(name)} (listed for this "
                                      f"file in {index.name})")
            tensors[name] = header[name]
        files.append(path)
    return tuple(files), tensors, metadata


def read_matrix_into(matrix: ExpertMatrix, out: np.ndarray, fd: int | None = None) -> None:
    """Copy one expert matrix's bytes from its file into ``out`` (C-contiguous, same size).

    Reads straight into the destination (``os.preadv``): no intermediate copy. Pass an
    open read-only ``fd`` of ``matrix.tensor.path`` to avoid reopening per matrix.
    """
    if not out.flags.c_contiguous or out.nbytes != matrix.nbytes:
        raise ValueError(f"destination for {matrix.tensor.name!r} must be C-contiguous with "
                         f"{matrix.nbytes} bytes; got {out.nbytes} bytes, "
                         f"c_contiguous={out.flags.c_contiguous}")
    own = fd is None
    if own:
        fd = open_checkpoint_file(matrix.tensor.path)
    try:
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < matrix.nbytes:
            got = os.preadv(fd, [view[done:]], matrix.file_offset + done)
            if got <= 0:
                raise CheckpointError(
                    f"{matrix.tensor.path}: file ended while reading tensor {matrix.tensor.name!r} "
                    f"(byte {matrix.file_offset + done}); it changed since its header was read")
            done += got
    finally:
        if own:
            os.close(fd)


def read_float_rows(info: TensorInfo, files: OpenFiles) -> np.ndarray:
    """A small float tensor (expert biases [E, n], any float dtype NUMPY_DTYPES names) as
    float32 ``[shape[0], prod(shape[1:])]``, read through ``files`` (an OpenFiles)."""
    rows = info.shape[0]
    cols = math.prod(info.shape[1:])
    values = np.empty((rows, cols), dtype=NUMPY_DTYPES[info.dtype])
    read_matrix_into(ExpertMatrix(0, 0, "bias", info, info.file_offset, rows, cols), values, files.fd(info.path))
    return values.astype(np.float32)


def read_scales_into(matrix: ExpertMatrix, out: np.ndarray, fd: int | None = None) -> None:
    """Copy the group scales of a quantized expert matrix into ``out`` ([rows, cols /
    group], C-contiguous, the scale dtype; int4-affine [rows, 2 cols / group], its
    minimums after the scales) and check them: a NaN, infinite or (but for iq4nl and
    int4-affine, quant.zero_scales_allowed) zero scale is a CheckpointError naming the
    tensor and the first bad element (a column past cols / group is a minimum)."""
    scales = matrix.scales
    if scales is None:
        raise ValueError(f"{matrix.tensor.name!r} is not a quantized expert matrix (no scales)")
    read_matrix_into(scales, out, fd)
    values = out.reshape(scales.rows, scales.cols).astype(np.float32)
    zero_allowed = zero_scales_allowed(matrix.quant)
    bad = ~np.isfinite(values) | ((values == 0) & (not zero_allowed))
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        what = "NaN" if np.isnan(values[r, c]) else "zero" if values[r, c] == 0 else "infinite"
        raise CheckpointError(
            f"{scales.tensor.path}: tensor {short(scales.tensor.name)}: {int(bad.sum())} NaN, "
            f"infinite or zero scale(s) for layer {matrix.layer} expert {matrix.expert} "
            f"{matrix.kind} (first: row {r}, group {c} is {what}); scales must be finite"
            + ("" if zero_allowed else " and non-zero"))

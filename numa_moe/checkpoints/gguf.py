"""The routed experts of a llama.cpp GGUF file, read with ggml's own ``gguf`` package.

llama.cpp stores a MoE layer's routed experts fused, one 3-D tensor per kind:
``blk.L.ffn_gate_exps.weight``, ``blk.L.ffn_up_exps.weight`` (ggml dims ``[H, I, E]``,
row-major ``[E, I, H]``) and ``blk.L.ffn_down_exps.weight`` (``[E, H, I]``), each
expert one contiguous slice. Rows are sequences of ggml blocks (32 weights for Q8_0 and
Q4_0, 256 for the K-quants), so an expert matrix is still (file, byte offset, rows, cols),
with ``rows x cols / block x block bytes`` bytes. Sizes come from the metadata
(``general.architecture``, ``{arch}.expert_count``, ``{arch}.embedding_length``,
``{arch}.expert_feed_forward_length`` or ``{arch}.feed_forward_length``,
``{arch}.expert_used_count``) and are checked against every expert tensor's shape.

Conversion into the store's layout (``GGUFImport``, one expert matrix at a time):

* Q8_0 -> int8 and Q4_0 -> int4, group 32, fp16 scales, MXFP4 -> mxfp4, group 32, e8m0
  scales, IQ4_NL -> iq4nl, group 32, fp16 scales: bytes re-arranged, no loss, at the
  file's own bytes (``numa_moe.quant.from_q8_0`` / ``from_q4_0`` / ``from_gguf_mxfp4`` /
  ``from_iq4_nl``; the block scales land in their own row-major tensor);
* IQ4_XS -> iq4nl, group 32, fp32 scales d * (ls - 32) (exact in fp32), at 1.18x the
  file's bytes (its two-level scales flattened, ``from_iq4_xs``), and Q5_0 -> int8, group
  32, fp16 scales, at 1.5x (``from_q5_0``): no loss, their defaults;
* Q4_1 -> int4-affine, group 32, fp16 scales and minimums, at the file's own bytes, and
  Q4_K -> int4-affine, group 32, fp32 scales d * sc and minimums -(dmin * m) (exact in
  fp32), at 1.33x (its two-level scales flattened): no loss, their defaults. These exact
  loads run natively, one pass from the file's bytes into the store's buffers
  (``_native.convert_ggml_blocks``: the same bytes as the numpy readers named here; Q4_1
  and Q4_K the gguf package's values, tests/test_ggml_blocks.py);
* BF16, F16, F32: copied as they are;
* every other type the ``gguf`` package dequantizes (the other K-quants, Q5_1, NVFP4, ...):
  dequantized by it and requantized to the int8/int4 format asked for (or rounded to
  bf16), as are the types above when another format is asked for. Types it cannot
  dequantize are refused when the file is opened.

Expert biases (``blk.L.ffn_{gate,up,down}_exps.bias``, ``[E, I]`` / ``[E, H]``, as
llama.cpp's converter writes gpt-oss's) load per expert as fp32; a ``gpt-oss`` file's
experts take gpt-oss's clamped SwiGLU (``numa_moe.activation.GPT_OSS``: llama.cpp fixes
its alpha 1.702 and limit 7 in code, not in the metadata).

The file is parsed by ``gguf.GGUFReader`` (given an fd from ``open_checkpoint_file``).
The reader builds a numpy view per metadata element and several per tensor record
before anything can be checked, so ``_check_layout`` first walks the header, metadata
and tensor records itself, bounding every count and length by the bytes the file holds
and by what a plausible model has; ``_BoundedReader`` adds the bounds checks that make a
truncated or crafted file a one-line ``CheckpointError`` instead of an exception from
deep inside the reader.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from numa_moe import _native
from numa_moe import quant as q
from numa_moe.activation import GPT_OSS, Activation
from numa_moe.checkpoints.expert_import import NATIVE_GROUP_FORMATS, ExpertImport, LoadFormat, convert_float
from numa_moe.checkpoints.safetensors import (Checkpoint, ExpertLayer, ExpertMatrix, ModelDims, TensorInfo,
                                              read_float_rows, read_matrix_into)
from numa_moe.files import CheckpointError, OpenFiles, open_checkpoint_file, short
from numa_moe.formats import KINDS

__all__ = ["open_gguf", "gguf_file_of", "read_gguf", "GGUFImport", "supported_types", "EXPERT_TENSOR", "MAX_METADATA_ELEMENTS",
           "MAX_TENSORS", "MAX_METADATA_KEYS", "DEQUANTIZE_CHUNK_WEIGHTS"]

EXPERT_TENSOR = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<kind>gate|up|down)_exps\.weight")
EXPERT_BIAS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<kind>gate|up|down)_exps\.bias")
# general.architecture -> the experts' activation, where it is not silu(g) * u
ARCH_ACTIVATIONS = {"gpt-oss": GPT_OSS}
_SHARED = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?:gate|up|down|gate_inp)_shexp\.weight")
_ROUTER = re.compile(r"blk\.(?P<layer>\d+)\.ffn_gate_inp\.weight")
_DENSE = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?:gate|up|down)\.weight")

# ggml float types -> the store's float format of the same bits
GGML_FLOATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
# ggml types that convert without loss: -> the contract's format (group 32)
EXACT = {"Q8_0": LoadFormat("int8", q.GGML_BLOCK, "fp16"),
            "Q4_0": LoadFormat("int4", q.GGML_BLOCK, "fp16"),
            "MXFP4": LoadFormat("mxfp4", q.MX_BLOCK, "e8m0"),
            "IQ4_NL": LoadFormat("iq4nl", q.GGML_BLOCK, "fp16"),
            "IQ4_XS": LoadFormat("iq4nl", q.GGML_BLOCK, "fp32"),
            "Q5_0": LoadFormat("int8", q.GGML_BLOCK, "fp16"),
            "Q4_1": LoadFormat("int4-affine", q.GGML_BLOCK, "fp16"),
            "Q4_K": LoadFormat("int4-affine", q.GGML_BLOCK, "fp32")}
# llama.cpp's K-quants: dequantized natively (the other requantized types by the gguf package)
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# bits per weight at or below which requantized experts default to int4 (Q4_K is 4.5)
INT4_DEFAULT_BITS = 4.5
_MAX_DIMS = 4  # GGML_MAX_DIMS
# The reader keeps one numpy view per metadata array element and several per metadata
# entry and tensor record, some hundred bytes each: these bounds keep a crafted file from
# costing gigabytes (the reader takes ~0.1 ms per entry or tensor record: the caps bound
# it to seconds). Real files hold about 1.3 M elements (a 256 k-token vocabulary's
# tokens, scores, types and merges), some tens of metadata entries and one or two
# thousand tensors (DeepSeek-V3, Llama-3.1-405B: ~1100).
MAX_METADATA_ELEMENTS = 4_000_000
MAX_METADATA_KEYS = 4_096
MAX_TENSORS = 16_384
GGUF_VERSIONS = (2, 3)
GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
# GGUF value type -> bytes of a scalar of it; 8 (string) and 9 (array) are variable
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# Fewest bytes a metadata entry (key length, type, a 1-byte value) and a tensor record
# (name length, n_dims, one dim, type, offset) take: a count times these must fit.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8
_MAX_KEY_BYTES = 65_535  # the GGUF specification's limit on a key (and a tensor name)


def _gguf():
    import gguf

    return gguf


def _bits_per_weight(type_name: str) -> float:
    gguf = _gguf()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return size * 8 / block


class _PastEnd(Exception):
    def __init__(self, begin: int, end: int, size: int):
        super().__init__(begin, end, size)
        self.begin, self.end, self.size = begin, end, size


def _bounded_reader_class():
    gguf = _gguf()

    class _BoundedReader(gguf.GGUFReader):
        """GGUFReader that refuses to read past the end of the file (the reader itself
        slices its memmap, which silently yields fewer bytes, and may then loop over a
        count read from the file) and checks each tensor's type, dims and byte range
        before it builds its views."""

        def __init__(self, f, path: Path, array_bytes: dict[int, int] | None = None):
            self._path = path
            self._elements = 0
            self._array_bytes = array_bytes
            super().__init__(f)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == gguf.GGUFValueType.ARRAY and self._array_bytes is not None:
                # the array as one raw view: no per-element views (the reader's cost)
                size = self._array_bytes[int(orig_offs)]
                itype = self._get(orig_offs, np.uint32)
                alen = self._get(orig_offs + 4, np.uint64)
                raw = self._get(orig_offs + 12, np.uint8, size - 12)
                return size, [itype, alen, raw], [], [gguf.GGUFValueType.ARRAY,
                                                      gguf.GGUFValueType(int(itype[0]))]
            if raw_type == gguf.GGUFValueType.ARRAY:
                self._elements += int(self._get(orig_offs + 4, np.uint64)[0])
                if self._elements > MAX_METADATA_ELEMENTS:
                    raise CheckpointError(
                        f"{self._path}: GGUF metadata arrays hold more than "
                        f"{MAX_METADATA_ELEMENTS} elements, more than a plausible model has "
                        "(corrupted or crafted file)")
            return super()._get_field_parts(orig_offs, raw_type)

        def _build_tensor_info(self, offs, count):
            if int(count) > MAX_TENSORS:
                raise CheckpointError(f"{self._path}: GGUF header declares {int(count)} tensors, "
                                      f"more than the {MAX_TENSORS} a plausible model has")
            return super()._build_tensor_info(offs, count)

        def _get(self, offset, dtype, count=1, override_order=None):
            count = int(count)
            end = int(offset) + np.dtype(dtype).itemsize * count
            if offset < 0 or count < 0 or end > self.data.size:
                raise _PastEnd(int(offset), end, int(self.data.size))
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _check_tensor_field(field, int(start_offs), int(self.data.size), self._path)
            super()._build_tensors(start_offs, fields)

    return _BoundedReader


class _Layout:
    """Walks a GGUF file's header, metadata and tensor records (the GGUF specification's
    layout) without building anything, refusing with a ``CheckpointError`` naming the
    field any count or length that the bytes after it cannot hold."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.size = data, path, len(data)
        self.elements = 0
        self.order = "<"
        self.array_bytes: dict[int, int] = {}  # offset of a metadata array -> its bytes

    def _past_end(self, at: int, field: str, need: int) -> CheckpointError:
        return CheckpointError(f"{self.path}: truncated GGUF file: {field} needs {need} bytes at "
                               f"byte {at}, but the file has {self.size} bytes")

    def uint(self, at: int, width: int, field: str) -> int:
        if at + width > self.size:
            raise self._past_end(at, field, width)
        return struct.unpack_from(self.order + ("I" if width == 4 else "Q"), self.data, at)[0]

    def string(self, at: int, field: str, limit: int | None = None) -> int:
        """End of the string at ``at``."""
        n = self.uint(at, 8, f"the length of {field}")
        left = self.size - at - 8
        if n > left or (limit is not None and n > limit):
            bound = f"only {left} bytes follow" if n > left else f"at most {limit} are allowed"
            raise CheckpointError(f"{self.path}: {field} claims a string of {n} bytes at byte "
                                  f"{at}, but {bound} (truncated or corrupted GGUF file)")
        return at + 8 + n

    def header(self) -> tuple[int, int, int]:
        """(tensor count, metadata entry count, end of the header), checked."""
        magic = bytes(self.data[:4])
        if magic != GGUF_MAGIC:
            raise CheckpointError(f"{self.path}: not a readable GGUF file: it starts with "
                                  f"{magic!r}, not the GGUF magic b'GGUF'")
        version = self.uint(4, 4, "the GGUF version")
        if version & 0xFFFF == 0:  # written big-endian
            self.order = ">"
            version = self.uint(4, 4, "the GGUF version")
        if version not in GGUF_VERSIONS:
            raise CheckpointError(f"{self.path}: not a readable GGUF file: GGUF version {version}; "
                                  f"the reader knows versions {', '.join(map(str, GGUF_VERSIONS))}")
        tensors = self.uint(8, 8, "the tensor count")
        keys = self.uint(16, 8, "the metadata entry count")
        if tensors > MAX_TENSORS:
            raise CheckpointError(f"{self.path}: GGUF header declares {tensors} tensors, more than "
                                  f"the {MAX_TENSORS} a plausible model has")
        if keys > MAX_METADATA_KEYS:
            raise CheckpointError(f"{self.path}: GGUF header declares {keys} metadata entries, more "
                                  f"than the {MAX_METADATA_KEYS} a plausible model has")
        need = 24 + keys * _MIN_KV_BYTES + tensors * _MIN_TENSOR_BYTES
        if need > self.size:
            raise CheckpointError(f"{self.path}: truncated or corrupted GGUF file: the header "
                                  f"declares {keys} metadata entries and {tensors} tensors, which "
                                  f"take at least {need} bytes, but the file has {self.size}")
        return tensors, keys, 24

    def value(self, at: int, vtype: int, field: str, nested: bool = False) -> int:
        """End of the value of type ``vtype`` at ``at``."""
        if vtype in _SCALAR_BYTES:
            if at + _SCALAR_BYTES[vtype] > self.size:
                raise self._past_end(at, field, _SCALAR_BYTES[vtype])
            return at + _SCALAR_BYTES[vtype]
        if vtype == _STRING:
            return self.string(at, field)
        if vtype != _ARRAY:
            raise CheckpointError(f"{self.path}: {field} has value type {vtype}, which GGUF does "
                                  "not define (corrupted file)")
        if nested:
            raise CheckpointError(f"{self.path}: {field} is an array of arrays of arrays; GGUF "
                                  "metadata nests arrays at most once")
        itype = self.uint(at, 4, f"the element type of {field}")
        count = self.uint(at + 4, 8, f"the length of {field}")
        at += 12
        self.elements += count
        if self.elements > MAX_METADATA_ELEMENTS:
            raise CheckpointError(f"{self.path}: GGUF metadata arrays hold more than "
                                  f"{MAX_METADATA_ELEMENTS} elements, more than a plausible model "
                                  f"has ({field} claims {count}; corrupted or crafted file)")
        least = _SCALAR_BYTES.get(itype, 8 if itype == _STRING else 12)
        if itype not in _SCALAR_BYTES and itype not in (_STRING, _ARRAY):
            raise CheckpointError(f"{self.path}: {field} is an array of value type {itype}, which "
                                  "GGUF does not define (corrupted file)")
        if count * least > self.size - at:
            raise CheckpointError(f"{self.path}: truncated or corrupted GGUF file: {field} claims "
                                  f"{count} elements of at least {least} bytes at byte {at}, but "
                                  f"only {self.size - at} bytes follow")
        if itype in _SCALAR_BYTES:
            return at + count * least
        if itype == _STRING:  # the one long loop of a real file (a vocabulary): kept lean
            unpack, size, data = struct.Struct(self.order + "Q").unpack_from, self.size, self.data
            for i in range(count):
                if at + 8 > size:
                    raise self._past_end(at, f"the length of {field}[{i}]", 8)
                at += 8 + unpack(data, at)[0]
                if at > size:
                    raise CheckpointError(f"{self.path}: truncated or corrupted GGUF file: "
                                          f"{field}[{i}] ends past the end of the file")
            return at
        for i in range(count):
            at = self.value(at, itype, f"{field}[{i}]", nested=True)
        return at

    def walk(self) -> None:
        tensors, keys, at = self.header()
        for i in range(keys):
            end = self.string(at, f"the key of metadata entry #{i}", _MAX_KEY_BYTES)
            key = f"metadata {short(bytes(self.data[at + 8:end]).decode('utf-8', 'replace'))}"
            vtype = self.uint(end, 4, f"the value type of {key}")
            at = self.value(end + 4, vtype, key)
            if vtype == _ARRAY:
                self.array_bytes[end + 4] = at - (end + 4)
        for i in range(tensors):
            end = self.string(at, f"the name of tensor #{i}", _MAX_KEY_BYTES)
            where = f"tensor #{i} ({short(bytes(self.data[at + 8:end]).decode('utf-8', 'replace'))})"
            n_dims = self.uint(end, 4, f"the dimension count of {where}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise CheckpointError(f"{self.path}: {where} has {n_dims} dimensions (GGUF allows "
                                      f"1 to {_MAX_DIMS}; corrupted file)")
            at = end + 4 + 8 * n_dims + 4 + 8
            if at > self.size:
                raise self._past_end(end + 4, f"the dims, type and offset of {where}",
                                     8 * n_dims + 12)


def _check_layout(fd: int, path: Path) -> dict[int, int]:
    """Walks the file (``_Layout``); returns the byte size of each metadata array by offset."""
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as data:
        layout = _Layout(data, path)
        layout.walk()
    return layout.array_bytes


def _check_tensor_field(field, data_start: int, file_bytes: int, path: Path) -> None:
    gguf = _gguf()
    _, name_data, n_dims, dims, raw_type, offset = field.parts
    try:
        name = bytes(name_data).decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: a tensor name is not UTF-8 "
                              f"({short(bytes(name_data))}): corrupted GGUF file") from None
    where = f"{path}: tensor {short(name)}"
    code = int(raw_type[0])
    try:
        qtype = gguf.GGMLQuantizationType(code)
    except ValueError:
        raise CheckpointError(f"{where} has ggml type {code}, which gguf {_gguf_version()} does "
                              "not know: unknown tensor type (a newer llama.cpp type, or a "
                              "corrupted file)") from None
    type_name = qtype.name
    shape = [int(d) for d in dims]
    if not 1 <= int(n_dims[0]) <= _MAX_DIMS or min(shape) < 1:
        raise CheckpointError(f"{where}: ggml dims {short(shape)} (at most {_MAX_DIMS}, each >= 1)")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[0] % block:
        raise CheckpointError(f"{where}: {type_name} rows of {shape[0]} weights are not whole "
                              f"{block}-weight blocks")
    nbytes = math.prod(shape) // block * size  # Python ints: never wraps
    begin = data_start + int(offset[0])
    if begin + nbytes > file_bytes:
        raise CheckpointError(f"{where}: {type_name} {short(shape)} declares {nbytes} bytes at "
                              f"byte {begin}, but the file has only {file_bytes} bytes "
                              "(truncated file, or sizes larger than its bytes)")


def _gguf_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:
        return "(unknown version)"


def read_gguf(path: str | os.PathLike, metadata_arrays: bool = True):
    """``gguf.GGUFReader`` of ``path`` (opened by ``open_checkpoint_file``: no FIFOs or
    devices), with every way a malformed file fails turned into a one-line
    ``CheckpointError`` naming the file. ``metadata_arrays=False`` keeps each metadata
    array as one raw byte view (``field.parts[2]``, ``field.contents()`` empty) instead
    of the reader's view per element: a vocabulary then costs nothing to open."""
    path = Path(path)
    fd = open_checkpoint_file(path)
    reader_class = _bounded_reader_class()
    try:
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes; the header "
                                      "alone needs 24)")
            array_bytes = _check_layout(f.fileno(), path)
            reader = reader_class(f, path, None if metadata_arrays else array_bytes)
    except CheckpointError:
        raise
    except _PastEnd as err:
        raise CheckpointError(f"{path}: truncated GGUF file: the header runs to byte {err.end} but "
                              f"the file has {err.size} bytes") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not a readable GGUF file: metadata arrays nested too "
                              "deeply to be plausible") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError,
            MemoryError) as err:
        # the reader's own messages may be empty (a bare KeyError ''): its type says more
        raise CheckpointError(f"{path}: not a readable GGUF file: the gguf reader failed with "
                              f"{type(err).__name__}: {short(str(err), 160) if str(err) else '(no message)'}") from None
    return reader


def _metadata_int(reader, path: Path, key: str, required: bool = True) -> int | None:
    gguf = _gguf()
    field = reader.get_field(key)
    if field is None:
        if required:
            raise CheckpointError(f"{path}: GGUF metadata {key} is missing (needed for the routed "
                                  "experts' sizes)")
        return None
    ints = {gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT16,
            gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
            gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64}
    if len(field.types) != 1 or field.types[0] not in ints:
        raise CheckpointError(f"{path}: GGUF metadata {key} is {field.types[0].name if field.types else '?'}, "
                              "not an integer")
    value = int(field.contents())
    if value < 1:
        raise CheckpointError(f"{path}: GGUF metadata {key}={value} is not a positive integer")
    return value


def _architecture(reader, path: Path) -> str:
    gguf = _gguf()
    field = reader.get_field("general.architecture")
    if field is None:
        raise CheckpointError(f"{path}: GGUF metadata general.architecture is missing")
    if field.types != [gguf.GGUFValueType.STRING]:
        raise CheckpointError(f"{path}: GGUF metadata general.architecture is not a string")
    try:
        return field.contents()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: GGUF metadata general.architecture is not UTF-8") from None


def gguf_file_of(root: Path) -> Path | None:
    """The GGUF file a checkpoint path names: a ``*.gguf`` file (or any file starting
    with the GGUF magic), or a directory holding one ``*.gguf`` file and no safetensors;
    None for safetensors checkpoints."""
    if root.is_dir():
        found = sorted(root.glob("*" + GGUF_SUFFIX))
        if not found or any(root.glob("*.safetensors")):
            return None
        if len(found) > 1:
            raise CheckpointError(f"{root}: holds {len(found)} GGUF files "
                                  f"({', '.join(p.name for p in found[:4])}); name the one to read "
                                  "(split GGUF models are not supported: merge them with "
                                  "llama-gguf-split --merge)")
        return found[0]
    if root.name.endswith(GGUF_SUFFIX):
        return root
    fd = open_checkpoint_file(root)
    try:
        head = os.pread(fd, 4, 0)
    finally:
        os.close(fd)
    return root if head == GGUF_MAGIC else None


def open_gguf(path: str | os.PathLike, pattern=None) -> Checkpoint:
    """A ``Checkpoint`` of a GGUF file: its tensors (dtype = ggml type name, shape in
    row-major order), the routed experts of every MoE block, shared experts, routers and
    dense FFNs reported apart, and a ``GGUFImport`` as ``checkpoint.importer``."""
    path = Path(path)
    if pattern is not None:
        raise CheckpointError(f"{path}: a naming pattern applies to safetensors checkpoints; GGUF "
                              "experts are found by llama.cpp's names (blk.L.ffn_*_exps.weight)")
    reader = read_gguf(path, metadata_arrays=False)  # only scalars are read below
    split = _metadata_int(reader, path, "split.count", required=False)
    if split is not None and split > 1:
        raise CheckpointError(f"{path}: one part of a split GGUF model ({split} parts); merge "
                              "them first (llama-gguf-split --merge)")
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = TensorInfo(t.name, path, t.tensor_type.name, shape, int(t.data_offset),
                                     int(t.n_bytes))
    arch = _architecture(reader, path)
    n_experts = _metadata_int(reader, path, f"{arch}.expert_count")
    hidden = _metadata_int(reader, path, f"{arch}.embedding_length")
    ffn_key = f"{arch}.expert_feed_forward_length"
    intermediate = _metadata_int(reader, path, ffn_key, required=False)
    if intermediate is None:
        ffn_key = f"{arch}.feed_forward_length"  # Mixtral-style: the experts are the FFN
        intermediate = _metadata_int(reader, path, ffn_key, required=False)
    if intermediate is None:
        raise CheckpointError(f"{path}: GGUF metadata {arch}.expert_feed_forward_length (or "
                              f"{arch}.feed_forward_length) is missing (needed for the routed "
                              "experts' sizes)")
    top_k = _metadata_int(reader, path, f"{arch}.expert_used_count", required=False)
    del reader  # its memmap: the experts are read through fds from here on

    expected = {"gate": (n_experts, intermediate, hidden), "up": (n_experts, intermediate, hidden),
                "down": (n_experts, hidden, intermediate)}
    by_layer: dict[int, dict[str, TensorInfo]] = defaultdict(dict)
    biases: dict[int, dict[str, TensorInfo]] = defaultdict(dict)
    shared, routers, dense = [], [], set()
    for name, info in tensors.items():
        match = EXPERT_TENSOR.fullmatch(name)
        if match is not None:
            by_layer[int(match.group("layer"))][match.group("kind")] = info
        elif (bias := EXPERT_BIAS.fullmatch(name)) is not None:
            biases[int(bias.group("layer"))][bias.group("kind")] = info
        elif _SHARED.fullmatch(name):
            shared.append(info)
        elif _ROUTER.fullmatch(name):
            routers.append(info)
        elif (dense_match := _DENSE.fullmatch(name)):
            dense.add(int(dense_match.group("layer")))
    if not by_layer:
        raise CheckpointError(f"{path}: no routed-expert tensors (blk.N.ffn_gate_exps.weight, "
                              f"ffn_up_exps, ffn_down_exps) among {len(tensors)} tensors of this "
                              f"{arch} GGUF file")
    types: set[str] = set()
    layers = {}
    for layer in sorted(by_layer):
        kinds = by_layer[layer]
        missing = [k for k in KINDS if k not in kinds]
        if missing:
            raise CheckpointError(f"{path}: block {layer}: incomplete routed experts "
                                  f"(ffn_{'_exps, ffn_'.join(missing)}_exps missing)")
        matrices = {kind: _expert_matrices(path, layer, kind, kinds[kind], expected[kind], arch)
                    for kind in KINDS}
        layer_types = sorted({kinds[k].dtype for k in KINDS})
        types.update(layer_types)
        layers[layer] = ExpertLayer(
            layer, hidden, intermediate, n_experts, "+".join(layer_types), matrices,
            next((r for r in routers if _ROUTER.fullmatch(r.name).group("layer") == str(layer)), None),
            tuple(s for s in shared if _SHARED.fullmatch(s.name).group("layer") == str(layer)))
    bias_widths = {"gate": intermediate, "up": intermediate, "down": hidden}
    for layer, kinds in biases.items():
        if layer not in layers:
            raise CheckpointError(f"{path}: block {layer} has expert biases but no routed experts")
        for kind, info in kinds.items():
            _check_bias(path, info, (n_experts, bias_widths[kind]))
    importer = GGUFImport(tuple(sorted(types)), dict(biases), ARCH_ACTIVATIONS.get(arch))
    sources = {"hidden_size": f"GGUF {arch}.embedding_length",
               "intermediate_size": f"GGUF {ffn_key}",
               "n_experts": f"GGUF {arch}.expert_count",
               "top_k": f"GGUF {arch}.expert_used_count" if top_k else "unknown (not in metadata)"}
    notes = []
    if top_k is None:
        notes.append(f"GGUF metadata has no {arch}.expert_used_count: top-k unknown")
    if dense:
        notes.append(f"dense FFN (not routed experts) in block(s) {_blocks(dense)}")
    ck = Checkpoint(root=path, files=(path,), tensors=tensors, config=None, naming=("gguf",),
                    layers=layers, dims=ModelDims(hidden, intermediate, n_experts, top_k, sources),
                    shared_tensors=tuple(shared), router_tensors=tuple(routers), notes=notes,
                    file_metadata={path: {"general.architecture": arch}}, importer=importer)
    return ck


def _check_bias(path: Path, info: TensorInfo, expected: tuple[int, int]) -> None:
    if info.shape != expected:
        raise CheckpointError(f"{path}: tensor {info.name!r}: expert bias of ggml dims {list(reversed(info.shape))}, "
                              f"expected {list(reversed(expected))}")
    if info.dtype not in GGML_FLOATS:
        raise CheckpointError(f"{path}: tensor {info.name!r}: expert bias of ggml type {info.dtype}, expected one "
                              f"of {', '.join(GGML_FLOATS)}")


def _blocks(ids) -> str:
    ids = sorted(ids)
    return ",".join(map(str, ids)) if len(ids) <= 8 else f"{ids[0]}-{ids[-1]} ({len(ids)} blocks)"


def _expert_matrices(path: Path, layer: int, kind: str, info: TensorInfo,
                     expected: tuple[int, int, int], arch: str) -> tuple[ExpertMatrix, ...]:
    where = f"{path}: tensor {info.name!r}"
    if info.shape != expected:
        ggml_expected = list(reversed(expected))
        what = ("wrong expert dimension order" if sorted(info.shape) == sorted(expected)
                else "shape does not match the metadata")
        raise CheckpointError(
            f"{where}: {what}: ggml dims {list(reversed(info.shape))}, expected {ggml_expected} "
            f"([cols, rows, experts] from {arch}.expert_count, embedding_length and the expert "
            f"feed-forward length)")
    if info.dtype not in GGML_FLOATS and info.dtype not in EXACT:
        _check_dequantizable(info, where)
    n_experts, rows, cols = info.shape
    per_expert = info.nbytes // n_experts
    return tuple(ExpertMatrix(layer, e, kind, info, info.file_offset + e * per_expert, rows, cols,
                              stored_bytes=per_expert)
                 for e in range(n_experts))


_DEQUANTIZABLE: dict[str, bool] = {}

# Weights per call of a type's row dequantizer (GGUFImport.dequantize). The package's
# gguf.quants.dequantize calls it 16 rows at a time, and at expert widths the Python
# between those calls holds the GIL about as long as their numpy work releases it, so
# loading threads barely overlap; about a million weights a call (tens of MB of a K-quant's
# float32 temporaries per thread) makes the numpy work, which releases the GIL, nearly all.
DEQUANTIZE_CHUNK_WEIGHTS = 1 << 20


def _dequantizable(type_name: str) -> bool:
    """Whether the gguf package dequantizes ``type_name`` (tried once per type on one zero block)."""
    if type_name not in _DEQUANTIZABLE:
        gguf = _gguf()
        qtype = gguf.GGMLQuantizationType[type_name]
        try:
            _, size = gguf.GGML_QUANT_SIZES[qtype]
            gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
            _DEQUANTIZABLE[type_name] = True
        except (KeyError, NotImplementedError, ValueError, TypeError):
            _DEQUANTIZABLE[type_name] = False
    return _DEQUANTIZABLE[type_name]


def _check_dequantizable(info: TensorInfo, where: str) -> None:
    """Refuse a type the gguf package cannot dequantize, naming the supported ones."""
    if not _dequantizable(info.dtype):
        raise CheckpointError(f"{where}: ggml type {info.dtype} cannot be read: gguf "
                              f"{_gguf_version()} has no dequantization for it; supported expert "
                              f"types: {', '.join(supported_types())}")


def supported_types() -> list[str]:
    """The ggml types routed experts may have: the floats, the exact loads and every
    other type the installed gguf package dequantizes."""
    names = [*GGML_FLOATS, *EXACT]
    return names + [t.name for t in _gguf().GGMLQuantizationType
                    if t.name not in names and _dequantizable(t.name)]


@dataclass(frozen=True)
class GGUFImport(ExpertImport):
    """How a GGUF file's routed experts become the store's formats (module doc)."""

    types: tuple[str, ...]
    # layer -> kind -> the experts' bias tensor ([E, I] or [E, H]); layers without: none
    bias_tensors: dict = None
    activation: Activation | None = None

    @property
    def source(self) -> str:
        return "GGUF " + "+".join(self.types)

    def biases(self, layer: ExpertLayer, files: OpenFiles | None = None):
        kinds = (self.bias_tensors or {}).get(layer.layer)
        if not kinds:
            return None
        with OpenFiles() as own:
            opened = files or own
            rows = {kind: read_float_rows(info, opened) for kind, info in kinds.items()}
        for kind, values in rows.items():
            if not np.all(np.isfinite(values)):
                e, i = (int(v) for v in np.argwhere(~np.isfinite(values))[0])
                raise CheckpointError(f"{kinds[kind].path}: tensor {kinds[kind].name!r}: expert {e}'s bias "
                                      f"entry {i} is not finite")
        return [tuple(rows[kind][e].copy() if kind in rows else None for kind in KINDS)
                for e in range(layer.n_experts)]

    @property
    def float_formats(self) -> tuple[str, ...]:
        own = {GGML_FLOATS[t] for t in self.types if t in GGML_FLOATS}
        return ("bf16",) + tuple(sorted(own - {"bf16"})) if len(self.types) == 1 else ("bf16",)

    def default(self) -> LoadFormat:
        if len(self.types) == 1:
            (only,) = self.types
            if only in GGML_FLOATS:
                return LoadFormat(GGML_FLOATS[only])
            if only in EXACT:
                return EXACT[only]
        low_bit = all(_bits_per_weight(t) <= INT4_DEFAULT_BITS for t in self.types)
        return LoadFormat("int4" if low_bit else "int8", q.GGML_BLOCK, "fp16")

    def exact(self, fmt: LoadFormat) -> bool:
        return all(_exact(t, fmt) for t in self.types)

    def read_into(self, matrix: ExpertMatrix, fd: int, values: np.ndarray,
                  scales: np.ndarray | None, fmt: LoadFormat) -> None:
        t = matrix.dtype
        if t in GGML_FLOATS and fmt.fmt == GGML_FLOATS[t]:
            read_matrix_into(matrix, values, fd)
            return
        if t in EXACT and EXACT[t] == fmt:
            # One native pass straight into the store's buffers, checking each block's
            # scale. A block whose scale is +-0 holds zeros (ggml writes d = 0 for an
            # all-zero block; IQ4_XS's sub-block scale d * (ls - 32) is 0 at ls = 32,
            # whatever its codes): iq4nl keeps the zero scale (its codebook has no 0); the
            # other formats' scales are never 0, so such a block becomes values 0 under the
            # scale +-1, the same zeros (e8m0 has no zero). The numpy readers of
            # numa_moe.quant give the same bytes before that rule (tests/test_ggml_blocks.py).
            try:
                _native.convert_ggml_blocks(t, _raw(matrix, fd), matrix.rows, matrix.cols, values, scales)
            except ValueError as err:
                raise CheckpointError(f"{_where(matrix)}: {err}") from None
            return
        if t in K_QUANTS and fmt.fmt in NATIVE_GROUP_FORMATS:
            # Dequantized and quantized a row at a time: the bytes of dequantize() then
            # quantize_into, without a float32 copy of the matrix (tests/test_ggml_blocks.py).
            try:
                q.check_arguments(weight_format=fmt.fmt, group=fmt.group, scale_dtype=fmt.scale_dtype)
                _native.requantize_ggml_k_blocks(t, _raw(matrix, fd), matrix.rows, matrix.cols, fmt.fmt,
                                                 fmt.group, fmt.scale_dtype, values, scales)
            except ValueError as err:
                raise CheckpointError(f"{_where(matrix)}: {err}") from None
            return
        convert_float(self.dequantize(matrix, fd), values, scales, fmt, _where(matrix))

    def dequantize(self, matrix: ExpertMatrix, fd: int) -> np.ndarray:
        """The matrix as float32 by the gguf package's dequantization: the K-quants in one
        native pass (``_native.dequantize_ggml_k_blocks``, bit for bit the package's,
        tests/test_ggml_blocks.py), the other types by their row dequantizer on chunks of
        about ``DEQUANTIZE_CHUNK_WEIGHTS`` weights where the package has one, else
        ``gguf.quants.dequantize`` (F16, F32)."""
        if matrix.dtype in K_QUANTS:
            out = np.empty((matrix.rows, matrix.cols), dtype=np.float32)
            try:
                _native.dequantize_ggml_k_blocks(matrix.dtype, _raw(matrix, fd), matrix.rows, matrix.cols, out)
            except ValueError as err:
                raise CheckpointError(f"{_where(matrix)}: {err}") from None
            return out
        gguf = _gguf()
        raw = _raw(matrix, fd).reshape(matrix.rows, -1)
        rows_of = getattr(getattr(gguf.quants, matrix.dtype, None), "dequantize_rows", None)
        if rows_of is None:
            w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[matrix.dtype])
            return np.asarray(w, dtype=np.float32).reshape(matrix.rows, matrix.cols)
        out = np.empty((matrix.rows, matrix.cols), dtype=np.float32)
        step = max(1, DEQUANTIZE_CHUNK_WEIGHTS // matrix.cols)
        for r0 in range(0, matrix.rows, step):
            out[r0:r0 + step] = rows_of(raw[r0:r0 + step])
        return out


def _exact(type_name: str, fmt: LoadFormat) -> bool:
    if type_name in GGML_FLOATS:
        return GGML_FLOATS[type_name] == fmt.fmt
    return EXACT.get(type_name) == fmt


def _raw(matrix: ExpertMatrix, fd: int) -> np.ndarray:
    raw = np.empty(matrix.nbytes, dtype=np.uint8)
    read_matrix_into(matrix, raw, fd)
    return raw


def _where(matrix: ExpertMatrix) -> str:
    return (f"{matrix.tensor.path}: tensor {matrix.tensor.name!r} (block {matrix.layer} expert "
            f"{matrix.expert} {matrix.kind}, {matrix.dtype})")

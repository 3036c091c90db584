"""Writing safetensors files and the directories that hold them.

``write_safetensors`` streams a file tensor by tensor (an 8-byte little-endian header
length, a JSON header, then the raw tensor bytes), so memory stays at about one tensor.
``building_directory`` builds an output directory beside its place and swaps it in whole,
and ``check_replaceable`` decides whether an existing directory may be replaced: only an
earlier output of numa-moe (``OUTPUT_MARKER``), never a directory of the user's.
Both the generated checkpoints (``numa_moe.checkpoints.synthetic``) and the quantized
ones (``numa_moe.checkpoints.quantize``) are written this way.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from numa_moe.files import CheckpointError, read_json_file
from numa_moe.formats import NUMPY_DTYPES

__all__ = ["TensorPlan", "write_safetensors", "building_directory", "check_replaceable", "is_earlier_output",
           "real_output", "OUTPUT_MARKER"]

# numpy dtype -> safetensors dtype code (NUMPY_DTYPES read backwards)
_DTYPE_CODES = {dtype: code for code, dtype in NUMPY_DTYPES.items()}


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


def real_output(out_dir: str | os.PathLike) -> Path:
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
    out = real_output(out_dir)
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
# An unmarked directory holding only the names of make_checkpoint's files,
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
    out = real_output(given)
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

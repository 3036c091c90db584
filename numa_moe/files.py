"""Reading the files a user names (checkpoint shards, config.json, machine files, segment
tables, routing traces): one way to open them, one way to read JSON from them, each
refusal a ``CheckpointError`` naming the file. Imports nothing of the package."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np

__all__ = ["CheckpointError", "open_checkpoint_file", "OpenFiles", "byte_progress", "read_json_file",
           "parse_json", "JSON_FILE_LIMIT", "JSON_MAX_DEPTH", "short"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked: the message names the file and tensor."""



def short(value, limit: int = 80) -> str:
    """repr of a value from a file, cut to one short line (a crafted header may hold
    megabytes in one field)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"



_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def _what_is(mode: int) -> str:
    return next((what for test, what in _FILE_KINDS if test(mode)), "not a regular file")


def open_checkpoint_file(path: str | os.PathLike) -> int:
    """The one way files a user names are opened (checkpoint shards, index, config.json,
    machine files, tables, traces): a read-only fd of a regular file.

    Symlinks are followed wherever they point (a Hugging Face cache snapshot is a
    directory of links into ``../../blobs``; the user can read the targets anyway).
    Refused, with a ``CheckpointError`` naming the file (and the link's target): what is
    not a regular file once links are followed (a FIFO would block ``open()`` forever,
    ``/dev/zero`` never ends, a directory is no file) and a dangling link. The open is
    non-blocking and the type is checked on the open fd, so a file swapped for a FIFO
    between the check and the open cannot hang it either.
    """
    path = Path(path)

    def refuse(what: str):
        link = _link_text(path)
        if link is not None:
            return CheckpointError(f"{path}: is a symlink to {link!r}, which {what}")
        return CheckpointError(f"{path}: {what}")

    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise refuse(f"is {_what_is(mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as err:
        if path.is_symlink():
            raise refuse("does not exist (a dangling link)") from err
        raise CheckpointError(f"{path}: cannot read: {err.strerror or err}") from err
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror or err}") from err
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise refuse(f"is {_what_is(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def _link_text(path: Path) -> str | None:
    """The target a symlink names, None for anything else."""
    try:
        return os.readlink(path)
    except OSError:
        return None


class OpenFiles:
    """Read-only fds of checkpoint files, each opened once (``open_checkpoint_file``) on
    first use and all closed when the ``with`` block ends: a loader that reads matrix
    after matrix would otherwise reopen a shard per matrix."""

    def __init__(self):
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = open_checkpoint_file(path)
        return self._fds[path]

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds.values():
            os.close(fd)


def byte_progress(total: int, desc: str, enabled: bool):
    """A progress bar counting bytes (tqdm; imported here, when a bar is wanted)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, disable=not enabled, desc=desc)


# Bounds of ``read_json_file``: config.json, an index, a machine file or a routing trace
# is at most some megabytes (a 1000-shard index is ~10 MB); nesting deeper than this is
# no document this project reads, and Python's own parser would overflow its stack.
JSON_FILE_LIMIT = 100_000_000
JSON_MAX_DEPTH = 100
_DEPTH_CHUNK = 1 << 24


def read_json_file(path: str | os.PathLike, what: str, limit: int = JSON_FILE_LIMIT,
                   error: type[ValueError] = CheckpointError):
    """The one way a JSON file a user names is read: opened by ``open_checkpoint_file``
    (a regular file, links followed), at most ``limit`` bytes, UTF-8, nested at most
    ``JSON_MAX_DEPTH`` deep; anything else is an ``error`` (a ``CheckpointError``
    unless the caller has its own kind) naming the file and ``what`` it was read as."""
    try:
        return _read_json(Path(path), what, limit)
    except CheckpointError as err:
        if error is CheckpointError:
            raise
        raise error(str(err)) from None


def _read_json(path: Path, what: str, limit: int):
    fd = open_checkpoint_file(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CheckpointError(f"{path}: {what} of {size} bytes is larger than the {limit} "
                                  "bytes such a file may have")
        raw = f.read(limit + 1)
    if len(raw) > limit:  # grew since fstat
        raise CheckpointError(f"{path}: {what} is larger than the {limit} bytes such a file "
                              "may have")
    return parse_json(raw, path, what)


def _json_depth_over(raw: bytes, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than ``limit`` (checked before
    parsing: the parser recurses once per level)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # Strings may hold brackets: blank them out first (escaped quotes taken care of).
    text = np.frombuffer(re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', raw), dtype=np.uint8)
    depth = 0
    for start in range(0, len(text), _DEPTH_CHUNK):  # vectorised, in bounded memory
        chunk = text[start:start + _DEPTH_CHUNK]
        brackets = chunk[(chunk == ord("[")) | (chunk == ord("{")) | (chunk == ord("]"))
                         | (chunk == ord("}"))]
        if not len(brackets):
            continue
        levels = depth + np.cumsum(np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1))
        if levels.max() > limit:
            return True
        depth = int(levels[-1])
    return False


def parse_json(raw: bytes, path: Path, what: str):
    if _json_depth_over(raw, JSON_MAX_DEPTH):
        raise CheckpointError(f"{path}: {what} is nested too deeply (more than "
                              f"{JSON_MAX_DEPTH} levels) to be a plausible one")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: {what} is not valid JSON: {err}") from err

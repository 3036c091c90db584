"""Interleaved allocation, the kernel's page-to-node map of any buffer, page migration.

* :func:`interleaved_empty` - a numpy array on its own anonymous mapping, with
  ``mbind(MPOL_INTERLEAVE)`` set before first touch, the huge-page advice set explicitly
  (``MADV_NOHUGEPAGE`` for ``page="4k"``, ``MADV_HUGEPAGE`` and 2 MiB alignment for
  ``"2m"``), populated by parallel first touch, unmapped when the last view dies.
* :func:`interleave_info` - where the kernel's interleave cycle puts the buffer's pages.
* :func:`page_nodes` / :func:`page_map` - the measured map: ``move_pages(2)`` with a NULL
  node list, one entry per 4 KB base page; pages not present give a negative errno.
* :func:`migrate_pages_to` - ``move_pages(2)`` with targets, reporting each failed page.

Node ids here are always *real* kernel node ids. A virtual topology (see
:mod:`numa_moe.placement.topology`) means nothing to the kernel, so ``nodes=None`` interleaves over
the real nodes this process may allocate on, whatever ``NUMA_MOE_VIRTUAL_NODES`` says.

The interleave rule Linux (4.x-6.x, mm/mempolicy.c ``interleave_nid``/``get_vma_policy``)
applies to a VMA with MPOL_INTERLEAVE: the folio of order ``o`` at address ``a`` goes to
the ``k``-th node of the mask (ascending node ids), ``k = ilx % len(nodes)`` with
``ilx = (vm_pgoff >> o) + ((a - vm_start) >> (PAGE_SHIFT + o))``. For an anonymous
mapping ``vm_pgoff = vm_start >> PAGE_SHIFT``, so with a 2 MiB-aligned ``vm_start`` the
index is simply the virtual page number (4 KB) or 2 MiB frame number (THP) of ``a``.

Kernel-version detail, verified in numa-vm (Debian 6.1, 3 of 4 nodes): before Linux 6.7
``offset_il_node`` computes ``(unsigned int)ilx % nnodes``, i.e. the index is truncated to
32 bits first; from 6.7 on (``interleave_nid(pol, ilx)``) it is ``ilx % nnodes`` in 64
bits. With a power-of-two node count both agree; with 3 nodes and user addresses above
16 TiB (0x7f... is ~127 TiB) they differ by ``2**32 % 3``. :func:`interleave_position`
applies the running kernel's rule.
"""

from __future__ import annotations

import errno as errno_module
import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from numa_moe import _native
from numa_moe.placement.pages import PAGE_CHOICES, page_name  # noqa: F401 (PAGE_CHOICES: a public name here too)


class PlacementError(OSError):
    """A placement call failed. ``.call`` names the call (mbind, move_pages, ...), ``.errno``
    is the errno (EINVAL for a node outside the allowed set, EPERM, ENOMEM, ...)."""

    def __init__(self, call: str, errno_code: int, message: str):
        super().__init__(errno_code, f"{call}: {message}")
        self.call = call


@dataclass(frozen=True)
class InterleaveInfo:
    nodes: tuple[int, ...]  # the interleave cycle, ascending node ids (the kernel's order)
    page_bytes: int  # interleave granularity: base page, or 2 MiB under THP
    phase: int  # index into `nodes` of the node holding the buffer's first page
    address: int  # of the buffer's first byte
    nbytes: int


@dataclass(frozen=True)
class PageMap:
    nodes: np.ndarray  # int32 per base page; negative = -errno (-ENOENT: not present)
    page_bytes: int  # base page size (4096)
    offset_bytes: int  # where the buffer starts inside its first page
    address: int  # of the buffer's first byte


@dataclass(frozen=True)
class PageFailure:
    page_index: int
    errno: int
    errno_name: str
    target_node: int


@dataclass(frozen=True)
class MigrationResult:
    nodes: np.ndarray  # int32 per page after the call: node id, or -errno for a failed page
    requested_pages: int
    moved_pages: int  # pages that now sit on their target node
    failures: tuple[PageFailure, ...]

    @property
    def ok(self) -> bool:
        return not self.failures


# ---------------------------------------------------------------------------- errors


def _errno_name(code: int) -> str:
    return errno_module.errorcode.get(abs(code), f"errno {abs(code)}")


def _raise_from_native(exc: OSError) -> None:
    call = getattr(exc, "call", "syscall")
    raise PlacementError(call, exc.errno or 0, str(exc.strerror or exc).removeprefix(f"{call}: ")) from exc


def _call(fn, *args):
    try:
        return fn(*args)
    except _native.SyscallError as exc:
        _raise_from_native(exc)


# ---------------------------------------------------------------------------- dtypes

_TORCH_TO_NUMPY = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}


def resolve_dtype(dtype: Any) -> np.dtype:
    """numpy dtype from a numpy/ml_dtypes dtype, a name ("bfloat16"/"bf16"), or a torch dtype."""
    import ml_dtypes

    if type(dtype).__module__.split(".")[0] == "torch":
        name = str(dtype).removeprefix("torch.")
        if name not in _TORCH_TO_NUMPY:
            raise TypeError(f"unsupported torch dtype {dtype} (supported: {sorted(_TORCH_TO_NUMPY)})")
        dtype = _TORCH_TO_NUMPY[name]
    if isinstance(dtype, str) and dtype.lower() in ("bf16", "bfloat16"):
        return np.dtype(ml_dtypes.bfloat16)
    try:
        resolved = np.dtype(dtype)
    except (TypeError, ValueError):
        raise TypeError(f"unsupported dtype {dtype!r}") from None
    if resolved.hasobject or resolved.itemsize == 0:
        raise TypeError(f"unsupported dtype {dtype!r}: needs a fixed-size, non-object dtype")
    return resolved


def check_fits(nbytes: int, what: str) -> None:
    """Refuses, with a ValueError saying both figures, a job that would need more than the
    memory this machine has available now (``psutil.virtual_memory().available``: free
    memory plus what the kernel can reclaim without swapping). Callers estimate ``nbytes``
    from their arguments and call this before they allocate, so that an absurd size is a
    one-line error in a fraction of a second rather than an allocation failure (or the
    OOM killer) minutes later."""
    import psutil

    available = psutil.virtual_memory().available
    if nbytes > available:
        raise ValueError(f"{what} needs about {nbytes / 2**30:,.1f} GiB of memory; this machine has "
                         f"{available / 2**30:,.1f} GiB available")


# ---------------------------------------------------------------------------- nodes


def _real_nodes() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(online nodes, nodes this process may allocate on): real kernel ids."""
    from numa_moe.placement.topology import memory_nodes

    return memory_nodes()


def _validate_nodes(nodes: Sequence[int] | None, call: str) -> tuple[int, ...]:
    existing, allowed = _real_nodes()
    if nodes is None:
        if not allowed:
            raise PlacementError(call, errno_module.EINVAL, "this process may allocate on no node")
        return allowed
    if isinstance(nodes, (int, np.integer)):
        nodes = (int(nodes),)
    chosen = []
    for node in nodes:
        if isinstance(node, bool) or not isinstance(node, (int, np.integer)):
            raise TypeError(f"{call}: node ids must be ints, got {node!r}")
        node = int(node)
        if node not in existing:
            raise PlacementError(call, errno_module.EINVAL, f"node {node} does not exist (online nodes: {list(existing)})")
        if node not in allowed:
            raise PlacementError(call, errno_module.EINVAL, f"node {node} is not allowed for this process (allowed: {list(allowed)})")
        chosen.append(node)
    if not chosen:
        raise PlacementError(call, errno_module.EINVAL, "empty node list")
    return tuple(sorted(set(chosen)))


def _thp_mode() -> str:
    from numa_moe.placement.topology import THP_ENABLED, parse_thp_mode

    try:
        return parse_thp_mode(THP_ENABLED.read_text())
    except OSError:
        return "unavailable"


# ---------------------------------------------------------------------------- allocation

# Live mappings, to answer interleave_info for any view (numpy, torch, memoryview) by address.
_MAPPINGS: list[weakref.ref] = []


def _register(mapping) -> None:
    _MAPPINGS[:] = [r for r in _MAPPINGS if r() is not None]
    _MAPPINGS.append(weakref.ref(mapping))


def _mapping_at(address: int):
    for ref in _MAPPINGS:
        m = ref()
        if m is not None and m.address <= address < m.address + max(m.mapped_bytes, 1):
            return m
    return None


def interleaved_empty(
    shape: int | Sequence[int],
    dtype: Any,
    nodes: Sequence[int] | None = None,
    page: str = "4k",
    touch_threads: int | None = None,
) -> np.ndarray:
    """A C-contiguous array on a fresh anonymous mapping interleaved over `nodes`.

    `nodes` are real node ids (default: every node this process may allocate on, also
    under a virtual topology). `page="4k"` sets MADV_NOHUGEPAGE so the interleave is per
    base page even where numpy or THP=always would use huge pages; `"2m"` aligns the
    mapping to 2 MiB and sets MADV_HUGEPAGE (interleave per 2 MiB folio). Contents are
    zero. The mapping is unmapped when the last array or tensor viewing it dies.
    """
    dt = resolve_dtype(dtype)
    shape_t = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape_t):
        raise ValueError(f"interleaved_empty: shape must be non-negative ints, got {shape!r}")
    try:
        huge = page_name(page) == "2m"
    except ValueError as error:
        raise ValueError(f"interleaved_empty: {error}") from None
    if huge and _thp_mode() in ("never", "unavailable"):
        raise PlacementError(
            "madvise", errno_module.EINVAL,
            f"page='2m' needs transparent huge pages, but THP is '{_thp_mode()}'",
        )
    node_ids = _validate_nodes(nodes, "mbind")
    nbytes = math.prod(int(s) for s in shape_t) * dt.itemsize
    if nbytes >= 1 << 63:  # past what the native size_t / mmap can take
        raise ValueError(f"interleaved_empty: shape {shape_t} of {dt} is {nbytes} bytes, "
                         "more than any address space holds")
    threads = touch_threads if touch_threads is not None else len(os.sched_getaffinity(0))
    mapping = _call(_native.InterleavedMapping, nbytes, list(node_ids), huge, int(threads))
    _register(mapping)
    flat = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
    return flat.view(dt).reshape(shape_t)


def as_torch(array):
    """Zero-copy torch view of a numpy array (bf16 arrays become torch.bfloat16)."""
    import ml_dtypes
    import torch

    if isinstance(array, torch.Tensor):
        return array
    if not isinstance(array, np.ndarray):
        raise TypeError(f"as_torch: expected a numpy array, got {type(array).__name__}")
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    if array.dtype.type.__module__.startswith("ml_dtypes"):
        raise TypeError(f"as_torch: no torch dtype for {array.dtype}")
    return torch.from_numpy(array)


# ---------------------------------------------------------------------------- buffers


def buffer_extent(buffer: Any) -> tuple[int, int]:
    """(address of the first byte, bytes spanned) of a numpy array, torch tensor, or any
    object exporting the buffer protocol (memoryview, mmap.mmap, bytearray, ...)."""
    if type(buffer).__module__.split(".")[0] == "torch" and hasattr(buffer, "data_ptr"):
        if buffer.numel() == 0:
            return int(buffer.data_ptr()), 0
        span = sum((s - 1) * st for s, st in zip(buffer.shape, buffer.stride()) if s > 0) + 1
        return int(buffer.data_ptr()), int(span * buffer.element_size())
    if isinstance(buffer, np.ndarray):
        if buffer.size == 0:
            return int(buffer.__array_interface__["data"][0]), 0
        try:
            from numpy.lib.array_utils import byte_bounds
        except ImportError:  # numpy < 2
            byte_bounds = np.byte_bounds
        lo, hi = byte_bounds(buffer)
        return int(lo), int(hi - lo)
    try:
        view = np.frombuffer(buffer, dtype=np.uint8)
    except (TypeError, ValueError, BufferError) as exc:
        raise TypeError(
            f"expected a numpy array, torch tensor or buffer-protocol object, got {type(buffer).__name__} ({exc})"
        ) from None
    return int(view.__array_interface__["data"][0]) if view.size else 0, int(view.size)


def page_nodes(buffer: Any) -> np.ndarray:
    """Node of each base page covering `buffer` (move_pages(2), NULL nodes), int32.
    Pages not present give -ENOENT (-2); unmapped addresses and the shared zero page -EFAULT."""
    address, nbytes = buffer_extent(buffer)
    if address == 0:
        return np.empty(0, dtype=np.int32)
    return _call(_native.page_nodes, address, nbytes)


def resident_pages(buffer: Any) -> np.ndarray:
    """Whether each base page covering `buffer` is resident (in RAM or the page cache),
    from mincore(2), as a bool array; no page is touched, so no disk I/O happens."""
    address, nbytes = buffer_extent(buffer)
    if address == 0:
        return np.empty(0, dtype=bool)
    return _call(_native.resident_pages, address, nbytes).astype(bool)


def page_map(buffer: Any) -> PageMap:
    address, nbytes = buffer_extent(buffer)
    base = int(_native.base_page_bytes())
    nodes = _call(_native.page_nodes, address, nbytes) if address else np.empty(0, np.int32)
    return PageMap(nodes=nodes, page_bytes=base, offset_bytes=address % base, address=address)


def migrate_pages_to(buffer: Any, nodes_per_page: int | Sequence[int] | np.ndarray) -> MigrationResult:
    """Move each base page of `buffer` to its target node (move_pages(2), MPOL_MF_MOVE).

    `nodes_per_page`: one node for all pages, or one per page (len == len(page_nodes(buffer))).
    Pages that failed (not present: ENOENT, busy: EBUSY, shared: EACCES, ...) are listed in
    the result with their index and errno name; the call itself raises PlacementError only
    when the kernel rejects it as a whole (EPERM, ENODEV, ...)."""
    address, nbytes = buffer_extent(buffer)
    base = int(_native.base_page_bytes())
    n_pages = 0 if address == 0 else (address + max(nbytes, 1) - 1) // base - address // base + 1
    if np.isscalar(nodes_per_page):
        targets = np.full(n_pages, int(nodes_per_page), dtype=np.int32)
    else:
        targets = np.ascontiguousarray(nodes_per_page, dtype=np.int32).reshape(-1)
        if targets.shape[0] != n_pages:
            raise ValueError(f"migrate_pages_to: {targets.shape[0]} target nodes for {n_pages} pages")
    if n_pages == 0:
        return MigrationResult(np.empty(0, np.int32), 0, 0, ())
    _validate_nodes(tuple(sorted(set(targets.tolist()))), "move_pages")
    status, _ = _call(_native.move_pages, address, nbytes, targets)
    failures = tuple(
        PageFailure(int(i), int(-status[i]), _errno_name(int(status[i])), int(targets[i]))
        for i in np.flatnonzero(status != targets)
    )
    moved = int(np.count_nonzero(status == targets))
    return MigrationResult(nodes=status, requested_pages=n_pages, moved_pages=moved, failures=failures)


# ---------------------------------------------------------------------------- interleave info


def interleave_index(address: int, vm_start: int, vm_pgoff: int, page_bytes: int, base_page_bytes: int = 4096) -> int:
    """The kernel's interleave index of the page holding `address` (before `% len(nodes)`):
    ``(vm_pgoff >> order) + ((page_address - vm_start) >> page_shift)``."""
    order_pages = page_bytes // base_page_bytes
    page_address = address - address % page_bytes
    return vm_pgoff // order_pages + (page_address - vm_start) // page_bytes


def _kernel_version(release: str | None = None) -> tuple[int, int]:
    release = release if release is not None else os.uname().release
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def kernel_truncates_interleave_index(release: str | None = None) -> bool:
    """True on kernels before 6.7, whose interleave index is cast to 32 bits before ``% N``."""
    return _kernel_version(release) < (6, 7)


def interleave_position(ilx: int, n_nodes: int, truncate_32: bool | None = None) -> int:
    """Index into the (ascending) node cycle of the page with interleave index `ilx`."""
    if truncate_32 is None:
        truncate_32 = kernel_truncates_interleave_index()
    return (ilx & 0xFFFFFFFF if truncate_32 else ilx) % n_nodes


def _vma_of(address: int) -> dict | None:
    """start, pgoff (in base pages), anonymous?, VmFlags of the mapping holding `address`."""
    base = int(_native.base_page_bytes())
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    vma = None
    for line in lines:
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            try:
                start, end = (int(x, 16) for x in head[0].split("-"))
            except ValueError:
                continue
            if vma is not None:
                return vma
            if start <= address < end:
                path = head[5] if len(head) > 5 else ""
                anon = path == "" or path.startswith("[")
                offset = int(head[2], 16)
                vma = {"start": start, "pgoff": (start // base) if anon else offset // base, "flags": ()}
        elif vma is not None and line.startswith("VmFlags:"):
            vma["flags"] = tuple(line.split()[1:])
    return vma


def interleave_info(array: Any) -> InterleaveInfo | None:
    """Where the interleave cycle puts `array`'s pages, or None when its memory has no
    interleave policy (neither the VMA's nor, for VMAs without one, the thread's)."""
    address, nbytes = buffer_extent(array)
    if address == 0:
        return None
    mapping = _mapping_at(address)
    if mapping is not None:
        nodes = tuple(mapping.nodes)
        page_bytes = int(mapping.page_bytes)
        # Our mappings start on a page_bytes boundary and vm_pgoff = vm_start >> PAGE_SHIFT.
        phase = interleave_position(address // page_bytes, len(nodes))
        return InterleaveInfo(nodes, page_bytes, phase, address, nbytes)
    mode, nodes = _call(_native.get_mempolicy, address)
    if mode == _native.MPOL_DEFAULT:
        mode, nodes = _call(_native.get_mempolicy, 0)
    if mode != _native.MPOL_INTERLEAVE or not nodes:
        return None
    base = int(_native.base_page_bytes())
    vma = _vma_of(address)
    if vma is None:
        return None
    flags = vma["flags"]
    thp = _thp_mode()
    huge = "nh" not in flags and (thp == "always" or (thp == "madvise" and "hg" in flags))
    page_bytes = int(_native.HUGE_PAGE_BYTES) if huge else base
    phase = interleave_position(interleave_index(address, vma["start"], vma["pgoff"], page_bytes, base), len(nodes))
    return InterleaveInfo(tuple(nodes), page_bytes, phase, address, nbytes)

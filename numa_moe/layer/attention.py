"""GQA decode attention: one new query per sequence against its KV cache.

``gqa_decode(q, k_cache, v_cache, lengths)`` computes, for every sequence ``b`` and query
head ``j``, ``softmax(scale * q[b, j] . K^T) V`` over the cached positions of KV head
``j // group`` (``group = Hq / Hkv``), with fp32 softmax and accumulation. The query heads
that share a KV head form one small block: on AMX the block takes a layout transform
once and the cache rows are tile operands exactly as they lie in memory (docs/attention.md).

Caches are ``[B, Hkv, T, D]`` bf16 (torch or numpy), or paged ``[n_blocks, Hkv,
block_size, D]`` with an int64 ``block_table [B, max_blocks]``. ``KVCache`` allocates a
cache interleaved over the nodes of a topology and splits each call by the nodes that
hold the positions' pages; the per-node results are merged by the log-sum-exp rule.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from numa_moe import _native
from numa_moe.arrays import BF16, as_index_array, bf16_bits, is_bf16_dtype, is_torch, output_view
from numa_moe.layer import kernels
from numa_moe.layer.pools import default_topology, topology_node_cpus, worker_pool
from numa_moe.placement import memory
from numa_moe.placement.pages import page_bytes_of
from numa_moe.placement.tables import buffer_table, check_table_source

__all__ = ["gqa_decode", "available_isas", "tested_isas", "default_isa", "merge_states", "KVCache", "HEAD_DIMS"]

HEAD_DIMS = (64, 128, 256)


def available_isas() -> tuple[str, ...]:
    """ISAs with attention kernels this CPU (and OS) runs, in the order of
    ``numa_moe.layer.kernels.available_isas``."""
    return tuple(_native.attention_isas())


def tested_isas() -> tuple[str, ...]:
    """The ISAs the test suite runs the attention kernels on, by the rule of
    ``numa_moe.layer.kernels.tested_isas``."""
    return kernels.tested_isas(available=available_isas())


def default_isa() -> str:
    """``NUMA_MOE_ISA`` when set, else the fastest (amx > avx512 > avx2 > ref)."""
    try:
        return _native.default_attention_isa()
    except RuntimeError as error:
        raise ValueError(str(error)) from None


def merge_states(m, l, o) -> np.ndarray:
    """The log-sum-exp merge of softmax states in order: ``sum_p o_p e^(m_p - M) / sum_p
    l_p e^(m_p - M)``, ``M = max m_p``, skipping states with ``l_p = 0`` (the native rule the
    cross-node merge uses). m, l: float32 ``[P]``; o: float32 ``[P, D]``."""
    return _native.merge_attention_states(np.ascontiguousarray(m, np.float32), np.ascontiguousarray(l, np.float32),
                                          np.ascontiguousarray(o, np.float32))


def gqa_decode(q: Any, k_cache: Any, v_cache: Any, lengths: Any, *, scale: float | None = None, window: int = 0,
               block_table: Any = None, out: Any = None, out_dtype: Any = "bfloat16", isa: str | None = None,
               threads: int | None = None, node_segments: Sequence[Any] | None = None, pool: Any = None):
    """Decode attention of one new query per sequence.

    q: ``[B, Hq, D]`` bf16; k_cache, v_cache: ``[B, Hkv, T, D]`` bf16, or with
    ``block_table`` (int64 ``[B, max_blocks]``) paged ``[n_blocks, Hkv, block_size, D]``;
    Hq a multiple of Hkv; D in 64, 128, 256. lengths: positions per sequence (int, ``[B]``);
    window > 0 attends to the last ``window`` positions only. scale: default ``1/sqrt(D)``.
    out_dtype: bfloat16 or float32 (or a preallocated ``out`` ``[B, Hq, D]``). threads:
    default this process's CPUs. node_segments with pool: one int64 ``[n, 5]`` array per
    pool node over the cache's rows (``KVCache`` supplies both). Returns a torch tensor if
    q is one, else a numpy array. A sequence of length 0 gets zeros.
    """
    use_torch = is_torch(q)
    q_u16 = bf16_bits("q", q)
    k_u16 = bf16_bits("k_cache", k_cache)
    v_u16 = bf16_bits("v_cache", v_cache)
    if isinstance(lengths, (int, np.integer)):
        lengths = [int(lengths)] * (q_u16.shape[0] if q_u16.ndim == 3 else 1)
    lengths_i64 = as_index_array("lengths", lengths)
    table = None if block_table is None else as_index_array("block_table", block_table)
    head_dim = q_u16.shape[-1] if q_u16.ndim else 0
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
        raise TypeError(f"window: expected an int, got {type(window).__name__}")
    if threads is None:
        threads = 0
    elif isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise ValueError(f"threads: must be an int >= 1, got {threads!r}")
    if out is None:
        want_bf16 = is_bf16_dtype(out_dtype)
        if use_torch:
            import torch

            out = torch.empty(tuple(q_u16.shape), dtype=torch.bfloat16 if want_bf16 else torch.float32)
        else:
            out = np.empty(q_u16.shape, dtype=BF16 if want_bf16 else np.float32)
    segments = None
    if node_segments is not None:
        segments = [as_index_array(f"node_segments[{n}]", s) for n, s in enumerate(node_segments)]
    _native.gqa_decode(isa if isa is not None else default_isa(), q_u16, k_u16, v_u16, lengths_i64, output_view(out),
                       float(scale), int(window), block_table=table, node_segments=segments, pool=pool,
                       threads=int(threads))
    return out


class KVCache:
    """K and V caches of one layer in memory interleaved over a topology's nodes.

    shape: ``(B, Hkv, T, D)`` (one cache per sequence) or ``(n_blocks, Hkv, block_size,
    D)`` (a paged cache, used with a block table). K and V share one mapping, V starting a
    whole number of interleave rounds after K, so row r of V lies on the node of row r of
    K and one segment table (over the ``rows = shape[0] * Hkv * shape[2]`` rows of D
    elements) places both. tables="measured" reads the page map the kernel reports;
    "theoretical" uses the interleave rule (virtual topologies, where nothing is really on
    those nodes). Each node's workers then take the positions on their node's pages.
    """

    def __init__(self, shape: Sequence[int], *, topology=None, page: str = "4k", tables: str = "measured",
                 phase: int = 0):
        shape = tuple(int(s) for s in shape)
        if len(shape) != 4 or min(shape) < 1:
            raise ValueError(f"KVCache: shape must be 4 positive ints (B or n_blocks, Hkv, T or block_size, D), "
                             f"got {shape}")
        if shape[3] not in HEAD_DIMS:
            raise ValueError(f"KVCache: head size {shape[3]} has no kernels ({', '.join(map(str, HEAD_DIMS))})")
        check_table_source(tables)
        self.topology = topology if topology is not None else default_topology()
        node_ids, node_cpus = topology_node_cpus(self.topology)
        self.shape = shape
        self.rows = shape[0] * shape[1] * shape[2]
        page_bytes = page_bytes_of(page)
        round_bytes = page_bytes * len(node_ids)
        cache_bytes = self.rows * shape[3] * 2
        v_offset = -(-cache_bytes // round_bytes) * round_bytes
        alloc_nodes = None if self.topology.is_virtual else node_ids
        self._buffer = memory.interleaved_empty(((v_offset + cache_bytes) // 2,), "bfloat16", nodes=alloc_nodes,
                                                page=page)
        self.k = self._buffer[: cache_bytes // 2].reshape(shape)
        self.v = self._buffer[v_offset // 2: v_offset // 2 + cache_bytes // 2].reshape(shape)
        self.table = buffer_table(self.k, self.rows, shape[3], "bf16", self.topology, page_bytes, tables=tables,
                                  phase=phase)
        # V starts whole interleave rounds after K: by the rule its table is K's
        measured = tables == "measured" and not self.topology.is_virtual
        self.v_table = (buffer_table(self.v, self.rows, shape[3], "bf16", self.topology, page_bytes)
                        if measured else self.table)
        self.node_ids = node_ids
        self.node_segments = [self.table.node_array(n) for n in node_ids]
        self.pool = worker_pool(node_cpus)

    @property
    def v_local(self) -> bool:
        """Whether every V row lies on the node of its K row (the split follows K)."""
        return self.v_table == self.table

    def positions_per_node(self, lengths: Sequence[int]) -> dict[int, int]:
        """Cached positions per node for contiguous caches at these lengths (the split)."""
        counts = dict.fromkeys(self.node_ids, 0)
        B, H, T, _ = self.shape
        for node in self.node_ids:
            for row0, stride, nrows, _, _ in self.table.node_array(node):
                rows = row0 + stride * np.arange(nrows)
                b, t = rows // (H * T), rows % T
                counts[node] += int(np.count_nonzero(t < np.asarray(lengths)[b]))
        return counts

    def decode(self, q: Any, lengths: Any, **kwargs):
        """gqa_decode over this cache, split by the nodes of its pages."""
        return gqa_decode(q, self.k, self.v, lengths, node_segments=self.node_segments, pool=self.pool, **kwargs)

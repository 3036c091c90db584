"""The segment table of a buffer a layer allocated: measured, or from the rule.

A layer that allocates its own interleaved buffers (``MoELayer.from_tensors``,
``KVCache``) takes the table from the page map the kernel reports (``tables="measured"``)
on a real topology; on a virtual one (node ids the memory is not really on), or when asked
(``tables="theoretical"``), from the interleave rule over the topology's nodes.
"""

from __future__ import annotations

from numa_moe.placement import memory
from numa_moe.placement.segments import SegmentTable

__all__ = ["TABLE_SOURCES", "check_table_source", "buffer_table"]

TABLE_SOURCES = ("measured", "theoretical")


def check_table_source(tables: str) -> None:
    if tables not in TABLE_SOURCES:
        raise ValueError(f"tables must be 'measured' or 'theoretical', got {tables!r}")


def buffer_table(buffer, rows: int, cols: int, fmt: str, topology, page_bytes: int, *,
                 tables: str = "measured", phase: int = 0) -> SegmentTable:
    """The table of ``buffer`` (``rows x cols`` of ``fmt``, interleaved over the
    topology's nodes at ``page_bytes``): measured from its page map when ``tables`` is
    "measured" and the topology is real, else the interleave rule starting at ``phase``."""
    if tables == "measured" and not topology.is_virtual:
        pm = memory.page_map(buffer)
        return SegmentTable.from_page_map(rows, cols, fmt, pm.nodes, pm.page_bytes, offset_bytes=pm.offset_bytes)
    return SegmentTable.theoretical(rows, cols, fmt, page_bytes, tuple(topology.node_ids), phase=phase)

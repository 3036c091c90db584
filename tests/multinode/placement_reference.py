"""An independent reference for the multinode tier: which bytes of a table's segments lie
on pages of another node, read off a page map byte by byte (sampled)."""

from __future__ import annotations

import numpy as np


def segment_bytes_on_wrong_node(table, page_nodes, page_bytes: int, offset_bytes: int,
                                step_bytes: int = 64) -> dict[int, int]:
    """Per node: how many sampled bytes of its segments (each segment row's last byte and
    every `step_bytes`-th byte from its first) sit on a page of another node."""
    bits = table.weight_format.bits_per_element
    row_bytes = table.row_bytes
    wrong = {}
    for node, segments in table.segments.items():
        count = 0
        for s in segments:
            rows = s.row0 + s.row_stride * np.arange(s.nrows, dtype=np.int64)
            starts = offset_bytes + rows * row_bytes + s.k0 * bits // 8
            ends = offset_bytes + rows * row_bytes + s.k1 * bits // 8
            for b in range(0, int((ends - starts)[0]), step_bytes):
                count += np.count_nonzero(page_nodes[(starts + b) // page_bytes] != node)
            count += np.count_nonzero(page_nodes[(ends - 1) // page_bytes] != node)
        wrong[node] = count
    return wrong

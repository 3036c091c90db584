"""Page-size names: one rule (numa_moe.placement.pages) used by memory, store, layer and CLI."""

import numpy as np
import pytest

from moe_reference import random_bf16
from numa_moe.placement import memory, pages
from numa_moe.layer import store
from numa_moe.layer.moe_layer import MoELayer
from numa_moe.placement.topology import Topology


@pytest.mark.parametrize("text,name,page_bytes", [("4k", "4k", 4096), (" 4K", "4k", 4096),
                                                  ("2m", "2m", 2 << 20), ("2M ", "2m", 2 << 20)])
def test_names_and_bytes(text, name, page_bytes):
    assert pages.page_name(text) == name
    assert pages.page_bytes_of(text) == page_bytes


@pytest.mark.parametrize("bad", ["1g", "", "4kb", None, 4.0])
def test_unknown_names_are_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match=r"page must be '4k' or '2m', got "):
        pages.page_name(bad)


def test_bytes_pass_through_positive_ints_only():
    assert pages.page_bytes_of(8192) == 8192
    assert pages.page_bytes_of(np.int64(65536)) == 65536
    with pytest.raises(ValueError, match="positive"):
        pages.page_bytes_of(0)
    with pytest.raises(TypeError, match="page"):
        pages.page_bytes_of(True)


def test_every_layer_uses_the_same_table():
    assert memory.PAGE_CHOICES is pages.PAGE_CHOICES
    assert store.PAGE_BYTES is pages.PAGE_BYTES and store.page_bytes_of is pages.page_bytes_of


def test_layer_tables_follow_the_page_name_whatever_its_case(rng):
    """from_tensors allocates with memory's rule and built its tables with its own
    (anything but "4k" meant 2 MiB): page="4K" gave 4 KB memory and 2 MiB tables."""
    hidden, inter, n_experts = 64, 32, 3
    gate_up = random_bf16(rng, (n_experts, 2 * inter, hidden), 0.1)
    down = random_bf16(rng, (n_experts, hidden, inter), 0.1)
    topology = Topology.virtual(2)
    lower = MoELayer.from_tensors(gate_up, down, topology=topology, page="4k", tables="theoretical")
    upper = MoELayer.from_tensors(gate_up, down, topology=topology, page="4K", tables="theoretical")
    for e in range(n_experts):
        for kind in ("gate", "up", "down"):
            assert upper.tables[e][kind] == lower.tables[e][kind]
            assert upper.tables[e][kind].page_bytes == 4096

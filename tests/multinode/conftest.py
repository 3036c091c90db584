"""The multinode tier: needs >= 2 real NUMA nodes this process may allocate on.

Run it on a real kernel with N nodes through the repository's VM runner (no torch here:
importing it costs ~45 s in the emulated guest):

    tools/numa-vm -n 2 -c 2 -m 1024 -- .venv/bin/python -m pytest -q tests/multinode

or both node counts with ``bash tools/run-multinode.sh``.
"""

from pathlib import Path

import pytest


def _real_allowed_nodes() -> list[int]:
    online = Path("/sys/devices/system/node/online")
    if not online.exists():
        return []
    from numa_moe.placement.topology import Topology

    return list(Topology.detect().allowed_nodes)


_NODES = _real_allowed_nodes()


def pytest_collection_modifyitems(config, items):
    if len(_NODES) >= 2:
        return
    skip = pytest.mark.skip(
        reason=f"needs >= 2 real NUMA nodes, this machine allows {len(_NODES)} "
        "(run inside tools/numa-vm -n 2, or bash tools/run-multinode.sh)"
    )
    for item in items:
        if "multinode" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_nodes() -> list[int]:
    return _NODES

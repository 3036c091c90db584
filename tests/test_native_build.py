"""The built objects: nothing compiled with ISA flags may share a weak (COMDAT) symbol
with another object, or the linker could hand a wide-ISA copy to baseline code."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WEAK_TYPES = {"W", "V", "u", "i"}


def isa_sources() -> set[str]:
    """Sources given ISA flags: the numa_moe_isa_source(...) lines of the CMake files."""
    sources = set()
    for cmake in (ROOT / "native").glob("*/sources.cmake"):
        sources.update(re.findall(r"numa_moe_isa_source\((\S+)", cmake.read_text()))
    return sources


# The library both modules link last: a build folder from before the modules shared it still
# holds the library's objects under _native.dir, and the current ones win.
MODULE_TARGETS = ("_native", "_native_bench", "numa_moe_core")


def module_objects(cmake_files: Path) -> dict[str, Path]:
    """The objects of the extension modules' targets in one build's CMakeFiles folder (the
    modules' own files and the library both link), by source path."""
    return {str(o.relative_to(cmake_files / f"{target}.dir"))[: -len(".o")]: o
            for target in MODULE_TARGETS for o in (cmake_files / f"{target}.dir").glob("native/**/*.o")}


def newest_object_dir(isa: set[str]) -> Path | None:
    """The CMakeFiles folder of the most recent complete CMake build of the extensions in
    this checkout (older folders may predate the current sources, a build under way is not
    complete yet)."""
    dirs = [d for d in (ROOT / "build").glob("**/CMakeFiles") if isa <= module_objects(d).keys()]
    return max(dirs, key=lambda d: max(o.stat().st_mtime for o in module_objects(d).values()), default=None)


def weak_symbols(obj: Path) -> set[str]:
    """Weak symbols of an object, less DW.ref.* (the unwinder's pointer to the C++
    personality routine: data, the same in every object, no ISA code)."""
    out = subprocess.run(["nm", "--defined-only", str(obj)], capture_output=True, text=True, check=True).stdout
    rows = (line.split() for line in out.splitlines())
    return {r[2] for r in rows if len(r) == 3 and r[1] in WEAK_TYPES and not r[2].startswith("DW.ref.")}


def test_isa_sources_are_listed():
    assert {"native/kernels/avx512_bf16.cpp", "native/kernels/amx_bf16.cpp", "native/kernels/amx_quant.cpp",
            "native/kernels/amx_quant_model.cpp", "native/bench/avx512_loops.cpp"} <= isa_sources()


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_isa_objects_share_no_weak_symbol():
    isa = isa_sources()
    obj_dir = newest_object_dir(isa)
    if obj_dir is None:
        pytest.skip("no complete CMake build of the extension under build/ (it was built elsewhere)")
    objects = module_objects(obj_dir)
    symbols = {name: weak_symbols(path) for name, path in objects.items()}
    for name in isa:
        others = set().union(*(s for other, s in symbols.items() if other != name))
        shared = symbols[name] & others
        assert not shared, f"{obj_dir}: {name} shares weak symbols with other objects: {sorted(shared)[:5]}"


def test_bench_loops_are_their_own_module():
    """The benchmark harness (peak, read and kernel-against-read loops) is the extension
    numa_moe._native_bench, built beside the API module, not a part of every user's _native."""
    from numa_moe import _bench, _native, _native_bench

    assert not hasattr(_native, "bench")
    assert _bench.peak_flops is _native_bench.peak_flops
    assert _bench.stream_read is _native_bench.stream_read

"""The native benchmark loops, called from this module only: the kernel and layer
benchmarks and ``numa-moe run`` reach native code through these functions, so that moving
the loops to another extension module changes this file alone.
"""

from __future__ import annotations

from numa_moe import _native

# The register-only loop behind each ISA's peak: the instruction it repeats. ISAs without
# one (ref, avx2, amx_model, and amx until a tile loop is built) have no measured peak.
PEAK_INSTRUCTIONS = {"avx512": "vdpbf16ps"}


def peak_flops(isa: str, iterations: int, threads: int) -> float:
    """Flops executed by `iterations` rounds of `isa`'s register-only loop on each of
    `threads` threads. ValueError for an ISA without one (PEAK_INSTRUCTIONS)."""
    if isa not in PEAK_INSTRUCTIONS:
        raise ValueError(f"no peak loop for isa {isa!r} in this build (peak loops: {', '.join(PEAK_INSTRUCTIONS)})")
    return _native.dpbf16ps_peak(iterations, threads)


def stream_read(buffers, threads: int) -> int:
    """Reads every buffer once with AVX-512 loads on `threads` pinned threads of the
    kernel pool; returns a checksum. ValueError without AVX-512."""
    return _native.stream_read(list(buffers), threads)


def expert_ffn_vs_read(isa: str, x, token_index, experts, threads: int, repeats: int):
    """(kernel seconds, read seconds) per repetition: repetition r runs expert_ffn on
    expert copy 2r, then stream-reads copy 2r+1 on the same pool."""
    return _native.bench_expert_ffn_vs_read(isa, x, token_index, experts, threads, repeats)


def affinity_cpu_count() -> int:
    return _native.affinity_cpu_count()

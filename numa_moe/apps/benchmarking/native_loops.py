"""The native benchmark loops (``numa_moe._bench``), called from this module only: the
kernel and layer benchmarks and ``numa-moe run`` reach native code through these
functions.
"""

from __future__ import annotations

from numa_moe import _bench, _native

# The register-only loop behind each ISA's peak: the instruction it repeats
# (_bench.peak_flops). ISAs without one (ref, amx_model) have no measured peak.
PEAK_INSTRUCTIONS = {"avx2": "vfmadd231ps", "avx512": "vdpbf16ps", "amx": "tdpbf16ps"}
# The integer formats' kernels multiply with these (int8 operations, counted as flops are).
INTEGER_PEAK_INSTRUCTIONS = {"avx2": "vpmaddubsw", "avx512": "vpdpbusd", "amx": "tdpbssd"}


def peak_instruction(isa: str, weight_format: str = "bf16") -> str | None:
    """The instruction of `isa`'s peak loop for a weight format, None if it has none."""
    table = PEAK_INSTRUCTIONS if weight_format == "bf16" else INTEGER_PEAK_INSTRUCTIONS
    return table.get(isa)


def peak_flops(isa: str, iterations: int, threads: int, weight_format: str = "bf16") -> float:
    """Operations executed by `iterations` rounds of the register-only loop of `isa`
    and the weight format on each of `threads` threads. ValueError for an ISA without one
    (peak_instruction) or one this CPU cannot run."""
    return _bench.peak_flops(isa, iterations, threads, weight_format)


def stream_read(buffers, threads: int) -> int:
    """Reads every buffer once with the CPU's widest loads (AVX-512, else AVX2, else
    64-bit words) on `threads` pinned threads; returns a checksum."""
    return _bench.stream_read(list(buffers), threads)


def expert_ffn_vs_read(isa: str, x, token_index, experts, threads: int, repeats: int,
                       weight_format: str = "bf16"):
    """(kernel seconds, read seconds) per repetition: repetition r runs expert_ffn on
    expert copy 2r (of ``weight_format``), then stream-reads copy 2r+1 on the same pool."""
    return _bench.bench_expert_ffn_vs_read(isa, x, token_index, experts, threads, repeats, format=weight_format)


def affinity_cpu_count() -> int:
    return _native.affinity_cpu_count()

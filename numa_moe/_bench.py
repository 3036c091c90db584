"""The native benchmark harness (``native/bench``): streaming read, peak-FLOP loops and
kernel-against-read loops, built apart from the API as the extension ``numa_moe._native_bench``."""

from numa_moe import _native_bench as _harness

stream_read = _harness.stream_read
bench_stream_read = _harness.bench_stream_read
bench_expert_ffn = _harness.bench_expert_ffn
bench_expert_ffn_vs_read = _harness.bench_expert_ffn_vs_read
peak_flops = _harness.peak_flops

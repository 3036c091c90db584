"""The native benchmark harness (``native/bench``): streaming read, peak-FLOP loops and
kernel-against-read loops, registered apart from the API as ``numa_moe._native.bench``."""

from numa_moe._native import bench as _harness

stream_read = _harness.stream_read
bench_stream_read = _harness.bench_stream_read
bench_expert_ffn = _harness.bench_expert_ffn
bench_expert_ffn_vs_read = _harness.bench_expert_ffn_vs_read
peak_flops = _harness.peak_flops

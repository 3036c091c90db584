#!/usr/bin/env python3
"""One thread's rate of `numa_moe.layer.kernels.matmul_segments` (gather included) on a weight
of ROWS x K (bf16, or int8 / int4 with --format) against M tokens, for comparing two builds of a kernel (run it once per
build, alternating, several times: the machines these figures come from are shared, and
only same-round ratios mean anything). With --copies N > 1 the calls rotate over N weight
copies, so that each call streams its weight from DRAM when N x ROWS x K x 2 bytes is well
beyond the last-level cache. Prints the median and the best call in GFLOP/s of useful
flops (2 x ROWS x K x M; padding tokens not counted). A measurement, not a test."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from numa_moe.layer import kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("m", type=int, help="tokens")
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--isa", default=None)
    parser.add_argument("--format", default="bf16", choices=("bf16", "int8", "int4"),
                        help="int8 / int4: the weights quantized (group 128, fp16 scales; numa_moe.quant)")
    args = parser.parse_args()
    import ml_dtypes

    rng = np.random.default_rng(0)
    from numa_moe import quant

    weights = []
    for _ in range(max(1, args.copies)):
        w = rng.standard_normal((args.rows, args.k), dtype=np.float32).astype(ml_dtypes.bfloat16)
        weights.append(w if args.format == "bf16" else quant.quantize(w, args.format))
    segments = np.array([[0, 1, args.rows, 0, args.k]], np.int64)
    m = args.m
    tokens = rng.standard_normal((m, args.k), dtype=np.float32).astype(ml_dtypes.bfloat16)
    out = np.zeros((args.rows, m), np.float32)
    times = []
    for i in range(args.calls + 3):
        start = time.perf_counter()
        kernels.matmul_segments(weights[i % len(weights)], segments, tokens, out, isa=args.isa)
        if i >= 3:
            times.append(time.perf_counter() - start)
    flops = 2.0 * args.rows * args.k * m
    print(f"{args.format} rows={args.rows} k={args.k} m={m} copies={len(weights)}: median {flops / statistics.median(times) / 1e9:.0f} "
          f"best {flops / min(times) / 1e9:.0f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The qwen3-30b-a3b MoE layer step per weight format, and nothing else: for comparing two
builds of the kernels (run it once per build, alternating, several times; the routings
are the same in every run). Each repetition draws a routing, runs one step of every format
after settle() (caches evicted, threads asleep), then streams the touched bf16 experts
once; prints the median step per format and the best read rate. `numa-moe bench layer
--format ...` measures the same steps beside the torch loop and a 2-virtual-node layer.
A measurement, not a test: nothing here asserts a speed."""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

from numa_moe.placement import memory
from numa_moe.apps.benchmarking import native_loops
from numa_moe.apps.benchmarking.layer import BENCH_MODELS, fill_bf16
from numa_moe.apps.benchmarking.yardsticks import settle
from numa_moe.layer.moe_layer import MoELayer
from numa_moe.apps.run import random_routing, touched_bytes

try:
    import torch  # noqa: F401  (as in an application: the layer then runs on torch's OpenMP team)
except ImportError:
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(BENCH_MODELS))
    parser.add_argument("--formats", default="bf16,int8,int4")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--label", default="", help="printed first on the line (e.g. the build)")
    args = parser.parse_args()
    n_experts, top_k, hidden, inter = BENCH_MODELS[args.model]
    formats = args.formats.split(",")
    rng = np.random.default_rng(0)
    gate_up = memory.interleaved_empty((n_experts, 2 * inter, hidden), "bfloat16")
    down = memory.interleaved_empty((n_experts, hidden, inter), "bfloat16")
    fill_bf16(gate_up, rng, hidden ** -0.5)
    fill_bf16(down, rng, inter ** -0.5)
    layers = {fmt: MoELayer.from_tensors(gate_up, down, tables="theoretical", weight_format=fmt, group=args.group)
              for fmt in formats}
    cells = []
    for n_tokens in (int(v) for v in args.tokens.split(",")):
        steps = {fmt: [] for fmt in formats}
        read_gbps = []
        for _ in range(args.repeats):
            x = rng.standard_normal((n_tokens, hidden)).astype(ml_dtypes.bfloat16)
            ids, weights = random_routing(rng, n_tokens, n_experts, top_k)
            for fmt, layer in layers.items():
                settle()
                start = time.perf_counter()
                layer.forward_numpy(x, ids, weights)
                steps[fmt].append(time.perf_counter() - start)
            active = np.unique(ids)
            settle()
            start = time.perf_counter()
            native_loops.stream_read([gate_up[e] for e in active] + [down[e] for e in active],
                                     layers[formats[0]].pool.n_threads)
            read_gbps.append(touched_bytes(layers[formats[0]], ids) / (time.perf_counter() - start) / 1e9)
        cells.append(f"T={n_tokens} read {max(read_gbps):.0f} GB/s " +
                     " ".join(f"{fmt} {statistics.median(v) * 1e3:.3f} ms" for fmt, v in steps.items()))
    print(args.label, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()

"""The fixed cost of a MoE layer call outside its native step, with the caches cold as a
decode step finds them (docs/benchmarks.md, "Fixed cost of a call").

    .venv/bin/python benchmarks/step_overhead.py [--format int4] [--calls 100]

A qwen3-30b-a3b layer (random experts) at one token; before each call the caches are
evicted (`settle()` of `numa-moe bench layer`, without its pause). Prints, per input kind
(numpy arrays, torch tensors), the median time of the call by the caller's clock, the
native step's wall time (`last_stats()["wall_ns"]`) and the difference: the Python and
binding cost of a call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np
import torch

from numa_moe.placement import memory
from numa_moe.apps.benchmarking.layer import BENCH_MODELS, fill_bf16
from numa_moe.apps.benchmarking.yardsticks import evict_caches
from numa_moe.layer.moe_layer import MoELayer
from numa_moe.apps.run import random_routing
from numa_moe.placement.topology import current_topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="int4", choices=("bf16", "int8", "int4"))
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    n_experts, top_k, hidden, inter = BENCH_MODELS["qwen3-30b-a3b"]
    rng = np.random.default_rng(0)
    gate_up = memory.interleaved_empty((n_experts, 2 * inter, hidden), "bfloat16")
    down = memory.interleaved_empty((n_experts, hidden, inter), "bfloat16")
    fill_bf16(gate_up, rng, hidden ** -0.5)
    fill_bf16(down, rng, inter ** -0.5)
    layer = MoELayer.from_tensors(gate_up, down, topology=current_topology(), tables="theoretical",
                                  weight_format=args.format)
    x = rng.standard_normal((1, hidden)).astype(ml_dtypes.bfloat16)
    x_torch = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    kinds = {"numpy": lambda ids, w: layer.forward_numpy(x, ids, w),
             "torch": lambda ids, w: layer.forward(x_torch, torch.from_numpy(ids), torch.from_numpy(w))}
    caller = {kind: [] for kind in kinds}
    native = {kind: [] for kind in kinds}
    for _ in range(args.calls):
        for kind, call in kinds.items():  # alternated: both see the same machine
            ids, w = random_routing(rng, 1, n_experts, top_k)
            evict_caches()
            start = time.perf_counter()
            call(ids, w)
            caller[kind].append(time.perf_counter() - start)
            native[kind].append(layer.last_stats()["wall_ns"] * 1e-9)
    print(f"qwen3-30b-a3b {args.format}, 1 token, caches evicted before each call, medians of {args.calls}")
    for kind in kinds:
        over = [c - n for c, n in zip(caller[kind], native[kind])]
        print(f"  {kind:5s} input: call {statistics.median(caller[kind]) * 1e3:.3f} ms, native step "
              f"{statistics.median(native[kind]) * 1e3:.3f} ms, outside it {statistics.median(over) * 1e6:.0f} us")


if __name__ == "__main__":
    main()

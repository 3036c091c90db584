"""The fixed cost of one native call on each thread backend: a tiny expert FFN (hidden 256,
intermediate 128, 4 tokens, 2 threads) called back to back, first on numa-moe's own
threads (torch not loaded), then on torch's OpenMP team (docs/benchmarks.md, "Fixed cost
of a call"; docs/architecture.md, "Threads").

    .venv/bin/python benchmarks/call_overhead.py [--calls 2000]

Prints, per backend, the median of five rounds of the mean time a call takes by the
caller's clock (Python and the binding included).
"""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

from numa_moe import _native
from numa_moe.layer import kernels


def per_call_us(args, calls: int) -> float:
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            kernels.expert_ffn(*args, threads=2)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    hidden, inter = 256, 128
    expert = (rng.standard_normal((4, hidden)).astype(ml_dtypes.bfloat16),
              (rng.standard_normal((inter, hidden)) / 16).astype(ml_dtypes.bfloat16),
              (rng.standard_normal((inter, hidden)) / 16).astype(ml_dtypes.bfloat16),
              (rng.standard_normal((hidden, inter)) / 11).astype(ml_dtypes.bfloat16))
    if "torch" in __import__("sys").modules:
        raise SystemExit("torch is already loaded: the own threads cannot be measured")
    kernels.expert_ffn(*expert, threads=2)
    print(f"{_native.thread_backend():60s} {per_call_us(expert, args.calls):6.1f} us a call")
    import torch

    torch.set_num_threads(2)
    (torch.randn(64, 64) @ torch.randn(64, 64)).sum()  # torch's team exists from here on
    kernels.expert_ffn(*expert, threads=2)
    print(f"{_native.thread_backend():60s} {per_call_us(expert, args.calls):6.1f} us a call")


if __name__ == "__main__":
    main()

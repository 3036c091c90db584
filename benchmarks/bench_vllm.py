#!/usr/bin/env python3
"""Throughput of vLLM's CPU build on a tiny-but-real-shaped model, with and without the
numa-moe plugin: 4 decoder layers of Qwen3-30B-A3B's shape (hidden 2048, 128 experts of
intermediate 768, top-8, 32 query / 4 KV heads of 128), a 4096-word vocabulary, seeded
random weights, generated locally (numa_moe.integrations.vllm_check). Per run and batch
size: decode tokens/s (median of repeats of one generate() of --tokens new tokens per
sequence after 8-word prompts, prefill included; --rounds runs of each, in turn, pooled),
the ratio to stock vLLM, the share of the time spent in the experts' apply() and that
time per decode step. The expert step is also set against the
streaming-read ceiling measured in this run (numa_moe.apps.benchmarking.yardsticks): at batch
B a layer reads E * (1 - (1 - k/E)^B) experts on average under uniform routing (exactly
k at B = 1), 3 * H * I weights each. vLLM runs in eager mode with its engine in one
process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so vLLM and numa-moe both use every CPU.
Run it in the vLLM venv:

    .venv-vllm/bin/python benchmarks/bench_vllm.py

A measurement, not a test: nothing here asserts a speed."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from numa_moe.apps.benchmarking import native_loops, yardsticks
from numa_moe.integrations import vllm_check as vc

RUNS = {  # name -> (plugin, extra environment)
    "stock vLLM": (False, {}),
    "numa-moe bf16": (True, {}),
    "numa-moe int8": (True, {"NUMA_MOE_VLLM_WEIGHT_FORMAT": "int8"}),
}
BYTES_PER_WEIGHT = {"stock vLLM": 2, "numa-moe bf16": 2, "numa-moe int8": 1 + 2 / 128}  # int8 + fp16 scale per 128


def read_ceiling(samples: int = 8) -> yardsticks.Yardstick:
    threads = native_loops.affinity_cpu_count()
    buffers = [np.ones(64 << 20, dtype=np.uint8) for _ in range(4)]
    rates = []
    for _ in range(samples):
        start = time.perf_counter()
        native_loops.stream_read(buffers, threads)
        rates.append(sum(b.nbytes for b in buffers) / (time.perf_counter() - start) / 1e9)
    return yardsticks.Yardstick.from_samples(rates)


def pooled(runs, batch: int, tokens: int) -> dict:
    """One run's figures at ``batch`` over every round: the median of all timed calls."""
    seconds = [s for run in runs for s in run[str(batch)]["seconds"]]
    shares = [run[str(batch)]["expert_share"] for run in runs]
    return {"tokens_per_s": batch * tokens / statistics.median(seconds), "expert_share": statistics.median(shares)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="build/bench-vllm", help="model and run files (kept between runs)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per sequence per timed generate()")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--rounds", type=int, default=2,
                        help="each run this many times, in turn (a busy machine's load moves between runs)")
    args = parser.parse_args()

    shape = vc.QWEN3_30B_A3B_4_LAYERS
    if args.layers != shape.layers:
        shape = vc.TinyShape(**{**shape.__dict__, "layers": args.layers})
    model_dir = Path(args.workdir) / f"qwen3-30b-a3b-{shape.layers}-layers"
    if not (model_dir / "config.json").exists():
        print(f"building {model_dir} ...", flush=True)
        vc.make_model(model_dir, "qwen3_moe", shape, seed=0)
    ceiling_before = read_ceiling()
    rounds = {name: [] for name in args.runs}
    ceilings = [ceiling_before]
    for round_ in range(args.rounds):
        for name in args.runs:
            plugin, env = RUNS[name]
            print(f"round {round_ + 1}: running {name} ...", flush=True)
            rounds[name].append(vc.generate(
                model_dir, vc.prompts(1, vocab=shape.vocab), plugin=plugin, mode="eager", max_tokens=1,
                name=name.replace(" ", "-"), timeout_s=1800,
                extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}, max_num_seqs=max(args.batches),
                timed_batches=args.batches, timed_tokens=args.tokens, repeats=args.repeats,
                vocab=shape.vocab).timings)
        ceilings.append(read_ceiling())
    ceiling = yardsticks.Yardstick.from_windows(ceilings)
    results = {name: {str(b): pooled(runs, b, args.tokens) for b in args.batches} for name, runs in rounds.items()}

    E, k, H, I = shape.experts, shape.top_k, shape.hidden, shape.intermediate
    print(f"\nvLLM {shape.layers} x Qwen3-30B-A3B layers, eager, {os.cpu_count()} CPUs, "
          f"{args.tokens} tokens per sequence, median of {args.rounds} x {args.repeats} calls; "
          f"read ceiling {ceiling.best:.1f} GB/s")
    header = (f"{'run':<15} {'batch':>5} {'tokens/s':>9} {'vs stock':>8} {'expert share':>12} "
              f"{'expert ms/step':>14} {'expert GB/s':>11} {'of ceiling':>10}")
    print(header)
    print("-" * len(header))
    fractions = []
    for batch in args.batches:
        experts_read = E * (1 - (1 - k / E) ** batch)
        for name in args.runs:
            t = results[name][str(batch)]
            stock = results.get("stock vLLM", {}).get(str(batch))
            ratio = f"{t['tokens_per_s'] / stock['tokens_per_s']:.2f}" if stock else "-"
            steps_per_s = t["tokens_per_s"] / batch
            expert_s_per_step = t["expert_share"] / steps_per_s
            gbps = shape.layers * experts_read * 3 * H * I * BYTES_PER_WEIGHT[name] / expert_s_per_step / 1e9
            fractions.append(gbps / ceiling.best)
            print(f"{name:<15} {batch:>5} {t['tokens_per_s']:>9.2f} {ratio:>8} {t['expert_share']:>12.0%} "
                  f"{expert_s_per_step * 1e3:>14.1f} {gbps:>11.1f} {yardsticks.ratio_cell(gbps / ceiling.best, 10)}")
    warning = yardsticks.busy_warning("read ceiling", ceiling, "GB/s")
    if warning:
        print(warning)
    if any(yardsticks.is_measurement_problem(f) for f in fractions):
        print(yardsticks.MEASUREMENT_NOTE)


if __name__ == "__main__":
    main()

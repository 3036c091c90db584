"""``numa-moe bench layer``: one MoE layer step, ours against the transformers-style torch
loop and against the read ceiling of the weights that step touches, all in one run.

The machine's memory bandwidth drifts (other tenants share it), so the ceiling is not a
number taken once: every repetition runs the layer (1 node, then N virtual nodes), the
torch loop, and a streaming read of exactly the expert bytes that repetition's routing
touched, and the table reports medians of each. The ratios are therefore taken between
measurements made seconds apart on the same bytes.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from numa_moe.moe import MoELayer
from numa_moe.moe_run import random_routing, torch_moe_loop, touched_bytes

BENCH_MODELS = {
    # name: (experts, top_k, hidden, intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def fill_bf16(array: np.ndarray, rng: np.random.Generator, scale: float) -> None:
    """Fills a big bf16 buffer quickly: a random block, tiled (the content does not
    matter for speed; the correctness check uses the same bytes on both sides)."""
    import ml_dtypes

    bits = array.reshape(-1).view(np.uint16)
    block = (rng.standard_normal(1 << 20) * scale).astype(ml_dtypes.bfloat16).view(np.uint16)
    for start in range(0, bits.size, block.size):
        n = min(block.size, bits.size - start)
        bits[start:start + n] = block[:n]


# Each timed call starts from the same state, so that the order of the engines within a
# repetition does not matter:
# - caches: the touched experts of a Qwen3 decode step (75 MB) are not much larger than
#   an L3, so whatever runs second would find part of them cached; a read of a buffer
#   twice the L3 size evicts them first;
# - spinning threads: every engine timed here (two worker pools, the kernel pool behind
#   the streaming read, torch's OpenMP team) keeps its threads spinning for a moment
#   after a call; on a machine with few cores they would steal the CPUs of the next
#   engine, which no application using one engine sees, so a short pause lets them sleep.
SETTLE_SECONDS = 0.005
_EVICTION_BUFFER: list[np.ndarray] = []


def _l3_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    except (OSError, ValueError):
        return 32 << 20


def _settle() -> None:
    if not _EVICTION_BUFFER:
        _EVICTION_BUFFER.append(np.ones(2 * _l3_bytes(), dtype=np.uint8))
    int(_EVICTION_BUFFER[0][::64].sum())
    time.sleep(SETTLE_SECONDS)


def _stream_read_seconds(buffers, threads: int) -> float:
    from numa_moe import _bench

    start = time.perf_counter()
    _bench.stream_read(list(buffers), threads)
    return time.perf_counter() - start


def bench_layer(models=("qwen3-30b-a3b", "mixtral-8x7b"), tokens=(1, 16), repeats: int = 20, virtual_nodes: int = 2,
                isa: str | None = None, seed: int = 0, echo=print) -> list[dict]:
    """ms per layer step: ours (1 node), ours (``virtual_nodes`` virtual nodes, same
    weights), the transformers-style torch loop (bf16, all CPUs), and the streaming read
    of the touched expert bytes; medians over ``repeats`` random routings."""
    import ml_dtypes
    import torch

    from numa_moe import memory
    from numa_moe.segments import SegmentTable
    from numa_moe.topology import Topology, current_topology

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    rows = []
    base = current_topology()
    one_node = Topology.virtual(1, base) if base.is_virtual or len(base.node_ids) > 1 else base
    multi = Topology.virtual(virtual_nodes, base)
    for name in models:
        n_experts, top_k, hidden, inter = BENCH_MODELS[name]
        gate_up = memory.interleaved_empty((n_experts, 2 * inter, hidden), "bfloat16")
        down = memory.interleaved_empty((n_experts, hidden, inter), "bfloat16")
        fill_bf16(gate_up, rng, hidden ** -0.5)
        fill_bf16(down, rng, inter ** -0.5)
        layers = {}
        for label, topo in (("1 node", one_node), (f"{virtual_nodes} virtual nodes", multi)):
            table_gate_up = SegmentTable.theoretical(n_experts * 2 * inter, hidden, "bf16", 4096, topo.node_ids)
            table_down = SegmentTable.theoretical(n_experts * hidden, inter, "bf16", 4096, topo.node_ids)
            layers[label] = MoELayer.from_stacked(gate_up, down, table_gate_up, table_down, topology=topo, isa=isa)
        gate_up_t, down_t = memory.as_torch(gate_up), memory.as_torch(down)
        for n_tokens in tokens:
            times = {label: [] for label in layers}
            times["torch loop"] = []
            times["read"] = []
            touched = []
            error = 0.0
            for i in range(repeats):
                x = rng.standard_normal((n_tokens, hidden)).astype(ml_dtypes.bfloat16)
                ids, weights = random_routing(rng, n_tokens, n_experts, top_k)
                for label, layer in layers.items():
                    _settle()
                    start = time.perf_counter()
                    y = layer.forward_numpy(x, ids, weights)
                    times[label].append(time.perf_counter() - start)
                active = np.unique(ids)
                _settle()
                times["read"].append(_stream_read_seconds([gate_up[e] for e in active] + [down[e] for e in active],
                                                          threads))
                xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
                ids_t, weights_t = torch.from_numpy(ids), torch.from_numpy(weights).to(torch.bfloat16)
                _settle()
                start = time.perf_counter()
                torch_moe_loop(xt, ids_t, weights_t, gate_up_t, down_t)
                times["torch loop"].append(time.perf_counter() - start)
                touched.append(touched_bytes(layers["1 node"], ids))
                if i == 0:
                    ref32 = torch_moe_loop(xt, ids_t, torch.from_numpy(weights), gate_up_t, down_t,
                                           compute_dtype=torch.float32)
                    ref64 = ref32.numpy().astype(np.float64)
                    error = float(np.linalg.norm(y.astype(np.float64) - ref64) / np.linalg.norm(ref64))
            read_s = statistics.median(times.pop("read"))
            touched_median = statistics.median(touched)
            row = {"model": name, "tokens": n_tokens, "experts": n_experts, "top_k": top_k, "hidden": hidden,
                   "intermediate": inter, "threads": threads, "repeats": repeats,
                   "ceiling_ms": read_s * 1e3, "ceiling_gbps": touched_median / read_s / 1e9,
                   "ceiling_source": "native streaming read of the touched experts, each repetition",
                   "rel_error_vs_fp32": error, "touched_mb": touched_median / 1e6}
            for label, samples in times.items():
                row[f"{label} ms"] = statistics.median(samples) * 1e3
            rows.append(row)
            echo(format_bench_row(row, virtual_nodes))
        del layers, gate_up, down, gate_up_t, down_t
    return rows


def format_bench_row(row: dict, virtual_nodes: int) -> str:
    ours = row["1 node ms"]
    multi = row[f"{virtual_nodes} virtual nodes ms"]
    return (f"{row['model']:>14s} T={row['tokens']:<3d} touched {row['touched_mb']:7.1f} MB | ours {ours:8.3f} ms | "
            f"{virtual_nodes}-node virtual {multi:8.3f} ms ({multi / ours - 1:+.1%}) | torch loop "
            f"{row['torch loop ms']:8.3f} ms ({row['torch loop ms'] / ours:.2f}x) | read {row['ceiling_ms']:7.3f} ms "
            f"({row['ceiling_gbps']:.1f} GB/s; ours at {row['ceiling_ms'] / ours:.0%} of it) | "
            f"err {row['rel_error_vs_fp32']:.1e}")

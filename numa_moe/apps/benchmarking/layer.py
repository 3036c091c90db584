"""``numa-moe bench layer``: one MoE layer step, ours against the transformers-style torch
loop and against its roofline, all in one run: max(the touched bytes over the read
ceiling, the step's flops over the in-run peak of the ISA each expert runs with).

The machine's memory bandwidth drifts (other tenants share it), so the ceiling is not a
number taken once: every repetition runs the layer (1 node, then N virtual nodes), the
torch loop, and a streaming read of exactly the expert bytes that repetition's routing
touched (same buffers, so the same page size; as many pinned threads as the layer's
workers). Times are medians; the ceiling is the best read rate of the repetitions (a
Yardstick: another tenant can only slow a read), applied to the median touched bytes.

``formats`` adds layers of quantized experts (int8, int4, mxfp4: the same random experts,
quantized once per format with numa_moe.quant, scales in fp16, mxfp4's its own e8m0 per
32) to the same repetitions:
same routing, same threads, 1 node. Their bytes read (values + scales, as the layer
reports them) are set against the same read rate, and their step against the BF16 one.
The torch loop stays BF16 (it has no integer experts).
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from numa_moe import quant
from numa_moe.apps.benchmarking import native_loops
from numa_moe.apps.benchmarking.yardsticks import Yardstick, busy_warning, percent_of, ratio_cell, settle
from numa_moe.apps.run import random_routing, torch_moe_loop, touched_bytes
from numa_moe.formats import FIXED_GROUPS, QUANT_FORMATS
from numa_moe.layer.moe_layer import MoELayer

BENCH_MODELS = {
    # name: (experts, top_k, hidden, intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    # gpt-oss's shapes; the layer runs the default activation (silu(g) * u) without biases:
    # the epilogue's share of a step, not the weights it streams, is what those change
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "gpt-oss-120b": (128, 4, 2880, 2880),
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


def _stream_read_seconds(buffers, threads: int) -> float:
    start = time.perf_counter()
    native_loops.stream_read(buffers, threads)
    return time.perf_counter() - start


def bench_layer(models=("qwen3-30b-a3b", "mixtral-8x7b"), tokens=(1, 16), repeats: int = 20, virtual_nodes: int = 2,
                isa: str | None = None, seed: int = 0, echo=print, formats=("bf16",), group: int = 128) -> list[dict]:
    """ms per layer step: ours (1 node), ours (``virtual_nodes`` virtual nodes, same
    weights), the transformers-style torch loop (bf16, all CPUs), and the streaming read
    of the touched expert bytes; medians over ``repeats`` random routings. Each integer
    format in ``formats`` (quantized with ``group`` columns per scale) adds its 1-node
    step to the same repetitions; BF16 always runs, as their baseline."""
    int_formats = _integer_formats(formats)
    if int_formats:
        quant.check_arguments(group=group)
    check_arguments(models, tokens, repeats, virtual_nodes, len(int_formats))
    import ml_dtypes
    import torch

    from numa_moe.placement import memory
    from numa_moe.placement.segments import SegmentTable
    from numa_moe.placement.topology import Topology, current_topology

    threads = len(os.sched_getaffinity(0))  # torch's, and the layer's workers: one per allowed CPU
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    rows = []
    peaks = {}  # isa -> Yardstick of its peak on the layer's threads, best of every measurement so far
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
        quantized = {fmt: MoELayer.from_tensors(gate_up, down, topology=one_node, tables="theoretical",
                                                weight_format=fmt, group=format_group(fmt, group), isa=isa)
                     for fmt in int_formats}
        gate_up_t, down_t = memory.as_torch(gate_up), memory.as_torch(down)
        for n_tokens in tokens:
            _measure_peaks(peaks, {layers["1 node"].isa_for_tokens(m) for m in (1, n_tokens)},
                           layers["1 node"].pool.n_threads)
            times = {label: [] for label in layers}
            times["torch loop"] = []
            read_gbps = []
            touched = []
            compute_s = []
            step_bytes = {fmt: [] for fmt in ("bf16", *quantized)}
            quantized_times = {fmt: [] for fmt in quantized}
            quantized_out = {}
            error, format_errors = 0.0, {}
            # One untimed step of every layer first: a layer's first step at a new size
            # grows its arenas (first touch of up to GBs of partials), which is set-up,
            # not a step, and with few repeats it would land in the median.
            x = rng.standard_normal((n_tokens, hidden)).astype(ml_dtypes.bfloat16)
            ids, weights = random_routing(rng, n_tokens, n_experts, top_k)
            for layer in (*layers.values(), *quantized.values()):
                layer.forward_numpy(x, ids, weights)
            for i in range(repeats):
                x = rng.standard_normal((n_tokens, hidden)).astype(ml_dtypes.bfloat16)
                ids, weights = random_routing(rng, n_tokens, n_experts, top_k)
                for label, layer in layers.items():
                    settle()
                    start = time.perf_counter()
                    y = layer.forward_numpy(x, ids, weights)
                    times[label].append(time.perf_counter() - start)
                step_bytes["bf16"].append(sum(layers["1 node"].last_stats()["node_bytes"]))
                for fmt, layer in quantized.items():
                    settle()
                    start = time.perf_counter()
                    quantized_out[fmt] = layer.forward_numpy(x, ids, weights)
                    quantized_times[fmt].append(time.perf_counter() - start)
                    step_bytes[fmt].append(sum(layer.last_stats()["node_bytes"]))
                active = np.unique(ids)
                compute_s.append(_compute_seconds(layers["1 node"], ids, hidden, inter, peaks))
                touched.append(touched_bytes(layers["1 node"], ids))
                settle()
                read_s = _stream_read_seconds([gate_up[e] for e in active] + [down[e] for e in active],
                                              layers["1 node"].pool.n_threads)
                read_gbps.append(touched[-1] / read_s / 1e9)
                xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
                ids_t, weights_t = torch.from_numpy(ids), torch.from_numpy(weights).to(torch.bfloat16)
                settle()
                start = time.perf_counter()
                torch_moe_loop(xt, ids_t, weights_t, gate_up_t, down_t)
                times["torch loop"].append(time.perf_counter() - start)
                if i == 0:
                    ref32 = torch_moe_loop(xt, ids_t, torch.from_numpy(weights), gate_up_t, down_t,
                                           compute_dtype=torch.float32)
                    ref64 = ref32.numpy().astype(np.float64)
                    error = _relative_error(y, ref64)
                    format_errors = {fmt: _relative_error(out, ref64) for fmt, out in quantized_out.items()}
            ceiling = Yardstick.from_samples(read_gbps)
            touched_median = statistics.median(touched)
            compute_ms = statistics.median(compute_s) * 1e3 if all(c is not None for c in compute_s) else None
            memory_ms = touched_median / (ceiling.best * 1e9) * 1e3
            roofline_ms = max(memory_ms, compute_ms or 0.0)
            row = {"model": name, "tokens": n_tokens, "experts": n_experts, "top_k": top_k, "hidden": hidden,
                   "intermediate": inter, "threads": threads, "repeats": repeats,
                   "ceiling_ms": touched_median / (ceiling.best * 1e9) * 1e3, "ceiling_gbps": ceiling.best,
                   "ceiling_spread": ceiling.spread, "ceiling_busy": ceiling.busy,
                   "ceiling_source": "native streaming read of the touched experts, each repetition; best rate",
                   "rel_error_vs_fp32": error, "touched_mb": touched_median / 1e6,
                   "compute_ms": compute_ms, "roofline_ms": roofline_ms,
                   "peaks_gflop_s": {isa: (p.best if p else None) for isa, p in peaks.items()}}
            for label, samples in times.items():
                row[f"{label} ms"] = statistics.median(samples) * 1e3
            row["of_roofline"] = roofline_ms / row["1 node ms"]
            row["measurement_problem"] = row["ceiling_ms"] > row["1 node ms"]
            row["formats"] = {}
            for fmt, samples in step_bytes.items():
                step_ms = row["1 node ms"] if fmt == "bf16" else statistics.median(quantized_times[fmt]) * 1e3
                read_mb = statistics.median(samples) / 1e6
                row["formats"][fmt] = {
                    "step_ms": step_ms, "read_mb": read_mb, "ceiling_ms": read_mb / ceiling.best,
                    "bf16_step_ratio": row["1 node ms"] / step_ms,
                    "rel_error_vs_fp32": error if fmt == "bf16" else format_errors[fmt],
                    "group": None if fmt == "bf16" else format_group(fmt, group)}
            rows.append(row)
            echo(format_bench_row(row, virtual_nodes))
            for fmt in quantized:
                echo(format_format_row(row, fmt))
            warning = busy_warning(f"read ceiling ({name}, T={n_tokens})", ceiling, "GB/s")
            if warning:
                echo(warning)
        del layers, quantized, gate_up, down, gate_up_t, down_t
    return rows


def _measure_peaks(peaks: dict, isas, threads: int) -> None:
    """Measures the peak of each ISA (kernels.measure_peak_gflop_s on the layer's threads)
    before a case is timed, and keeps the best of all measurements so far: a neighbour can
    only lower a peak, and a low peak would flatter the roofline fractions."""
    from numa_moe.apps.benchmarking.kernels import measure_peak_gflop_s

    for isa in isas:
        peak = measure_peak_gflop_s(isa, threads)
        if peak is None or peaks.get(isa) is None:
            peaks[isa] = peak
        else:
            peaks[isa] = Yardstick.from_windows([peaks[isa], peak])


def _compute_seconds(layer, ids: np.ndarray, hidden: int, inter: int, peaks: dict) -> float | None:
    """The step's compute floor: each active expert's flops (2 x 3 x H x I per routed token)
    at the in-run peak of the ISA the layer runs it with (_measure_peaks). None when one of
    those ISAs has no peak loop (ref, amx_model): the memory time alone is then the
    roofline."""
    from numa_moe.apps.benchmarking.kernels import measure_peak_gflop_s

    total = 0.0
    for m in np.bincount(ids.reshape(-1)):
        if m == 0:
            continue
        isa = layer.isa_for_tokens(int(m))
        if isa not in peaks:
            peaks[isa] = measure_peak_gflop_s(isa, layer.pool.n_threads)
        if peaks[isa] is None:
            return None
        total += 2.0 * 3 * hidden * inter * int(m) / (peaks[isa].best * 1e9)
    return total


def format_group(fmt: str, group: int) -> int:
    """The group a quantized format runs with: its own where it fixes one (mxfp4, iq4nl: 32)."""
    return FIXED_GROUPS.get(fmt, group)


def _integer_formats(formats) -> list[str]:
    for fmt in formats:
        quant.check_arguments(weight_format=fmt, formats=("bf16", *QUANT_FORMATS))
    return list(dict.fromkeys(f for f in formats if f != "bf16"))


def check_arguments(models, tokens, repeats: int, virtual_nodes: int = 2, int_formats: int = 0) -> None:
    """Refuses unknown models, counts out of range and token counts whose step does not fit
    in memory (memory.check_fits), before anything is allocated (bench_layer's, and
    app.bench_app's with its defaults)."""
    from numa_moe.placement import memory
    from numa_moe.placement.segments import MAX_NODES

    for name in models:
        if name not in BENCH_MODELS:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(BENCH_MODELS)}")
    for what, values in (("tokens", tokens), ("repeats", (repeats,))):
        for value in values:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{what} must be integers >= 1, got {value!r}")
    if isinstance(virtual_nodes, bool) or not isinstance(virtual_nodes, (int, np.integer)) \
            or not 2 <= virtual_nodes <= MAX_NODES:
        raise ValueError(f"virtual_nodes must be in 2..{MAX_NODES} (the most NUMA nodes a Linux kernel "
                         f"supports), got {virtual_nodes!r}")
    t = int(max(tokens, default=1))
    for name in models:
        n_experts, top_k, hidden, inter = BENCH_MODELS[name]
        # bf16 experts and their integer copies (at most a byte a weight, plus scales), then
        # per token: x in float64 and bf16, each layer's output, the partial sums of every
        # node, the torch loop's bf16 and fp32 runs (gate/up, product, down per routed
        # expert) and the fp32 / float64 reference
        weights = n_experts * 3 * hidden * inter * (2 + int_formats * 9 // 8)
        per_token = (hidden * (8 + 2 + 2 * (2 + int_formats) + 4 * (virtual_nodes + 1) + 4 + 8)
                     + top_k * (3 * inter * 6 + hidden * 6))
        memory.check_fits(weights + t * per_token, f"the layer benchmark of {name} at {t} tokens")


def _relative_error(y: np.ndarray, ref64: np.ndarray) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - ref64) / np.linalg.norm(ref64))


def format_format_row(row: dict, fmt: str) -> str:
    """The line of one weight format's 1-node step, under the BF16 row of the same case."""
    entry = row["formats"][fmt]
    return (f"{fmt:>14s} T={row['tokens']:<3d} read    {entry['read_mb']:7.1f} MB | ours {entry['step_ms']:8.3f} ms | "
            f"{entry['bf16_step_ratio']:.2f}x the bf16 step (group {entry['group']}) | read {entry['ceiling_ms']:7.3f} ms "
            f"(ours {percent_of(entry['ceiling_ms'] / entry['step_ms'], 'the read')}) | "
            f"err {entry['rel_error_vs_fp32']:.1e}")


def format_bench_row(row: dict, virtual_nodes: int) -> str:
    ours = row["1 node ms"]
    multi = row[f"{virtual_nodes} virtual nodes ms"]
    return (f"{row['model']:>14s} T={row['tokens']:<3d} touched {row['touched_mb']:7.1f} MB | ours {ours:8.3f} ms | "
            f"{virtual_nodes}-node virtual {multi:8.3f} ms ({multi / ours - 1:+.1%}) | torch loop "
            f"{row['torch loop ms']:8.3f} ms ({row['torch loop ms'] / ours:.2f}x) | read {row['ceiling_ms']:7.3f} ms "
            f"({row['ceiling_gbps']:.1f} GB/s; ours {percent_of(row['ceiling_ms'] / ours, 'the read')}) | "
            f"{_roofline_cell(row)} | err {row['rel_error_vs_fp32']:.1e}")


def _roofline_cell(row: dict) -> str:
    """'roofline 1.234 ms (compute), ours 0.81 of it': max(touched bytes / in-run read
    ceiling, flops / in-run peak) over our 1-node step."""
    roofline = row.get("roofline_ms")
    if roofline is None:
        return "roofline -"
    compute = row.get("compute_ms")
    which = "memory" if compute is None or compute <= row["ceiling_ms"] else "compute"
    return (f"roofline {roofline:7.3f} ms ({which}{'' if compute is not None else ', no peak loop'}), "
            f"ours {ratio_cell(roofline / row['1 node ms'], 0)} of it")

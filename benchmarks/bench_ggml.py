#!/usr/bin/env python3
"""One MoE layer step, numa-moe against llama.cpp's ggml CPU backend, side by side on this
machine. Build the peer first (tools/build-ggml.sh), then:

    python benchmarks/bench_ggml.py [--shapes qwen3-30b-a3b,deepseek-v3] [--tokens 1,4,16]
                                    [--formats bf16,int8,int4,mxfp4] [--repeats 10] [--json FILE]
    python benchmarks/bench_ggml.py --check     # both sides on the same small weights

Per case (shape, M, format) the ggml harness (benchmarks/ggml_moe_step.cpp) runs as a
child process that stays alive over the repetitions; each repetition draws one random
routing (numa_moe.apps.run.random_routing), runs our layer on it, then hands the same
routing to the harness, which computes its graph once: the two sides alternate, seconds
apart, on the same routing, with the same threads (every CPU of the affinity mask; use
taskset to choose) and 4 KB pages on both. Formats pair the same bytes per weight: bf16
with BF16, int8 group 32 (fp16 scales) with Q8_0, int4 group 32 with Q4_0, mxfp4 with
MXFP4. Weights are random on both sides (their values do not change the speed). The
experts run silu(g) * u on both sides, also for gpt-oss's shape (its clamped SwiGLU and
biases change the epilogue, not the bytes). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "build" / "ggml" / "ggml_moe_step"

# name: (experts of the real model, top_k, hidden, intermediate, experts benchmarked).
# Fewer experts than the model where their BF16 copy would pass ~3 GB (it exists on both
# sides); a step touches top_k experts per token of tens of MB each, past any L3.
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, 128),
    "qwen3-235b": (128, 8, 4096, 1536, 32),
    "deepseek-v3": (256, 8, 7168, 2048, 16),
    "mixtral-8x7b": (8, 2, 4096, 14336, 8),
    "gpt-oss-120b": (128, 4, 2880, 2880, 48),
}
GGML_TYPES = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0", "mxfp4": "mxfp4"}
GROUP = 32  # Q8_0 / Q4_0 / MXFP4 blocks: 32 values and one scale (fp16; e8m0)


def summarize(samples_ms):
    """(median, spread): spread is (max - min) / median of the samples."""
    med = statistics.median(samples_ms)
    return med, (max(samples_ms) - min(samples_ms)) / med


def format_table(rows, cpu: str, threads: int) -> str:
    lines = [f"CPU: {cpu}, {threads} threads; medians over repetitions (spread = (max-min)/median)",
             f"{'shape':<24} {'M':>4} {'format':<12} {'ours ms':>16} {'ggml ms':>16} {'ggml/ours':>9}"]
    for r in rows:
        shape = r["shape"] + ("" if r["experts"] == r["model_experts"] else f" (E={r['experts']}/{r['model_experts']})")
        lines.append(f"{shape:<24} {r['tokens']:>4} {r['format'] + '/' + r['ggml_type']:<12} "
                     f"{r['ours_ms']:>8.3f} ±{100 * r['ours_spread']:>4.0f}% "
                     f"{r['ggml_ms']:>8.3f} ±{100 * r['ggml_spread']:>4.0f}% {r['ggml_ms'] / r['ours_ms']:>9.2f}")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class Harness:
    """The ggml harness as a child: one routing per line in, one JSON line out."""

    def __init__(self, experts, top_k, hidden, inter, tokens, ggml_type, threads, extra=()):
        cmd = [str(HARNESS), "--experts", str(experts), "--top-k", str(top_k), "--hidden", str(hidden),
               "--inter", str(inter), "--tokens", str(tokens), "--type", ggml_type, "--threads", str(threads),
               *extra]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()  # {"ready": true, ...}: weights filled

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self.proc.kill()
            raise SystemExit(f"bench_ggml: the ggml harness failed (status {self.proc.wait()}; "
                             "its message is above)") from None

    def step(self, ids: np.ndarray, weights: np.ndarray) -> dict:
        self.proc.stdin.write(" ".join(map(str, ids.ravel().tolist())) + " "
                              + " ".join(repr(float(w)) for w in weights.ravel()) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def our_layer(gate_up, down, fmt: str):
    from numa_moe.layer.moe_layer import MoELayer
    from numa_moe.placement.topology import Topology, current_topology

    base = current_topology()  # one node, as `numa-moe bench layer` times it (ggml has no NUMA placement)
    one_node = Topology.virtual(1, base) if base.is_virtual or len(base.node_ids) > 1 else base
    return MoELayer.from_tensors(gate_up, down, topology=one_node, tables="theoretical", page="4k",
                                 weight_format=fmt, group=GROUP)


def bench_case(shape: str, tokens, fmt: str, repeats: int, threads: int, rng, echo) -> list[dict]:
    import ml_dtypes

    from numa_moe.apps.benchmarking.layer import fill_bf16
    from numa_moe.apps.benchmarking.yardsticks import settle
    from numa_moe.apps.run import random_routing

    model_experts, top_k, hidden, inter, experts = SHAPES[shape]
    gate_up = np.empty((experts, 2 * inter, hidden), dtype=ml_dtypes.bfloat16)
    down = np.empty((experts, hidden, inter), dtype=ml_dtypes.bfloat16)
    fill_bf16(gate_up, rng, hidden ** -0.5)
    fill_bf16(down, rng, inter ** -0.5)
    layer = our_layer(gate_up, down, fmt)
    del gate_up, down  # the layer holds its own copy
    rows = []
    for m in tokens:
        harness = Harness(experts, top_k, hidden, inter, m, GGML_TYPES[fmt], threads)
        repacked = harness.info.get("repacked")
        try:
            ours, theirs = [], []
            for i in range(repeats + 1):  # the first is untimed: both sides size their buffers
                x = rng.standard_normal((m, hidden)).astype(ml_dtypes.bfloat16)
                ids, weights = random_routing(rng, m, experts, top_k)
                settle()
                start = time.perf_counter()
                layer.forward_numpy(x, ids, weights)
                elapsed = (time.perf_counter() - start) * 1e3
                settle()
                ggml_ms = harness.step(ids, weights)["ms"][0]
                if i:
                    ours.append(elapsed)
                    theirs.append(ggml_ms)
        finally:
            harness.close()
        (o, os_), (g, gs) = summarize(ours), summarize(theirs)
        row = {"shape": shape, "model_experts": model_experts, "experts": experts, "top_k": top_k,
               "hidden": hidden, "intermediate": inter, "tokens": m, "format": fmt, "ggml_type": GGML_TYPES[fmt],
               "threads": threads, "repeats": repeats, "ours_ms": o, "ours_spread": os_, "ggml_ms": g,
               "ggml_spread": gs, "ggml_repacked": repacked, "ours_samples_ms": ours, "ggml_samples_ms": theirs}
        echo(format_table([row], cpu_model(), threads).splitlines()[-1])
        rows.append(row)
    del layer
    return rows


def check(threads: int, rng, echo) -> dict:
    """Both sides on the same small weights and routing: ggml BF16 against ours bf16
    (bf16 rounding apart), Q8_0 / Q4_0 and int8 / int4 against a float64 reference."""
    import ml_dtypes
    import tempfile

    from numa_moe.apps.run import random_routing

    experts, top_k, hidden, inter, m = 8, 2, 256, 128, 4
    gate_up = (rng.standard_normal((experts, 2 * inter, hidden)) * hidden ** -0.5).astype(ml_dtypes.bfloat16)
    down = (rng.standard_normal((experts, hidden, inter)) * inter ** -0.5).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((m, hidden)).astype(ml_dtypes.bfloat16)
    ids, weights = random_routing(rng, m, experts, top_k)
    g64, u64, d64 = (gate_up[:, :inter].astype(np.float64), gate_up[:, inter:].astype(np.float64),
                     down.astype(np.float64))
    x64 = x.astype(np.float64)
    ref = np.zeros((m, hidden))
    for t in range(m):
        for k in range(top_k):
            e = ids[t, k]
            g, u = g64[e] @ x64[t], u64[e] @ x64[t]
            ref[t] += weights[t, k] * (d64[e] @ (g / (1 + np.exp(-g)) * u))
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        wfile, xfile = Path(tmp) / "w.f32", Path(tmp) / "x.f32"
        np.concatenate([gate_up[:, :inter].ravel(), gate_up[:, inter:].ravel(), down.ravel()]) \
            .astype(np.float32).tofile(wfile)
        x.astype(np.float32).tofile(xfile)
        for fmt, gtype in GGML_TYPES.items():
            ours = our_layer(gate_up, down, fmt).forward_numpy(x, ids, weights, out_dtype="float32")
            h = Harness(experts, top_k, hidden, inter, m, gtype, threads,
                        ("--weights", str(wfile), "--input", str(xfile), "--check"))
            theirs = np.asarray(h.step(ids, weights)["out"]).reshape(m, hidden)
            h.close()
            rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
            result[fmt] = {"ours_vs_f64": rel(ours, ref), "ggml_vs_f64": rel(theirs, ref),
                           "ggml_vs_ours": rel(theirs, ours)}
            echo(f"{fmt:>5}/{gtype:<5} rel. error vs float64: ours {result[fmt]['ours_vs_f64']:.2e}, "
                 f"ggml {result[fmt]['ggml_vs_f64']:.2e}; ggml vs ours {result[fmt]['ggml_vs_ours']:.2e}")
    return result


def parse_list(text: str, allowed=None, kind=str):
    items = [kind(s) for s in text.split(",") if s.strip()]
    bad = [s for s in items if allowed is not None and s not in allowed]
    if not items or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed or ['values'])}")
    return items


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=lambda s: parse_list(s, SHAPES), default=list(SHAPES))
    p.add_argument("--tokens", type=lambda s: parse_list(s, kind=int), default=[1, 4, 16, 64, 256])
    p.add_argument("--formats", type=lambda s: parse_list(s, GGML_TYPES), default=list(GGML_TYPES))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--check", action="store_true", help="compare both sides' outputs on one small case")
    a = p.parse_args(argv)
    if not HARNESS.exists():
        print(f"bench_ggml: {HARNESS} is missing; build it with tools/build-ggml.sh", file=sys.stderr)
        return 1
    if a.repeats < 1 or any(t < 1 for t in a.tokens):
        print("bench_ggml: --repeats and --tokens must be positive", file=sys.stderr)
        return 1
    threads = len(os.sched_getaffinity(0))
    rng = np.random.default_rng(a.seed)
    if a.check:
        out = {"check": check(threads, rng, print)}
    else:
        print(f"CPU: {cpu_model()}, {threads} threads")
        rows = []
        for shape in a.shapes:
            for fmt in a.formats:
                rows += bench_case(shape, a.tokens, fmt, a.repeats, threads, rng, print)
        print()
        print(format_table(rows, cpu_model(), threads))
        out = {"cpu": cpu_model(), "threads": threads, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

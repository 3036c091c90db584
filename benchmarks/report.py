#!/usr/bin/env python3
"""Turns the JSON of `numa-moe bench kernels --json` and `numa-moe bench layer --json`
into the tables and plots of docs/benchmarks.md.

    python3 benchmarks/report.py --kernels kernels.json --layer layer.json --out docs/
"""

import argparse
import json
from pathlib import Path

from numa_moe.apps.benchmarking.yardsticks import MEASUREMENT_NOTE, is_measurement_problem, ratio_cell


def _ratio(value) -> str:
    """A fraction of a ceiling or peak; above 1 marked as a measurement problem."""
    return ratio_cell(value, 0) if value is not None else "—"


def kernel_table(result: dict) -> str:
    lines = [
        "| shape | M | ours ms | torch ms | read ms | ours / read ceiling | GFLOP/s | / peak | speedup vs torch | target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        if r.get("target_value") is None:
            target = f"{r['target_metric']} — (no peak loop)"
        elif r.get("target"):
            target = f"{r['target_metric']} {_ratio(r['target_value'])} ≥ {r['target']:.2f}"
        else:
            target = f"{r['target_metric']} {_ratio(r['target_value'])} (no target)"
        lines.append(
            f"| {r['shape']} | {r['m']} | {r['ours_ms']:.3f} | {r['torch_ms']:.3f} | {r['read_ms']:.3f} | "
            f"{_ratio(r['fraction_of_read'])} | {r['gflop_s']:.0f} | {_ratio(r.get('fraction_of_peak'))} | "
            f"{r['speedup_vs_torch']:.2f}x | {target} |")
    if any(r.get("measurement_problem") for r in result["rows"]):
        lines.append(f"\n{MEASUREMENT_NOTE}")
    lines += [f"\n{warning}" for warning in result.get("warnings", [])]
    return "\n".join(lines)


def target_summary(result: dict) -> str:
    """One row per shape: the target metric at every M that has a target (read fraction at
    M <= 8, fraction of max(memory, compute) at 16, fraction of the peak at 128), and the
    read ceiling's range in GB/s, so runs on different page sizes or days compare at a glance.
    ✗ marks a miss at the printed two decimals (the runs scatter by more than that)."""
    rows = [r for r in result["rows"] if r.get("target")]
    m_values = sorted({r["m"] for r in rows})
    lines = ["| shape | " + " | ".join(f"M = {m}" for m in m_values) + " | read GB/s |",
             "|---|" + "---:|" * (len(m_values) + 1)]
    for shape in dict.fromkeys(r["shape"] for r in result["rows"]):
        cells = {r["m"]: r for r in rows if r["shape"] == shape}
        gb_s = [r["read_gb_s"] for r in result["rows"] if r["shape"] == shape]
        lines.append(f"| {shape} | " + " | ".join(
            _target_value(cells[m]) if m in cells else "—" for m in m_values) + f" | {min(gb_s):.0f}-{max(gb_s):.0f} |")
    return "\n".join(lines)


def _target_value(row: dict) -> str:
    value = row["target_value"]
    if value is None:
        return "—"
    if is_measurement_problem(value):
        return _ratio(value)  # not a result: neither met nor missed
    return f"{value:.2f}" + ("" if round(value, 2) >= row["target"] else " ✗")


def layer_table(rows: list) -> str:
    lines = [
        "| layer | tokens | touched MB | ours ms (1 node) | 2 virtual nodes ms | torch loop ms | read ms | "
        "ours vs read | ours vs torch | rel. error vs fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ours = r["1 node ms"]
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['touched_mb']:.1f} | {ours:.3f} | {r['2 virtual nodes ms']:.3f} "
            f"({r['2 virtual nodes ms'] / ours - 1:+.1%}) | {r['torch loop ms']:.3f} | {r['ceiling_ms']:.3f} | "
            f"{ours / r['ceiling_ms']:.2f}x{'!' if r['ceiling_ms'] > ours else ''} | "
            f"{r['torch loop ms'] / ours:.2f}x faster | {r['rel_error_vs_fp32']:.1e} |")
    if any(r["ceiling_ms"] > r["1 node ms"] for r in rows):
        lines.append("\n! ours faster than the read of its own weights: the read ceiling measured low; a "
                     "measurement problem, not a result")
    return "\n".join(lines)


def kernel_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in result["rows"] if r["shape"] == shape]
        m = [r["m"] for r in rows]
        ax.plot(m, [r["ours_ms"] for r in rows], "o-", label=f"numa-moe ({result['isa']})")
        ax.plot(m, [r["torch_ms"] for r in rows], "s--", label="torch F.linear bf16")
        ax.plot(m, [r["read_ms"] for r in rows], ":", color="gray", label="fastest streaming read (ceiling)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(m)
        ax.set_xticklabels([str(v) for v in m])
        ax.set_title(f"{shape} ({rows[0]['hidden']}x{rows[0]['intermediate']})", fontsize=10)
        ax.set_xlabel("tokens per expert (M)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per expert FFN (median)")
    axes[0][0].legend(fontsize=8)
    unit = "GFLOP/s" if result.get("weight_format", "bf16") == "bf16" else "GOP/s"
    peaks = [f"{result['peak_instructions'][isa]} {value:.0f} {unit}" for isa, value in result["peaks_gflop_s"].items()
             if value]
    peak = "peak " + ", ".join(peaks) if peaks else "no peak loop for this ISA"
    fig.suptitle(f"Expert FFN, {result['threads']} threads, {peak}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def layer_plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"{r['model']}\nT={r['tokens']}" for r in rows]
    series = [("numa-moe, 1 node", "1 node ms"), ("numa-moe, 2 virtual nodes", "2 virtual nodes ms"),
              ("torch loop (transformers)", "torch loop ms"), ("read of touched experts", "ceiling_ms")]
    x = np.arange(len(rows))
    width = 0.2
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, (name, key) in enumerate(series):
        ax.bar(x + (i - 1.5) * width, [r[key] / r["ceiling_ms"] for r in rows], width, label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=9)
    ax.set_ylabel("time / streaming-read time")
    ax.set_title("MoE layer step, relative to reading the touched expert weights once (lower is better)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kernels", type=Path, required=True)
    parser.add_argument("--layer", type=Path, required=True)
    parser.add_argument("--kernels-4k", type=Path, default=None,
                        help="the kernel benchmark on 4 KB pages (--page 4k), summarised after the main table")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    kernels = json.loads(args.kernels.read_text())
    layer = json.loads(args.layer.read_text())
    kernel_plot(kernels, args.out / "bench-kernels.png")
    layer_plot(layer, args.out / "bench-layer.png")
    print("## Expert FFN kernels\n")
    print(kernel_table(kernels))
    print(f"\nTargets, {kernels.get('page', '?')} pages:\n")
    print(target_summary(kernels))
    if args.kernels_4k:
        kernels_4k = json.loads(args.kernels_4k.read_text())
        print(f"\nTargets, {kernels_4k.get('page', '?')} pages:\n")
        print(target_summary(kernels_4k))
    print("\n## MoE layer\n")
    print(layer_table(layer))


if __name__ == "__main__":
    main()

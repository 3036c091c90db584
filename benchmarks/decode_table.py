#!/usr/bin/env python3
"""Decode and prefill of one expert on every non-AMX ISA of this CPU, in every weight
format, as one table per phase (docs/benchmarks.md, "Decode kernels without AMX"):

    .venv/bin/python benchmarks/decode_table.py [--shapes ...] [--group 32] [--json FILE]

Decode (M = 1, 2, 4, 8): each format's fraction of the read ceiling of its own bytes
(weights + scales, `numa-moe bench kernels`' /read column) and the step ratios int8/bf16,
int4/int8, mxfp4/int4 and iq4nl/int4 (mxfp4 and iq4nl always in their blocks of 32:
compare them with --group 32).
Prefill (M = 64, 256): each format's fraction of its ISA's peak loop (fp32 FMA for avx2
bf16, vdpbf16ps for avx512 bf16, vpmaddubsw / vpdpbusd for the integer formats). Every figure comes from `numa_moe.apps.benchmarking.kernels.run`, the code of `numa-moe
bench kernels` (medians against the fastest interleaved read, 2 MiB pages, no torch).
A measurement, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

from numa_moe.layer import kernels
from numa_moe.apps.benchmarking import kernels as bench

FORMATS = ("bf16", "int8", "int4", "mxfp4", "iq4nl")
DECODE_M = (1, 2, 4, 8)
PREFILL_M = (64, 256)
DEFAULT_SHAPES = ("qwen3-30b-a3b", "qwen3-235b", "deepseek-v3", "mixtral-8x7b")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def native_isas() -> list[str]:
    """The non-AMX SIMD ISAs this CPU runs natively, in both integer and bf16 formats."""
    return [isa for isa in ("avx2", "avx512") if all(isa in kernels.available_isas(f) for f in FORMATS)]


def measure(shapes, isas, m_values, group: int, min_seconds: float) -> dict:
    """{(isa, format): {(shape, m): Row}}"""
    rows = {}
    for isa in isas:
        for fmt in FORMATS:
            result = bench.run(shapes=list(shapes), m_values=list(m_values), isa=isa, with_torch=False,
                               weight_format=fmt, group=group, min_seconds=min_seconds, progress=lambda line: None)
            rows[(isa, fmt)] = {(row.shape, row.m): row for row in result.rows}
            for warning in result.warnings:
                print(f"  ({isa} {fmt}) {warning}")
    return rows


def decode_table(rows, shapes, isas) -> list[str]:
    lines = ["shape            M  isa     bf16 /read  int8 /read  int4 /read mxfp4 /read iq4nl /read"
             "  int8/bf16  int4/int8  mxfp4/int4  iq4nl/int4"]
    for shape in shapes:
        for m in DECODE_M:
            for isa in isas:
                cell = {fmt: rows[(isa, fmt)][(shape, m)] for fmt in FORMATS}
                lines.append(f"{shape:<15} {m:>2}  {isa:<6}  " +
                             "  ".join(f"{cell[fmt].fraction_of_read:>10.2f}" for fmt in FORMATS) +
                             f"  {cell['int8'].ours_ms / cell['bf16'].ours_ms:>9.2f}"
                             f"  {cell['int4'].ours_ms / cell['int8'].ours_ms:>9.2f}"
                             f"  {cell['mxfp4'].ours_ms / cell['int4'].ours_ms:>10.2f}"
                             f"  {cell['iq4nl'].ours_ms / cell['int4'].ours_ms:>10.2f}")
    return lines


def prefill_table(rows, shapes, isas) -> list[str]:
    lines = ["shape            M  isa     bf16 /peak  int8 /peak  int4 /peak mxfp4 /peak iq4nl /peak"]
    for shape in shapes:
        for m in PREFILL_M:
            for isa in isas:
                cells = [rows[(isa, fmt)][(shape, m)].fraction_of_peak for fmt in FORMATS]
                lines.append(f"{shape:<15} {m:>3} {isa:<6}  " +
                             "  ".join(f"{c:>10.2f}" if c is not None else f"{'-':>10}" for c in cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma list of " + ", ".join(bench.SHAPES))
    parser.add_argument("--group", type=int, default=128, choices=(32, 64, 128), help="columns per scale of int8 / int4")
    parser.add_argument("--min-seconds", type=float, default=0.25, help="calls per point span at least this long")
    parser.add_argument("--no-prefill", action="store_true", help="decode token counts only")
    parser.add_argument("--json", default=None, help="also write every row as JSON to this file")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in bench.SHAPES]
    if unknown:
        parser.error(f"unknown shapes {', '.join(unknown)}; known: {', '.join(bench.SHAPES)}")
    isas = native_isas()
    if not isas:
        parser.error("this CPU runs neither the avx2 nor the avx512 kernels natively")
    m_values = DECODE_M + (() if args.no_prefill else PREFILL_M)
    threads = len(os.sched_getaffinity(0))
    print(f"{cpu_model()}; {threads} threads; ISAs {', '.join(isas)}; int8 / int4 group {args.group}, fp16 scales; "
          f"mxfp4 e8m0 per 32; iq4nl fp16 per 32; 2 MiB pages")
    rows = measure(shapes, isas, m_values, args.group, args.min_seconds)
    print("\n".join(["", "decode: fraction of the read ceiling of each format's bytes; step ratios"]
                    + decode_table(rows, shapes, isas)))
    if not args.no_prefill:
        print("\n".join(["", "prefill: fraction of the ISA's peak loop"] + prefill_table(rows, shapes, isas)))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({f"{isa} {fmt}": [vars(row) for row in by_point.values()]
                       for (isa, fmt), by_point in rows.items()}, handle, indent=1)


if __name__ == "__main__":
    main()

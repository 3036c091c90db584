#!/usr/bin/env python3
"""Tile instructions of the AMX integer kernels (native/kernels/amx_quant.cpp), counted on
the AMX software model: one gate matrix [I, H] of an expert shape, int8 or int4, per
token count M, through kernels.matmul_segments(isa="amx_model") on this thread. Counts,
not times (the model says nothing about speed); they show what the tile rule costs per
KiB of weights and how full the tdpbssd tiles are (useful products over 16 x 16 x K per
instruction, K = min(group, 64) the tile rule's columns per tdpbssd). Needs an extension
built with test hooks (tools/setup.sh does)."""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from numa_moe import _native, quant
from numa_moe.layer import kernels

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = {"qwen3-30b-a3b": (2048, 768), "mixtral-8x7b": (4096, 14336), "deepseek-v3": (7168, 2048)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--m", default="1,4,8,16,32,128")
    parser.add_argument("--formats", default="int8,int4")
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    if not hasattr(_native, "testing") or "amx_model" not in kernels.available_isas("int8"):
        raise SystemExit("needs the AMX model (AVX-512) and an extension built with test hooks")
    rng = np.random.default_rng(0)
    print(f"gate matrix [I, H] of each shape, group {args.group}; counts per KiB of weights")
    print(f"{'shape':<15}{'fmt':<6}{'M':>5}{'tdpbssd':>9}{'loads':>8}{'stores':>8}{'zeros':>8}{'tile fill':>11}")
    for name in args.shapes.split(","):
        hidden, inter = SHAPES[name]
        w = (rng.standard_normal((inter, hidden), dtype=np.float32) * hidden ** -0.5)
        for fmt in args.formats.split(","):
            qm = quant.quantize(w, fmt, args.group, "fp16")
            kib = qm.q.nbytes / 1024
            segments = np.array([[0, 1, inter, 0, hidden]], np.int64)
            for m in (int(v) for v in args.m.split(",")):
                x = rng.standard_normal((m, hidden), dtype=np.float32).astype(BF16)
                out = np.zeros((inter, m), np.float32)
                _native.testing.amx_model_counts(reset=True)
                kernels.matmul_segments(qm, segments, x, out, isa="amx_model")
                c = _native.testing.amx_model_counts(reset=True)
                fill = inter * m * hidden / (c["dpbssd"] * 16 * 16 * min(args.group, 64))
                print(f"{name:<15}{fmt:<6}{m:>5}{c['dpbssd'] / kib:>9.1f}{c['loads'] / kib:>8.1f}"
                      f"{c['stores'] / kib:>8.1f}{c['zeros'] / kib:>8.1f}{fill:>11.3f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""One expert FFN (numa_moe.layer.kernels.expert_ffn) with bf16, int8 and int4 weights: the
median time per call, and the bytes it reads (weights + scales) per second next to the
streaming-read ceiling of the same bytes (numa_moe._bench.stream_read). The calls rotate
over enough weight copies to exceed the last-level cache, so every call reads DRAM.
With --hot: the compute cost alone, one matmul_segments call on one thread over weights
that stay in L2 (256 x 2048), the minimum of many calls (the least disturbed by other
work on a shared machine), each format against bf16; --isa runs every format on one ISA
(e.g. avx2: its integer kernels against its bf16 kernel) instead of each format's fastest.
A measurement, not a test: nothing here asserts a speed."""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np

from numa_moe import _bench, _native, quant
from numa_moe.layer import kernels

try:
    # As in an application: once torch is loaded the calls run on its OpenMP team. Without
    # it they run on numa-moe's own threads, whose wake-ups cost about 40 us a 2-thread
    # call on this VM: a third of a qwen3 int4 expert's time at one token.
    import torch  # noqa: F401
except ImportError:
    pass

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = {"qwen3-30b-a3b": (2048, 768), "deepseek-v3": (7168, 2048)}  # hidden, intermediate
FORMATS = ("bf16", "int8", "int4")


def expert(rng, hidden, inter, fmt, group, scale_dtype):
    """(gate, up, down) in the format: bf16 arrays or QuantizedMatrix."""
    mats = []
    for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter)):
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5)
        mats.append(w.astype(BF16) if fmt == "bf16" else quant.quantize(w, fmt, group, scale_dtype))
    return tuple(mats)


def copy_of(mats):
    return tuple(m.copy() if isinstance(m, np.ndarray) else
                 quant.QuantizedMatrix(m.fmt, m.group, m.q.copy(), m.scales.copy()) for m in mats)


def buffers(mats):
    out = []
    for m in mats:
        out += [m.view(np.uint16)] if isinstance(m, np.ndarray) else [m.q, m.scales]
    return out


def nbytes(mats):
    return sum(b.nbytes for b in buffers(mats))


def median_seconds(fn, copies, calls):
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn(copies[i % len(copies)])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hot(m_values, group: int, scale_dtype: str, calls: int, isa: str | None = None) -> None:
    rng = np.random.default_rng(0)
    rows, cols = 256, 2048
    w = rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5
    mats = {"bf16": w.astype(BF16)}
    mats.update({fmt: quant.quantize(w, fmt, group, scale_dtype) for fmt in ("int8", "int4")})
    segments = np.array([[0, 1, rows, 0, cols]], np.int64)
    for fmt in mats:
        if isa is not None and isa not in kernels.available_isas(fmt):
            raise SystemExit(f"--isa {isa}: not available for {fmt} here (available: "
                             f"{', '.join(kernels.available_isas(fmt))})")
    isas = {fmt: isa or kernels.fastest_isa(fmt) for fmt in mats}
    print(f"hot: {rows} x {cols} weights, one thread, min of {calls} calls; ISA {isas}")
    print(f"{'M':>5}" + "".join(f"{fmt + ' us':>10}" for fmt in mats) + f"{'bf16/int8':>11}{'bf16/int4':>11}")
    for m in m_values:
        x = rng.standard_normal((m, cols), dtype=np.float32).astype(BF16)
        best = {}
        for fmt, weight in mats.items():
            out = np.zeros((rows, m), np.float32)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                kernels.matmul_segments(weight, segments, x, out, isa=isas[fmt])
                times.append(time.perf_counter() - start)
            best[fmt] = min(times) * 1e6
        print(f"{m:>5}" + "".join(f"{best[fmt]:>10.1f}" for fmt in mats) +
              f"{best['bf16'] / best['int8']:>11.2f}{best['bf16'] / best['int4']:>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hot", action="store_true", help="compute cost only: weights in L2, one thread")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--m", default="1,4,16")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30, help="calls per point (median; at least 20)")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--scale-dtype", default="fp16")
    parser.add_argument("--isa", default=None, help="--hot: run every format on this ISA (default: each one's fastest)")
    parser.add_argument("--cache-mib", type=int, default=32, help="last-level cache the copies must exceed")
    args = parser.parse_args()
    calls = max(20, args.calls)
    if args.hot:
        hot([int(v) for v in args.m.split(",")], args.group, args.scale_dtype, max(calls, 200), args.isa)
        return
    if args.isa is not None:
        parser.error("--isa applies to --hot only")
    rng = np.random.default_rng(0)
    print(f"threads={args.threads} group={args.group} scales={args.scale_dtype} calls={calls} (median) "
          f"int ISA={kernels.fastest_isa('int8')} bf16 ISA={kernels.default_isa()} "
          f"workers={_native.thread_backend()}")
    print(f"{'shape':<15}{'fmt':<6}{'M':>4}{'MB/call':>9}{'copies':>7}{'us/call':>10}{'GB/s':>8}"
          f"{'read GB/s':>11}{'of read':>9}")
    for shape in args.shapes.split(","):
        hidden, inter = SHAPES[shape]
        x = rng.standard_normal((max(int(v) for v in args.m.split(",")), hidden), dtype=np.float32).astype(BF16)
        for fmt in args.formats.split(","):
            first = expert(rng, hidden, inter, fmt, args.group, args.scale_dtype)
            size = nbytes(first)
            n_copies = max(2, -(-2 * args.cache_mib * 2**20 // size) + 1)
            copies = [first] + [copy_of(first) for _ in range(n_copies - 1)]
            read = median_seconds(lambda c: _bench.stream_read(buffers(c), args.threads), copies, calls)
            for m in (int(v) for v in args.m.split(",")):
                out = np.empty((m, hidden), np.float32)
                index = np.arange(m)

                def call(c):
                    kernels.expert_ffn(x, *c, token_index=index, out=out, threads=args.threads)

                call(copies[0])  # warm-up: pool start, page faults of out
                seconds = median_seconds(call, copies, calls)
                gbps, read_gbps = size / seconds / 1e9, size / read / 1e9
                print(f"{shape:<15}{fmt:<6}{m:>4}{size / 1e6:>9.2f}{n_copies:>7}{seconds * 1e6:>10.0f}"
                      f"{gbps:>8.1f}{read_gbps:>11.1f}{gbps / read_gbps:>9.2f}")
            del copies, first


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Expert-FFN kernels vs torch F.linear vs the streaming-read ceiling (see
numa_moe/apps/benchmarking/kernels.py; same code as `numa-moe bench kernels`)."""

import argparse
import sys

from numa_moe.apps.benchmarking import kernels as bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default=",".join(bench.SHAPES), help="comma list of " + ", ".join(bench.SHAPES))
    parser.add_argument("--m", default=",".join(map(str, bench.M_VALUES)), help="comma list of token counts")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--isa", default=None, choices=bench.kernels.ISAS)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--page", choices=("2m", "4k"), default="2m", help="page size of the weight copies")
    parser.add_argument("--min-seconds", type=float, default=0.25, help="enough calls per point to span this long")
    parser.add_argument("--json", default=None, help="write the result as JSON to this path")
    args = parser.parse_args()
    result = bench.run(shapes=args.shapes.split(","), m_values=[int(v) for v in args.m.split(",")],
                       repeats=args.repeats, threads=args.threads, isa=args.isa, with_torch=not args.no_torch,
                       page=args.page, min_seconds=args.min_seconds, table=print)
    if args.json:
        bench.to_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()

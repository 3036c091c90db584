#!/usr/bin/env python3
"""One MoE layer step: ours (1 node and N virtual nodes) vs the transformers-style torch
loop vs the streaming read of the touched experts (see numa_moe/apps/benchmarking/layer.py;
same code as `numa-moe bench layer`)."""

import argparse
import json
import sys

from numa_moe.apps.benchmarking import layer as bench
from numa_moe.layer.kernels import ISAS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(bench.BENCH_MODELS), help="comma list of " + ", ".join(bench.BENCH_MODELS))
    parser.add_argument("--tokens", default="1,16", help="comma list of token counts")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--virtual-nodes", type=int, default=2)
    parser.add_argument("--isa", default=None, choices=ISAS, help="kernel ISA (default: chosen per expert)")
    parser.add_argument("--json", default=None, help="write the rows as JSON to this path")
    args = parser.parse_args()
    rows = bench.bench_layer(args.models.split(","), [int(t) for t in args.tokens.split(",")], repeats=args.repeats,
                             virtual_nodes=args.virtual_nodes, isa=args.isa)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()

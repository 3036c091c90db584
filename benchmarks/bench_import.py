#!/usr/bin/env python3
"""Loading routed experts from GGUF files and FP8 checkpoints into an ExpertStore: the
median load time per format, the expert bytes it turns into per second, and these against
loading the BF16 safetensors checkpoint of the same shape (the plain copy), against reading
the source's expert bytes from the page cache into memory already faulted in (the same
preadv the loader issues, one thread), and against the in-run streaming-read ceiling of the
loaded buffers (numa_moe._bench.stream_read). Files are written first (the gguf package's
writer, torch for FP8) and read from the page cache. A measurement, not a test: nothing here
asserts a speed."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from numa_moe import _bench
from numa_moe.checkpoints.dispatch import open_checkpoint
from numa_moe.checkpoints.safetensors import read_matrix_into
from numa_moe.files import OpenFiles
from numa_moe.layer.store import ExpertStore
from numa_moe.checkpoints.synthetic import make_checkpoint
from numa_moe.formats import KINDS

SHAPES = {"qwen3-30b-a3b": (2048, 768), "deepseek-v3": (7168, 2048)}  # hidden, intermediate


# Types the gguf package dequantizes but does not quantize: written as random raw blocks.
RAW_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def random_k_blocks(rng, qtype, shape):
    """Random raw blocks of a type of RAW_TYPES with finite fp16 scales (d where the
    K-quants and IQ4 types keep it; the bytes after it, dmin or codes, the same)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    d = (rng.random(len(blocks)) * 0.02 + 0.001).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        blocks[:, size - 2:] = d
    else:
        blocks[:, 0:2] = d
        blocks[:, 2:4] = d
    return raw


def write_gguf(path: Path, types: dict, experts: int, hidden: int, inter: int, rng) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_expert_count(experts)
    w.add_expert_used_count(min(8, experts))
    w.add_embedding_length(hidden)
    w.add_expert_feed_forward_length(inter)
    for kind in KINDS:
        shape = (experts, inter, hidden) if kind != "down" else (experts, hidden, inter)
        x = (rng.standard_normal(shape, dtype=np.float32) * shape[-1] ** -0.5)
        qtype = gguf.GGMLQuantizationType[types[kind]]
        data = (random_k_blocks(rng, qtype, shape) if types[kind] in RAW_TYPES
                else gguf.quants.quantize(x, qtype))
        w.add_tensor(f"blk.0.ffn_{kind}_exps.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_fp8(directory: Path, experts: int, hidden: int, inter: int, seed: int) -> Path:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    directory.mkdir()
    tensors = {}
    for e in range(experts):
        for name, (rows, cols) in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                   ("down_proj", (hidden, inter))):
            key = f"model.layers.0.mlp.experts.{e}.{name}.weight"
            tensors[key] = (torch.randn(rows, cols, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[key + "_scale_inv"] = torch.rand(math.ceil(rows / 128), math.ceil(cols / 128), generator=g) * 1e-3
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "hidden_size": hidden, "moe_intermediate_size": inter, "n_routed_experts": experts,
        "num_experts_per_tok": min(8, experts),
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    return directory


def store_buffers(store):
    out = []
    for layer in store.layers:
        for kind in KINDS:
            out.append(store.weights(layer, kind).reshape(-1).view(np.uint8))
            if store.quantized:
                out.append(store.scales(layer, kind).reshape(-1).view(np.uint8))
    return out


def page_cache_read_seconds(path, repeats: int) -> float:
    """Median seconds to read every routed-expert matrix of ``path`` from the page cache
    into memory already faulted in, each into its own bytes of one buffer
    (read_matrix_into, as the loader reads)."""
    ck = open_checkpoint(path)
    matrices = [m for layer in ck.layer_ids for m in ck.layers[layer].expert_matrices()]
    ends = np.cumsum([m.nbytes for m in matrices])
    buffer = np.ones(int(ends[-1]), dtype=np.uint8)
    times = []
    with OpenFiles() as files:
        for _ in range(repeats + 1):  # the first pass brings any page not cached in
            started = time.perf_counter()
            for m, end in zip(matrices, ends):
                read_matrix_into(m, buffer[end - m.nbytes:end], files.fd(m.tensor.path))
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def measure(path, weight_format, repeats: int, threads: int, page: str):
    """(median load seconds, expert bytes loaded, read-ceiling GB/s of the loaded buffers,
    source label, median seconds of the page-cache read of the source's expert bytes)."""
    times, ceilings = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        store = ExpertStore.load(path, page=page, progress=False, weight_format=weight_format)
        times.append(time.perf_counter() - started)
        buffers = store_buffers(store)
        nbytes = sum(b.nbytes for b in buffers)
        reads = []
        for _ in range(3):
            t0 = time.perf_counter()
            _bench.stream_read(buffers, threads)
            reads.append(time.perf_counter() - t0)
        ceilings.append(nbytes / min(reads) / 1e9)
        label = store.checkpoint.source_format
        del store, buffers
    return statistics.median(times), nbytes, max(ceilings), label, page_cache_read_seconds(path, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="threads of the read ceiling")
    parser.add_argument("--page", choices=("4k", "2m"), default="4k",
                        help="page size of the loaded buffers (ExpertStore.load's page)")
    args = parser.parse_args()
    hidden, inter = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    cases = [("Q8_0", dict.fromkeys(KINDS, "Q8_0"), None), ("Q4_0", dict.fromkeys(KINDS, "Q4_0"), None),
             ("MXFP4", dict.fromkeys(KINDS, "MXFP4"), None), ("IQ4_NL", dict.fromkeys(KINDS, "IQ4_NL"), None),
             ("IQ4_XS", dict.fromkeys(KINDS, "IQ4_XS"), None), ("Q4_1", dict.fromkeys(KINDS, "Q4_1"), None),
             ("Q4_K", dict.fromkeys(KINDS, "Q4_K"), None), ("BF16", dict.fromkeys(KINDS, "BF16"), None),
             ("Q4_K_M", {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, None),
             ("Q4_K_M", {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, "int4")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        baseline_path = make_checkpoint(tmp / "st", "qwen3-30b-a3b", 1, args.experts, 0, hidden_size=hidden,
                                        intermediate_size=inter, progress=False, shared=False)
        def row(path, fmt):
            seconds, nbytes, ceiling, label, read = measure(path, fmt, args.repeats, args.threads, args.page)
            return label, fmt or "default", seconds, nbytes, ceiling, read

        rows = [row(baseline_path, None)]
        base_s = rows[0][2]
        for name, types, fmt in cases:
            path = tmp / f"{name}.gguf"
            if not path.exists():
                write_gguf(path, types, args.experts, hidden, inter, rng)
            rows.append(row(path, fmt))
        fp8 = write_fp8(tmp / "fp8", args.experts, hidden, inter, 0)
        for fmt in (None, "int8"):
            rows.append(row(fp8, fmt))
    print(f"ExpertStore.load of 1 layer x {args.experts} experts, {args.shape} shapes (H={hidden}, I={inter}); "
          f"median of {args.repeats} loads from the page cache into {args.page} pages")
    print(f"{'source':<28} {'--format':<8} {'load ms':>9} {'loaded MB':>10} {'GB/s':>7} "
          f"{'time x bf16':>11} {'read ms':>8} {'x read':>7} {'of ceiling':>10}")
    for label, fmt, seconds, nbytes, ceiling, read in rows:
        rate = nbytes / seconds / 1e9
        print(f"{label:<28} {fmt:<8} {seconds * 1e3:>9.1f} {nbytes / 1e6:>10.1f} {rate:>7.2f} "
              f"{seconds / base_s:>11.2f} {read * 1e3:>8.1f} {seconds / read:>7.1f} {rate / ceiling:>10.3f}")
    print("GB/s: bytes written into the interleaved buffers per second of load; time x bf16: load "
          "time over the BF16 safetensors load's (the plain copy); read ms: the source's expert bytes "
          "read from the page cache into memory already faulted in, and x read the load time over it; "
          f"of ceiling: GB/s over the streaming read of the loaded buffers ({args.threads} thread(s), "
          "best of the run)")


if __name__ == "__main__":
    main()

"""``numa-moe bench attention``: GQA decode attention against PyTorch's
``scaled_dot_product_attention(..., enable_gqa=True)`` and the read ceiling of the KV
bytes, all in one run.

Per (shape, batch, context): the median time of ``numa_moe.layer.attention.gqa_decode`` (the
default ISA, all CPUs; and its best, which on a shared machine is the call least held up
by waking threads), of SDPA on the same bf16 tensors (all CPUs), and the streaming
read of the same K and V bytes (the read ceiling; best rate over the repetitions, a
Yardstick: another tenant can only slow a read). Caches are filled to the full context.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from numa_moe.apps.benchmarking import native_loops
from numa_moe.apps.benchmarking.layer import fill_bf16
from numa_moe.apps.benchmarking.yardsticks import Yardstick, busy_warning, percent_of, settle

ATTENTION_SHAPES = {
    # name: (query heads, KV heads, head size)
    "qwen3-30b-a3b": (32, 4, 128),
    "llama-8/1": (8, 1, 128),  # one KV head and its 8 query heads (a Llama-70B tensor-parallel shard)
}


def bench_attention(shapes=tuple(ATTENTION_SHAPES), contexts=(512, 4096, 32768), batches=(1, 8), repeats: int = 10,
                    isa: str | None = None, seed: int = 0, echo=print) -> list[dict]:
    """Rows of ms per decode-attention call: ours, SDPA, and the read ceiling."""
    from numa_moe.layer import attention
    from numa_moe.placement import memory

    _check_arguments(shapes, contexts, batches, repeats)
    import ml_dtypes
    import torch

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    isa = isa or attention.default_isa()
    rng = np.random.default_rng(seed)
    rows = []
    for name in shapes:
        q_heads, kv_heads, head_dim = ATTENTION_SHAPES[name]
        for batch in batches:
            for context in contexts:
                k = memory.interleaved_empty((batch, kv_heads, context, head_dim), "bfloat16")
                v = memory.interleaved_empty((batch, kv_heads, context, head_dim), "bfloat16")
                fill_bf16(k, rng, 1.0)
                fill_bf16(v, rng, 1.0)
                q = rng.standard_normal((batch, q_heads, head_dim)).astype(ml_dtypes.bfloat16)
                kt, vt = memory.as_torch(k), memory.as_torch(v)
                qt = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16).unsqueeze(2)
                lengths = np.full(batch, context, dtype=np.int64)
                out = np.empty((batch, q_heads, head_dim), dtype=ml_dtypes.bfloat16)
                times = {"ours": [], "sdpa": []}
                read_gbps = []
                kv_bytes = k.nbytes + v.nbytes
                for _ in range(repeats):
                    settle()
                    start = time.perf_counter()
                    attention.gqa_decode(q, k, v, lengths, out=out, isa=isa)
                    times["ours"].append(time.perf_counter() - start)
                    settle()
                    start = time.perf_counter()
                    with torch.no_grad():
                        expected = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                    times["sdpa"].append(time.perf_counter() - start)
                    settle()
                    start = time.perf_counter()
                    native_loops.stream_read([k, v], threads)
                    read_gbps.append(kv_bytes / (time.perf_counter() - start) / 1e9)
                error = float((torch.from_numpy(out.astype(np.float32)) - expected.squeeze(2).float()).abs().max())
                ceiling = Yardstick.from_samples(read_gbps)
                row = {"shape": name, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim, "batch": batch,
                       "context": context, "isa": isa, "threads": threads, "repeats": repeats,
                       "kv_mb": kv_bytes / 1e6, "ours_ms": statistics.median(times["ours"]) * 1e3,
                       "ours_best_ms": min(times["ours"]) * 1e3,
                       "sdpa_ms": statistics.median(times["sdpa"]) * 1e3,
                       "ceiling_ms": kv_bytes / (ceiling.best * 1e9) * 1e3, "ceiling_gbps": ceiling.best,
                       "ceiling_spread": ceiling.spread, "ceiling_busy": ceiling.busy,
                       "max_abs_diff_vs_sdpa": error}
                rows.append(row)
                echo(format_attention_row(row))
                warning = busy_warning(f"read ceiling ({name}, B={batch}, T={context})", ceiling, "GB/s")
                if warning:
                    echo(warning)
                del k, v, kt, vt
    return rows


def _check_arguments(shapes, contexts, batches, repeats) -> None:
    """Refuses unknown shapes, counts below 1 and cases whose KV cache does not fit in
    memory (memory.check_fits), before anything is allocated."""
    from numa_moe.placement import memory

    for name in shapes:
        if name not in ATTENTION_SHAPES:
            raise ValueError(f"unknown shape {name!r}; known: {', '.join(ATTENTION_SHAPES)}")
    for what, values in (("contexts", contexts), ("batches", batches), ("repeats", (repeats,))):
        for value in values:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{what} must be integers >= 1, got {value!r}")
    batch, context = int(max(batches, default=1)), int(max(contexts, default=1))
    for name in shapes:
        q_heads, kv_heads, head_dim = ATTENTION_SHAPES[name]
        # K and V in bf16, SDPA's K and V expanded to the query heads (enable_gqa on CPU) and
        # its fp32 scores
        kv = 2 * batch * kv_heads * context * head_dim * 2
        needed = kv + kv * q_heads // kv_heads + 2 * batch * q_heads * context * 4
        memory.check_fits(needed, f"decode attention of {name} at batch {batch} and context {context}")


def format_attention_row(row: dict) -> str:
    ours = row["ours_ms"]
    return (f"{row['shape']:>13s} B={row['batch']:<2d} T={row['context']:<6d} KV {row['kv_mb']:8.1f} MB | ours "
            f"({row['isa']}) {ours:8.3f} ms (best {row['ours_best_ms']:.3f}) | sdpa {row['sdpa_ms']:8.3f} ms ({row['sdpa_ms'] / ours:.2f}x) | read "
            f"{row['ceiling_ms']:7.3f} ms ({row['ceiling_gbps']:.1f} GB/s; ours "
            f"{percent_of(row['ceiling_ms'] / ours, 'the read')}) | max diff {row['max_abs_diff_vs_sdpa']:.1e}")

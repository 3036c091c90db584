"""``numa-moe bench layer --app``: the layer called the way an application calls it.

In a model every MoE call comes right after torch work (the router, attention, norms),
whose OpenMP threads keep spinning for a while after each parallel op. This benchmark
runs, per model and token count:

- ``back to back``: the 1-node layer on torch tensors, one call after the other;
- ``app``: before every call a torch router (``softmax(x @ router.T)``, ``topk``) and an
  attention-sized matmul (``x @ W[H, H]``), timed apart from the layer call; the layer
  gets the same kind of random routing as back to back, so only the neighbour differs;
- ``torch alone``: that torch work where torch itself, not the layer, streams the same
  expert bytes between calls (``tensor.sum()`` over the touched experts, on torch's own
  threads): the same memory traffic and cache state without numa-moe, so the two differ
  only in whose threads read the weights;

then the HF-patched Qwen3-MoE block against the raw layer on the block's own routing,
and the fixed cost of a call: a tiny layer (8 experts of 256 x 128, 1 token) and one
tiny ``expert_ffn``, with the Python share separated from the native step.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from numa_moe import _native
from numa_moe.apps.benchmarking.layer import BENCH_MODELS, check_arguments, fill_bf16
from numa_moe.apps.run import random_routing
from numa_moe.layer.moe_layer import MoELayer
from numa_moe.placement import memory

TINY = (8, 8, 256, 128)  # experts, top_k, hidden, intermediate


def _layer(n_experts: int, hidden: int, inter: int, rng: np.random.Generator, isa=None):
    from numa_moe.placement.segments import SegmentTable
    from numa_moe.placement.topology import Topology, current_topology

    base = current_topology()
    topo = Topology.virtual(1, base) if base.is_virtual or len(base.node_ids) > 1 else base
    gate_up = memory.interleaved_empty((n_experts, 2 * inter, hidden), "bfloat16")
    down = memory.interleaved_empty((n_experts, hidden, inter), "bfloat16")
    fill_bf16(gate_up, rng, hidden ** -0.5)
    fill_bf16(down, rng, inter ** -0.5)
    tables = (SegmentTable.theoretical(n_experts * 2 * inter, hidden, "bf16", 4096, topo.node_ids),
              SegmentTable.theoretical(n_experts * hidden, inter, "bf16", 4096, topo.node_ids))
    return MoELayer.from_stacked(gate_up, down, *tables, topology=topo, isa=isa), gate_up, down


def _median_us(samples) -> float:
    return statistics.median(samples) * 1e6


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def app_rows(name: str, tokens, repeats: int, rng, isa=None) -> list[dict]:
    """Back to back, app-like and torch-alone medians for one model."""
    import torch

    n_experts, top_k, hidden, inter = BENCH_MODELS[name]
    layer, gate_up, down = _layer(n_experts, hidden, inter, rng, isa)
    gate_up_t, down_t = memory.as_torch(gate_up), memory.as_torch(down)
    router = torch.randn(n_experts, hidden, dtype=torch.bfloat16)
    attention = torch.randn(hidden, hidden, dtype=torch.bfloat16) * hidden ** -0.5
    rows = []
    for n_tokens in tokens:
        x = torch.randn(n_tokens, hidden, dtype=torch.bfloat16)
        routings = [tuple(torch.from_numpy(a) for a in random_routing(rng, n_tokens, n_experts, top_k))
                    for _ in range(repeats + 2)]

        def torch_work():
            logits = (x @ attention) @ router.T
            torch.topk(torch.softmax(logits.float(), dim=-1), top_k)

        b2b = [_timed(lambda: layer(x, *routing)) for routing in routings]
        app, torch_in_app = [], []
        for routing in routings:
            torch_in_app.append(_timed(torch_work))
            app.append(_timed(lambda: layer(x, *routing)))
        torch_alone = []
        for ids, _ in routings:
            for e in torch.unique(ids).tolist():
                gate_up_t[e].sum()
                down_t[e].sum()
            torch_alone.append(_timed(torch_work))
        # the first two calls of each loop warm it up
        b2b, app, torch_in_app, torch_alone = (s[2:] for s in (b2b, app, torch_in_app, torch_alone))
        rows.append({"model": name, "tokens": n_tokens, "repeats": repeats,
                     "back_to_back_ms": statistics.median(b2b) * 1e3, "app_ms": statistics.median(app) * 1e3,
                     "torch_in_app_ms": statistics.median(torch_in_app) * 1e3,
                     "torch_alone_ms": statistics.median(torch_alone) * 1e3})
    del layer, gate_up, down, gate_up_t, down_t
    return rows


def hf_block_row(repeats: int, rng) -> dict | None:
    """The HF-patched Qwen3-MoE sparse block at 1 token against the raw layer on the
    block's own routing (None when transformers is not installed)."""
    try:
        import transformers
        from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3
    except ImportError:
        return None
    import torch

    from numa_moe.integrations.hf import patch_moe

    n_experts, top_k, hidden, inter = BENCH_MODELS["qwen3-30b-a3b"]
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=n_experts,
                                         num_experts_per_tok=top_k, norm_topk_prob=True)
    with torch.device("meta"):
        block = qwen3.Qwen3MoeSparseMoeBlock(config)
    block = block.to_empty(device="cpu").to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, hidden ** -0.5)
    (layer,) = patch_moe(block, isa=None)
    with torch.no_grad():
        blocks, raws = [], []
        for i in range(repeats + 2):
            # a fresh token (fresh experts) each time, and the order of the pair swapped
            # every time: the second call of a pair finds part of the first's experts in
            # the cache, which must not favour one side
            x = torch.randn(1, 1, hidden, dtype=torch.bfloat16)
            _, weights, ids = block.gate(x.view(-1, hidden))
            pair = [(blocks, lambda: block(x)), (raws, lambda: layer(x.view(-1, hidden), ids, weights))]
            for samples, call in (pair if i % 2 else pair[::-1]):
                samples.append(_timed(call))
    return {"model": "qwen3-30b-a3b HF block", "tokens": 1, "block_ms": statistics.median(blocks[2:]) * 1e3,
            "raw_layer_ms": statistics.median(raws[2:]) * 1e3}


def overhead_row(rng, calls: int = 2000) -> dict:
    """Median µs of a tiny layer call (torch path, and the native step alone) and of a
    tiny expert_ffn."""
    import ml_dtypes
    import torch

    from numa_moe.layer import kernels

    n_experts, top_k, hidden, inter = TINY
    layer, gate_up, down = _layer(n_experts, hidden, inter, rng)
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    ids = torch.from_numpy(rng.permutation(n_experts)[:top_k].reshape(1, top_k).astype(np.int64))
    weights = torch.softmax(torch.randn(1, top_k), dim=-1)
    x_bits, out = x.view(torch.int16).numpy().view(np.uint16), np.empty((1, hidden), np.uint16)
    wg, wu, wd = (rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in ((inter, hidden), (inter, hidden),
                                                                              (hidden, inter)))
    xe, ye = x.float().numpy().astype(ml_dtypes.bfloat16), np.empty((1, hidden), np.float32)

    def median_us(fn):
        for _ in range(calls // 10):
            fn()
        return _median_us([_timed(fn) for _ in range(calls)])

    row = {"layer_us": median_us(lambda: layer(x, ids, weights)),
           "layer_native_us": median_us(lambda: layer.core.forward(x_bits, ids.numpy(), weights.numpy(), out)),
           "expert_ffn_us": median_us(lambda: kernels.expert_ffn(xe, wg, wu, wd, out=ye)),
           "threads": len(os.sched_getaffinity(0)), "thread_backend": _native.thread_backend()}
    del layer, gate_up, down
    return row


def bench_app(models=("qwen3-30b-a3b", "mixtral-8x7b"), tokens=(1, 4, 16), repeats: int = 20, isa=None,
              seed: int = 0, echo=print) -> dict:
    check_arguments(models, tokens, repeats)
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rng = np.random.default_rng(seed)
    echo(f"threads: {_native.thread_backend()}")
    result = {"app": [], "hf_block": None, "overhead": None}
    for name in models:
        for row in app_rows(name, tokens, repeats, rng, isa):
            result["app"].append(row)
            echo(format_app_row(row))
    result["hf_block"] = hf_block_row(repeats, rng)
    if result["hf_block"]:
        row = result["hf_block"]
        echo(f"{row['model']:>24s} T=1   block {row['block_ms']:8.3f} ms | raw layer {row['raw_layer_ms']:8.3f} ms "
             f"({row['block_ms'] / row['raw_layer_ms']:.2f}x, target <= 1.15)")
    result["overhead"] = row = overhead_row(rng)
    echo(f"tiny layer (8 x 256 x 128, 1 token): {row['layer_us']:.1f} us per call, of which native step "
         f"{row['layer_native_us']:.1f} us (targets <= 50 and <= 30); tiny expert_ffn {row['expert_ffn_us']:.1f} us "
         f"(target <= 30)")
    return result


def format_app_row(row: dict) -> str:
    ratio = row["app_ms"] / row["back_to_back_ms"]
    torch_ratio = row["torch_in_app_ms"] / row["torch_alone_ms"]
    return (f"{row['model']:>24s} T={row['tokens']:<3d} back to back {row['back_to_back_ms']:8.3f} ms | after torch "
            f"work {row['app_ms']:8.3f} ms ({ratio:.2f}x, target <= 1.10) | torch work {row['torch_in_app_ms']:.3f} ms "
            f"beside the layer, {row['torch_alone_ms']:.3f} ms alone ({torch_ratio:.2f}x)")

"""The float64 reference of GQA decode attention (the textbook softmax(q K^T * scale) V,
written independently of the kernels' online-softmax rule)."""

from __future__ import annotations

import numpy as np


def reference_decode(q, k, v, lengths, *, window: int = 0, scale: float | None = None,
                     block_table=None) -> np.ndarray:
    """q [B, Hq, D]; k, v [B, Hkv, T, D] (or paged [n_blocks, Hkv, bs, D] with block_table
    [B, max_blocks]); float64 out [B, Hq, D], zeros for an empty sequence."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out = np.zeros((B, Hq, D))
    for b in range(B):
        length = int(lengths[b])
        start = max(0, length - window) if window else 0
        positions = np.arange(start, length)
        if positions.size == 0:
            continue
        for h in range(Hkv):
            if block_table is None:
                keys, values = k[b, h, positions], v[b, h, positions]
            else:
                bs = k.shape[2]
                blocks = np.asarray(block_table)[b, positions // bs]
                keys, values = k[blocks, h, positions % bs], v[blocks, h, positions % bs]
            for j in range(h * group, (h + 1) * group):
                s = keys @ q[b, j] * scale
                p = np.exp(s - s.max())
                out[b, j] = p @ values / p.sum()
    return out


def error_bound(isa: str, v, out_bf16: bool = False) -> float:
    """Largest admissible |kernel - reference| for values v: ref and avx2 (native or emulated) keep fp32
    softmax and sums (1e-5 of max|v|); avx512 and AMX round each e^(s - m) to bf16 (relative 2^-9) for
    the bf16 P.V product, in numerator and denominator alike, so o moves by at most
    2 * 2^-9 of max|v|; a bf16 output adds its own rounding (2^-9 relative)."""
    vmax = float(np.abs(np.asarray(v, dtype=np.float64)).max()) or 1.0
    bound = (1e-5 if isa in ("ref", "avx2", "avx2_emulated") else 2.0**-8) * vmax
    if out_bf16:
        bound += 2.0**-8 * vmax
    return bound

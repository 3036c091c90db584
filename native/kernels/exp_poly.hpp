// e^x as the vector kernels compute it, written once over the vector type (the pattern of
// llamafile's tinyBLAS): a small struct of wrappers per vector type for the few intrinsics
// (avx512_common.hpp for __m512, attention_avx2.cpp for __m256), this one body for the
// arithmetic. Each ISA's result is what its own intrinsics give for this sequence, so an
// ISA's bits do not change when another's wrappers do.
//
// x is clamped to [Ops::kLowest, 88.7], then x = n ln2 + r with n = round(x / ln2) (ln2 in
// two parts, so that r is exact), |r| <= ln2/2, e^r by its degree-6 Taylor polynomial and
// the result scaled by 2^n (Ops::scale_pow2).
//
// Internal linkage (anonymous namespace) like the wrappers: each ISA translation unit keeps
// its own copy compiled with its own flags.
#pragma once

namespace numa_moe::kernels {
namespace {

template <typename Ops, typename V>
inline V exp_poly(V x) {
    x = Ops::max(Ops::min(x, Ops::set1(88.7f)), Ops::set1(Ops::kLowest));
    const V n = Ops::round(Ops::mul(x, Ops::set1(1.44269504088896341f)));
    V r = Ops::fnmadd(n, Ops::set1(0.693145751953125f), x);
    r = Ops::fnmadd(n, Ops::set1(1.428606765330187045e-06f), r);
    V p = Ops::set1(1.0f / 720.0f);
    p = Ops::fmadd(p, r, Ops::set1(1.0f / 120.0f));
    p = Ops::fmadd(p, r, Ops::set1(1.0f / 24.0f));
    p = Ops::fmadd(p, r, Ops::set1(1.0f / 6.0f));
    p = Ops::fmadd(p, r, Ops::set1(0.5f));
    p = Ops::fmadd(p, r, Ops::set1(1.0f));
    p = Ops::fmadd(p, r, Ops::set1(1.0f));
    return Ops::scale_pow2(p, n);
}

}  // namespace
}  // namespace numa_moe::kernels

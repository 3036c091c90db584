"""The emulated builds (avx2_emulated, avx512_emulated: the AVX2 and AVX-512 kernel sources
over SIMDe) and the rule that picks the ISAs the tests run (kernels.tested_isas). The kernel
test files run the emulated builds against the reference where this CPU lacks the ISA; here,
on a CPU that has it, the emulated build is held to the native one, so that the emulation
itself cannot drift."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from attention_reference import error_bound, reference_decode
from numa_moe import quant
from numa_moe.layer import attention, kernels

BF16 = np.dtype(ml_dtypes.bfloat16)
PAIRS = [("avx2_emulated", "avx2"), ("avx512_emulated", "avx512")]
# Token counts across the kernels' paths: avx512 pairs (1-4; groups of 32 1-3), row lanes
# (5-12, groups of 32 from 4; int4 to 16), token lanes (13 or 17 and more), and a tail of a
# lane block.
TOKEN_COUNTS = [1, 3, 4, 5, 13, 17, 40]


def both_available(emulated: str, native: str, fmt: str = "bf16"):
    available = kernels.available_isas(fmt)
    if native not in available:
        pytest.skip(f"this CPU has no native {native} kernels for {fmt} to compare with")
    if emulated not in available:
        pytest.skip(f"{emulated} is not built (NUMA_MOE_TEST_HOOKS) or not runnable here")


def test_tested_isas_replaces_only_missing_isas_by_their_emulated_build():
    full = ("ref", "avx2_emulated", "avx2", "avx512_emulated", "avx512", "amx_model", "amx")
    assert kernels.tested_isas(available=full) == ("ref", "avx2", "avx512", "amx_model", "amx")
    no_avx512 = ("ref", "avx2_emulated", "avx2", "avx512_emulated", "amx_model")
    assert kernels.tested_isas(available=no_avx512) == ("ref", "avx2", "avx512_emulated", "amx_model")
    no_avx2 = ("ref", "avx2_emulated")
    assert kernels.tested_isas(available=no_avx2) == ("ref", "avx2_emulated")


def test_tested_isas_of_this_machine():
    for fmt in ("bf16", "int8", "int4", "mxfp4", "iq4nl"):
        available = kernels.available_isas(fmt)
        tested = kernels.tested_isas(fmt)
        assert set(tested) <= set(available) and tested[0] == "ref"
        for emulated, native in PAIRS:
            if emulated in available:
                assert (emulated in tested) == (native not in available), (fmt, tested)
    assert set(attention.tested_isas()) <= set(attention.available_isas())


def test_emulated_isas_are_never_a_default():
    for fmt in ("bf16", "int8", "int4", "mxfp4", "iq4nl"):
        assert kernels.fastest_isa(fmt) not in kernels.EMULATED_ISAS
        for m in (1, 64):
            assert kernels.isa_for_tokens(m, fmt) not in kernels.EMULATED_ISAS


# Kernels with a second build by CPU feature: the testing hook that names an ISA's build,
# the native and emulated ISA, the format whose table is looked at, the feature, the build
# with it and without it, and the build the emulated ISA runs where the native ISA is missing.
SECOND_BUILDS = [
    *(("avx2_integer_build", "avx2", "avx2_emulated", fmt, "avx_vnni", ("avx_vnni", "maddubs"), "maddubs")
      for fmt in ("int8", "iq4nl")),
    *(("avx512_codebook_build", "avx512", "avx512_emulated", fmt, "avx512_vbmi", ("vpermb", "vpshufb"), "vpermb")
      for fmt in ("mxfp4", "iq4nl")),
]


@pytest.mark.parametrize(("hook", "native", "emulated", "fmt", "feature", "builds", "alone"), SECOND_BUILDS,
                         ids=[f"{b[0]}-{b[3]}" for b in SECOND_BUILDS])
def test_both_builds_of_a_kernel_are_tested(hook, native, emulated, fmt, feature, builds, alone):
    """The AVX2 integer kernels (vpmaddubsw, AVX-VNNI's vpdpbusd; iq4nl's sign trick is a
    path of the first alone) and avx512's codebook tables (vpshufb, VBMI's vpermb) have two
    builds each; the native ISA runs the one this CPU has, the emulated ISA the other, so
    that the bit-for-bit comparison below covers both (the emulated ISA runs `alone` where
    the native ISA is missing)."""
    from numa_moe import _native

    build_of = lambda isa: getattr(_native.testing, hook)(isa, fmt)  # noqa: E731
    build = {isa: build_of(isa) for isa in (native, emulated)}
    if emulated not in kernels.available_isas(fmt):
        pytest.skip(f"{emulated} is not built (NUMA_MOE_TEST_HOOKS) or not runnable here")
    assert build[emulated] in builds
    if native in kernels.available_isas(fmt):
        with_feature, without = builds
        assert build[native] == (with_feature if _native.cpu_features()[feature] else without)
        assert {build[native], build[emulated]} == set(builds)
    else:
        assert build[emulated] == alone
    # the other ISA's tables have one build
    assert build_of("avx512" if native == "avx2" else "avx2") == ""


@pytest.mark.parametrize(("emulated", "native"), PAIRS)
@pytest.mark.parametrize("fmt", ["int8", "int4", "mxfp4", "iq4nl"])
@pytest.mark.parametrize("m", TOKEN_COUNTS)
def test_integer_emulated_build_equals_native_bit_for_bit(rng, emulated, native, fmt, m):
    both_available(emulated, native, fmt)
    rows, cols, group = 48, 384, int(rng.choice(quant.groups_for(fmt)))
    w = rng.standard_normal((rows, cols)).astype(np.float32) * cols**-0.5
    qm = quant.quantize(w, fmt, group, str(rng.choice(sorted(quant.scale_dtypes_for(fmt)))))
    x = rng.standard_normal((m, cols)).astype(BF16)
    # a segment with a row stride and columns inside the rows, one with odd rows
    segments = np.array([[0, 2, 20, group, cols], [1, 1, 7, 0, 2 * group]], np.int64)
    outs = {}
    for isa in (emulated, native):
        outs[isa] = np.zeros((rows, m), np.float32)
        kernels.matmul_segments(qm, segments, x, outs[isa], isa=isa)
    np.testing.assert_array_equal(outs[emulated], outs[native])
    assert np.abs(outs[native]).max() > 0

    inter, hidden = 2 * group, 3 * group
    qms = [quant.quantize(rng.standard_normal(shape).astype(np.float32) * shape[1] ** -0.5, fmt, group)
           for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    xs = rng.standard_normal((m + 3, hidden)).astype(BF16)
    index = rng.permutation(m + 3)[:m]
    ffn = {}
    for isa in (emulated, native):
        ffn[isa] = np.full((m, hidden), np.nan, np.float32)
        kernels.expert_ffn(xs, *qms, token_index=index, out=ffn[isa], isa=isa)
    np.testing.assert_array_equal(ffn[emulated], ffn[native])


@pytest.mark.parametrize(("emulated", "native"), PAIRS)
@pytest.mark.parametrize("m", TOKEN_COUNTS)
def test_bf16_emulated_build_matches_the_reference_and_native(rng, emulated, native, m):
    both_available(emulated, native)
    rows, cols = 40, 200  # a k tail on every path
    w = rng.standard_normal((rows, cols)).astype(BF16)
    x = rng.standard_normal((m, cols)).astype(BF16)
    segments = np.array([[0, 1, rows, 0, cols]], np.int64)
    expected = w.astype(np.float64) @ x.astype(np.float64).T
    outs = {}
    for isa in (emulated, native):
        outs[isa] = np.zeros((rows, m), np.float32)
        kernels.matmul_segments(w, segments, x, outs[isa], isa=isa)
    scale = np.abs(expected).max()
    for isa, out in outs.items():
        assert np.abs(out - expected).max() / scale < 1e-5, isa
    # the same operations in the same order; only avx2_emulated's unfused multiply-add
    # (baseline flags) rounds differently
    if emulated == "avx512_emulated":
        np.testing.assert_array_equal(outs[emulated], outs[native])


@pytest.mark.parametrize(("emulated", "native"), PAIRS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_emulated_build_matches_native(rng, emulated, native, head_dim):
    if native not in attention.available_isas() or emulated not in attention.available_isas():
        pytest.skip(f"needs both {native} and {emulated} attention kernels")
    batch, q_heads, kv_heads, capacity = 2, 8, 2, 300
    q = rng.standard_normal((batch, q_heads, head_dim)).astype(BF16)
    k = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(BF16)
    v = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(BF16)
    lengths = [capacity, 37]
    expected = reference_decode(q, k, v, lengths)
    outs = {isa: attention.gqa_decode(q, k, v, lengths, isa=isa, out_dtype=np.float32) for isa in (emulated, native)}
    for isa, out in outs.items():
        assert np.abs(out - expected).max() <= error_bound(isa, v), isa
    if emulated == "avx512_emulated":  # as for bf16 matmul: the same roundings in the same order
        np.testing.assert_array_equal(outs[emulated], outs[native])


def run_hidden(hide: str, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMA_MOE_TEST_HIDE_ISA": hide}
    env.pop("NUMA_MOE_ISA", None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_hiding_an_isa_makes_the_tests_run_its_emulated_build():
    if "avx512_emulated" not in kernels.available_isas():
        pytest.skip("no avx512_emulated build here")
    code = ("from numa_moe.layer import attention, kernels\n"
            "print((kernels.available_isas(), kernels.tested_isas('int8'), attention.tested_isas(),"
            " kernels.fastest_isa()))")
    result = run_hidden("avx512", code)
    assert result.returncode == 0, result.stderr
    available, tested, attention_tested, fastest = ast.literal_eval(result.stdout)
    assert "avx512" not in available and "amx" not in available and "avx512_emulated" in available
    assert "avx512_emulated" in tested and "avx512_emulated" in attention_tested
    assert fastest == ("avx2" if "avx2" in kernels.available_isas() else "ref")
    result = run_hidden("avx2", code)
    assert result.returncode == 0, result.stderr
    available, tested, attention_tested, fastest = ast.literal_eval(result.stdout)
    assert tested == ("ref", "avx2_emulated") == attention_tested and fastest == "ref"


def test_hiding_an_unknown_isa_is_an_error():
    result = run_hidden("avx512,sse9", "from numa_moe.layer import kernels\nprint(kernels.available_isas())")
    assert result.returncode != 0
    assert "NUMA_MOE_TEST_HIDE_ISA: 'sse9' is not one of avx2, avx512, amx" in result.stderr

import signal

import numpy as np
import pytest


def isa_report(isas) -> str:
    """`isas` (kernels.tested_isas) as the kernel families they test, natively or emulated."""
    from numa_moe.layer import kernels

    words = []
    for isa in isas:
        if isa not in kernels.EMULATED_ISAS:
            words.append(f"{isa} native")
        elif (family_how := kernels.EMULATED_ISAS[isa])[0] in isas:
            words.append(f"{isa} ({family_how[1]})")
        else:
            words.append(f"{family_how[0]} emulated ({family_how[1]})")
    return ", ".join(words)


def pytest_sessionstart(session):
    """Which ISAs the kernel tests run here, natively or emulated: an AVX-512 change tested on
    an AVX2 machine says so in the log. Written at the start of every run, -q included
    (pytest's report header is hidden there)."""
    from numa_moe.layer import kernels

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    integer = ("int8", "int4", "mxfp4", "iq4nl")
    lines = {fmt: isa_report(kernels.tested_isas(fmt)) for fmt in ("bf16", *integer)}
    reporter.write_line(f"ISAs: {lines['bf16']}")
    if any(lines[fmt] != lines["bf16"] for fmt in integer):
        for fmt in integer:
            reporter.write_line(f"ISAs ({fmt}): {lines[fmt]}")
    from numa_moe import _native

    builds = [f"{isa} {build}" for isa in ("avx2", "avx2_emulated")
              if (build := _native.testing.avx2_integer_build(isa)) and isa in kernels.available_isas("int8")]
    reporter.write_line(f"AVX2 integer builds (vpmaddubsw, AVX-VNNI): {', '.join(builds) or 'none'}")
    lookups = [f"{isa} {build}" for isa in ("avx512", "avx512_emulated")
               if (build := _native.testing.avx512_codebook_build(isa)) and isa in kernels.available_isas("mxfp4")]
    reporter.write_line(f"AVX-512 mxfp4 / iq4nl lookups (vpshufb, VBMI vpermb): {', '.join(lookups) or 'none'}")


@pytest.fixture
def rng(request):
    """A fresh, reported seed per test: data is random but a failure can be replayed."""
    seed = np.random.SeedSequence().entropy % (2**32)
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt during the test, as in a terminal, even when pytest
    was started with SIGINT ignored (a shell's background job inherits SIG_IGN)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)

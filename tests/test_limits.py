"""Absurd sizes and counts at the CLI and the package API: one line that says the limit
and why, no traceback, and for sizes an estimate of the memory needed against what the
machine has available, made before anything is allocated (so in well under a second)."""

from __future__ import annotations

import importlib
import math
import time

import ml_dtypes
import psutil
import pytest
from click.testing import CliRunner

from numa_moe import quant
from numa_moe.placement import memory
from numa_moe.apps.benchmarking import native_loops
from numa_moe.checkpoints.synthetic import make_checkpoint
from numa_moe_cli.main import cli

HUGE = str(10**12)
SIMULATE = ["simulate", "--like", "qwen3-30b-a3b", "--machine", "xeon-6430"]

# Modules the commands import lazily, imported here so that the time measured is the
# command's own, not the first import of torch or transformers.
_MODULES = ("numa_moe.apps.generate", "numa_moe.apps.simulate", "numa_moe.apps.run", "numa_moe.apps.benchmarking.kernels",
            "numa_moe.apps.benchmarking.attention", "numa_moe.apps.benchmarking.layer", "numa_moe.apps.benchmarking.app")


@pytest.fixture(scope="module")
def warm():
    for name in _MODULES:
        importlib.import_module(name)


def _one_line_error(args, *needles):
    """Runs the CLI; asserts a non-zero exit with exactly one 'Error:' line holding every
    needle and no traceback; returns (that line, seconds the command took)."""
    start = time.perf_counter()
    result = CliRunner().invoke(cli, args)
    seconds = time.perf_counter() - start
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # not a crash
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0], seconds


def _memory_error(args, what):
    """A refusal by memory.check_fits: says what needs how much, and what is available."""
    line, seconds = _one_line_error(args, what, "GiB of memory", "GiB available")
    needed = float(line.split("needs about ")[1].split(" GiB")[0].replace(",", ""))
    assert needed * 2**30 > psutil.virtual_memory().available
    # loose: the work it prevents would take minutes or exhaust memory; a loaded CI machine
    # must not trip it
    assert seconds < 5, f"took {seconds:.2f} s: the estimate must come before the work"


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ck") / "small", "qwen3-30b-a3b", 1, 2, 0, hidden_size=64,
                           intermediate_size=32, progress=False)


# ------------------------------------------------------------------ memory estimates

@pytest.mark.parametrize("args, what", [
    (["generate", "--vocab", HUGE], "vocabulary 1000000000000"),
    (["generate", "--layers", str(10**9)], "1000000000-layer"),
    (["generate", "--prompt", "20000", "--vocab", str(10**8)], "20000-token prompt"),
    ([*SIMULATE, "--tokens", HUGE], "draws of 1000000000000 tokens"),
    ([*SIMULATE, "--samples", HUGE], "1000000000000 draws"),
    (["bench", "kernels", "--m", str(10**9)], "at 1000000000 tokens"),
    (["bench", "attention", "-T", HUGE], "context 1000000000000"),
    (["bench", "attention", "-b", HUGE], "batch 1000000000000"),
    (["bench", "layer", "-t", str(10**9)], "at 1000000000 tokens"),
    (["bench", "layer", "--app", "-t", str(10**9)], "at 1000000000 tokens"),
])
def test_sizes_beyond_memory_are_refused_before_allocating(warm, args, what):
    _memory_error(args, what)


def test_run_tokens_beyond_memory(warm, small_checkpoint):
    _memory_error(["run", str(small_checkpoint), "--tokens", str(10**15)], "a step of 1000000000000000 tokens")


def test_check_fits_says_both_figures():
    available = psutil.virtual_memory().available
    memory.check_fits(0, "nothing")
    with pytest.raises(ValueError, match=r"^a test needs about [\d,]+\.\d GiB of memory; this machine has "
                                         r"[\d,.]+ GiB available$"):
        memory.check_fits(available + 2**40, "a test")


# ------------------------------------------------------------------ counts with limits

def test_bench_kernels_threads_name_the_option_and_its_range(warm):
    cpus = native_loops.affinity_cpu_count()
    for threads in ("-1", "-3", str(cpus + 1), "100000"):
        _one_line_error(["bench", "kernels", "--threads", threads], "threads must be in 1..", f"{cpus}",
                        f"got {threads}")


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e9"])
def test_bench_kernels_min_seconds_is_finite_and_bounded(warm, value):
    _one_line_error(["bench", "kernels", "--min-seconds", value], "min_seconds must be a finite number",
                    "0..3600")


@pytest.mark.parametrize("args, needles", [
    (["bench", "kernels", "--repeats", "0"], ("repeats must be an integer >= 1",)),
    (["bench", "layer", "--virtual-nodes", "2000"], ("virtual_nodes must be in 2..1024", "got 2000")),
    (["bench", "layer", "--virtual-nodes", "1"], ("virtual_nodes must be in 2..1024", "got 1")),
    (["run", "--virtual-nodes", "2000"], ("virtual_nodes must be in 1..1024", "got 2000")),
    (["generate", "--experts", str(10**9)], ("experts must be in 1..128", "real model's count")),
    (["generate", "--prompt", str(10**9)], ("at most 32768", "max_position_embeddings")),
    ([*SIMULATE, "--routing", "zipf", "--zipf-s", "inf"], ("zipf_s must be a finite number >= 0",)),
    ([*SIMULATE, "--seed", "-1"], ("seed must be an integer >= 0",)),
])
def test_counts_beyond_their_limit_say_it(warm, args, needles):
    _one_line_error(args, *needles)


def test_run_seed_names_the_argument(warm, small_checkpoint):
    _one_line_error(["run", str(small_checkpoint), "--seed", "-1"], "seed must be an integer >= 0")


def test_kernel_benchmark_api_raises_value_errors():
    from numa_moe.apps.benchmarking import kernels as kernel_bench

    for kwargs, needle in ((dict(threads=-1), "threads must be in 1.."), (dict(min_seconds=math.inf), "min_seconds"),
                           (dict(m_values=(10**9,)), "GiB of memory"), (dict(repeats=0), "repeats")):
        with pytest.raises(ValueError, match=needle):
            kernel_bench.run(shapes=["qwen3-30b-a3b"], with_torch=False, progress=lambda line: None, **kwargs)


# ------------------------------------------------------------------ quantization arguments

def _stacked(rng, experts=2, inter=64, hidden=128):
    gate_up = (rng.standard_normal((experts, 2 * inter, hidden)) * 0.1).astype(ml_dtypes.bfloat16)
    down = (rng.standard_normal((experts, hidden, inter)) * 0.1).astype(ml_dtypes.bfloat16)
    return gate_up, down


@pytest.mark.parametrize("kwargs, message", [
    (dict(weight_format="int8", group=0), "group 0 is not one of 32, 64, 128"),
    (dict(weight_format="int8", scale_dtype="fp8"), "scale_dtype 'fp8' is not one of fp16, bf16, fp32"),
    (dict(weight_format="int8", scale_dtype=3), "scale_dtype 3 is not one of fp16, bf16, fp32"),
    (dict(weight_format="mxfp4", group=64), r"weight_format 'mxfp4' takes group 32 only \(group 32, e8m0 scales\)"),
    (dict(weight_format="mxfp4", scale_dtype="bf16"), "weight_format 'mxfp4' takes scale_dtype 'e8m0' only"),
    (dict(weight_format="int4", scale_dtype="e8m0"), "scale_dtype 'e8m0' belongs to weight_format 'mxfp4' only"),
])
def test_from_tensors_names_the_bad_quantization_argument(rng, kwargs, message):
    from numa_moe.layer.moe_layer import MoELayer
    from numa_moe.placement.topology import Topology

    gate_up, down = _stacked(rng)
    with pytest.raises(ValueError, match=message):
        MoELayer.from_tensors(gate_up, down, topology=Topology.virtual(1), tables="theoretical", **kwargs)


def test_store_names_the_bad_scale_dtype(small_checkpoint):
    from numa_moe.layer.store import ExpertStore

    with pytest.raises(ValueError, match="scale_dtype 'fp8' is not one of fp16, bf16, fp32"):
        ExpertStore.load(small_checkpoint, nodes=1, progress=False, weight_format="int8", scale_dtype="fp8")


def test_quantize_and_the_layer_refuse_alike(rng):
    """One check behind both: the same message for the same bad group."""
    from numa_moe.layer.moe_layer import MoELayer
    from numa_moe.placement.topology import Topology

    gate_up, down = _stacked(rng)
    messages = []
    for call in (lambda: quant.quantize(gate_up[0], "int8", group=96),
                 lambda: MoELayer.from_tensors(gate_up, down, topology=Topology.virtual(1), tables="theoretical",
                                               weight_format="int8", group=96)):
        with pytest.raises(ValueError) as info:
            call()
        messages.append(str(info.value))
    assert messages[0] == messages[1] == "group 96 is not one of 32, 64, 128"
    with pytest.raises(ValueError, match="weight_format 'int3' is not one of int8, int4"):
        quant.quantize(gate_up[0], "int3")
    with pytest.raises(ValueError, match="weight_format 'int3' is not one of bf16, int8, int4"):
        MoELayer.from_tensors(gate_up, down, topology=Topology.virtual(1), weight_format="int3")


# ------------------------------------------------------------------ make-checkpoint

def test_make_checkpoint_layers_are_at_most_the_real_count(tmp_path):
    _one_line_error(["make-checkpoint", "--layers", str(10**9), "-o", str(tmp_path / "ck")],
                    "layers must be in 1..48 for qwen3-30b-a3b", "real model's count")
    assert not (tmp_path / "ck").exists()


def test_make_checkpoint_beyond_the_free_disk_is_refused_before_writing(tmp_path):
    import shutil

    out = tmp_path / "ck"
    # DeepSeek-V3's 61 layers x 256 experts: ~1.3 TiB of BF16 experts, twice that with int8
    if shutil.disk_usage(tmp_path).free > 3 * 2**40:
        pytest.skip("this file system has room for it")
    line, seconds = _one_line_error(["make-checkpoint", "--like", "deepseek-v3", "--layers", "61", "--experts",
                                     "256", "--format", "int8", "--quiet", "-o", str(out)],
                                    "GiB of disk", "GiB free")
    assert seconds < 5 and not out.exists() and list(tmp_path.iterdir()) == []

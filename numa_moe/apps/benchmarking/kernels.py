"""Expert-FFN kernel benchmark: our kernel vs torch ``F.linear`` (bf16, same thread count)
vs a streaming read of the same weight bytes (the in-run bandwidth ceiling), plus the
measured register-only peak of the ISA that ran (vdpbf16ps for avx512; see
native_loops.PEAK_INSTRUCTIONS) for the compute-bound rows. Without an ISA given, each
token count runs the ISA the MoE layer would run an expert of that many tokens with
(kernels.isa_for_tokens: for the integer formats VNNI below the AMX crossover).

Weights rotate over enough expert copies that they are not in cache (>= 4x L3, at least
2 copies); every time is a median over repetitions, all in one run so that they share
the machine's state. The read ceiling is measured interleaved with our kernel
(repetition r: one kernel call on expert copy 2r, then a streaming read of copy 2r+1, on
the same worker pool, so both pay the same dispatch cost): the machine's DRAM bandwidth is
shared with other VMs and drifts between runs minutes apart. The ceiling of a point is
its fastest read (yardsticks.Yardstick: a neighbour can only slow a read down), the
fraction of it is that read's time over the kernel's median. A fraction above 1 is
marked as a measurement problem; a ceiling that moves more than 20% between the points
of one shape, or a peak that moves as much between the start and the end of the run,
gives a warning that the machine is busy.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from numa_moe import quant
from numa_moe.apps.benchmarking import native_loops
from numa_moe.apps.benchmarking.yardsticks import (
    MEASUREMENT_NOTE,
    Yardstick,
    busy_warning,
    is_measurement_problem,
    l3_bytes,
    ratio_cell,
)
from numa_moe.formats import FIXED_GROUPS, FIXED_SCALE_DTYPES, QUANT_FORMATS, SCALE_DTYPES, scale_columns
from numa_moe.layer import kernels
from numa_moe.placement import memory
from numa_moe.placement.pages import page_name

# Routed-expert shapes (hidden H, intermediate I) from the models' published configs.
SHAPES: dict[str, tuple[int, int]] = {
    "mixtral-8x7b": (4096, 14336),
    "qwen3-30b-a3b": (2048, 768),
    "deepseek-v3": (7168, 2048),
    "qwen3-235b": (4096, 1536),
    "gpt-oss": (2880, 2880),  # 20b and 120b alike
}
M_VALUES = (1, 2, 4, 8, 16, 32, 128)
ROTATION_TARGET_FACTOR = 4        # rotate over >= 4x the L3 size of weights
MAX_ROTATION_BYTES = 3 * 1024**3  # ... but never allocate more than this
AUTO_ISA = "auto"  # Result.isa when no ISA was given: each M runs kernels.isa_for_tokens(M)


@dataclass
class Row:
    shape: str
    hidden: int
    intermediate: int
    m: int
    isa: str
    threads: int
    weight_bytes: int
    flops: float
    ours_ms: float        # median
    read_ms: float        # the fastest read: the ceiling
    torch_ms: float | None
    ours_gb_s: float = 0.0
    read_gb_s: float = 0.0
    fraction_of_read: float = 0.0
    gflop_s: float = 0.0
    fraction_of_peak: float | None = None  # None: no peak loop for this ISA
    # roofline time / ours: roofline = max(bytes / in-run read ceiling, flops / in-run
    # peak of the ISA that ran); without a peak loop the memory time alone
    fraction_of_roofline: float = 0.0
    speedup_vs_torch: float | None = None
    # The issue's target metric for this M: read fraction (M <= 8), fraction of
    # max(memory time, compute time) (M = 16), fraction of peak (M >= 128); M = 32 has
    # its metric shown but no target (target 0.0).
    target_metric: str = ""
    target_value: float | None = 0.0
    target: float = 0.0
    repetitions: int = 0  # timed (kernel, read) pairs behind the medians
    read_median_ms: float = 0.0
    read_spread: float = 0.0  # how far the slowest window's fastest read fell below the fastest
    measurement_problem: bool = False  # a fraction of a ceiling or peak above 1


@dataclass
class Result:
    isa: str  # the ISA asked for, or AUTO_ISA: each M the layer's choice (Row.isa)
    threads: int
    repeats: int
    page: str
    min_seconds: float
    # Per ISA that ran: its peak (None: no peak loop for it) and the loop's instruction.
    peaks_gflop_s: dict[str, float | None]
    l3_bytes: int
    rows: list[Row] = field(default_factory=list)
    torch_version: str | None = None
    peak_instructions: dict[str, str | None] = field(default_factory=dict)
    peaks_end_gflop_s: dict[str, float] = field(default_factory=dict)  # measured again after the last point
    # The rows scored again against the best of the start and end peaks, when the end one
    # was higher (a neighbour slowed the start measurement; a low peak flatters fractions).
    rescored_rows: list[Row] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    weight_format: str = "bf16"
    group: int | None = None  # of the integer formats


def random_bf16_bits(rng: np.random.Generator, shape) -> np.ndarray:
    """Finite random bf16 bit patterns (|v| in [2^-7, 2^-5), never zero), cheap to make in bulk."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return (bits & np.uint16(0x80FF)) | np.uint16(0x3C00)


def measure_peak_gflop_s(isa: str, threads: int, seconds: float = 0.1, tries: int = 5,
                        weight_format: str = "bf16") -> Yardstick | None:
    """The register-only peak of `isa` (native_loops.peak_instruction: the instruction its
    kernels for `weight_format` multiply with; int8 operations for integer formats) on
    `threads` threads: a Yardstick over `tries` runs of about `seconds` each, whose best is
    the peak. Another process on the cores can only lower a run (one disturbed 0.2 s run
    read 425 instead of 465 GFLOP/s), and a low peak would flatter every fraction of it.
    None for an ISA without a peak loop."""
    if native_loops.peak_instruction(isa, weight_format) is None:
        return None
    iterations = 1000
    while True:
        start = time.perf_counter()
        flops = native_loops.peak_flops(isa, iterations, threads, weight_format)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
        iterations *= max(2, int(seconds / max(elapsed, 1e-6)))
    rates = [flops / elapsed / 1e9]
    for _ in range(tries - 1):
        start = time.perf_counter()
        flops = native_loops.peak_flops(isa, iterations, threads, weight_format)
        rates.append(flops / (time.perf_counter() - start) / 1e9)
    return Yardstick.from_samples(rates)


def random_weights(rng: np.random.Generator, shape, page: str) -> np.ndarray:
    """Random bf16 bits (uint16) on a fresh mapping with `page`-sized pages, interleaved over
    the nodes this process may use (memory.interleaved_empty), as the layer's weights are.

    The page size is chosen here, not left to numpy: numpy asks for huge pages on arrays of
    4 MiB and more only, so Qwen3-30B-A3B's 3 MiB matrices would stream from 4 KB pages and
    the larger shapes from 2 MiB pages, and the page size alone moves the read ceiling and
    the kernel time (measured in docs/benchmarks.md)."""
    weights = memory.interleaved_empty(shape, np.uint16, page=page)
    weights[...] = random_bf16_bits(rng, shape)
    return weights


def _on_pages(array: np.ndarray, page: str) -> np.ndarray:
    copy = memory.interleaved_empty(array.shape, array.dtype, page=page)
    copy[...] = array
    return copy


def format_scales(weight_format: str, group: int) -> tuple[int, str]:
    """(group, scale dtype) the benchmark quantizes a format with: fp16 scales of `group`
    columns, or the format's own (mxfp4: e8m0 per 32; iq4nl: per 32)."""
    return FIXED_GROUPS.get(weight_format, group), FIXED_SCALE_DTYPES.get(weight_format, "fp16")


def expert_bytes_read(hidden: int, inter: int, weight_format: str = "bf16", group: int = 128) -> int:
    """Bytes one call of an expert streams: its three matrices and, for the integer
    formats, their scales (expert_copies' layout)."""
    elements = 3 * hidden * inter
    if weight_format == "bf16":
        return 2 * elements
    per_weight = 1 if weight_format == "int8" else 0.5
    group, scale_dtype = format_scales(weight_format, group)
    return int(elements * per_weight) + elements // group * scale_columns(weight_format, group, group) * \
        SCALE_DTYPES[scale_dtype].itemsize


def expert_copies(rng: np.random.Generator, hidden: int, inter: int, copies: int, page: str,
                  weight_format: str = "bf16", group: int = 128) -> list[tuple[np.ndarray, ...]]:
    """`copies` experts for the native loops, each array on its own page-interleaved
    mapping: (w_gate, w_up, w_down) as bf16 bits, or for int8 / int4 their values
    (numa_moe.quant layout) followed by their three scale arrays. The integer copies
    repeat one quantized random expert: the values do not change the speed."""
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    if weight_format == "bf16":
        return [tuple(random_weights(rng, shape, page) for shape in shapes) for _ in range(copies)]
    group, scale_dtype = format_scales(weight_format, group)
    templates = [quant.quantize(rng.standard_normal(shape, dtype=np.float32), weight_format, group, scale_dtype)
                 for shape in shapes]
    return [tuple(_on_pages(t.q, page) for t in templates) + tuple(_on_pages(t.scales, page) for t in templates)
            for _ in range(copies)]


def torch_experts(experts, weight_format: str, group: int) -> list[tuple]:
    """The same experts for PyTorch's own CPU kernels, packed outside any timing: bf16
    tensors for F.linear; for int8 the values with one scale per row for
    aten._weight_int8pack_mm (it has no groups); for int4 the values repacked by
    aten._convert_weight_to_int4pack_for_cpu with (scale, zero) per group for
    aten._weight_int4pack_mm_for_cpu. The integer copies repeat one expert
    (expert_copies), so it is packed once and cloned: each copy still has memory of its
    own to stream."""
    import torch

    if weight_format == "bf16":
        return [tuple(torch.from_numpy(w.view(np.int16)).view(torch.bfloat16) for w in expert) for expert in experts]
    packed = []
    for i in range(3):
        values, scales = experts[0][i], torch.from_numpy(experts[0][3 + i].astype(np.float32)).to(torch.bfloat16)
        if weight_format == "int8":
            packed.append((torch.from_numpy(values), scales.mean(dim=1).contiguous()))
            continue
        unsigned = torch.from_numpy(quant.unpack_int4(values).astype(np.int32) + 8)
        scale_zero = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).contiguous()
        packed.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1), scale_zero))
    return [tuple((w.clone(), s) for w, s in packed) for _ in experts]


def _torch_linear(x_t, matrix, weight_format: str, group: int):
    import torch
    import torch.nn.functional as F

    if weight_format == "bf16":
        return F.linear(x_t, matrix)
    if weight_format == "int8":
        return torch.ops.aten._weight_int8pack_mm(x_t, *matrix)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x_t, matrix[0], group, matrix[1])


def _torch_ffn_times(experts_t, x_t, repeats: int, threads: int, weight_format: str = "bf16",
                     group: int = 128) -> list[float]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    linear = lambda x, w: _torch_linear(x, w, weight_format, group)  # noqa: E731
    times = []
    with torch.inference_mode():
        for r in range(repeats):
            wg, wu, wd = experts_t[r % len(experts_t)]
            start = time.perf_counter()
            linear(F.silu(linear(x_t, wg)) * linear(x_t, wu), wd)
            times.append(time.perf_counter() - start)
    return times


def repetitions(repeats: int, copies: int, pair_seconds: float, min_seconds: float) -> int:
    """Timed (kernel, read) pairs for one point: at least `repeats`, one pass over the
    `copies`, and enough pairs to span `min_seconds`. A small expert's 20 calls last a few
    ms, so one disturbance from another VM could move their median (Qwen3-30B-A3B at M = 16
    read 0.45-0.87 of its target over five such runs); spread over a quarter of a second,
    the median outlasts it."""
    by_time = math.ceil(min_seconds / pair_seconds) if pair_seconds > 0 else 0
    return max(repeats, copies, by_time)


def run(shapes=None, m_values=M_VALUES, repeats: int = 20, threads: int | None = None, isa: str | None = None,
        with_torch: bool = True, seed: int = 0, page: str = "2m", min_seconds: float = 0.25,
        progress=print, table=None, weight_format: str = "bf16", group: int = 128) -> Result:
    """Runs the benchmark; returns a Result (see format_table / to_json). `page`: "2m" or
    "4k", the page size of the weight copies (random_weights). Each point times
    `repetitions(repeats, copies, ..., min_seconds)` kernel calls. `progress` gets status
    lines; `table`, when given, gets the lines of format_table as they become known
    (header, then each row, then the footer), so that a caller can print the table once
    while it fills. weight_format "int8" / "int4" runs quantized experts (group `group`,
    fp16 scales; the bytes read count the scales) against PyTorch's own low-bit kernels;
    "mxfp4" its own e8m0 scales per 32 columns and "iq4nl" fp16 ones per 32, without torch
    (it has no CPU kernel for their codebooks)."""
    if weight_format in FIXED_GROUPS:
        group = FIXED_GROUPS[weight_format]
        if with_torch:
            progress(f"torch has no CPU kernel for {weight_format} weights: no torch column")
            with_torch = False
    shapes, page, isa = _checked_arguments(shapes, page, min_seconds, isa, weight_format, group, repeats)
    threads = _checked_threads(threads)
    _check_memory(shapes, m_values, weight_format, group, with_torch)
    table = table or (lambda line: None)
    torch_version = None
    if with_torch:
        import torch

        torch_version = torch.__version__
    isa_of = (lambda m: isa) if isa != AUTO_ISA else (lambda m: kernels.isa_for_tokens(m, weight_format, group))
    isas = list(dict.fromkeys(isa_of(m) for m in m_values))
    peaks = {name: measure_peak_gflop_s(name, threads, weight_format=weight_format) for name in isas}
    instructions = {name: native_loops.peak_instruction(name, weight_format) if peaks[name] else None
                    for name in isas}
    unit = peak_unit(weight_format)
    peak_text = "; ".join(f"{instructions[name]} peak: {peaks[name].best:.0f} {unit}" if peaks[name]
                          else f"no peak loop for isa {name} and {weight_format}" for name in isas)
    cache = l3_bytes()
    progress(f"{peak_text} on {threads} threads; L3 {cache / 2**20:.0f} MiB; isa {isa_text(isa, m_values, isa_of)}; "
             f"{page} pages; {weight_format} weights")
    result = Result(isa=isa, threads=threads, repeats=repeats, page=page, min_seconds=min_seconds,
                    peaks_gflop_s={name: peaks[name].best if peaks[name] else None for name in isas},
                    l3_bytes=cache, torch_version=torch_version, peak_instructions=instructions,
                    weight_format=weight_format, group=group if weight_format != "bf16" else None)
    for line in table_header(result):
        table(line)
    rng = np.random.default_rng(seed)
    for name in shapes:
        _run_shape(name, result, m_values, rng, with_torch, min_seconds, progress, table, isa_of)
    if with_torch:
        import torch

        torch.set_num_threads(threads)
    for name, peak in peaks.items():
        if not peak:
            continue
        peak_end = measure_peak_gflop_s(name, threads, weight_format=weight_format)
        result.peaks_end_gflop_s[name] = peak_end.best
        warning = busy_warning(f"{instructions[name]} peak", Yardstick.from_windows([peak, peak_end]), unit)
        if warning:
            result.warnings.append(warning)
        if peak_end.best > peak.best:
            result.rescored_rows += [rescore(row, peak_end.best) for row in result.rows if row.isa == name]
    for line in table_footer(result):
        table(line)
    return result


# The longest --min-seconds a point may ask for: an hour per point already makes a
# run of the default 28 points last more than a day.
MAX_MIN_SECONDS = 3600.0


def _checked_arguments(shapes, page, min_seconds, isa, weight_format, group, repeats):
    """(shapes, page, isa), all checked before anything is allocated."""
    shapes = list(SHAPES) if shapes is None else list(shapes)
    for name in shapes:
        if name not in SHAPES:
            raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    page = page_name(page)
    if not 0 <= min_seconds <= MAX_MIN_SECONDS:  # also refuses NaN
        raise ValueError(f"min_seconds must be a finite number of seconds in 0..{MAX_MIN_SECONDS:g}, "
                         f"got {min_seconds!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    quant.check_arguments(weight_format=weight_format, formats=("bf16",) + QUANT_FORMATS)
    if weight_format != "bf16":
        quant.check_arguments(group=group)
    available = kernels.available_isas() if weight_format == "bf16" else kernels.available_isas(weight_format)
    if isa is not None and isa not in kernels.ISAS:
        raise ValueError(f"isa must be one of {', '.join(kernels.ISAS)}, got {isa!r}")
    if isa is not None and isa not in available:
        for_format = "" if weight_format == "bf16" else f" for {weight_format} weights"
        raise ValueError(f"isa {isa!r} is not available on this CPU{for_format} (available: {', '.join(available)})")
    return shapes, page, isa if isa is not None else AUTO_ISA


def _checked_threads(threads: int | None) -> int:
    """The thread count to run with: None or 0 for every CPU this process may run on, else
    at most that many (more threads than CPUs would time the scheduler, not the kernel)."""
    cpus = native_loops.affinity_cpu_count()
    if threads is None or (isinstance(threads, (int, np.integer)) and threads == 0):
        return cpus
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or not 1 <= threads <= cpus:
        raise ValueError(f"threads must be in 1..{cpus} (the CPUs this process may run on), or 0 for all "
                         f"of them; got {threads!r}")
    return threads


def rotation_copies(expert_bytes: int, l3: int) -> int:
    """Expert copies a shape rotates over: >= ROTATION_TARGET_FACTOR x the L3 size, at
    least 2, at most MAX_ROTATION_BYTES of them (unless 2 are more)."""
    copies = max(2, math.ceil(ROTATION_TARGET_FACTOR * l3 / expert_bytes))
    return max(2, min(copies, MAX_ROTATION_BYTES // expert_bytes))


def _check_memory(shapes, m_values, weight_format: str, group: int, with_torch: bool) -> None:
    """Refuses token counts whose experts and activations do not fit in memory
    (memory.check_fits), before anything is allocated."""
    for m in m_values:
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"token counts must be integers >= 1, got {m!r}")
    m = int(max(m_values, default=1))
    cache = l3_bytes()
    for name in shapes:
        hidden, inter = SHAPES[name]
        # the expert copies (and torch's repacked ones), plus per token: x as random uint16
        # bits and its two temporaries, our fp32 output and gate/up sums, torch's bf16
        # copy of x, its gate/up/product and output
        expert_bytes = expert_bytes_read(hidden, inter, weight_format, group)
        weights = rotation_copies(expert_bytes, cache) * expert_bytes * (2 if with_torch else 1)
        per_token = 6 * hidden + 4 * hidden + 8 * inter + (2 * hidden + 6 * inter + 2 * hidden if with_torch else 0)
        memory.check_fits(weights + m * per_token, f"the kernel benchmark of {name} at {m} tokens")


def isa_text(isa: str, m_values, isa_of) -> str:
    """'amx', or for AUTO_ISA which ISA takes which token counts: 'auto (avx512 at M = 1, 2,
    4; amx at M = 8, 16)'."""
    if isa != AUTO_ISA:
        return isa
    by_isa: dict[str, list[int]] = {}
    for m in m_values:
        by_isa.setdefault(isa_of(m), []).append(m)
    return f"{AUTO_ISA} ({'; '.join(f'{name} at M = ' + ', '.join(map(str, ms)) for name, ms in by_isa.items())})"


def _run_shape(name, result: Result, m_values, rng, with_torch, min_seconds, progress, table, isa_of) -> None:
    """Every M of one shape: our kernel against the read of a same-size copy, interleaved
    call by call (see the module docstring), then torch."""
    hidden, inter = SHAPES[name]
    fmt, group, threads = result.weight_format, result.group or 128, result.threads
    expert_bytes = expert_bytes_read(hidden, inter, fmt, group)
    copies = rotation_copies(expert_bytes, result.l3_bytes)
    progress(f"{name}: H={hidden} I={inter}, {expert_bytes / 2**20:.1f} MiB per expert ({fmt}), {copies} copies")
    experts = expert_copies(rng, hidden, inter, copies, result.page, fmt, group)
    experts_t = torch_experts(experts, fmt, group) if with_torch else None
    point_ceilings = []
    for m in m_values:
        x = random_bf16_bits(rng, (m, hidden))
        index = np.arange(m, dtype=np.int64)
        isa = isa_of(m)
        warm_ours, warm_read = native_loops.expert_ffn_vs_read(isa, x, index, experts, threads, copies, fmt)
        reps = repetitions(result.repeats, copies, statistics.median(warm_ours) + statistics.median(warm_read),
                           min_seconds)
        ours, read_s = native_loops.expert_ffn_vs_read(isa, x, index, experts, threads, reps, fmt)
        torch_s = None
        if with_torch:
            import torch

            # a torch-allocated copy: its low-bit kernels assume their own alignment (a
            # numpy buffer made them fault)
            x_t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).clone()
            _torch_ffn_times(experts_t, x_t, copies, threads, fmt, group)
            torch_s = _torch_ffn_times(experts_t, x_t, reps, threads, fmt, group)
        row = make_row(name, hidden, inter, m, isa, threads, expert_bytes, ours, read_s, torch_s,
                       result.peaks_gflop_s[isa], fmt)
        row.repetitions = reps
        result.rows.append(row)
        point_ceilings.append(Yardstick.from_samples([expert_bytes / t / 1e9 for t in read_s]))
        table(format_row(row))
    warning = busy_warning(f"read ceiling of {name}", Yardstick.from_windows(point_ceilings), "GB/s")
    if warning:
        result.warnings.append(warning)


def make_row(name, hidden, inter, m, isa, threads, expert_bytes, ours, read_s, torch_s, peak,
             weight_format: str = "bf16") -> Row:
    """One table row from the samples of one point: `ours` and `read_s` (seconds per
    kernel call and per read), `torch_s` (or None), `peak` in GFLOP/s (or None). The read
    target at M <= 8 is 0.90 for bf16 and 0.85 for the integer formats (their kernels
    also dequantize)."""
    flops = 2.0 * m * hidden * inter * 3
    ours_s, read_best = statistics.median(ours), min(read_s)
    row = Row(shape=name, hidden=hidden, intermediate=inter, m=m, isa=isa, threads=threads,
              weight_bytes=expert_bytes, flops=flops, ours_ms=ours_s * 1e3, read_ms=read_best * 1e3,
              torch_ms=statistics.median(torch_s) * 1e3 if torch_s else None,
              read_median_ms=statistics.median(read_s) * 1e3)
    row.read_spread = Yardstick.from_samples([1.0 / t for t in read_s]).spread
    row.ours_gb_s = expert_bytes / ours_s / 1e9
    row.read_gb_s = expert_bytes / read_best / 1e9
    row.fraction_of_read = read_best / ours_s
    row.gflop_s = flops / ours_s / 1e9
    row.fraction_of_peak = row.gflop_s / peak if peak else None
    if torch_s:
        row.speedup_vs_torch = statistics.median(torch_s) / ours_s
    # without a peak loop the compute time is unknown: the memory time alone stands in
    compute_s = flops / (peak * 1e9) if peak else 0.0
    bound = max(read_best, compute_s) / ours_s
    row.fraction_of_roofline = bound
    if m <= 8:
        row.target_metric, row.target_value = "read", row.fraction_of_read
        row.target = 0.90 if weight_format == "bf16" else 0.85
    elif m <= 16:
        row.target_metric, row.target_value, row.target = "max(mem,compute)", bound, 0.80
    elif m >= 128:
        row.target_metric, row.target_value, row.target = "peak", row.fraction_of_peak, 0.70
    else:
        row.target_metric, row.target_value, row.target = "max(mem,compute)", bound, 0.0
    row.measurement_problem = any(is_measurement_problem(v) for v in (row.fraction_of_read, row.fraction_of_peak,
                                                                        row.fraction_of_roofline, row.target_value))
    return row


def rescore(row: Row, peak: float) -> Row:
    """A copy of `row` with its peak-dependent fractions (peak, roofline, the M >= 16
    targets) against another peak."""
    new = Row(**asdict(row))
    ours_s, read_s = row.ours_ms / 1e3, row.read_ms / 1e3
    new.fraction_of_peak = row.gflop_s / peak
    new.fraction_of_roofline = max(read_s, row.flops / (peak * 1e9)) / ours_s
    if row.target_metric == "peak":
        new.target_value = new.fraction_of_peak
    elif row.target_metric.startswith("max("):
        new.target_value = new.fraction_of_roofline
    new.measurement_problem = any(is_measurement_problem(v) for v in (new.fraction_of_read, new.fraction_of_peak,
                                                                        new.fraction_of_roofline, new.target_value))
    return new


_HEADER = (f"{'shape':<14} {'M':>4} {'isa':>6} {'ours ms':>9} {'GB/s':>6} {'/read':>6} {'GFLOP/s':>8} {'/peak':>6} "
           f"{'/roof':>6} {'read ms':>8} {'torch ms':>9} {'speedup':>8} {'target':>34}")


def target_cell(row: Row) -> str:
    """'read 0.93>=0.90', 'max(mem,compute) 0.23 (no target)' at M = 32, 'peak - (no peak
    loop)' without one; a value above 1 carries the measurement-problem mark."""
    if row.target_value is None:
        return f"{row.target_metric} - (no peak loop)"
    value = ratio_cell(row.target_value, 0)
    if not row.target:
        return f"{row.target_metric} {value} (no target)"
    return f"{row.target_metric} {value}>={row.target:.2f}"


def format_row(row: Row) -> str:
    torch_ms = f"{row.torch_ms:9.3f}" if row.torch_ms is not None else f"{'-':>9}"
    speedup = f"{row.speedup_vs_torch:7.2f}x" if row.speedup_vs_torch is not None else f"{'-':>8}"
    return (f"{row.shape:<14} {row.m:>4} {row.isa:>6} {row.ours_ms:9.3f} {row.ours_gb_s:6.1f} {ratio_cell(row.fraction_of_read)} "
            f"{row.gflop_s:8.1f} {ratio_cell(row.fraction_of_peak)} "
            f"{ratio_cell(row.fraction_of_roofline)} {row.read_ms:8.3f} {torch_ms} {speedup} "
            f"{target_cell(row):>34}")


def peak_unit(weight_format: str) -> str:
    """The integer formats' peaks count int8 operations, as flops are counted."""
    return "GFLOP/s" if weight_format == "bf16" else "GOP/s"


def table_header(result: Result) -> list[str]:
    peak = " ".join(f"peak={value:.0f} {peak_unit(result.weight_format)} ({result.peak_instructions.get(isa)})" if value
                    else f"peak=- (no peak loop for isa {isa})" for isa, value in result.peaks_gflop_s.items())
    weights = result.weight_format + (f" (group {result.group})" if result.group else "")
    isa = result.isa + (" (each M the ISA the MoE layer runs it with)" if result.isa == AUTO_ISA else "")
    return [f"isa={isa} threads={result.threads} repeats={result.repeats} pages={result.page} "
            f"weights={weights} {peak} torch={result.torch_version}",
            "ours ms: median call; read ms: fastest read of a same-size copy, interleaved (the ceiling); "
            "/roof: max(read ms, flops / peak) over ours ms",
            _HEADER]


def table_footer(result: Result) -> list[str]:
    lines = []
    for isa, end in result.peaks_end_gflop_s.items():
        rescored = [row for row in result.rescored_rows if row.isa == isa]
        if not rescored:
            continue
        # indented, so that the table itself stays the one block a reader (or a script) finds
        lines.append(f"against the best peak of the run, the end one ({isa}: {end:.0f} {peak_unit(result.weight_format)}, start "
                     f"{result.peaks_gflop_s[isa]:.0f}):")
        lines += [f"  {row.shape} M={row.m}: /peak {ratio_cell(row.fraction_of_peak, 0)} /roof "
                  f"{ratio_cell(row.fraction_of_roofline, 0)} {target_cell(row)}" for row in rescored]
    if any(row.measurement_problem for row in result.rows + result.rescored_rows):
        lines.append(MEASUREMENT_NOTE)
    return lines + list(result.warnings)


def format_table(result: Result) -> str:
    """The whole table: the lines run() gives its `table` callback, in the same order."""
    return "\n".join(table_header(result) + [format_row(row) for row in result.rows] + table_footer(result))


def to_json(result: Result, path) -> None:
    with open(path, "w") as handle:
        json.dump(asdict(result), handle, indent=2)

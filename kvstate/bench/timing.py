"""Timing helpers shared by the benchmarks: a robust median timer and machine limits."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable


def time_fn(fn: Callable[[], object], *, warmup: int = 1, min_time: float = 0.3, max_iters: int = 50) -> float:
    """Median seconds per call of `fn`, after `warmup` calls; runs until `min_time` has elapsed."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_iters and (len(times) < 3 or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class MachineLimits:
    gemm_flops: float  # fp32 FLOP/s of a large square matmul
    bandwidth: float  # bytes/s of a large tensor copy (read + write counted)


def measure_machine(size: int = 2048, copy_mib: int = 256) -> MachineLimits:
    """Measure this machine's fp32 GEMM rate and memory bandwidth with torch itself."""
    import torch

    a = torch.randn(size, size)
    b = torch.randn(size, size)
    t = time_fn(lambda: torch.mm(a, b), warmup=2, min_time=0.5)
    gemm = 2 * size**3 / t
    n = copy_mib * 2**20 // 4
    x = torch.randn(n)
    y = torch.empty_like(x)
    t = time_fn(lambda: y.copy_(x), warmup=2, min_time=0.5)
    bandwidth = 2 * n * 4 / t  # one read and one write of every byte
    return MachineLimits(gemm_flops=gemm, bandwidth=bandwidth)


def measure_read_bandwidth(gib: float = 1.0) -> float:
    """Bytes/s of a plain read: `sum` of a `gib` GiB fp32 tensor on torch's threads (the rate a decode
    step that streams its weights once can reach; no write traffic counted, unlike the copy above)."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)  # filled: every page is mapped before the timing
    t = time_fn(lambda: x.sum(), warmup=1, min_time=0.5, max_iters=10)
    return x.numel() * 4 / t


# What transformers says when it runs its pure-PyTorch fallbacks: the benchmarks measure exactly
# those on purpose (they are the bar to beat), so the warning is expected noise there.
EXPECTED_WARNINGS = ("is falling back to its reference PyTorch implementation", "fast path is not available")


class _ExpectedWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in EXPECTED_WARNINGS)


def silence_expected_warnings() -> None:
    """Drop transformers' expected fallback warnings (and its save progress bars); others still show."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # no reference side installed: nothing to silence
        return
    hf_logging.disable_progress_bar()  # "Writing model shards" while a benchmark checkpoint is saved
    expected = _ExpectedWarnings()
    for name in ("transformers", "transformers.integrations.hub_kernels"):
        logger = logging.getLogger(name)
        for target in [logger, *logger.handlers]:
            if not any(isinstance(f, _ExpectedWarnings) for f in target.filters):
                target.addFilter(expected)


def start(args, *, reference: bool = True):
    """The common start of a benchmark run: torch threads (--threads), a rich console (on stderr
    under --json, so stdout stays machine-readable) and this machine's measured limits. `reference`:
    the run will use transformers (whose expected warnings are then silenced; importing it costs
    ~0.6 s, so a run without it does not)."""
    import torch

    from kvstate.terminal.console import make_console

    if args.threads:
        torch.set_num_threads(args.threads)
    if reference:
        silence_expected_warnings()
    quick = getattr(args, "quick", False)
    console = make_console(stderr=args.json)
    with console.status("measuring the machine's GEMM rate and memory bandwidth"):
        limits = measure_machine(size=1024 if quick else 2048, copy_mib=64 if quick else 256)
    return console, limits


def alternate_steps(step_s, low: int, high: int, rounds: int) -> dict:
    """`rounds` alternating decode measurements at batch `low` then `high` (`step_s(b)` -> seconds a step),
    so that both see the same minutes of a noisy machine -> {"batches": [low, high], "ms": {b: per round},
    "ratios": high's step / low's per round, "median"}."""
    ms: dict[int, list[float]] = {low: [], high: []}
    for _ in range(rounds):
        for b in (low, high):
            ms[b].append(1e3 * step_s(b))
    ratios = [h / lo for lo, h in zip(ms[low], ms[high])]
    return dict(batches=[low, high], ms={str(b): v for b, v in ms.items()}, ratios=ratios,
                median=statistics.median(ratios))


def timed_generate(llm, prompts: list[list[int]], n: int, clock=None) -> tuple[float, list[float]]:
    """Greedy generate() of n tokens per prompt (eos ignored) -> (seconds in all, seconds of each engine
    step: the prefill's chunks, the last of them sampling the first token, then one step per token).
    `clock`: seconds now (default time.perf_counter)."""
    from kvstate.engine.params import SamplingParams

    clock = clock or time.perf_counter
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    core, steps = llm.engine, []
    step = core.step

    def timed_step():
        t = clock()
        try:
            return step()
        finally:
            steps.append(clock() - t)

    core.step = timed_step  # an instance attribute over the method, removed below
    try:
        t0 = clock()
        llm.generate(prompts, params)
        return clock() - t0, steps
    finally:
        del core.step

"""Timing for the benchmark scripts: CUDA events or perf_counter, interleaved medians."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch


def _time_block(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds per call of ``fn``, over ``calls`` back-to-back calls (CUDA: event timing)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    warmup: int,
    min_block_s: float = 1e-2,
) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin.

    Each repeat times every function once (in a rotated order), so load from other processes
    affects all variants alike; a block repeats a fast call until it lasts ``min_block_s``.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    calls = {
        name: max(1, min(1000, math.ceil(min_block_s / max(_time_block(fn, 1, device), 1e-7))))
        for name, fn in fns.items()
    }
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_time_block(fns[name], calls[name], device))
    return {name: statistics.median(values) for name, values in samples.items()}


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--threads``, shared by every benchmark."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads; 1 (default) keeps ratios stable on a shared machine, "
        "0 keeps torch's default",
    )


def setup_device(args: argparse.Namespace) -> torch.device:
    """Apply ``--threads`` and return the ``--device`` to time on."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return torch.device(args.device)

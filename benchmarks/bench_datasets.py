"""Cost of generating the embedded synthetic dataset, against drawing the same bytes at random.

Run ``python benchmarks/bench_datasets.py``. It times, in the same process and interleaved
round-robin, ``make_synthetic`` at CIFAR-100 size (100 classes x 600 images of 32x32x3, the
default) and a baseline that only draws as many random uint8 pixels with numpy, and prints the
ratio. The generator was built to finish well under 2 s on 2 busy CPU cores (the budget a test
once asserted; a wall-time assert is flaky on a shared machine, so it lives here as a number).
"""

from __future__ import annotations

import argparse

import numpy as np
from timing import add_device_arguments, interleaved_medians, setup_device  # benchmarks/timing.py

from pilot_online.core.datasets import SyntheticSpec, make_synthetic

BUDGET_SECONDS = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-per-class", type=int, default=500)
    parser.add_argument("--test-per-class", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    add_device_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = setup_device(args)
    spec = SyntheticSpec(train_per_class=args.train_per_class, test_per_class=args.test_per_class)
    data = make_synthetic(spec)
    shapes = [data["train_x"].shape, data["test_x"].shape]
    images = sum(shape[0] for shape in shapes)
    rng = np.random.default_rng(0)

    def random_pixels() -> None:
        for shape in shapes:
            rng.integers(0, 256, size=shape, dtype=np.uint8)

    seconds = interleaved_medians(
        {"make_synthetic": lambda: make_synthetic(spec), "random pixels": random_pixels},
        device,
        repeats=args.repeats,
        warmup=0,
    )
    ours, baseline = seconds["make_synthetic"], seconds["random pixels"]
    print(f"{images} images of {shapes[0][1:]} (median of {args.repeats}, interleaved)")
    print(f"  make_synthetic   {ours:8.3f} s   ({ours / BUDGET_SECONDS:.2f}x the 2 s budget)")
    print(f"  random pixels    {baseline:8.3f} s")
    print(f"  ratio make_synthetic / random pixels: {ours / baseline:.1f}x")


if __name__ == "__main__":
    main()

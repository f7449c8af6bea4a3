"""Images per second the run's data path delivers to a null model at 224 px, against today's path.

Run ``python benchmarks/pipeline.py`` (``--device cuda`` on a GPU machine). It writes two small
datasets in a temporary folder: CIFAR-style uint8 arrays (32 px, upscaled by the transforms) and
CUB-style JPEG folders (500 x 375 px), ``--classes`` x ``--train-per-class`` training and
``--test-per-class`` test images each, with the transforms PILOT gives CODA-P/L2P on them
(``build_transform``: RandomResizedCrop(224, scale 0.05-1) + flip for training, Resize(256,
bicubic) + CenterCrop(224) for test, then ToTensor). Everything is timed in this process:

- **raw transform rate per worker**: the whole training (test) transform list, float output,
  image by image in this process with one intra-op thread, as a DataLoader worker runs
  (decoding included for JPEGs): the most one worker can deliver.
- **training**: ``PilotDataSource.train_batches`` (the run's path: one persistent loader, uint8
  across, float on the device) over the stream's tasks 2 to 4 (the first warms the loader), with
  1 and 2 workers: the median rate of a task's pass. The ratio is that rate over the raw rate
  times the workers (target >= 0.90). Today's path (a new DataLoader per task, float batches)
  beside it.
- **evaluation from the 2nd evaluation on**: ``PilotDataSource.eval_batches`` with and without
  the pixel cache, and today's path (a new DataLoader, new workers, per evaluation); the median
  over evaluations 2 to ``--evaluations``. Each variant's evaluations run back to back, as a
  run's do: interleaved, one variant's exiting workers and freed memory would land in the next
  one's time.

The null model only moves each batch to the device and waits for it. On the CPU it receives the
float batch, so the uint8-to-float conversion is in the measured path. The last line is the
evaluation speedup of the pixel cache over today's path with today's default of 2 workers, on the
CUB-style folders (target >= 10x). With 2 workers on a 2-core machine the workers share the cores
with the training process, so a training ratio near 1 is possible only with 1 worker there (the
default, ``num_workers: null``, gives one worker per CPU less one). On a shared machine the
absolute rates move with the load; the ratios are measured back to back.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from timing import add_device_arguments, setup_device  # benchmarks/timing.py
from torchvision import transforms as T

from pilot_online.pilot.data import Images, PilotDataSource, SeededSamples

SIDE = 224


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, default=20)
    parser.add_argument(
        "--train-per-class", type=int, default=60, help="tasks of 300 images by default, as CUB's"
    )
    parser.add_argument("--test-per-class", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=20, help="stream batch size")
    parser.add_argument("--eval-batch-size", type=int, default=50)
    parser.add_argument("--evaluations", type=int, default=6, help="evaluations per variant")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    add_device_arguments(parser)
    return parser.parse_args(argv)


def transforms() -> dict[str, list]:
    """PILOT's ``build_transform`` lists for 224 px (written from reading upstream)."""
    return {
        "train": [
            T.RandomResizedCrop(SIDE, scale=(0.05, 1.0), ratio=(3 / 4, 4 / 3)),
            T.RandomHorizontalFlip(p=0.5),
            T.ToTensor(),
        ],
        "test": [
            T.Resize(int(256 / 224 * SIDE), interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(SIDE),
            T.ToTensor(),
        ],
    }


def make_datasets(root: Path, args: argparse.Namespace) -> dict[str, SimpleNamespace]:
    """DataManager-like fields of the CIFAR-style arrays and the CUB-style JPEG folders."""
    from PIL import Image

    rng = np.random.default_rng(0)
    trsf = transforms()
    out = {}
    counts = {"train": args.train_per_class, "test": args.test_per_class}
    arrays, paths = {}, {}
    for split, per_class in counts.items():
        labels = np.repeat(np.arange(args.classes), per_class)
        arrays[split] = (rng.integers(0, 256, (len(labels), 32, 32, 3), dtype=np.uint8), labels)
        files = []
        for i, label in enumerate(labels):
            folder = root / split / f"{label:03d}.class"
            folder.mkdir(parents=True, exist_ok=True)
            # Smooth content, as photographs compress: a gradient plus noise.
            base = np.linspace(0, 255, 500, dtype=np.float32)[None, :, None]
            noise = rng.normal(0, 20, (375, 500, 3)).astype(np.float32)
            pixels = np.clip(base + noise + 10 * label, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=90)
            files.append(str(folder / f"{i}.jpg"))
        paths[split] = (np.array(files), labels)
    for name, source, use_path in (("cifar arrays", arrays, False), ("cub jpegs", paths, True)):
        out[name] = SimpleNamespace(
            _train_data=source["train"][0],
            _train_targets=source["train"][1],
            _test_data=source["test"][0],
            _test_targets=source["test"][1],
            _train_trsf=trsf["train"],
            _test_trsf=trsf["test"],
            _common_trsf=[],
            use_path=use_path,
        )
    return out


def raw_rate(dm: SimpleNamespace, split: str) -> float:
    """Images/s of the whole transform list (float output) in this process, one image at a time."""
    data, labels = (
        (dm._train_data, dm._train_targets)
        if split == "train"
        else (
            dm._test_data,
            dm._test_targets,
        )
    )
    trsf = dm._train_trsf if split == "train" else dm._test_trsf
    dataset = Images(data, labels, T.Compose([*trsf, *dm._common_trsf]), dm.use_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    try:
        rates = []
        for _ in range(2):
            begin = time.perf_counter()
            for i in range(len(dataset)):
                dataset[i]
            rates.append(len(dataset) / (time.perf_counter() - begin))
    finally:
        torch.set_num_threads(threads)
    return max(rates)


def consume(batches: Iterable, device: torch.device) -> int:
    """The null model: each batch on the device, waited for; returns the images seen."""
    seen = 0
    for inputs, _ in batches:
        inputs = inputs.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seen += len(inputs)
    return seen


def rate(run: Callable[[], Iterable], device: torch.device) -> float:
    begin = time.perf_counter()
    seen = consume(run(), device)
    return seen / (time.perf_counter() - begin)


# -- today's path (before issue 15): a new DataLoader per task and per evaluation, float batches --
def todays_loader(dataset, batches: list[list[int]], workers: int, generator=None) -> Iterable:
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=batches, num_workers=workers, generator=generator
    )
    return ((inputs, labels) for _, inputs, labels in loader)


def todays_datasets(dm: SimpleNamespace, seed: int) -> tuple[SeededSamples, Images]:
    train_trsf = T.Compose([*dm._train_trsf, *dm._common_trsf])
    test_trsf = T.Compose([*dm._test_trsf, *dm._common_trsf])
    train = Images(dm._train_data, dm._train_targets, train_trsf, dm.use_path)
    test = Images(dm._test_data, dm._test_targets, test_trsf, dm.use_path)
    return SeededSamples(train, seed), test


def measure(dm: SimpleNamespace, args, device: torch.device) -> list[dict]:
    rows = []
    raw = {split: raw_rate(dm, split) for split in ("train", "test")}
    order = np.random.default_rng(1).permutation(len(dm._train_targets))
    tasks = np.array_split(order, 4)
    size = args.batch_size

    def task_batches(task: np.ndarray) -> list[np.ndarray]:
        return [task[i : i + size] for i in range(0, len(task), size)]

    test_indices = np.arange(len(dm._test_targets))
    chunks = [
        test_indices[i : i + args.eval_batch_size].tolist()
        for i in range(0, len(test_indices), args.eval_batch_size)
    ]
    for workers in args.workers:
        stream, test = todays_datasets(dm, seed=0)
        # Training: the run's path, on tasks 2 to 4 (the first warms the loader).
        config = {"num_workers": workers, "eval_batch_size": args.eval_batch_size}
        source = PilotDataSource(dm, {**config, "eval_pixel_cache": "auto"}, seed=0)
        source.attach_device(device)
        consume(source.train_batches(task_batches(tasks[0])), device)
        train_new = statistics.median(
            rate(lambda s=source, t=task: s.train_batches(task_batches(t)), device)
            for task in tasks[1:]
        )
        generator = torch.Generator().manual_seed(0)
        train_old = statistics.median(
            rate(
                lambda s=stream, w=workers, t=task, g=generator: todays_loader(
                    s, [b.tolist() for b in task_batches(t)], w, g
                ),
                device,
            )
            for task in tasks[1:]
        )
        # Evaluation, from the 2nd on: cached, uncached (persistent workers), today's path.
        plain = PilotDataSource(dm, {**config, "eval_pixel_cache": "off"}, seed=0)
        plain.attach_device(device)
        variants = {
            "pixel cache": lambda s=source: s.eval_batches(test_indices),
            "no pixel cache": lambda s=plain: s.eval_batches(test_indices),
            "today": lambda t=test, w=workers: todays_loader(t, chunks, w),
        }
        evals = {
            name: [rate(run, device) for _ in range(args.evaluations)]
            for name, run in variants.items()
        }
        source.close()
        plain.close()
        medians = {name: statistics.median(values[1:]) for name, values in evals.items()}
        rows.append(
            {
                "workers": workers,
                "raw train": raw["train"],
                "raw test": raw["test"],
                "train": train_new,
                "train today": train_old,
                "train ratio": train_new / (raw["train"] * workers),
                **{f"eval {name}": value for name, value in medians.items()},
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = setup_device(args)
    print(
        f"data path to a null model at {SIDE} px on {device}: {args.classes} classes x "
        f"{args.train_per_class} training / {args.test_per_class} test images; images/s"
    )
    header = (
        f"{'dataset':<13}{'workers':>8}{'raw train':>10}{'train':>8}{'today':>8}{'ratio':>7}"
        f"{'raw test':>10}{'eval cache':>11}{'no cache':>9}{'today':>8}{'speedup':>9}"
    )
    print(header)
    speedup = None
    with tempfile.TemporaryDirectory() as folder:
        for name, dm in make_datasets(Path(folder), args).items():
            for row in measure(dm, args, device):
                ratio = row["eval pixel cache"] / row["eval today"]
                print(
                    f"{name:<13}{row['workers']:>8}{row['raw train']:>10.1f}{row['train']:>8.1f}"
                    f"{row['train today']:>8.1f}{row['train ratio']:>7.2f}{row['raw test']:>10.1f}"
                    f"{row['eval pixel cache']:>11.1f}{row['eval no pixel cache']:>9.1f}"
                    f"{row['eval today']:>8.1f}{ratio:>8.2f}x"
                )
                if name == "cub jpegs" and row["workers"] == 2:
                    speedup = ratio
    print(
        "ratio: training images/s over (raw training transform rate x workers), target >= 0.90; "
        "speedup: pixel cache over today's path, evaluations 2 on, target >= 10x"
    )
    if speedup is None:  # --workers without 2: the last row measured
        speedup = ratio
    print(f"eval speedup from the 2nd evaluation: {speedup:.2f}x")


if __name__ == "__main__":
    main()

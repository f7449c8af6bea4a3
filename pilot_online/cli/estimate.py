"""The FLOP model: a run's GPU compute time from FLOPs counted on each method's real network.

``benchmarks/flops.py`` builds every registered method's PILOT network (ViT-B/16 at 224 px) and
counts, with ``torch.utils.flop_counter.FlopCounterMode`` (2 FLOPs per multiply-add), the FLOPs
per image of a training step (forward with the query pass, loss, backward), of the training
forward alone, of the frozen query pass, and of a test forward. It writes them to the package
data ``cli/flops.json`` that this module reads (no PILOT, no torch needed here).

A run's FLOPs (:func:`run_flops`):

- **training**: every training image once (online: one pass over the stream), at the step's
  FLOPs; experience replay adds ``er_batch_size / batch_size`` more images per stream image; a
  method with the engine teacher (``keeps_teacher``) adds the teacher's forward (a test
  forward) on every training image, counted from the first step (an upper bound: the teacher
  exists from the first firing on); oLoRA adds its ``hard_buffer_size`` buffered batches
  (forward and backward with ``hard_loss``, else forward only), both counted as if full from
  the first step (an upper bound). P and FGH add
  element-wise work only (no matrix products): nothing here.
- **evaluation**: one evaluation per task, over the test images of the classes seen so far (the
  clear stream's ``init_cls`` + ``increment`` schedule; a Si-Blurry run is counted the same).
  With the query cache (``eval_query_cache`` not ``"off"``) the frozen query pass runs once per
  test image per run and each evaluation runs the rest; ``eval_period`` adds evaluations over
  the average seen share of the test set.

Two figures, each saying what it assumes (:func:`estimate_config`, :meth:`RunEstimate.describe`):

- **ideal**: FLOPs / :data:`DEFAULT_SUSTAINED_TFLOPS`, an H100 SXM's dense bf16 peak
  (989.4 TFLOP/s, NVIDIA's datasheet) at 40%, i.e. 395.8 TFLOP/s. A floor for the GPU's
  compute, not a wall-clock prediction: data loading, optimiser and FGH element-wise work,
  kernel launches and host syncs are not in it.
- **calibrated**: FLOPs / the throughput that the paper's own measured time table implies
  (:func:`calibration`: CUB, clear, batch 100, one Quadro RTX 8000, whole runs). That is the
  median over the paper's methods of (FLOPs of its CUB run / its measured seconds), so it folds
  in everything the FLOP model leaves out, as the paper's machine paid it. oLoRA (two GPUs) and
  ConvPrompt (its measured hour is 12 times what its FLOPs explain) are left out of the fit.

Other image sizes (``backbone_kwargs.img_size``) scale the counts by the ViT's token count,
roughly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from statistics import median
from typing import Any

from ..core.progress import duration, progress_line  # noqa: F401  (the CLI's names)

#: H100 SXM5 dense bf16 tensor-core peak (TFLOP/s, NVIDIA H100 datasheet; 1,979 with sparsity).
H100_BF16_PEAK_TFLOPS = 989.4
#: The share of that peak a ViT-B training loop sustains, as assumed here.
SUSTAINED_FRACTION = 0.40
DEFAULT_SUSTAINED_TFLOPS = H100_BF16_PEAK_TFLOPS * SUSTAINED_FRACTION  # 395.76
#: The image size the FLOPs were counted at, and ViT-B/16's token count there (1 + 14 x 14).
MEASURED_IMG_SIZE = 224
PATCH = 16


@dataclass(frozen=True)
class DatasetSize:
    """Train/test image counts and classes of a dataset as PILOT reads it."""

    train: int
    test: int
    classes: int
    source: str


#: The paper's datasets as PILOT 5240714 reads them (``utils/data.py``).
DATASET_SIZES: dict[str, DatasetSize] = {
    "cifar224": DatasetSize(
        50_000, 10_000, 100, "torchvision CIFAR-100 (paper appendix: 500 train, 100 test a class)"
    ),
    "cub": DatasetSize(
        9_430,
        2_358,
        200,
        "the APER split PILOT's README links (11,788 images, 80/20; APER, Zhou et al., "
        "arXiv:2303.07338); CUB-200-2011's official split is 5,994/5,794",
    ),
    "imagenetr": DatasetSize(
        24_000, 6_000, 200, "the APER split PILOT's README links (30,000 images, 80/20)"
    ),
    "vtab": DatasetSize(1_796, 8_619, 50, "the APER VTAB-CIL split PILOT's README links"),
}


def _tokens(img_size: int) -> int:
    return 1 + (img_size // PATCH) ** 2


@lru_cache(maxsize=1)
def load_flops() -> dict[str, Any]:
    """The package data ``pilot_online/cli/flops.json`` (written by ``benchmarks/flops.py``)."""
    text = resources.files("pilot_online.cli").joinpath("flops.json").read_text(encoding="utf-8")
    return json.loads(text)


def method_flops(method: str, table: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The per-image FLOPs of one registered method; a clear error for one not counted."""
    methods = (table or load_flops())["methods"]
    if method not in methods:
        raise ValueError(
            f"the FLOP model has no counts for {method!r} (it has {', '.join(sorted(methods))}): "
            "run `python benchmarks/flops.py` with PILOT_ROOT set to count every registered method"
        )
    return dict(methods[method])


def _method_default(method: str, key: str, fallback: Any) -> Any:
    """A method's own config default (e.g. oLoRA's ``hard_buffer_size``), without PILOT."""
    try:
        from ..engine.registry import get_method

        spec = get_method(method).config_keys.get(key)
    except (ImportError, ValueError):
        return fallback
    return spec.default if spec is not None else fallback


def keeps_teacher(method: str) -> bool:
    """Whether the method runs the engine teacher on each training batch (``keeps_teacher``)."""
    try:
        from ..engine.registry import get_method

        return bool(get_method(method).keeps_teacher)
    except (ImportError, ValueError):
        return False


def dataset_size(cfg: Mapping[str, Any]) -> DatasetSize:
    """The run's dataset sizes: the paper's datasets, or the plugin's synthetic ones."""
    name = str(cfg.get("dataset") or "").lower()
    if name in DATASET_SIZES:
        return DATASET_SIZES[name]
    try:
        from ..core.datasets import DATASETS

        spec = DATASETS.get(name)
    except ImportError:
        spec = None
    if spec is None:
        raise ValueError(
            f"the FLOP model knows no image counts for dataset {name!r}: it has "
            f"{', '.join(DATASET_SIZES)} and the synthetic datasets"
        )
    return DatasetSize(
        spec.num_classes * spec.train_per_class,
        spec.num_classes * spec.test_per_class,
        spec.num_classes,
        "synthetic spec",
    )


def seen_fractions(classes: int, init_cls: int, increment: int) -> list[float]:
    """The share of classes seen at each task end of a clear stream (one evaluation each)."""
    if init_cls < 1 or increment < 1:
        raise ValueError(f"init_cls and increment must be >= 1, got {init_cls}, {increment}")
    tasks = 1 + max(0, math.ceil((classes - init_cls) / increment))
    return [min(classes, init_cls + t * increment) / classes for t in range(tasks)]


def flops_at(counts: Mapping[str, Any], firings: int) -> dict[str, float]:
    """A method's per-image counts after ``firings`` consolidation firings. A network that grows
    at its firings (``MethodAdapter.grows``: DER and MEMO add a branch, FOSTER a boosting branch
    and a student) was counted at 0, 1, 2, ... firings (``by_firings``); past the last count the
    last increment repeats (linear growth; a constant cost repeats a zero increment)."""
    steps = counts.get("by_firings")
    if not steps:
        return {k: float(v) for k, v in counts.items() if not isinstance(v, (list, dict))}
    if firings < len(steps):
        return dict(steps[firings])
    last, before = steps[-1], steps[-2] if len(steps) > 1 else steps[-1]
    extra = firings - (len(steps) - 1)
    return {k: last[k] + extra * (last[k] - before[k]) for k in last}


def step_flops_per_stream_image(cfg: Mapping[str, Any], counts: Mapping[str, float]) -> float:
    """Training FLOPs per stream image of one step of ``cfg`` (counts at 224 px, unscaled): the
    step on the stream image and its share of replayed images, the teacher's forward on both,
    oLoRA's buffered batches."""
    method = str(cfg["model_name"])
    batch = int(cfg.get("batch_size", 100))
    step = counts["train_flops_per_image"]
    trained_per_stream_image = 1.0  # images in the training batch per stream image
    if int(cfg.get("er_memory_size", _method_default(method, "er_memory_size", 0)) or 0) > 0:
        replayed = int(cfg.get("er_batch_size", _method_default(method, "er_batch_size", batch)))
        trained_per_stream_image += replayed / batch
    per_stream_image = step * trained_per_stream_image
    if keeps_teacher(method):  # the engine teacher's forward on every training image
        per_stream_image += counts["test_flops_per_image"] * trained_per_stream_image
    buffered = int(cfg.get("hard_buffer_size", _method_default(method, "hard_buffer_size", 0)))
    if buffered:
        hard_loss = bool(cfg.get("hard_loss", _method_default(method, "hard_loss", True)))
        per_buffered = step if hard_loss else counts["train_forward_flops_per_image"]
        per_stream_image += buffered * per_buffered
    return per_stream_image


def run_flops(cfg: Mapping[str, Any], table: Mapping[str, Any] | None = None) -> dict[str, float]:
    """``{"train": FLOPs, "eval": FLOPs, "total": FLOPs}`` of one run (one seed) of ``cfg``.

    Task by task of the clear stream's schedule (a firing at each task boundary, as the methods'
    default ``new_classes`` trigger gives): task ``t`` trains its classes' share of the images
    at the counts after ``t`` firings and is evaluated at them."""
    method = str(cfg["model_name"])
    counts = method_flops(method, table)
    size = dataset_size(cfg)
    img_size = int((cfg.get("backbone_kwargs") or {}).get("img_size", MEASURED_IMG_SIZE))
    scale = _tokens(img_size) / _tokens(MEASURED_IMG_SIZE)

    fractions = seen_fractions(
        size.classes, int(cfg.get("init_cls", 10)), int(cfg.get("increment", 10))
    )
    shares = [b - a for a, b in zip([0.0, *fractions[:-1]], fractions)]
    per_task = [flops_at(counts, t) for t in range(len(fractions))]
    train = sum(
        size.train * share * step_flops_per_stream_image(cfg, c)
        for share, c in zip(shares, per_task)
    )
    # Test images evaluated at each task end (all seen classes), at that task's counts.
    passes = [size.test * f for f in fractions]
    period = cfg.get("eval_period")
    if period:  # periodic evaluations over the average seen share, spread over the tasks
        extra = size.test * (size.train // int(period)) * sum(fractions) / len(fractions)
        passes = [p + extra / len(fractions) for p in passes]
    evaluation = 0.0
    for images, c in zip(passes, per_task):
        test, query = c["test_flops_per_image"], c.get("query_flops_per_image", 0.0)
        cached = query > 0 and cfg.get("eval_query_cache", "auto") != "off"
        evaluation += images * (test - query if cached else test)
    last = per_task[-1]
    if last.get("query_flops_per_image", 0.0) > 0 and cfg.get("eval_query_cache", "auto") != "off":
        # The cached query pass: once per test image ever evaluated (all seen by the last task).
        evaluation += size.test * fractions[-1] * last["query_flops_per_image"]
    train, evaluation = train * scale, evaluation * scale
    return {"train": train, "eval": evaluation, "total": train + evaluation}


def estimate_run_seconds(
    cfg: Mapping[str, Any], sustained_tflops: float = DEFAULT_SUSTAINED_TFLOPS
) -> float:
    """The GPU compute seconds of one run (one seed) of ``cfg`` at ``sustained_tflops``
    (default: an H100's bf16 peak at 40%, 395.8 TFLOP/s); see the module docstring."""
    if not sustained_tflops > 0:
        raise ValueError(f"sustained_tflops must be > 0, got {sustained_tflops}")
    return run_flops(cfg)["total"] / (sustained_tflops * 1e12)


def paper_run_config(method: str, dataset: str = "cub", **overrides: Any) -> dict[str, Any]:
    """The paper's run of ``method`` on ``dataset`` (clear, batch 100, 10 classes a task; VTAB
    5), the method's own defaults for the rest."""
    increment = 5 if dataset == "vtab" else 10
    return {
        "model_name": method,
        "dataset": dataset,
        "stream": "clear",
        "batch_size": 100,
        "init_cls": increment,
        "increment": increment,
        **overrides,
    }


def predicted_time_table(
    configs: Iterable[Mapping[str, Any]] | None = None,
    sustained_tflops: float = DEFAULT_SUSTAINED_TFLOPS,
    dataset: str = "cub",
) -> list[dict[str, Any]]:
    """One row per run: ``method``, ``dataset``, ``train_tflop``, ``eval_tflop``, ``seconds``.

    ``configs`` default to the paper's run (:func:`paper_run_config`) of every method the FLOP
    table counts, on ``dataset``.
    """
    if configs is None:
        configs = [paper_run_config(m, dataset) for m in sorted(load_flops()["methods"])]
    rows = []
    for cfg in configs:
        flops = run_flops(cfg)
        rows.append(
            {
                "method": str(cfg["model_name"]),
                "dataset": str(cfg.get("dataset")),
                "train_tflop": flops["train"] / 1e12,
                "eval_tflop": flops["eval"] / 1e12,
                "seconds": flops["total"] / (sustained_tflops * 1e12),
            }
        )
    return rows


# --- calibration against the paper's measured time table -------------------------------------

#: Quadro RTX 8000 fp32 (non-tensor) peak, TFLOP/s (NVIDIA's datasheet): the paper's GPU.
QUADRO_RTX_8000_FP32_PEAK_TFLOPS = 16.3
#: Paper rows left out of the fit, with why.
CALIBRATION_EXCLUDED = {
    "oLoRA": "ran on two GPUs",
    "ConvPrompt": "its measured hour is not in its FLOPs (12 times what they explain)",
}
#: What the ideal figure assumes, in one line.
IDEAL_ASSUMES = (
    f"an H100 at {SUSTAINED_FRACTION:.0%} of its bf16 peak "
    f"({DEFAULT_SUSTAINED_TFLOPS:.0f} TFLOP/s), GPU compute only"
)


@dataclass(frozen=True)
class Calibration:
    """The throughput that fits the paper's time table, and the per-method points it came from."""

    tflops: float
    #: paper method name -> (registered name, mean measured seconds of its rows, run TFLOP)
    points: dict[str, tuple[str, float, float]]
    excluded: dict[str, str]
    hardware: str

    @property
    def share_of_peak(self) -> float:
        """The fitted throughput as a share of the paper GPU's fp32 peak."""
        return self.tflops / QUADRO_RTX_8000_FP32_PEAK_TFLOPS

    def assumes(self) -> str:
        """What the calibrated figure assumes, in one line."""
        return (
            f"the paper's Quadro RTX 8000 at the {self.tflops:.2f} TFLOP/s its time table implies "
            f"(median over {len(self.points)} methods' CUB runs, {self.share_of_peak:.0%} of the "
            "fp32 peak; data loading and overheads included as the paper paid them)"
        )


def calibration(table: Mapping[str, Any] | None = None) -> Calibration:
    """Fit one sustained throughput to the paper's time table (``time_consumption``: CUB, clear,
    batch 100, Quadro RTX 8000): per paper method, the FLOPs of its CUB run over the mean
    measured seconds of its rows (P and FGH add no FLOPs); the median over methods."""
    from ..engine.paper import registered_names, time_consumption

    paper = time_consumption()
    names = registered_names()
    counted = (table or load_flops())["methods"]
    seconds: dict[str, list[float]] = {}
    for row in paper["rows"]:
        seconds.setdefault(row["method"], []).append(float(row["seconds"]))
    points: dict[str, tuple[str, float, float]] = {}
    for method, measured in seconds.items():
        name = names.get(method)
        if method in CALIBRATION_EXCLUDED or name not in counted:
            continue
        config = paper_run_config(name, str(paper["dataset"]), stream=str(paper["stream"]))
        flops = run_flops(config, table)["total"]
        points[method] = (name, sum(measured) / len(measured), flops / 1e12)
    if not points:
        raise ValueError("no method of the paper's time table has FLOP counts to calibrate with")
    rate = median(tflop / secs for _, secs, tflop in points.values())
    return Calibration(rate, points, dict(CALIBRATION_EXCLUDED), str(paper["hardware"]))


def paper_measured_seconds(cfg: Mapping[str, Any]) -> tuple[float, str] | None:
    """The paper's measured time of this config's method and ablation row on CUB (clear, one
    Quadro RTX 8000), with the row it is, or None where the table has no such row."""
    from ..engine.config import variant_of
    from ..engine.paper import time_consumption
    from ..engine.registry import get_method

    try:
        paper_name = get_method(str(cfg.get("model_name"))).paper_name
    except ValueError:
        return None
    row = variant_of(cfg)
    row = "ours" if row == "fgh" else row
    for entry in time_consumption()["rows"]:
        if entry["method"] == paper_name and entry["row"] == row:
            return float(entry["seconds"]), f"{paper_name} {row}"
    return None


@dataclass(frozen=True)
class RunEstimate:
    """One config's estimate: per-seed ideal and calibrated seconds, the seed count, and the
    paper's measured time of the same method and row on CUB (when the table has it)."""

    method: str
    dataset: str
    seeds: int
    ideal_seconds: float
    calibrated_seconds: float
    calibration: Calibration
    paper: tuple[float, str] | None

    def describe(self) -> list[str]:
        """Lines that say each figure and what it assumes."""
        per = "per seed" if self.seeds == 1 else f"per seed, x {self.seeds} seeds"
        total = (
            ""
            if self.seeds == 1
            else f" = {duration(self.ideal_seconds * self.seeds)} / "
            f"{duration(self.calibrated_seconds * self.seeds)}"
        )
        lines = [
            f"{self.method} on {self.dataset}: ideal {duration(self.ideal_seconds)}, "
            f"calibrated {duration(self.calibrated_seconds)} ({per}{total}; training and "
            "every evaluation of one run, which gives AP, A_T and, with eval_period, A_auc)",
            f"  ideal: {IDEAL_ASSUMES}: a floor, not a prediction",
            f"  calibrated: {self.calibration.assumes()}",
        ]
        if self.paper is not None:
            seconds, row = self.paper
            lines.append(
                f"  paper: {row} on CUB measured {duration(seconds)} on one Quadro RTX 8000 "
                "(time_consumption table)"
            )
        return lines


def estimate_config(cfg: Mapping[str, Any], table: Mapping[str, Any] | None = None) -> RunEstimate:
    """Ideal and calibrated seconds of one seed of ``cfg``, with the seed count and the paper's
    measured time where it has one (see the module docstring)."""
    flops = run_flops(cfg, table)["total"]
    fit = calibration(table)
    seeds = cfg.get("seed", [0])
    paper = paper_measured_seconds(cfg) if str(cfg.get("dataset")) == "cub" else None
    return RunEstimate(
        method=str(cfg["model_name"]),
        dataset=str(cfg.get("dataset")),
        seeds=len(seeds) if isinstance(seeds, list) else 1,
        ideal_seconds=flops / (DEFAULT_SUSTAINED_TFLOPS * 1e12),
        calibrated_seconds=flops / (fit.tflops * 1e12),
        calibration=fit,
        paper=paper,
    )

"""The FLOP model: a run's GPU compute time from FLOPs counted on each method's real network.

``benchmarks/flops.py`` builds every registered method's PILOT network (ViT-B/16 at 224 px) and
counts, with ``torch.utils.flop_counter.FlopCounterMode`` (2 FLOPs per multiply-add), the FLOPs
per image of a training step (forward with the query pass, loss, backward), of the training
forward alone, of the frozen query pass, and of a test forward. It writes them to the package
data ``data/flops.json`` that this module reads (no PILOT, no torch needed here).

A run's FLOPs (:func:`run_flops`):

- **training**: every training image once (online: one pass over the stream), at the step's
  FLOPs; experience replay adds ``er_batch_size / batch_size`` more images per stream image; a
  method with the engine teacher (``Consolidation(teacher=True)``) adds the teacher's forward
  (a test forward) on every training image, counted from the first step (an upper bound: the teacher
  exists from the first firing on); oLoRA adds its ``hard_buffer_size`` buffered batches
  (forward and backward with ``hard_loss``, else forward only), both counted as if full from
  the first step (an upper bound). P and FGH add
  element-wise work only (no matrix products): nothing here.
- **evaluation**: one evaluation per task, over the test images of the classes seen so far (the
  clear stream's ``init_cls`` + ``increment`` schedule; a Si-Blurry run is counted the same).
  With the query cache (``eval_query_cache`` not ``"off"``) the frozen query pass runs once per
  test image per run and each evaluation runs the rest; ``eval_period`` adds evaluations over
  the average seen share of the test set.
- **protocol keys** (issue 29, docs/protocol.md): ``online_iter`` multiplies the training
  FLOPs (k optimiser steps per batch); real-time mode (``realtime``) trains only the batches
  its schedule picks (``ceil(B / C)`` of ``B``; a ``"measured"`` C is priced at its
  ``"flops"`` value, which is known before the run); A_online (``online_accuracy``, on in
  real-time mode) adds a test forward per stream image it scores with an extra pass (every one,
  unless the method's training forward predicts: then the skipped ones).

C from the FLOP model (:func:`realtime_flop_cost`): training FLOPs per stream image of the run
over the reference method's (``realtime_reference``, its own replay defaults), both from
:func:`run_flops` (so teacher, query passes, replay, growth and ``online_iter`` are in).
``"flops"`` prices the backward as Ghunaim et al. count passes, 2 x the forward it runs back
through (:func:`pass_counted`); ``"flops_counted"`` keeps the backward torch counted.

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from statistics import median
from typing import Any

from ..core.progress import duration, progress_line  # noqa: F401  (the CLI's names)

# The FLOP model's arithmetic lives in the engine (real-time mode prices a step with it); its
# names stay importable from here.
from ..engine.flops import (  # noqa: F401
    DATASET_SIZES,
    HEAD_ONLY_BACKWARD,
    MEASURED_IMG_SIZE,
    PATCH,
    DatasetSize,
    _method_default,
    _tokens,
    dataset_size,
    flops_at,
    keeps_teacher,
    load_flops,
    method_flops,
    pass_counted,
    realtime_cost,
    realtime_flop_cost,
    realtime_trained_fraction,
    reference_config,
    run_flops,
    seen_fractions,
    step_flops_per_stream_image,
    training_flops_per_stream_image,
)

#: H100 SXM5 dense bf16 tensor-core peak (TFLOP/s, NVIDIA H100 datasheet; 1,979 with sparsity).
H100_BF16_PEAK_TFLOPS = 989.4
#: The share of that peak a ViT-B training loop sustains, as assumed here.
SUSTAINED_FRACTION = 0.40
DEFAULT_SUSTAINED_TFLOPS = H100_BF16_PEAK_TFLOPS * SUSTAINED_FRACTION  # 395.76


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
    from .paper import registered_names, time_consumption

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
    from ..engine.registry import method_card
    from .paper import time_consumption

    try:
        paper_name = method_card(str(cfg.get("model_name"))).paper_name
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
        total = "" if self.seeds == 1 else f" = {duration(self.calibrated_seconds * self.seeds)}"
        lines = [
            f"{self.method} on {self.dataset}: about {duration(self.calibrated_seconds)} of GPU "
            f"time ({per}{total}; training and every evaluation of one run, which gives AP, A_T "
            "and, with eval_period, A_auc), calibrated to the paper's measured times",
            f"  calibrated: {self.calibration.assumes()}",
            f"  floor: ideal {duration(self.ideal_seconds)} per seed ({IDEAL_ASSUMES}): no run "
            "is faster; not a prediction",
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

"""The FLOP model's arithmetic: a run's FLOPs from the per-image counts of each method's real
network (``pilot_online/data/flops.json``, written by ``benchmarks/flops.py``), and real-time
mode's cost C from them (issue 29).

It lives in the engine, not beside the harness's estimates (``harness/estimate.py``, which
re-exports every name here and documents the model), because real-time mode prices a run's step
from it when the session starts: the engine may not import the harness (``tests/test_layers.py``).
No PILOT, no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from ..core.realtime import DEFAULT_REFERENCE, RealtimeSchedule, scores_online

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
    """The package data ``pilot_online/data/flops.json`` (written by ``benchmarks/flops.py``)."""
    text = (resources.files("pilot_online") / "data" / "flops.json").read_text(encoding="utf-8")
    return json.loads(text)


def method_flops(method: str, table: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The per-image FLOPs of one registered method: the package table's counts, else its card's
    (``MethodCard.flops``: a method from outside the package); a clear error for one not counted."""
    methods = (table or load_flops())["methods"]
    if method in methods:
        return dict(methods[method])
    own = _card_counts(method)
    if own is not None:
        return dict(own)
    raise ValueError(
        f"the FLOP model has no counts for {method!r} (it has {', '.join(sorted(methods))}): "
        f"{count_fix(method)}"
    )


def _card_counts(method: str) -> Mapping[str, Any] | None:
    """The counts on the method's card, or None. The one card field the engine reads: real-time
    evaluation prices a step by the FLOP model, whose counts of an outside method are there."""
    try:
        from .registry import method_card

        return method_card(method).flops
    except (ImportError, ValueError):
        return None


def count_fix(method: str) -> str:
    """How to give the FLOP model a method's counts: the package table for a built-in method,
    its own card for one from outside (never an edit of the installed package's data)."""
    try:
        from .registry import get_method

        built_in = get_method(method).__module__.startswith("pilot_online.")
    except (ImportError, ValueError):
        built_in = False
    if built_in:
        return (
            f"run `python benchmarks/flops.py --methods {method}` (PILOT_ROOT set) in the "
            "pilot-online checkout"
        )
    return (
        f"count them with `pilot-online flops {method} --pilot-root <PILOT checkout>` and paste "
        f"the printed flops={{...}} into {method}'s MethodCard (register_method(..., card=...))"
    )


def _method_default(method: str, key: str, fallback: Any) -> Any:
    """A method's own config default (e.g. oLoRA's ``hard_buffer_size``), without PILOT."""
    try:
        from .registry import get_method

        spec = get_method(method).config_keys.get(key)
    except (ImportError, ValueError):
        return fallback
    return spec.default if spec is not None else fallback


def keeps_teacher(method: str) -> bool:
    """Whether the method runs the engine teacher on each training batch
    (``Consolidation(teacher=True)``)."""
    try:
        from .registry import get_method

        return bool(get_method(method).consolidation.teacher)
    except (ImportError, ValueError):
        return False


def dataset_size(cfg: Mapping[str, Any]) -> DatasetSize:
    """The run's dataset sizes: the paper's datasets, or the plugin's own."""
    name = str(cfg.get("dataset") or "").lower()
    if name in DATASET_SIZES:
        return DATASET_SIZES[name]
    try:
        from ..core.datasets import DATASETS, SCALE_DATASETS

        spec = DATASETS.get(name) or SCALE_DATASETS.get(name)
    except ImportError:
        spec = None
    if spec is None:
        raise ValueError(
            f"the FLOP model knows no image counts for dataset {name!r}: it has "
            f"{', '.join(DATASET_SIZES)}, the synthetic and the scale-model datasets"
        )
    return DatasetSize(
        spec.num_classes * spec.train_per_class,
        spec.num_classes * spec.test_per_class,
        spec.num_classes,
        "plugin spec",
    )


def seen_fractions(classes: int, init_cls: int, increment: int) -> list[float]:
    """The share of classes seen at each task end of a clear stream (one evaluation each)."""
    if init_cls < 1 or increment < 1:
        raise ValueError(f"init_cls and increment must be >= 1, got {init_cls}, {increment}")
    tasks = 1 + max(0, math.ceil((classes - init_cls) / increment))
    return [min(classes, init_cls + t * increment) / classes for t in range(tasks)]


def flops_at(counts: Mapping[str, Any], firings: int) -> dict[str, float]:
    """A method's per-image counts after ``firings`` consolidation firings. A network that grows
    at its firings (a method card's ``grows``: DER and MEMO add a branch, FOSTER a boosting branch
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
    from .eval_cache import QueryCacheOptions  # its module imports torch; this one does not

    cached_query = QueryCacheOptions.of(cfg).eval_query_cache != "off"
    evaluation = 0.0
    for images, c in zip(passes, per_task):
        test, query = c["test_flops_per_image"], c.get("query_flops_per_image", 0.0)
        cached = query > 0 and cached_query
        evaluation += images * (test - query if cached else test)
    last = per_task[-1]
    if last.get("query_flops_per_image", 0.0) > 0 and cached_query:
        # The cached query pass: once per test image ever evaluated (all seen by the last task).
        evaluation += size.test * fractions[-1] * last["query_flops_per_image"]
    # The protocol keys (issue 29): k steps per batch, the batches real-time mode trains, and
    # A_online's passes (each scored image one test forward at its task's counts).
    trained = realtime_trained_fraction(cfg, table)
    train *= int(cfg.get("online_iter", 1) or 1) * trained
    if scores_online(cfg):
        evaluation += sum(
            size.train * share * c["test_flops_per_image"] for share, c in zip(shares, per_task)
        )
    train, evaluation = train * scale, evaluation * scale
    return {"train": train, "eval": evaluation, "total": train + evaluation}


# --- real-time mode: C from the FLOP model (issue 29) -----------------------------------------

#: Below this share of the trained forward, a counted backward stops at the head (a linear
#: probe, SimpleCIL): Ghunaim et al.'s 2 x forward would price a backward that never runs.
HEAD_ONLY_BACKWARD = 0.1


def pass_counted(counts: Mapping[str, Any]) -> dict[str, Any]:
    """A method's counts with the training step priced as Ghunaim et al. count passes: the
    backward at 2 x the forward it runs back through (the trained forward, the frozen query pass
    aside), at least; the counted step's other terms (its own loss terms' forwards) stay. A
    backward that stops at the head (counted below :data:`HEAD_ONLY_BACKWARD` of the trained
    forward) keeps its count. Per firing count for a growing network (``by_firings``)."""
    if counts.get("by_firings"):
        return {**counts, "by_firings": [pass_counted(c) for c in counts["by_firings"]]}
    forward = float(counts["train_forward_flops_per_image"])
    trained = forward - float(counts.get("query_flops_per_image", 0.0))
    backward = float(counts["train_flops_per_image"]) - forward
    if backward <= HEAD_ONLY_BACKWARD * trained:
        return dict(counts)
    return {**counts, "train_flops_per_image": forward + max(backward, 2 * trained)}


def reference_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The reference run of real-time mode: ``realtime_reference`` on the run's data and batch
    size, base variant, its own replay defaults, one step per batch."""
    kept = ("dataset", "batch_size", "backbone_kwargs", "init_cls", "increment")
    reference = str(cfg.get("realtime_reference") or DEFAULT_REFERENCE)
    return {"model_name": reference, **{k: cfg[k] for k in kept if k in cfg}}


def training_flops_per_stream_image(
    cfg: Mapping[str, Any], counted: bool = False, table: Mapping[str, Any] | None = None
) -> float:
    """Training FLOPs per stream image of ``cfg`` trained on every batch (:func:`run_flops`
    with real-time mode and A_online off), the backward pass-counted unless ``counted``."""
    table = table or load_flops()
    if not counted:
        table = {**table, "methods": {m: pass_counted(c) for m, c in table["methods"].items()}}
    every_batch = {**cfg, "realtime": None, "online_accuracy": False}
    return run_flops(every_batch, table)["train"] / dataset_size(cfg).train


def realtime_flop_cost(
    cfg: Mapping[str, Any], counted: bool = False, table: Mapping[str, Any] | None = None
) -> tuple[float, dict[str, Any]]:
    """C of ``cfg`` from the FLOP model: its training FLOPs per stream image over the reference
    run's (:func:`reference_config`), and the numbers it came from. Unclamped: a method cheaper
    than the reference gets C < 1 (the schedule trains it on every batch)."""
    method = training_flops_per_stream_image(cfg, counted, table)
    reference = reference_config(cfg)
    theirs = training_flops_per_stream_image(reference, counted, table)
    return method / theirs, {
        "method_gflop_per_stream_image": method / 1e9,
        "reference_gflop_per_stream_image": theirs / 1e9,
        "backward": "counted" if counted else "2x forward",
    }


def realtime_cost(cfg: Mapping[str, Any], table: Mapping[str, Any] | None = None) -> float | None:
    """The C a config's real-time mode prices with: the FLOP model's for ``"flops"`` (and for
    ``"measured"``, which is only known once the run measures it), the counted one for
    ``"flops_counted"``, the number itself; None when ``realtime`` is off."""
    mode = cfg.get("realtime")
    if mode is None:
        return None
    if isinstance(mode, str):
        return realtime_flop_cost(cfg, mode == "flops_counted", table)[0]
    return float(mode)


def realtime_trained_fraction(
    cfg: Mapping[str, Any], table: Mapping[str, Any] | None = None
) -> float:
    """The share of stream batches a run trains on: 1 normally, ``ceil(B / C) / B`` in
    real-time mode (B: the stream's batches, training images / batch size)."""
    cost = realtime_cost(cfg, table)
    if cost is None:
        return 1.0
    batches = max(1, math.ceil(dataset_size(cfg).train / int(cfg.get("batch_size", 100))))
    return RealtimeSchedule.from_value(cost, "given").trained_count(batches) / batches


def check_flop_counts(cfg: Mapping[str, Any]) -> None:
    """``realtime`` ``"flops"``/``"flops_counted"`` needs the FLOP model to count the method and
    the reference (``data/flops.json``) and to know the dataset's image counts; else a ValueError
    naming ``benchmarks/flops.py`` and the other modes, before any work: never a silent C."""
    mode = cfg.get("realtime")
    if mode not in ("flops", "flops_counted"):
        return
    other_modes = (
        'or set realtime to "measured" (step times measured in this process) or to a number '
        "(C given)"
    )
    try:  # the FLOP model counts a run task by task over the dataset's classes
        dataset_size(cfg)
    except ValueError as err:
        raise ValueError(f'realtime="{mode}": {err}. Use another dataset, {other_modes}') from None
    counted = load_flops()["methods"]
    reference = cfg.get("realtime_reference", DEFAULT_REFERENCE)
    wanted = dict.fromkeys((str(cfg.get("model_name")), str(reference)))
    missing = [m for m in wanted if m not in counted and _card_counts(m) is None]
    if missing:
        fixes = "; ".join(count_fix(m) for m in missing)
        raise ValueError(
            f'realtime="{mode}" needs the FLOP model\'s counts, and it has none for '
            f"{', '.join(missing)}: {fixes}; {other_modes}"
        )

"""Seeded single-pass training streams: PILOT's clear class-incremental split and Si-Blurry.

A stream is a fixed list of per-task index arrays into the training set, built once from the
labels and a seed (STYLE rule 7: the seed alone fixes the order). Batches carry task-boundary
flags so that boundary-aware baselines can be expressed, but a task-free learner never needs
to read them.

Two kinds:

* ``clear``: PILOT ``DataManager``'s split (``[init_cls, increment, ..., remainder]``) over a
  class order; every task sees only its own classes, shuffled.
* ``si_blurry``: the stochastic-incremental blurry stream of Moon et al. (ICCV 2023), as the
  upstream ``OnlineSampler`` (KHU-AGI/Si-Blurry, ``varing_NM`` branch) builds it; see
  ``shared/SI_BLURRY.md``. It draws from a ``torch.Generator`` seeded with the run's seed, with
  the same calls in the same order as upstream, so the same labels and seed give upstream's
  task lists and sample order exactly (``SI_BLURRY_STREAM_VERSION`` 2; version 1 drew the same
  distribution from numpy). Two upstream defects are handled: the trainer's argument-order bug
  cannot happen here (keyword-only arguments), and the dataset-order choice of blurred samples
  is kept as the default for fidelity with ``blurred_selection="random"`` as the fix.

Everything is vectorised over samples (owner tables indexed by label, one stable sort to
group by task); the only Python loops run over tasks or batches.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from .checks import check_choice, check_int
from .lazy import torch

logger = logging.getLogger(__name__)

BLURRED_SELECTIONS = ("dataset_order", "random")
#: How ``si_blurry`` draws: 1 = numpy's generator (results schema 1), 2 = upstream's torch draws.
SI_BLURRY_STREAM_VERSION = 2

__all__ = [
    "BLURRED_SELECTIONS",
    "SI_BLURRY_STREAM_VERSION",
    "STREAMS",
    "STREAM_BUILDERS",
    "STREAM_CONFIG_KEYS",
    "STREAM_KINDS",
    "Batch",
    "Stream",
    "StreamKind",
    "TaskSummary",
    "build_stream",
    "clear_stream",
    "pilot_increments",
    "si_blurry_stream",
]


# --------------------------------------------------------------------------- validation


def _as_labels(labels: Any) -> np.ndarray:
    """Training labels as a read-only 1-D int64 copy; accepts lists, numpy arrays, torch tensors."""
    if hasattr(labels, "detach"):  # a torch tensor, without importing torch here
        labels = labels.detach().cpu().numpy()
    array = np.asarray(labels)
    if array.ndim != 1:
        raise ValueError(f"labels must be 1-D (one class id per sample), got shape {array.shape}")
    if array.size == 0:
        raise ValueError("labels is empty: a stream needs at least one training sample")
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"labels must have an integer dtype, got {array.dtype}; "
            "pass the class ids (e.g. DataManager._train_targets), not one-hot or float labels"
        )
    if array.min() < 0:
        raise ValueError(f"labels must be non-negative class ids, found {int(array.min())}")
    out = array.astype(np.int64, copy=True)
    out.setflags(write=False)
    return out


def _as_class_order(labels: np.ndarray, class_order: Sequence[int] | None) -> np.ndarray:
    """The class order as int64: given (validated) or the sorted unique labels."""
    if class_order is None:
        return np.unique(labels)
    if hasattr(class_order, "detach"):
        class_order = class_order.detach().cpu().numpy()
    order = np.asarray(class_order)
    if order.ndim != 1 or order.size == 0:
        raise ValueError(
            f"class_order must be a non-empty 1-D sequence of class ids, got shape {order.shape}"
        )
    if order.dtype.kind not in "iu":
        raise TypeError(f"class_order must hold integer class ids, got dtype {order.dtype}")
    order = order.astype(np.int64)
    unique, counts = np.unique(order, return_counts=True)
    if (counts > 1).any():
        raise ValueError(
            f"class_order repeats class ids {unique[counts > 1].tolist()}; "
            "each class must appear once"
        )
    missing = unique[~np.isin(unique, labels)]
    if missing.size:
        raise ValueError(
            f"class_order names classes with no training sample: {missing.tolist()[:20]}; "
            "pass the order over the classes present in labels"
        )
    return order


# --------------------------------------------------------------------------- data records


def pilot_increments(num_classes: int, init_cls: int, increment: int) -> list[int]:
    """Task sizes as PILOT ``DataManager`` splits them: ``[init_cls, increment, ..., rest]``."""
    num_classes = check_int("num_classes", num_classes, 1)
    init_cls = check_int("init_cls", init_cls, 1)
    increment = check_int("increment", increment, 1)
    if init_cls > num_classes:
        raise ValueError(
            f"init_cls={init_cls} exceeds the number of classes ({num_classes}); "
            f"use init_cls <= {num_classes}"
        )
    increments = [init_cls]
    while sum(increments) + increment < num_classes:  # a loop over tasks, as PILOT writes it
        increments.append(increment)
    remainder = num_classes - sum(increments)
    if remainder > 0:
        increments.append(remainder)
    return increments


@dataclass(frozen=True)
class Batch:
    """One training batch: sample indices in stream order plus task-boundary flags.

    The flags exist for boundary-aware baselines; a task-free learner must not read them
    unless its config explicitly allows it (STYLE rule 7).
    """

    indices: np.ndarray
    task: int
    first_in_task: bool
    last_in_task: bool

    def __len__(self) -> int:
        return int(self.indices.shape[0])


@dataclass(frozen=True)
class TaskSummary:
    """What one task of a stream contains, for logs and the results file."""

    task: int
    num_samples: int
    classes: list[int]  # classes present in the task's samples (sorted)
    new_classes: list[int]  # first exposed in this task
    disjoint_classes: list[
        int
    ]  # clear: all the task's classes; Si-Blurry: its disjoint-pool classes
    blurry_classes: list[int]  # clear: []; Si-Blurry: the blurry-pool classes the task owns
    blurred_out: int = 0  # Si-Blurry: samples of this task's blurry list moved to the shared pool
    blurred_in: int = 0  # Si-Blurry: pool samples handed to this task

    def to_dict(self) -> dict:
        return asdict(self)


def _readonly(array: np.ndarray) -> np.ndarray:
    out = np.ascontiguousarray(array, dtype=np.int64)
    out.setflags(write=False)
    return out


class Stream:
    """A fixed, seeded single-pass stream: per-task index arrays and batched iteration."""

    def __init__(
        self,
        kind: str,
        tasks: Sequence[np.ndarray],
        labels: np.ndarray,
        *,
        batch_size: int,
        seed: int,
        params: dict,
        disjoint_classes: Sequence[np.ndarray] | None = None,
        blurry_classes: Sequence[np.ndarray] | None = None,
        blurred_out: Sequence[int] | None = None,
        blurred_in: Sequence[int] | None = None,
        blurred_indices: np.ndarray | None = None,
        info: dict | None = None,
    ) -> None:
        self.kind = kind
        self.tasks: list[np.ndarray] = [_readonly(t) for t in tasks]
        self.labels = labels
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = seed
        self.params = params
        num_tasks = len(self.tasks)
        empty = np.zeros(0, dtype=np.int64)
        self._disjoint_classes = [np.sort(c) for c in (disjoint_classes or [empty] * num_tasks)]
        self._blurry_classes = [np.sort(c) for c in (blurry_classes or [empty] * num_tasks)]
        self._blurred_out = [int(x) for x in (blurred_out or [0] * num_tasks)]
        self._blurred_in = [int(x) for x in (blurred_in or [0] * num_tasks)]
        #: Si-Blurry: every sample that went through the shared blur pool (sorted); empty for clear.
        self.blurred_indices = _readonly(
            np.sort(blurred_indices) if blurred_indices is not None else empty
        )
        #: Derived numbers (pool sizes, quotas, leftovers) for logs and the results file.
        self.info: dict = info or {}
        self._presence: np.ndarray | None = None

    # ---- sizes
    def __len__(self) -> int:
        return int(sum(t.shape[0] for t in self.tasks))

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def _check_task(self, task: int) -> int:
        return check_int("task", task, 0, self.num_tasks - 1)

    def num_batches(self, task: int | None = None) -> int:
        sizes = (
            [t.shape[0] for t in self.tasks]
            if task is None
            else [self.tasks[self._check_task(task)].shape[0]]
        )
        return int(sum(math.ceil(n / self.batch_size) for n in sizes))

    # ---- iteration
    def batches(self, task: int | None = None) -> Iterator[Batch]:
        """Batches of ``batch_size`` for one task or the whole stream; none crosses a task boundary.

        A task's last partial batch is kept; an empty task (possible in Si-Blurry) yields nothing.
        """
        tasks = range(self.num_tasks) if task is None else [self._check_task(task)]
        for t in tasks:
            indices = self.tasks[t]
            n = indices.shape[0]
            for start in range(0, n, self.batch_size):
                stop = start + self.batch_size
                yield Batch(indices[start:stop], t, start == 0, stop >= n)

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    # ---- class bookkeeping
    def _class_presence(self) -> np.ndarray:
        """Boolean ``[num_tasks, max_label + 1]``: does class c occur in task t's samples."""
        if self._presence is None:
            width = int(self.labels.max()) + 1
            presence = np.zeros((self.num_tasks, width), dtype=bool)
            for t, indices in enumerate(self.tasks):
                presence[t] = np.bincount(self.labels[indices], minlength=width) > 0
            self._presence = presence
        return self._presence

    @property
    def trained_classes(self) -> np.ndarray:
        """Sorted classes that appear anywhere in the stream."""
        return np.flatnonzero(self._class_presence().any(axis=0)).astype(np.int64)

    def exposure_task(self) -> np.ndarray:
        """Per label value 0..max(label): the task that first streams the class, -1 if never."""
        presence = self._class_presence()
        first = presence.argmax(axis=0).astype(np.int64)
        return np.where(presence.any(axis=0), first, -1)

    def summary(self) -> list[TaskSummary]:
        presence = self._class_presence()
        exposure = self.exposure_task()
        out = []
        for t, indices in enumerate(self.tasks):
            classes = np.flatnonzero(presence[t])
            out.append(
                TaskSummary(
                    task=t,
                    num_samples=int(indices.shape[0]),
                    classes=classes.tolist(),
                    new_classes=classes[exposure[classes] == t].tolist(),
                    disjoint_classes=(
                        classes if self.kind == "clear" else self._disjoint_classes[t]
                    ).tolist(),
                    blurry_classes=[] if self.kind == "clear" else self._blurry_classes[t].tolist(),
                    blurred_out=self._blurred_out[t],
                    blurred_in=self._blurred_in[t],
                )
            )
        return out

    def to_dict(self) -> dict:
        """Kind, construction parameters, derived numbers and per-task summary (JSON-ready)."""
        return {
            "kind": self.kind,
            "params": dict(self.params),
            "num_samples": len(self),
            "num_tasks": self.num_tasks,
            "info": dict(self.info),
            "tasks": [s.to_dict() for s in self.summary()],
        }

    def __repr__(self) -> str:
        sizes = [int(t.shape[0]) for t in self.tasks]
        return (
            f"Stream(kind={self.kind!r}, seed={self.seed}, batch_size={self.batch_size}, "
            f"task_sizes={sizes})"
        )


# --------------------------------------------------------------------------- helpers


def _group_by_task(owner: np.ndarray, num_tasks: int) -> list[np.ndarray]:
    """Per task, the sample indices whose owner is that task, in dataset order (-1 = none)."""
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(num_tasks + 1))
    return [order[bounds[t] : bounds[t + 1]] for t in range(num_tasks)]


def _torch_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``: upstream's dedicated sampler generator."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _randperm(generator: torch.Generator, n: int) -> np.ndarray:
    """``torch.randperm(n)`` from ``generator`` as int64 numpy (one draw, as upstream makes it)."""
    return torch.randperm(n, generator=generator).numpy().astype(np.int64)


def _random_cuts(generator: torch.Generator, size: int, num_tasks: int) -> np.ndarray:
    """Bounds ``[0, c_1, ..., c_{T-1}, size]`` with the c's drawn with replacement in [0, size-1].

    Upstream draws ``torch.randint(0, size, (T-1,))`` (exclusive high) and sorts it, hence
    ``size - 1`` as the largest cut: task 0 is never emptied by a cut at ``size``, the last task
    may get all.
    """
    drawn = torch.randint(0, size, (num_tasks - 1,), generator=generator)
    cuts = drawn.sort().values.numpy()
    return np.concatenate(([0], cuts, [size])).astype(np.int64)


def _owner_table(pool: np.ndarray, bounds: np.ndarray, width: int) -> np.ndarray:
    """Class id -> owning task for the classes of one pool sliced at ``bounds``, -1 elsewhere."""
    table = np.full(width, -1, dtype=np.int64)
    table[pool] = np.repeat(np.arange(bounds.shape[0] - 1), np.diff(bounds))
    return table


def _blur(
    blurry_lists: Sequence[np.ndarray],
    quota_bounds: np.ndarray,
    generator: torch.Generator,
    selection: str,
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Si-Blurry step 6: move per-task quotas into a shared pool, shuffle, hand them back in order.

    Task t gives up ``min(k_t, len(blurry_t))`` entries (its first ones in dataset order, or
    random ones) and then receives up to ``k_t`` pool items; as the pool can hold fewer than
    ``sum(k_t)`` items, later tasks can come up short. The pool (the given-up entries, task by
    task) is shuffled by one ``randperm`` when ``K > 0``, as upstream does. Returns (kept per
    task, received per task, the pool in its shuffled order).
    """
    quotas = np.diff(quota_bounds)
    kept, moved = [], []
    for blurry, quota in zip(blurry_lists, quotas):
        take = int(min(quota, blurry.shape[0]))
        leave = np.ones(blurry.shape[0], dtype=bool)
        if take > 0:
            if selection == "dataset_order":
                leave[:take] = False
            else:  # our option, not upstream's: a random subset of the task's blurry list
                leave[_randperm(generator, blurry.shape[0])[:take]] = False
        kept.append(blurry[leave])
        moved.append(blurry[~leave])
    pool = np.concatenate(moved) if moved else np.zeros(0, dtype=np.int64)
    if quota_bounds[-1] > 0:  # upstream shuffles the pool only when K > 0
        pool = pool[_randperm(generator, pool.shape[0])]
    clipped = np.minimum(quota_bounds, pool.shape[0])
    received = [pool[clipped[t] : clipped[t + 1]] for t in range(quotas.shape[0])]
    return kept, received, pool


# --------------------------------------------------------------------------- builders


def clear_stream(
    labels: Any,
    class_order: Sequence[int] | None = None,
    *,
    init_cls: int,
    increment: int,
    batch_size: int = 100,
    seed: int = 0,
    num_tasks: int | None = None,
) -> Stream:
    """PILOT's class-incremental split, streamed once: task k holds ``class_order[s_k:f_k]``.

    Each task's samples are shuffled by a dedicated generator seeded with ``seed``; samples of
    classes outside ``class_order`` are never streamed. ``num_tasks``, when given, must be the
    number of tasks the split makes (PILOT's trainer expects that many segments).
    """
    labels = _as_labels(labels)
    order = _as_class_order(labels, class_order)
    batch_size = check_int("batch_size", batch_size, 1)
    seed = check_int("seed", seed, 0)
    increments = pilot_increments(order.shape[0], init_cls, increment)
    if num_tasks is not None and check_int("num_tasks", num_tasks, 1) != len(increments):
        raise ValueError(
            f"init_cls={init_cls}, increment={increment} split {order.shape[0]} classes into "
            f"{len(increments)} tasks, but {num_tasks} were expected: make the two agree"
        )
    num_tasks = len(increments)

    bounds = np.concatenate(([0], np.cumsum(increments))).astype(np.int64)
    owner = _owner_table(order, bounds, int(labels.max()) + 1)[labels]
    rng = np.random.default_rng(seed)
    tasks = [rng.permutation(indices) for indices in _group_by_task(owner, num_tasks)]

    params = {
        "init_cls": int(init_cls),
        "increment": int(increment),
        "batch_size": batch_size,
        "seed": seed,
        "class_order": None if class_order is None else order.tolist(),
    }
    info = {"num_classes": int(order.shape[0]), "increments": increments}
    stream = Stream(
        "clear", tasks, labels, batch_size=batch_size, seed=seed, params=params, info=info
    )
    logger.info(
        "clear stream: %d tasks, increments %s, %d samples", num_tasks, increments, len(stream)
    )
    return stream


def si_blurry_stream(
    labels: Any,
    class_order: Sequence[int] | None = None,
    *,
    num_tasks: int,
    n: int = 50,
    m: int = 10,
    seed: int = 0,
    batch_size: int = 100,
    blurred_selection: str = "dataset_order",
) -> Stream:
    """The Si-Blurry stream (shared/SI_BLURRY.md; upstream ``OnlineSampler``, ``varing_NM``).

    ``n``: percent of classes that are disjoint; ``m``: percent of blurry-class samples that
    are blurred. ``class_order`` only defines the class set (the algorithm shuffles it): upstream
    shuffles class ids ``0..C-1``, here the sorted class ids, which is the same thing when the
    classes are ``0..C-1``. Draws come from ``torch.Generator().manual_seed(seed)`` in upstream's
    order, so the task lists and their order equal upstream's for the same labels and seed.
    ``blurred_selection``: ``"dataset_order"`` (upstream: the first k_t entries of a task's
    blurry list, whole class blocks on class-sorted data) or ``"random"``.
    """
    labels = _as_labels(labels)
    classes = np.sort(_as_class_order(labels, class_order))
    num_tasks = check_int("num_tasks", num_tasks, 1)
    n = check_int("n", n, 0, 100)
    m = check_int("m", m, 0, 100)
    seed = check_int("seed", seed, 0)
    batch_size = check_int("batch_size", batch_size, 1)
    check_choice("blurred_selection", blurred_selection, BLURRED_SELECTIONS)

    # Step 2: pool sizes, each rounded down to a multiple of T (upstream integer arithmetic).
    num_classes = int(classes.shape[0])
    disjoint_wanted = num_classes * n // 100
    disjoint_size = disjoint_wanted // num_tasks * num_tasks
    blurry_wanted = num_classes - disjoint_size
    blurry_size = blurry_wanted // num_tasks * num_tasks
    if n > 0 and disjoint_size == 0:
        raise ValueError(
            f"Si-Blurry: n={n}% of {num_classes} classes gives {disjoint_wanted} disjoint classes, "
            f"fewer than num_tasks={num_tasks}, so the disjoint pool rounds down to 0 classes; "
            "use fewer tasks, a larger n, or n=0 for a fully blurry stream"
        )
    if n < 100 and blurry_size == 0:
        raise ValueError(
            f"Si-Blurry: {blurry_wanted} classes remain for the blurry pool, fewer than "
            f"num_tasks={num_tasks}, so it rounds down to 0 classes; "
            "use fewer tasks, a smaller n, or n=100 for a fully disjoint stream"
        )

    # Steps 1, 3, 4: one torch generator, drawn from in upstream's order (randperm of the
    # classes, then the cut points of each non-empty pool, then the blur quotas and the pool
    # shuffle, then one randperm per task); shuffle classes; random slices of each pool.
    generator = _torch_generator(seed)
    shuffled = classes[_randperm(generator, num_classes)]
    disjoint_pool = shuffled[:disjoint_size]
    blurry_pool = shuffled[disjoint_size : disjoint_size + blurry_size]
    leftover = np.sort(shuffled[disjoint_size + blurry_size :])
    zero_bounds = np.zeros(num_tasks + 1, dtype=np.int64)
    disjoint_bounds = (
        _random_cuts(generator, disjoint_size, num_tasks) if disjoint_size > 0 else zero_bounds
    )
    blurry_bounds = (
        _random_cuts(generator, blurry_size, num_tasks) if blurry_size > 0 else zero_bounds
    )

    # Step 5: per-sample owner via class lookup tables; group in dataset order.
    width = int(labels.max()) + 1
    disjoint_lists = _group_by_task(
        _owner_table(disjoint_pool, disjoint_bounds, width)[labels], num_tasks
    )
    blurry_lists = _group_by_task(
        _owner_table(blurry_pool, blurry_bounds, width)[labels], num_tasks
    )

    # Step 6: K blurred samples through the quota pool.
    blurry_samples = int(sum(b.shape[0] for b in blurry_lists))
    blur_quota = blurry_samples * m // 100
    quota_bounds = _random_cuts(generator, blur_quota, num_tasks) if blur_quota > 0 else zero_bounds
    kept, received, pool = _blur(blurry_lists, quota_bounds, generator, blurred_selection)

    # Step 7: a task's stream is its disjoint + kept blurry + received samples (upstream's list
    # order), permuted by one randperm per task, task by task.
    tasks = []
    for parts in zip(disjoint_lists, kept, received):
        joined = np.concatenate(parts)
        tasks.append(joined[_randperm(generator, joined.shape[0])])

    params = {
        "num_tasks": num_tasks,
        "n": n,
        "m": m,
        "seed": seed,
        "batch_size": batch_size,
        "blurred_selection": blurred_selection,
        "class_order": None if class_order is None else classes.tolist(),
    }
    info = {
        "stream_version": SI_BLURRY_STREAM_VERSION,
        "num_classes": num_classes,
        "disjoint_pool_size": disjoint_size,
        "blurry_pool_size": blurry_size,
        "leftover_classes": leftover.tolist(),
        "blurry_samples": blurry_samples,
        "blur_quota": blur_quota,
        "quotas": np.diff(quota_bounds).tolist(),
        "num_blurred": int(pool.shape[0]),
    }
    stream = Stream(
        "si_blurry",
        tasks,
        labels,
        batch_size=batch_size,
        seed=seed,
        params=params,
        disjoint_classes=[
            disjoint_pool[disjoint_bounds[t] : disjoint_bounds[t + 1]] for t in range(num_tasks)
        ],
        blurry_classes=[
            blurry_pool[blurry_bounds[t] : blurry_bounds[t + 1]] for t in range(num_tasks)
        ],
        blurred_out=[b.shape[0] - k.shape[0] for b, k in zip(blurry_lists, kept)],
        blurred_in=[r.shape[0] for r in received],
        blurred_indices=pool,
        info=info,
    )
    logger.info(
        "si_blurry stream: T=%d, N=%d, M=%d, D=%d, B=%d, K=%d (moved %d), task sizes %s",
        num_tasks, n, m, disjoint_size, blurry_size, blur_quota, pool.shape[0],
        [int(t.shape[0]) for t in stream.tasks],
    )  # fmt: skip
    return stream


@dataclass(frozen=True)
class StreamKind:
    """One stream kind, all it needs in one place (a new kind is one :data:`STREAM_KINDS` entry):
    its builder, the run-config keys it reads (``{builder keyword: config key}``), how tables
    and file names call it (``short``) and its LaTeX title, and the results schema versions whose
    runs of this kind trained on an older stream (``load_results`` warns about them)."""

    builder: Callable[..., Stream]
    config_keys: dict[str, str]
    short: str
    title: str
    outdated_schemas: tuple[int, ...] = ()


STREAM_KINDS: dict[str, StreamKind] = {
    "clear": StreamKind(
        clear_stream,
        {
            "init_cls": "init_cls",
            "increment": "increment",
            "batch_size": "batch_size",
            "seed": "seed",
        },
        short="clear",
        title=r"\textit{clear}",
    ),
    "si_blurry": StreamKind(
        si_blurry_stream,
        {
            "n": "si_blurry_n",
            "m": "si_blurry_m",
            "blurred_selection": "si_blurry_selection",
            "batch_size": "batch_size",
            "seed": "seed",
        },
        short="blurry",
        title=r"\textit{Si-Blurry}",
        # Schema 1: numpy's draws, not upstream Si-Blurry's task lists (SI_BLURRY_STREAM_VERSION).
        outdated_schemas=(1,),
    ),
}
#: The stream kinds, in the order the docs list them (the config's ``stream`` choices).
STREAMS = tuple(STREAM_KINDS)
#: Each kind's builder, and the run-config keys it reads (views of :data:`STREAM_KINDS`).
STREAM_BUILDERS: dict[str, Callable[..., Stream]] = {k: v.builder for k, v in STREAM_KINDS.items()}
STREAM_CONFIG_KEYS: dict[str, dict[str, str]] = {k: v.config_keys for k, v in STREAM_KINDS.items()}


def build_stream(
    kind: str,
    labels: Any,
    class_order: Sequence[int] | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Stream:
    """Build a stream by name; unknown names and unknown options raise listing the valid ones.

    With ``config`` (a run config), the kind's options come from the config keys it declares in
    ``STREAM_CONFIG_KEYS``; explicit keyword arguments win over them.
    """
    builder = STREAM_BUILDERS[check_choice("stream kind", kind, STREAMS)]
    if config is not None:
        kwargs = {
            arg: config[key] for arg, key in STREAM_CONFIG_KEYS[kind].items() if key in config
        } | kwargs
    accepted = [
        p for p in inspect.signature(builder).parameters if p not in ("labels", "class_order")
    ]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"stream kind {kind!r} does not take {unknown}; it accepts {accepted}")
    return builder(labels, class_order, **kwargs)

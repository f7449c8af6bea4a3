"""Continual-learning metrics as pure functions: arrays in, numbers out.

Why pure functions: the learner decides *when* to evaluate (by sample count or task end), and
these functions only turn predictions and accuracy matrices into numbers, so every metric can be
checked by hand without a model, a GPU or PILOT.

Conventions
-----------
* Accuracies are in percent (0-100), as in PILOT.
* The accuracy matrix ``acc`` is a ``T x T`` float array with ``acc[l, k] = a_{l,k}``, the
  accuracy on task ``l``'s classes after training on task ``k`` (0-based). Entries with
  ``l > k`` are NaN (task ``l`` not yet exposed). A whole NaN row is a task without classes of
  its own, which Si-Blurry allows (a task may expose no new class).
* In Si-Blurry, "task ``l``'s classes" are the classes *first exposed* in task ``l``.
* A column that is entirely NaN was never measured (run stopped early); the "last available
  column" is the last one holding at least one finite value.

Paper references: ``A_k`` and AP (Sec. 4.1), ``A_T`` and per-task final accuracy (appendix
"Additional Evaluation Metrics"), ``G^k`` and ``G^k_n`` (Sec. 5.1). Si-Blurry (Moon et al.,
ICCV 2023): ``A_auc``, ``A_avg``, ``A_last``, ``F_last``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .checks import check_int

__all__ = [
    "METRIC_DEFINITIONS",
    "PILOT_AVERAGE_NOTE",
    "accuracy_matrix",
    "area_under_curve",
    "average_accuracy",
    "average_performance",
    "class_forgetting",
    "final_average_accuracy",
    "final_task_accuracies",
    "forgetting",
    "per_class_accuracy",
    "run_summary_line",
    "summarize",
    "task_accuracies",
    "task_gradient_norms",
    "task_gradient_trace",
]


# --------------------------------------------------------------------------------------------
# Input checks (shared so every function fails with the same clear message)
# --------------------------------------------------------------------------------------------
def _as_label_vector(values: Any, name: str) -> np.ndarray:
    """Return a 1-D int64 array; reject floats with fractions, which hide label/score mix-ups."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of integer labels, got shape {array.shape}.")
    if array.size == 0:
        return array.astype(np.int64)
    if array.dtype.kind == "b" or array.dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold integer labels, got dtype {array.dtype}.")
    if array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
            raise TypeError(
                f"{name} must hold integer labels; got non-integer floats "
                "(pass argmax predictions, not logits or probabilities)."
            )
    return array.astype(np.int64)


def _check_predictions(y_true: Any, y_pred: Any) -> tuple[np.ndarray, np.ndarray]:
    true = _as_label_vector(y_true, "y_true")
    pred = _as_label_vector(y_pred, "y_pred")
    if true.shape != pred.shape:
        raise ValueError(
            f"y_true and y_pred must have the same length, got {true.size} and {pred.size}."
        )
    return true, pred


def _check_matrix(acc: Any) -> np.ndarray:
    """Validate a T x T accuracy matrix; finite values below the diagonal suggest a transpose."""
    matrix = np.asarray(acc, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(
            "acc must be a square T x T accuracy matrix (rows = tasks l, columns = after task k), "
            f"got shape {matrix.shape}. Build it with accuracy_matrix(columns, num_tasks)."
        )
    below_diagonal = np.tril(np.ones(matrix.shape, dtype=bool), k=-1)
    if np.any(np.isfinite(matrix[below_diagonal])):
        raise ValueError(
            "acc has finite entries acc[l, k] with l > k (a task measured before it was "
            "exposed); acc[l, k] must be the accuracy on task l AFTER task k. Did you pass the "
            "transpose? accuracy_matrix() sets these entries to NaN."
        )
    return matrix


def _last_column(matrix: np.ndarray) -> int:
    """Index of the last column with at least one finite entry; -1 if there is none."""
    measured = np.flatnonzero(np.any(np.isfinite(matrix), axis=0))
    return int(measured[-1]) if measured.size else -1


def _safe_ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator with NaN where the denominator is 0, without runtime warnings."""
    out = np.full(np.shape(numerator), np.nan, dtype=np.float64)
    np.divide(numerator, denominator, out=out, where=denominator > 0)
    return out


def _finite_mean(values: np.ndarray) -> float:
    """Mean of the finite entries; NaN (not a warning) when there are none."""
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else math.nan


# --------------------------------------------------------------------------------------------
# From predictions to accuracies
# --------------------------------------------------------------------------------------------
def task_accuracies(y_true: Any, y_pred: Any, class_task: Any, num_tasks: int) -> np.ndarray:
    """Top-1 accuracy (%) per task, over the test samples whose class belongs to that task.

    ``class_task[c]`` is the task in which class ``c`` was first exposed (-1: never exposed).
    Samples of classes with ``class_task == -1`` or ``>= num_tasks`` are ignored, so the caller
    can pass the whole test set at any point of the stream. Tasks without test samples get NaN.
    """
    num_tasks = check_int("num_tasks", num_tasks, 1)
    true, pred = _check_predictions(y_true, y_pred)
    owner = _as_label_vector(class_task, "class_task")
    if true.size and (true.min() < 0 or true.max() >= owner.size):
        raise ValueError(
            f"y_true holds class ids in [{true.min()}, {true.max()}] but class_task covers only "
            f"classes 0..{owner.size - 1}; pass one class_task entry per class."
        )
    if np.any(owner < -1):
        raise ValueError("class_task entries must be a task index >= 0, or -1 for 'never exposed'.")
    sample_task = owner[true]
    keep = (sample_task >= 0) & (sample_task < num_tasks)
    kept_task = sample_task[keep]
    counts = np.bincount(kept_task, minlength=num_tasks)
    hits = np.bincount(kept_task, weights=(true[keep] == pred[keep]), minlength=num_tasks)
    return 100.0 * _safe_ratio(hits, counts)


def per_class_accuracy(y_true: Any, y_pred: Any, num_classes: int) -> np.ndarray:
    """Top-1 accuracy (%) per class; NaN for classes with no test samples."""
    num_classes = check_int("num_classes", num_classes, 1)
    true, pred = _check_predictions(y_true, y_pred)
    if true.size and (true.min() < 0 or true.max() >= num_classes):
        raise ValueError(
            f"y_true holds class ids in [{true.min()}, {true.max()}], outside "
            f"0..{num_classes - 1}; raise num_classes or fix the labels."
        )
    counts = np.bincount(true, minlength=num_classes)
    hits = np.bincount(true, weights=(true == pred), minlength=num_classes)
    return 100.0 * _safe_ratio(hits, counts)


def accuracy_matrix(columns: Sequence[Any], num_tasks: int) -> np.ndarray:
    """Stack per-evaluation task accuracies into the T x T matrix ``acc[l, k]``.

    ``columns[k]`` is ``task_accuracies(...)`` measured after task ``k``. Entries ``l > k`` are
    forced to NaN (those tasks were not exposed yet). If the run stopped early, the missing
    columns are NaN, so every downstream metric uses only what was measured.
    """
    num_tasks = check_int("num_tasks", num_tasks, 1)
    if len(columns) > num_tasks:
        raise ValueError(
            f"got {len(columns)} evaluation columns for num_tasks={num_tasks}; "
            "evaluate once per task end."
        )
    matrix = np.full((num_tasks, num_tasks), np.nan, dtype=np.float64)
    for k, column in enumerate(columns):  # one per task: a handful, not a hot path
        values = np.asarray(column, dtype=np.float64)
        if values.shape != (num_tasks,):
            raise ValueError(
                f"columns[{k}] must have length num_tasks={num_tasks}, got shape {values.shape}."
            )
        matrix[:, k] = values
    matrix[np.tril(np.ones((num_tasks, num_tasks), dtype=bool), k=-1)] = np.nan
    return matrix


# --------------------------------------------------------------------------------------------
# From the accuracy matrix to summary numbers (paper, Sec. 4.1 and appendix)
# --------------------------------------------------------------------------------------------
def average_accuracy(acc: Any) -> np.ndarray:
    """``A_k`` for each column k: mean over tasks ``l <= k`` of ``acc[l, k]``.

    NaN rows (tasks without classes of their own) are skipped, so ``A_k`` averages the tasks
    that can be measured; an unmeasured column gives NaN.
    """
    matrix = _check_matrix(acc)
    finite = np.isfinite(matrix)
    sums = np.where(finite, matrix, 0.0).sum(axis=0)
    return _safe_ratio(sums, finite.sum(axis=0))


def average_performance(acc: Any) -> float:
    """AP = mean over k of ``A_k``, over the columns that were measured (paper Eq. for P)."""
    return _finite_mean(average_accuracy(acc))


def final_average_accuracy(acc: Any) -> float:
    """``A_T``: ``A_k`` at the last measured column (NaN if nothing was measured)."""
    matrix = _check_matrix(acc)
    last = _last_column(matrix)
    return float(average_accuracy(matrix)[last]) if last >= 0 else math.nan


def final_task_accuracies(acc: Any) -> np.ndarray:
    """Accuracy on each task after the last measured task (the appendix's per-task tables)."""
    matrix = _check_matrix(acc)
    last = _last_column(matrix)
    if last < 0:
        return np.full(matrix.shape[0], np.nan)
    return matrix[:, last].copy()


def forgetting(acc: Any) -> float:
    """Average forgetting (Chaudhry et al., 2018) at the last measured column ``K``.

    ``F = mean over l < K of ( max_{l <= k < K} acc[l, k] - acc[l, K] )``, skipping tasks that
    have no measurement (NaN rows). NaN if fewer than two columns were measured.

    Unlike PILOT's ``print_forget``, the max excludes the final column, so a task that improved
    at the end gives a *negative* contribution (backward transfer shows up instead of being
    clipped to zero).
    """
    matrix = _check_matrix(acc)
    last = _last_column(matrix)
    if last < 1:
        return math.nan
    earlier = matrix[:, :last]
    has_earlier = np.any(np.isfinite(earlier), axis=1)
    best_earlier = np.where(np.isfinite(earlier), earlier, -np.inf).max(axis=1)
    final = matrix[:, last]
    valid = has_earlier & np.isfinite(final)
    return _finite_mean(np.where(valid, best_earlier - final, np.nan))


# --------------------------------------------------------------------------------------------
# Si-Blurry metrics
# --------------------------------------------------------------------------------------------
def area_under_curve(accuracies: Sequence[float]) -> float:
    """Si-Blurry ``A_auc``: mean of the periodic accuracies (every N stream samples).

    NaN entries (an evaluation before any class was exposed) are skipped; NaN if none is left.
    """
    values = np.asarray(accuracies, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"accuracies must be a 1-D sequence, got shape {values.shape}.")
    return _finite_mean(values)


def class_forgetting(per_class_history: Any) -> float:
    """Si-Blurry ``F_last``: mean over classes of (best earlier accuracy - final accuracy).

    ``per_class_history`` is ``E x C``: the per-class accuracy (%) at each end-of-task
    evaluation (periodic evaluations do not count), NaN for classes not yet exposed. "Earlier"
    is every evaluation but the last; "final" is the last one.

    Which classes count follows upstream Si-Blurry (KHU-AGI/Si-Blurry, ``methods/_trainer.py``):
    only classes whose best earlier accuracy is **above zero**. A class never recognised before
    the last evaluation (best earlier 0) is left out, as is one not yet exposed (NaN; upstream
    scores it 0) or first exposed at the last evaluation. Counting those zero-best classes too
    would add ``0 - final <= 0`` terms and lower F_last (12.5 instead of 26.7 in the hand
    example of ``tests/test_metrics.py``). Improvement on a counted class still gives a negative
    contribution. NaN if ``E < 2`` or no class qualifies.
    """
    history = np.asarray(per_class_history, dtype=np.float64)
    if history.ndim != 2:
        raise ValueError(
            "per_class_history must be a 2-D array (evaluations x classes), "
            f"got shape {history.shape}."
        )
    if history.shape[0] < 2:
        return math.nan
    earlier = history[:-1]
    best_earlier = np.where(np.isfinite(earlier), earlier, -np.inf).max(axis=0)
    final = history[-1]
    counted = (best_earlier > 0) & np.isfinite(final)
    return _finite_mean(np.where(counted, best_earlier - final, np.nan))


# --------------------------------------------------------------------------------------------
# Gradient imbalance (paper Sec. 5.1)
# --------------------------------------------------------------------------------------------
def task_gradient_norms(
    class_grad_norm_mean: Any, task_classes: Sequence[Sequence[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """Task gradient norms ``G^k`` and their normalised form ``G^k_n = G^k / max_l G^l``.

    ``class_grad_norm_mean[j]`` is ``g^j``, the mean over training steps of the norm of the
    gradient of classifier column ``j``. ``task_classes[k]`` is ``C_k``; a class may appear in
    several tasks (blurry streams). NaN entries of ``g`` (class never trained) are skipped;
    a task with no usable class gets NaN. ``G_n`` is NaN everywhere if ``max G`` is not > 0.
    """
    grad = np.asarray(class_grad_norm_mean, dtype=np.float64)
    if grad.ndim != 1:
        raise ValueError(f"class_grad_norm_mean must be 1-D (one g^j per class), got {grad.shape}.")
    num_tasks = len(task_classes)
    if num_tasks == 0:
        raise ValueError("task_classes is empty; pass one list of class ids per task.")
    sizes = np.array([len(classes) for classes in task_classes], dtype=np.int64)
    class_ids = (
        np.concatenate([np.asarray(classes, dtype=np.int64) for classes in task_classes])
        if sizes.sum()
        else np.zeros(0, dtype=np.int64)
    )
    if class_ids.size and (class_ids.min() < 0 or class_ids.max() >= grad.size):
        raise ValueError(
            f"task_classes holds class ids in [{class_ids.min()}, {class_ids.max()}] but "
            f"class_grad_norm_mean has only {grad.size} classes."
        )
    task_of_entry = np.repeat(np.arange(num_tasks), sizes)
    values = grad[class_ids]
    usable = np.isfinite(values)
    sums = np.bincount(task_of_entry[usable], weights=values[usable], minlength=num_tasks)
    counts = np.bincount(task_of_entry[usable], minlength=num_tasks)
    task_norm = _safe_ratio(sums, counts)
    finite = task_norm[np.isfinite(task_norm)]
    peak = finite.max() if finite.size else math.nan
    if not peak > 0:
        return task_norm, np.full(num_tasks, np.nan)
    return task_norm, task_norm / peak


def task_gradient_trace(
    class_grad_norm_trace: Any, task_classes: Sequence[Sequence[int]]
) -> np.ndarray:
    """Per-step task gradient norms ``G^k_t = mean_{j in C_k} ||g_t^j||`` (paper Fig. 2).

    ``class_grad_norm_trace`` is ``steps x classes`` (the norm of each classifier column's gradient
    at each optimizer step); the result is ``steps x tasks``. Averaging it over the steps gives
    :func:`task_gradient_norms`'s ``G^k``. A task without classes gets a NaN column.
    """
    trace = np.asarray(class_grad_norm_trace, dtype=np.float64)
    if trace.ndim != 2:
        raise ValueError(f"class_grad_norm_trace must be steps x classes, got shape {trace.shape}.")
    columns = []
    for k, classes in enumerate(task_classes):
        ids = np.asarray(classes, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= trace.shape[1]):
            raise ValueError(
                f"task_classes[{k}] holds class ids in [{ids.min()}, {ids.max()}] but the trace "
                f"has only {trace.shape[1]} classes."
            )
        columns.append(trace[:, ids].mean(axis=1) if ids.size else np.full(len(trace), np.nan))
    return np.stack(columns, axis=1) if columns else np.zeros((len(trace), 0))


# --------------------------------------------------------------------------------------------
# Everything in one JSON-friendly dict
# --------------------------------------------------------------------------------------------
def _number_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _list_or_none(values: np.ndarray) -> list[Any]:
    return [_list_or_none(v) if np.ndim(v) else _number_or_none(v) for v in values]


def online_accuracy(correct: int, samples: int) -> float | None:
    """A_online (%): the stream samples predicted right by the model as it stood before training
    on them, over the samples scored (sample-weighted, as Avalanche's accuracy metric that
    Ghunaim et al. report); None when none was scored."""
    if samples < 0 or not 0 <= correct <= samples:
        raise ValueError(
            f"online counts must satisfy 0 <= correct <= samples, got {correct}/{samples}"
        )
    return 100.0 * correct / samples if samples else None


def summarize(
    acc: Any,
    *,
    periodic: Sequence[float] | None = None,
    per_class_history: Any | None = None,
    end_of_task: Sequence[float] | None = None,
    online: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """All metrics in one JSON-friendly dict (NaN -> None).

    ``periodic``: accuracies from the periodic evaluations (Si-Blurry ``A_auc``).
    ``per_class_history``: ``E x C`` per-class accuracies at task ends (Si-Blurry ``F_last``,
    upstream's rule: only classes whose best earlier accuracy is above zero count).
    ``end_of_task``: sample-level accuracy over all exposed classes after each task
    (Si-Blurry ``A_avg`` = mean, ``A_last`` = last). Si-Blurry keys are None when their input
    is not given: they are sample-level numbers and cannot be derived from ``acc`` alone.
    ``online``: (stream samples predicted right before training on them, samples scored), for
    ``A_online`` (Ghunaim et al. 2023's average online accuracy, docs/protocol.md); None when
    not given or nothing was scored.
    """
    matrix = _check_matrix(acc)
    end_values = None if end_of_task is None else np.asarray(end_of_task, dtype=np.float64)
    if end_values is not None and end_values.ndim != 1:
        raise ValueError(f"end_of_task must be a 1-D sequence, got shape {end_values.shape}.")
    finite_end = None if end_values is None else end_values[np.isfinite(end_values)]
    return {
        "accuracy_matrix": _list_or_none(matrix),
        "A_k": _list_or_none(average_accuracy(matrix)),
        "AP": _number_or_none(average_performance(matrix)),
        "A_T": _number_or_none(final_average_accuracy(matrix)),
        "final_task_accuracies": _list_or_none(final_task_accuracies(matrix)),
        "forgetting": _number_or_none(forgetting(matrix)),
        "A_auc": None if periodic is None else _number_or_none(area_under_curve(periodic)),
        "A_avg": None if finite_end is None else _number_or_none(_finite_mean(finite_end)),
        "A_last": (None if finite_end is None or not finite_end.size else float(finite_end[-1])),
        "A_online": online_accuracy(*online) if online is not None else None,
        "F_last": (
            None
            if per_class_history is None
            else _number_or_none(class_forgetting(per_class_history))
        ),
    }


# --------------------------------------------------------------------------------------------
# The numbers in words: one definition for the run's log line and the report's legend
# --------------------------------------------------------------------------------------------
#: What each summary number is, in the words a reader checks against the functions above (the
#: report's legend and the run's summary line both read these, so they cannot drift apart).
METRIC_DEFINITIONS: dict[str, str] = {
    "AP": (
        "average performance, the paper's metric (Sec. 4.1): the mean over task ends k = 1..T "
        "of A_k, where A_k is the mean accuracy (%) on tasks 1..k after training on task k"
    ),
    "A_T": "A_k after the last task T: the final average accuracy",
    "forgetting": (
        "average forgetting (Chaudhry et al., 2018) over tasks l = 1..T-1: task l's best "
        "accuracy after tasks l..T-1 minus its accuracy after the last task T, averaged; "
        'negative where a task improved (PILOT\'s "Forgetting (CNN)" takes the best over all '
        "T task ends, so it never goes below 0)"
    ),
    "A_auc": (
        "Si-Blurry's A_auc: the mean accuracy on the classes seen so far over the periodic "
        "evaluations (one every eval_period stream samples); - when eval_period is off"
    ),
    "A_online": (
        "average online accuracy (Ghunaim et al., CVPR 2023): the share of stream samples the "
        "model predicted right before training on them; - unless online_accuracy is on (real-time "
        "mode turns it on)"
    ),
}

#: PILOT's own average, which its trainer logs beside ours: a different number from AP.
PILOT_AVERAGE_NOTE = (
    'PILOT\'s "Average Accuracy (CNN)" line is a different average: its top-1 over all seen test '
    "images (sample-weighted, not per task), averaged over task ends; it is not the paper's AP"
)


def _percent(value: Any) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}"


def run_summary_line(metrics: dict[str, Any], results_file: Any = None) -> str:
    """The line a run logs when it ends: AP named as the paper's metric, and PILOT's
    "Average Accuracy (CNN)", which its trainer logs next, named as another average, so
    that a reader of the log compares the right number with the paper."""
    line = (
        f"AP {_percent(metrics.get('AP'))} (the paper's metric: average performance, Sec. 4.1), "
        f"A_T {_percent(metrics.get('A_T'))} (after the last task). {PILOT_AVERAGE_NOTE}."
    )
    return line if results_file is None else f"{line} Results: {results_file}"

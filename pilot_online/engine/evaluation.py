"""The run's evaluations: at each task end (the accuracy matrix a_{l,k}) and, if ``eval_period``
is set, every ``eval_period`` stream samples (A_auc).

Evaluation is decided here and only here. Task ends are the stream's segments, which PILOT's
trainer walks one ``incremental_train`` call at a time; the learner itself never reads them (no
task identity reaches the model). Groups come from the stream (classes first exposed in each
task), so they are right for Si-Blurry too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core import metrics
from ..core.checks import integer, optional
from ..core.lazy import torch
from ..core.streams import Stream
from .events import RunClock, RunListener, StepEvent
from .loop import OnlineLoop
from .options import ConfigKey, Options, option


@dataclass(frozen=True)
class EvaluationOptions(Options):
    """The evaluations' config keys (``engine/config.py`` gathers every component's)."""

    eval_period: int | None = option(
        ConfigKey(
            None,
            "also evaluate every N stream samples (A_auc); null = off",
            check=optional(integer(1)),
        )
    )


class Evaluator(RunListener):
    """Evaluates the loop on the test samples of the classes exposed so far, and keeps what
    every evaluation measured."""

    def __init__(
        self,
        loop: OnlineLoop,
        stream: Stream,
        data: Any,
        config: Mapping[str, Any],
        clock: RunClock,
        live_log: Any = None,
    ) -> None:
        self.loop, self.stream, self.data, self.clock = loop, stream, data, clock
        self.live_log = live_log
        num_classes = loop.num_classes
        exposure = np.full(num_classes, -1, dtype=np.int64)
        first = stream.exposure_task()[:num_classes]
        exposure[: len(first)] = first
        self.exposure = exposure  # class -> task of first exposure (-1: never streamed)
        self.columns: list[np.ndarray] = []
        self.class_history: list[np.ndarray] = []
        # Sample-level accuracy at each task end (Si-Blurry's A_avg and A_last).
        self.end_of_task: list[float] = []
        self.periodic: list[dict[str, float]] = []
        # PILOT's evaluation report of each completed task: what a rerun hands back.
        self.task_reports: list[dict[str, Any]] = []
        self.period = EvaluationOptions.of(config).eval_period
        self.next_periodic = self.period if self.period else None

    # -- periodic ----------------------------------------------------------------------------------
    def on_step(self, event: StepEvent) -> None:
        if self.next_periodic is not None and event.samples_passed >= self.next_periodic:
            self.evaluate_periodic(event.samples_passed)

    def evaluate_periodic(self, samples_passed: int) -> None:
        """Top-1 accuracy on the test samples of the classes seen so far (one point of A_auc)."""
        while self.next_periodic <= samples_passed:
            self.next_periodic += int(self.period)
        allowed = self.loop.seen.cpu().numpy()
        y_pred, y_true = self.predict(allowed, topk=1)
        accuracy = float(np.mean(y_pred[:, 0] == y_true) * 100) if len(y_true) else float("nan")
        self.periodic.append({"samples_seen": samples_passed, "accuracy": accuracy})
        if self.live_log is not None:
            self.live_log.on_eval("periodic", {"accuracy": accuracy})

    # -- task ends ---------------------------------------------------------------------------------
    def predict(self, allowed: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        start = time.perf_counter()
        test_labels = np.asarray(self.data.test_labels)
        indices = np.flatnonzero(allowed[test_labels])
        batches = self.data.eval_batches(indices)
        # Deterministic test transforms: the same index is the same input at every evaluation,
        # so the loop may cache the frozen query pass by index.
        sample_ids = indices if getattr(self.data, "deterministic_eval", False) else None
        y_pred, y_true = self.loop.predict(
            batches, torch.from_numpy(allowed), topk, sample_ids=sample_ids
        )
        self.clock.eval_seconds += time.perf_counter() - start
        return y_pred, y_true

    def evaluate_task_end(self, task: int) -> dict[str, Any]:
        """Evaluate on test samples of every exposed class; record column ``task`` of a_{l,k}.

        Returns PILOT's ``cnn_accy`` structure; ``top5`` is top-min(5, seen)."""
        allowed = (self.exposure >= 0) & (self.exposure <= task)
        y_pred, y_true = self.predict(allowed, topk=5)
        top1 = y_pred[:, 0] if len(y_pred) else np.zeros(0, dtype=np.int64)
        column = metrics.task_accuracies(y_true, top1, self.exposure, self.stream.num_tasks)
        self.columns.append(column)
        self.class_history.append(metrics.per_class_accuracy(y_true, top1, self.loop.num_classes))

        def accuracy(mask: np.ndarray) -> float:
            return round(float(np.mean(top1[mask] == y_true[mask]) * 100), 2) if mask.any() else 0.0

        exposure_of_sample = self.exposure[y_true]
        grouped = {
            f"task-{t:02d}": round(float(column[t]), 2)
            for t in range(task + 1)
            if not np.isnan(column[t])
        }
        grouped["total"] = accuracy(np.ones(len(y_true), dtype=bool))
        grouped["old"] = accuracy(exposure_of_sample < task)
        grouped["new"] = accuracy(exposure_of_sample == task)
        self.end_of_task.append(grouped["total"])
        if self.live_log is not None:
            named = {"accuracy": grouped["total"], "old": grouped["old"], "new": grouped["new"]}
            named.update(
                {f"task_{t + 1}": v for t, v in enumerate(column[: task + 1]) if np.isfinite(v)}
            )
            self.live_log.on_eval("task_end", named)
        topk_hit = (y_pred == y_true[:, None]).any(1) if len(y_true) else np.zeros(0, dtype=bool)
        return {
            "grouped": grouped,
            "top1": grouped["total"],
            "top5": round(float(np.mean(topk_hit) * 100), 2) if len(y_true) else 0.0,
        }

    def accuracy_matrix(self) -> np.ndarray:
        return metrics.accuracy_matrix(self.columns, self.stream.num_tasks)

    def summary(self, online: tuple[int, int]) -> dict[str, Any]:
        """The results file's ``metrics``: the accuracy matrix's metrics, A_auc, A_avg and
        A_last, and A_online from ``online`` (right, scored)."""
        history = np.stack(self.class_history) if self.class_history else None
        return metrics.summarize(
            self.accuracy_matrix(),
            periodic=[p["accuracy"] for p in self.periodic] or None,
            per_class_history=history,
            end_of_task=self.end_of_task or None,
            online=online,
        )

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "columns": list(self.columns),
            "class_history": list(self.class_history),
            "end_of_task": list(self.end_of_task),
            "periodic": list(self.periodic),
            "next_periodic": self.next_periodic,
            "task_reports": list(self.task_reports),
            "eval_seconds": self.clock.eval_seconds,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.columns = [np.asarray(c) for c in state["columns"]]
        self.class_history = [np.asarray(h) for h in state["class_history"]]
        self.end_of_task = [float(v) for v in state["end_of_task"]]
        self.periodic = [dict(p) for p in state["periodic"]]
        self.next_periodic = state["next_periodic"]
        self.task_reports = list(state["task_reports"])
        self.clock.eval_seconds = float(state["eval_seconds"])

"""What a run tells its listeners, and what it measures of itself: its clock and peak memory.

The session (``session.py``) is the one driver of a run: it walks the stream, trains a step on
each batch, and tells its listeners what happened. Everything else a run does listens: the
real-time scoring and A_online (``scoring.py``), the evaluations (``evaluation.py``), the
checkpoints and stop signals (``checkpointer.py``), the progress bar (``console.py``), the live
log (``live_log.py``) and the results file (``results_file.py``). A listener keeps its own state,
and one that must survive a resume returns it from ``state_dict``.

Training emits three kinds of event: a task's start and end, each step, and each consolidation
firing (:meth:`RunListener.on_firing`). Inside the loop, the parameters a firing adds, replaces or
restarts reach the optimiser, FGH, the prototypes, the memory and the checkpoint through one
:class:`~pilot_online.engine.loop.ParameterChange`.
"""

from __future__ import annotations

import gc
import resource
from dataclasses import dataclass
from typing import Any

from ..core.lazy import torch
from .loop import StepStats


@dataclass
class RunClock:
    """Wall time of a run by what it was spent on, resumed runs included: training steps,
    evaluations, and A_online's eval-mode passes (evaluation too, kept out of training time)."""

    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    online_seconds: float = 0.0

    @property
    def total(self) -> float:
        return self.train_seconds + self.eval_seconds + self.online_seconds


def reset_peak_memory(device: torch.device) -> None:
    """Start the run's peak-memory count: PILOT runs every seed of a config in one process, and
    without a reset each seed would report the maximum over all earlier seeds. The collection
    first frees what only reference cycles still hold of the previous seed's network. On the CPU
    the peak resident set size cannot be reset: it stays the process's."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory since :func:`reset_peak_memory` on CUDA (the run's own); peak
    resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass(frozen=True)
class StepEvent:
    """One training step and the stream batches it consumed.

    In real-time mode the batches that passed while the step ran were scored by the model the
    step started from (``passing_correct`` of ``passing_samples``, in ``passing_batches``
    batches) and never trained on."""

    task: int
    #: Batches of the task passed after this step (trained or scored): a checkpoint's position.
    step: int
    #: Batches the task has.
    task_batches: int
    stats: StepStats
    #: Stream batches passed before this step, over the whole stream.
    passed_before: int
    #: Stream samples passed after this step, trained on or not.
    samples_passed: int
    #: Stream batches trained on so far, this step's included.
    batches_trained: int
    passing_correct: Any = None
    passing_samples: int = 0
    passing_batches: int = 0

    @property
    def passed(self) -> int:
        """Stream batches passed after this step."""
        return self.passed_before + 1 + self.passing_batches


class RunListener:
    """A part of a run that hears the session's events; every hook does nothing by default.

    The session calls the listeners in its order (``OnlineSession.listeners``) and keeps the
    time they take out of the training time."""

    def on_task_start(self, task: int, first: int) -> None:
        """Training of ``task`` starts at its batch ``first`` (0, or where a resume left it)."""

    def on_firing(self, event: StepEvent) -> None:
        """The consolidation trigger fired at the start of this step (``event.stats.firing``:
        its index): the method consolidated before the step trained. Heard before
        :meth:`on_step` of the same step."""

    def on_step(self, event: StepEvent) -> None:
        """A step trained (and, in real-time mode, the batches that passed were scored)."""

    def on_task_trained(self, task: int) -> None:
        """The stream segment of ``task`` is consumed (before its evaluation)."""

    def on_task_left(self, task: int) -> None:
        """Training of ``task`` ended, consumed or not (an error, a stop): always called."""

    def on_close(self) -> None:
        """The run ended (finished, failed or stopped): release what the listener holds."""

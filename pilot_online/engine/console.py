"""What a person watching a run sees: a progress bar per task with the loss, the accuracy and
A_online of the last ``log_interval`` batches, and a progress line with an ETA per task end.

The window's sums stay on the device and are read once per interval (one transfer), never per
step: the bar costs a training step nothing on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.checks import integer
from ..core.lazy import torch
from ..core.progress import progress_line
from .events import RunClock, RunListener, StepEvent
from .options import ConfigKey, Options, option
from .scoring import OnlineScoring

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsoleOptions(Options):
    """The console's config keys (``engine/config.py`` gathers every component's)."""

    log_interval: int = option(
        ConfigKey(
            10, "steps between progress-bar updates (each one syncs the device)", check=integer(1)
        )
    )


class ProgressBar(RunListener):
    """The task's bar (``progress``: shown or not) and the run's progress lines."""

    def __init__(
        self,
        config: Mapping[str, Any],
        num_tasks: int,
        task_batches: list[int],
        scoring: OnlineScoring,
        device: torch.device,
        shown: bool = True,
    ) -> None:
        self.num_tasks, self.task_batches, self.scoring = num_tasks, task_batches, scoring
        self.interval = int(ConsoleOptions.of(config).log_interval)
        self.device = device
        self.shown = shown
        self.bar: Any = None

    def on_task_start(self, task: int, first: int) -> None:
        # Here, not at the top: the key table imports this module for log_interval, and
        # resolving a config needs no progress bar.
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=self.task_batches[task],
            initial=first,
            desc=f"task {task + 1}/{self.num_tasks}",
            disable=not self.shown,
            leave=False,
        )
        self.loss_sum = torch.zeros((), device=self.device)
        self.correct_sum = torch.zeros((), device=self.device, dtype=torch.long)
        self.seen = self.steps = 0
        self.previous = first

    def on_step(self, event: StepEvent) -> None:
        stats = event.stats
        if not stats.skipped:
            self.loss_sum += stats.loss
            self.steps += 1
        self.correct_sum += stats.correct
        self.seen += stats.samples
        previous, self.previous = self.previous, event.step
        if (
            event.step // self.interval > previous // self.interval
            or event.step == event.task_batches
        ):
            loss, correct, online = torch.stack(  # the only device reads
                [self.loss_sum.float(), self.correct_sum.float(), self.scoring.correct.float()]
            ).tolist()
            shown = {
                "loss": f"{loss / max(self.steps, 1):.3f}",
                "acc": f"{100.0 * correct / self.seen:.1f}",
            }
            if self.scoring.samples:  # scored only with online_accuracy on
                shown["A_online"] = f"{100.0 * online / self.scoring.samples:.1f}"
            if self.scoring.realtime is not None:
                shown["trained"] = f"{event.batches_trained}/{event.passed}"
            self.bar.set_postfix(**shown)
            self.bar.update(event.step - self.bar.n)
            self.loss_sum.zero_(), self.correct_sum.zero_()
            self.seen = self.steps = 0

    def on_task_trained(self, task: int) -> None:
        self.bar.update(self.task_batches[task] - self.bar.n)  # batches scored in earlier steps

    def on_task_left(self, task: int) -> None:
        self.close()

    def on_close(self) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def task_evaluated(self, task: int, clock: RunClock) -> None:
        """The whole run's progress, with an ETA at the pace so far (resumed time included)."""
        logger.info(progress_line("run", task + 1, self.num_tasks, clock.total))

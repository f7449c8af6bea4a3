"""Live logging of a run to TensorBoard (config ``"logger": "tensorboard"``).

The logger is one of the session's listeners (``events.py``: :meth:`TensorBoardLogger.on_step`,
``on_task_trained``, ``on_close``), and the evaluations call its ``on_eval``; with ``logger``
null no object exists and ``torch.utils.tensorboard`` is never imported, so a run without the
key is unchanged. The x axis of every scalar is the global stream step: the number of stream
batches consumed so far (1 after the first batch).

Step scalars are kept on the device and read once every ``log_interval`` steps (the session's
progress bar reads the device there too), so logging adds no per-step host sync:

- ``train/loss``: the step's training loss (the sum of its terms); ``train/loss_<term>``: each
  term (``ce``, ``prototypes`` = L_P, ``method`` = the method's own loss, ...);
- ``train/batch_accuracy``: accuracy (%) of the training forward on its stream batch (train
  mode, the training logit mask), before the update; ``train/running_accuracy``: the same over
  the stream so far;
- ``online/batch_accuracy``: the batch's accuracy (%) as the model predicted it before training
  on it (eval mode, classes seen before the batch: docs/protocol.md, A_online);
  ``online/A_online``: the same over the stream so far (since the session started or resumed);
- every ``log_interval`` steps and at each task end: ``fgh/alpha_{mean,std,min,max}`` over FGH's
  coefficients (``fgh/group<i>/...`` for several groups), ``gradient_imbalance/G_n/task_<k>``
  (running G^k_n, paper Sec. 5.1, over the tasks whose classes were seen, from the mean
  classifier-row gradient norms so far) and ``gradient_imbalance/max_over_mean`` (max over the
  seen classes of g^j divided by their mean);
- at each consolidation firing: ``consolidation/firings`` (the firings so far, at the step after
  which the trigger fired);
- at evaluations: ``eval/periodic_accuracy`` (``eval_period``), and at task ends
  ``eval/accuracy``, ``eval/old``, ``eval/new`` and ``eval/task_<k>`` (tasks numbered from 1).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.checks import optional, string
from ..core.fgh_stats import alpha_statistics
from ..core.lazy import torch
from ..core.metrics import task_gradient_norms
from .console import ConsoleOptions
from .events import RunListener, StepEvent
from .options import ConfigKey, Options, option

if TYPE_CHECKING:
    from .loop import OnlineLoop, StepStats

#: Values of the ``logger`` config key (null: no live logging).
LOGGERS = (None, "tensorboard")
INSTALL_HINT = 'pip install tensorboard (or pip install -e ".[tensorboard]")'


def check_logger_available(name: str | None) -> None:
    """Fail before any training when the configured logger's package is missing."""
    if name == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ImportError(f'"logger": "tensorboard" needs the tensorboard package: {INSTALL_HINT}')


def _logger(name: str, value: Any) -> Any:
    """A live logger whose package is installed (the name itself is checked by ``choices``)."""
    try:
        check_logger_available(value)
    except ImportError as err:
        raise ValueError(str(err)) from None
    return value


@dataclasses.dataclass(frozen=True)
class LiveLogOptions(Options):
    """The live log's config keys (``engine/config.py`` gathers every component's)."""

    logger: str | None = option(
        ConfigKey(
            None,
            "live logging: null (off) or tensorboard (scalars every log_interval)",
            choices=LOGGERS,
            check=_logger,
        )
    )
    logger_dir: str | None = option(
        ConfigKey(
            None,
            "TensorBoard folder (default: beside the results file)",
            check=optional(string("a folder path")),
        )
    )


def default_log_dir(results_path: Path | None, logger_dir: str | None) -> Path:
    """One folder per run: ``<logger_dir>/<results stem>``, or ``<results stem>.tensorboard``
    beside the results file (``runs/tensorboard/<time>`` when the run writes no results)."""
    stem = results_path.name.removesuffix(".results.json") if results_path else None
    if logger_dir is not None:
        return Path(logger_dir) / (stem or time.strftime("run-%Y%m%d-%H%M%S", time.gmtime()))
    if results_path is not None:
        return results_path.with_name(f"{stem}.tensorboard")
    return Path("runs", "tensorboard", time.strftime("run-%Y%m%d-%H%M%S", time.gmtime()))


class TensorBoardLogger(RunListener):
    """Writes a run's scalars with ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(
        self,
        log_dir: Path,
        loop: OnlineLoop,
        task_classes: list[list[int]],
        interval: int = 10,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                f'"logger": "tensorboard" needs the tensorboard package: {INSTALL_HINT}'
            ) from err
        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.loop = loop
        self.task_classes = task_classes
        self.interval = max(int(interval), 1)
        self.step = 0  # stream batches consumed
        self.correct = 0
        self.samples = 0
        self.online_correct = 0
        self.online_samples = 0
        self._pending: list[tuple[int, StepStats]] = []
        self._summarised_at = 0  # the step of the last alpha / imbalance summary
        self._closed = False

    # -- hooks -------------------------------------------------------------------------------------
    def on_step(self, event: StepEvent) -> None:
        """One stream batch was trained on (in real-time mode with the batches that passed,
        scored only, while it ran); its device tensors are read at the next flush."""
        stats = _with_passing(event)
        self.step += stats.stream_batches
        self._pending.append((self.step, stats))
        if self.step % self.interval == 0:
            self.flush()
            self.summarise()

    def on_task_trained(self, task: int) -> None:
        self.end_task()

    def on_close(self) -> None:
        self.close()

    def end_task(self) -> None:
        """A stream segment ended: write what is pending and the summaries at this step."""
        self.flush()
        self.summarise()

    def on_firing(self, event: StepEvent) -> None:
        """The trigger fired after ``self.step`` stream batches: ``consolidation/firings``, the
        firings so far, at that step."""
        self.writer.add_scalar("consolidation/firings", event.stats.firing + 1, self.step)

    def on_eval(self, kind: str, accuracies: dict[str, float]) -> None:
        """An evaluation (``periodic`` or ``task_end``) with its accuracies by name (%)."""
        self.flush()  # the steps before it come first in the event file
        for name, value in accuracies.items():
            tag = "eval/periodic_accuracy" if kind == "periodic" else f"eval/{name}"
            self.writer.add_scalar(tag, value, self.step)
        self.writer.flush()

    def flush(self) -> None:
        """Write the pending steps' scalars, with one device read."""
        if not self._pending:
            return
        steps = [step for step, _ in self._pending]
        stats = [s for _, s in self._pending]
        self._pending = []
        names = sorted({name for s in stats for name in s.terms})
        rows = [
            torch.stack(
                [
                    s.loss.float().reshape(()),
                    s.correct.float().reshape(()),
                    _online(s).float().reshape(()),
                    *(
                        s.terms[n].float().reshape(())
                        if n in s.terms
                        else s.loss.new_tensor(math.nan)
                        for n in names
                    ),
                ]
            )
            for s in stats
        ]
        values = torch.stack(rows).cpu().numpy()  # the one host sync
        for step, s, row in zip(steps, stats, values):
            self.writer.add_scalar("train/loss", row[0], step)
            for name, value in zip(names, row[3:]):
                self.writer.add_scalar(f"train/loss_{name}", value, step)
            self.correct += int(row[1])
            self.samples += s.samples
            self.writer.add_scalar("train/batch_accuracy", 100.0 * row[1] / s.samples, step)
            self.writer.add_scalar(
                "train/running_accuracy", 100.0 * self.correct / self.samples, step
            )
            if s.online_correct is not None:
                scored = s.samples if s.online_samples is None else s.online_samples
                self.online_correct += int(row[2])
                self.online_samples += scored
                self.writer.add_scalar("online/batch_accuracy", 100.0 * row[2] / scored, step)
                self.writer.add_scalar(
                    "online/A_online", 100.0 * self.online_correct / self.online_samples, step
                )

    def summarise(self) -> None:
        """FGH's alpha statistics and the gradient-imbalance summary at the current step."""
        if self._summarised_at == self.step or self.step == 0:
            return
        self._summarised_at = self.step
        self._log_alphas(self.step)
        self._log_imbalance(self.step)

    def close(self) -> None:
        """Write everything left and close the event file (idempotent)."""
        if self._closed:
            return
        self.end_task()
        self.writer.close()
        self._closed = True

    # -- interval summaries ------------------------------------------------------------------------
    def _log_alphas(self, step: int) -> None:
        fgh = getattr(self.loop, "fgh", None)
        if fgh is None:
            return
        groups = alpha_statistics(fgh)
        for index, group in enumerate(groups):
            prefix = "fgh/" if len(groups) == 1 else f"fgh/group{index}/"
            for name in ("mean", "std", "min", "max"):
                self.writer.add_scalar(f"{prefix}alpha_{name}", float(group[name]), step)

    def _log_imbalance(self, step: int) -> None:
        g = self.loop.gradient_statistics(include_trace=False)["mean"]
        seen = self.loop.seen.cpu().numpy()
        tasks = [
            k for k, classes in enumerate(self.task_classes) if classes and seen[classes].any()
        ]
        if not tasks or self.loop.optimizer_steps == 0:
            return
        _, g_n = task_gradient_norms(g, [self.task_classes[k] for k in tasks])
        for k, value in zip(tasks, g_n):
            if np.isfinite(value):
                self.writer.add_scalar(f"gradient_imbalance/G_n/task_{k + 1}", value, step)
        seen_norms = g[seen[: len(g)]]
        if seen_norms.size and seen_norms.mean() > 0:
            ratio = float(seen_norms.max() / seen_norms.mean())
            self.writer.add_scalar("gradient_imbalance/max_over_mean", ratio, step)


def _online(stats: StepStats) -> torch.Tensor:
    """The step's A_online count, NaN where it was not scored."""
    if stats.online_correct is None:
        return stats.loss.new_tensor(math.nan)
    return stats.online_correct


def make_live_logger(
    config: Any, loop: OnlineLoop, task_classes: list[list[int]], results_path: Path | None
) -> TensorBoardLogger | None:
    """The logger ``config["logger"]`` asks for, or None (no import, nothing created)."""
    options = LiveLogOptions.of(config)
    name = options.logger
    if name is None:
        return None
    if name != "tensorboard":
        raise ValueError(f"unknown logger {name!r}; valid: null, 'tensorboard'")
    log_dir = default_log_dir(results_path, options.logger_dir)
    interval = int(ConsoleOptions.of(config).log_interval)
    return TensorBoardLogger(log_dir, loop, task_classes, interval)


def _with_passing(event: StepEvent) -> StepStats:
    """A real-time step's stats with the batches that passed during it: its A_online count
    with theirs, which advance the stream step too."""
    stats = event.stats
    if not event.passing_batches:
        return stats
    own = stats.online_correct
    correct = event.passing_correct
    return dataclasses.replace(
        stats,
        online_correct=correct if own is None else own + correct,
        online_samples=stats.samples + event.passing_samples,
        stream_batches=stats.stream_batches + event.passing_batches,
    )

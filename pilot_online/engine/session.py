"""One online run over a stream: task segments, evaluations, the accuracy matrix, the results file.

Evaluation is decided here and only here: at each task end (the accuracy matrix a_{l,k}) and, if
``eval_period`` is set, every ``eval_period`` stream samples (A_auc). Task ends are the stream's
segments, which PILOT's trainer walks one ``incremental_train`` call at a time; the learner itself
never reads them (no task identity reaches the model).

Needs no PILOT: data comes from any :class:`DataSource`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import io
import itertools
import logging
import resource
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from ..core import metrics
from ..core.files import human_bytes, write_atomic
from ..core.progress import progress_line
from ..core.realtime import DEFAULT_REFERENCE, RealtimeSchedule, realtime_on
from ..core.results import build_results, to_jsonable, write_results
from ..core.rng import capture_rng_state, restore_rng_state
from ..core.streams import Stream
from .checkpoint import (
    CheckpointError,
    checkpoint_path_for,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)
from .loop import OnlineLoop, StepStats, _synchronize

logger = logging.getLogger(__name__)

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]
#: Builds a fresh loop (adapter, network, mixins) for a resolved config: what ``realtime:
#: "measured"`` times the method's and the reference's steps with (the PILOT learner gives one).
LoopFactory = Callable[[Mapping[str, Any]], OnlineLoop]

#: ``realtime: "measured"``: training steps run before the timed ones (the replay memory fills,
#: lazy initialisation and kernel selection happen), and steps timed; C is the ratio of the
#: fastest timed step of each (the least disturbed by other work on the machine).
MEASURE_WARMUP_STEPS = 2
MEASURE_TIMED_STEPS = 3

#: ``checkpoint_every: "auto"``: seconds of training between two checkpoints, besides the one at
#: each task end. Ten minutes bound the work a kill without warning loses (a SIGTERM loses
#: none); a full ViT-B fine-tuning checkpoint (1 GB with Adam) took 20 s to write on a slow
#: virtual disk (docs/checkpoints.md), under 4% of the interval, and less on a local SSD.
AUTO_CHECKPOINT_SECONDS = 600.0


class RunInterrupted(SystemExit):
    """SIGINT or SIGTERM stopped the run at a point where its state is whole (after a step, or
    after a task's evaluation), once that point was checkpointed. A ``SystemExit`` with code 128
    + the signal's number, so PILOT's ``main.py`` and ``pilot-online run`` exit without a
    traceback; the session has printed the one line that says where and what to do."""


def _logs_reach_stderr(log: logging.Logger) -> bool:
    """Whether a WARNING of ``log`` reaches stderr: through a handler of its chain writing there,
    or, with no handler at all, through logging's last resort (which writes there)."""
    handlers = []
    current: logging.Logger | None = log
    while current is not None:
        handlers += current.handlers
        current = current.parent if current.propagate else None
    if not handlers:
        return True
    return any(
        isinstance(h, logging.StreamHandler)
        and getattr(h, "stream", None) is sys.stderr
        and h.level <= logging.WARNING
        for h in handlers
    )


class StopSignals:
    """While entered (``with``), SIGINT and SIGTERM only note that a stop was asked for; the
    session then checkpoints at its next whole point and stops (:class:`RunInterrupted`). A
    second signal stops at once (``KeyboardInterrupt``). Entered around the session's own
    calls only, so that no handler outlives them; outside them (PILOT's trainer between two
    calls, where the last task-end checkpoint is current) the process's handlers apply. Signals
    reach Python's main thread only: elsewhere (a Ray actor's thread) nothing is installed."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(
        self,
        on_first: Callable[[int], None] | None = None,
        on_second: Callable[[int], None] | None = None,
    ) -> None:
        """``on_first(signum)`` runs at the first signal (the session says, at once, what will
        happen); ``on_second(signum)`` at the second, and should raise (the session says what
        is on disk, then stops): without it, ``KeyboardInterrupt``."""
        self.received: int | None = None
        # Weakly: the session holds this object, and a strong bound method back to it would
        # make a cycle that keeps the network alive until the garbage collector runs.
        self._on_first = None if on_first is None else weakref.WeakMethod(on_first)
        self._on_second = None if on_second is None else weakref.WeakMethod(on_second)
        self._previous: dict[int, Any] = {}
        self._depth = 0

    def __enter__(self) -> StopSignals:
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            for signum, handler in self._previous.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
            self._previous.clear()

    def _note(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # asked twice: stop now, without waiting for a checkpoint
            on_second = self._on_second() if self._on_second is not None else None
            if on_second is not None:
                on_second(signum)
            raise KeyboardInterrupt
        self.received = signum
        on_first = self._on_first() if self._on_first is not None else None
        if on_first is not None:
            on_first(signum)


class DataSource(Protocol):
    """Where a session gets images: stream batches in stream order, training samples by index
    (replay), and test samples.

    ``deterministic_eval`` (optional, False when absent): the test transforms are deterministic
    and ``eval_batches`` yields the samples in the order of the indices it is given, so the
    evaluation query cache may key features by test-sample index.

    Optional too: ``attach_device(device)``, called once here before any batch, for a source
    that delivers batches on the loop's device (``PilotDataSource``: uint8 from its workers, made
    float there); ``close()``, called by :meth:`OnlineSession.finish`, stops its workers."""

    test_labels: np.ndarray

    def train_batches(self, batches: Sequence[np.ndarray]) -> Batches:
        """Yield (inputs, labels) for each array of training indices, in the given order."""

    def train_samples(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of the given training indices, through the training transforms."""

    def eval_batches(self, indices: np.ndarray) -> Batches:
        """Yield (inputs, labels) over the given test indices."""


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


class OnlineSession:
    """Drives an :class:`OnlineLoop` through a :class:`Stream` and records everything measured.

    Drive it task by task with :meth:`train_task` then :meth:`complete_task`, and :meth:`finish`
    after the last task (or all at once with :meth:`run`). Unless ``checkpoint_every`` is null,
    the session checkpoints at every task end but the last, and every ``AUTO_CHECKPOINT_SECONDS``
    of training (``"auto"``, the default) or every N stream batches (an integer); a new session
    over the same config resumes from the checkpoint when it is built: the tasks already
    completed are skipped by :meth:`train_task` (and :meth:`complete_task` returns their stored
    evaluation), the current one restarts at the saved batch. SIGINT or SIGTERM during its calls
    checkpoints at the next whole point and stops the run (:class:`StopSignals`).
    """

    def __init__(
        self,
        loop: OnlineLoop,
        stream: Stream,
        data: DataSource,
        config: Mapping[str, Any],
        results_path: Path | None = None,
        progress: bool = True,
        checkpoint_path: Path | None = None,
        loop_factory: LoopFactory | None = None,
    ) -> None:
        self.loop, self.stream, self.data, self.config = loop, stream, data, config
        self.loop_factory = loop_factory
        reset_peak_memory(loop.device)
        self.results_path = results_path
        self.written_path: Path | None = None
        self.progress = progress
        attach_device = getattr(data, "attach_device", None)
        if attach_device is not None:  # batches then arrive on the loop's device, as its inputs
            attach_device(loop.device)
        loader = getattr(data, "train_samples", None)
        if loader is not None:  # optional for memory-free runs; replay says so when missing
            loop.attach_samples(loader)
        num_classes = loop.num_classes
        for name, labels in (("training", stream.labels), ("test", data.test_labels)):
            labels = np.asarray(labels)
            if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
                raise ValueError(
                    f"{name} labels span [{labels.min()}, {labels.max()}], outside "
                    f"the model's {num_classes} classes"
                )
        exposure = np.full(num_classes, -1, dtype=np.int64)
        first = stream.exposure_task()[:num_classes]
        exposure[: len(first)] = first
        self.exposure = exposure  # class -> task of first exposure (-1: never streamed)
        self.columns: list[np.ndarray] = []
        self.class_history: list[np.ndarray] = []
        # Sample-level accuracy at each task end (Si-Blurry's A_avg and A_last).
        self.end_of_task: list[float] = []
        self.periodic: list[dict[str, float]] = []
        self.train_seconds = 0.0
        self.eval_seconds = 0.0
        self.tasks_trained = 0
        # A_online (docs/protocol.md): stream samples predicted right before training on them,
        # counted on the device (read at log intervals and for results), and samples scored.
        self.online_correct = torch.zeros((), device=loop.device, dtype=torch.long)
        self.online_samples = 0
        # Wall time of A_online's eval-mode passes: evaluation, kept out of train_seconds.
        self.online_seconds = 0.0
        period = config.get("eval_period")
        self._next_periodic = period if period else None
        self.live_log = None  # live logging (``logger``): only built when asked for
        if config.get("logger") is not None:
            from .live_log import make_live_logger

            task_classes = [s.new_classes for s in stream.summary()]
            self.live_log = make_live_logger(config, loop, task_classes, results_path)
        # Resuming: PILOT's evaluation report of each completed task, the stream batches trained
        # so far, and where a restored run picks up (task, batches of it already trained).
        self.task_reports: list[dict[str, Any]] = []
        self.batches_trained = 0
        # Real-time mode (core/realtime.py, docs/protocol.md): which stream batches a step trains
        # on; the others pass, scored only. Global stream batches before ``scored_until`` were
        # trained on or scored (a step scores the batches that pass while it runs, before it
        # trains). ``samples_passed``: stream samples consumed, trained on or not.
        self.realtime: RealtimeSchedule | None = None
        self.batches_skipped = 0
        self.scored_until = 0
        self.samples_passed = 0
        self.resume_position = (0, 0)
        self.resumed_from: list[dict[str, int]] = []
        self.checkpoint_every = config.get("checkpoint_every", "auto") or None
        self.checkpoint_path = self._checkpoint_location(checkpoint_path)
        self.stop_signals = StopSignals(self._say_it_will_stop, self._stop_at_once)
        self._last_checkpoint = time.monotonic()
        #: Where the checkpoint on disk stands, for people (``_position_text``), once known.
        self._saved_at: str | None = None
        if self.checkpoint_path is not None:
            remove_stale_temporaries(self.checkpoint_path)
            if self.checkpoint_path.exists():
                self._resume()
                if self.live_log is not None:  # live curves go on at the resumed stream step
                    self.live_log.step = self.batches_trained + self.batches_skipped
        if self.resume_position == (0, 0):
            self._say_why_it_starts_over()
        if realtime_on(config) and not loop.online_accuracy:
            raise ValueError(
                "real-time mode scores every stream batch, but this loop scores none "
                "(online_accuracy false): remove online_accuracy or set it true"
            )
        if realtime_on(config) and self.realtime is None:  # a resumed run keeps its C
            self.realtime = self._resolve_realtime()

    # -- driving -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Every task (train, then evaluate), then the results file; resumes if checkpointed."""
        try:
            for task in range(self.stream.num_tasks):
                self.train_task(task)
                self.complete_task(task)
        except RunInterrupted:
            raise  # checkpointed: the rerun resumes, nothing failed
        except BaseException as err:
            self.write(status="failed", error=f"{type(err).__name__}: {err}")
            raise
        return self.finish()

    def complete_task(self, task: int) -> dict[str, Any]:
        """Evaluate at the end of ``task`` (:meth:`evaluate_task_end`), keep its report and
        checkpoint; a task completed before a resume returns its stored report."""
        if task < len(self.task_reports):
            return self.task_reports[task]
        last = task + 1 == self.stream.num_tasks
        with self.stop_signals:
            report = self.evaluate_task_end(task)
            self.task_reports.append(report)
            # The whole run's progress, with an ETA at the pace so far (resumed time included).
            logger.info(
                progress_line(
                    "run",
                    task + 1,
                    self.stream.num_tasks,
                    self.train_seconds + self.eval_seconds + self.online_seconds,
                )
            )
            if self.checkpoint_path is not None and not last:
                self.save_checkpoint(task + 1, 0)
            if self.stop_signals.received is not None and not last:  # the last: finish() says
                self._stop(task + 1, 0, saved=True)
        return report

    def finish(self) -> dict[str, Any]:
        """Write the final results, then delete the checkpoint: a finished run is not resumed."""
        with self.stop_signals:
            results = self.write()
            if self.checkpoint_path is not None:
                self.checkpoint_path.unlink(missing_ok=True)
            close = getattr(self.data, "close", None)
            if close is not None:  # the data source's persistent loader workers
                close()
        received = self.stop_signals.received
        if received is not None:  # asked to stop as the run ended: it is complete, stop here
            print(
                f"interrupted ({signal.Signals(received).name}) as the run ended; its results "
                f"are complete ({self.written_path}): rerun the same command for any seeds left",
                file=sys.stderr,
                flush=True,
            )
            raise RunInterrupted(128 + received)
        return results

    # -- training ----------------------------------------------------------------------------------
    def train_task(self, task: int) -> None:
        """Consume one stream segment in a single pass (after a resume: what is left of it)."""
        resume_task, resume_step = self.resume_position
        if task < resume_task:
            return  # trained (and evaluated) before the checkpoint this session resumed from
        first = resume_step if task == resume_task else 0
        batch_indices = [batch.indices for batch in self.stream.batches(task)]
        interval = int(self.config.get("log_interval", 10))
        bar = tqdm(
            total=len(batch_indices),
            initial=first,
            desc=f"task {task + 1}/{self.stream.num_tasks}",
            disable=not self.progress,
            leave=False,
        )
        with self.stop_signals:
            try:
                self._train_batches(task, batch_indices, first, bar, interval)
            finally:
                bar.close()
        if self.live_log is not None:
            self.live_log.end_task()
        self.tasks_trained = task + 1

    def _train_batches(
        self, task: int, batch_indices: list[np.ndarray], first: int, bar: Any, interval: int
    ) -> None:
        """Train on the batches of ``task`` from ``first`` on; stop cleanly when a signal came.

        In real-time mode each step comes with the batches that pass while it runs (up to the
        next batch its schedule trains, possibly in the next tasks): they are loaded with it and
        scored first, by the model the step starts from, then the step trains on its batch."""
        loss_sum = torch.zeros((), device=self.loop.device)
        correct_sum = torch.zeros((), device=self.loop.device, dtype=torch.long)
        seen_in_window = steps_in_window = 0
        offset = self._task_offsets[task]
        groups = self._step_groups(offset + first, offset + len(batch_indices))
        stream = self._stream_batches
        start = time.perf_counter()
        loads = [stream[g] for trained, passing in groups for g in (trained, *passing)]
        batches = iter(self.data.train_batches(loads))
        step = first  # batches of the task passed (trained or scored): what a checkpoint records
        for trained, passing in groups:
            try:
                inputs, labels = next(batches)
                waiting = [next(batches) for _ in passing]
            except StopIteration:
                break
            except Exception:
                # A signal sent to the whole process group may have stopped the data workers
                # first: the state is whole after the last step, so checkpoint that.
                if self.stop_signals.received is None:
                    raise
                self.train_seconds += time.perf_counter() - start
                self._stop(task, step)
            waiting_correct, waiting_samples = self._score_passing(waiting)
            stats = self.loop.train_step(inputs, labels, stream[trained])
            end = (passing[-1] if passing else trained) + 1
            previous, step = step, min(end - offset, len(batch_indices))
            passed_before = self.batches_trained + self.batches_skipped
            self.scored_until = end
            self.batches_trained += 1
            self.batches_skipped += len(passing)
            self.samples_passed += stats.samples + waiting_samples
            if self.live_log is not None:
                passing_stats = _with_passing(stats, waiting_correct, waiting_samples, len(passing))
                self.live_log.on_step(passing_stats)
            if not stats.skipped:
                loss_sum += stats.loss
                steps_in_window += 1
            correct_sum += stats.correct
            seen_in_window += stats.samples
            if stats.online_correct is not None:
                self.online_correct += stats.online_correct
                self.online_samples += stats.samples
            self.online_seconds += stats.online_seconds
            self.train_seconds -= stats.online_seconds  # the step's timer includes the pass
            if step // interval > previous // interval or step == len(batch_indices):
                loss, correct, online = torch.stack(  # the only device reads
                    [loss_sum.float(), correct_sum.float(), self.online_correct.float()]
                ).tolist()
                shown = {
                    "loss": f"{loss / max(steps_in_window, 1):.3f}",
                    "acc": f"{100.0 * correct / seen_in_window:.1f}",
                }
                if self.online_samples:  # scored only with online_accuracy on
                    shown["A_online"] = f"{100.0 * online / self.online_samples:.1f}"
                if self.realtime is not None:
                    shown["trained"] = f"{self.batches_trained}/{passed_before + 1 + len(passing)}"
                bar.set_postfix(**shown)
                bar.update(step - bar.n)
                loss_sum.zero_(), correct_sum.zero_()
                seen_in_window = steps_in_window = 0
            if self._next_periodic is not None and self.samples_passed >= self._next_periodic:
                self.train_seconds += time.perf_counter() - start
                self._periodic_evaluation()
                start = time.perf_counter()
            if self.stop_signals.received is not None:
                self.train_seconds += time.perf_counter() - start
                self._stop(task, step)
            if self._checkpoint_due(passed_before):
                self.train_seconds += time.perf_counter() - start
                self.save_checkpoint(task, step)
                start = time.perf_counter()
        self.train_seconds += time.perf_counter() - start
        bar.update(len(batch_indices) - bar.n)  # batches scored in an earlier task's steps

    def _step_groups(self, begin: int, stop: int) -> list[tuple[int, list[int]]]:
        """``(trained batch, batches passing while its step runs)`` for the steps whose trained
        batch lies in global batches ``[begin, stop)``; batches before :attr:`scored_until`
        were trained or scored already (by a step of an earlier task, or before a resume)."""
        total = len(self._stream_batches)
        batch = max(begin, self.scored_until)
        groups = []
        schedule = self.realtime
        while batch < stop:
            following = batch + 1 if schedule is None else schedule.next_trained(batch + 1)
            if schedule is not None and not schedule.trains(batch):
                raise RuntimeError(f"stream batch {batch} is neither trained nor scored")
            groups.append((batch, list(range(batch + 1, min(following, total)))))
            batch = following
        return groups

    def _score_passing(self, waiting: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, int]:
        """Score the batches that pass during a real-time step, before it trains (the model
        they meet is the one the step starts from) and never train on them: (right, samples).
        Their passes are evaluation time, kept out of ``train_seconds``."""
        if not waiting:
            return None, 0
        right = torch.zeros((), device=self.loop.device, dtype=torch.long)
        samples = 0
        for inputs, labels in waiting:
            correct, seconds = self.loop.score_batch(inputs, labels)
            right += correct
            samples += len(labels)
            self.online_seconds += seconds
            self.train_seconds -= seconds
        self.online_correct += right
        self.online_samples += samples
        return right, samples

    @functools.cached_property
    def _batches_by_task(self) -> list[list[np.ndarray]]:
        """Each task's stream batches (dataset indices), drawn once: the stream is fixed for
        the session."""
        return [[b.indices for b in self.stream.batches(t)] for t in range(self.stream.num_tasks)]

    @functools.cached_property
    def _stream_batches(self) -> list[np.ndarray]:
        """Every stream batch, in stream order over all tasks: real-time mode numbers batches
        globally, the stream never waits at a task's end."""
        return [batch for task in self._batches_by_task for batch in task]

    @functools.cached_property
    def _task_offsets(self) -> list[int]:
        """The global index of each task's first batch."""
        return [0, *itertools.accumulate(len(task) for task in self._batches_by_task)]

    def _checkpoint_due(self, passed_before: int) -> bool:
        """After a step: every N stream batches (an integer: the step passed a multiple of N,
        its trained batch and, in real-time mode, those scored with it), or once the interval
        has passed (auto)."""
        if self.checkpoint_path is None:
            return False
        if self.checkpoint_every == "auto":
            return time.monotonic() - self._last_checkpoint >= AUTO_CHECKPOINT_SECONDS
        passed = self.batches_trained + self.batches_skipped
        return passed // self.checkpoint_every > passed_before // self.checkpoint_every

    def _stop(self, task: int, step: int, saved: bool = False) -> None:
        """Checkpoint the position (``step`` batches of ``task`` trained) unless ``saved``, say
        where the run stopped and how to go on, and raise :class:`RunInterrupted`."""
        received = self.stop_signals.received
        if self.checkpoint_path is not None and not saved:
            self.save_checkpoint(task, step)
        if self.live_log is not None:
            self.live_log.close()
        where = self._position_text(task, step)
        if self.checkpoint_path is not None:
            then = self._resume_or_drop()
        else:
            then = "checkpoint_every is null, so nothing was saved; a rerun starts over"
        name = signal.Signals(received).name
        print(f"interrupted ({name}) at {where}; {then}", file=sys.stderr, flush=True)
        raise RunInterrupted(128 + received)

    def _resume_or_drop(self) -> str:
        """How to go on from the checkpoint on disk, and how to delete it instead."""
        path = self.checkpoint_path.resolve()
        size = human_bytes(path.stat().st_size)
        return (
            f"checkpoint {path} ({size}); rerun the same command to resume, or "
            f"`pilot-online clean {path}` to delete it"
        )

    def _say_it_will_stop(self, signum: int) -> None:
        """At the first signal, at once: what the run does now, and what a second one does."""
        name = signal.Signals(signum).name
        if self.checkpoint_path is None:
            then = "checkpoint_every is null, so nothing will be saved"
        else:
            then = f"writes a checkpoint to {self.checkpoint_path.resolve()}"
        line = (
            f"{name}: the run stops after this batch (or evaluation) and {then}; press Ctrl-C "
            "again to stop at once (within 2 s), keeping the last checkpoint on disk"
        )
        logger.warning("%s", line)
        if not _logs_reach_stderr(logger):  # PILOT's main.py logs to a file and stdout only
            print(f"WARNING {line}", file=sys.stderr, flush=True)

    def _stop_at_once(self, signum: int) -> None:
        """At the second signal: stop now, saying what the checkpoint on disk holds (it is
        whole: every checkpoint is written to a temporary file and renamed)."""
        name = signal.Signals(signum).name
        path = self.checkpoint_path
        if path is None or not path.exists():
            why = "checkpoint_every is null" if path is None else "no checkpoint was written yet"
            then = f"{why}, so a rerun starts over"
        else:
            age = time.time() - path.stat().st_mtime
            at = "" if self._saved_at is None else f", at {self._saved_at}"
            then = f"the last checkpoint is whole, written {age:.0f} s ago{at}: "
            then += self._resume_or_drop()
        print(f"stopped at once ({name} twice); {then}", file=sys.stderr, flush=True)
        raise RunInterrupted(128 + signum)

    def _position_text(self, task: int, step: int) -> str:
        """Where ``step`` batches of ``task`` are trained, for people: ``task 2 of 10, after 5 of
        its 40 batches (1234 stream samples trained)``, or ``the end of task 1 of 10 (...)``."""
        tasks, samples = self.stream.num_tasks, self.loop.samples_seen
        if step == 0:
            where = f"the end of task {task} of {tasks}" if task else "the start of the stream"
            return f"{where} ({samples} stream samples trained)"
        batches = len(self._batches_by_task[task])  # drawn once per session
        return (
            f"task {task + 1} of {tasks}, after {step} of its {batches} batches "
            f"({samples} stream samples trained)"
        )

    def _periodic_evaluation(self) -> None:
        period = int(self.config["eval_period"])
        while self._next_periodic <= self.samples_passed:
            self._next_periodic += period
        allowed = self.loop.seen.cpu().numpy()
        y_pred, y_true = self._predict(allowed, topk=1)
        accuracy = float(np.mean(y_pred[:, 0] == y_true) * 100) if len(y_true) else float("nan")
        self.periodic.append({"samples_seen": self.samples_passed, "accuracy": accuracy})
        if self.live_log is not None:
            self.live_log.on_eval("periodic", {"accuracy": accuracy})

    # -- real-time mode ----------------------------------------------------------------------------
    def _resolve_realtime(self) -> RealtimeSchedule:
        """The run's C (``realtime``): from the FLOP model, measured here, or given. Once per
        run: a resumed run takes its C from the checkpoint."""
        mode = self.config["realtime"]
        reference = str(self.config.get("realtime_reference") or DEFAULT_REFERENCE)
        if mode in ("flops", "flops_counted"):
            from .flops import realtime_flop_cost

            cost, detail = realtime_flop_cost(self.config, counted=mode == "flops_counted")
            schedule = RealtimeSchedule.from_value(cost, mode, reference, detail)
        elif mode == "measured":
            schedule = self._measure_cost(reference)
        else:
            schedule = RealtimeSchedule.from_value(float(mode), "given")
        total = len(self._stream_batches)
        logger.info(
            "real-time mode: C = %s (%s, %s; reference %s): %d of the stream's %d batches train",
            f"{float(schedule.cost):g}",
            f"{schedule.cost.numerator}/{schedule.cost.denominator}",
            schedule.source,
            schedule.reference or "none",
            schedule.trained_count(total),
            total,
        )
        return schedule

    def _measure_cost(self, reference: str) -> RealtimeSchedule:
        """C from step times measured in this process: a fresh loop of this run's config and one
        of the reference's (:func:`reference_run_config`), each trained for
        :data:`MEASURE_WARMUP_STEPS` + :data:`MEASURE_TIMED_STEPS` steps on the stream's first
        batch, random weights, no A_online pass; C is the ratio of their fastest timed steps.
        Every RNG is put back afterwards and the peak-memory count restarted, so the run trains
        as it would have."""
        if self.loop_factory is None:
            raise ValueError(
                "realtime=\"measured\" builds the method's and the reference's loops to time "
                "their steps, and this session was given no loop_factory (PILOT's learner gives "
                'one): set realtime to "flops" or to a number'
            )
        device = self.loop.device
        first = self.data.train_batches(self._stream_batches[:1])
        inputs, labels = next(iter(first))
        getattr(first, "close", lambda: None)()  # the data source's pass ends here
        indices = self._stream_batches[0]
        state = capture_rng_state(device)
        try:
            seconds = {}
            for who, config in (
                ("method", timing_config(self.config)),
                ("reference", reference_run_config(self.config, reference)),
            ):
                loop = self.loop_factory(config)
                seconds[who] = _fastest_step(loop, self.data, inputs, labels, indices)
                del loop
                gc.collect()
        finally:
            restore_rng_state(state, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak_memory(device)  # the throwaway loops are not the run's memory
        detail = {
            "method_step_seconds": seconds["method"],
            "reference_step_seconds": seconds["reference"],
            "steps": f"{MEASURE_WARMUP_STEPS} warm-up + {MEASURE_TIMED_STEPS} timed, fastest",
            "device": str(device),
        }
        cost = seconds["method"] / seconds["reference"]
        return RealtimeSchedule.from_value(cost, "measured", reference, detail)

    def _realtime_report(self) -> dict[str, Any]:
        """The results file's ``extra.realtime``: C, where it came from, and the batches."""
        return {
            **self.realtime.to_dict(),
            "batches_trained": self.batches_trained,
            "batches_skipped": self.batches_skipped,
            "stream_batches": len(self._stream_batches),
        }

    # -- checkpoints -------------------------------------------------------------------------------
    def _checkpoint_location(self, path: Path | None) -> Path | None:
        if not self.checkpoint_every:
            if path is None and self.results_path is not None:
                path = checkpoint_path_for(self.results_path)
            if path is not None and path.exists():
                logger.warning(
                    "starting over: checkpoint_every is null, so this run is not resuming from "
                    "the checkpoint %s (remove checkpoint_every: null to resume it, or delete it)",
                    path,
                )
            return None
        if path is None and self.results_path is None:
            if self.checkpoint_every == "auto":  # nowhere to put one: a run kept in memory
                return None
            raise ValueError(
                "checkpoint_every is set but the session has no results_path or checkpoint_path "
                "to put the checkpoint beside: give one, or set checkpoint_every to null"
            )
        return path if path is not None else checkpoint_path_for(self.results_path)

    @functools.cached_property
    def _stream_digest(self) -> str:
        """SHA-256 of every task's batches: the checkpoint's position means this exact stream
        (computed once: the stream is fixed for the session)."""
        digest = hashlib.sha256()
        for task in range(self.stream.num_tasks):
            digest.update(f"task {task}".encode())
            for batch in self.stream.batches(task):
                digest.update(np.ascontiguousarray(batch.indices, dtype=np.int64).tobytes())
        return digest.hexdigest()

    def state_dict(self, task: int, step: int) -> dict[str, Any]:
        """The whole run at a point where ``step`` batches of ``task`` are trained: the loop
        (parameters, optimiser, mixins, method), the metrics so far and every RNG state."""
        return {
            "position": {"task": task, "step": step},
            "stream_digest": self._stream_digest,
            "batches_trained": self.batches_trained,
            "batches_skipped": self.batches_skipped,
            "scored_until": self.scored_until,
            "samples_passed": self.samples_passed,
            "realtime": None if self.realtime is None else self.realtime.state_dict(),
            "columns": list(self.columns),
            "class_history": list(self.class_history),
            "end_of_task": list(self.end_of_task),
            "periodic": list(self.periodic),
            "next_periodic": self._next_periodic,
            "task_reports": list(self.task_reports),
            "tasks_trained": self.tasks_trained,
            "train_seconds": self.train_seconds,
            "eval_seconds": self.eval_seconds,
            "online": {
                "correct": int(self.online_correct),
                "samples": self.online_samples,
                "seconds": self.online_seconds,
            },
            "resumed_from": list(self.resumed_from),
            "loop": self.loop.state_dict(),
            "rng": capture_rng_state(self.loop.device),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the RNG last, so nothing drawn while loading counts)."""
        if state["stream_digest"] != self._stream_digest:
            raise CheckpointError(
                f"checkpoint {self.checkpoint_path} was written for another stream (same config, "
                "other data: did the dataset change?): delete it to start the run over"
            )
        self.loop.load_state_dict(state["loop"])
        self.columns = [np.asarray(c) for c in state["columns"]]
        self.class_history = [np.asarray(h) for h in state["class_history"]]
        self.end_of_task = [float(v) for v in state["end_of_task"]]
        self.periodic = [dict(p) for p in state["periodic"]]
        self._next_periodic = state["next_periodic"]
        self.task_reports = list(state["task_reports"])
        self.tasks_trained = int(state["tasks_trained"])
        self.batches_trained = int(state["batches_trained"])
        self.batches_skipped = int(state["batches_skipped"])
        self.scored_until = int(state["scored_until"])
        self.samples_passed = int(state["samples_passed"])
        realtime = state["realtime"]
        self.realtime = None if realtime is None else RealtimeSchedule.from_state(realtime)
        self.train_seconds = float(state["train_seconds"])
        self.eval_seconds = float(state["eval_seconds"])
        online = state["online"]
        self.online_correct.fill_(int(online["correct"]))
        self.online_samples = int(online["samples"])
        self.online_seconds = float(online["seconds"])
        self.resumed_from = list(state["resumed_from"])
        position = state["position"]
        self.resume_position = (int(position["task"]), int(position["step"]))
        self._saved_at = self._position_text(*self.resume_position)
        restore_rng_state(state["rng"], self.loop.device)

    def save_checkpoint(self, task: int, step: int) -> None:
        """Write the checkpoint atomically (the previous one stays until the rename)."""
        save_checkpoint(self.checkpoint_path, self.state_dict(task, step), dict(self.config))
        self._last_checkpoint = time.monotonic()
        self._saved_at = self._position_text(task, step)
        logger.info("checkpoint at %s: %s", self._saved_at, self.checkpoint_path)

    def _say_why_it_starts_over(self) -> None:
        """A rerun that finds what an earlier attempt left, but no checkpoint, says so."""
        if self.results_path is None:
            return
        partial = self.results_path.with_name(
            self.results_path.name.replace(".results.json", ".partial.results.json")
        )
        if not partial.exists():
            return
        why = (
            "checkpoint_every is null"
            if not self.checkpoint_every
            else "it stopped before its first checkpoint"
        )
        logger.warning(
            "starting over from the first batch: %s is an earlier attempt's partial results, "
            "and there is no checkpoint to resume (%s)",
            partial,
            why,
        )

    def _resume(self) -> None:
        state = load_checkpoint(self.checkpoint_path, dict(self.config))
        try:
            self.load_state_dict(state)
        except (KeyError, ValueError, RuntimeError, TypeError) as err:
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(
                f"checkpoint {self.checkpoint_path} does not fit this run "
                f"({type(err).__name__}: {err}): delete it to start the run over"
            ) from err
        task, step = self.resume_position
        self.resumed_from.append(
            {"task": task, "step": step, "samples_seen": self.loop.samples_seen}
        )
        logger.warning(
            "resuming from %s at %s", self.checkpoint_path, self._position_text(task, step)
        )

    # -- evaluation --------------------------------------------------------------------------------
    def _predict(self, allowed: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
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
        self.eval_seconds += time.perf_counter() - start
        return y_pred, y_true

    def evaluate_task_end(self, task: int) -> dict[str, Any]:
        """Evaluate on test samples of every exposed class; record column ``task`` of a_{l,k}.

        Returns PILOT's ``cnn_accy`` structure. Groups come from the stream (classes first
        exposed in each task), so they are right for Si-Blurry too; ``top5`` is top-min(5, seen).
        """
        allowed = (self.exposure >= 0) & (self.exposure <= task)
        y_pred, y_true = self._predict(allowed, topk=5)
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

    # -- results -----------------------------------------------------------------------------------
    def accuracy_matrix(self) -> np.ndarray:
        return metrics.accuracy_matrix(self.columns, self.stream.num_tasks)

    def results(self, status: str = "complete", error: str | None = None) -> dict[str, Any]:
        """Everything the run measured, in the results schema (``core/results.py``)."""
        loop = self.loop
        history = np.stack(self.class_history) if self.class_history else None
        summary = metrics.summarize(
            self.accuracy_matrix(),
            periodic=[p["accuracy"] for p in self.periodic] or None,
            per_class_history=history,
            end_of_task=self.end_of_task or None,
            online=(int(self.online_correct), self.online_samples),
        )
        gradients = loop.gradient_statistics()
        diagnostics = loop.report()
        task_classes = [s.new_classes for s in self.stream.summary()]
        g, g_n = metrics.task_gradient_norms(gradients["mean"], task_classes)
        imbalance = {
            "class_mean_grad_norm": gradients["mean"],
            "task_grad_norm": g,
            "task_grad_norm_normalized": g_n,
        }
        if "trace" in gradients:  # G^k per step (paper Fig. 2), 4 significant digits: compact
            per_step = metrics.task_gradient_trace(gradients["trace"], task_classes)
            imbalance["task_grad_norm_trace"] = [
                [float(f"{v:.4g}") for v in row] for row in per_step
            ]
        config = {k: (str(v) if k == "device" else v) for k, v in self.config.items()}
        results = build_results(
            config=to_jsonable(config),
            stream=self.stream.to_dict(),
            metrics=summary,
            timing={
                "train_seconds": self.train_seconds,
                "eval_seconds": self.eval_seconds,
                "online_eval_seconds": self.online_seconds,
                "samples_per_second": loop.samples_seen / self.train_seconds
                if self.train_seconds
                else None,
                "peak_memory_bytes": peak_memory_bytes(loop.device),
            },
            counters={
                "optimizer_steps": loop.optimizer_steps,
                "samples_seen": loop.samples_seen,
                "online_scored_samples": self.online_samples,
                # Stream batches a step trained on, and those that passed scored only
                # (real-time mode; 0 otherwise).
                "batches_trained": self.batches_trained,
                "batches_skipped": self.batches_skipped,
                "stream_length": len(self.stream),
                "tasks_trained": self.tasks_trained,
                "skipped_nonfinite_steps": loop.skipped_nonfinite_steps,
                "trainable_parameters": sum(p.numel() for _, p in loop.named_parameters),
                "parameters": sum(p.numel() for p in loop.network.parameters()),
                "skipped_nonfinite_hypergradients": diagnostics.get("fgh", {}).get(
                    "skipped_nonfinite", 0
                ),
            },
            extra={
                **({"resumed_from": self.resumed_from} if self.resumed_from else {}),
                **({"realtime": self._realtime_report()} if self.realtime is not None else {}),
                "periodic_evaluations": self.periodic,
                # PILOT's cnn_accy of each task: what a rerun hands back for a finished seed.
                "task_reports": self.task_reports,
                "per_class_final_accuracy": history[-1] if history is not None else None,
                "gradient_imbalance": imbalance,
                "diagnostics": diagnostics,
            },
        )
        results["status"] = status
        if error:
            results["error"] = error
        return to_jsonable(results)

    def write(self, status: str = "complete", error: str | None = None) -> dict[str, Any]:
        """Write the results (and the gradient trace beside them); partial runs go to ``*.partial``.

        Returns the results; ``self.written_path`` is where they went (None without a path)."""
        results = self.results(status, error)
        if self.live_log is not None:  # the run is over (finished or failed): flush and close
            self.live_log.close()
        if self.results_path is None:
            return results
        path = self.results_path
        if status != "complete":
            path = path.with_name(path.name.replace(".results.json", ".partial.results.json"))
        elif path.exists():  # before the trace: a refused write must not replace its sidecar
            raise FileExistsError(
                f"results file {path} already exists; refusing to overwrite a finished run's "
                "results and gradient trace. Use another prefix/log_dir or delete the file."
            )
        trace = self.loop.gradient_statistics().get("trace")
        if trace is not None:
            trace_path = path.with_name(path.name.replace(".json", ".gradtrace.npy"))
            buffer = io.BytesIO()
            np.save(buffer, trace.astype(np.float32))
            write_atomic(trace_path, buffer.getvalue())
            results["extra"]["gradient_imbalance"]["trace_file"] = trace_path.name
        write_results(path, results, overwrite=status != "complete")
        self.written_path = path
        logger.info("results written to %s", path)
        return results


def timing_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as its step is timed: random weights (nothing to load), no A_online pass (it
    is evaluation, not the method's cost), no real-time mode, no live log or checkpoint."""
    return {
        **config,
        "pretrained": False,
        "pretrained_path": None,
        "online_accuracy": False,
        "realtime": None,
        "logger": None,
        "checkpoint_every": None,
        "grad_trace": False,
    }


def reference_run_config(config: Mapping[str, Any], reference: str) -> dict[str, Any]:
    """The reference's run beside ``config``: the same PILOT and online keys (data, batch size,
    device, image size, optimiser, LR) with ``model_name`` the reference, its base variant, one
    step per batch, its own defaults for everything else (replay, trigger, backbone: the one of
    its backbones the run's backbone name starts with, else its first)."""
    from .config import ONLINE_KEYS, PILOT_KEYS, resolve_config
    from .registry import get_method

    adapter = get_method(reference)
    own = ("er_memory_size", "er_batch_size", "er_memory", "er_memory_per_class", "consolidation")
    raw = {
        k: v
        for k, v in config.items()
        if (k in PILOT_KEYS or k in ONLINE_KEYS) and k not in own and k != "backbone_type"
    }
    backbone = str(config.get("backbone_type") or "")
    names = sorted(adapter.backbone_types, key=len, reverse=True)
    raw["backbone_type"] = next((n for n in names if backbone.startswith(n)), None) or (
        adapter.backbone_types[0] if adapter.backbone_types else backbone
    )
    raw.update(model_name=reference, online_prototypes=False, fgh=None, online_iter=1)
    resolved = resolve_config(timing_config(raw))
    resolved.update({k: config[k] for k in ("nb_classes", "nb_tasks") if k in config})
    return resolved


def _fastest_step(
    loop: OnlineLoop, data: Any, inputs: torch.Tensor, labels: torch.Tensor, indices: np.ndarray
) -> float:
    """The fastest of :data:`MEASURE_TIMED_STEPS` training steps of ``loop`` on one batch, after
    :data:`MEASURE_WARMUP_STEPS` (seconds, between device syncs). Replay loads through the data
    source unkeyed, in this process."""
    loader = getattr(data, "train_samples", None)
    if loader is not None:
        loop.attach_samples(lambda drawn: loader(drawn))
    times = []
    for step in range(MEASURE_WARMUP_STEPS + MEASURE_TIMED_STEPS):
        _synchronize(loop.device)
        start = time.perf_counter()
        loop.train_step(inputs, labels, indices)
        _synchronize(loop.device)
        if step >= MEASURE_WARMUP_STEPS:
            times.append(time.perf_counter() - start)
    return min(times)


def _with_passing(stats: StepStats, correct: Any, samples: int, batches: int) -> StepStats:
    """A real-time step's stats for the live log: its A_online count with the ``batches`` that
    passed during it (``correct`` of ``samples``), which advance the stream step too."""
    if not batches:
        return stats
    own = stats.online_correct
    return dataclasses.replace(
        stats,
        online_correct=correct if own is None else own + correct,
        online_samples=stats.samples + samples,
        stream_batches=stats.stream_batches + batches,
    )


def unique_results_path(path: Path) -> Path:
    """``path`` itself, or a timestamped sibling if a finished run already wrote there."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    candidate, attempt = path, 1
    while candidate.exists():
        suffix = stamp if attempt == 1 else f"{stamp}-{attempt}"
        candidate = path.with_name(path.name.replace(".results.json", f".{suffix}.results.json"))
        attempt += 1
    return candidate


class ArrayDataSource:
    """A :class:`DataSource` over in-memory uint8 images (HWC), for the demo and the tests."""

    deterministic_eval = True  # no test transforms; batches follow the given indices

    def __init__(
        self,
        train_x: np.ndarray,
        train_y: np.ndarray,
        test_x: np.ndarray,
        test_y: np.ndarray,
        eval_batch_size: int = 256,
    ) -> None:
        self._train_x, self._train_y = self._to_tensor(train_x), torch.as_tensor(train_y)
        self._test_x, self._test_y = self._to_tensor(test_x), torch.as_tensor(test_y)
        self.test_labels = np.asarray(test_y)
        self.eval_batch_size = eval_batch_size

    @staticmethod
    def _to_tensor(images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0

    def train_batches(self, batches: Sequence[np.ndarray]) -> Batches:
        for indices in batches:
            index = torch.from_numpy(np.array(indices))  # a copy: stream arrays are read-only
            yield self._train_x[index], self._train_y[index]

    def train_samples(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.from_numpy(np.array(indices, dtype=np.int64))
        return self._train_x[index], self._train_y[index]

    def eval_batches(self, indices: np.ndarray) -> Batches:
        for start in range(0, len(indices), self.eval_batch_size):
            index = torch.from_numpy(np.array(indices[start : start + self.eval_batch_size]))
            yield self._test_x[index], self._test_y[index]

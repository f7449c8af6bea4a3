"""One online run over a stream: the driver that trains on it and the listeners it tells.

The session walks the stream task by task (PILOT's trainer calls one ``incremental_train`` per
task segment), trains a step on each batch and tells its listeners (``events.py``) what happened:
A_online and real-time scoring (``scoring.py``), the live log (``live_log.py``), the progress bar
(``console.py``), the periodic and task-end evaluations (``evaluation.py``), the checkpoints and
stop signals (``checkpointer.py``); the results file (``results_file.py``) gathers what they
measured. The session itself keeps only where the run is: the stream batches trained, skipped and
scored, and the tasks done.

Needs no PILOT: data comes from any :class:`DataSource`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..core.lazy import torch
from ..core.realtime import realtime_on
from ..core.rng import capture_rng_state, restore_rng_state
from ..core.streams import Stream
from .checkpoint import CheckpointError
from .checkpointer import Checkpointer, RunInterrupted
from .config import reference_run_config
from .console import ProgressBar
from .evaluation import Evaluator
from .events import RunClock, RunListener, StepEvent, reset_peak_memory
from .loop import OnlineLoop
from .results_file import ResultsFile
from .scoring import LoopFactory, OnlineScoring, resolve_realtime

logger = logging.getLogger(__name__)

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


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


class OnlineSession:
    """Drives an :class:`OnlineLoop` through a :class:`Stream` and tells its listeners.

    Drive it task by task with :meth:`train_task` then :meth:`complete_task`, and :meth:`finish`
    after the last task (or all at once with :meth:`run`). Unless ``checkpoint_every`` is null,
    the session checkpoints (``checkpointer.py``); a new session over the same config resumes
    from the checkpoint when it is built: the tasks already completed are skipped by
    :meth:`train_task` (and :meth:`complete_task` returns their stored evaluation), the current
    one restarts at the saved batch. SIGINT or SIGTERM during its calls checkpoints at the next
    whole point and stops the run.
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
        self.loop, self.stream, self.config = loop, stream, config
        self.loop_factory = loop_factory
        reset_peak_memory(loop.device)
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
        # Where the run is: stream batches a step trained on and those that passed scored only
        # (real-time mode); global batches before ``scored_until`` were trained or scored (a step
        # scores the batches that pass while it runs, before it trains); stream samples passed,
        # trained on or not; the tasks trained; where a restored run picks up (task, batches of
        # it already trained) and every position it resumed from.
        self.batches_trained = 0
        self.batches_skipped = 0
        self.scored_until = 0
        self.samples_passed = 0
        self.tasks_trained = 0
        self.resume_position = (0, 0)
        self.resumed_from: list[dict[str, int]] = []

        self.clock = RunClock()
        self.scoring = OnlineScoring(loop, config, self.clock)
        self.live_log = None  # live logging (``logger``): only built when asked for
        if config.get("logger") is not None:
            from .live_log import make_live_logger

            task_classes = [s.new_classes for s in stream.summary()]
            self.live_log = make_live_logger(config, loop, task_classes, results_path)
        self.console = ProgressBar(
            config,
            stream.num_tasks,
            [len(task) for task in self._batches_by_task],
            self.scoring,
            loop.device,
            shown=progress,
        )
        self.evaluator = Evaluator(loop, stream, data, config, self.clock, self.live_log)
        self.results_file = ResultsFile(self, results_path)
        self.checkpointer = Checkpointer(
            config,
            results_path,
            checkpoint_path,
            state=self.state_dict,
            position=self._position_text,
            on_stop=self._close_listeners,
        )
        self._data = data
        #: In the order they hear a step: A_online first (the bar shows it), the evaluations
        #: before the checkpoint that records them.
        self.listeners: list[RunListener] = [
            self.scoring,
            *([self.live_log] if self.live_log is not None else []),
            self.console,
            self.evaluator,
            self.checkpointer,
        ]
        state = self.checkpointer.load()
        if state is not None:
            self._resume(state)
            if self.live_log is not None:  # live curves go on at the resumed stream step
                self.live_log.step = self.batches_trained + self.batches_skipped
        if self.resume_position == (0, 0):
            self.checkpointer.say_why_it_starts_over()
        if realtime_on(config) and self.scoring.realtime is None:  # a resumed run keeps its C
            self.scoring.realtime = resolve_realtime(
                config, loop, data, self.stream_batches, loop_factory, reference_run_config
            )

    # -- what the learner and the tests read ---------------------------------------------------
    @property
    def data(self) -> DataSource:
        return self._data

    @data.setter
    def data(self, source: DataSource) -> None:
        """Training and evaluation read the new source from here on."""
        self._data = source
        self.evaluator.data = source

    @property
    def progress(self) -> bool:
        return self.console.shown

    @progress.setter
    def progress(self, shown: bool) -> None:
        self.console.shown = shown

    @property
    def checkpoint_path(self) -> Path | None:
        return self.checkpointer.path

    @property
    def written_path(self) -> Path | None:
        """Where the results went (None before a write, or without a results path)."""
        return self.results_file.written

    @property
    def realtime(self) -> Any:
        return self.scoring.realtime

    @property
    def periodic(self) -> list[dict[str, float]]:
        return self.evaluator.periodic

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
        reports = self.evaluator.task_reports
        if task < len(reports):
            return reports[task]
        with self.checkpointer.signals:
            report = self.evaluate_task_end(task)
            reports.append(report)
            self.console.task_evaluated(task, self.clock)
            self.checkpointer.task_completed(task, last=task + 1 == self.stream.num_tasks)
        return report

    def finish(self) -> dict[str, Any]:
        """Write the final results, then delete the checkpoint: a finished run is not resumed."""
        with self.checkpointer.signals:
            results = self.write()
            self.checkpointer.finished()
            close = getattr(self.data, "close", None)
            if close is not None:  # the data source's persistent loader workers
                close()
        self.checkpointer.stop_at_the_end(self.written_path)
        return results

    def evaluate_task_end(self, task: int) -> dict[str, Any]:
        """The task-end evaluation (``evaluation.py``): PILOT's ``cnn_accy`` of ``task``."""
        return self.evaluator.evaluate_task_end(task)

    def results(self, status: str = "complete", error: str | None = None) -> dict[str, Any]:
        """Everything the run measured, in the results schema (``results_file.py``)."""
        return self.results_file.results(status, error)

    def write(self, status: str = "complete", error: str | None = None) -> dict[str, Any]:
        """Close the listeners (the run is over: finished, failed or stopped) and write the
        results; partial runs go to ``*.partial`` (``results_file.py``)."""
        self._close_listeners()
        return self.results_file.write(status, error)

    def _close_listeners(self) -> None:
        for listener in self.listeners:
            listener.on_close()

    # -- training ----------------------------------------------------------------------------------
    def train_task(self, task: int) -> None:
        """Consume one stream segment in a single pass (after a resume: what is left of it)."""
        resume_task, resume_step = self.resume_position
        if task < resume_task:
            return  # trained (and evaluated) before the checkpoint this session resumed from
        first = resume_step if task == resume_task else 0
        for listener in self.listeners:
            listener.on_task_start(task, first)
        with self.checkpointer.signals:
            try:
                self._train_batches(task, first)
            finally:
                for listener in self.listeners:
                    listener.on_task_left(task)
        self.tasks_trained = task + 1

    def _train_batches(self, task: int, first: int) -> None:
        """Train on the batches of ``task`` from ``first`` on, telling the listeners after each
        step (their time is kept out of the training time).

        In real-time mode each step comes with the batches that pass while it runs (up to the
        next batch its schedule trains, possibly in the next tasks): they are loaded with it and
        scored first, by the model the step starts from, then the step trains on its batch."""
        task_batches = len(self._batches_by_task[task])
        offset = self._task_offsets[task]
        groups = self._step_groups(offset + first, offset + task_batches)
        stream = self.stream_batches
        clock = self.clock
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
                if self.checkpointer.signals.received is None:
                    raise
                clock.train_seconds += time.perf_counter() - start
                self.checkpointer.stop(task, step)
            passing_correct, passing_samples = self.scoring.score_passing(waiting)
            stats = self.loop.train_step(inputs, labels, stream[trained])
            end = (passing[-1] if passing else trained) + 1
            step = min(end - offset, task_batches)
            passed_before = self.batches_trained + self.batches_skipped
            self.scored_until = end
            self.batches_trained += 1
            self.batches_skipped += len(passing)
            self.samples_passed += stats.samples + passing_samples
            clock.train_seconds += time.perf_counter() - start
            event = StepEvent(
                task=task,
                step=step,
                task_batches=task_batches,
                stats=stats,
                passed_before=passed_before,
                samples_passed=self.samples_passed,
                batches_trained=self.batches_trained,
                passing_correct=passing_correct,
                passing_samples=passing_samples,
                passing_batches=len(passing),
            )
            if stats.firing is not None:
                for listener in self.listeners:
                    listener.on_firing(event)
            for listener in self.listeners:
                listener.on_step(event)
            start = time.perf_counter()
        clock.train_seconds += time.perf_counter() - start
        for listener in self.listeners:
            listener.on_task_trained(task)

    def _step_groups(self, begin: int, stop: int) -> list[tuple[int, list[int]]]:
        """``(trained batch, batches passing while its step runs)`` for the steps whose trained
        batch lies in global batches ``[begin, stop)``; batches before :attr:`scored_until`
        were trained or scored already (by a step of an earlier task, or before a resume)."""
        total = len(self.stream_batches)
        batch = max(begin, self.scored_until)
        groups = []
        schedule = self.scoring.realtime
        while batch < stop:
            following = batch + 1 if schedule is None else schedule.next_trained(batch + 1)
            if schedule is not None and not schedule.trains(batch):
                raise RuntimeError(f"stream batch {batch} is neither trained nor scored")
            groups.append((batch, list(range(batch + 1, min(following, total)))))
            batch = following
        return groups

    @functools.cached_property
    def _batches_by_task(self) -> list[list[np.ndarray]]:
        """Each task's stream batches (dataset indices), drawn once: the stream is fixed for
        the session."""
        return [[b.indices for b in self.stream.batches(t)] for t in range(self.stream.num_tasks)]

    @functools.cached_property
    def stream_batches(self) -> list[np.ndarray]:
        """Every stream batch, in stream order over all tasks: real-time mode numbers batches
        globally, the stream never waits at a task's end."""
        return [batch for task in self._batches_by_task for batch in task]

    @functools.cached_property
    def _task_offsets(self) -> list[int]:
        """The global index of each task's first batch."""
        return [0, *itertools.accumulate(len(task) for task in self._batches_by_task)]

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

    # -- checkpoints -------------------------------------------------------------------------------
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
        (parameters, optimiser, mixins, method), the listeners' state and every RNG state."""
        return {
            "position": {"task": task, "step": step},
            "stream_digest": self._stream_digest,
            "batches_trained": self.batches_trained,
            "batches_skipped": self.batches_skipped,
            "scored_until": self.scored_until,
            "samples_passed": self.samples_passed,
            "tasks_trained": self.tasks_trained,
            "train_seconds": self.clock.train_seconds,
            "resumed_from": list(self.resumed_from),
            **self.scoring.state_dict(),
            **self.evaluator.state_dict(),
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
        self.evaluator.load_state_dict(state)
        self.scoring.load_state_dict(state)
        self.tasks_trained = int(state["tasks_trained"])
        self.batches_trained = int(state["batches_trained"])
        self.batches_skipped = int(state["batches_skipped"])
        self.scored_until = int(state["scored_until"])
        self.samples_passed = int(state["samples_passed"])
        self.clock.train_seconds = float(state["train_seconds"])
        self.resumed_from = list(state["resumed_from"])
        position = state["position"]
        self.resume_position = (int(position["task"]), int(position["step"]))
        self.checkpointer.saved_at = self._position_text(*self.resume_position)
        restore_rng_state(state["rng"], self.loop.device)

    def _resume(self, state: dict[str, Any]) -> None:
        try:
            self.load_state_dict(state)
        except (KeyError, ValueError, RuntimeError, TypeError) as err:
            raise self.checkpointer.does_not_fit(err) from err
        task, step = self.resume_position
        self.resumed_from.append(
            {"task": task, "step": step, "samples_seen": self.loop.samples_seen}
        )
        logger.warning(
            "resuming from %s at %s", self.checkpoint_path, self._position_text(task, step)
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

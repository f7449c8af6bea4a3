"""A run's checkpoints and stop signals: when to write one, where, how to resume it, and what a
person who pressed Ctrl-C is told.

Unless ``checkpoint_every`` is null, a run checkpoints at every task end but the last, and every
:data:`AUTO_CHECKPOINT_SECONDS` of training (``"auto"``, the default) or every N stream batches
(an integer). SIGINT or SIGTERM during the session's calls checkpoints at the next whole point and
stops the run (:class:`StopSignals`, :class:`RunInterrupted`); a second signal stops at once,
keeping the last checkpoint on disk.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.checks import described, integer, optional, spec_of
from ..core.files import human_bytes
from .checkpoint import (
    CheckpointError,
    checkpoint_path_for,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)
from .events import RunListener, StepEvent
from .options import ConfigKey, Options, option

logger = logging.getLogger(__name__)

#: ``checkpoint_every: "auto"``: seconds of training between two checkpoints, besides the one at
#: each task end. Ten minutes bound the work a kill without warning loses (a SIGTERM loses
#: none); a full ViT-B fine-tuning checkpoint (1 GB with Adam) took 20 s to write on a slow
#: virtual disk (docs/checkpoints.md), under 4% of the interval, and less on a local SSD.
AUTO_CHECKPOINT_SECONDS = 600.0


_EVERY = 'null, "auto" or a positive integer'


def _checkpoint_every(name: str, value: Any) -> Any:
    """``"auto"`` (task ends and a time interval), a positive batch count, or null (off)."""
    if value is None or value == "auto":
        return value
    try:
        return integer(1)(name, value)
    except (TypeError, ValueError):
        raise ValueError(
            f'{name} must be {_EVERY} ("auto": at each task end and every 10 '
            f"minutes; N: every N stream batches; null: never), got {value!r}"
        ) from None


# Its cases are those of an optional positive integer ("auto" is the default, always valid).
described(_EVERY, _checkpoint_every, spec_of(optional(integer(1))))


@dataclass(frozen=True)
class CheckpointOptions(Options):
    """The checkpointer's config keys (``engine/config.py`` gathers every component's)."""

    checkpoint_every: str | int | None = option(
        ConfigKey(
            "auto",
            '"auto": checkpoint at each task end and every 10 minutes of training; N: every N '
            "stream batches and at each task end; null: off. A rerun resumes from the checkpoint",
            check=_checkpoint_every,
        )
    )


class RunInterrupted(SystemExit):
    """SIGINT or SIGTERM stopped the run at a point where its state is whole (after a step, or
    after a task's evaluation), once that point was checkpointed. A ``SystemExit`` with code 128
    + the signal's number, so PILOT's ``main.py`` and ``pilot-online run`` exit without a
    traceback; the session has logged the one line that says where and what to do."""


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


def _tell(line: str) -> None:
    """Log a stop notice at WARNING, where the run's handlers put it (PILOT's main.py: its log
    file and stdout), and make sure the person at the terminal sees it: when no handler of the
    chain writes to stderr, one that does carries this record too (the message alone)."""
    if _logs_reach_stderr(logger):
        logger.warning("%s", line)
        return
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(terminal)
    try:
        logger.warning("%s", line)
    finally:
        logger.removeHandler(terminal)


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


class Checkpointer(RunListener):
    """Writes the run's checkpoints and stops it at the next whole point when a signal came.

    ``state(task, step)`` is the whole run where ``step`` batches of ``task`` are trained (the
    session's ``state_dict``); ``position(task, step)`` says that point for people; ``on_stop()``
    closes what the run holds open before it stops. All three are the session's methods."""

    def __init__(
        self,
        config: Mapping[str, Any],
        results_path: Path | None,
        path: Path | None,
        state: Callable[[int, int], dict[str, Any]],
        position: Callable[[int, int], str],
        on_stop: Callable[[], None],
    ) -> None:
        self.config, self.results_path = config, results_path
        # Weakly, as StopSignals' callbacks: they are the session's methods, and the session
        # holds this object.
        self._state, self._position = weakref.WeakMethod(state), weakref.WeakMethod(position)
        self._on_stop = weakref.WeakMethod(on_stop)
        self.every = CheckpointOptions.of(config).checkpoint_every or None
        self.path = self._location(path)
        self.signals = StopSignals(self._say_it_will_stop, self._stop_at_once)
        self.last_saved = time.monotonic()
        #: Where the checkpoint on disk stands, for people, once known.
        self.saved_at: str | None = None
        if self.path is not None:
            remove_stale_temporaries(self.path)

    def state(self, task: int, step: int) -> dict[str, Any]:
        return self._state()(task, step)

    def position(self, task: int, step: int) -> str:
        return self._position()(task, step)

    def on_stop(self) -> None:
        self._on_stop()()

    def _location(self, path: Path | None) -> Path | None:
        if not self.every:
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
            if self.every == "auto":  # nowhere to put one: a run kept in memory
                return None
            raise ValueError(
                "checkpoint_every is set but the session has no results_path or checkpoint_path "
                "to put the checkpoint beside: give one, or set checkpoint_every to null"
            )
        return path if path is not None else checkpoint_path_for(self.results_path)

    # -- saving --------------------------------------------------------------------------------
    def on_step(self, event: StepEvent) -> None:
        if self.signals.received is not None:
            self.stop(event.task, event.step)
        if self.due(event.passed_before, event.passed):
            self.save(event.task, event.step)

    def due(self, passed_before: int, passed: int) -> bool:
        """After a step: every N stream batches (an integer: the step passed a multiple of N,
        its trained batch and, in real-time mode, those scored with it), or once the interval
        has passed (auto)."""
        if self.path is None:
            return False
        if self.every == "auto":
            return time.monotonic() - self.last_saved >= AUTO_CHECKPOINT_SECONDS
        return passed // self.every > passed_before // self.every

    def save(self, task: int, step: int) -> None:
        """Write the checkpoint atomically (the previous one stays until the rename)."""
        save_checkpoint(self.path, self.state(task, step), dict(self.config))
        self.last_saved = time.monotonic()
        self.saved_at = self.position(task, step)
        logger.info("checkpoint at %s: %s", self.saved_at, self.path)

    def task_completed(self, task: int, last: bool) -> None:
        """After ``task``'s evaluation: checkpoint the start of the next (not after the last),
        then stop there if a signal came (the last: the run's end says so)."""
        if self.path is not None and not last:
            self.save(task + 1, 0)
        if self.signals.received is not None and not last:
            self.stop(task + 1, 0, saved=True)

    def finished(self) -> None:
        """The run's results are written: a finished run is not resumed."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    # -- resuming ------------------------------------------------------------------------------
    def load(self) -> dict[str, Any] | None:
        """The checkpoint on disk, checked against the config; None without one."""
        if self.path is None or not self.path.exists():
            return None
        return load_checkpoint(self.path, dict(self.config))

    def does_not_fit(self, err: Exception) -> CheckpointError:
        """The error for a checkpoint whose state the run could not load."""
        if isinstance(err, CheckpointError):
            return err
        return CheckpointError(
            f"checkpoint {self.path} does not fit this run ({type(err).__name__}: {err}): "
            "delete it to start the run over"
        )

    def say_why_it_starts_over(self) -> None:
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
            if not self.every
            else "it stopped before its first checkpoint"
        )
        logger.warning(
            "starting over from the first batch: %s is an earlier attempt's partial results, "
            "and there is no checkpoint to resume (%s)",
            partial,
            why,
        )

    # -- stopping ------------------------------------------------------------------------------
    def stop(self, task: int, step: int, saved: bool = False) -> None:
        """Checkpoint the position (``step`` batches of ``task`` trained) unless ``saved``, say
        where the run stopped and how to go on, and raise :class:`RunInterrupted`."""
        received = self.signals.received
        if self.path is not None and not saved:
            self.save(task, step)
        self.on_stop()
        where = self.position(task, step)
        if self.path is not None:
            then = self._resume_or_drop()
        else:
            then = "checkpoint_every is null, so nothing was saved; a rerun starts over"
        name = signal.Signals(received).name
        _tell(f"interrupted ({name}) at {where}; {then}")
        raise RunInterrupted(128 + received)

    def stop_at_the_end(self, written: Path | None) -> None:
        """Asked to stop as the run ended: it is complete, so say so and stop here."""
        received = self.signals.received
        if received is None:
            return
        _tell(
            f"interrupted ({signal.Signals(received).name}) as the run ended; its results "
            f"are complete ({written}): rerun the same command for any seeds left"
        )
        raise RunInterrupted(128 + received)

    def _resume_or_drop(self) -> str:
        """How to go on from the checkpoint on disk, and how to delete it instead."""
        path = self.path.resolve()
        size = human_bytes(path.stat().st_size)
        return (
            f"checkpoint {path} ({size}); rerun the same command to resume, or "
            f"`pilot-online clean {path}` to delete it"
        )

    def _say_it_will_stop(self, signum: int) -> None:
        """At the first signal, at once: what the run does now, and what a second one does."""
        name = signal.Signals(signum).name
        if self.path is None:
            then = "checkpoint_every is null, so nothing will be saved"
        else:
            then = f"writes a checkpoint to {self.path.resolve()}"
        line = (
            f"{name}: the run stops after this batch (or evaluation) and {then}; press Ctrl-C "
            "again to stop at once (within 2 s), keeping the last checkpoint on disk"
        )
        _tell(line)

    def _stop_at_once(self, signum: int) -> None:
        """At the second signal: stop now, saying what the checkpoint on disk holds (it is
        whole: every checkpoint is written to a temporary file and renamed)."""
        name = signal.Signals(signum).name
        path = self.path
        if path is None or not path.exists():
            why = "checkpoint_every is null" if path is None else "no checkpoint was written yet"
            then = f"{why}, so a rerun starts over"
        else:
            age = time.time() - path.stat().st_mtime
            at = "" if self.saved_at is None else f", at {self.saved_at}"
            then = f"the last checkpoint is whole, written {age:.0f} s ago{at}: "
            then += self._resume_or_drop()
        _tell(f"stopped at once ({name} twice); {then}")
        raise RunInterrupted(128 + signum)

"""Task-free consolidation triggers: when a method's task-boundary step happens, from the stream.

Upstream PILOT methods act at task boundaries: RanPAC and FeCAM freeze what the first session
trained, EASE and MOS add an adapter, CoFiMA and DUCT merge models, SLCA realigns its classifier.
Online and task-free, the learner never sees a boundary, so the loop asks a trigger after every
step whether the method's :meth:`~pilot_online.engine.adapter.MethodAdapter.consolidate` runs now.
A trigger reads only what the stream shows: how many samples passed, their labels (observed
information), and the training loss. Task ids and segment ends never reach it.

The choices (config key ``consolidation``; the method's ``Consolidation.trigger`` when null):

* ``never``: the method does without.
* ``every_n_samples``: after every ``consolidation_every_n_samples`` stream samples.
* ``new_classes``: before the first batch that brings a class beyond the
  ``consolidation_new_classes`` classes first seen since the last firing (a class counts once, at
  its first sample): in a clear stream whose tasks hold that many classes, at each task boundary.
* ``plateau``: Online-LoRA's loss-plateau detector (:class:`~pilot_online.core.lora.
  LossPlateauDetector`, the same class oLoRA uses) on the step's classification loss.

A trigger is asked at the start of each step, before the step trains on its batch, so that a
firing acts where upstream's task boundary would: between the last batch of one "task" and the
first of the next.

Torch and the standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .checks import check_choice, check_int
from .lazy import torch
from .lora import LossPlateauDetector

#: The trigger names a config may give, ``never`` first.
TRIGGERS = ("never", "every_n_samples", "new_classes", "plateau")


class ConsolidationTrigger:
    """Decides, between training steps, whether the method consolidates now.

    The loop calls :meth:`update` at the start of each step with the step's stream labels,
    before anything trains on them: True means consolidate first, as upstream does at a task
    boundary before the next task's first batch. After each completed step it calls
    :meth:`observe` with the step's sample count and classification loss. ``firings`` lists the
    stream position (samples trained before the consolidation) of every firing.
    """

    name = "never"
    #: Whether :meth:`observe` reads the loss (a host sync per step, so only where needed).
    needs_loss = False

    def __init__(self) -> None:
        self.samples = 0
        self.firings: list[int] = []

    def update(self, labels: torch.Tensor) -> bool:
        """Before a step on ``labels``: True when the method consolidates before it."""
        if self._fires(labels):
            self.firings.append(self.samples)
            return True
        return False

    def observe(self, samples: int, loss: torch.Tensor | float | None = None) -> None:
        """After a completed step of ``samples`` stream samples (skipped steps are not observed)."""
        self.samples += samples

    def _fires(self, labels: torch.Tensor) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "samples": self.samples, "firings": list(self.firings)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["name"] != self.name:
            raise ValueError(
                f"the checkpoint's consolidation trigger is {state['name']!r}, the config's "
                f"{self.name!r}: resume with the config that wrote it"
            )
        self.samples = int(state["samples"])
        self.firings = [int(s) for s in state["firings"]]


class EveryNSamples(ConsolidationTrigger):
    """Fires before the first step once ``n`` stream samples were trained since the last firing
    (batches of b: every ceil(n / b) steps; the count restarts at each firing)."""

    name = "every_n_samples"

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = check_int("consolidation_every_n_samples", n, 1)
        self.since = 0

    def observe(self, samples: int, loss=None) -> None:
        super().observe(samples, loss)
        self.since += samples

    def _fires(self, labels) -> bool:
        if self.since >= self.n:
            self.since = 0
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "since": self.since}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.since = int(state["since"])


class NewClasses(ConsolidationTrigger):
    """Fires before the first batch that brings a class beyond the ``k`` first seen since the
    last firing: in a clear stream with ``k`` = the task's class count, exactly at each task
    boundary. The classes that batch brings start the next count. A class is new once, at its
    first sample; labels are read on the host (free for batches still on the CPU)."""

    name = "new_classes"

    def __init__(self, k: int, num_classes: int) -> None:
        super().__init__()
        self.k = check_int("consolidation_new_classes", k, 1)
        self.seen = torch.zeros(check_int("num_classes", num_classes, 1), dtype=torch.bool)
        self.counted = 0  # classes first seen since the last firing

    def _fires(self, labels) -> bool:
        present = torch.zeros_like(self.seen)
        present[labels.detach().long().cpu()] = True
        new = int((present & ~self.seen).sum())
        self.seen |= present
        if new and self.counted >= self.k:
            self.counted = new
            return True
        self.counted += new
        return False

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "seen": self.seen.clone(), "counted": self.counted}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.seen.copy_(state["seen"])
        self.counted = int(state["counted"])


class Plateau(ConsolidationTrigger):
    """Fires before the step after Online-LoRA's detector sees a loss plateau: the mean and the
    variance of the last ``window`` losses both under their thresholds, after a new peak since
    the last plateau (the detector's own rule)."""

    name = "plateau"
    needs_loss = True

    def __init__(self, window: int, mean_threshold: float, variance_threshold: float) -> None:
        super().__init__()
        self.detector = LossPlateauDetector(window, mean_threshold, variance_threshold)
        self.pending = False

    def observe(self, samples: int, loss=None) -> None:
        super().observe(samples, loss)
        if loss is None:
            raise ValueError("the plateau trigger needs the step's loss")
        self.pending = self.detector.update(float(loss)) or self.pending

    def _fires(self, labels) -> bool:
        fires, self.pending = self.pending, False
        return fires

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "detector": self.detector.state_dict(),
            "pending": self.pending,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.detector.load_state_dict(state["detector"])
        self.pending = bool(state["pending"])


def make_trigger(config: Mapping[str, Any], num_classes: int) -> ConsolidationTrigger:
    """The trigger a resolved config names (``consolidation`` and its parameters)."""
    name = config.get("consolidation") or "never"
    if name == "never":
        return ConsolidationTrigger()
    if name == "every_n_samples":
        return EveryNSamples(config.get("consolidation_every_n_samples", 1000))
    if name == "new_classes":
        return NewClasses(config.get("consolidation_new_classes", 10), num_classes)
    if name == "plateau":
        return Plateau(
            config.get("consolidation_plateau_window", 5),
            config.get("consolidation_plateau_mean", 6.0),
            config.get("consolidation_plateau_variance", 0.1),
        )
    check_choice("consolidation", name, TRIGGERS)
    raise AssertionError(f"trigger {name!r} is listed in TRIGGERS but not built here")

"""Real-time evaluation (Ghunaim et al., "Real-Time Evaluation in Online Continual Learning: A New
Hope", CVPR 2023): the stream does not wait for the learner.

A method whose training step costs ``C`` times a reference method's step (the reference trains
on every batch) is still busy when the next ``C - 1`` batches arrive: it trains on one batch in
every ``C`` and the stream moves on. Every batch is predicted when it arrives: the ones it
trains on by the model as it stands, the ones that pass while it is busy by that same model (the
update they wait for is not finished), and none of those is ever trained on.

Which batches train, for a rational ``C = p / q`` (:class:`RealtimeSchedule`): the k-th step
starts at time ``k C`` (in batch arrivals) on the newest batch there, ``floor(k C)``. So batch
``i`` trains iff ``i = floor(k C)`` for some k. For an integer C that is every C-th batch; for
``C = 4/3`` it is 3 batches in every 4 (0, 1, 2, 4, 5, 6, ...) and for ``C = 5/2`` batches 0
and 2 of every 5: the two fractional cases RealtimeOCL's ``Delay.is_training_batch`` writes out
by hand (its LwF and MIR rows). The count over ``B`` batches is ``ceil(B / C)``.

Config keys (``engine/config.py``, docs/configuration.md): ``realtime`` (null: off; ``"flops"``,
``"flops_counted"``, ``"measured"`` or a number >= 1), ``realtime_reference`` (the method whose
step is ``C = 1``) and ``online_iter`` (optimiser steps per trained batch, which ``C`` includes).
Torch-free: the schedule is integer arithmetic on a :class:`~fractions.Fraction`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .checks import described, optional, real, spec_of

#: ``realtime`` values that compute C: from the FLOP model with Ghunaim et al.'s pass counting
#: (backward = 2 x forward), from the FLOP model's counted backward, or from step times measured
#: in the run's own process.
REALTIME_MODES = ("flops", "flops_counted", "measured")
#: Where a run's C came from (results ``extra.realtime.source``): a mode, or ``given`` (a number).
REALTIME_SOURCES = (*REALTIME_MODES, "given")
#: The method whose step is C = 1: plain fine-tuning of the whole network on the stream batch,
#: no memory, no extra pass (docs/protocol.md says why this one).
DEFAULT_REFERENCE = "finetune_online"
#: C is kept as a fraction with a denominator at most this (4/3 stays 4/3; 1.4566 becomes 1.46).
MAX_DENOMINATOR = 100

_REALTIME_TEXT = 'null, "flops", "flops_counted", "measured" or a number >= 1'


def _check_realtime(name: str, value: Any) -> Any:
    """``null`` (off), a mode of :data:`REALTIME_MODES`, or a cost C >= 1 (a fixed compute
    budget: Prabhu et al.'s fixed iterations per time step)."""
    if value is None or value in REALTIME_MODES:
        return value
    if isinstance(value, str):
        raise ValueError(
            f"{name} must be {_REALTIME_TEXT}, got {value!r}: a mode computes C, a number gives it"
        )
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be {_REALTIME_TEXT}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 1:
        raise ValueError(
            f"{name} must be {_REALTIME_TEXT}, got {value}: C is the step's cost relative to the "
            "reference's; a method cheaper than the stream still trains on each batch once (1)"
        )
    return value


#: The ``realtime`` validator; its cases are those of an optional real >= 1 (strings checked
#: against the modes by hand).
check_realtime = described(_REALTIME_TEXT, _check_realtime, spec_of(optional(real(1))))


def as_cost(value: float | Fraction) -> Fraction:
    """C as the schedule's fraction (denominator at most :data:`MAX_DENOMINATOR`), >= 1."""
    cost = Fraction(value).limit_denominator(MAX_DENOMINATOR)
    if cost < 1:
        raise ValueError(f"a real-time cost C must be >= 1, got {float(value):g}")
    return cost


@dataclass(frozen=True)
class RealtimeSchedule:
    """Which stream batches a run of cost ``cost`` trains on (global batch indices, from 0).

    ``source``: where C came from (:data:`REALTIME_SOURCES`); ``reference``: the method whose
    step is C = 1 (None for a given C); ``raw``: C before it was clamped to 1 and rounded
    (a method cheaper than the reference trains on every batch); ``detail``: the numbers it came
    from (FLOPs or seconds per step)."""

    cost: Fraction
    source: str
    reference: str | None = None
    raw: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.cost, Fraction) or self.cost < 1:
            raise ValueError(f"cost must be a Fraction >= 1, got {self.cost!r}")
        if self.source not in REALTIME_SOURCES:
            raise ValueError(f"source must be one of {REALTIME_SOURCES}, got {self.source!r}")

    @classmethod
    def from_value(
        cls,
        value: float,
        source: str,
        reference: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> RealtimeSchedule:
        """A schedule for a computed or given C: clamped to 1 below (the stream brings one batch
        at a time), kept as a fraction (:func:`as_cost`)."""
        raw = float(value)
        if not (math.isfinite(raw) and raw > 0):
            raise ValueError(f"a real-time cost must be a finite number > 0, got {value!r}")
        return cls(as_cost(max(raw, 1.0)), source, reference, raw, dict(detail or {}))

    def trains(self, batch: int) -> bool:
        """Whether global batch ``batch`` is trained on: ``batch == floor(k C)`` for some k."""
        return self.next_trained(batch) == batch

    def next_trained(self, batch: int) -> int:
        """The first trained batch at or after ``batch``: ``floor(ceil(batch / C) C)``."""
        p, q = self.cost.numerator, self.cost.denominator
        step = -(-batch * q // p)  # ceil(batch / C)
        return step * p // q

    def trained_count(self, batches: int) -> int:
        """Batches trained among the first ``batches``: ``ceil(batches / C)``."""
        p, q = self.cost.numerator, self.cost.denominator
        return -(-batches * q // p)

    def to_dict(self) -> dict[str, Any]:
        """The results file's ``extra.realtime`` (without the counts the session adds)."""
        return {
            "C": float(self.cost),
            "C_fraction": f"{self.cost.numerator}/{self.cost.denominator}",
            "source": self.source,
            "reference": self.reference,
            "C_unclamped": self.raw,
            "detail": dict(self.detail),
        }

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: a measured C is never measured again on resume."""
        return {
            "numerator": self.cost.numerator,
            "denominator": self.cost.denominator,
            "source": self.source,
            "reference": self.reference,
            "raw": self.raw,
            "detail": dict(self.detail),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> RealtimeSchedule:
        cost = Fraction(int(state["numerator"]), int(state["denominator"]))
        return cls(cost, str(state["source"]), state["reference"], state["raw"], state["detail"])


def realtime_on(config: Mapping[str, Any]) -> bool:
    """Whether the config runs in real-time mode (``realtime`` not null)."""
    return config.get("realtime") is not None


def scores_online(config: Mapping[str, Any]) -> bool:
    """Whether a run scores A_online: ``online_accuracy`` true, or null (the default) in
    real-time mode, where it is the metric (skipped batches are scored, never trained on)."""
    asked = config.get("online_accuracy")
    return realtime_on(config) if asked is None else bool(asked)


def check_realtime_config(cfg: Mapping[str, Any], adapter: Any) -> None:
    """Cross-key checks of the real-time keys, before any work (raises ValueError with the fix).

    - ``online_accuracy: false`` with ``realtime``: real-time mode scores every batch;
    - ``online_iter`` > 1 for a method that trains nothing (``trains = False``): there is no
      optimiser step to repeat, and repeating its observation would count the batch twice.

    The FLOP model's own check (it counts the method and the reference) is
    ``engine.flops.check_flop_counts``."""
    name = cfg.get("model_name")
    if int(cfg.get("online_iter", 1)) > 1 and not getattr(adapter, "trains", True):
        raise ValueError(
            f"online_iter={cfg['online_iter']}, but {name} trains nothing by gradients (it "
            "learns in after_step()): there is no optimiser step to repeat. Remove online_iter"
        )
    mode = cfg.get("realtime")
    if mode is None:
        return
    if cfg.get("online_accuracy") is False:
        raise ValueError(
            "online_accuracy is false, but real-time mode (realtime) scores every stream batch: "
            "A_online is its metric. Remove online_accuracy (null: on in real-time mode) or set "
            "it true"
        )

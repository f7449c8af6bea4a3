"""A_online and real-time scoring: what a run counts of the stream samples it predicts before it
trains on them (docs/protocol.md).

A_online counts the stream samples predicted right before each step trains on them (the loop's
``StepStats.online_correct``, on the device, read at log intervals and for the results). In
real-time mode (``core/realtime.py``) the stream does not wait for a slow step: the batches that
pass while a step runs are scored by the model the step starts from and never trained on; which
batches a step trains on follows the run's C, resolved once here (from the FLOP model, measured,
or given) and kept in the checkpoint.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.checks import closest, described
from ..core.lazy import torch
from ..core.realtime import DEFAULT_REFERENCE, RealtimeSchedule, check_realtime, realtime_on
from ..core.rng import capture_rng_state, restore_rng_state
from .events import RunClock, RunListener, StepEvent, reset_peak_memory
from .loop import OnlineLoop, _synchronize
from .options import ConfigKey, Options, option

logger = logging.getLogger(__name__)

#: Builds a fresh loop (adapter, network, mixins) for a resolved config: what ``realtime:
#: "measured"`` times the method's and the reference's steps with (the PILOT learner gives one).
LoopFactory = Callable[[Mapping[str, Any]], OnlineLoop]

#: ``realtime: "measured"``: training steps run before the timed ones (the replay memory fills,
#: lazy initialisation and kernel selection happen), and steps timed; C is the ratio of the
#: fastest timed step of each (the least disturbed by other work on the machine).
MEASURE_WARMUP_STEPS = 2
MEASURE_TIMED_STEPS = 3


def _registered_method(name: str, value: Any) -> str:
    """A registered method's name (``realtime_reference``)."""
    from .registry import list_methods

    methods = list_methods()
    if value not in methods:
        raise ValueError(
            f"{name} {value!r} is no registered method{closest(str(value), methods)}; "
            f"pilot-online methods: {', '.join(methods)}"
        )
    return value


described("a registered method", _registered_method)


@dataclass(frozen=True)
class RealtimeOptions(Options):
    """Real-time mode's config keys (``engine/config.py`` gathers every component's; A_online's
    ``online_accuracy`` belongs to the loop, which scores)."""

    realtime: str | float | None = option(
        ConfigKey(
            None,
            "real-time mode (Ghunaim et al. 2023, docs/protocol.md): the stream does not wait; a "
            "step costing C reference steps trains on one batch in every C, the others are only "
            "scored. C from the FLOP model (flops: backward = 2x forward; flops_counted), "
            "measured step times (measured), or given (a number: a fixed compute budget); "
            "null: off",
            check=check_realtime,
        )
    )
    realtime_reference: str = option(
        ConfigKey(
            DEFAULT_REFERENCE,
            "real-time mode: the method whose step costs C = 1 (its base variant, its own replay "
            "defaults, one step per batch)",
            check=_registered_method,
        )
    )


class OnlineScoring(RunListener):
    """The run's A_online counts and, in real-time mode, its schedule of trained batches."""

    def __init__(self, loop: OnlineLoop, config: Mapping[str, Any], clock: RunClock) -> None:
        if realtime_on(config) and not loop.online_accuracy:
            raise ValueError(
                "real-time mode scores every stream batch, but this loop scores none "
                "(online_accuracy false): remove online_accuracy or set it true"
            )
        self.loop, self.clock = loop, clock
        self.correct = torch.zeros((), device=loop.device, dtype=torch.long)
        self.samples = 0
        #: Which stream batches a step trains on (real-time mode), else None.
        self.realtime: RealtimeSchedule | None = None

    def score_passing(self, waiting: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, int]:
        """Score the batches that pass during a real-time step, before it trains (the model
        they meet is the one the step starts from) and never train on them: (right, samples).
        Their passes are evaluation time, kept out of training time."""
        if not waiting:
            return None, 0
        right = torch.zeros((), device=self.loop.device, dtype=torch.long)
        samples = 0
        for inputs, labels in waiting:
            correct, seconds = self.loop.score_batch(inputs, labels)
            right += correct
            samples += len(labels)
            self.clock.online_seconds += seconds
            self.clock.train_seconds -= seconds
        self.correct += right
        self.samples += samples
        return right, samples

    def on_step(self, event: StepEvent) -> None:
        stats = event.stats
        if stats.online_correct is not None:
            self.correct += stats.online_correct
            self.samples += stats.samples
        self.clock.online_seconds += stats.online_seconds
        self.clock.train_seconds -= stats.online_seconds  # the step's timer includes the pass

    def counts(self) -> tuple[int, int]:
        """(right, scored) so far: one device read."""
        return int(self.correct), self.samples

    def report(self, batches_trained: int, batches_skipped: int, stream_batches: int) -> dict:
        """The results file's ``extra.realtime``: C, where it came from, and the batches."""
        return {
            **self.realtime.to_dict(),
            "batches_trained": batches_trained,
            "batches_skipped": batches_skipped,
            "stream_batches": stream_batches,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "realtime": None if self.realtime is None else self.realtime.state_dict(),
            "online": {
                "correct": int(self.correct),
                "samples": self.samples,
                "seconds": self.clock.online_seconds,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        realtime = state["realtime"]
        self.realtime = None if realtime is None else RealtimeSchedule.from_state(realtime)
        online = state["online"]
        self.correct.fill_(int(online["correct"]))
        self.samples = int(online["samples"])
        self.clock.online_seconds = float(online["seconds"])


#: Builds the reference's run config beside a run's (``engine.config.reference_run_config``).
ReferenceConfig = Callable[[Mapping[str, Any], str], dict[str, Any]]


def resolve_realtime(
    config: Mapping[str, Any],
    loop: OnlineLoop,
    data: Any,
    stream_batches: Sequence[np.ndarray],
    loop_factory: LoopFactory | None,
    reference_config: ReferenceConfig,
) -> RealtimeSchedule:
    """The run's C (``realtime``): from the FLOP model, measured here, or given. Once per run: a
    resumed run takes its C from the checkpoint."""
    options = RealtimeOptions.of(config)
    mode, reference = options.realtime, options.realtime_reference or DEFAULT_REFERENCE
    if mode in ("flops", "flops_counted"):
        from .flops import realtime_flop_cost

        cost, detail = realtime_flop_cost(config, counted=mode == "flops_counted")
        schedule = RealtimeSchedule.from_value(cost, mode, reference, detail)
    elif mode == "measured":
        schedule = measure_cost(
            config, loop, data, stream_batches, loop_factory, reference_config, reference
        )
    else:
        schedule = RealtimeSchedule.from_value(float(mode), "given")
    total = len(stream_batches)
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


def measure_cost(
    config: Mapping[str, Any],
    loop: OnlineLoop,
    data: Any,
    stream_batches: Sequence[np.ndarray],
    loop_factory: LoopFactory | None,
    reference_config: ReferenceConfig,
    reference: str,
) -> RealtimeSchedule:
    """C from step times measured in this process: a fresh loop of this run's config and one of
    the reference's (``reference_config(config, reference)``), each trained for
    :data:`MEASURE_WARMUP_STEPS` + :data:`MEASURE_TIMED_STEPS` steps on the stream's first
    batch, random weights, no A_online pass; C is the ratio of their fastest timed steps. Every
    RNG is put back afterwards and the peak-memory count restarted, so the run trains as it
    would have."""
    if loop_factory is None:
        raise ValueError(
            "realtime=\"measured\" builds the method's and the reference's loops to time "
            "their steps, and this session was given no loop_factory (PILOT's learner gives "
            'one): set realtime to "flops" or to a number'
        )
    device = loop.device
    first = data.train_batches(stream_batches[:1])
    inputs, labels = next(iter(first))
    getattr(first, "close", lambda: None)()  # the data source's pass ends here
    indices = stream_batches[0]
    state = capture_rng_state(device)
    try:
        seconds = {}
        for who, run_config in (
            ("method", timing_config(config)),
            ("reference", reference_config(config, reference)),
        ):
            timed = loop_factory(run_config)
            seconds[who] = _fastest_step(timed, data, inputs, labels, indices)
            del timed
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

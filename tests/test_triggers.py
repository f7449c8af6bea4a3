"""Task-free consolidation triggers (``core/triggers.py``) and the loop's ``consolidate`` call.

Firing points are worked out by hand from each trigger's rule; the loop tests check that the
adapter's ``consolidate`` runs exactly at those steps, that what it restarts loses its optimiser
state, and that a checkpoint carries the trigger. The contract suite checks every registered
method for independence from segment ends (``test_training_does_not_depend_on_segment_ends``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TinyAdapter, TinyNet

from pilot_online.core.triggers import (
    TRIGGERS,
    ConsolidationTrigger,
    EveryNSamples,
    NewClasses,
    Plateau,
    make_trigger,
)
from pilot_online.engine.adapter import Consolidated, Consolidation
from pilot_online.engine.config import ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop


def firings(trigger: ConsolidationTrigger, batches, losses=None) -> list[int]:
    """Run ``trigger`` as the loop does over label batches (and each step's loss): asked before
    each step, told after it. The samples trained before each firing."""
    losses = losses if losses is not None else [None] * len(batches)
    for labels, loss in zip(batches, losses):
        trigger.update(torch.tensor(labels))
        trigger.observe(len(labels), loss)
    return trigger.firings


def test_never_fires():
    assert firings(ConsolidationTrigger(), [[0, 1]] * 50) == []


def test_every_n_samples_restarts_its_count_at_each_firing():
    # n = 10, batches of 4: 12 >= 10 trained before the 4th step, which it precedes; the count
    # restarts: 12 more before the 7th step (sample 24).
    assert firings(EveryNSamples(10), [[0] * 4] * 7) == [12, 24]
    # n = 8 divides 4 * 2: before every third batch. After the last batch no step is left.
    assert firings(EveryNSamples(8), [[0] * 4] * 6) == [8, 16]
    # Batches of unequal size (a stream's last batch): 3 + 3 = 6 < 7, + 2 = 8 fires.
    assert firings(EveryNSamples(7), [[0] * 3, [0] * 3, [0] * 2, [0] * 3]) == [8]


def test_new_classes_fires_at_the_first_class_beyond_k():
    batches = [
        [0, 0, 1],  # 0 and 1 new: 2 counted
        [1, 0, 2],  # 2 is the 3rd class: fires before this batch (3 samples), 2 starts the count
        [2, 2, 2],  # nothing new
        [3, 4, 5],  # 3, 4, 5: counted 1 < 2 before them, so no firing; 4 counted
        [5, 0, 1],  # nothing new
        [6, 7, 6],  # 6 and 7 new, 4 >= 2 counted: fires (15 samples); 2 counted
    ]
    trigger = NewClasses(2, num_classes=8)
    assert firings(trigger, batches) == [3, 15]
    assert trigger.counted == 2 and trigger.seen.all()


def test_new_classes_fires_at_each_task_boundary_of_a_clear_stream():
    # Three tasks of two classes, two batches of 4 each: boundaries after samples 8 and 16.
    batches = [[0, 1, 1, 0], [0, 1, 0, 1], [2, 3, 3, 3], [2, 2, 3, 2], [4, 4, 4, 4], [5, 4, 5, 4]]
    assert firings(NewClasses(2, num_classes=6), batches) == [8, 16]
    # A class already seen never counts again: k = 1 fires only at 1's first sample.
    assert firings(NewClasses(1, num_classes=4), [[0, 0], [0, 0], [1, 0], [1, 1]]) == [4]


def test_plateau_fires_under_both_thresholds_and_rearms_after_a_peak():
    # Window 3, mean < 1, variance < 0.01. Steps of 2 samples.
    losses = [5.0, 4.0, 3.0, 0.5, 0.5, 0.5, 0.5, 3.0, 3.0, 0.4, 0.4, 0.4, 0.4]
    # Step 6: window (0.5, 0.5, 0.5), mean 0.5 < 1, variance 0: a plateau, so the trigger fires
    # before step 7 (12 samples). Step 7 is a plateau too but the detector is disarmed; step 8's
    # window mean (0.5 + 0.5 + 3) / 3 = 1.33 > 0.5 + 0 re-arms it; step 12's window
    # (0.4, 0.4, 0.4) is a plateau again: fires before step 13 (24 samples).
    trigger = Plateau(window=3, mean_threshold=1.0, variance_threshold=0.01)
    assert firings(trigger, [[0, 1]] * len(losses), losses) == [12, 24]
    assert trigger.needs_loss


def test_plateau_needs_the_loss():
    with pytest.raises(ValueError, match="needs the step's loss"):
        Plateau(3, 1.0, 0.1).observe(4, None)


@pytest.mark.parametrize(
    ("trigger", "losses"),
    [
        (EveryNSamples(6), None),
        (NewClasses(2, num_classes=8), None),
        (Plateau(2, 1.5, 0.5), [3.0, 1.0, 1.0, 2.5, 2.5, 1.0, 1.0, 1.0]),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_a_restored_trigger_fires_where_the_original_does(trigger, losses):
    batches = [[0, 1], [2, 2], [3, 4], [1, 5], [6, 0], [7, 7], [2, 3], [0, 1]]
    losses = losses or [None] * len(batches)
    reference = copy.deepcopy(trigger)
    expected = firings(reference, batches, losses)
    firings(trigger, batches[:3], losses[:3])
    state = trigger.state_dict()
    restored = make_trigger(
        {
            "consolidation": trigger.name,
            "consolidation_every_n_samples": 6,
            "consolidation_new_classes": 2,
            "consolidation_plateau_window": 2,
            "consolidation_plateau_mean": 1.5,
            "consolidation_plateau_variance": 0.5,
        },
        num_classes=8,
    )
    restored.load_state_dict(state)
    assert firings(restored, batches[3:], losses[3:]) == expected
    assert expected  # each trigger fires on this stream


def test_a_checkpoint_of_another_trigger_is_refused():
    state = EveryNSamples(4).state_dict()
    with pytest.raises(ValueError, match="'every_n_samples', the config's 'new_classes'"):
        NewClasses(2, 4).load_state_dict(state)


def test_make_trigger_builds_each_choice():
    built = {name: make_trigger({"consolidation": name}, num_classes=4) for name in TRIGGERS}
    assert {name: trigger.name for name, trigger in built.items()} == {n: n for n in TRIGGERS}
    assert make_trigger({}, num_classes=4).name == "never"
    with pytest.raises(ValueError, match=r"unknown consolidation 'plateu'.*did you mean 'plateau'"):
        make_trigger({"consolidation": "plateu"}, num_classes=4)


# -- config ------------------------------------------------------------------------------------
def smoke(method: str = "coda_online", **overrides):
    from conftest import raw_smoke_config

    return resolve_config({**raw_smoke_config(method), **overrides})


def test_a_null_trigger_resolves_to_the_method_default():
    assert smoke()["consolidation"] == "never"


def test_a_trigger_the_method_would_ignore_is_refused():
    with pytest.raises(ConfigError, match="coda_online does nothing at a consolidation"):
        smoke(consolidation="every_n_samples")
    with pytest.raises(ConfigError, match="consolidation_new_classes must be a positive integer"):
        smoke(consolidation_new_classes=0)


# -- the loop ----------------------------------------------------------------------------------
class Consolidating(TinyAdapter):
    """Records each consolidation; restarts the classifier's weight (its optimiser state goes)."""

    consolidation = Consolidation(trigger="every_n_samples")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[int, int]] = []
        self.loop = None

    def consolidate(self, network, firing):
        self.calls.append((firing, self.loop.samples_seen))
        return Consolidated(restarted=[network.fc.weight])


def make_loop(adapter, **config):
    loop = build_loop(adapter, TinyNet(), {"consolidation": "every_n_samples", **config}, 6)
    adapter.loop = loop
    return loop


def step(loop, labels):
    loop.train_step(torch.randn(len(labels), 5), torch.tensor(labels))


def test_the_loop_consolidates_before_the_step_and_drops_restarted_state():
    adapter = Consolidating()
    loop = make_loop(adapter, consolidation_every_n_samples=8)
    fc = loop.network.fc
    for _ in range(2):
        step(loop, [0, 1, 2, 3])
    assert adapter.calls == []
    step(loop, [4, 5, 0, 1])  # 8 samples trained: consolidates before this step
    assert adapter.calls == [(0, 8)]
    # The restarted weight's Adam state began again at this step; the bias kept its three.
    state = loop.optimizer.state
    assert int(state[fc.weight]["step"]) == 1 and int(state[fc.bias]["step"]) == 3
    for _ in range(2):
        step(loop, [4, 5, 0, 1])
    assert adapter.calls == [(0, 8), (1, 16)]
    assert loop.report()["consolidation"] == {"trigger": "every_n_samples", "firings": [8, 16]}


def test_a_method_that_trains_nothing_consolidates_too():
    class Observing(Consolidating):
        trains = False

    adapter = Observing()
    loop = make_loop(adapter, consolidation_every_n_samples=4)
    step(loop, [0, 1, 2, 3])
    step(loop, [0, 1, 2, 3])
    assert adapter.calls == [(0, 4)] and loop.optimizer_steps == 0


def test_a_skipped_step_is_not_observed():
    adapter = Consolidating()
    loop = make_loop(adapter, consolidation_every_n_samples=4)
    loop.train_step(torch.full((4, 5), float("nan")), torch.tensor([0, 1, 2, 3]))
    step(loop, [0, 1, 2, 3])
    assert adapter.calls == [] and loop.trigger.samples == 4


def test_the_loop_checkpoint_carries_the_trigger():
    adapter = Consolidating()
    loop = make_loop(adapter, consolidation_every_n_samples=12)
    for _ in range(2):
        step(loop, [0, 1, 2, 3])
    resumed_adapter = Consolidating()
    resumed = make_loop(resumed_adapter, consolidation_every_n_samples=12)
    resumed.load_state_dict(loop.state_dict())
    step(resumed, [0, 1, 2, 3])  # 12 samples trained: 4 of them after the resume
    step(resumed, [0, 1, 2, 3])
    assert resumed_adapter.calls == [(0, 12)]
    assert resumed.trigger.firings == [12]
    assert "consolidation" not in build_loop(TinyAdapter(), TinyNet(), {}, 6).report()


def test_a_restored_plateau_detector_stays_disarmed():
    """Constant losses of 1 under a mean threshold of 1.5: the detector fires at its first step
    (it starts armed), then stays disarmed, since no window mean rises above the last plateau's
    1 + sqrt(0). Restored mid-stream, it must stay disarmed: a fresh detector (armed) would fire
    again at the first step after the resume, at 8 samples."""
    batches, losses = [[0, 1]] * 6, [1.0] * 6
    expected = firings(Plateau(3, 1.5, 0.5), batches, losses)
    assert expected == [2]
    trigger = Plateau(3, 1.5, 0.5)
    firings(trigger, batches[:3], losses[:3])
    restored = Plateau(3, 1.5, 0.5)
    restored.load_state_dict(trigger.state_dict())
    assert firings(restored, batches[3:], losses[3:]) == expected


class Penalised(Consolidating):
    """A method whose own loss term is 10 at every step: the total loss never goes under the
    plateau's mean threshold of 6, its classification loss (about log 6 = 1.8) always does."""

    def forward(self, network, x, train):
        out = super().forward(network, x, train)
        out.aux_loss = 10.0 + 0.0 * out.logits.sum()
        return out


def test_the_plateau_trigger_reads_the_classification_loss():
    """Online-LoRA's detector watches the loss it trains on for classification; a method's own
    terms (prompt losses, regularisers) are not part of it. Fed the total loss (11.8), it would
    never fire here; fed the classification loss, it fires after the first step."""
    adapter = Penalised()
    loop = make_loop(
        adapter,
        consolidation="plateau",
        consolidation_plateau_window=1,
        consolidation_plateau_mean=6.0,
        consolidation_plateau_variance=0.5,
    )
    step(loop, [0, 1, 2, 3])
    step(loop, [0, 1, 2, 3])
    assert adapter.calls == [(0, 4)] and loop.trigger.firings == [4]

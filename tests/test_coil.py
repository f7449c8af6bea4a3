"""COIL online (``coil_online``) on a tiny network, no PILOT: the loss weights by hand, the teacher
from the first firing on, the transport-initialised rows against independently computed means,
the arrivals rule, a checkpoint round trip and the config's refusals.

Model: ``features = tanh(backbone(x))`` (never zero, so every mean has a direction), COIL's cosine
head over 6 classes. Stream: classes 0-2, then 3 and 4 (the trigger, new_classes 3, fires first),
then 5 (no firing: 2 classes since the last one)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import unit_config
from torch import nn

from pilot_online.core.transport import prospective_rows
from pilot_online.engine.adapter import StepOutput, TrainingBatch
from pilot_online.engine.config import VARIANTS, ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.teacher import distillation_loss
from pilot_online.methods.coil import (
    NEW_BRANCH_WEIGHT,
    COILOnline,
    attach_coil_head,
)

C, D_IN, D = 6, 5, 4
X = torch.randn(12, D_IN, generator=torch.Generator().manual_seed(5))
Y = torch.tensor([0, 1, 2, 0, 3, 4, 3, 1, 5, 0, 5, 3])
STEPS = (np.arange(0, 4), np.arange(4, 8), np.arange(8, 12))


class TinyCOIL(COILOnline):
    """COIL's rules over a one-layer backbone (no PILOT)."""

    def build_network(self, args: dict) -> nn.Module:
        network = nn.Module()
        network.backbone = nn.Sequential(nn.Linear(D_IN, D), nn.Tanh())
        attach_coil_head(network, D, int(args["nb_classes"]))
        self._state = network.co_transport
        return network


def config(**overrides) -> dict:
    settings = {
        "consolidation": "new_classes",
        "consolidation_new_classes": 3,
        "er_memory_size": 6,
        "er_batch_size": 2,
        **overrides,
    }
    return unit_config(COILOnline, C, **settings)


def make_loop(**overrides):
    cfg = config(**overrides)
    torch.manual_seed(0)
    adapter = TinyCOIL(args=cfg)
    loop = build_loop(adapter, adapter.build_network(cfg), cfg, C)
    loop.attach_samples(lambda indices: (X[torch.as_tensor(indices)], Y[torch.as_tensor(indices)]))
    return loop


def step(loop, rows: np.ndarray):
    return loop.train_step(X[rows], Y[rows], rows)


def unit_features(backbone: nn.Module, rows: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return F.normalize(torch.tanh(backbone[0](X[rows])), dim=1)


def log_softmax(values: list[float]) -> list[float]:
    top = max(values)
    total = math.log(sum(math.exp(v - top) for v in values)) + top
    return [v - total for v in values]


# -- the loss by hand ---------------------------------------------------------------------------
def test_the_loss_weights_by_hand():
    """Known {0, 1}; classes 0-2 seen before the step, whose batch brings 3: lamda = 2 / 4. CE
    takes 1 - lamda; the distillation over columns 0, 1 takes lamda; the new branch (columns 2,
    3, transported rows e1 and e2, so the target logits are the unit features' coordinates)
    takes 0.001."""
    cfg = config()
    adapter = TinyCOIL(args=cfg)
    network = adapter.build_network(cfg)
    state = network.co_transport
    state.known[:2] = True
    state.seen[:3] = True
    state.transported[2:4] = True
    state.new_branch[2, 0] = state.new_branch[3, 1] = 1.0
    logits = torch.tensor([[1.0, -0.5, 0.3, 2.0, 0.0, 0.0], [0.2, 0.4, -1.0, 0.5, 0.0, 0.0]])
    teacher = torch.tensor([[0.6, 0.1, 9.0, 9.0, 9.0, 9.0], [-0.3, 1.2, 9.0, 9.0, 9.0, 9.0]])
    features = torch.tensor([[0.6, 0.8, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    labels = torch.tensor([3, 2])
    out = StepOutput(logits, features)
    seen = torch.tensor([True] * 4 + [False] * 2)
    batch = TrainingBatch(
        X[:2], labels, 2, seen, state.known.clone(), StepOutput(teacher, features)
    )

    ce = F.cross_entropy(logits, labels).item()
    terms = adapter.loss_terms(network, out, batch)
    assert terms["ce"].item() == pytest.approx(0.5 * ce, rel=1e-6)
    assert state.seen.tolist() == seen.tolist()  # the loop's seen, kept for the next lamda
    temperature = cfg["T"]

    def distilled(student_rows, target_rows, columns):
        total = 0.0
        for student, target in zip(student_rows, target_rows):
            log_p = log_softmax([student[c] / temperature for c in columns])
            q = [math.exp(v) for v in log_softmax([target[c] / temperature for c in columns])]
            total -= sum(qc * lc for qc, lc in zip(q, log_p))
        return total / len(student_rows)

    kd = distilled(logits.tolist(), teacher.tolist(), [0, 1])
    # The new branch's target: cos(feature, e1) and cos(feature, e2) in columns 2 and 3.
    targets = [[0, 0, f[0], f[1], 0, 0] for f in features.tolist()]
    new_branch = distilled(logits.tolist(), targets, [2, 3])
    assert terms["distillation"].item() == pytest.approx(0.5 * kd, rel=1e-6)
    assert terms["new_branch"].item() == pytest.approx(NEW_BRANCH_WEIGHT * new_branch, rel=1e-6)


def test_no_column_gives_a_zero_term_without_nan():
    """Before any transport the new branch has no column: 0, with a zero gradient."""
    logits = torch.randn(3, C, requires_grad=True)
    value = distillation_loss(logits, torch.randn(3, C), torch.zeros(C, dtype=torch.bool), 2.0)
    value.backward()
    assert value.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


# -- the stream: teacher, transports --------------------------------------------------------------
@pytest.fixture(scope="module")
def stream():
    """The three steps, with the network before each and each step's stats."""
    loop = make_loop()
    before, stats = [], []
    for rows in STEPS:
        before.append(copy.deepcopy(loop.network))
        stats.append(step(loop, rows))
    return loop, before, stats


def test_the_teacher_exists_from_the_first_firing(stream):
    """Step 0: no teacher, the loss is the plain CE (upstream's first task). Step 1 fires first:
    the teacher is the network after step 0, frozen, and the distillation and the (still empty)
    new branch join; at step 2 the new branch is not empty."""
    loop, before, stats = stream
    assert set(stats[0].terms) == {"ce"}
    assert loop.trigger.firings == [4]
    assert loop.teacher is not None and loop.teacher.firing == 0
    for name, value in loop.teacher.module.state_dict().items():
        torch.testing.assert_close(value, before[1].state_dict()[name], rtol=0, atol=0, msg=name)
    assert not any(p.requires_grad for p in loop.teacher.module.parameters())
    assert set(stats[1].terms) == {"ce", "distillation", "new_branch"}
    assert stats[1].terms["new_branch"].item() == 0.0
    assert stats[2].terms["new_branch"].item() > 0.0
    assert loop.network.co_transport.known.tolist() == [True] * 3 + [False] * 3
    report = loop.report()["method"]["coil"]
    assert (report["transports"], report["known"], report["transported"]) == (2, 3, 3)


def test_the_first_arrivals_rows_are_transported(stream):
    """After step 1 (classes 3 and 4 arrive): the transport from classes 0-2 (means of step 0's
    normalised features, under the network as built; rows as after step 0) to 3 and 4 (means of
    step 1's features, under the network after step 0) set rows 3 and 4 and the new branch."""
    loop, before, _ = stream
    cfg = loop.config
    old_features = unit_features(before[0].backbone, STEPS[0])
    old_means = torch.stack([old_features[Y[STEPS[0]] == c].mean(0) for c in range(3)])
    new_features = unit_features(before[1].backbone, STEPS[1])
    new_means = torch.stack([new_features[Y[STEPS[1]] == c].mean(0) for c in (3, 4)])
    rows, gamma = prospective_rows(
        F.normalize(old_means.double(), dim=1),
        F.normalize(new_means.double(), dim=1),
        before[1].fc.weight.detach()[:3].double(),
        cfg["sinkhorn"],
        cfg["norm_term"],
    )
    state = before[2].co_transport  # as step 1 left it
    torch.testing.assert_close(before[2].fc.weight[3:5], rows.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.new_branch[3:5], rows.float(), rtol=1e-5, atol=1e-6)
    assert state.transported.tolist() == [False] * 3 + [True, True, False]
    assert state.calibration.item() == pytest.approx(gamma.item(), rel=1e-5)
    # The known classes' rows are trained, never transported.
    assert not torch.equal(before[2].fc.weight[:3], before[1].fc.weight[:3])


def test_a_later_arrival_is_transported_jointly_with_the_earlier_ones(stream):
    """After step 2 (class 5 arrives, 3 streams again): the transport runs over 3, 4 and 5
    (class 3's mean now over both its steps); row 5 is set, rows 3 and 4 keep what step 2
    trained, and the new branch's rows of all three are replaced."""
    loop, before, _ = stream
    cfg = loop.config
    state = loop.network.co_transport
    anchor = before[2].co_transport  # the firing's state, kept through the period
    step1 = unit_features(before[1].backbone, STEPS[1])
    step2 = unit_features(before[2].backbone, STEPS[2])
    y1, y2 = Y[STEPS[1]], Y[STEPS[2]]
    means = [
        torch.cat([step1[y1 == 3], step2[y2 == 3]]).mean(0),
        step1[y1 == 4].mean(0),
        step2[y2 == 5].mean(0),
    ]
    old_features = unit_features(before[0].backbone, STEPS[0])
    old_means = torch.stack([old_features[Y[STEPS[0]] == c].mean(0) for c in range(3)])
    rows, _ = prospective_rows(
        F.normalize(old_means.double(), dim=1),
        F.normalize(torch.stack(means).double(), dim=1),
        before[1].fc.weight.detach()[:3].double(),
        cfg["sinkhorn"],
        cfg["norm_term"],
    )
    torch.testing.assert_close(state.new_branch[3:6], rows.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loop.network.fc.weight[5], rows[2].float(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(loop.network.fc.weight[3:5], rows[:2].float(), atol=1e-4)
    assert torch.equal(state.anchor_rows, anchor.anchor_rows)
    assert torch.equal(state.anchor_rows, before[1].fc.weight)  # the rows at the firing
    assert state.transported.tolist() == [False] * 3 + [True] * 3


def test_a_checkpoint_round_trip_continues_bit_for_bit():
    """+ P + FGH: two steps (one firing, one transport), a checkpoint, then the third step on the
    loop and on a fresh loop restored from it: the same loss, weights and COIL state."""
    rows = VARIANTS["fgh"]
    loop = make_loop(**rows)
    for part in STEPS[:2]:
        step(loop, part)
    saved = copy.deepcopy(loop.state_dict())
    fresh = make_loop(**rows)
    fresh.load_state_dict(saved)
    assert fresh.teacher is not None and fresh.teacher.firing == 0
    first, second = step(loop, STEPS[2]), step(fresh, STEPS[2])
    assert torch.equal(first.loss, second.loss)
    for name, value in loop.network.state_dict().items():
        torch.testing.assert_close(fresh.network.state_dict()[name], value, msg=name)
    assert loop.report()["method"] == fresh.report()["method"]


# -- the config ---------------------------------------------------------------------------------
def raw_config(**overrides) -> dict:
    model = {"model_name": "coil_online", "backbone_type": "vit_base_patch16_224"}
    return {**model, "dataset": "cifar224", **overrides}


def test_the_defaults_are_upstreams():
    cfg = resolve_config(raw_config())
    assert (cfg["sinkhorn"], cfg["norm_term"], cfg["T"]) == (0.464, 3.0, 2.0)
    assert (cfg["er_memory_size"], cfg["er_memory"], cfg["er_memory_per_class"]) == (
        2000,
        "herding",
        None,
    )
    assert COILOnline.consolidation.trigger == "new_classes" and COILOnline.consolidation.teacher


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"consolidation": "never"}, "takes no teacher and no transport"),
        ({"sinkhorn": 0}, "sinkhorn must be a number > 0"),
        ({"norm_term": 0.5}, "norm_term must be a number >= 1"),
        ({"er_memory_size": 0}, "er_memory_size must be > 0"),
    ],
)
def test_bad_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(raw_config(**overrides))

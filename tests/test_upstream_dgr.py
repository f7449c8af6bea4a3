"""``dgr_online`` against upstream's own code (PILOT ``models/dgr.py``).

The port claims DGR's logit-adjusted cross-entropy (``regularized_cn``), its distillation from the
network at the last task end (``_KD_loss``, weighted by ``lambda * known / (total - known)``),
and its per-class gradient reweighting of the head's rows, from the row-gradient norms of the
cross-entropy accumulated since the task began: ``min(G) / G_c`` on the first task
(``_init_train``); on later ones (``_update_representation``) old and new classes each within
their group, scaled by ``rs_old`` and ``rs_new``, with the distillation's head gradient added
times ``ratio_kd``. Upstream's learner runs one batch with an optimiser that only records
gradients, on the same weights and state as ours, and our loop's step on the same batch (stream
and replayed rows) must give the same gradient on every parameter.

Upstream's ``regularized_cn`` moves its prior to CUDA (``.cuda()``); :func:`prior_on_cpu` leaves
it on the CPU, where these tests run.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import PILOT_ROOT, build_smoke_method, classification_term, requires_pilot
from test_upstream_finetune import (
    BASE_ROW,
    NUM_CLASSES,
    GradientsOnly,
    NoSchedule,
    assert_same_gradients,
    images,
    one_batch,
    upstream_learner,
)
from torch import nn

from pilot_online.core.masks import training_mask
from pilot_online.core.memory import ClassBalancedMemory
from pilot_online.engine.adapter import StepOutput, TrainingBatch
from pilot_online.engine.mixins import build_loop

pytestmark = requires_pilot

Built = tuple[Any, nn.Module, dict[str, Any]]
OLD = 4  # classes of the first task; the second brings 4 more
UPSTREAM_KEYS = {"init_epoch": 1, "epochs": 1, "T": 2, "lambda": 1}
#: The loop's stream: a first task of KNOWN classes, then a firing and the other 3 (5 / 3 is
#: the distillation weight, so that known / new and new / known tell apart).
KNOWN = 5
STEPS = ([0, 1, 2, 3, 4, 0, 1, 2], [5, 6, 7, 5, 6, 7, 0, 3], [0, 1, 2, 3, 4, 5, 6, 7, 5, 6])
REPLAYED = 4


@pytest.fixture(scope="module")
def dgr(pilot_on_path: Path) -> Iterator[Built]:
    yield build_smoke_method("dgr_online", **BASE_ROW)


@contextmanager
def prior_on_cpu() -> Iterator[None]:
    """``Tensor.cuda()`` returns the tensor itself, so ``regularized_cn`` runs on the CPU."""
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *args, **kwargs: self):
        yield


class GradSumsFrom:
    """``models/dgr.py``'s ``np`` with ``np.zeros`` (called once per ``_update_representation``:
    its ``gradall``) starting at ``start``: upstream's row-norm sums over the task's earlier
    batches, here ours, so that its second batch of a task runs on our state."""

    def __init__(self, start: np.ndarray) -> None:
        self.start = start

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def zeros(self, shape: Any, dtype: Any = float) -> np.ndarray:
        assert np.shape(self.start) == np.zeros(shape).shape
        return self.start.astype(dtype).copy()


def our_step(adapter: Any, network: nn.Module, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
    """Our adapter's part of one loop step before any firing, without the optimiser: the loss
    under the batch mask, backward, DGR's reweighting."""
    adapter.set_mode(network, train=True)
    network.zero_grad(set_to_none=True)
    out = adapter.forward(network, x, train=True)
    mask = training_mask("batch", y, torch.zeros(NUM_CLASSES, dtype=torch.bool), NUM_CLASSES)
    classification_term(adapter, network, out, y, mask).backward()
    adapter.after_backward(network, contextlib.nullcontext)
    return out


def gradients(network: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in network.named_parameters() if p.grad is not None}


def upstream_dgr(built: Built, total: int, **keys: Any) -> Any:
    """Upstream's learner on a copy of our network, its head grown to ``total`` classes with our
    rows."""
    adapter, network, config = built
    from models.dgr import Learner

    learner = upstream_learner(
        Learner, adapter, config, network.backbone, **{**UPSTREAM_KEYS, **keys}
    )
    learner._network.update_fc(total)
    with torch.no_grad():
        learner._network.fc.weight.copy_(network.fc.weight[:total])
        learner._network.fc.bias.copy_(network.fc.bias[:total])
    return learner


def test_first_task_is_upstreams_init_train(dgr: Built) -> None:
    """One imbalanced batch of the first task: our gradients are ``_init_train``'s, whose
    reweighting is ``min(G) / G_c``."""
    adapter, network, _ = dgr
    x, y = images([0, 1, 2, 3, 0, 0, 1])
    learner = upstream_dgr(dgr, OLD)
    learner._cur_task, learner._known_classes, learner._total_classes = 0, 0, OLD
    label_distribution = np.bincount(y.numpy(), minlength=OLD)
    with prior_on_cpu():
        learner._init_train(
            one_batch(x, y),
            one_batch(x, y),
            GradientsOnly(learner._network.parameters()),
            NoSchedule(),
            label_distribution,
        )
    adapter.clear_statistics()
    our_step(adapter, network, x, y)
    assert_same_gradients(gradients(network), learner._network)
    assert adapter.weights[:OLD].min() < 0.9  # the reweighting acted


@pytest.fixture(scope="module")
def after_firing(pilot_on_path: Path) -> dict[str, Any]:
    """Our loop (base row, SGD, herding replay, the default ``new_classes`` trigger at
    ``KNOWN`` classes) on :data:`STEPS`: the trigger fires before step 2, so step 3 is the
    second step of the new task, its network moved away from its teacher. Upstream's learner
    holds that state: its network built on our teacher's weights and ``after_task`` called
    (upstream's own ``_old_network = copy().freeze()``, ``_known_classes``), then our step-3
    weights loaded into its grown network; its ``gradall`` starts at our ``G`` after step 2
    (:class:`GradSumsFrom`) and its label distribution is our running counts. It then runs
    ``_update_representation`` with ``lambda`` 1 on step 3's whole batch (stream and replay)."""
    from models import dgr as upstream

    adapter, network, config = build_smoke_method(
        "dgr_online",
        **BASE_ROW,
        er_memory_size=40,
        er_batch_size=REPLAYED,
        consolidation_new_classes=KNOWN,
    )
    loop = build_loop(adapter, network, config, NUM_CLASSES)
    labels = [label for step in STEPS for label in step]
    pool_x, pool_y = images(labels, seed=5)
    drawn: list[np.ndarray] = []

    def load(indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        drawn.append(np.asarray(indices).copy())
        return pool_x[torch.as_tensor(indices)], pool_y[torch.as_tensor(indices)]

    loop.attach_samples(load)
    starts = np.cumsum([0, *map(len, STEPS)])
    batches = [np.arange(starts[i], starts[i + 1]) for i in range(len(STEPS))]
    loop.train_step(pool_x[batches[0]], pool_y[batches[0]], batches[0])
    before_firing = {n: t.detach().clone() for n, t in network.state_dict().items()}
    loop.train_step(pool_x[batches[1]], pool_y[batches[1]], batches[1])
    assert loop.trigger.firings == [len(STEPS[0])]  # before step 2
    teacher = loop.teacher.module

    learner = upstream_learner(
        upstream.Learner, adapter, config, teacher.backbone, thaw=True, **UPSTREAM_KEYS
    )
    learner._network.update_fc(KNOWN)
    learner._total_classes = KNOWN
    with torch.no_grad():
        learner._network.fc.weight.copy_(teacher.fc.weight[:KNOWN])
        learner._network.fc.bias.copy_(teacher.fc.bias[:KNOWN])
    learner.after_task()
    learner._cur_task, learner._total_classes = 1, NUM_CLASSES
    learner._network.update_fc(NUM_CLASSES)
    learner._network.backbone.load_state_dict(network.backbone.state_dict())
    with torch.no_grad():
        learner._network.fc.weight.copy_(network.fc.weight)
        learner._network.fc.bias.copy_(network.fc.bias)
    grad_sums = adapter.grad_sums.cpu().numpy().copy()

    captured: dict[str, Any] = {}
    transform = adapter.after_backward

    def spy(net: nn.Module, autocast) -> dict:
        captured["distillation"] = adapter.distillation
        captured["head"] = net.fc.weight.grad.clone()  # the loss's head gradient
        return transform(net, autocast)

    with mock.patch.object(adapter, "after_backward", spy):
        stats = loop.train_step(pool_x[batches[2]], pool_y[batches[2]], batches[2])
    captured["after"] = adapter.distillation
    ours = gradients(network)
    assert len(drawn) == 2  # steps 2 and 3 replayed (the memory was empty at step 1)
    x = torch.cat([pool_x[batches[2]], pool_x[drawn[-1]]])
    y = torch.cat([pool_y[batches[2]], pool_y[drawn[-1]]])
    counts = adapter.label_counts.cpu().numpy()
    with prior_on_cpu(), mock.patch.object(upstream, "np", GradSumsFrom(grad_sums)):
        learner._update_representation(
            one_batch(x, y),
            one_batch(x, y),
            GradientsOnly(learner._network.parameters()),
            NoSchedule(),
            counts,
        )
    return {
        "adapter": adapter,
        "loop": loop,
        "learner": learner,
        "ours": ours,
        "stats": stats,
        "captured": captured,
        "before_firing": before_firing,
        "y": y,
        "replayed_at_step_2": pool_y[drawn[0]],
        "counts": counts,
    }


def test_step_after_a_firing_is_upstreams_update_representation(
    after_firing: dict[str, Any],
) -> None:
    """Every parameter's gradient, the head's rows after upstream's replacement
    (``w * g_ce + ratio_kd * g_kd`` on the old rows, ``w * g_ce`` on the new) and the backbone's
    plain ``loss.backward()`` one with ``lambda * 5 / 3`` times the distillation, is upstream's."""
    learner, ours = after_firing["learner"], after_firing["ours"]
    largest = assert_same_gradients(ours, learner._network)
    assert largest < 1e-5
    # The state was the one claimed: replayed rows, both groups, the distillation at work.
    y = after_firing["y"]
    assert len(y) == len(STEPS[2]) + REPLAYED
    trained = [STEPS[1], after_firing["replayed_at_step_2"].numpy(), y.numpy()]
    counted = np.bincount(np.concatenate(trained), minlength=NUM_CLASSES)
    assert after_firing["counts"].tolist() == counted.tolist()
    stats, adapter = after_firing["stats"], after_firing["adapter"]
    kd = after_firing["stats"].terms["kd"]
    assert not stats.skipped and kd.item() > 0.1
    assert adapter.known.tolist() == [True] * KNOWN + [False] * (NUM_CLASSES - KNOWN)
    # The distillation's share of the old rows is not small: without it they would be w * g.
    captured = after_firing["captured"]
    without = adapter.weights.float()[:, None] * captured["head"]
    added = ours["fc.weight"] - without
    assert added[:KNOWN].norm() > 0.1 * ours["fc.weight"][:KNOWN].norm()
    assert added[KNOWN:].abs().max() == 0  # new rows: no distillation
    assert captured["after"] is None  # consumed by the step's transform


def test_difference_teacher_at_firing(after_firing: dict[str, Any]) -> None:
    """Our teacher is the network as it was when the trigger fired (before step 2), as
    upstream's ``after_task`` copies it at a task end; it distils the classes seen before the
    firing, a mask: here the prefix 0-4, so upstream's ``logits[:, :known]`` gave the same
    gradients above; with known classes {1, 3}, ours reads those columns, not the prefix."""
    from models.dgr import _KD_loss

    teacher = after_firing["loop"].teacher
    for name, tensor in teacher.module.state_dict().items():
        assert torch.equal(tensor, after_firing["before_firing"][name]), name
    assert teacher.classes.tolist() == [True] * KNOWN + [False] * (NUM_CLASSES - KNOWN)
    adapter = after_firing["adapter"]
    generator = torch.Generator().manual_seed(4)
    features = torch.randn(6, 3, generator=generator)
    network = nn.Module()
    network.fc = nn.Linear(3, NUM_CLASSES)
    out = StepOutput(network.fc(features), features)
    soft = torch.randn(6, NUM_CLASSES, generator=generator)
    known = torch.zeros(NUM_CLASSES, dtype=torch.bool)
    known[[1, 3]] = True
    seen = known.clone()
    seen[[0, 5]] = True  # two new classes: weight lambda * 2 / 2
    batch = TrainingBatch(features, torch.zeros(6).long(), 6, seen, known, StepOutput(soft, None))
    ours = adapter.loss_terms(network, out, batch)["kd"]
    logits = out.logits.detach()
    masked = _KD_loss(logits[:, [1, 3]], soft[:, [1, 3]], 2)
    prefix = _KD_loss(logits[:, :2], soft[:, :2], 2)
    assert ours.item() == pytest.approx(masked.item(), rel=1e-6)
    assert abs(ours.item() - prefix.item()) > 1e-3


def test_difference_new_classes_counted_online(dgr: Built) -> None:
    """Upstream weighs ``_KD_loss`` by ``lambda * known / (total - known)`` with the task's
    total known up front (4 known of 8: 1); ours counts the classes seen so far: with 6 seen,
    4 / 2; with none new yet, at least one (4 / 1)."""
    from models.dgr import _KD_loss

    adapter = dgr[0]
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(5, 3, generator=generator)
    network = nn.Module()
    network.fc = nn.Linear(3, NUM_CLASSES)
    out = StepOutput(network.fc(features), features)
    soft = torch.randn(5, NUM_CLASSES, generator=generator)
    known = torch.arange(NUM_CLASSES) < OLD
    upstream = _KD_loss(out.logits.detach()[:, :OLD], soft[:, :OLD], 2).item()
    for seen_count, weight in ((6, 2.0), (OLD, 4.0), (NUM_CLASSES, 1.0)):
        seen = torch.arange(NUM_CLASSES) < seen_count
        batch = TrainingBatch(
            features, torch.zeros(5).long(), 5, seen, known, StepOutput(soft, None)
        )
        ours = adapter.loss_terms(network, out, batch)["kd"].item()
        assert ours == pytest.approx(weight * upstream, rel=1e-6)
    seen = torch.arange(NUM_CLASSES) < 6
    batch = TrainingBatch(features, torch.zeros(5).long(), 5, seen, known, StepOutput(soft, None))
    assert abs(adapter.loss_terms(network, out, batch)["kd"].item() - upstream) > 1e-3


class OneKnownClass(nn.Module):
    """An old network that knew one class: its logits, any values, for that class only."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": torch.linspace(-1.0, 1.0, len(x))[:, None]}


def test_difference_kd_ratio_without_gradient(dgr: Built) -> None:
    """With one known class the KD loss is 0 and has no gradient (a softmax over one logit is
    1), so upstream's ``ratio_kd`` divides by 0 and its known class's head row is NaN. Ours
    gives that row its reweighted cross-entropy gradient; every other parameter's gradient is
    upstream's."""
    adapter, network, _ = dgr
    x, y = images([0, 1, 2, 1, 2, 0], seed=6)
    total = 3
    learner = upstream_dgr(dgr, total)
    learner._cur_task, learner._known_classes, learner._total_classes = 1, 1, total
    learner._old_network = OneKnownClass()
    with prior_on_cpu(), np.errstate(divide="ignore", invalid="ignore"):
        learner._update_representation(
            one_batch(x, y),
            one_batch(x, y),
            GradientsOnly(learner._network.parameters()),
            NoSchedule(),
            np.bincount(y.numpy(), minlength=total),
        )
    upstream = dict(learner._network.named_parameters())
    assert torch.isnan(upstream["fc.weight"].grad[0]).all()
    assert torch.isnan(upstream["fc.bias"].grad[0])

    adapter.clear_statistics()
    stats = adapter._statistics(network)
    stats["seen"][0] = True
    adapter.consolidate(network, 0)  # class 0 known, G and the counts restarted
    adapter.set_mode(network, train=True)
    network.zero_grad(set_to_none=True)
    out = adapter.forward(network, x, train=True)
    seen = torch.arange(NUM_CLASSES) < total
    mask = training_mask("batch", y, seen, NUM_CLASSES)
    known = torch.arange(NUM_CLASSES) < 1
    teacher = torch.zeros(len(y), NUM_CLASSES)
    teacher[:, 0] = OneKnownClass()(x)["logits"][:, 0]
    batch = TrainingBatch(x, y, len(y), seen, known, StepOutput(teacher, None))
    loss = classification_term(adapter, network, out, y, mask)
    terms = adapter.loss_terms(network, out, batch)
    (loss + terms["kd"]).backward()
    adapter.after_backward(network, contextlib.nullcontext)
    ours = gradients(network)
    assert all(torch.isfinite(g).all() for g in ours.values())
    head = {"fc.weight": ours.pop("fc.weight"), "fc.bias": ours.pop("fc.bias")}
    assert_same_gradients(ours, learner._network, learner._network.backbone.parameters())
    for name, grad in head.items():
        # float32 on both sides, summed in another order (1e-7 apart on some CPUs' kernels).
        torch.testing.assert_close(grad[1:total], upstream[name].grad[1:], rtol=1e-4, atol=1e-6)
        # Row 0: the cross-entropy's gradient, reweighted, and no KD term.
        assert grad[0].abs().max() > 0


def test_difference_running_label_prior(pilot_on_path: Path) -> None:
    """Upstream's prior is the task's whole label distribution, known before training; ours
    counts the labels trained on since the last consolidation, batch by batch. After batches
    [0, 0, 1] and [1, 2], our second loss is ``regularized_cn`` with the running counts
    [2, 2, 1], not with the task's distribution."""
    from models.dgr import regularized_cn

    from pilot_online.methods.dgr import DGROnline

    adapter = DGROnline(args={"gammar_r": 1.0})
    network = nn.Module()
    network.fc = nn.Linear(2, 3)
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
    first = StepOutput(torch.zeros(3, 3), None)
    classification_term(adapter, network, first, torch.tensor([0, 0, 1]), None)
    ours = classification_term(
        adapter, network, StepOutput(logits, None), torch.tensor([1, 2]), None
    )
    labels = torch.tensor([1, 2])
    with prior_on_cpu():
        running = regularized_cn(logits, labels, np.array([2.0, 2.0, 1.0]))
        task = regularized_cn(logits, labels, np.array([2.0, 3.0, 4.0]))
    assert ours.item() == pytest.approx(running.item(), rel=1e-6)
    assert abs(ours.item() - task.item()) > 1e-3


def test_difference_batch_logit_mask(pilot_on_path: Path) -> None:
    """Upstream's ``regularized_cn`` covers every class of its head; ours masks the classes
    absent from the batch: with counts [2, 2, 1] and a batch of classes 0 and 1, ours is
    ``regularized_cn`` over those two classes, not over all three."""
    from models.dgr import regularized_cn

    from pilot_online.methods.dgr import DGROnline

    adapter = DGROnline(args={})
    network = nn.Module()
    network.fc = nn.Linear(2, 3)
    labels = torch.tensor([0, 1, 1])
    logits = torch.tensor([[2.0, 0.5, 1.5], [0.1, 0.2, 2.3], [0.4, -0.2, 0.9]])
    classification_term(adapter, network, StepOutput(logits[:2], None), torch.tensor([2, 0]), None)
    mask = training_mask("batch", labels, torch.ones(3, dtype=torch.bool), 3)
    ours = classification_term(adapter, network, StepOutput(logits, None), labels, mask)
    assert adapter.label_counts.tolist() == [2, 2, 1]
    with prior_on_cpu():
        present = regularized_cn(logits[:, :2], labels, np.array([2.0, 2.0]))
        every_class = regularized_cn(logits, labels, np.array([2.0, 2.0, 1.0]))
    assert ours.item() == pytest.approx(present.item(), rel=1e-6)
    assert abs(ours.item() - every_class.item()) > 1e-3


def test_difference_one_linear_head_over_every_class(dgr: Built) -> None:
    """Ours: one ``nn.Linear`` over all the stream's classes from the start. Upstream's
    ``update_fc`` makes a head of the task's total at each task, keeping the old rows."""
    adapter, network, _ = dgr
    head = adapter.classifier(network)
    assert type(head) is nn.Linear and head.out_features == NUM_CLASSES
    learner = upstream_dgr(dgr, OLD)
    old = learner._network.fc.weight.detach().clone()
    learner._network.update_fc(NUM_CLASSES)
    assert learner._network.fc.out_features == NUM_CLASSES
    assert torch.equal(learner._network.fc.weight[:OLD], old)


class OneClassData:
    """The ``data_manager`` upstream's ``_construct_exemplar`` reads: one class's samples (their
    dataset indices stand for the images)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def get_dataset(self, indices: Any, source: str, mode: str, **kwargs: Any) -> Any:
        data = np.arange(self.count)
        return (data, np.zeros(self.count), list(data)) if kwargs.get("ret_data") else []


def test_difference_online_herding(dgr: Built) -> None:
    """Upstream's memory (``memory_size`` 2000, ``fixed_memory`` false) is ours by default
    (herding, a quota of 2000 // classes seen). Upstream herds once per class, at the task end,
    over the class's whole data (``_construct_exemplar``); ours re-picks as the samples stream
    past. Offered in one batch, ours picks upstream's exemplars in upstream's order; offered in
    batches of 3, it keeps a different set."""
    from pilot_online.methods.dgr import DGROnline

    config = json.loads((Path(PILOT_ROOT) / "exps" / "dgr.json").read_text())
    keys = DGROnline.config_keys
    assert keys["er_memory_size"].default == config["memory_size"] == 2000
    assert config["fixed_memory"] is False and keys["er_memory_per_class"].default is None
    assert keys["er_memory"].default == "herding" and DGROnline.replay is not None

    count, quota = 12, 4
    vectors = np.random.default_rng(0).normal(size=(count, 5))
    learner = upstream_dgr(dgr, 1)
    learner._known_classes, learner._total_classes = 0, 1
    learner._class_means = np.zeros((1, 5))
    extract = mock.Mock(side_effect=[(vectors, None), (vectors[:quota], None)])
    with mock.patch.object(learner, "_extract_vectors", extract):
        learner._construct_exemplar(OneClassData(count), quota)
    upstream = learner._data_memory.tolist()

    def herd(batch: int) -> list[int]:
        memory = ClassBalancedMemory(quota, 1, selection="herding")
        for start in range(0, count, batch):
            rows = np.arange(start, min(start + batch, count))
            memory.add(rows, np.zeros(len(rows), dtype=np.int64), vectors[rows])
        return memory.stored[0].tolist()

    assert herd(count) == upstream
    assert sorted(herd(3)) != sorted(upstream)

"""``icarl_online`` against upstream's own code (PILOT ``models/icarl.py``, and the exemplar memory
it inherits from ``models/base.py``).

- The step after a firing: upstream's ``Learner._update_representation`` (cross-entropy over its
  head plus ``_KD_loss(logits[:, :known], old(x), T)``) runs on the batch our loop trained on
  (the stream rows and the rows it replayed from its memory), with the old network made by
  upstream's own ``after_task`` from our weights at the firing and an optimiser that only keeps
  gradients; every parameter's gradient must be ours.
- Herding: upstream's ``build_rehearsal_memory`` (``_reduce_exemplar``, ``_construct_exemplar``),
  on feature vectors handed to it in place of its ``_extract_vectors``, picks the engine's
  herding memory's exemplars, in the same order (``core.memory.herding_order``).

One ``test_difference_<key>`` per entry of the card's ``upstream_differences`` (``icarl_online``).
"""

from __future__ import annotations

import copy
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    PILOT_ROOT,
    build_smoke_method,
    classification_term,
    make_exps,
    requires_pilot,
    stream_step,
)
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
from pilot_online.core.memory import ClassBalancedMemory, herding_order, normalized
from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.config import resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card

pytestmark = [
    requires_pilot,
    # Upstream's memory code makes DataLoaders with 4 workers; the tests never iterate them.
    pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes"),
]

OLD = 4  # the smoke stream's first task: classes 0-3; the second brings 4-7
#: A small memory and replay batch, so that the step after the firing replays a few rows.
REPLAY = {"er_memory_size": 8, "er_batch_size": 4}
Built = tuple[Any, nn.Module, dict[str, Any], type]


@pytest.fixture(scope="module")
def icarl(pilot_on_path: Path) -> Iterator[Built]:
    from models.icarl import Learner

    yield (*build_smoke_method("icarl_online", **BASE_ROW, **REPLAY), Learner)


def upstream_icarl(built: Built, **args: Any) -> Any:
    """Upstream's ``Learner`` on our config and a copy of our backbone (one epoch, T from ours)."""
    adapter, network, config, learner_class = built
    keys = {"epochs": 1, "init_epoch": 1, "T": config["T"], **args}
    return upstream_learner(learner_class, adapter, config, network.backbone, **keys)


def replaying_loop(built: Built, pool: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, list]:
    """Our loop on a copy of the network, loading memory rows from ``pool``; returns it and the
    list the rows each step replayed are appended to."""
    adapter, network, config, _ = built
    loop = build_loop(adapter, copy.deepcopy(network), config, NUM_CLASSES)
    drawn: list[np.ndarray] = []

    def load(indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        drawn.append(np.array(indices))
        rows = torch.as_tensor(indices)
        return pool[0][rows], pool[1][rows]

    loop.attach_samples(load)
    return loop, drawn


def train(loop: Any, pool: tuple[torch.Tensor, torch.Tensor], rows: list[int]) -> Any:
    index = np.asarray(rows)
    return loop.train_step(pool[0][index], pool[1][index], index)


def with_head_rows(state: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``state`` with the head cut to its first ``rows`` classes (upstream's head at a task)."""
    return {k: v[:rows] if k.startswith("fc.") else v for k, v in state.items()}


# -- the step after a firing ------------------------------------------------------------------
@pytest.fixture(scope="module")
def second_task(icarl: Built) -> dict[str, Any]:
    """Ours: a step on classes 0-3, then one on every class (the trigger fires first: the
    teacher is the network after the first step). Upstream: ``after_task`` on those weights
    with a head of 4 (its old network and ``_known_classes``), ``update_fc(8)``, then
    ``_update_representation`` on the second step's stream and replayed rows."""
    pool = images([0, 1, 2, 3, 0, 1, *range(8), 4, 5, 6, 7], seed=4)
    loop, drawn = replaying_loop(icarl, pool)
    train(loop, pool, [0, 1, 2, 3, 4, 5])
    at_firing = copy.deepcopy(loop.network.state_dict())
    stream = list(range(6, 18))
    stats = train(loop, pool, stream)
    assert loop.teacher is not None and loop.teacher.firing == 0
    ours = {n: p.grad.clone() for n, p in loop.network.named_parameters() if p.grad is not None}

    learner = upstream_icarl(icarl)
    learner._network.update_fc(OLD)
    learner._network.load_state_dict(with_head_rows(at_firing, OLD))
    learner._cur_task, learner._total_classes = 0, OLD
    learner.after_task()  # upstream's own: _old_network = copy().freeze(); _known_classes = 4
    learner._network.update_fc(NUM_CLASSES)
    learner._network.load_state_dict(at_firing)  # our new classes' rows too
    learner._cur_task, learner._total_classes = 1, NUM_CLASSES
    rows = torch.as_tensor(np.concatenate([stream, drawn[-1]]))
    x, y = pool[0][rows], pool[1][rows]
    optimiser = GradientsOnly(learner._network.parameters())
    learner._update_representation(one_batch(x, y), one_batch(x, y), optimiser, NoSchedule())
    return {"loop": loop, "learner": learner, "ours": ours, "stats": stats, "replayed": drawn[-1]}


def test_the_step_after_a_firing_is_upstreams_update_representation(second_task) -> None:
    """Every class is in the batch, so our batch mask is upstream's whole head: CE plus KD over
    the known classes gives upstream's gradient on every parameter, backbone and head."""
    assert len(second_task["replayed"]) == REPLAY["er_batch_size"]
    assert set(second_task["stats"].terms) == {"ce", "kd"}
    largest = assert_same_gradients(second_task["ours"], second_task["learner"]._network)
    assert largest <= 1e-5


# -- herding, upstream's build_rehearsal_memory -----------------------------------------------
D = 6  # feature width of the herding tests


class Rows:
    """A dataset of row numbers into a table of feature vectors (``DataLoader`` only stores it:
    upstream's ``_extract_vectors`` is replaced and reads the rows)."""

    def __init__(self, data: np.ndarray, targets: np.ndarray) -> None:
        self.data, self.targets = np.asarray(data, dtype=np.int64), np.asarray(targets)

    def __len__(self) -> int:
        return len(self.data)


class ClassRows:
    """What upstream's memory code reads of PILOT's ``DataManager.get_dataset``: a class's
    samples (here their row numbers) and datasets of given rows (``appendent``)."""

    def __init__(self, labels: np.ndarray) -> None:
        self.labels = np.asarray(labels)

    def get_dataset(self, indices, source, mode, appendent=None, ret_data=False):
        rows = np.flatnonzero(np.isin(self.labels, indices))
        data, targets = rows, self.labels[rows]
        if appendent is not None:
            data = np.concatenate([data, np.asarray(appendent[0], dtype=np.int64)])
            targets = np.concatenate([targets, np.asarray(appendent[1])])
        dataset = Rows(data, targets)
        return (data, targets, dataset) if ret_data else dataset


def herding_learner(vectors: np.ndarray, memory_size: int) -> types.SimpleNamespace:
    """An object with what iCaRL's ``build_rehearsal_memory`` reads (``models/base.py``, which
    ``models/icarl.Learner`` inherits), its memory methods bound to it; each sample's feature
    vector is row ``data`` of ``vectors`` (``_extract_vectors`` stands in for the network)."""
    from models.icarl import Learner

    learner = types.SimpleNamespace(
        _data_memory=np.array([]),
        _targets_memory=np.array([]),
        _known_classes=0,
        _total_classes=0,
        _fixed_memory=False,
        _memory_size=memory_size,
        feature_dim=vectors.shape[1],
        _extract_vectors=lambda loader: (
            vectors[loader.dataset.data].copy(),
            loader.dataset.targets,
        ),
    )
    for name in ("build_rehearsal_memory", "_reduce_exemplar", "_construct_exemplar"):
        setattr(learner, name, types.MethodType(getattr(Learner, name), learner))
    return learner


def upstream_task_end(learner: types.SimpleNamespace, data: ClassRows, classes: int) -> None:
    """Upstream's task end for a task ending with ``classes`` seen: the memory rebuilt at
    ``memory_size // total`` per class (``samples_per_class``, ``fixed_memory: false``)."""
    learner._total_classes = classes
    learner.build_rehearsal_memory(data, learner._memory_size // classes)
    learner._known_classes = classes


def upstream_exemplars(learner: types.SimpleNamespace, c: int) -> list[int]:
    return learner._data_memory[learner._targets_memory == c].astype(np.int64).tolist()


def class_vectors(sizes: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Feature vectors of classes with ``sizes`` samples each (float64), classes in order."""
    rng = np.random.default_rng(seed)
    vectors = np.concatenate([rng.normal(c, 1.0, size=(n, D)) for c, n in enumerate(sizes)])
    return vectors, np.repeat(np.arange(len(sizes)), sizes)


def test_herding_order_is_upstreams_construct_exemplar(pilot_on_path: Path) -> None:
    """``herding_order`` of the L2-normalised vectors, against their mean, picks upstream's
    exemplars in upstream's order."""
    vectors, labels = class_vectors([11])
    learner = herding_learner(vectors, memory_size=7)
    upstream_task_end(learner, ClassRows(labels), classes=1)
    unit = normalized(vectors)
    assert herding_order(unit, unit.mean(0), 7).tolist() == upstream_exemplars(learner, 0)


def test_the_herding_memory_is_upstreams_build_rehearsal_memory(icarl: Built) -> None:
    """The port's own configured memory (its ``er_memory`` default, a capacity of 12), fed by its
    loop as a training step does (the stream batch offered before the forward pass, stored after
    the step with the step's features): two tasks of two classes, each task's samples in one
    batch. It holds what upstream's task ends build, in its order: 6 per class after the first
    (``_construct_exemplar``), then 3 (``_reduce_exemplar`` keeps the first 3 of the old
    classes; the new ones herded)."""
    adapter, network, config, _ = icarl
    assert (
        "er_memory" not in config or config["er_memory"] == adapter.config_keys["er_memory"].default
    ), "the test must see the port's own memory"
    loop = build_loop(
        adapter, copy.deepcopy(network), {**config, "er_memory_size": 12}, NUM_CLASSES
    )
    # float32, as the loop hands the memory a network's features.
    vectors, labels = class_vectors([10, 9, 8, 10], seed=3)
    vectors = vectors.astype(np.float32)
    loop.attach_samples(
        lambda rows: (torch.zeros(len(rows), 3, 32, 32), torch.tensor(labels[rows]))
    )
    data = ClassRows(labels)
    learner = herding_learner(vectors, memory_size=12)
    for task in ((0, 1), (2, 3)):
        rows = np.flatnonzero(np.isin(labels, task))
        batch_labels = torch.tensor(labels[rows])
        loop.replay_batch(rows, batch_labels)
        features = torch.from_numpy(vectors[rows])
        out = StepOutput(torch.zeros(len(rows), NUM_CLASSES), features)
        loop.after_step(stream_step(out, batch_labels))
        upstream_task_end(learner, data, classes=max(task) + 1)
        for c in range(max(task) + 1):
            assert loop.memory.stored[c].tolist() == upstream_exemplars(learner, c), (task, c)
    assert loop.memory.class_histogram(4).tolist() == [3, 3, 3, 3]


# -- the declared differences -----------------------------------------------------------------
def test_difference_batch_logit_mask(icarl: Built) -> None:
    """A first-task batch of classes 0 and 1: our masked CE's head gradient is upstream's
    ``_init_train`` (CE over its whole head) for a head of exactly those two classes, not for
    the task's four."""
    adapter, network, config, _ = icarl
    x, y = images([0, 1, 1])
    head_gradients = []
    for total in (2, OLD):
        learner = upstream_icarl(icarl)
        learner._network.update_fc(total)
        learner._network.load_state_dict(with_head_rows(network.state_dict(), total))
        learner._network.backbone.requires_grad_(False)  # the head's gradient is enough here
        learner._cur_task, learner._total_classes = 0, total
        loader, optimiser = one_batch(x, y), GradientsOnly(learner._network.parameters())
        learner._init_train(loader, loader, optimiser, NoSchedule())
        head_gradients.append(learner._network.fc.weight.grad)
    adapter.set_mode(network, train=True)
    with torch.no_grad():
        features = network.backbone(x)
    out = StepOutput(network.fc(features), features)
    mask = training_mask(
        config["logit_mask"], y, torch.zeros(NUM_CLASSES, dtype=torch.bool), NUM_CLASSES
    )
    (ours,) = torch.autograd.grad(
        classification_term(adapter, network, out, y, mask), network.fc.weight
    )
    # float32 sums in another order: 1e-7 apart on some CPUs' kernels; a wrong row is 1e-3 off.
    torch.testing.assert_close(ours[:2], head_gradients[0], rtol=1e-4, atol=1e-6)
    assert (ours[:OLD] - head_gradients[1]).abs().max() > 1e-3 * head_gradients[1].abs().max()


def test_difference_one_linear_head_over_every_class(icarl: Built) -> None:
    """Ours: one ``nn.Linear`` over all the stream's classes from the start. Upstream's
    ``update_fc`` makes a ``SimpleLinear`` of the task's total at each task, keeping the old
    rows."""
    adapter, network, _, _ = icarl
    head = adapter.classifier(network)
    assert type(head) is nn.Linear and head.out_features == NUM_CLASSES
    learner = upstream_icarl(icarl)
    learner._network.update_fc(OLD)
    old = learner._network.fc.weight.detach().clone()
    learner._network.update_fc(NUM_CLASSES)
    assert type(learner._network.fc).__name__ == "SimpleLinear"
    assert learner._network.fc.out_features == NUM_CLASSES
    assert torch.equal(learner._network.fc.weight[:OLD], old)


def test_difference_online_herding(pilot_on_path: Path) -> None:
    """One class of 10 samples, 3 kept. In one batch our memory picks upstream's task-end
    exemplars; streamed in two batches of 5, the 2 samples of the first batch not kept then are
    gone, and herding over what is left picks other exemplars than upstream's."""
    vectors, labels = class_vectors([10], seed=1)
    learner = herding_learner(vectors, memory_size=3)
    upstream_task_end(learner, ClassRows(labels), classes=1)
    theirs = upstream_exemplars(learner, 0)
    whole, streamed = (ClassBalancedMemory(3, 1, selection="herding") for _ in range(2))
    whole.add(np.arange(10), labels, vectors)
    for part in (np.arange(5), np.arange(5, 10)):
        streamed.add(part, labels[part], vectors[part])
    assert whole.stored[0].tolist() == theirs
    kept = streamed.stored[0].tolist()
    assert kept != theirs
    assert set(theirs) & {0, 1, 2, 3, 4} - set(kept)  # upstream picks one the stream dropped
    # The running mean is the whole class's, as upstream's class mean.
    np.testing.assert_allclose(streamed.means[0], normalized(vectors).mean(0), rtol=1e-12)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # toolkit's empty old group
def test_difference_logits_only_evaluation(icarl: Built) -> None:
    """Upstream's ``eval_task`` reports a nearest-mean-of-exemplars accuracy beside the logits'
    whenever ``_class_means`` exists (iCaRL's task end always sets it); ours predicts with the
    logits alone, which are upstream's ``_eval_cnn`` predictions."""
    adapter, network, _, _ = icarl
    x, y = images([0, 1, 2, 3, 4, 5, 6, 7, 0, 1], seed=6)
    learner = upstream_icarl(icarl)
    learner._network.update_fc(NUM_CLASSES)
    learner._network.load_state_dict(network.state_dict())
    learner._total_classes = learner._known_classes = NUM_CLASSES
    learner.test_loader = one_batch(x, y)
    vectors, targets = learner._extract_vectors(learner.test_loader)
    unit = normalized(vectors)
    means = np.stack([unit[targets == c].mean(0) for c in range(NUM_CLASSES)])
    learner._class_means = means / np.linalg.norm(means, axis=1, keepdims=True)
    cnn, nme = learner.eval_task()
    assert nme is not None and nme["top1"] != cnn["top1"]
    adapter.set_mode(network, train=False)
    with torch.no_grad():
        ours = adapter.forward(network, x, train=False).logits.argmax(1)
    theirs, _ = learner._eval_cnn(learner.test_loader)
    assert ours.tolist() == theirs[:, 0].tolist()


def test_difference_adam_constant_lr(icarl: Built) -> None:
    """Upstream's ``_train`` makes SGD (momentum 0.9, ``exps/icarl.json``'s LR and weight decay)
    with a step schedule at each task (milestones past its 20 epochs); the paper configs run Adam
    at a constant 5e-5 (no scheduler exists online), and ``optimizer: sgd`` gives upstream's
    momentum."""
    adapter, network, _, _ = icarl
    upstream = json.loads((Path(PILOT_ROOT) / "exps" / "icarl.json").read_text())
    keys = (
        "init_lr", "init_milestones", "init_lr_decay", "init_weight_decay",
        "lrate", "milestones", "lrate_decay", "weight_decay",
    )  # fmt: skip
    learner = upstream_icarl(icarl, **{k: upstream[k] for k in keys})
    made = []
    learner._init_train = lambda train, test, optimizer, scheduler: made.append(
        (optimizer, scheduler)
    )
    learner._update_representation = learner._init_train
    for task in (0, 1):
        learner._cur_task = task
        learner._train(None, None)
    for (optimizer, scheduler), lr, decay in zip(
        made,
        (upstream["init_lr"], upstream["lrate"]),
        (upstream["init_weight_decay"], upstream["weight_decay"]),
    ):
        assert type(optimizer) is torch.optim.SGD and type(scheduler).__name__ == "MultiStepLR"
        group = optimizer.param_groups[0]
        assert (group["lr"], group["momentum"], group["weight_decay"]) == (lr, 0.9, decay)
    # Its schedules never step within a task: every milestone lies past the task's 20 epochs.
    assert min(upstream["init_milestones"]) > upstream["init_epoch"] == 20
    assert min(upstream["milestones"]) > upstream["epochs"] == 20
    paper = resolve_config(make_exps().paper_config("icarl", "base", blurry=False))
    paper["seed"] = paper["seed"][0]  # PILOT's trainer hands the learner one seed of the list
    loop = build_loop(adapter, copy.deepcopy(network), paper, 100)
    assert type(loop.optimizer) is torch.optim.Adam
    assert (
        [g["lr"] for g in loop.optimizer.param_groups]
        == [method_card("icarl_online").default_lr]
        == [5e-5]
    )
    sgd = build_loop(adapter, copy.deepcopy(network), {**paper, "optimizer": "sgd"}, 100)
    assert sgd.optimizer.param_groups[0]["momentum"] == 0.9


def test_difference_teacher_at_firing(icarl: Built) -> None:
    """Upstream's ``after_task`` freezes a copy and makes the first ``_total_classes`` the known
    prefix. Ours fires before the batch bringing a fifth class; on a stream whose first classes
    are 5, 2, 7, 0 (Si-Blurry's order), the known classes are that set, no prefix, and the step's
    KD term is upstream's ``_KD_loss`` over those columns, not over ``[:, :4]``."""
    from models.icarl import _KD_loss

    learner = upstream_icarl(icarl)
    learner._network.update_fc(OLD)
    learner._total_classes = OLD
    learner.after_task()
    assert learner._known_classes == OLD
    assert all(not p.requires_grad for p in learner._old_network.parameters())

    pool = images([5, 2, 7, 0, 5, 3, 1], seed=7)
    loop, drawn = replaying_loop(icarl, pool)
    train(loop, pool, [0, 1, 2, 3, 4])
    stats = train(loop, pool, [5, 6])  # class 3 is the fifth: the trigger fires first
    known = [0, 2, 5, 7]
    assert torch.nonzero(loop.known).flatten().tolist() == known
    rows = torch.as_tensor(np.concatenate([[5, 6], drawn[-1]]))
    with torch.no_grad():
        # At the firing's step the student is the teacher (nothing trained in between).
        logits = loop.teacher.forward(loop.adapter, pool[0][rows]).logits
    temperature = loop.config["T"]
    expected = _KD_loss(logits[:, known], logits[:, known], temperature)
    prefix = _KD_loss(logits[:, :OLD], logits[:, :OLD], temperature)
    assert stats.terms["kd"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert abs(stats.terms["kd"].item() - prefix.item()) > 1e-3

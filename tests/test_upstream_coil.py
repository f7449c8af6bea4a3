"""``coil_online`` against upstream's own code (PILOT ``models/coil.py``, its network
``SimpleCosineIncrementalNet`` and the exemplar memory it inherits from ``models/base.py``).

Ours runs three steps on the smoke network (random ViT, 32 px): classes 0-3, then a batch of all of
4-7 (the trigger fires first: the teacher and the old classes' means and rows are the network's
after the first step; after the step, the transport over 4-7 sets their rows), then a batch of
every class. Upstream, on our weights:

- ``after_task`` (``solving_ot``, POT's ``ot.sinkhorn``) on the same class means (handed to it in
  place of its ``_extract_class_means``), then ``update_fc(8, nextperiod_initialization)``: the
  rows it starts the task with, its ``_ot_new_branch`` and calibration are ours;
- ``_update_representation`` (one epoch, an optimiser that only keeps gradients) on the third
  step's stream and replayed rows: every parameter's gradient is ours.

One ``test_difference_<key>`` per entry of the card's ``upstream_differences``.
"""

from __future__ import annotations

import copy
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    PILOT_ROOT,
    build_smoke_method,
    classification_term,
    import_pot,
    make_exps,
    requires_pilot,
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
from test_upstream_icarl import test_difference_online_herding as icarl_online_herding
from torch import nn

from pilot_online.core.masks import mask_logits, training_mask
from pilot_online.core.memory import normalized
from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.config import resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.engine.teacher import distillation_loss

pytestmark = requires_pilot

OLD = 4  # the smoke stream's first task: classes 0-3; the second brings 4-7
#: A small memory and replay batch, so that the steps after the first replay a few rows.
REPLAY = {"er_memory_size": 8, "er_batch_size": 4}
#: ViT-B cut to its first 2 blocks: the file holds several copies of the network at once (ours,
#: the teacher, upstream's and its old network); every claim is about the loss, not the depth.
BLOCKS = 2
Built = tuple[Any, nn.Module, dict[str, Any], type]


@pytest.fixture(scope="module")
def coil(pilot_on_path: Path) -> Iterator[Built]:
    import_pot("upstream's models/coil.py imports POT (ot.sinkhorn in solving_ot)")
    from models.coil import Learner

    adapter, network, config = build_smoke_method("coil_online", **BASE_ROW, **REPLAY)
    network.backbone.blocks = network.backbone.blocks[:BLOCKS]
    yield adapter, network, config, Learner


def upstream_coil(built: Built, **args: Any) -> Any:
    """Upstream's ``Learner`` on our config and a copy of our backbone: one epoch, our ``T``,
    ``sinkhorn`` and ``norm_term``, and ``exps/coil.json``'s other keys."""
    adapter, network, config, learner_class = built
    keys = {
        "epochs": 1,
        "T": config["T"],
        "sinkhorn": config["sinkhorn"],
        "norm_term": config["norm_term"],
        "calibration_term": 1.5,
        "reg_term": 1e-3,
        "lrate": 1e-3,
        "milestones": [80, 120],
        "lrate_decay": 0.1,
        **args,
    }
    return upstream_learner(learner_class, adapter, config, network.backbone, **keys)


def upstream_state(ours: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Our network's weights in upstream's names: the backbone, the head's first ``rows`` rows
    (``fc.weight``) and its sigma (ours ``fc_sigma``, upstream's ``fc.sigma``)."""
    state = {k: v for k, v in ours.items() if k.startswith("backbone.")}
    state["fc.weight"] = ours["fc.weight"][:rows]
    state["fc.sigma"] = ours["fc_sigma"]
    return state


def upstream_names(gradients: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {("fc.sigma" if n == "fc_sigma" else n): g for n, g in gradients.items()}


def replaying_loop(built: Built, pool: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, list]:
    """Our loop on a copy of the network (a fresh COIL state), loading memory rows from
    ``pool``; returns it and the list the rows each step replayed are appended to."""
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


class Tasks:
    """What upstream's ``solving_ot`` reads of PILOT's ``DataManager``: the class count and the
    size of the next task."""

    def __init__(self, nb_classes: int, task_size: int) -> None:
        self.nb_classes, self.task_size = nb_classes, task_size

    def get_task_size(self, task: int) -> int:
        return self.task_size


def transport_upstream(
    built: Built, at_firing: dict[str, torch.Tensor], means: torch.Tensor, task_size: int
) -> Any:
    """Upstream's task end on our weights at the firing (a head of ``OLD`` rows): ``after_task``
    with ``means`` (``[OLD + task_size, D]``, unit rows) as its ``_extract_class_means``."""
    learner = upstream_coil(built)
    learner._network.update_fc(OLD)
    learner._network.load_state_dict(upstream_state(at_firing, OLD))
    learner._cur_task, learner._total_classes = 0, OLD
    learner.data_manager = Tasks(NUM_CLASSES, task_size)

    def extract(data_manager, low, high):
        learner._ot_prototype_means = np.zeros((data_manager.nb_classes, means.shape[1]))
        learner._ot_prototype_means[low:high] = means.double().numpy()

    learner._extract_class_means = extract
    learner.after_task()  # solving_ot, then _old_network = copy().freeze(), _known_classes
    return learner


# -- the period after a firing ------------------------------------------------------------------
@pytest.fixture(scope="module")
def second_task(coil: Built) -> dict[str, Any]:
    pool = images([0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 4, 5, *range(8), 2, 3], seed=4)
    loop, drawn = replaying_loop(coil, pool)
    train(loop, pool, list(range(6)))
    at_firing = copy.deepcopy(loop.network.state_dict())
    train(loop, pool, list(range(6, 12)))
    state = loop.network.co_transport
    assert loop.teacher is not None and state.transported.tolist() == [False] * 4 + [True] * 4
    means = torch.cat([state.anchor_means[:OLD], F.normalize(state.class_means.means[OLD:])])
    ours_after_arrival = {
        "rows": loop.network.fc.weight.detach()[OLD:].clone(),
        "new_branch": state.new_branch[OLD:].clone(),
        "calibration": float(state.calibration),
        "known": int(state.known.sum()),
    }
    before_step = upstream_state(loop.network.state_dict(), NUM_CLASSES)
    before_step = {k: v.clone() for k, v in before_step.items()}
    stream = list(range(12, 22))
    stats = train(loop, pool, stream)
    ours = {n: p.grad.clone() for n, p in loop.network.named_parameters() if p.grad is not None}
    del loop  # one network fewer held through the module

    learner = transport_upstream(coil, at_firing, means, task_size=NUM_CLASSES - OLD)
    init = learner.nextperiod_initialization
    learner._cur_task, learner._total_classes = 1, NUM_CLASSES  # incremental_train's lines
    learner._network.update_fc(learner._total_classes, init)
    learner.lamda = learner._known_classes / learner._total_classes
    started = {k: v.detach().clone() for k, v in learner._network.fc.state_dict().items()}
    learner._network.load_state_dict(before_step)
    rows = torch.as_tensor(np.concatenate([stream, drawn[-1]]))
    x, y = pool[0][rows], pool[1][rows]
    optimiser = GradientsOnly(learner._network.parameters())
    learner._update_representation(one_batch(x, y), one_batch(x, y), optimiser, NoSchedule())
    return {
        "learner": learner,
        "started": started,
        "firing_head": (at_firing["fc.weight"][:OLD].clone(), at_firing["fc_sigma"].clone()),
        "ours_after_arrival": ours_after_arrival,
        "ours": upstream_names(ours),
        "terms": set(stats.terms),
        "batch": (x, y),
    }


def test_solving_ot_and_update_fc_start_the_task_with_our_rows(second_task) -> None:
    """Upstream's ``solving_ot`` (POT's Sinkhorn) on our class means, then ``update_fc(8,
    nextperiod_initialization)``: the old rows at the firing, the transported rows (ours after
    the arrival step), sigma kept; ``_ot_new_branch`` and the calibration are ours."""
    learner, started = second_task["learner"], second_task["started"]
    ours = second_task["ours_after_arrival"]
    rows, sigma = second_task["firing_head"]
    assert torch.equal(started["weight"][:OLD], rows) and torch.equal(started["sigma"], sigma)
    torch.testing.assert_close(started["weight"][OLD:], ours["rows"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(learner._ot_new_branch, ours["new_branch"], rtol=1e-5, atol=1e-7)
    assert ours["calibration"] == pytest.approx(float(learner.calibration_term), rel=1e-5)
    assert learner._known_classes == OLD == ours["known"]


def test_the_step_after_the_transport_is_upstreams_first_epoch(second_task) -> None:
    """Every class in the batch (our batch mask is upstream's whole head), lamda 4 / 8: CE * (1 -
    lamda) + KD * lamda + 0.001 * the new branch on stream and replayed rows gives upstream's
    gradient on every parameter: backbone, rows, sigma."""
    assert second_task["terms"] == {"ce", "distillation", "new_branch"}
    assert len(second_task["batch"][1]) == 10 + REPLAY["er_batch_size"]
    largest = assert_same_gradients(second_task["ours"], second_task["learner"]._network)
    assert largest <= 1e-5


# -- the declared differences -----------------------------------------------------------------
def test_difference_batch_logit_mask(coil: Built) -> None:
    """A first-task batch of classes 0 and 1: our masked CE's head gradient is upstream's first
    task (plain CE over its whole head, no old network) for a head of exactly those two classes,
    not for the task's four."""
    adapter, network, config, _ = coil
    x, y = images([0, 1, 1])
    head_gradients = []
    for total in (2, OLD):
        learner = upstream_coil(coil)
        learner._network.update_fc(total)
        learner._network.load_state_dict(upstream_state(network.state_dict(), total))
        learner._network.backbone.requires_grad_(False)  # the head's gradient is enough here
        learner._cur_task, learner._total_classes = 0, total
        loader, optimiser = one_batch(x, y), GradientsOnly(learner._network.parameters())
        learner._update_representation(loader, loader, optimiser, NoSchedule())
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
    torch.testing.assert_close(ours[:2], head_gradients[0], rtol=1e-5, atol=1e-8)
    assert (ours[:OLD] - head_gradients[1]).abs().max() > 1e-3 * head_gradients[1].abs().max()


def test_difference_one_cosine_head_over_every_class(coil: Built) -> None:
    """Ours: a cosine head with a row for every class from the build. Upstream's ``update_fc``
    makes a ``CosineLinear`` of the task's total and, without a transport, zero rows (logit 0)
    for the new classes; with our rows and sigma, its logits are ours."""
    adapter, network, _, _ = coil
    head = adapter.classifier(network)
    assert isinstance(head, nn.Linear) and head.out_features == NUM_CLASSES
    assert (head.weight.norm(dim=1) > 0).all() and head.bias is None
    learner = upstream_coil(coil)
    learner._network.update_fc(OLD)
    assert type(learner._network.fc).__name__ == "CosineLinear"
    learner._network.update_fc(NUM_CLASSES)  # no nextperiod_initialization: zero rows
    assert learner._network.fc.out_features == NUM_CLASSES
    assert torch.equal(learner._network.fc.weight[OLD:], torch.zeros(OLD, head.in_features))
    learner._network.load_state_dict(upstream_state(network.state_dict(), NUM_CLASSES))
    x, _ = images([0, 1, 2], seed=2)
    adapter.set_mode(network, train=False), learner._network.eval()
    with torch.no_grad():
        ours = adapter.forward(network, x, train=False).logits
        theirs = learner._network(x)["logits"]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_difference_first_epoch_loss(second_task) -> None:
    """Ours is upstream's epoch 0 (the equivalence test), which never reads ``reg_term``.
    Upstream's second epoch on the same state takes the retrospective branch
    (``solving_ot_to_old``, here a stand-in for its memory pass, weighted ``reg_term * (1/2)^2``;
    ``reg_term`` 10 to make it plain) and drops the new branch: another gradient."""
    learner, (x, y) = copy.deepcopy(second_task["learner"]), second_task["batch"]
    learner.epochs, learner.args["reg_term"] = 2, 10.0
    learner.solving_ot_to_old = lambda: learner._network.fc.weight[:OLD].detach().clone()
    optimiser = GradientsOnly(learner._network.parameters())
    learner._update_representation(one_batch(x, y), one_batch(x, y), optimiser, NoSchedule())
    with pytest.raises(AssertionError, match="relative difference"):
        assert_same_gradients(second_task["ours"], learner._network)


@pytest.mark.filterwarnings("ignore:Sinkhorn did not converge")  # 4 old classes, 2 new: mass 1/2
def test_difference_transport_at_arrival(coil: Built) -> None:
    """The firing's batch brings 4 and 5 of the task 4-7. After the step our rows 4 and 5 are
    upstream's ``solving_ot`` for a next task of those two, not its rows for the whole task
    (6 and 7 read ahead, as upstream does); during the step they were the rows drawn at
    build."""
    pool = images([0, 1, 2, 3, 0, 1, 4, 5, 4, 5, 6, 7], seed=8)
    loop, _ = replaying_loop(coil, pool)
    train(loop, pool, list(range(6)))
    at_firing = copy.deepcopy(loop.network.state_dict())
    train(loop, pool, list(range(6, 10)))
    state = loop.network.co_transport
    rows = loop.network.fc.weight.detach()[OLD:6]
    arrived = torch.cat([state.anchor_means[:OLD], F.normalize(state.class_means.means[OLD:6])])
    two = transport_upstream(coil, at_firing, arrived, task_size=2).nextperiod_initialization
    torch.testing.assert_close(rows, two, rtol=1e-5, atol=1e-7)
    teacher = loop.teacher.module  # the network at the firing
    with torch.no_grad():
        ahead = F.normalize(teacher.backbone(pool[0][10:12]))  # one sample each of 6 and 7
    whole = torch.cat([arrived, ahead])
    four = transport_upstream(coil, at_firing, whole, task_size=4).nextperiod_initialization
    assert (rows - four[:2]).abs().max() > 1e-3 * four.abs().max()
    assert not torch.allclose(at_firing["fc.weight"][OLD:6], rows)


def test_difference_stream_class_means(coil: Built) -> None:
    """Upstream's ``_extract_class_means`` through the network at the firing (after the first
    step) gives other old-class means than ours, the features of the first step's forward:
    those are upstream's extraction through the network as built, the network of that step."""
    from models import coil as upstream_module

    pool = images([0, 1, 2, 3, 0, 1, 4, 5], seed=9)
    loop, _ = replaying_loop(coil, pool)
    built_state = copy.deepcopy(loop.network.state_dict())
    train(loop, pool, list(range(6)))
    at_firing = copy.deepcopy(loop.network.state_dict())
    train(loop, pool, [6, 7])  # fires: the old classes' means are kept
    ours = loop.network.co_transport.anchor_means[:OLD].double()

    class Images:
        nb_classes = NUM_CLASSES

        def get_dataset(self, indices, source, mode, ret_data=False):
            rows = torch.isin(pool[1][:6], torch.as_tensor(indices))
            return None, None, (pool[0][:6][rows], pool[1][:6][rows])

    def extracted(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        learner = upstream_coil(coil)
        learner._network.update_fc(OLD)
        learner._network.load_state_dict(upstream_state(weights, OLD))
        with mock.patch.object(upstream_module, "DataLoader", lambda data, **_: one_batch(*data)):
            learner._extract_class_means(Images(), 0, OLD)
        return torch.as_tensor(learner._ot_prototype_means[:OLD])

    torch.testing.assert_close(ours, extracted(built_state), rtol=1e-5, atol=1e-6)
    at_end = extracted(at_firing)
    assert (ours - at_end).abs().max() > 1e-4


def test_difference_lamda_over_seen_classes(coil: Built) -> None:
    """Upstream's ``incremental_train`` sets lamda = 4 / 8 for the task 4-7 at its start. Ours,
    on a step after the firing whose classes so far are 0-5: 4 / 6, the CE's factor 1/3."""
    adapter, network, config, _ = coil
    learner = upstream_coil(coil)
    learner._network.update_fc(OLD)
    learner._cur_task, learner._known_classes = 0, OLD
    data = types.SimpleNamespace(get_task_size=lambda task: 4, get_dataset=lambda *a, **k: None)
    with (
        mock.patch.object(learner, "_train"),
        mock.patch.object(learner, "build_rehearsal_memory"),
        mock.patch("models.coil.DataLoader"),
    ):
        learner.incremental_train(data)
    assert (learner._total_classes, learner.lamda) == (NUM_CLASSES, 0.5)
    fresh = copy.deepcopy(network)
    fresh.co_transport.known[:OLD] = True
    fresh.co_transport.seen[:OLD] = True
    x, y = images([4, 5, 4])
    with torch.no_grad():
        out = adapter.forward(fresh, x, train=True)
    mask = training_mask(config["logit_mask"], y, fresh.co_transport.seen, NUM_CLASSES)
    ce = F.cross_entropy(mask_logits(out.logits, mask), y)  # the loop's default term
    ours = classification_term(adapter, fresh, out, y, mask)
    assert ours.item() == pytest.approx(ce.item() / 3, rel=1e-6)


def test_difference_online_herding(pilot_on_path: Path) -> None:
    """COIL's memory is upstream's ``build_rehearsal_memory`` (``models/base.py``, inherited:
    the very functions iCaRL's port is held to), so iCaRL's check of this difference is COIL's:
    streamed, the herding memory keeps other exemplars than upstream's task-end herding."""
    from models.coil import Learner as COIL
    from models.icarl import Learner as ICaRL

    for name in ("build_rehearsal_memory", "_reduce_exemplar", "_construct_exemplar"):
        assert getattr(COIL, name) is getattr(ICaRL, name)
    icarl_online_herding(pilot_on_path)


def test_difference_teacher_at_firing(coil: Built) -> None:
    """Upstream's ``after_task`` (the last task: no transport) freezes a copy and makes the
    first ``_total_classes`` the known prefix. Ours fires before the batch bringing a fifth
    class; on a stream whose first classes are 5, 2, 7, 0, the known classes are that set and
    the distillation is upstream's expression over those columns, not over ``[:, :4]``."""
    learner = upstream_coil(coil)
    learner._network.update_fc(OLD)
    learner._total_classes = OLD
    learner.data_manager = Tasks(OLD, 0)  # the last task: solving_ot returns None
    learner.after_task()
    assert learner._known_classes == OLD
    assert all(not p.requires_grad for p in learner._old_network.parameters())

    pool = images([5, 2, 7, 0, 5, 3, 1], seed=7)
    loop, drawn = replaying_loop(coil, pool)
    train(loop, pool, [0, 1, 2, 3, 4])
    stats = train(loop, pool, [5, 6])  # class 3 is the fifth: the trigger fires first
    known = [0, 2, 5, 7]
    assert torch.nonzero(loop.known).flatten().tolist() == known
    rows = torch.as_tensor(np.concatenate([[5, 6], drawn[-1]]))
    with torch.no_grad():
        # At the firing's step the student is the teacher (nothing trained in between).
        logits = loop.teacher.forward(loop.adapter, pool[0][rows]).logits
    temperature = loop.config["T"]

    def upstream_kd(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """``_update_representation``'s ``distill_loss`` on the given columns."""
        hat_pai_k = F.softmax(teacher / temperature, dim=1)
        log_pai_k = F.log_softmax(student / temperature, dim=1)
        return -torch.mean(torch.sum(hat_pai_k * log_pai_k, dim=1))

    lamda = len(known) / 6  # classes 0, 1, 2, 3, 5, 7 seen
    expected = lamda * upstream_kd(logits[:, known], logits[:, known]).item()
    assert stats.terms["distillation"].item() == pytest.approx(expected, rel=1e-5)
    # Which columns it distils: with the student one step on (so that it differs from the
    # teacher), our term moves the known columns, upstream's prefix moves 0-3.
    with torch.no_grad():
        after = loop.adapter.forward(loop.network, pool[0][rows], train=False).logits
    ours, prefix = (after.clone().requires_grad_() for _ in range(2))
    distillation_loss(ours, logits, loop.known, temperature).backward()
    upstream_kd(prefix[:, :OLD], logits[:, :OLD]).backward()
    assert torch.nonzero(ours.grad.abs().sum(0)).flatten().tolist() == known
    assert torch.nonzero(prefix.grad.abs().sum(0)).flatten().tolist() == [0, 1, 2, 3]


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # toolkit's empty old group
def test_difference_logits_only_evaluation(coil: Built) -> None:
    """Upstream's ``eval_task`` reports a nearest-mean-of-exemplars accuracy beside the logits'
    whenever ``_class_means`` exists (its memory building sets it); ours predicts with the
    cosine head's logits alone, which are upstream's ``_eval_cnn`` predictions."""
    adapter, network, _, _ = coil
    x, y = images([0, 1, 2, 3, 4, 5, 6, 7, 0, 1], seed=6)
    learner = upstream_coil(coil)
    learner._network.update_fc(NUM_CLASSES)
    learner._network.load_state_dict(upstream_state(network.state_dict(), NUM_CLASSES))
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


def test_difference_adam_constant_lr(coil: Built) -> None:
    """Upstream's ``_train`` makes SGD (momentum 0.9, ``exps/coil.json``'s LR 1e-3, weight
    decay 5e-4) with a step schedule at each task; the paper configs run Adam at a constant 5e-5
    (no scheduler exists online), and ``optimizer: sgd`` gives upstream's momentum."""
    adapter, network, _, _ = coil
    upstream = json.loads((Path(PILOT_ROOT) / "exps" / "coil.json").read_text())
    keys = ("lrate", "milestones", "lrate_decay")
    learner = upstream_coil(coil, **{k: upstream[k] for k in keys})
    learner._network.update_fc(OLD)
    made = []
    learner._update_representation = lambda train, test, optimizer, scheduler: made.append(
        (optimizer, scheduler)
    )
    learner._train(None, None)
    ((optimizer, scheduler),) = made
    assert type(optimizer) is torch.optim.SGD and type(scheduler).__name__ == "MultiStepLR"
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (1e-3, 0.9, 5e-4)
    paper = resolve_config(make_exps().paper_config("coil", "base", blurry=False))
    paper["seed"] = paper["seed"][0]  # PILOT's trainer hands the learner one seed of the list
    loop = build_loop(adapter, copy.deepcopy(network), paper, 100)
    assert type(loop.optimizer) is torch.optim.Adam
    assert (
        [g["lr"] for g in loop.optimizer.param_groups]
        == [method_card("coil_online").default_lr]
        == [5e-5]
    )
    sgd = build_loop(adapter, copy.deepcopy(network), {**paper, "optimizer": "sgd"}, 100)
    assert sgd.optimizer.param_groups[0]["momentum"] == 0.9

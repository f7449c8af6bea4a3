"""``der_online`` against upstream's own code (PILOT ``models/der.py``, ``DERNet`` in
``utils/inc_net.py``, ``models/base.py``'s herding).

The port claims upstream's task start and its training step: at a consolidation firing the
network grows as ``DERNet.update_fc`` grows it (a branch loaded from the last, the head's old
weights kept, the old branch frozen in ``incremental_train``, eval mode in ``train()``), and the
step after it is ``_update_representation``'s: ``CE(logits, y) + CE(aux_logits, aux_y)``. Here
upstream's ``incremental_train`` runs on a network in the state ours had right before the firing
(its own ``update_fc``, freezing and ``_update_representation``, with an optimiser that only
records gradients), and our loop's firing step on the same batch must give the same two loss
terms and the same gradient on every parameter. Tiny ViTs (32 px, 2 blocks, width 24) stand in
for ViT-B through PILOT's ``get_backbone``.

The helpers here serve ``tests/test_upstream_memo.py`` too (MEMO grows the same way).
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import PILOT_ROOT, requires_pilot, smoke_config
from test_upstream_finetune import (
    GradientsOnly,
    NoSchedule,
    assert_same_gradients,
    images,
    one_batch,
    pilot_backbone,
    upstream_learner,
)
from torch import nn

from pilot_online import get_method
from pilot_online.core.masks import training_mask
from pilot_online.core.memory import ClassBalancedMemory
from pilot_online.engine.adapter import TrainingBatch
from pilot_online.engine.mixins import build_loop
from pilot_online.harness.protocol import HP_GRID

pytestmark = requires_pilot

WIDTH, FIRST, TOTAL = 24, 4, 8  # the tiny ViT's width; two tasks of four classes
#: Plain SGD without P or FGH, replay off (the batch holds the old classes as upstream's does
#: its exemplars): the gradients the loop applies are the loss's.
LOOP_ROW = {"online_prototypes": False, "fgh": None, "optimizer": "sgd", "init_lr": 0.01}
FIRST_LABELS = [0, 1, 2, 3, 1, 0]
#: The firing step's batch: every class of the new task and every old one.
FIRING_LABELS = [4, 5, 6, 7, 0, 1, 2, 3, 5]
#: The keys of upstream's ``exps/der.json`` and ``exps/memo.json`` its training loops read.
TRAINING_KEYS = (
    "init_lr", "init_milestones", "init_lr_decay", "init_weight_decay", "lrate", "milestones",
    "lrate_decay", "weight_decay", "scheduler", "t_max", "alpha_aux", "train_base",
    "train_adaptive", "skip",
)  # fmt: skip


def tiny_vit() -> nn.Module:
    """timm's ``VisionTransformer`` as PILOT's ``get_backbone`` returns it, tiny."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    vit = VisionTransformer(
        img_size=32, patch_size=16, embed_dim=WIDTH, depth=2, num_heads=2, num_classes=0
    )
    vit.out_dim = WIDTH
    return vit.eval()


def upstream_exps(name: str) -> dict[str, Any]:
    """Upstream's ``exps/<name>.json``: the keys its training loop reads."""
    return json.loads((Path(PILOT_ROOT) / "exps" / f"{name}.json").read_text())


@dataclass
class Port:
    """One growing port and its upstream: the registered name, upstream's learner class, the
    patch that makes PILOT's ``get_backbone`` return tiny copies, and upstream's call that sets
    its network's train/eval modes."""

    name: str
    learner_class: type
    backbone: Callable[[], Any]
    upstream_train: Callable[[Any], None]
    exps: str

    @property
    def module(self) -> Any:
        return sys.modules[self.learner_class.__module__]

    def build(self, **overrides: Any) -> tuple[Any, nn.Module, dict[str, Any]]:
        config = smoke_config(self.name, num_classes=TOTAL, **LOOP_ROW, **overrides)
        adapter = get_method(self.name)(args=config)
        with self.backbone():
            network = adapter.build_network(config)
        return adapter, network, config

    def learner(self, adapter: Any, config: dict[str, Any]) -> Any:
        """Upstream's learner on our config with upstream's training keys (one epoch)."""
        exps = upstream_exps(self.exps)
        keys = {k: exps[k] for k in TRAINING_KEYS if k in exps}
        keys.update(epochs=1, init_epoch=1)
        with self.backbone():
            return upstream_learner(self.learner_class, adapter, config, **keys)


@pytest.fixture(scope="module")
def der(pilot_on_path: Path) -> Port:
    from models.der import Learner

    return Port("der_online", Learner, lambda: pilot_backbone(tiny_vit()), Learner.train, "der")


def aux_rows(total: int) -> list[int]:
    """Our auxiliary head's rows in upstream's order: "old", then the task's new classes."""
    return [0, *(1 + c for c in range(FIRST, total))]


def load_first_task(port: Port, learner: Any, adapter: Any, ours: nn.Module) -> None:
    """Upstream's network after its first task, in the state of ours (one branch): its own
    ``update_fc(FIRST)``, our branch (and shared) weights, our head's first rows, then
    ``after_task``."""
    net = learner._network
    with port.backbone():
        net.update_fc(FIRST)
    shared = {k: v for k, v in ours.state_dict().items() if not k.startswith(("fc.", "aux_fc."))}
    result = net.load_state_dict(shared, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    with torch.no_grad():
        net.fc.weight.copy_(ours.fc.weight[:FIRST])
        net.fc.bias.copy_(ours.fc.bias[:FIRST])
    learner._cur_task, learner._total_classes = 0, FIRST
    learner.after_task()


def assert_grown_like_upstream(adapter: Any, grown: nn.Module, upstream: nn.Module) -> None:
    """What upstream's ``update_fc`` keeps, ours keeps: the new branch is the last one's copy,
    the head's old weights sit in its first rows and columns, and the auxiliary head reads the
    newest branch; upstream's auxiliary head has "old" plus the task's classes."""
    new, theirs = adapter.branches(grown)[-1].state_dict(), adapter.branches(upstream)[-1]
    for key, value in theirs.state_dict().items():
        if key in new:  # MEMO: ours dropped the blocks upstream's extractor never runs
            assert torch.equal(new[key], value), key
    assert len(adapter.branches(grown)) == len(adapter.branches(upstream)) == 2
    assert torch.equal(grown.fc.weight[:FIRST, :WIDTH], upstream.fc.weight[:FIRST, :WIDTH])
    assert torch.equal(grown.fc.bias[:FIRST], upstream.fc.bias[:FIRST])
    assert upstream.fc.weight.shape == grown.fc.weight.shape == (TOTAL, 2 * WIDTH)
    assert upstream.aux_fc.weight.shape == (TOTAL - FIRST + 1, WIDTH)


@torch.no_grad()
def copy_grown_heads(grown: nn.Module, upstream: nn.Module, total: int) -> None:
    """Our draws of what upstream draws afresh (the head's new parts, the auxiliary head) into
    upstream's network, the auxiliary rows in upstream's order."""
    upstream.fc.weight.copy_(grown.fc.weight[:total])
    upstream.fc.bias.copy_(grown.fc.bias[:total])
    upstream.aux_fc.weight.copy_(grown.aux_fc.weight[aux_rows(total)])
    upstream.aux_fc.bias.copy_(grown.aux_fc.bias[aux_rows(total)])


@contextmanager
def upstream_training(port: Port, learner: Any, x: torch.Tensor, y: torch.Tensor) -> Iterator[list]:
    """Upstream's ``incremental_train`` made to run one batch: its loaders yield ``(x, y)``, its
    optimiser only records gradients, no rehearsal memory is built; yields the list that
    collects upstream's ``F.cross_entropy`` values (``loss_clf``, then ``loss_aux``)."""
    losses: list[torch.Tensor] = []

    def cross_entropy(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = F.cross_entropy(*args, **kwargs)
        losses.append(loss.detach())
        return loss

    schedulers = SimpleNamespace(
        MultiStepLR=lambda **kwargs: NoSchedule(),
        CosineAnnealingLR=lambda **kwargs: NoSchedule(),
    )
    optim = SimpleNamespace(
        SGD=lambda params, **kwargs: GradientsOnly(params), lr_scheduler=schedulers
    )
    with ExitStack() as patches:
        patches.enter_context(port.backbone())
        patches.enter_context(
            mock.patch.object(port.module, "DataLoader", lambda *a, **k: one_batch(x, y))
        )
        patches.enter_context(mock.patch.object(port.module, "optim", optim))
        patches.enter_context(
            mock.patch.object(port.module, "F", SimpleNamespace(cross_entropy=cross_entropy))
        )
        patches.enter_context(mock.patch.object(learner, "build_rehearsal_memory"))
        yield losses


def task_manager(total: int) -> SimpleNamespace:
    """The data manager ``incremental_train`` asks for the task's size (its datasets are
    replaced by the one batch)."""
    return SimpleNamespace(get_task_size=lambda task: total - FIRST, get_dataset=lambda *a, **k: 0)


def firing_equivalence(port: Port) -> dict[str, Any]:
    """Our loop: a first step (classes 0-3), then the firing step (every class); upstream:
    ``incremental_train`` of the second task on ours before the firing, with our draws of the
    fresh parts copied in right after its ``update_fc``. Returns both sides' losses and
    gradients."""
    adapter, network, config = port.build()
    loop = build_loop(adapter, network, {**config, "er_memory_size": 0}, TOTAL)
    loop.train_step(*images(FIRST_LABELS, seed=1))
    before = copy.deepcopy(network)
    grown = copy.deepcopy(before)
    copy.deepcopy(adapter).consolidate(grown, 0)  # the loop's firing draws the same
    x, y = images(FIRING_LABELS, seed=2)
    stats = loop.train_step(x, y)
    assert loop.trigger.firings == [len(FIRST_LABELS)]
    ours = {n: p.grad.clone() for n, p in network.named_parameters() if p.grad is not None}

    learner = port.learner(adapter, config)
    load_first_task(port, learner, adapter, before)
    update_fc = learner._network.update_fc

    synced = []

    def update_fc_then_sync(total: int) -> None:
        update_fc(total)
        assert_grown_like_upstream(adapter, grown, learner._network)
        copy_grown_heads(grown, learner._network, total)
        synced.append(total)

    with upstream_training(port, learner, x, y) as losses:
        learner._network.update_fc = update_fc_then_sync
        learner.incremental_train(task_manager(TOTAL))
    assert synced == [TOTAL] and learner._cur_task == 1
    return {
        "adapter": adapter,
        "grown": grown,
        "learner": learner,
        "stats": stats,
        "ours": ours,
        "upstream_losses": losses,
    }


def assert_firing_step_is_upstreams(run: dict[str, Any]) -> float:
    """Same loss terms, same gradient on every parameter (the auxiliary head's rows mapped; its
    rows of the known classes get none), nothing for the frozen branch."""
    loss_clf, loss_aux = run["upstream_losses"][:2]
    terms = run["stats"].terms
    torch.testing.assert_close(terms["ce"], loss_clf, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(terms["aux"], loss_aux, rtol=1e-5, atol=1e-7)
    ours = dict(run["ours"])
    rows = aux_rows(TOTAL)
    known_rows = [r for r in range(TOTAL + 1) if r not in rows]
    for name in ("aux_fc.weight", "aux_fc.bias"):
        assert not ours[name][known_rows].any(), f"{name}: a known class's row got a gradient"
        ours[name] = ours[name][rows]
    network = run["learner"]._network
    largest = assert_same_gradients(ours, network)
    assert not any(name.startswith(("backbones.0.", "AdaptiveExtractors.0.")) for name in ours)
    return largest


@pytest.fixture(scope="module")
def der_firing(der) -> dict[str, Any]:
    return firing_equivalence(der)


def test_a_firing_step_is_upstreams_update_fc_and_update_representation(der_firing) -> None:
    largest = assert_firing_step_is_upstreams(der_firing)
    assert largest < 1e-5  # measured: 8.6e-9


def assert_same_train_modes(port: Port, run: dict[str, Any]) -> None:
    """Upstream's ``train()`` / ``set_network()`` and our ``set_mode`` leave every module of
    the grown network in the same mode (frozen branches in eval mode)."""
    learner, grown, adapter = run["learner"], run["grown"], run["adapter"]
    port.upstream_train(learner)
    adapter.set_mode(grown, train=True)
    theirs = {n: m.training for n, m in learner._network.named_modules()}
    ours = {n: m.training for n, m in grown.named_modules()}
    assert {n: theirs[n] for n in ours} == ours
    assert not adapter.branches(grown)[0].training and adapter.branches(grown)[1].training


def test_train_modes_are_upstreams(der, der_firing) -> None:
    assert_same_train_modes(der, der_firing)


def test_eval_forward_is_dernets(der, der_firing) -> None:
    """Upstream's ``DERNet.forward`` on the grown weights gives our logits and features."""
    adapter, grown, learner = der_firing["adapter"], der_firing["grown"], der_firing["learner"]
    assert_same_eval_forward(adapter, grown, learner._network)


def assert_same_eval_forward(adapter: Any, grown: nn.Module, upstream: nn.Module) -> None:
    upstream.load_state_dict(
        {k: v for k, v in grown.state_dict().items() if not k.startswith("aux_fc.")},
        strict=False,
    )
    x, _ = images([0, 1, 2], seed=5)
    upstream.eval(), adapter.set_mode(grown, train=False)
    with torch.no_grad():
        theirs = upstream(x)
        ours = adapter.forward(grown, x, train=False)
    torch.testing.assert_close(ours.logits, theirs["logits"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.features, theirs["features"], rtol=0, atol=0)


# -- the declared differences --------------------------------------------------------------------
def assert_head_over_every_class(port: Port, adapter: Any) -> None:
    """Ours keeps every row's old weights (all TOTAL rows existed from the build); upstream's
    ``update_fc`` draws the new task's rows whole, with a zero bias."""
    learner = port.learner(adapter, smoke_config(port.name, num_classes=TOTAL))
    net = learner._network
    with port.backbone():
        net.update_fc(FIRST)
        old = net.fc.weight.detach().clone()
        net.update_fc(TOTAL)
    assert net.fc.out_features == TOTAL and net.fc.in_features == 2 * WIDTH
    assert torch.equal(net.fc.weight[:FIRST, :WIDTH], old)
    assert not net.fc.bias[FIRST:].any()
    adapter, network, _ = port.build()
    head = adapter.classifier(network)
    assert type(head) is nn.Linear and head.out_features == TOTAL
    before = head.weight.detach().clone()
    adapter.consolidate(network, 0)
    assert network.fc.out_features == TOTAL
    assert torch.equal(network.fc.weight[:, :WIDTH], before)  # every row, the new classes' too


def test_difference_one_linear_head_over_every_class(der, der_firing) -> None:
    assert_head_over_every_class(der, der_firing["adapter"])


def upstream_grown(port: Port, run: dict[str, Any], total: int) -> Any:
    """Upstream's learner at its second task of classes ``FIRST..total-1`` (its own
    ``update_fc`` twice, ``after_task`` between), on our grown weights."""
    adapter, grown = run["adapter"], run["grown"]
    learner = port.learner(adapter, smoke_config(port.name, num_classes=TOTAL))
    net = learner._network
    with port.backbone():
        net.update_fc(FIRST)
        learner._cur_task, learner._total_classes = 0, FIRST
        learner.after_task()
        net.update_fc(total)
    shared = {k: v for k, v in grown.state_dict().items() if not k.startswith(("fc.", "aux_fc."))}
    assert not net.load_state_dict(shared, strict=False).unexpected_keys
    copy_grown_heads(grown, net, total)
    learner._cur_task, learner._total_classes = 1, total
    return learner


def upstream_losses(port: Port, run: dict[str, Any], total: int, x, y) -> list[torch.Tensor]:
    """Upstream's ``loss_clf`` and ``loss_aux`` of ``_update_representation`` on ``(x, y)`` for
    a second task of classes ``FIRST..total-1``, on our grown weights."""
    learner = upstream_grown(port, run, total)
    with upstream_training(port, learner, x, y) as losses:
        optimiser = GradientsOnly(learner._network.parameters())
        loader = one_batch(x, y)
        learner._update_representation(loader, loader, optimiser, NoSchedule())
    return losses[:2]


def our_loss_terms(run: dict[str, Any], x, y) -> dict[str, Any]:
    """Our firing step's loss terms on ``(x, y)`` (the grown network, classes 0-3 known, the
    batch mask)."""
    adapter, grown = run["adapter"], run["grown"]
    adapter.set_mode(grown, train=True)
    with torch.no_grad():
        out = adapter.forward(grown, x, train=True)
    known = torch.arange(TOTAL) < FIRST
    seen = known | torch.zeros(TOTAL, dtype=torch.bool).index_fill(0, y, True)
    mask = training_mask("batch", y, seen, TOTAL)
    return adapter.loss_terms(grown, out, TrainingBatch(x, y, len(y), seen, known, mask=mask))


@pytest.fixture(scope="module")
def der_partial_task(der, der_firing) -> dict[str, Any]:
    """A firing-step batch without class 7: upstream's losses for a task of 4-7 and for a task
    of exactly the batch's new classes (4-6), and ours."""
    x, y = images([4, 5, 6, 0, 1, 2, 3, 6], seed=3)
    return {
        "task": upstream_losses(der, der_firing, TOTAL, x, y),
        "batch": upstream_losses(der, der_firing, TOTAL - 1, x, y),
        "ours": our_loss_terms(der_firing, x, y),
    }


def assert_partial_task(partial: dict[str, Any], index: int, term: str) -> None:
    ours, task, batch = partial["ours"][term], partial["task"][index], partial["batch"][index]
    torch.testing.assert_close(ours, batch, rtol=1e-5, atol=1e-7)
    assert abs(float(ours) - float(task)) > 1e-3


def test_difference_batch_logit_mask(der_partial_task) -> None:
    """Our cross-entropy on a batch without class 7 is upstream's for a head without it."""
    assert_partial_task(der_partial_task, 0, "ce")


def test_difference_auxiliary_head_over_every_class(der_partial_task, der_firing) -> None:
    """The auxiliary head has TOTAL + 1 outputs (upstream's: the task's 4 + 1). On a batch
    holding every new class it gives upstream's loss (the equivalence test); on one without
    class 7 it is upstream's for a task of the batch's new classes, not of the whole task."""
    assert der_firing["grown"].aux_fc.out_features == TOTAL + 1
    assert der_firing["learner"]._network.aux_fc.out_features == TOTAL - FIRST + 1
    assert_partial_task(der_partial_task, 1, "aux")


def upstream_herding(learner: Any, vectors: np.ndarray, m: int) -> np.ndarray:
    """Upstream's ``_construct_exemplar`` for one class (class 0) whose samples' features are
    ``vectors`` (the network is replaced by the identity on them): the chosen sample indices,
    in order."""
    module = sys.modules[type(learner).__module__]
    base = sys.modules["models.base"]

    class Identity(nn.Module):
        def extract_vector(self, inputs: torch.Tensor) -> torch.Tensor:
            return inputs

    def dataset(indices, source, mode, appendent=None, ret_data=False):
        data = np.arange(len(vectors)) if appendent is None else np.asarray(appendent[0])
        rows = SimpleNamespace(data=data)
        return (data, np.zeros(len(data), dtype=np.int64), rows) if ret_data else rows

    def loader(rows, **kwargs):
        data = torch.as_tensor(rows.data)
        return [(data, torch.as_tensor(vectors[rows.data]), torch.zeros(len(data)))]

    learner._network = Identity()
    learner._known_classes, learner._total_classes = 0, 1
    learner._class_means = np.zeros((1, vectors.shape[1]))
    manager = SimpleNamespace(get_dataset=dataset)
    with (
        mock.patch.object(module, "DataLoader", loader),
        mock.patch.object(base, "DataLoader", loader),
    ):
        learner._construct_exemplar(manager, m)
    return np.asarray(learner._data_memory, dtype=np.int64)


def assert_online_herding(port: Port, adapter: Any) -> None:
    """A class of 12 samples, a quota of 4. Offered in one batch, our herding memory keeps
    upstream's picks in upstream's order; offered as it streams (two batches of 6), it picks
    among what it still holds, another set."""
    vectors = np.random.default_rng(7).normal(size=(12, 5))
    learner = port.learner(adapter, smoke_config(port.name, num_classes=TOTAL))
    theirs = upstream_herding(learner, vectors, 4)
    picks = []
    for cuts in ([12], [6, 6]):
        memory = ClassBalancedMemory(4, 1, selection="herding")
        for rows in np.split(np.arange(12), np.cumsum(cuts)[:-1]):
            memory.add(rows, np.zeros(len(rows), dtype=np.int64), vectors[rows])
        picks.append(memory.stored[0])
    np.testing.assert_array_equal(picks[0], theirs)
    assert set(picks[1]) != set(theirs)


def test_difference_online_herding(der, der_firing) -> None:
    assert_online_herding(der, der_firing["adapter"])


def assert_adam_constant_lr(port: Port, run: dict[str, Any]) -> None:
    """Upstream's second task builds SGD (momentum 0.9, ``lrate``, ``weight_decay``) with a
    step schedule; the paper configs run Adam at a constant 5e-5 (the hp_grid's ER row)."""
    from conftest import make_exps

    built = {}

    def sgd(params, **kwargs):
        built.update(kwargs)
        return GradientsOnly(params)

    learner = upstream_grown(port, run, TOTAL)
    x, y = images(FIRING_LABELS, seed=2)
    with upstream_training(port, learner, x, y):
        port.module.optim.SGD = sgd
        learner._train(one_batch(x, y), one_batch(x, y))
    exps = upstream_exps(port.exps)
    assert built == {
        "lr": exps["lrate"],
        "momentum": 0.9,
        "weight_decay": exps["weight_decay"],
    }
    config = make_exps().paper_config(port.name.removesuffix("_online"), "base", blurry=False)
    assert config["optimizer"] == "adam" and config["init_lr"] == HP_GRID["er"].best_lr == 5e-5


def test_difference_adam_constant_lr(der, der_firing) -> None:
    assert_adam_constant_lr(der, der_firing)


def assert_seeded_growth(port: Port) -> None:
    """Upstream's ``update_fc`` draws the new head parts from the global random stream: two
    global seeds, two heads. Ours, at a firing, from the run's seed and the firing: the same."""
    adapter, network, config = port.build()
    learner = port.learner(adapter, config)
    heads = []
    for seed in (10, 11):
        net = copy.deepcopy(learner._network)
        with port.backbone():
            net.update_fc(FIRST)
            torch.manual_seed(seed)
            net.update_fc(TOTAL)
        heads.append(net.fc.weight[:, WIDTH:].detach().clone())
    assert not torch.equal(heads[0], heads[1])
    ours = []
    for seed in (10, 11):
        grown = copy.deepcopy(network)
        torch.manual_seed(seed)
        copy.deepcopy(adapter).consolidate(grown, 3)
        ours.append((grown.fc.weight[:, WIDTH:].detach(), grown.aux_fc.weight.detach()))
    assert torch.equal(ours[0][0], ours[1][0]) and torch.equal(ours[0][1], ours[1][1])


def test_difference_seeded_growth(der) -> None:
    assert_seeded_growth(der)

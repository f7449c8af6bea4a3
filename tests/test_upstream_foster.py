"""``foster_online`` against upstream's own code (PILOT ``models/foster.py``, ``FOSTERNet``).

The port claims upstream's boosting structure and losses: ``FOSTERNet.update_fc`` (a second
branch copied from the first, the old head's rows in the new head's old-feature block, ``oldfc``)
and ``copy_fc`` (the student's head), ``_feature_boosting``'s loss (``CE(logits /
per_cls_weights) + CE(fe_logits) + lambda_okd * _KD_loss``) and ``BKD``. Upstream's functions
run here on the same state as ours: its ``FOSTERNet`` grown with its own ``update_fc`` around our
backbone (PILOT's ``get_backbone`` patched to return copies of it), our weights loaded, one
batch through ``_feature_boosting`` with an optimiser that only records gradients; our loop's
step on the same batch must give the same gradient on every parameter upstream trains. The
student's too: upstream's ``_train`` runs on one batch (boosting, then ``_feature_compression``,
each with the ``per_cls_weights`` it computes and its ``args["T"]``), and our one step's gradients
on the branch and heads are boosting's, on the student ``_feature_compression``'s BKD.

The network is test_foster.py's: ``FOSTERNet`` around a one-block ViT of width 16.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import make_exps, requires_pilot
from test_foster import NUM_CLASSES, WIDTH, after_first_firing, tiny_foster
from test_upstream_finetune import (
    BASE_ROW,
    GradientsOnly,
    NoSchedule,
    assert_same_gradients,
    images,
    one_batch,
    our_gradients,
    pilot_backbone,
    upstream_learner,
)
from torch import nn

from pilot_online.engine.adapter import StepOutput, TrainingBatch
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.teacher import distillation_loss
from pilot_online.methods.foster import (
    HERDING_FEATURES,
    effective_number_weights,
)

pytestmark = requires_pilot

Built = tuple[Any, nn.Module, dict[str, Any]]
KNOWN = 4  # classes of the first task (seen before the first firing)
#: Upstream keys our config lacks: one epoch per phase, exps/foster.json's memory and rates.
UPSTREAM_KEYS = {
    "lr": 1e-3,
    "weight_decay": 5e-4,
    "boosting_epochs": 1,
    "compression_epochs": 1,
    "memory_size": 2000,
    "memory_per_class": 20,
    "fixed_memory": True,
}
#: Samples per new class: upstream's ``data_manager.getlen``, our stream counts since the firing
#: (the known classes count memory_per_class 20, our memory's quota): far from uniform weights.
NEW_COUNTS = {4: 500, 5: 60, 6: 30, 7: 5}
TEMPERATURE = 3.0  # upstream's args["T"] and ours, off the default 2 that a constant could hold


@pytest.fixture(scope="module")
def built(pilot_on_path: Path) -> Iterator[Built]:
    yield tiny_foster(**BASE_ROW)


def upstream_network(learner: Any, ours: nn.Module, total: int) -> nn.Module:
    """Upstream's ``FOSTERNet`` of ``learner`` grown by its own ``update_fc`` to a first task of
    ``KNOWN`` classes and a second up to ``total``, around copies of our first backbone."""
    network = learner._network
    with pilot_backbone(ours.backbones[0], thaw=True):
        network.update_fc(KNOWN)
        network.update_fc(total)
    return network


def boosted_learner(built: Built, grown: nn.Module, total: int, weights: torch.Tensor, **args):
    """Upstream's learner in its second task (``KNOWN`` known classes of ``total``) with our
    boosted state: both branches, ``fc``, ``fe_fc`` and ``oldfc`` (the rows its heads have),
    frozen as ``incremental_train`` freezes them, ``per_cls_weights`` given."""
    from models.foster import Learner

    adapter, _, config = built
    learner = upstream_learner(Learner, adapter, config, **{**UPSTREAM_KEYS, **args})
    network = upstream_network(learner, grown, total)
    network.backbones.load_state_dict(grown.backbones.state_dict())
    with torch.no_grad():
        for name in ("fc", "fe_fc"):
            getattr(network, name).weight.copy_(getattr(grown, name).weight[:total])
            getattr(network, name).bias.copy_(getattr(grown, name).bias[:total])
        network.oldfc.weight.copy_(grown.oldfc.weight[:KNOWN])
        network.oldfc.bias.copy_(grown.oldfc.bias[:KNOWN])
    network.backbones[0].requires_grad_(False)
    network.oldfc.requires_grad_(False)
    learner._cur_task, learner._known_classes, learner._total_classes = 1, KNOWN, total
    learner._network_module_ptr = network
    learner.per_cls_weights = weights[:total].clone()
    return learner


def upstream_boosting_gradients(learner: Any, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """One batch of upstream's ``_feature_boosting``; its gradients stay on the network."""
    optimiser = GradientsOnly(learner._network.parameters())
    learner._feature_boosting(one_batch(x, y), one_batch(x, y), optimiser, NoSchedule())
    return learner._network


def our_step(
    built: Built, grown: nn.Module, x: torch.Tensor, y: torch.Tensor, **overrides: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], nn.Module]:
    """Our loop's step on a copy of ``grown`` (no replay, no further firing; ``overrides`` on the
    config): every gradient it applied, the class weights it used by beta key, the network."""
    adapter, _, config = built
    adapter.args = {**config, **overrides}
    try:
        network = copy.deepcopy(grown)
        loop_config = {**adapter.args, "er_memory_size": 0, "consolidation": "never"}
        loop = build_loop(adapter, network, loop_config, NUM_CLASSES)
        probe = copy.deepcopy(network)  # the weights the step computes, from the batch's classes
        probe.seen_classes[y] = True
        weights = {
            beta: adapter.class_weights(probe, float(adapter.args[beta]))
            for beta in ("beta1", "beta2")
        }
        gradients = our_gradients(loop, x, y)
    finally:
        adapter.args = config
    return gradients, weights, network


def our_boosting(built: Built, grown: nn.Module, x, y, oofc: str = "ft"):
    """Our loop's step on a copy of ``grown``: the gradients it applied to the boosted network
    (the student's left out), the boosting CE's class weights, the network."""
    gradients, weights, network = our_step(built, grown, x, y, oofc=oofc)
    boosted = {n: g for n, g in gradients.items() if not n.startswith("snet.")}
    return boosted, weights["beta1"], network


def upstream_train_phases(
    learner: Any, student: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    """Upstream's ``_train`` of the second task on one batch, each phase's SGD (built by
    ``_train`` and by ``_feature_compression``) a :class:`GradientsOnly`: boosting's gradients
    stay on ``learner._network``, compression's on ``learner._snet``. The ``_snet`` that
    ``_feature_compression`` sets up (the old branch, ``copy_fc(oldfc)``) takes ``student``'s
    weights before its batch, a state its loop reaches after some batches. Returns the
    ``per_cls_weights`` each phase saw (beta1, then beta2)."""
    weights: list[torch.Tensor] = []

    def optimiser(parameters: Any, **kwargs: Any) -> GradientsOnly:
        weights.append(learner.per_cls_weights.clone())
        if learner._snet is not None:  # _feature_compression's, after its set-up
            learner._snet.backbones[0].load_state_dict(student.backbones[0].state_dict())
            with torch.no_grad():
                learner._snet.fc.weight.copy_(student.fc.weight)
                learner._snet.fc.bias.copy_(student.fc.bias)
        return GradientsOnly(parameters)

    with ExitStack() as patches:
        patches.enter_context(mock.patch("torch.optim.SGD", optimiser))
        patches.enter_context(
            mock.patch("torch.optim.lr_scheduler.CosineAnnealingLR", lambda **_: NoSchedule())
        )
        patches.enter_context(pilot_backbone(student.backbones[0], thaw=True))  # _snet's
        learner._train(one_batch(x, y), one_batch(x, y))
    assert len(weights) == 2 and learner._snet is not None
    return weights


def grown_with(built: Built, oofc: str = "ft", seen: list[int] | None = None) -> nn.Module:
    """Our network after the first firing (classes 0-3 known), ``seen`` classes seen since."""
    adapter, _, config = built
    adapter.args = {**config, "oofc": oofc}
    grown = after_first_firing(built)
    adapter.args = config
    if seen:
        grown.seen_classes[seen] = True
    return grown


# -- equivalence --------------------------------------------------------------------------------
def test_first_firing_is_upstreams_update_fc_and_copy_fc(built: Built) -> None:
    """Upstream's ``update_fc`` from a first task of 4 classes (our stage-0 backbone and head
    loaded) to 8, and its compression's student (``FOSTERNet`` + ``update_fc``, the old
    backbone's state, ``copy_fc(oldfc)``): our first firing's branches and heads, where
    upstream's are not freshly drawn."""
    from models.foster import Learner
    from utils.inc_net import FOSTERNet

    adapter, network, config = built
    grown = after_first_firing(built)
    learner = upstream_learner(Learner, adapter, config, **UPSTREAM_KEYS)
    theirs = learner._network
    with pilot_backbone(network.backbones[0], thaw=True):
        theirs.update_fc(KNOWN)
        theirs.backbones[0].load_state_dict(network.backbones[0].state_dict())
        with torch.no_grad():
            theirs.fc.weight.copy_(network.fc.weight[:KNOWN])
            theirs.fc.bias.copy_(network.fc.bias[:KNOWN])
        theirs.update_fc(NUM_CLASSES)
        student = FOSTERNet(learner.args, True)  # _feature_compression's _snet
        student.update_fc(NUM_CLASSES)
    student.backbones[0].load_state_dict(theirs.backbones[0].state_dict())
    student.copy_fc(theirs.oldfc)
    for ours, upstream in [
        *zip(grown.backbones, theirs.backbones),
        (grown.snet.backbones[0], student.backbones[0]),
    ]:
        expected = upstream.state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in ours.state_dict().items())
    assert grown.fc.weight.shape == theirs.fc.weight.shape == (NUM_CLASSES, 2 * WIDTH)
    assert grown.fe_fc.weight.shape == theirs.fe_fc.weight.shape
    assert torch.equal(grown.fc.weight[:KNOWN, :WIDTH], theirs.fc.weight[:KNOWN, :WIDTH])
    assert torch.equal(grown.fc.bias, theirs.fc.bias)  # the old rows' bias, zero for the new
    assert torch.equal(grown.oldfc.weight[:KNOWN], theirs.oldfc.weight)
    assert torch.equal(grown.oldfc.bias[:KNOWN], theirs.oldfc.bias)
    assert torch.equal(grown.snet.fc.weight[:KNOWN], student.fc.weight[:KNOWN])
    assert torch.equal(grown.snet.fc.bias, student.fc.bias)


@pytest.mark.parametrize("oofc", ["ft", "az"])
def test_boosting_step_is_upstreams_feature_boosting(built: Built, oofc: str) -> None:
    """A batch of all 8 classes (so our batch mask is upstream's whole head) after the first
    firing: upstream's ``_feature_boosting`` (CE of logits over per_cls_weights, CE of
    fe_logits, KD of the 4 known classes against oldfc, ``oofc`` az zeroing the new rows' old
    block) gives our step's gradient on the new branch, fc and fe_fc."""
    grown = grown_with(built, oofc)
    x, y = images([0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 0], seed=3)
    ours, weights, _ = our_boosting(built, grown, x, y, oofc)
    learner = boosted_learner(built, grown, NUM_CLASSES, weights, oofc=oofc)
    largest = assert_same_gradients(ours, upstream_boosting_gradients(learner, x, y))
    assert largest < 1e-5
    if oofc == "az":
        assert (ours["fc.weight"][KNOWN:, :WIDTH] == 0).all()


@pytest.fixture(scope="module")
def weighted_step(built: Built) -> dict[str, Any]:
    """A batch of all 8 classes after the first firing, the new classes counted as
    ``NEW_COUNTS``, T 3, the new branch and the student moved off the old branch (as some steps
    into a segment): our loop's step, and upstream's ``_train`` on the same state and batch."""
    grown = grown_with(built, seen=[4, 5, 6, 7])
    grown.stream_counts[list(NEW_COUNTS)] = torch.tensor(list(NEW_COUNTS.values()))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in [*grown.backbones[1].parameters(), *grown.snet.parameters()]:
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    x, y = images([0, 1, 2, 3, 4, 5, 6, 7, 7, 5, 2], seed=8)
    ours, weights, _ = our_step(built, grown, x, y, T=TEMPERATURE)
    learner = boosted_learner(built, grown, NUM_CLASSES, torch.ones(NUM_CLASSES), T=TEMPERATURE)
    learner.data_manager = SimpleNamespace(getlen=NEW_COUNTS.__getitem__)  # samples_new_class
    theirs = upstream_train_phases(learner, grown.snet, x, y)
    return {"ours": ours, "weights": weights, "learner": learner, "theirs": theirs}


def test_student_step_is_upstreams_bkd_compression(weighted_step: dict[str, Any]) -> None:
    """Our step's student gradients are those of upstream's ``_feature_compression`` batch: its
    ``BKD`` of the student's logits against the boosted network's (no gradient), under the
    ``per_cls_weights`` its ``_train`` computes with beta2 from memory_per_class and ``getlen``,
    at its ``args["T"]``. Our student loss is BKD alone over the classes seen (all 8 here,
    upstream's head); concurrent compression is the declared difference in *when* it runs, not in
    the loss: the teacher here is the boosted network as it stands at our step, the state
    upstream's compression starts from once boosting is done. The weights are far from uniform, so
    an unweighted BKD, another beta or a wrong T gives other gradients. Tolerance: the same
    float32 modules and formula on the same inputs; only the BKD's summation order and the weights'
    float64 rounding may differ (0 measured on the CPU), far inside 1e-5 of each parameter's
    largest gradient entry; those mutants miss it by over 20%."""
    weights, (_, compression) = weighted_step["weights"], weighted_step["theirs"]
    torch.testing.assert_close(weights["beta2"], compression, rtol=1e-6, atol=0)
    assert compression.max() > 3 * compression.min()
    student = {
        n.removeprefix("snet."): g
        for n, g in weighted_step["ours"].items()
        if n.startswith("snet.")
    }
    largest = assert_same_gradients(student, weighted_step["learner"]._snet)
    assert largest < 1e-5


def test_boosting_step_under_class_weights_is_upstreams_train(
    weighted_step: dict[str, Any],
) -> None:
    """The same step's branch and head gradients are the boosting batch of upstream's ``_train``
    under the beta1 ``per_cls_weights`` it computes from the same counts (``CE(logits /
    per_cls_weights)``), and BKD leaves them alone (the boosted logits are its detached target)."""
    weights, (boosting, _) = weighted_step["weights"], weighted_step["theirs"]
    torch.testing.assert_close(weights["beta1"], boosting, rtol=1e-6, atol=0)
    assert boosting.max() > 3 * boosting.min()
    boosted = {n: g for n, g in weighted_step["ours"].items() if not n.startswith("snet.")}
    assert assert_same_gradients(boosted, weighted_step["learner"]._network) < 1e-5


def test_bkd_is_upstreams(built: Built, upstream_train: dict[str, Any]) -> None:
    """Upstream's ``BKD`` (with ``per_cls_weights``) and ``_KD_loss``, values and gradients, on
    every class and on the first 6 (ours: the others masked). Then the adapter's own ``bkd``
    term, as its step calls it: upstream's ``BKD`` under the weights upstream's ``_train`` gives
    compression (beta2, memory_per_class 20, 500 samples per new class) at its ``args["T"]``."""
    from models.foster import Learner, _KD_loss

    adapter, _, config = built
    learner = upstream_learner(Learner, adapter, config, **UPSTREAM_KEYS)
    generator = torch.Generator().manual_seed(4)
    student = torch.randn(5, NUM_CLASSES, generator=generator) * 3
    teacher = torch.randn(5, NUM_CLASSES, generator=generator) * 3
    weights = effective_number_weights(
        torch.tensor([20] * 4 + [500, 30, 7, 1]), torch.ones(8) > 0, 0.97
    )
    for columns in (NUM_CLASSES, 6):
        allowed = torch.arange(NUM_CLASSES) < columns
        learner.per_cls_weights = weights[:columns]
        ours_in = student.clone().requires_grad_()
        theirs_in = student[:, :columns].clone().requires_grad_()
        ours = distillation_loss(ours_in, teacher, allowed, 2.0, weights)
        theirs = learner.BKD(theirs_in, teacher[:, :columns], 2.0)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
        ours.backward(), theirs.backward()
        torch.testing.assert_close(ours_in.grad[:, :columns], theirs_in.grad, rtol=1e-5, atol=1e-8)
        assert (ours_in.grad[:, columns:] == 0).all()
        kd = distillation_loss(student, teacher, allowed, 2.0)
        torch.testing.assert_close(kd, _KD_loss(student[:, :columns], teacher[:, :columns], 2.0))

    learner = upstream_learner(Learner, adapter, config, **UPSTREAM_KEYS, T=TEMPERATURE)
    learner.per_cls_weights = upstream_train["calls"][1][1]  # _train's, for compression
    network = copy.deepcopy(upstream_train["grown"])
    network.seen_classes[:] = True
    network.stream_counts[KNOWN:] = 500
    ours_in = student.clone().requires_grad_()
    theirs_in = student.clone().requires_grad_()
    other = torch.randn(2, 5, NUM_CLASSES, generator=generator)
    out = StepOutput(
        teacher.clone(),
        torch.zeros(5, 2 * WIDTH),
        extras={"fe_logits": other[0], "old_logits": other[1], "student_logits": ours_in},
    )
    labels = torch.arange(5)
    inputs = torch.zeros(5, 3, 32, 32)  # loss_terms reads the logits only
    batch = TrainingBatch(inputs, labels, 5, network.seen_classes, network.known_classes)
    adapter.args = {**config, "T": TEMPERATURE}
    try:
        ours = adapter.loss_terms(network, out, batch)["bkd"]
    finally:
        adapter.args = config
    theirs = learner.BKD(theirs_in, teacher, learner.args["T"])
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    ours.backward(), theirs.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-8)


# -- the declared differences -------------------------------------------------------------------
def test_difference_batch_logit_mask(built: Built) -> None:
    """Classes 6 and 7 seen but absent from the batch: our step's gradients are upstream's with
    heads over exactly the batch's classes (a second task up to 6), not its heads over all 8."""
    grown = grown_with(built, seen=[4, 5, 6, 7])
    x, y = images([0, 1, 2, 3, 4, 5, 5, 4], seed=5)
    ours, weights, _ = our_boosting(built, grown, x, y)
    assert (ours["fc.weight"][6:] == 0).all()  # the absent classes' logits are masked
    sixes = upstream_boosting_gradients(boosted_learner(built, grown, 6, weights), x, y)
    assert_same_gradients(ours, sixes)
    eights = upstream_boosting_gradients(boosted_learner(built, grown, NUM_CLASSES, weights), x, y)
    branch = "backbones.1.norm.weight"
    theirs = dict(eights.named_parameters())[branch].grad
    assert (ours[branch] - theirs).abs().max() > 1e-3 * theirs.abs().max()


def test_difference_one_linear_head_over_every_class(built: Built) -> None:
    """Ours: heads over all 8 classes from the build, their rows of classes not seen at a firing
    drawn afresh. Upstream's ``update_fc`` sizes them to the task's total, 4 then 8."""
    from models.foster import Learner

    adapter, network, config = built
    assert network.fc.out_features == NUM_CLASSES and network.fc.in_features == WIDTH
    learner = upstream_learner(Learner, adapter, config, **UPSTREAM_KEYS)
    with pilot_backbone(network.backbones[0], thaw=True):
        learner._network.update_fc(KNOWN)
        assert learner._network.fc.out_features == KNOWN
        learner._network.update_fc(NUM_CLASSES)
    assert learner._network.fc.out_features == NUM_CLASSES
    grown = after_first_firing(built)
    assert grown.fc.out_features == grown.fe_fc.out_features == grown.snet.fc.out_features == 8
    assert not torch.equal(grown.snet.fc.weight[KNOWN:], network.fc.weight[KNOWN:])


def test_difference_seeded_heads(built: Built) -> None:
    """Upstream's ``update_fc`` draws its new head entries from the global random stream: the
    same global seed draws the same, another seed others. Ours depend on the run's seed and the
    firing alone, whatever the global stream's state."""
    from models.foster import Learner

    adapter, network, config = built
    theirs = []
    for seed in (1, 1, 2):
        learner = upstream_learner(Learner, adapter, config, **UPSTREAM_KEYS)
        torch.manual_seed(seed)
        theirs.append(upstream_network(learner, network, NUM_CLASSES).fc.weight.detach().clone())
    assert torch.equal(theirs[0], theirs[1]) and not torch.equal(theirs[0], theirs[2])
    ours = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        ours.append(after_first_firing(built).fc.weight.detach().clone())
    assert torch.equal(ours[0], ours[1])
    other = copy.deepcopy(network)
    other.seen_classes[:KNOWN] = True
    adapter.consolidate(other, 1)  # another firing index: other draws
    assert not torch.equal(other.fc.weight[KNOWN:], ours[0][KNOWN:])


@pytest.fixture(scope="module")
def upstream_train(built: Built) -> dict[str, Any]:
    """Upstream's ``_train`` of a second task (4 + 4 classes, 500 samples each), its two phases
    recorded instead of run: their order, the per_cls_weights each saw, boosting's optimiser."""
    grown = grown_with(built)
    learner = boosted_learner(built, grown, NUM_CLASSES, torch.ones(NUM_CLASSES))
    learner.data_manager = SimpleNamespace(getlen=lambda index: 500)  # samples_new_class
    calls: list[tuple[str, Any]] = []

    def boosting(train_loader, test_loader, optimizer, scheduler) -> None:
        calls.append(("boosting", learner.per_cls_weights.clone(), optimizer, scheduler))

    def compression(train_loader, test_loader) -> None:
        calls.append(("compression", learner.per_cls_weights.clone()))

    learner._feature_boosting, learner._feature_compression = boosting, compression
    x, y = images([0, 4])
    learner._train(one_batch(x, y), one_batch(x, y))
    return {"calls": calls, "grown": grown}


def test_difference_concurrent_compression(built: Built, upstream_train) -> None:
    """Upstream's ``_train`` compresses after boosting has finished; our one step after a
    firing trains the boosted branch and the student (its BKD) together."""
    assert [call[0] for call in upstream_train["calls"]] == ["boosting", "compression"]
    x, y = images([0, 1, 4, 5], seed=6)
    _, _, network = our_boosting(built, upstream_train["grown"], x, y)
    for name in ("backbones.1.norm.weight", "snet.backbones.0.norm.weight", "snet.fc.weight"):
        grad = dict(network.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_difference_running_class_counts(built: Built, upstream_train) -> None:
    """Upstream's weights (beta1 for boosting, beta2 for compression) from memory_per_class 20
    and 500 samples per new class are ours once the segment has streamed those 500 samples per
    class; before that ours differ (here at 50 samples)."""
    adapter, _, config = built
    (_, boosting, *_), (_, compression) = upstream_train["calls"]
    stats = copy.deepcopy(upstream_train["grown"])
    stats.seen_classes[:] = True
    stats.stream_counts[KNOWN:] = 500
    for beta, theirs in ((config["beta1"], boosting), (config["beta2"], compression)):
        torch.testing.assert_close(adapter.class_weights(stats, beta), theirs, rtol=1e-6, atol=0)
    stats.stream_counts[KNOWN:] = 50
    early = adapter.class_weights(stats, config["beta1"])
    assert (early - boosting).abs().max() > 0.05


def test_difference_online_herding_on_student_features(built: Built) -> None:
    """Upstream's herding reads ``_extract_vectors``: the boosted network's concatenated
    features, 2 x 16 wide. Ours ranks by the student's 16, one width at every firing."""
    grown = grown_with(built)
    with torch.no_grad():  # the student after some training: no longer the old branch
        for p in grown.snet.backbones.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, y = images([0, 1, 4])
    learner = boosted_learner(built, grown, NUM_CLASSES, torch.ones(NUM_CLASSES))
    vectors, _ = learner._extract_vectors(one_batch(x, y))
    adapter = built[0]
    adapter.set_mode(grown, train=False)
    with torch.no_grad():
        ours = adapter.forward(grown, x, train=True).extras[HERDING_FEATURES]
        branches = torch.cat([b(x) for b in grown.backbones], 1)
        student = grown.snet.backbones[0](x)
    assert vectors.shape == (3, 2 * WIDTH) and ours.shape == (3, WIDTH)
    torch.testing.assert_close(torch.from_numpy(vectors), branches, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, student, rtol=0, atol=0)


def test_difference_adam_constant_lr(built: Built, upstream_train) -> None:
    """Upstream's boosting optimiser: SGD (LR 1e-3, momentum 0.9, weight decay 5e-4) with a
    cosine schedule. Ours: the paper configs' Adam at a constant 5e-5, one optimiser for all."""
    _, boosting_weights, optimiser, scheduler = upstream_train["calls"][0]
    assert type(optimiser) is torch.optim.SGD
    group = optimiser.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (1e-3, 0.9, 5e-4)
    assert type(scheduler) is torch.optim.lr_scheduler.CosineAnnealingLR
    paper = make_exps().paper_config("foster", "base", blurry=False)
    assert (paper["optimizer"], paper["init_lr"]) == ("adam", 5e-5)
    adapter, _, config = built
    loop = build_loop(
        adapter,
        copy.deepcopy(upstream_train["grown"]),
        {**config, "optimizer": "adam", "init_lr": 5e-5, "er_memory_size": 0},
        NUM_CLASSES,
    )
    assert type(loop.optimizer) is torch.optim.Adam
    assert {g["lr"] for g in loop.optimizer.param_groups} == {5e-5}
    names = {n.split(".")[0] for n, _ in loop.named_parameters}
    assert {"backbones", "fc", "fe_fc", "snet"} <= names  # branch, heads and student together
    assert len(boosting_weights) == NUM_CLASSES

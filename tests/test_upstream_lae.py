"""LAE against upstream's own code: PILOT's ``models/lae.py`` (``Learner._init_train``: the
training step, the PET freeze and the per-step EMA; ``Learner._eval_cnn``: the ensemble) and the
PET modules of ``backbone/vit_lae.py`` in PILOT's ``LAE`` network, run on the same state as the
port. One ``test_difference_<key>`` per entry of the card's ``upstream_differences``.

The training and EMA checks run upstream's ``_init_train`` on the tiny LAE network of
tests/test_lae.py (upstream's loop reads only ``backbone``, ``pets``, ``pets_emas``, ``fc`` and
``attach_pets_vit``); the forward and ensemble checks run PILOT's ``LAE`` (a ViT-B at 32 px,
random weights, built once)."""

from __future__ import annotations

import copy
import json
import types

import pytest
import torch
from conftest import build_smoke_method
from test_lae import TinyLAENet, make
from torch import nn

from pilot_online.engine.registry import method_card
from pilot_online.methods.lae import LAEOnline


def upstream_linear(head: nn.Linear) -> nn.Module:
    """Upstream's head class (``backbone/linears.py``'s ``SimpleLinear``: returns a dict) with
    ``head``'s parameters (shared, not copied)."""
    from backbone.linears import SimpleLinear

    linear = SimpleLinear(head.in_features, head.out_features)
    linear.weight, linear.bias = head.weight, head.bias
    return linear


class UpstreamTinyLAE(TinyLAENet):
    """The tiny network with upstream's head and ``LAE.forward`` (``utils/inc_net.py``)."""

    def forward(self, x: torch.Tensor) -> dict:
        from utils.inc_net import LAE

        return LAE.forward(self, x)


def upstream_learner(network: nn.Module, **fields) -> types.SimpleNamespace:
    """An object with what upstream's ``Learner`` methods read, bound to them (its ``__init__``
    builds a ViT-B and reads a full config): ``network`` as ``_network``, one task of
    ``total`` classes, no test pass (``_compute_accuracy`` returns 0)."""
    from models.lae import Learner

    learner = types.SimpleNamespace(
        _network=network,
        _device="cpu",
        _cur_task=0,
        _known_classes=0,
        _compute_accuracy=lambda model, loader: 0.0,
        **fields,
    )
    for name in ("_init_train", "get_optimizer", "_eval_cnn"):
        setattr(learner, name, types.MethodType(getattr(Learner, name), learner))
    return learner


def twins(decay: float, steps_per_sample: float, freeze: int, **config):
    """(our adapter and loop on the tiny network, upstream's copy of that network)."""
    adapter, loop = make(freeze=freeze, decay=decay, steps_per_sample=steps_per_sample, **config)
    with torch.no_grad():  # offline PET away from the online one: the EMA has to move it
        for p in loop.network.pets_emas.parameters():
            p.add_(1.0)
    theirs = UpstreamTinyLAE()
    theirs.load_state_dict(loop.network.state_dict(), strict=False)
    theirs.fc = upstream_linear(copy.deepcopy(loop.network.fc))
    theirs.attach_pets_vit(theirs.pets)
    return adapter, loop, theirs


def batches(count: int, size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of ``size`` samples, every batch holding each of the 3 classes (so
    upstream's mask, the task's classes, and the loop's batch-wise mask are the same)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(3).repeat(size)[:size]
    return [(torch.randn(size, 4, generator=generator), labels) for _ in range(count)]


def run_upstream(theirs: nn.Module, data, epochs: int, freeze: int, decay: float, lr: float):
    learner = upstream_learner(
        theirs,
        args={"tuned_epoch": epochs, "optimizer": "adam"},
        init_lr=lr,
        weight_decay=0.0,
        num_freeze_epochs=freeze,
        ema_decay=decay,
        _total_classes=3,
    )
    optimizer = learner.get_optimizer()
    learner._init_train([(None, x, y) for x, y in data], None, optimizer, None)


def test_a_training_pass_and_its_ema_match_upstreams_init_train(pilot_on_path):
    """One epoch, PET never frozen, batches of 6 with ``lae_ema_steps_per_sample`` 1/6 (one
    upstream EMA step per step): upstream's ``_init_train`` (Adam at a constant LR, its mask of
    the task's classes, its EMA after each step) and the loop give the same PET, offline PET
    and head."""
    data = batches(4, 6)
    _adapter, loop, theirs = twins(decay=0.9, steps_per_sample=1 / 6, freeze=0, init_lr=0.01)
    run_upstream(theirs, data, epochs=1, freeze=0, decay=0.9, lr=0.01)
    for x, y in data:
        loop.train_step(x, y)
    ours = loop.network
    for mine, upstream in (
        (ours.pets, theirs.pets),
        (ours.pets_emas, theirs.pets_emas),
        (ours.fc, theirs.fc),
    ):
        for p, q in zip(mine.parameters(), upstream.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(ours.pets[0].weight, TinyLAENet().pets[0].weight)


def test_difference_ema_rate_per_sample(pilot_on_path):
    """Upstream: 5 epochs of a 16-sample task in batches of 4, 20 EMA steps of 0.9. Ours: one
    pass in batches of 8 (2 steps) at ``lae_ema_steps_per_sample`` = 5/4 (tuned_epoch /
    batch_size): each step decays by 0.9 ** 10, and the offline PET ends where upstream's does,
    P + (E0 - P) 0.9 ** 20 (the PET frozen throughout in both, so P is fixed). Per step at 0.9
    it would end at P + (E0 - P) 0.9 ** 2."""
    data = batches(4, 4)
    adapter, loop, theirs = twins(decay=0.9, steps_per_sample=5 / 4, freeze=100)
    start = [p.detach().clone() for p in loop.network.pets_emas.parameters()]
    online = [p.detach().clone() for p in loop.network.pets.parameters()]
    run_upstream(theirs, data, epochs=5, freeze=5, decay=0.9, lr=0.01)
    for i in (0, 2):
        loop.train_step(torch.cat([data[i][0], data[i + 1][0]]), torch.cat([data[i][1]] * 2))
    for p, q, e0, pet in zip(
        loop.network.pets_emas.parameters(), theirs.pets_emas.parameters(), start, online
    ):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        torch.testing.assert_close(p, pet + (e0 - pet) * 0.9**20, rtol=0, atol=1e-6)
    assert adapter.args["lae_ema_steps_per_sample"] == 5 / 4
    assert LAEOnline.config_keys["lae_ema_steps_per_sample"].default == 5 / 128  # lae.json


def pet_trained_steps(network: nn.Module, steps) -> list[bool]:
    """Runs ``steps()`` and returns, per backward pass, whether the PET received a gradient."""
    marks: list[bool] = []
    handle = network.pets[0].weight.register_hook(lambda grad: marks.append(True))
    head = network.fc.weight.register_hook(lambda grad: marks.append(False))
    try:
        steps()
    finally:
        handle.remove(), head.remove()
    # Per step the head's hook fires first (backward runs from the loss down), then the PET's
    # when it trains.
    out: list[bool] = []
    for mark in marks:
        if mark:
            out[-1] = True
        else:
            out.append(False)
    return out


def test_difference_freeze_window_per_segment(pilot_on_path):
    """Upstream, with ``exps/lae.json``'s ``num_freeze_epochs`` (3) of ``tuned_epoch`` (5) on a
    task of 4 batches: the PET trains in the last 8 of 20 steps, 40%. Ours, at the port's default
    ``lae_freeze_fraction``, three clear tasks of 5 batches with a firing at each boundary:
    frozen for ``lae_first_freeze_samples`` (20) at the start, then for the default share of the
    closed segment: the PET trains in the last 40% of every later task."""
    upstream_json = json.loads((pilot_on_path / "exps" / "lae.json").read_text())
    epochs, freeze = upstream_json["tuned_epoch"], upstream_json["num_freeze_epochs"]
    assert (epochs, freeze) == (5, 3)
    data = batches(4, 6)
    adapter, loop, theirs = twins(
        decay=0.9,
        steps_per_sample=1 / 6,
        freeze=20,
        consolidation="new_classes",
        consolidation_new_classes=2,
    )
    # The port's default (what exps/lae_online_*.json are generated with), not a typed 0.6.
    adapter.args["lae_freeze_fraction"] = LAEOnline.config_keys["lae_freeze_fraction"].default
    upstream = pet_trained_steps(
        theirs, lambda: run_upstream(theirs, data, epochs=epochs, freeze=freeze, decay=0.9, lr=0.01)
    )
    assert upstream == [False] * 12 + [True] * 8
    tasks = [torch.tensor([0, 1] * 5), torch.tensor([2, 3] * 5), torch.tensor([4, 0] * 5)]

    def stream() -> None:
        for labels in tasks:
            for _ in range(5):
                loop.train_step(torch.randn(10, 4), labels)

    ours = pet_trained_steps(loop.network, stream)
    assert loop.trigger.firings == [50, 100]
    assert ours[:5] == [False, False, True, True, True]  # 20 samples frozen at the start
    for task in (ours[5:10], ours[10:]):
        assert task == [False] * 3 + [True] * 2
        assert sum(task) / len(task) == sum(upstream) / len(upstream) == 0.4


# -- PILOT's LAE network (ViT-B at 32 px, Prefix PETs from backbone/vit_lae.py) -----------------
@pytest.fixture(scope="module")
def lae(pilot_on_path):
    adapter, network, _ = build_smoke_method("lae_online", num_classes=6)
    torch.manual_seed(3)
    with torch.no_grad():  # distinct online and offline PETs and a head that separates classes
        for p in network.pets.parameters():
            p.normal_(0, 0.5)
        for p in network.pets_emas.parameters():
            p.normal_(0, 0.5)
        network.fc.weight.normal_(0, 0.5)
    adapter.set_mode(network, train=False)
    return adapter, network


def images(count: int = 6) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(4))


def upstream_predictions(network: nn.Module, x: torch.Tensor, total: int, topk: int):
    """Upstream's ``_eval_cnn`` on one batch: the top-k of the class-wise max of the online and
    offline PETs' softmaxes over the first ``total`` classes."""
    from backbone.vit_lae import Prefix

    assert isinstance(network.pets[0], Prefix) and isinstance(network.pets_emas[0], Prefix)
    head = network.fc
    network.fc = upstream_linear(head)
    try:
        learner = upstream_learner(network, _total_classes=total, topk=topk)
        with torch.no_grad():
            predictions, _ = learner._eval_cnn([(None, x, torch.zeros(len(x)))])
    finally:
        network.fc = head
    return torch.as_tensor(predictions)


def test_pet_forwards_and_ensemble_match_upstreams_network_and_eval(lae):
    """The online and offline passes are PILOT's ``LAE.forward`` with each PET attached, and the
    ensemble ranks the classes as upstream's ``_eval_cnn`` (all 6 classes seen)."""
    from utils.inc_net import LAE

    adapter, network = lae
    x = images()
    network.lae_seen.fill_(True)
    with torch.no_grad():
        online = adapter.forward(network, x, train=True).logits
        predicted = adapter.forward(network, x, train=False).logits
        torch.testing.assert_close(online, LAE.forward(network, x), rtol=0, atol=0)
        network.attach_pets_vit(network.pets_emas)
        offline = LAE.forward(network, x)
        network.attach_pets_vit(network.pets)
    want = torch.maximum(online.softmax(-1), offline.softmax(-1)).log()
    torch.testing.assert_close(predicted, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(online.argmax(-1), offline.argmax(-1))  # the ensemble is tested
    ranking = predicted.topk(3, dim=-1).indices
    assert torch.equal(ranking, upstream_predictions(network, x, total=6, topk=3))


def test_difference_ensemble_over_seen_classes(lae):
    """Four of six classes seen: our softmaxes run over those four, which upstream's do when its
    tasks so far hold exactly them (``_total_classes`` 4); unseen classes rank last. Upstream
    over all six (a task's classes not all seen yet) can rank an unseen class first."""
    adapter, network = lae
    x = images()
    network.lae_seen.copy_(torch.tensor([True] * 4 + [False] * 2))
    bias = network.fc.bias.detach().clone()
    try:
        with torch.no_grad():
            network.fc.bias[4:] = 50.0  # the unseen classes would win every softmax
            predicted = adapter.forward(network, x, train=False).logits
        assert (predicted[:, 4:] == torch.finfo(predicted.dtype).min).all()
        ranking = predicted.topk(2, dim=-1).indices
        assert torch.equal(ranking, upstream_predictions(network, x, total=4, topk=2))
        assert (upstream_predictions(network, x, total=6, topk=1) >= 4).all()
    finally:
        with torch.no_grad():
            network.fc.bias.copy_(bias)
        network.lae_seen.fill_(True)


def test_the_paper_configs_run_upstreams_lr():
    """Upstream's exps/lae.json and lae_inr.json already train with Adam, a constant LR and
    weight decay 0, the online protocol's optimiser: their LRs (and ImageNet-R's 50 epochs)."""
    assert method_card("lae_online").settings_for("cifar224", "clear") == {"init_lr": 0.0028125}
    assert method_card("lae_online").settings_for("imagenetr", "si_blurry") == {
        "init_lr": 0.00046875,
        "lae_ema_steps_per_sample": 50 / 128,
    }

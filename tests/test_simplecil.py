"""SimpleCIL online: nearest class mean (cosine) over running class means, with no gradient step.

The unit tests drive the real adapter and loop on a stand-in network whose "backbone" is the
identity on 2-d features, so every mean, logit and prediction is worked out by hand below. The
PILOT test checks the same on PILOT's frozen ViT (32 px, random weights).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import build_smoke_method, requires_pilot, smoke_config
from torch import nn

from pilot_online.core.prototypes import PrototypeBank
from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.methods.simplecil import SimpleCILOnline

REPO = Path(__file__).resolve().parent.parent
CONFIG = {"online_prototypes": False, "fgh": None, "init_lr": 0.01, "optimizer": "adam"}


def stand_in_network(num_classes: int = 3, dim: int = 2) -> nn.Module:
    """What ``SimpleCILOnline.build_network`` builds, with the identity as the frozen backbone."""
    network = nn.Module()
    network.backbone = nn.Identity()
    network.fc = nn.Linear(dim, num_classes, bias=False).requires_grad_(False)
    network.class_means = PrototypeBank(num_classes, dim)
    return network


def trained_loop():
    """Two stream batches: class 0 sees [1,0] and [3,0]; class 1 sees [0,2], then [0,4]."""
    adapter = SimpleCILOnline(args=CONFIG)
    loop = build_loop(adapter, stand_in_network(), CONFIG, num_classes=3)
    first = loop.train_step(
        torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0, 1])
    )
    second = loop.train_step(torch.tensor([[0.0, 4.0]]), torch.tensor([1]))
    return loop, first, second


def test_running_class_means_without_a_gradient_step() -> None:
    loop, first, second = trained_loop()
    bank = loop.network.class_means
    # class 0: mean of [1,0], [3,0] = [2,0]; class 1: mean of [0,2], [0,4] = [0,3]; class 2 unseen
    assert torch.equal(bank.means, torch.tensor([[2.0, 0.0], [0.0, 3.0], [0.0, 0.0]]))
    assert bank.counts.tolist() == [2, 2, 0]
    assert loop.optimizer_steps == 0 and loop.samples_seen == 4
    assert loop.named_parameters == []
    # Test-then-train: batch 1 met an all-zero head (argmax 0: the two class-0 samples right);
    # batch 2's [0,4] met rows [1,0], [0,1], [0,0] -> logits [0,1,0] -> class 1, right.
    assert int(first.correct) == 2 and int(second.correct) == 1


def test_predictions_are_cosine_nearest_class_mean() -> None:
    loop, _, _ = trained_loop()
    x = torch.tensor([[1.0, 0.8], [-1.0, 0.2], [0.2, -1.0]])
    allowed = torch.tensor([True, True, False])
    preds, _ = loop.predict([(x, torch.zeros(3))], allowed, topk=1)
    # [1, 0.8]: cosine 0.78 to class 0, 0.62 to class 1 -> 0 (a dot product with the raw means,
    # 2.0 vs 2.4, would say 1); [-1, 0.2] -> 1; [0.2, -1] -> 0 (class 2 is masked out).
    assert preds[:, 0].tolist() == [0, 1, 0]
    logits = loop.adapter.forward(loop.network, x[:1], train=False).logits
    norm = math.sqrt(1.64)
    assert logits[0].tolist() == pytest.approx([1 / norm, 0.8 / norm, 0.0], abs=1e-6)


def test_checkpoint_round_trip_restores_the_means_and_predictions() -> None:
    loop, _, _ = trained_loop()
    x = torch.tensor([[1.0, 0.8], [-1.0, 0.2]])
    allowed = torch.ones(3, dtype=torch.bool)
    before, _ = loop.predict([(x, torch.zeros(2))], allowed, topk=2)
    fresh = build_loop(SimpleCILOnline(args=CONFIG), stand_in_network(), CONFIG, num_classes=3)
    fresh.load_state_dict(loop.state_dict())
    after, _ = fresh.predict([(x, torch.zeros(2))], allowed, topk=2)
    assert torch.equal(fresh.network.class_means.means, loop.network.class_means.means)
    assert (before == after).all()


@pytest.mark.parametrize(
    "change", [{"online_prototypes": True}, {"fgh": {"gamma": 1}}], ids=["P", "FGH"]
)
def test_p_and_fgh_are_refused_with_the_fix(change: dict) -> None:
    raw = {**load_json(REPO / "exps" / "smoke_simplecil_online.json"), **change}
    with pytest.raises(ConfigError, match='"online_prototypes": false and "fgh": null'):
        resolve_config(raw)


@requires_pilot
def test_pilot_simplecil_means_of_frozen_vit_features(pilot_on_path: Path) -> None:
    adapter, network, config = build_smoke_method("simplecil_online")
    assert not any(p.requires_grad for p in network.parameters())
    loop = build_loop(adapter, network, config, num_classes=8)
    torch.manual_seed(1)
    x, y = torch.randn(6, 3, 32, 32), torch.tensor([0, 1, 0, 2, 1, 0])
    weights = [p.detach().clone() for p in network.backbone.parameters()]
    loop.train_step(x, y)
    assert all(torch.equal(w, p) for w, p in zip(weights, network.backbone.parameters()))
    assert loop.optimizer_steps == 0
    network.eval()
    with torch.no_grad():
        features = network.backbone(x)
    for c, members in ((0, [0, 2, 5]), (1, [1, 4]), (2, [3])):
        mean = sum(features[i] for i in members) / len(members)
        assert torch.allclose(network.class_means.means[c], mean, atol=1e-5)
    logits = adapter.forward(network, x, train=False).logits
    means = network.class_means.means[:3]
    cosine = torch.stack(
        [torch.stack([torch.dot(f, m) / (f.norm() * m.norm()) for m in means]) for f in features]
    )
    assert torch.allclose(logits[:, :3], cosine, atol=1e-5)
    assert torch.equal(logits[:, 3:], torch.zeros(6, 5))  # unseen classes: zero rows


def test_smoke_config_is_the_base_row() -> None:
    config = smoke_config("simplecil_online")
    assert config["online_prototypes"] is False and config["fgh"] is None

"""LAE online: the offline PET is an EMA of the online one at upstream's rate per sample, the
ensemble is the class-wise max of the two softmaxes over the seen classes, and the PET is frozen
for ``lae_first_freeze_samples`` at the stream's start and for ``lae_freeze_fraction`` of the
closed segment after each firing. Tiny networks, no PILOT (the contract suite runs PILOT's LAE
network; tests/test_upstream_lae.py compares with upstream's own code)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import stream_step
from torch import nn

from pilot_online.engine.mixins import build_loop
from pilot_online.methods.lae import LAEOnline, ensemble

C = 5


class TinyBackbone(nn.Module):
    """Tokens [B, 1, D] = h + pet(h), h = linear(x), with whichever PET is attached."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.attached: list[nn.ModuleList] = []  # a plain list: not a registered submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return (h + self.attached[0][0](h))[:, None, :]


class TinyLAENet(nn.Module):
    """What LAEOnline reads of PILOT's ``LAE``: backbone, pets, pets_emas, attach_pets_vit."""

    feature_dim = 3

    def __init__(self) -> None:
        super().__init__()
        self.backbone = TinyBackbone()
        self.pets = nn.ModuleList([nn.Linear(3, 3)])
        self.pets_emas = copy.deepcopy(self.pets)
        self.attach_pets_vit(self.pets)

    def attach_pets_vit(self, pets: nn.ModuleList) -> None:
        self.backbone.attached[:] = [pets]


class TinyLAE(LAEOnline):
    def build_network(self, args: dict) -> nn.Module:
        return self.prepare(TinyLAENet(), args)


def make(freeze: int = 0, decay: float = 0.5, steps_per_sample: float = 0.25, **config):
    args = {
        "nb_classes": C,
        "ema_decay": decay,
        "lae_ema_steps_per_sample": steps_per_sample,
        "lae_first_freeze_samples": freeze,
        "lae_freeze_fraction": 0.6,
        "lae_reset_optimizer": True,
    }
    adapter = TinyLAE(args=args)
    torch.manual_seed(0)
    network = adapter.build_network(args)
    return adapter, build_loop(adapter, network, {"optimizer": "adam", **config}, C)


def test_ensemble_is_the_max_of_the_two_softmaxes_over_seen_classes():
    online = torch.tensor([[1.0, 2.0, 0.0, 4.0]])
    offline = torch.tensor([[3.0, 0.0, 0.0, -1.0]])

    def softmax(z):
        e = np.exp(z - z.max())
        return e / e.sum()

    want = np.log(np.maximum(softmax(online.numpy()[0]), softmax(offline.numpy()[0])))
    every = torch.ones(4, dtype=torch.bool)
    np.testing.assert_allclose(ensemble(online, offline, every)[0].numpy(), want, rtol=1e-6)
    # Nothing seen yet: all classes, as above.
    none = torch.zeros(4, dtype=torch.bool)
    np.testing.assert_allclose(ensemble(online, offline, none)[0].numpy(), want, rtol=1e-6)
    seen = torch.tensor([True, True, True, False])
    want = np.log(np.maximum(softmax(online.numpy()[0, :3]), softmax(offline.numpy()[0, :3])))
    got = ensemble(online, offline, seen)[0]
    np.testing.assert_allclose(got[:3].numpy(), want, rtol=1e-6)
    assert got[3] == torch.finfo(torch.float32).min and torch.isfinite(got).all()


def test_the_offline_pet_is_the_ema_of_the_online_one_at_a_rate_per_sample():
    """ema_decay 0.5 per upstream step, 0.25 upstream steps per sample: a step of 6 samples
    decays by 0.5 ** 1.5, one of 2 samples by 0.5 ** 0.5."""
    _adapter, loop = make(decay=0.5, steps_per_sample=0.25)
    pets, offline = loop.network.pets, loop.network.pets_emas
    ema = [p.detach().clone() for p in offline.parameters()]
    for size in (6, 2, 6):
        loop.train_step(torch.randn(size, 4), torch.tensor([0, 1, 2, 0, 1, 2][:size]))
        decay = 0.5 ** (size * 0.25)
        ema = [decay * e + (1 - decay) * p.detach() for e, p in zip(ema, pets.parameters())]
        for e, q in zip(ema, offline.parameters()):
            torch.testing.assert_close(q, e, rtol=0, atol=1e-7)
    assert not any(q.requires_grad for q in offline.parameters())


def test_evaluation_ensembles_the_offline_pet_and_puts_the_online_one_back():
    adapter, loop = make()
    network = loop.network
    x = torch.randn(3, 4)
    loop.train_step(torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2]))
    with torch.no_grad():
        for p in network.pets_emas.parameters():
            p.add_(torch.randn_like(p))
        out = adapter.forward(network, x, train=False)
        online = adapter.forward(network, x, train=True).logits
        offline_net = copy.deepcopy(network)
        offline_net.attach_pets_vit(offline_net.pets_emas)
        offline = adapter.forward(offline_net, x, train=True).logits
    assert network.backbone.attached[0] is network.pets
    torch.testing.assert_close(out.logits, ensemble(online, offline, network.lae_seen))
    assert network.lae_seen.tolist() == [True, True, True, False, False]


def test_the_pet_is_frozen_for_a_fraction_of_the_closed_segment_after_each_firing():
    """Three clear tasks of 5 batches of 10 ({0, 1}, {2, 3}, {4, 0}), a firing at each boundary:
    frozen for 20 samples at the start (steps 0-1), then for 0.6 x 50 = 30 samples of each task
    (3 steps): the PET trains in the last 2 steps, 40%, of every later task, as upstream's last
    2 of 5 epochs."""
    _adapter, loop = make(freeze=20, consolidation="new_classes", consolidation_new_classes=2)
    pets, head = loop.network.pets[0].weight, loop.network.fc.weight
    labels = [[0, 1]] * 5 + [[2, 3]] * 5 + [[4, 0]] * 5
    changed = []
    for step, y in enumerate(labels):
        before = pets.detach().clone(), head.detach().clone()
        loop.train_step(torch.randn(10, 4), torch.tensor(y).repeat_interleave(5))
        changed.append(not torch.equal(pets, before[0]))
        assert not torch.equal(head, before[1]), step  # the head always trains
        if step in (5, 10):  # the firings, before these steps: a fresh optimiser
            assert int(loop.optimizer.state[head]["step"]) == 1
            assert pets not in loop.optimizer.state
    assert loop.trigger.firings == [50, 100]
    frozen, trains = [False] * 3, [True] * 2
    assert changed == [False, False, True, True, True, *frozen, *trains, *frozen, *trains]
    assert pets.requires_grad  # frozen only while a training pass is recorded


@pytest.mark.parametrize("task", [470, 5000])
def test_the_pet_trains_in_the_last_40_percent_of_cub_and_cifar_sized_tasks(task):
    """Tasks of CUB's size (about 470 samples) and CIFAR-100's (5000), batches of 10: after each
    firing the PET is frozen for 0.6 of the task and trains in the rest (to a batch)."""
    adapter, loop = make(freeze=300)
    network = loop.network
    for firing in range(3):
        trained = 0
        for start in range(0, task, 10):
            size = min(10, task - start)
            if adapter.frozen_left <= 0:
                trained += size
            out = adapter.forward(network, torch.randn(size, 4), train=True)
            adapter.after_step(network, stream_step(out, torch.zeros(size, dtype=torch.long)))
        if firing > 0:
            assert abs(trained / task - 0.4) <= 10 / task, (firing, trained)
        adapter.consolidate(network, firing)
        assert adapter.frozen_left == round(0.6 * task)


def test_state_dict_restores_the_offline_pet_and_the_freeze_countdown():
    adapter, loop = make(freeze=25)
    loop.train_step(torch.randn(10, 4), torch.tensor([0, 1] * 5))
    assert adapter.segment_samples == 10
    with torch.no_grad():
        for p in loop.network.pets_emas.parameters():
            p.add_(1.0)
    state = copy.deepcopy(adapter.state_dict(loop.network))
    twin, twin_loop = make(freeze=25)
    twin.load_state_dict(twin_loop.network, state)
    assert twin.frozen_left == 15 and twin.segment_samples == 10
    for p, q in zip(loop.network.pets_emas.parameters(), twin_loop.network.pets_emas.parameters()):
        assert torch.equal(p, q)


def test_the_removed_window_key_is_refused_with_its_replacement():
    from conftest import raw_smoke_config

    from pilot_online.engine.config import ConfigError, resolve_config

    raw = raw_smoke_config("lae_online")
    with pytest.raises(ConfigError, match=r"'lae_freeze_samples' was removed.*lae_freeze_fraction"):
        resolve_config({**raw, "lae_freeze_samples": 1000})

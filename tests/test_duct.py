"""DUCT online (methods/duct.py), without PILOT: the adapter runs on a tiny network.

Expected values come from upstream's equations worked out by hand or from numpy (a plain
Sinkhorn iteration, the task-vector merge, the transported head rows), never read back from the
code under test.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import TinyNet
from torch import nn

from pilot_online.engine.loop import build_loop
from pilot_online.methods.duct import ClassPeriods, DUCTOnline, sinkhorn, transport_head

NUM_CLASSES = 6


class TinyDUCT(DUCTOnline):
    """DUCT over conftest's TinyNet: ``body`` is the merged backbone, features relu(body(x))."""

    def build_network(self, args: dict) -> nn.Module:
        network = TinyNet(num_classes=NUM_CLASSES)
        self.setup_state(network, args)
        return network

    def backbone(self, network: nn.Module) -> nn.Module:
        return network.body

    def features(self, network, x, params=None):
        return torch.relu(super().features(network, x, params))


def config(**overrides) -> dict:
    cfg = {key: spec.default for key, spec in DUCTOnline.config_keys.items()}
    cfg.update(
        nb_classes=NUM_CLASSES,
        seed=[3],
        optimizer="sgd",
        init_lr=0.1,
        weight_decay=0.0,
        logit_mask="none",
        consolidation="every_n_samples",
        consolidation_every_n_samples=10**6,  # no firing unless a test sets one
        grad_trace=False,
    )
    cfg.update(overrides)
    return cfg


def make(**overrides):
    torch.manual_seed(0)
    cfg = config(**overrides)
    adapter = TinyDUCT(args=cfg)
    network = adapter.build_network(cfg)
    return adapter, network, build_loop(adapter, network, cfg, NUM_CLASSES)


def batches(steps: int, size: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 5, generator=g), torch.randint(0, NUM_CLASSES, (size,), generator=g))
        for _ in range(steps)
    ]


# -- optimal transport ---------------------------------------------------------------------------
def test_sinkhorn_matches_the_plain_iteration():
    rng = np.random.default_rng(0)
    cost = rng.uniform(size=(3, 4))
    a, b = np.array([0.2, 0.3, 0.5]), np.full(4, 0.25)
    reg = 0.3
    kernel = np.exp(-cost / reg)  # POT's iteration, no underflow at these costs
    u, v = np.ones(3), np.ones(4)
    for _ in range(5000):
        u = a / (kernel @ v)
        v = b / (kernel.T @ u)
    expected = u[:, None] * kernel * v[None, :]
    plan = sinkhorn(torch.tensor(a), torch.tensor(b), torch.tensor(cost), reg).numpy()
    np.testing.assert_allclose(plan, expected, atol=1e-9)
    np.testing.assert_allclose(plan.sum(1), a, atol=1e-9)
    np.testing.assert_allclose(plan.sum(0), b, atol=1e-9)


def test_sinkhorn_survives_costs_where_the_kernel_underflows():
    cost = torch.tensor([[0.0, 30.0], [30.0, 0.0]], dtype=torch.float64) + 20.0
    plan = sinkhorn(torch.full((2,), 0.5), torch.full((2,), 0.5), cost, 0.02)
    assert np.exp(-50.0 / 0.02) == 0.0  # the plain kernel would be all zeros
    torch.testing.assert_close(plan, torch.tensor([[0.5, 0.0], [0.0, 0.5]], dtype=torch.float64))


def test_transport_head_by_hand():
    # Current classes 0, 1 and old 2, 3 with means far apart except 0~2 and 1~3: the plan is
    # diag(1/2, 1/2), so W_old <- 0.75 W_old + 0.25 * 0.5 * W_matched.
    layer = nn.Linear(2, 4)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [4.0, 4.0]]))
        layer.bias.copy_(torch.tensor([8.0, 16.0, 0.0, 0.0]))
    means = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 0.1], [10.0, 0.1]])
    transport_head(layer, torch.tensor([0, 1]), torch.tensor([2, 3]), means, 0.25, 0.02)
    expected = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.625, 1.5], [3.0, 3.125]])
    torch.testing.assert_close(layer.weight.detach(), expected)
    torch.testing.assert_close(layer.bias.detach(), torch.tensor([8.0, 16.0, 1.0, 2.0]))


# -- the firing ----------------------------------------------------------------------------------
def test_class_periods_group_the_classes_of_each_period():
    periods = ClassPeriods(5)
    periods.observe(torch.tensor([0, 1, 1]))
    periods.observe(torch.tensor([1, 2]))
    assert periods.close(0).tolist() == [True, True, True, False, False]
    periods.observe(torch.tensor([2, 3]))
    assert periods.close(1).tolist() == [False, False, True, True, False]
    assert periods.group.tolist() == [0, 0, 1, 1, -1]  # 2 was current again at firing 1


def test_merge_scales_the_period_task_vector_by_the_mean_cosine():
    adapter, network, _ = make(merge_scalar=0.5)
    params = list(network.body.parameters())
    built = [p.detach().clone() for p in params]  # the first anchor: the built backbone
    head = network.fc.weight.detach().clone()
    with torch.no_grad():
        for p in params:
            p.add_(2.0)  # the first period's training
    # The period's class means under the anchor and the training backbone, fed directly:
    # class 0: (1, 0) vs (1, 1) -> cos 1/sqrt(2); class 1: (0, 2) vs (0, 3) -> cos 1.
    labels = torch.tensor([0, 1])
    pad = torch.zeros(2, 6)
    adapter.anchored.update(torch.cat([torch.tensor([[1.0, 0.0], [0.0, 2.0]]), pad], 1), labels)
    adapter.trained.update(torch.cat([torch.tensor([[1.0, 1.0], [0.0, 3.0]]), pad], 1), labels)
    adapter.periods.observe(labels)
    adapter.consolidate(network, 0)
    s = (1 / np.sqrt(2) + 1) / 2
    assert adapter.ratios == [pytest.approx(s, rel=1e-6)]
    for p, a in zip(params, built):  # a + 0.5 * s * 2
        torch.testing.assert_close(p.detach(), a + s, atol=1e-6, rtol=0)
    torch.testing.assert_close(network.fc.weight.detach(), head)  # no old classes yet
    for a, p in zip(adapter.anchor, params):
        torch.testing.assert_close(a, p.detach())
    assert int(adapter.trained.counts.sum()) == 0  # a fresh period


def test_the_loop_merges_and_transports_at_its_firings_only():
    adapter, _, loop = make(consolidation="every_n_samples", consolidation_every_n_samples=8)
    for step, (x, y) in enumerate(batches(8)):
        loop.train_step(x, y)
        # firings come before steps 2, 4 and 6 (8 samples each)
        assert len(adapter.ratios) == sum(1 for fired in (2, 4, 6) if fired <= step)
    assert loop.trigger.firings == [8, 16, 24]
    assert all(0 < r <= 1 for r in adapter.ratios)
    assert adapter.transports > 0


def test_the_anchor_features_come_from_the_kept_copy():
    adapter, network, _ = make()
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(8, 5, generator=g), torch.randn(8, generator=g)
    adapter.anchor = [weight, bias]
    x, y = torch.randn(6, 5, generator=g), torch.tensor([0, 2, 0, 2, 2, 1])
    adapter.after_step(network, x, y, {})
    expected = torch.relu(x @ weight.T + bias)  # not the network's own weights
    assert not torch.allclose(network.body.weight, weight)
    for c in (0, 1, 2):
        torch.testing.assert_close(adapter.anchored.means[c], expected[y == c].mean(0))


def test_extra_state_round_trip_takes_the_same_steps():
    kwargs = dict(consolidation="every_n_samples", consolidation_every_n_samples=8)
    adapter, network, loop = make(**kwargs)
    data = batches(9)
    for x, y in data[:5]:
        loop.train_step(x, y)
    assert len(adapter.ratios) == 2
    state = copy.deepcopy(loop.state_dict())
    other_adapter, other_network, other_loop = make(**kwargs)
    other_loop.load_state_dict(state)
    for x, y in data[5:]:
        loop.train_step(x, y)
        other_loop.train_step(x, y)
    assert other_adapter.ratios == adapter.ratios and len(adapter.ratios) == 4
    for a, b in zip(network.parameters(), other_network.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_state_bytes_counts_one_backbone_copy():
    # the anchor (fp32 ViT-B/16 backbone) and three fp32 10 x 768 banks of class means
    assert DUCTOnline.state_bytes({"nb_classes": 10}) == 4 * 85_798_656 + 3 * 4 * 10 * 768

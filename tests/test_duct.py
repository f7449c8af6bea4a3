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
from conftest import TinyNet, unit_config
from torch import nn

from pilot_online.engine.adapter import TrainedStep
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.methods.duct import ClassPeriods, DUCTOnline, sinkhorn, transported_rows

NUM_CLASSES = 6


class TinyDUCT(DUCTOnline):
    """DUCT over conftest's TinyNet: ``body`` is the merged backbone, features relu(body(x))."""

    def build_network(self, args: dict) -> nn.Module:
        network = TinyNet(num_classes=int(args["nb_classes"]))
        self.setup_state(network, args)
        return network

    def backbone(self, network: nn.Module) -> nn.Module:
        return network.body

    def features(self, network, x, params=None):
        return torch.relu(super().features(network, x, params))


def config(**overrides) -> dict:
    defaults = {
        "consolidation": "every_n_samples",
        "consolidation_every_n_samples": 10**6,  # no firing unless a test sets one
    }
    return unit_config(DUCTOnline, NUM_CLASSES, **{**defaults, **overrides})


def make(**overrides):
    torch.manual_seed(0)
    cfg = config(**overrides)
    adapter = TinyDUCT(args=cfg)
    network = adapter.build_network(cfg)
    return adapter, network, build_loop(adapter, network, cfg, cfg["nb_classes"])


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


def test_transported_rows_by_hand():
    # Current classes 0, 1 and old 2, 3 with means far apart except 0~2 and 1~3: the plan is
    # diag(1/2, 1/2), so the old rows move to 0.75 W_old + 0.25 * 0.5 * W_matched, each scaled
    # back to its own norm (upstream's cosine head sees only the direction).
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [4.0, 4.0]])
    means = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 0.1], [10.0, 0.1]])
    rows = transported_rows(weight, torch.tensor([0, 1]), torch.tensor([2, 3]), means, 0.25, 0.02)
    raw = torch.tensor([[1.625, 1.5], [3.0, 3.125]])
    norms = torch.tensor([[2 * 2**0.5], [4 * 2**0.5]])
    torch.testing.assert_close(rows, raw / raw.norm(dim=1, keepdim=True) * norms)
    torch.testing.assert_close(rows.norm(dim=1), norms.flatten())


def test_consolidate_transports_rows_at_their_norms_and_keeps_the_bias():
    adapter, network, _ = make()
    labels = torch.tensor([0, 1, 2, 3])
    features = torch.cat([torch.eye(4), torch.zeros(4, 4)], 1)
    adapter.means.update(features, labels)
    adapter.periods.observe(labels[:2])
    adapter.consolidate(network, 0)  # classes 0, 1: group 0
    weight, bias = network.fc.weight.detach().clone(), network.fc.bias.detach().clone()
    adapter.periods.observe(labels[2:])
    for _ in range(3):  # three firings of classes 2, 3 alone: group 0 moves at each
        adapter.consolidate(network, len(adapter.ratios))
        adapter.periods.observe(labels[2:])
    assert adapter.transports == 3
    torch.testing.assert_close(network.fc.weight.detach().norm(dim=1), weight.norm(dim=1))
    torch.testing.assert_close(network.fc.bias.detach(), bias)
    assert not torch.allclose(network.fc.weight[:2], weight[:2])  # the directions moved


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
    adapter.after_step(network, TrainedStep(x, y, len(y), {}))
    expected = torch.relu(x @ weight.T + bias)  # not the network's own weights
    assert not torch.allclose(network.body.weight, weight)
    for c in (0, 1, 2):
        torch.testing.assert_close(adapter.anchored.means[c], expected[y == c].mean(0))


def test_state_dict_round_trip_takes_the_same_steps():
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
    assert (
        method_card("duct_online").memory_bytes({"nb_classes": 10})
        == 4 * 85_798_656 + 3 * 4 * 10 * 768
    )


# -- the evaluation view ---------------------------------------------------------------------------
def flat_state(adapter: DUCTOnline, network: nn.Module) -> list[torch.Tensor]:
    """Every tensor of the method's state and the network's, in a fixed order."""
    state = adapter.state_dict(network)
    tensors = [v for k in ("means", "trained", "anchored", "periods") for v in state[k].values()]
    return [*tensors, *state["anchor"], *network.state_dict().values()]


def test_evaluation_view_is_the_coming_firing_and_changes_nothing():
    adapter, network, loop = make(consolidation="every_n_samples", consolidation_every_n_samples=8)
    for x, y in batches(5):
        loop.train_step(x, y)  # firings before steps 2 and 4: a period of one step is open
    before = [t.clone() for t in flat_state(adapter, network)]
    ratios, transports = list(adapter.ratios), adapter.transports
    view = adapter.evaluation(network).view
    for a, b in zip(flat_state(adapter, network), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert adapter.ratios == ratios and adapter.transports == transports
    # What the next firing then makes of the training state is what the view showed.
    adapter.consolidate(network, len(adapter.ratios))
    assert adapter.transports > transports and set(view) == {
        "body.weight",
        "body.bias",
        "fc.weight",
    }
    parameters = dict(network.named_parameters())
    for name, value in view.items():
        torch.testing.assert_close(parameters[name].detach(), value, rtol=0, atol=0)
    adapter, network, loop = make(consolidation="never")
    loop.train_step(*batches(1)[0])
    assert adapter.evaluation(network).view == {}


def test_defaults_act_on_twenty_cub_sized_tasks():
    # CUB's stream: 20 tasks of 10 classes, about 470 samples each, with the default trigger
    # (new_classes, 10): a firing at each of the 19 boundaries merges and transports every older
    # group at the rows' norms, and each task-end evaluation sees the merge and the transport.
    tasks, classes, samples, batch = 20, 10, 470, 235
    adapter, network, loop = make(
        nb_classes=tasks * classes, consolidation="new_classes", consolidation_new_classes=classes
    )
    norms_kept = []
    consolidate = adapter.consolidate

    def checked(network: nn.Module, firing: int):
        before = network.fc.weight.detach().norm(dim=1)
        result = consolidate(network, firing)
        norms_kept.append(torch.allclose(network.fc.weight.detach().norm(dim=1), before))
        return result

    adapter.consolidate = checked
    g = torch.Generator().manual_seed(2)
    for task in range(tasks):
        labels = torch.arange(task * classes, (task + 1) * classes).repeat(samples // classes)
        labels = labels[torch.randperm(len(labels), generator=g)]
        for step in range(len(labels) // batch):
            y = labels[step * batch : (step + 1) * batch]
            loop.train_step(torch.randn(len(y), 5, generator=g), y)
        view = adapter.evaluation(network).view  # the task-end evaluation's
        assert {"body.weight", "body.bias"} <= set(view)
        assert ("fc.weight" in view) == (task > 0)
    assert loop.trigger.firings == [samples * t for t in range(1, tasks)]
    assert len(adapter.ratios) == tasks - 1 and all(norms_kept)
    assert adapter.transports == sum(range(tasks - 1))  # firing f moves its f older groups

"""CoFiMA online (methods/cofima.py), without PILOT: the adapter runs on a tiny network.

Expected values come from upstream's equations worked out by hand (the Fisher-weighted and plain
averages) or from a separate autograd pass (the squared gradients), never read back from the code
under test. CA is SLCA's, tested in test_slca.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyNet, unit_config
from torch import nn

from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.methods.cofima import CoFiMAOnline, fisher_average

NUM_CLASSES = 6


class TinyCoFiMA(CoFiMAOnline):
    """CoFiMA's state and firings over conftest's TinyNet (features = relu(body(x)))."""

    def build_network(self, args: dict) -> nn.Module:
        network = TinyNet(num_classes=int(args["nb_classes"]))
        self._setup_state(args, network.fc.in_features)  # SLCA's class Gaussians
        self.setup_state(network)
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = torch.relu(network.body(x))
        return StepOutput(network.fc(features), features)


def config(**overrides) -> dict:
    defaults = {
        "consolidation": "every_n_samples",
        "consolidation_every_n_samples": 10**6,  # no firing unless a test sets one
    }
    return unit_config(CoFiMAOnline, NUM_CLASSES, **{**defaults, **overrides})


def make(**overrides):
    torch.manual_seed(0)
    cfg = config(**overrides)
    adapter = TinyCoFiMA(args=cfg)
    network = adapter.build_network(cfg)
    return adapter, network, build_loop(adapter, network, cfg, cfg["nb_classes"])


def batches(steps: int, size: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 5, generator=g), torch.randint(0, NUM_CLASSES, (size,), generator=g))
        for _ in range(steps)
    ]


# -- the Fisher-weighted average ----------------------------------------------------------------
def test_fisher_average_by_hand():
    # ((1-a) F0 t0 + a F1 t1) / ((1-a) F0 + a F1), a = 0.4:
    # t0=1, t1=3, F0=2e-5, F1=6e-5: (0.6*2e-5*1 + 0.4*6e-5*3) / (0.6*2e-5 + 0.4*6e-5)
    #                              = (1.2e-5 + 7.2e-5) / (1.2e-5 + 2.4e-5) = 8.4 / 3.6 = 7/3
    # F1 = 0 (the current model has no information): t0; both 0 (upstream's 0/0): t1.
    t0 = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    t1 = torch.tensor([3.0, 3.0, 3.0], dtype=torch.float64)
    f0 = torch.tensor([2e-5, 2e-5, 0.0], dtype=torch.float64)
    f1 = torch.tensor([6e-5, 0.0, 0.0], dtype=torch.float64)
    (merged,) = fisher_average([t0], [f0], [t1], [f1], alpha=0.4)
    torch.testing.assert_close(merged, torch.tensor([7 / 3, 1.0, 3.0], dtype=torch.float64))


# -- the Fisher, online --------------------------------------------------------------------------
def test_period_fisher_is_the_mean_squared_gradient_clamped():
    adapter, network, loop = make(cofima_fisher_max=1.0)
    data = batches(2)
    expected = []
    for x, y in data:
        shadow = copy.deepcopy(network)  # the step's gradient at the weights before it
        loss = F.cross_entropy(shadow.fc(torch.relu(shadow.body(x))), y)
        grads = torch.autograd.grad(loss, [p for _, p in shadow.named_parameters()])
        expected.append([g.pow(2) for g in grads])
        loop.train_step(x, y)
    fisher = adapter.period_fisher()
    for got, *steps in zip(fisher, *expected):
        torch.testing.assert_close(got, sum(steps) / 2)
    # The clamp: upstream's fishermax caps each scalar.
    adapter, network, loop = make(cofima_fisher_max=1e-4)
    for x, y in data:
        loop.train_step(x, y)
    fisher = adapter.period_fisher()
    assert max(f.max().item() for f in fisher) == pytest.approx(1e-4)
    assert adapter.fisher_sum is None and adapter.fisher_steps == 0  # a fresh period
    # Without a trigger nothing would read it: no Fisher is kept.
    adapter, network, loop = make(consolidation="never")
    loop.train_step(*data[0])
    assert adapter.fisher_sum is None and adapter.fisher_steps == 0


def sessions(adapter: TinyCoFiMA) -> None:
    """Classes 0, 1 first seen before the first firing, 2, 3 after it, 4, 5 never."""
    adapter.stats.session.copy_(torch.tensor([0, 0, 1, 1, -1, -1]))


def test_merge_from_the_second_firing_with_the_hand_formula():
    adapter, network, _ = make(ca_epochs=0, wt_lambda=0.25)
    body, head = list(network.body.parameters()), list(network.fc.parameters())
    params = [p for _, p in network.named_parameters()]
    w0 = {id(p): p.detach().clone() for p in params}
    adapter.fisher_sum, adapter.fisher_steps = [torch.full_like(p, 4e-5) for p in params], 2
    adapter.consolidate(network, 0)  # upstream's first task end: kept, no merge
    assert adapter.merges == []
    for p in params:
        torch.testing.assert_close(p.detach(), w0[id(p)])
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # the second period's training
    sessions(adapter)
    adapter.fisher_sum, adapter.fisher_steps = [torch.full_like(p, 3e-5) for p in params], 1
    adapter.consolidate(network, 1)
    # F0 = 4e-5 / 2 = 2e-5, F1 = 3e-5, a = 0.25, t1 = t0 + 1:
    # (0.75 * 2e-5 * t0 + 0.25 * 3e-5 * (t0 + 1)) / (0.75 * 2e-5 + 0.25 * 3e-5)
    # = t0 + 0.75e-5 / 2.25e-5 = t0 + 1/3
    assert adapter.merges == [1]
    for p in body:  # the merged backbone trains on
        torch.testing.assert_close(p.detach(), w0[id(p)] + 1 / 3)
    for p in head:  # the head trains on as it was (upstream's fc.recall())
        torch.testing.assert_close(p.detach(), w0[id(p)] + 1)
    # The next merge's previous model: the merged backbone, and the head merged per row: old
    # classes (0, 1) averaged, new ones (2, 3) F1 t1 (upstream's keys of the new model only),
    # never seen ones (4, 5) t1.
    anchor = dict(zip(map(id, params), adapter.anchor))
    for p in body:
        torch.testing.assert_close(anchor[id(p)], w0[id(p)] + 1 / 3)
    for p in head:
        t0 = w0[id(p)]
        expected = torch.cat([t0[:2] + 1 / 3, 3e-5 * (t0[2:4] + 1), t0[4:] + 1])
        torch.testing.assert_close(anchor[id(p)], expected)


def test_plain_average_without_fisher_weighting():
    adapter, network, _ = make(ca_epochs=0, wt_lambda=0.4, fisher_weighting=False)
    params = [p for _, p in network.named_parameters()]
    w0 = {id(p): p.detach().clone() for p in params}
    adapter.consolidate(network, 0)
    with torch.no_grad():
        for p in params:
            p.add_(2.0)
    sessions(adapter)
    adapter.consolidate(network, 1)
    anchor = dict(zip(map(id, params), adapter.anchor))
    for p in network.body.parameters():  # 0.6 t0 + 0.4 (t0 + 2) = t0 + 0.8
        torch.testing.assert_close(p.detach(), w0[id(p)] + 0.8)
    for p in network.fc.parameters():  # new and unseen rows: t1 (upstream's new keys)
        t0 = w0[id(p)]
        torch.testing.assert_close(p.detach(), t0 + 2)
        torch.testing.assert_close(anchor[id(p)], torch.cat([t0[:2] + 0.8, t0[2:] + 2]))


def test_fisher_average_of_subnormal_fishers_is_the_formula():
    # F0 = F1 = 1e-40 (float32 subnormals): the formula's (0.6 * 1 + 0.4 * 3) / 1 = 1.8, which
    # a float32 denominator clamped at 1e-38 would shrink to 0.018.
    f = torch.tensor([1e-40])
    (merged,) = fisher_average([torch.tensor([1.0])], [f], [torch.tensor([3.0])], [f], alpha=0.4)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged, torch.tensor([1.8]))


# -- the evaluation view ---------------------------------------------------------------------------
def flat_state(adapter: TinyCoFiMA, network: nn.Module) -> list[torch.Tensor]:
    """Every tensor of the method's state and the network's, in a fixed order."""
    state = adapter.state_dict(network)
    tensors = [*state["stats"].values(), *state["fisher_sum"], *state["prev_fisher"]]
    return [*tensors, *state["anchor"], *network.state_dict().values()]


def test_evaluation_view_is_the_coming_firing_and_changes_nothing():
    kwargs = dict(
        consolidation="every_n_samples", consolidation_every_n_samples=8, ca_samples_per_class=8
    )
    adapter, network, loop = make(**kwargs)
    data = batches(7)
    loop.train_step(*data[0])
    assert adapter.evaluation(network).view == {}  # upstream's first task: no merge, no CA
    for x, y in data[1:7]:
        loop.train_step(x, y)  # firings before steps 2, 4 and 6: a period of one step is open
    before = [t.clone() for t in flat_state(adapter, network)]
    view = adapter.evaluation(network).view
    for a, b in zip(flat_state(adapter, network), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert set(view) == {name for name, _ in network.named_parameters()}
    parameters = dict(network.named_parameters())
    # CA moved the merged head: the view's head is not the training head.
    assert not torch.allclose(view["fc.weight"], parameters["fc.weight"])
    # The next firing makes the same model: its backbone trains on, all of it is the anchor.
    adapter.consolidate(network, len(adapter.merges) + 1)
    for (name, p), kept in zip(adapter._named, adapter.anchor):
        torch.testing.assert_close(kept, view[name], rtol=0, atol=0)
        if name.startswith("body."):
            torch.testing.assert_close(p.detach(), view[name], rtol=0, atol=0)
    adapter, network, loop = make(consolidation="never")
    loop.train_step(*data[0])
    assert adapter.evaluation(network).view == {}


def test_the_loop_merges_at_its_firings_only():
    adapter, _, loop = make(
        consolidation="every_n_samples", consolidation_every_n_samples=8, ca_samples_per_class=8
    )
    for step, (x, y) in enumerate(batches(8)):
        loop.train_step(x, y)
        # firing f comes before step 2f + 2 (8 samples each); merges from the second on
        assert adapter.merges == [f for f in (1, 2) if 2 * f + 2 <= step]
    assert loop.trigger.firings == [8, 16, 24]


# -- checkpoints ---------------------------------------------------------------------------------
def test_state_dict_round_trip_takes_the_same_steps():
    kwargs = dict(
        consolidation="every_n_samples", consolidation_every_n_samples=8, ca_samples_per_class=8
    )
    adapter, network, loop = make(**kwargs)
    data = batches(9)
    for x, y in data[:6]:
        loop.train_step(x, y)
    assert adapter.merges == [1]
    state = copy.deepcopy(loop.state_dict())
    other_adapter, other_network, other_loop = make(**kwargs)
    other_loop.load_state_dict(state)
    for x, y in data[6:]:  # crosses two firings, each with a merge and CA
        loop.train_step(x, y)
        other_loop.train_step(x, y)
    assert other_adapter.merges == adapter.merges == [1, 2, 3]
    for a, b in zip(network.parameters(), other_network.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_state_bytes_adds_three_weight_copies_to_slca():
    # SLCA's 10 classes of (768^2 + 768) fp32 + 16 bytes, and 3 fp32 copies of the ViT-B/16
    # backbone (85,798,656) with a 10-class head (10 * 769)
    expected = 10 * (4 * 589_824 + 4 * 768 + 16) + 3 * 4 * (85_798_656 + 7690)
    assert method_card("cofima_online").memory_bytes({"nb_classes": 10}) == expected


def test_defaults_act_on_twenty_cub_sized_tasks():
    # CUB's stream: 20 tasks of 10 classes, about 470 samples each, with the default trigger
    # (new_classes, 10): a firing at each of the 19 boundaries, and each task-end evaluation from
    # the second task on sees the merged model. (CA, whose cost grows with the classes, runs for
    # the last evaluation only: it is no window, it aligns whenever a view is asked for.)
    tasks, classes, samples, batch = 20, 10, 470, 235
    adapter, network, loop = make(
        nb_classes=tasks * classes,
        consolidation="new_classes",
        consolidation_new_classes=classes,
        ca_samples_per_class=4,
        ca_epochs=0,
    )
    g = torch.Generator().manual_seed(2)
    for task in range(tasks):
        labels = torch.arange(task * classes, (task + 1) * classes).repeat(samples // classes)
        labels = labels[torch.randperm(len(labels), generator=g)]
        for step in range(len(labels) // batch):
            y = labels[step * batch : (step + 1) * batch]
            loop.train_step(torch.randn(len(y), 5, generator=g), y)
        if task < tasks - 1:
            view = adapter.evaluation(network).view  # the task-end evaluation's
            assert bool(view) == (task > 0)
            if view:
                assert not torch.allclose(view["body.weight"], network.body.weight)
    assert loop.trigger.firings == [samples * t for t in range(1, tasks)]
    # Firings 1 to 18 merge (the first only keeps the model); the last task's merge, upstream's
    # 19th, is the view its evaluation sees: merged and aligned.
    assert adapter.merges == list(range(1, tasks - 1))
    adapter.args["ca_epochs"] = 1
    view = adapter.evaluation(network).view
    adapter.args["ca_epochs"] = 0
    merged = adapter.evaluation(network).view
    assert not torch.allclose(view["fc.weight"], merged["fc.weight"])
    torch.testing.assert_close(view["body.weight"], merged["body.weight"])

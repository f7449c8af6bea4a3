"""``cofima_online`` against upstream's own code (PILOT ``models/cofima.py``; its head,
``backbone/linears.py``'s ``SimpleContinualLinear``).

Upstream's ``Learner`` methods run unbound on small stand-ins of ``self`` (a linear "backbone" of
4 -> 6 and a head of two 3-class tasks), on the same weights, Fishers and features as our
adapter, and the numbers are compared: the task end (``incremental_train`` with
``interpolate_weights``, ``fc.backup()`` and, in ``after_task``, ``fc.recall()``), the Fisher
(``getFisherDiagonal``), the class statistics (``_compute_class_mean``) and CA's mean decay
(``_stage2_compact_classifier``). Each declared difference (the card's ``upstream_differences``)
has its ``test_difference_<key>``.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import requires_pilot, unit_config
from torch import nn

from pilot_online.engine.adapter import trained_parameters
from pilot_online.engine.mixins import build_loop
from pilot_online.methods.cofima import CoFiMAOnline, fisher_average
from pilot_online.methods.slca import mean_scales

pytestmark = requires_pilot

TASK = 3  # classes per task
NUM_CLASSES = 2 * TASK
BACKBONE = ("backbone.bias", "backbone.weight")


@pytest.fixture(scope="module")
def upstream(pilot_on_path) -> Iterator[types.ModuleType]:
    import models.cofima

    yield models.cofima


class Net(nn.Module):
    """``SLCANet``'s shape: ``backbone`` (here linear), ``fc``, ``extract_vector``, and its
    ``forward(x, bcb_no_grad, fc_only)`` returning a dict of logits."""

    def __init__(self, fc: nn.Module | None = None) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 6)
        self.fc = fc

    def update_fc(self, nb_classes: int) -> None:
        from backbone.linears import SimpleContinualLinear

        if self.fc is None:
            self.fc = SimpleContinualLinear(6, nb_classes)
        else:
            self.fc.update(nb_classes)

    def extract_vector(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor, bcb_no_grad: bool = False, fc_only: bool = False):
        logits = self.fc(x if fc_only else self.backbone(x))
        return logits if isinstance(logits, dict) else {"logits": logits}


def config(**overrides: Any) -> dict[str, Any]:
    defaults = {
        "consolidation": "new_classes",
        "consolidation_new_classes": TASK,
        "ca_epochs": 0,
    }
    return unit_config(CoFiMAOnline, NUM_CLASSES, **{**defaults, **overrides})


def ours(**overrides: Any) -> tuple[CoFiMAOnline, Net]:
    """Our adapter on :class:`Net` with one linear head over the six classes, state fresh."""
    torch.manual_seed(0)
    cfg = config(**overrides)
    adapter = CoFiMAOnline(args=cfg)
    network = Net(nn.Linear(6, NUM_CLASSES))
    adapter._setup_state(cfg, 6)
    adapter.setup_state(network)
    return adapter, network


def random_like(
    shapes: dict[str, tuple[int, ...]], seed: int, scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """Standard normal tensors of the given shapes, times ``scale``."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * scale for k, s in shapes.items()}


# -- the task end -------------------------------------------------------------------------------
def upstream_learner(upstream: types.ModuleType, network: Net, tasks: list[dict]) -> Any:
    """Upstream's ``Learner`` ``self`` whose task training sets the weights ``tasks[t]["theta"]``
    and whose Fisher is ``tasks[t]["fisher"]`` (by upstream's parameter names)."""
    learner = SimpleNamespace(
        _cur_task=-1,
        _known_classes=0,
        _total_classes=0,
        task_sizes=[],
        batch_size=4,
        _device="cpu",
        _multiple_gpus=[],
        _network=network,
        fisher_weighting=True,
        wt_lambda=0.4,
        prev_nets=[],
        init_nets=[],
        fisher_mat=[],
        ca_epochs=0,
        exemplar_size=0,
        optimizer=None,
        _compute_class_mean=lambda data_manager: None,
    )

    def stage1_training(train_loader: Any, test_loader: Any) -> None:
        network.load_state_dict(tasks[learner._cur_task]["theta"], strict=True)

    learner._stage1_training = stage1_training
    learner.getFisherDiagonal = lambda loader, optimizer: tasks[learner._cur_task]["fisher"]
    return learner


def as_ours(values: dict[str, torch.Tensor], rows: torch.Tensor | None = None) -> list:
    """Upstream's per-task head keys as our one head's rows (``rows``: the second task's, when
    upstream's dict has no second head), in the order of our trainable parameters."""
    weight = [values["fc.heads.0.0.weight"]]
    bias = [values["fc.heads.0.0.bias"]]
    if "fc.heads.1.0.weight" in values:
        weight.append(values["fc.heads.1.0.weight"])
        bias.append(values["fc.heads.1.0.bias"])
    else:
        weight.append(rows[0])
        bias.append(rows[1])
    return [values["backbone.weight"], values["backbone.bias"], torch.cat(weight), torch.cat(bias)]


def test_task_end_matches_upstream(upstream, monkeypatch):
    # Two tasks of three classes through upstream's incremental_train and after_task, and two
    # periods through ours: the model evaluated (our view), the model trained on (after upstream's
    # fc.recall()), and the next merge's previous model (upstream's prev_nets) agree.
    shapes = {"backbone.weight": (6, 4), "backbone.bias": (6,)}
    head0 = {"fc.heads.0.0.weight": (3, 6), "fc.heads.0.0.bias": (3,)}
    head1 = {"fc.heads.1.0.weight": (3, 6), "fc.heads.1.0.bias": (3,)}
    theta0 = random_like({**shapes, **head0}, 1)
    theta1 = {**random_like(shapes, 2), **{k: v for k, v in theta0.items() if "heads.0" in k}}
    theta1.update(random_like(head1, 3))
    # Fishers under fishermax (1e-4), which upstream's getFisherDiagonal has applied.
    fisher0 = {
        k: v.abs().clamp(max=9e-5) for k, v in random_like({**shapes, **head0}, 4, 4e-5).items()
    }
    fisher1 = {
        k: v.abs().clamp(max=9e-5)
        for k, v in random_like({**shapes, **head0, **head1}, 5, 4e-5).items()
    }
    tasks = [{"theta": theta0, "fisher": fisher0}, {"theta": theta1, "fisher": fisher1}]
    monkeypatch.setattr(upstream, "DataLoader", lambda dataset, **kwargs: dataset)  # never read
    network = Net()
    learner = upstream_learner(upstream, network, tasks)
    manager = SimpleNamespace(
        get_task_size=lambda t: TASK,
        get_dataset=lambda *a, **k: [(0, torch.zeros(4), 0)],
        dataset_name="tiny",
    )
    upstream.Learner.incremental_train(learner, manager)
    upstream.Learner.after_task(learner)
    upstream.Learner.incremental_train(learner, manager)
    evaluated = {k: v.clone() for k, v in network.state_dict().items()}
    upstream.Learner.after_task(learner)
    trained = network.state_dict()

    adapter, ours_net = ours()
    params = [p for _, p in adapter._named]
    spare = random_like({"w": (3, 6), "b": (3,)}, 6)  # the second task's rows before it
    spare = (spare["w"], spare["b"])
    zeros = (torch.zeros(3, 6), torch.zeros(3))
    with torch.no_grad():
        for p, value in zip(params, as_ours(theta0, spare)):
            p.copy_(value)
    adapter.stats.update(torch.randn(3, 6), torch.arange(TASK), 0)
    adapter.fisher_sum, adapter.fisher_steps = as_ours(fisher0, zeros), 1
    adapter.consolidate(ours_net, 0)
    with torch.no_grad():
        for p, value in zip(params, as_ours(theta1)):
            p.copy_(value)
    adapter.stats.update(torch.randn(3, 6), torch.arange(TASK, NUM_CLASSES), 1)
    adapter.fisher_sum, adapter.fisher_steps = as_ours(fisher1), 1
    view = adapter.evaluation(ours_net).view
    adapter.consolidate(ours_net, 1)

    def check(got: list[torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
        for a, b in zip(got, as_ours(expected)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    check([view[name] for name, _ in adapter._named], evaluated)
    check([p.detach() for p in params], trained)
    check(adapter.anchor, learner.prev_nets[-1])
    # Upstream's second head exists only in the current model: F1 t1, about 0.
    assert float(evaluated["fc.heads.1.0.weight"].abs().max()) < 1e-3
    torch.testing.assert_close(trained["fc.heads.1.0.weight"], theta1["fc.heads.1.0.weight"])


def test_plain_average_matches_upstream(upstream):
    g = torch.Generator().manual_seed(7)
    theta_0 = {"w": torch.randn(3, generator=g), "h0": torch.randn(2, generator=g)}
    theta_1 = {**{k: torch.randn(v.shape, generator=g) for k, v in theta_0.items()}}
    theta_1["h1"] = torch.randn(2, generator=g)
    theirs = upstream.interpolate_weights(theta_0, theta_1, alpha=0.4)
    adapter, network = ours(fisher_weighting=False, wt_lambda=0.4)
    adapter.anchor = [p.detach() + 1.0 for _, p in adapter._named]
    adapter.prev_fisher = [torch.zeros_like(p) for _, p in adapter._named]
    adapter.stats.update(torch.randn(3, 6), torch.arange(TASK), 0)
    adapter.sessions_closed = 1
    adapter.stats.update(torch.randn(3, 6), torch.arange(TASK, NUM_CLASSES), 1)
    merged = adapter.merged(network, adapter.current_fisher())
    for (name, p), a, m in zip(adapter._named, adapter.anchor, merged):
        t1 = p.detach()
        expected = 0.6 * a + 0.4 * t1
        if name.startswith("fc."):
            expected[TASK:] = t1[TASK:]  # upstream's new keys: theta_1
        torch.testing.assert_close(m, expected)
    for key in theta_0:
        torch.testing.assert_close(theirs[key], 0.6 * theta_0[key] + 0.4 * theta_1[key])
    torch.testing.assert_close(theirs["h1"], theta_1["h1"])


# -- the Fisher -----------------------------------------------------------------------------------
def batches(count: int, seed: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 4, generator=g) * 3, torch.randint(0, NUM_CLASSES, (4,), generator=g))
        for _ in range(count)
    ]


def their_fisher(upstream, network: Net, data: list) -> dict[str, torch.Tensor]:
    """Upstream's ``getFisherDiagonal`` of ``network`` over the batches ``data``."""
    learner = SimpleNamespace(_network=network, _device="cpu", fix_bcb=False)
    loader = [(torch.arange(len(y)), x, y) for x, y in data]
    optimizer = SimpleNamespace(zero_grad=lambda: network.zero_grad(set_to_none=True))
    return upstream.Learner.getFisherDiagonal(learner, loader, optimizer)


def test_fisher_matches_upstream_on_the_same_weights(upstream, monkeypatch):
    # fishermax at 0.01 (upstream's 1e-4 would clamp every scalar of this tiny net's Fisher).
    monkeypatch.setattr(upstream, "fishermax", 0.01)
    adapter, network = ours(cofima_fisher_max=0.01)
    data = batches(3)
    for x, y in data:  # what our loop's steps hand the hook, here at fixed weights
        network.zero_grad(set_to_none=True)
        F.cross_entropy(network(x)["logits"], y).backward()
        adapter.after_backward(network, contextlib.nullcontext)
    fisher = adapter.current_fisher()
    theirs = their_fisher(upstream, network, data)
    for (name, _), value in zip(adapter._named, fisher):
        torch.testing.assert_close(value, theirs[name], rtol=1e-6, atol=0)
    clamped = sum(int((f == 0.01).sum()) for f in fisher)
    assert 0 < clamped < sum(f.numel() for f in fisher)  # fishermax acts, on some scalars


def test_difference_fisher_from_training_steps(upstream, monkeypatch):
    # With the clamp out of the way: ours is the mean over the steps of upstream's one-batch
    # Fisher at the weights each step saw, not upstream's Fisher of the final weights.
    monkeypatch.setattr(upstream, "fishermax", 1e6)
    adapter, network = ours(cofima_fisher_max=1e6, init_lr=0.5)
    loop = build_loop(adapter, network, adapter.args, NUM_CLASSES)
    data = batches(2)
    per_step = []
    for x, y in data:
        per_step.append(their_fisher(upstream, network, [(x, y)]))
        loop.train_step(x, y)
    fisher = adapter.current_fisher()
    final = their_fisher(upstream, network, data)
    for (name, _), value in zip(adapter._named, fisher):
        expected = (per_step[0][name] + per_step[1][name]) / 2
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-9)
        assert not torch.allclose(value, final[name], rtol=1e-2)


# -- the merge's numerics -------------------------------------------------------------------------
def merge_one(upstream, f0: float, f1: float, t0: float = 0.3, t1: float = 0.6):
    """Upstream's and our Fisher average of one float32 scalar, at ``wt_lambda`` 0.4."""
    theta_0, theta_1 = {"w": torch.tensor([t0])}, {"w": torch.tensor([t1])}
    fishers = [{"w": torch.tensor([f0])}, {"w": torch.tensor([f1])}]
    theirs = upstream.interpolate_weights(theta_0, theta_1, 0.4, fisher=True, fisher_mat=fishers)
    (mine,) = fisher_average(
        [theta_0["w"]], [fishers[0]["w"]], [theta_1["w"]], [fishers[1]["w"]], 0.4
    )
    return theirs["w"], mine


def test_fisher_average_matches_upstream(upstream):
    for f0, f1 in [(2e-5, 6e-5), (1e-4, 3e-7), (1e-40, 1e-40), (0.0, 5e-5)]:
        theirs, mine = merge_one(upstream, f0, f1)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=0)


def test_difference_zero_fisher_keeps_current(upstream):
    theirs, mine = merge_one(upstream, 0.0, 0.0)
    assert torch.isnan(theirs).all()
    assert mine.item() == pytest.approx(0.6)


def test_difference_merge_in_float64(upstream):
    # Fishers of 2.8e-45 (float32's smallest subnormals): upstream's F t products round to
    # multiples of it and give 0.5; the formula's value is 0.6 * 0.3 + 0.4 * 0.6 = 0.42.
    theirs, mine = merge_one(upstream, 2.8e-45, 2.8e-45)
    assert theirs.item() == pytest.approx(0.5)
    assert mine.item() == pytest.approx(0.42, rel=1e-7)


def test_difference_unseen_class_rows_kept(upstream):
    # Upstream's average has no rows for classes to come; ours keeps their current values.
    adapter, network = ours()
    adapter.anchor = [p.detach() + 1.0 for _, p in adapter._named]
    adapter.prev_fisher = [torch.full_like(p, 1e-5) for _, p in adapter._named]
    adapter.stats.update(torch.randn(3, 6), torch.arange(TASK), 0)
    adapter.sessions_closed = 1
    fisher = [torch.full_like(p, 1e-5) for _, p in adapter._named]
    merged = dict(zip((n for n, _ in adapter._named), adapter.merged(network, fisher)))
    torch.testing.assert_close(merged["fc.weight"][TASK:], network.fc.weight[TASK:].detach())
    torch.testing.assert_close(merged["fc.weight"][:TASK], network.fc.weight[:TASK] + 0.6)
    theta = {"h0": torch.ones(3)}
    fishers = [{"h0": torch.ones(3)}, {"h0": torch.ones(3)}]
    assert set(upstream.interpolate_weights(theta, theta, 0.4, True, fishers)) == {"h0"}


# -- SLCA's part, as upstream's cofima.py repeats it ----------------------------------------------
def test_difference_running_class_statistics(upstream, monkeypatch):
    # The same features give upstream's mean and covariance (+ 1e-4 I); upstream takes them from
    # a pass of the trained backbone, ours from the steps as the backbone moves.
    def loader(dataset, batch_size, shuffle, num_workers):
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)

    monkeypatch.setattr(upstream, "DataLoader", loader)
    adapter, network = ours(init_lr=0.5, bcb_lrscale=1.0)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(9))
    y = torch.zeros(6, dtype=torch.long)
    dataset = [(torch.tensor(i), x[i], 0) for i in range(6)]
    learner = SimpleNamespace(
        _network=network,
        _device="cpu",
        _known_classes=0,
        _total_classes=1,
        feature_dim=6,
        batch_size=4,
    )
    learner._extract_vectors = types.MethodType(upstream.BaseLearner._extract_vectors, learner)
    manager = SimpleNamespace(get_dataset=lambda *a, **k: (None, None, dataset))
    upstream.Learner._compute_class_mean(learner, manager)
    with torch.no_grad():
        adapter.stats.update(network.backbone(x[:4]), y[:4], 0)
        adapter.stats.update(network.backbone(x[4:]), y[4:], 0)
    classes = torch.tensor([0])
    torch.testing.assert_close(
        adapter.stats.means[0].double(), torch.tensor(learner._class_means_slca[0])
    )
    torch.testing.assert_close(
        adapter.stats.covariances(classes)[0].float(),
        learner._class_covs_slca[0],
        rtol=1e-5,
        atol=1e-6,
    )
    # Through the loop, the steps' features move with the backbone: another mean.
    adapter, network = ours(init_lr=0.5, bcb_lrscale=1.0)
    loop = build_loop(adapter, network, adapter.args, NUM_CLASSES)
    loop.train_step(x[:4], y[:4])
    loop.train_step(x[4:], y[4:])
    learner._network, learner._class_means_slca = network, None
    upstream.Learner._compute_class_mean(learner, manager)
    assert not np.allclose(adapter.stats.means[0].numpy(), learner._class_means_slca[0], atol=1e-4)


def test_difference_sessions_from_firings(upstream, monkeypatch):
    # CA's mean decay: upstream's task of class c is c // task_size; ours its session. Class 4
    # (task 1 by its id) first came before the first firing (session 0).
    drawn: dict[int, torch.Tensor] = {}

    class Recorder:
        def __init__(self, mean: torch.Tensor, cov: torch.Tensor) -> None:
            self.mean = mean

        def sample(self, sample_shape: tuple[int, ...]) -> torch.Tensor:
            drawn[len(drawn)] = self.mean
            return torch.zeros(*sample_shape, len(self.mean))

    monkeypatch.setattr(upstream, "MultivariateNormal", Recorder)
    means = np.ones((NUM_CLASSES, 6))
    learner = SimpleNamespace(
        _network=Net(nn.Linear(6, NUM_CLASSES)),
        _device="cpu",
        _multiple_gpus=[],
        ca_epochs=1,
        lrate=0.01,
        weight_decay=5e-4,
        _total_classes=NUM_CLASSES,
        _cur_task=1,
        task_sizes=[TASK, TASK],
        logit_norm=None,
        _class_means_slca=means,
        _class_covs_slca=torch.eye(6).repeat(NUM_CLASSES, 1, 1),
        _compute_accuracy=lambda *a: 0.0,
        test_loader=None,
    )
    upstream.Learner._stage2_compact_classifier(learner, TASK)
    theirs = torch.stack([drawn[c][0] for c in range(NUM_CLASSES)]).double()
    torch.testing.assert_close(theirs, torch.tensor([0.95] * 3 + [1.0] * 3, dtype=torch.float64))
    clear = mean_scales(torch.tensor([0, 0, 0, 1, 1, 1]), 1)
    torch.testing.assert_close(clear, theirs)
    blurry = mean_scales(torch.tensor([0, 0, 0, 1, 0, 1]), 1)
    assert blurry[4].item() == pytest.approx(0.95) and theirs[4].item() == pytest.approx(1.0)


def test_difference_old_head_rows_keep_training(upstream):
    # Upstream freezes the earlier task heads when it adds one; our one head keeps every row
    # trainable: an old class's row gets its gradient after a firing.
    network = Net()
    network.update_fc(TASK)
    network.update_fc(TASK)
    assert not network.fc.heads[0][0].weight.requires_grad
    assert network.fc.heads[1][0].weight.requires_grad
    adapter, ours_net = ours()
    adapter.consolidate(ours_net, 0)
    assert dict(trained_parameters(ours_net))["fc.weight"] is ours_net.fc.weight
    F.cross_entropy(ours_net(torch.randn(2, 4))["logits"], torch.tensor([0, 1])).backward()
    assert ours_net.fc.weight.grad[:2].abs().sum() > 0


# -- CA's weight decay ----------------------------------------------------------------------------
def test_alignment_weight_decay_is_upstreams(upstream, monkeypatch, pilot_on_path):
    # Upstream's CA optimiser takes the config's weight_decay: 5e-4 in exps/cofima.json.
    exps = json.loads((pilot_on_path / "exps" / "cofima.json").read_text())
    decays = []
    sgd = torch.optim.SGD

    def recording_sgd(params, **kwargs):
        decays.append(kwargs["weight_decay"])
        return sgd(params, **kwargs)

    monkeypatch.setattr(torch.optim, "SGD", recording_sgd)
    adapter, network = ours(ca_epochs=1, ca_samples_per_class=4)
    adapter.stats.update(torch.randn(4, 6), torch.tensor([0, 0, 1, 1]), 0)
    adapter.consolidate(network, 0)
    adapter.stats.update(torch.randn(4, 6), torch.tensor([3, 3, 4, 4]), 1)
    adapter.evaluation(network)
    assert decays == [exps["weight_decay"]] == [5e-4]

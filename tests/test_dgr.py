"""DGR online (``dgr_online``): logit adjustment, per-class gradient reweighting, its product with
FGH, the consolidation's reset, and its replay memory; checked against numpy on a tiny net."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyNet
from torch import nn

from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.config import ConfigError, resolve_config
from pilot_online.engine.loop import build_loop
from pilot_online.methods.dgr import DGROnline, class_weights

C = 6  # TinyNet's classes
ROOT = Path(__file__).resolve().parents[1]


class TinyDGR(DGROnline):
    """DGR's training rules over conftest's TinyNet (no PILOT)."""

    def build_network(self, args: dict) -> nn.Module:
        self.clear_statistics()
        return TinyNet()

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = torch.relu(network.body(x))
        return StepOutput(network.fc(features), features)

    def train_mode(self, network: nn.Module) -> None:
        network.train()


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _hand_fc_gradient(
    network: nn.Module, x: torch.Tensor, labels: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The raw gradient of the logit-adjusted, batch-masked CE on fc, in closed form:
    dL/dz = (softmax(z + log prior) - onehot) / B over the batch's classes, 0 elsewhere."""
    with torch.no_grad():
        f = torch.relu(network.body(x)).double().numpy()
    w = network.fc.weight.detach().double().numpy()
    b = network.fc.bias.detach().double().numpy()
    present = np.unique(labels)
    z = (f @ w.T + b)[:, present] + np.log(counts[present] / counts.sum())
    dz_present = _softmax(z)
    dz_present[np.arange(len(labels)), np.searchsorted(present, labels)] -= 1
    dz = np.zeros((len(labels), C))
    dz[:, present] = dz_present / len(labels)
    return dz.T @ f, dz.sum(0)


def _batches(seed: int = 0, steps: int = 3, size: int = 4):
    gen = torch.Generator().manual_seed(seed)
    labels = [torch.tensor([0, 0, 1, 2]), torch.tensor([1, 3, 3, 3]), torch.tensor([0, 4, 4, 1])]
    return [(torch.randn(size, 5, generator=gen), labels[i % 3]) for i in range(steps)]


def test_class_weights_are_min_over_accumulated_norm():
    # G = [0, 2, 4, 1]: class 0 has no gradient yet (left out of the min, weight 1).
    weights = class_weights(torch.tensor([0.0, 2.0, 4.0, 1.0], dtype=torch.float64))
    assert weights.tolist() == [1.0, 0.5, 0.25, 1.0]
    assert class_weights(torch.zeros(3, dtype=torch.float64)).tolist() == [1.0, 1.0, 1.0]


def _np_weights(grad_sums: np.ndarray, known: np.ndarray, gammar_r: float) -> np.ndarray:
    """Upstream's _update_representation weights, in numpy, over the classes with a gradient."""
    active = grad_sums > 0
    old, new = active & known, active & ~known
    w = np.ones_like(grad_sums)
    if not (old.any() and new.any()):
        w[active] = grad_sums[active].min() / grad_sums[active]
        return w
    w[old] = grad_sums[old].min() / grad_sums[old]
    w[new] = grad_sums[new].min() / grad_sums[new]
    ratio = grad_sums[new].mean() / grad_sums[old].mean()
    w[old] *= min(1.0, ratio)
    w[new] *= min(1.0, ratio * np.exp(-gammar_r * known.sum() / (known | active).sum()))
    return w


def test_class_weights_with_old_and_new_groups_are_upstreams_later_task_rule():
    """G = [2, 4, 0, 1, 3, 0], classes 0-2 known (2 without a gradient yet). Old {0, 1}:
    min 2 -> [1, 1/2]; new {3, 4}: min 1 -> [1, 1/3]; mean_new / mean_old = 2 / 3;
    known / total = 3 / 5 (the known classes and those with a gradient): rs_old = 2/3,
    rs_new = 2/3 exp(-0.6) with gammar_r 1, and exp(-1.2) with 2."""
    grad_sums = torch.tensor([2.0, 4.0, 0.0, 1.0, 3.0, 0.0], dtype=torch.float64)
    known = torch.tensor([True, True, True, False, False, False])
    for gammar_r in (1.0, 2.0):
        rs_new = 2 / 3 * np.exp(-0.6 * gammar_r)
        weights = class_weights(grad_sums, known, gammar_r).numpy()
        np.testing.assert_allclose(weights[[0, 1, 3, 4]], [2 / 3, 1 / 3, rs_new, rs_new / 3])
        np.testing.assert_allclose(weights, _np_weights(grad_sums.numpy(), known.numpy(), gammar_r))
    # One group without a gradient yet: the first-task rule over all classes with one.
    only_old = torch.tensor([2.0, 4.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert class_weights(only_old, known).tolist()[:2] == [1.0, 0.5]


def test_loss_is_upstreams_logit_adjusted_cross_entropy():
    adapter = TinyDGR()
    network = adapter.build_network({})
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.0, 0.0, 0.0]])
    out = StepOutput(logits, torch.zeros(2, 8))
    adapter.classification_loss(network, out, torch.tensor([0, 0]), None)  # counts [2, 0, ...]
    loss = adapter.classification_loss(network, out, torch.tensor([0, 1]), None)
    # counts are now [3, 1, 0, 0, 0, 0]: prior [3/4, 1/4]; classes never trained on get -inf.
    z = logits.double().numpy()[:, :2] + np.log([0.75, 0.25])
    expected = -np.mean(np.log(_softmax(z)[[0, 1], [0, 1]]))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert adapter.label_counts.tolist() == [3, 1, 0, 0, 0, 0]


def test_reweighting_then_fgh_applies_the_product_of_both_factors():
    """The gradient the optimiser receives is alpha_c * w_c * g_c: DGR's weights from the
    accumulated raw row norms, FGH's class alpha from the product of consecutive reweighted
    gradients (weight row and bias entry together), gamma 10 so that alpha visibly moves."""
    gamma = 10.0
    config = {
        "optimizer": "sgd",
        "init_lr": 0.5,
        "logit_mask": "batch",
        "fgh": {
            "gamma": gamma,
            "granularity": "class",
            "direction": "grad",
            "apply": "grad",
            "clamp": [0.0, 10.0],
        },
    }
    torch.manual_seed(0)
    adapter = TinyDGR(args=config)
    network = adapter.build_network(config)
    loop = build_loop(adapter, network, config, C)
    counts, sums, previous = np.zeros(C), np.zeros(C), None
    for x, y in _batches(steps=2):
        before = copy.deepcopy(network)
        labels = y.numpy()
        counts += np.bincount(labels, minlength=C)
        g_w, g_b = _hand_fc_gradient(before, x, labels, counts)
        sums += np.linalg.norm(g_w, axis=1)
        active = sums > 0
        w = np.where(active, sums[active].min() / np.where(active, sums, 1), 1.0)
        reweighted = (w[:, None] * g_w, w * g_b)
        alpha = np.ones(C)
        if previous is not None:  # FGH's first step leaves alpha at 1
            h = (reweighted[0] * previous[0]).sum(1) + reweighted[1] * previous[1]
            alpha = np.clip(1 + gamma * h, 0.0, 10.0)
        loop.train_step(x, y)
        np.testing.assert_allclose(
            network.fc.weight.grad.numpy(), alpha[:, None] * reweighted[0], atol=1e-6
        )
        np.testing.assert_allclose(network.fc.bias.grad.numpy(), alpha * reweighted[1], atol=1e-6)
        np.testing.assert_allclose(adapter.grad_sums.numpy(), sums, rtol=1e-5)
        previous = reweighted
    # Both factors acted: otherwise the test could not tell the order or the product apart.
    assert w[active].min() < 0.9
    assert np.abs(alpha - 1).max() > 1e-3


def _loop(trigger: dict, steps: int = 3):
    config = {"optimizer": "adam", "init_lr": 1e-2, "logit_mask": "batch", **trigger}
    torch.manual_seed(0)
    adapter = TinyDGR(args=config)
    network = adapter.build_network(config)
    loop = build_loop(adapter, network, config, C)
    seen = []
    for x, y in _batches(steps=steps):
        loop.train_step(x, y)
        seen.append((adapter.resets, adapter.label_counts.tolist(), adapter.grad_sums > 0))
    return loop, adapter, seen


def test_consolidation_restarts_the_statistics_at_the_firing_only():
    """Batches of 4 with labels [0,0,1,2], [1,3,3,3], [0,4,4,1] under the batch mask: only a
    batch's classes get a gradient. Every 8 samples: the trigger fires before step 3, so step 3's
    statistics are its own alone, classes 0-3 are the old group and class 4 the new one."""
    loop, adapter, seen = _loop(
        {"consolidation": "every_n_samples", "consolidation_every_n_samples": 8}
    )
    assert loop.trigger.firings == [8]
    resets = [r for r, _, _ in seen]
    counts = [n for _, n, _ in seen]
    active = [np.flatnonzero(a.numpy()).tolist() for _, _, a in seen]
    assert resets == [0, 0, 1]
    assert counts == [[2, 1, 1, 0, 0, 0], [2, 2, 1, 3, 0, 0], [1, 1, 0, 0, 2, 0]]
    assert active == [[0, 1, 2], [0, 1, 2, 3], [0, 1, 4]]
    assert adapter.known.tolist() == [True, True, True, True, False, False]
    grad_sums = adapter.grad_sums.numpy()
    expected = _np_weights(grad_sums, adapter.known.numpy(), 1.0)
    np.testing.assert_allclose(adapter.weights.numpy()[[0, 1, 4]], expected[[0, 1, 4]])
    # Without a trigger the sums run over the whole stream, and there is no old group.
    never, adapter, seen = _loop({"consolidation": "never"})
    assert never.trigger.firings == [] and not adapter.known.any()
    assert [r for r, _, _ in seen] == [0, 0, 0]
    assert seen[2][1] == [3, 3, 1, 3, 2, 0]
    assert np.flatnonzero(seen[2][2].numpy()).tolist() == [0, 1, 2, 3, 4]


def test_checkpoint_keeps_the_statistics():
    _, adapter, _ = _loop({"consolidation": "every_n_samples", "consolidation_every_n_samples": 8})
    state = adapter.extra_state(None)
    fresh = TinyDGR()
    network = fresh.build_network({})
    fresh.load_extra_state(network, state)
    assert torch.equal(fresh.grad_sums, adapter.grad_sums)
    assert torch.equal(fresh.label_counts, adapter.label_counts)
    assert torch.equal(fresh.seen, adapter.seen) and torch.equal(fresh.known, adapter.known)
    # The reset count and the last step's weights, which the results file reports.
    assert adapter.resets == 1 and fresh.resets == 1
    assert adapter.weights.min() < 1 and torch.equal(fresh.weights, adapter.weights)
    assert fresh.report() == adapter.report()
    bad = {**state, "grad_sums": torch.zeros(C + 1, dtype=torch.float64)}
    with pytest.raises(ValueError, match="cover 7 classes"):
        TinyDGR().load_extra_state(TinyDGR().build_network({}), bad)


def test_recorded_gradient_norms_are_those_after_the_reweighting():
    """The loop's per-class gradient norms (the paper's imbalance statistics) measure what the
    optimiser receives: DGR's reweighted rows, ``||(w_c g_c, w_c b_c)||``, not the raw ones."""
    config = {"optimizer": "sgd", "init_lr": 0.5, "logit_mask": "batch"}
    torch.manual_seed(0)
    adapter = TinyDGR(args=config)
    network = adapter.build_network(config)
    loop = build_loop(adapter, network, config, C)
    (x, y), counts = _batches(steps=1)[0], np.zeros(C)
    counts += np.bincount(y.numpy(), minlength=C)
    g_w, g_b = _hand_fc_gradient(copy.deepcopy(network), x, y.numpy(), counts)
    raw = np.sqrt((g_w**2).sum(1) + g_b**2)  # weight row and bias entry
    grad_sums = np.linalg.norm(g_w, axis=1)  # DGR's G: the weight rows
    active = grad_sums > 0
    w = np.where(active, grad_sums[active].min() / np.where(active, grad_sums, 1), 1.0)
    loop.train_step(x, y)
    recorded = loop.gradient_statistics()["mean"]
    np.testing.assert_allclose(recorded, w * raw, rtol=1e-5, atol=1e-7)
    assert np.abs(recorded - raw).max() > 1e-3  # the reweighting acted


def test_memory_is_upstreams_size_and_replay_is_required():
    smoke = json.loads((ROOT / "exps" / "smoke_dgr_online.json").read_text())
    dropped = ("er_memory_size", "er_batch_size", "consolidation_new_classes")
    raw = {k: v for k, v in smoke.items() if k not in dropped}
    cfg = resolve_config(raw)
    assert cfg["er_memory_size"] == 2000  # exps/dgr.json memory_size; ER's rows keep 1000
    assert cfg["er_batch_size"] == 100  # as ER's rows
    assert cfg["consolidation"] == "new_classes" and cfg["consolidation_new_classes"] == 10
    assert cfg["gammar_r"] == 1.0  # exps/dgr.json
    with pytest.raises(ConfigError, match="er_memory_size must be > 0"):
        resolve_config({**raw, "er_memory_size": 0})


def test_replayed_labels_join_the_prior_and_the_stream_alone_counts_as_seen():
    """Upstream's label distribution is of the task's data plus its exemplars: online, the stream
    batch plus the replayed batch. Two steps of 4 stream samples, 2 replayed at step 2 (the
    reservoir is empty at step 1): 4 + (4 + 2) labels counted."""
    batches = _batches(steps=2)
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    config = {"optimizer": "adam", "init_lr": 1e-2, "er_memory_size": 8, "er_batch_size": 2}
    adapter = TinyDGR(args=config)
    loop = build_loop(adapter, adapter.build_network(config), config, C)
    loop.attach_samples(lambda idx: (xs[torch.as_tensor(idx)], ys[torch.as_tensor(idx)]))
    for step, (x, y) in enumerate(batches):
        loop.train_step(x, y, np.arange(4 * step, 4 * step + 4))
    assert adapter.label_counts.sum().item() == 10
    replayed = adapter.label_counts.numpy() - np.bincount(ys.numpy(), minlength=C)
    assert replayed.sum() == 2 and (replayed >= 0).all()
    assert np.isin(np.flatnonzero(replayed), ys[:4].numpy()).all()  # drawn from step 1's batch
    assert loop.samples_seen == 8

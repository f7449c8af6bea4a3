"""DGR online (``dgr_online``): logit adjustment, per-class gradient reweighting, its product with
FGH, the distillation and its head-gradient replacement (with + P), the consolidation's reset,
and its replay memory; checked against numpy on a tiny net."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyNet, classification_term
from torch import nn

from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.config import ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.methods.dgr import (
    DGROnline,
    class_weights,
    distillation_weight,
    kd_ratio,
)

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
    classification_term(adapter, network, out, torch.tensor([0, 0]), None)  # counts [2, 0, ...]
    loss = classification_term(adapter, network, out, torch.tensor([0, 1]), None)
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
    state = adapter.state_dict(None)
    fresh = TinyDGR()
    network = fresh.build_network({})
    fresh.load_state_dict(network, state)
    assert torch.equal(fresh.grad_sums, adapter.grad_sums)
    assert torch.equal(fresh.label_counts, adapter.label_counts)
    assert torch.equal(fresh.seen, adapter.seen) and torch.equal(fresh.known, adapter.known)
    # The reset count and the last step's weights, which the results file reports.
    assert adapter.resets == 1 and fresh.resets == 1
    assert adapter.weights.min() < 1 and torch.equal(fresh.weights, adapter.weights)
    assert fresh.report() == adapter.report()
    bad = {**state, "grad_sums": torch.zeros(C + 1, dtype=torch.float64)}
    with pytest.raises(ValueError, match="cover 7 classes"):
        TinyDGR().load_state_dict(TinyDGR().build_network({}), bad)


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
    assert cfg["er_memory"] == "herding" and cfg["er_memory_per_class"] is None  # upstream's
    assert cfg["er_batch_size"] == 100  # as ER's rows
    assert cfg["consolidation"] == "new_classes" and cfg["consolidation_new_classes"] == 10
    assert (cfg["gammar_r"], cfg["lambda"], cfg["T"]) == (1.0, 1.0, 2.0)  # exps/dgr.json
    assert (
        smoke["init_lr"] == method_card("dgr_online").default_lr == 5e-5
    )  # ER's Best HP, not Adam at 5e-3
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


def test_distillation_weight_counts_the_classes_seen_since_the_firing():
    """``lambda * known / (total - known)``, total the classes seen so far: 3 known and 5 seen
    give 3 / 2 (times lambda 2: 3); none new yet counts one (3 / 1)."""
    known = torch.tensor([True, True, True, False, False, False])
    seen = torch.tensor([True, True, True, True, True, False])
    assert distillation_weight(known, seen, 1.0).item() == pytest.approx(1.5)
    assert distillation_weight(known, seen, 2.0).item() == pytest.approx(3.0)
    assert distillation_weight(known, known, 1.0).item() == pytest.approx(3.0)


def test_kd_ratio_is_upstreams_and_zero_without_a_kd_gradient():
    """``||w * ||g_ce rows|| || / || ||g_kd rows|| ||``: weighted norms [3, 4] (norm 5) over KD
    rows of norms 1 and 0 give 5; a KD gradient of zero gives 0, not upstream's NaN."""
    weighted = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert kd_ratio(weighted, torch.tensor([[0.6, 0.8], [0.0, 0.0]])).item() == pytest.approx(5)
    assert kd_ratio(weighted, torch.zeros(2, 2)).item() == 0.0


def _features(network: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return torch.relu(network.body(x)).double().numpy()


def _head(network: nn.Module) -> tuple[np.ndarray, np.ndarray]:
    return network.fc.weight.detach().double().numpy(), network.fc.bias.detach().double().numpy()


def _ce_logit_gradient(z: np.ndarray, labels: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """d/dz of the logit-adjusted CE under the batch mask: (softmax - onehot) / B over the
    batch's classes, with log(prior) from ``counts``."""
    present = np.unique(labels)
    adjusted = z[:, present] + np.log(counts[present] / counts.sum())
    dz_present = _softmax(adjusted)
    dz_present[np.arange(len(labels)), np.searchsorted(present, labels)] -= 1
    dz = np.zeros_like(z)
    dz[:, present] = dz_present / len(labels)
    return dz


def _class_means(features: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The prototypes (class means of the stream features) and which classes have one."""
    sums, counts = np.zeros((C, features.shape[1])), np.zeros(C)
    np.add.at(sums, labels, features)
    np.add.at(counts, labels, 1)
    return sums / np.maximum(counts, 1)[:, None], counts > 0


def _prototype_head_gradient(
    means: np.ndarray, has_mean: np.ndarray, w: np.ndarray, b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """L_P's head gradient (paper Eq. 2): the CE of each seen class's prototype through the
    head, over the seen classes' logits, averaged over the seen prototypes."""
    seen = np.flatnonzero(has_mean)
    logits = (means @ w.T + b)[np.ix_(seen, seen)]
    dz_seen = _softmax(logits)
    dz_seen[np.arange(len(seen)), np.arange(len(seen))] -= 1
    dz = np.zeros((len(means), len(means)))
    dz[np.ix_(seen, seen)] = dz_seen / len(seen)
    return dz.T @ means, dz.sum(0)


def test_distillation_replaces_the_head_rows_and_reaches_the_backbone_with_prototypes():
    """Three steps of 4 (+ P, SGD, lambda 1, T 2): classes 0-2, then 1,3,3,0 (the
    ``new_classes`` trigger at 3 fires before it: the teacher is the network then, 0-2 known),
    then 0,4,4,1. Step 3's gradients, by hand in numpy from the networks before each step:

    - the head's: ``w * g + ratio_kd * g_kd`` with ``g`` the CE's plus L_P's head gradient (+ P
      is a classifier loss, which DGR's reweighting covers with the CE), ``w`` upstream's rule
      from ``G`` (step 2's and step 3's ``||g||`` rows), ``g_kd`` the KD loss's head gradient
      over the known classes and ``ratio_kd = ||w * ||g rows|| || / || ||g_kd rows|| ||``;
    - the body's: the plain gradient of CE + (1 * 3 / 2) * KD (L_P does not reach it)."""
    config = {
        "optimizer": "sgd",
        "init_lr": 0.5,
        "logit_mask": "batch",
        "consolidation": "new_classes",
        "consolidation_new_classes": 3,
        "online_prototypes": True,
        "lambda": 1.0,
        "T": 2.0,
    }
    torch.manual_seed(0)
    adapter = TinyDGR(args=config)
    network = adapter.build_network(config)
    loop = build_loop(adapter, network, config, C)
    gen = torch.Generator().manual_seed(1)
    steps = [[0, 0, 1, 2], [1, 3, 3, 0], [0, 4, 4, 1]]
    batches = [(torch.randn(4, 5, generator=gen), torch.tensor(y)) for y in steps]
    before = []
    for x, y in batches:
        before.append(copy.deepcopy(network))
        loop.train_step(x, y)
    assert loop.trigger.firings == [4] and adapter.distillation is None
    (x1, y1), (x2, y2), (x3, y3) = [(x, y.numpy()) for x, y in batches]
    net1, net2, net3 = before
    f1, f2, f3 = _features(net1, x1), _features(net2, x2), _features(net3, x3)

    # Step 2 (after the firing): G from the CE's and L_P's head gradient on net2; the
    # prototypes are the class means of the earlier steps' (pre-update) stream features.
    w2, b2 = _head(net2)
    counts2 = np.bincount(y2, minlength=C).astype(float)
    dz2 = _ce_logit_gradient(f2 @ w2.T + b2, y2, counts2)
    p_w2, _ = _prototype_head_gradient(*_class_means(f1, y1), w2, b2)
    grad_sums = np.linalg.norm(dz2.T @ f2 + p_w2, axis=1)
    # Step 3.
    w3, b3 = _head(net3)
    z3 = f3 @ w3.T + b3
    dz_ce = _ce_logit_gradient(z3, y3, counts2 + np.bincount(y3, minlength=C))
    p_w3, p_b3 = _prototype_head_gradient(
        *_class_means(np.concatenate([f1, f2]), np.concatenate([y1, y2])), w3, b3
    )
    g_w, g_b = dz_ce.T @ f3 + p_w3, dz_ce.sum(0) + p_b3
    norms = np.linalg.norm(g_w, axis=1)
    grad_sums += norms
    known = np.array([True, True, True, False, False, False])
    w = _np_weights(grad_sums, known, 1.0)
    teacher_w, teacher_b = _head(net2)
    t = _features(net2, x3) @ teacher_w.T + teacher_b
    student, soft = _softmax(z3[:, known] / 2.0), _softmax(t[:, known] / 2.0)
    dz_kd = np.zeros_like(z3)
    dz_kd[:, known] = (student - soft) / (2.0 * len(y3))
    kd_w, kd_b = dz_kd.T @ f3, dz_kd.sum(0)
    ratio = np.linalg.norm(w * norms) / np.linalg.norm(np.linalg.norm(kd_w, axis=1))
    # float32 against float64: 1e-6 absolute is 1e-5 of the gradient's scale (0.1), and the
    # float32 sums' order differs between CPUs' kernels (4e-7 seen on one machine).
    np.testing.assert_allclose(
        network.fc.weight.grad.numpy(), w[:, None] * g_w + ratio * kd_w, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        network.fc.bias.grad.numpy(), w * g_b + ratio * kd_b, rtol=1e-5, atol=1e-6
    )
    # The body: CE + 3/2 KD through the features (relu), nothing of L_P.
    df = ((dz_ce + 1.5 * dz_kd) @ w3) * (f3 > 0)
    x3n = x3.double().numpy()
    np.testing.assert_allclose(network.body.weight.grad.numpy(), df.T @ x3n, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(network.body.bias.grad.numpy(), df.sum(0), rtol=1e-5, atol=1e-7)
    # Each part acted: the KD term on the old rows, L_P in G, the weights below 1.
    assert np.linalg.norm(ratio * kd_w[known]) > 0.1 * np.linalg.norm(w[known, None] * g_w[known])
    assert np.abs(p_w3).max() > 1e-3 and w[w < 1].size


def test_a_skipped_step_leaves_no_distillation_behind():
    """A non-finite step after a firing is skipped before the gradient transform: the head
    gradients its ``loss_terms`` kept are dropped by the next step's, never applied, and
    training goes on finite."""
    config = {
        "optimizer": "sgd",
        "init_lr": 0.1,
        "logit_mask": "batch",
        "consolidation": "new_classes",
        "consolidation_new_classes": 3,
    }
    torch.manual_seed(0)
    adapter = TinyDGR(args=config)
    network = adapter.build_network(config)
    loop = build_loop(adapter, network, config, C)
    batches = _batches(steps=3)
    loop.train_step(*batches[0])
    loop.train_step(*batches[1])  # the firing: 0-2 known
    poisoned = batches[2][0].clone()
    poisoned[0, 0] = float("nan")
    stats = loop.train_step(poisoned, batches[2][1])
    assert stats.skipped and loop.skipped_nonfinite_steps == 1
    stale = adapter.distillation
    assert stale is not None and not torch.isfinite(stale.weight).all()
    used = []
    transform = adapter.after_backward

    def spy(net: nn.Module, autocast) -> dict:
        used.append(adapter.distillation)
        return transform(net, autocast)

    adapter.after_backward = spy
    stats = loop.train_step(*batches[2])
    assert not stats.skipped and used[0] is not stale and adapter.distillation is None
    assert torch.isfinite(used[0].weight).all()
    assert all(torch.isfinite(p).all() for p in network.parameters())

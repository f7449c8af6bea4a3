"""SLCA online: the loop's per-group learning rates (the slow learner), the online class
Gaussians, and classifier alignment as an evaluation view once a firing closed the first session
(upstream: backup, align, evaluate, recall). Tiny networks, no PILOT (the contract suite runs the
PILOT network; tests/test_upstream_slca.py compares with upstream's own code)."""

from __future__ import annotations

import copy
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet
from torch import nn

from pilot_online.core.class_stats import ClassGaussians, normalised_logits
from pilot_online.engine.adapter import ConfigKey, lr_scale, trained_parameters
from pilot_online.engine.loop import make_optimizer
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.methods.slca import SLCAOnline, mean_scales

C = 6


class SlowBody(TinyAdapter):
    """TinyNet with its body at a tenth of the head's learning rate."""

    lr_scales: ClassVar[dict[str, float | str]] = {"body.": 0.1}


def test_the_backbones_step_is_the_scale_times_the_heads():
    torch.manual_seed(0)
    loop = build_loop(SlowBody(), TinyNet(), {"optimizer": "sgd", "init_lr": 0.5}, C)
    assert [g["lr"] for g in loop.optimizer.param_groups] == [0.05, 0.5]
    before = {n: p.detach().clone() for n, p in loop.named_parameters}
    loop.train_step(torch.randn(8, 5), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]))
    # SGD's first step (momentum buffer = gradient): p <- p - lr * scale * grad.
    for name, p in loop.named_parameters:
        scale = 0.1 if name.startswith("body.") else 1.0
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.detach(), before[name] - 0.5 * scale * p.grad)


def test_one_scale_gives_one_group_and_bad_scales_are_refused():
    params = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    assert len(make_optimizer("adam", params, 1e-3, 0.0).param_groups) == 1
    assert len(make_optimizer("adam", [], 1e-3, 0.0).param_groups) == 1  # SimpleCIL: empty
    with pytest.raises(ValueError, match="requires_grad_"):
        make_optimizer("adam", params, 1e-3, 0.0, lr_scales=[1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="3 parameters"):
        make_optimizer("adam", params, 1e-3, 0.0, lr_scales=[1.0])


def test_groups_with_fgh_survive_a_checkpoint():
    config = {"optimizer": "adam", "init_lr": 0.01, "fgh": {"granularity": "element", "gamma": 0.1}}
    data = [(torch.randn(6, 5), torch.tensor([0, 1, 2, 0, 1, 2])) for _ in range(4)]
    torch.manual_seed(0)
    loop = build_loop(SlowBody(), TinyNet(), config, C)
    for x, y in data[:3]:
        loop.train_step(x, y)
    state = copy.deepcopy(loop.state_dict())
    torch.manual_seed(1)
    twin = build_loop(SlowBody(), TinyNet(), config, C)
    twin.load_state_dict(state)
    for each in (loop, twin):
        each.train_step(*data[3])
    for (name, p), (_, q) in zip(loop.named_parameters, twin.named_parameters):
        assert torch.equal(p, q), name
    assert [g["lr"] for g in twin.optimizer.param_groups] == [0.001, 0.01]


def test_class_gaussians_equal_numpy_mean_and_covariance():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(30, 4)) * [1.0, 2.0, 0.5, 3.0] + [5.0, -3.0, 10.0, 0.0]
    labels = np.array([0] * 13 + [2] * 16 + [3])
    order = rng.permutation(30)
    features, labels = features[order], labels[order]
    stats = ClassGaussians(4, 4)
    for session, part in enumerate(np.array_split(np.arange(30), 3)):
        stats.update(torch.tensor(features[part]).float(), torch.tensor(labels[part]), session)
    for c in (0, 2):
        rows = features[labels == c]
        np.testing.assert_allclose(stats.means[c].numpy(), rows.mean(0), rtol=0, atol=1e-5)
        want = np.cov(rows.T, ddof=1) + 1e-4 * np.eye(4)
        got = stats.covariances(torch.tensor([c]))[0].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # One sample: no spread, the ridge alone; class 1 never seen.
    np.testing.assert_allclose(stats.covariances(torch.tensor([3]))[0].numpy(), 1e-4 * np.eye(4))
    assert stats.seen().tolist() == [0, 2, 3]
    sessions = stats.session.tolist()
    assert sessions[1] == -1
    for c in (0, 2, 3):  # the part (session) holding the class's first sample
        position = int(np.flatnonzero(labels == c)[0])
        assert sessions[c] == position // 10


def test_mean_scales_and_logit_normalisation_by_hand():
    scales = mean_scales(torch.tensor([0, 1, 2]), firing=2)
    torch.testing.assert_close(scales, torch.tensor([0.9 + 0.1 / 3, 0.9 + 0.2 / 3, 1.0]).double())
    logits = torch.tensor([[3.0, 4.0, 1.0, 0.0]])
    blocks = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    # Block norms 5 and 1: mean 3; over the temperature 0.1: divide by 0.3.
    want = torch.tensor([[10.0, 40 / 3, 10 / 3, 0.0]])
    torch.testing.assert_close(normalised_logits(logits, blocks, 0.1), want, atol=1e-5, rtol=0)


class TinySLCA(SLCAOnline):
    """SLCA's adapter over a tiny network with ``backbone`` and ``fc`` (no PILOT)."""

    def build_network(self, args: dict) -> nn.Module:
        network = nn.Module()
        network.backbone = nn.Sequential(nn.Linear(5, 3), nn.Tanh())
        network.fc = nn.Linear(3, C)
        self._setup_state(args, 3)
        return network


ARGS = {
    "nb_classes": C,
    "bcb_lrscale": 0.01,
    "ca_epochs": 3,
    "ca_samples_per_class": 64,
    "ca_lr": 0.1,
    "ca_with_logit_norm": 0.1,
    "ca_weight_decay": 5e-4,
    "weight_decay": 0.0,
    "seed": [1993],
}


def test_the_view_aligns_a_copy_and_training_keeps_its_head_and_optimiser():
    """Upstream backs the head up, aligns, evaluates and recalls: the view is the aligned head,
    the training head and the loop's optimiser state of it are untouched, and a firing changes
    nothing trained."""
    adapter = TinySLCA(args=dict(ARGS))
    torch.manual_seed(0)
    loop = build_loop(adapter, adapter.build_network(adapter.args), {"optimizer": "adam"}, C)
    for _ in range(2):  # the loop's Adam now holds moments for the head
        loop.train_step(torch.randn(8, 5), torch.tensor([0, 1, 2, 3] * 2))
    head = loop.network.fc
    moments = {k: v.clone() for k, v in loop.optimizer.state[head.weight].items()}
    means = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    adapter.stats = ClassGaussians(C, 3)
    for c in range(3):  # class c in session c, tight around its mean
        adapter.stats.update(means[c] + 0.1 * torch.randn(20, 3), torch.full((20,), c), c)
    with torch.no_grad():
        head.weight.copy_(torch.eye(C, 3))
        head.bias.copy_(torch.tensor([0.0, 0.0, 10.0, 0, 0, 0]))  # everything reads class 2
    trained = head.weight.detach().clone(), head.bias.detach().clone()
    assert (head(means)[:, :3].argmax(1) == 2).all()
    assert list(adapter.consolidate(loop.network, 2).restarted) == []  # nothing restarted
    assert adapter.sessions_closed == 3
    assert torch.equal(head.weight, trained[0]) and torch.equal(head.bias, trained[1])
    view = adapter.evaluation(loop.network).view
    assert set(view) == {"fc.weight", "fc.bias"}
    aligned = torch.nn.functional.linear(means, view["fc.weight"], view["fc.bias"])
    assert aligned[:, :3].argmax(1).tolist() == [0, 1, 2]
    assert torch.equal(head.weight, trained[0]) and torch.equal(head.bias, trained[1])
    for key, value in loop.optimizer.state[head.weight].items():
        assert torch.equal(value, moments[key]), key
    # Unseen classes' rows are not aligned (upstream's head has none).
    assert torch.equal(view["fc.weight"][3:], trained[0][3:])
    assert torch.equal(view["fc.bias"][3:], trained[1][3:])
    # The view is a function of the training state: asked again, the same tensors.
    again = adapter.evaluation(loop.network).view
    assert all(torch.equal(view[k], again[k]) for k in view)


def test_the_view_aligns_once_the_first_session_is_closed(monkeypatch):
    """Upstream aligns from its second task on: no view before the first firing; after firing f
    the view aligns with the current session f (the newest session's means undecayed)."""
    adapter = TinySLCA(args=dict(ARGS))
    calls: list[int] = []
    monkeypatch.setattr(adapter, "align", lambda head, firing, samples=0: calls.append(firing))
    torch.manual_seed(0)
    network = adapter.build_network(adapter.args)
    config = {"optimizer": "adam", "consolidation": "new_classes", "consolidation_new_classes": 2}
    loop = build_loop(adapter, network, config, C)
    views = []
    for step in range(9):  # classes {0, 1}, then {2, 3}, then {4, 5}: three steps each
        first = 2 * (step // 3)
        loop.train_step(torch.randn(10, 5), torch.tensor([first] * 5 + [first + 1] * 5))
        views.append(adapter.evaluation(loop.network).view)
    assert loop.trigger.firings == [30, 60]
    assert calls == [1, 1, 1, 2, 2, 2]
    assert [len(v) for v in views] == [0, 0, 0, 2, 2, 2, 2, 2, 2]
    assert adapter.sessions_closed == 2
    # A class's session is the number of firings before its first sample.
    assert adapter.stats.session.tolist() == [0, 0, 1, 1, 2, 2]


def test_evaluations_change_nothing_trained():
    """The same stream with an evaluation after every step and without: identical weights and
    statistics (the view is derived under a forked RNG and never written back)."""
    data = [(torch.randn(8, 5), torch.tensor([s % 3, 3 + s % 3] * 4)) for s in range(6)]
    config = {"optimizer": "adam", "consolidation": "new_classes", "consolidation_new_classes": 2}
    runs = []
    for evaluate in (False, True):
        adapter = TinySLCA(args=dict(ARGS))
        torch.manual_seed(0)
        loop = build_loop(adapter, adapter.build_network(adapter.args), config, C)
        for x, y in data:
            loop.train_step(x, y)
            if evaluate:
                loop.predict([(x, y)], torch.ones(C, dtype=torch.bool), 1)
        runs.append((loop, adapter))
    (a, sa), (b, sb) = runs
    assert sa.sessions_closed == sb.sessions_closed == 2  # firings before steps 1 and 2
    for (name, p), (_, q) in zip(a.named_parameters, b.named_parameters):
        assert torch.equal(p, q), name
    for key, value in sa.stats.state_dict().items():
        assert torch.equal(value, sb.stats.state_dict()[key]), key


def test_on_a_20_task_cub_sized_stream_every_task_end_evaluation_is_aligned(monkeypatch):
    """20 clear tasks of 2 classes and about 47 samples (CUB's 470 at a tenth): the default
    trigger fires at every task boundary, so each task-end evaluation from the second task on
    aligns with the sessions as upstream's tasks (its t-th evaluation: session t)."""
    assert SLCAOnline.consolidation.trigger == "new_classes"
    classes = 40
    adapter = TinySLCA(args={**ARGS, "nb_classes": classes})
    calls: list[int] = []
    monkeypatch.setattr(adapter, "align", lambda head, firing, samples=0: calls.append(firing))
    torch.manual_seed(0)
    network = adapter.build_network(adapter.args)
    network.fc = nn.Linear(3, classes)
    config = {"optimizer": "adam", "consolidation": "new_classes", "consolidation_new_classes": 2}
    loop = build_loop(adapter, network, config, classes)
    for task in range(20):
        labels = torch.tensor([2 * task, 2 * task + 1]).repeat(24)[:47]
        for batch in labels.split(24):
            loop.train_step(torch.randn(len(batch), 5), batch)
        with loop.evaluation_view():  # the task-end evaluation
            pass
    assert len(loop.trigger.firings) == 19
    assert calls == list(range(1, 20))


def test_the_slow_learner_scales_backbone_parameters_only():
    adapter = TinySLCA(args=dict(ARGS))
    network = adapter.build_network(adapter.args)
    scales = {name: lr_scale(adapter, name) for name, _ in trained_parameters(network)}
    assert scales == {
        "backbone.0.weight": 0.01,
        "backbone.0.bias": 0.01,
        "fc.weight": 1.0,
        "fc.bias": 1.0,
    }


def test_state_bytes_count_a_float32_scatter_matrix_per_class():
    # 100 classes at D = 768: scatter 768 x 768, mean 768 (float32), count and session (8 bytes).
    want = 100 * (768 * 768 * 4 + 768 * 4 + 8 + 8)
    assert method_card("slca_online").memory_bytes({"nb_classes": 100}) == want
    assert 230e6 < want < 240e6  # the docs' 236 MB


def test_declared_lr_scales_take_the_longest_prefix_and_read_a_config_key():
    class Scaled(TinyAdapter):
        config_keys: ClassVar[dict[str, ConfigKey]] = {"slow": ConfigKey(0.01, "body factor")}
        lr_scales: ClassVar[dict[str, float | str]] = {"body.": "slow", "body.0.": 0.5}

    adapter = Scaled(args={"slow": 0.2})
    assert lr_scale(adapter, "body.0.weight") == 0.5  # the longer prefix wins
    assert lr_scale(adapter, "body.2.weight") == 0.2  # the config key's value, not its default
    assert lr_scale(adapter, "head.weight") == 1.0
    assert lr_scale(adapter, "bodyguard.weight") == 1.0  # a prefix of the name, not of a word


@pytest.mark.parametrize(
    "scales, message",
    [
        ({"body.": "missing"}, r"names 'missing', which is none of its config_keys"),
        ({"body.": 0.0}, r"is 0.0: a factor is a finite number > 0"),
        ({"body.": float("nan")}, r"is nan"),
        ({"body.": True}, r"is True"),
    ],
)
def test_a_bad_lr_scale_is_refused_when_the_class_is_defined(scales, message):
    with pytest.raises(TypeError, match=message):
        type("Bad", (TinyAdapter,), {"lr_scales": scales})


def test_the_retired_lr_scales_hook_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"lr_scales is a method; declare the factors instead"):

        class Hooked(TinyAdapter):
            def lr_scales(self, network):
                return {}

"""SLCA against upstream's own code: PILOT's ``models/slca.py``
(``Learner._stage2_compact_classifier``, the classifier alignment;
``Learner._compute_class_mean``, the class statistics) on the network classes of
``utils/inc_net.py`` (``SLCANet.forward``) and ``backbone/linears.py``
(``SimpleContinualLinear``, its ``backup``/``recall``), run on the same state as the port. One
``test_difference_<key>`` per entry of the card's ``upstream_differences``.

Upstream's methods run bound to a small object holding what they read (its ``Learner.__init__``
builds a ViT-B): the alignment needs no backbone (``fc_only``), the statistics only the feature
vectors."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from test_slca import ARGS, TinySLCA
from torch import nn

from pilot_online.core.class_stats import ClassGaussians
from pilot_online.core.rng import key_seed
from pilot_online.engine.mixins import build_loop
from pilot_online.methods.slca import SLCAOnline

D = 8  # feature width
SIZES = [2, 2]  # upstream's task sizes: classes 0-1 in task (session) 0, 2-3 in 1


def upstream(name: str, **fields) -> types.SimpleNamespace:
    """An object with the fields upstream's ``Learner.<name>`` reads, the method bound to it."""
    from models.slca import Learner

    learner = types.SimpleNamespace(_device="cpu", _multiple_gpus=["cpu"], **fields)
    setattr(learner, name, types.MethodType(getattr(Learner, name), learner))
    return learner


def class_features(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """30 features per class for 4 classes, each its own mean and spread, shuffled."""
    rng = np.random.default_rng(seed)
    x = np.concatenate(
        [
            rng.normal(size=(30, D)) * rng.uniform(0.3, 2.0, D) + rng.normal(0, 2, D)
            for _ in range(4)
        ]
    ).astype(np.float32)
    y = np.repeat(np.arange(4), 30)
    order = rng.permutation(len(y))
    return x[order], y[order]


def streamed(x: np.ndarray, y: np.ndarray, num_classes: int = 6) -> ClassGaussians:
    """Our running statistics of the features, in uneven batches; a class's session is its
    task (classes 0-1: 0, 2-3: 1)."""
    stats = ClassGaussians(num_classes, D)
    for part in np.array_split(np.arange(len(y)), 7):
        labels = torch.from_numpy(y[part])
        stats.update(torch.from_numpy(x[part]), labels)
    stats.session[:4] = torch.tensor([0, 0, 1, 1])
    return stats


def test_difference_running_class_statistics(pilot_on_path, monkeypatch):
    """Given the same feature vectors, our statistics merged batch by batch are upstream's
    ``_compute_class_mean`` (np.mean; torch.cov + 1e-4 I, kept in float32): the difference is
    only which features (the stream's, before each step's update) they are computed from."""
    import models.slca

    x, y = class_features()
    monkeypatch.setattr(models.slca, "DataLoader", lambda dataset, **kwargs: dataset)
    manager = types.SimpleNamespace(
        get_dataset=lambda classes, **kwargs: (None, None, x[y == int(classes[0])])
    )
    learner = upstream(
        "_compute_class_mean",
        _known_classes=0,
        _total_classes=4,
        feature_dim=D,
        batch_size=16,
        _extract_vectors=lambda vectors: (vectors, None),
    )
    learner._compute_class_mean(manager)
    stats = streamed(x, y)
    classes = torch.arange(4)
    np.testing.assert_allclose(
        stats.means[classes].numpy(), learner._class_means_slca, rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        stats.covariances(classes).float(), learner._class_covs_slca, rtol=1e-5, atol=1e-5
    )


class FcOnly(nn.Module):
    """What ``_stage2_compact_classifier`` calls: ``SLCANet.forward`` (``fc_only=True``) over
    upstream's ``SimpleContinualLinear`` head, one ``nn.Linear`` per task."""

    def __init__(self, head: nn.Linear) -> None:
        from backbone.linears import SimpleContinualLinear

        super().__init__()
        self.old_fc = None
        self.fc = SimpleContinualLinear(D, SIZES[0])
        for size in SIZES[1:]:
            self.fc.update(size)
        start = 0
        with torch.no_grad():
            for task, size in zip(self.fc.heads, SIZES):
                task[0].weight.copy_(head.weight[start : start + size])
                task[0].bias.copy_(head.bias[start : start + size])
                start += size

    def forward(self, x: torch.Tensor, bcb_no_grad: bool = False, fc_only: bool = False):
        from utils.inc_net import SLCANet

        return SLCANet.forward(self, x, bcb_no_grad=bcb_no_grad, fc_only=fc_only)

    def head(self) -> tuple[torch.Tensor, torch.Tensor]:
        weights = [task[0].weight.detach() for task in self.fc.heads]
        return torch.cat(weights), torch.cat([task[0].bias.detach() for task in self.fc.heads])


@pytest.mark.parametrize("weight_decay", [5e-4, 0.05])
def test_the_evaluation_view_is_upstreams_backup_align_recall(pilot_on_path, weight_decay):
    """Upstream at its second task's end: ``fc.backup()``, ``_stage2_compact_classifier`` (256
    features per class drawn from each Gaussian, shuffled, batches of 256, SGD with momentum
    and weight decay, cosine LR, logit normalisation over tasks), evaluate, ``fc.recall()``.
    Ours, after one firing: the view is upstream's aligned head (the same draws: its global
    generator seeded as our view's), and the training head is the recalled one. Six classes in
    our head, four seen: the two unseen rows (upstream has none) keep their values. At weight
    decay 0.05 an alignment that ignored it would be off by about 1e-2."""
    x, y = class_features(1)
    args = {
        **ARGS,
        "ca_epochs": 2,
        "ca_samples_per_class": 256,
        "ca_lr": 0.05,
        "ca_weight_decay": weight_decay,
        "weight_decay": 0.0,
    }
    adapter = TinySLCA(args=args)
    torch.manual_seed(0)
    network = adapter.build_network(args)
    network.fc = nn.Linear(D, 6)  # the features' width
    adapter.stats = streamed(x, y)
    adapter.sessions_closed = 1
    head = network.fc
    trained = head.weight.detach().clone(), head.bias.detach().clone()
    view = adapter.evaluation(network).view

    theirs = FcOnly(head)
    classes = torch.arange(4)
    learner = upstream(
        "_stage2_compact_classifier",
        _network=theirs,
        ca_epochs=args["ca_epochs"],
        _total_classes=4,
        _cur_task=1,
        lrate=args["ca_lr"],
        weight_decay=weight_decay,
        logit_norm=args["ca_with_logit_norm"],
        task_sizes=SIZES,
        _class_means_slca=adapter.stats.means[classes].double().numpy(),
        _class_covs_slca=adapter.stats.covariances(classes).float(),
        _compute_accuracy=lambda model, loader: 0.0,
        test_loader=None,
    )
    theirs.fc.backup()
    torch.manual_seed(key_seed(1993, 1, int(adapter.stats.counts.sum())))
    learner._stage2_compact_classifier(SIZES[-1])
    weight, bias = theirs.head()
    torch.testing.assert_close(view["fc.weight"][:4], weight, rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(view["fc.bias"][:4], bias, rtol=1e-4, atol=2e-6)
    assert (view["fc.weight"][:4] - trained[0][:4]).abs().max() > 1e-3  # alignment moved it
    assert torch.equal(view["fc.weight"][4:], trained[0][4:])
    theirs.fc.recall()
    weight, bias = theirs.head()
    assert torch.equal(head.weight.detach()[:4], weight) and torch.equal(head.bias[:4], bias)
    assert torch.equal(head.weight, trained[0]) and torch.equal(head.bias, trained[1])


def test_alignment_weight_decay_is_upstreams_not_the_online_optimisers():
    """Upstream aligns with its config's weight_decay, 5e-4 in exps/slca.json; the online
    paper configs train with weight decay 0, so CA has its own key, 5e-4."""
    assert SLCAOnline.config_keys["ca_weight_decay"].default == 5e-4
    assert SLCAOnline.config_keys["ca_lr"].default == 0.01  # upstream's lrate in slca.json


def test_difference_sessions_from_firings():
    """A clear stream of three 2-class tasks with a firing per task (the default trigger): each
    class's session is upstream's task id, class_id // task_size."""
    adapter = TinySLCA(args=dict(ARGS))
    torch.manual_seed(0)
    config = {"optimizer": "adam", "consolidation": "new_classes", "consolidation_new_classes": 2}
    loop = build_loop(adapter, adapter.build_network(adapter.args), config, 6)
    for task in range(3):
        for _ in range(2):
            loop.train_step(torch.randn(6, 5), torch.tensor([2 * task, 2 * task + 1] * 3))
    assert adapter.stats.session.tolist() == [c // 2 for c in range(6)]
    assert adapter.sessions_closed == 2


def test_difference_old_head_rows_keep_training(pilot_on_path):
    """Upstream's ``SimpleContinualLinear.update`` freezes every earlier task's head; ours keeps
    one head whose old rows still train when their class comes back (Si-Blurry)."""
    from backbone.linears import SimpleContinualLinear

    upstream_head = SimpleContinualLinear(D, 2)
    upstream_head.update(2)
    assert not any(p.requires_grad for p in upstream_head.heads[0].parameters())
    adapter = TinySLCA(args=dict(ARGS))
    torch.manual_seed(0)
    config = {"optimizer": "adam", "consolidation": "new_classes", "consolidation_new_classes": 2}
    loop = build_loop(adapter, adapter.build_network(adapter.args), config, 6)
    loop.train_step(torch.randn(6, 5), torch.tensor([0, 1] * 3))
    row = loop.network.fc.weight[0].detach().clone()
    loop.train_step(torch.randn(6, 5), torch.tensor([2, 3, 0] * 2))  # a firing, class 0 again
    assert adapter.sessions_closed == 1
    assert not torch.equal(loop.network.fc.weight[0], row)

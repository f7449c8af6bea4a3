"""``duct_online`` against upstream's own code (PILOT ``models/duct.py``; its head,
``backbone/linears.py``'s ``CosineLinear``; its task vectors, ``utils/toolkit.py``).

Upstream's ``Learner`` methods run unbound on small stand-ins of ``self`` (a linear "backbone" of
4 -> 6 and a 9-class head), on the same weights and class means as our adapter, and the numbers
are compared: the task-vector merge (``_stage1_merge_backbone`` with ``_calculate_adjust_ratio``)
and the head transport (``_stage2_transport_classifier``). Each declared difference
(the card's ``upstream_differences``) has its ``test_difference_<key>``.

Upstream imports POT (``ot``) at module level. POT is no runtime dependency of ours but is in the
``test`` extra: these tests claim upstream's code, POT's Sinkhorn included, so they fail without
it (``conftest.import_pot``) rather than stand in a Sinkhorn of their own.
"""

from __future__ import annotations

import types
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import import_pot, requires_pilot, unit_config
from torch import nn

from pilot_online.engine.mixins import build_loop
from pilot_online.methods.duct import DUCTOnline, sinkhorn

pytestmark = requires_pilot

NUM_CLASSES = 9
TASK = 3  # upstream's task_cl_inc: classes per task


@pytest.fixture(scope="module")
def upstream(pilot_on_path) -> types.ModuleType:
    """Upstream's ``models/duct.py``, which imports POT."""
    import_pot("upstream's models/duct.py imports POT (ot.sinkhorn in its head transport)")
    import models.duct

    return models.duct


class Net(nn.Module):
    """``SimpleVitNet``'s shape: ``backbone`` (here linear) and ``fc``; ``extract_vector``."""

    def __init__(self, fc: nn.Module) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 6)
        self.fc = fc

    def extract_vector(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)


def config(**overrides: Any) -> dict[str, Any]:
    defaults = {
        "consolidation": "new_classes",
        "consolidation_new_classes": TASK,
    }
    return unit_config(DUCTOnline, NUM_CLASSES, **{**defaults, **overrides})


def ours(**overrides: Any) -> tuple[DUCTOnline, Net]:
    """Our adapter on :class:`Net` with a linear head, its state fresh."""
    torch.manual_seed(0)
    cfg = config(**overrides)
    adapter = DUCTOnline(args=cfg)
    network = Net(nn.Linear(6, NUM_CLASSES))
    adapter.setup_state(network, cfg)
    return adapter, network


def upstream_self(upstream: types.ModuleType, network: nn.Module, **fields: Any) -> Any:
    """A stand-in for upstream's ``Learner`` ``self``: its fields, and its methods bound to it."""
    learner = SimpleNamespace(
        _network=network,
        _device="cpu",
        task_cl_inc=TASK,
        remove_keys=upstream.Learner.remove_keys,
        test_loader=None,
        _compute_accuracy=lambda *args: 0.0,
        **fields,
    )
    for name in ("_calculate_adjust_ratio", "_stage1_merge_backbone", "_cal_means_cur"):
        setattr(learner, name, types.MethodType(getattr(upstream.Learner, name), learner))
    return learner


def class_means(seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    """Nine class means, near enough (distances below 1) for POT's kernel at ``ot_reg`` 0.02."""
    return torch.randn(NUM_CLASSES, 6, generator=torch.Generator().manual_seed(seed)) * scale


def cosine_head(upstream: types.ModuleType, weight: torch.Tensor) -> nn.Module:
    from backbone.linears import CosineLinear

    head = CosineLinear(6, NUM_CLASSES)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head


def three_periods(adapter: DUCTOnline, means: torch.Tensor) -> None:
    """Our state after two firings (classes 0-2, then 3-5) and a period of classes 6-8."""
    adapter.means.update(means, torch.arange(NUM_CLASSES))
    for task in range(2):
        adapter.periods.observe(torch.arange(task * TASK, (task + 1) * TASK))
        adapter.periods.close(task)
    adapter.ratios = [1.0, 1.0]
    adapter.periods.observe(torch.arange(2 * TASK, NUM_CLASSES))


def upstream_transport(upstream: types.ModuleType, weight: torch.Tensor, means: torch.Tensor):
    """Upstream's ``_stage2_transport_classifier`` at its third task on a ``CosineLinear`` head
    holding ``weight``: the head's weight after it."""
    network = Net(cosine_head(upstream, weight))
    learner = upstream_self(
        upstream,
        network,
        _cur_task=2,
        _class_means=means.double().numpy(),
        args={"ot_reg": 0.02, "head_merge_ratio": 0.25},
    )
    upstream.Learner._stage2_transport_classifier(learner)
    return network.fc


# -- the head transport ---------------------------------------------------------------------------
def test_transport_directions_match_upstream(upstream):
    means = class_means()
    adapter, network = ours()
    weight = network.fc.weight.detach().clone()
    three_periods(adapter, means)
    adapter.consolidate(network, 2)
    assert adapter.transports == 2
    theirs = upstream_transport(upstream, weight, means)
    ours_rows = nn.functional.normalize(network.fc.weight.detach(), dim=1)
    their_rows = nn.functional.normalize(theirs.weight.detach(), dim=1)
    torch.testing.assert_close(ours_rows, their_rows, rtol=0, atol=1e-6)
    assert not torch.allclose(their_rows[:6], nn.functional.normalize(weight, dim=1)[:6])
    # Upstream's cosine logits of any input are the same through either head.
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    logits = theirs(x)["logits"]
    torch.testing.assert_close(cosine_head(upstream, network.fc.weight)(x)["logits"], logits)


def test_difference_linear_head_rows_keep_norms(upstream):
    means = class_means()
    adapter, network = ours()
    weight, bias = network.fc.weight.detach().clone(), network.fc.bias.detach().clone()
    three_periods(adapter, means)
    adapter.consolidate(network, 2)
    theirs = upstream_transport(upstream, weight, means).weight.detach()
    # Upstream's raw update shrinks each old row (its cosine head does not see it); ours keeps it.
    shrink = theirs[:6].norm(dim=1) / weight[:6].norm(dim=1)
    assert float(shrink.max()) < 0.8
    torch.testing.assert_close(network.fc.weight.detach().norm(dim=1), weight.norm(dim=1))
    torch.testing.assert_close(network.fc.bias.detach(), bias)  # upstream's head has no bias


def test_difference_groups_from_periods(upstream):
    # Class 2 (task 0 by upstream's ranges) comes back in the third period: ours carries rows
    # from it as a current class and leaves its row; upstream moves it with task 0's rows.
    means = class_means()
    adapter, network = ours()
    weight = network.fc.weight.detach().clone()
    three_periods(adapter, means)
    adapter.periods.observe(torch.tensor([2]))
    adapter.consolidate(network, 2)
    theirs = upstream_transport(upstream, weight, means).weight.detach()
    torch.testing.assert_close(network.fc.weight[2].detach(), weight[2], rtol=0, atol=0)
    assert not torch.allclose(theirs[2], weight[2])
    assert adapter.periods.group.tolist() == [0, 0, 2, 1, 1, 1, 2, 2, 2]


def test_difference_log_domain_sinkhorn():
    # Where POT's kernel is finite, its plan; where it underflows, a plan with the marginals.
    reg = 0.02
    cost = torch.cdist(class_means(1)[:3].double(), class_means(2)[:4].double())
    a = torch.full((3,), 1 / 3, dtype=torch.float64)
    b = torch.full((4,), 1 / 4, dtype=torch.float64)
    ot = import_pot("upstream's DUCT transports with POT's ot.sinkhorn, the reference here")
    reference = ot.sinkhorn(a, b, cost, reg)
    torch.testing.assert_close(sinkhorn(a, b, cost, reg), reference, rtol=0, atol=1e-9)
    far = cost * 100 + 16  # ViT-scale distances
    assert not torch.exp(far / -reg).any()  # POT's kernel: all zeros
    plan = sinkhorn(a, b, far, reg)
    torch.testing.assert_close(plan.sum(1), a, rtol=0, atol=1e-9)
    torch.testing.assert_close(plan.sum(0), b, rtol=0, atol=1e-9)


# -- the backbone merge -------------------------------------------------------------------------
def merge_setup(adapter: DUCTOnline, network: Net, anchored: torch.Tensor, trained: torch.Tensor):
    """One period of classes 0-2 whose class means under the anchor and the trained backbone
    are ``anchored`` and ``trained``."""
    labels = torch.arange(TASK)
    adapter.anchored.update(anchored, labels)
    adapter.trained.update(trained, labels)
    adapter.periods.observe(labels)


def upstream_merge(upstream, network, init_vector, merged_vector, anchored, trained, cur_task):
    """Upstream's ``_stage1_merge_backbone`` on ``network`` (its trained backbone), with the task's
    class means under the pre-trained (``anchored``) and trained backbone."""
    learner = upstream_self(
        upstream,
        network,
        _cur_task=cur_task,
        _known_classes=0,
        _total_classes=TASK,
        _class_means=anchored.double().numpy(),
        args={"merge_scalar": 0.25},
        model_init_vector=init_vector,
        model_merged_vector=merged_vector,
    )
    learner._cal_means_cur = lambda data_manager: trained.double().numpy()
    learner._stage1_merge_backbone(None)
    return learner


def test_merge_matches_upstream_first_task(upstream):
    from utils.toolkit import state_dict_to_vector

    adapter, network = ours()
    init = {k: v.clone() for k, v in network.state_dict().items()}
    with torch.no_grad():
        for p in network.backbone.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    g = torch.Generator().manual_seed(5)
    anchored, trained = torch.randn(TASK, 6, generator=g), torch.randn(TASK, 6, generator=g)
    theirs = Net(cosine_head(upstream, network.fc.weight))
    theirs.backbone.load_state_dict(network.backbone.state_dict())
    init_vector = state_dict_to_vector(
        {k: v for k, v in init.items() if k.startswith("backbone.")}, remove_keys=["fc."]
    )
    upstream_merge(
        upstream, theirs, init_vector, torch.zeros_like(init_vector), anchored, trained, 0
    )
    merge_setup(adapter, network, anchored, trained)
    adapter.consolidate(network, 0)
    for (name, p), q in zip(network.backbone.named_parameters(), theirs.backbone.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6, msg=name)
    assert not torch.allclose(network.backbone.weight, init["backbone.weight"])


def test_difference_task_vector_from_last_firing(upstream):
    # A second firing: ours merges from the anchor a1 (the first merge's result), upstream from
    # the pre-trained weights plus its sum of task vectors: on the same trained backbone b2,
    # upstream's result is ours plus c2 * (a1 - init), the first task vector scaled once more.
    from utils.toolkit import state_dict_to_vector, vector_to_state_dict

    adapter, network = ours()
    keys = ["fc."]
    init_vector = state_dict_to_vector(network.backbone.state_dict(), remove_keys=keys)
    g = torch.Generator().manual_seed(6)
    a1_vector = init_vector + torch.randn(init_vector.shape, generator=g)
    b2_vector = a1_vector + torch.randn(init_vector.shape, generator=g)
    means = [torch.randn(TASK, 6, generator=g) for _ in range(2)]
    reference = network.backbone.state_dict()
    network.backbone.load_state_dict(vector_to_state_dict(b2_vector, reference, keys))
    anchor = vector_to_state_dict(a1_vector, reference, keys)
    adapter.anchor = [anchor[name].clone() for name, _ in adapter._named]
    adapter.ratios = [1.0]
    merge_setup(adapter, network, *means)
    adapter.consolidate(network, 1)
    ours_vector = state_dict_to_vector(network.backbone.state_dict(), remove_keys=keys)

    def their_merge(init: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
        theirs = Net(nn.Identity())
        theirs.backbone.load_state_dict(vector_to_state_dict(b2_vector, reference, keys))
        upstream_merge(upstream, theirs, init, merged, *means, cur_task=1)
        return state_dict_to_vector(theirs.backbone.state_dict(), remove_keys=keys)

    # Upstream's merge with the anchor as its pre-trained weights is ours ...
    torch.testing.assert_close(ours_vector, their_merge(a1_vector, torch.zeros_like(a1_vector)))
    # ... and its own, from init with the first task vector in the sum, differs by c2 (a1 - init).
    upstream_vector = their_merge(init_vector, a1_vector - init_vector)
    c2 = 0.25 * adapter.ratios[-1]
    torch.testing.assert_close(upstream_vector - ours_vector, c2 * (a1_vector - init_vector))


def test_difference_no_head_retraining(upstream):
    # Upstream's task: train, merge, retrain the head (mode "retrain"), transport. Ours: a firing
    # with no older group leaves the head exactly as the stream trained it.
    calls: list[str] = []
    learner = SimpleNamespace(
        _cur_task=-1,
        _known_classes=0,
        batch_size=4,
        num_workers=0,
        model_init_state={},
        _device="cpu",
        _network=SimpleNamespace(update_fc=lambda n: None, to=lambda d: None),
        _compute_class_mean=lambda dm: None,
        _train=lambda train, test, mode="train": calls.append(mode),
        _stage1_merge_backbone=lambda dm: calls.append("merge"),
        _stage2_transport_classifier=lambda: calls.append("transport"),
    )
    learner._network.load_state_dict = lambda state, strict=True: None
    one_sample = [(0, torch.zeros(4), 0)]
    manager = SimpleNamespace(get_task_size=lambda t: TASK, get_dataset=lambda *a, **k: one_sample)
    upstream.Learner.incremental_train(learner, manager)
    assert calls == ["train", "merge", "retrain", "transport"]

    adapter, network = ours()
    head = {k: v.clone() for k, v in network.fc.state_dict().items()}
    merge_setup(adapter, network, torch.ones(TASK, 6), torch.ones(TASK, 6))
    adapter.consolidate(network, 0)
    for key, value in network.fc.state_dict().items():
        torch.testing.assert_close(value, head[key], rtol=0, atol=0)


def test_difference_class_means_from_training_features(upstream):
    # Two steps on class 0's batch with the backbone training: our transport's mean is that of
    # the two steps' features (each under the weights it trained); upstream's _cal_means_cur
    # passes the task's data through the final backbone.
    adapter, network = ours(init_lr=0.5, bcb_lr_scale=1.0)
    loop = build_loop(adapter, network, adapter.args, NUM_CLASSES)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
    y = torch.zeros(4, dtype=torch.long)
    features = []
    for _ in range(2):
        with torch.no_grad():
            features.append(network.backbone(x))
        loop.train_step(x, y)
    expected = torch.cat(features).mean(0)
    torch.testing.assert_close(adapter.means.means[0], expected)
    dataset = [(torch.tensor(i), x[i], 0) for i in range(4)]
    learner = upstream_self(
        upstream, network, _known_classes=0, _total_classes=1, batch_size=4, num_workers=0
    )
    learner._extract_vectors = types.MethodType(upstream.BaseLearner._extract_vectors, learner)
    theirs = learner._cal_means_cur(SimpleNamespace(get_dataset=lambda *a, **k: dataset))
    with torch.no_grad():
        final = network.backbone(x).mean(0)
    torch.testing.assert_close(torch.from_numpy(theirs[0]), final)
    assert not np.allclose(theirs[0], expected.double().numpy(), atol=1e-4)

"""``mos_online`` against upstream's own code (PILOT ``models/mos.py``'s ``Learner`` and
``backbone/vit_mos.py``'s ``VisionTransformer``).

Both sides run on one tiny ``vit_mos`` ViT (32 px, width 32, depth 3, two heads, bottleneck 4):
upstream's module as built, ours a deep copy given the online state by ``MOSOnline.equip``, with
the same adapter sets. Upstream's ``Learner`` methods run unbound on small stand-ins of ``self``.
Compared: one training step (``forward_features`` with ``train=True``, whose per-block
``reweight_adapter`` pulls every layer, the orthogonality term, ``get_optimizer``'s groups, and
``adapter_merge``); the statistics pass (``_compute_mean``: its statistics and where it leaves the
next task's adapter); the classifier alignment (``classifer_align``, its random draws replayed).
Each declared difference (the card's ``upstream_differences``) has its ``test_difference_<key>``.
"""

from __future__ import annotations

import copy
import math
from functools import partial
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import requires_pilot, smoke_config, stream_step
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from pilot_online.engine.adapter import TrainedStep, lr_scale, trained_parameters
from pilot_online.engine.loop import make_optimizer
from pilot_online.methods.mos import MOSOnline

pytestmark = requires_pilot

NUM_CLASSES, DEPTH, WIDTH, BOTTLENECK = 6, 3, 32, 4
STORED = 2  # adapter sets stored before the one in training (upstream's _cur_task)


def tiny_vit(momentum: float) -> nn.Module:
    """Upstream's ``vit_mos.VisionTransformer`` at toy size, its frozen weights random (its own
    init leaves the tokens and position embeddings at zero), frozen as ``Learner`` freezes it."""
    from backbone import vit_mos
    from easydict import EasyDict

    config = EasyDict(
        ffn_adapt=True,
        ffn_option="parallel",
        ffn_adapter_layernorm_option="none",
        ffn_adapter_init_option="lora",
        ffn_adapter_scalar="0.1",
        ffn_num=BOTTLENECK,
        d_model=WIDTH,
        _device="cpu",
        adapter_momentum=momentum,
        vpt_on=False,
        vpt_num=0,
    )
    torch.manual_seed(0)
    vit = vit_mos.VisionTransformer(
        img_size=32,
        patch_size=16,
        embed_dim=WIDTH,
        depth=DEPTH,
        num_heads=2,
        mlp_ratio=2,
        qkv_bias=True,
        num_classes=NUM_CLASSES,
        norm_layer=partial(nn.LayerNorm, eps=1e-6),
        tuning_config=config,
    )
    with torch.no_grad():
        vit.cls_token.normal_()
        vit.pos_embed.normal_(std=0.5)
    for name, p in vit.named_parameters():
        p.requires_grad = "adapter" in name or "head" in name
    return vit


def random_set(seed: int) -> list[torch.Tensor]:
    """Values for one adapter set (up_proj is zero at init: random here, so every term acts)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(BOTTLENECK, WIDTH), (BOTTLENECK,), (WIDTH, BOTTLENECK), (WIDTH,)] * DEPTH
    return [torch.randn(shape, generator=gen) * 0.5 for shape in shapes]


def assign(adapters: nn.Module, values: list[torch.Tensor]) -> None:
    """Set an adapter set's values as upstream does (``.data =``: no storage shared with the
    prefix sums, which alias the first stored set's storage)."""
    for p, v in zip(adapters.parameters(), values):
        p.data = v.clone()


def state(momentum: float = 0.1, stored: int = STORED, **overrides: Any):
    """(upstream's ViT with ``stored`` sets stored and the next in training, our adapter and
    network with the same sets, the values of each set)."""
    vit = tiny_vit(momentum)
    ours = nn.Module()
    ours.backbone = copy.deepcopy(vit)
    values = [random_set(seed) for seed in range(stored + 1)]
    for s in range(stored):
        assign(vit.cur_adapter, values[s])
        vit.adapter_update()
    assign(vit.cur_adapter, values[stored])
    config = smoke_config("mos_online", num_classes=NUM_CLASSES, **overrides)
    config.update(adapter_momentum=momentum, adapter_dropout=0.1)
    adapter = MOSOnline(args=config)
    adapter.equip(ours, config)
    adapter.load_state_dict(ours, {"sets": stored + 1, "alignments": 0})
    for s in range(stored + 1):
        assign(ours.backbone.adapter_list[s], values[s])
    return vit, adapter, ours, values


def learner_stub(**fields: Any) -> SimpleNamespace:
    """The attributes of upstream's ``Learner`` its methods below read."""
    base = {"_device": "cpu", "cls_mean": {}, "cls_cov": {}}
    return SimpleNamespace(**{**base, **fields})


IMAGES = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(3))
LABELS = torch.tensor([4, 5, 4, 5, 4, 5, 5, 4])


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# -- one training step -------------------------------------------------------------------------
def test_training_step_is_upstreams(pilot_on_path):
    """Upstream's step (``forward(adapter_id=2, train=True)``: a ``reweight_adapter`` of every
    layer before each of the 3 blocks; CE + ``orth_loss``; SGD with ``get_optimizer``'s groups;
    ``adapter_merge``) and ours (forward, the loop's optimiser with our ``lr_scale``,
    ``after_step``) on the same sets, batch and dropout draws give the same features, gradients
    and weights. The active set keeps (1 - m)^(D + 1) of its distance to the mean."""
    from models.mos import Learner

    vit, adapter, ours, _ = state()
    old_means = {c: torch.randn(WIDTH, generator=torch.Generator().manual_seed(c)) for c in (0, 1)}
    stub = learner_stub(
        cls_mean=old_means,
        args={"reg": 0.1, "optimizer": "sgd"},
        init_lr=0.05,
        weight_decay=5e-4,
    )
    for c, mean in old_means.items():
        ours.orth_means[c] = mean
        ours.orth_classes[c] = True

    vit.train()
    torch.manual_seed(7)  # the same adapter-dropout draws on both sides
    theirs = vit(IMAGES, adapter_id=STORED, train=True)
    loss = F.cross_entropy(theirs["logits"], LABELS)
    loss = loss + Learner.orth_loss(stub, theirs["pre_logits"], LABELS)
    optimizer = Learner.get_optimizer(stub, vit)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    vit.adapter_merge()

    adapter.set_mode(ours, train=True)
    torch.manual_seed(7)
    out = adapter.forward(ours, IMAGES, train=True)
    (F.cross_entropy(out.logits, LABELS) + out.aux_loss).backward()
    named = trained_parameters(ours)
    ours_optimizer = make_optimizer(
        "sgd",
        [p for _, p in named],
        lr=0.05,
        weight_decay=5e-4,
        lr_scales=[lr_scale(adapter, name) for name, _ in named],
    )
    ours_optimizer.step()
    adapter.after_step(ours, TrainedStep(IMAGES, LABELS, len(LABELS), {}))

    torch.testing.assert_close(out.features, theirs["features"], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.backbone.head.weight.grad, vit.head.weight.grad)
    active = list(ours.backbone.adapter_list[STORED].parameters())
    for p, q in zip(active, vit.cur_adapter.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    for p, q in zip(ours.backbone.head.parameters(), vit.head.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
    for s in range(STORED):  # the stored sets do not move
        for p, q in zip(
            ours.backbone.adapter_list[s].parameters(), vit.adapter_list[s].parameters()
        ):
            assert torch.equal(p.detach(), q.detach())
    # The head learns at 0.1 x (get_optimizer's second group), the adapters at 1 x.
    lrs = sorted(g["lr"] for g in optimizer.param_groups)
    assert sorted(g["lr"] for g in ours_optimizer.param_groups) == pytest.approx(lrs)
    assert lrs == pytest.approx([0.005, 0.05])


def test_merge_strength_is_upstreams_without_a_gradient(pilot_on_path):
    """With a zero learning rate, a step is the pulls alone: upstream's forward pulls 3 times and
    ``adapter_merge`` once, so the active set becomes 0.9^4 A + (1 - 0.9^4) mean(A0, A1), which
    ours matches (the former port: 0.9^2)."""
    vit, adapter, ours, values = state()
    vit(IMAGES, adapter_id=STORED, train=True)
    vit.adapter_merge()
    adapter.set_mode(ours, train=True)
    with torch.no_grad():
        adapter.forward(ours, IMAGES, train=True)
    adapter.after_step(ours, TrainedStep(IMAGES, LABELS, len(LABELS), {}))
    keep = 0.9 ** (DEPTH + 1)
    expected = [keep * a + (1 - keep) * (x + y) / 2 for a, x, y in zip(values[2], *values[:2])]
    got = [p.detach() for p in ours.backbone.adapter_list[STORED].parameters()]
    assert max_difference(got, [q.detach() for q in vit.cur_adapter.parameters()]) < 1e-6
    assert max_difference(got, expected) < 1e-6


# -- the statistics pass and the next task's start -------------------------------------------------
class ClassData:
    """Upstream's ``data_manager.get_dataset(..., ret_data=True)`` for one class at a time."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def get_dataset(self, indices, source, mode, ret_data=False):
        keep = torch.isin(self.labels, torch.as_tensor(indices))
        index = torch.nonzero(keep).flatten()
        dataset = torch.utils.data.TensorDataset(index, self.images[keep], self.labels[keep])
        return None, None, dataset


def upstream_statistics(vit: nn.Module, task: int, batch_size: int, classes=(4, 5)):
    """Upstream's ``_compute_mean`` for ``classes`` (the task's) on IMAGES, its loaders in
    process (its 4 workers change no number, only the test's time)."""
    import models.mos
    from models.mos import Learner

    stub = learner_stub(
        _known_classes=min(classes),
        _total_classes=max(classes) + 1,
        _cur_task=task,
        batch_size=batch_size,
        data_manager=ClassData(IMAGES, LABELS),
        args={"ca_storage_efficient_method": "covariance"},
    )

    def in_process(*args: Any, **kwargs: Any) -> DataLoader:
        return DataLoader(*args, **{**kwargs, "num_workers": 0})

    with mock.patch.object(models.mos, "DataLoader", in_process):
        Learner._compute_mean(stub, vit)
    return stub


def our_statistics(adapter: MOSOnline, ours: nn.Module) -> None:
    """Our statistics of IMAGES, one stream batch of 8, as the loop folds them in."""
    adapter.set_mode(ours, train=True)
    with torch.no_grad():
        out = adapter.forward(ours, IMAGES, train=True)
    adapter.after_step(ours, stream_step(out, LABELS, IMAGES))


@pytest.mark.parametrize("stored", [0, STORED])
def test_class_statistics_are_upstreams(pilot_on_path, stored):
    """Upstream's statistics (eval mode: no adapter dropout; with ``train=True``, pulling the
    adapter towards the earlier sets' mean) and ours agree: for the first set, its features; for a
    later one, at momentum 1 (the pull's limit from the first pull), the mean of the earlier sets.
    Means, and covariances + 1e-4 I."""
    vit, adapter, ours, _ = state(momentum=1.0, stored=stored)
    vit.adapter_update()  # the task ends: upstream stores its adapter first
    stub = upstream_statistics(vit, stored, batch_size=2)
    our_statistics(adapter, ours)
    classes = torch.tensor([4, 5])
    covariances = ours.class_stats.covariances(classes)
    for i, c in enumerate(classes.tolist()):
        torch.testing.assert_close(ours.class_stats.means[c], stub.cls_mean[c], atol=1e-5, rtol=0)
        torch.testing.assert_close(covariances[i].float(), stub.cls_cov[c], atol=1e-5, rtol=0)


def test_next_adapter_starts_where_upstreams_statistics_pass_leaves_it(pilot_on_path):
    """Upstream's ``_compute_mean`` after task 2 pulls the adapter D times per forward towards the
    mean of sets 0 and 1 (not 2): with 4 + 4 samples at batch 1 x 3, ceil(4 / 3) = 2 forwards per
    class, 4 forwards, 12 pulls. Our firing starts set 3 at the same values (set 2 stays as it
    was trained, upstream's stored copy)."""
    vit, adapter, ours, values = state(batch_size=1)
    vit.adapter_update()
    upstream_statistics(vit, STORED, batch_size=1)
    ours.class_slot_counts[4:, -1] = 4  # what set 2 saw of its classes
    assert adapter.statistics_pulls(ours) == DEPTH * 4
    adapter.consolidate(ours, 0)  # firing 0: no alignment
    sets = ours.backbone.adapter_list
    assert len(sets) == STORED + 2
    new = [p.detach() for p in sets[-1].parameters()]
    assert max_difference(new, [q.detach() for q in vit.cur_adapter.parameters()]) < 1e-6
    assert max_difference([p.detach() for p in sets[STORED].parameters()], values[STORED]) == 0
    keep = 0.9 ** (DEPTH * 4)
    expected = [keep * a + (1 - keep) * (x + y) / 2 for a, x, y in zip(values[2], *values[:2])]
    assert max_difference(new, expected) < 1e-6


# -- classifier alignment -------------------------------------------------------------------------
def test_alignment_is_upstreams_on_the_same_draws(pilot_on_path, monkeypatch):
    """``classifer_align`` (SGD with momentum 0.9 and weight decay, cosine LR per epoch, CE over
    every class so far, batches of ``batch_size x 5`` from a shuffle of the Gaussian draws) and
    our firing's alignment, given our draws (upstream's ``MultivariateNormal`` fed our standard
    normals, ``torch.randperm`` our orders), give the same head."""
    from models.mos import Learner

    vit, adapter, ours, _ = state(ca_epochs=3, ca_samples_per_class=5, ca_weight_decay=5e-4)
    gen = torch.Generator().manual_seed(11)
    features = (
        torch.randn(24, WIDTH, generator=gen)
        + 3 * torch.randn(6, WIDTH, generator=gen)[torch.arange(24) % 6]
    )
    ours.class_stats.update(features, torch.arange(24) % NUM_CLASSES)
    with torch.no_grad():
        ours.backbone.head.weight.normal_(generator=gen)
    vit.head.load_state_dict(ours.backbone.head.state_dict())

    normals, orders = [], []
    randn, randperm = torch.randn, torch.randperm

    def recording_randn(*args, **kwargs):
        normals.append(randn(*args, **kwargs))
        return normals[-1]

    def recording_randperm(*args, **kwargs):
        orders.append(randperm(*args, **kwargs))
        return orders[-1]

    monkeypatch.setattr(torch, "randn", recording_randn)
    monkeypatch.setattr(torch, "randperm", recording_randperm)
    adapter.consolidate(ours, 1)
    monkeypatch.undo()
    assert len(normals) == len(orders) == 3  # one draw and one shuffle per epoch

    classes = torch.arange(NUM_CLASSES)
    draws = iter(n[c] for n in normals for c in range(NUM_CLASSES))  # epoch, then class
    shuffles = iter(orders)
    from torch.distributions import multivariate_normal

    monkeypatch.setattr(multivariate_normal, "_standard_normal", lambda *a, **k: next(draws))
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: next(shuffles))
    stub = learner_stub(
        cls_mean={c: ours.class_stats.means[c].clone() for c in range(NUM_CLASSES)},
        cls_cov={c: cov for c, cov in enumerate(ours.class_stats.covariances(classes).float())},
        crct_epochs=3,
        ca_lr=adapter.args["ca_lr"],
        weight_decay=5e-4,
        batch_size=1,  # x 5 = ca_samples_per_class
        _total_classes=NUM_CLASSES,
        _cur_task=1,
        args={"ca_storage_efficient_method": "covariance"},
    )
    Learner.classifer_align(stub, vit)
    monkeypatch.undo()
    for p, q in zip(ours.backbone.head.parameters(), vit.head.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5)
    assert adapter.alignments == 1


# -- the declared differences ------------------------------------------------------------------
def test_difference_running_class_statistics(pilot_on_path):
    """Ours fold in each batch as it arrives, through set 0 as it trains: after a batch, a change
    of set 0 and a second batch, the statistics are those of the two batches' features as they
    were computed (eval mode), where upstream's pass after training would take both through the
    final set 0."""
    vit, adapter, ours, _ = state(stored=0)
    halves = (slice(0, 4), slice(4, 8))
    adapter.set_mode(ours, train=True)
    seen = []
    for half in halves:
        with torch.no_grad():
            out = adapter.forward(ours, IMAGES[half], train=True)
            ours.backbone.adapter_list[0][0].up_proj.weight.add_(0.5)  # a training step
        adapter.after_step(ours, stream_step(out, LABELS[half], IMAGES[half]))
        seen.append(out.extras["statistics_features"])
    vit.eval()
    with torch.no_grad():
        first = vit(IMAGES[halves[0]], adapter_id=0, train=True)["features"]
    torch.testing.assert_close(seen[0], first, rtol=0, atol=1e-5)  # eval mode, as upstream's
    features, labels = torch.cat(seen), LABELS
    for c in (4, 5):
        torch.testing.assert_close(ours.class_stats.means[c], features[labels == c].mean(0))
    assign(vit.cur_adapter, [p.detach() for p in ours.backbone.adapter_list[0].parameters()])
    vit.adapter_update()
    stub = upstream_statistics(vit, 0, batch_size=2)
    gap = max(float((ours.class_stats.means[c] - stub.cls_mean[c]).abs().max()) for c in (4, 5))
    assert gap > 1e-3


def test_difference_statistics_at_pull_limit(pilot_on_path):
    """At m = 0.1 upstream's first statistics forward sees the adapter pulled only 1, 2, 3 times
    per block (class 4 differs from ours); from an adapter already at the mean of the earlier
    sets (the pulls' limit) upstream's statistics are ours."""
    vit, adapter, ours, values = state()
    vit.adapter_update()
    stub = upstream_statistics(vit, STORED, batch_size=2)
    our_statistics(adapter, ours)
    assert float((ours.class_stats.means[4] - stub.cls_mean[4]).abs().max()) > 1e-3
    limit = [(x + y) / 2 for x, y in zip(*values[:2])]
    assign(vit.cur_adapter, limit)
    stub = upstream_statistics(vit, STORED, batch_size=2)
    for c in (4, 5):
        torch.testing.assert_close(ours.class_stats.means[c], stub.cls_mean[c], atol=1e-5, rtol=0)


def test_difference_evaluation_at_pull_limit(pilot_on_path):
    """Upstream's evaluation forward of stored set s (``train=False``) pulls it in place towards
    the mean of sets 0..s-1 at every batch: its first batch differs from our view's features,
    after 5 batches (at m = 0.7: 15 pulls, 0.3^15 ~ 1e-8 left) they agree. The view leaves our
    sets as trained."""
    vit, adapter, ours, _ = state(momentum=0.7)
    vit.adapter_update()  # set 2 stored: upstream evaluates sets 0, 1, 2
    view = adapter.evaluation(ours).view
    assert set(view) == {
        f"backbone.adapter_list.{s}.{name}"
        for s in (1, 2)
        for name, _ in ours.backbone.adapter_list[s].named_parameters()
    }  # no class seen yet: no head to align (test_mos.py checks the aligned head)
    trained = {n: p.detach().clone() for n, p in ours.named_parameters()}
    named = dict(ours.named_parameters())
    vit.eval()
    adapter.set_mode(ours, train=False)
    with torch.no_grad():
        saved = {name: named[name].data for name in view}
        for name, value in view.items():
            named[name].data = value
        viewed = [adapter.features(ours, IMAGES, s) for s in range(3)]
        for name, data in saved.items():
            named[name].data = data
        first = [vit(IMAGES, adapter_id=s, train=False)["features"] for s in range(3)]
        for _ in range(4):
            pulled = [vit(IMAGES, adapter_id=s, train=False)["features"] for s in (1, 2)]
        later = [first[0], *pulled]
    torch.testing.assert_close(first[0], viewed[0], rtol=0, atol=1e-5)  # set 0: no pull
    assert float((first[2] - viewed[2]).abs().max()) > 1e-3
    for s in range(3):
        torch.testing.assert_close(later[s], viewed[s], rtol=0, atol=1e-5)
    for name, p in ours.named_parameters():
        assert torch.equal(p.detach(), trained[name])


def test_difference_retrieval_by_majority_set(pilot_on_path):
    """Upstream retrieves a class through its task's adapter (``cls2task``, the task that brought
    it); ours through the set that saw most of its samples: class 4, first seen by set 0 (its
    task) but mostly by set 1, is retrieved through set 1; in a clear stream the two agree."""
    _, _, ours, _ = state(stored=1)
    counts = ours.class_slot_counts
    counts[4] = torch.tensor([2, 5])
    counts[0] = torch.tensor([3, 0])
    assert ours.class_slot_counts.argmax(1)[[0, 4]].tolist() == [0, 1]
    assert math.isclose(float(counts[4, 0]), 2)  # its "task" (first set) is 0

"""MOS online (``pilot_online/methods/mos.py``): its pieces against closed forms and upstream's
loops written out by hand, and its consolidation against upstream's task-end step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_network, raw_smoke_config, requires_pilot, smoke_config, stream_step
from torch import nn

from pilot_online import get_method
from pilot_online.core.class_stats import (
    COVARIANCE_RIDGE,
    ClassGaussians,
    align_classifier,
    sampling_factors,
)
from pilot_online.engine.config import ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.engine.session import ArrayDataSource
from pilot_online.methods.mos import orth_loss, pull, pull_term, self_refined


# -- the pure pieces -----------------------------------------------------------------------------
@pytest.mark.parametrize("diagonal", [False, True])
def test_class_statistics_equal_numpy_on_the_whole_stream(diagonal):
    """Chan's batch-by-batch merge gives np.mean and np.cov (ddof 1) + 1e-4 I of each class's
    stacked features; a class seen once gets the ridge alone (torch.cov would be NaN)."""
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(60, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=60)
    y[-1] = 3  # class 3: one sample
    stats = ClassGaussians(5, 5, diagonal)
    for batch in np.array_split(np.arange(59), 7):
        stats.update(torch.from_numpy(x[batch]), torch.from_numpy(y[batch]))
    stats.update(torch.from_numpy(x[-1:]), torch.from_numpy(y[-1:]))
    classes = torch.tensor([0, 1, 2, 3])
    covariances = stats.covariances(classes).numpy()
    for c in range(3):
        rows = x[y == c].astype(np.float64)
        expected = np.cov(rows.T, ddof=1) + COVARIANCE_RIDGE * np.eye(5)
        np.testing.assert_allclose(stats.means[c].numpy(), rows.mean(0), rtol=1e-5, atol=1e-5)
        got = covariances[c]
        np.testing.assert_allclose(got, np.diag(expected) if diagonal else expected, atol=1e-4)
    ridge = np.full(5, COVARIANCE_RIDGE) if diagonal else COVARIANCE_RIDGE * np.eye(5)
    np.testing.assert_allclose(covariances[3], ridge)
    assert stats.counts.tolist() == [int((y == c).sum()) for c in range(4)] + [0]


def test_sampling_factors_reproduce_the_covariance():
    a = torch.randn(3, 4, 4, dtype=torch.float64)
    sigma = a @ a.transpose(1, 2) + 0.1 * torch.eye(4, dtype=torch.float64)
    factors = sampling_factors(sigma).double()
    torch.testing.assert_close(factors @ factors.transpose(1, 2), sigma, rtol=1e-5, atol=1e-5)
    variances = torch.tensor([[4.0, 9.0]], dtype=torch.float64)
    assert sampling_factors(variances).tolist() == [[2.0, 3.0]]


def test_pull_is_upstreams_reweighting_by_hand():
    """One pull: ``(1 - m) p + m sum / n``: 1 -> 0.9 + 0.1 * 4 = 1.3 -> 0.9 * 1.3 + 0.4 = 1.57
    (two pulls), on a new tensor (a graph built before keeps the value it ran with)."""
    frozen = [nn.ParameterList([nn.Parameter(torch.tensor(v))]) for v in ([3.0, 0.0], [5.0, 2.0])]
    active = [nn.Parameter(torch.tensor([1.0, -2.0]))]
    before = active[0].data
    term = pull_term(frozen, 2, 0.1)
    pull(active, term, 0.1)
    assert before.tolist() == [1.0, -2.0]
    pull(active, term, 0.1)
    torch.testing.assert_close(active[0].data, torch.tensor([1.57, 0.81 * -2 + 0.19 * 1]))


def upstream_refine(slot_logits, start, class_slot, passes):
    """Upstream's while loop of ``_eval_cnn``, one sample at a time."""
    finals = []
    for b in range(slot_logits.shape[1]):
        prev, loops = int(start[b]), 0
        while True:
            loops += 1
            logits = slot_logits[prev, b]
            cur = int(class_slot[int(logits.argmax())])
            if loops >= passes or cur == prev:
                break
            prev = cur
        finals.append(logits)
    return torch.stack(finals)


def test_self_refined_retrieval_follows_upstreams_loop():
    class_slot = torch.tensor([0, 0, 1, 1])
    slot_logits = torch.zeros(2, 3, 4)
    slot_logits[0, 0, 2] = slot_logits[1, 0, 3] = 1  # slot 0 -> class 2 (slot 1) -> class 3: stays
    slot_logits[0, 1, 1] = 1  # slot 0 predicts its own class 1: stays at once
    slot_logits[0, 2, 2] = slot_logits[1, 2, 0] = 1  # 0 -> 1 -> 0 -> 1: cut after 4 passes
    final, slot = self_refined(slot_logits, torch.zeros(3, dtype=torch.long), class_slot, 4)
    assert slot.tolist() == [1, 0, 1]
    torch.testing.assert_close(final, slot_logits[[1, 0, 1], [0, 1, 2]])
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, 6, generator=gen)
    start, class_slot = torch.randint(0, 3, (50,), generator=gen), torch.tensor([0, 0, 1, 1, 2, 2])
    for passes in (1, 2, 4):
        final, _ = self_refined(logits, start, class_slot, passes)
        torch.testing.assert_close(final, upstream_refine(logits, start, class_slot, passes))


def log_softmax_ce(sim: np.ndarray) -> float:
    """Mean CE of each row of ``sim`` against its own index."""
    z = sim - sim.max(1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float(-np.diag(log_p).mean())


def test_orth_loss_is_upstreams_on_the_old_class_means_only():
    rng = np.random.default_rng(1)
    features, means = rng.normal(size=(4, 3)), rng.normal(size=(5, 3))
    old = np.array([True, False, True, False, False])
    rows = np.concatenate([means[old], features])
    expected = log_softmax_ce(rows @ rows.T / 0.8)
    got = orth_loss(torch.from_numpy(features), torch.from_numpy(means), torch.from_numpy(old))
    assert got.item() == pytest.approx(expected, rel=1e-10)
    none = torch.zeros(5, dtype=torch.bool)
    got = orth_loss(torch.from_numpy(features), torch.from_numpy(means), none)
    assert got.item() == pytest.approx(log_softmax_ce(features @ features.T / 0.8), rel=1e-10)


def test_alignment_fits_the_head_to_the_class_gaussians_and_is_seeded():
    """Three well-separated 2-D Gaussians, a head that starts at zero: after alignment it
    classifies each mean as its class; rows of classes not aligned get no CE gradient; the same
    seed gives the same head."""
    means = torch.tensor([[4.0, 0.0], [-4.0, 0.0], [0.0, 4.0]])
    factors = torch.eye(2).expand(3, 2, 2) * 0.5
    classes = torch.tensor([0, 2, 4])

    def aligned(seed: int) -> nn.Linear:
        head = nn.Linear(2, 5)
        nn.init.zeros_(head.weight), nn.init.zeros_(head.bias)
        align_classifier(
            head,
            classes,
            means,
            factors,
            epochs=5,
            lr=0.05,
            weight_decay=0.0,
            samples_per_class=32,
            generator=torch.Generator().manual_seed(seed),
        )
        return head

    head = aligned(0)
    with torch.no_grad():
        predicted = head(means)[:, classes].argmax(1)
    assert predicted.tolist() == [0, 1, 2]
    assert head.weight[[1, 3]].abs().max() == 0 and head.weight.grad is None
    torch.testing.assert_close(aligned(0).weight, head.weight, rtol=0, atol=0)
    assert not torch.equal(aligned(1).weight, head.weight)


def test_keys_are_checked():
    raw = raw_smoke_config("mos_online")
    with pytest.raises(ConfigError, match="ca_storage_efficient_method"):
        resolve_config({**raw, "ca_storage_efficient_method": "multi-centroid"})
    for value in (10, None):
        with pytest.raises(ConfigError, match=r"'mos_max_adapters' was removed.*without a cap.*"
                           "delete the key"):  # fmt: skip
            resolve_config({**raw, "mos_max_adapters": value})
    assert resolve_config(raw)["consolidation"] == "new_classes"


def test_imagenet_r_aligns_with_upstreams_weight_decay():
    """``exps/mos_inr.json`` has weight_decay 5e-3, which ``classifer_align`` uses."""
    card = method_card("mos_online")
    assert card.settings_for("imagenetr", "clear") == {"ca_weight_decay": 5e-3}
    assert card.settings_for("cifar224", "clear") == {}
    assert get_method("mos_online").config_keys["ca_weight_decay"].default == 5e-4


def test_state_bytes_counts_the_class_statistics():
    card = method_card("mos_online")
    assert card.memory_bytes({"nb_classes": 100}) == 4 * 100 * (768 * 768 + 3 * 768)
    variance = {"nb_classes": 100, "ca_storage_efficient_method": "variance"}
    assert card.memory_bytes(variance) == 4 * 100 * 4 * 768


# -- on PILOT's network (32 px, random weights) -------------------------------------------------
IMAGES = ArrayDataSource._to_tensor(
    np.random.default_rng(5).integers(0, 256, size=(16, 32, 32, 3), dtype=np.uint8)
)


@pytest.fixture(scope="module")
def mos(pilot_on_path):
    config = smoke_config("mos_online", num_classes=6)
    adapter = get_method("mos_online")(args=config)
    return adapter, build_network(adapter, config), config


def adapter_set(network, s):
    return [p.detach().clone() for p in network.backbone.adapter_list[s].parameters()]


@requires_pilot
def test_consolidation_is_upstreams_task_end_step(mos):
    """Firing 0: set 0 frozen, set 1 added as a copy of it (upstream's idx 0: no statistics
    pulls), the head untouched (upstream aligns from the second task on), the orthogonality
    snapshot taken. Firing 1: the head realigned; set 2 starts pulled 12 x 4 times (4 classes of
    2 samples, one statistics forward each) towards set 0, the mean of the sets before set 1."""
    adapter, network, _ = mos
    sets = network.backbone.adapter_list
    adapter.set_mode(network, train=True)
    assert sets[0].training and len(sets) == 1
    labels = torch.tensor([0, 1, 2, 3] * 2)
    out = adapter.forward(network, IMAGES[:8], train=True)
    adapter.after_step(network, stream_step(out, labels, IMAGES[:8]))
    with torch.no_grad():
        sets[0][0].up_proj.weight.add_(0.01)  # make set 0 distinguishable from a fresh init
    head = [p.detach().clone() for p in network.backbone.head.parameters()]
    assert list(adapter.consolidate(network, 0).restarted) == []  # new parameters, none restarted
    assert len(sets) == 2 and network.class_slot_counts.shape == (6, 2)
    for a, b in zip(adapter_set(network, 0), adapter_set(network, 1)):
        assert torch.equal(a, b)
    assert not any(p.requires_grad for p in sets[0].parameters())
    assert all(p.requires_grad for p in sets[1].parameters())
    for a, b in zip(head, network.backbone.head.parameters()):
        assert torch.equal(a, b)
    assert network.orth_classes.tolist() == [True] * 4 + [False] * 2
    adapter.set_mode(network, train=True)
    assert sets[1].training and not sets[0].training  # dropout in the active set only

    with torch.no_grad():
        for p in sets[1].parameters():
            p.add_(0.01)
    out = adapter.forward(network, IMAGES[8:16], train=True)
    for name in ("prototype_features", "statistics_features"):  # set 0, eval mode
        torch.testing.assert_close(out.extras[name], adapter.features(network, IMAGES[8:16], 0))
    adapter.after_step(network, stream_step(out, torch.tensor([2, 3, 4, 5] * 2), IMAGES[8:16]))
    assert network.class_slot_counts[:, 1].tolist() == [0, 0, 2, 2, 2, 2]
    assert adapter.statistics_pulls(network) == 12 * 4
    set0, set1 = adapter_set(network, 0), adapter_set(network, 1)
    assert list(adapter.consolidate(network, 1).restarted) == []
    assert adapter.alignments == 1 and len(sets) == 3
    keep = 0.9**48
    for p, a, b in zip(sets[2].parameters(), set1, set0):
        torch.testing.assert_close(p.detach(), keep * a + (1 - keep) * b, rtol=0, atol=1e-6)
    changed = [not torch.equal(a, b) for a, b in zip(head, network.backbone.head.parameters())]
    assert all(changed)
    assert adapter.report()["mos"] == {"adapter_sets": 3, "alignments": 1}


@requires_pilot
def test_retrieval_after_consolidation_does_not_depend_on_batching(mos):
    """With three sets in use (the test above), each sample's ensemble scores are the same
    alone (the first 4) and in one batch, and equal the hand-written retrieval."""
    adapter, network, config = mos
    assert len(network.backbone.adapter_list) == 3, "runs after the consolidation test"
    adapter.set_mode(network, train=False)
    with torch.no_grad():
        whole = adapter.forward(network, IMAGES, train=False).logits
        alone = [adapter.forward(network, x[None], train=False).logits for x in IMAGES[:4]]
        feats = torch.stack([adapter.features(network, IMAGES, s) for s in range(3)])
        seen = network.prototypes.counts > 0
        logits = network.backbone.head(feats).masked_fill(~seen, -torch.inf)
        protos = torch.nn.functional.normalize(network.prototypes.means, dim=1)
        cosine = torch.nn.functional.normalize(feats[0], dim=1) @ protos.T
        cosine = cosine.masked_fill(~seen, -torch.inf)
        class_slot = network.class_slot_counts.argmax(1)
        final = upstream_refine(logits, class_slot[cosine.argmax(1)], class_slot, 4)
        expected = final.softmax(1) + (cosine * 3).softmax(1)
    torch.testing.assert_close(torch.cat(alone), whole[:4], rtol=0, atol=1e-5)
    torch.testing.assert_close(whole, expected, rtol=0, atol=1e-6)
    assert config["ensemble"]


@requires_pilot
def test_evaluation_view_is_the_next_firings_alignment_and_the_pull_limit(mos):
    """After the tests above (3 sets, 6 classes seen): the view holds the head the next firing
    aligns (same seed, same state), and sets 1 and 2 as the means of the sets before them; deriving
    it changes no training value."""
    adapter, network, _ = mos
    assert len(network.backbone.adapter_list) == 3, "runs after the consolidation test"
    before = {n: t.detach().clone() for n, t in network.state_dict().items()}
    adapter.set_mode(network, train=False)
    with torch.no_grad():
        view = adapter.evaluation(network).view
    for name, tensor in network.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    sets = [adapter_set(network, s) for s in range(3)]
    names = [n for n, _ in network.backbone.adapter_list[0].named_parameters()]
    for i, name in enumerate(names):
        torch.testing.assert_close(view[f"backbone.adapter_list.1.{name}"], sets[0][i])
        mean = (sets[0][i] + sets[1][i]) / 2
        torch.testing.assert_close(view[f"backbone.adapter_list.2.{name}"], mean)
    assert not any(k.startswith("backbone.adapter_list.0.") for k in view)
    adapter.consolidate(network, 2)  # the next firing
    head = network.backbone.head
    torch.testing.assert_close(view["backbone.head.weight"], head.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(view["backbone.head.bias"], head.bias.detach(), rtol=0, atol=0)


@requires_pilot
def test_sets_are_unbounded_and_resume(pilot_on_path):
    """Every firing adds a set, past any former cap (12 firings: 13 sets); the loop adopts each
    new set (the head in a group at 0.1 x the LR) and a resume into a fresh network rebuilds them
    all from the checkpoint."""
    config = smoke_config("mos_online", num_classes=6, ca_epochs=0)
    adapter = get_method("mos_online")(args=config)
    loop = build_loop(adapter, build_network(adapter, config), config, 6)
    lrs = {g["lr_scale"]: g["lr"] for g in loop.optimizer.param_groups}
    assert lrs == pytest.approx({1.0: config["init_lr"], 0.1: 0.1 * config["init_lr"]})
    head = {id(p) for p in loop.network.backbone.head.parameters()}
    grouped = {g["lr_scale"]: {id(p) for p in g["params"]} for g in loop.optimizer.param_groups}
    assert grouped[0.1] == head
    for firing in range(12):
        loop.adapter.consolidate(loop.network, firing)
        loop._sync_parameters()
    sets = loop.network.backbone.adapter_list
    assert len(sets) == 13
    optimised = {id(p) for g in loop.optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in sets[12].parameters()} <= optimised
    with torch.no_grad():
        for s, group in enumerate(sets):
            for p in group.parameters():
                p.fill_(s / 10)
    state = loop.state_dict()
    fresh = get_method("mos_online")(args=config)
    resumed = build_loop(fresh, build_network(fresh, config), config, 6)
    resumed.load_state_dict(state)
    again = resumed.network.backbone.adapter_list
    assert len(again) == 13 and all(p.requires_grad for p in again[12].parameters())
    assert not any(p.requires_grad for p in again[11].parameters())
    for a, b in zip(sets.parameters(), again.parameters()):
        assert torch.equal(a, b)
    assert resumed.network.class_slot_counts.shape == (6, 13)
    with pytest.raises(ValueError, match="former port"):  # a checkpoint of the capped sets
        fresh.load_state_dict(resumed.network, {"active": 2, "alignments": 0})


@requires_pilot
def test_the_loop_consolidates_at_the_trigger_only(pilot_on_path):
    """In a loop, consolidate runs at each new_classes firing and never otherwise: with 2 new
    classes per firing, labels first seen at steps 0 (0, 1), 2 (2, 3) and 3 (4): firings before
    steps 2 and 3 (after 8 and 12 samples); the active set moves at those steps only."""
    config = smoke_config("mos_online", num_classes=6, consolidation_new_classes=2)
    adapter = get_method("mos_online")(args=config)
    loop = build_loop(adapter, build_network(adapter, config), config, 6)
    calls = []
    consolidate = adapter.consolidate
    adapter.consolidate = lambda network, firing: (
        calls.append(firing) or consolidate(network, firing)
    )
    steps = [[0, 1, 0, 1], [1, 0, 1, 0], [2, 3, 2, 3], [4, 0, 1, 2]]
    active = []
    for i, labels in enumerate(steps):
        loop.train_step(IMAGES[4 * i : 4 * i + 4], torch.tensor(labels))
        active.append(len(loop.network.backbone.adapter_list) - 1)
    assert calls == [0, 1] and loop.trigger.firings == [8, 12]
    assert active == [0, 0, 1, 2]

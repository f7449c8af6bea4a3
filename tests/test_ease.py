"""EASE online (``ease_online``): the prototype complement and the reweighted prediction against
hand-worked values and upstream's ``EaseCosineLinear.forward_reweight``; which firing opens which
subspace; the class means per subspace; and, on PILOT's network, that a firing freezes the active
adapter set and restarts the next set's and the head's optimiser state, and nothing else does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import build_network, raw_smoke_config, requires_pilot, smoke_config
from torch import nn

from pilot_online import get_method
from pilot_online.core.prototypes import PrototypeBank
from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.config import VARIANTS
from pilot_online.engine.loop import build_loop
from pilot_online.methods.ease import complemented_prototypes, reweighted_logits

E = math.e


# -- the prototype complement ----------------------------------------------------------------
def test_complement_mixes_the_donors_means_by_softmax_of_home_cosines() -> None:
    """Class 0 was learnt in subspace 0 and has no mean in subspace 1; classes 1 and 2 have both.
    In subspace 0 its cosines with them are 1 and 0, so its subspace-1 mean is
    (e * m1[1] + 1 * m1[2]) / (e + 1); class 3 was never seen and stays zero."""
    means = torch.zeros(2, 4, 2)
    means[0, 0], means[0, 1], means[0, 2] = (
        torch.tensor([2.0, 0]),
        torch.tensor([5.0, 0]),
        torch.tensor([0, 3.0]),
    )
    means[1, 1], means[1, 2] = torch.tensor([0, 1.0]), torch.tensor([3.0, 0])
    counts = torch.tensor([[4, 4, 4, 0], [0, 4, 4, 0]])
    home = torch.tensor([0, 1, 1, 0])
    out = complemented_prototypes(means, counts, home)
    expected = [3 / (E + 1), E / (E + 1)]
    np.testing.assert_allclose(out[1, 0].numpy(), expected, rtol=1e-6)
    torch.testing.assert_close(out[0], means[0])  # real means are kept
    torch.testing.assert_close(out[1, 1:], means[1, 1:])  # ... and unseen class 3 stays zero


def test_complement_reads_cosines_in_the_class_home_subspace() -> None:
    """Class 0 trained in subspace 1 (home 1) and is missing from subspace 2. In subspace 0 it
    looks like class 1, in its home like class 2: the home decides (weights e : 1 for class 2).
    Donors must have a mean in both the home and the target subspace (class 3 has none in 1)."""
    means = torch.zeros(3, 4, 2)
    means[0, 0], means[0, 1], means[0, 2] = (
        torch.tensor([1.0, 0]),
        torch.tensor([1.0, 0]),
        torch.tensor([0, 1.0]),
    )
    means[1, 0], means[1, 1], means[1, 2] = (
        torch.tensor([0, 1.0]),
        torch.tensor([1.0, 0]),
        torch.tensor([0, 2.0]),
    )
    means[2, 1], means[2, 2], means[2, 3] = (
        torch.tensor([1.0, 0]),
        torch.tensor([0, 1.0]),
        torch.tensor([0, 9.0]),
    )
    means[0, 3] = torch.tensor([0, 1.0])
    counts = torch.tensor([[3, 3, 3, 3], [3, 3, 3, 0], [0, 3, 3, 3]])
    home = torch.tensor([1, 0, 0, 2])
    out = complemented_prototypes(means, counts, home)
    np.testing.assert_allclose(out[2, 0].numpy(), [1 / (E + 1), E / (E + 1)], rtol=1e-6)
    # class 3 lacks subspace 1; its donors (home 2, target 1) are classes 1 and 2 with cosines
    # 0 and 1 with it in subspace 2: (1 * [1, 0] + e * [0, 2]) / (1 + e)
    np.testing.assert_allclose(out[1, 3].numpy(), [1 / (E + 1), 2 * E / (E + 1)], rtol=1e-6)


def test_complement_without_donors_leaves_zero() -> None:
    means = torch.zeros(2, 2, 3)
    means[0, 0], means[1, 1] = torch.ones(3), torch.ones(3)
    counts = torch.tensor([[2, 0], [0, 2]])
    out = complemented_prototypes(means, counts, torch.tensor([0, 1]))
    torch.testing.assert_close(out, means)
    assert torch.isfinite(out).all()


# -- the reweighted prediction ---------------------------------------------------------------
def test_reweighting_weighs_the_home_subspace_one_and_the_others_alpha_over_s_minus_1() -> None:
    features = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]], [[1.0, 0.0]]])  # [S=3, B=1, D=2]
    prototypes = torch.tensor(
        [
            [[1.0, 0.0], [1.0, 1.0]],  # cosines with (1, 0): 1, 1/sqrt(2)
            [[0.0, 1.0], [1.0, 0.0]],  # 0, 1
            [[-1.0, 0.0], [0.0, 1.0]],  # -1, 0
        ]
    )
    home = torch.tensor([0, 2])
    logits = reweighted_logits(features, prototypes, home, alpha=0.2)
    expected = [1 + 0.1 * 0 + 0.1 * -1, 0.1 / math.sqrt(2) + 0.1 * 1 + 1 * 0]
    np.testing.assert_allclose(logits[0].numpy(), expected, rtol=1e-6)
    single = reweighted_logits(features[:1], prototypes[:1], torch.tensor([0, 0]), alpha=0.2)
    np.testing.assert_allclose(single[0].numpy(), [1, 1 / math.sqrt(2)], rtol=1e-6)


@requires_pilot
def test_reweighting_equals_upstreams_forward_reweight(pilot_on_path) -> None:
    """PILOT's ``EaseCosineLinear.forward_reweight`` on the concatenated features and prototypes,
    with tasks of 2 classes (class c's home subspace is c // 2)."""
    from backbone.linears import EaseCosineLinear

    subspaces, classes, dim = 3, 6, 768
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(subspaces, 5, dim, generator=generator)
    prototypes = torch.randn(subspaces, classes, dim, generator=generator)
    head = EaseCosineLinear(subspaces * dim, classes)
    with torch.no_grad():
        head.weight.copy_(torch.cat(list(prototypes), dim=1))
    upstream = head.forward_reweight(
        torch.cat(list(features), dim=1), cur_task=subspaces - 1, alpha=0.1, init_cls=2, inc=2
    )["logits"]
    ours = reweighted_logits(features, prototypes, torch.arange(classes) // 2, alpha=0.1)
    torch.testing.assert_close(ours, upstream.detach(), rtol=1e-5, atol=1e-6)


# -- firings and class means on a stand-in network ---------------------------------------------
def stand_in(slots: int = 3, classes: int = 4, dim: int = 2) -> nn.Module:
    """What EaseOnline's consolidate, observe and prototype_logits touch: adapter sets, class
    means per subspace, the head and the active index."""
    network = nn.Module()
    network.subspaces = nn.ModuleList(nn.ModuleList([nn.Linear(dim, dim)]) for _ in range(slots))
    network.class_means = nn.ModuleList(PrototypeBank(classes, dim) for _ in range(slots))
    network.fc = nn.Linear(dim, classes)
    network.ease_active = 0
    return network


def adapter_for(**keys) -> object:
    adapter = get_method("ease_online")(args={"seed": 3, "alpha": 0.1, **keys})
    adapter.opened_at, adapter.ignored_firings = [], 0  # what build_network sets
    return adapter


def test_each_firing_opens_the_next_subspace_until_the_cap() -> None:
    """A firing freezes the active set, activates the next and restarts the head; it returns
    both sets' and the head's parameters (their optimiser state is dropped). With 3 sets the
    third firing is ignored."""
    adapter, network = adapter_for(), stand_in()
    head_before = network.fc.weight.detach().clone()
    restarted = list(adapter.consolidate(network, 0))
    assert network.ease_active == 1
    assert not any(p.requires_grad for p in network.subspaces[0].parameters())
    assert all(p.requires_grad for p in network.subspaces[1].parameters())
    expected = {*network.subspaces[0].parameters(), *network.subspaces[1].parameters()}
    assert set(restarted) == expected | set(network.fc.parameters())
    assert not torch.equal(network.fc.weight, head_before)  # a fresh head
    assert network.fc.weight.abs().max() <= 1 / math.sqrt(2)  # nn.Linear's init range
    adapter.consolidate(network, 1)
    assert network.ease_active == 2
    assert list(adapter.consolidate(network, 2)) == []  # at the cap
    assert network.ease_active == 2 and adapter.ignored_firings == 1
    assert adapter.report()["ease"]["opened_at_firings"] == [0, 1]
    assert adapter.report()["ease"]["subspaces"] == 3


def test_a_restarted_head_is_the_same_on_every_rerun() -> None:
    heads = []
    for _ in range(2):
        adapter, network = adapter_for(), stand_in()
        torch.manual_seed(len(heads))  # other draws between runs do not matter
        adapter.consolidate(network, 0)
        heads.append(network.fc.weight.detach().clone())
    torch.testing.assert_close(heads[0], heads[1])


def test_class_means_per_subspace_and_the_home_subspace() -> None:
    """Subspace 0 sees classes 0 and 1 (3 samples of class 1), then subspace 1 opens and sees
    class 1 (2 samples, through both subspaces) and class 2: class 1's home stays 0 (3 > 2),
    class 2's is 1. Prediction: class 2 has no mean in subspace 0, and its complement there is
    class 1's mean (the only donor: a mean in both subspaces)."""
    adapter, network = adapter_for(alpha=0.5), stand_in(slots=2, classes=4)

    def observe(active_features, labels, frozen=None):
        extras = {} if frozen is None else {"frozen": torch.tensor(frozen).unsqueeze(0)}
        out = StepOutput(torch.zeros(len(labels), 4), torch.tensor(active_features), extras=extras)
        adapter.observe(network, out, torch.tensor(labels))

    observe([[1.0, 0], [3.0, 0], [0, 1.0], [0, 2.0]], [0, 0, 1, 1])
    observe([[0, 3.0]], [1])
    adapter.consolidate(network, 0)
    observe([[2.0, 2.0], [1.0, 1.0], [-1.0, 0]], [1, 1, 2], frozen=[[0, 6.0], [0, 8.0], [4.0, 4.0]])
    means0, means1 = network.class_means[0].means, network.class_means[1].means
    np.testing.assert_allclose(means0[:3].numpy(), [[2, 0], [0, 4], [4, 4]])
    np.testing.assert_allclose(means1[:3].numpy(), [[0, 0], [1.5, 1.5], [-1, 0]])
    # Samples' features: (1, 0) in subspace 0, (0, 1) in subspace 1; weights 1 (home), 0.5.
    features = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    with torch.no_grad():
        logits = adapter.prototype_logits(network, features)[0]
    # Class 0 (home 0: cos 1) lacks subspace 1. Donors with means in 0 and 1: classes 1 and 2,
    # cosines 0 and 1/sqrt(2) with (2, 0) in subspace 0, so softmax weights w1, w2 on their
    # subspace-1 means (1.5, 1.5) and (-1, 0).
    w2 = E ** (1 / math.sqrt(2)) / (1 + E ** (1 / math.sqrt(2)))
    w1 = 1 - w2
    synthesised = np.array([1.5 * w1 - w2, 1.5 * w1])
    class0 = 1 + 0.5 * synthesised[1] / np.linalg.norm(synthesised)
    # Class 1 (home 0): cos((1,0), (0,4)) = 0, then 0.5 cos((0,1), (1.5,1.5)).
    # Class 2 (home 1: 1 of its samples there, none while 0 was active): 0.5 cos((1,0), (4,4))
    # and 1 * cos((0,1), (-1,0)) = 0.
    expected = [class0, 0.5 / math.sqrt(2), 0.5 / math.sqrt(2)]
    np.testing.assert_allclose(logits[:3].numpy(), expected, rtol=1e-6)
    head = torch.nn.functional.normalize(network.fc.weight[3].detach(), dim=0)
    np.testing.assert_allclose(float(logits[3]), float(head[1]), rtol=1e-6)  # unseen: the head


# -- on PILOT's network ------------------------------------------------------------------------
@requires_pilot
def test_a_firing_freezes_the_active_set_and_only_a_firing_does(pilot_on_path) -> None:
    """Smoke network (2 sets), new_classes every 2: step 0 shows classes 0 and 1, step 1 classes
    2 and 3 (the trigger fires before it: subspace 1 opens), step 2 old classes only. Set 1 does
    not change before the firing, set 0 not after it; the head's Adam state restarts there; the
    frozen set keeps counting its class means."""
    config = smoke_config(
        "ease_online",
        num_classes=4,
        consolidation="new_classes",
        consolidation_new_classes=2,
        **VARIANTS["fgh"],
    )
    adapter = get_method("ease_online")(args=config)
    network = build_network(adapter, config)
    loop = build_loop(adapter, network, config, 4)
    sets = [[p.detach().clone() for p in s.parameters()] for s in network.subspaces]

    def changed(index: int) -> bool:
        now = list(network.subspaces[index].parameters())
        return any(not torch.equal(a, b) for a, b in zip(sets[index], now))

    def snapshot() -> None:
        sets[:] = [[p.detach().clone() for p in s.parameters()] for s in network.subspaces]

    images = torch.rand(3, 4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    loop.train_step(images[0], torch.tensor([0, 1, 0, 1]))
    assert network.ease_active == 0 and loop.trigger.firings == []
    assert changed(0) and not changed(1)
    snapshot()
    loop.train_step(images[1], torch.tensor([2, 3, 2, 3]))
    assert network.ease_active == 1 and loop.trigger.firings == [4]
    assert not changed(0) and changed(1)
    assert int(loop.optimizer.state[network.fc.weight]["step"]) == 1  # restarted at the firing
    assert not any(p in loop.optimizer.state for p in network.subspaces[0].parameters())
    snapshot()
    loop.train_step(images[2], torch.tensor([0, 2, 0, 2]))
    assert loop.trigger.firings == [4] and network.ease_active == 1
    assert not changed(0) and changed(1)
    assert not any(p.requires_grad for p in network.subspaces[0].parameters())
    np.testing.assert_array_equal(network.class_means[0].counts.numpy(), [4, 2, 4, 2])
    np.testing.assert_array_equal(network.class_means[1].counts.numpy(), [2, 0, 4, 2])
    report = loop.report()["method"]["ease"]
    assert report == {
        "subspaces": 2,
        "adapter_num": 2,
        "opened_at_firings": [0],
        "ignored_firings": 0,
    }


def test_keys_are_checked() -> None:
    from pilot_online.engine.config import ConfigError, resolve_config

    for key, value in (("adapter_num", 0), ("alpha", -0.1), ("adapter_dropout", 1.5)):
        with pytest.raises(ConfigError, match=key):
            resolve_config({**raw_smoke_config("ease_online"), key: value})

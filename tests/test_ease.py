"""EASE online (``ease_online``): the prototype complement and the reweighted prediction against
hand-worked values and upstream's ``EaseCosineLinear.forward_reweight``; which firing opens which
subspace; the class means per subspace; and, on PILOT's network, that a firing freezes the active
adapter set and restarts the next set's and the head's optimiser state, and nothing else does.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import build_network, raw_smoke_config, requires_pilot, smoke_config, stream_step
from torch import nn

from pilot_online import get_method
from pilot_online.core.cosine_head import attach_cosine_head
from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.config import VARIANTS
from pilot_online.engine.mixins import build_loop
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
class StandInBackbone(nn.Module):
    """What EaseOnline's subspace bookkeeping reads of PILOT's vit_ease backbone: a current
    adapter set that ``get_new_adapter`` replaces with a fresh one, and a device."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.get_new_adapter()

    def get_new_adapter(self) -> None:
        self.cur_adapter = nn.ModuleList([nn.Linear(self.dim, self.dim)])


def stand_in(adapter, classes: int = 4, dim: int = 2) -> nn.Module:
    """What EaseOnline's consolidate, observe and prototype_logits touch: the backbone's adapter
    sets as subspaces, class means per subspace and the cosine proxy head."""
    network = nn.Module()
    network.backbone, network.out_dim = StandInBackbone(dim), dim
    network.subspaces, network.class_means = nn.ModuleList(), nn.ModuleList()
    adapter._open_subspace(network, firing=None)
    attach_cosine_head(network, dim, classes)
    adapter.opened_at = []  # what build_network sets
    return network


def adapter_for(**keys) -> object:
    args = {"seed": 3, "alpha": 0.1, "nb_classes": 4, "adapter_dropout": 0.0, **keys}
    return get_method("ease_online")(args=args)


def test_each_firing_adds_a_subspace_without_a_cap() -> None:
    """A firing freezes the active set, adds a fresh one and restarts the head (rows and sigma);
    it returns the frozen set's and the head's parameters (their optimiser state is dropped).
    Twelve firings open twelve subspaces: no cap."""
    adapter = adapter_for()
    network = stand_in(adapter)
    with torch.no_grad():
        network.fc_sigma.fill_(3.0)
    head_before = network.fc.weight.detach().clone()
    first = network.subspaces[0]
    restarted = list(adapter.consolidate(network, 0).restarted)
    assert len(network.subspaces) == 2 and len(network.class_means) == 2
    assert not any(p.requires_grad for p in first.parameters())
    assert all(p.requires_grad for p in network.subspaces[1].parameters())
    assert set(restarted) == {*first.parameters(), network.fc.weight, network.fc_sigma}
    assert not torch.equal(network.fc.weight, head_before)  # a fresh head
    assert network.fc.weight.abs().max() <= 1 / math.sqrt(2)  # upstream's init range
    assert float(network.fc_sigma.detach()) == 1.0
    for firing in range(1, 12):
        adapter.consolidate(network, firing)
    assert len(network.subspaces) == 13
    assert adapter.report()["ease"] == {"subspaces": 13, "opened_at_firings": list(range(12))}


def test_a_restarted_head_and_a_new_subspace_are_the_same_on_every_rerun() -> None:
    heads, sets = [], []
    for _ in range(2):
        adapter = adapter_for()
        network = stand_in(adapter)
        torch.manual_seed(len(heads))  # other draws between runs do not matter
        adapter.consolidate(network, 0)
        heads.append(network.fc.weight.detach().clone())
        sets.append(network.subspaces[1][0].weight.detach().clone())
    torch.testing.assert_close(heads[0], heads[1])
    torch.testing.assert_close(sets[0], sets[1])


def test_a_resume_rebuilds_the_subspaces_from_the_count() -> None:
    """load_state_dict re-creates the subspaces the firings added (values load afterwards),
    the older ones frozen."""
    adapter = adapter_for()
    network = stand_in(adapter)
    for firing in range(3):
        adapter.consolidate(network, firing)
    state = adapter.state_dict(network)
    fresh_adapter = adapter_for()
    fresh = stand_in(fresh_adapter)
    fresh_adapter.load_state_dict(fresh, state)
    assert len(fresh.subspaces) == 4 and len(fresh.class_means) == 4
    assert [any(p.requires_grad for p in s.parameters()) for s in fresh.subspaces] == [
        False,
        False,
        False,
        True,
    ]
    assert set(dict(fresh.named_parameters())) == set(dict(network.named_parameters()))


def test_class_means_per_subspace_and_the_home_subspace() -> None:
    """Subspace 0 sees classes 0 and 1 (3 samples of class 1), then subspace 1 opens and sees
    class 1 (2 samples, through both subspaces) and class 2: class 1's home stays 0 (3 > 2),
    class 2's is 1. Prediction: class 2 has no mean in subspace 0, and its complement there is
    class 1's mean (the only donor: a mean in both subspaces)."""
    adapter = adapter_for(alpha=0.5)
    network = stand_in(adapter, classes=4)

    def observe(active_features, labels, frozen=None):
        extras = {} if frozen is None else {"frozen": torch.tensor(frozen).unsqueeze(0)}
        out = StepOutput(torch.zeros(len(labels), 4), torch.tensor(active_features), extras=extras)
        adapter.after_step(network, stream_step(out, torch.tensor(labels)))

    observe([[1.0, 0], [3.0, 0], [0, 1.0], [0, 2.0]], [0, 0, 1, 1])
    observe([[0, 3.0]], [1])
    adapter.consolidate(network, 0)  # subspace 1 opens
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
def test_a_firing_adds_a_trained_subspace_and_freezes_the_old(pilot_on_path) -> None:
    """Smoke network, new_classes every 2: step 0 shows classes 0 and 1, step 1 classes 2 and 3
    (the trigger fires before it: subspace 1 is added and the loop adopts it), step 2 old classes
    only. Set 0 does not change after the firing, set 1 trains from its first step; the head's
    Adam state restarts there; the frozen set keeps counting its class means."""
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
    assert len(network.subspaces) == 1

    def snapshot() -> list[list[torch.Tensor]]:
        return [[p.detach().clone() for p in s.parameters()] for s in network.subspaces]

    def changed(before: list[list[torch.Tensor]], index: int) -> bool:
        now = list(network.subspaces[index].parameters())
        return any(not torch.equal(a, b) for a, b in zip(before[index], now))

    images = torch.rand(3, 4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    before = snapshot()
    loop.train_step(images[0], torch.tensor([0, 1, 0, 1]))
    assert len(network.subspaces) == 1 and loop.trigger.firings == []
    assert changed(before, 0)
    before = snapshot()
    loop.train_step(images[1], torch.tensor([2, 3, 2, 3]))
    assert len(network.subspaces) == 2 and loop.trigger.firings == [4]
    assert not changed(before, 0)
    adopted = {id(p) for _, p in loop.named_parameters}
    assert all(id(p) in adopted for p in network.subspaces[1].parameters())
    assert int(loop.optimizer.state[network.fc.weight]["step"]) == 1  # restarted at the firing
    assert not any(p in loop.optimizer.state for p in network.subspaces[0].parameters())
    # Its up-projections start at zero (LoRA init): its first step moves them.
    assert any(p in loop.optimizer.state for p in network.subspaces[1].parameters())
    before = snapshot()
    loop.train_step(images[2], torch.tensor([0, 2, 0, 2]))
    assert loop.trigger.firings == [4] and len(network.subspaces) == 2
    assert not changed(before, 0) and changed(before, 1)
    assert not any(p.requires_grad for p in network.subspaces[0].parameters())
    np.testing.assert_array_equal(network.class_means[0].counts.numpy(), [4, 2, 4, 2])
    np.testing.assert_array_equal(network.class_means[1].counts.numpy(), [2, 0, 4, 2])
    assert loop.report()["method"]["ease"] == {"subspaces": 2, "opened_at_firings": [0]}


@requires_pilot
def test_a_checkpoint_after_firings_resumes_with_the_added_subspaces(pilot_on_path) -> None:
    """+ P + FGH on a tiny vit_ease, a firing every 4 samples: after 3 steps (2 subspaces added),
    a loop rebuilt on a fresh network from the checkpoint re-creates the subspaces, adopts them
    and takes the next step exactly as the original."""
    from test_upstream_ease import WIDTH, tiny_vit

    config = smoke_config(
        "ease_online",
        num_classes=4,
        consolidation="every_n_samples",
        consolidation_every_n_samples=4,
        **VARIANTS["fgh"],
    )

    def fresh() -> tuple[object, object]:
        adapter = get_method("ease_online")(args=config)
        network = nn.Module()
        vit = tiny_vit()
        vit.adapter_list = []  # the build's one set, as EaseNet's backbone
        vit.requires_grad_(False)  # build_network freezes PILOT's network
        network.backbone, network.out_dim = vit, WIDTH
        network.subspaces, network.class_means = nn.ModuleList(), nn.ModuleList()
        adapter._open_subspace(network, firing=None)
        attach_cosine_head(network, WIDTH, 4)
        adapter.opened_at = []
        return adapter, build_loop(adapter, network, config, 4)

    images = torch.randn(5, 4, 3, 32, 32, generator=torch.Generator().manual_seed(30))
    labels = torch.tensor([[0, 1, 0, 1], [2, 3, 2, 3], [0, 2, 1, 3], [1, 1, 2, 2], [3, 0, 3, 0]])
    _, loop = fresh()
    for step in range(3):
        loop.train_step(images[step], labels[step])
    assert len(loop.network.subspaces) == 3 and loop.trigger.firings == [4, 8]
    state = copy.deepcopy(loop.state_dict())  # as a checkpoint file: no tensor shared
    resumed_adapter, resumed = fresh()
    resumed.load_state_dict(state)
    assert len(resumed.network.subspaces) == 3 and resumed_adapter.opened_at == [0, 1]
    assert [n for n, _ in resumed.named_parameters] == [n for n, _ in loop.named_parameters]
    for step in (3, 4):  # each fires: a subspace added on both
        ours = loop.train_step(images[step], labels[step])
        theirs = resumed.train_step(images[step], labels[step])
        torch.testing.assert_close(theirs.loss, ours.loss, rtol=1e-6, atol=1e-7)
    assert len(resumed.network.subspaces) == 5
    expected = loop.network.state_dict()
    for key, value in resumed.network.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-7, msg=key)


def test_keys_are_checked() -> None:
    from pilot_online.engine.config import ConfigError, resolve_config

    for key, value in (("alpha", -0.1), ("adapter_dropout", 1.5)):
        with pytest.raises(ConfigError, match=key):
            resolve_config({**raw_smoke_config("ease_online"), key: value})
    # The cap is gone: a config that still sets it is refused with the fix.
    with pytest.raises(ConfigError, match=r"'adapter_num' was removed.*without a cap.*delete"):
        resolve_config({**raw_smoke_config("ease_online"), "adapter_num": 10})

"""Networks that grow at a firing (DER, MEMO, FOSTER add a branch and widen their head): the
loop's handling of parameters replaced under a known name (``OnlineLoop.parameters_changed``)
and of the online prototypes (``Consolidated.feature_map``).

The head ``fc`` of :class:`Growing` reads ``relu(body(x))`` and, after each firing, one more
branch: a copy of the last branch's layer, as DER copies its last backbone. At the firing the
new branch's features equal the last one's, so the prototypes extend exactly by repeating that
branch's columns, and the wider head (old columns copied, new ones zero) gives the same logits.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet, unit_config
from torch import nn

from pilot_online.engine.adapter import Consolidated, Consolidation, StepOutput
from pilot_online.engine.mixins import build_loop

C, WIDTH = 6, 8


class Growing(TinyAdapter):
    consolidation = Consolidation(trigger="every_n_samples")

    def build_network(self, args):
        network = TinyNet(hidden=WIDTH, num_classes=C)
        network.branches = nn.ModuleList([network.body])
        return network

    def features(self, network, x):
        return torch.cat([torch.relu(branch(x)) for branch in network.branches], 1)

    def forward(self, network, x, train):
        features = self.features(network, x)
        return StepOutput(network.fc(features), features)

    def grow(self, network):
        """A copy of the last branch (the older ones frozen) and a head one branch wider."""
        for branch in network.branches:
            branch.requires_grad_(False)
        network.branches.append(copy.deepcopy(network.branches[-1]).requires_grad_(True))
        old = network.fc
        wider = nn.Linear(old.in_features + WIDTH, C).to(old.weight.device)
        with torch.no_grad():
            wider.weight.zero_()
            wider.weight[:, : old.in_features] = old.weight
            wider.bias.copy_(old.bias)
        network.fc = wider

    def consolidate(self, network, firing):
        self.grow(network)
        return Consolidated(feature_map=lambda rows: torch.cat([rows, rows[:, -WIDTH:]], 1))

    def state_dict(self, network):
        return {"branches": len(network.branches)}

    def load_state_dict(self, network, state):
        while len(network.branches) < state["branches"]:
            self.grow(network)


def make_loop(variant="fgh", optimizer="adam", every=4):
    torch.manual_seed(0)
    cfg = unit_config(
        Growing,
        C,
        consolidation="every_n_samples",
        consolidation_every_n_samples=every,
        optimizer=optimizer,
        online_prototypes=variant in ("p", "fgh"),
        fgh={"gamma": 1.0, "granularity": "class", "direction": "adam", "clamp": [0.0, None]}
        if variant in ("fgh", "fgh_only")
        else None,
    )
    adapter = Growing(args=cfg)
    return build_loop(adapter, adapter.build_network(cfg), cfg, C)


X = torch.randn(16, 5, generator=torch.Generator().manual_seed(2))
Y = torch.tensor([0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 0, 2, 4, 1])


def step(loop, i):
    rows = slice(4 * i, 4 * i + 4)
    return loop.train_step(X[rows], Y[rows], np.arange(4 * i, 4 * i + 4))


def test_the_wider_head_takes_the_old_ones_place_with_fresh_state():
    loop = make_loop()
    step(loop, 0)
    old_weight = loop.network.fc.weight
    position = [p is old_weight for g in loop.optimizer.param_groups for p in g["params"]]
    assert old_weight in loop.optimizer.state
    step(loop, 1)  # fires: the head is replaced, then trains
    new_weight = loop.network.fc.weight
    assert new_weight is not old_weight and new_weight.shape == (C, 2 * WIDTH)
    assert [p is new_weight for g in loop.optimizer.param_groups for p in g["params"]][
        : len(position)
    ] == position
    assert old_weight not in loop.optimizer.state
    assert loop.optimizer.state[new_weight]["step"].item() == 1  # a first step after the firing
    names = [n for n, _ in loop.named_parameters]
    assert names.count("fc.weight") == 1 and "branches.1.weight" in names
    assert dict(loop.named_parameters)["fc.weight"] is new_weight


def test_a_firing_sends_one_event_with_everything_it_changed():
    """The optimiser, FGH, the prototypes and the memory learn of a firing from one
    ParameterChange: here the head replaced under its names and a new branch added, together."""
    loop = make_loop()
    events = []
    send = loop.parameters_changed

    def record(change):
        events.append(change)
        send(change)

    loop.parameters_changed = record
    step(loop, 0)
    assert events == []  # no firing, no change
    old = {n: p for n, p in loop.named_parameters}
    step(loop, 1)  # fires once
    (change,) = events
    assert change.restarted == ()
    assert [(n, o is old[n], new is loop.network.fc.get_parameter(n[3:])) for n, o, new in
            change.replaced] == [("fc.weight", True, True), ("fc.bias", True, True)]  # fmt: skip
    assert [n for n, _ in change.added] == ["branches.1.weight", "branches.1.bias"]
    assert dict(loop.named_parameters)["branches.1.weight"] is loop.network.branches[1].weight


def test_fgh_keeps_the_class_alphas_across_the_replacement():
    loop = make_loop(every=8)
    step(loop, 0), step(loop, 1)  # two steps: the class alphas moved from 1
    old = loop.network.fc.weight
    alpha = loop.fgh.state[old]["alpha"].clone()
    assert not torch.equal(alpha, torch.ones(C))
    step(loop, 2)  # fires: the wider head's first FGH step pairs nothing, so alpha stays
    new = loop.network.fc.weight
    assert loop.fgh.param_groups[0]["params"][0] is new and old not in loop.fgh.state
    assert torch.equal(loop.fgh.state[new]["alpha"], alpha)
    step(loop, 3)  # its second step updates the carried alphas
    assert not torch.equal(loop.fgh.state[new]["alpha"], alpha)


def test_prototypes_are_mapped_and_equal_the_new_features_at_the_firing():
    loop = make_loop(variant="p")
    step(loop, 0)
    means = loop.prototypes.means.clone()
    network = loop.network
    loop.trigger.update(Y[4:8])  # as the next step would: fires
    loop._consolidate(0)
    assert loop.prototypes.means.shape == (C, 2 * WIDTH)
    torch.testing.assert_close(loop.prototypes.means, torch.cat([means, means[:, -WIDTH:]], 1))
    # At the firing the copied branch computes the same features, so the mapped means are the
    # means of the new features of the same samples.
    new = loop.adapter.features(network, X[:4])
    old = torch.relu(network.branches[0](X[:4]))
    torch.testing.assert_close(new, torch.cat([old, old], 1))


def test_a_wider_head_without_a_feature_map_is_refused_by_name():
    class NoMapping(Growing):
        def consolidate(self, network, firing):
            self.grow(network)
            return Consolidated()

    loop = make_loop(variant="p")
    loop.adapter.__class__ = NoMapping
    step(loop, 0)
    with pytest.raises(ValueError, match=r"online prototypes no longer fit.*feature_map="):
        step(loop, 1)


def test_consolidate_must_say_what_it_changed():
    class OldStyle(Growing):
        def consolidate(self, network, firing):
            self.grow(network)
            return ()

    loop = make_loop(variant="base")
    loop.adapter.__class__ = OldStyle
    step(loop, 0)
    with pytest.raises(TypeError, match=r"OldStyle\.consolidate returned tuple.*Consolidated"):
        step(loop, 1)


@pytest.mark.parametrize("variant", ["base", "p", "fgh_only", "fgh"])
def test_a_resume_after_growth_continues_bit_for_bit(variant):
    loop = make_loop(variant)
    for i in range(3):
        step(loop, i)  # two firings: three branches
    state = copy.deepcopy(loop.state_dict())
    resumed = make_loop(variant)
    resumed.load_state_dict(state)
    assert len(resumed.network.branches) == 3
    a, b = step(loop, 3), step(resumed, 3)
    assert torch.equal(a.loss, b.loss)
    for (name, p), (_, q) in zip(
        loop.network.named_parameters(), resumed.network.named_parameters()
    ):
        assert torch.equal(p, q), name


def test_frozen_branches_stay_bit_identical():
    loop = make_loop("base", optimizer="sgd")
    step(loop, 0)
    step(loop, 1)
    first = copy.deepcopy(loop.network.branches[0].state_dict())
    step(loop, 2), step(loop, 3)
    for name, value in loop.network.branches[0].state_dict().items():
        assert torch.equal(value, first[name])

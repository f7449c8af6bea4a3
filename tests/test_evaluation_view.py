"""The loop's two engine hooks for boundary steps (``engine/loop.py``):

- the evaluation view (``MethodAdapter.evaluation``'s): what evaluation predicts with, derived
  from the training state when an evaluation asks, under a forked RNG, cached until the training
  state changes, and never written back;
- parameters a method adds at a firing (a new adapter per task, as upstream): adopted by the
  optimiser, FGH and the checkpoint, and rebuilt on a resume before any value loads.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet
from torch import nn

from pilot_online.engine.adapter import (
    Consolidated,
    Consolidation,
    Evaluation,
    QueryPass,
    StepOutput,
)
from pilot_online.engine.mixins import build_loop

C = 6


def predict(loop, inputs: torch.Tensor) -> np.ndarray:
    batches = [(inputs, torch.zeros(len(inputs), dtype=torch.long))]
    y_pred, _ = loop.predict(batches, torch.ones(C, dtype=torch.bool), topk=1)
    return y_pred[:, 0]


class Viewing(TinyAdapter):
    """Evaluation sees a head whose class-5 row is the training row plus 100 times a random
    draw, and whose bias favours class 5 by 1000: every prediction is 5 under the view."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.views = 0

    def evaluation(self, network):
        self.views += 1
        weight = network.fc.weight.detach().clone()
        weight[5] += 100 * torch.randn(weight.shape[1])  # a draw, as alignment's samples
        bias = torch.zeros_like(network.fc.bias)
        bias[5] = 1000.0
        return Evaluation(view={"fc.weight": weight, "fc.bias": bias})


def test_evaluation_sees_the_view_and_training_keeps_its_values():
    torch.manual_seed(0)
    adapter = Viewing()
    loop = build_loop(adapter, TinyNet(), {"init_lr": 0.05}, C)
    x = torch.randn(8, 5)
    loop.train_step(x[:4], torch.tensor([0, 1, 2, 3]))
    head = {k: v.clone() for k, v in loop.network.fc.state_dict().items()}
    rng = torch.get_rng_state()
    assert (predict(loop, x) == 5).all()
    assert torch.equal(torch.get_rng_state(), rng), "the view's draw moved training's RNG"
    for key, value in loop.network.fc.state_dict().items():
        assert torch.equal(value, head[key]), f"evaluation wrote fc.{key}"
    assert not (TinyAdapter().forward(loop.network, x, train=False).logits.argmax(1) == 5).all()


def test_the_view_is_derived_once_per_training_state():
    adapter = Viewing()
    loop = build_loop(adapter, TinyNet(), {"init_lr": 0.05}, C)
    x = torch.randn(4, 5)
    predict(loop, x), predict(loop, x)
    assert adapter.views == 1  # two evaluations, one state
    loop.train_step(x, torch.tensor([0, 1, 2, 3]))
    predict(loop, x)
    assert adapter.views == 2
    loop.load_state_dict(loop.state_dict())
    predict(loop, x)
    assert adapter.views == 3  # a restore is a new state


@pytest.mark.parametrize(
    ("view", "error", "message"),
    [
        ({"fc.nope": torch.zeros(1)}, KeyError, "no parameter or buffer"),
        ({"fc.bias": torch.zeros(C + 1)}, ValueError, "(7,) torch.float32; the network's is (6,)"),
        ({"fc.bias": torch.zeros(C, dtype=torch.float64)}, ValueError, "float64"),
    ],
)
def test_a_view_that_does_not_fit_the_network_is_refused(view, error, message):
    class Bad(TinyAdapter):
        def evaluation(self, network):
            return Evaluation(view=view)

    loop = build_loop(Bad(), TinyNet(), {}, C)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        predict(loop, torch.randn(2, 5))
    assert torch.isfinite(loop.network.fc.bias).all()


def test_an_evaluation_that_is_no_evaluation_record_is_refused():
    class Bare(TinyAdapter):
        def evaluation(self, network):
            return {"fc.bias": torch.zeros(C)}  # the retired evaluation_view's return

    loop = build_loop(Bare(), TinyNet(), {}, C)
    with pytest.raises(TypeError, match=r"returned dict; return Evaluation\(view=\.\.\."):
        predict(loop, torch.randn(2, 5))


def test_a_view_may_not_override_the_query_pass():
    class Both(TinyAdapter):
        def evaluation(self, network):
            query = QueryPass(
                list(network.body.parameters()),
                lambda x: torch.relu(network.body(x)),
                lambda x, q, train: StepOutput(network.fc(q), q),
            )
            return Evaluation(view={"body.bias": torch.zeros_like(network.body.bias)}, query=query)

    loop = build_loop(Both(), TinyNet(frozen_body=True), {}, C)
    with pytest.raises(ValueError, match=r"overrides 'body\.bias', a parameter of the frozen"):
        predict(loop, torch.randn(2, 5))


@pytest.mark.parametrize("retired", ["evaluation_view", "query_pass"])
def test_the_retired_evaluation_hooks_are_refused_with_the_fix(retired):
    with pytest.raises(TypeError, match=rf"defines {retired}.*override evaluation\(network\)"):
        type("Old", (TinyAdapter,), {retired: lambda self, network: None})


class GrowingNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.adapters = nn.ModuleList()


class Growing(TinyAdapter):
    """One new residual adapter on the features at each firing (the older ones frozen), as
    upstream EASE and MOS add one adapter per task; zero-initialised, so a firing changes no
    output."""

    consolidation = Consolidation(trigger="every_n_samples")

    def build_network(self, args):
        return GrowingNet()

    def forward(self, network, x, train):
        features = torch.relu(network.body(x))
        for adapter in network.adapters:
            features = features + adapter(features)
        return StepOutput(network.fc(features), features)

    def _add(self, network) -> None:
        for old in network.adapters:
            old.requires_grad_(False)
        network.adapters.append(nn.Linear(8, 8).to(network.fc.weight.device))
        nn.init.zeros_(network.adapters[-1].weight), nn.init.zeros_(network.adapters[-1].bias)

    def consolidate(self, network, firing):
        self._add(network)
        return Consolidated()

    def state_dict(self, network):
        return {"adapters": len(network.adapters)}

    def load_state_dict(self, network, state):
        while len(network.adapters) < state["adapters"]:
            self._add(network)


GROWING_CONFIG = {
    "init_lr": 0.05,
    "consolidation": "every_n_samples",
    "consolidation_every_n_samples": 4,
    "fgh": {"gamma": 1e-3, "granularity": "element", "clamp": [0.0, 10.0]},
}


def growing_loop():
    torch.manual_seed(0)
    adapter = Growing()
    return build_loop(adapter, adapter.build_network({}), GROWING_CONFIG, C)


def test_parameters_added_at_a_firing_train_and_stay_in_the_checkpoint():
    """Firings before steps 2 and 3 add adapters 0 and 1: each joins the optimiser and FGH and
    trains from the step it was added; adapter 0, frozen at the second firing, keeps its values
    and stays in the checkpoint; a fresh loop restored from that checkpoint rebuilds both and
    takes the same next step."""
    loop = growing_loop()
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 3] * 4)
    loop.train_step(x[:4], y[:4])
    loop.train_step(x[4:8], y[4:8])  # fires first: adapter 0 trains in this step
    adapter0 = loop.network.adapters[0].weight
    assert any(p is adapter0 for g in loop.optimizer.param_groups for p in g["params"])
    assert any(p is adapter0 for g in loop.fgh.param_groups for p in g["params"])
    assert adapter0.abs().sum() > 0, "the new adapter did not train"
    trained = adapter0.detach().clone()
    loop.train_step(x[8:12], y[8:12])  # fires: adapter 1 added, adapter 0 frozen
    assert torch.equal(adapter0.detach(), trained)
    names = [name for name, _ in loop.named_parameters]
    assert names[-4:] == [f"adapters.{i}.{k}" for i in (0, 1) for k in ("weight", "bias")]
    state = copy.deepcopy(loop.state_dict())  # as a checkpoint file: no tensor shared

    fresh = growing_loop()
    fresh.load_state_dict(state)
    assert [name for name, _ in fresh.named_parameters] == names
    assert torch.equal(fresh.network.adapters[0].weight, adapter0)
    a, b = loop.train_step(x[12:], y[12:]), fresh.train_step(x[12:], y[12:])
    assert torch.equal(a.loss, b.loss)
    for (name, p), (_, q) in zip(loop.named_parameters, fresh.named_parameters):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)

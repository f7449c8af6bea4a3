"""``online_iter`` (issue 29): k optimiser steps per incoming stream batch, as upstream
Si-Blurry's trainers take ``online_iter`` ``online_train`` calls per batch (its scripts: 3).

Each step is a whole step with its own replay draw (upstream builds a memory loader of
``online_iter`` batches per incoming batch and takes one per call, all from the memory as it was
before the batch: ``update_memory`` runs after them); the batch enters the memory, the
prototypes, the trigger and the counters once; FGH pairs consecutive optimiser steps, those on
the same batch included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet
from torch import nn

from pilot_online.engine.adapter import MethodAdapter, StepOutput
from pilot_online.engine.config import PAPER_FGH
from pilot_online.engine.loop import OnlineLoop
from pilot_online.engine.mixins import build_loop


class LinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)


class LinearAdapter(MethodAdapter):
    """logits = fc(x): the loss is plain cross-entropy of a linear model."""

    base_model_name = "linear"

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        return StepOutput(network.fc(x), x)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc


CONFIG = {"optimizer": "adam", "init_lr": 0.05, "logit_mask": "none", "grad_trace": False}


@pytest.mark.parametrize("k", [1, 3])
def test_k_steps_equal_k_manual_adam_steps_on_the_same_batch(k) -> None:
    torch.manual_seed(0)
    network = LinearNet()
    manual = LinearNet()
    manual.load_state_dict(network.state_dict())
    weight, bias = network.fc.weight.detach().clone(), network.fc.bias.detach().clone()
    loop = OnlineLoop(LinearAdapter(), network, {**CONFIG, "online_iter": k}, 4)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    stats = loop.train_step(x, y)

    optimizer = torch.optim.Adam(manual.parameters(), lr=0.05)
    losses = []
    for _ in range(k):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(manual.fc(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    assert torch.equal(network.fc.weight, manual.fc.weight)
    assert torch.equal(network.fc.bias, manual.fc.bias)
    assert loop.optimizer_steps == k and loop.samples_seen == 6
    assert stats.loss.item() == pytest.approx(torch.stack(losses).mean().item())
    # The step's accuracy is the first step's: the prediction before any update on the batch.
    first = (nn.functional.linear(x, weight, bias).argmax(1) == y).sum()
    assert int(stats.correct) == int(first)


class RecordingLoader:
    """A replay loader that records each draw (dataset indices) and returns them as inputs."""

    keyed = True

    def __init__(self, x: torch.Tensor, y: np.ndarray) -> None:
        self.x, self.y = x, y
        self.draws: list[tuple[list[int], int]] = []

    def __call__(self, indices: np.ndarray, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.draws.append((sorted(int(i) for i in indices), int(step)))
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return self.x[index], torch.as_tensor(self.y[np.asarray(indices)])

    def prefetch(self, indices: np.ndarray, step: int) -> None:
        pass


def replay_loop(
    k: int, **overrides
) -> tuple[OnlineLoop, RecordingLoader, torch.Tensor, np.ndarray]:
    torch.manual_seed(0)
    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(2))
    y = np.arange(40) % 6
    config = {
        **CONFIG,
        **({} if k is None else {"online_iter": k}),
        "er_memory_size": 30,
        "er_batch_size": 4,
        "online_prototypes": True,
        "fgh": dict(PAPER_FGH),
        "seed": 0,
        **overrides,
    }
    loop = build_loop(TinyAdapter(), TinyNet(), config, 6)
    loader = RecordingLoader(x, y)
    loop.attach_samples(loader)
    return loop, loader, x, y


def run_batches(loop: OnlineLoop, x: torch.Tensor, y: np.ndarray, batches: int = 4) -> None:
    for b in range(batches):
        index = np.arange(b * 8, b * 8 + 8)
        loop.train_step(x[index], torch.as_tensor(y[index]), index)


def test_each_step_draws_its_own_replay_batch_from_the_memory_before_the_batch() -> None:
    """k = 3, batches of 8, 4 replayed: batch 1 meets an empty memory (no draw); each later
    batch gets 3 draws, of samples stored before it, under 3 distinct keys; the memory was
    offered each stream sample once."""
    loop, loader, x, y = replay_loop(3)
    run_batches(loop, x, y)
    assert len(loader.draws) == 9  # batches 2, 3, 4: 3 draws each
    for batch in range(1, 4):
        draws = loader.draws[(batch - 1) * 3 : batch * 3]
        assert all(max(indices) < batch * 8 for indices, _ in draws)  # from before the batch
        assert len({key for _, key in draws}) == 3
    assert loop.memory.num_seen == 32
    assert loop.optimizer_steps == 12 and loop.samples_seen == 32


def test_prototypes_trigger_and_fgh_see_the_batch_once_and_the_steps_k_times() -> None:
    loop, _, x, y = replay_loop(3, consolidation="never")
    run_batches(loop, x, y)
    assert int(loop.prototypes.counts.sum()) == 32  # each stream sample folded in once
    assert loop.trigger.samples == 32
    assert loop.fgh.num_steps == 12  # FGH pairs consecutive steps, those on one batch too


def test_online_iter_one_is_the_single_step_bit_for_bit() -> None:
    """online_iter 1 (the default) takes the same draws and ends at the same weights as a
    config without the key."""
    one, one_loader, x, y = replay_loop(1)
    run_batches(one, x, y)
    default, default_loader, _, _ = replay_loop(None)
    run_batches(default, x, y)
    assert one_loader.draws == default_loader.draws
    for a, b in zip(one.network.parameters(), default.network.parameters()):
        assert torch.equal(a, b)


class RecordingAdapter(LinearAdapter):
    """Records each ``after_step``: whether it carried the stream batch, and the batch's rows."""

    def after_step(self, network, step):
        self.calls = getattr(self, "calls", [])
        self.calls.append((step.stream is not None, len(step.inputs), step.stream_size))
        return ()


def test_after_step_follows_every_update_and_carries_the_stream_batch_at_its_own_step() -> None:
    """k = 3: three calls per batch, after each update; only the last (the batch's own step)
    carries the stream batch's outputs, so a method observes the batch once."""
    adapter = RecordingAdapter()
    loop = OnlineLoop(adapter, LinearNet(), {**CONFIG, "online_iter": 3}, 4)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    loop.train_step(x, torch.tensor([0, 1, 2, 3, 0, 1]))
    loop.train_step(x, torch.tensor([0, 1, 2, 3, 0, 1]))
    assert adapter.calls == [(False, 6, 6), (False, 6, 6), (True, 6, 6)] * 2


class NonFiniteOwnStep(RecordingAdapter):
    """The batch's third forward (its own step at k = 3) gives a NaN loss."""

    def forward(self, network, x, train):
        self.forwards = getattr(self, "forwards", 0) + 1
        out = super().forward(network, x, train)
        if train and self.forwards == 3:
            return StepOutput(out.logits * float("nan"), out.features)
        return out


def test_a_batch_whose_own_step_is_skipped_is_not_observed() -> None:
    """As at k = 1: a skipped step observes nothing, even when the extra steps before it were
    finite (they update, and their after_step runs without the stream batch)."""
    adapter = NonFiniteOwnStep()
    loop = build_loop(
        adapter, LinearNet(), {**CONFIG, "online_iter": 3, "online_prototypes": True}, 4
    )
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    stats = loop.train_step(x, torch.tensor([0, 1, 2, 3, 0, 1]))
    assert adapter.calls == [(False, 6, 6), (False, 6, 6)]
    assert loop.optimizer_steps == 2 and not stats.skipped
    assert int(loop.prototypes.counts.sum()) == 0  # the prototypes did not observe it either
    assert loop.trigger.samples == 6  # the trigger counts the batch after its finite steps


def test_the_retired_hook_and_signature_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"observe.*after_step\(network, step\)"):

        class Observing(LinearAdapter):
            def observe(self, network, out, labels):
                pass

    with pytest.raises(TypeError, match=r"after_step takes \(self, network, step\)"):

        class OldSignature(LinearAdapter):
            def after_step(self, network, inputs, labels, terms):
                return ()

"""A_online (issue 29; docs/protocol.md): each stream batch scored by the model as it stood
before training on it, over the classes seen before the batch, in eval mode, and without any
effect on training.

The hand-computed stream uses a model whose head rows are running sums of the features of each
class (a class-sum classifier that learns in ``observe``), so every prediction before each
update can be worked out on paper; predicting after the update, or with the batch's own new
classes allowed, gives other numbers (worked out beside the right ones).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet, VectorSource
from torch import nn

from pilot_online.core.metrics import online_accuracy, summarize
from pilot_online.core.streams import Stream
from pilot_online.engine.adapter import Consolidated, MethodAdapter, StepOutput
from pilot_online.engine.loop import OnlineLoop
from pilot_online.engine.session import OnlineSession

A, B, C3 = torch.eye(3)
# The stream, two tasks of two batches of two samples: (input, label).
STREAM = [
    (A, 0), (B, 1),  # batch 1: nothing seen yet: both wrong
    (A, 0), (A, 1),  # batch 2: W0 = a, W1 = b: a -> 0 for both: 1 right
    (C3 - A, 2), (B, 1),  # batch 3 (task 1): W0 = 2a, W1 = a + b, class 2 unseen: 1 right
    (C3, 2), (A, 0),  # batch 4: W2 = c - a, W1 = a + 2b: c -> 2, a -> 0: 2 right
]  # fmt: skip
TRAIN_X = torch.stack([x for x, _ in STREAM])
TRAIN_Y = np.array([y for _, y in STREAM])
# By hand, per batch: [0, 1, 1, 2] right, A_online = 4 / 8.
HAND_PER_BATCH = [0, 1, 1, 2]
# Wrong definitions, by hand: after the update (W already holds the batch): [2, 1, 2, 2];
# with the batch's own classes allowed: batch 1's a -> 0 (all logits 0) right, and batch 3's
# c - a -> 2 (logit 0 beats -2 and -1) right: [1, 1, 2, 2].


class ClassSumNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3, bias=False)
        nn.init.zeros_(self.fc.weight)
        self.fc.requires_grad_(False)


class ClassSumAdapter(MethodAdapter):
    """logits = W x, W's row c the sum of the class-c features seen (learned in after_step)."""

    base_model_name = "class_sum"
    trains = False

    def build_network(self, args: dict) -> nn.Module:
        return ClassSumNet()

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        return StepOutput(x @ network.fc.weight.T, x)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc

    @torch.no_grad()
    def after_step(self, network: nn.Module, step) -> tuple:
        network.fc.weight.index_add_(0, step.stream_labels, step.stream.features)
        return ()

    def state_dict(self, network: nn.Module) -> dict:
        return {"sums": network.fc.weight.detach().clone()}

    @torch.no_grad()
    def load_state_dict(self, network: nn.Module, state: dict) -> None:
        network.fc.weight.copy_(state["sums"])


def stream() -> Stream:
    tasks = [np.arange(4), np.arange(4, 8)]
    return Stream("clear", tasks, TRAIN_Y, batch_size=2, seed=0, params={})


CONFIG = {
    "optimizer": "adam",
    "init_lr": 0.01,
    "logit_mask": "batch",
    "grad_trace": False,
    "online_accuracy": True,
}


def run_loop(adapter: MethodAdapter) -> list[int]:
    loop = OnlineLoop(adapter, adapter.build_network({}), CONFIG, 3)
    counts = []
    for start in range(0, 8, 2):
        stats = loop.train_step(
            TRAIN_X[start : start + 2], torch.as_tensor(TRAIN_Y[start : start + 2])
        )
        counts.append(int(stats.online_correct))
    return counts


def test_online_counts_per_batch_by_hand() -> None:
    """The eval-mode pass before each step gives the hand counts."""
    assert run_loop(ClassSumAdapter()) == HAND_PER_BATCH


def test_the_session_records_a_online_by_hand() -> None:
    """The results hold A_online = 4 / 8; the eval-mode passes' time is kept apart from
    training's."""
    adapter = ClassSumAdapter()
    loop = OnlineLoop(adapter, adapter.build_network({}), CONFIG, 3)
    source = VectorSource(TRAIN_X, TRAIN_Y, TRAIN_X[:3], np.array([0, 1, 2]))
    session = OnlineSession(loop, stream(), source, CONFIG, progress=False)
    results = session.run()
    assert results["metrics"]["A_online"] == pytest.approx(100.0 * 4 / 8)
    assert results["counters"]["online_scored_samples"] == 8
    online_seconds = results["timing"]["online_eval_seconds"]
    assert online_seconds > 0.0
    assert results["timing"]["train_seconds"] >= 0.0


def test_a_resumed_session_keeps_its_online_counts(tmp_path) -> None:
    """A checkpoint after task 0 (1 of 4 right so far) and a fresh session resuming it end at
    the uninterrupted run's A_online."""
    config = {**CONFIG, "checkpoint_every": 100}
    source = VectorSource(TRAIN_X, TRAIN_Y, TRAIN_X[:3], np.array([0, 1, 2]))
    path = tmp_path / "run.results.json"

    def session() -> OnlineSession:
        adapter = ClassSumAdapter()
        loop = OnlineLoop(adapter, adapter.build_network({}), config, 3)
        return OnlineSession(loop, stream(), source, config, path, progress=False)

    first = session()
    first.train_task(0)
    first.complete_task(0)  # checkpoints at the task end
    assert first.scoring.counts() == (1, 4)
    results = session().run()
    assert results["metrics"]["A_online"] == pytest.approx(50.0)


def test_summarize_and_online_accuracy() -> None:
    matrix = np.array([[80.0]])
    assert summarize(matrix, online=(3, 4))["A_online"] == pytest.approx(75.0)
    assert summarize(matrix)["A_online"] is None
    assert online_accuracy(0, 0) is None
    with pytest.raises(ValueError, match="0 <= correct <= samples"):
        online_accuracy(5, 4)


# ------------------------------------------------------------------ no effect on training


class DropoutAdapter(TinyAdapter):
    """TinyNet with dropout on its features, and an eval forward that draws random numbers: the
    A_online pass must leave the RNG (so the next dropout mask) and the weights untouched."""

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = torch.relu(network.body(x))
        features = nn.functional.dropout(features, 0.5, training=network.training)
        noise = 0.0 if train else torch.rand(()) * 0  # a draw on the eval path only
        return StepOutput(network.fc(features) + noise, features)


def train_weights(adapter: MethodAdapter, score_online: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    loop = OnlineLoop(adapter, TinyNet(), {**CONFIG, "online_accuracy": score_online}, 6)
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(4, 5, generator=generator)
        y = torch.tensor([step % 6, (step + 1) % 6, step % 6, (step + 2) % 6])
        loop.train_step(x, y)
    return [p.detach().clone() for p in loop.network.parameters()]


def test_the_online_pass_changes_no_trained_weight_bit_for_bit() -> None:
    scored = train_weights(DropoutAdapter(), score_online=True)
    unscored = train_weights(DropoutAdapter(), score_online=False)
    for a, b in zip(scored, unscored):
        assert torch.equal(a, b)


class FlippingAdapter(TinyAdapter):
    """A firing negates the head: a prediction taken after it would be another model's."""

    def consolidate(self, network: nn.Module, firing: int):
        with torch.no_grad():
            network.fc.weight.neg_()
            network.fc.bias.neg_()
        return Consolidated()


def test_a_step_that_a_firing_opens_is_scored_before_the_firing() -> None:
    """A_online scores the model the batch meets: at a step whose firing negates the head, the
    count is the pre-firing model's (taken by hand with ``predict_online`` just before the step),
    which differs from the negated model's."""
    torch.manual_seed(0)
    config = {**CONFIG, "consolidation": "every_n_samples", "consolidation_every_n_samples": 8}
    loop = OnlineLoop(FlippingAdapter(), TinyNet(), config, 6)
    generator = torch.Generator().manual_seed(2)
    differed = 0
    for step in range(8):
        y = torch.tensor([step % 3, 3 + step % 3, step % 3, 3 + step % 3])
        x = torch.randn(4, 5, generator=generator) + nn.functional.one_hot(y % 5, 5) * 3
        before = int(loop.predict_online(x, y))
        firings = len(loop.trigger.firings)
        scored = int(loop.train_step(x, y).online_correct)
        assert scored == before
        if len(loop.trigger.firings) > firings:  # this step fired: the head is negated now
            differed += int(loop.predict_online(x, y)) != before
    assert differed >= 1  # the order matters at some firing, so the assertion above has teeth


# ------------------------------------------------------------------ report and tables


def test_tables_and_report_show_a_online_where_runs_record_it(tmp_path) -> None:
    import json

    from test_tables import write_run

    from pilot_online.harness import tables
    from pilot_online.harness.report import collect, format_table

    folder = tmp_path / "results"
    paths = [write_run(folder, lr=5e-5, seed=seed, ap=50.0) for seed in range(2)]
    names = [t.name for t in tables.build_tables(tables.load_rows([folder]))]
    assert "online_clear" not in names  # older files carry no A_online: no empty table
    for path, value in zip(paths, (30.0, 40.0)):
        results = json.loads(path.read_text())
        results["metrics"]["A_online"] = value
        path.write_text(json.dumps(results))
    runs = tables.load_rows([folder])
    online = next(t for t in tables.build_tables(runs) if t.name == "online_clear")
    assert online.cell("CODA", "", 0).mean == 35.0
    assert "A_online" in tables.to_markdown(online)
    assert format_table(collect([folder])).splitlines()[2].split()[-1] == "35.00±5.00"


class CountingAdapter(TinyAdapter):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eval_forwards = 0

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        self.eval_forwards += not train
        return super().forward(network, x, train)


def test_off_by_default_no_pass_and_no_number() -> None:
    """A_online costs an eval-mode pass per batch (and, for a method with an evaluation view,
    the view at every step: RanPAC's solve, SLCA's alignment): off unless the config asks, and
    then neither a pass runs nor a number is reported."""
    adapter = CountingAdapter()
    loop = OnlineLoop(
        adapter, TinyNet(), {k: v for k, v in CONFIG.items() if k != "online_accuracy"}, 6
    )
    stats = loop.train_step(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]))
    assert adapter.eval_forwards == 0 and stats.online_correct is None
    assert summarize([[50.0]])["A_online"] is None

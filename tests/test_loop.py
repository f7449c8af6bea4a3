"""The online loop (loop.py) and its mixins, driven by a tiny two-layer model instead of PILOT.

Model: ``features = relu(body(x))``, ``logits = fc(features)``. Expected values come from the
stream's sizes, from the paper's equations (Eq. 1 running means, Eq. 2 prototype CE) or from the
cross-entropy gradient written out by hand, never from the loop's own output.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyAdapter, TinyNet, VectorSource, smoke_config
from torch import nn

from pilot_online.core.streams import clear_stream
from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.config import ConfigError
from pilot_online.engine.loop import NonFiniteLossError, OnlineLoop
from pilot_online.engine.mixins import FGHMixin, PrototypeMixin, build_loop
from pilot_online.engine.session import OnlineSession

D_IN, HIDDEN, C = 5, 8, 6
# Training samples per class. Clear stream, init_cls=2, increment=2, batch_size=4:
#   task 0 = classes {0, 1}: 5 + 3 = 8  samples -> ceil(8 / 4)  = 2 batches
#   task 1 = classes {2, 3}: 4 + 6 = 10 samples -> ceil(10 / 4) = 3 batches
#   task 2 = classes {4, 5}: 2 + 7 = 9  samples -> ceil(9 / 4)  = 3 batches
#   in all 27 samples and 8 optimizer steps.
TRAIN_COUNTS = [5, 3, 4, 6, 2, 7]
TEST_COUNTS = [2, 1, 1, 1, 1, 1]
BASE_CONFIG = {"optimizer": "adam", "init_lr": 0.05, "logit_mask": "batch"}


class NaNAdapter(TinyAdapter):
    """Returns NaN logits on the training forward passes listed in ``nan_calls`` (0-based)."""

    nan_calls: frozenset = frozenset()
    train_calls = 0

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        out = super().forward(network, x, train)
        if train:
            call, self.train_calls = self.train_calls, self.train_calls + 1
            if call in self.nan_calls:
                out.logits = out.logits * float("nan")
        return out


class Recorder:
    """A mixin that calls super() in every hook and records what it saw."""

    def __init__(self, *args, **kwargs) -> None:
        self.events: list[str] = []
        self.terms: list[dict[str, torch.Tensor]] = []
        self.snapshots: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.after: list[tuple[torch.Tensor, torch.Tensor]] = []
        super().__init__(*args, **kwargs)
        self.events.append("init")

    def loss_terms(self, out, labels):
        terms = super().loss_terms(out, labels)
        self.events.append("loss_terms")
        self.terms.append({k: v.detach().clone() for k, v in terms.items()})
        fc = self.adapter.classifier(self.network)
        self.snapshots.append(
            {
                "features": out.features.detach().clone(),
                "labels": labels.clone(),
                "weight": fc.weight.detach().clone(),
                "bias": fc.bias.detach().clone(),
            }
        )
        return terms

    def after_backward(self) -> None:
        super().after_backward()
        self.events.append("after_backward")
        self.grads.append(
            {n: p.grad.clone() for n, p in self.named_parameters if p.grad is not None}
        )

    def after_step(self, step) -> None:
        super().after_step(step)
        if step.stream is not None:
            self.events.append("observe")
            self.after.append((step.stream.features.detach().clone(), step.stream_labels.clone()))


def make_data(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    train_y = np.repeat(np.arange(C), TRAIN_COUNTS)
    test_y = np.repeat(np.arange(C), TEST_COUNTS)
    centers = 2 * torch.randn(C, D_IN, generator=generator)
    train_x = centers[train_y] + torch.randn(len(train_y), D_IN, generator=generator)
    test_x = centers[test_y] + torch.randn(len(test_y), D_IN, generator=generator)
    return train_x, train_y, test_x, test_y


def make_stream(train_y):
    return clear_stream(train_y, init_cls=2, increment=2, batch_size=4, seed=0)


def make_loop(
    config, mixins=(), seed: int = 0, frozen_body: bool = False, adapter=None, device="cpu"
):
    torch.manual_seed(seed)
    adapter = adapter or TinyAdapter()
    network = TinyNet(frozen_body=frozen_body)
    if mixins:
        loop_cls = type("TestLoop", (*mixins, OnlineLoop), {})
        return loop_cls(adapter, network, config, C, device)
    return build_loop(adapter, network, config, C, device)


def run_stream(loop, stream, train_x, train_y):
    """Drive the loop over every batch of the stream, in stream order."""
    labels = torch.as_tensor(train_y)
    stats = []
    for batch in stream.batches():
        index = torch.from_numpy(np.array(batch.indices))
        stats.append(loop.train_step(train_x[index], labels[index]))
    return stats


def params(loop) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in loop.network.named_parameters()}


# --------------------------------------------------------------------------- one pass


def test_one_pass_consumes_each_sample_once_and_steps_once_per_batch(device) -> None:
    train_x, train_y, test_x, test_y = make_data()
    stream = make_stream(train_y)
    task_sizes = [len(t) for t in stream.tasks]
    assert task_sizes == [8, 10, 9]  # see TRAIN_COUNTS
    expected_steps = sum(math.ceil(n / 4) for n in task_sizes)
    assert expected_steps == 2 + 3 + 3

    loop = make_loop(BASE_CONFIG, device=device)
    session = OnlineSession(
        loop, stream, VectorSource(train_x, train_y, test_x, test_y), BASE_CONFIG, progress=False
    )
    for task in range(stream.num_tasks):
        session.train_task(task)
    assert loop.samples_seen == len(stream) == 27
    assert loop.optimizer_steps == expected_steps
    assert session.tasks_trained == 3
    assert loop.seen.tolist() == [True] * C


# --------------------------------------------------------------------------- logit masks


def _one_step_grads(mask: str, batches: list[list[int]]):
    loop = make_loop({**BASE_CONFIG, "logit_mask": mask}, mixins=(Recorder,))
    generator = torch.Generator().manual_seed(1)
    for labels in batches:
        x = torch.randn(len(labels), D_IN, generator=generator)
        loop.train_step(x, torch.tensor(labels))
    return loop.grads[-1]


def test_batch_mask_zeroes_classifier_gradient_of_absent_classes() -> None:
    grads = _one_step_grads("batch", [[0, 2, 0, 2]])
    absent = [1, 3, 4, 5]
    # Masked logits are -inf: softmax gives them p = 0 and they are not targets, so
    # dL/dz_j = 0 for every sample, hence zero rows of dL/dW and dL/db.
    assert torch.all(grads["fc.weight"][absent] == 0)
    assert torch.all(grads["fc.bias"][absent] == 0)
    assert torch.all(grads["fc.bias"][[0, 2]] != 0)
    assert torch.all(grads["fc.weight"][[0, 2]].abs().sum(1) > 0)


def test_no_mask_gives_every_class_a_gradient() -> None:
    grads = _one_step_grads("none", [[0, 2, 0, 2]])
    # Without a mask an absent class j gets dL/db_j = mean_i p_ij > 0.
    assert torch.all(grads["fc.bias"][[1, 3, 4, 5]] > 0)
    assert torch.all(grads["fc.weight"].abs().sum(1) > 0)


def test_seen_mask_keeps_every_class_seen_so_far() -> None:
    grads = _one_step_grads("seen", [[0, 2], [1, 1]])
    # Second step: seen = {0, 2} from step 1 plus {1} from this batch; 3, 4, 5 stay masked.
    assert torch.all(grads["fc.bias"][[0, 1, 2]] != 0)
    assert torch.all(grads["fc.bias"][[3, 4, 5]] == 0)
    assert torch.all(grads["fc.weight"][[3, 4, 5]] == 0)


# --------------------------------------------------------------------------- hooks


def test_hooks_run_in_order_and_observe_gets_pre_update_features() -> None:
    loop = make_loop(BASE_CONFIG, mixins=(Recorder,))
    assert loop.events == ["init"]
    generator = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(4, D_IN, generator=generator)
        labels = torch.tensor([0, 1, 2, step])
        before = copy.deepcopy(loop.network)
        stats = loop.train_step(x, labels)
        features, seen_labels = loop.after[-1]
        with torch.no_grad():
            expected = torch.relu(before.body(x))
            after_update = torch.relu(loop.network.body(x))
            logits = before.fc(expected)
        torch.testing.assert_close(features, expected, rtol=0, atol=0)
        assert not torch.equal(features, after_update)  # the body did move: not vacuous
        assert torch.equal(seen_labels, labels)
        # The step's loss is the CE over the batch-masked logits of the pre-update model.
        present = torch.zeros(C, dtype=torch.bool)
        present[labels] = True
        expected_ce = F.cross_entropy(logits.masked_fill(~present, float("-inf")), labels)
        torch.testing.assert_close(stats.loss, expected_ce)
    per_step = ["loss_terms", "after_backward", "observe"]
    assert loop.events == ["init", *per_step * 3]


def test_loss_terms_are_added_to_the_loss() -> None:
    class Extra:
        def loss_terms(self, out, labels):
            terms = super().loss_terms(out, labels)
            terms["extra"] = torch.tensor(2.5)
            return terms

    loop = make_loop(BASE_CONFIG, mixins=(Extra,))
    x = torch.randn(3, D_IN, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([0, 1, 1])
    with torch.no_grad():
        logits = loop.network.fc(torch.relu(loop.network.body(x)))
    mask = torch.tensor([True, True, False, False, False, False])
    ce = F.cross_entropy(logits.masked_fill(~mask, float("-inf")), labels)
    stats = loop.train_step(x, labels)
    torch.testing.assert_close(stats.loss, ce + 2.5)


# --------------------------------------------------------------------------- prototypes


def test_prototypes_with_frozen_body_are_class_means_and_loss_is_eq2(device) -> None:
    train_x, train_y, _, _ = make_data()
    stream = make_stream(train_y)
    loop = make_loop(
        BASE_CONFIG, mixins=(Recorder, PrototypeMixin), frozen_body=True, device=device
    )
    assert [n for n, _ in loop.named_parameters] == ["fc.weight", "fc.bias"]
    body = copy.deepcopy(loop.network.body).cpu()
    stats = run_stream(loop, stream, train_x, train_y)
    assert torch.equal(loop.network.body.weight.cpu(), body.weight)  # frozen: fixed features
    loop.snapshots = [{k: v.cpu() for k, v in snap.items()} for snap in loop.snapshots]

    with torch.no_grad():
        features = torch.relu(body(train_x)).double()
    labels = torch.as_tensor(train_y)
    # Eq. 1 applied over a whole stream is the arithmetic mean of each class's features.
    expected_means = torch.stack([features[labels == c].mean(0) for c in range(C)])
    torch.testing.assert_close(loop.prototypes.means.double().cpu(), expected_means)
    assert loop.prototypes.counts.tolist() == TRAIN_COUNTS

    batches = [np.array(b.indices) for b in stream.batches()]
    assert len(loop.terms) == len(batches) == 8
    assert all("prototypes" in terms for terms in loop.terms)
    assert loop.terms[0]["prototypes"].item() == 0.0  # step 1: no prototype yet
    for step in range(1, len(batches)):
        streamed = np.concatenate(batches[:step])
        seen = sorted(set(train_y[streamed].tolist()))
        means = torch.stack(
            [features[streamed[train_y[streamed] == c]].mean(0) for c in seen]
        )  # Eq. 1 before this step
        snap = loop.snapshots[step]  # classifier as it is at this step (before its update)
        logits = means @ snap["weight"].double().T + snap["bias"].double()
        # Eq. 2 with the logit mask: CE of fc(p_c) over the seen classes' logits only.
        seen_logits = logits[:, seen]
        expected = (seen_logits.logsumexp(1) - seen_logits.diagonal()).mean()
        torch.testing.assert_close(loop.terms[step]["prototypes"].double().cpu(), expected)
        # The step's loss = batch-masked CE of the batch + L_P.
        batch_labels = snap["labels"]
        z = snap["features"].double() @ snap["weight"].double().T + snap["bias"].double()
        present = torch.zeros(C, dtype=torch.bool)
        present[batch_labels] = True
        ce = F.cross_entropy(z.masked_fill(~present, float("-inf")), batch_labels)
        torch.testing.assert_close(stats[step].loss.double().cpu(), ce + expected)
    assert loop.report()["prototypes"] == {"classes": C, "samples": 27}


# --------------------------------------------------------------------------- FGH


def test_fgh_gamma_zero_is_bit_identical_to_the_plain_loop(device) -> None:
    train_x, train_y, _, _ = make_data()
    stream = make_stream(train_y)
    plain = make_loop(BASE_CONFIG, device=device)
    start = params(plain)
    run_stream(plain, stream, train_x, train_y)
    fgh = make_loop({**BASE_CONFIG, "fgh": {"gamma": 0}}, device=device)
    assert isinstance(fgh, FGHMixin)
    run_stream(fgh, stream, train_x, train_y)
    for name, value in params(plain).items():
        assert not torch.equal(value, start[name])  # training moved every tensor
        assert torch.equal(value, params(fgh)[name]), name
    alphas = fgh.report()["fgh"]["alpha"]
    assert all(a["min"] == a["max"] == 1.0 for a in alphas.values())


def test_fgh_gamma_one_moves_alpha_and_counts_steps(device) -> None:
    train_x, train_y, _, _ = make_data()
    loop = make_loop({**BASE_CONFIG, "fgh": {"gamma": 1.0}}, device=device)
    run_stream(loop, make_stream(train_y), train_x, train_y)
    report = loop.report()["fgh"]
    assert report["steps"] == loop.optimizer_steps == 8
    assert set(report["alpha"]) == {"body.weight", "body.bias", "fc.weight", "fc.bias"}
    assert any(a["min"] != 1.0 or a["max"] != 1.0 for a in report["alpha"].values())
    assert report["options"]["gamma"] == 1.0


def test_fgh_class_granularity_covers_only_the_classifier() -> None:
    train_x, train_y, _, _ = make_data()
    loop = make_loop({**BASE_CONFIG, "fgh": {"gamma": 1.0, "granularity": "class"}})
    assert [n for n, _ in loop.named_parameters] == [
        "body.weight",
        "body.bias",
        "fc.weight",
        "fc.bias",
    ]
    assert [g["names"] for g in loop.fgh.param_groups] == [["fc.weight", "fc.bias"]]
    run_stream(loop, make_stream(train_y), train_x, train_y)
    alpha = loop.fgh.state[loop.adapter.classifier(loop.network).weight]["alpha"]
    assert alpha.shape == (C,)
    assert torch.any(alpha != 1)


# --------------------------------------------------------------------------- composition


@pytest.mark.parametrize(
    ("config", "has_p", "has_fgh"),
    [
        ({}, False, False),
        ({"online_prototypes": True, "fgh": None}, True, False),
        ({"online_prototypes": False, "fgh": {"gamma": 1}}, False, True),
        ({"online_prototypes": True, "fgh": {"gamma": 1}}, True, True),
        ({"fgh": {}}, False, True),  # an empty FGH object means FGH with its defaults
    ],
)
def test_build_loop_composes_the_requested_mixins(config, has_p, has_fgh) -> None:
    loop = make_loop({**BASE_CONFIG, **config})
    mro = type(loop).__mro__
    assert (PrototypeMixin in mro) is has_p
    assert (FGHMixin in mro) is has_fgh
    assert isinstance(loop, OnlineLoop)
    if not has_p and not has_fgh:
        assert type(loop) is OnlineLoop
    if has_p and has_fgh:
        assert mro.index(PrototypeMixin) < mro.index(FGHMixin) < mro.index(OnlineLoop)
        assert type(loop).__name__ == "PrototypeFGHOnlineLoop"


def test_unknown_optimizer_is_rejected() -> None:
    with pytest.raises(ValueError, match="valid choices: adam, adamw, sgd"):
        make_loop({**BASE_CONFIG, "optimizer": "rmsprop"})


# --------------------------------------------------------------------------- non-finite


def test_non_finite_step_is_skipped() -> None:
    adapter = NaNAdapter()
    adapter.nan_calls = frozenset({1})
    loop = make_loop(BASE_CONFIG, mixins=(Recorder,), adapter=adapter)
    generator = torch.Generator().manual_seed(4)
    batches = [(torch.randn(4, D_IN, generator=generator), torch.tensor([0, 1, 2, 3]))] * 3

    loop.train_step(*batches[0])
    after_first = params(loop)
    stats = loop.train_step(*batches[1])
    assert stats.skipped
    assert loop.skipped_nonfinite_steps == 1
    assert loop.optimizer_steps == 1
    assert loop.samples_seen == 8  # the batch was consumed, only the update was dropped
    for name, value in params(loop).items():
        assert torch.equal(value, after_first[name]), name
    # The skipped step stopped before the gradient transform: no FGH hook, no observe.
    assert loop.events[-1] == "loss_terms"
    assert len(loop.grads) == len(loop.after) == 1

    stats = loop.train_step(*batches[2])
    assert not stats.skipped
    assert loop.optimizer_steps == 2
    assert loop.gradient_statistics()["trace"].shape == (2, C)
    adam_state = loop.optimizer.state[loop.network.fc.weight]
    assert int(adam_state["step"]) == 2


class NaNGradientAdapter(TinyAdapter):
    """A finite loss whose backward pass puts NaN into the body's gradient."""

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        out = super().forward(network, x, train)
        if train:
            out.features.register_hook(lambda grad: grad * float("nan"))
        return out


def test_non_finite_gradient_with_finite_loss_is_skipped_and_named() -> None:
    loop = make_loop({**BASE_CONFIG, "max_nonfinite_steps": 1}, adapter=NaNGradientAdapter())
    before = params(loop)
    x, labels = torch.randn(4, D_IN), torch.tensor([0, 1, 0, 1])
    stats = loop.train_step(x, labels)
    assert stats.skipped and torch.isfinite(stats.loss)
    assert loop.optimizer_steps == 0
    assert all(torch.equal(value, before[name]) for name, value in params(loop).items())
    assert all(p.grad is None for _, p in loop.named_parameters)  # nothing left for a later step
    with pytest.raises(NonFiniteLossError, match=r"gradient of body\.weight"):
        loop.train_step(x, labels)


class ExtraTermAdapter(NaNAdapter):
    """Backpropagates one term of its own after the loop's backward (as oLoRA's hard buffer
    does): 2 x the stream batch's mean logit, NaN on the calls listed in ``nan_extra``."""

    nan_extra: frozenset = frozenset()

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.after_backward_calls: list[int] = []
        self.inputs: torch.Tensor | None = None

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        if train:
            self.inputs = x
        return super().forward(network, x, train)

    def after_backward(self, network: nn.Module, autocast) -> dict[str, torch.Tensor]:
        call = len(self.after_backward_calls)
        self.after_backward_calls.append(call)
        with autocast():
            term = 2 * network.fc(torch.relu(network.body(self.inputs))).mean()
        if call in self.nan_extra:
            term = term * float("nan")
        term.backward()
        return {"extra": term.detach()}


def test_after_backward_runs_on_finite_steps_and_its_own_terms_are_checked() -> None:
    adapter = ExtraTermAdapter()
    adapter.nan_calls = frozenset({1})  # the second step's loss is NaN: no after_backward
    adapter.nan_extra = frozenset({1})  # the second after_backward (third step) returns NaN
    loop = make_loop(BASE_CONFIG, mixins=(Recorder,), adapter=adapter)
    x, labels = torch.randn(4, D_IN), torch.tensor([0, 1, 2, 3])
    # Step 1: the extra term's gradient joins the loss's, as if the two were one loss.
    reference = copy.deepcopy(loop.network)
    out = reference.fc(torch.relu(reference.body(x)))
    present = torch.zeros(C, dtype=torch.bool)
    present[labels] = True
    ce = F.cross_entropy(out.masked_fill(~present, float("-inf")), labels)
    (ce + 2 * out.mean()).backward()
    stats = loop.train_step(x, labels)
    assert not stats.skipped and set(stats.terms) == {"ce", "extra"}
    torch.testing.assert_close(stats.loss, (ce + 2 * out.mean()).detach())
    for name, p in reference.named_parameters():  # what FGH's hook saw: both gradients
        torch.testing.assert_close(loop.grads[0][name], p.grad)
    assert loop.optimizer_steps == 1 and adapter.after_backward_calls == [0]
    # Step 2: a non-finite loss is skipped before after_backward runs.
    assert loop.train_step(x, labels).skipped and adapter.after_backward_calls == [0]
    # Step 3: a finite loss, but after_backward's own term is NaN: skipped, nothing applied.
    before = params(loop)
    stats = loop.train_step(x, labels)
    assert stats.skipped and adapter.after_backward_calls == [0, 1]
    assert loop.optimizer_steps == 1 and loop.skipped_nonfinite_steps == 2
    assert all(torch.equal(value, before[name]) for name, value in params(loop).items())
    assert len(loop.grads) == 1  # FGH's hook never saw the skipped steps


def test_isolated_non_finite_steps_do_not_stop_training() -> None:
    adapter = NaNAdapter()
    adapter.nan_calls = frozenset({0, 1, 3, 4})  # streaks of 2, broken by a finite step
    loop = make_loop({**BASE_CONFIG, "max_nonfinite_steps": 2}, adapter=adapter)
    x, labels = torch.randn(4, D_IN), torch.tensor([0, 1, 0, 1])
    for _ in range(5):
        loop.train_step(x, labels)
    assert loop.skipped_nonfinite_steps == 4
    assert loop.optimizer_steps == 1


def test_too_many_consecutive_non_finite_steps_raise() -> None:
    adapter = NaNAdapter()
    adapter.nan_calls = frozenset(range(10))
    loop = make_loop({**BASE_CONFIG, "max_nonfinite_steps": 2}, adapter=adapter)
    x, labels = torch.randn(4, D_IN), torch.tensor([0, 1, 0, 1])
    loop.train_step(x, labels)  # streak 1 <= 2
    loop.train_step(x, labels)  # streak 2 <= 2
    with pytest.raises(NonFiniteLossError, match="init_lr"):
        loop.train_step(x, labels)  # streak 3 > 2
    assert loop.optimizer_steps == 0


# --------------------------------------------------------------------------- gradient statistics


def _hand_fc_gradient(snapshot):
    """dL/dW and dL/db of the batch-masked CE, written out: dz = (softmax_masked(z) - y) / B."""
    h = snapshot["features"].double()
    labels = snapshot["labels"]
    weight, bias = snapshot["weight"].double(), snapshot["bias"].double()
    z = h @ weight.T + bias
    present = torch.zeros(C, dtype=torch.bool)
    present[labels] = True
    z = z.masked_fill(~present, float("-inf"))
    p = torch.softmax(z, dim=1)
    dz = (p - F.one_hot(labels, C).double()) / len(labels)
    return dz.T @ h, dz.sum(0)


def test_gradient_statistics_are_mean_per_class_gradient_norms(device) -> None:
    train_x, train_y, _, _ = make_data()
    loop = make_loop(BASE_CONFIG, mixins=(Recorder,), device=device)
    run_stream(loop, make_stream(train_y), train_x, train_y)
    per_step = []
    for snapshot, grads in zip(loop.snapshots, loop.grads):
        snapshot = {k: v.cpu() for k, v in snapshot.items()}
        grads = {k: v.cpu() for k, v in grads.items()}
        grad_w, grad_b = _hand_fc_gradient(snapshot)
        torch.testing.assert_close(grads["fc.weight"].double(), grad_w)  # the hand formula holds
        # ||g_t^j|| = sqrt(sum_d dW[j, d]^2 + db[j]^2)
        per_step.append((grad_w.pow(2).sum(1) + grad_b.pow(2)).sqrt())
    per_step = torch.stack(per_step)
    stats = loop.gradient_statistics()
    assert stats["trace"].shape == (8, C)
    np.testing.assert_allclose(stats["trace"], per_step.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(stats["mean"], per_step.mean(0).numpy(), rtol=1e-5, atol=1e-7)
    # Batch mask: a class absent from a batch has a zero row that step (task 0 never sees 2..5).
    assert np.all(stats["trace"][:2, 2:] == 0)


def test_gradient_trace_can_be_switched_off() -> None:
    loop = make_loop({**BASE_CONFIG, "grad_trace": False})
    loop.train_step(torch.randn(2, D_IN), torch.tensor([0, 1]))
    stats = loop.gradient_statistics()
    assert "trace" not in stats
    assert stats["mean"].shape == (C,)


# --------------------------------------------------------------------------- reproducibility


def _full_run(seed: int, device="cpu"):
    train_x, train_y, test_x, test_y = make_data()
    stream = make_stream(train_y)
    config = {**BASE_CONFIG, "online_prototypes": True, "fgh": {"gamma": 1}}
    loop = make_loop(config, seed=seed, device=device)
    source = VectorSource(train_x, train_y, test_x, test_y)
    session = OnlineSession(loop, stream, source, BASE_CONFIG, progress=False)
    for task in range(stream.num_tasks):
        session.train_task(task)
        session.evaluate_task_end(task)
    results = session.results()
    return params(loop), results, loop.gradient_statistics()["trace"]


def test_same_seed_gives_identical_parameters_and_metrics(device) -> None:
    params_a, results_a, trace_a = _full_run(seed=0, device=device)
    params_b, results_b, trace_b = _full_run(seed=0, device=device)
    params_c, _, _ = _full_run(seed=1, device=device)
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
    assert any(not torch.equal(params_a[n], params_c[n]) for n in params_a)  # seed matters
    assert results_a["metrics"] == results_b["metrics"]
    assert results_a["counters"] == results_b["counters"]
    assert results_a["extra"]["diagnostics"] == results_b["extra"]["diagnostics"]
    assert np.array_equal(trace_a, trace_b)


# --------------------------------------------------------------------------- GPU state (issue 15)


def test_gradient_trace_is_stored_as_float32_on_every_device(device) -> None:
    """CUDA runs kept the trace as float16 (3 significant digits) and CPU runs in the model's
    dtype: CPU and GPU results files differed. A float64 classifier shows the rule on the CPU."""
    torch.manual_seed(0)
    network = TinyNet().double()
    loop = build_loop(TinyAdapter(), network, BASE_CONFIG, C, device)
    x = torch.randn(4, D_IN, dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 3])
    fc = loop.network.fc
    with torch.no_grad():  # the classifier's gradient by hand, before the step moves it
        h = torch.relu(loop.network.body(x.to(device))).cpu()
        grad_w, grad_b = _hand_fc_gradient(
            {"features": h, "labels": labels, "weight": fc.weight.cpu(), "bias": fc.bias.cpu()}
        )
    loop.train_step(x, labels)
    trace = loop.state_dict()["grad_trace"]
    assert trace.dtype == torch.float32 and trace.shape == (1, C)
    expected = (grad_w.pow(2).sum(1) + grad_b.pow(2)).sqrt()  # ||g^j||, float64
    torch.testing.assert_close(trace[0].cpu(), expected.float(), rtol=1e-6, atol=0)
    assert (trace[0].cpu() > 0).tolist() == [True, True, False, True, False, False]


class PrecisionSpy(TinyAdapter):
    """Records torch's float32 matmul precision and cuDNN's TF32 switch in every forward."""

    seen: list

    def forward(self, network, x, train):
        self.seen.append(
            (train, torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
        )
        return super().forward(network, x, train)


@pytest.mark.parametrize("mode, tf32", [("highest", False), ("high", True), ("medium", True)])
def test_matmul_precision_applies_to_steps_and_evaluation_and_is_restored(mode, tf32) -> None:
    assert smoke_config("coda_online")["matmul_precision"] == "highest"  # the default
    adapter = PrecisionSpy()
    adapter.seen = []
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    outside = ("medium" if mode != "medium" else "high", not tf32)  # differs from the run's
    torch.set_float32_matmul_precision(outside[0])
    torch.backends.cudnn.allow_tf32 = outside[1]
    try:
        loop = make_loop({**BASE_CONFIG, "matmul_precision": mode}, adapter=adapter)
        loop.train_step(torch.randn(2, D_IN), torch.tensor([0, 1]))
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == outside
        batches = [(torch.randn(3, D_IN), torch.tensor([0, 1, 0]))]
        loop.predict(batches, torch.ones(C, dtype=torch.bool), topk=1)
        assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == outside
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
    assert adapter.seen == [(True, mode, tf32), (False, mode, tf32)]


def test_matmul_precision_is_validated() -> None:
    with pytest.raises(ConfigError, match="did you mean 'high'"):
        smoke_config("coda_online", matmul_precision="hihg")
    with pytest.raises(ValueError, match="matmul_precision"):
        make_loop({**BASE_CONFIG, "matmul_precision": "tf32"})


def test_loss_terms_without_the_classification_term_are_refused_by_name() -> None:
    class Forgetful(TinyAdapter):
        def loss_terms(self, network, out, batch):
            return {"kd": out.logits.sum()}  # forgot super().loss_terms(...)

    loop = make_loop(BASE_CONFIG, adapter=Forgetful())
    with pytest.raises(ValueError, match=r'Forgetful\.loss_terms returned \[.kd.\], without.*"ce"'):
        loop.train_step(torch.randn(4, D_IN), torch.tensor([0, 1, 2, 3]))

"""The engine teacher (``engine/teacher.py``): a frozen snapshot of the network taken at each
consolidation firing, before the method's boundary step, run on every training batch, and kept
by the loop's checkpoints. The distilling ports (iCaRL, COIL, DGR) stand on it; these tests hold
the engine to its contract with a tiny network whose numbers are worked out by hand."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyAdapter, TinyNet, unit_config

from pilot_online.engine.adapter import Consolidated, Consolidation
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.teacher import Teacher, teacher_bytes
from pilot_online.harness.estimate import method_flops, run_flops

C = 6


class Distilling(TinyAdapter):
    """Distils the teacher's logits over the known classes (squared error, weight 1); its
    boundary step doubles the head's bias, so a snapshot taken after it would show that."""

    consolidation = Consolidation(trigger="every_n_samples", teacher=True)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batches = []

    def consolidate(self, network, firing):
        with torch.no_grad():
            network.fc.bias.mul_(2.0)
        return Consolidated()

    def loss_terms(self, network, out, batch):
        self.batches.append(batch)
        terms = super().loss_terms(network, out, batch)
        if batch.teacher is None:
            return terms
        known = batch.known
        terms["kd"] = F.mse_loss(out.logits[:, known], batch.teacher.logits[:, known])
        return terms


def config(**overrides):
    return unit_config(
        Distilling,
        C,
        consolidation="every_n_samples",
        consolidation_every_n_samples=4,
        **overrides,
    )


def make_loop(device="cpu", frozen_body=False, **overrides):
    torch.manual_seed(0)
    cfg = config(frozen_body=frozen_body, **overrides)
    adapter = Distilling(args=cfg)
    return build_loop(adapter, adapter.build_network(cfg), cfg, C, device)


X = torch.randn(12, 5, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5])


def step(loop, i):
    rows = slice(4 * i, 4 * i + 4)
    return loop.train_step(X[rows], Y[rows], np.arange(4 * i, 4 * i + 4))


def test_no_teacher_before_the_first_firing_and_known_is_empty():
    loop = make_loop()
    step(loop, 0)
    batch = loop.adapter.batches[-1]
    assert batch.teacher is None and loop.teacher is None
    assert not batch.known.any()
    assert batch.seen.tolist() == [True, True, False, False, False, False]


def test_the_snapshot_is_the_state_before_the_boundary_step():
    loop = make_loop()
    step(loop, 0)
    before = copy.deepcopy(loop.network.state_dict())
    step(loop, 1)  # fires first: snapshot, then the bias doubles, then this batch trains
    teacher = loop.teacher.module
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, before[name]), f"the snapshot's {name} is not the task-end state"
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    assert not teacher.training
    assert loop.teacher.classes.tolist() == [True, True, False, False, False, False]
    batch = loop.adapter.batches[-1]
    assert batch.known.tolist() == [True, True, False, False, False, False]
    # The teacher's outputs on the batch are the snapshot's forward, by hand: fc(relu(body(x))).
    net = TinyNet()
    net.load_state_dict(before)
    expected = net.fc(torch.relu(net.body(X[4:8])))
    torch.testing.assert_close(batch.teacher.logits, expected, rtol=0, atol=0)


def test_the_distillation_term_is_the_hand_computed_one():
    """At the firing step the student is the snapshot with its head bias doubled, so each known
    class's logit exceeds the teacher's by the teacher's bias: mean((z - t)^2) = mean(b_known^2)."""
    loop = make_loop()
    step(loop, 0)
    stats = step(loop, 1)
    bias = loop.teacher.module.fc.bias
    assert stats.terms["kd"].item() == pytest.approx((bias[:2] ** 2).mean().item(), rel=1e-6)


def test_a_new_firing_replaces_the_snapshot():
    loop = make_loop()
    for i in range(3):
        step(loop, i)
    assert loop.teacher.firing == 1
    assert loop.teacher.classes.tolist() == [True, True, True, True, False, False]


def test_the_checkpoint_keeps_only_what_differs_from_the_network():
    loop = make_loop(frozen_body=True)
    step(loop, 0)
    step(loop, 1)
    step(loop, 2)  # the head trained on after the snapshot; the frozen body never changes
    saved = loop.state_dict()["teacher"]
    assert sorted(saved["same"]) == ["body.bias", "body.weight"]
    assert sorted(saved["differs"]) == ["fc.bias", "fc.weight"]


def test_a_resume_restores_the_teacher_and_the_next_step_bit_for_bit():
    loop = make_loop()
    for i in range(2):
        step(loop, i)
    state = copy.deepcopy(loop.state_dict())
    resumed = make_loop()
    resumed.load_state_dict(state)
    for name, value in loop.teacher.module.state_dict().items():
        assert torch.equal(resumed.teacher.module.state_dict()[name], value)
    assert torch.equal(resumed.known, loop.known) and resumed.teacher.firing == 0
    a, b = step(loop, 2), step(resumed, 2)
    assert torch.equal(a.loss, b.loss)
    for p, q in zip(loop.network.parameters(), resumed.network.parameters()):
        assert torch.equal(p, q)


def test_a_checkpoint_of_another_structure_is_refused():
    loop = make_loop()
    step(loop, 0), step(loop, 1)
    state = loop.state_dict()
    del state["teacher"]["differs"]["fc.bias"]
    with pytest.raises(ValueError, match="teacher does not fit the network's structure"):
        Teacher.from_state(make_loop().network, state["teacher"])


def test_the_teacher_lives_on_the_loops_device(device):
    loop = make_loop(device=device)
    step(loop, 0), step(loop, 1)
    assert {p.device.type for p in loop.teacher.module.parameters()} == {device.type}
    state = loop.state_dict()
    cpu_state = {  # as load_checkpoint maps every tensor to the CPU
        **state,
        "teacher": {
            **state["teacher"],
            "differs": {k: v.cpu() for k, v in state["teacher"]["differs"].items()},
            "classes": state["teacher"]["classes"].cpu(),
        },
    }
    resumed = make_loop(device=device)
    resumed.load_state_dict(cpu_state)
    assert {p.device.type for p in resumed.teacher.module.parameters()} == {device.type}
    assert resumed.teacher.classes.device.type == device.type


def test_doctor_and_the_flop_model_count_the_teacher(monkeypatch):
    # A ViT-B/16 (85,798,656 parameters) and a 100-class head of 768 + 1 inputs, fp32.
    assert teacher_bytes(100) == 4 * (85_798_656 + 100 * 769)
    import pilot_online.engine.flops as flops  # the FLOP model's arithmetic (harness/estimate's)

    cfg = {"model_name": "er_online", "dataset": "cifar224", "batch_size": 100}
    counts = method_flops("er_online")
    base = run_flops(cfg)["train"]
    monkeypatch.setattr(flops, "keeps_teacher", lambda method: True)
    with_teacher = run_flops(cfg)["train"]
    # ER replays 100 per 100 stream images: the teacher's forward runs on 2 images per stream
    # image, a test forward each, over CIFAR-100's 50,000 training images.
    assert with_teacher - base == pytest.approx(50_000 * 2 * counts["test_flops_per_image"])

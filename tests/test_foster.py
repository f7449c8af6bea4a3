"""``foster_online``'s behaviour: the class weights and BKD against hand computations, the branch
structure and freezing at firings, the loop's adoption of what they add, and a checkpoint round
trip across firings, bit for bit.

The network is PILOT's ``FOSTERNet`` around a one-block, 16-wide ViT (PILOT's ``get_backbone``
patched to return it), so that a stream through two firings takes seconds; the contract suite
runs the real smoke ViT. ``tests/test_upstream_foster.py`` holds the comparisons with upstream's
own code and reuses :func:`tiny_foster`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import raw_smoke_config, requires_pilot, smoke_config
from test_upstream_finetune import pilot_backbone
from torch import nn

from pilot_online import get_method
from pilot_online.engine.checkpoint import load_checkpoint, save_checkpoint
from pilot_online.engine.config import ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.teacher import distillation_loss
from pilot_online.methods.foster import (
    HERDING_FEATURES,
    effective_number_weights,
)

NUM_CLASSES, WIDTH = 8, 16


def tiny_vit() -> nn.Module:
    """A one-block ViT of width 16 on 32 px images, as PILOT's ``get_backbone`` returns ViTs."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(5)
    vit = VisionTransformer(
        img_size=32, patch_size=16, embed_dim=WIDTH, depth=1, num_heads=2, num_classes=0
    )
    vit.out_dim = WIDTH
    return vit.eval()


def tiny_foster(**overrides: Any) -> tuple[Any, nn.Module, dict[str, Any]]:
    """(adapter, network, config): the smoke config (``overrides`` on top) and our ``FOSTERNet``
    around :func:`tiny_vit` (needs ``pilot_on_path``)."""
    config = smoke_config("foster_online", num_classes=NUM_CLASSES, **overrides)
    adapter = get_method("foster_online")(args=config)
    with pilot_backbone(tiny_vit()):
        torch.manual_seed(0)
        network = adapter.build_network(config)
    return adapter, network, config


# -- the class weights and BKD, by hand ---------------------------------------------------------
def hand_weights(counts: list[int], beta: float) -> list[float]:
    """Upstream's ``per_cls_weights`` written out: ``(1 - beta) / (1 - beta**n)``, scaled to sum
    to the number of classes."""
    raw = [(1 - beta) / (1 - beta**n) for n in counts]
    return [w / sum(raw) * len(raw) for w in raw]


def test_class_weights_are_the_effective_number_formula():
    """20 exemplars against 500 samples at beta 0.96: 0.04 / (1 - 0.96**20) = 0.071685 and
    0.04, scaled to sum 2: 1.28369 and 0.71631. Classes outside the set get 1; a count of 0
    counts as 1 (weight (1 - beta) / (1 - beta) = 1 before scaling)."""
    counts = torch.tensor([20, 500, 0, 7, 3])
    classes = torch.tensor([True, True, False, True, True])
    weights = effective_number_weights(counts[:2], classes[:2], 0.96)
    torch.testing.assert_close(weights, torch.tensor([1.28369, 0.71631]), rtol=0, atol=1e-5)
    weights = effective_number_weights(counts, classes, 0.97)
    expected = hand_weights([20, 500, 7, 3], 0.97)
    torch.testing.assert_close(weights[[0, 1, 3, 4]], torch.tensor(expected), rtol=1e-6, atol=0)
    assert weights[2] == 1 and weights.dtype == torch.float32
    torch.testing.assert_close(
        effective_number_weights(torch.tensor([0, 1, 20]), torch.ones(3, dtype=torch.bool), 0.9),
        torch.tensor(hand_weights([1, 1, 20], 0.9)),
    )


class Statistics(nn.Module):
    """The buffers :meth:`FosterOnline.class_weights` reads, without a network around them."""

    def __init__(self, seen: list[int], known: list[int], stream: list[int]) -> None:
        super().__init__()
        mask = torch.zeros(NUM_CLASSES, dtype=torch.bool)
        self.register_buffer("seen_classes", mask.clone().index_fill_(0, torch.tensor(seen), 1))
        self.register_buffer("known_classes", mask.clone().index_fill_(0, torch.tensor(known), 1))
        self.register_buffer("stream_counts", torch.tensor(stream))


def test_class_counts_are_the_quota_of_known_classes_plus_their_stream_samples():
    """Known classes (0-3) count the memory's quota, min(er_memory_per_class 20, 200 // 8 seen
    = 25) = 20, plus their stream samples since the firing; the others their stream samples."""
    stats = Statistics(seen=list(range(8)), known=[0, 1, 2, 3], stream=[0, 0, 0, 2, 30, 30, 5, 0])
    adapter = get_method("foster_online")(args={"er_memory_size": 200, "er_memory_per_class": 20})
    expected = hand_weights([20, 20, 20, 22, 30, 30, 5, 1], 0.96)
    torch.testing.assert_close(adapter.class_weights(stats, 0.96), torch.tensor(expected))
    adapter.args["er_memory_per_class"] = None  # the quota is 200 // 8 = 25
    expected = hand_weights([25, 25, 25, 27, 30, 30, 5, 1], 0.96)
    torch.testing.assert_close(adapter.class_weights(stats, 0.96), torch.tensor(expected))
    partial = Statistics(seen=[0, 1, 4], known=[0, 1], stream=[0, 0, 0, 0, 9, 0, 0, 0])
    weights = adapter.class_weights(partial, 0.96)  # quota 200 // 3 = 66; unseen classes 1
    torch.testing.assert_close(weights[[0, 1, 4]], torch.tensor(hand_weights([66, 66, 9], 0.96)))
    assert (weights[[2, 3, 5, 6, 7]] == 1).all()


def hand_bkd(student, teacher, columns, temperature, weights=None) -> float:
    """BKD written out over ``columns``: q = softmax(teacher / T) * w, renormalised; the loss is
    -sum(q * log softmax(student / T)) over the rows, divided by the rows."""
    total = 0.0
    for s_row, t_row in zip(student, teacher):
        s = [s_row[c] / temperature for c in columns]
        t = [t_row[c] / temperature for c in columns]
        log_z = math.log(sum(math.exp(v) for v in s))
        q = [math.exp(v) for v in t]
        q = [v * (1.0 if weights is None else weights[c]) for v, c in zip(q, columns)]
        total -= sum(qi / sum(q) * (si - log_z) for qi, si in zip(q, s))
    return total / len(student)


def test_bkd_matches_a_hand_computation():
    student = [[1.0, -0.5, 2.0, 0.3], [0.2, 0.1, -1.0, 1.5]]
    teacher = [[0.5, 1.5, -0.2, 0.0], [2.0, -1.0, 0.4, 0.7]]
    weights = [0.5, 1.0, 2.0, 1.5]
    s, t, w = torch.tensor(student), torch.tensor(teacher), torch.tensor(weights)
    every = torch.ones(4, dtype=torch.bool)
    ours = distillation_loss(s, t, every, 2.0, w)
    assert ours.item() == pytest.approx(hand_bkd(student, teacher, range(4), 2.0, weights), 1e-6)
    some = torch.tensor([True, False, True, True])  # a column outside: as if never there
    ours = distillation_loss(s, t, some, 2.0, w)
    assert ours.item() == pytest.approx(hand_bkd(student, teacher, [0, 2, 3], 2.0, weights), 1e-6)
    ours = distillation_loss(s, t, some, 0.5)  # no weights: upstream's _KD_loss
    assert ours.item() == pytest.approx(hand_bkd(student, teacher, [0, 2, 3], 0.5), 1e-6)
    nothing = distillation_loss(s.requires_grad_(), t, torch.zeros(4, dtype=torch.bool), 2.0)
    nothing.backward()
    assert nothing.item() == 0 and s.grad.abs().max() == 0  # no known class: no term, no NaN


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("beta1", 1.0, "beta1 must be below 1"),
        ("consolidation", "never", "never boosts"),
        ("is_teacher_wa", True, "cannot be used online"),
        ("boosting_epochs", 20, "boosting trains on each step"),
        ("oofc", "zero", "oofc"),
    ],
)
def test_bad_keys_are_refused_by_name(key, value, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config({**raw_smoke_config("foster_online"), key: value})


# -- the firings, on the network ----------------------------------------------------------------
SEEN_BEFORE = [0, 1, 2, 3]


def after_first_firing(built) -> nn.Module:
    """A copy of the built network that has seen classes 0-3, after the first firing."""
    adapter, network, _ = built
    network = copy.deepcopy(network)
    network.seen_classes[SEEN_BEFORE] = True
    network.stream_counts[:4] = 5
    adapter.consolidate(network, 0)
    return network


@pytest.fixture(scope="module")
def built(pilot_on_path: Path) -> Iterator[tuple[Any, nn.Module, dict[str, Any]]]:
    yield tiny_foster(online_prototypes=False, fgh=None)


@requires_pilot
def test_first_firing_adds_a_frozen_old_branch_a_copy_and_the_student(built):
    adapter, network, _ = built
    before = copy.deepcopy(network)
    grown = after_first_firing(built)
    old, new = grown.backbones
    state = before.backbones[0].state_dict()
    for module in (old, new, grown.snet.backbones[0]):
        assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
    assert not any(p.requires_grad for p in old.parameters())
    assert all(p.requires_grad for p in [*new.parameters(), *grown.snet.parameters()])
    assert not any(p.requires_grad for p in grown.oldfc.parameters())
    torch.testing.assert_close(grown.oldfc.weight, before.fc.weight, rtol=0, atol=0)
    # fc over both branches: the known classes' old-feature block is the old head's rows.
    assert grown.fc.weight.shape == (NUM_CLASSES, 2 * WIDTH) and grown.fc.weight.requires_grad
    known = torch.tensor(SEEN_BEFORE)
    assert torch.equal(grown.fc.weight[known, :WIDTH], before.fc.weight[known])
    assert torch.equal(grown.fc.bias[known], before.fc.bias[known])
    assert (grown.fc.bias[4:] == 0).all() and not torch.equal(
        grown.fc.weight[4:, :WIDTH], before.fc.weight[4:]
    )  # new classes' rows drawn afresh (SimpleLinear: zero bias)
    bound = math.sqrt(3 / (2 * WIDTH))  # kaiming uniform, gain 1
    assert grown.fc.weight[:, WIDTH:].abs().max() <= bound
    assert grown.fe_fc.weight.shape == (NUM_CLASSES, WIDTH) and (grown.fe_fc.bias == 0).all()
    # The student's head: copy_fc of the old head's known rows.
    assert torch.equal(grown.snet.fc.weight[known], before.fc.weight[known])
    assert torch.equal(grown.known_classes, grown.seen_classes)
    assert (grown.stream_counts == 0).all() and adapter.boosting(grown)


@requires_pilot
def test_later_firings_copy_the_student_into_both_branches_and_oldfc(built):
    adapter, _, _ = built
    grown = after_first_firing(built)
    with torch.no_grad():  # the student after a segment of training
        for p in grown.snet.parameters():
            p.add_(torch.randn_like(p))
    grown.seen_classes[[4, 5]] = True
    student = copy.deepcopy(grown.snet)
    branch_objects = [id(p) for p in grown.backbones.parameters()]
    restarted = list(adapter.consolidate(grown, 1).restarted)
    assert [id(p) for p in grown.backbones.parameters()] == branch_objects  # copied in place
    for module in (*grown.backbones, grown.snet.backbones[0]):
        for name, value in module.state_dict().items():
            assert torch.equal(value, student.backbones[0].state_dict()[name]), name
    assert not any(p.requires_grad for p in grown.backbones[0].parameters())
    assert all(p.requires_grad for p in grown.backbones[1].parameters())
    assert torch.equal(grown.oldfc.weight, student.fc.weight)  # every row of the student's head
    known = torch.tensor([0, 1, 2, 3, 4, 5])
    assert torch.equal(grown.known_classes, torch.isin(torch.arange(8), known))
    assert torch.equal(grown.fc.weight[known, :WIDTH], student.fc.weight[known])
    assert torch.equal(grown.snet.fc.weight[known], student.fc.weight[known])
    assert (grown.snet.fc.bias[6:] == 0).all()  # rows of classes not seen: drawn afresh
    assert {id(p) for p in grown.backbones[1].parameters()} <= {id(p) for p in restarted}


@requires_pilot
def test_oofc_az_keeps_the_new_rows_old_block_at_zero(pilot_on_path):
    """``oofc: az``: the rows of classes not known at the firing are 0 in the old-feature block,
    and stay 0 through a step (their gradient is zeroed before FGH and the optimiser)."""
    adapter, network, config = tiny_foster(oofc="az", online_prototypes=False)
    network.seen_classes[SEEN_BEFORE] = True
    adapter.consolidate(network, 0)
    assert (network.fc.weight[4:, :WIDTH] == 0).all()
    assert (network.fc.weight[:4, :WIDTH] != 0).all()
    loop = build_loop(adapter, network, {**config, "er_memory_size": 0}, NUM_CLASSES)
    x = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    loop.train_step(x, torch.tensor([0, 1, 4, 5, 6, 7]))
    assert (network.fc.weight[4:, :WIDTH] == 0).all()
    assert (network.fc.weight.grad[4:, :WIDTH] == 0).all()
    assert network.fc.weight.grad[4:, WIDTH:].abs().sum() > 0


@requires_pilot
def test_the_student_learns_from_bkd_alone_and_the_old_branch_from_nothing(built):
    """Each term reaches what upstream's reaches: BKD the student only (the boosted logits are
    its detached target); CE, fe and KD the new branch and the heads, never the student, the
    old branch or oldfc."""
    adapter = built[0]
    grown = after_first_firing(built)
    x, y = torch.randn(5, 3, 32, 32), torch.tensor([0, 1, 4, 5, 4])
    from pilot_online.engine.adapter import TrainingBatch

    adapter.set_mode(grown, train=True)
    out = adapter.forward(grown, x, train=True)
    batch = TrainingBatch(x, y, 5, grown.seen_classes, grown.known_classes)
    terms = adapter.loss_terms(grown, out, batch)
    ce = terms["ce"]
    assert set(terms) == {"ce", "fe", "kd", "bkd"}
    student = [p for p in grown.snet.parameters()]
    boosted = [*grown.backbones[1].parameters(), *grown.fc.parameters(), *grown.fe_fc.parameters()]
    grads = torch.autograd.grad(terms["bkd"], student + boosted, allow_unused=True)
    assert all(g is not None for g in grads[: len(student)])
    assert all(g is None for g in grads[len(student) :])
    rest = ce + terms["fe"] + terms["kd"]
    grads = torch.autograd.grad(rest, student + boosted, allow_unused=True)
    assert all(g is None for g in grads[: len(student)])
    assert all(g is not None for g in grads[len(student) :])
    assert out.extras[HERDING_FEATURES].shape == (5, WIDTH)  # herding: the student's features
    assert not any(
        p.requires_grad for p in [*grown.backbones[0].parameters(), *grown.oldfc.parameters()]
    )


# -- a stream through two firings, and a checkpoint between them ---------------------------------
#: Batches of 8: classes 0-1, then 2-3 (the first firing, consolidation_new_classes 2), a mix,
#: then 4-5 (the second firing), a mix.
STREAM_LABELS = [[0, 1] * 4, [2, 3] * 4, [0, 1, 2, 3] * 2, [4, 5] * 4, [0, 2, 4, 5, 1, 3, 4, 5]]
STREAM_CONFIG = {
    "consolidation_new_classes": 2,
    "er_memory_size": 40,
    "er_memory_per_class": 5,
    "er_batch_size": 4,
}
LABELS = torch.tensor([label for batch in STREAM_LABELS for label in batch])
IMAGES = torch.randn(len(LABELS), 3, 32, 32, generator=torch.Generator().manual_seed(9))


def stream_loop(adapter, network, config):
    loop = build_loop(adapter, network, config, NUM_CLASSES)
    loop.attach_samples(lambda indices: (IMAGES[indices], LABELS[indices]))
    return loop


def take(loop, step: int):
    indices = np.arange(8 * step, 8 * step + 8)
    return loop.train_step(IMAGES[indices], LABELS[indices], indices)


@pytest.fixture(scope="module")
def streamed(pilot_on_path: Path, tmp_path_factory) -> dict[str, Any]:
    """+ P + FGH with herding replay through the stream; a checkpoint after step 2 (between
    the firings), restored into a freshly built network that takes steps 3 and 4 as well."""
    adapter, network, config = tiny_foster(**STREAM_CONFIG)
    mapped = []
    original = adapter.lineage_twice

    def spy(net, means):
        result = original(net, means)
        mapped.append((means.clone(), net.lineage_means.means.clone(), result.clone()))
        return result

    adapter.lineage_twice = spy
    loop = stream_loop(adapter, network, config)
    losses, names = [], []
    for step in range(3):
        losses.append(take(loop, step).loss)
        names.append([n for n, _ in loop.named_parameters])
    path = tmp_path_factory.mktemp("foster") / "foster.ckpt.pt"
    save_checkpoint(path, loop.state_dict(), config)
    rng = torch.get_rng_state()
    for step in (3, 4):
        losses.append(take(loop, step).loss)
    fresh_adapter, fresh_network, _ = tiny_foster(**STREAM_CONFIG)
    resumed = stream_loop(fresh_adapter, fresh_network, config)
    resumed.load_state_dict(load_checkpoint(path, config))
    torch.set_rng_state(rng)
    resumed_losses = [take(resumed, step).loss for step in (3, 4)]
    return {
        "loop": loop,
        "resumed": resumed,
        "losses": losses,
        "resumed_losses": resumed_losses,
        "names": names,
        "mapped": mapped,
    }


@requires_pilot
def test_the_loop_adopts_and_replaces_what_the_firings_add(streamed):
    loop = streamed["loop"]
    assert loop.trigger.firings == [8, 24]
    first, second = streamed["names"][0], streamed["names"][1]
    added = [n for n in second if n not in first]
    assert {n.split(".")[0] for n in added} == {"backbones", "fe_fc", "snet"}
    assert all(n.startswith(("backbones.1.", "fe_fc.", "snet.")) for n in added)
    everything = dict(loop.network.named_parameters())
    current = dict(loop.named_parameters)
    for name in ("fc.weight", "fe_fc.weight", "snet.fc.weight"):
        assert current[name] is everything[name]  # the heads drawn at the last firing
    in_optimiser = {id(p) for g in loop.optimizer.param_groups for p in g["params"]}
    assert id(everything["fc.weight"]) in in_optimiser
    frozen = [p for n, p in current.items() if n.startswith("backbones.0.")]
    assert frozen and all(not p.requires_grad and p not in loop.optimizer.state for p in frozen)
    assert [p.shape for p in loop.fgh.param_groups[0]["params"]] == [(8, 32), (8,)]
    assert all(len(v) <= 5 for v in loop.memory.features.values())
    assert {v.shape[1] for v in loop.memory.features.values()} == {WIDTH}  # the student's width


@requires_pilot
def test_prototypes_carry_over_as_the_lineage_means_twice(streamed):
    """At the first firing the lineage is the only branch: P's means, repeated, bit for bit. At
    the second, the student's running means, repeated (the boosted means are dropped)."""
    (means, lineage, result), (_, lineage2, result2) = streamed["mapped"]
    assert means.shape == (NUM_CLASSES, WIDTH) and torch.equal(means, lineage)
    assert torch.equal(result, torch.cat([means, means], 1))
    assert torch.equal(result2, torch.cat([lineage2, lineage2], 1))


@requires_pilot
def test_checkpoint_round_trip_across_firings_is_bit_exact(streamed):
    loop, resumed = streamed["loop"], streamed["resumed"]
    assert resumed.trigger.firings == loop.trigger.firings == [8, 24]
    for ours, theirs in zip(streamed["losses"][3:], streamed["resumed_losses"]):
        assert torch.equal(ours, theirs)
    theirs = resumed.network.state_dict()
    for name, value in loop.network.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    a, b = loop.adapter.state_dict(loop.network), resumed.adapter.state_dict(resumed.network)
    assert a["firings"] == b["firings"] == 2
    assert all(torch.equal(a["oldfc"][k], b["oldfc"][k]) for k in a["oldfc"])
    assert torch.equal(loop.prototypes.means, resumed.prototypes.means)
    assert loop.memory.state_dict()["indices"].tolist() == (
        resumed.memory.state_dict()["indices"].tolist()
    )

"""``der_online``'s behaviour (``pilot_online/methods/der.py``) on a toy network of ``DERNet``'s
shape (``backbones`` -> concatenated features, ``fc`` -> logits, ``aux_fc`` on the newest
branch), through the online loop with + P + FGH and its herding memory: the auxiliary loss and
the head's growth worked out by hand, what a firing adds and freezes, the prototypes and herding
features mapped exactly at the firing, a checkpoint across firings resumed bit for bit, the
memory estimate, and bad keys refused. (tests/test_upstream_der.py runs upstream's own code.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import build_smoke_method, raw_smoke_config, requires_pilot, unit_config
from torch import nn

from pilot_online.core.memory import normalized
from pilot_online.engine.backbone_names import VIT_B16_PARAMETERS
from pilot_online.engine.checkpoint import load_checkpoint, save_checkpoint
from pilot_online.engine.config import PAPER_FGH, ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.methods.der import (
    DEROnline,
    auxiliary_loss,
    repeat_last_branch,
    widened_head,
)

C, WIDTH = 6, 4
#: Six stream batches of four: classes 0-1 twice, 2-3 (the trigger fires before it: a third
#: class since the last firing), 0-3 (old and new), 4-5 (fires again), then all.
LABELS = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 2, 3, 3, 2, 0, 2, 1, 3, 4, 5, 4, 5, 1, 5, 4, 0])
X = torch.randn(len(LABELS), 5, generator=torch.Generator().manual_seed(1))


class TinyDER(nn.Module):
    """``DERNet`` at toy size, as ``DEROnline.first_update_fc`` leaves it: one branch (with a
    dropout, so train and eval modes differ), a head over every class and an auxiliary head over
    every class plus "old"."""

    def __init__(self) -> None:
        super().__init__()
        branch = nn.Sequential(nn.Linear(5, WIDTH), nn.Tanh(), nn.Dropout(0.5))
        self.backbones = nn.ModuleList([branch])
        self.out_dim = WIDTH
        self.fc = nn.Linear(WIDTH, C)
        self.aux_fc = nn.Linear(WIDTH, C + 1)


def make_loop(**overrides):
    config = unit_config(
        DEROnline,
        C,
        consolidation="new_classes",
        consolidation_new_classes=2,
        er_memory_size=6,
        er_batch_size=2,
        online_prototypes=True,
        fgh=dict(PAPER_FGH),
        optimizer="adam",
        init_lr=1e-2,
        logit_mask="batch",
        **overrides,
    )
    torch.manual_seed(0)
    adapter = DEROnline(args=config)
    network = TinyDER()
    adapter.grown_at = []
    loop = build_loop(adapter, network, config, C)
    loop.attach_samples(lambda indices: (X[torch.as_tensor(indices)], LABELS[indices]))
    return loop


def step(loop, i: int):
    rows = np.arange(4 * i, 4 * i + 4)
    return loop.train_step(X[rows], LABELS[rows], rows)


# -- the pieces, by hand -----------------------------------------------------------------------
def test_auxiliary_loss_targets_old_for_known_classes_and_masks_the_rest():
    """Classes 0 and 1 known; the batch holds 0, 2, 3 (mask "batch"). Row 0 (class 0) targets
    "old" (column 0), rows 1 and 2 columns 3 and 4; the softmax covers columns 0, 3, 4."""
    logits = torch.tensor(
        [
            [1.0, 5.0, 5.0, 0.0, 2.0, 9.0, 9.0],
            [0.0, 9.0, 9.0, 3.0, 1.0, 9.0, 9.0],
            [2.0, 9.0, 9.0, 0.0, 0.0, 9.0, 9.0],
        ]
    )
    labels = torch.tensor([0, 2, 3])
    known = torch.tensor([True, True, False, False, False, False])
    allowed = torch.tensor([True, False, True, True, False, False])
    loss = auxiliary_loss(logits, labels, known, allowed)

    def nll(row: list[float], target: int) -> float:
        return -row[target] + math.log(sum(math.exp(v) for v in row))

    expected = (nll([1.0, 0.0, 2.0], 0) + nll([0.0, 3.0, 1.0], 1) + nll([2.0, 0.0, 0.0], 2)) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    # Without a mask ("none"): "old" and every class not known.
    loss = auxiliary_loss(logits, labels, known, None)
    expected = (
        nll([1.0, 0.0, 2.0, 9.0, 9.0], 0)
        + nll([0.0, 3.0, 1.0, 9.0, 9.0], 1)
        + nll([2.0, 0.0, 0.0, 9.0, 9.0], 2)
    ) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_repeat_last_branch_by_hand():
    rows = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert repeat_last_branch(rows, 2, 3).tolist() == [[1.0, 2.0, 3.0, 4.0, 3.0, 4.0]]
    assert repeat_last_branch(rows, 2, 2).tolist() == rows.tolist()
    with pytest.raises(ValueError, match="whole number of branches"):
        repeat_last_branch(rows, 3, 3)


def test_widened_head_keeps_every_row_and_draws_the_new_columns_as_simple_linear():
    head = nn.Linear(4, 3)
    wide = widened_head(head, 8, torch.Generator().manual_seed(5))
    assert (wide.in_features, wide.out_features) == (8, 3)
    assert torch.equal(wide.weight[:, :4], head.weight) and torch.equal(wide.bias, head.bias)
    assert wide.weight is not head.weight and wide.weight.requires_grad
    bound = math.sqrt(3 / 8)  # Kaiming uniform, linear gain, fan-in 8: SimpleLinear's draw
    assert float(wide.weight[:, 4:].detach().abs().max()) <= bound
    again = widened_head(head, 8, torch.Generator().manual_seed(5))
    assert torch.equal(again.weight, wide.weight)


# -- through the loop ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grown():
    """Four steps (one firing, before step 2), with what the firing step saw recorded right
    before its forward pass (after the loop swapped the head in and mapped P and the memory)."""
    loop = make_loop()
    adapter, network = loop.adapter, loop.network
    recorded = {}
    set_mode = adapter.set_mode

    def record(net, train):
        set_mode(net, train)
        if train and len(loop.trigger.firings) == 1 and "means" not in recorded:
            recorded["means"] = loop.prototypes.means.clone()
            recorded["features"] = {c: v.copy() for c, v in loop.memory.features.items()}
            recorded["memory_means"] = {c: v.copy() for c, v in loop.memory.means.items()}
            recorded["new_branch"] = [p.detach().clone() for p in net.backbones[1].parameters()]
            recorded["fc"] = net.fc.weight.detach().clone()
            recorded["training"] = [m.training for m in net.backbones]
            recorded["fc_state"] = loop.optimizer.state.get(net.fc.weight)
            recorded["alpha"] = loop.fgh.coefficients()

    adapter.set_mode = record
    stats = [step(loop, 0), step(loop, 1)]
    before = {
        "means": loop.prototypes.means.clone(),
        "features": {c: v.copy() for c, v in loop.memory.features.items()},
        "memory_means": {c: v.copy() for c, v in loop.memory.means.items()},
        "fc": network.fc.weight.detach().clone(),
        "fc_bias": network.fc.bias.detach().clone(),
        "branch": [p.detach().clone() for p in network.backbones[0].parameters()],
        "alpha": loop.fgh.coefficients(),
    }
    stats += [step(loop, 2), step(loop, 3)]
    adapter.set_mode = set_mode
    return loop, before, recorded, stats


def test_a_firing_adds_a_branch_copied_from_the_last_and_widens_the_head(grown):
    loop, before, recorded, _ = grown
    network = loop.network
    assert loop.trigger.firings == [8] and len(network.backbones) == 2
    assert loop.adapter.grown_at == [0]
    assert network.fc.in_features == 2 * WIDTH and network.aux_fc.out_features == C + 1
    # At the firing the head held the old weights in its first columns, bit for bit.
    assert torch.equal(recorded["fc"][:, :WIDTH], before["fc"])
    # The new branch started as a copy of the old one, which has not changed since.
    assert all(torch.equal(a, b) for a, b in zip(recorded["new_branch"], before["branch"]))
    old = list(network.backbones[0].parameters())
    assert all(torch.equal(a, b) for a, b in zip(old, before["branch"]))
    assert loop.report()["method"] == {"branches": {"count": 2, "added_at_firings": [0]}}


def test_the_old_branch_is_frozen_gets_no_gradient_and_runs_in_eval_mode(grown):
    loop, _, recorded, _ = grown
    network = loop.network
    assert recorded["training"] == [False, True]
    assert not any(p.requires_grad for p in network.backbones[0].parameters())
    assert all(p.grad is None for p in network.backbones[0].parameters())
    assert all(p.requires_grad for p in network.backbones[1].parameters())
    assert not any(p in loop.optimizer.state for p in network.backbones[0].parameters())
    adopted = {id(p) for _, p in loop.named_parameters}
    assert all(id(p) in adopted for p in network.backbones[1].parameters())


def test_the_replaced_head_restarts_its_optimiser_state_and_keeps_fgh_alpha(grown):
    loop, before, recorded, _ = grown
    assert recorded["fc_state"] is None  # fresh state for the new head
    assert int(loop.optimizer.state[loop.network.fc.weight]["step"]) == 2  # steps 2 and 3
    alpha, kept = before["alpha"]["fc.weight"], recorded["alpha"]["fc.weight"]
    assert not torch.equal(alpha, torch.ones_like(alpha))  # two steps: FGH has moved it
    assert torch.equal(kept, alpha[:, :1].expand(C, 2 * WIDTH))  # one alpha per class row
    assert torch.equal(recorded["alpha"]["fc.bias"], before["alpha"]["fc.bias"])


def test_prototypes_and_herding_features_are_mapped_exactly_at_the_firing(grown):
    """The new branch's features equal the old one's at the firing, so each class mean extends
    by its last WIDTH columns; a stored herding vector v becomes [v, v] normalised (the
    normalised features the copy gives), its class mean m becomes [m, m] / sqrt(2)."""
    _, before, recorded, _ = grown
    expected = torch.cat([before["means"], before["means"]], dim=1)
    torch.testing.assert_close(recorded["means"], expected, rtol=0, atol=0)
    for c, vectors in before["features"].items():
        np.testing.assert_allclose(
            recorded["features"][c], normalized(np.hstack([vectors, vectors])), rtol=1e-12
        )
    for c, mean in before["memory_means"].items():
        mapped = np.hstack([mean, mean]) / math.sqrt(2)
        np.testing.assert_allclose(recorded["memory_means"][c], mapped, rtol=1e-12)


def test_the_new_branch_repeats_the_old_features_at_the_firing():
    """The exactness the mappings rely on: right after ``consolidate`` the features of the new
    branch are the last branch's, in training and in evaluation mode."""
    loop = make_loop()
    network = loop.network
    loop.adapter.consolidate(network, 0)
    for train in (False, True):
        loop.adapter.set_mode(network, train)
        if train:
            network.backbones[1].eval()  # dropout off: compare the weights' function
        with torch.no_grad():
            features = loop.adapter.forward(network, X[:4], train=train).features
        assert torch.equal(features[:, :WIDTH], features[:, WIDTH:])


def test_the_auxiliary_loss_starts_at_the_first_firing(grown):
    _, _, _, stats = grown
    assert "aux" not in stats[0].terms and "aux" not in stats[1].terms
    assert "aux" in stats[2].terms and "aux" in stats[3].terms


def test_a_checkpoint_across_firings_resumes_bit_for_bit(tmp_path):
    """After four steps (one firing), a loop rebuilt from the checkpoint file on a fresh toy
    network regrows the branch, the head's width and the frozen set, adopts them in the same
    order, and takes the next two steps (the first fires again) exactly as the original."""
    loop = make_loop()
    for i in range(4):
        step(loop, i)
    path = tmp_path / "der.ckpt.pt"
    save_checkpoint(path, loop.state_dict(), loop.config)
    resumed = make_loop()
    resumed.load_state_dict(load_checkpoint(path, loop.config))
    assert len(resumed.network.backbones) == 2 and resumed.adapter.grown_at == [0]
    assert resumed.network.fc.in_features == 2 * WIDTH
    assert not any(p.requires_grad for p in resumed.network.backbones[0].parameters())
    assert [n for n, _ in resumed.named_parameters] == [n for n, _ in loop.named_parameters]
    for i in (4, 5):
        torch.manual_seed(i)  # the same dropout draws (the session checkpoints the RNG)
        ours = step(loop, i)
        torch.manual_seed(i)
        theirs = step(resumed, i)
        assert torch.equal(theirs.loss, ours.loss)
    assert len(resumed.network.backbones) == 3 and loop.trigger.firings == [8, 16]
    assert resumed.trigger.firings == [8, 16]
    expected = loop.network.state_dict()
    for key, value in resumed.network.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert torch.equal(resumed.prototypes.means, loop.prototypes.means)


# -- the memory estimate and the keys --------------------------------------------------------------
def test_state_bytes_counts_one_vit_per_firing():
    """CIFAR-100 in tasks of 10: nine firings, nine more ViT-B/16s (fp32) beside the first."""
    args = {"nb_classes": 100, "consolidation": "new_classes", "consolidation_new_classes": 10}
    assert method_card("der_online").memory_bytes(args) == 9 * 4 * VIT_B16_PARAMETERS
    assert DEROnline.expected_branches({**args, "consolidation_new_classes": 20}) == 5
    every = {"nb_classes": 200, "consolidation": "every_n_samples", "init_cls": 10}
    assert DEROnline.expected_branches({**every, "increment": 10}) == 20


@requires_pilot
def test_the_smoke_build_is_upstreams_first_update_fc_with_two_blocks(pilot_on_path):
    """PILOT's ``DERNet`` after ``update_fc(nb_classes)``: one ViT-B (kept to ``vit_depth`` 2
    blocks), the head over every class on its 768 features, the auxiliary head over every class
    plus "old"; everything trains."""
    _, network, config = build_smoke_method("der_online", num_classes=8)
    assert config["vit_depth"] == 2 and len(network.backbones) == 1
    assert len(network.backbones[0].blocks) == 2
    assert (network.fc.in_features, network.fc.out_features) == (768, 8)
    assert (network.aux_fc.in_features, network.aux_fc.out_features) == (768, 9)
    assert not network.fc.bias.any()  # SimpleLinear's zero bias
    assert all(p.requires_grad for p in network.parameters())


def test_keys_are_checked():
    raw = raw_smoke_config("der_online")
    with pytest.raises(ConfigError, match="vit_depth"):
        resolve_config({**raw, "vit_depth": 13})
    with pytest.raises(ConfigError, match='consolidation "never" never adds a branch'):
        resolve_config({**raw, "consolidation": "never"})
    with pytest.raises(ConfigError, match="er_memory_size must be > 0"):
        resolve_config({**raw, "er_memory_size": 0})
    config = resolve_config(raw)
    assert (config["er_memory"], config["consolidation"]) == ("herding", "new_classes")


def test_the_paper_configs_default_to_a_whole_vit_learning_rate():
    from conftest import make_exps

    config = make_exps().paper_config("der", "fgh", blurry=False)
    assert config["init_lr"] == 5e-5 and config["er_memory_size"] == 2000
    assert config["er_memory"] == "herding" and config["optimizer"] == "adam"

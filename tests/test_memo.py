"""``memo_online``'s behaviour (``pilot_online/methods/memo.py``) on a toy network of
``AdaptiveNet``'s shape (shared generalized blocks, one specialized extractor per branch, the
heads of DER), through the online loop with + P + FGH and its herding memory: what a firing
freezes (the generalized blocks after the first, the older extractors) and what ``train_base``
and ``train_adaptive`` keep training, the auxiliary weight, the prototypes mapped exactly at the
firing, a checkpoint across firings resumed bit for bit, the trimmed extractor's size, and bad
keys refused. (tests/test_upstream_memo.py runs upstream's own code.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_smoke_method, raw_smoke_config, requires_pilot, unit_config
from torch import nn

from pilot_online.engine.checkpoint import load_checkpoint, save_checkpoint
from pilot_online.engine.config import PAPER_FGH, ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.methods.memo import (
    MEMO_BRANCH_PARAMETERS,
    MEMOOnline,
    specialized_trainable,
    trim_specialized,
)

C, WIDTH = 6, 4
#: As test_der.py: classes 0-1 twice, 2-3 (fires), 0-3, 4-5 (fires), all.
LABELS = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 2, 3, 3, 2, 0, 2, 1, 3, 4, 5, 4, 5, 1, 5, 4, 0])
X = torch.randn(len(LABELS), 5, generator=torch.Generator().manual_seed(2))


class TinySpecialized(nn.Module):
    """``Specialized_Vit`` at toy size: it builds an embedding and blocks it never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(5, WIDTH)
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH))
        self.last_block = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.5))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, base: torch.Tensor) -> torch.Tensor:
        return self.norm(self.last_block(base))


class TinyMEMO(nn.Module):
    """``AdaptiveNet`` at toy size, as ``MEMOOnline.build_network`` leaves it."""

    def __init__(self) -> None:
        super().__init__()
        self.TaskAgnosticExtractor = nn.Sequential(nn.Linear(5, WIDTH), nn.Tanh(), nn.Dropout(0.5))
        self.AdaptiveExtractors = nn.ModuleList([trim_specialized(TinySpecialized())])
        self.out_dim = WIDTH
        self.fc = nn.Linear(WIDTH, C)
        self.aux_fc = nn.Linear(WIDTH, C + 1)


def make_loop(**overrides):
    config = unit_config(
        MEMOOnline,
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
    adapter = MEMOOnline(args=config)
    adapter.grown_at = []
    loop = build_loop(adapter, TinyMEMO(), config, C)
    loop.attach_samples(lambda indices: (X[torch.as_tensor(indices)], LABELS[indices]))
    return loop


def step(loop, i: int):
    torch.manual_seed(i)  # dropout draws that depend on the step only
    rows = np.arange(4 * i, 4 * i + 4)
    return loop.train_step(X[rows], LABELS[rows], rows)


def snapshot(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def unchanged(module: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(module.parameters(), before))


def run(**overrides):
    """Two steps, a firing step, one more; the modules' snapshots at the firing step's start and
    their training flags in its forward pass."""
    loop = make_loop(**overrides)
    network = loop.network
    step(loop, 0), step(loop, 1)
    before = {
        "base": snapshot(network.TaskAgnosticExtractor),
        "first": snapshot(network.AdaptiveExtractors[0]),
        "means": loop.prototypes.means.clone(),
    }
    modes, set_mode = {}, loop.adapter.set_mode

    def record(net, train):
        set_mode(net, train)
        if train and loop.trigger.firings and not modes:
            modes["base"] = net.TaskAgnosticExtractor.training
            modes["extractors"] = [e.training for e in net.AdaptiveExtractors]
            modes["means"] = loop.prototypes.means.clone()

    loop.adapter.set_mode = record
    stats = [step(loop, 2), step(loop, 3)]
    loop.adapter.set_mode = set_mode
    return loop, before, modes, stats


@pytest.fixture(scope="module")
def default_run():
    return run()


def test_a_firing_freezes_the_generalized_blocks_and_the_older_extractor(default_run):
    loop, before, modes, _ = default_run
    network = loop.network
    assert loop.trigger.firings == [8] and len(network.AdaptiveExtractors) == 2
    assert network.fc.in_features == 2 * WIDTH
    assert modes["base"] is False and modes["extractors"] == [False, True]
    for module, key in (
        (network.TaskAgnosticExtractor, "base"),
        (network.AdaptiveExtractors[0], "first"),
    ):
        assert unchanged(module, before[key])
        assert not any(p.requires_grad for p in module.parameters())
        assert all(p.grad is None for p in module.parameters())
        assert not any(p in loop.optimizer.state for p in module.parameters())
    new = network.AdaptiveExtractors[1]
    trainable = {n for n, p in new.named_parameters() if p.requires_grad}
    assert trainable == {"last_block.0.weight", "last_block.0.bias", "norm.weight", "norm.bias"}
    assert all(p.grad is not None for p in new.parameters() if p.requires_grad)


def test_the_prototypes_are_mapped_exactly_at_the_firing(default_run):
    _, before, modes, _ = default_run
    expected = torch.cat([before["means"], before["means"]], dim=1)
    torch.testing.assert_close(modes["means"], expected, rtol=0, atol=0)


def test_train_base_and_train_adaptive_keep_the_older_modules_training():
    """Upstream's two keys: the generalized blocks (train_base) and the older extractors
    (train_adaptive) keep their gradients and training mode after a firing."""
    loop, before, modes, _ = run(train_base=True, train_adaptive=True)
    network = loop.network
    assert modes["base"] is True and modes["extractors"] == [True, True]
    assert not unchanged(network.TaskAgnosticExtractor, before["base"])
    assert not unchanged(network.AdaptiveExtractors[0], before["first"])
    assert network.AdaptiveExtractors[0].patch_embed.weight.grad is None  # never run


def test_alpha_aux_weighs_the_auxiliary_loss():
    """The same firing step with alpha_aux 1 and 0.25: the aux term scales by exactly 0.25."""
    terms = []
    for alpha in (1.0, 0.25):
        loop = make_loop(alpha_aux=alpha)
        for i in range(3):
            stats = step(loop, i)
        terms.append(stats.terms["aux"])
    assert float(terms[1]) == pytest.approx(0.25 * float(terms[0]), rel=1e-6)


def test_specialized_trainable_leaves_only_what_the_forward_runs():
    extractor = TinySpecialized()
    specialized_trainable(extractor)
    assert {n for n, p in extractor.named_parameters() if p.requires_grad} == {
        "last_block.0.weight",
        "last_block.0.bias",
        "norm.weight",
        "norm.bias",
    }
    trim_specialized(extractor)
    assert len(extractor.blocks) == 0


def test_a_checkpoint_across_firings_resumes_bit_for_bit(tmp_path):
    loop = make_loop()
    for i in range(4):
        step(loop, i)
    path = tmp_path / "memo.ckpt.pt"
    save_checkpoint(path, loop.state_dict(), loop.config)
    resumed = make_loop()
    resumed.load_state_dict(load_checkpoint(path, loop.config))
    network = resumed.network
    assert len(network.AdaptiveExtractors) == 2 and resumed.adapter.grown_at == [0]
    assert not any(p.requires_grad for p in network.TaskAgnosticExtractor.parameters())
    assert [n for n, _ in resumed.named_parameters] == [n for n, _ in loop.named_parameters]
    for i in (4, 5):
        assert torch.equal(step(resumed, i).loss, step(loop, i).loss)
    assert len(network.AdaptiveExtractors) == 3 and resumed.trigger.firings == [8, 16]
    expected = loop.network.state_dict()
    for key, value in network.state_dict().items():
        assert torch.equal(value, expected[key]), key


@requires_pilot
def test_the_trimmed_extractor_holds_memo_branch_parameters(pilot_on_path):
    """A ViT-B/16 ``Specialized_Vit`` at 224 px, trimmed: the count ``state_bytes`` uses."""
    from backbone.vit_memo import Specialized_Vit

    extractor = trim_specialized(Specialized_Vit(num_classes=0))
    assert sum(p.numel() for p in extractor.parameters()) == MEMO_BRANCH_PARAMETERS
    args = {"nb_classes": 100, "consolidation": "new_classes", "consolidation_new_classes": 10}
    assert method_card("memo_online").memory_bytes(args) == 9 * 4 * MEMO_BRANCH_PARAMETERS
    assert method_card("memo_online").memory_bytes(
        {**args, "train_adaptive": True}
    ) == 4 * 9 * 4 * (MEMO_BRANCH_PARAMETERS)


@requires_pilot
def test_the_smoke_build_splits_two_blocks_and_drops_the_dead_ones(pilot_on_path):
    """PILOT's ``AdaptiveNet`` after ``update_fc(nb_classes)`` at ``vit_depth`` 2: one
    generalized block, one specialized extractor without the blocks it never runs, its block
    and norm trainable, the generalized part trainable but its unread final norm."""
    _, network, _ = build_smoke_method("memo_online", num_classes=8)
    base, (extractor,) = network.TaskAgnosticExtractor, network.AdaptiveExtractors
    assert len(base.blocks) == 1 and len(extractor.blocks) == 0
    assert (network.fc.in_features, network.aux_fc.out_features) == (768, 9)
    trainable = {n.split(".")[0] for n, p in extractor.named_parameters() if p.requires_grad}
    assert trainable == {"last_block", "norm"}
    assert all(p.requires_grad for n, p in base.named_parameters() if not n.startswith("norm."))
    assert not base.norm.weight.requires_grad


def test_keys_are_checked():
    raw = raw_smoke_config("memo_online")
    for key, value, message in (
        ("vit_depth", 1, "no generalized block"),
        ("alpha_aux", -1.0, "alpha_aux"),
        ("train_base", "yes", "train_base"),
        ("consolidation", "never", 'consolidation "never" never adds a branch'),
    ):
        with pytest.raises(ConfigError, match=message):
            resolve_config({**raw, key: value})
    config = resolve_config(raw)
    assert (config["train_base"], config["train_adaptive"], config["alpha_aux"]) == (
        False,
        False,
        1.0,
    )
    assert config["backbone_type"] == "vit_base_patch16_224_memo"

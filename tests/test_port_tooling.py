"""What an outside port gets from the tooling without a checkout of this repository: its configs
(``pilot-online configs``), its FLOP counts (``pilot-online flops``, ``harness/flop_count.py``),
and a FLOP model and ``doctor`` that read those counts from its card.

Before: ``make_exps`` wrote built-in methods only, and the fix ``doctor`` named for a method
without counts edited the installed plugin's own FLOP table."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import TinyAdapter

from pilot_online.cli.main import main
from pilot_online.engine import flops, registry
from pilot_online.engine.backbone_names import PLAIN_VIT
from pilot_online.engine.card import MethodCard
from pilot_online.engine.config import PAPER_FGH, resolve_config
from pilot_online.harness.flop_count import card_literal, count_network
from pilot_online.methods.finetune import FinetuneOnline


class OutsidePort(FinetuneOnline):
    """Stands for a method from another package: fine-tuning's network, its own card."""


OUTSIDE_CARD = MethodCard(
    paper_name="Outside",
    backbone_types=PLAIN_VIT[1:],  # its own table: the in21k ViT first
    variants=("base", "fgh"),
    default_lr=1e-4,
    smoke_overrides={"log_interval": 5},
    flops={
        "train_flops_per_image": 3e9,
        "train_forward_flops_per_image": 1e9,
        "query_flops_per_image": 0.0,
        "test_flops_per_image": 1e9,
    },
)


@pytest.fixture
def outside(monkeypatch):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    monkeypatch.setattr(registry, "_CARDS", dict(registry._CARDS))
    registry.register_method("outside_online", OUTSIDE_CARD)(OutsidePort)
    return "outside_online"


def test_configs_refuses_an_outside_method_whose_card_names_no_backbone(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    monkeypatch.setattr(registry, "_CARDS", dict(registry._CARDS))
    card = dataclasses.replace(OUTSIDE_CARD, backbone_types=())
    registry.register_method("bare_online", card)(OutsidePort)  # fine-tuning's table not inherited
    assert main(["configs", "bare_online", "--out", str(tmp_path)]) != 0
    assert "bare_online's card declares no backbone_types" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_configs_writes_an_outside_methods_configs_from_its_card(outside, tmp_path, capsys):
    assert main(["configs", outside, "--out", str(tmp_path)]) == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    # its card's rows (base and + P + FGH) on both streams, and its smoke config
    assert written == [
        "outside_online_base.json",
        "outside_online_base_blurry.json",
        "outside_online_fgh.json",
        "outside_online_fgh_blurry.json",
        "smoke_outside_online.json",
    ]
    base = json.loads((tmp_path / "outside_online_base.json").read_text())
    assert base["model_name"] == outside and base["init_lr"] == 1e-4  # the card's LR
    assert base["backbone_type"] == "vit_base_patch16_224_in21k"  # the card's first name
    assert base["online_prototypes"] is False and base["fgh"] is None
    ours = json.loads((tmp_path / "outside_online_fgh_blurry.json").read_text())
    assert ours["stream"] == "si_blurry" and ours["fgh"] == PAPER_FGH
    smoke = json.loads((tmp_path / "smoke_outside_online.json").read_text())
    assert smoke["dataset"] == "synthetic_small" and smoke["log_interval"] == 5  # the card's
    resolve_config(smoke)
    assert "5 configs of outside_online" in capsys.readouterr().out

    assert main(["configs", outside, "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "outside_online_base.json").write_text("{}\n")
    assert main(["configs", outside, "--out", str(tmp_path), "--check"]) == 1
    assert (tmp_path / "outside_online_base.json").read_text() == "{}\n"  # --check writes none


def test_configs_of_an_unknown_method_name_the_registered_ones(tmp_path, capsys):
    assert main(["configs", "nope_online", "--out", str(tmp_path)]) == 2
    assert "unknown model_name 'nope_online'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_flops_refuses_a_folder_that_is_no_pilot_checkout(tmp_path, capsys):
    assert main(["flops", "coda_online", "--pilot-root", str(tmp_path)]) == 2
    assert "is no PILOT checkout" in capsys.readouterr().err


def test_count_network_counts_two_flops_per_multiply_add_by_hand():
    """TinyNet: body Linear(5, 8), fc Linear(8, 6). Per image: forward 2*5*8 + 2*8*6 = 176;
    backward: the head's input and weight gradients 2 x 2*8*6 = 192 and the body's weight
    gradient 2*5*8 = 80 (the images need none) = 272; train 448; no query pass."""
    adapter = TinyAdapter()
    network = adapter.build_network({})
    counts = count_network(adapter, network, torch.rand(4, 5), classes=6)
    assert counts == {
        "train_flops_per_image": 448.0,
        "train_forward_flops_per_image": 176.0,
        "query_flops_per_image": 0.0,
        "test_flops_per_image": 176.0,
    }
    assert all(p.grad is None for p in network.parameters())  # counting leaves no gradients
    literal = card_literal("tiny_online", counts)
    assert literal.startswith("# tiny_online: FLOPs per image at 224 px\nflops={")
    assert eval(literal.split("=", 1)[1].replace("\n", "")) == counts  # pastes as it prints


def test_the_flop_model_reads_an_outside_methods_counts_from_its_card(outside):
    assert flops.method_flops(outside) == dict(OUTSIDE_CARD.flops)
    assert outside not in flops.load_flops()["methods"]  # not from the package table


def test_a_method_without_counts_is_told_to_count_them_onto_its_card(monkeypatch):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    monkeypatch.setattr(registry, "_CARDS", dict(registry._CARDS))
    registry.register_method("uncounted_online")(OutsidePort)
    with pytest.raises(ValueError) as caught:
        flops.method_flops("uncounted_online")
    message = str(caught.value)
    assert "pilot-online flops uncounted_online" in message and "MethodCard" in message
    assert "benchmarks/flops.py" not in message  # never an edit of the installed package
    with pytest.raises(ValueError, match=r"benchmarks/flops\.py --methods l2p_online"):
        flops.method_flops("l2p_online", {"methods": {}})  # a built-in: the package's table


def test_a_methods_flop_config_is_one_run_of_its_paper_config():
    """The paper's configs list 10 seeds; a FLOP count builds one run, whose firings draw from
    its one seed (``run_seed``), so a growing method's count can fire."""
    from pilot_online.harness.flop_count import method_config

    config = method_config("der_online", classes=10)
    assert config["seed"] == 0  # the first of the paper's list, 0 to 9
    assert registry.get_method("der_online")(args=config).run_seed() == 0

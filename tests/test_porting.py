"""What a port gets wrong without being told: a report label taken from its parent, state kept
outside the parameters that ``doctor`` would not count. (The walk-through itself runs in
test_contract.py.)"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from conftest import raw_smoke_config

from pilot_online.cli import doctor
from pilot_online.engine import registry
from pilot_online.engine.card import MethodCard
from pilot_online.engine.config import resolve_config
from pilot_online.harness.report import method_label
from pilot_online.methods.finetune import FinetuneOnline


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations in the test do not outlive it."""
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    monkeypatch.setattr(registry, "_CARDS", dict(registry._CARDS))


def test_a_subclass_is_another_method_with_its_own_card(scratch_registry):
    """Before cards, a subclass inherited its parent's paper name, and reports named it as the
    parent's row. A card belongs to one registration: none is inherited."""

    class Renamed(FinetuneOnline):
        pass

    registry.register_method("renamed_online")(Renamed)
    assert registry.method_card("finetune_online").paper_name == "Fine-tuning"
    card = registry.method_card("renamed_online")
    assert (card.paper_name, card.upstream_differences, card.default_lr) == ("", (), None)
    assert card.upstream_model == "finetune"  # filled from the network's base_model_name
    assert method_label("renamed_online") == "renamed_online"  # not "Fine-tuning"

    registry.register_method("labelled_online", MethodCard(paper_name="Labelled"))(Renamed)
    assert method_label("labelled_online") == "Labelled"
    with pytest.raises(TypeError, match="needs a MethodCard"):
        registry.register_method("typo_online", card={"paper_name": "x"})  # type: ignore[arg-type]


def test_doctor_counts_the_method_state_beside_its_parameters(monkeypatch):
    """A method's ``state_bytes`` (RanPAC's Gram matrix) joins the host need of a CPU run, for the
    class count of the config's dataset (CIFAR-100: 100)."""
    seen = []

    def state_bytes(args):
        seen.append(args["nb_classes"])
        return 3 * doctor.GIB

    config = resolve_config({**raw_smoke_config("simplecil_online"), "dataset": "cifar224"})
    config["device"] = ["-1"]
    before = {c.name: c for c in doctor.check_memory(config)}["host memory"]
    card = replace(registry.method_card("simplecil_online"), state_bytes=state_bytes)
    monkeypatch.setitem(registry._CARDS, "simplecil_online", card)
    after = {c.name: c for c in doctor.check_memory(config)}["host memory"]
    assert seen == [100]

    def need(check) -> float:
        return float(re.search(r"needs about ([0-9.]+) GiB", check.detail).group(1))

    assert need(after) == pytest.approx(need(before) + 3, abs=0.051)
    assert "+ 3.00 GiB of the method's own state" in after.detail

"""What a port gets wrong without being told: an inherited report label, state kept outside the
parameters that ``doctor`` would not count. (The walk-through itself runs in test_contract.py.)"""

from __future__ import annotations

import re

import pytest
from conftest import raw_smoke_config

from pilot_online import get_method
from pilot_online.cli import doctor
from pilot_online.engine import registry
from pilot_online.engine.config import resolve_config
from pilot_online.methods.finetune import FinetuneOnline


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations in the test do not outlive it."""
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))


def test_a_subclass_that_inherits_a_report_label_is_refused(scratch_registry):
    class Renamed(FinetuneOnline):
        pass

    assert Renamed.paper_name == FinetuneOnline.paper_name != ""
    with pytest.raises(TypeError, match=r"inherits paper_name 'Fine-tuning'.*set paper_name in"):
        registry.register_method("renamed_online")(Renamed)
    assert "renamed_online" not in registry.list_methods()

    class Labelled(FinetuneOnline):
        paper_name = "Labelled"

    registry.register_method("labelled_online")(Labelled)
    assert registry.get_method("labelled_online") is Labelled


def test_doctor_counts_the_method_state_beside_its_parameters(monkeypatch):
    """A method's ``state_bytes`` (RanPAC's Gram matrix) joins the host need of a CPU run, for the
    class count of the config's dataset (CIFAR-100: 100)."""
    seen = []

    def state_bytes(cls, args):
        seen.append(args["nb_classes"])
        return 3 * doctor.GIB

    config = resolve_config({**raw_smoke_config("simplecil_online"), "dataset": "cifar224"})
    config["device"] = ["-1"]
    before = {c.name: c for c in doctor.check_memory(config)}["host memory"]
    monkeypatch.setattr(get_method("simplecil_online"), "state_bytes", classmethod(state_bytes))
    after = {c.name: c for c in doctor.check_memory(config)}["host memory"]
    assert seen == [100]

    def need(check) -> float:
        return float(re.search(r"needs about ([0-9.]+) GiB", check.detail).group(1))

    assert need(after) == pytest.approx(need(before) + 3, abs=0.051)
    assert "+ 3.00 GiB of the method's own state" in after.detail

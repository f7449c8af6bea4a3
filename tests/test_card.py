"""Method cards (``engine/card.py``): the tooling's facts, kept out of what training runs.

Before cards, 20 class attributes and 3 classmethods of the adapter mixed the tooling's facts
(paper names, smoke values, FLOP and memory facts, upstream differences) into the training
contract, and a subclass inherited its parent's paper name. These tests hold the split: a card is
checked when it is made, belongs to one registration, is refused on the adapter class, and is
never read by the training code."""

from __future__ import annotations

import ast
from dataclasses import fields

import pytest
from conftest import REPO

from pilot_online.core.masks import LOGIT_MASKS
from pilot_online.engine import registry
from pilot_online.engine.adapter import RETIRED_MEMBERS, MethodAdapter
from pilot_online.engine.card import ABLATION_ROWS, MethodCard, UpstreamDifference
from pilot_online.engine.config import VARIANTS
from pilot_online.methods.finetune import FinetuneOnline


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    monkeypatch.setattr(registry, "_CARDS", dict(registry._CARDS))


def test_the_cards_names_are_the_engines():
    """The card restates two tuples so that it imports no torch; they must stay the engine's."""
    assert ABLATION_ROWS == tuple(VARIANTS) == ("base", "p", "fgh_only", "fgh")
    from pilot_online.engine import card

    assert card._LOGIT_MASKS == LOGIT_MASKS


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("variants", ("base", "ours"), "subset of"),
        ("variants", (), "non-empty"),
        ("default_logit_mask", "task", "default_logit_mask must be one of"),
        (
            "upstream_differences",
            (UpstreamDifference("a", "w", "y"), UpstreamDifference("a", "w2", "y2")),
            "repeats a key",
        ),
    ],
)
def test_a_bad_card_is_refused_when_it_is_made(field, value, match):
    with pytest.raises(ValueError, match=match):
        MethodCard(**{field: value})


def test_the_upstream_file_follows_the_network_unless_the_card_says_otherwise(scratch_registry):
    class Port(FinetuneOnline):
        pass

    registry.register_method("port_online")(Port)
    registry.register_method("outside_online", MethodCard(upstream_model=""))(Port)
    registry.register_method("other_online", MethodCard(upstream_model="slca"))(Port)
    assert registry.method_card("port_online").upstream_file == "models/finetune.py"
    assert registry.method_card("outside_online").upstream_file is None
    assert registry.method_card("other_online").upstream_file == "models/slca.py"
    assert registry.method_card("PORT_online") is registry.method_card("port_online")  # as configs


def test_card_fields_on_the_adapter_class_are_refused(scratch_registry):
    """A port that writes ``paper_name = "X"`` on its class, as the adapter once had it, would be
    silently unlabelled: the registry names the fix instead."""

    class Labelled(FinetuneOnline):
        paper_name = "X"
        default_lr = 1e-4

    with pytest.raises(TypeError, match=r"sets paper_name, default_lr on the adapter class.*"):
        registry.register_method("labelled_online")(Labelled)
    assert "labelled_online" not in registry.list_methods()


def test_retired_members_on_an_adapter_class_are_refused_when_it_is_defined():
    """``keeps_teacher = True`` or a ``train_mode`` hook on a port written against the old
    contract would give a method that never distils or never freezes its query ViT, silently:
    the class is refused where it is defined, registered or not, naming what replaced each."""
    with pytest.raises(
        TypeError,
        match=r"Old defines default_consolidation, keeps_teacher, which the method contract no "
        r"longer reads: default_consolidation: declare consolidation = "
        r"Consolidation\(trigger=\.\.\.\); keeps_teacher: declare consolidation = "
        r"Consolidation\(teacher=True\)",
    ):

        class Old(FinetuneOnline):
            keeps_teacher = True
            default_consolidation = "new_classes"

    with pytest.raises(TypeError, match=r"defines train_mode.*override set_mode\(network, train\)"):

        class OldHook(FinetuneOnline):
            def train_mode(self, network):
                network.train()

    with pytest.raises(TypeError, match=r"defines backbone_types.*MethodCard\(backbone_types="):

        class OldTable(FinetuneOnline):
            backbone_types = ("vit_base_patch16_224",)

    assert not set(RETIRED_MEMBERS) & set(dir(MethodAdapter))


def test_no_adapter_has_a_card_field():
    names = {f.name for f in fields(MethodCard)}
    assert not names & set(dir(MethodAdapter))
    for name in registry.list_methods():
        assert not [n for n in names if hasattr(registry.get_method(name), n)], name


def test_the_smoke_overrides_are_the_cards_own_copy():
    shared = {"M": 1}
    card = MethodCard(smoke_overrides=shared)
    shared["M"] = 2
    assert card.smoke_overrides == {"M": 1}


def test_memory_and_settings_default_to_nothing():
    card = MethodCard()
    assert card.memory_bytes({"nb_classes": 10}) == 0 and card.settings_for("cub", "clear") == {}
    card = MethodCard(state_bytes=lambda a: 4 * a["nb_classes"], paper_settings=lambda d, s: {d: s})
    assert card.memory_bytes({"nb_classes": 10}) == 40
    assert card.settings_for("cub", "clear") == {"cub": "clear"}


TRAINING_LAYERS = ("core", "engine", "methods", "pilot")
#: The only training-side modules that name the card lookup: the registry keeps the cards and the
#: card module defines them; the FLOP model reads one field, ``flops``, an outside method's counts
#: (real-time evaluation prices its steps by them, as by the package table's for the others);
#: config validation reads one, ``removed_keys``, and can only refuse a config with it.
CARD_KEEPERS = {"engine/registry.py", "engine/card.py", "engine/flops.py", "engine/config.py"}


def test_training_code_never_reads_a_card():
    """Only the tooling (harness, cli, scripts, benchmarks) looks a card up: a card cannot change
    a run. Methods pass their cards to ``register_method`` and never read one back."""
    readers = []
    package = REPO / "pilot_online"
    for layer in TRAINING_LAYERS:
        for path in sorted((package / layer).rglob("*.py")):
            where = path.relative_to(package).as_posix()
            if where in CARD_KEEPERS:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            names |= {
                a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
            }
            if names & {"method_card", "_CARDS"}:
                readers.append(where)
    assert readers == []


def test_a_key_the_card_removed_is_refused_by_name_with_its_fix(monkeypatch):
    """A method's removed keys live on its card: a config that still sets one is refused with the
    card's fix, not as an unknown key; the adapter class may no longer declare them."""
    from conftest import raw_smoke_config

    from pilot_online.engine.config import ConfigError, resolve_config

    class Renamed(FinetuneOnline):
        pass

    monkeypatch.setitem(registry._METHODS, "renamed_online", Renamed)
    card = MethodCard(removed_keys={"old_width": "set new_width, in pixels"})
    monkeypatch.setitem(registry._CARDS, "renamed_online", card)
    config = {**raw_smoke_config("finetune_online"), "model_name": "renamed_online"}
    resolve_config(config)
    with pytest.raises(
        ConfigError,
        match=r"'old_width' was removed from renamed_online: set new_width, in pixels; delete",
    ):
        resolve_config({**config, "old_width": 3})
    with pytest.raises(TypeError, match=r"defines removed_keys.*MethodCard\(removed_keys=\.\.\.\)"):

        class Old(FinetuneOnline):
            removed_keys = ("old_width",)

"""Discoverability: ``--version``, ``--help``'s examples, ``pilot-online methods``, and methods
registered from outside the package through the ``pilot_online.methods`` entry point group."""

from __future__ import annotations

import sys
import textwrap

import pytest

from pilot_online import __version__, cli
from pilot_online.engine import registry


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"pilot-online {__version__}"


def test_help_has_examples_and_docs_and_no_sphinx_markup(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "pilot-online demo" in out and "docs/methods.md" in out
    assert "``" not in out and ":func:" not in out and "methods" in out


def _table(out: str) -> dict[str, list[str]]:
    import re

    lines = out.split("\n\n", 1)[0].splitlines()  # the table, without the outside methods' notes
    return {re.split(r"\s{2,}", line)[0]: re.split(r"\s{2,}", line) for line in lines[2:]}


def test_methods_lists_paper_name_rows_trigger_and_keys(capsys) -> None:
    assert cli.main(["methods"]) == 0
    rows = _table(capsys.readouterr().out)
    assert set(rows) == set(registry.list_methods())
    # By hand, from the methods' cards (coda_prompt.py: paper_name and full_name;
    # cofima.py, simplecil.py).
    coda = [
        "coda_online",
        "CODA (CODA-Prompt)",
        "base,+P,+FGH,+P+FGH",
        "never",
        "-",
        "prompt_param",
    ]
    assert rows["coda_online"] == coda
    assert rows["cofima_online"][1:4] == ["CoFiMA", "base,+P,+FGH,+P+FGH", "new_classes"]
    assert rows["simplecil_online"][2] == "base"
    assert rows["er_online"][4] == "reservoir 1000"  # methods/finetune.py: Replay(1000)


def test_methods_filter_and_keys(capsys) -> None:
    assert cli.main(["methods", "CODA", "--keys"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("coda_online") and len(out) == 4
    assert out[3].split()[:2] == ["prompt_param", "default"]
    assert cli.main(["methods", "no_such_method"]) == 1
    assert "no method matches 'no_such_method'" in capsys.readouterr().out


PLUGIN = """
from typing import ClassVar

from pilot_online.engine.adapter import MethodAdapter
from pilot_online.engine.card import MethodCard
from pilot_online.engine.registry import register_method


@register_method("plugin_online", card=MethodCard(paper_name="My method", variants=("base",)))
class PluginAdapter(MethodAdapter):
    '''A method from outside the package.'''


class BareAdapter(MethodAdapter):
    pass
"""


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A distribution on sys.path, as pip would install it: a package and its dist-info with an
    entry_points.txt naming, under the group, a module that registers its method with a card and
    an adapter class (registered under the entry point's name, with an empty card)."""
    (tmp_path / "my_plugin_pkg").mkdir()
    (tmp_path / "my_plugin_pkg" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "my_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[pilot_online.methods]\nplugin_online = my_plugin_pkg\n"
        "bare_online = my_plugin_pkg:BareAdapter\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))  # restored after
    monkeypatch.setattr(registry, "_CARDS", dict(registry._CARDS))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    yield info
    sys.modules.pop("my_plugin_pkg", None)


def test_a_method_registers_from_outside_the_package(installed_plugin, capsys) -> None:
    """Before: only an edit of pilot_online/methods could add a method."""
    adapter = registry.get_method("plugin_online")
    assert adapter.__module__ == "my_plugin_pkg" and adapter.__name__ == "PluginAdapter"
    assert registry.method_card("plugin_online").paper_name == "My method"
    assert registry.method_card("bare_online").paper_name == ""  # a class: an empty card
    assert registry.get_method("bare_online").__name__ == "BareAdapter"
    assert {"plugin_online", "bare_online"} <= set(registry.list_methods())
    assert cli.main(["methods", "plugin"]) == 0
    out = capsys.readouterr().out
    assert _table(out)["plugin_online"][1:3] == ["My method", "base"]  # the card's
    assert "plugin_online: from my_plugin_pkg (a pilot_online.methods entry point)" in out


def test_an_entry_point_that_names_no_adapter_is_refused(installed_plugin) -> None:
    (installed_plugin / "entry_points.txt").write_text(
        "[pilot_online.methods]\nbroken_online = textwrap:dedent\n"
    )
    with pytest.raises(ValueError, match="must name a MethodAdapter subclass"):
        registry.list_methods()

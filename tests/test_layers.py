"""Imports point one way: core <- engine <- methods <- pilot <- harness <- cli, with no circles and
no method borrowing from another method's file (``core/layers.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pilot_online
from pilot_online.core.layers import LAYERS, circles, layer_of, module_sources, violations

ROOT = Path(pilot_online.__file__).resolve().parent


def _packages(sources: dict[str, str], root: Path) -> set[str]:
    return {m for m in sources if (root.parent / Path(*m.split(".")) / "__init__.py").is_file()}


def test_the_package_imports_one_way_without_circles():
    sources = module_sources(ROOT)
    assert {m.split(".")[1] for m in sources if m.count(".") >= 1} >= set(LAYERS)
    assert violations(sources, _packages(sources, ROOT)) == []


def _draft(tmp_path: Path, files: dict[str, str]) -> list[str]:
    root = tmp_path / "pilot_online"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(root).parents:
            (root / folder / "__init__.py").touch()
        path.write_text(text)
    sources = module_sources(root)
    return violations(sources, _packages(sources, root))


def test_an_upward_import_fails_even_when_lazy(tmp_path):
    lines = _draft(
        tmp_path,
        {
            "core/a.py": "def f():\n    from ..cli import main\n",
            "cli/main.py": "",
        },
    )
    assert lines == [
        "pilot_online.core.a (core) imports pilot_online.cli.main (cli): layers point "
        "core <- engine <- methods <- pilot <- harness <- cli"
    ]


def test_a_type_checking_import_counts(tmp_path):
    lines = _draft(
        tmp_path,
        {
            "engine/loop.py": "from .mixins import M\n",
            "engine/mixins.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from .loop import L\nclass M: ...\n",
        },
    )
    assert lines == ["import circle: pilot_online.engine.loop <-> pilot_online.engine.mixins"]


def test_downward_and_sideways_imports_pass(tmp_path):
    lines = _draft(
        tmp_path,
        {
            "core/a.py": "",
            "engine/b.py": "from ..core import a\n",
            "harness/c.py": "from pilot_online.engine.b import x\nfrom . import d\n",
            "harness/d.py": "",
            "version.py": "",
            "methods/m.py": "from ..version import v\n",
        },
    )
    assert lines == []


def test_a_method_takes_only_adapter_classes_and_cards_from_another(tmp_path):
    lines = _draft(
        tmp_path,
        {
            "methods/icarl.py": "class ICaRLOnline: ...\ndef distillation_loss(): ...\nCARD = 1\n",
            "methods/der.py": "from .icarl import ICaRLOnline\n",  # subclassing: allowed
            "methods/memo.py": "from .icarl import CARD as ICARL_CARD\n",  # deriving: allowed
            "methods/dgr.py": "from .icarl import ICaRLOnline, distillation_loss\n",
        },
    )
    assert lines == [
        "pilot_online.methods.dgr imports pilot_online.methods.icarl.distillation_loss: a method "
        "takes only adapter classes and cards from another method's file; move shared pieces to "
        "core or the engine component they belong to"
    ]


def test_circles_are_found_round_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_scripts_and_benchmarks_import_names_that_exist():
    """scripts/ and benchmarks/ run outside the suite, so a renamed or moved name they import
    (at their top or inside a function) would only fail in a user's hands: every
    ``from pilot_online... import name`` they hold must resolve."""
    import ast
    import importlib

    repo = ROOT.parent
    missing = []
    for path in sorted([*repo.glob("scripts/*.py"), *repo.glob("benchmarks/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pilot_")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{path.name}: {node.module}.{alias.name}")
    assert missing == []


#: The library's layers: they log (a reader chooses what shows); only the harness and the CLI,
#: which answer a command, print.
LIBRARY = ("core", "engine", "methods", "pilot")
#: The one print below the harness: the excepthook PILOT's patched main.py installs is that
#: program's top level, where a user error is shown as its line alone (as the CLI's main does).
TOP_LEVEL_PRINTS = {"pilot_online.pilot.errors"}


def _prints(source: str) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    ]


def test_library_code_logs_and_never_prints():
    sources = module_sources(ROOT)
    printing = {
        f"{module}:{line}"
        for module, source in sources.items()
        if layer_of(module) is not None and LAYERS[layer_of(module)] in LIBRARY
        if module not in TOP_LEVEL_PRINTS
        for line in _prints(source)
    }
    assert printing == set()
    assert _prints(sources["pilot_online.pilot.errors"]), "TOP_LEVEL_PRINTS names a stale module"

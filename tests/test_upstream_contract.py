"""Every port of a PILOT model is held to upstream's own code, and its differences are written once.

For each registered method whose card names a PILOT model (its card's ``upstream_file``):

- ``tests/test_upstream_<methods-file>.py`` exists and imports upstream's ``models/<name>.py``
  (the file a reviewer diffs against), so its equivalence tests run upstream's functions;
- each :class:`UpstreamDifference` the adapter declares has a ``test_difference_<key>`` there,
  with a unique snake_case key and both sentences written;
- ``docs/upstream-differences.md`` holds exactly what ``scripts/make_docs.py`` generates from those
  declarations, so the page, the code and the tests cannot drift apart.
"""

from __future__ import annotations

import ast
import re

import pytest
from conftest import PILOT_ROOT, REPO, load_script

from pilot_online import get_method, list_methods
from pilot_online.engine.config import PILOT_MODEL_NAMES, unknown_method
from pilot_online.engine.registry import method_card

PORTS = [name for name in list_methods() if method_card(name).upstream_file is not None]


def make_docs():
    """``scripts/make_docs.py``, which generates the differences and method-keys sections."""
    return load_script("make_docs")


def upstream_test_file(name: str):
    stem = get_method(name).__module__.rsplit(".", 1)[1]
    return REPO / "tests" / f"test_upstream_{stem}.py"


def test_every_pilot_model_has_a_port_claiming_it():
    """Every model of PILOT 5240714 (its factory's names: the 18 pre-trained-model methods and the
    classic iCaRL, DER, MEMO, FOSTER and COIL) has a port that names it, and each is what
    ``unknown_method`` offers for upstream's own name."""
    claimed = {method_card(name).upstream_file for name in PORTS}
    everything = {f"models/{name}.py" for name in PILOT_MODEL_NAMES}
    assert len(everything) == 23
    assert everything <= claimed, sorted(everything - claimed)
    for name in PILOT_MODEL_NAMES:
        assert f"'{name}_online'" in unknown_method(name) or name == "coda_prompt", name
    if PILOT_ROOT:
        from pathlib import Path

        missing = [f for f in claimed if not (Path(PILOT_ROOT) / f).is_file()]
        assert not missing, f"ports name PILOT files that do not exist: {missing}"
        upstream = {f"models/{p.name}" for p in (Path(PILOT_ROOT) / "models").glob("*.py")}
        assert upstream - {"models/__init__.py", "models/base.py"} == everything


@pytest.mark.parametrize("name", PORTS)
def test_equivalence_tests_run_upstreams_code(name):
    path = upstream_test_file(name)
    assert path.is_file(), f"{name} ports {method_card(name).upstream_file}: write {path.name}"
    module = method_card(name).upstream_file.removesuffix(".py").replace("/", ".")
    source = path.read_text(encoding="utf-8")
    assert re.search(rf"\b(from|import) {re.escape(module)}\b", source), (
        f"{path.name} never imports upstream's {module}: its tests must run upstream's code"
    )


@pytest.mark.parametrize("name", PORTS)
def test_each_declared_difference_is_asserted(name):
    card = method_card(name)
    keys = [d.key for d in card.upstream_differences]
    assert len(keys) == len(set(keys)), f"{name} declares a difference key twice: {keys}"
    for difference in card.upstream_differences:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", difference.key), difference.key
        assert difference.what.strip() and difference.why.strip(), difference.key
    path = upstream_test_file(name)
    defined = set()
    if path.is_file():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    missing = [f"test_difference_{key}" for key in keys if f"test_difference_{key}" not in defined]
    assert not missing, f"{path.name} lacks {missing}"


def test_the_differences_page_is_generated_from_the_cards():
    docs = make_docs()
    page = docs.PAGE.read_text(encoding="utf-8")
    assert docs.render(page) == page, "run `python scripts/make_docs.py`"
    for name in PORTS:
        for difference in method_card(name).upstream_differences:
            assert f"| `{difference.key}` |" in page

"""Every port of a PILOT model is held to upstream's own code, and its differences are written once.

For each registered method whose card names a PILOT model (its card's ``upstream_file``):

- ``tests/test_upstream_<methods-file>.py`` exists and imports upstream's ``models/<name>.py``
  (the file a reviewer diffs against), so its equivalence tests run upstream's functions; that
  they do run is checked while the file runs (``tests/upstream_watch.py``: a
  module whose tests never call a function of ``models/<name>.py`` fails at its last teardown);
- each :class:`UpstreamDifference` the adapter declares has a ``test_difference_<key>`` there,
  with a unique snake_case key and both sentences written, and every ``test_difference_*``
  asserts something (read from its source: an empty one would pass any run);
- ``docs/upstream-differences.md`` holds exactly what ``scripts/make_docs.py`` generates from those
  declarations, so the page, the code and the tests cannot drift apart.

A built-in method without a PILOT model (its card's ``upstream_file`` None: MVP, Online-LoRA, ...)
has no such file; ``docs/porting.md`` ("Methods without a PILOT model") says what stands in for
its upstream.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PILOT_ROOT, REPO, load_script, package_root

from pilot_online import get_method, list_methods
from pilot_online.engine.config import PILOT_MODEL_NAMES, unknown_method
from pilot_online.engine.registry import BUILTIN_PACKAGE, method_card

PORTS = [name for name in list_methods() if method_card(name).upstream_file is not None]
#: The built-in methods whose card names no PILOT model: docs/porting.md states their stand-ins.
WITHOUT_PILOT_MODEL = [
    name
    for name in list_methods()
    if method_card(name).upstream_file is None
    and get_method(name).__module__.startswith(f"{BUILTIN_PACKAGE}.")
]
TESTS = REPO / "tests"
UPSTREAM_TEST_FILES = sorted(
    path for path in TESTS.glob("test_upstream_*.py") if path.name != Path(__file__).name
)
PORTING_PAGE = REPO / "docs" / "porting.md"
STAND_INS_HEADING = "## Methods without a PILOT model"


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


# --------------------------------------------------------------------------------------------
# Each test_difference_* asserts something.

Function = ast.FunctionDef | ast.AsyncFunctionDef
FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef)
#: ``pytest.<name>(...)`` calls that assert: its failure and its raises/warns blocks.
PYTEST_ASSERTING = {"raises", "warns", "deprecated_call", "fail"}
#: How many calls deep a test's helpers are followed.
HELPER_DEPTH = 4


@functools.cache
def module_functions(path: Path) -> tuple[dict[str, Function], dict[str, tuple[Path, str]]]:
    """A test file's module-level functions by name, and the names it imports from the test files
    beside it (``{local name: (file, name there)}``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    functions = {n.name: n for n in tree.body if isinstance(n, FUNCTION_NODES)}
    imports = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            source = path.parent / f"{node.module}.py"
            if source.is_file():
                for alias in node.names:
                    imports[alias.asname or alias.name] = (source, alias.name)
    return functions, imports


def own_nodes(function: Function) -> Iterator[ast.AST]:
    """The nodes of ``function``'s body, not of the functions, lambdas and classes it defines."""
    definitions = (*FUNCTION_NODES, ast.Lambda, ast.ClassDef)
    stack = [node for node in function.body if not isinstance(node, definitions)]
    while stack:
        node = stack.pop()
        yield node
        stack += [c for c in ast.iter_child_nodes(node) if not isinstance(c, definitions)]


def helper(name: str, function: Function, path: Path) -> tuple[Function, Path] | None:
    """The function a call of ``name`` in ``function`` reaches where its source is in the tests:
    one ``function`` defines, one of its file, or one its file imports from a test file beside
    it; None for anything else (torch, numpy, pytest, the package)."""
    nested = [n for n in ast.walk(function) if isinstance(n, FUNCTION_NODES) and n is not function]
    for node in nested:
        if node.name == name:
            return node, path
    functions, imports = module_functions(path)
    if name in functions:
        return functions[name], path
    if name in imports:
        source, original = imports[name]
        found = module_functions(source)[0].get(original)
        return (found, source) if found is not None else None
    return None


def asserts(function: Function, path: Path, depth: int = 0) -> bool:
    """Whether ``function`` asserts something: an ``assert`` (not of a true constant), a
    ``pytest.raises``/``warns`` block or ``pytest.fail``, a call of an ``assert*`` function whose
    source is not in the tests (``torch.testing.assert_close``, ``np.testing.assert_allclose``,
    a mock's ``assert_called_once``), or a call of a test helper that does, followed
    :data:`HELPER_DEPTH` calls deep. A helper is judged by its body, never by its name."""
    for node in own_nodes(function):
        if isinstance(node, ast.Assert):
            if not (isinstance(node.test, ast.Constant) and node.test.value):
                return True
        elif isinstance(node, ast.Call):
            called = node.func
            if isinstance(called, ast.Name):
                found = helper(called.id, function, path)
                if found is not None:
                    if depth < HELPER_DEPTH and asserts(*found, depth + 1):
                        return True
                    continue
                name = called.id
            elif isinstance(called, ast.Attribute):
                name = called.attr
                if isinstance(called.value, ast.Name) and called.value.id == "pytest":
                    if name in PYTEST_ASSERTING:
                        return True
            else:
                continue
            if name.startswith("assert"):
                return True
    return False


def silent_difference_tests(path: Path) -> list[str]:
    """The ``test_difference_*`` functions of a test file that assert nothing."""
    functions, _ = module_functions(path)
    return [
        name
        for name, function in functions.items()
        if name.startswith("test_difference_") and not asserts(function, path)
    ]


@pytest.mark.parametrize("path", UPSTREAM_TEST_FILES, ids=lambda path: path.name)
def test_each_difference_test_asserts(path: Path) -> None:
    """A ``test_difference_*`` that asserts nothing passes whatever the port does."""
    silent = silent_difference_tests(path)
    assert not silent, (
        f"{path.name}: {silent} assert nothing: a difference test must show the difference on "
        "upstream's code (an assert, pytest.raises, torch.testing.assert_close, or a helper of "
        "the tests that does one of these)"
    )


def test_the_assertion_check_sees_through_helpers_and_catches_empty_tests(tmp_path: Path) -> None:
    """The check above can fail: empty bodies, true constants and helpers that only look like
    assertions are caught; asserts in helpers (this file's, another test file's, nested) count."""
    (tmp_path / "test_upstream_shared.py").write_text(
        "import torch\n"
        "def assert_close_rows(a, b):\n"
        "    torch.testing.assert_close(a, b)\n"
        "def assert_nothing(a):\n"
        "    return a\n",
        encoding="utf-8",
    )
    path = tmp_path / "test_upstream_demo.py"
    path.write_text(
        "import pytest\n"
        "from test_upstream_shared import assert_close_rows, assert_nothing as assert_shown\n"
        "def check(a):\n"
        "    assert a\n"
        "def indirect(a):\n"
        "    check(a)\n"
        "def test_difference_x():\n"
        "    pass\n"
        "def test_difference_true_constant():\n"
        "    assert True\n"
        "def test_difference_looks_like_one():\n"
        "    assert_shown(1)\n"
        "def test_difference_unused_nested():\n"
        "    def inner():\n"
        "        assert 0\n"
        "def test_difference_imported_helper():\n"
        "    assert_close_rows(1, 1)\n"
        "def test_difference_two_levels():\n"
        "    indirect(1)\n"
        "def test_difference_called_nested():\n"
        "    def inner():\n"
        "        assert 0\n"
        "    inner()\n"
        "def test_difference_raises():\n"
        "    with pytest.raises(ValueError):\n"
        "        int('x')\n",
        encoding="utf-8",
    )
    assert silent_difference_tests(path) == [
        "test_difference_x",
        "test_difference_true_constant",
        "test_difference_looks_like_one",
        "test_difference_unused_nested",
    ]


# --------------------------------------------------------------------------------------------
# The execution check of tests/upstream_watch.py bites: a module that only imports upstream fails.

FAKE_PILOT_MODEL = """
def replace_fc(rows):
    return [2 * r for r in rows]


DEFAULT = replace_fc([r for r in range(2)])  # runs at import: it must not count


class Learner:  # so does a class body
    scale = replace_fc.__name__

    def train(self, rows):
        return replace_fc(rows)
"""

FAKE_UPSTREAM_TEST = """
import sys

import pytest

ROOT = {root!r}


@pytest.fixture(scope="module")
def upstream():
    sys.path.insert(0, ROOT)
    from models.{name} import Learner

    yield Learner
    sys.path.remove(ROOT)
    for module in [m for m in sys.modules if m.split(".")[0] == "models"]:
        del sys.modules[module]


def test_first(upstream):
    assert upstream.scale == "replace_fc"


def test_second(upstream):
    {second}
"""


def test_a_module_that_never_calls_upstream_fails_at_its_last_teardown(tmp_path: Path) -> None:
    """The execution check of ``tests/upstream_watch.py`` bites, in a scratch session whose
    ``PILOT_ROOT`` is a fake PILOT tree: a module whose tests call upstream's ``Learner.train``
    passes; one that only imports upstream and reads its class attributes errors at its last
    teardown, naming the file; run in part (one test by node id, or ``--deselect``), such a
    module is not judged."""
    pilot = tmp_path / "pilot"
    (pilot / "models").mkdir(parents=True)
    for name in ("main.py", "trainer.py", "models/__init__.py"):
        (pilot / name).write_text("", encoding="utf-8")
    session = tmp_path / "session"
    session.mkdir()
    for plugin in ("conftest.py", "upstream_watch.py"):
        (session / plugin).write_text(
            (TESTS / plugin).read_text(encoding="utf-8"), encoding="utf-8"
        )
    calls = "assert upstream().train([1, 2]) == [2, 4]"
    imports_only = "assert upstream.__name__ == 'Learner'"
    modules = {"simplecil": calls, "l2p": imports_only, "der": imports_only, "coil": imports_only}
    for name, second in modules.items():
        (pilot / "models" / f"{name}.py").write_text(FAKE_PILOT_MODEL, encoding="utf-8")
        test = FAKE_UPSTREAM_TEST.format(root=str(pilot), name=name, second=second)
        (session / f"test_upstream_{name}.py").write_text(test, encoding="utf-8")
    env = {
        **os.environ,
        "PILOT_ROOT": str(pilot),
        "PILOT_ONLINE_REQUIRE_PILOT": "0",
        "PYTHONPATH": package_root(),
        "PYTHONDONTWRITEBYTECODE": "1",  # the fake PILOT_ROOT stays as written
    }
    selection = [
        "test_upstream_simplecil.py",
        "test_upstream_l2p.py",
        "test_upstream_der.py::test_second",
        "test_upstream_coil.py",
        "--deselect=test_upstream_coil.py::test_first",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *selection],
        cwd=session,
        env=env,
        capture_output=True,
        text=True,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 1, report
    assert "6 passed, 1 deselected, 1 error" in report, report
    assert report.count("ERROR test_upstream_") == 1
    assert "ERROR test_upstream_l2p.py::test_second" in report
    assert "claims upstream's models/l2p.py (the card of l2p_online)" in report
    assert "its tests must call upstream's functions" in report.lower()
    assert "PILOT_ROOT was modified" not in report


# --------------------------------------------------------------------------------------------
# Methods without a PILOT model: what stands in for upstream is written down.


def stand_in_rows() -> dict[str, str]:
    """The rows of docs/porting.md's table of methods without a PILOT model, by method name."""
    page = PORTING_PAGE.read_text(encoding="utf-8")
    assert STAND_INS_HEADING in page, f"docs/porting.md has no section {STAND_INS_HEADING!r}"
    section = page.split(STAND_INS_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = re.finditer(r"^\| `([a-z0-9_]+)` \|.*$", section, re.MULTILINE)
    return {row.group(1): row.group(0) for row in rows}


def test_each_method_without_a_pilot_model_states_its_stand_in() -> None:
    """Every built-in method whose card names no PILOT model (found through the registry) has a
    row saying what stands in for upstream's code, naming test files that exist and test it; a
    method with a PILOT model has none (its equivalence file is the stand-in's absence)."""
    rows = stand_in_rows()
    assert WITHOUT_PILOT_MODEL
    missing = sorted(set(WITHOUT_PILOT_MODEL) - set(rows))
    assert not missing, (
        f"docs/porting.md, {STAND_INS_HEADING!r}: no row for {missing}, whose cards name no PILOT "
        "model: say which upstream it follows and which tests stand in for running its code"
    )
    extra = sorted(set(rows) - set(WITHOUT_PILOT_MODEL))
    assert not extra, f"{STAND_INS_HEADING!r} lists {extra}: not built-in methods without one"
    for name, row in rows.items():
        files = re.findall(r"`(tests/test_[a-z0-9_]+\.py)`", row)
        assert files, f"the row of {name} names no test file"
        absent = [f for f in files if not (REPO / f).is_file()]
        assert not absent, f"the row of {name} names test files that do not exist: {absent}"
        assert any(name in (REPO / f).read_text(encoding="utf-8") for f in files), (
            f"none of {files} (the row of {name}) names {name}"
        )

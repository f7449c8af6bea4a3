"""What each folder may pull in from outside the package: ``core/`` needs torch and numpy alone,
``engine/`` and ``methods/`` import no PILOT, timm or torchvision, and ``import pilot_online``
pulls in no PILOT. (Imports inside the package, layer by layer: ``tests/test_layers.py``.)

Every module file in a folder is imported, so a new file is covered without editing this test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pilot_online"

PILOT = ["models", "utils", "backbone", "trainer"]
BLOCKED = {
    "core": [*PILOT, "timm", "torchvision", "scipy", "tqdm", "easydict"],
    "engine": [*PILOT, "timm", "torchvision"],
    "methods": [*PILOT, "timm", "torchvision"],
}


def modules_in(folder: str) -> list[str]:
    files = sorted((PACKAGE / folder).glob("*.py"))
    return [f"pilot_online.{folder}.{f.stem}".removesuffix(".__init__") for f in files]


def import_blocking(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        BLOCKED = {blocked!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError("blocked in this test: " + name)
                return None

        sys.meta_path.insert(0, Block())
        import pilot_online
        for module in {modules!r}:
            importlib.import_module(module)
        print(pilot_online.list_methods())
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
    """)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("folder", sorted(BLOCKED))
def test_folder_imports_nothing_it_must_not(folder):
    modules = modules_in(folder)
    assert len(modules) > 1, f"no modules found under pilot_online/{folder}"
    result = import_blocking(modules, BLOCKED[folder])
    assert result.returncode == 0, result.stderr
    assert "coda_online" in result.stdout


def test_the_blocker_catches_a_forbidden_import():
    """The check above can fail: the PILOT glue imports torchvision, and is caught."""
    result = import_blocking(["pilot_online.pilot.data", "torchvision"], ["torchvision"])
    assert result.returncode != 0 and "blocked in this test: torchvision" in result.stderr


def test_package_import_pulls_in_no_pilot():
    script = (
        "import sys, pilot_online; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('models', 'utils', 'backbone', 'trainer', 'timm')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

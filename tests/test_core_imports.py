"""The core imports with torch and numpy alone: no PILOT, timm, torchvision, scipy or tqdm."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BLOCKED = [
    "timm",
    "torchvision",
    "scipy",
    "tqdm",
    "easydict",
    "models",
    "utils",
    "backbone",
    "trainer",
]
CORE = [
    "streams",
    "prototypes",
    "fgh",
    "masks",
    "metrics",
    "results",
    "datasets",
    "adapter",
    "registry",
    "config",
    "loop",
]


def test_core_needs_only_torch_and_numpy():
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        BLOCKED = {BLOCKED!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError("blocked in this test: " + name)
                return None

        sys.meta_path.insert(0, Block())
        import pilot_online
        for module in {CORE!r}:
            importlib.import_module("pilot_online." + module)
        print(pilot_online.list_methods())
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "coda_online" in result.stdout


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

"""Shared test fixtures. PILOT: the tests that need a real LAMDA-PILOT checkout (commit 5240714)
take it from ``PILOT_ROOT``; CI's ``.ci/run`` sets it to ``../shared/LAMDA-PILOT`` when unset. They
copy that tree and patch the copy, never the original.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

PILOT_ROOT = os.environ.get("PILOT_ROOT")
requires_pilot = pytest.mark.skipif(
    not PILOT_ROOT,
    reason="PILOT_ROOT is not set: point it at a LAMDA-PILOT checkout (commit 5240714), e.g. "
    "`PILOT_ROOT=../shared/LAMDA-PILOT make test`, to run the PILOT tests",
)


def copy_pilot(destination: Path) -> Path:
    """A copy of ``PILOT_ROOT`` (without .git, logs and data) at ``destination``."""
    shutil.copytree(PILOT_ROOT, destination, ignore=shutil.ignore_patterns(".git", "logs", "data"))
    return destination


@pytest.fixture(scope="session")
def pilot(tmp_path_factory) -> Path:
    """A patched copy of PILOT, shared by the whole session (tests must not edit it)."""
    if not PILOT_ROOT:
        pytest.skip(requires_pilot.kwargs["reason"])
    from pilot_online.pilot.patching import apply

    root = copy_pilot(tmp_path_factory.mktemp("pilot") / "LAMDA-PILOT")
    apply(root)
    return root


def offline_env(tmp_path: Path) -> dict[str, str]:
    """The environment for a PILOT subprocess: no network (a closed loopback proxy), an empty
    weights cache, and this checkout first on the import path."""
    env = dict(os.environ, TORCH_HOME=str(tmp_path / "torch-home"), PYTHONUNBUFFERED="1")
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env[key] = "http://127.0.0.1:9"
    return env

"""The suite's PILOT policy (tests/conftest.py), checked by running pytest on generated tests.

CI sets ``PILOT_ONLINE_REQUIRE_PILOT=1``: a PILOT test skipped for a missing ``PILOT_ROOT`` must
fail there, while on a user's machine it stays a skip that says how to enable it. A test that
writes into ``PILOT_ROOT`` instead of a copy must fail the session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parent / "conftest.py"

SAMPLE_TESTS = """
import os
from pathlib import Path

import pytest
from conftest import requires_pilot


@requires_pilot
def test_marked_for_pilot():
    pass


def test_skips_in_its_body_like_test_patching():
    if not os.environ.get("PILOT_ROOT"):
        pytest.skip("PILOT_ROOT is not set: point it at a LAMDA-PILOT checkout")


def test_needs_nothing():
    pass


def test_leaves_pilot_root_alone_or_writes_into_it():
    if os.environ.get("WRITE_INTO_PILOT_ROOT"):
        Path(os.environ["PILOT_ROOT"], "utils", "written.py").write_text("x = 1\\n")
"""


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    folder = tmp_path / "sample"
    folder.mkdir()
    shutil.copy(CONFTEST, folder / "conftest.py")
    shutil.copy(CONFTEST.with_name("upstream_watch.py"), folder)  # the plugin conftest loads
    (folder / "test_sample.py").write_text(SAMPLE_TESTS)
    return folder


@pytest.fixture
def fake_pilot(tmp_path: Path) -> Path:
    root = tmp_path / "LAMDA-PILOT"
    (root / "utils").mkdir(parents=True)
    (root / "main.py").write_text("# stand-in\n")
    (root / "utils" / "factory.py").write_text("# stand-in\n")
    return root


def run_pytest(folder: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PILOT_ROOT", "PILOT_ONLINE_REQUIRE_PILOT", "PYTEST_ADDOPTS")
    }
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", "."],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_pilot_root_pilot_tests_skip_and_say_how_to_enable(sample: Path) -> None:
    done = run_pytest(sample)
    assert done.returncode == 0, done.stdout
    assert "2 passed, 2 skipped" in done.stdout
    assert "2 tests skipped because PILOT_ROOT is not set" in done.stdout
    assert "`PILOT_ROOT=../shared/LAMDA-PILOT make test`" in done.stdout


def test_required_pilot_turns_each_pilot_skip_into_a_failure(sample: Path) -> None:
    done = run_pytest(sample, PILOT_ONLINE_REQUIRE_PILOT="1")
    assert done.returncode == 1, done.stdout
    # the marked test fails in setup (an error), the one that skips in its body fails
    summary = done.stdout.strip().splitlines()[-1]
    assert "1 failed, 2 passed, 1 error" in summary and "skipped" not in summary
    assert done.stdout.count("PILOT_ONLINE_REQUIRE_PILOT is set (as in .ci/run)") >= 2


def test_with_pilot_root_nothing_skips(sample: Path, fake_pilot: Path) -> None:
    done = run_pytest(sample, PILOT_ROOT=str(fake_pilot), PILOT_ONLINE_REQUIRE_PILOT="1")
    assert done.returncode == 0, done.stdout
    summary = done.stdout.strip().splitlines()[-1]
    assert "4 passed" in summary and "skipped" not in summary


def test_writing_into_pilot_root_fails_the_session_naming_the_file(
    sample: Path, fake_pilot: Path
) -> None:
    done = run_pytest(sample, PILOT_ROOT=str(fake_pilot), WRITE_INTO_PILOT_ROOT="1")
    assert done.returncode == 1, done.stdout
    assert "4 passed" in done.stdout  # every test passed: only the session check fails
    assert "PILOT_ROOT was modified" in done.stdout
    assert f"added   {Path('utils', 'written.py')}" in done.stdout


def test_pilot_root_that_is_no_checkout_is_refused(sample: Path, tmp_path: Path) -> None:
    done = run_pytest(sample, PILOT_ROOT=str(tmp_path / "nowhere"))
    assert done.returncode == pytest.ExitCode.USAGE_ERROR
    assert "is not a LAMDA-PILOT checkout (no main.py there)" in done.stderr

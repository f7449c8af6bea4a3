"""Shared core helpers: atomic writes (core/files.py) and argument checks (core/checks.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pilot_online.core import files
from pilot_online.core.checks import check_choice, check_int, check_real


def test_write_atomic_replaces_keeping_permissions(tmp_path: Path) -> None:
    target = tmp_path / "factory.py"
    target.write_bytes(b"old\n")
    os.chmod(target, 0o751)
    files.write_atomic(target, "new é\n")
    assert target.read_bytes() == "new é\n".encode()
    assert stat.S_IMODE(target.stat().st_mode) == 0o751
    assert sorted(p.name for p in tmp_path.iterdir()) == ["factory.py"]  # no temporary left


def test_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "results.json"
    target.write_bytes(b"finished run\n")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        files.write_atomic(target, b"half")
    assert target.read_bytes() == b"finished run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_checks_normalise_or_name_the_problem() -> None:
    assert check_int("n", 3, 0, 100) == 3
    with pytest.raises(TypeError, match="n must be an integer, got True"):
        check_int("n", True)
    with pytest.raises(ValueError, match=r"m must be in \[0, 100\], got 150"):
        check_int("m", 150, 0, 100)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        check_int("batch_size", 0, 1)
    assert check_real("gamma", 1) == 1.0 and isinstance(check_real("gamma", 1), float)
    with pytest.raises(TypeError, match="gamma must be a real number"):
        check_real("gamma", "1")
    assert check_choice("stream", "clear", ("clear", "si_blurry")) == "clear"
    with pytest.raises(
        ValueError, match=r"unknown stream 'si-blurry' \(did you mean 'si_blurry'\?\); valid"
    ):
        check_choice("stream", "si-blurry", ("clear", "si_blurry"))


def test_a_new_file_gets_a_plain_files_mode(tmp_path: Path) -> None:
    """Results files and tables are for collaborators: a new file is created 0o666 less the
    umask (644 under the usual 022), not the 600 of the temporary file it is renamed from."""
    previous = os.umask(0o022)
    try:
        written = files.write_atomic(tmp_path / "run.results.json", "{}")
        assert stat.S_IMODE(written.stat().st_mode) == 0o644
        os.umask(0o077)
        private = files.write_atomic(tmp_path / "private.json", "{}")
        assert stat.S_IMODE(private.stat().st_mode) == 0o600
    finally:
        os.umask(previous)

"""Tests for pilot_online.pilot.patching: the diffs against pinned PILOT and the setup command.

The first half needs no PILOT. The second half works on a copy of a real LAMDA-PILOT checkout
named by $PILOT_ROOT and is skipped without it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pilot_online.cli import setup as setup_command
from pilot_online.pilot import patching
from pilot_online.pilot.patching import PatchError

FAKE_CONFIG = "online_fake.json"
PILOT_SKIP_REASON = (
    "PILOT_ROOT is not set: point it at a LAMDA-PILOT checkout (commit 5240714) to run PILOT "
    "integration tests"
)


def _setup_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    setup_command.add_setup_arguments(parser)
    return parser.parse_args(list(argv))


def _diff_text(diff_name: str) -> str:
    return (patching.patches_dir() / diff_name).read_text(encoding="utf-8")


def _hunk_bodies(text: str) -> list[tuple[tuple[int, int], list[str]]]:
    """Split a diff into hunks by hand (independent of the module's parser)."""
    hunks: list[tuple[tuple[int, int], list[str]]] = []
    for line in text.split("\n"):
        header = re.match(r"^@@ -\d+,(\d+) \+\d+,(\d+) @@", line)
        if header:
            hunks.append(((int(header.group(1)), int(header.group(2))), []))
        elif hunks and line != "":
            hunks[-1][1].append(line)
    return hunks


# --------------------------------------------------------------------------------------------
# Without PILOT


def test_empty_folder_is_refused_naming_main_py(tmp_path: Path) -> None:
    with pytest.raises(PatchError, match=r"missing main\.py.*PILOT_ROOT must point at"):
        patching.apply(tmp_path)


def test_partial_checkout_names_the_missing_file(tmp_path: Path) -> None:
    for name in ("main.py", "trainer.py", "utils/data_manager.py", "models/base.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    with pytest.raises(PatchError) as error:
        patching.inspect(tmp_path)
    message = str(error.value)
    assert "missing utils/factory.py." in message
    assert "main.py," not in message  # only the absent file is named
    assert "LAMDA-PILOT" in message


def test_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PatchError, match="does not exist"):
        patching.ensure_patched(tmp_path / "nowhere")


def test_setup_without_root_or_env_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PILOT_ROOT", raising=False)
    assert setup_command.run_setup(_setup_args()) == 2
    assert "PILOT_ROOT" in capsys.readouterr().err


def test_setup_on_non_checkout_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert setup_command.run_setup(_setup_args(str(tmp_path), "--check")) == 2
    assert "main.py" in capsys.readouterr().err


def test_check_and_revert_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        _setup_args("x", "--check", "--revert")


@pytest.mark.parametrize(("rel", "diff_name"), patching.PATCHES)
def test_diffs_are_well_formed(rel: str, diff_name: str) -> None:
    text = _diff_text(diff_name)
    lines = text.split("\n")
    assert f"--- a/{rel}" in lines
    assert f"+++ b/{rel}" in lines
    hunks = _hunk_bodies(text)
    assert hunks, "no hunks"
    for (old_count, new_count), body in hunks:
        # each header count equals the body lines on that side ('\\' markers belong to no side)
        assert sum(line[0] in " -" for line in body) == old_count
        assert sum(line[0] in " +" for line in body) == new_count
        assert all(line[0] in " -+\\" for line in body)


@pytest.mark.parametrize(("rel", "diff_name"), patching.PATCHES)
def test_every_change_group_is_commented(rel: str, diff_name: str) -> None:
    groups: list[list[str]] = []
    previous_changed = False
    for _, body in _hunk_bodies(_diff_text(diff_name)):
        for line in body:
            changed = line[:1] in "+-"
            if changed and not previous_changed:
                groups.append([])
            if changed:
                groups[-1].append(line)
            previous_changed = changed
    assert groups
    for group in groups:
        assert any(line.startswith("+") and "# pilot-online: " in line for line in group), group


def test_total_changed_lines_at_most_20() -> None:
    changed = 0
    for _, diff_name in patching.PATCHES:
        for _, body in _hunk_bodies(_diff_text(diff_name)):
            changed += sum(line[:1] in "+-" for line in body)
    # factory: -1 +3; data_manager: two groups of -1 +3; main: +2, -3 +2 -> 19 in all
    assert changed <= 20
    assert changed == 19


def test_missing_git_is_refused_with_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(patching.shutil, "which", lambda name: None)
    with pytest.raises(PatchError, match=r"git is not on PATH.*apt-get install git"):
        patching._git_apply(tmp_path, ["factory.diff"], reverse=False, check=True)


def test_unknown_bytes_are_refused_and_left_alone(tmp_path: Path) -> None:
    for name in patching.REQUIRED_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("# some other PILOT version\n")
    state = patching.inspect(tmp_path)
    assert {f.state for f in state.files} == {"modified"}
    with pytest.raises(PatchError, match=r"5240714.*git -C .* checkout -- utils/factory\.py"):
        patching.apply(tmp_path)
    assert (tmp_path / "utils/factory.py").read_text() == "# some other PILOT version\n"
    with pytest.raises(PatchError, match="pilot-online setup"):
        patching.ensure_patched(tmp_path)


# --------------------------------------------------------------------------------------------
# With a real PILOT checkout


@pytest.fixture
def pilot_root() -> Path:
    root = os.environ.get("PILOT_ROOT")
    if not root:
        pytest.skip(PILOT_SKIP_REASON)
    return Path(root)


@pytest.fixture
def our_exps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for our exps/ with one config, so the tests do not depend on the real ones."""
    folder = tmp_path / "ours" / "exps"
    folder.mkdir(parents=True)
    (folder / FAKE_CONFIG).write_text('{"model_name": "fake_online"}\n')
    monkeypatch.setattr(patching, "exps_dir", lambda: folder)
    return folder


@pytest.fixture
def checkout(pilot_root: Path, tmp_path: Path, our_exps: Path) -> Path:
    copy = tmp_path / "pilot"
    copy.mkdir()
    ignore = shutil.ignore_patterns(".git", "logs", "__pycache__")
    for folder in ("utils", "exps"):
        shutil.copytree(pilot_root / folder, copy / folder, ignore=ignore)
    (copy / "models").mkdir()
    for name in ("models/base.py", "main.py", "trainer.py"):
        shutil.copy2(pilot_root / name, copy / name)
    return copy


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(root: Path) -> dict[str, tuple[bool, bytes]]:
    """main.py and every path under utils/ and exps/ with whether it is a link and its link
    target/bytes."""
    snap = {}
    paths = [root / "main.py", *root.joinpath("utils").rglob("*"), *root.joinpath("exps").iterdir()]
    for path in sorted(paths):
        if path.is_symlink():
            snap[str(path.relative_to(root))] = (True, os.readlink(path).encode())
        elif path.is_file():
            snap[str(path.relative_to(root))] = (False, path.read_bytes())
    return snap


def test_pinned_hashes_match_the_real_checkout(pilot_root: Path) -> None:
    for rel, _ in patching.PATCHES:
        assert _sha(pilot_root / rel) == patching.UPSTREAM_SHA256[rel], (
            f"{pilot_root} is not at commit {patching.PINNED_COMMIT}"
        )


def test_pins_match_the_diffs_applied_by_git(pilot_root: Path, tmp_path: Path) -> None:
    """Recompute both pins with a plain `git apply`, outside any repository: if a diff in
    patches/ changes, this names the new hash to put in PATCHED_SHA256."""
    for rel, _ in patching.PATCHES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pilot_root / rel, tmp_path / rel)
    diffs = [str(patching.patches_dir() / diff) for _, diff in patching.PATCHES]
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path.parent))
    subprocess.run(["git", "apply", "-p1", *diffs], cwd=tmp_path, env=env, check=True)
    for rel, _ in patching.PATCHES:
        assert _sha(tmp_path / rel) == patching.PATCHED_SHA256[rel], f"new pin for {rel}"
    subprocess.run(["git", "apply", "-p1", "-R", *diffs], cwd=tmp_path, env=env, check=True)
    for rel, _ in patching.PATCHES:
        assert _sha(tmp_path / rel) == patching.UPSTREAM_SHA256[rel], rel


def test_checkout_inside_another_repository_is_patched(
    checkout: Path, tmp_path: Path, pilot_root: Path
) -> None:
    """git apply run from a subfolder of a repository would resolve paths against that
    repository's top and skip our files silently (the quickstart's .pilot/ sits in ours)."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert {f.state for f in patching.apply(checkout).files} == {"patched"}
    assert {f.state for f in patching.revert(checkout).files} == {"upstream"}
    for rel, _ in patching.PATCHES:
        assert (checkout / rel).read_bytes() == (pilot_root / rel).read_bytes()


def test_apply_check_revert_round_trip(
    checkout: Path, pilot_root: Path, our_exps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = patching.inspect(checkout)
    assert [f.state for f in state.files] == ["upstream"] * len(patching.PATCHES)
    assert state.missing_links == [FAKE_CONFIG]
    assert not state.patched
    assert setup_command.run_setup(_setup_args(str(checkout), "--check")) == 1
    with pytest.raises(PatchError, match=r"(?s)not patched yet.*Run `pilot-online setup"):
        patching.ensure_patched(checkout)
    pilot_own_configs = sorted(p.name for p in (checkout / "exps").iterdir())

    state = patching.apply(checkout)
    assert state.patched
    assert [f.state for f in state.files] == ["patched"] * len(patching.PATCHES)
    for rel, _ in patching.PATCHES:
        assert _sha(checkout / rel) == patching.PATCHED_SHA256[rel]
    link = checkout / "exps" / FAKE_CONFIG
    assert link.is_symlink()
    assert link.resolve() == (our_exps / FAKE_CONFIG).resolve()
    assert link.read_text() == '{"model_name": "fake_online"}\n'
    patching.ensure_patched(checkout)

    factory = (checkout / "utils/factory.py").read_text()
    data_manager = (checkout / "utils/data_manager.py").read_text()
    assert "assert 0" not in factory
    assert "from pilot_online.pilot import create_learner" in factory
    assert "idata.download_data()" not in data_manager
    assert "prepare(idata, dataset_name, self.args)" in data_manager
    assert "return get_idata(dataset_name, args)" in data_manager
    main_py = (checkout / "main.py").read_text()
    assert "json.load(data_file)" not in main_py
    assert main_py.index("import load_config") < main_py.index("from trainer import train")
    compile(factory, "utils/factory.py", "exec")
    compile(data_manager, "utils/data_manager.py", "exec")
    compile(main_py, "main.py", "exec")

    # applying again rewrites nothing
    before = {rel: os.stat(checkout / rel).st_mtime_ns for rel, _ in patching.PATCHES}
    link_inode = os.lstat(link).st_ino
    snapshot = _snapshot(checkout)
    assert setup_command.run_setup(_setup_args(str(checkout))) == 0
    assert _snapshot(checkout) == snapshot
    assert {rel: os.stat(checkout / rel).st_mtime_ns for rel, _ in patching.PATCHES} == before
    assert os.lstat(link).st_ino == link_inode

    capsys.readouterr()
    assert setup_command.run_setup(_setup_args(str(checkout), "--check")) == 0
    report = capsys.readouterr().out
    assert "utils/factory.py" in report and "status: patched" in report

    state = patching.revert(checkout)
    assert [f.state for f in state.files] == ["upstream"] * len(patching.PATCHES)
    for rel, _ in patching.PATCHES:
        assert (checkout / rel).read_bytes() == (pilot_root / rel).read_bytes()
    assert not os.path.lexists(link)
    assert sorted(p.name for p in (checkout / "exps").iterdir()) == pilot_own_configs

    snapshot = _snapshot(checkout)
    assert setup_command.run_setup(_setup_args(str(checkout), "--revert")) == 0
    assert _snapshot(checkout) == snapshot


def test_env_var_is_the_default_root(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PILOT_ROOT", str(checkout))
    assert setup_command.run_setup(_setup_args()) == 0
    assert patching.inspect(checkout).patched


def test_locally_modified_factory_is_refused_untouched(
    checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    factory = checkout / "utils/factory.py"
    edited = factory.read_bytes() + b"\n# my local experiment\n"
    factory.write_bytes(edited)
    snapshot = _snapshot(checkout)

    with pytest.raises(PatchError) as error:
        patching.apply(checkout)
    message = str(error.value)
    assert "utils/factory.py" in message and "5240714" in message
    assert f"git -C {checkout} checkout -- utils/factory.py" in message
    assert _snapshot(checkout) == snapshot  # data_manager not patched either, no link made

    assert setup_command.run_setup(_setup_args(str(checkout))) == 2
    assert "utils/factory.py" in capsys.readouterr().err
    with pytest.raises(PatchError, match="refusing to revert"):
        patching.revert(checkout)
    assert factory.read_bytes() == edited


@pytest.mark.parametrize("kind", ["file", "link"])
def test_foreign_config_with_our_name_is_refused(checkout: Path, kind: str) -> None:
    target = checkout / "exps" / FAKE_CONFIG
    if kind == "file":
        target.write_text("{}\n")
    else:
        target.symlink_to(checkout / "exps" / "l2p.json")
    snapshot = _snapshot(checkout)

    state = patching.inspect(checkout)
    assert state.foreign_links == [FAKE_CONFIG]
    with pytest.raises(PatchError, match=rf"exps/{FAKE_CONFIG} .* move or delete it"):
        patching.apply(checkout)
    assert _snapshot(checkout) == snapshot
    assert {f.state for f in patching.inspect(checkout).files} == {"upstream"}

    # revert leaves links that are not ours alone
    patching.revert(checkout)
    assert _snapshot(checkout) == snapshot


def test_stale_link_from_an_old_location_is_replaced_and_reverted(
    checkout: Path, tmp_path: Path, our_exps: Path
) -> None:
    old = tmp_path / "old-pilot-online"
    (old / "exps").mkdir(parents=True)
    (old / "pilot_online").mkdir()
    (old / "exps" / FAKE_CONFIG).write_text("{}\n")
    link = checkout / "exps" / FAKE_CONFIG
    link.symlink_to(old / "exps" / FAKE_CONFIG)

    state = patching.inspect(checkout)
    assert state.stale_links == [FAKE_CONFIG] and not state.patched
    assert patching.apply(checkout).patched
    assert link.resolve() == (our_exps / FAKE_CONFIG).resolve()
    patching.revert(checkout)
    assert not os.path.lexists(link)


def test_dangling_link_into_our_exps_is_removed_by_revert(checkout: Path, our_exps: Path) -> None:
    patching.apply(checkout)
    gone = checkout / "exps" / "retired_online.json"
    gone.symlink_to(our_exps / "retired_online.json")  # a config we no longer ship
    patching.revert(checkout)
    assert not os.path.lexists(gone)

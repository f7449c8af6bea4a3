"""Hook pilot-online into a LAMDA-PILOT checkout: three small diffs plus config links.

PILOT has no plugin mechanism: its model factory ends in ``assert 0`` and its dataset lookup
raises for unknown names. ``patches/`` holds small unified diffs that route unknown names to
pilot-online instead, and let ``main.py`` read its config through the plugin's loader (a broken
file is one line with its line and column); ``apply`` writes them into a checkout and links our
``exps/*.json`` into PILOT's ``exps/`` so that ``python main.py --config exps/<name>.json`` works
as usual.

Safety rules, because this edits someone else's checkout:

- Every file is identified by its SHA-256: only the pinned upstream bytes get patched and only our
  patched bytes get reverted, so an unknown PILOT version or a local edit is refused, never merged.
- All refusals are decided before anything is written, so a refusal changes nothing.
- Files are replaced atomically and ``revert`` restores the upstream bytes exactly.

The diffs are applied by ``git apply`` (``-R`` to revert), which also works outside a git
repository: ``--check`` on the checkout first, then the diffs are applied to a scratch copy of the
files, whose hashes must match the pins before the checkout is written.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..core.files import write_atomic

logger = logging.getLogger(__name__)

PINNED_COMMIT = "5240714"

# (path inside the PILOT root, diff file name inside patches/)
PATCHES: list[tuple[str, str]] = [
    ("utils/factory.py", "factory.diff"),
    ("utils/data_manager.py", "data_manager.diff"),
    ("main.py", "main.diff"),
]

# SHA-256 of the files at LAMDA-PILOT commit 5240714, and after applying our diffs to them.
UPSTREAM_SHA256: dict[str, str] = {
    "utils/factory.py": "da71488c0e12f2433ed5de46a038d199dcc794b22371be715bee44af98eef2aa",
    "utils/data_manager.py": "74601c9c46d1e51ee95ee20c8a261b28325b997586bd3bf6e78a361d41289857",
    "main.py": "23d494c98deaf6a408664865f7d7dc1259a417531ab2d0c975dcbb02d14117ca",
}
PATCHED_SHA256: dict[str, str] = {
    "utils/factory.py": "e003f1a35a38bc7978997c40c4f0081d1e818c3dd126820d0dd752202b22d2fc",
    "utils/data_manager.py": "8de062bc17cfee47f938751c088e21f3160f84ec45cf00705c45a96d79c62379",
    "main.py": "5bd99e7074bf42090079a8151c2edadac987d16062f62d73ea0a23ef96719ff2",
}

# Files whose presence tells a LAMDA-PILOT checkout apart from any other folder.
REQUIRED_FILES: tuple[str, ...] = (
    "main.py",
    "trainer.py",
    "utils/factory.py",
    "utils/data_manager.py",
    "models/base.py",
)

PILOT_EXPS = "exps"

FILE_STATES = ("upstream", "patched", "modified", "missing")


class PatchError(RuntimeError):
    """A checkout cannot be patched or reverted safely; the message says what to do."""


# --------------------------------------------------------------------------------------------
# Where our files live


def _repo_dir(name: str) -> Path:
    """A top-level folder of the pilot-online checkout (it ships next to the package)."""
    path = Path(__file__).resolve().parents[2] / name
    if not path.is_dir():
        raise PatchError(
            f"pilot-online's {name}/ folder was not found at {path}: it lives in the source "
            "checkout, not in the installed package. Install from a checkout with "
            "`pip install -e .` and run this again."
        )
    return path


def patches_dir() -> Path:
    """The repository's ``patches/`` folder holding the diffs against pinned PILOT."""
    return _repo_dir("patches")


def exps_dir() -> Path:
    """The repository's ``exps/`` folder holding our PILOT-style JSON configs."""
    return _repo_dir("exps")


# --------------------------------------------------------------------------------------------
# Applying the diffs with `git apply`


def _diff_path(diff_name: str) -> Path:
    path = patches_dir() / diff_name
    if not path.is_file():
        raise PatchError(
            f"pilot-online's patch {path} is missing: restore it (`git checkout -- patches/`) "
            "in your pilot-online checkout"
        )
    return path


def _git() -> str:
    git = shutil.which("git")
    if git is None:
        raise PatchError(
            "`pilot-online setup` applies patches/*.diff with `git apply`, and git is not on "
            "PATH: install git (`apt-get install git`, `conda install git`, or "
            "https://git-scm.com/downloads) and run this again"
        )
    return git


def _git_apply(root: Path, diff_names: list[str], *, reverse: bool, check: bool) -> None:
    """Run ``git apply [-R] [--check] -p1`` on ``diff_names`` from ``root``; raise with git's
    message on failure. The folder above ``root`` is a ceiling, so a checkout that sits inside
    another repository (the quickstart's ``.pilot/``) is not patched relative to that one."""
    if not diff_names:
        return
    command = [_git(), "apply", "-p1", *(["-R"] if reverse else [])]
    command += ["--check"] if check else []
    command += [str(_diff_path(name)) for name in diff_names]
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        action = "revert" if reverse else "apply"
        raise PatchError(
            f"`git apply{' -R' if reverse else ''}` cannot {action} {', '.join(diff_names)} in "
            f"{root}: {done.stderr.strip() or done.stdout.strip()}"
        )


# --------------------------------------------------------------------------------------------
# Inspecting a checkout


@dataclass
class FileState:
    """``state`` is one of FILE_STATES; ``modified`` means bytes we do not recognise."""

    path: str
    state: str


@dataclass
class CheckoutState:
    """What ``inspect`` found. Link lists hold config file names (``l2p_online.json``).

    ``stale_links`` are links to our config from an old location of pilot-online (``apply``
    replaces them); ``foreign_links`` are real files or links to something else under one of
    our names (``apply`` refuses to touch them).
    """

    root: Path
    files: list[FileState]
    linked_configs: list[str]
    missing_links: list[str]
    foreign_links: list[str]
    stale_links: list[str] = field(default_factory=list)

    @property
    def patched(self) -> bool:
        return (
            all(f.state == "patched" for f in self.files)
            and not self.missing_links
            and not self.foreign_links
            and not self.stale_links
        )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checkout_root(root: str | os.PathLike[str]) -> Path:
    """Refuse anything that is not a LAMDA-PILOT checkout, naming what is missing."""
    path = Path(root).expanduser()
    if not path.is_dir():
        raise PatchError(
            f"PILOT_ROOT {path} does not exist or is not a folder: PILOT_ROOT must point at a "
            f"LAMDA-PILOT checkout (git clone https://github.com/LAMDA-CL/LAMDA-PILOT, "
            f"commit {PINNED_COMMIT})"
        )
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise PatchError(
            f"{path} is not a LAMDA-PILOT checkout: missing {', '.join(missing)}. "
            f"PILOT_ROOT must point at a LAMDA-PILOT checkout (commit {PINNED_COMMIT}), the "
            "folder that holds main.py"
        )
    return path.resolve()


def _file_state(path: Path, rel: str) -> str:
    if not path.is_file():
        return "missing"
    digest = _sha256(path)
    if digest == UPSTREAM_SHA256[rel]:
        return "upstream"
    if digest == PATCHED_SHA256[rel]:
        return "patched"
    return "modified"


def _link_target(link: Path) -> str:
    """Where a symlink points, as an absolute normalised path (it may not exist)."""
    raw = os.readlink(link)
    return os.path.normpath(os.path.join(link.parent, raw))


def _link_state(link: Path, ours: Path) -> str:
    """``linked``, ``missing``, ``stale`` (ours from an old location) or ``foreign``."""
    if link.is_symlink():
        if os.path.realpath(link) == os.path.realpath(ours):
            return "linked"
        target = Path(_link_target(link))
        looks_like_ours = target.name == ours.name and target.parent.name == "exps"
        if looks_like_ours and (
            not os.path.lexists(target) or (target.parent.parent / "pilot_online").is_dir()
        ):
            return "stale"
        return "foreign"
    if os.path.lexists(link):
        return "foreign"
    return "missing"


def _our_configs() -> list[Path]:
    return sorted(exps_dir().glob("*.json"))


def inspect(root: str | os.PathLike[str]) -> CheckoutState:
    """Report the state of a PILOT checkout without changing anything."""
    path = _checkout_root(root)
    files = [FileState(rel, _file_state(path / rel, rel)) for rel, _ in PATCHES]
    groups: dict[str, list[str]] = {"linked": [], "missing": [], "foreign": [], "stale": []}
    for config in _our_configs():
        state = _link_state(path / PILOT_EXPS / config.name, config)
        groups[state].append(config.name)
    return CheckoutState(
        root=path,
        files=files,
        linked_configs=groups["linked"],
        missing_links=groups["missing"],
        foreign_links=groups["foreign"],
        stale_links=groups["stale"],
    )


def _describe_foreign(root: Path, name: str) -> str:
    link = root / PILOT_EXPS / name
    what = f"a link to {_link_target(link)}" if link.is_symlink() else "a real file"
    return (
        f"{PILOT_EXPS}/{name} in {root} is {what}, not pilot-online's config: move or delete it, "
        "then run `pilot-online setup` again"
    )


def _describe_modified(root: Path, rel: str) -> str:
    return (
        f"{rel} in {root} matches neither LAMDA-PILOT commit {PINNED_COMMIT} nor its "
        f"pilot-online patched version (another PILOT version or a local edit). Check out the "
        f"pinned commit (`git -C {root} checkout {PINNED_COMMIT}`) or drop local changes "
        f"(`git -C {root} checkout -- {rel}`), then run `pilot-online setup {root}` again"
    )


def _refusals(state: CheckoutState) -> list[str]:
    problems = [
        _describe_modified(state.root, f.path) for f in state.files if f.state == "modified"
    ]
    problems += [
        f"{f.path} is missing from {state.root}: restore it with "
        f"`git -C {state.root} checkout -- {f.path}`"
        for f in state.files
        if f.state == "missing"
    ]
    problems += [_describe_foreign(state.root, name) for name in state.foreign_links]
    return problems


# --------------------------------------------------------------------------------------------
# Writing


def _symlink_atomic(link: Path, target: Path) -> None:
    """Create or replace the symlink ``link -> target`` in one step."""
    tmp_link = link.parent / f".{link.name}.pilot-online-tmp"
    if os.path.lexists(tmp_link):
        os.unlink(tmp_link)
    os.symlink(target, tmp_link)
    os.replace(tmp_link, link)


def _transformed(
    root: Path, pending: list[tuple[str, str]], *, reverse: bool, expected: dict[str, str]
) -> dict[str, bytes]:
    """New bytes for each pending ``(file, diff)``, made by ``git apply`` in a scratch copy and
    checked against the hashes they must have; the checkout itself is only read."""
    diffs = [diff for _, diff in pending]
    _git_apply(root, diffs, reverse=reverse, check=True)
    with tempfile.TemporaryDirectory(prefix="pilot-online-setup-") as scratch:
        scratch_root = Path(scratch) / "pilot"
        for rel, _ in pending:
            (scratch_root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, scratch_root / rel)
        _git_apply(scratch_root, diffs, reverse=reverse, check=False)
        result = {rel: (scratch_root / rel).read_bytes() for rel, _ in pending}
    for rel, diff in pending:
        if hashlib.sha256(result[rel]).hexdigest() != expected[rel]:
            raise PatchError(
                f"applying {diff} to {rel} did not give the expected bytes: pilot-online's "
                "patches/ and the pins in pilot_online/pilot/patching.py disagree; reinstall "
                "pilot-online from a clean checkout"
            )
    return result


def apply(root: str | os.PathLike[str]) -> CheckoutState:
    """Patch upstream files and link our configs; already-patched parts are left alone.

    Everything that could make us refuse is checked, and every new file content is computed,
    before the first write.
    """
    state = inspect(root)
    problems = _refusals(state)
    if problems:
        raise PatchError("refusing to patch:\n- " + "\n- ".join(problems))

    pending = [patch for patch, f in zip(PATCHES, state.files) if f.state == "upstream"]
    new_bytes = _transformed(state.root, pending, reverse=False, expected=PATCHED_SHA256)
    configs = {config.name: config for config in _our_configs()}

    for rel, data in new_bytes.items():
        write_atomic(state.root / rel, data)
        logger.info("patched %s", state.root / rel)
    pilot_exps = state.root / PILOT_EXPS
    pilot_exps.mkdir(exist_ok=True)
    for name in state.missing_links + state.stale_links:
        _symlink_atomic(pilot_exps / name, configs[name])
        logger.info("linked %s -> %s", pilot_exps / name, configs[name])
    return inspect(state.root)


def _our_links(root: Path) -> list[Path]:
    """Symlinks in PILOT's exps/ that point into our exps/ (even dangling) or are stale ours."""
    pilot_exps = root / PILOT_EXPS
    if not pilot_exps.is_dir():
        return []
    ours_dir = os.path.realpath(exps_dir())
    configs = {config.name: config for config in _our_configs()}
    found = []
    for link in sorted(pilot_exps.iterdir()):
        if not link.is_symlink():
            continue
        points_into_ours = os.path.dirname(os.path.realpath(link)) == ours_dir
        stale = link.name in configs and _link_state(link, configs[link.name]) == "stale"
        if points_into_ours or stale:
            found.append(link)
    return found


def revert(root: str | os.PathLike[str]) -> CheckoutState:
    """Restore the upstream bytes exactly and remove our config links; a no-op when clean."""
    state = inspect(root)
    problems = [
        _describe_modified(state.root, f.path) for f in state.files if f.state == "modified"
    ]
    if problems:
        raise PatchError("refusing to revert:\n- " + "\n- ".join(problems))

    pending = [patch for patch, f in zip(PATCHES, state.files) if f.state == "patched"]
    old_bytes = _transformed(state.root, pending, reverse=True, expected=UPSTREAM_SHA256)
    links = _our_links(state.root)

    for rel, data in old_bytes.items():
        write_atomic(state.root / rel, data)
        logger.info("restored upstream %s", state.root / rel)
    for link in links:
        link.unlink()
        logger.info("removed link %s", link)
    return inspect(state.root)


def some_names(names: list[str], shown: int = 3) -> str:
    """``a.json, b.json, c.json and 240 more``: a count, not one line per config."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _problems_for_run(state: CheckoutState) -> list[str]:
    problems = _refusals(state)
    problems += [f"{f.path} is not patched yet" for f in state.files if f.state == "upstream"]
    if state.missing_links:
        problems.append(
            f"{len(state.missing_links)} of pilot-online's configs are not linked into "
            f"{PILOT_EXPS}/ yet ({some_names(state.missing_links)})"
        )
    if state.stale_links:
        problems.append(
            f"{len(state.stale_links)} configs in {PILOT_EXPS}/ link to an old pilot-online "
            f"location ({some_names(state.stale_links)})"
        )
    return problems


def ensure_patched(root: str | os.PathLike[str]) -> None:
    """Stop a run early, with the fix, unless the checkout is fully set up for pilot-online;
    each problem is one line, however many configs it concerns."""
    state = inspect(root)
    if state.patched:
        return
    problems = _problems_for_run(state)
    raise PatchError(
        f"PILOT at {state.root} is not set up for pilot-online:\n- "
        + "\n- ".join(problems)
        + f"\nRun `pilot-online setup {state.root}` first."
    )

"""``pilot-online clean``: delete the checkpoints that interrupted runs left, and nothing else.

An interrupted run keeps its checkpoint beside its results file (``x.ckpt.pt``) so that the same
command resumes it; one of an ER run on ViT-B is about a gigabyte. This command finds them (and
the temporary files of a writer that was killed), lists each with its size, and deletes them;
``--dry-run`` lists only. Results files, logs and anything else are never touched.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

from ..core.files import human_bytes
from ..core.progress import plural
from ..engine.checkpoint import CHECKPOINT_SUFFIX


class NotACheckpointError(ValueError):
    """A path given to clean that is missing or is no checkpoint: nothing is deleted."""


def add_clean_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths",
        nargs="*",
        type=Path,
        default=[Path(".")],
        help="checkpoint files, or folders searched recursively (default: the current folder)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be deleted, delete nothing"
    )


def is_checkpoint(path: Path) -> bool:
    """A pilot-online checkpoint (``*.ckpt.pt``, a torch zip archive) or a killed writer's
    temporary beside one (``.x.ckpt.pt.<random>.tmp``)."""
    name = path.name
    if name.startswith(".") and name.endswith(".tmp") and CHECKPOINT_SUFFIX + "." in name:
        return path.is_file()
    return name.endswith(CHECKPOINT_SUFFIX) and path.is_file() and zipfile.is_zipfile(path)


def find_checkpoints(paths: list[Path]) -> list[Path]:
    """Every checkpoint at or under ``paths``, sorted, each once."""
    found: set[Path] = set()
    for path in paths:
        if not path.exists():
            raise NotACheckpointError(f"{path} does not exist: give a checkpoint file or a folder")
        candidates = path.rglob("*") if path.is_dir() else [path]
        found.update(p.resolve() for p in candidates if is_checkpoint(p))
        if path.is_file() and not is_checkpoint(path):
            raise NotACheckpointError(
                f"{path} is not a pilot-online checkpoint (*{CHECKPOINT_SUFFIX}): clean deletes "
                "checkpoints only"
            )
    return sorted(found)


def run_clean(args: argparse.Namespace) -> int:
    try:
        checkpoints = find_checkpoints(args.paths)
    except NotACheckpointError as err:
        print(f"pilot-online clean: {err}; nothing was deleted", file=sys.stderr)
        return 2
    if not checkpoints:
        print("no checkpoints found under " + ", ".join(str(p) for p in args.paths))
        return 0
    sizes = [path.stat().st_size for path in checkpoints]
    for path, size in zip(checkpoints, sizes):
        print(f"{human_bytes(size):>9}  {path}")
    count = plural(len(checkpoints), "checkpoint")
    total = human_bytes(sum(sizes))
    if args.dry_run:
        print(f"would delete {count} ({total}); nothing deleted (--dry-run)")
        return 0
    for path in checkpoints:
        path.unlink(missing_ok=True)
    print(f"deleted {count} ({total}); the runs they belonged to start over if rerun")
    return 0

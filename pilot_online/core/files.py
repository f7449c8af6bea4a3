"""One way to write a file: atomically, so a crash leaves the old file or the new one, never half.

The data goes to a hidden temporary file in the same folder (same filesystem, so the rename is
atomic), is flushed and fsync'ed, then ``os.replace``d onto the target; the folder is fsync'ed so
the rename survives a power cut. On any error the temporary file is removed and the target is
untouched. An existing target keeps its permission bits; a new one gets a plain file's (0o666
less the umask, 644 as a rule), not the 600 of the temporary file, so that collaborators can read
results and tables.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Replace (or create) ``path`` with ``data`` in one step; ``str`` is written as UTF-8."""
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    return write_atomic_with(path, lambda handle: handle.write(payload))


def write_atomic_with(path: str | os.PathLike[str], writer: Callable[[BinaryIO], object]) -> Path:
    """Like :func:`write_atomic`, with ``writer`` streaming the bytes into an open binary file
    (``torch.save`` of a large checkpoint, without a second copy in memory)."""
    target = Path(path)
    mode = target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask()
    handle, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as tmp:
            writer(tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_directory(target.parent)
    return target


def _umask() -> int:
    """The process's umask (read by setting it, so set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable on POSIX; skipped where folders cannot be opened (Windows)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def human_bytes(size: int) -> str:
    """``1.03 GB``, ``74 MB``, ``512 B``: a file's size for people (decimal units, as ``ls -h
    --si`` and file managers give them)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return (
                f"{size / scale:.3g} {unit}" if size < 100 * scale else f"{size / scale:.0f} {unit}"
            )
    return f"{size} B"


def sha256(path: str | os.PathLike[str]) -> str:
    """The file's SHA-256, hex, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()

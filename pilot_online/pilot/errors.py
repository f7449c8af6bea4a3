"""User errors end in their message alone: one place decides what is one and how it is shown.

A user error is a wrong config, a missing dataset or missing weights, a checkpoint that does not
fit, an unpatched PILOT: its message already says what to change, and a traceback only buries
it. Every entry point shows it the same way: ``pilot-online`` (its ``main()`` wraps each
subcommand) and PILOT's own ``main.py``, which has no wrapper of ours, through
:func:`install_excepthook` (the patched ``main.py`` installs it before it reads the config, and
the patched data manager's first call into the plugin before any data loads). A traceback
comes back with ``pilot-online --verbose`` or ``PILOT_ONLINE_TRACEBACK=1``; any other exception
(a bug) keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType


class DatasetUnavailableError(RuntimeError):
    """The dataset's files are missing and could not be downloaded (``pilot/data.py``)."""


#: Set to 1 to see the traceback of a user error too.
TRACEBACK_FLAG = "PILOT_ONLINE_TRACEBACK"


def show_tracebacks(verbose: bool = False) -> bool:
    """Whether user errors keep their traceback (``--verbose`` or the environment variable)."""
    return verbose or os.environ.get(TRACEBACK_FLAG, "") not in ("", "0")


def _user_error_types() -> tuple[type[BaseException], ...]:
    # Imported when an error is shown, not before: this module must stay cheap to import.
    from ..core.results import ResultsNotFoundError
    from ..engine.checkpoint import CheckpointError
    from ..engine.config import ConfigError
    from .backbones import WeightsUnavailableError
    from .patching import PatchError

    return (
        ConfigError,
        CheckpointError,
        DatasetUnavailableError,
        WeightsUnavailableError,
        PatchError,
        ResultsNotFoundError,
    )


def user_error_line(error: BaseException, program: str = "pilot-online") -> str | None:
    """The line a user error ends in, or None for an error that is not one (a bug)."""
    if isinstance(error, KeyboardInterrupt):
        return (
            f"{program}: interrupted; rerun the same command (a run resumes from its last "
            "checkpoint, if it wrote one)"
        )
    if isinstance(error, _user_error_types()):
        return f"{program}: {error}"
    return None


def install_excepthook() -> None:
    """Show user errors that reach the top of PILOT's ``main.py`` as their line alone."""
    if getattr(sys.excepthook, "pilot_online", False):
        return
    previous = sys.excepthook

    def hook(
        kind: type[BaseException], error: BaseException, traceback: TracebackType | None
    ) -> None:
        line = None if show_tracebacks() else user_error_line(error)
        if line is None:
            previous(kind, error, traceback)
        else:
            print(line, file=sys.stderr, flush=True)

    hook.pilot_online = True  # type: ignore[attr-defined]
    sys.excepthook = hook

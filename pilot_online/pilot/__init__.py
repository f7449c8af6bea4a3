"""The PILOT glue: the only code that imports or edits LAMDA-PILOT (the learner, the data hooks,
backbone options, and ``setup``'s patching). Importing this package imports nothing from PILOT;
:func:`create_learner` imports it when PILOT's patched factory calls it, and PILOT's patched
``main.py`` reads its config with :func:`load_config`.
"""

from __future__ import annotations

from typing import Any


def create_learner(args: dict[str, Any]):
    """Build the online PILOT learner for ``args["model_name"]`` (called by PILOT's factory)."""
    from ..engine.registry import get_method
    from .learner import OnlineLearner

    return OnlineLearner(args, get_method(str(args.get("model_name", ""))))


def load_config(path: str) -> dict[str, Any]:
    """PILOT's ``main.py`` reads ``--config`` here (``patches/main.diff``): through the plugin's
    one loader, with the hook that shows user errors as their line installed first, so that a
    missing or malformed file ends in one line naming its line and column, not a traceback."""
    from ..engine.config import load_json
    from .errors import install_excepthook

    install_excepthook()
    return load_json(path)


__all__ = ["create_learner", "load_config"]

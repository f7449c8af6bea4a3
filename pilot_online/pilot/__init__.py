"""The PILOT glue: the only code that imports or edits LAMDA-PILOT (the learner, the data hooks,
backbone options, and ``setup``'s patching). Importing this package imports nothing from PILOT;
:func:`create_learner` imports it when PILOT's patched factory calls it.
"""

from __future__ import annotations

from typing import Any


def create_learner(args: dict[str, Any]):
    """Build the online PILOT learner for ``args["model_name"]`` (called by PILOT's factory)."""
    from ..engine.registry import get_method
    from .learner import OnlineLearner

    return OnlineLearner(args, get_method(str(args.get("model_name", ""))))


__all__ = ["create_learner"]

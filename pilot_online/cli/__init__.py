"""The ``pilot-online`` command and its tools: run, setup, sweep, report, check-config, demo."""

from .main import main

__all__ = ["main"]

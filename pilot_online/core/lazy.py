"""torch, imported the first time it is used, so that commands which only read configs never
import it (``pilot-online methods``, ``check-config``: ``tests/test_cli_imports.py``).

Why: importing torch takes seconds, and the key tables, the method adapters and their cards are
plain data. Modules of ``core``, ``engine`` and ``methods`` bind ``torch``, ``nn`` and ``F`` from
here instead of importing them::

    from ..core.lazy import F, nn, no_grad, torch

Each is a module object standing in for the real one. Its first attribute access imports the
real module and puts it in place of the stand-in in every ``pilot_online`` module that bound it
(this module included), so from then on each name *is* torch: lookups cost what they always did,
and ``monkeypatch.setattr(torch, ...)`` reaches our code as it reaches anyone's. The scientific
Python ecosystem loads its heavy modules the same way (SPEC 1, ``lazy_loader``).

What must not run at import in such a module, because it would import torch there: a module-level
``class X(nn.Module)``, a decorator ``@torch.no_grad()`` (use :func:`no_grad`), a constant such as
``torch.float32``. A module that needs one of them imports torch as usual, and the light commands
must not import it.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any, Callable, TypeVar


class LazyModule(types.ModuleType):
    """Stands in for the module ``name`` until an attribute is read."""

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):  # copy, pickle and inspect probe dunders: not a use
            raise AttributeError(attribute)
        real = importlib.import_module(self.__name__)
        _put_in_place(self, real)
        return getattr(real, attribute)

    def __repr__(self) -> str:
        return f"<lazy module {self.__name__!r}, not imported yet>"


def _put_in_place(stand_in: LazyModule, real: types.ModuleType) -> None:
    """Bind ``real`` wherever a ``pilot_online`` module bound ``stand_in``. A module outside the
    package that bound it keeps the stand-in, which goes on delegating to ``real``."""
    for name, module in list(sys.modules.items()):
        if name != "pilot_online" and not name.startswith("pilot_online."):
            continue
        namespace = getattr(module, "__dict__", None) or {}
        for key, value in list(namespace.items()):
            if value is stand_in:
                namespace[key] = real


torch = LazyModule("torch")
nn = LazyModule("torch.nn")
F = LazyModule("torch.nn.functional")

FunctionT = TypeVar("FunctionT", bound=Callable[..., Any])


def no_grad(function: FunctionT) -> FunctionT:
    """``@torch.no_grad()``, whose use as a decorator would import torch when the module is."""

    @functools.wraps(function)
    def without_gradients(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return function(*args, **kwargs)

    return without_gradients  # type: ignore[return-value]

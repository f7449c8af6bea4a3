"""Method registry: names in configs map to adapter classes through a decorator (as timm registers
models), and :func:`create_learner` is the one entry point PILOT's patched factory calls.

Differences from timm: a duplicate name raises, and the built-in adapters are imported explicitly by
:func:`_load_builtin_methods` rather than by import side effects scattered over the package.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, TypeVar

from .adapter import MethodAdapter

_METHODS: dict[str, type[MethodAdapter]] = {}
_BUILTIN_MODULES = ("pilot_online.l2p", "pilot_online.dualprompt", "pilot_online.coda_prompt")
_builtins_loaded = False

AdapterT = TypeVar("AdapterT", bound=type[MethodAdapter])


def register_method(name: str) -> Callable[[AdapterT], AdapterT]:
    """Register an adapter class under ``name`` (the config's ``model_name``)."""

    def decorator(cls: AdapterT) -> AdapterT:
        if name in _METHODS:
            raise ValueError(
                f"method {name!r} is already registered by {_METHODS[name].__module__}; "
                "pick another name"
            )
        if not (isinstance(cls, type) and issubclass(cls, MethodAdapter)):
            raise TypeError(f"{cls!r} must subclass pilot_online.adapter.MethodAdapter")
        _METHODS[name] = cls
        return cls

    return decorator


def _load_builtin_methods() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def list_methods() -> list[str]:
    """Registered method names, sorted."""
    _load_builtin_methods()
    return sorted(_METHODS)


def get_method(name: str) -> type[MethodAdapter]:
    """The adapter class for ``name``; unknown names raise with the valid choices."""
    _load_builtin_methods()
    try:
        return _METHODS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown model_name {name!r}. pilot-online methods: {', '.join(list_methods())}; "
            "upstream PILOT names (l2p, coda_prompt, ...) are handled by PILOT itself"
        ) from None


def create_learner(args: dict[str, Any]):
    """Build the online PILOT learner for ``args["model_name"]`` (called by PILOT's factory).

    PILOT is imported here, not at package import, so the core stays PILOT-free.
    """
    adapter_cls = get_method(str(args.get("model_name", "")))
    from .learner import OnlineLearner

    return OnlineLearner(args, adapter_cls)

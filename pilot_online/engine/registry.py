"""Method registry: names in configs map to adapter classes through a decorator, as timm registers
models. PILOT's patched factory reaches it through :func:`pilot_online.pilot.create_learner`.

Differences from timm: a duplicate name raises, and the built-in adapters are registered by the
explicit imports of ``pilot_online/methods/__init__.py`` (which ``import pilot_online`` runs).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from .adapter import MethodAdapter

_METHODS: dict[str, type[MethodAdapter]] = {}

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
            raise TypeError(f"{cls!r} must subclass pilot_online.engine.adapter.MethodAdapter")
        if cls.paper_name and "paper_name" not in vars(cls):
            raise TypeError(
                f"{cls.__name__} ({name!r}) inherits paper_name {cls.paper_name!r}, so reports "
                f'would label it as that method: set paper_name in {cls.__name__} ("" labels it '
                f"{name!r})"
            )
        _METHODS[name] = cls
        return cls

    return decorator


def list_methods() -> list[str]:
    """Registered method names, sorted."""
    return sorted(_METHODS)


def get_method(name: str) -> type[MethodAdapter]:
    """The adapter class for ``name``; unknown names raise with the valid choices."""
    try:
        return _METHODS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown model_name {name!r}. pilot-online methods: {', '.join(list_methods())}; "
            "upstream PILOT names (l2p, coda_prompt, ...) are handled by PILOT itself"
        ) from None

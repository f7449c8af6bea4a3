"""Method registry: names in configs map to adapter classes through a decorator, as timm registers
models. PILOT's patched factory reaches it through :func:`pilot_online.pilot.create_learner`.

Differences from timm: a duplicate name raises, and the built-in adapters are registered by the
explicit imports of ``pilot_online/methods/__init__.py`` (which ``import pilot_online`` runs).

Methods from outside the package register through the ``pilot_online.methods`` entry point
group, with no edit here: in the third party's ``pyproject.toml``

    [project.entry-points."pilot_online.methods"]
    my_method_online = "my_package.adapter:MyAdapter"

(or ``setup.py``'s ``entry_points={"pilot_online.methods": ["name = module:Class"]}``). The
entry point's name is the config's ``model_name``; it names either the adapter class (registered
under that name) or a module whose import registers it with :func:`register_method`. They are
loaded once, the first time a name is listed or looked up.
"""

from __future__ import annotations

from importlib import metadata
from typing import Callable, TypeVar

from .adapter import MethodAdapter

#: The entry point group third-party methods register under.
ENTRY_POINT_GROUP = "pilot_online.methods"

_METHODS: dict[str, type[MethodAdapter]] = {}
_entry_points_loaded = False

AdapterT = TypeVar("AdapterT", bound=type[MethodAdapter])


def register_method(name: str) -> Callable[[AdapterT], AdapterT]:
    """Register an adapter class under ``name`` (the config's ``model_name``), which must be
    lower case: PILOT's factory lower-cases ``model_name`` before it looks the method up."""

    def decorator(cls: AdapterT) -> AdapterT:
        if name != name.lower():
            raise ValueError(
                f"method name {name!r} has capitals, but PILOT lower-cases model_name before "
                f"its factory looks it up, so configs could never reach it: register "
                f"{name.lower()!r}"
            )
        if name in _METHODS:
            raise ValueError(
                f"method {name!r} is already registered by {_METHODS[name].__module__}; "
                "pick another name"
            )
        if not (isinstance(cls, type) and issubclass(cls, MethodAdapter)):
            raise TypeError(f"{cls!r} must subclass pilot_online.engine.adapter.MethodAdapter")
        for label in ("paper_name", "full_name"):  # a subclass is another method: own names
            inherited = getattr(cls, label)
            if inherited and label not in vars(cls):
                raise TypeError(
                    f"{cls.__name__} ({name!r}) inherits {label} {inherited!r}, so reports and "
                    f"`pilot-online methods` would name it as that method: set {label} in "
                    f'{cls.__name__} ("" labels it {name!r})'
                )
        _METHODS[name] = cls
        return cls

    return decorator


def load_entry_point_methods() -> None:
    """Register the methods of every installed ``pilot_online.methods`` entry point (once)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True  # before loading: a plugin's own lookups must not recurse
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {entry.name} = {entry.value} ({ENTRY_POINT_GROUP})"
        try:
            loaded = entry.load()
        except Exception as err:
            raise ImportError(f"the {where} failed to import: {type(err).__name__}: {err}") from err
        if isinstance(loaded, type) and issubclass(loaded, MethodAdapter):
            if _METHODS.get(entry.name) is not loaded:
                register_method(entry.name)(loaded)
        elif entry.name not in _METHODS:
            raise ValueError(
                f"the {where} must name a MethodAdapter subclass, or a module that registers "
                f"{entry.name!r} with @register_method"
            )


def list_methods() -> list[str]:
    """Registered method names, sorted (entry-point methods included)."""
    load_entry_point_methods()
    return sorted(_METHODS)


def get_method(name: str) -> type[MethodAdapter]:
    """The adapter class for ``name``; unknown names raise with the valid choices."""
    if name.lower() not in _METHODS:
        load_entry_point_methods()
    try:
        return _METHODS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown model_name {name!r}. pilot-online methods: {', '.join(list_methods())}; "
            "upstream PILOT names (l2p, coda_prompt, ...) are handled by PILOT itself"
        ) from None

"""Method registry: names in configs map to adapter classes through a decorator, as timm registers
models. PILOT's patched factory reaches it through :func:`pilot_online.pilot.create_learner`.

Differences from timm: a duplicate name raises, and nothing registers at import. The built-in
methods are the modules of the ``pilot_online/methods/`` folder, found on disk and imported the
first time a name is listed or looked up, as the entry points below are: a new method is one file
in that folder, and commands that need no method (``pilot-online --help``) never import torch.

Methods from outside the package register through the ``pilot_online.methods`` entry point
group, with no edit here: in the third party's ``pyproject.toml``

    [project.entry-points."pilot_online.methods"]
    my_method_online = "my_package.adapter:MyAdapter"

(or ``setup.py``'s ``entry_points={"pilot_online.methods": ["name = module:Class"]}``). The
entry point's name is the config's ``model_name``; it names either the adapter class (registered
under that name) or a module whose import registers it with :func:`register_method`. They are
loaded once, the first time a name is listed or looked up. A module registers its method with
its card (``@register_method("my_method_online", card=MethodCard(...))``, ``engine/card.py``); an
entry point that names the class registers it with an empty card.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import fields, replace
from importlib import metadata
from typing import Callable, TypeVar

from .adapter import MethodAdapter
from .card import MethodCard

#: The entry point group third-party methods register under.
ENTRY_POINT_GROUP = "pilot_online.methods"
#: The package whose every module is a built-in method's file.
BUILTIN_PACKAGE = "pilot_online.methods"

_METHODS: dict[str, type[MethodAdapter]] = {}
_CARDS: dict[str, MethodCard] = {}
_entry_points_loaded = False
_builtins_loaded = False

AdapterT = TypeVar("AdapterT", bound=type[MethodAdapter])


def register_method(name: str, card: MethodCard | None = None) -> Callable[[AdapterT], AdapterT]:
    """Register an adapter class under ``name`` (the config's ``model_name``), which must be
    lower case: PILOT's factory lower-cases ``model_name`` before it looks the method up, with the
    tooling's facts about it (``card``, ``engine/card.py``; None: an empty card)."""
    if card is None:
        card = MethodCard()
    if not isinstance(card, MethodCard):
        raise TypeError(f"register_method({name!r}, card=...) needs a MethodCard, got {card!r}")

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
        misplaced = [f.name for f in fields(MethodCard) if hasattr(cls, f.name)]
        if misplaced:  # a class attribute the tooling would never read
            raise TypeError(
                f"{cls.__name__} ({name!r}) sets {', '.join(misplaced)} on the adapter class, "
                f"where nothing reads it: these are card fields, pass them as "
                f"register_method({name!r}, card=MethodCard({misplaced[0]}=...))"
            )
        if card.upstream_model is None:  # the network's own PILOT model
            resolved = replace(card, upstream_model=cls.base_model_name)
        else:
            resolved = card
        _METHODS[name] = cls
        _CARDS[name] = resolved
        return cls

    return decorator


def builtin_modules() -> list[str]:
    """The built-in methods' modules: every module of :data:`BUILTIN_PACKAGE`, by name."""
    package = importlib.import_module(BUILTIN_PACKAGE)
    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__))
    return [f"{BUILTIN_PACKAGE}.{name}" for name in names]


def load_builtin_methods() -> None:
    """Import every built-in method's module, which registers it (once)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True  # before importing: a method file's own lookups must not recurse
    for module in builtin_modules():
        importlib.import_module(module)


def load_methods() -> None:
    """Register every method: the built-in ones, then the entry points'."""
    load_builtin_methods()
    load_entry_point_methods()


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
    load_methods()
    return sorted(_METHODS)


def get_method(name: str) -> type[MethodAdapter]:
    """The adapter class for ``name``; unknown names raise with the valid choices."""
    if name.lower() not in _METHODS:
        load_methods()
    try:
        return _METHODS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown model_name {name!r}. pilot-online methods: {', '.join(list_methods())}; "
            "upstream PILOT names (l2p, coda_prompt, ...) are handled by PILOT itself"
        ) from None


def method_card(name: str) -> MethodCard:
    """The card of the method registered as ``name`` (``engine/card.py``): for the tooling only."""
    get_method(name)  # the same lookup and error as the adapter's
    return _CARDS[name.lower()]

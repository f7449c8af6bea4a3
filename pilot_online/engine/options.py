"""Config keys, and the typed options a component builds from them.

A component owns its keys: it declares them as the fields of a frozen dataclass, each field made
by :func:`option` from a :class:`ConfigKey` (default, doc, choices, check), and reads them back as
that dataclass: ``CheckpointOptions.of(config).checkpoint_every``, typed, with its default stated
once. ``engine/config.py`` gathers every component's ``Options.keys()`` into the key table that
``resolve_config`` checks, ``check-config --keys`` prints and the docs are generated from. This
module imports no torch, so the key table is cheap to build.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Callable, TypeVar


@dataclass(frozen=True)
class ConfigKey:
    """A config key: its default, whether online training forces it, and its valid values.

    ``choices`` comes from the module that owns the option (e.g. ``core.streams.STREAMS``), so
    the list exists once; ``resolve_config`` refuses any other value, listing the choices.
    ``check`` validates the value where the key is defined: ``check(key, value)`` raises a
    TypeError or ValueError naming the key, what it must be and what it got (``core.checks``
    builds the common ones: ``integer(minimum=1)``, ``boolean``, ``optional(...)``).
    ``cross_check`` validates it against the rest of the resolved config, after every value has
    passed its own check: ``cross_check(cfg)`` raises a ValueError that says what to set (L2P's
    ``top_k`` no larger than its pool's ``size``; a block index within ``vit_depth``). A method's
    constraint that involves engine keys sits on the method's key it is about (LAE's PET module
    cannot run under ``sdpa``), so a method's checks are all in its key table.
    """

    default: Any
    doc: str
    forced: bool = False  # online training needs exactly this value (a different one is an error)
    choices: tuple | None = None
    check: Callable[[str, Any], Any] | None = None
    cross_check: Callable[[Mapping[str, Any]], None] | None = None


def option(key: ConfigKey) -> Any:
    """A field of an :class:`Options` dataclass: the config key of the field's name."""
    return field(default=key.default, metadata={"key": key})


OptionsT = TypeVar("OptionsT", bound="Options")


@dataclass(frozen=True)
class Options:
    """Base of a component's typed options: a frozen dataclass whose fields are its keys."""

    @classmethod
    def keys(cls) -> dict[str, ConfigKey]:
        """The component's keys, by name, in field order."""
        return {f.name: f.metadata["key"] for f in fields(cls)}

    @classmethod
    def of(cls: type[OptionsT], config: Mapping[str, Any]) -> OptionsT:
        """The options in ``config`` (a resolved config holds every key), else their defaults."""
        return cls(**{name: config.get(name, key.default) for name, key in cls.keys().items()})

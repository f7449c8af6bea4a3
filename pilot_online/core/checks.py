"""The argument checks every module shares, so a bad value fails with the same clear message.

Each check returns the value normalised (a Python ``int``/``float``) or raises naming the argument,
what it must be and what it got. Choices also suggest the closest valid spelling.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

Choice = TypeVar("Choice")


def closest(value: Any, known: Collection[Any]) -> str:
    """`` (did you mean 'x'?)`` for the closest spelling among ``known``, or an empty string."""
    close = difflib.get_close_matches(str(value), [str(k) for k in known], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(name: str, value: Choice, choices: Collection[Choice]) -> Choice:
    """``value`` if it is one of ``choices``; else a ValueError listing them all."""
    if value not in choices:
        raise ValueError(
            f"unknown {name} {value!r}{closest(value, choices)}; "
            f"valid choices: {', '.join(map(str, choices))}"
        )
    return value


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int within ``[minimum, maximum]`` (either bound may be open).

    Bools are refused (``True`` is an int to Python, never a count to a user): TypeError.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if maximum is None:
            bound = f">= {minimum}"
        elif minimum is None:
            bound = f"<= {maximum}"
        else:
            bound = f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_real(name: str, value: Any) -> float:
    """``value`` as a float; bools and non-numbers raise TypeError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


#: A config-key validator: ``check(name, value)`` raises TypeError/ValueError naming the key.
Check = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Spec:
    """What a validator accepts, readable by a program: the tests generate each key's cases (the
    values at and past each bound, a bool for an integer, NaN for a real, ...) from it, so a key
    is covered the day it is defined. ``kind`` is one of ``integer``, ``real``, ``boolean``,
    ``string``, ``object``, ``list``, ``optional`` or ``custom`` (no generated cases)."""

    kind: str
    minimum: float | None = None
    maximum: float | None = None
    #: ``real(positive=True)``: the minimum (0) itself is refused.
    exclusive_minimum: bool = False
    #: A list's entries, or what :func:`optional` wraps.
    item: Check | None = None
    min_length: int = 0
    distinct: bool = False


CUSTOM = Spec("custom")


def described(description: str, check: Callable[[str, Any], Any], spec: Spec = CUSTOM) -> Check:
    """``check`` with the phrase it tests for (``"a positive integer"``), which containers and
    :func:`optional` reuse in their own messages, and its :class:`Spec`."""
    check.description = description  # type: ignore[attr-defined]
    check.spec = spec  # type: ignore[attr-defined]
    return check


def description_of(check: Check) -> str:
    """The phrase a validator tests for, e.g. ``"null or a positive integer"``."""
    return getattr(check, "description", "valid")


def spec_of(check: Check) -> Spec:
    """What ``check`` accepts (:class:`Spec`); ``custom`` for a validator written by hand."""
    return getattr(check, "spec", CUSTOM)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(minimum: int | None = None, maximum: int | None = None) -> Check:
    """A validator for an integer key within ``[minimum, maximum]``: bools and floats (``2.0``,
    a float seed) are refused, as is anything outside the bounds."""
    if minimum == 0 and maximum is None:
        description = "a non-negative integer"
    elif minimum == 1 and maximum is None:
        description = "a positive integer"
    elif minimum is not None and maximum is not None:
        description = f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        description = f"an integer >= {minimum}"
    elif maximum is not None:
        description = f"an integer <= {maximum}"
    else:
        description = "an integer"

    def check(name: str, value: Any) -> int:
        if not _is_int(value):
            raise TypeError(f"{name} must be {description}, got {value!r} ({type(value).__name__})")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise ValueError(f"{name} must be {description}, got {value}")
        return int(value)

    return described(description, check, Spec("integer", minimum, maximum))


def real(
    minimum: float | None = None, maximum: float | None = None, *, positive: bool = False
) -> Check:
    """A validator for a real-valued key: ``>= minimum``, ``<= maximum``, ``> 0`` with
    ``positive``. Integers are real numbers; bools, strings, NaN and the infinities are not (JSON
    as Python reads it accepts ``NaN`` and ``Infinity``; a lower bound alone stops neither)."""
    if minimum is not None and maximum is not None:
        description = f"a number in [{minimum:g}, {maximum:g}]"
    elif positive:
        description = "a number > 0"
    elif minimum is not None:
        description = f"a number >= {minimum:g}"
    elif maximum is not None:
        description = f"a number <= {maximum:g}"
    else:
        description = "a number"

    def check(name: str, value: Any) -> float:
        if not _is_real(value):
            raise TypeError(f"{name} must be {description}, got {value!r} ({type(value).__name__})")
        if not math.isfinite(value):
            raise ValueError(
                f"{name} must be {description}, got {value}: write a finite number (NaN and "
                "Infinity are refused)"
            )
        if (
            (positive and not value > 0)
            or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)
        ):
            raise ValueError(f"{name} must be {description}, got {value}")
        return float(value)

    lower = 0 if positive and minimum is None else minimum
    return described(description, check, Spec("real", lower, maximum, exclusive_minimum=positive))


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
    return value


#: A validator for a true/false key: strings such as ``"false"`` are refused, not truthy.
boolean: Check = described("true or false", _boolean, Spec("boolean"))


def string(description: str) -> Check:
    """A validator for a string key whose messages say what the string is (``"a folder path"``)."""

    def check(name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"{name} must be {description}, got {value!r} ({type(value).__name__})")
        return value

    return described(description, check, Spec("string"))


#: A validator for a string key (a name, a path).
text: Check = string("a string")


def _json_object(name: str, value: Any) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{name} must be an object of named values, e.g. {{...}}, got {value!r}")
    return value


#: A validator for a key holding a JSON object (``backbone_kwargs``).
json_object: Check = described("an object", _json_object, Spec("object"))


def optional(check: Check) -> Check:
    """``check``, with ``null`` also accepted; its messages say that null is allowed."""
    inner = description_of(check)
    description = f"null or {inner}"

    def wrapped(name: str, value: Any) -> Any:
        if value is None:
            return None
        try:
            return check(name, value)
        except (TypeError, ValueError) as err:
            message, plain = str(err), f"{name} must be {inner}"
            if message.startswith(plain):  # "x must be a ..., got" -> "x must be null or a ..."
                message = f"{name} must be {description}{message[len(plain) :]}"
            raise type(err)(message) from None

    return described(description, wrapped, Spec("optional", item=check))


def list_of(
    item: Check,
    description: str,
    *,
    min_length: int = 0,
    distinct: bool = False,
    entry: str = "a block",
) -> Check:
    """A validator for a JSON list whose every entry passes ``item`` (``description`` names the
    whole, e.g. ``"a list of block indices"``); ``distinct`` refuses an entry listed twice, and
    its message calls the entry ``entry`` (block indices are the common distinct list)."""

    def check(name: str, value: Any) -> list:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be {description}, got {value!r} ({type(value).__name__})")
        if len(value) < min_length:
            raise ValueError(f"{name} must be {description} with at least {min_length} entries")
        for index, each in enumerate(value):
            item(f"{name}[{index}]", each)
        if distinct:
            twice = sorted({v for v in value if list(value).count(v) > 1})
            if twice:
                raise ValueError(
                    f"{name} lists {entry} twice ({twice[0]!r}): {list(value)!r}; list each once"
                )
        return list(value)

    spec = Spec("list", item=item, min_length=min_length, distinct=distinct)
    return described(description, check, spec)


#: The blocks of PILOT's ViT-B/16 (and of timm's): what ``backbone_type`` builds unless
#: ``backbone_kwargs`` says otherwise.
VIT_DEPTH = 12


def vit_depth(cfg: Any) -> int:
    """The number of ViT blocks a config builds: its ``vit_depth`` (which every family's build
    honours, ``pilot/backbones.py``), else ``backbone_kwargs.depth``, else 12."""
    depth = cfg.get("vit_depth")
    if depth is None:
        kwargs = cfg.get("backbone_kwargs") or {}
        depth = kwargs.get("depth", VIT_DEPTH) if isinstance(kwargs, dict) else VIT_DEPTH
    return depth if _is_int(depth) and depth > 0 else VIT_DEPTH


def check_blocks(cfg: Any, *keys: str) -> None:
    """Every block index under ``keys`` (lists, or null) names a block the ViT has."""
    depth = vit_depth(cfg)
    for key in keys:
        late = [i for i in cfg.get(key) or () if _is_int(i) and i >= depth]
        if late:
            raise ValueError(
                f"{key}={list(cfg[key])!r} names block {late[0]}, past the last block of the "
                f"{depth}-block ViT: use indices in [0, {depth - 1}]"
            )


def within_vit_depth(key: str) -> Callable[[Any], None]:
    """A ``ConfigKey.cross_check`` for a key of block indices: each names a block of the ViT the
    config builds (:func:`vit_depth`), checked once ``vit_depth`` itself has passed its check."""

    def cross_check(cfg: Any) -> None:
        check_blocks(cfg, key)

    return cross_check

"""The argument checks every module shares, so a bad value fails with the same clear message.

Each check returns the value normalised (a Python ``int``/``float``) or raises naming the argument,
what it must be and what it got. Choices also suggest the closest valid spelling.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Callable, Collection
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


def integer(minimum: int | None = None, maximum: int | None = None) -> Check:
    """A validator for an integer key within ``[minimum, maximum]`` (see :func:`check_int`)."""
    return lambda name, value: check_int(name, value, minimum, maximum)


def real(minimum: float | None = None, *, positive: bool = False) -> Check:
    """A validator for a real-valued key, ``>= minimum`` (or ``> 0`` with ``positive``)."""

    def check(name: str, value: Any) -> float:
        value = check_real(name, value)
        if positive and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        return value

    return check


def boolean(name: str, value: Any) -> bool:
    """A validator for a true/false key: strings such as ``"false"`` are refused, not truthy."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def optional(check: Check) -> Check:
    """``check``, with ``null`` also accepted."""
    return lambda name, value: None if value is None else check(name, value)

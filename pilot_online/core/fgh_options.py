"""FGH's options: their values, their defaults and their checks, in one place.

:class:`~pilot_online.core.fgh.FineGrainedHypergradients` takes them per param group (like
``torch.optim``'s ``lr``); a config's ``"fgh"`` object is checked here too
(:func:`validate_options`), so that the component, the configs and the docs agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .checks import check_choice, check_real
from .lazy import torch

if TYPE_CHECKING:
    from torch import Tensor

GRANULARITIES = ("element", "class", "global")
DIRECTIONS = ("grad", "adam")
#: What alpha scales: the gradient, as the paper does. A key of its own so that configs state it.
APPLIES = ("grad",)
# gamma=None resolves per direction: raw-gradient products are tiny, so the paper uses gamma=1;
# Adam-normalised directions are O(1), so the appendix pseudo-code uses gamma=1e-3.
DEFAULT_GAMMA = {"grad": 1.0, "adam": 1e-3}
OPTION_KEYS = ("gamma", "granularity", "direction", "apply", "clamp", "betas", "eps", "foreach")
#: The component's defaults (for use on any model; the paper configs set every option).
DEFAULTS: dict[str, Any] = {
    "gamma": None,
    "granularity": "element",
    "direction": "grad",
    "apply": "grad",
    "clamp": (0.0, 10.0),
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "foreach": None,
}


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """Validate one group's options and return them normalised (gamma resolved, tuples)."""
    granularity = check_choice("granularity", options["granularity"], GRANULARITIES)
    direction = check_choice("direction", options["direction"], DIRECTIONS)
    apply = check_choice("apply", options["apply"], APPLIES)

    gamma = options["gamma"]
    gamma = DEFAULT_GAMMA[direction] if gamma is None else check_real("gamma", gamma)
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"gamma must be finite and >= 0 (0 disables learning), got {gamma}")

    lo, hi = _check_clamp(options["clamp"])

    betas = options["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2) in [0, 1), got {betas!r}")
    beta1, beta2 = check_real("betas[0]", betas[0]), check_real("betas[1]", betas[1])
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"betas must be a pair (beta1, beta2) in [0, 1), got {betas!r}")

    eps = check_real("eps", options["eps"])
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")

    foreach = options["foreach"]
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be None, True or False, got {foreach!r}")
    return {
        "gamma": gamma,
        "granularity": granularity,
        "direction": direction,
        "apply": apply,
        "clamp": (lo, hi),
        "betas": (beta1, beta2),
        "eps": eps,
        "foreach": foreach,
    }


def _check_clamp(clamp: Any) -> tuple[float, float | None]:
    """``(lo, hi)`` with finite 0 <= lo < hi, or ``(lo, None)``: no upper bound (JSON ``null``;
    the paper states only alpha > 0). Infinity is refused, so configs and results stay strict JSON.
    """
    usage = "clamp must be a pair [lo, hi] with 0 <= lo < hi, or [lo, null] for no upper bound"
    if not isinstance(clamp, (tuple, list)) or len(clamp) != 2:
        raise ValueError(f"{usage}, got {clamp!r}")
    lo = check_real("clamp[0]", clamp[0])
    hi = None if clamp[1] is None else check_real("clamp[1]", clamp[1])
    for index, bound in enumerate((lo, hi)):
        if bound is not None and not math.isfinite(bound):
            raise ValueError(
                f"clamp[{index}] is {bound}, not a finite number; write null (None) for "
                "'no upper bound', e.g. \"clamp\": [0.0, null], and a finite lower bound >= 0"
            )
    if not (0 <= lo and (hi is None or lo < hi)):
        raise ValueError(f"{usage}, got {clamp!r}")
    return lo, hi


def check_class_group(names: list[str], params: list[Tensor]) -> None:
    """The class granularity needs one final layer: a 2-D weight [C, D] and an optional bias [C]."""
    weights = [p for p in params if p.ndim == 2]
    biases = [p for p in params if p.ndim == 1]
    ok = (
        len(weights) == 1
        and len(biases) <= 1
        and len(params) == len(weights) + len(biases)
        and all(b.shape[0] == weights[0].shape[0] for b in biases)
    )
    if not ok:
        shapes = {n: tuple(p.shape) for n, p in zip(names, params)}
        raise ValueError(
            "granularity='class' needs a group holding exactly one 2-D weight [C, D] and "
            f"optionally one 1-D bias [C] (the final layer), got {shapes}; put the classifier "
            "in its own group, e.g. {'params': model.fc.named_parameters(), "
            "'granularity': 'class'}"
        )


def named_pairs(items: Iterable[Any], where: str) -> list[tuple[str, Tensor]]:
    pairs = []
    for item in items:
        if (
            not isinstance(item, (tuple, list))
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], torch.Tensor)
        ):
            raise TypeError(
                f"{where} must hold (name, Parameter) pairs such as model.named_parameters(), "
                f"got {type(item).__name__}: {item!r:.80}"
            )
        pairs.append((item[0], item[1]))
    return pairs


def validate_options(**options: Any) -> dict[str, Any]:
    """Check FGH options given as keywords (a config's ``"fgh"`` object); return them normalised."""
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise TypeError(f"unknown FGH option(s) {unknown}; valid: {', '.join(OPTION_KEYS)}")
    return check_options({**DEFAULTS, **options})

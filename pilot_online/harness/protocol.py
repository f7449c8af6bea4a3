"""The paper's evaluation protocol, as data: the two fixed learning rates, the hp_grid table (the
VTAB search behind the "Best HP" column) and the rule that picks a grid point.

Why one module: scripts/make_exps.py (the per-LR configs), ``pilot-online sweep --preset hp_grid``
(the search), ``pilot-online best`` (the selection) and ``pilot-online tables`` (the columns) all
read the table from here, so they cannot disagree with each other or with the paper. The table's
values themselves are the package's paper data (``harness/paper.py``), beside Tables 1-2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

#: The main tables' fixed-learning-rate columns (paper Sec. 4.1, "Performance Across LR").
FIXED_LRS: tuple[float, ...] = (5e-5, 5e-3)


#: Where the Best HP search runs (hp_grid caption): VTAB, clear, 10 tasks of 5 classes.
HP_SEARCH_SETTINGS: dict[str, Any] = {
    "dataset": "vtab",
    "stream": "clear",
    "init_cls": 5,
    "increment": 5,
}

#: The searched rows of a method: ``base`` (the method alone) and ``ours`` (+ P + FGH); each maps
#: to a row of ``engine.config.VARIANTS``.
HP_ROWS: dict[str, str] = {"base": "base", "ours": "fgh"}


@dataclass(frozen=True)
class HPGridRow:
    """One row of the hp_grid table: the learning rates (and gammas) tried, and the bold ones."""

    learning_rates: tuple[float, ...]
    best_lr: float
    gammas: tuple[float, ...] = ()  # empty: "N/A" in the paper (no + ours row searched)
    best_gamma: float | None = None


@functools.cache
def _hp_grid() -> dict[str, HPGridRow]:
    """The hp_grid table from the package's paper data (``engine.paper``), keyed by short name."""
    from .paper import hp_grid_rows, registered_names

    names = registered_names()
    grid = {}
    for row in hp_grid_rows():
        grid[method_short_name(names[row["method"]])] = HPGridRow(
            tuple(row["learning_rates"]),
            row["best_lr"],
            tuple(row["gammas"] or ()),
            row["best_gamma"],
        )
    return grid


def __getattr__(name: str) -> Any:
    """``HP_GRID``: the paper's appendix table hp_grid, keyed by the method's short name
    (exps/<name>_online_*.json; ``model_name`` is ``<name>_online``), in the table's row order.
    Built on first use from ``pilot_online/data/paper_tables.json`` (one copy of the values),
    because the method registry it names methods through fills only once the methods import."""
    if name == "HP_GRID":
        return _hp_grid()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


SELECTION_RULE = (
    "For each method and row (base; ours = + P + FGH), the grid point with the highest AP "
    "averaged over its seeds is chosen (AP: mean of the average accuracies after each task, on "
    "the search dataset). Seeds whose AP is missing (null) do not count. Ties go to the smaller "
    "learning rate, then the smaller gamma. A point with fewer seeds than the most common count "
    "of its method and row stays eligible but is flagged (fewer_seeds), as is a chosen one. "
    "Where the hp_grid table lists no gamma (N/A: fine-tuning, linear probe, ER, ER + linear "
    "probe, MVP, oLoRA) and no + ours run was searched, + ours takes the base row's learning rate "
    "with the paper's gamma 1 (derived_from: base)."
)


def method_short_name(model_name: str) -> str:
    """``coda_online`` -> ``coda`` (the exps/ and hp_grid naming)."""
    return str(model_name).removesuffix("_online")


def hp_grid_points(
    method: str,
    learning_rates: list[float] | None = None,
    gammas: list[float] | None = None,
) -> list[dict[str, Any]]:
    """The grid points of ``method``'s hp_grid row: every LR for the base row, and every
    LR x gamma for + ours where the table lists gammas. ``learning_rates``/``gammas`` replace
    the table's values (smoke runs)."""
    grid = _hp_grid()
    if method not in grid:
        raise ValueError(
            f"method {method!r} has no row in the hp_grid table; choose from {', '.join(grid)}"
        )
    row = grid[method]
    lrs = list(learning_rates or row.learning_rates)
    points = [{"variant": HP_ROWS["base"], "init_lr": lr} for lr in lrs]
    if row.gammas:
        points += [
            {"variant": HP_ROWS["ours"], "init_lr": lr, "fgh.gamma": gamma}
            for lr in lrs
            for gamma in (gammas or row.gammas)
        ]
    return points


def select_best(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply ``SELECTION_RULE`` to one method's row.

    ``points``: ``{"init_lr", "gamma" (None for base), "ap": {seed: AP or None}}`` per grid
    point. Returns the chosen point with ``AP_mean``, ``AP_std``, ``seeds`` and ``fewer_seeds``,
    plus ``grid`` (every point, in the same form)."""
    summaries = []
    for point in points:
        seeds = sorted(s for s, ap in point["ap"].items() if ap is not None)
        values = [point["ap"][s] for s in seeds]
        mean = sum(values) / len(values) if values else None
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5 if values else None
        summaries.append(
            {
                "init_lr": point["init_lr"],
                "gamma": point.get("gamma"),
                "AP_mean": mean,
                "AP_std": std,
                "seeds": seeds,
            }
        )
    counts = [len(s["seeds"]) for s in summaries]
    modal = max(set(counts), key=lambda c: (counts.count(c), c)) if counts else 0
    for summary in summaries:
        summary["fewer_seeds"] = len(summary["seeds"]) < modal
    eligible = [s for s in summaries if s["AP_mean"] is not None]
    if not eligible:
        raise ValueError("no grid point has an AP: every run is missing or failed")
    best = min(
        eligible,
        key=lambda s: (-s["AP_mean"], s["init_lr"], s["gamma"] if s["gamma"] is not None else 0),
    )
    return {**best, "grid": summaries}

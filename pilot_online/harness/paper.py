"""The paper's own numbers, as package data (``pilot_online/data/paper_tables.json``).

Why: a researcher reproducing a cell must see at once how far it is from the paper. The values
of Tables 1-2 (``all_acc_clear``, ``all_acc_blurry``), the Si-Blurry ablation
(``all_ablation_blurry``), the appendix's ``hp_grid`` and ``time_consumption`` were copied once
from the paper's LaTeX (the data file names its source) and are read here; ``protocol``
derives ``HP_GRID`` from the same file, so the search grid and the compared values cannot
disagree. Nothing here imports torch, timm or PILOT; the method rows are matched to registered
methods through their cards' ``paper_name`` (``engine/card.py``).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

#: The Best HP column's key in the data file (the others are learning rates, e.g. "5e-3").
BEST = "best"
#: Where the paper's numbers live inside the package.
DATA_FILE = "paper_tables.json"
#: The tables of the paper whose cells ``--vs-paper`` compares (``time_consumption`` has no std).
COMPARED_TABLES = ("all_acc_clear", "all_acc_blurry", "all_ablation_blurry")
#: The paper's dataset columns (PILOT names -> headers), in its order; others follow, by name
#: (the scale model's benchmarks among them).
DATASET_NAMES = {
    "cifar224": "CIFAR100",
    "cifar100": "CIFAR100",
    "cub": "CUB",
    "imagenetr": "Imagenet-R",
    "fashion_mnist": "Fashion-MNIST",
    "fashion_mnist_quick": "Fashion-MNIST (quick)",
    "fractal": "Fractal (held out)",
}


@dataclass(frozen=True)
class PaperCell:
    """One cell of a paper table: AP (%) mean and std over ``n`` seeds, as printed."""

    table: str  # all_acc_clear | all_acc_blurry | all_ablation_blurry
    dataset: str  # PILOT's name: cifar224, cub, imagenetr
    stream: str  # clear | si_blurry
    method: str  # the paper's row name (a method card's paper_name): CODA, L2P, ...
    row: str  # base | ours (+ P + FGH) | p (+ P) | fgh_only (+ FGH)
    column: float | str  # a learning rate (5e-5, 5e-3) or BEST
    mean: float
    std: float
    n: int


@functools.cache
def paper_data() -> dict[str, Any]:
    """The data file, parsed (read once)."""
    text = resources.files("pilot_online").joinpath("data", DATA_FILE).read_text("utf-8")
    return json.loads(text)


def parse_column(text: str) -> float | str:
    """``"5e-3"`` -> 0.005; ``"best"`` stays."""
    return BEST if text == BEST else float(text)


def same_column(a: float | str | None, b: float | str | None) -> bool:
    """Learning rates compare with a relative tolerance (5e-3 written as 0.005 is the same)."""
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-9)


def same_cell(a: tuple, b: tuple) -> bool:
    """Cell keys ``(dataset, stream, method, row, column)`` that name the same cell."""
    return a[:4] == b[:4] and same_column(a[4], b[4])


@functools.cache
def paper_cells() -> tuple[PaperCell, ...]:
    """Every compared cell of the paper, table by table, in the data file's order."""
    data = paper_data()
    pilot_of = {header: name for name, header in data["datasets"].items()}
    cells = []
    for name in COMPARED_TABLES:
        table = data["tables"][name]
        columns = [parse_column(c) for c in table["columns"]]
        keys = [(pilot_of[d], c) for d in table["datasets"] for c in columns]
        for row in table["rows"]:
            if len(row["cells"]) != len(keys):
                raise ValueError(
                    f"{DATA_FILE}: {name} {row['method']} {row['row']}: "
                    f"{len(row['cells'])} cells, expected {len(keys)}"
                )
            for (dataset, column), (mean, std) in zip(keys, row["cells"]):
                cells.append(
                    PaperCell(
                        name,
                        dataset,
                        table["stream"],
                        row["method"],
                        row["row"],
                        column,
                        float(mean),
                        float(std),
                        int(row["seeds"]),
                    )
                )
    return tuple(cells)


def find_paper_cell(
    table: str, dataset: str, stream: str, method: str, row: str, column: float | str
) -> PaperCell | None:
    """The paper's cell with these keys (``method``: the paper's row name), or None."""
    for cell in paper_cells():
        if (cell.table, cell.dataset, cell.stream, cell.method, cell.row) == (
            table,
            dataset,
            stream,
            method,
            row,
        ) and same_column(cell.column, column):
            return cell
    return None


def paper_datasets() -> dict[str, str]:
    """PILOT dataset name -> the paper's column header (cifar224 -> CIFAR100, ...)."""
    return dict(paper_data()["datasets"])


def paper_streams() -> list[str]:
    """The streams of the paper's tables, as the config's ``stream`` names them."""
    return list(paper_data()["streams"])


def paper_seed_count(method: str) -> int:
    """The seeds the paper states for a method (its row name): 10, or 3 (ConvPrompt, oLoRA)."""
    counts = {
        r["seeds"]
        for t in paper_data()["tables"].values()
        for r in t["rows"]
        if r["method"] == method
    }
    if len(counts) != 1:
        raise ValueError(f"the paper's tables have no single seed count for {method!r}")
    return counts.pop()


def registered_names() -> dict[str, str]:
    """The paper's row name -> the registered ``model_name`` whose card has that
    ``paper_name`` (every method the paper lists must have exactly one)."""
    from ..engine.registry import list_methods, method_card

    names: dict[str, list[str]] = {}
    for name in list_methods():
        paper_name = method_card(name).paper_name
        if paper_name:
            names.setdefault(paper_name, []).append(name)
    listed = [r["method"] for r in paper_data()["hp_grid"]["rows"]]
    out = {}
    for method in listed:
        found = names.get(method, [])
        if len(found) != 1:
            raise ValueError(
                f"the paper's row {method!r} matches {len(found)} registered methods "
                f"({', '.join(found) or 'none'}): exactly one method card must have paper_name "
                f"{method!r}"
            )
        out[method] = found[0]
    return out


def hp_grid_rows() -> list[dict[str, Any]]:
    """The hp_grid table's rows, in its order: method (row name), learning_rates, best_lr,
    gammas (None: N/A), best_gamma."""
    return [dict(r) for r in paper_data()["hp_grid"]["rows"]]


def time_consumption() -> dict[str, Any]:
    """The time_consumption table (CUB, clear, batch 100): rows of method, row, time, seconds,
    memory_mb; no std and no seed count in the paper."""
    return paper_data()["time_consumption"]


def _column_values(cells: list[PaperCell], lr: float) -> dict[tuple[str, str, str], tuple]:
    """(mean, std) of the cells in the column of ``lr``, by (table, dataset, row)."""
    return {
        (c.table, c.dataset, c.row): (c.mean, c.std) for c in cells if same_column(c.column, lr)
    }


def best_hp_columns() -> dict[str, dict[str, Any]]:
    """Per method (row name), how its Best HP cells relate to its fixed-LR cells in Tables 1-2.

    ``equal_to``: the fixed LR whose cells equal every Best HP cell of the method (both tables,
    every dataset, base and + ours), or None; ``bold_lr``: hp_grid's bold LR. Where both are set
    and differ (L2P: bold 0.01, Best HP = its 5e-3 cells), the Best HP numbers cannot have come
    from the bold LR."""
    out: dict[str, dict[str, Any]] = {}
    cells = [c for c in paper_cells() if c.table in ("all_acc_clear", "all_acc_blurry")]
    for row in hp_grid_rows():
        method = row["method"]
        mine = [c for c in cells if c.method == method]
        best = [c for c in mine if c.column == BEST]
        equal_to = None
        for lr in sorted({c.column for c in mine if c.column != BEST}):
            fixed = _column_values(mine, lr)
            if best and all(
                fixed.get((c.table, c.dataset, c.row)) == (c.mean, c.std) for c in best
            ):
                equal_to = lr
        differ = 0
        if row["best_lr"] in [c.column for c in mine]:  # the bold LR is a fixed column
            fixed = _column_values(mine, row["best_lr"])
            differ = sum(fixed.get((c.table, c.dataset, c.row)) != (c.mean, c.std) for c in best)
        out[method] = {
            "bold_lr": row["best_lr"],
            "bold_gamma": row["best_gamma"],
            "equal_to": equal_to,
            "best_cells": len(best),
            "differ_from_bold_column": differ,
        }
    return out


def best_hp_discrepancies() -> list[str]:
    """Sentences on every method whose Best HP cells disagree with hp_grid's bold LR."""
    notes = []
    for method, info in best_hp_columns().items():
        bold, equal = info["bold_lr"], info["equal_to"]
        if equal is not None and not same_column(equal, bold):
            notes.append(
                f"{method}: hp_grid's bold LR is {bold:g}, but all {info['best_cells']} of its "
                f"Best HP cells in Tables 1-2 equal its {equal:g} cells"
            )
        elif info["differ_from_bold_column"]:
            notes.append(
                f"{method}: hp_grid's bold LR is {bold:g}, a fixed-LR column, but "
                f"{info['differ_from_bold_column']} of its {info['best_cells']} Best HP cells "
                f"differ from that column (the paper does not say which other setting ran)"
            )
    return notes

"""``pilot-online tables``: the paper's tables, in its layout, from results folders.

Tables (file stems; each written as ``.md`` and ``.tex``):

- ``all_acc_clear`` / ``all_acc_blurry`` (Tables 1-2): AP; rows are methods, each with its
  "+ ours" (+ P + FGH) row under it; columns are dataset x {5e-5, 5e-3, Best HP}. A row with
  no entry is left out, and a method without its own row names itself on the others
  ("CODA + ours"). The caption says the Best HP was "found on VTAB" only where the hp_grid
  search's runs are among the results and chose it (:func:`best_hp_sentence`); else it gives
  the LR and gamma the Best HP runs used.
- ``total_clear`` / ``total_blurry``: the same layout for A_T (final average accuracy).
- ``online_clear`` / ``online_blurry``: the same layout for A_online (average online accuracy:
  each stream batch predicted before training on it, docs/protocol.md); only when some run
  records it (results files of older versions do not).
- ``ablation_<stream>``: base, + P, + FGH, + P + FGH per method, dataset x {5e-5, 5e-3}, AP.
- ``task<k>_<stream>``: accuracy on task k at the end of training (the appendix's clear_t1...).
- ``time_<dataset>_<stream>``: wall time (train + eval) and peak accelerator memory per row.
- ``realtime_<stream>``: the compute-aware table (issue 29, docs/protocol.md): runs in
  real-time mode (``realtime``), each method beside its + ours, at the stream speed of the
  reference method; per dataset C, the share of stream batches trained, A_online and AP.

Only runs of the paper's protocol (``realtime`` null, ``online_iter`` 1) fill the paper's
tables (the others are left out, counted in a note): a real-time run trains on fewer batches,
an ``online_iter`` run takes more steps, and neither is the number the paper printed.

Which runs fill which cell: a run tagged ``hp_column: "best"`` (``sweep --hp-from``) fills the
Best HP column; any other run fills the column of its ``init_lr`` if that is one of the fixed
LRs (others are left out and counted in a note). The fixed-LR columns take FGH runs only at the
paper's FGH setting (``engine.config.PAPER_FGH``: the appendix algorithm, class-wise on the
classifier with Adam directions, gamma 1, alpha >= 0 with no upper bound): the others are left
out, counted.

Cells are mean ± std (population std, ddof 0) over seeds. A seed run more than once (the same
seed and hyperparameters) counts once, by its newest complete run; the notes count the runs set
aside. A cell whose runs have different hyperparameters (a Best HP cell fed by two choices) shows
no mean: it is flagged (‡) and the notes give each setting's own mean. A cell with no run is "—";
a cell with fewer seeds than the table's most common count gets a dagger and its count; the best
mean of a column is bold (per method block in the ablation table, as in the paper; the smallest
in the time table). The build functions return ``Table`` objects holding numbers (tests compare
those), and ``to_markdown`` / ``to_latex`` render them.

``--vs-paper`` sets each cell of Tables 1-2 and the Si-Blurry ablation beside the paper's own
(``harness/paper.py``: mean ± std and seeds), with the difference and a verdict: within the
paper's std, within twice it, or differs (:func:`compare_with_paper`).
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.fgh_options import validate_options
from ..core.files import write_atomic
from ..core.progress import plural
from ..core.results import find_results, load_results
from ..core.streams import STREAM_KINDS, STREAMS
from ..engine.config import HP_COLUMNS, PAPER_FGH, variant_of
from .paper import (
    DATASET_NAMES,
    PaperCell,
    best_hp_discrepancies,
    find_paper_cell,
    paper_datasets,
    same_cell,
)
from .protocol import (
    FIXED_LRS,
    HP_SEARCH_SETTINGS,
    method_short_name,
    select_best,
)
from .report import DUPLICATE_RULE, hyperparameters, method_label, one_run_per_seed, protocol_of

#: Method blocks of the paper's tables (separated by rules), in its row order.
PAPER_GROUPS: tuple[tuple[str, ...], ...] = (
    ("Fine-tuning", "Linear probe"),
    ("ER", "ER + Linear probe"),
    ("MVP", "oLoRA"),
    ("CODA", "L2P", "DualPrompt", "ConvPrompt"),
)
#: Each stream kind's short name and LaTeX title, from its definition (``core.streams``).
STREAM_NAMES = {kind: spec.short for kind, spec in STREAM_KINDS.items()}
STREAM_TITLES = {kind: spec.title for kind, spec in STREAM_KINDS.items()}
ROW_LABELS = {"base": "", "p": "+ P", "fgh_only": "+ FGH", "ours": "+ ours"}
ABLATION_LABELS = {"base": "", "p": "+ P", "fgh_only": "+ FGH", "ours": "+ P + FGH"}
BEST = "best"
MISSING = "—"
MIXED = "‡"
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
            "tenth")  # fmt: skip


@dataclass
class Cell:
    """One table entry: the per-seed values behind it, and what the table decided about it."""

    values: list[float] = field(default_factory=list)
    bold: bool = False
    fewer_seeds: bool = False
    #: Runs left out because a newer complete run of the same seed and hyperparameters exists.
    set_aside: int = 0
    #: Hyperparameter setting -> its values, when the runs have more than one setting.
    settings: dict[str, list[float]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mixed(self) -> bool:
        """Runs of different hyperparameters: no single mean stands for the cell."""
        return len(self.settings) > 1

    @property
    def mean(self) -> float | None:
        return sum(self.values) / len(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        if not self.values:
            return None
        mean = self.mean
        return math.sqrt(sum((v - mean) ** 2 for v in self.values) / len(self.values))


@dataclass
class Row:
    method: str
    label: str  # "" for the method's own row, else "+ ours", "+ P", ...
    cells: list[Cell]
    depth: int = 0  # indentation: 1 for "+ ..." rows, 2 for the ablation's + P + FGH
    kind: str = "base"  # base | p | fgh_only | ours: the row's key in the paper data


@dataclass
class Table:
    name: str  # file stem
    caption: str
    label: str  # LaTeX label
    groups: list[tuple[str, list[str]]]  # (group header, column headers)
    blocks: list[list[Row]]  # row blocks, separated by rules
    kind: str = "percent"  # percent | time
    notes: list[str] = field(default_factory=list)
    stream: str = ""
    keys: list[tuple[str, float | str]] = field(default_factory=list)  # (dataset, column) per cell

    def cell(self, method: str, label: str, column: int) -> Cell:
        for block in self.blocks:
            for row in block:
                if row.method == method and row.label == label:
                    return row.cells[column]
        raise KeyError((method, label))


# --- reading runs ---------------------------------------------------------------------------


def row_kind(config: dict[str, Any]) -> str:
    """The table row: a :data:`VARIANTS` name, with + P + FGH called ``ours``."""
    variant = variant_of(config)
    return "ours" if variant == "fgh" else variant


def _fgh_caption(latex: bool = True) -> str:
    """The FGH the paper configs run (``PAPER_FGH``): form, gamma and bounds, for the ablation
    caption (LaTeX) and the ``--vs-paper`` notes (plain text)."""
    options = validate_options(**PAPER_FGH)
    form = (
        "class-wise on the classifier, Adam directions (appendix algorithm)"
        if (options["granularity"], options["direction"]) == ("class", "adam")
        else f"{options['granularity']}-wise, {options['direction']} directions"
    )
    lo, hi = options["clamp"]
    gamma, alpha = (
        ("$\\gamma={:g}$", "$\\alpha \\geq {:g}$") if latex else ("γ = {:g}", "alpha >= {:g}")
    )
    bound = f"{alpha.format(lo)}, no upper bound" if hi is None else f"clamp [{lo:g}, {hi:g}]"
    return f"{form}, {gamma.format(options['gamma'])}, {bound}"


def _paper_fgh(config: dict[str, Any]) -> bool:
    """No FGH, or FGH at the paper's setting (``engine.config.PAPER_FGH``, options resolved)."""
    fgh = config.get("fgh")
    return fgh is None or validate_options(**fgh) == validate_options(**PAPER_FGH)


def _hyperparameter_label(hp: tuple) -> str:
    lr, options, *protocol = hp
    text = "LR ?" if lr is None else f"LR {lr:g}"
    if options is not None:
        resolved, paper = dict(options), validate_options(**PAPER_FGH)
        text += f", γ {resolved['gamma']:g}"
        text += "".join(
            f", {k} {resolved[k]}"
            for k in sorted(resolved)
            if k != "gamma" and k in paper and resolved[k] != paper[k]
        )
    if protocol:
        realtime, reference, steps = protocol[0]
        if realtime is not None:
            text += f", real-time {realtime} (reference {reference})"
        if steps > 1:
            text += f", online_iter {steps}"
    return text


def load_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """One flat record per complete results file under ``paths`` (files or folders)."""
    runs = []
    for file in find_results(paths):
        results = load_results(file)
        config, metrics, timing = results["config"], results["metrics"], results["timing"]
        lr = config.get("init_lr")
        realtime = results["extra"].get("realtime") or {}
        counters = results.get("counters", {})
        passed = (counters.get("batches_trained") or 0) + (counters.get("batches_skipped") or 0)
        runs.append(
            {
                "file": str(file),
                "created": str(results.get("created_utc") or ""),
                "hp": hyperparameters(config),
                "method": method_label(config.get("model_name")),
                "method_key": method_short_name(config.get("model_name", "")),
                "dataset": config.get("dataset"),
                "stream": config.get("stream", "clear"),
                "row": row_kind(config),
                "paper_fgh": _paper_fgh(config),
                "hp_column": config.get("hp_column", HP_COLUMNS[0]),
                "lr": float(lr) if lr is not None else None,
                "seed": config.get("seed"),
                "AP": metrics.get("AP"),
                "A_T": metrics.get("A_T"),
                "A_online": metrics.get("A_online"),
                "protocol": protocol_of(config),
                "realtime": config.get("realtime"),
                "reference": realtime.get("reference"),
                "C": realtime.get("C"),
                "trained_percent": (
                    100.0 * counters["batches_trained"] / passed if realtime and passed else None
                ),
                "final_task_accuracies": metrics.get("final_task_accuracies") or [],
                "seconds": (timing.get("train_seconds") or 0) + (timing.get("eval_seconds") or 0),
                "peak_memory_bytes": timing.get("peak_memory_bytes"),
            }
        )
    return runs


def column_of(run: dict[str, Any]) -> float | str | None:
    """The main-table column a run fills: ``"best"``, one of ``FIXED_LRS``, or None."""
    if run["hp_column"] == BEST:
        return BEST
    if not run["paper_fgh"] or run["lr"] is None:
        return None
    return next((lr for lr in FIXED_LRS if math.isclose(run["lr"], lr, rel_tol=1e-9)), None)


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def make_cell(runs: list[dict[str, Any]], value: Any, flag_mixed: bool = True) -> Cell:
    """A cell from its runs: one run per (seed, hyperparameters), the newest complete one
    (``created_utc``, then the file name); ``value(run)`` gives the number (non-finite ones are
    left out). With ``flag_mixed``, runs of more than one setting mark the cell mixed."""
    kept, _ = one_run_per_seed(
        runs, lambda r: (r["seed"], r["hp"]), lambda r: (r["created"], r["file"])
    )
    cell = Cell(set_aside=len(runs) - len(kept))
    settings: dict[str, list[float]] = {}
    for run in kept:
        v = value(run)
        if _finite(v):
            cell.values.append(v)
            settings.setdefault(_hyperparameter_label(run["hp"]), []).append(v)
    if flag_mixed and len(settings) > 1:
        cell.settings = settings
    return cell


def _methods_in_order(runs: list[dict[str, Any]]) -> list[list[str]]:
    """Method blocks as in the paper; methods it does not list form a last block, by name."""
    present = {r["method"] for r in runs}
    blocks = [[m for m in group if m in present] for group in PAPER_GROUPS]
    known = {m for group in PAPER_GROUPS for m in group}
    blocks.append(sorted(present - known))
    return [b for b in blocks if b]


def _datasets_in_order(runs: list[dict[str, Any]]) -> list[str]:
    present = {r["dataset"] for r in runs}
    order = list(dict.fromkeys(d for d in DATASET_NAMES if d in present))
    return order + sorted(present - set(order))


def _dataset_header(dataset: str) -> str:
    return DATASET_NAMES.get(dataset, dataset)


def _lr_header(lr: float | str) -> str:
    if lr == BEST:
        return "Best HP"
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


# --- building tables ------------------------------------------------------------------------


def _finish(table: Table, better: str = "max", bold_per_block: bool = False) -> Table:
    """Flag cells with fewer seeds than the table's most common count, bold the best means, and
    write the notes (missing cells, flagged cells, seed count)."""
    cells = [c for block in table.blocks for row in block for c in row.cells]
    counts = Counter(c.n for c in cells if c.n)
    modal = max(counts, key=lambda n: (counts[n], n)) if counts else 0
    for cell in cells:
        cell.fewer_seeds = 0 < cell.n < modal
    columns = len(cells) and len(next(r for b in table.blocks for r in b).cells)
    scopes = table.blocks if bold_per_block else [[r for b in table.blocks for r in b]]
    for scope in scopes:
        for column in range(columns):
            means = [
                r.cells[column].mean
                for r in scope
                if r.cells[column].n and not r.cells[column].mixed
            ]
            if not means:
                continue
            target = max(means) if better == "max" else min(means)
            for row in scope:
                cell = row.cells[column]
                cell.bold = (
                    cell.n > 0
                    and not cell.mixed
                    and math.isclose(cell.mean, target, rel_tol=0, abs_tol=1e-12)
                )
    if any(c.n == 0 for c in cells):
        table.notes.append(f"{MISSING}: no results for this entry.")
    set_aside = sum(c.set_aside for c in cells)
    if set_aside:
        table.notes.append(f"{plural(set_aside, 'run')} set aside: {DUPLICATE_RULE}.")
    headers = [f"{g} {c}".strip() for g, columns_ in table.groups for c in columns_]
    mixed = [
        f"{_plain_label(row)}, {headers[i]}: "
        + "; ".join(
            f"{setting} (n={len(v)}: {_plain_value(table, i, v)})"
            for setting, v in cell.settings.items()
        )
        for block in table.blocks
        for row in block
        for i, cell in enumerate(row.cells)
        if cell.mixed
    ]
    if mixed:
        table.notes.append(
            f"{MIXED}: runs of different hyperparameters, so no mean is shown; per setting: "
            + " | ".join(mixed)
            + "."
        )
    if any(c.fewer_seeds for c in cells):
        table.notes.append(
            "†: fewer seeds than the other entries (count shown); "
            f"the table's usual count is {modal}."
        )
    if modal == 1:
        runs = "run" if table.kind == "time" else "seed"
        table.notes.insert(0, f"One {runs} per entry: its value, no std.")
    elif modal:
        runs = "runs" if table.kind == "time" else "seeds"
        table.notes.insert(0, f"Mean ± std over {modal} {runs} (population std).")
    return table


def _plain_label(row: Row) -> str:
    return row.method if not row.label else f"{row.method} {row.label}"


def _plain_value(table: Table, column: int, values: list[float]) -> str:
    mean, std = _values(table, column, Cell(list(values)))
    return mean if len(values) == 1 else f"{mean} ± {std}"


def without_empty_rows(block: list[Row]) -> list[Row]:
    """A method's rows less those with no entry at all; where its own (base) row goes, every
    row left names the method (``CODA + ours``, not a "↳ + ours" under an empty "CODA" row)."""
    kept = [row for row in block if any(cell.n for cell in row.cells)]
    if any(row.kind == "base" for row in kept):
        return kept
    for row in kept:
        row.depth = 0
    return kept


def _method_blocks(blocks: list[list[Row]]) -> list[list[Row]]:
    """Each block with every method's empty rows dropped (:func:`without_empty_rows`); blocks
    left empty are dropped too."""
    cleaned = []
    for block in blocks:
        methods = list(dict.fromkeys(row.method for row in block))
        rows = [
            row
            for method in methods
            for row in without_empty_rows([r for r in block if r.method == method])
        ]
        if rows:
            cleaned.append(rows)
    return cleaned


def main_table(runs: list[dict[str, Any]], stream: str, metric: str = "AP") -> Table:
    """Tables 1-2 (``AP``), the A_T tables (``A_T``), the A_online tables (``A_online``), or
    one per-task table (``task<k>``: the accuracy on task k at the end, 1-based)."""
    best_hp = best_hp_sentence(runs, stream)
    selected = [r for r in runs if r["stream"] == stream and r["row"] in ("base", "ours")]
    ignored = sum(1 for r in selected if column_of(r) is None)
    selected = [r for r in selected if column_of(r) is not None]
    datasets = _datasets_in_order(selected)
    columns = [(d, c) for d in datasets for c in (*FIXED_LRS, BEST)]
    blocks = []
    for methods in _methods_in_order(selected):
        block = []
        for method in methods:
            for row in ("base", "ours"):
                mine = [r for r in selected if r["method"] == method and r["row"] == row]
                if row == "ours" and not mine:
                    continue  # the paper has no + ours row for this method
                cells = [
                    make_cell(
                        [r for r in mine if r["dataset"] == d and column_of(r) == c],
                        lambda r: _metric(r, metric),
                    )
                    for d, c in columns
                ]
                block.append(
                    Row(method, ROW_LABELS[row], cells, depth=int(row != "base"), kind=row)
                )
        blocks.append(block)
    name, caption, label = _main_names(stream, metric, best_hp)
    table = Table(
        name=name,
        caption=caption,
        label=label,
        groups=[
            (_dataset_header(d), [_lr_header(c) for c in (*FIXED_LRS, BEST)]) for d in datasets
        ],
        blocks=_method_blocks(blocks),
        stream=stream,
        keys=columns,
    )
    if ignored:
        table.notes.append(
            f"{plural(ignored, 'run')} left out: neither at a fixed LR "
            f"({', '.join(map(_lr_header, FIXED_LRS))}) "
            "with the paper's FGH setting nor tagged hp_column: best."
        )
    return _finish(table)


def _metric(run: dict[str, Any], metric: str) -> float | None:
    if metric.startswith("task"):
        k = int(metric.removeprefix("task")) - 1
        accuracies = run["final_task_accuracies"]
        return accuracies[k] if k < len(accuracies) else None
    return run[metric]


def _gamma_of(hp: tuple) -> float | None:
    """The FGH gamma of :func:`report.hyperparameters`' tuple; None without FGH."""
    options = hp[1]
    return None if options is None else float(dict(options)["gamma"])


def _searched_choice(
    runs: list[dict[str, Any]], method_key: str, row: str
) -> tuple[float, float | None] | None:
    """The (LR, gamma) that ``pilot-online best`` picks (``SELECTION_RULE``) from the hp_grid
    search's runs of one method and row among ``runs``: those on the search's dataset and
    stream (``HP_SEARCH_SETTINGS``: VTAB, clear), not tagged best; None without such runs. A
    + ours row that hp_grid does not search (no gamma listed) takes the base row's LR with the
    paper's gamma, as ``best`` derives it."""
    search = [
        r
        for r in runs
        if r["dataset"] == HP_SEARCH_SETTINGS["dataset"]
        and r["stream"] == HP_SEARCH_SETTINGS["stream"]
        and r["hp_column"] != BEST
        and r["method_key"] == method_key
        and r["lr"] is not None
    ]
    points: dict[tuple[float, float | None], dict[Any, Any]] = {}
    for run in one_run_per_seed(search, _run_identity, _run_recency)[0]:
        if run["row"] == row:
            key = (run["lr"], _gamma_of(run["hp"]) if row == "ours" else None)
            points.setdefault(key, {})[run["seed"]] = run["AP"] if _finite(run["AP"]) else None
    if not points:
        grid = _hp_grid().get(method_key)
        if row == "ours" and not (grid and grid.gammas):
            base = _searched_choice(runs, method_key, "base")
            return None if base is None else (base[0], float(PAPER_FGH["gamma"]))
        return None
    try:
        chosen = select_best(
            [{"init_lr": lr, "gamma": gamma, "ap": ap} for (lr, gamma), ap in points.items()]
        )
    except ValueError:  # no grid point has an AP
        return None
    return chosen["init_lr"], chosen["gamma"]


def _hp_grid() -> dict[str, Any]:
    """``protocol.HP_GRID``, read when needed: building it imports every method."""
    from . import protocol

    return protocol.HP_GRID


def _run_identity(run: dict[str, Any]) -> tuple:
    return (run["method_key"], run["dataset"], run["stream"], run["row"], run["seed"], run["hp"])


def _run_recency(run: dict[str, Any]) -> tuple:
    return (run["created"], run["file"])


def best_hp_sentence(runs: list[dict[str, Any]], stream: str) -> str:
    """What the Best HP column of ``stream``'s main tables holds, for their caption (LaTeX).

    "found on VTAB" only where it is so: the hp_grid search's own runs (VTAB, clear) are among
    ``runs`` and pick the LR and gamma the Best HP runs used. Otherwise the caption gives those
    numbers: the runs tagged ``hp_column: best`` ran at their configs' LR (and gamma), whether
    ``reproduce`` took them from the paper or ``sweep --hp-from`` from a search elsewhere."""
    best = [
        r
        for r in runs
        if r["stream"] == stream and r["hp_column"] == BEST and r["row"] in ("base", "ours")
    ]
    if not best:
        return _tex_note("Best HP: no run here is tagged hp_column: best.")
    settings: dict[tuple[str, str], list[tuple]] = {}
    for run in sorted(best, key=lambda r: (_sort_order(r["method"]), r["row"] != "base")):
        hps = settings.setdefault((run["method"], run["row"]), [])
        if run["hp"] not in hps:
            hps.append(run["hp"])
    keys = {r["method"]: r["method_key"] for r in best}
    searched = {
        (method, row)
        for (method, row), hps in settings.items()
        if all(
            _searched_choice(runs, keys[method], row)
            == (hp[0], _gamma_of(hp) if row == "ours" else None)
            for hp in hps
        )
    }
    if len(searched) == len(settings):
        return _tex_note(
            "Best HP refers to the best set of LR and γ found on VTAB by the hp_grid search "
            "(its runs are among these results)."
        )
    rows = "; ".join(
        f"{method}{' + ours' if row == 'ours' else ''} "
        + " or ".join(_hyperparameter_label(hp) for hp in hps)
        for (method, row), hps in settings.items()
    )
    text = f"Best HP: the runs tagged hp_column: best, at the LR and γ of their configs: {rows}."
    if searched:
        found = ", ".join(
            f"{method}{' + ours' if row == 'ours' else ''}"
            for method, row in settings
            if (method, row) in searched
        )
        text += f" Found on VTAB by the hp_grid search: {found}."
    return _tex_note(text)


def _sort_order(method: str) -> tuple[int, str]:
    """The paper's row order, then the name (methods the paper does not list)."""
    order = [m for group in PAPER_GROUPS for m in group]
    return (order.index(method) if method in order else len(order), method)


def _main_names(stream: str, metric: str, best_hp: str = "") -> tuple[str, str, str]:
    short = STREAM_NAMES.get(stream, stream)
    setting = STREAM_TITLES.get(stream, stream)
    tail = (
        rf"\textit{{+ ours}} refers to combining the baselines with prototypes and FGH. {best_hp}"
    )
    tail = tail.rstrip()
    if metric == "AP":
        return (
            f"all_acc_{short}",
            "Average Performances (\\%) of all considered baselines, "
            f"in the {setting} setting. {tail}",
            f"tab:{short}_all",
        )
    if metric == "A_T":
        return (
            f"total_{short}",
            f"Final performances $\\mathcal{{A}}_T$ (\\%) of all considered baselines, in the "
            f"{setting} setting. {tail}",
            f"tab:{short}_total",
        )
    if metric == "A_online":
        return (
            f"online_{short}",
            "Average online accuracy $\\mathcal{A}_{online}$ (\\%, Ghunaim et al., 2023: each "
            "stream batch predicted before training on it) of all considered baselines, in the "
            f"{setting} setting. {tail}",
            f"tab:{short}_online",
        )
    k = int(metric.removeprefix("task"))
    which = ORDINALS[k - 1] if k <= len(ORDINALS) else f"{k}th"
    return (
        f"task{k}_{short}",
        f"Accuracy on the \\textbf{{{which} task}} at the end of training, in the {setting} "
        f"setting. {tail}",
        f"tab:{short}_t{k}",
    )


def ablation_table(runs: list[dict[str, Any]], stream: str) -> Table:
    """The ablation (paper: Si-Blurry): base, + P, + FGH, + P + FGH at the fixed LRs, gamma 1."""
    selected = [
        r
        for r in runs
        if r["stream"] == stream and r["hp_column"] != BEST and column_of(r) in FIXED_LRS
    ]
    with_ablation = {r["method"] for r in selected if r["row"] in ("p", "fgh_only")}
    selected = [r for r in selected if r["method"] in with_ablation]
    datasets = _datasets_in_order(selected)
    columns = [(d, lr) for d in datasets for lr in FIXED_LRS]
    blocks = []
    for methods in _methods_in_order(selected):
        for method in methods:
            block = []
            for row in ("base", "p", "fgh_only", "ours"):
                mine = [r for r in selected if r["method"] == method and r["row"] == row]
                cells = [
                    make_cell(
                        [r for r in mine if r["dataset"] == d and column_of(r) == lr],
                        lambda r: r["AP"],
                    )
                    for d, lr in columns
                ]
                depth = {"base": 0, "ours": 2}.get(row, 1)
                block.append(Row(method, ABLATION_LABELS[row], cells, depth=depth, kind=row))
            blocks.append(block)
    short = STREAM_NAMES.get(stream, stream)
    table = Table(
        name=f"ablation_{short}",
        caption="Average Performances (\\%) of all considered baselines with and without "
        f"prototypes as memory and FGH, in the {STREAM_TITLES.get(stream, stream)} setting; "
        f"FGH: {_fgh_caption()}.",
        label="tab:ablation" if stream == "si_blurry" else f"tab:ablation_{short}",
        groups=[(_dataset_header(d), [_lr_header(lr) for lr in FIXED_LRS]) for d in datasets],
        blocks=_method_blocks(blocks),
        stream=stream,
        keys=columns,
    )
    return _finish(table, bold_per_block=True)


def time_table(runs: list[dict[str, Any]], dataset: str, stream: str) -> Table:
    """Time and memory per method and row (paper: CUB, clear), over every run of that dataset
    and stream (any LR: one pass costs the same) except the Best HP column's."""
    selected = [  # Best HP runs repeat a configuration of the search: not counted twice
        r
        for r in runs
        if r["dataset"] == dataset and r["stream"] == stream and r["hp_column"] != BEST
    ]
    blocks = []
    for methods in _methods_in_order(selected):
        block = []
        for method in methods:
            for row in ("base", "p", "fgh_only", "ours"):
                mine = [r for r in selected if r["method"] == method and r["row"] == row]
                cells = [  # every LR on purpose: not flagged as mixed
                    make_cell(mine, lambda r: r["seconds"], flag_mixed=False),
                    make_cell(
                        mine,
                        lambda r: (
                            r["peak_memory_bytes"] / 2**20 if r["peak_memory_bytes"] else None
                        ),
                        flag_mixed=False,
                    ),
                ]
                block.append(
                    Row(method, ROW_LABELS[row], cells, depth=int(row != "base"), kind=row)
                )
        blocks.append(block)
    short = STREAM_NAMES.get(stream, stream)
    table = Table(
        name=f"time_{dataset}_{short}",
        caption="Time and Spatial complexity of compared methods on "
        f"{_latex_escape(_dataset_header(dataset))} in the {STREAM_TITLES.get(stream, stream)} "
        "setting.",
        label=f"tab:time_consumption_{dataset}_{short}",
        groups=[("", ["Time", "Memory Footprint (MB)"])],
        blocks=_method_blocks(blocks),
        kind="time",
        stream=stream,
    )
    table = _finish(table, better="min")
    table.notes.append(
        "Time: training + evaluation wall clock per run; memory: peak accelerator memory on "
        "CUDA, peak resident memory of the process on CPU (MB = 2^20 bytes); over every run of "
        "the row (seeds and learning rates)."
    )
    return table


def realtime_table(runs: list[dict[str, Any]], stream: str) -> Table:
    """The compute-aware table: real-time runs (``realtime``), each method beside its + ours at
    the stream speed of one reference method; per dataset (and reference), C, the percentage of
    stream batches trained, A_online (every batch scored) and AP. Runs of every LR pool into one
    cell, so two LRs show as mixed hyperparameters, with each one's mean in the notes."""
    selected = [
        r for r in runs if r["stream"] == stream and r["realtime"] is not None
        and r["row"] in ("base", "ours")
    ]  # fmt: skip
    # A column group per dataset, reference and way of pricing C (flops, measured, a number):
    # each is its own stream speed.
    keys = list(dict.fromkeys((r["dataset"], r["reference"], _mode(r)) for r in selected))
    keys.sort(key=lambda k: (_datasets_in_order(selected).index(k[0]), str(k[1]), k[2]))
    measures = (
        ("C", lambda r: r["C"]),
        ("trained %", lambda r: r["trained_percent"]),
        ("A_online", lambda r: r["A_online"]),
        ("AP", lambda r: r["AP"]),
    )
    blocks = []
    for methods in _methods_in_order(selected):
        block = []
        for method in methods:
            for row in ("base", "ours"):
                mine = [r for r in selected if r["method"] == method and r["row"] == row]
                if not mine:
                    continue
                cells = [
                    make_cell(
                        [r for r in mine if (r["dataset"], r["reference"], _mode(r)) == key], value
                    )
                    for key in keys
                    for _, value in measures
                ]
                block.append(
                    Row(method, ROW_LABELS[row], cells, depth=int(row != "base"), kind=row)
                )
        blocks.append(block)
    short = STREAM_NAMES.get(stream, stream)
    references = sorted({str(k[1]) for k in keys})
    modes = {k[2] for k in keys}
    table = Table(
        name=f"realtime_{short}",
        caption="Compute-aware comparison (real-time evaluation, Ghunaim et al., 2023): the "
        f"stream does not wait; a step costing $C$ steps of the reference method "
        f"({_latex_escape(', '.join(references))}) trains on one batch in every $C$ and every "
        r"batch is predicted before training; $\mathcal{A}_{online}$ and AP (\%), in the "
        f"{STREAM_TITLES.get(stream, stream)} setting.",
        label=f"tab:realtime_{short}",
        groups=[
            (
                _dataset_header(d)
                + ("" if len(references) == 1 else f" ({ref})")
                + ("" if len(modes) == 1 else f" ({mode})"),
                [name for name, _ in measures],
            )
            for d, ref, mode in keys
        ],
        blocks=_method_blocks(blocks),
        kind="realtime",
        stream=stream,
    )
    table = _finish(table)
    for block in table.blocks:  # the best C or share trained is no achievement: no bold
        for row in block:
            for i, cell in enumerate(row.cells):
                if i % len(measures) < 2:
                    cell.bold = False
    table.notes.append(
        "C: the step's cost relative to the reference's (its source is each run's "
        "realtime: flops, flops_counted, measured or given); trained %: stream batches trained "
        "on; the others were scored only. A method cheaper than the reference has C = 1."
    )
    return table


def _mode(run: dict[str, Any]) -> str:
    """How a real-time run priced C: ``flops``, ``flops_counted``, ``measured`` or ``C=2``."""
    mode = run["realtime"]
    return mode if isinstance(mode, str) else f"C={mode:g}"


def build_tables(runs: list[dict[str, Any]]) -> list[Table]:
    """Every table the runs can fill: the paper's from the runs of its protocol, the
    compute-aware ones from the real-time runs."""
    realtime = [r for r in runs if r.get("realtime") is not None]
    other = sum(1 for r in runs if r.get("protocol") is not None)
    runs = [r for r in runs if r.get("protocol") is None]
    tables: list[Table] = []
    streams = [s for s in STREAMS if any(r["stream"] == s for r in runs)]
    online = ("A_online",) if any(_finite(r.get("A_online")) for r in runs) else ()
    for metric in ("AP", "A_T", *online):
        tables += [main_table(runs, s, metric) for s in streams]
    for stream in streams:
        if any(r["stream"] == stream and r["row"] in ("p", "fgh_only") for r in runs):
            tables.append(ablation_table(runs, stream))
    for stream in streams:
        tasks = max(
            (len(r["final_task_accuracies"]) for r in runs if r["stream"] == stream), default=0
        )
        tables += [main_table(runs, stream, f"task{k}") for k in range(1, tasks + 1)]
    for dataset in _datasets_in_order(runs):
        for stream in streams:
            if any(r["dataset"] == dataset and r["stream"] == stream for r in runs):
                tables.append(time_table(runs, dataset, stream))
    if other:
        for table in tables:
            table.notes.append(
                f"{plural(other, 'run')} of another protocol (real-time mode or online_iter > 1) "
                "left out: the paper's tables hold its protocol only (real-time runs: realtime_*)."
            )
    tables += [
        realtime_table(realtime, s) for s in STREAMS if any(r["stream"] == s for r in realtime)
    ]
    return [t for t in tables if any(t.blocks)]


# --- rendering ------------------------------------------------------------------------------


def _format_seconds(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + f"{secs}s"


def _values(table: Table, column: int, cell: Cell) -> tuple[str, str | None]:
    """(mean, std) as text, in the table's units."""
    if table.kind == "time" and column == 0:
        return _format_seconds(cell.mean), _format_seconds(cell.std)
    if table.kind == "time":
        return f"{cell.mean:,.0f}", f"{cell.std:,.0f}"
    return f"{cell.mean:.2f}", f"{cell.std:.2f}"


def _md_cell(table: Table, column: int, cell: Cell) -> str:
    if not cell.n:
        return MISSING
    if cell.mixed:
        return f"{MIXED} mixed HP (n={cell.n})"
    mean, std = _values(table, column, cell)
    text = mean if cell.n == 1 else f"{mean} ± {std}"  # one seed: no std to show
    if cell.bold:
        text = f"**{text}**"
    if cell.fewer_seeds:
        text += f" †(n={cell.n})"
    return text


def _md_label(row: Row) -> str:
    """The row name; a sub-row ("+ ours") indented by em spaces, which Markdown keeps and a
    terminal shows as spaces (not raw ``&nbsp;`` entities)."""
    if not row.label or not row.depth:  # a method's own row, or one standing without it
        return _plain_label(row)
    return "\u2003" * (row.depth - 1) + "↳ " + row.label


def to_markdown(table: Table) -> str:
    headers = ["Method"] + [
        f"{group} {column}".strip() for group, columns in table.groups for column in columns
    ]
    caption = table.caption.replace(r"\textit{", "*").replace(r"\textbf{", "**")
    caption = caption.replace("$\\mathcal{A}_T$", "A_T").replace("$\\gamma$", "γ")
    caption = caption.replace("$\\mathcal{A}_{online}$", "A_online")
    caption = caption.replace("$C$", "C")
    caption = re.sub(r"\$\\gamma=([^$]*)\$", r"γ = \1", caption)
    caption = caption.replace("\\%", "%").replace("\\_", "_")
    caption = _close_markup(caption)
    lines = [f"**{table.name}**: {caption}", "", "| " + " | ".join(headers) + " |"]
    lines.append("| " + " | ".join(["---"] * len(headers)) + " |")
    for block in table.blocks:
        for row in block:
            cells = [_md_cell(table, i, c) for i, c in enumerate(row.cells)]
            lines.append("| " + " | ".join([_md_label(row), *cells]) + " |")
    if table.notes:
        lines += [""] + [f"- {note}" for note in table.notes]
    return "\n".join(lines) + "\n"


def _close_markup(text: str) -> str:
    """``\\textit{x}`` became ``*x}``: turn each closing brace into the matching marker."""
    out, stack = [], []
    i = 0
    while i < len(text):
        if text.startswith("**", i):
            stack.append("**")
            out.append("**")
            i += 2
        elif text[i] == "*":
            stack.append("*")
            out.append("*")
            i += 1
        elif text[i] == "}" and stack:
            out.append(stack.pop())
            i += 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _latex_escape(text: str) -> str:
    for char, escaped in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"),
                          ("#", r"\#"), ("$", r"\$")):  # fmt: skip
        text = text.replace(char, escaped)
    return text


def _tex_cell(table: Table, column: int, cell: Cell) -> str:
    if not cell.n:
        return "---"
    if cell.mixed:
        return f"$\\ddagger$ mixed HP (n={cell.n})"
    mean, std = _values(table, column, cell)
    text = mean if cell.n == 1 else f"{mean}{{\\scriptsize$\\pm${std}}}"
    if cell.bold:
        text = f"\\textbf{{{text}}}"
    if cell.fewer_seeds:
        text += f"$^{{\\dagger{cell.n}}}$"
    return text


def _tex_label(row: Row) -> str:
    if not row.label or not row.depth:
        return _latex_escape(_plain_label(row))
    return r"\ \ " * row.depth + r" $\hookrightarrow$ " + _latex_escape(row.label)


def to_latex(table: Table) -> str:
    """A booktabs ``table*`` in the paper's layout (needs booktabs and graphicx)."""
    widths = [len(columns) for _, columns in table.groups]
    spec = "l|" + "|".join("c" * w for w in widths)
    group_line = " & ".join(
        [r"\multicolumn{1}{c}{Dataset}"]
        + [
            f"\\multicolumn{{{w}}}{{c}}{{{_latex_escape(g)}}}"
            for (g, _), w in zip(table.groups, widths)
        ]
    )
    column_line = " & ".join(
        [
            r"\multicolumn{1}{c}{Learning Rate}"
            if table.kind == "percent"
            else r"\multicolumn{1}{c}{Method}"
        ]
        + [f"\\multicolumn{{1}}{{c}}{{{_tex_header(c)}}}" for _, cols in table.groups for c in cols]
    )
    lines = [
        r"\begin{table*}[t]",
        r"    \centering",
        f"    \\caption{{{table.caption}}}",
        r"    \resizebox{\textwidth}{!}{",
        f"    \\begin{{tabular}}{{{spec}}}",
        r"    \toprule",
    ]
    if table.kind != "time":
        lines += [group_line + r" \\", r"\midrule"]
    lines += [column_line + r" \\", r"\midrule\midrule"]
    for i, block in enumerate(table.blocks):
        if i:
            lines.append(r"\midrule")
        for row in block:
            cells = [_tex_cell(table, j, c) for j, c in enumerate(row.cells)]
            lines.append(" & ".join([_tex_label(row), *cells]) + r" \\")
    lines += [r"\bottomrule", r"    \end{tabular}}"]
    if table.notes:
        notes = " ".join(map(_tex_note, table.notes))
        lines.append(f"    \\par\\footnotesize {notes}")
    lines += [f"    \\label{{{table.label}}}", r"\end{table*}"]
    return "\n".join(lines) + "\n"


def _tex_note(note: str) -> str:
    note = _latex_escape(note).replace("±", r"$\pm$").replace("†", r"$\dagger$")
    note = note.replace("‡", r"$\ddagger$").replace("γ", r"$\gamma$").replace("Δ", r"$\Delta$")
    return note.replace("—", "---").replace("2^20", "$2^{20}$").replace("≥", r"$\geq$")


def _tex_header(column: str) -> str:
    if "e-" in column:
        mantissa, exponent = column.split("e")
        return f"${mantissa} \\times 10^{{{int(exponent)}}}$"
    return _latex_escape(column)


# --- against the paper ----------------------------------------------------------------------

#: Our table -> the paper's (package data, ``harness/paper.py``) with the same rows and columns.
PAPER_TABLES = {
    "all_acc_clear": "all_acc_clear",
    "all_acc_blurry": "all_acc_blurry",
    "ablation_blurry": "all_ablation_blurry",
}
WITHIN_STD, WITHIN_2STD, DIFFERS, NOT_COMPARED = (
    "within std",
    "within 2 std",
    "differs",
    "mixed HP, not compared",
)
VERDICTS = (WITHIN_STD, WITHIN_2STD, DIFFERS, NOT_COMPARED)
#: The paper prints two decimals: a difference within half a unit of the last one is no
#: difference (so a printed std of 0.0 still admits the rounding of the printed mean).
PRINTED_ROUNDING = 0.005


@dataclass
class Comparison:
    """One of our cells beside the paper's cell with the same keys."""

    table: str  # our table name
    dataset: str  # PILOT's name
    method: str  # the paper's row name
    label: str  # our row label ("", "+ ours", "+ P", ...)
    column: float | str  # learning rate or "best"
    ours: Cell
    paper: PaperCell

    @property
    def difference(self) -> float | None:
        return None if self.ours.mixed else self.ours.mean - self.paper.mean

    @property
    def verdict(self) -> str:
        """Within the paper's std, within twice it, or differs (by the mean's distance)."""
        if self.ours.mixed:
            return NOT_COMPARED
        distance = abs(self.difference)
        if distance <= self.paper.std + PRINTED_ROUNDING:
            return WITHIN_STD
        if distance <= 2 * self.paper.std + PRINTED_ROUNDING:
            return WITHIN_2STD
        return DIFFERS


@dataclass
class PaperReport:
    comparisons: list[Comparison]
    unmatched: int  # our filled cells with no paper cell (other datasets, LRs, methods)
    notes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        found = Counter(c.verdict for c in self.comparisons)
        return {v: found.get(v, 0) for v in VERDICTS}


def compare_with_paper(
    tables: Iterable[Table], only: set[tuple[str, str, str, str, float | str]] | None = None
) -> PaperReport:
    """Every filled cell of our AP tables whose dataset, stream, method row and column have a
    cell in the paper. ``only``: keep just these (dataset, stream, method short name, row,
    column) keys (``reproduce`` compares the cells it ran)."""
    comparisons: list[Comparison] = []
    unmatched = 0
    short = _short_names()
    for table in tables:
        paper_table = PAPER_TABLES.get(table.name)
        if paper_table is None:
            continue
        for block in table.blocks:
            for row in block:
                for (dataset, column), cell in zip(table.keys, row.cells):
                    if not cell.n:
                        continue
                    key = (dataset, table.stream, short.get(row.method), row.kind, column)
                    if only is not None and not any(same_cell(key, k) for k in only):
                        continue
                    paper = find_paper_cell(
                        paper_table, dataset, table.stream, row.method, row.kind, column
                    )
                    if paper is None:
                        unmatched += 1
                        continue
                    comparisons.append(
                        Comparison(table.name, dataset, row.method, row.label, column, cell, paper)
                    )
    return PaperReport(comparisons, unmatched, _paper_notes(comparisons))


def _short_names() -> dict[str, str]:
    """The paper's row name -> the method's short name (coda, l2p, ...), from the registry."""
    from .paper import registered_names

    return {paper: method_short_name(name) for paper, name in registered_names().items()}


def _paper_notes(comparisons: list[Comparison]) -> list[str]:
    notes = [
        "Verdict: |ours - paper| (means) within the paper's std, within twice it, or more "
        f"(differs); {PRINTED_ROUNDING} is added to each bound for the paper's two printed "
        "decimals. Our std is the population std (ddof 0); the paper does not say which it prints."
    ]
    fewer = [c for c in comparisons if c.ours.n < c.paper.n]
    if fewer:
        notes.append(
            f"{len(fewer)} of our cells have fewer seeds than the paper's "
            "(10; 3 for ConvPrompt and oLoRA): their std is less certain."
        )
    with_fgh = {ROW_LABELS["fgh_only"], ROW_LABELS["ours"], ABLATION_LABELS["ours"]}
    if any(c.label in with_fgh for c in comparisons):
        notes.append(
            f"FGH in our + FGH and + ours cells: {_fgh_caption(latex=False)} "
            "(engine.config.PAPER_FGH; docs/fgh.md)."
        )
    best_methods = {c.method for c in comparisons if c.column == BEST}
    notes += [
        f"Best HP: {text}; `pilot-online reproduce` runs the Best HP cells at the LR the "
        "tables' numbers came from (see docs/protocol.md)."
        for text in best_hp_discrepancies()
        if text.split(":")[0] in best_methods
    ]
    return notes


def _column_header(column: float | str) -> str:
    return _lr_header(column)


def _comparison_cells(c: Comparison) -> list[str]:
    if c.ours.mixed:
        ours = f"{MIXED} mixed HP (n={c.ours.n})"
    elif c.ours.n == 1:  # one seed: its value, no std
        ours = f"{c.ours.mean:.2f} (n=1)"
    else:
        ours = f"{c.ours.mean:.2f} ± {c.ours.std:.2f} (n={c.ours.n})"
    paper = f"{c.paper.mean:.2f} ± {c.paper.std:.2f} (n={c.paper.n})"
    diff = "—" if c.difference is None else f"{c.difference:+.2f}"
    return [ours, paper, diff, c.verdict]


def _summary(report: PaperReport) -> str:
    counts = report.counts()
    text = ", ".join(f"{verdict}: {n}" for verdict, n in counts.items())
    return f"Summary ({plural(len(report.comparisons), 'cell')}): {text}." + (
        f" {report.unmatched} of our cells have no paper counterpart." if report.unmatched else ""
    )


def vs_paper_markdown(report: PaperReport) -> str:
    """One line per compared cell, then the notes and the count per verdict."""
    headers = ["Table", "Dataset", "Method", "LR", "Ours", "Paper", "Δ", "Verdict"]
    lines = ["**vs_paper**: our cells beside the paper's (AP, %).", ""]
    lines += ["| " + " | ".join(headers) + " |", "| " + " | ".join(["---"] * len(headers)) + " |"]
    for c in report.comparisons:
        method = c.method if not c.label else f"{c.method} {c.label}"
        lines.append(
            "| "
            + " | ".join(
                [
                    c.table,
                    paper_datasets().get(c.dataset, c.dataset),
                    method,
                    _column_header(c.column),
                    *_comparison_cells(c),
                ]
            )
            + " |"
        )
    lines += [""] + [f"- {note}" for note in report.notes] + ["", _summary(report)]
    return "\n".join(lines) + "\n"


def vs_paper_latex(report: PaperReport) -> str:
    """The same, as a booktabs ``longtable``-free ``table*`` (needs booktabs and graphicx)."""
    lines = [
        r"\begin{table*}[t]",
        r"    \centering",
        r"    \caption{Our cells beside the paper's (AP, \%).}",
        r"    \resizebox{\textwidth}{!}{",
        r"    \begin{tabular}{lllllllll}",
        r"    \toprule",
        r"Table & Dataset & Method & LR & Ours & Paper & $\Delta$ & Verdict \\",
        r"\midrule",
    ]
    for c in report.comparisons:
        method = c.method if not c.label else f"{c.method} {c.label}"
        ours, paper, diff, verdict = _comparison_cells(c)
        cells = [
            _latex_escape(c.table),
            _latex_escape(paper_datasets().get(c.dataset, c.dataset)),
            _latex_escape(method),
            _tex_header(_column_header(c.column)),
            _tex_note(ours),
            _tex_note(paper),
            diff if c.difference is not None else "---",
            _latex_escape(verdict),
        ]
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"    \end{tabular}}"]
    notes = " ".join(_tex_note(n).replace("`", "") for n in [*report.notes, _summary(report)])
    lines += [f"    \\par\\footnotesize {notes}", r"    \label{tab:vs_paper}", r"\end{table*}"]
    return "\n".join(lines) + "\n"


VS_PAPER_FORMATS = {"md": vs_paper_markdown, "tex": vs_paper_latex}


def write_vs_paper(report: PaperReport, out: Path, formats: Iterable[str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        path = out / f"vs_paper.{fmt}"
        write_atomic(path, VS_PAPER_FORMATS[fmt](report))
        written.append(path)
    return written


FORMATS = {"md": to_markdown, "tex": to_latex}


def write_tables(
    tables: list[Table], out: Path, formats: Iterable[str] = ("md", "tex")
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for table in tables:
        for fmt in formats:
            path = out / f"{table.name}.{fmt}"
            write_atomic(path, FORMATS[fmt](table))
            written.append(path)
    if "md" in formats and tables:  # every Markdown table in one file, for notes and reviews
        index = out / "tables.md"
        write_atomic(index, "\n".join(to_markdown(t) for t in tables))
        written.append(index)
    return written


def add_tables_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, help="results files or folders")
    parser.add_argument("--out", type=Path, required=True, help="folder for the tables")
    parser.add_argument("--format", default="md,tex", help="comma-separated: md, tex")
    parser.add_argument(
        "--figures", action="store_true", help="also write the paper's figures into --out"
    )
    parser.add_argument(
        "--vs-paper",
        action="store_true",
        help="also compare every cell of Tables 1-2 and the Si-Blurry ablation with the paper's "
        "(mean ± std, difference, verdict): vs_paper.md / .tex, printed too",
    )


def run_tables(args: argparse.Namespace) -> int:
    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    unknown = set(formats) - set(FORMATS)
    if unknown:
        print(f"--format {args.format!r}: choose from {', '.join(FORMATS)}")
        return 2
    runs = load_rows(args.paths)
    if not runs:
        print("no results files found under " + ", ".join(map(str, args.paths)))
        return 1
    tables = build_tables(runs)
    for path in write_tables(tables, args.out, formats):
        print(f"wrote {path}")
    if getattr(args, "vs_paper", False):
        report = compare_with_paper(tables)
        if not report.comparisons:
            print(no_paper_cells_message())
        else:
            print(vs_paper_markdown(report))
            for path in write_vs_paper(report, args.out, formats):
                print(f"wrote {path}")
    if args.figures:  # the five figures beside the tables (matplotlib: the plots extra)
        from .figures import load_runs, write_figures

        for path in write_figures(load_runs(args.paths), Path(args.out) / "figures"):
            print(f"wrote {path}")
    return 0


def no_paper_cells_message() -> str:
    """Why nothing was compared: what a cell needs to meet a paper cell."""
    return (
        "--vs-paper: no cell matches one of the paper's. A paper cell needs dataset "
        + ", ".join(paper_datasets())
        + f"; stream {' or '.join(STREAMS)}; a method row of the paper (base or + P + FGH at the "
        "paper's FGH setting; + P and + FGH in the Si-Blurry ablation); and init_lr "
        + ", ".join(map(_lr_header, FIXED_LRS))
        + " or a run tagged hp_column: best."
    )

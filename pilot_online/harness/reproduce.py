"""``pilot-online reproduce``: run cells of the paper's tables and set them beside the paper's.

A cell is ``DATASET/STREAM/METHOD/ROW/COLUMN``, e.g. ``cifar224/si_blurry/coda/ours/5e-3`` or
``cub/clear/l2p/base/best``: a PILOT dataset name, ``clear`` or ``si_blurry``, a method's short
name (``exps/<method>_online_*.json``), ``base``, ``ours`` (+ P + FGH), ``p`` or ``fgh_only`` (the
Si-Blurry ablation's + P and + FGH), and ``5e-5``, ``5e-3`` or ``best``. ``--table NAME`` adds
every cell of one of the paper's tables (all_acc_clear, all_acc_blurry, all_ablation_blurry).

Each cell runs the paper-row config ``exps/<method>_online_<variant>[_blurry].json`` with the
cell's dataset and learning rate, once per seed of the paper's count (the config's first 10
seeds; 3 for ConvPrompt and oLoRA), each seed its own config so that the engines (``--engine
local`` or ``ray``, as ``pilot-online sweep``) spread them over GPUs; finished runs are skipped.
Then the ``--vs-paper`` comparison of those cells is printed and written beside the results.
``--dry-run`` checks the configs and lists the runs with their estimated GPU time, and writes
nothing: no config, no ``--out`` folder.

The Best HP column runs hp_grid's bold LR (and gamma for + ours; the paper configs' gamma where
hp_grid has none), tagged ``hp_column: best``. By default (``--best-hp tables``) a method whose
Best HP cells in Tables 1-2 all equal its cells at a fixed LR runs that column's config instead:
those numbers came from it. That matters for L2P, whose 12 Best HP cells equal its 5e-3 cells
while hp_grid bolds 0.01; ``--best-hp hp_grid`` runs the bold LR.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.progress import plural
from ..engine.config import HP_COLUMNS, PAPER_FGH, PILOT_KEYS, ConfigError, load_json
from ..engine.registry import method_card
from .engines import EngineUnavailable, add_engine_arguments
from .estimate import dataset_size, estimate_run_seconds
from .paper import (
    BEST,
    COMPARED_TABLES,
    best_hp_columns,
    best_hp_discrepancies,
    paper_cells,
    paper_datasets,
    paper_streams,
    registered_names,
    same_cell,
    same_column,
)
from .points import apply_point, parse_sets, plan_configs, write_configs
from .protocol import FIXED_LRS, HP_ROWS, method_short_name
from .sweep import run_config_files, run_finished

#: Our row names -> the exps/ variant they run (``engine.config.VARIANTS``).
ROW_VARIANTS = {**HP_ROWS, "p": "p", "fgh_only": "fgh_only"}
COLUMN_NAMES = ("5e-5", "5e-3", BEST)
BEST_HP_POLICIES = ("tables", "hp_grid")
#: Keys that make a run another cell: ``--set`` may not change them.
CELL_KEYS = ("model_name", "stream", "init_lr", "online_prototypes", "fgh", "hp_column")

#: A cell's configs, one per seed, by the path each is written to (``points.plan_configs``).
PlannedConfigs = dict[Path, dict[str, Any]]


@dataclass(frozen=True)
class CellSpec:
    """One cell to reproduce (``method``: short name, ``column``: a learning rate or "best")."""

    dataset: str
    stream: str
    method: str
    row: str
    column: float | str

    @property
    def text(self) -> str:
        column = self.column if self.column == BEST else _lr_text(self.column)
        return f"{self.dataset}/{self.stream}/{self.method}/{self.row}/{column}"

    @property
    def name(self) -> str:
        return self.text.replace("/", "__")

    def key(self) -> tuple[str, str, str, str, float | str]:
        return (self.dataset, self.stream, self.method, self.row, self.column)


def _lr_text(lr: float) -> str:
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _methods() -> dict[str, str]:
    """Short name -> the paper's row name, for every method of the paper's tables."""
    return {method_short_name(name): paper for paper, name in registered_names().items()}


def _paper_keys() -> set[tuple[str, str, str, str, float | str]]:
    short = {paper: s for s, paper in _methods().items()}
    return {(c.dataset, c.stream, short[c.method], c.row, c.column) for c in paper_cells()}


def parse_cell(text: str) -> CellSpec:
    """``cifar224/si_blurry/coda/ours/5e-3`` -> a CellSpec; any bad part raises a ConfigError
    that lists the valid values."""
    parts = text.strip().strip("/").split("/")
    if len(parts) != 5:
        raise ConfigError(
            f"cell {text!r}: write DATASET/STREAM/METHOD/ROW/COLUMN, "
            "e.g. cifar224/si_blurry/coda/ours/5e-3 or cub/clear/l2p/base/best"
        )
    dataset, stream, method, row, column = parts
    methods = _methods()
    checks = (
        ("dataset", dataset, list(paper_datasets())),
        ("stream", stream, paper_streams()),
        ("method", method, list(methods)),
        ("row", row, list(ROW_VARIANTS)),
    )
    for what, value, valid in checks:
        if value not in valid:
            raise ConfigError(
                f"cell {text!r}: unknown {what} {value!r}; choose from {', '.join(valid)}"
            )
    parsed: float | str
    if column == BEST:
        parsed = BEST
    else:
        try:
            parsed = float(column)
        except ValueError:
            parsed = column
        match = [lr for lr in FIXED_LRS if same_column(lr, parsed)]
        if not match:
            raise ConfigError(
                f"cell {text!r}: unknown learning-rate column {column!r}; choose from "
                f"{', '.join(COLUMN_NAMES)}"
            )
        parsed = match[0]
    cell = CellSpec(dataset, stream, method, row, parsed)
    if not any(same_cell(cell.key(), k) for k in _paper_keys()):
        rows = sorted({k[3] for k in _paper_keys() if k[1] == stream and k[2] == method})
        raise ConfigError(
            f"cell {text!r}: the paper has no such cell; {methods[method]} has the rows "
            f"{', '.join(rows) or 'none'} on {stream} (p and fgh_only: Si-Blurry, 5e-5 and "
            "5e-3 only)"
        )
    return cell


def table_cells(table: str) -> list[CellSpec]:
    """Every cell of one of the paper's tables, in its order."""
    if table not in COMPARED_TABLES:
        raise ConfigError(f"--table {table!r}: choose from {', '.join(COMPARED_TABLES)}")
    short = {paper: s for s, paper in _methods().items()}
    return [
        CellSpec(c.dataset, c.stream, short[c.method], c.row, c.column)
        for c in paper_cells()
        if c.table == table
    ]


def best_point(method: str, row: str, policy: str = "tables") -> tuple[float, float | None, str]:
    """The Best HP cell's learning rate, gamma (None: the paper config's FGH as it is) and why.

    ``policy`` "tables": where every Best HP cell of the method in Tables 1-2 equals its cell at
    a fixed LR (L2P, ConvPrompt, linear probe, ER), the Best HP run repeats that column's config,
    FGH included, since that is the run those numbers came from; otherwise hp_grid's bold LR and
    gamma. "hp_grid": always hp_grid's bold LR and gamma (gamma 1 where it lists none)."""
    from .protocol import HP_GRID

    paper = _methods()[method]
    grid = HP_GRID[method]
    equal = best_hp_columns()[paper]["equal_to"]
    if policy == "tables" and equal is not None:
        why = f"the paper's Best HP cells equal its {_lr_text(equal)} cells"
        if not same_column(equal, grid.best_lr):
            why += f"; hp_grid bolds {grid.best_lr:g} (--best-hp hp_grid runs that)"
        if row == "ours" and grid.gammas and grid.best_gamma != PAPER_FGH["gamma"]:
            why += f"; the paper config's gamma {PAPER_FGH['gamma']:g}, hp_grid bolds "
            why += f"{grid.best_gamma:g}"
        return float(equal), None, why
    why = f"hp_grid's bold LR {grid.best_lr:g}"
    gamma = None
    if row == "ours":
        gamma = grid.best_gamma if grid.gammas else PAPER_FGH["gamma"]
        why += f", gamma {gamma:g}" + ("" if grid.gammas else " (hp_grid: N/A; the paper's gamma)")
    return float(grid.best_lr), gamma, why


def cell_configs(
    cell: CellSpec,
    exps: Path,
    out: Path,
    sets: dict[str, Any],
    policy: str = "tables",
) -> tuple[PlannedConfigs, str]:
    """Check one config per seed of ``cell`` (nothing is written); returns them by the path
    each goes to, and the LR's reason."""
    variant = ROW_VARIANTS[cell.row]
    path = (
        exps
        / f"{cell.method}_online_{variant}{'_blurry' if cell.stream == 'si_blurry' else ''}.json"
    )
    if not path.is_file():
        raise ConfigError(
            f"{path}: no paper config for {cell.text}; run from the repository root or pass --exps"
        )
    config = load_json(path)
    if (
        config.get("stream", "clear") != cell.stream
        or config.get("model_name") != f"{cell.method}_online"
    ):
        raise ConfigError(f"{path} is not the {cell.method} {cell.stream} config it is named for")
    _check_paper_fgh(config, path)
    point: dict[str, Any] = {"dataset": cell.dataset}
    point.update(method_card(config["model_name"]).settings_for(cell.dataset, cell.stream))
    if cell.column == BEST:
        lr, gamma, why = best_point(cell.method, cell.row, policy)
        point["init_lr"] = lr
        if gamma is not None:
            point["fgh.gamma"] = gamma
        point["hp_column"] = HP_COLUMNS[1]  # fills the Best HP column, whatever its LR
    else:
        point["init_lr"], why = cell.column, f"the column's LR {_lr_text(cell.column)}"
    config = apply_point(config, point)
    count = paper_seeds(cell)
    where = "--set seed" if "seed" in sets else str(path)
    try:  # distinct seeds: a repeat would count as a seed and run as none
        seeds = PILOT_KEYS["seed"].check("seed", sets.get("seed", config["seed"]))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None
    if "seed" not in sets and len(seeds) < count:
        raise ConfigError(
            f"{path} lists {len(seeds)} seeds; the paper ran {count}: add seeds there"
        )
    if "seed" not in sets:
        seeds = seeds[:count]
    config = apply_point(config, {k: v for k, v in sets.items() if k != "seed"})
    # One config per seed, <cell>__seed-<s>, so that the engines spread the seeds.
    return plan_configs(config, {"seed": seeds}, out, name_prefix=cell.name), why


def _paper_cell(cell: CellSpec):
    """The paper's value of the cell (Tables 1-2 first, else the ablation)."""
    from .paper import find_paper_cell

    paper = _methods()[cell.method]
    for table in COMPARED_TABLES:
        found = find_paper_cell(table, cell.dataset, cell.stream, paper, cell.row, cell.column)
        if found is not None:
            return found
    return None


def _check_paper_fgh(config: dict[str, Any], path: Path) -> None:
    """A paper-row config must run the paper's FGH (``engine.config.PAPER_FGH``): the tables put
    a fixed-LR "+ ours" run in its column only then, so a stale config would run for nothing."""
    from ..core.fgh_options import validate_options

    fgh = config.get("fgh")
    if fgh is not None and validate_options(**fgh) != validate_options(**PAPER_FGH):
        raise ConfigError(
            f"{path}: its fgh {fgh} is not the paper configs' FGH {PAPER_FGH} "
            "(engine.config.PAPER_FGH), so its runs would fill no cell; regenerate exps/ with "
            "python scripts/make_exps.py"
        )


def paper_seeds(cell: CellSpec) -> int:
    from .paper import paper_seed_count

    return paper_seed_count(_methods()[cell.method])


# --- estimates -------------------------------------------------------------------------------


def step_count(config: dict[str, Any]) -> tuple[int, float] | None:
    """Trained stream steps x batch passes per step (1, plus the replay batch of the rows with
    experience replay, plus oLoRA's hard-buffer batches at most, all times ``online_iter``);
    None for a dataset of unknown size. In real-time mode, the steps are the ``ceil(B / C)`` of
    the stream's B batches that its schedule trains (:func:`realtime_note`)."""
    try:
        images = dataset_size(config).train
    except ValueError:
        return None
    batch = int(config.get("batch_size", 100))
    steps = math.ceil(images / batch)
    passes = 1.0
    if config.get("er_memory_size"):
        passes += int(config.get("er_batch_size", batch)) / batch
    if config.get("hard_loss"):
        passes += int(config.get("hard_buffer_size", 0))
    passes *= int(config.get("online_iter") or 1)
    cost = _realtime_cost(config)
    if cost is not None:
        from ..core.realtime import RealtimeSchedule

        steps = RealtimeSchedule.from_value(cost, "given").trained_count(steps)
    return steps, passes


def _realtime_cost(config: dict[str, Any]) -> float | None:
    """The C real-time mode prices with (``estimate.realtime_cost``), None when off or when the
    FLOP model cannot price it."""
    from .estimate import realtime_cost

    try:
        return realtime_cost(config)
    except (ValueError, KeyError):
        return None


def realtime_note(config: dict[str, Any]) -> str:
    """``real-time C=1.33 (flops)``, for a dry-run line; "" when real-time mode is off. A
    ``"measured"`` C is priced at its FLOP-model value (it is known only once the run
    measures it)."""
    mode = config.get("realtime")
    if mode is None:
        return ""
    cost = _realtime_cost(config)
    if cost is None:
        return f"  real-time {mode}: C unknown to the FLOP model"
    from ..core.realtime import RealtimeSchedule

    schedule = RealtimeSchedule.from_value(cost, "given")
    source = "given" if not isinstance(mode, str) else mode
    if mode == "measured":
        source = "measured, priced at its flops value"
    return f"  real-time C={float(schedule.cost):.2f} ({source})"


def estimator(tflops: float | None):
    """``(function, description)``: the FLOP model (``harness/estimate.py``) at ``tflops``."""
    what = "FLOP model (pilot_online.harness.estimate)"
    if tflops is not None:
        what += f" at {tflops:g} TFLOP/s sustained"
        return (lambda cfg: estimate_run_seconds(cfg, sustained_tflops=tflops)), what
    return estimate_run_seconds, what


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


# --- the command ---------------------------------------------------------------------------


def add_reproduce_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "cells",
        nargs="*",
        help="DATASET/STREAM/METHOD/ROW/COLUMN, e.g. cifar224/si_blurry/coda/ours/5e-3",
    )
    parser.add_argument(
        "--table",
        action="append",
        default=[],
        help=f"every cell of a paper table: {', '.join(COMPARED_TABLES)} (repeatable)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/reproduce"),
        help="folder for configs, results and vs_paper.md",
    )
    parser.add_argument(
        "--exps",
        type=Path,
        default=Path("exps"),
        help="folder of the paper configs (default: exps)",
    )
    parser.add_argument(
        "--best-hp",
        choices=BEST_HP_POLICIES,
        default="tables",
        help="Best HP LR: 'tables' (default) the LR the paper's Best HP numbers came from, "
        "where hp_grid's bold LR cannot be it (L2P: 5e-3); 'hp_grid' always the bold LR",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (smoke runs: dataset, seed, batch_size...); "
        "the keys that define the cell cannot change",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the configs, list the runs and their estimated GPU time; writes nothing",
    )
    parser.add_argument(
        "--tflops", type=float, help="sustained TFLOP/s for the FLOP model's estimate"
    )
    parser.add_argument("--pilot-root", help="patched PILOT checkout (default: $PILOT_ROOT, .)")
    add_engine_arguments(parser)


def plan(
    args: argparse.Namespace,
) -> tuple[list[CellSpec], dict[CellSpec, tuple[PlannedConfigs, str]]]:
    """The cells to run and their checked configs; nothing is written."""
    cells: list[CellSpec] = []
    for table in args.table:
        cells += table_cells(table)
    cells += [parse_cell(c) for c in args.cells]
    if not cells:
        raise ConfigError(
            "name cells (e.g. cifar224/si_blurry/coda/ours/5e-3) or --table "
            + "|".join(COMPARED_TABLES)
        )
    cells = list(dict.fromkeys(cells))  # a cell in two tables (the ablation's base rows) runs once
    sets = parse_sets(args.set)
    fixed = sorted(set(sets) & set(CELL_KEYS))
    if fixed:
        raise ConfigError(
            f"--set {', '.join(fixed)}: that changes which cell runs; name another cell instead"
        )
    out = args.out.resolve()
    configs = {cell: cell_configs(cell, args.exps, out, sets, args.best_hp) for cell in cells}
    return cells, configs


def dry_run_listing(cells, configs, tflops: float | None) -> tuple[list[str], float, int]:
    """Lines listing each cell's runs and estimates (ideal and calibrated, for all its seeds),
    the total ideal seconds of the runs the FLOP model prices, and the total of training batch
    passes (steps x passes per step, over every run). The footer says what each figure assumes:
    an ideal figure is a floor, 50-70x below the paper's measured times."""
    from ..core.progress import duration
    from .estimate import IDEAL_ASSUMES, calibration

    estimate, what = estimator(tflops)
    fit = calibration()
    lines, total_seconds, total_steps = [], 0.0, 0
    total_calibrated = 0.0
    priced, unpriced, reasons = 0, 0, {}
    for cell in cells:
        planned, why = configs[cell]
        config = next(iter(planned.values()))
        seeds = len(planned)
        counted = step_count(config)
        text = f"{cell.text:<42} {plural(seeds, 'run'):>7}  LR {config['init_lr']:g} ({why})"
        paper = _paper_cell(cell)
        if paper is not None:
            text += f"  paper {paper.mean:.2f} ± {paper.std:.2f} (n={paper.n})"
        try:  # the seeds' configs differ only in the seed, which costs nothing
            seconds = float(estimate(config)) * seeds
            calibrated = float(estimate_run_seconds(config, sustained_tflops=fit.tflops)) * seeds
            total_seconds += seconds
            total_calibrated += calibrated
            priced += seeds
            text += f"  est. {duration(seconds)} ideal / {duration(calibrated)} calibrated"
        except Exception as err:  # the FLOP model cannot price this config: say why once
            unpriced += seeds
            reason = str(err).replace(str(config.get("model_name")), "<method>")
            reasons.setdefault(f"{type(err).__name__}: {reason}", []).append(cell.method)
            text += "  no estimate"
        text += realtime_note(config)
        if counted is not None:
            steps, passes = counted
            total_steps += round(steps * passes) * seeds
            text += f"  {steps:,} steps x {passes:g} batch passes/run"
        lines.append(text)
    ideal = IDEAL_ASSUMES if tflops is None else f"{tflops:g} TFLOP/s sustained"
    lines.append(
        f"estimate: {what}, for all the seeds of a cell (each run gives AP, the paper's metric, "
        "and A_T); ideal: " + ideal + ", a floor, not a prediction (it runs 50-70x below the "
        f"paper's measured times); calibrated: {fit.assumes()}"
    )
    if priced:
        lines.append(
            f"the priced runs: {duration(total_seconds)} ideal, "
            f"{duration(total_calibrated)} calibrated"
        )
    lines.append(f"the FLOP model prices {priced} of {plural(priced + unpriced, 'run')}")
    first_configs = (next(iter(configs[cell][0].values())) for cell in cells)
    if any(config.get("realtime") is not None for config in first_configs):
        lines.append(
            "real-time runs (realtime): their steps are the ceil(B / C) of the stream's B batches "
            "the schedule trains, and their estimates add A_online's scoring pass on every "
            "stream image (docs/protocol.md)"
        )
    for reason, methods in reasons.items():
        lines.append(f"no estimate for {', '.join(dict.fromkeys(methods))}: {reason}")
    return lines, total_seconds, total_steps


def run_reproduce(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(line, flush=True)

    cells, configs = plan(args)
    out = args.out.resolve()
    runs = sum(len(planned) for planned, _ in configs.values())
    where = (
        f"nothing written (a run writes its configs to {out / 'configs'})"
        if args.dry_run
        else f"configs in {out / 'configs'}"
    )
    say(f"reproduce: {plural(len(cells), 'cell')}, {plural(runs, 'run')} (one per seed); {where}")
    for note in best_hp_discrepancies():
        if any(c.column == BEST and _methods()[c.method] == note.split(":")[0] for c in cells):
            say(f"note: {note}")
    if args.dry_run:
        lines, seconds, steps = dry_run_listing(cells, configs, args.tflops)
        for line in lines:
            say(line)
        total = f"total: {plural(runs, 'run')}, {steps:,} training batch passes"
        if seconds:
            total += f", at least {_duration(seconds)} of GPU compute for the priced runs (ideal)"
        say(total)
        return 0
    paths = [path for planned, _ in configs.values() for path in write_configs(planned)]
    todo = [path for path in paths if not run_finished(path)]
    say(f"{plural(runs - len(todo), 'run')} already finished, {len(todo)} to run")
    failed: list[str] = []
    if todo:
        try:
            failed = run_config_files(todo, out, args, say)
        except EngineUnavailable as err:
            print(f"pilot-online reproduce: {err}", file=sys.stderr)
            return 2
    report_text = vs_paper_for(cells, out, parse_sets(args.set))
    print(report_text)
    if failed:
        print(f"{plural(len(failed), 'run')} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def vs_paper_for(cells: list[CellSpec], out: Path, sets: dict[str, Any]) -> str:
    """The ``--vs-paper`` comparison of ``cells`` from the results under ``out``; results of a
    run whose dataset a ``--set`` replaced (a smoke run) are compared as their cell, with a
    note saying so."""
    from .tables import (
        build_tables,
        compare_with_paper,
        load_rows,
        vs_paper_markdown,
        write_vs_paper,
    )

    results = out / "results"
    if not results.is_dir():
        return "no results yet under " + str(results)
    by_name = {cell.name: cell for cell in cells}
    runs = []
    for run in load_rows([results]):
        name = Path(run["file"]).name.split("__seed-")[0]
        cell = by_name.get(name)
        if cell is None:
            continue
        run["dataset"] = cell.dataset  # a --set dataset=... smoke run stands for its cell
        runs.append(run)
    report = compare_with_paper(build_tables(runs), only={c.key() for c in cells})
    if sets:
        overrides = ", ".join(f"{k}={v}" for k, v in sets.items())
        report.notes.insert(
            0,
            f"These runs override the paper's configs ({overrides}): the comparison checks the "
            "plumbing, not the paper's numbers.",
        )
    write_vs_paper(report, out, ("md", "tex"))
    return vs_paper_markdown(report)

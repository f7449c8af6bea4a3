"""The paper's protocol as sweeps: the VTAB search (``sweep --preset hp_grid``), the choice of
each method's Best HP (``pilot-online best``) and its transfer (``sweep --hp-from best.json``).

Base configs: ``--config`` may name one file, or a template with ``{method}`` (e.g.
``exps/{method}_online_base.json``, the preset's default) filled once per method of ``--methods``
(short names: coda, l2p, ...). Each method's grid points get names, results prefixes and config
files starting with ``<method>__`` so that methods sharing a backbone never share a file name.
Order of application: the method's base config, then the preset's search settings (VTAB, clear,
5 classes per task) or the Best HP, then ``--set KEY=VALUE`` overrides, then the grid point.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from ..core.fgh_options import validate_options
from ..core.files import write_atomic
from ..core.results import find_results, load_results
from ..engine.config import HP_COLUMNS, PAPER_FGH, ConfigError, load_json, variant_of
from .points import apply_point, build_configs, parse_grid, parse_sets
from .protocol import (
    HP_GRID,
    HP_ROWS,
    HP_SEARCH_SETTINGS,
    SELECTION_RULE,
    hp_grid_points,
    method_short_name,
    select_best,
)

PRESETS = ("hp_grid",)
DEFAULT_PRESET_CONFIG = "exps/{method}_online_base.json"
#: ``hp_column`` value of the runs that fill the tables' "Best HP" column.
BEST_COLUMN = HP_COLUMNS[1]


def _methods(args: argparse.Namespace, default: list[str]) -> list[str]:
    names = [m.strip() for m in (args.methods or "").split(",") if m.strip()] or default
    return [method_short_name(m) for m in names]


def method_config(template: str, method: str) -> dict[str, Any]:
    """The base config of ``method``: ``template`` with ``{method}`` filled in."""
    path = Path(template.format(method=method))
    if not path.is_file():
        raise ConfigError(
            f"{path}: no base config for method {method!r} (from --config {template!r}); "
            "run from the repository root or pass --config with a {method} template"
        )
    config = load_json(path)
    if method_short_name(config.get("model_name", "")) != method:
        raise ConfigError(f"{path} is a config of {config.get('model_name')!r}, not {method!r}")
    return config


def uses_protocol(args: argparse.Namespace) -> bool:
    """Whether ``sweep`` goes through this module (a Namespace built without the protocol's
    options, as by older callers, is an ordinary sweep)."""
    for name, default in (("preset", None), ("hp_from", None), ("methods", None), ("set", [])):
        if not hasattr(args, name):
            setattr(args, name, default)
    return bool(args.preset or args.hp_from or "{method}" in str(args.config or ""))


def protocol_configs(args: argparse.Namespace, out: Path) -> list[Path]:
    """Write and validate the configs of a preset, an ``--hp-from`` run or a per-method sweep."""
    if args.preset and args.hp_from:
        raise ConfigError("--preset and --hp-from are separate steps: use one of them")
    grid = parse_grid(args.grid)
    sets = parse_sets(args.set)
    if args.preset:
        return preset_configs(args.preset, args, grid, sets, out)
    if args.hp_from:
        return hp_from_configs(Path(args.hp_from), args, grid, sets, out)
    template = str(args.config)
    if not args.methods:
        raise ConfigError(f"--config {template!r} is a template: name the methods with --methods")
    paths: list[Path] = []
    for method in _methods(args, []):
        base = apply_point(method_config(template, method), sets)
        paths += build_configs(base, grid, out, name_prefix=method)
    return paths


def preset_configs(
    preset: str,
    args: argparse.Namespace,
    grid: dict[str, list[Any]],
    sets: dict[str, Any],
    out: Path,
) -> list[Path]:
    """``hp_grid``: each method's row of the hp_grid table, on VTAB clear, 5 classes per task.

    ``--grid init_lr=...`` / ``--grid fgh.gamma=...`` replace the table's values (smoke runs;
    the result is then not the paper's search); other ``--grid`` axes are added."""
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r}: choose one of {', '.join(PRESETS)}")
    template = str(args.config or DEFAULT_PRESET_CONFIG)
    lrs, gammas = grid.pop("init_lr", None), grid.pop("fgh.gamma", None)
    if "variant" in grid:
        raise ConfigError(
            "--preset hp_grid sets the rows itself (base, + P + FGH): drop --grid variant"
        )
    if lrs or gammas:
        print("note: --grid init_lr / fgh.gamma replace the hp_grid table's values")
    paths: list[Path] = []
    for method in _methods(args, list(HP_GRID)):
        base = apply_point(method_config(template, method), {**HP_SEARCH_SETTINGS, **sets})
        for point in hp_grid_points(method, lrs, gammas):
            paths += build_configs(
                apply_point(base, point),
                grid,
                out,
                name_prefix=f"{method}__" + "__".join(f"{k}-{v}" for k, v in point.items()),
            )
    return paths


def load_best(path: Path) -> dict[str, Any]:
    try:
        best = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"--hp-from {path}: not a readable best.json ({err})") from err
    if not isinstance(best, dict) or not isinstance(best.get("methods"), dict):
        raise ConfigError(f"--hp-from {path}: no 'methods' object; write it with pilot-online best")
    return best


def hp_from_configs(
    path: Path,
    args: argparse.Namespace,
    grid: dict[str, list[Any]],
    sets: dict[str, Any],
    out: Path,
) -> list[Path]:
    """The "Best HP" column: each method's chosen LR (and gamma for + ours), tagged
    ``hp_column: "best"``, over the ``--grid`` axes (dataset, stream)."""
    best = load_best(path)["methods"]
    clash = {"init_lr", "variant", "fgh.gamma"} & set(grid)
    if clash:
        raise ConfigError(
            f"--hp-from sets {', '.join(sorted(clash))} itself: drop those --grid axes"
        )
    template = str(args.config or "exps/{method}_online_base.json")
    paths: list[Path] = []
    for method in _methods(args, list(best)):
        if method not in best:
            raise ConfigError(f"{path} has no choice for {method!r} (it has {', '.join(best)})")
        base = method_config(template, method) if "{method}" in template else load_json(template)
        for row, choice in best[method].items():
            point: dict[str, Any] = {"variant": HP_ROWS[row], "init_lr": choice["init_lr"]}
            if choice.get("fgh.gamma") is not None:
                point["fgh.gamma"] = choice["fgh.gamma"]
            config = apply_point(base, point)
            config["hp_column"] = BEST_COLUMN
            config = apply_point(config, sets)
            paths += build_configs(config, grid, out, name_prefix=f"{method}__best-{row}")
    return paths


def _run_row(config: dict[str, Any]) -> str | None:
    """``base``, ``ours`` (+ P + FGH), or None for the ablation-only rows."""
    return {HP_ROWS[row]: row for row in ("base", "ours")}.get(variant_of(config))


def _gamma(config: dict[str, Any]) -> float | None:
    """The run's FGH gamma (a direction's default when the config leaves it out)."""
    fgh = config.get("fgh")
    return None if fgh is None else float(validate_options(**fgh)["gamma"])


def choose_best(paths: list[Path]) -> dict[str, Any]:
    """Read every results file under ``paths`` and apply ``SELECTION_RULE`` per method and row."""
    grid: dict[str, dict[str, dict[tuple, dict[int, float | None]]]] = {}
    settings: set[tuple] = set()
    for file in find_results(paths):
        results = load_results(file)
        config = results["config"]
        row = _run_row(config)
        if row is None:
            continue
        settings.add((config.get("dataset"), config.get("stream")))
        method = method_short_name(config.get("model_name", ""))
        key = (float(config["init_lr"]), _gamma(config) if row == "ours" else None)
        ap = results["metrics"].get("AP")
        ap = ap if ap is not None and math.isfinite(ap) else None
        grid.setdefault(method, {}).setdefault(row, {}).setdefault(key, {})[config.get("seed")] = ap
    if not grid:
        raise ConfigError(
            "no results files (base or + P + FGH rows) under " + ", ".join(map(str, paths))
        )
    methods: dict[str, Any] = {}
    for method in sorted(grid, key=lambda m: list(HP_GRID).index(m) if m in HP_GRID else 99):
        for row in ("base", "ours"):
            if row not in grid[method]:
                continue
            points = [
                {"init_lr": lr, "gamma": gamma, "ap": aps}
                for (lr, gamma), aps in sorted(grid[method][row].items(), key=str)
            ]
            chosen = select_best(points)
            entry = {"init_lr": chosen["init_lr"]}
            if row == "ours":
                entry["fgh.gamma"] = chosen["gamma"]
            entry.update(
                AP_mean=chosen["AP_mean"],
                AP_std=chosen["AP_std"],
                seeds=chosen["seeds"],
                fewer_seeds=chosen["fewer_seeds"],
                grid=chosen["grid"],
            )
            methods.setdefault(method, {})[row] = entry
        rows = methods.get(method, {})
        if (
            "base" in rows
            and "ours" not in rows
            and method in HP_GRID
            and not HP_GRID[method].gammas
        ):
            rows["ours"] = derived_ours(rows["base"])
    return {
        "selection_rule": SELECTION_RULE,
        "search": [{"dataset": d, "stream": s} for d, s in sorted(settings, key=str)],
        "sources": [str(p) for p in paths],
        "methods": methods,
    }


def derived_ours(base: dict[str, Any]) -> dict[str, Any]:
    """+ ours of a method whose hp_grid row has no gamma (N/A): the base row's learning rate with
    the paper's gamma, unsearched (``SELECTION_RULE``)."""
    return {
        "init_lr": base["init_lr"],
        "fgh.gamma": PAPER_FGH["gamma"],
        "derived_from": "base",
        "AP_mean": None,
        "AP_std": None,
        "seeds": [],
        "fewer_seeds": False,
        "grid": [],
    }


def best_markdown(best: dict[str, Any]) -> str:
    lines = [
        "# Best HP (pilot-online best)",
        "",
        f"Selection rule: {best['selection_rule']}",
        "",
        "Search: " + ", ".join(f"{s['dataset']} / {s['stream']}" for s in best["search"]),
        "",
        "| method | row | LR | gamma | AP (mean ± std) | seeds | grid points |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method, rows in best["methods"].items():
        for row, e in rows.items():
            flag = " † fewer seeds" if e["fewer_seeds"] else ""
            gamma = e.get("fgh.gamma")
            ap = (
                f"not searched (the {e['derived_from']} row's LR)"
                if e.get("derived_from")
                else f"{e['AP_mean']:.2f} ± {e['AP_std']:.2f}{flag}"
            )
            lines.append(
                f"| {method} | {row} | {e['init_lr']:g} | {'—' if gamma is None else f'{gamma:g}'} "
                f"| {ap} | {len(e['seeds'])} | {len(e['grid'])} |"
            )
    flagged = [
        f"{m} {r} LR {p['init_lr']:g}"
        + (f" gamma {p['gamma']:g}" if p["gamma"] is not None else "")
        for m, rows in best["methods"].items()
        for r, e in rows.items()
        for p in e["grid"]
        if p["fewer_seeds"]
    ]
    if flagged:
        lines += ["", "Grid points with fewer seeds than the others: " + "; ".join(flagged)]
    return "\n".join(lines) + "\n"


def run_best(args: argparse.Namespace) -> int:
    best = choose_best(args.paths)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(best, indent=2) + "\n")
    write_atomic(out.with_suffix(".md"), best_markdown(best))
    print(best_markdown(best))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def add_best_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, help="results folders of the search")
    parser.add_argument("--out", type=Path, default=Path("best.json"), help="best.json to write")

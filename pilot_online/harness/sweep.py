"""``pilot-online sweep``: a grid of runs from one config, each in its own process.

The paper's tables are grids: methods x {base, + P, + FGH, + P + FGH} x {clear, Si-Blurry} x
learning rates (x gamma). A sweep writes one derived config per grid point (so every run can be
re-run alone), runs each through PILOT's trainer in a fresh process (PILOT configures logging
once per process) on an engine (``engines.py``: a local pool, or a Ray cluster), runs a failed run
again, keeps going when one still fails, and prints the report table. A sweep started again skips
the runs that finished.

    pilot-online sweep --config exps/coda_online_fgh.json --grid variant=base,p,fgh_only,fgh \\
        --grid stream=clear,si_blurry --grid init_lr=5e-5,5e-3 --out runs/coda_table
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..core.progress import plural
from ..core.results import load_results, results_path
from ..engine.config import (
    ConfigError,
    load_json,
    resolve_config,
)
from .engines import (
    EngineUnavailable,
    Job,
    add_engine_arguments,
    create_engine,
    engine_options,
    run_jobs,
)
from .points import apply_point, build_configs, parse_grid, parse_sets


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="the base config, or a template with {method} filled per --methods "
        "(e.g. 'exps/{method}_online_base.json')",
    )
    parser.add_argument("--methods", help="comma-separated methods for a {method} template")
    parser.add_argument(
        "--preset",
        help="hp_grid: the paper's VTAB search (hp_grid table) for each of --methods "
        "(default: every method of the table; --config default exps/{method}_online_base.json)",
    )
    parser.add_argument(
        "--hp-from",
        metavar="BEST_JSON",
        help="run each method's Best HP from `pilot-online best` (tagged hp_column: best)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a base-config key (JSON value; repeatable), e.g. seed=[1993,1994]",
    )
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a grid axis (repeatable); variant=base,p,fgh_only,fgh expands to "
        "the paper's ablation rows; fgh.gamma=... sets FGH options; seed=... one run per seed",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for configs and results")
    parser.add_argument("--pilot-root", help="patched PILOT checkout (default: $PILOT_ROOT, .)")
    parser.add_argument("--dry-run", action="store_true", help="write and check configs only")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="set checkpoint_every=N (stream batches) in every run's config; by default each "
        'run checkpoints as its config says ("auto": task ends and every 10 minutes), so a '
        "retried or rerun run resumes",
    )
    add_engine_arguments(parser)


def run_finished(config_path: Path) -> bool:
    """Whether every seed of a run left a complete results file (a restarted sweep skips it)."""
    config = resolve_config(load_json(config_path))
    seeds = config["seed"] if isinstance(config["seed"], list) else [config["seed"]]
    for seed in seeds:
        path = results_path(config["results_dir"], config["prefix"], seed, config["backbone_type"])
        try:
            if load_results(path)["status"] != "complete":
                return False
        except (OSError, ValueError):
            return False
    return True


def run_sweep(args: argparse.Namespace) -> int:
    from .presets import protocol_configs, uses_protocol
    from .report import collect, format_table

    def say(line: str) -> None:
        print(line, flush=True)

    out = args.out.resolve()  # each run's process works in ``out``: hand it absolute paths
    if getattr(args, "checkpoint_every", None) is not None:  # a retried run then resumes
        sets = [*(getattr(args, "set", None) or []), f"checkpoint_every={args.checkpoint_every}"]
        args = argparse.Namespace(**{**vars(args), "set": sets})
    if uses_protocol(args):
        paths = protocol_configs(args, out)
    elif not args.config:
        raise ConfigError("sweep needs --config (or --preset / --hp-from)")
    else:
        base = apply_point(load_json(args.config), parse_sets(getattr(args, "set", None) or []))
        paths = build_configs(base, parse_grid(args.grid), out)
    print(f"{plural(len(paths), 'run')}; configs in {out / 'configs'}")
    todo = []
    for i, path in enumerate(paths, 1):
        finished = run_finished(path)
        print(f"[{i}/{len(paths)}] {path.stem}" + (": skipped (finished)" if finished else ""))
        if not finished:
            todo.append(path)
    failed: list[str] = []
    if todo and not args.dry_run:
        try:
            failed = run_config_files(todo, out, args, say)
        except EngineUnavailable as err:
            print(f"pilot-online sweep: {err}", file=sys.stderr)
            return 2
    if not args.dry_run and (out / "results").is_dir():
        rows = collect([out / "results"])
        if rows:
            print(format_table(rows))
    if failed:
        print(f"{plural(len(failed), 'run')} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_config_files(
    paths: list[Path], out: Path, args: argparse.Namespace, say: Callable[[str], None]
) -> list[str]:
    """Run each config as ``pilot-online run`` (one process each) on the engine the arguments
    name, with retries; the names of the runs that failed. EngineUnavailable when the engine
    cannot start."""
    options = engine_options(args)
    engine = create_engine(options, say)
    started = time.monotonic()
    command: tuple[str, ...] = ("-m", "pilot_online.cli", "run")
    pilot_root = args.pilot_root or os.environ.get("PILOT_ROOT")  # the same on every node
    if pilot_root:
        command += ("--pilot-root", str(Path(pilot_root).resolve()))
    jobs = [Job(p.stem, (*command, "--config", str(p)), out, p.with_suffix(".log")) for p in paths]
    try:
        codes = run_jobs(jobs, engine, options.retries, say)
    finally:
        engine.close()
    seconds = time.monotonic() - started
    say(f"{plural(len(jobs), 'run')} in {seconds:.0f} s on engine {options.engine}")
    return [job.name for job, code in zip(jobs, codes) if code]

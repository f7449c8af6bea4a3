"""pilot-online: online, task-free training of LAMDA-PILOT's methods, with online prototypes and
Fine-Grained Hypergradients. Commands: setup | run | sweep | best | tables | reproduce | doctor |
check-config | methods | report | figures | scale-model | demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from ..engine.config import ConfigError, key_reference, load_json, resolve_config
from ..harness.presets import add_best_arguments, run_best
from ..harness.reproduce import add_reproduce_arguments, run_reproduce
from ..harness.sweep import add_sweep_arguments, run_sweep
from ..harness.tables import add_tables_arguments, run_tables
from ..pilot import patching
from .doctor import add_doctor_arguments, run_doctor


def _cmd_run(args: argparse.Namespace) -> int:
    """``python main.py --config X`` from anywhere: logs/ and data/ stay relative to the cwd."""
    root = Path(args.pilot_root or os.environ.get("PILOT_ROOT") or ".").resolve()
    try:
        patching.ensure_patched(root)
    except patching.PatchError as err:
        print(f"pilot-online run: {err}", file=sys.stderr)
        return 2
    raw = {**load_json(args.config), **run_overrides(args)}
    config = {"config": str(args.config), **resolve_config(raw)}
    sys.path.insert(0, str(root))
    from trainer import train  # PILOT's

    train(config)
    return 0


def _device_list(text: str) -> list:
    """``--device``: ``cpu`` (or -1), ``cuda`` (the first GPU), ``cuda:N`` or ``N``, as PILOT's
    ``device`` list."""
    value = text.strip().lower()
    if value in ("cpu", "-1"):
        return [-1]
    index = value.removeprefix("cuda").removeprefix(":") or "0"
    if not index.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give cpu, cuda, cuda:N or a GPU index N")
    return [index]


def run_overrides(args: argparse.Namespace) -> dict:
    """The config keys ``run``'s flags set: every ``--set KEY=VALUE`` (a JSON value, as in
    ``sweep``), then ``--seed`` and ``--device``."""
    from ..harness.points import parse_sets

    values = parse_sets(args.set)
    if args.seed is not None:
        values["seed"] = args.seed
    if args.device is not None:
        values["device"] = args.device
    return values


def _cmd_check_config(args: argparse.Namespace) -> int:
    if args.keys:
        print(key_reference())
        return 0
    status = 0
    for path in args.configs:
        try:
            resolve_config(load_json(path))
            print(f"ok      {path}")
        except ConfigError as err:
            reason = str(err).removeprefix(f"{path}: ")  # the loader's errors name the file too
            print(f"invalid {path}: {reason}")
            status = 1
    return status


def _cmd_report(args: argparse.Namespace) -> int:
    from ..harness.figures import plot_gradient_imbalance, plot_task_gradient_trace
    from ..harness.report import collect, format_table

    rows = collect(args.paths)
    if not rows:
        print("no results files found under " + ", ".join(map(str, args.paths)), file=sys.stderr)
        return 1
    print(format_table(rows, group=not args.per_seed))
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    if args.plot:
        print(f"gradient-imbalance plot: {plot_gradient_imbalance(rows, Path(args.plot))}")
    if args.plot_trace:
        png = plot_task_gradient_trace(rows, args.trace_task - 1, Path(args.plot_trace))
        print(f"gradient trace of task {args.trace_task}: {png}")
    return 0


def _cmd_figures(args: argparse.Namespace) -> int:
    from ..harness.figures import load_runs, write_figures

    runs = load_runs(args.paths)
    if not runs:
        print("no results files found under " + ", ".join(map(str, args.paths)), file=sys.stderr)
        return 1
    written = write_figures(
        runs,
        args.out,
        which=args.which,
        trace_task=args.trace_task,
        max_steps=args.max_steps,
        gamma_metric=args.gamma_metric,
    )
    for path in written:
        print(path)
    return 0 if written else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(train_per_class=args.train_per_class, seed=args.seed, output=args.output)
    return 0


#: ``pilot-online --help``'s examples and where the documentation is.
EPILOG = """examples:
  pilot-online setup /path/to/LAMDA-PILOT                   patch a PILOT checkout
  pilot-online doctor --config exps/coda_online_fgh.json    can this machine run it?
  pilot-online run --config exps/smoke_coda_online.json     a run through PILOT's trainer
  pilot-online methods prompt                               methods: rows, triggers, keys
  pilot-online reproduce --table all_acc_blurry --dry-run   the runs and their time
  pilot-online report runs/ --per-seed                      AP / A_T of each run
  pilot-online demo                                         P + FGH without PILOT

documentation: README.md and docs/ in the pilot-online checkout (docs/methods.md: every
method and its keys; docs/protocol.md: the paper's protocol, tables and figures);
pilot-online COMMAND --help for each command's flags."""


def build_parser() -> argparse.ArgumentParser:
    from ..version import __version__

    parser = argparse.ArgumentParser(
        prog="pilot-online",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pilot-online {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at INFO level, and show a user error's traceback (also PILOT_ONLINE_TRACEBACK=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    setup = sub.add_parser("setup", help="patch a PILOT checkout (idempotent; --check, --revert)")
    patching.add_setup_arguments(setup)
    setup.set_defaults(func=patching.run_setup)

    run = sub.add_parser("run", help="run a config through PILOT's trainer, like its main.py")
    run.add_argument("--config", required=True, type=Path, help="a PILOT-style JSON config")
    run.add_argument("--pilot-root", help="patched PILOT checkout (default: $PILOT_ROOT, then .)")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (JSON value; repeatable), e.g. init_lr=0.01",
    )
    run.add_argument("--seed", type=int, nargs="+", help="the seeds to run (the config's seed)")
    run.add_argument(
        "--device", type=_device_list, help="cpu, cuda, cuda:N or N (the config's device)"
    )
    run.set_defaults(func=_cmd_run)

    sweep = sub.add_parser("sweep", help="a grid of runs (LR, variants, streams...) + table")
    add_sweep_arguments(sweep)
    sweep.set_defaults(func=run_sweep)

    best = sub.add_parser("best", help="choose each method's Best HP from an hp_grid sweep")
    add_best_arguments(best)
    best.set_defaults(func=run_best)

    tables = sub.add_parser("tables", help="the paper's tables (Markdown, LaTeX) from results")
    add_tables_arguments(tables)
    tables.set_defaults(func=run_tables)

    reproduce = sub.add_parser(
        "reproduce", help="run cells of the paper's tables (or a whole table), then --vs-paper"
    )
    add_reproduce_arguments(reproduce)
    reproduce.set_defaults(func=run_reproduce)

    doctor = sub.add_parser(
        "doctor", help="before a real run: can this machine run it (GPU, weights, data, memory)"
    )
    add_doctor_arguments(doctor)
    doctor.set_defaults(func=run_doctor)

    check = sub.add_parser("check-config", help="validate configs without PILOT")
    check.add_argument(
        "configs",
        nargs="*",
        type=Path,
        metavar="CONFIG",
        help="JSON configs to resolve as a run would: 'ok' or 'invalid' and why, per file",
    )
    check.add_argument("--keys", action="store_true", help="print the config-key reference")
    check.set_defaults(func=_cmd_check_config)

    from .methods import add_methods_arguments, run_methods

    methods = sub.add_parser(
        "methods", help="list methods: paper name, rows, default trigger, keys (filterable)"
    )
    add_methods_arguments(methods)
    methods.set_defaults(func=run_methods)

    from .port import add_configs_arguments, add_flops_arguments, run_configs, run_flops

    configs = sub.add_parser("configs", help="write a method's configs (one from outside too)")
    add_configs_arguments(configs)
    configs.set_defaults(func=run_configs)
    flops = sub.add_parser("flops", help="count a method's FLOPs per image for its card")
    add_flops_arguments(flops)
    flops.set_defaults(func=run_flops)

    report = sub.add_parser("report", help="AP / A_T table (mean ± std over seeds) from results")
    report.add_argument("paths", nargs="+", type=Path, help="results files or folders to search")
    report.add_argument("--per-seed", action="store_true", help="one row per run")
    report.add_argument("--json", action="store_true", help="also print the rows as JSON")
    report.add_argument("--plot", metavar="PNG", help="plot normalised task gradient norms G^k_n")
    report.add_argument("--plot-trace", metavar="PNG", help="plot one task's G^k over the steps")
    report.add_argument(
        "--trace-task", type=int, default=2, help="task k for --plot-trace (1-based)"
    )
    report.set_defaults(func=_cmd_report)

    from ..harness.figures import FIGURES, GAMMA_METRICS

    figures = sub.add_parser("figures", help="the paper's figures (PNG + PDF) from results files")
    figures.add_argument("paths", nargs="+", type=Path, help="results files or folders to search")
    figures.add_argument("--out", type=Path, required=True, help="folder for the figures")
    figures.add_argument(
        "--which", nargs="+", choices=FIGURES, default=list(FIGURES), help="figures to draw"
    )
    figures.add_argument(
        "--trace-task", type=int, default=2, help="task k of the single-task G^k trace (1-based)"
    )
    figures.add_argument("--max-steps", type=int, help="draw the first N steps of G^k traces")
    figures.add_argument(
        "--gamma-metric", default="AP", choices=GAMMA_METRICS, help="metric against gamma (Fig. 3)"
    )
    figures.set_defaults(func=_cmd_figures)

    from .clean import add_clean_arguments, run_clean

    clean = sub.add_parser(
        "clean", help="delete the checkpoints interrupted runs left (lists them; --dry-run)"
    )
    add_clean_arguments(clean)
    clean.set_defaults(func=run_clean)

    from ..harness.scale_model import add_scale_model_arguments, run_scale_model

    scale = sub.add_parser(
        "scale-model", help="the paper's experiments on the scale model, and docs/scale-model.md"
    )
    add_scale_model_arguments(scale)
    scale.set_defaults(func=run_scale_model)

    demo = sub.add_parser(
        "demo", help="without PILOT: Split Fashion-MNIST, the shipped ViT, base vs + P + FGH"
    )
    demo.add_argument(
        "--train-per-class",
        type=int,
        default=500,
        help="stream images per class (at most 500, the quickstart's stream)",
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="seeds the stream's order and the training (default 0)"
    )
    demo.add_argument(
        "--output",
        type=Path,
        default=Path("runs/demo"),
        help="folder for the two results files (default runs/demo)",
    )
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # A user error (config, dataset, checkpoint, patch) ends in its line alone, before any work
    # where it can; --verbose or PILOT_ONLINE_TRACEBACK=1 keeps the traceback.
    from ..pilot.errors import show_tracebacks, user_error_line

    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as err:
        line = None if show_tracebacks(args.verbose) else user_error_line(err)
        if line is None:
            raise
        print(line.replace("pilot-online:", f"pilot-online {args.command}:", 1), file=sys.stderr)
        return 130 if isinstance(err, KeyboardInterrupt) else 2


if __name__ == "__main__":
    sys.exit(main())

"""pilot-online: online, task-free training of LAMDA-PILOT's methods, with online prototypes and
Fine-Grained Hypergradients. Commands: setup | run | sweep | best | tables | reproduce | doctor |
check-config | methods | configs | flops | report | figures | clean | scale-model | demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable


def _cmd_run(args: argparse.Namespace) -> int:
    """``python main.py --config X`` from anywhere: logs/ and data/ stay relative to the cwd."""
    from ..engine.config import load_json, resolve_config
    from ..pilot import patching

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

    from ..pilot.learner import show_run_summary

    show_run_summary()
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
    from ..engine.config import ConfigError, key_reference, load_json, resolve_config

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


def _setup(parser: argparse.ArgumentParser) -> None:
    from . import setup

    setup.add_setup_arguments(parser)
    parser.set_defaults(func=setup.run_setup)


def _run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="a PILOT-style JSON config")
    parser.add_argument(
        "--pilot-root", help="patched PILOT checkout (default: $PILOT_ROOT, then .)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (JSON value; repeatable), e.g. init_lr=0.01",
    )
    parser.add_argument("--seed", type=int, nargs="+", help="the seeds to run (the config's seed)")
    parser.add_argument(
        "--device", type=_device_list, help="cpu, cuda, cuda:N or N (the config's device)"
    )
    parser.set_defaults(func=_cmd_run)


def _sweep(parser: argparse.ArgumentParser) -> None:
    from ..harness.sweep import add_sweep_arguments, run_sweep

    add_sweep_arguments(parser)
    parser.set_defaults(func=run_sweep)


def _best(parser: argparse.ArgumentParser) -> None:
    from ..harness.presets import add_best_arguments, run_best

    add_best_arguments(parser)
    parser.set_defaults(func=run_best)


def _tables(parser: argparse.ArgumentParser) -> None:
    from ..harness.tables import add_tables_arguments, run_tables

    add_tables_arguments(parser)
    parser.set_defaults(func=run_tables)


def _reproduce(parser: argparse.ArgumentParser) -> None:
    from ..harness.reproduce import add_reproduce_arguments, run_reproduce

    add_reproduce_arguments(parser)
    parser.set_defaults(func=run_reproduce)


def _doctor(parser: argparse.ArgumentParser) -> None:
    from .doctor import add_doctor_arguments, run_doctor

    add_doctor_arguments(parser)
    parser.set_defaults(func=run_doctor)


def _check_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "configs",
        nargs="*",
        type=Path,
        metavar="CONFIG",
        help="JSON configs to resolve as a run would: 'ok' or 'invalid' and why, per file",
    )
    parser.add_argument("--keys", action="store_true", help="print the config-key reference")
    parser.set_defaults(func=_cmd_check_config)


def _methods(parser: argparse.ArgumentParser) -> None:
    from .methods import add_methods_arguments, run_methods

    add_methods_arguments(parser)
    parser.set_defaults(func=run_methods)


def _configs(parser: argparse.ArgumentParser) -> None:
    from .port import add_configs_arguments, run_configs

    add_configs_arguments(parser)
    parser.set_defaults(func=run_configs)


def _flops(parser: argparse.ArgumentParser) -> None:
    from .port import add_flops_arguments, run_flops

    add_flops_arguments(parser)
    parser.set_defaults(func=run_flops)


def _report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, help="results files or folders to search")
    parser.add_argument("--per-seed", action="store_true", help="one row per run")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument("--plot", metavar="PNG", help="plot normalised task gradient norms G^k_n")
    parser.add_argument("--plot-trace", metavar="PNG", help="plot one task's G^k over the steps")
    parser.add_argument(
        "--trace-task", type=int, default=2, help="task k for --plot-trace (1-based)"
    )
    parser.set_defaults(func=_cmd_report)


def _figures(parser: argparse.ArgumentParser) -> None:
    from ..harness.figures import FIGURES, GAMMA_METRICS

    parser.add_argument("paths", nargs="+", type=Path, help="results files or folders to search")
    parser.add_argument("--out", type=Path, required=True, help="folder for the figures")
    parser.add_argument(
        "--which", nargs="+", choices=FIGURES, default=list(FIGURES), help="figures to draw"
    )
    parser.add_argument(
        "--trace-task", type=int, default=2, help="task k of the single-task G^k trace (1-based)"
    )
    parser.add_argument("--max-steps", type=int, help="draw the first N steps of G^k traces")
    parser.add_argument(
        "--gamma-metric", default="AP", choices=GAMMA_METRICS, help="metric against gamma (Fig. 3)"
    )
    parser.set_defaults(func=_cmd_figures)


def _clean(parser: argparse.ArgumentParser) -> None:
    from .clean import add_clean_arguments, run_clean

    add_clean_arguments(parser)
    parser.set_defaults(func=run_clean)


def _scale_model(parser: argparse.ArgumentParser) -> None:
    from ..harness.scale_model import add_scale_model_arguments, run_scale_model

    add_scale_model_arguments(parser)
    parser.set_defaults(func=run_scale_model)


def _demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--train-per-class",
        type=int,
        default=500,
        help="stream images per class (at most 500, the quickstart's stream)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the stream's order and the training (default 0)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("runs/demo"),
        help="folder for the two results files (default runs/demo)",
    )
    parser.set_defaults(func=_cmd_demo)


#: Every command: its one-line help and the function that adds its flags and what it runs.
#: A command's modules are imported only when it is parsed, so ``pilot-online --help`` and the
#: light commands answer without importing torch.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "setup": ("patch a PILOT checkout (idempotent; --check, --revert)", _setup),
    "run": ("run a config through PILOT's trainer, like its main.py", _run),
    "sweep": ("a grid of runs (LR, variants, streams...) + table", _sweep),
    "best": ("choose each method's Best HP from an hp_grid sweep", _best),
    "tables": ("the paper's tables (Markdown, LaTeX) from results", _tables),
    "reproduce": (
        "run cells of the paper's tables (or a whole table), then --vs-paper",
        _reproduce,
    ),
    "doctor": ("before a real run: can this machine run it (GPU, weights, data, memory)", _doctor),
    "check-config": ("validate configs without PILOT", _check_config),
    "methods": ("list methods: paper name, rows, default trigger, keys (filterable)", _methods),
    "configs": ("write a method's configs (one from outside too)", _configs),
    "flops": ("count a method's FLOPs per image for its card", _flops),
    "report": ("AP / A_T table (mean ± std over seeds) from results", _report),
    "figures": ("the paper's figures (PNG + PDF) from results files", _figures),
    "clean": ("delete the checkpoints interrupted runs left (lists them; --dry-run)", _clean),
    "scale-model": (
        "the paper's experiments on the scale model, and docs/scale-model.md",
        _scale_model,
    ),
    "demo": ("without PILOT: Split Fashion-MNIST, the shipped ViT, base vs + P + FGH", _demo),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, every command's name and help but only that command's
    flags (the others' modules stay unimported)."""
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
    for name, (help_line, configure) in COMMANDS.items():
        command = sub.add_parser(name, help=help_line)
        if only is None or only == name:
            configure(command)
    return parser


def _command_in(argv: list[str]) -> str:
    """The command ``argv`` names (its first word that is one), or "" (``--help``, a typo)."""
    return next((word for word in argv if word in COMMANDS), "")


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    args = build_parser(only=_command_in(words)).parse_args(words)
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

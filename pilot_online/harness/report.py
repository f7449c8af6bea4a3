"""Tables from results files: the paper's AP/A_T tables (mean ± std over seeds). Its figures live
in ``figures.py``; ``report --plot`` draws Fig. 1 and 2 through it."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..core.fgh_options import validate_options
from ..core.metrics import METRIC_DEFINITIONS, PILOT_AVERAGE_NOTE
from ..core.progress import plural
from ..core.results import find_results, load_results
from ..engine.config import FGH_FORMS, PAPER_FGH

#: The options that make an FGH form (gamma aside): a label names the form, or what differs.
FORM_KEYS = ("granularity", "direction", "apply", "clamp")

METRIC_COLUMNS = ("AP", "A_T", "forgetting", "A_auc", "A_online")

#: The rule every output (report, tables, figures) states for runs set aside.
DUPLICATE_RULE = (
    "a seed run more than once with the same hyperparameters counts once, by its newest "
    "complete run"
)

RunT = TypeVar("RunT")

#: What the columns other than the metrics hold (the metrics: ``core.metrics.METRIC_DEFINITIONS``).
COLUMN_DEFINITIONS = {
    "method": "the paper's row name of the method (its registered name where the paper has none)",
    "dataset": "the dataset as PILOT names it (cifar224: CIFAR100)",
    "stream": "clear (one task after another) or si_blurry (Si-Blurry)",
    "variant": (
        "base, + P (online prototypes), + FGH, + P + FGH (the paper's + ours); FGH options "
        "and a protocol other than the paper's (real-time, online_iter) are named"
    ),
    "lr": "init_lr of the run's config",
    "runs": "seeds counted (a seed run more than once counts once: its newest complete run)",
    "seed": "the run's seed",
}


#: Characters per legend line (the table itself is as wide as its cells).
LEGEND_WIDTH = 100


def legend(group: bool = True) -> list[str]:
    """The lines under the report's table that define its columns, forgetting's formula and
    tasks included, from the same words as the metrics' code (``core.metrics``), so that a
    reader need not guess which average or which forgetting a column holds."""
    columns = ["method", "dataset", "stream", "lr", "variant", "runs" if group else "seed"]
    columns += METRIC_COLUMNS
    width = max(map(len, columns))
    definitions = {**COLUMN_DEFINITIONS, **METRIC_DEFINITIONS}
    cells = (
        "mean±std over the seeds (population std); one seed: its value; -: not recorded"
        if group
        else "each run's own value; -: not recorded"
    )
    definitions["cells"] = cells
    indent = " " * (width + 4)
    lines = ["columns (tasks numbered 1..T, accuracies in %):"]
    for name in [*columns, "cells"]:
        text = f"  {name:<{width}}  {definitions[name]}"
        lines += textwrap.wrap(text, LEGEND_WIDTH, subsequent_indent=indent, break_on_hyphens=False)
    return [*lines, f"note: {PILOT_AVERAGE_NOTE}."]


#: The paper's method rows (method cards' ``paper_name``), in its tables' order.
PAPER_ROW_ORDER = (
    "Fine-tuning",
    "Linear probe",
    "ER",
    "ER + Linear probe",
    "MVP",
    "oLoRA",
    "L2P",
    "DualPrompt",
    "CODA",
    "ConvPrompt",
)
_ROW_ORDER = {name: i for i, name in enumerate(PAPER_ROW_ORDER)}


def _registered(model_name: str | None, lookup: str):
    """The registry's ``lookup`` (``get_method`` or ``method_card``) of a method, or None for a
    results file of a method this install does not register."""
    from ..engine import registry

    try:
        return getattr(registry, lookup)(str(model_name))
    except ValueError:
        return None


def method_label(model_name: str | None) -> str | None:
    """The paper's row name of a method (its card's ``paper_name``), else its registered name."""
    card = _registered(model_name, "method_card")
    return (card.paper_name if card else "") or model_name


def _memory_based(model_name: str | None) -> bool:
    adapter = _registered(model_name, "get_method")
    return bool(adapter and adapter.replay is not None)


def variant_label(config: dict[str, Any]) -> str:
    """The paper's variant names: base, + P, + FGH, + P + FGH (with non-default FGH options shown;
    + ER where replay was added to a memory-free row)."""
    parts = []
    if (config.get("er_memory_size") or 0) > 0 and not _memory_based(config.get("model_name")):
        parts.append("ER")  # replay added to a memory-free row (allow_memory)
    if config.get("online_prototypes"):
        parts.append("P")
    fgh = config.get("fgh")
    if fgh is not None:  # {} is FGH with its defaults (build_loop enables it), not "base"
        parts.append(fgh_label(fgh))
    label = "base" if not parts else "+ " + " + ".join(parts)
    protocol = protocol_label(config)
    return f"{label}, {protocol}" if protocol else label


def protocol_of(config: dict[str, Any]) -> tuple | None:
    """What makes a run another protocol than the paper's (docs/protocol.md): real-time mode
    (``realtime`` and its reference) or more than one optimiser step per batch
    (``online_iter``); None for the paper's protocol. Such runs never fill the paper's tables."""
    realtime = config.get("realtime")
    steps = int(config.get("online_iter") or 1)
    if realtime is None and steps == 1:
        return None
    reference = config.get("realtime_reference") if realtime is not None else None
    return (realtime, reference, steps)


def protocol_label(config: dict[str, Any]) -> str:
    """``real-time (flops)``, ``online_iter 3``, both, or "" for the paper's protocol."""
    protocol = protocol_of(config)
    if protocol is None:
        return ""
    realtime, _, steps = protocol
    parts = (
        []
        if realtime is None
        else [f"real-time ({realtime if isinstance(realtime, str) else f'C={realtime:g}'})"]
    )
    if steps > 1:
        parts.append(f"online_iter {steps}")
    return ", ".join(parts)


def fgh_label(fgh: dict[str, Any]) -> str:
    """``FGH`` for the paper's form (``engine.config.PAPER_FGH``), ``FGH(eq8)`` for another
    named form (``FGH_FORMS``), else ``FGH(k=v, ...)`` with the options that differ from the
    paper's; `` γ=...`` when gamma differs from the form's."""
    resolved = validate_options(**fgh)  # gamma: the direction's default when left out
    paper = validate_options(**PAPER_FGH)
    forms = {name: validate_options(**form) for name, form in FGH_FORMS.items()}
    name = next((n for n, f in forms.items() if all(resolved[k] == f[k] for k in FORM_KEYS)), None)
    if name is not None:
        reference = forms[name]
        text = "FGH" if all(reference[k] == paper[k] for k in FORM_KEYS) else f"FGH({name})"
    else:
        reference = paper
        options = [
            f"{k}={list(resolved[k]) if k == 'clamp' else resolved[k]}"
            for k in FORM_KEYS
            if resolved[k] != paper[k]
        ]
        text = f"FGH({', '.join(options)})"
    if resolved["gamma"] != reference["gamma"]:
        text += f" γ={resolved['gamma']:g}"
    return text


def hyperparameters(config: dict[str, Any]) -> tuple:
    """What tells two runs of one configuration apart besides the seed: LR and the resolved FGH
    options (``foreach`` aside, which changes no number), and the protocol where it is not the
    paper's (:func:`protocol_of`: real-time mode, ``online_iter``)."""
    lr = config.get("init_lr")
    fgh = config.get("fgh")
    options = None
    if fgh is not None:
        resolved = validate_options(**fgh)
        options = tuple((k, resolved[k]) for k in sorted(resolved) if k != "foreach")
    protocol = protocol_of(config)
    hp = (float(lr) if lr is not None else None, options)
    return hp if protocol is None else (*hp, protocol)


def one_run_per_seed(
    runs: Sequence[RunT],
    identity: Callable[[RunT], tuple],
    recency: Callable[[RunT], tuple],
) -> tuple[list[RunT], list[RunT]]:
    """The one rule by which ``report``, ``tables`` and the figures count runs: of the runs with
    the same ``identity`` (configuration, seed and :func:`hyperparameters`), the newest complete
    one (largest ``recency``: ``created_utc``, then the file name) counts; the others are set
    aside. Returns ``(kept, set_aside)``, each in the input's order."""
    newest: dict[tuple, RunT] = {}
    for run in runs:
        key = identity(run)
        if key not in newest or recency(run) > recency(newest[key]):
            newest[key] = run
    kept = [r for r in runs if newest[identity(r)] is r]
    return kept, [r for r in runs if newest[identity(r)] is not r]


def duplicates_note(set_aside: Sequence[str]) -> str:
    """The note for runs set aside (their files), as every output words it."""
    files = ", ".join(Path(f).name for f in set_aside)
    return f"{plural(len(set_aside), 'run')} set aside ({files}): {DUPLICATE_RULE}."


def collect(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """One row per complete results file found in ``paths`` (files or folders, searched deeply)."""
    rows = []
    for file in find_results(paths):
        results = load_results(file)
        config, metrics = results["config"], results["metrics"]
        imbalance = results["extra"].get("gradient_imbalance", {})
        rows.append(
            {
                "file": str(file),
                "method": method_label(config.get("model_name")),
                "dataset": config.get("dataset"),
                "stream": config.get("stream"),
                "lr": config.get("init_lr"),
                "variant": variant_label(config),
                "seed": config.get("seed"),
                "hp": hyperparameters(config),
                "created": str(results.get("created_utc") or ""),
                **{m: metrics.get(m) for m in METRIC_COLUMNS},
                "G_n": imbalance.get("task_grad_norm_normalized"),
                "trace": file.parent / imbalance["trace_file"]
                if imbalance.get("trace_file")
                else None,
                "task_classes": [t["new_classes"] for t in results["stream"]["tasks"]],
            }
        )
    return rows


def _group_key(row: dict[str, Any]) -> tuple:
    return (row["method"], row["dataset"], row["stream"], row["lr"], row["variant"])


def _sort_key(key: tuple) -> tuple:
    """The paper's row order first (baselines, then the prompt methods), then the other fields."""
    return (_ROW_ORDER.get(key[0], len(_ROW_ORDER)), *map(str, key))


def _mean_std(values: list[Any]) -> str:
    finite = [v for v in values if v is not None and np.isfinite(v)]
    if not finite:
        return "-"
    if len(finite) == 1:
        return f"{finite[0]:.2f}"
    return f"{np.mean(finite):.2f}±{np.std(finite):.2f}"


def _identity(row: dict[str, Any]) -> tuple:
    return (*_group_key(row), row["seed"], row["hp"])


def _recency(row: dict[str, Any]) -> tuple:
    return (row["created"], row["file"])


def counted_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(kept, set_aside)`` of ``collect``'s rows by :func:`one_run_per_seed`."""
    return one_run_per_seed(rows, _identity, _recency)


def _run_name(row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The results file, as short as still tells it from the others: its name, else the path."""
    name = Path(row["file"]).name
    same = sum(Path(r["file"]).name == name for r in rows)
    return name if same == 1 else row["file"]


def format_table(rows: list[dict[str, Any]], group: bool = True) -> str:
    """A fixed-width table; with ``group``, mean±std over the seeds of each configuration, a
    repeated seed counted once (:func:`one_run_per_seed`), and a note naming the runs set aside;
    without, one row per run with its results file, the set-aside ones marked."""
    kept, set_aside = counted_rows(rows)
    header = ["method", "dataset", "stream", "lr", "variant", "runs", *METRIC_COLUMNS]
    lines = []
    if group:
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for row in kept:
            groups.setdefault(_group_key(row), []).append(row)
        for key, members in sorted(groups.items(), key=lambda kv: _sort_key(kv[0])):
            lines.append(
                (
                    *map(str, key),
                    str(len(members)),
                    *(_mean_std([m[c] for m in members]) for c in METRIC_COLUMNS),
                )
            )
    else:
        header[5] = "seed"
        header.append("results file")
        aside = {id(r) for r in set_aside}
        for row in sorted(rows, key=lambda r: (_sort_key(_group_key(r)), str(r["seed"]))):
            name = _run_name(row, rows)
            lines.append(
                (
                    *map(str, _group_key(row)),
                    str(row["seed"]),
                    *(_mean_std([row[c]]) for c in METRIC_COLUMNS),
                    f"{name} (set aside: a repeat)" if id(row) in aside else name,
                )
            )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    table = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    table += [fmt.format(*line).rstrip() for line in lines]
    table.append("")
    if set_aside:
        table.append("note: " + duplicates_note([r["file"] for r in set_aside]))
    table += legend(group)
    return "\n".join(table)

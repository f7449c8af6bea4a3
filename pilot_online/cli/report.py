"""Tables from results files: the paper's AP/A_T tables (mean ± std over seeds). Its figures live
in ``figures.py``; ``report --plot`` draws Fig. 1 and 2 through it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..core.fgh import validate_options
from ..core.results import find_results, load_results
from ..engine.config import FGH_FORMS, PAPER_FGH

#: The options that make an FGH form (gamma aside): a label names the form, or what differs.
FORM_KEYS = ("granularity", "direction", "apply", "clamp")

METRIC_COLUMNS = ("AP", "A_T", "forgetting", "A_auc")

#: The paper's method rows (adapters' ``paper_name``), in its tables' order.
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


def _adapter(model_name: str | None):
    from ..engine.registry import get_method

    try:
        return get_method(str(model_name))
    except ValueError:
        return None  # a results file of a method this install does not register


def method_label(model_name: str | None) -> str | None:
    """The paper's row name of a method (its adapter's ``paper_name``), else its registered name."""
    adapter = _adapter(model_name)
    return (adapter.paper_name if adapter else "") or model_name


def _memory_based(model_name: str | None) -> bool:
    adapter = _adapter(model_name)
    return bool(adapter and adapter.memory_based)


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
    return "base" if not parts else "+ " + " + ".join(parts)


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


def format_table(rows: list[dict[str, Any]], group: bool = True) -> str:
    """A fixed-width table; with ``group``, mean±std over seeds of each configuration."""
    header = ("method", "dataset", "stream", "lr", "variant", "runs", *METRIC_COLUMNS)
    lines = []
    if group:
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for row in rows:
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
        for row in rows:
            lines.append(
                (
                    *map(str, _group_key(row)),
                    f"seed {row['seed']}",
                    *(_mean_std([row[c]]) for c in METRIC_COLUMNS),
                )
            )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        + [fmt.format(*line) for line in lines]
    )


def _runs_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from .figures import load_runs

    return load_runs(row["file"] for row in rows)


def plot_gradient_imbalance(rows: list[dict[str, Any]], output: Path) -> Path:
    """Bars of G^k_n per task for each configuration (paper Fig. 1), averaged over seeds:
    ``output`` (PNG) and the same stem as PDF (:func:`figures.gradient_imbalance_figure`)."""
    from .figures import FigureSkipped, gradient_imbalance_figure

    try:
        data = gradient_imbalance_figure(_runs_of(rows), Path(output).with_suffix(""))
    except FigureSkipped as err:
        raise RuntimeError(str(err)) from None
    return data.paths[0]


def plot_task_gradient_trace(rows: list[dict[str, Any]], task: int, output: Path) -> Path:
    """Per-step G^k of task ``task`` (0-based) for each configuration (paper Fig. 2): ``output``
    (PNG) and the same stem as PDF (:func:`figures.gradient_trace_figure`)."""
    from .figures import FigureSkipped, gradient_trace_figure

    try:
        data = gradient_trace_figure(_runs_of(rows), Path(output).with_suffix(""), [task + 1])
    except FigureSkipped as err:
        raise RuntimeError(str(err)) from None
    return data.paths[0]

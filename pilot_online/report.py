"""Tables and plots from results files: the paper's AP/A_T tables (mean ± std over seeds) and its
gradient-imbalance figure (normalised task gradient norms G^k_n)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .results import RESULTS_SUFFIX, load_results

METRIC_COLUMNS = ("AP", "A_T", "forgetting", "A_auc")


def variant_label(config: dict[str, Any]) -> str:
    """The paper's row names: base, + P, + FGH, + P + FGH (with non-default FGH options shown)."""
    parts = []
    if config.get("online_prototypes"):
        parts.append("P")
    fgh = config.get("fgh")
    if fgh is not None:  # {} is FGH with its defaults (build_loop enables it), not "base"
        options = [
            f"{k}={v}"
            for k, v in sorted(fgh.items())
            if k in ("granularity", "direction", "apply") and v not in ("element", "grad")
        ]
        parts.append("FGH" + (f"({', '.join(options)})" if options else ""))
        if fgh.get("gamma", 1) != 1:
            parts[-1] += f" γ={fgh['gamma']}"
    return "base" if not parts else "+ " + " + ".join(parts)


def collect(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """One row per complete results file found in ``paths`` (files or folders, searched deeply)."""
    files: list[Path] = []
    for path in paths:
        path = Path(path)
        files += sorted(path.rglob(f"*{RESULTS_SUFFIX}")) if path.is_dir() else [path]
    rows = []
    for file in files:
        if ".partial" in file.name:
            continue
        results = load_results(file)
        config, metrics = results["config"], results["metrics"]
        imbalance = results["extra"].get("gradient_imbalance", {})
        rows.append(
            {
                "file": str(file),
                "method": config.get("model_name"),
                "dataset": config.get("dataset"),
                "stream": config.get("stream"),
                "lr": config.get("init_lr"),
                "variant": variant_label(config),
                "seed": config.get("seed"),
                **{m: metrics.get(m) for m in METRIC_COLUMNS},
                "G_n": imbalance.get("task_grad_norm_normalized"),
            }
        )
    return rows


def _group_key(row: dict[str, Any]) -> tuple:
    return (row["method"], row["dataset"], row["stream"], row["lr"], row["variant"])


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
        for key, members in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
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


def plot_gradient_imbalance(rows: list[dict[str, Any]], output: Path) -> Path:
    """Bars of G^k_n per task for each configuration (paper Fig. 1), averaged over seeds."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("plots need matplotlib: pip install 'pilot-online[plots]'") from err
    groups: dict[tuple, list[np.ndarray]] = {}
    for row in rows:
        if row["G_n"] is not None:
            groups.setdefault(_group_key(row), []).append(
                np.array([np.nan if v is None else v for v in row["G_n"]], dtype=float)
            )
    if not groups:
        raise RuntimeError("no results file holds gradient statistics (task_grad_norm_normalized)")
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(groups)
    for i, (key, curves) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        mean = np.nanmean(np.stack(curves), axis=0)
        tasks = np.arange(1, len(mean) + 1)
        ax.bar(tasks + (i - (len(groups) - 1) / 2) * width, mean, width, label=f"{key[0]} {key[4]}")
    ax.set_xlabel("task k")
    ax.set_ylabel("normalised gradient norm $G^k_n$")
    ax.legend(fontsize="small")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
    return output

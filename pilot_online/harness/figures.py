"""The paper's figures from results files, as PNG and PDF.

Each figure function takes loaded results dicts (one run or many) and an output path stem, works
out the plotted numbers first, draws them, writes ``<stem>.png`` and ``<stem>.pdf``, and returns
the numbers (:class:`FigureData`), so tests compare data, not pixels. Runs are grouped by
configuration (method, dataset, stream, learning rate, variant); a group's curve is the mean over
its seeds, with the standard deviation where there are several. Runs are counted by the rule
``report`` and ``tables`` use (:func:`report.one_run_per_seed`): a seed run twice with the same
hyperparameters counts once, and ``write_figures`` says which files it set aside.

Every figure's title ends with a line naming what it shows (:func:`subject_line`): dataset,
stream, LR, seeds and the number of runs. Task-wise gradient norms are written G^(k) (task k in
parentheses: not a power), defined in a caption under each gradient figure
(:data:`TRACE_CAPTION`, :data:`IMBALANCE_CAPTION`); tasks are numbered from 1. Fonts are
embedded as TrueType (``pdf.fonttype`` 42), never Type 3, which some publishers reject.

========================  ===========================================  ==========================
figure (``--which``)      what it shows                                paper
========================  ===========================================  ==========================
``imbalance``             G^k_n per task k (bars)                      Fig. 1
``trace``                 G^k over optimizer steps, one panel per      Fig. 2 (task 2), appendix
                          task, and task 2 alone                       grid (every task)
``gamma``                 AP against the FGH gamma, one panel per FGH  Fig. 3
                          form and one curve per method/variant/stream
                          (a ``fgh.gamma`` sweep); below, the fraction
                          of coefficients at the clamp's upper bound,
                          or the final mean alpha if it has none
``accuracy``              accuracy on the seen classes against         the A_auc curve
                          stream samples (periodic evaluations)        (Si-Blurry)
``heatmap``               accuracy matrix: after task l (rows), on     appendix tables
                          task k (columns)
========================  ===========================================  ==========================

Matplotlib is imported only when drawing (``pip install -e ".[plots]"``), with the Agg backend.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.fgh_options import validate_options
from ..core.metrics import task_gradient_trace
from ..core.progress import plural
from ..core.results import find_results, load_results
from ..core.streams import STREAM_KINDS
from ..engine.config import FGH_FORMS, PAPER_FGH
from .paper import DATASET_NAMES
from .report import (
    FORM_KEYS,
    duplicates_note,
    fgh_label,
    hyperparameters,
    method_label,
    one_run_per_seed,
    variant_label,
)

logger = logging.getLogger(__name__)

#: ``--which`` names, in the order ``write_figures`` draws them.
FIGURES = ("imbalance", "trace", "gamma", "accuracy", "heatmap")
#: Metrics Fig. 3 can put against gamma (``metrics`` keys of a results file).
GAMMA_METRICS = ("AP", "A_T", "A_auc", "A_avg", "A_last")
#: Output stems (file names without suffix) that ``write_figures`` uses.
STEMS = {
    "imbalance": "fig1_gradient_imbalance",
    "trace": "fig2_gradient_trace_task2",
    "trace_grid": "gradient_trace_all_tasks",
    "gamma": "fig3_gamma_sensitivity",
    "accuracy": "accuracy_over_stream",
    "heatmap": "accuracy_matrix",
}
PLOTS_HINT = 'pip install -e ".[plots]" (or pip install matplotlib)'
#: The key ``load_runs`` adds to each results dict: the file it came from (for the run rule).
RESULTS_FILE = "results_file"
#: Fonts as TrueType in PDF and PS (Type 3 fonts are refused by some publishers).
RC_PARAMS = {"pdf.fonttype": 42, "ps.fonttype": 42}
#: The legend entry of the dotted vertical guide lines.
TASK_END_LABEL = "task boundary (end of a task)"
#: G^(k) in words, as ``core.grad_norms.class_grad_norms`` and ``core.metrics`` compute it (the
#: paper's Sec. 5.1: g_t^j = grad of the loss on class j's column W^j, G^k the mean over task k's
#: classes).
TASK_NORM_WORDS = (
    "the mean, over task k's classes (those first seen in task k), of the norm of the loss "
    "gradient on each class's weights in the last (classifier) layer, bias included"
)
#: Under every gradient trace (Fig. 2 and its grid).
TRACE_CAPTION = (
    f"$G^{{(k)}}$ at an optimizer step: {TASK_NORM_WORDS}, as the optimizer receives it (after "
    "FGH's reweighting in FGH runs); paper Sec.\u00a05.1. Tasks are numbered from 1; the dotted "
    "lines are task ends."
)
#: Under Fig. 1 (``core.metrics.task_gradient_norms``).
IMBALANCE_CAPTION = (
    r"$G^{(k)}_n=G^{(k)}/\mathrm{max}_{l}\,G^{(l)}$, where $G^{(k)}$ is "
    f"{TASK_NORM_WORDS}, averaged over every optimizer step of the stream (after FGH's "
    "reweighting in FGH runs); paper Sec.\u00a05.1. Tasks are numbered from 1."
)


class FigureSkipped(RuntimeError):
    """The given results hold none of the data a figure needs; the message says what is missing."""


@dataclass
class Series:
    """One plotted curve: ``y`` (mean over ``runs`` seeds) against ``x``; ``std`` over the seeds
    (None for a single run). For the heat map, ``y`` is the matrix and ``x`` the task numbers."""

    label: str
    x: np.ndarray
    y: np.ndarray
    std: np.ndarray | None = None
    runs: int = 1


@dataclass
class FigureData:
    """What a figure shows: panels (title -> curves), markers (e.g. task ends), written files."""

    name: str
    panels: dict[str, list[Series]]
    markers: list[float] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def series(self, panel: str | None = None) -> dict[str, Series]:
        """The curves of one panel (the only one by default), by label."""
        if panel is None:
            (panel,) = self.panels
        return {s.label: s for s in self.panels[panel]}


# -- loading ---------------------------------------------------------------------------------------
def load_runs(paths: Iterable[Path | str]) -> list[dict[str, Any]]:
    """The complete results files in ``paths`` (files or folders, searched deeply), loaded.

    A file written before the per-step G^k trace was stored in the results
    (``task_grad_norm_trace``) gets it from its ``.gradtrace.npy`` sidecar, when that exists."""
    runs = []
    for file in find_results(paths):
        results = load_results(file)
        imbalance = results.get("extra", {}).get("gradient_imbalance", {})
        sidecar = file.parent / imbalance["trace_file"] if imbalance.get("trace_file") else None
        if "task_grad_norm_trace" not in imbalance and sidecar and sidecar.is_file():
            task_classes = [t["new_classes"] for t in results["stream"]["tasks"]]
            imbalance["task_grad_norm_trace"] = task_gradient_trace(np.load(sidecar), task_classes)
        results[RESULTS_FILE] = str(file)
        runs.append(results)
    return runs


# -- grouping --------------------------------------------------------------------------------------
_KEY_FIELDS = ("method", "dataset", "stream", "lr", "variant")


def _fields(results: dict[str, Any], config: dict[str, Any] | None = None) -> dict[str, Any]:
    config = results["config"] if config is None else config
    return {
        "method": method_label(config.get("model_name")),
        "dataset": config.get("dataset"),
        "stream": config.get("stream"),
        "lr": config.get("init_lr"),
        "variant": variant_label(config),
    }


def _key(fields: dict[str, Any]) -> tuple:
    return tuple(fields[name] for name in _KEY_FIELDS)


def _identity(results: dict[str, Any]) -> tuple:
    config = results["config"]
    return (_key(_fields(results)), config.get("seed"), hyperparameters(config))


def _recency(results: dict[str, Any]) -> tuple:
    return (str(results.get("created_utc") or ""), str(results.get(RESULTS_FILE) or ""))


def counted_runs(runs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The runs that count (one per configuration, seed and hyperparameters: the newest), and the
    files of those set aside, by the rule ``report`` and ``tables`` use."""
    kept, aside = one_run_per_seed(list(runs), _identity, _recency)
    return kept, [str(r.get(RESULTS_FILE) or f"seed {r['config'].get('seed')}") for r in aside]


def _group(runs: Sequence[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for results in counted_runs(runs)[0]:
        groups.setdefault(_key(_fields(results)), []).append(results)
    return dict(sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))))


def _labels(keys: Iterable[tuple]) -> dict[tuple, str]:
    """Method and variant always; dataset, stream and LR only where the groups differ in them."""
    keys = list(keys)
    varying = [
        i
        for i, name in enumerate(_KEY_FIELDS)
        if name in ("dataset", "stream", "lr") and len({k[i] for k in keys}) > 1
    ]
    labels = {}
    for key in keys:
        extra = [
            f"LR {lr_text(key[i])}"
            if _KEY_FIELDS[i] == "lr"
            else stream_name(key[i])
            if _KEY_FIELDS[i] == "stream"
            else DATASET_NAMES.get(key[i], str(key[i]))
            for i in varying
        ]
        labels[key] = ", ".join([f"{key[0]} {key[4]}", *extra])
    return labels


def _as_float(values: Any) -> np.ndarray:
    """JSON numbers (null -> NaN), nested lists included, as a float array."""
    return np.array(values, dtype=float)


def _mean_std(stack: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Mean over axis 0 ignoring NaN (all-NaN stays NaN, silently); std only for several runs."""
    finite = np.isfinite(stack)
    counts = finite.sum(axis=0)
    sums = np.where(finite, stack, 0.0).sum(axis=0)
    mean = np.divide(sums, counts, out=np.full(sums.shape, np.nan), where=counts > 0)
    if len(stack) < 2:
        return mean, None
    squares = np.where(finite, (stack - mean) ** 2, 0.0).sum(axis=0)
    std = np.sqrt(np.divide(squares, counts, out=np.full(sums.shape, np.nan), where=counts > 0))
    return mean, std


def task_end_steps(results: dict[str, Any]) -> list[float]:
    """Optimizer steps at each task end: every task's batches (``ceil(samples / batch)``)."""
    stream = results["stream"]
    batch = stream.get("params", {}).get("batch_size") or results["config"].get("batch_size")
    if not batch:
        return []
    sizes = [math.ceil(t["num_samples"] / batch) for t in stream["tasks"]]
    return [float(s) for s in np.cumsum(sizes)[:-1]]


def _task_end_samples(results: dict[str, Any]) -> list[float]:
    return [
        float(s) for s in np.cumsum([t["num_samples"] for t in results["stream"]["tasks"]])[:-1]
    ]


def _groups_having(
    runs: Sequence[dict[str, Any]], has_data: Callable[[dict[str, Any]], Any], missing: str
) -> dict[tuple, list[dict[str, Any]]]:
    """The groups of the runs for which ``has_data`` holds (groups left empty are dropped); the
    figure is skipped, saying what is ``missing``, when none is left."""
    groups = {key: [r for r in members if has_data(r)] for key, members in _group(runs).items()}
    groups = {key: members for key, members in groups.items() if members}
    if not groups:
        raise FigureSkipped(missing)
    return groups


# -- what a figure shows ---------------------------------------------------------------------------
def lr_text(lr: float | None) -> str:
    """0.005 -> "5e-3", 0.0015 -> "1.5e-3": the paper's way of writing a learning rate."""
    if lr is None:
        return "?"
    mantissa, exponent = f"{float(lr):e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def seeds_text(seeds: Iterable[Any]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5": runs of consecutive seeds as ranges."""
    numbers = sorted({s for s in seeds if isinstance(s, int)})
    others = sorted({str(s) for s in seeds if not isinstance(s, int)})
    spans: list[list[int]] = []
    for seed in numbers:
        if spans and seed == spans[-1][1] + 1:
            spans[-1][1] = seed
        else:
            spans.append([seed, seed])
    texts = [str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in spans]
    return ", ".join(texts + others)


def stream_name(kind: str | None) -> str:
    """``si_blurry`` -> "Si-Blurry", ``clear`` -> "clear" (the paper's names, as in its tables)."""
    spec = STREAM_KINDS.get(str(kind))
    return re.sub(r"\\textit\{(.*)\}", r"\1", spec.title) if spec else str(kind)


def subject_line(runs: Sequence[dict[str, Any]], curves: Sequence[int] = ()) -> str:
    """What a figure's numbers come from, for its title: dataset, stream, LR, seeds and the
    number of runs (``curves``: the runs behind each curve, when there are several curves).
    Values that differ between the runs are all listed; the legend tells the curves apart."""
    configs = [r["config"] for r in runs]
    datasets = sorted({DATASET_NAMES.get(c.get("dataset"), str(c.get("dataset"))) for c in configs})
    streams = sorted({stream_name(c.get("stream")) for c in configs})
    lrs = sorted({c.get("init_lr") for c in configs}, key=lambda lr: (lr is None, lr or 0))
    seeds = [c.get("seed") for c in configs]
    count = f"n = {plural(len(runs), 'run')}"
    if len(curves) > 1:
        low, high = min(curves), max(curves)
        count += f" ({low if low == high else f'{low}-{high}'} per curve)"
    return "; ".join(
        [
            ("dataset " if len(datasets) == 1 else "datasets ") + ", ".join(datasets),
            ", ".join(streams) + (" stream" if len(streams) == 1 else " streams"),
            ("LR " if len(lrs) == 1 else "LRs ") + ", ".join(lr_text(lr) for lr in lrs),
            ("seed " if len(set(seeds)) == 1 else "seeds ") + seeds_text(seeds),
            count,
        ]
    )


def _subject_of(groups: dict[tuple, list[dict[str, Any]]]) -> str:
    return subject_line(
        [r for members in groups.values() for r in members], [len(m) for m in groups.values()]
    )


# -- the figures' data -----------------------------------------------------------------------------
def gradient_imbalance_data(runs: Sequence[dict[str, Any]]) -> FigureData:
    """Fig. 1: G^k_n = G^k / max_l G^l per task k (``task_grad_norm_normalized``), per group."""
    groups = _groups_having(
        runs,
        lambda r: _imbalance(r).get("task_grad_norm_normalized") is not None,
        "no results file holds gradient statistics (extra.gradient_imbalance."
        "task_grad_norm_normalized)",
    )
    series = []
    for key, label in _labels(groups).items():
        curves = [_as_float(_imbalance(r)["task_grad_norm_normalized"]) for r in groups[key]]
        mean, std = _mean_std(_stack_truncated(curves))
        series.append(Series(label, np.arange(1, len(mean) + 1), mean, std, len(curves)))
    fgh = [groups[key][0]["config"].get("fgh") is not None for key in groups]
    return FigureData("imbalance", {"": series}, meta={"fgh": fgh, "subject": _subject_of(groups)})


def gradient_trace_data(
    runs: Sequence[dict[str, Any]], tasks: Sequence[int] | None = None, max_steps: int | None = None
) -> FigureData:
    """Fig. 2 and its appendix grid: G^k at each optimizer step, one panel per task k (1-based
    ``tasks``; all by default), one curve per group (mean over seeds, truncated to the shortest
    run). ``max_steps`` keeps the first steps only (the paper shows 250)."""
    groups = _groups_having(
        runs,
        lambda r: _imbalance(r).get("task_grad_norm_trace") is not None,
        "no results file holds a per-step gradient trace (extra.gradient_imbalance."
        "task_grad_norm_trace, or a .gradtrace.npy beside it): run with grad_trace true",
    )
    traces = {
        key: [_as_float(_imbalance(r)["task_grad_norm_trace"]) for r in members]
        for key, members in groups.items()
    }
    traces = {key: [t for t in ts if t.ndim == 2 and t.size] for key, ts in traces.items()}
    groups = {key: groups[key] for key, ts in traces.items() if ts}
    traces = {key: traces[key] for key in groups}
    if not traces:
        raise FigureSkipped("the gradient traces in these results are empty (no optimizer step)")
    num_tasks = max(t.shape[1] for ts in traces.values() for t in ts)
    tasks = list(range(1, num_tasks + 1)) if tasks is None else list(tasks)
    missing = [k for k in tasks if not 1 <= k <= num_tasks]
    if missing:
        raise FigureSkipped(
            f"no results file has task {missing[0]} (the runs have {num_tasks} tasks; "
            "tasks are numbered from 1)"
        )
    labels = _labels(groups)
    panels: dict[str, list[Series]] = {}
    for k in tasks:
        series = []
        for key, per_run in traces.items():
            curves = [t[:max_steps, k - 1] for t in per_run if t.shape[1] >= k]
            if not curves:
                continue
            mean, std = _mean_std(_stack_truncated(curves))
            series.append(Series(labels[key], np.arange(1, len(mean) + 1), mean, std, len(curves)))
        panels[f"task {k}"] = series
    first = next(iter(groups.values()))[0]
    limit = max_steps or math.inf
    markers = [s for s in task_end_steps(first) if s < limit]
    return FigureData("trace", panels, markers, meta={"subject": _subject_of(groups)})


#: Fig. 3 panel titles of the named FGH forms (``engine.config.FGH_FORMS``).
FORM_TITLES = {
    "appendix": "appendix algorithm: class-wise FC, Adam directions",
    "appendix_clamp10": "appendix algorithm, clamp [0, 10]",
    "eq8": "Eq. 8: element-wise, raw gradients",
}
#: Fig. 3's lower panels are keyed by one of these prefixes + the form's title: for a form whose
#: clamp has an upper bound, the fraction of coefficients at it; for one without (the paper's
#: alpha >= 0 alone), where that fraction is 0 by construction, the mean alpha at the stream's end.
CLAMP_PANEL = "at the clamp: "
ALPHA_PANEL = "alpha at the end: "
LOWER_PANELS = (CLAMP_PANEL, ALPHA_PANEL)


def fgh_form_title(fgh: dict[str, Any]) -> str:
    """The Fig. 3 panel of an FGH setting (gamma aside): its named form, the paper's marked, else
    the options that differ from the paper's form."""
    resolved = validate_options(**fgh)
    paper = validate_options(**PAPER_FGH)
    for name, form in FGH_FORMS.items():
        options = validate_options(**form)
        if all(resolved[k] == options[k] for k in FORM_KEYS):
            ours = all(options[k] == paper[k] for k in FORM_KEYS)
            return FORM_TITLES.get(name, name) + (" (paper configs)" if ours else "")
    return fgh_label({**fgh, "gamma": paper["gamma"]})


def _sweep_form(fgh: dict[str, Any]) -> dict[str, Any]:
    """A sweep's FGH without its gamma: the gamma set to its named form's (the paper's for any
    other setting), so that one sweep is one key and its label names no gamma."""
    resolved = validate_options(**fgh)
    for form in FGH_FORMS.values():
        if all(resolved[k] == validate_options(**form)[k] for k in FORM_KEYS):
            return {**fgh, "gamma": form["gamma"]}
    return {**fgh, "gamma": PAPER_FGH["gamma"]}


def _alpha_groups(results: dict[str, Any]) -> list[dict[str, Any]]:
    """``extra.diagnostics.fgh.alpha_bounds``: one entry per FGH group, [] if not recorded."""
    fgh = results.get("extra", {}).get("diagnostics", {}).get("fgh", {})
    return [g for g in fgh.get("alpha_bounds") or () if g.get("coefficients")]


def _weighted(groups: list[dict[str, Any]], values: list[float | None]) -> float | None:
    """The groups' ``values`` averaged with each group weighted by its coefficient count."""
    if not groups or any(v is None for v in values):
        return None
    count = sum(g["coefficients"] for g in groups)
    return sum(v * g["coefficients"] for v, g in zip(values, groups)) / count


def _at_upper_bound(results: dict[str, Any]) -> float | None:
    """Fraction of FGH coefficients at the clamp's upper bound, averaged over the stream's steps
    (all groups weighted by size); None if not recorded or if no group's clamp has an upper
    bound, where the fraction is 0 by construction."""
    groups = _alpha_groups(results)
    if not any(g.get("clamp", [None, None])[1] is not None for g in groups):
        return None
    return _weighted(groups, [g["stream"].get("at_hi") for g in groups])


def final_alpha(results: dict[str, Any]) -> float | None:
    """The mean FGH coefficient at the stream's end over every group (weighted by size); None if
    not recorded."""
    groups = _alpha_groups(results)
    return _weighted(groups, [g.get("final", {}).get("mean") for g in groups])


def _sweep_series(label: str, points: dict[float, list[float]]) -> Series:
    """Mean (± std over seeds, where some gamma has several) of each gamma's values."""
    gammas = sorted(points)
    stats = [_mean_std(np.array(points[g])[:, None]) for g in gammas]
    several = any(len(points[g]) > 1 for g in gammas)
    mean = np.array([m[0] for m, _ in stats])
    std = np.array([0.0 if sd is None else sd[0] for _, sd in stats]) if several else None
    return Series(label, np.array(gammas), mean, std, max(len(points[g]) for g in gammas))


def gamma_sensitivity_data(runs: Sequence[dict[str, Any]], metric: str = "AP") -> FigureData:
    """Fig. 3: ``metric`` (mean ± std over seeds) against the FGH gamma. One panel per FGH form
    (the appendix algorithm the paper configs run, the main text's Eq. 8, or other options), one
    curve per method, variant, dataset, stream and LR. The same configuration without FGH
    (gamma = 0 disables it, Sec. 5.2), when present, is a series at x = 0 in each panel. Where the
    runs recorded alpha, a panel below each form's holds, against gamma, the fraction of
    coefficients at the clamp's upper bound (stream mean; ``CLAMP_PANEL + title``) or, for a form
    with no upper bound, the mean alpha at the stream's end (``ALPHA_PANEL + title``)."""
    sweeps: dict[tuple, dict[float, list[float]]] = {}
    lower: dict[tuple, tuple[str, dict[float, list[float]]]] = {}  # key -> (prefix, points)
    title_of: dict[tuple, str] = {}
    baseline_of: dict[tuple, tuple] = {}  # sweep -> the same configuration without FGH
    baselines: dict[tuple, list[float]] = {}
    used: dict[tuple, list[dict[str, Any]]] = {}  # key -> its runs, for the subject line
    for results in counted_runs(runs)[0]:
        config = results["config"]
        value = results["metrics"].get(metric)
        value = np.nan if value is None else float(value)
        if config.get("fgh") is None:
            baselines.setdefault(_key(_fields(results)), []).append(value)
            used.setdefault(("no FGH", _key(_fields(results))), []).append(results)
            continue
        gamma = float(validate_options(**config["fgh"])["gamma"])
        fgh = _sweep_form(config["fgh"])
        key = _key(_fields(results, {**config, "fgh": fgh}))
        title_of[key] = fgh_form_title(fgh)
        sweeps.setdefault(key, {}).setdefault(gamma, []).append(value)
        used.setdefault(("FGH", key), []).append(results)
        bound = _at_upper_bound(results)
        prefix, value = (
            (CLAMP_PANEL, bound) if bound is not None else (ALPHA_PANEL, final_alpha(results))
        )
        if value is not None:
            lower.setdefault(key, (prefix, {}))[1].setdefault(gamma, []).append(value)
        baseline_of[key] = _key(_fields(results, {**config, "fgh": None}))
    sweeps = {key: points for key, points in sweeps.items() if len(points) > 1}
    if not sweeps:
        raise FigureSkipped(
            "gamma sensitivity needs FGH runs of one configuration at two or more values of "
            "fgh.gamma (e.g. pilot-online sweep --grid fgh.gamma=1e-4,1e-2,1)"
        )
    paper_title = fgh_form_title(PAPER_FGH)
    titles = sorted({title_of[key] for key in sweeps}, key=lambda t: (t != paper_title, t))
    panels: dict[str, list[Series]] = {title: [] for title in titles}
    lower_panels: dict[str, list[Series]] = {}
    for key, label in _labels(sorted(sweeps, key=lambda k: tuple(map(str, k)))).items():
        title = title_of[key]
        panels[title].append(_sweep_series(label, sweeps[key]))
        if baseline_of[key] in baselines:
            base = np.array(baselines[baseline_of[key]])
            mean_b, std_b = _mean_std(base[:, None])
            panels[title].append(
                Series(f"{label} (γ=0: no FGH)", np.zeros(1), mean_b, std_b, len(base))
            )
        if key in lower and len(lower[key][1]) > 1:
            prefix, points = lower[key]
            lower_panels.setdefault(prefix + title, []).append(_sweep_series(label, points))
    ordered = {
        **panels,
        **{
            p + t: lower_panels[p + t]
            for t in titles
            for p in LOWER_PANELS
            if p + t in lower_panels
        },
    }
    drawn = {("FGH", key): used[("FGH", key)] for key in sweeps} | {
        ("no FGH", baseline_of[key]): used[("no FGH", baseline_of[key])]
        for key in sweeps
        if baseline_of[key] in baselines
    }
    return FigureData("gamma", ordered, meta={"metric": metric, "subject": _subject_of(drawn)})


def accuracy_curve_data(runs: Sequence[dict[str, Any]]) -> FigureData:
    """Accuracy on the classes seen so far against stream samples, from the periodic
    evaluations (``eval_period``); the mean of each run's curve is its A_auc. Seeds are averaged
    at the sample counts they share."""
    groups = _groups_having(
        runs,
        lambda r: r.get("extra", {}).get("periodic_evaluations"),
        "no results file holds periodic evaluations (extra.periodic_evaluations): run with "
        "eval_period set, e.g. 1000 stream samples",
    )
    series = []
    for key, label in _labels(groups).items():
        curves = [
            {p["samples_seen"]: p["accuracy"] for p in r["extra"]["periodic_evaluations"]}
            for r in groups[key]
        ]
        shared = sorted(set.intersection(*(set(c) for c in curves)))
        stack = np.array([[np.nan if c[s] is None else c[s] for s in shared] for c in curves])
        mean, std = _mean_std(stack.reshape(len(curves), len(shared)))
        series.append(Series(label, np.array(shared, dtype=float), mean, std, len(curves)))
    first = next(iter(groups.values()))[0]
    return FigureData(
        "accuracy", {"": series}, _task_end_samples(first), meta={"subject": _subject_of(groups)}
    )


def accuracy_matrix_data(runs: Sequence[dict[str, Any]]) -> FigureData:
    """The accuracy matrix per group (mean over seeds), laid out as the heat map shows it: row l
    is the evaluation after task l, column k the accuracy on task k (a_{k,l} of the results
    file's ``acc[task][after]``); tasks not yet seen (k > l) are NaN (masked)."""
    groups = _group(runs)
    panels = {}
    drawn: dict[tuple, list[dict[str, Any]]] = {}
    for key, label in _labels(groups).items():
        matrices = [_as_float(r["metrics"]["accuracy_matrix"]).T for r in groups[key]]
        shapes = {m.shape for m in matrices}
        if len(shapes) != 1:
            raise FigureSkipped(f"{label}: runs of one configuration differ in tasks ({shapes})")
        mean, std = _mean_std(np.stack(matrices))
        if not np.isfinite(mean).any():
            continue
        tasks = np.arange(1, mean.shape[0] + 1)
        panels[label] = [Series(label, tasks, mean, std, len(matrices))]
        drawn[key] = groups[key]
    if not panels:
        raise FigureSkipped("no results file holds a measured accuracy matrix")
    return FigureData("heatmap", panels, meta={"subject": _subject_of(drawn)})


def _imbalance(results: dict[str, Any]) -> dict[str, Any]:
    return results.get("extra", {}).get("gradient_imbalance") or {}


def _stack_truncated(curves: list[np.ndarray]) -> np.ndarray:
    length = min(len(c) for c in curves)
    return np.stack([c[:length] for c in curves])


# -- drawing ---------------------------------------------------------------------------------------
def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError(f"figures need matplotlib: {PLOTS_HINT}") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def task_norm(k: int | str, normalised: bool = False) -> str:
    """Mathtext of task k's gradient norm, G^(k) (``_n`` normalised): the parentheses keep the
    task index from reading as a power ("G²")."""
    return f"$G^{{({k})}}_n$" if normalised else f"$G^{{({k})}}$"


def round_half_away(value: float) -> int:
    """62.5 -> 63 and -62.5 -> -63, as a reader rounds (``format`` rounds half to even: 62)."""
    return int(math.copysign(math.floor(abs(value) + 0.5), value))


def _describe(fig) -> dict[str, Any]:
    """What a drawn figure shows, for tests: size in inches, each visible panel's title, axis
    labels and legend entries, colorbar labels, and the figure-level legends and title."""
    panels = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        legend = ax.get_legend()
        panels.append(
            {
                "title": ax.get_title(),
                "xlabel": ax.get_xlabel(),
                "ylabel": ax.get_ylabel(),
                "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
            }
        )
    return {
        "size_inches": tuple(float(v) for v in fig.get_size_inches()),
        "panels": panels,
        "figure_legend": [t.get_text() for lg in fig.legends for t in lg.get_texts()],
        "suptitle": fig._suptitle.get_text() if fig._suptitle is not None else "",
        "captions": [t.get_text() for t in fig.texts if t is not fig._suptitle],
    }


def _caption(fig, text: str) -> None:
    """``text`` under the figure (below its axes and legends), wrapped to the figure's width;
    ``bbox_inches="tight"`` keeps it in the saved file."""
    width = max(60, int(fig.get_size_inches()[0] * 13))  # about 13 small characters an inch
    wrapped = "\n".join(textwrap.wrap(text, width, break_on_hyphens=False))
    fig.text(0.5, -0.01, wrapped, ha="center", va="top", fontsize="small")


def _heading(data: FigureData, title: str) -> str:
    """A figure's title over the line saying what it shows (:func:`subject_line`)."""
    subject = data.meta.get("subject")
    return f"{title}\n{subject}" if subject else title


def _save(fig, stem: Path, data: FigureData | None = None, tight: bool = True) -> list[Path]:
    """``<stem>.png`` and ``<stem>.pdf`` (the PDF without a creation date: reruns match; fonts
    as TrueType, :data:`RC_PARAMS`); what was drawn goes to ``data.meta["drawn"]``. ``tight``:
    lay the figure out here (False where the drawing did, around a colorbar or a legend)."""
    import matplotlib

    plt = _pyplot()
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    with matplotlib.rc_context(RC_PARAMS):
        if tight:
            fig.tight_layout()
        fig.savefig(paths[0], dpi=150, bbox_inches="tight")
        fig.savefig(paths[1], bbox_inches="tight", metadata={"CreationDate": None})
    if data is not None:
        data.meta["drawn"] = _describe(fig)
    plt.close(fig)  # else pyplot keeps every figure a long session draws
    return paths


def _grid(plt, panels: int, width: float = 4.0, height: float = 3.0, max_cols: int = 5, **kw):
    cols = min(panels, max_cols)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, **kw)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:panels])


def _run_label(s: Series) -> str:
    return s.label if s.runs == 1 else f"{s.label} ({s.runs} runs)"


def _line(ax, s: Series, **kwargs) -> None:
    (line,) = ax.plot(s.x, s.y, label=_run_label(s), **kwargs)
    if s.std is not None:
        ax.fill_between(s.x, s.y - s.std, s.y + s.std, color=line.get_color(), alpha=0.2, lw=0)


def _task_ends(ax, positions: Sequence[float]) -> None:
    """Dotted grey verticals at the task ends, named once in the legend."""
    for i, position in enumerate(positions):
        ax.axvline(position, color="grey", lw=0.6, ls=":", label=TASK_END_LABEL if i == 0 else None)


def _imbalance_title(fgh: Sequence[bool]) -> str:
    """Fig. 1's title: it speaks of FGH's reweighting only over runs that have FGH."""
    title = "Gradient imbalance of the classifier rows"
    if fgh and all(fgh):
        return title + " (after FGH's reweighting)"
    if any(fgh):
        return title + " (FGH runs: after FGH's reweighting)"
    return title


def _draw_imbalance(data: FigureData, stem: Path) -> list[Path]:
    plt = _pyplot()
    series = data.panels[""]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, s in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar(s.x + offset, s.y, width, yerr=s.std, label=_run_label(s), capsize=2)
    ax.set_xticks(series[0].x)
    ax.set_xlabel("task k")
    ax.set_ylabel(f"normalised gradient norm {task_norm('k', normalised=True)}")
    ax.set_title(_heading(data, _imbalance_title(data.meta.get("fgh", []))))
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    fig.tight_layout()
    _caption(fig, IMBALANCE_CAPTION)
    return _save(fig, stem, data, tight=False)


def _draw_trace(data: FigureData, stem: Path) -> list[Path]:
    """One panel: 8 x 4 in with its own legend. Several: at most 3 panels a row (3.4 x 2.6 in
    each, shared axes) and one legend for all of them below the grid."""
    plt = _pyplot()
    single = len(data.panels) == 1
    if single:
        fig, ax = plt.subplots(figsize=(8, 4))
        axes = [ax]
    else:
        fig, axes = _grid(plt, len(data.panels), 3.4, 2.6, max_cols=3, sharex=True, sharey=True)
    for ax, (title, series) in zip(axes, data.panels.items()):
        for s in series:
            _line(ax, s, lw=1)
        _task_ends(ax, data.markers)
        k = title.removeprefix("task ")
        ax.set_title(f"task {k}: {task_norm(k)}", fontsize="medium")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"{task_norm(k)} (gradient norm)")
    if single:
        (ax,) = axes
        ax.set_title(_heading(data, ax.get_title()), fontsize="medium")
        ax.legend(fontsize="small")
        fig.tight_layout()
        _caption(fig, TRACE_CAPTION)
        return _save(fig, stem, data, tight=False)
    fig.suptitle(_heading(data, f"{task_norm('k')} over the optimizer steps, one panel per task k"))
    handles, labels = axes[0].get_legend_handles_labels()
    free = [ax for ax in fig.axes if not ax.get_visible()]
    if free:  # the grid's empty slot holds the one legend
        slot = free[0]
        slot.set_visible(True)
        slot.axis("off")
        slot.legend(handles, labels, loc="center", fontsize="small", frameon=False)
        fig.tight_layout()
    else:
        fig.tight_layout(rect=(0, 0.03 * math.ceil(len(labels) / 2), 1, 1))
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize="small", frameon=False)
    _caption(fig, TRACE_CAPTION)
    return _save(fig, stem, data, tight=False)


def _draw_gamma(data: FigureData, stem: Path) -> list[Path]:
    """One column per FGH form: the metric against gamma on top, and below it (when recorded) the
    fraction of coefficients at the clamp's upper bound, or the final mean alpha of a form with
    no upper bound."""
    plt = _pyplot()
    metric = data.meta.get("metric", "AP")
    tops = [t for t in data.panels if not t.startswith(LOWER_PANELS)]
    lowers = {t: [p for p in LOWER_PANELS if p + t in data.panels] for t in tops}
    rows = 2 if any(lowers.values()) else 1
    fig, axes = plt.subplots(
        rows,
        len(tops),
        figsize=(6 * len(tops), 4 + 2.5 * (rows - 1)),
        squeeze=False,
        sharex="col",
    )
    for column in range(1, len(tops)):  # the forms side by side on one scale
        axes[0][column].sharey(axes[0][0])
    first_of: dict[str, Any] = {}  # lower panels of one kind share theirs
    for column, title in enumerate(tops):
        for prefix in lowers[title]:
            if prefix in first_of:
                axes[1][column].sharey(first_of[prefix])
            first_of.setdefault(prefix, axes[1][column])
    for column, title in enumerate(tops):
        ax = axes[0][column]
        for s in data.panels[title]:
            if s.x[0] == 0:  # gamma = 0 cannot sit on a log axis: a dashed level
                ax.axhline(s.y[0], ls="--", lw=1, label=_run_label(s), color="grey")
                continue
            ax.errorbar(s.x, s.y, yerr=s.std, marker="o", capsize=3, label=_run_label(s))
        ax.set_xscale("log")
        ax.set_ylabel(f"{metric} (%)")
        ax.set_title(title, fontsize="medium")
        ax.legend(fontsize="x-small")
        below = axes[1][column] if rows == 2 else None
        for prefix in lowers[title]:
            for s in data.panels[prefix + title]:
                below.errorbar(s.x, s.y, yerr=s.std, marker="s", capsize=3, label=s.label)
            below.set_xscale("log")
            if prefix == CLAMP_PANEL:
                below.set_ylim(-0.02, 1.02)
                below.set_ylabel("α at clamp's upper bound\n(fraction, stream mean)")
            else:
                below.set_yscale("log")
                below.set_ylabel("mean α at the stream's end\n(no upper bound)")
        axes[rows - 1][column].set_xlabel("FGH γ")
    fig.suptitle(_heading(data, f"Sensitivity to γ ({metric}), by FGH form"))
    return _save(fig, stem, data)


def _draw_accuracy(data: FigureData, stem: Path) -> list[Path]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for s in data.panels[""]:
        _line(ax, s, marker=".")
    _task_ends(ax, data.markers)
    ax.set_xlabel("stream samples seen")
    ax.set_ylabel("accuracy on seen classes (%)")
    ax.set_title(_heading(data, "Accuracy over the stream (its mean is $A_{auc}$)"))
    ax.legend(fontsize="small")
    return _save(fig, stem, data)


def _draw_heatmap(data: FigureData, stem: Path) -> list[Path]:
    """One panel per configuration, one colorbar for all (the same 0-100 scale), labelled."""
    plt = _pyplot()
    fig, axes = _grid(plt, len(data.panels), width=4.2, height=4, max_cols=3)
    image = None
    for ax, (s,) in zip(axes, data.panels.values()):
        matrix = np.ma.masked_invalid(s.y)
        image = ax.imshow(matrix, vmin=0, vmax=100, cmap="viridis")
        if len(s.x) <= 12:
            for (row, col), value in np.ndenumerate(s.y):
                if np.isfinite(value):
                    color = "white" if value < 50 else "black"
                    text = str(round_half_away(value))
                    ax.text(col, row, text, ha="center", va="center", color=color)
        ax.set_xticks(range(len(s.x)), [str(t) for t in s.x])
        ax.set_yticks(range(len(s.x)), [str(t) for t in s.x])
        ax.set_xlabel("accuracy on task k")
        ax.set_ylabel("after task l")
        ax.set_title(_run_label(s), fontsize="small")
    fig.suptitle(_heading(data, "Accuracy (%) on task k (columns) after task l (rows)"))
    fig.tight_layout()
    bar = fig.colorbar(image, ax=axes, fraction=0.046 / max(1, math.ceil(len(axes) / 3)), pad=0.04)
    bar.set_label("accuracy (%)")
    return _save(fig, stem, data, tight=False)


# -- one call per figure ---------------------------------------------------------------------------
def gradient_imbalance_figure(runs: Sequence[dict[str, Any]], stem: Path) -> FigureData:
    """Fig. 1 (G^k_n per task) to ``<stem>.png`` / ``.pdf``; returns the plotted data."""
    data = gradient_imbalance_data(runs)
    data.paths = _draw_imbalance(data, Path(stem))
    return data


def gradient_trace_figure(
    runs: Sequence[dict[str, Any]],
    stem: Path,
    tasks: Sequence[int] | None = None,
    max_steps: int | None = None,
) -> FigureData:
    """Fig. 2 (``tasks=[2]``) or its appendix grid (every task, by default)."""
    data = gradient_trace_data(runs, tasks, max_steps)
    data.paths = _draw_trace(data, Path(stem))
    return data


def gamma_sensitivity_figure(
    runs: Sequence[dict[str, Any]], stem: Path, metric: str = "AP"
) -> FigureData:
    """Fig. 3: ``metric`` against gamma, from runs of a ``fgh.gamma`` sweep."""
    data = gamma_sensitivity_data(runs, metric)
    data.paths = _draw_gamma(data, Path(stem))
    return data


def accuracy_curve_figure(runs: Sequence[dict[str, Any]], stem: Path) -> FigureData:
    """Accuracy over the stream (the A_auc curve) from the periodic evaluations."""
    data = accuracy_curve_data(runs)
    data.paths = _draw_accuracy(data, Path(stem))
    return data


def accuracy_matrix_figure(runs: Sequence[dict[str, Any]], stem: Path) -> FigureData:
    """The accuracy matrix as a heat map, one panel per configuration."""
    data = accuracy_matrix_data(runs)
    data.paths = _draw_heatmap(data, Path(stem))
    return data


def _default_skip(name: str, reason: str) -> None:
    print(f"figures: skipped {name}: {reason}", file=sys.stderr)


def write_figures(
    results_list: Sequence[dict[str, Any]],
    out_dir: Path,
    *,
    which: Iterable[str] = FIGURES,
    trace_task: int = 2,
    max_steps: int | None = None,
    gamma_metric: str = "AP",
    on_skip: Callable[[str, str], None] = _default_skip,
    on_note: Callable[[str], None] = lambda note: print(f"figures: note: {note}", file=sys.stderr),
) -> list[Path]:
    """Every figure in ``which`` that ``results_list`` (loaded results dicts) supports, into
    ``out_dir`` (file names: ``STEMS``); returns the written paths. A figure without its data is
    skipped, and ``on_skip(name, reason)`` says why (by default on stderr); ``on_note`` gets the
    note naming runs set aside as repeats of a seed."""
    out_dir = Path(out_dir)
    which = list(which)
    unknown = sorted(set(which) - set(FIGURES))
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; choose from {', '.join(FIGURES)}")
    if not results_list:
        raise ValueError("no results to draw: pass at least one loaded results file")
    trace_stem = STEMS["trace"].replace("task2", f"task{trace_task}")
    jobs: dict[str, list[tuple[str, Callable[[], FigureData]]]] = {
        "imbalance": [
            (
                "imbalance",
                lambda: gradient_imbalance_figure(results_list, out_dir / STEMS["imbalance"]),
            )
        ],
        "trace": [
            (
                f"trace (task {trace_task})",
                lambda: gradient_trace_figure(
                    results_list, out_dir / trace_stem, [trace_task], max_steps
                ),
            ),
            (
                "trace (all tasks)",
                lambda: gradient_trace_figure(
                    results_list, out_dir / STEMS["trace_grid"], None, max_steps
                ),
            ),
        ],
        "gamma": [
            (
                "gamma",
                lambda: gamma_sensitivity_figure(
                    results_list, out_dir / STEMS["gamma"], gamma_metric
                ),
            )
        ],
        "accuracy": [
            ("accuracy", lambda: accuracy_curve_figure(results_list, out_dir / STEMS["accuracy"]))
        ],
        "heatmap": [
            ("heatmap", lambda: accuracy_matrix_figure(results_list, out_dir / STEMS["heatmap"]))
        ],
    }
    written: list[Path] = []
    for name, job in [job for figure in FIGURES if figure in which for job in jobs[figure]]:
        try:
            written += job().paths
        except FigureSkipped as reason:
            on_skip(name, str(reason))
    _, set_aside = counted_runs(results_list)
    if set_aside:
        on_note(duplicates_note(set_aside))
    return written


# -- the report command's plots (``pilot-online report --plot``) ---------------------------------


def _runs_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return load_runs(row["file"] for row in rows)


def plot_gradient_imbalance(rows: list[dict[str, Any]], output: Path) -> Path:
    """Bars of G^k_n per task for each configuration (paper Fig. 1), averaged over seeds:
    ``output`` (PNG) and the same stem as PDF (:func:`gradient_imbalance_figure`)."""
    try:
        data = gradient_imbalance_figure(_runs_of(rows), Path(output).with_suffix(""))
    except FigureSkipped as err:
        raise RuntimeError(str(err)) from None
    return data.paths[0]


def plot_task_gradient_trace(rows: list[dict[str, Any]], task: int, output: Path) -> Path:
    """Per-step G^k of task ``task`` (0-based) for each configuration (paper Fig. 2): ``output``
    (PNG) and the same stem as PDF (:func:`gradient_trace_figure`)."""
    try:
        data = gradient_trace_figure(_runs_of(rows), Path(output).with_suffix(""), [task + 1])
    except FigureSkipped as err:
        raise RuntimeError(str(err)) from None
    return data.paths[0]

"""``pilot-online tables``: the paper's tables, in its layout, from results folders.

Tables (file stems; each written as ``.md`` and ``.tex``):

- ``all_acc_clear`` / ``all_acc_blurry`` (Tables 1-2): AP; rows are methods, each with its
  "+ ours" (+ P + FGH) row under it; columns are dataset x {5e-5, 5e-3, Best HP}.
- ``total_clear`` / ``total_blurry``: the same layout for A_T (final average accuracy).
- ``ablation_<stream>``: base, + P, + FGH, + P + FGH per method, dataset x {5e-5, 5e-3}, AP.
- ``task<k>_<stream>``: accuracy on task k at the end of training (the appendix's clear_t1...).
- ``time_<dataset>_<stream>``: wall time (train + eval) and peak accelerator memory per row.

Which runs fill which cell: a run tagged ``hp_column: "best"`` (``sweep --hp-from``) fills the
Best HP column; any other run fills the column of its ``init_lr`` if that is one of the fixed
LRs (others are left out and counted in a note). The fixed-LR columns take FGH runs only at the
paper's FGH setting (gamma 1, element-wise, raw gradients): the others are left out, counted.

Cells are mean ± std (population std, ddof 0) over seeds. A cell with no run is "—"; a cell with
fewer seeds than the table's most common count gets a dagger and its count; the best mean of a
column is bold (per method block in the ablation table, as in the paper; the smallest in the time
table). The build functions return ``Table`` objects holding numbers (tests compare those), and
``to_markdown`` / ``to_latex`` render them.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.fgh import validate_options
from ..core.files import write_atomic
from ..core.results import find_results, load_results
from ..engine.config import PAPER_FGH, variant_of
from ..engine.protocol import FIXED_LRS, HP_COLUMNS, method_short_name
from .report import method_label

#: Method blocks of the paper's tables (separated by rules), in its row order.
PAPER_GROUPS: tuple[tuple[str, ...], ...] = (
    ("Fine-tuning", "Linear probe"),
    ("ER", "ER + Linear probe"),
    ("MVP", "oLoRA"),
    ("CODA", "L2P", "DualPrompt", "ConvPrompt"),
)
#: The paper's dataset columns (PILOT names -> headers), in its order; others follow, by name.
DATASET_NAMES = {
    "cifar224": "CIFAR100",
    "cifar100": "CIFAR100",
    "cub": "CUB",
    "imagenetr": "Imagenet-R",
}
STREAM_NAMES = {"clear": "clear", "si_blurry": "blurry"}
STREAM_TITLES = {"clear": r"\textit{clear}", "si_blurry": r"\textit{Si-Blurry}"}
ROW_LABELS = {"base": "", "p": "+ P", "fgh_only": "+ FGH", "ours": "+ ours"}
ABLATION_LABELS = {"base": "", "p": "+ P", "fgh_only": "+ FGH", "ours": "+ P + FGH"}
BEST = "best"
MISSING = "—"
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
            "tenth")  # fmt: skip


@dataclass
class Cell:
    """One table entry: the per-seed values behind it, and what the table decided about it."""

    values: list[float] = field(default_factory=list)
    bold: bool = False
    fewer_seeds: bool = False

    @property
    def n(self) -> int:
        return len(self.values)

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


@dataclass
class Table:
    name: str  # file stem
    caption: str
    label: str  # LaTeX label
    groups: list[tuple[str, list[str]]]  # (group header, column headers)
    blocks: list[list[Row]]  # row blocks, separated by rules
    kind: str = "percent"  # percent | time
    notes: list[str] = field(default_factory=list)

    def cell(self, method: str, label: str, column: int) -> Cell:
        for block in self.blocks:
            for row in block:
                if row.method == method and row.label == label:
                    return row.cells[column]
        raise KeyError((method, label))


# --- reading runs ---------------------------------------------------------------------------


def _row_kind(config: dict[str, Any]) -> str:
    """The table row: a :data:`VARIANTS` name, with + P + FGH called ``ours``."""
    variant = variant_of(config)
    return "ours" if variant == "fgh" else variant


def _paper_fgh(config: dict[str, Any]) -> bool:
    """No FGH, or FGH at the paper's setting (gamma 1, element-wise, raw gradients)."""
    fgh = config.get("fgh")
    return fgh is None or validate_options(**fgh) == validate_options(**PAPER_FGH)


def load_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """One flat record per complete results file under ``paths`` (files or folders)."""
    runs = []
    for file in find_results(paths):
        results = load_results(file)
        config, metrics, timing = results["config"], results["metrics"], results["timing"]
        lr = config.get("init_lr")
        runs.append(
            {
                "file": str(file),
                "method": method_label(config.get("model_name")),
                "method_key": method_short_name(config.get("model_name", "")),
                "dataset": config.get("dataset"),
                "stream": config.get("stream", "clear"),
                "row": _row_kind(config),
                "paper_fgh": _paper_fgh(config),
                "hp_column": config.get("hp_column", HP_COLUMNS[0]),
                "lr": float(lr) if lr is not None else None,
                "seed": config.get("seed"),
                "AP": metrics.get("AP"),
                "A_T": metrics.get("A_T"),
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
            means = [r.cells[column].mean for r in scope if r.cells[column].n]
            if not means:
                continue
            target = max(means) if better == "max" else min(means)
            for row in scope:
                cell = row.cells[column]
                cell.bold = cell.n > 0 and math.isclose(cell.mean, target, rel_tol=0, abs_tol=1e-12)
    if any(c.n == 0 for c in cells):
        table.notes.append(f"{MISSING}: no results for this entry.")
    if any(c.fewer_seeds for c in cells):
        table.notes.append(
            "†: fewer seeds than the other entries (count shown); "
            f"the table's usual count is {modal}."
        )
    if modal:
        runs = "runs" if table.kind == "time" else "seeds"
        table.notes.insert(0, f"Mean ± std over {modal} {runs} (population std).")
    return table


def main_table(runs: list[dict[str, Any]], stream: str, metric: str = "AP") -> Table:
    """Tables 1-2 (``AP``), the A_T tables (``A_T``), or one per-task table (``task<k>``: the
    accuracy on task k at the end, 1-based)."""
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
                    Cell(
                        [
                            v
                            for r in mine
                            if r["dataset"] == d and column_of(r) == c
                            for v in [_metric(r, metric)]
                            if _finite(v)
                        ]
                    )
                    for d, c in columns
                ]
                block.append(Row(method, ROW_LABELS[row], cells, depth=int(row != "base")))
        blocks.append(block)
    name, caption, label = _main_names(stream, metric)
    table = Table(
        name=name,
        caption=caption,
        label=label,
        groups=[
            (_dataset_header(d), [_lr_header(c) for c in (*FIXED_LRS, BEST)]) for d in datasets
        ],
        blocks=blocks,
    )
    if ignored:
        table.notes.append(
            f"{ignored} run(s) left out: neither at a fixed LR "
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


def _main_names(stream: str, metric: str) -> tuple[str, str, str]:
    short = STREAM_NAMES.get(stream, stream)
    setting = STREAM_TITLES.get(stream, stream)
    tail = (
        r"\textit{+ ours} refers to combining the baselines with prototypes and FGH. Best HP "
        r"refers to the best set of LR and $\gamma$ found on VTAB."
    )
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
                    Cell(
                        [
                            r["AP"]
                            for r in mine
                            if r["dataset"] == d and column_of(r) == lr and _finite(r["AP"])
                        ]
                    )
                    for d, lr in columns
                ]
                depth = {"base": 0, "ours": 2}.get(row, 1)
                block.append(Row(method, ABLATION_LABELS[row], cells, depth=depth))
            blocks.append(block)
    short = STREAM_NAMES.get(stream, stream)
    table = Table(
        name=f"ablation_{short}",
        caption="Average Performances (\\%) of all considered baselines with and without "
        f"prototypes as memory and FGH, in the {STREAM_TITLES.get(stream, stream)} setting, "
        "$\\gamma=1$.",
        label="tab:ablation" if stream == "si_blurry" else f"tab:ablation_{short}",
        groups=[(_dataset_header(d), [_lr_header(lr) for lr in FIXED_LRS]) for d in datasets],
        blocks=blocks,
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
                if not mine and row != "base":
                    continue
                memory = [r["peak_memory_bytes"] / 2**20 for r in mine if r["peak_memory_bytes"]]
                cells = [Cell([r["seconds"] for r in mine]), Cell(memory)]
                block.append(Row(method, ROW_LABELS[row], cells, depth=int(row != "base")))
        blocks.append(block)
    short = STREAM_NAMES.get(stream, stream)
    table = Table(
        name=f"time_{dataset}_{short}",
        caption="Time and Spatial complexity of compared methods on "
        f"{_latex_escape(_dataset_header(dataset))} in the {STREAM_TITLES.get(stream, stream)} "
        "setting.",
        label=f"tab:time_consumption_{dataset}_{short}",
        groups=[("", ["Time", "Memory Footprint (MB)"])],
        blocks=blocks,
        kind="time",
    )
    table = _finish(table, better="min")
    table.notes.append(
        "Time: training + evaluation wall clock per run; memory: peak accelerator memory on "
        "CUDA, peak resident memory of the process on CPU (MB = 2^20 bytes); over every run of "
        "the row (seeds and learning rates)."
    )
    return table


def build_tables(runs: list[dict[str, Any]]) -> list[Table]:
    """Every table the runs can fill."""
    tables: list[Table] = []
    streams = [s for s in ("clear", "si_blurry") if any(r["stream"] == s for r in runs)]
    for metric in ("AP", "A_T"):
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
    mean, std = _values(table, column, cell)
    text = f"{mean} ± {std}"
    if cell.bold:
        text = f"**{text}**"
    if cell.fewer_seeds:
        text += f" †(n={cell.n})"
    return text


def _md_label(row: Row) -> str:
    return row.method if not row.label else "&nbsp;" * 2 * row.depth + "↳ " + row.label


def to_markdown(table: Table) -> str:
    headers = ["Method"] + [
        f"{group} {column}".strip() for group, columns in table.groups for column in columns
    ]
    caption = table.caption.replace(r"\textit{", "*").replace(r"\textbf{", "**")
    caption = caption.replace("$\\mathcal{A}_T$", "A_T").replace("$\\gamma$", "γ")
    caption = caption.replace("$\\gamma=1$", "γ = 1").replace("\\%", "%").replace("\\_", "_")
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
    mean, std = _values(table, column, cell)
    text = f"{mean}{{\\scriptsize$\\pm${std}}}"
    if cell.bold:
        text = f"\\textbf{{{text}}}"
    if cell.fewer_seeds:
        text += f"$^{{\\dagger{cell.n}}}$"
    return text


def _tex_label(row: Row) -> str:
    if not row.label:
        return _latex_escape(row.method)
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
            if table.kind != "time"
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
    return note.replace("—", "---").replace("2^20", "$2^{20}$").replace("≥", r"$\geq$")


def _tex_header(column: str) -> str:
    if "e-" in column:
        mantissa, exponent = column.split("e")
        return f"${mantissa} \\times 10^{{{int(exponent)}}}$"
    return _latex_escape(column)


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
    if args.figures:  # the five figures beside the tables (matplotlib: the plots extra)
        from .figures import load_runs, write_figures

        for path in write_figures(load_runs(args.paths), Path(args.out) / "figures"):
            print(f"wrote {path}")
    return 0

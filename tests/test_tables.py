"""``pilot-online tables``: the paper's tables from tiny results folders with hand-picked values."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest

from pilot_online.cli import tables
from pilot_online.cli.main import main
from pilot_online.core.results import build_results, results_path, write_results
from pilot_online.engine.config import PAPER_FGH

ROWS = {
    "base": {"online_prototypes": False, "fgh": None},
    "p": {"online_prototypes": True, "fgh": None},
    "fgh_only": {"online_prototypes": False, "fgh": dict(PAPER_FGH)},
    "ours": {"online_prototypes": True, "fgh": dict(PAPER_FGH)},
}


def write_run(
    folder: Path,
    *,
    method: str = "coda_online",
    dataset: str = "cifar224",
    stream: str = "clear",
    lr: float = 5e-3,
    row: str = "base",
    seed: int = 0,
    ap: float = 50.0,
    a_t: float | None = None,
    final: list[float] | None = None,
    seconds: tuple[float, float] = (100.0, 20.0),
    peak: int | None = None,
    gamma: float | None = None,
    hp_column: str | None = None,
) -> Path:
    """One valid results file (built with the project's own builder) with the given values."""
    config = {
        "model_name": method,
        "dataset": dataset,
        "stream": stream,
        "init_lr": lr,
        "seed": seed,
        "backbone_type": "vit",
        **{k: (dict(v) if isinstance(v, dict) else v) for k, v in ROWS[row].items()},
    }
    if gamma is not None:
        config["fgh"]["gamma"] = gamma
    if hp_column:
        config["hp_column"] = hp_column
    final = final or [ap, ap]
    results = build_results(
        config=config,
        stream={"tasks": []},
        metrics={
            "accuracy_matrix": [[final[0], final[0]], [None, final[1]]],
            "A_k": [ap, ap],
            "AP": ap,
            "A_T": ap if a_t is None else a_t,
            "final_task_accuracies": final,
        },
        timing={
            "train_seconds": seconds[0],
            "eval_seconds": seconds[1],
            "samples_per_second": 1.0,
            "peak_memory_bytes": peak,
        },
        counters={
            "optimizer_steps": 1,
            "samples_seen": 1,
            "skipped_nonfinite_steps": 0,
            "skipped_nonfinite_hypergradients": 0,
        },
    )
    prefix = f"{method}_{dataset}_{stream}_{lr:g}_{row}_{gamma}_{hp_column}"
    return write_results(results_path(folder, prefix, seed, "vit"), results)


@pytest.fixture
def results(tmp_path) -> Path:
    folder = tmp_path / "results"
    for seed, ap in enumerate((10.0, 20.0, 30.0)):  # 20 ± sqrt(200/3) = 8.16
        write_run(folder, lr=5e-5, seed=seed, ap=ap, a_t=ap / 2, final=[ap, 2 * ap])
    for seed, ap in enumerate((40.0, 50.0, 60.0)):  # 50 ± 8.16
        write_run(folder, lr=5e-5, row="ours", seed=seed, ap=ap)
    for seed, ap in enumerate((70.0, 80.0)):  # two seeds only: 75 ± 5, flagged
        write_run(folder, lr=5e-3, seed=seed, ap=ap)
    for seed, ap in enumerate((60.0, 60.0, 63.0)):  # Best HP: 61 ± 1.41
        write_run(folder, lr=0.01, row="ours", seed=seed, ap=ap, gamma=0.1, hp_column="best")
    for seed in range(3):
        write_run(folder, method="l2p_online", lr=5e-5, seed=seed, ap=5.0)
        # neither a fixed LR nor tagged best: left out, counted in a note
        write_run(folder, method="l2p_online", lr=1e-3, seed=seed, ap=99.0)
        # + ours at a fixed LR but gamma 0.1: not the paper's fixed-LR setting, left out
        write_run(folder, method="l2p_online", lr=5e-3, row="ours", seed=seed, ap=98.0, gamma=0.1)
    return folder


def _md_row(text: str, label: str) -> list[str]:
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r} in\n{text}")


def test_main_table_means_stds_bold_flags_and_missing(results):
    table = tables.main_table(tables.load_rows([results]), "clear", "AP")
    assert table.name == "all_acc_clear" and table.label == "tab:clear_all"
    assert table.groups == [("CIFAR100", ["5e-5", "5e-3", "Best HP"])]
    # Paper order: CODA, its + ours row, then L2P (its "+ ours" runs are all left out).
    labels = [(r.method, r.label) for b in table.blocks for r in b]
    assert labels == [("CODA", ""), ("CODA", "+ ours"), ("L2P", "")]
    base_low = table.cell("CODA", "", 0)
    assert (base_low.n, base_low.mean) == (3, 20.0)
    assert base_low.std == pytest.approx(math.sqrt(200 / 3))
    ours_low = table.cell("CODA", "+ ours", 0)
    assert ours_low.mean == 50.0 and ours_low.bold and not base_low.bold
    base_high = table.cell("CODA", "", 1)
    assert (base_high.mean, base_high.std, base_high.n) == (75.0, 5.0, 2)
    assert base_high.fewer_seeds and base_high.bold  # the column's only entry
    assert table.cell("CODA", "+ ours", 1).n == 0  # missing
    best = table.cell("CODA", "+ ours", 2)
    assert best.mean == 61.0 and best.std == pytest.approx(math.sqrt(2)) and best.bold
    assert table.cell("CODA", "", 2).n == 0
    assert table.cell("L2P", "", 0).mean == 5.0
    assert table.cell("L2P", "", 1).n == 0  # the gamma 0.1 runs did not land here
    notes = " ".join(table.notes)
    assert "over 3 seeds" in notes and "†" in notes and "—" in notes
    assert "6 run(s) left out" in notes

    md = tables.to_markdown(table)
    assert _md_row(md, "CODA") == ["20.00 ± 8.16", "**75.00 ± 5.00** †(n=2)", "—"]
    assert _md_row(md, "&nbsp;&nbsp;↳ + ours") == ["**50.00 ± 8.16**", "—", "**61.00 ± 1.41**"]


def test_a_t_and_per_task_tables(results):
    runs = tables.load_rows([results])
    total = tables.main_table(runs, "clear", "A_T")
    assert total.name == "total_clear"
    assert total.cell("CODA", "", 0).mean == 10.0  # A_T = AP / 2 for those runs
    task2 = tables.main_table(runs, "clear", "task2")
    assert task2.name == "task2_clear" and task2.label == "tab:clear_t2"
    assert task2.cell("CODA", "", 0).mean == 40.0  # 2 x (10, 20, 30)
    assert "second task" in task2.caption


def test_ablation_table_bolds_per_method_block(tmp_path):
    folder = tmp_path / "r"
    values = {
        "base": (10.0, 70.0),
        "p": (30.0, 75.0),
        "fgh_only": (20.0, 69.0),
        "ours": (40.0, 74.0),
    }
    for method in ("coda_online", "l2p_online"):
        for row, (low, high) in values.items():
            for seed in range(2):
                shift = 0.0 if method == "coda_online" else -5.0
                write_run(folder, method=method, stream="si_blurry", row=row, lr=5e-5, seed=seed,
                          ap=low + shift)  # fmt: skip
                write_run(folder, method=method, stream="si_blurry", row=row, lr=5e-3, seed=seed,
                          ap=high + shift)  # fmt: skip
    table = tables.ablation_table(tables.load_rows([folder]), "si_blurry")
    assert table.name == "ablation_blurry" and table.label == "tab:ablation"
    assert [[r.label for r in b] for b in table.blocks] == [["", "+ P", "+ FGH", "+ P + FGH"]] * 2
    # Bold per method block: + P + FGH at 5e-5 (40 / 35), + P at 5e-3 (75 / 70), in both blocks.
    for method, shift in (("CODA", 0.0), ("L2P", -5.0)):
        assert table.cell(method, "+ P + FGH", 0).bold
        assert table.cell(method, "+ P + FGH", 0).mean == 40.0 + shift
        assert table.cell(method, "+ P", 1).bold and not table.cell(method, "+ P + FGH", 1).bold


def test_time_table_formats_minutes_and_megabytes(tmp_path):
    folder = tmp_path / "r"
    write_run(folder, dataset="cub", seed=0, seconds=(100.0, 20.0), peak=2**30)
    write_run(folder, dataset="cub", seed=1, seconds=(200.0, 40.0), peak=3 * 2**30)
    write_run(folder, dataset="cub", row="ours", seed=0, seconds=(3600.0, 0.0), peak=4 * 2**30)
    # A Best HP run repeats a searched configuration: the time table does not count it.
    write_run(folder, dataset="cub", lr=0.01, seed=2, seconds=(9000.0, 0.0), hp_column="best")
    table = tables.time_table(tables.load_rows([folder]), "cub", "clear")
    assert table.name == "time_cub_clear"
    time, memory = table.cell("CODA", "", 0), table.cell("CODA", "", 1)
    assert (time.mean, time.std) == (180.0, 60.0)
    assert (memory.mean, memory.std) == (2048.0, 1024.0)
    assert time.bold and memory.bold  # the smallest is the best here
    md = tables.to_markdown(table)
    assert _md_row(md, "CODA") == ["**3m0s ± 1m0s**", "**2,048 ± 1,024**"]
    assert _md_row(md, "&nbsp;&nbsp;↳ + ours")[0] == "1h0m0s ± 0s †(n=1)"


def test_latex_has_booktabs_bold_pm_and_daggers(results):
    table = tables.main_table(tables.load_rows([results]), "clear", "AP")
    tex = tables.to_latex(table)
    assert r"\toprule" in tex and r"\bottomrule" in tex and r"\midrule" in tex
    assert r"\textbf{50.00{\scriptsize$\pm$8.16}}" in tex
    assert r"\textbf{75.00{\scriptsize$\pm$5.00}}$^{\dagger2}$" in tex
    assert r"$5 \times 10^{-5}$" in tex and r"\label{tab:clear_all}" in tex
    assert r"$\hookrightarrow$ + ours" in tex
    for table in tables.build_tables(tables.load_rows([results])):  # what a LaTeX run needs
        tex = tables.to_latex(table)
        assert tex.isascii(), [c for c in tex if not c.isascii()]
        assert tex.count("{") == tex.count("}") and tex.count("$") % 2 == 0


LATEX_ENGINES = ("pdflatex", "lualatex", "xelatex", "tectonic")


def test_latex_compiles(results, tmp_path):
    engine = next((e for e in LATEX_ENGINES if shutil.which(e)), None)
    if engine is None:
        pytest.skip(
            f"no LaTeX engine on PATH (looked for {', '.join(LATEX_ENGINES)}); install one to "
            "compile the tables, e.g. `apt-get install texlive-latex-extra` (pdflatex with "
            "booktabs and graphicx) or `cargo install tectonic`"
        )
    runs = tables.load_rows([results])
    body = "\n".join(tables.to_latex(t) for t in tables.build_tables(runs))
    document = tmp_path / "tables.tex"
    document.write_text(
        "\\documentclass{article}\n\\usepackage[utf8]{inputenc}\n\\usepackage{booktabs}\n"
        "\\usepackage{graphicx}\n\\begin{document}\n" + body + "\n\\end{document}\n"
    )
    command = [engine, document.name] if engine == "tectonic" else [
        engine, "-interaction=nonstopmode", "-halt-on-error", document.name
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]


def test_cli_writes_every_table_as_markdown_and_latex(results, tmp_path, capsys):
    out = tmp_path / "tables"
    assert main(["tables", str(results), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    for stem in (
        "all_acc_clear",
        "total_clear",
        "task1_clear",
        "task2_clear",
        "time_cifar224_clear",
    ):
        assert f"{stem}.md" in names and f"{stem}.tex" in names
    assert "ablation_clear.md" not in names  # no + P / + FGH runs
    assert "20.00 ± 8.16" in (out / "all_acc_clear.md").read_text()
    index = (out / "tables.md").read_text()  # every Markdown table in one file
    assert index.count("| Method |") == sum(
        1 for n in names if n.endswith(".md") and n != "tables.md"
    )


def test_cli_figures_flag_draws_the_figures_beside_the_tables(results, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="figures need matplotlib: pip install -e '.[plots]'")
    out = tmp_path / "tables"
    assert main(["tables", str(results), "--out", str(out), "--figures"]) == 0
    figures = out / "figures"
    for suffix in (".png", ".pdf"):  # every results file has its accuracy matrix
        assert (figures / f"accuracy_matrix{suffix}").stat().st_size > 0
    # These tiny files store no gradient statistics: Fig. 1 is skipped, with its reason.
    assert not list(figures.glob("fig1_gradient_imbalance.*"))
    assert "imbalance" in capsys.readouterr().err

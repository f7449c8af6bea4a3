"""Reports over results files written by real (tiny) sessions, the CLI's report command, and the
core-only demo."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet, VectorSource

from pilot_online import cli
from pilot_online.core.results import load_results
from pilot_online.core.streams import clear_stream
from pilot_online.engine.config import PAPER_FGH
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.session import OnlineSession
from pilot_online.harness.figures import plot_gradient_imbalance, plot_task_gradient_trace
from pilot_online.harness.report import collect, format_table, variant_label

C, D_IN, HIDDEN = 6, 5, 8
SEEDS = (0, 1, 2)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_session(folder: Path, seed: int, variant: dict | None = None, status="complete") -> Path:
    """One tiny run (3 tasks of 2 classes) that writes its results file; returns its path."""
    generator = torch.Generator().manual_seed(100)  # the same data for every seed
    train_y, test_y = np.repeat(np.arange(C), 10), np.repeat(np.arange(C), 5)
    centers = 1.5 * torch.randn(C, D_IN, generator=generator)
    train_x = centers[train_y] + torch.randn(len(train_y), D_IN, generator=generator)
    test_x = centers[test_y] + torch.randn(len(test_y), D_IN, generator=generator)
    stream = clear_stream(train_y, init_cls=2, increment=2, batch_size=5, seed=0)
    config = {
        "model_name": "tiny_online",
        "dataset": "blobs",
        "stream": "clear",
        "init_lr": 0.05,
        "optimizer": "adam",
        "seed": seed,
        "online_prototypes": False,
        "online_accuracy": True,
        "fgh": None,
        **(variant or {}),
    }
    torch.manual_seed(seed)  # the seed changes the initial weights only
    adapter = TinyAdapter(args=config)
    loop = build_loop(adapter, TinyNet(), config, C)
    name = "partial" if status != "complete" else f"tiny_{seed}"
    path = folder / f"{name}.results.json"
    source = VectorSource(train_x, train_y, test_x, test_y)
    session = OnlineSession(loop, stream, source, config, path, progress=False)
    for task in range(stream.num_tasks):
        session.train_task(task)
        session.evaluate_task_end(task)
    session.write(status=status)
    return session.written_path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[Path]]:
    folder = tmp_path_factory.mktemp("runs")
    paths = [run_session(folder, seed) for seed in SEEDS]
    run_session(folder, 9, status="failed")  # a partial file: reports must skip it
    return folder, paths


def _table_rows(table: str) -> list[list[str]]:
    """Split a format_table output into cells (columns are separated by >= 2 spaces)."""
    lines = table.splitlines()
    assert set(lines[1].replace(" ", "")) == {"-"}  # the rule under the header
    rows = lines[2 : lines.index("")]  # a blank line ends the table: notes and legend follow
    return [re.split(r"\s{2,}", line.strip()) for line in [lines[0], *rows]]


def test_grouped_table_gives_mean_and_std_over_seeds(runs) -> None:
    folder, paths = runs
    assert (folder / "partial.partial.results.json").exists()
    rows = collect([folder])
    assert sorted(row["seed"] for row in rows) == list(SEEDS)  # the partial run is skipped
    ap = [load_results(path)["metrics"]["AP"] for path in paths]
    a_t = [load_results(path)["metrics"]["A_T"] for path in paths]
    online = [load_results(path)["metrics"]["A_online"] for path in paths]
    assert len(set(ap)) > 1  # the seeds really differ, so the std is not trivially 0

    header, *lines = _table_rows(format_table(rows))
    assert header == [
        "method", "dataset", "stream", "lr", "variant", "runs", "AP", "A_T", "forgetting", "A_auc",
        "A_online",
    ]  # fmt: skip
    assert len(lines) == 1
    cells = dict(zip(header, lines[0]))
    assert cells["method"] == "tiny_online" and cells["variant"] == "base"
    assert cells["lr"] == "0.05"
    assert cells["runs"] == "3"
    assert cells["AP"] == f"{np.mean(ap):.2f}±{np.std(ap):.2f}"
    assert cells["A_T"] == f"{np.mean(a_t):.2f}±{np.std(a_t):.2f}"
    assert cells["A_auc"] == "-"  # no periodic evaluation in these runs
    assert cells["A_online"] == f"{np.mean(online):.2f}±{np.std(online):.2f}"


def test_per_seed_table_has_one_row_per_run(runs) -> None:
    folder, paths = runs
    header, *lines = _table_rows(format_table(collect([folder]), group=False))
    assert header[5] == "seed" and header[-1] == "results file"
    assert len(lines) == 3
    by_seed = {dict(zip(header, line))["seed"]: dict(zip(header, line)) for line in lines}
    assert set(by_seed) == {"0", "1", "2"}
    for seed, path in zip(SEEDS, paths):
        assert by_seed[str(seed)]["AP"] == f"{load_results(path)['metrics']['AP']:.2f}"
        assert by_seed[str(seed)]["results file"] == path.name


def test_a_seed_run_twice_counts_once_with_a_note(tmp_path, runs) -> None:
    """The issue's case: seed 0 run again under another prefix. Before, report said "runs 4" and
    its per-seed rows could not be told apart; tables counted 3."""
    folder, paths = runs
    again = json.loads(paths[0].read_text())
    again["created_utc"] = "9999-01-01T00:00:00Z"  # the newer run of seed 0 counts
    copy = tmp_path / "rerun_0.results.json"
    copy.write_text(json.dumps(again))
    rows = collect([folder, copy])
    table = format_table(rows)
    header, *lines = _table_rows(table)
    assert dict(zip(header, lines[0]))["runs"] == "3"
    assert table.splitlines()[-1].startswith('note: PILOT\'s "Average Accuracy (CNN)" line is')
    assert table.splitlines()[table.splitlines().index("") + 1] == (
        f"note: 1 run set aside ({paths[0].name}): a seed run more than once with the same "
        "hyperparameters counts once, by its newest complete run."
    )
    per_seed = format_table(rows, group=False)
    header, *lines = _table_rows(per_seed)
    files = [
        dict(zip(header, line))["results file"] for line in lines if not line[0].startswith("note:")
    ]
    assert sorted(files) == sorted(
        [f"{paths[0].name} (set aside: a repeat)", copy.name] + [p.name for p in paths[1:]]
    )


def test_collect_accepts_files_and_separates_variants(tmp_path, runs) -> None:
    _, paths = runs
    p_fgh = run_session(tmp_path, 0, {"online_prototypes": True, "fgh": dict(PAPER_FGH)})
    rows = collect([*paths, p_fgh])
    assert [row["variant"] for row in rows] == ["base"] * 3 + ["+ P + FGH"]
    _, *lines = _table_rows(format_table(rows))
    assert len(lines) == 2  # two configurations, two grouped rows


@pytest.mark.parametrize(
    ("config", "label"),
    [
        ({"online_prototypes": False, "fgh": None}, "base"),
        ({"online_prototypes": True, "fgh": None}, "+ P"),
        # The paper's FGH (the appendix algorithm, engine.config.PAPER_FGH) is plain "FGH".
        (
            {
                "online_prototypes": True,
                "fgh": {
                    "gamma": 1,
                    "granularity": "class",
                    "direction": "adam",
                    "apply": "grad",
                    "clamp": [0, None],
                },
            },
            "+ P + FGH",
        ),
        # The class-wise Adam form at the default clamp [0, 10] and gamma (Adam's 1e-3) is the
        # former paper setting, named.
        ({"fgh": {"granularity": "class", "direction": "adam"}}, "+ FGH(appendix_clamp10)"),
        # The main text's Eq. 8 form is named; a gamma other than the form's is shown.
        ({"online_prototypes": False, "fgh": {"gamma": 1, "granularity": "element"}}, "+ FGH(eq8)"),
        ({"fgh": {}}, "+ FGH(eq8)"),  # build_loop enables FGH (component defaults: Eq. 8)
        ({"fgh": {"gamma": 0.5}}, "+ FGH(eq8) γ=0.5"),
        (
            {"fgh": {"gamma": 1, "granularity": "class", "direction": "adam"}},
            "+ FGH(appendix_clamp10) γ=1",
        ),
        # Any other setting names what differs from the paper's form.
        (
            {"fgh": {"direction": "adam", "gamma": 1e-3}},
            "+ FGH(granularity=element, clamp=[0.0, 10.0]) γ=0.001",
        ),
        (
            {"fgh": {"granularity": "class", "direction": "adam", "clamp": [0, 5], "gamma": 1}},
            "+ FGH(clamp=[0.0, 5.0])",
        ),
    ],
)
def test_variant_label(config: dict, label: str) -> None:
    assert variant_label(config) == label


def test_gradient_imbalance_plot_is_a_png(tmp_path, runs) -> None:
    folder, _ = runs
    output = plot_gradient_imbalance(collect([folder]), tmp_path / "plots" / "imbalance.png")
    assert output.read_bytes()[:8] == PNG_MAGIC


def test_cli_report(tmp_path, runs, capsys) -> None:
    folder, paths = runs
    assert cli.main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    header = ["method", "dataset", "stream", "lr", "variant", "runs"]
    assert out.splitlines()[0].split()[:6] == header
    assert "tiny_online" in out and "base" in out

    plot = tmp_path / "cli.png"
    assert cli.main(["report", str(folder), "--per-seed", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert all(path.name in out for path in paths)
    assert plot.read_bytes()[:8] == PNG_MAGIC

    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["report", str(empty)]) == 1
    assert "no results files found" in capsys.readouterr().err


def test_demo_runs_both_variants(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("timm", reason="the demo's ViT comes from timm (pip install timm)")
    pytest.importorskip("safetensors", reason="the shipped backbone is a safetensors file")
    from pilot_online.cli import demo

    # Fewer test images keep the test fast; the stream (10 classes x 100 images, two steps a
    # task) is cut by the demo's own knob.
    original = demo.demo_data

    def small_test_set(train_per_class):
        arrays = original(train_per_class)
        keep = np.concatenate([np.flatnonzero(arrays["test_y"] == c)[:20] for c in range(10)])
        return {**arrays, "test_x": arrays["test_x"][keep], "test_y": arrays["test_y"][keep]}

    monkeypatch.setattr(demo, "demo_data", small_test_set)
    summaries = demo.run_demo(train_per_class=100, output=tmp_path)
    out = capsys.readouterr().out
    assert out.startswith(demo.DEFINITIONS)  # AP and A_T defined before anything runs
    assert "AP (average performance, the paper's metric)" in out and "A_T: A_l after" in out
    assert "demo: 1/10 tasks" in out and "left" in out and "demo: 10/10 tasks" in out
    # The printed matrix is the figure's orientation: row l = after task l, column k = task k,
    # i.e. the transpose of the results file's acc[task][after].
    acc = load_results(tmp_path / "demo_base_0.results.json")["metrics"]["accuracy_matrix"]
    lines = out.split("base: accuracy matrix")[1].splitlines()
    second = lines[3].split()  # header, "after \\ task" line, after task 1, after task 2
    assert second == ["2", f"{acc[0][1]:.1f}", f"{acc[1][1]:.1f}", "--", "--", "--"]
    assert set(summaries) == {"base", "+ P + FGH"}
    files = sorted(tmp_path.glob("*.results.json"))
    assert [f.name for f in files] == ["demo_base_0.results.json", "demo_p_fgh_0.results.json"]
    for file in files:
        results = load_results(file)
        assert results["counters"]["samples_seen"] == 10 * 100
        assert results["counters"]["optimizer_steps"] == 10  # 5 tasks x 200 samples, batch 100
        assert len(results["metrics"]["accuracy_matrix"]) == 5
    # With the pretrained ViT, + P + FGH learns each task it has just trained on, even at two
    # steps a task (base's newest task can score 0 there: Adam moves the masked old rows on
    # momentum, docs/scale-model.md); no zero on its diagonal.
    matrix = load_results(tmp_path / "demo_p_fgh_0.results.json")["metrics"]["accuracy_matrix"]
    assert min(matrix[k][k] for k in range(5)) > 0
    p_fgh = load_results(tmp_path / "demo_p_fgh_0.results.json")["extra"]["diagnostics"]
    assert p_fgh["prototypes"] == {"classes": 10, "samples": 1000}
    assert p_fgh["fgh"]["steps"] == 10


def test_task_gradient_trace_plot_reads_the_sidecar_trace(tmp_path, runs) -> None:
    folder, _ = runs
    rows = collect([folder])
    trace = np.load(rows[0]["trace"])
    assert trace.shape[0] == load_results(rows[0]["file"])["counters"]["optimizer_steps"]
    png = plot_task_gradient_trace(rows, 0, tmp_path / "trace.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(RuntimeError, match="task 100 "):  # 0-based 99: the message counts from 1
        plot_task_gradient_trace(rows, 99, tmp_path / "none.png")


def test_paper_rows_are_registered_and_other_methods_follow_them():
    """Every row of the paper's tables has a registered method; ``paper_name`` is optional: a
    method without one is labelled by its registered name and sorts after the paper's rows."""
    from pilot_online import list_methods
    from pilot_online.engine.registry import method_card
    from pilot_online.harness.report import PAPER_ROW_ORDER, _sort_key, method_label

    labels = {method_label(name) for name in list_methods()}
    assert set(PAPER_ROW_ORDER) <= labels, set(PAPER_ROW_ORDER) - labels
    unnamed = [name for name in list_methods() if not method_card(name).paper_name]
    assert all(method_label(name) == name for name in unnamed)
    keys = [(label, "cifar224", "clear", 0.005, "base") for label in ("zzz_online", "CODA", "ER")]
    assert [k[0] for k in sorted(keys, key=_sort_key)] == ["ER", "CODA", "zzz_online"]


def test_report_legend_defines_every_column_and_forgetting_by_hand(tmp_path, capsys) -> None:
    """Before: the report's columns were not defined, forgetting's formula nowhere (issue 36).
    The legend's words, applied by hand to a 3-task accuracy matrix, give the report's numbers."""
    from pilot_online.core.metrics import METRIC_DEFINITIONS, summarize
    from pilot_online.core.results import build_results, write_results

    nan = float("nan")
    # acc[l][k]: accuracy (%) on task l after training on task k (tasks 1..3 in the legend).
    acc = [[90.0, 70.0, 60.0], [nan, 80.0, 85.0], [nan, nan, 95.0]]
    results = build_results(
        config={"model_name": "coda_online", "dataset": "cifar224", "stream": "clear",
                "init_lr": 5e-3, "seed": 0, "online_prototypes": False, "fgh": None},
        stream={"tasks": []},
        metrics=summarize(acc),
        timing={"train_seconds": 1.0, "eval_seconds": 1.0, "samples_per_second": 1.0,
                "peak_memory_bytes": None},
        counters={"optimizer_steps": 1, "samples_seen": 1, "skipped_nonfinite_steps": 0,
                  "skipped_nonfinite_hypergradients": 0},
    )  # fmt: skip
    write_results(tmp_path / "coda.results.json", results)
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header, (row,) = _table_rows(out)[0], _table_rows(out)[1:]
    cells = dict(zip(header, row))

    # Forgetting, as the legend words it: over tasks l = 1..T-1, task l's best accuracy after
    # tasks l..T-1 minus its accuracy after the last task T, averaged (not clipped at 0).
    task_1 = max(90.0, 70.0) - 60.0  # 30
    task_2 = 80.0 - 85.0  # -5: task 2 improved at the end
    assert cells["forgetting"] == f"{(task_1 + task_2) / 2:.2f}" == "12.50"
    # PILOT's print_forget takes the max over all T columns: task 2 gives 0, F = 15.
    # AP: the mean over task ends k of A_k (the mean accuracy on tasks 1..k after task k).
    a_k = [90.0, (70.0 + 80.0) / 2, (60.0 + 85.0 + 95.0) / 3]
    assert cells["AP"] == f"{sum(a_k) / 3:.2f}" and cells["A_T"] == f"{a_k[-1]:.2f}"

    legend = out[out.index("columns (tasks numbered 1..T") :]
    flat = " ".join(legend.split())
    for column in header:
        assert f"\n  {column} " in legend, column  # every column of the table is defined
    assert " ".join(METRIC_DEFINITIONS["forgetting"].split()) in flat
    assert (
        "over tasks l = 1..T-1: task l's best accuracy after tasks l..T-1 minus its accuracy "
        "after the last task T, averaged; negative where a task improved" in flat
    )
    assert "the mean over task ends k = 1..T of A_k" in flat
    assert flat.endswith(
        'note: PILOT\'s "Average Accuracy (CNN)" line is a different average: its top-1 over all '
        "seen test images (sample-weighted, not per task), averaged over task ends; it is not the "
        "paper's AP."
    )


def test_run_summary_line_names_the_papers_metric_and_pilots_other_average() -> None:
    """The line a run logs at its end, just before PILOT's trainer logs its "Average Accuracy
    (CNN)": AP is named as the paper's metric, PILOT's line as a different average."""
    from pilot_online.core.metrics import run_summary_line

    line = run_summary_line({"AP": 61.234, "A_T": 55.0}, "runs/coda_0_vit.results.json")
    assert line == (
        "AP 61.23 (the paper's metric: average performance, Sec. 4.1), A_T 55.00 (after the last "
        'task). PILOT\'s "Average Accuracy (CNN)" line is a different average: its top-1 over all '
        "seen test images (sample-weighted, not per task), averaged over task ends; it is not the "
        "paper's AP. Results: runs/coda_0_vit.results.json"
    )
    assert run_summary_line({"AP": None, "A_T": float("nan")}).startswith("AP n/a (the paper's")

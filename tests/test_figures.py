"""Figures (``harness/figures.py``) from tiny hand-written results files: the plotted numbers are
checked against values worked out by hand, and each figure is written as a non-empty PNG and PDF.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from pilot_online import cli
from pilot_online.core.metrics import task_gradient_trace
from pilot_online.core.results import build_results, to_jsonable
from pilot_online.engine.config import PAPER_FGH
from pilot_online.harness import figures

pytest.importorskip("matplotlib", reason="figures need matplotlib: pip install -e '.[plots]'")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAN = float("nan")


def make_results(
    *,
    seed: int = 0,
    model: str = "coda_online",
    lr: float = 5e-3,
    stream: str = "clear",
    prototypes: bool = True,
    fgh: dict | None = None,
    matrix: list | None = None,
    ap: float = 50.0,
    g_n: list | None = None,
    trace: list | None = None,
    periodic: list | None = None,
    task_samples: tuple[int, ...] = (250, 200, 100),
    batch_size: int = 100,
    at_hi: float | None = None,
    final_alpha: float | None = None,
    clamp_hi: float | None = 10.0,
) -> dict:
    """A valid results dict (schema of core/results.py) holding only the given numbers."""
    tasks = len(task_samples)
    config = {
        "model_name": model,
        "dataset": "cifar224",
        "stream": stream,
        "init_lr": lr,
        "seed": seed,
        "batch_size": batch_size,
        "online_prototypes": prototypes,
        "fgh": fgh,
    }
    stream_dict = {
        "kind": stream,
        "params": {"batch_size": batch_size},
        "num_samples": sum(task_samples),
        "num_tasks": tasks,
        "tasks": [
            {"task": k, "num_samples": n, "new_classes": [2 * k, 2 * k + 1]}
            for k, n in enumerate(task_samples)
        ],
    }
    matrix = matrix if matrix is not None else [[NAN] * tasks for _ in range(tasks)]
    extra = {"gradient_imbalance": {}}
    if g_n is not None:
        extra["gradient_imbalance"]["task_grad_norm_normalized"] = g_n
    if trace is not None:
        extra["gradient_imbalance"]["task_grad_norm_trace"] = trace
    if periodic is not None:
        extra["periodic_evaluations"] = [{"samples_seen": s, "accuracy": a} for s, a in periodic]
    if at_hi is not None:  # FGHMixin.report's alpha_bounds, one group of 10 coefficients
        stream_stats = {"mean": 5.0, "at_lo": 0.0, "at_hi": at_hi, "steps": 6}
        final = {} if final_alpha is None else {"mean": final_alpha, "at_hi": 0.0}
        bounds = {
            "clamp": [0.0, clamp_hi],
            "coefficients": 10,
            "final": final,
            "stream": stream_stats,
        }
        extra["diagnostics"] = {"fgh": {"alpha_bounds": [bounds]}}
    results = build_results(
        config=config,
        stream=stream_dict,
        metrics={"accuracy_matrix": matrix, "A_k": [], "AP": ap, "A_T": ap},
        timing={
            "train_seconds": 1.0,
            "eval_seconds": 1.0,
            "samples_per_second": 1.0,
            "peak_memory_bytes": None,
        },
        counters={
            "optimizer_steps": 6,
            "samples_seen": sum(task_samples),
            "skipped_nonfinite_steps": 0,
            "skipped_nonfinite_hypergradients": 0,
        },
        extra=extra,
    )
    return json.loads(json.dumps(to_jsonable(results)))  # exactly what a file holds (NaN: null)


def assert_written(data: figures.FigureData, stem: Path) -> None:
    png, pdf = stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")
    assert data.paths == [png, pdf]
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 1000


def test_task_gradient_trace_by_hand() -> None:
    # steps x classes -> steps x tasks: mean of the task's classes' row-gradient norms per step.
    trace = [[1.0, 2.0, 3.0, 4.0, 9.0], [5.0, 6.0, 7.0, 8.0, 9.0]]
    out = task_gradient_trace(trace, [[0, 1], [2, 3, 4], []])
    np.testing.assert_allclose(out[:, :2], [[1.5, 16 / 3], [5.5, 8.0]])
    assert np.isnan(out[:, 2]).all()  # a task without classes of its own
    with pytest.raises(ValueError, match="only 5 classes"):
        task_gradient_trace(trace, [[0, 5]])


def test_gradient_imbalance_by_hand(tmp_path) -> None:
    # Two seeds of CODA + P; one seed of CODA base. G^k_n is averaged over seeds, null skipped.
    runs = [
        make_results(seed=0, g_n=[1.0, 0.5, 0.25]),
        make_results(seed=1, g_n=[0.5, 1.0, None]),
        make_results(seed=0, prototypes=False, g_n=[1.0, 0.8, 0.6]),
        make_results(seed=0, prototypes=False, fgh={"gamma": 1}),  # no gradient stats: ignored
    ]
    data = figures.gradient_imbalance_figure(runs, tmp_path / "fig1")
    assert_written(data, tmp_path / "fig1")
    series = data.series()
    assert set(series) == {"CODA + P", "CODA base"}
    p = series["CODA + P"]
    np.testing.assert_array_equal(p.x, [1, 2, 3])
    np.testing.assert_allclose(p.y, [0.75, 0.75, 0.25])
    np.testing.assert_allclose(p.std, [0.25, 0.25, 0.0])
    assert p.runs == 2
    base = series["CODA base"]
    np.testing.assert_allclose(base.y, [1.0, 0.8, 0.6])
    assert base.std is None and base.runs == 1


def test_gradient_trace_by_hand(tmp_path) -> None:
    # Stream: tasks of 250, 200 and 100 samples, batch 100 -> 3 + 2 + 1 steps; task ends at 3, 5.
    seed0 = [
        [1.0, 0.0, 0.0],
        [2.0, 0.0, 0.0],
        [3.0, 1.0, 0.0],
        [4.0, 2.0, 0.0],
        [5, 3, 1],
        [6, 4, 2],
    ]
    seed1 = [[3.0, 0.0, 0.0], [4.0, 0.0, 0.0], [5.0, 3.0, 0.0], [6.0, 4.0, 0.0], [7, 5, 3]]
    runs = [make_results(seed=0, trace=seed0), make_results(seed=1, trace=seed1)]

    single = figures.gradient_trace_figure(runs, tmp_path / "fig2", tasks=[2])
    assert_written(single, tmp_path / "fig2")
    assert list(single.panels) == ["task 2"]
    (curve,) = single.panels["task 2"]
    # Seeds are averaged over the steps both have (5): task 2's column.
    np.testing.assert_array_equal(curve.x, [1, 2, 3, 4, 5])
    np.testing.assert_allclose(curve.y, [0.0, 0.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(curve.std, [0.0, 0.0, 1.0, 1.0, 1.0])
    assert single.markers == [3.0, 5.0]

    grid = figures.gradient_trace_figure(runs, tmp_path / "grid", max_steps=4)
    assert_written(grid, tmp_path / "grid")
    assert list(grid.panels) == ["task 1", "task 2", "task 3"]
    np.testing.assert_allclose(grid.panels["task 1"][0].y, [2.0, 3.0, 4.0, 5.0])
    assert grid.markers == [3.0]  # the task end at step 5 is past the 4 steps shown

    with pytest.raises(figures.FigureSkipped, match="task 4 "):
        figures.gradient_trace_data(runs, tasks=[4])
    with pytest.raises(figures.FigureSkipped, match="grad_trace"):
        figures.gradient_trace_data([make_results()])


def test_trace_of_an_older_file_comes_from_its_sidecar(tmp_path) -> None:
    results = make_results()
    results["extra"]["gradient_imbalance"]["trace_file"] = "run.results.gradtrace.npy"
    (tmp_path / "run.results.json").write_text(json.dumps(results))
    # steps x classes; the tasks' classes are {0, 1}, {2, 3}, {4, 5}.
    np.save(tmp_path / "run.results.gradtrace.npy", np.array([[1, 3, 2, 2, 0, 4]], dtype=float))
    (run,) = figures.load_runs([tmp_path])
    np.testing.assert_allclose(
        run["extra"]["gradient_imbalance"]["task_grad_norm_trace"], [[2, 2, 2]]
    )


EQ8 = figures.FORM_TITLES["eq8"]
APPENDIX = figures.FORM_TITLES["appendix"] + " (paper configs)"


def test_gamma_sensitivity_by_hand(tmp_path) -> None:
    runs = [
        make_results(seed=0, fgh={"gamma": 1e-3}, ap=50.0),
        make_results(seed=1, fgh={"gamma": 1e-3}, ap=54.0),
        make_results(seed=0, fgh={"gamma": 1.0}, ap=60.0),
        make_results(seed=1, fgh={"gamma": 1.0}, ap=62.0),
        make_results(seed=0, fgh={"gamma": 0.1}, ap=58.0),
        # The same configuration without FGH: gamma = 0.
        make_results(seed=0, fgh=None, ap=40.0),
        make_results(seed=1, fgh=None, ap=44.0),
        # Another method at one gamma only: no sweep, no curve.
        make_results(seed=0, model="l2p_online", fgh={"gamma": 1.0}, ap=30.0),
    ]
    data = figures.gamma_sensitivity_figure(runs, tmp_path / "fig3")
    assert_written(data, tmp_path / "fig3")
    # {"gamma": ...} alone is the component's default form: Eq. 8, one panel.
    assert list(data.panels) == [EQ8]
    series = data.series(EQ8)
    assert set(series) == {"CODA + P + FGH(eq8)", "CODA + P + FGH(eq8) (γ=0: no FGH)"}
    sweep = series["CODA + P + FGH(eq8)"]
    np.testing.assert_allclose(sweep.x, [1e-3, 0.1, 1.0])
    np.testing.assert_allclose(sweep.y, [52.0, 58.0, 61.0])
    np.testing.assert_allclose(sweep.std, [2.0, 0.0, 1.0])
    baseline = series["CODA + P + FGH(eq8) (γ=0: no FGH)"]
    np.testing.assert_allclose(baseline.x, [0.0])
    np.testing.assert_allclose(baseline.y, [42.0])
    np.testing.assert_allclose(baseline.std, [2.0])

    with pytest.raises(figures.FigureSkipped, match=r"two or more values of fgh\.gamma"):
        figures.gamma_sensitivity_data(runs[2:4] + runs[5:])


def test_gamma_sensitivity_separates_the_two_fgh_forms(tmp_path) -> None:
    """The paper configs' form (appendix) and the Eq. 8 form are separate panels, the paper's
    first, each with the no-FGH level; below each, alpha at the clamp's upper bound."""
    appendix = {"granularity": "class", "direction": "adam", "clamp": [0, None]}
    runs = [
        make_results(seed=0, fgh={**appendix, "gamma": 1e-4}, ap=70.0, at_hi=0.0),
        make_results(seed=1, fgh={**appendix, "gamma": 1e-4}, ap=72.0, at_hi=0.1),
        make_results(seed=0, fgh={**appendix, "gamma": 1.0}, ap=60.0, at_hi=0.6),
        make_results(seed=0, fgh={"gamma": 1e-4}, ap=61.0, at_hi=0.0),
        make_results(seed=0, fgh={"gamma": 1.0}, ap=63.0, at_hi=0.0),
        make_results(seed=0, fgh=None, ap=59.0),
    ]
    data = figures.gamma_sensitivity_figure(runs, tmp_path / "fig3")
    assert_written(data, tmp_path / "fig3")
    clamp = figures.CLAMP_PANEL
    assert list(data.panels) == [APPENDIX, EQ8, clamp + APPENDIX, clamp + EQ8]
    assert data.meta["metric"] == "AP"
    ours = data.series(APPENDIX)
    assert set(ours) == {"CODA + P + FGH", "CODA + P + FGH (γ=0: no FGH)"}
    np.testing.assert_allclose(ours["CODA + P + FGH"].x, [1e-4, 1.0])
    np.testing.assert_allclose(ours["CODA + P + FGH"].y, [71.0, 60.0])
    np.testing.assert_allclose(ours["CODA + P + FGH (γ=0: no FGH)"].y, [59.0])
    np.testing.assert_allclose(data.series(EQ8)["CODA + P + FGH(eq8)"].y, [61.0, 63.0])
    np.testing.assert_allclose(data.series(EQ8)["CODA + P + FGH(eq8) (γ=0: no FGH)"].y, [59.0])
    (bound,) = data.panels[clamp + APPENDIX]
    np.testing.assert_allclose(bound.y, [0.05, 0.6])  # seeds averaged: (0 + 0.1) / 2
    np.testing.assert_allclose(bound.std, [0.05, 0.0])


def test_a_form_without_an_upper_bound_shows_its_final_alpha_below(tmp_path) -> None:
    """The paper's form clamps alpha only below, so no coefficient is ever at an upper bound: its
    lower panel shows the mean alpha at the stream's end instead (seeds averaged), while a
    bounded form keeps the fraction at its bound."""
    appendix = {"granularity": "class", "direction": "adam", "clamp": [0, None]}
    unbounded = {"at_hi": 0.0, "clamp_hi": None}
    runs = [
        make_results(seed=0, fgh={**appendix, "gamma": 1e-4}, final_alpha=2.0, **unbounded),
        make_results(seed=1, fgh={**appendix, "gamma": 1e-4}, final_alpha=4.0, **unbounded),
        make_results(seed=0, fgh={**appendix, "gamma": 1.0}, final_alpha=100.0, **unbounded),
        make_results(seed=0, fgh={"gamma": 1e-4}, at_hi=0.0, final_alpha=1.0),
        make_results(seed=0, fgh={"gamma": 1.0}, at_hi=0.5, final_alpha=10.0),
    ]
    data = figures.gamma_sensitivity_figure(runs, tmp_path / "fig3")
    assert_written(data, tmp_path / "fig3")
    alpha, clamp = figures.ALPHA_PANEL, figures.CLAMP_PANEL
    assert list(data.panels) == [APPENDIX, EQ8, alpha + APPENDIX, clamp + EQ8]
    (final,) = data.panels[alpha + APPENDIX]
    np.testing.assert_allclose(final.x, [1e-4, 1.0])
    np.testing.assert_allclose(final.y, [3.0, 100.0])
    np.testing.assert_allclose(final.std, [1.0, 0.0])
    (bound,) = data.panels[clamp + EQ8]
    np.testing.assert_allclose(bound.y, [0.0, 0.5])


def test_gamma_default_of_the_direction_counts_as_its_value() -> None:
    # direction "adam" defaults to gamma 1e-3: a run without gamma sits at x = 1e-3.
    runs = [
        make_results(fgh={"direction": "adam"}, ap=10.0),
        make_results(fgh={"direction": "adam", "gamma": 1.0}, ap=20.0),
    ]
    data = figures.gamma_sensitivity_data(runs)
    (title,) = data.panels  # neither named form: the options that differ from the paper's
    assert title == "FGH(granularity=element, clamp=[0.0, 10.0])"
    (sweep,) = data.panels[title]
    assert sweep.label == "CODA + P + FGH(granularity=element, clamp=[0.0, 10.0])"
    np.testing.assert_allclose(sweep.x, [1e-3, 1.0])
    np.testing.assert_allclose(sweep.y, [10.0, 20.0])


def test_accuracy_over_the_stream_by_hand(tmp_path) -> None:
    runs = [
        make_results(seed=0, stream="si_blurry", periodic=[(100, 10.0), (200, 20.0), (300, 30.0)]),
        make_results(seed=1, stream="si_blurry", periodic=[(100, 20.0), (200, 40.0)]),
    ]
    data = figures.accuracy_curve_figure(runs, tmp_path / "auc")
    assert_written(data, tmp_path / "auc")
    (curve,) = data.panels[""]
    np.testing.assert_array_equal(curve.x, [100, 200])  # the sample counts both seeds share
    np.testing.assert_allclose(curve.y, [15.0, 30.0])
    np.testing.assert_allclose(curve.std, [5.0, 10.0])
    assert data.markers == [250.0, 450.0]  # task ends, in stream samples
    with pytest.raises(figures.FigureSkipped, match="eval_period"):
        figures.accuracy_curve_data([make_results()])


def test_accuracy_matrix_heat_map_by_hand(tmp_path) -> None:
    # Results store acc[task][after task]; the heat map shows rows = after task l, columns = task k.
    first = [[90.0, 80.0, 70.0], [None, 85.0, 75.0], [None, None, 95.0]]
    second = [[80.0, 70.0, 60.0], [None, 75.0, 65.0], [None, None, 85.0]]
    runs = [make_results(seed=0, matrix=first), make_results(seed=1, matrix=second)]
    data = figures.accuracy_matrix_figure(runs, tmp_path / "heat")
    assert_written(data, tmp_path / "heat")
    (matrix,) = data.panels["CODA + P"]
    expected = [[85.0, NAN, NAN], [75.0, 80.0, NAN], [65.0, 70.0, 90.0]]
    np.testing.assert_allclose(matrix.y, expected)  # NaN above the diagonal: masked
    np.testing.assert_allclose(matrix.std[np.isfinite(matrix.std)], [5.0] * 6)
    np.testing.assert_array_equal(matrix.x, [1, 2, 3])


def one_full_run() -> dict:
    return make_results(
        g_n=[1.0, 0.5, 0.5],
        trace=[[1, 0, 0], [2, 0, 0], [1, 1, 0], [1, 2, 0], [1, 1, 1], [1, 1, 2]],
        periodic=[(100, 50.0), (300, 60.0), (500, 70.0)],
        matrix=[[90.0, 80.0, 70.0], [None, 85.0, 75.0], [None, None, 95.0]],
    )


def test_write_figures_from_a_single_results_file(tmp_path) -> None:
    skipped: dict[str, str] = {}
    written = figures.write_figures(
        [one_full_run()], tmp_path, on_skip=lambda name, why: skipped.update({name: why})
    )
    names = sorted(p.name for p in written)
    stems = [
        "accuracy_matrix",
        "accuracy_over_stream",
        "fig1_gradient_imbalance",
        "fig2_gradient_trace_task2",
        "gradient_trace_all_tasks",
    ]
    assert names == sorted(f"{s}.{ext}" for s in stems for ext in ("pdf", "png"))
    assert all(p.stat().st_size > 1000 for p in written)
    assert list(skipped) == ["gamma"] and "fgh.gamma" in skipped["gamma"]

    only = figures.write_figures([one_full_run()], tmp_path / "only", which=["heatmap"])
    assert [p.name for p in only] == ["accuracy_matrix.png", "accuracy_matrix.pdf"]
    with pytest.raises(ValueError, match="unknown figure"):
        figures.write_figures([one_full_run()], tmp_path, which=["fig9"])


def test_cli_figures(tmp_path, capsys) -> None:
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "a.results.json").write_text(json.dumps(one_full_run()))
    (folder / "b.partial.results.json").write_text(json.dumps(one_full_run()))  # skipped
    out = tmp_path / "figs"
    assert cli.main(["figures", str(folder), "--out", str(out), "--trace-task", "3"]) == 0
    captured = capsys.readouterr()
    assert "skipped gamma" in captured.err and "fgh.gamma" in captured.err
    assert (out / "fig2_gradient_trace_task3.pdf").is_file()
    assert len(captured.out.split()) == 10 and all(Path(p).is_file() for p in captured.out.split())

    assert cli.main(["figures", str(folder), "--out", str(out), "--which", "gamma"]) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["figures", str(empty), "--out", str(out)]) == 1
    assert "no results files found" in capsys.readouterr().err


def test_report_plot_writes_png_and_pdf(tmp_path) -> None:
    (tmp_path / "a.results.json").write_text(json.dumps(one_full_run()))
    assert cli.main(["report", str(tmp_path), "--plot", str(tmp_path / "fig1.png")]) == 0
    assert (tmp_path / "fig1.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "fig1.pdf").read_bytes()[:5] == b"%PDF-"


def test_missing_matplotlib_names_the_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(RuntimeError, match=r'pip install -e "\.\[plots\]"'):
        figures.gradient_imbalance_figure([one_full_run()], tmp_path / "fig1")


def test_session_stores_the_per_step_task_gradient_norms(tmp_path) -> None:
    """A real (tiny) run: G^k at each step is the mean of task k's classifier-row gradient norms
    in the sidecar trace, and its mean over the steps is the paper's G^k (Sec. 5.1)."""
    from test_report_demo import run_session

    path = run_session(tmp_path, seed=0, variant={"online_prototypes": True, "fgh": {"gamma": 1}})
    results = json.loads(path.read_text())
    imbalance = results["extra"]["gradient_imbalance"]
    per_class = np.load(path.parent / imbalance["trace_file"])  # steps x classes
    stored = np.array(imbalance["task_grad_norm_trace"])  # steps x tasks
    assert stored.shape == (results["counters"]["optimizer_steps"], 3)
    for k, task in enumerate(results["stream"]["tasks"]):
        by_hand = per_class[:, task["new_classes"]].mean(axis=1)
        np.testing.assert_allclose(stored[:, k], by_hand, rtol=5e-4)  # 4 significant digits
        assert stored[:, k].mean() == pytest.approx(imbalance["task_grad_norm"][k], rel=1e-3)
    assert stored[-1].min() > 0  # prototypes keep every seen task's rows training


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[16:24]  # IHDR: width, height (big-endian)
    return int.from_bytes(header[:4], "big"), int.from_bytes(header[4:], "big")


def test_rendered_figures_read_as_a_paper_needs(tmp_path) -> None:
    """Each figure drawn once, small: G^(k) not G^k, the dotted task ends named in the legend,
    the all-tasks grid no strip and with one legend, one labelled colorbar, no FGH wording over
    base runs, a repeated seed counted once (noted), no Type 3 font in any PDF."""
    fgh = dict(PAPER_FGH)
    runs = []
    for variant in (None, fgh):
        for seed, created in ((0, "a"), (1, "a"), (1, "b")):  # seed 1 twice: the newer counts
            results = make_results(
                seed=seed,
                fgh=variant,
                prototypes=variant is not None,
                g_n=[1.0, 0.5, 0.25, 0.5, 1.0],
                trace=[[1, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1]] * 7,
                periodic=[(200, 50.0), (600, 60.0), (1000, 70.0)],
                matrix=[
                    [62.5 if k == j else 50.0 if k < j else None for j in range(5)]
                    for k in range(5)
                ],
                task_samples=(200,) * 5,
            )
            results["created_utc"], results[figures.RESULTS_FILE] = created, f"{seed}{created}"
            runs.append(results)
    notes: list[str] = []
    written = figures.write_figures(runs, tmp_path, which=[], on_note=notes.append)
    assert notes == [
        "2 runs set aside (1a, 1a): a seed run more than once with the same hyperparameters "
        "counts once, by its newest complete run."
    ]
    grid = figures.gradient_trace_figure(runs, tmp_path / "grid")
    heat = figures.accuracy_matrix_figure(runs, tmp_path / "heat")
    base_only = figures.gradient_imbalance_figure(runs[:3], tmp_path / "base")
    mixed = figures.gradient_imbalance_figure(runs, tmp_path / "mixed")
    stream = figures.accuracy_curve_figure(runs, tmp_path / "stream")
    for data in (grid, heat, base_only, mixed, stream):
        width, height = _png_size(data.paths[0])
        assert width <= 2000 and height <= 2000 and max(width, height) / min(width, height) < 2.2
        assert b"/Type3" not in data.paths[1].read_bytes()  # pdf.fonttype 42: TrueType
    panels = grid.meta["drawn"]["panels"]
    assert [p["title"] for p in panels[:5]] == [f"task {k}: $G^{{({k})}}$" for k in range(1, 6)]
    legends = [p["legend"] for p in panels if p["legend"]]
    assert legends == [["CODA + P + FGH (2 runs)", "CODA base (2 runs)", figures.TASK_END_LABEL]]
    assert figures.TASK_END_LABEL in stream.meta["drawn"]["panels"][0]["legend"]
    bars = [p for p in heat.meta["drawn"]["panels"] if p["ylabel"] == "accuracy (%)"]
    assert len(bars) == 1  # one shared colorbar, labelled
    assert [p["title"] for p in heat.meta["drawn"]["panels"][:2]] == [
        "CODA + P + FGH (2 runs)",
        "CODA base (2 runs)",
    ]
    assert "FGH" not in base_only.meta["drawn"]["panels"][0]["title"]
    assert "FGH runs: after FGH's reweighting" in mixed.meta["drawn"]["panels"][0]["title"]
    assert written == []  # the note comes whatever is drawn


def test_cell_labels_round_half_away_from_zero() -> None:
    assert f"{62.5:.0f}" == "62"  # what the heat map printed before: half to even
    assert [figures.round_half_away(v) for v in (62.5, 63.5, 0.5, -2.5, 49.4)] == [
        63,
        64,
        1,
        -3,
        49,
    ]


def test_the_si_blurry_smoke_config_evaluates_along_the_stream() -> None:
    """The Si-Blurry smoke config (scripts/make_exps.py): the stream the issue found uncovered,
    with periodic evaluations, so a smoke run has A_auc and the accuracy-over-stream figure:
    synthetic_small streams 20 classes x 40 images = 800 samples, one evaluation every 100."""
    from pilot_online.engine.config import load_json, resolve_config

    root = Path(__file__).resolve().parent.parent
    config = resolve_config(load_json(root / "exps" / "smoke_coda_online_blurry.json"))
    assert (config["stream"], config["dataset"], config["eval_period"]) == (
        "si_blurry",
        "synthetic_small",
        100,
    )
    assert config["online_prototypes"] and config["fgh"] == PAPER_FGH
    assert config["device"] == [-1] and not config["pretrained"]


def _heading(data: figures.FigureData) -> str:
    """Every title a drawn figure shows: its figure title and each panel's."""
    drawn = data.meta["drawn"]
    return "\n".join([drawn["suptitle"], *(p["title"] for p in drawn["panels"])])


def test_every_figure_names_its_dataset_stream_lr_seeds_and_runs(tmp_path) -> None:
    """Before: a figure said what it plotted but not from which runs (issue 36)."""
    runs = []
    for seed in (0, 1, 2):
        for fgh in (None, dict(PAPER_FGH)):
            runs.append(
                make_results(
                    seed=seed,
                    lr=5e-5,
                    stream="si_blurry",
                    fgh=fgh,
                    g_n=[1.0, 0.5, 0.25],
                    trace=[[1, 0, 0], [2, 1, 0], [1, 2, 1]],
                    periodic=[(100, 50.0), (300, 60.0)],
                    matrix=[[90.0, 80.0, 70.0], [None, 85.0, 75.0], [None, None, 95.0]],
                )
            )
    subject = "dataset CIFAR100; Si-Blurry stream; LR 5e-5; seeds 0-2; n = 6 runs (3 per curve)"
    drawn = [
        figures.gradient_imbalance_figure(runs, tmp_path / "fig1"),
        figures.gradient_trace_figure(runs, tmp_path / "fig2", tasks=[2]),
        figures.gradient_trace_figure(runs, tmp_path / "grid"),
        figures.accuracy_curve_figure(runs, tmp_path / "auc"),
        figures.accuracy_matrix_figure(runs, tmp_path / "heat"),
    ]
    for data in drawn:
        assert subject in _heading(data), (data.name, _heading(data))

    sweep = [
        make_results(seed=seed, lr=5e-3, fgh={"gamma": gamma}, ap=50.0 + gamma)
        for seed in (0, 1)
        for gamma in (1e-3, 1.0)
    ]
    gamma = figures.gamma_sensitivity_figure(sweep, tmp_path / "fig3")
    assert _heading(gamma).startswith(
        "Sensitivity to γ (AP), by FGH form\n"
        "dataset CIFAR100; clear stream; LR 5e-3; seeds 0, 1; n = 4 runs"
    )
    # Runs that differ in dataset facts list every value (the legend tells the curves apart).
    mixed = [
        make_results(seed=s, lr=lr, g_n=[1.0, 0.5, 0.5]) for s in (0, 1) for lr in (5e-5, 5e-3)
    ]
    mixed.append(make_results(seed=7, lr=5e-3, stream="si_blurry", g_n=[1.0, 0.5, 0.5]))
    heading = _heading(figures.gradient_imbalance_figure(mixed, tmp_path / "mixed"))
    assert (
        "dataset CIFAR100; Si-Blurry, clear streams; LRs 5e-5, 5e-3; seeds 0, 1, 7; "
        "n = 5 runs (1-2 per curve)"
    ) in heading
    assert "1 run" in figures.subject_line(mixed[:1]) and "1 runs" not in figures.subject_line(
        mixed[:1]
    )


def test_the_gradient_figures_define_g_k_in_a_caption(tmp_path) -> None:
    """G^(k) as the paper defines it (Sec. 5.1) and as the code computes it, under each
    gradient figure; tasks counted from 1 in every label."""
    run = one_full_run()
    trace = figures.gradient_trace_figure([run], tmp_path / "fig2", tasks=[2])
    grid = figures.gradient_trace_figure([run], tmp_path / "grid")
    bars = figures.gradient_imbalance_figure([run], tmp_path / "fig1")
    for data, caption in ((trace, figures.TRACE_CAPTION), (grid, figures.TRACE_CAPTION),
                          (bars, figures.IMBALANCE_CAPTION)):  # fmt: skip
        (drawn,) = data.meta["drawn"]["captions"]
        assert " ".join(drawn.split()) == " ".join(caption.split())
        text = " ".join(drawn.split())
        assert (
            "the mean, over task k's classes (those first seen in task k), of the norm of the loss "
            "gradient on each class's weights in the last (classifier) layer, bias included" in text
        )
        assert "Tasks are numbered from 1" in text
    (panel,) = trace.meta["drawn"]["panels"]
    assert panel["title"].startswith("task 2: $G^{(2)}$\n")
    assert panel["ylabel"] == "$G^{(2)}$ (gradient norm)"
    titles = [p["title"] for p in grid.meta["drawn"]["panels"] if p["title"]]
    assert titles == ["task 1: $G^{(1)}$", "task 2: $G^{(2)}$", "task 3: $G^{(3)}$"]
    assert bars.meta["drawn"]["panels"][0]["xlabel"] == "task k"
    np.testing.assert_array_equal(bars.series()["CODA + P"].x, [1, 2, 3])

"""Live logging (``"logger": "tensorboard"``): the event file read back holds the run's own step
statistics, FGH's alphas and the evaluations; with the key off nothing changes and TensorBoard
is never imported; without TensorBoard installed the run stops before training, saying what to
install."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    TEST_VIT_DEPTH,
    TinyAdapter,
    TinyNet,
    VectorSource,
    offline_env,
    requires_pilot,
)

from pilot_online.core.fgh import FineGrainedHypergradients
from pilot_online.core.fgh_stats import alpha_statistics
from pilot_online.core.streams import clear_stream
from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.session import OnlineSession

C, D_IN = 6, 5
ROOT = Path(__file__).resolve().parent.parent


def block_tensorboard(monkeypatch) -> None:
    """Make ``import tensorboard`` (and torch's writer module) fail, as if not installed."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def tiny_session(tmp_path: Path, extra: dict | None = None, seed: int = 0) -> OnlineSession:
    """3 tasks of 2 classes, 10 training samples per class, batch 4: 15 stream batches."""
    generator = torch.Generator().manual_seed(100)
    train_y, test_y = np.repeat(np.arange(C), 10), np.repeat(np.arange(C), 5)
    centers = 1.5 * torch.randn(C, D_IN, generator=generator)
    train_x = centers[train_y] + torch.randn(len(train_y), D_IN, generator=generator)
    test_x = centers[test_y] + torch.randn(len(test_y), D_IN, generator=generator)
    stream = clear_stream(train_y, init_cls=2, increment=2, batch_size=4, seed=0)
    config = {
        "model_name": "tiny_online",
        "dataset": "blobs",
        "init_lr": 0.05,
        "optimizer": "adam",
        "seed": seed,
        "online_prototypes": True,
        "fgh": {"gamma": 1.0},
        "log_interval": 4,
        "eval_period": 12,
        **(extra or {}),
    }
    torch.manual_seed(seed)
    adapter = TinyAdapter(args=config)
    loop = build_loop(adapter, TinyNet(), config, C)
    source = VectorSource(train_x, train_y, test_x, test_y)
    tmp_path.mkdir(parents=True, exist_ok=True)
    return OnlineSession(loop, stream, source, config, tmp_path / "tiny.results.json", False)


def run_all(session: OnlineSession) -> tuple[dict, list[dict]]:
    evaluations = []
    for task in range(session.stream.num_tasks):
        session.train_task(task)
        evaluations.append(session.evaluate_task_end(task))
    return session.write(), evaluations


def record_steps(session: OnlineSession) -> list[dict]:
    """Wrap the loop's train_step to keep what each step reports, read independently."""
    recorded, step = [], session.loop.train_step

    def train_step(*args, **kwargs):
        stats = step(*args, **kwargs)
        terms = {name: t.item() for name, t in stats.terms.items()}
        recorded.append({"loss": stats.loss.item(), "correct": stats.correct.item(), **terms})
        recorded[-1]["samples"] = stats.samples
        recorded[-1]["online"] = stats.online_correct.item()
        return stats

    session.loop.train_step = train_step
    return recorded


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_event_file_holds_the_runs_own_numbers(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    logs = tmp_path / "tb"
    session = tiny_session(
        tmp_path, {"logger": "tensorboard", "logger_dir": str(logs), "online_accuracy": True}
    )
    recorded = record_steps(session)
    results, evaluations = run_all(session)
    log_dir = logs / "tiny"  # <logger_dir>/<results file stem>
    assert list(log_dir.glob("events.out.tfevents.*"))
    scalars = read_scalars(log_dir)

    # One point per stream batch: 60 samples in batches of 4 (no batch crosses a task end).
    batches = sum(math.ceil(t["num_samples"] / 4) for t in results["stream"]["tasks"])
    assert batches == len(recorded) == 15
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps == list(range(1, batches + 1))
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [r["loss"] for r in recorded])
    for term in ("ce", "prototypes"):
        logged = [v for _, v in scalars[f"train/loss_{term}"]]
        np.testing.assert_allclose(logged, [r[term] for r in recorded], rtol=1e-6)
    correct = np.cumsum([r["correct"] for r in recorded])
    samples = np.cumsum([r["samples"] for r in recorded])
    running = [v for _, v in scalars["train/running_accuracy"]]
    np.testing.assert_allclose(running, 100 * correct / samples, rtol=1e-6)
    assert correct[-1] > 0  # a run that learns something: the check above is not 0 == 0
    online = np.cumsum([r["online"] for r in recorded])  # A_online: predicted before each step
    np.testing.assert_allclose(
        [v for _, v in scalars["online/A_online"]], 100 * online / samples, rtol=1e-6
    )
    assert results["metrics"]["A_online"] == pytest.approx(100 * online[-1] / samples[-1])

    # FGH's alphas: logged every log_interval (4) steps and at each task end (5, 10, 15); the
    # last point is the final state, whose mean, min and max are worked out from the alphas.
    alpha = torch.cat([a.flatten() for a in session.loop.fgh.coefficients().values()]).double()
    assert [s for s, _ in scalars["fgh/alpha_mean"]] == [4, 5, 8, 10, 12, 15]
    assert scalars["fgh/alpha_mean"][-1][1] == pytest.approx(alpha.mean().item(), rel=1e-6)
    assert scalars["fgh/alpha_min"][-1][1] == pytest.approx(alpha.min().item(), rel=1e-6)
    assert scalars["fgh/alpha_max"][-1][1] == pytest.approx(alpha.max().item(), rel=1e-6)
    assert alpha.min() != alpha.max()  # the alphas moved

    # Gradient imbalance at the end: G^k_n from the run's mean class-row gradient norms g^j.
    g = np.array(results["extra"]["gradient_imbalance"]["class_mean_grad_norm"])
    task_norms = np.array([g[t["new_classes"]].mean() for t in results["stream"]["tasks"]])
    for k in range(3):
        last = scalars[f"gradient_imbalance/G_n/task_{k + 1}"][-1]
        assert last[0] == 15 and last[1] == pytest.approx(task_norms[k] / task_norms.max())
    assert scalars["gradient_imbalance/max_over_mean"][-1][1] == pytest.approx(g.max() / g.mean())

    # Evaluations, at the step they followed: task ends after 5, 10, 15 batches; periodic
    # every 12 samples (3 batches).
    ends = [(s, v) for s, v in scalars["eval/accuracy"]]
    assert ends == [(5 * (k + 1), pytest.approx(e["top1"])) for k, e in enumerate(evaluations)]
    periodic = results["extra"]["periodic_evaluations"]
    assert [s for s, _ in scalars["eval/periodic_accuracy"]] == [3 * (i + 1) for i in range(5)]
    logged = [v for _, v in scalars["eval/periodic_accuracy"]]
    np.testing.assert_allclose(logged, [p["accuracy"] for p in periodic], rtol=1e-6)
    assert scalars["eval/task_1"][-1] == (15, pytest.approx(evaluations[-1]["grouped"]["task-00"]))

    # Logging only reads: the same run without it measures exactly the same.
    quiet, _ = run_all(tiny_session(tmp_path / "quiet", {"online_accuracy": True}))
    assert json.dumps(comparable(quiet)) == json.dumps(comparable(results))


def comparable(results: dict) -> dict:
    """Everything a run measured, without wall-clock numbers and the config itself."""
    return {k: v for k, v in results.items() if k not in ("created_utc", "timing", "config")}


def test_logger_off_changes_nothing_and_imports_nothing(tmp_path, monkeypatch) -> None:
    block_tensorboard(monkeypatch)  # any import of TensorBoard would fail the runs below
    without, _ = run_all(tiny_session(tmp_path / "a"))
    session = tiny_session(tmp_path / "b", {"logger": None, "logger_dir": str(tmp_path / "tb")})
    assert session.live_log is None
    with_null, _ = run_all(session)
    assert json.dumps(comparable(without)) == json.dumps(comparable(with_null))
    assert not (tmp_path / "tb").exists()


def test_missing_tensorboard_stops_before_training(tmp_path, monkeypatch) -> None:
    block_tensorboard(monkeypatch)
    raw = {**load_json(ROOT / "exps" / "smoke_coda_online.json"), "logger": "tensorboard"}
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        resolve_config(raw)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        tiny_session(tmp_path, {"logger": "tensorboard", "logger_dir": str(tmp_path / "tb")})


def test_logger_key_is_validated() -> None:
    raw = load_json(ROOT / "exps" / "smoke_coda_online.json")
    with pytest.raises(ConfigError, match=r"tensorbord.*did you mean 'tensorboard'"):
        resolve_config({**raw, "logger": "tensorbord"})
    with pytest.raises(ConfigError, match="logger_dir must be null or a folder"):
        resolve_config({**raw, "logger_dir": 3})
    assert resolve_config(raw)["logger"] is None


def test_alpha_statistics_by_hand() -> None:
    layer = torch.nn.Linear(2, 2)
    fgh = FineGrainedHypergradients(layer.named_parameters())
    (before,) = alpha_statistics(fgh)  # no step yet: every alpha is its starting 1
    assert [before[k].item() for k in ("mean", "std", "min", "max")] == [1.0, 0.0, 1.0, 1.0]
    layer(torch.ones(1, 2)).sum().backward()
    fgh.step()
    fgh.state[layer.weight]["alpha"] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    fgh.state[layer.bias]["alpha"] = torch.tensor([5.0, 6.0])
    (stats,) = alpha_statistics(fgh)
    # Six alphas 1..6: mean 3.5, population variance 17.5 / 6.
    assert stats["mean"].item() == pytest.approx(3.5)
    assert stats["std"].item() == pytest.approx(math.sqrt(17.5 / 6))
    assert (stats["min"].item(), stats["max"].item()) == (1.0, 6.0)

    # Class granularity: one alpha per row, shared by the weight row and its bias entry.
    per_class = FineGrainedHypergradients(layer.named_parameters(), granularity="class")
    layer.zero_grad()
    layer(torch.ones(1, 2)).sum().backward()
    per_class.step()
    per_class.state[layer.weight]["alpha"] = torch.tensor([2.0, 4.0])
    (stats,) = alpha_statistics(per_class)
    assert (stats["mean"].item(), stats["std"].item()) == (3.0, 1.0)


@requires_pilot
def test_pilot_run_logs_live_and_draws_every_figure_from_its_results(pilot, tmp_path) -> None:
    """One CODA + P + FGH run through PILOT's main.py on a Si-Blurry stream with periodic
    evaluations: its event file sits beside its results file, and that single results file
    gives every figure but the gamma sweep."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    pytest.importorskip("matplotlib", reason="pip install matplotlib")
    from pilot_online.core.results import load_results
    from pilot_online.harness.figures import write_figures

    config = load_json(ROOT / "exps" / "smoke_coda_online.json")
    config.update(
        dataset="synthetic_tiny",
        batch_size=40,
        eval_batch_size=40,
        stream="si_blurry",
        eval_period=80,
        log_interval=2,
        results_dir=str(tmp_path / "results"),
        logger="tensorboard",
        vit_depth=TEST_VIT_DEPTH,
    )
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "main.py", "--config", str(config_path)],
        cwd=pilot,
        env=offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (results_file,) = (tmp_path / "results").glob("*.results.json")
    results = load_results(results_file)
    log_dir = results_file.with_name(results_file.name.replace(".results.json", ".tensorboard"))
    scalars = read_scalars(log_dir)
    steps = results["counters"]["optimizer_steps"]
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, steps + 1))
    assert len(scalars["eval/accuracy"]) == results["stream"]["num_tasks"]
    periodic = [p["accuracy"] for p in results["extra"]["periodic_evaluations"]]
    np.testing.assert_allclose([v for _, v in scalars["eval/periodic_accuracy"]], periodic)
    assert scalars["fgh/alpha_max"][-1][1] > 1.0 or scalars["fgh/alpha_min"][-1][1] < 1.0

    skipped: list[str] = []
    written = write_figures([results], tmp_path / "figures", on_skip=lambda n, _: skipped.append(n))
    assert skipped == ["gamma"] and len(written) == 10
    assert all(path.stat().st_size > 1000 for path in written)

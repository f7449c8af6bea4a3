"""End-to-end runs through a real, patched PILOT checkout (``PILOT_ROOT``, commit 5240714).

Every run goes through PILOT's own ``main.py`` (via ``pilot_driver.py``, which adds probes) in a
patched temporary copy of the checkout, on the synthetic dataset at 32 px with random weights.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import copy_pilot, offline_env, requires_pilot

from pilot_online.core.results import load_results
from pilot_online.engine.config import load_json

pytestmark = requires_pilot
HERE = Path(__file__).resolve().parent
EXPS = HERE.parent / "exps"
DRIVER = HERE / "pilot_driver.py"
METHODS = ("coda", "l2p", "dualprompt")


def tiny_config(method: str, variant: str, stream: str, results_dir: Path) -> dict:
    config = load_json(EXPS / f"smoke_{method}_online.json")
    config.update(
        dataset="synthetic_tiny",
        init_cls=4,
        increment=4,
        batch_size=40,
        eval_batch_size=40,
        stream=stream,
        prefix=f"{variant}_{stream}",
        results_dir=str(results_dir),
    )
    if variant == "base":
        config.update(online_prototypes=False, fgh=None)
    if stream == "si_blurry":
        config["eval_period"] = 80
    return config


def run(command: list[str], cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """``python COMMAND`` in ``cwd``, offline, with its output captured."""
    return subprocess.run(
        [sys.executable, *command],
        cwd=cwd,
        env=offline_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=900,
    )


def write_config(config: dict, path: Path) -> Path:
    path.write_text(json.dumps(config))
    return path


def run_driver(pilot: Path, config: dict, tmp_path: Path) -> tuple[dict, dict]:
    config_path = write_config(config, tmp_path / "config.json")
    report_path = tmp_path / "report.json"
    done = run([str(DRIVER), str(config_path), str(report_path)], pilot, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    return report, load_results(report["results_path"])


def assert_single_pass(results: dict, batch_size: int = 40) -> list[int]:
    """One pass: every streamed sample once, one optimizer step per batch, no skipped step.
    Returns the segment sizes."""
    counters = results["counters"]
    sizes = [t["num_samples"] for t in results["stream"]["tasks"]]
    assert counters["samples_seen"] == counters["stream_length"] == sum(sizes) > 0
    assert counters["optimizer_steps"] == sum(math.ceil(n / batch_size) for n in sizes)
    assert counters["skipped_nonfinite_steps"] == 0
    return sizes


@pytest.mark.parametrize("stream", ["clear", "si_blurry"])
@pytest.mark.parametrize("variant", ["base", "p_fgh"])
@pytest.mark.parametrize("method", METHODS)
def test_online_run_through_pilot_main(pilot, tmp_path, method, variant, stream):
    config = tiny_config(method, variant, stream, tmp_path / "results")
    report, results = run_driver(pilot, config, tmp_path)
    tasks = results["stream"]["tasks"]
    sizes = assert_single_pass(results)

    # Task-free: no upstream task-boundary hook ran, no task id reached a prompt network.
    assert report["boundary_calls"] == []
    assert set(report["task_ids"]) <= {-1}
    assert report["learner_calls"] == ["eval_task"] * 2

    # Prompts and classifier trained; every frozen parameter is untouched.
    changed = report["changed"]
    trainable = {n for n, c in changed.items() if c["trainable"]}
    assert trainable and all(changed[n]["changed"] for n in trainable), trainable
    assert not [n for n, c in changed.items() if not c["trainable"] and c["changed"]]
    prompt_names = [n for n in trainable if "prompt" in n or n.startswith("prompt.")]
    classifier_names = [n for n in trainable if n.endswith(("head.weight", "fc.weight"))]
    assert prompt_names and classifier_names

    # The results file holds the full 2 x 2 accuracy matrix and the paper's metrics.
    matrix = results["metrics"]["accuracy_matrix"]
    assert len(matrix) == 2 and all(len(row) == 2 for row in matrix)
    assert matrix[1][0] is None
    new_classes = [t["new_classes"] for t in tasks]
    for task in range(2):
        for after in range(task, 2):
            assert (matrix[task][after] is not None) == bool(new_classes[task])
    assert results["metrics"]["AP"] is not None and results["metrics"]["A_T"] is not None
    if stream == "si_blurry":
        assert len(results["extra"]["periodic_evaluations"]) == sum(sizes) // 80
        assert results["metrics"]["A_auc"] is not None

    diagnostics = results["extra"]["diagnostics"]
    if variant == "p_fgh":
        alphas = diagnostics["fgh"]["alpha"]
        assert alphas and any(a["min"] != 1.0 or a["max"] != 1.0 for a in alphas.values())
        assert diagnostics["prototypes"]["samples"] == sum(sizes)
    else:
        assert "fgh" not in diagnostics and "prototypes" not in diagnostics


def test_paper_config_fails_only_for_missing_data(pilot, tmp_path):
    done = run(["main.py", "--config", "exps/coda_online_fgh.json"], pilot, tmp_path)
    assert done.returncode != 0
    assert "DatasetUnavailableError: dataset 'cifar224' could not be loaded" in done.stderr
    assert "cifar-100-python" in done.stderr


def test_missing_weights_say_what_to_do(pilot, tmp_path):
    config = tiny_config("coda", "base", "clear", tmp_path / "results")
    config["pretrained"] = True
    config_path = write_config(config, tmp_path / "weights.json")
    done = run(["main.py", "--config", str(config_path)], pilot, tmp_path)
    assert done.returncode != 0
    assert "WeightsUnavailableError" in done.stderr and "pretrained_path" in done.stderr


def test_cli_run_from_elsewhere_writes_one_results_file_per_seed(pilot, tmp_path):
    config = tiny_config("coda", "base", "clear", tmp_path / "results")
    config["seed"] = [1, 2, 1]  # seed 1 twice: reproducible, and the rerun keeps both files
    config_path = write_config(config, tmp_path / "seeds.json")
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    done = run(
        ["-m", "pilot_online.cli", "run", "--config", str(config_path), "--pilot-root", str(pilot)],
        workdir,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted((tmp_path / "results").glob("*.results.json"), key=lambda f: f.stat().st_mtime)
    results = [load_results(f) for f in files]
    assert [r["config"]["seed"] for r in results] == [1, 2, 1]
    assert files[0].name != files[2].name  # the first seed-1 run was not overwritten
    first, rerun = results[0], results[2]
    assert first["metrics"] == rerun["metrics"]  # same seed, same numbers on CPU
    assert first["stream"] == rerun["stream"]
    assert first["counters"] == rerun["counters"]
    assert (workdir / "logs").is_dir()  # PILOT's log folder follows the working directory


def test_cli_run_refuses_an_unpatched_checkout(tmp_path):
    unpatched = copy_pilot(tmp_path / "LAMDA-PILOT")
    done = run(
        [
            "-m",
            "pilot_online.cli",
            "run",
            "--config",
            str(EXPS / "smoke_coda_online.json"),
            "--pilot-root",
            str(unpatched),
        ],
        tmp_path,
        tmp_path,
    )
    assert done.returncode == 2
    assert "pilot-online setup" in done.stderr

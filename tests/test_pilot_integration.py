"""End-to-end runs through a real, patched PILOT checkout (``PILOT_ROOT``, commit 5240714).

Every run goes through PILOT's own ``main.py`` (via ``pilot_driver.py``, which adds probes) in a
patched temporary copy of the checkout, on the synthetic dataset at 32 px with random weights.
Every registered method runs (clear, base) and (Si-Blurry, + P + FGH) in test_contract.py, with
the checks of :func:`check_online_run`; the method files (test_pilot_baselines.py, ...) add their
own checks to the same runs (conftest's ``pilot_main_run`` makes each once per session). Here:
what the prompt methods train, and the command-line and failure paths.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import copy_pilot, offline_env, raw_smoke_config, requires_pilot, vit_depth_for_tests

from pilot_online.core.results import load_results
from pilot_online.engine.registry import get_method

pytestmark = requires_pilot
HERE = Path(__file__).resolve().parent
EXPS = HERE.parent / "exps"
DRIVER = HERE / "pilot_driver.py"
#: Tiny-stream replay for the memory-based rows: the stream has 160 samples, so the reservoir
#: fills, then replaces.
MEMORY, REPLAYED = 60, 20


def tiny_config(method: str, variant: str, stream: str, results_dir: Path) -> dict:
    """The method's smoke config on ``synthetic_tiny`` (2 tasks of 4 classes, 160 samples in 4
    batches of 40), at the tests' ViT depth. ``variant``: ``base`` (P and FGH off) or ``p_fgh``
    (the smoke config's + P + FGH)."""
    config = raw_smoke_config(f"{method.removesuffix('_online')}_online")
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
    config["vit_depth"] = vit_depth_for_tests(config)
    if variant == "base":
        config.update(online_prototypes=False, fgh=None)
    if stream == "si_blurry":
        config["eval_period"] = 80
    if config.get("er_memory_size", 0) > 0:
        config.update(er_memory_size=MEMORY, er_batch_size=REPLAYED)
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
    (made,) = run_drivers(pilot, [(config, tmp_path)])
    assert not isinstance(made, str), made
    return made


def run_drivers(pilot: Path, runs: list[tuple[dict, Path]]) -> list[tuple[dict, dict] | str]:
    """(report, results) of each (config, folder) through ``main.py``, in turn, in one driver
    process (the imports, torch, timm and PILOT, take about 6 s on 2 cores: paid once), or, for
    a run that failed, what it printed and its traceback."""
    command = [str(DRIVER)]
    for config, folder in runs:
        command += [str(write_config(config, folder / "config.json")), str(folder / "report.json")]
    done = run(command, pilot, runs[0][1])
    output = done.stdout[-3000:] + done.stderr[-3000:]
    made: list[tuple[dict, dict] | str] = []
    for _, folder in runs:
        path = folder / "report.json"
        report = json.loads(path.read_text()) if path.exists() else {"error": "no report"}
        if "error" in report:
            made.append(f"{output}\n{folder.name}: {report['error']}")
        else:
            made.append((report, load_results(report["results_path"])))
    return made


def assert_single_pass(
    results: dict, batch_size: int = 40, trains: bool = True, until: int | None = None
) -> list[int]:
    """One pass: every streamed sample once, one optimizer step per batch (none for a method
    that trains nothing; with ``until``, a stream position, only for the batches that end at or
    before it), no skipped step. Returns the segment sizes."""
    counters = results["counters"]
    sizes = [t["num_samples"] for t in results["stream"]["tasks"]]
    assert counters["samples_seen"] == counters["stream_length"] == sum(sizes) > 0
    ends = [
        sum(sizes[:i]) + min(b + batch_size, n)
        for i, n in enumerate(sizes)
        for b in range(0, n, batch_size)
    ]
    steps = sum(until is None or end <= until for end in ends) if trains else 0
    assert counters["optimizer_steps"] == steps
    assert counters["skipped_nonfinite_steps"] == 0
    return sizes


def check_online_run(report: dict, results: dict, method: str, variant: str, stream: str) -> None:
    """What every method's run through ``main.py`` must show (test_contract.py): one task-free
    pass, a learned model, the paper's metrics, and the diagnostics of its variant."""
    adapter = get_method(f"{method.removesuffix('_online')}_online")
    tasks = results["stream"]["tasks"]
    changed = report["changed"]
    trainable = {n for n, c in changed.items() if c["trainable"]}
    # A method that trains a first session and then learns in observe() (RanPAC, FeCAM) freezes
    # everything at the trigger's first firing: its optimizer steps end with that batch.
    first_session = adapter.trains and not trainable
    until = None
    if first_session:
        firings = results["extra"]["diagnostics"].get("consolidation", {}).get("firings")
        assert firings, "every parameter ends frozen, but no consolidation fired"
        until = firings[0]
    sizes = assert_single_pass(results, trains=adapter.trains, until=until)

    # Task-free: no upstream task-boundary hook ran, no task id reached a prompt network.
    assert report["boundary_calls"] == []
    assert set(report["task_ids"]) <= {-1}
    assert report["learner_calls"] == ["eval_task"] * 2

    # The model learned: every trainable parameter moved, the classifier among them; a method
    # that trains nothing learned in its buffers (SimpleCIL's class means); a first session
    # moved the parameters it trained (what a method learns afterwards lives outside them).
    if first_session:
        assert any(c["changed"] for c in changed.values())
        assert all(changed[n]["changed"] for n in report["classifier"]), report["classifier"]
    elif adapter.trains:
        assert trainable and all(changed[n]["changed"] for n in trainable), trainable
        assert set(report["classifier"]) <= trainable, report["classifier"]
    else:
        assert not trainable and any(report["buffers_changed"].values())

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


@pytest.mark.parametrize("method", ["coda", "l2p", "dualprompt"])
def test_prompt_methods_train_prompts_and_head_only(pilot_main_run, method):
    """PILOT's prompt networks: prompts and classifier trained, every frozen parameter untouched
    (the contract suite's runs, read again)."""
    for variant, stream in (("base", "clear"), ("p_fgh", "si_blurry")):
        report, _ = pilot_main_run(method, variant, stream)
        changed = report["changed"]
        trainable = {n for n, c in changed.items() if c["trainable"]}
        assert not [n for n, c in changed.items() if not c["trainable"] and c["changed"]]
        prompt_names = [n for n in trainable if "prompt" in n or n.startswith("prompt.")]
        classifier_names = [n for n in trainable if n.endswith(("head.weight", "fc.weight"))]
        assert prompt_names and classifier_names


def test_paper_config_fails_only_for_missing_data(pilot, tmp_path):
    done = run(["main.py", "--config", "exps/coda_online_fgh.json"], pilot, tmp_path)
    assert done.returncode != 0
    # The message alone, without a traceback (issue 30).
    assert "pilot-online: dataset 'cifar224' could not be loaded" in done.stderr
    assert "cifar-100-python" in done.stderr and "Traceback" not in done.stderr


def test_missing_weights_say_what_to_do(pilot, tmp_path):
    config = tiny_config("coda", "base", "clear", tmp_path / "results")
    config["pretrained"] = True
    config_path = write_config(config, tmp_path / "weights.json")
    done = run(["main.py", "--config", str(config_path)], pilot, tmp_path)
    assert done.returncode != 0
    assert "pretrained_path" in done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr  # the message alone (issue 30)


def test_cli_run_trains_each_seed_once_and_a_rerun_trains_none(pilot, tmp_path):
    """PILOT runs every seed of a config in one process: a seed whose results are complete for
    this config is not trained again (no timestamped copy), and PILOT's trainer still gets its
    evaluations. A run from another folder logs there."""
    config = tiny_config("coda", "base", "clear", tmp_path / "results")
    config["seed"] = [1]
    config_path = write_config(config, tmp_path / "seeds.json")
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    command = ["-m", "pilot_online.cli", "run", "--config", str(config_path)]
    command += ["--pilot-root", str(pilot)]
    alone = run(command, workdir, tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    config["seed"] = [1, 2]  # seed 1 again: its turn finds its results complete
    write_config(config, config_path)
    done = run(command, workdir, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / "results"
    names = [f"base_clear_{seed}_{config['backbone_type']}.results.json" for seed in (1, 2)]
    assert sorted(f.name for f in folder.glob("*.results.json")) == names
    output = done.stdout + done.stderr
    assert output.count("not training it again") == 1
    # PILOT's trainer printed the skipped seed's stored accuracies: those of seed 1's own run.
    first = [line for line in alone.stdout.splitlines() if line.startswith("Average Accuracy")]
    printed = [line for line in done.stdout.splitlines() if line.startswith("Average Accuracy")]
    assert len(first) == 2 and len(printed) == 4  # 2 tasks x 2 seed turns
    assert printed[:2] == first
    # pilot-online run logs warnings only, yet the trained seed's closing line reaches stdout.
    closing = [line for line in alone.stdout.splitlines() if line.startswith("AP ")]
    assert len(closing) == 1 and "the paper's metric" in closing[0]
    assert (workdir / "logs").is_dir()  # PILOT's log folder follows the working directory

    # The same command again: every seed is complete, nothing is trained or written.
    before = {f.name: f.read_bytes() for f in folder.iterdir()}
    again = run(command, workdir, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (again.stdout + again.stderr).count("not training it again") == 2
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == before

    # Reproducible: seed 1 trained again under another prefix gives the same numbers on CPU.
    config.update(seed=[1], prefix="again")
    write_config(config, config_path)
    third = run(command, workdir, tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    first = load_results(folder / names[0])
    rerun = load_results(folder / names[0].replace("base_clear", "again"))
    assert first["metrics"] == rerun["metrics"]
    assert first["stream"] == rerun["stream"]
    assert first["counters"] == rerun["counters"]


def test_pilot_smoke_run_on_the_test_device(pilot_main_run, pilot, tmp_path, device):
    """One end-to-end run through PILOT's main.py on each test device (CODA, Si-Blurry, + P +
    FGH). On the CPU it is the contract suite's run, made once per session: no extra cost."""
    if device.type == "cpu":
        report, results = pilot_main_run("coda", "p_fgh", "si_blurry")
    else:
        config = tiny_config("coda", "p_fgh", "si_blurry", tmp_path / "results")
        config["device"] = [str(device.index or 0)]
        report, results = run_driver(pilot, config, tmp_path)
    check_online_run(report, results, "coda", "p_fgh", "si_blurry")
    assert f"type='{device.type}'" in results["config"]["device"]
    # What the numbers depend on beyond config and code (docs/gpu.md: the CPU's thread count).
    environment = results["environment"]
    assert environment["torch"] == torch.__version__ and environment["numpy"] == np.__version__
    assert isinstance(environment["threads"], int) and environment["threads"] >= 1
    assert environment["device"].split(":")[0] == device.type
    assert (environment["accelerator"] is None) == (device.type == "cpu")
    if device.type == "cuda":
        assert results["timing"]["peak_memory_bytes"] > 0
        trace = results["extra"]["gradient_imbalance"]["trace_file"]
        assert np.load(Path(report["results_path"]).with_name(trace)).dtype == np.float32


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

"""Sweep engines: the local pool and Ray run the same runs to the same table, retry failures,
survive a lost Ray worker, and a restarted sweep skips finished runs.

The Ray tests start their own local Ray instance (2 CPUs, no dashboard) and shut it down after.
The end-to-end sweeps run two tiny linear-probe runs through a patched copy of PILOT.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import offline_env

from pilot_online.engine.config import ConfigError, load_json
from pilot_online.harness import engines, points, sweep
from pilot_online.harness.report import METRIC_COLUMNS, collect, format_table

EXPS = Path(__file__).resolve().parent.parent / "exps"
RAY_REASON = 'Ray is not installed: pip install -e ".[ray]" to run the Ray-engine tests'


def tiny_base(path: Path) -> Path:
    """The cheapest real run: a linear probe on synthetic_tiny (8 classes, 2 segments)."""
    config = load_json(EXPS / "smoke_linear_probe_online.json")
    config.update(dataset="synthetic_tiny", batch_size=40, eval_batch_size=40)
    path.write_text(json.dumps(config))
    return path


def sweep_args(base: Path, out: Path, pilot: Path | None, **engine) -> argparse.Namespace:
    return argparse.Namespace(
        config=base,
        grid=["variant=base,fgh"],
        out=out,
        pilot_root=str(pilot) if pilot else None,
        dry_run=False,
        **engine,
    )


def run_sweep(args: argparse.Namespace) -> tuple[int, str]:
    """``sweep.run_sweep`` with its stdout captured."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = sweep.run_sweep(args)
    return code, printed.getvalue()


def table_rows(out: Path) -> list[tuple]:
    """The comparable part of each row: labels and metrics (not file paths)."""
    keys = ("method", "dataset", "stream", "lr", "variant", "seed", *METRIC_COLUMNS)
    return sorted(tuple(row[k] for k in keys) for row in collect([out / "results"]))


def tries(log: Path) -> int:
    return log.read_text().count("=== pilot-online sweep:")


def script_job(tmp_path: Path, name: str, code: str) -> engines.Job:
    return engines.Job(name, ("-c", code), tmp_path, tmp_path / f"{name}.log")


# A job that fails on its first try only: its first try leaves a marker file.
FAIL_ONCE = (
    "import pathlib, sys; marker = pathlib.Path('{name}.marker'); seen = marker.exists(); "
    "marker.touch(); sys.exit(0 if seen else 1)"
)


def retry_jobs(tmp_path: Path) -> list[engines.Job]:
    return [
        script_job(tmp_path, "once", FAIL_ONCE.format(name="once")),
        script_job(tmp_path, "usage", "import sys; sys.exit(2)"),
        script_job(tmp_path, "always", "import sys; sys.exit(1)"),
        script_job(tmp_path, "fine", "pass"),
    ]


def assert_retried(jobs: list[engines.Job], codes: list[int]) -> None:
    # A failure is run again (up to 2 retries); exit 2, a usage error, is not.
    assert codes == [0, 2, 1, 0]
    assert [tries(job.log) for job in jobs] == [2, 1, 3, 1]


def test_local_engine_retries_failed_runs_but_not_usage_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    jobs = retry_jobs(tmp_path)
    engine = engines.create_engine(engines.EngineOptions(retries=2), say=lambda line: None)
    try:
        codes = engines.run_jobs(jobs, engine, retries=2, say=lambda line: None)
    finally:
        engine.close()
    assert_retried(jobs, codes)


def test_local_engine_gives_each_run_one_gpu(tmp_path, monkeypatch):
    """Two visible GPUs: two slots, each run sees exactly one of them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    code = "import os; print('GPU=' + os.environ['CUDA_VISIBLE_DEVICES'])"
    jobs = [script_job(tmp_path, f"run{i}", code) for i in range(4)]
    lines: list[str] = []
    engine = engines.create_engine(engines.EngineOptions(), say=lines.append)
    try:
        assert engines.run_jobs(jobs, engine, retries=0, say=lines.append) == [0] * 4
    finally:
        engine.close()
    assert lines[0] == "engine local: 2 runs at a time on GPUs 3,5"
    # The whole sweep's progress after each run, with an ETA until the last.
    progress = [line.rsplit("[", 1)[1] for line in lines[1:]]
    assert [p.split(",")[0] for p in progress] == [f"sweep: {i}/4 runs" for i in range(1, 5)]
    assert all("left" in p for p in progress[:3]) and progress[3].endswith(", done]")
    for job in jobs:
        seen = [line for line in job.log.read_text().splitlines() if line.startswith("GPU=")]
        assert seen in (["GPU=3"], ["GPU=5"])


def test_parallel_cpu_runs_split_the_cores_unless_the_user_chose(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(engines.os, "cpu_count", lambda: 8)
    code = "import os; print('THREADS=' + os.environ.get('OMP_NUM_THREADS', 'unset'))"

    def threads_seen(options: engines.EngineOptions, name: str) -> str:
        job = script_job(tmp_path, name, code)
        engine = engines.create_engine(options, say=lambda line: None)
        try:
            assert engines.run_jobs([job], engine, retries=0, say=lambda line: None) == [0]
        finally:
            engine.close()
        return job.log.read_text().splitlines()[-1]

    assert threads_seen(engines.EngineOptions(jobs=2), "two") == "THREADS=4"  # 8 cores / 2
    assert threads_seen(engines.EngineOptions(), "one") == "THREADS=unset"  # torch's default
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_seen(engines.EngineOptions(jobs=2), "chosen") == "THREADS=3"


def test_engine_ray_without_ray_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    base = tiny_base(tmp_path / "base.json")
    args = sweep_args(base, tmp_path / "out", None, engine="ray")
    assert sweep.run_sweep(args) == 2
    assert 'pip install -e ".[ray]"' in capsys.readouterr().err
    assert not list((tmp_path / "out" / "configs").glob("*.log"))  # nothing ran
    assert len(list((tmp_path / "out" / "configs").glob("*.json"))) == 2  # all validated


def test_engine_options_belong_to_their_engine(tmp_path, capsys):
    base = tiny_base(tmp_path / "base.json")
    for engine, extra, message in [
        ("local", {"address": "auto"}, "add --engine ray"),
        ("ray", {"jobs": 2}, "local-engine option"),
        ("local", {"retries": -1}, "--retries -1"),
    ]:
        args = sweep_args(base, tmp_path / "out", None, engine=engine, **extra)
        assert sweep.run_sweep(args) == 2
        assert message in capsys.readouterr().err


def test_checkpoint_every_reaches_every_run(tmp_path):
    base = tiny_base(tmp_path / "base.json")
    args = sweep_args(base, tmp_path / "out", None, checkpoint_every=50)
    args.dry_run = True
    assert run_sweep(args)[0] == 0
    configs = sorted((tmp_path / "out" / "configs").glob("*.json"))
    assert [json.loads(p.read_text())["checkpoint_every"] for p in configs] == [50, 50]
    args = sweep_args(base, tmp_path / "out0", None, checkpoint_every=0)
    args.dry_run = True
    with pytest.raises(ConfigError, match="checkpoint_every"):
        sweep.run_sweep(args)


def test_every_run_gets_the_sweeps_pilot_root(tmp_path, monkeypatch):
    """Without --pilot-root, the sweep's own $PILOT_ROOT goes on each command line, so runs on
    Ray nodes (whose environment is their own) use the same PILOT."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PILOT_ROOT", "shared/pilot")
    roots = []

    def fake_call(command, **kwargs):
        roots.append(command[command.index("--pilot-root") + 1])
        return 0

    monkeypatch.setattr(engines.subprocess, "call", fake_call)
    base = tiny_base(tmp_path / "base.json")
    assert run_sweep(sweep_args(base, tmp_path / "out", None))[0] == 0
    assert roots == [str(tmp_path / "shared" / "pilot")] * 2


def test_a_seed_axis_makes_one_run_per_seed(tmp_path):
    """Seeds as runs of their own spread over a cluster (a config's seed list runs in turn)."""
    base = tiny_base(tmp_path / "base.json")
    paths = points.build_configs(load_json(base), points.parse_grid(["seed=1,2"]), tmp_path)
    assert [json.loads(p.read_text())["seed"] for p in paths] == [[1], [2]]


def test_a_usage_error_fails_the_run_without_retries(tmp_path):
    """An unpatched (here: missing) PILOT makes `pilot-online run` exit 2: reported, not retried."""
    base = tiny_base(tmp_path / "base.json")
    args = sweep_args(base, tmp_path / "out", tmp_path / "no-pilot", retries=2, jobs=2)
    code, printed = run_sweep(args)
    assert code == 1
    assert printed.count("failed (exit 2)") == 2 and "retry" not in printed
    assert [tries(p) for p in sorted((tmp_path / "out" / "configs").glob("*.log"))] == [1, 1]


# --------------------------------------------------------------------------------------------
# Real runs (PILOT) and Ray


@pytest.fixture(scope="module")
def run_env(tmp_path_factory):
    """The runs' environment (offline, an empty weights cache), set before Ray starts so that
    its workers inherit it too."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in offline_env(tmp_path_factory.mktemp("env")).items():
            patch.setenv(key, value)
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # the local engine: one run at a time on CPU
        yield


@pytest.fixture(scope="module")
def local_ray(run_env):
    ray = pytest.importorskip("ray", reason=RAY_REASON)
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_engine_retries_and_survives_a_lost_worker(local_ray, tmp_path):
    jobs = retry_jobs(tmp_path)
    # Kills its Ray worker (its parent process) on the first try: Ray resubmits the task.
    jobs.append(
        script_job(
            tmp_path,
            "lost",
            "import os, pathlib, signal; marker = pathlib.Path('lost.marker'); "
            "seen = marker.exists(); marker.touch(); "
            "seen or os.kill(os.getppid(), signal.SIGKILL)",
        )
    )
    engine = engines.create_engine(engines.EngineOptions(engine="ray", retries=2), lambda s: None)
    try:
        codes = engines.run_jobs(jobs, engine, retries=2, say=lambda line: None)
    finally:
        engine.close()
    assert_retried(jobs[:4], codes[:4])
    assert codes[4] == 0
    assert tries(jobs[4].log) == 2  # Ray's resubmission of the same try


@pytest.fixture(scope="module")
def local_sweep(pilot, run_env, tmp_path_factory) -> tuple[Path, Path, str]:
    """Two real runs on the local engine: (base config, out folder, printed output)."""
    folder = tmp_path_factory.mktemp("local-sweep")
    base = tiny_base(folder / "base.json")
    code, printed = run_sweep(sweep_args(base, folder / "out", pilot, engine="local"))
    assert code == 0, printed
    return base, folder / "out", printed


def test_ray_engine_gives_the_local_engines_table(local_sweep, local_ray, pilot, tmp_path):
    base, local_out, local_printed = local_sweep
    assert "engine local: 1 run at a time on CPU" in local_printed
    code, printed = run_sweep(sweep_args(base, tmp_path / "out", pilot, engine="ray"))
    assert code == 0, printed
    assert "each run takes 0 GPUs and 1 CPU" in printed  # a CPU-only cluster
    assert printed.count(": done (") == 2
    rows = table_rows(tmp_path / "out")
    assert len(rows) == 2 and rows == table_rows(local_out)
    assert format_table(collect([tmp_path / "out" / "results"])) == format_table(
        collect([local_out / "results"])
    )


def test_a_restarted_sweep_skips_finished_runs(local_sweep, pilot, tmp_path):
    """Restarted after one run's results were lost, a sweep reruns only that run."""
    base, local_out, _ = local_sweep
    out = tmp_path / "out"
    shutil.copytree(local_out / "results", out / "results")
    (lost,) = out.glob("results/variant-fgh_*.results.json")
    lost.unlink()
    kept = next(out.glob("results/variant-base_*.results.json"))
    kept_bytes = kept.read_bytes()
    code, printed = run_sweep(sweep_args(base, out, pilot, engine="local"))
    assert code == 0, printed
    assert "[1/2] variant-base: skipped (finished)" in printed
    assert "variant-fgh: done" in printed and "variant-base: done" not in printed
    assert not (out / "configs" / "variant-base.log").exists()
    assert kept.read_bytes() == kept_bytes
    assert len(list(out.glob("results/*.results.json"))) == 2  # no timestamped duplicate
    assert table_rows(out) == table_rows(local_out)  # the rerun gives the same numbers

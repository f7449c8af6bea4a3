"""A researcher's first day (issue 30): runs that survive SIGTERM by default, errors before any
work and without tracebacks, upstream names and unpatched checkouts answered in one line, and
``run``'s overrides.

The PILOT tests run PILOT's own ``main.py`` of a patched copy (conftest's ``pilot``) as a user
would, from working directories of their own (PILOT writes ``logs/`` there), offline, on the
synthetic dataset at 32 px with random weights on the CPU.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import offline_env, raw_smoke_config, requires_pilot
from test_resume import comparable

from pilot_online.cli import setup as setup_command
from pilot_online.cli.main import build_parser, main, run_overrides
from pilot_online.core.files import human_bytes
from pilot_online.core.results import load_results
from pilot_online.engine.config import ConfigError, resolve_config
from pilot_online.pilot import patching

#: Where PILOT's trainer puts the tiny run's files, under the working directory.
RUN_FILES = "logs/linear_probe_online/synthetic_tiny/0/4/first_1993_vit_base_patch16_224"


def tiny_stream_config() -> dict:
    """Linear probe + P + FGH's smoke config (the cheapest step: only the head trains) on
    ``synthetic_tiny`` (2 tasks of 4 classes, 80 samples each) in batches of 10: 8 steps a
    task, so that a signal sent once task 0's checkpoint is written lands inside task 1. No
    ``checkpoint_every``: the default must checkpoint."""
    config = raw_smoke_config("linear_probe_online")
    config.update(dataset="synthetic_tiny", batch_size=10, eval_batch_size=40, prefix="first")
    assert "checkpoint_every" not in config and config["online_prototypes"] and config["fgh"]
    return config


def start_main(pilot: Path, config: Path, workdir: Path, tmp_path: Path) -> subprocess.Popen:
    """``python <pilot>/main.py --config CONFIG`` in ``workdir``, output to ``output.txt``; one
    torch thread (two runs share the CPUs)."""
    workdir.mkdir(exist_ok=True)
    env = {**offline_env(tmp_path), "OMP_NUM_THREADS": "1"}
    with open(workdir / "output.txt", "a") as output:
        return subprocess.Popen(
            [sys.executable, str(pilot / "main.py"), "--config", str(config)],
            cwd=workdir,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture
def processes():
    """The test's subprocesses, killed if the test ends before they do."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def output_of(workdir: Path) -> str:
    return (workdir / "output.txt").read_text()


@requires_pilot
def test_sigterm_then_the_same_command_gives_the_uninterrupted_results(pilot, tmp_path, processes):
    """Done when of issue 30: a SIGTERM mid-stream, then the same command with no config
    change, gives the results file of an uninterrupted run."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_stream_config()))
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    task_end_checkpoint = resumed_dir / f"{RUN_FILES}.ckpt.pt"

    victim = start_main(pilot, config, resumed_dir, tmp_path)
    straight = start_main(pilot, config, straight_dir, tmp_path)
    processes += [victim, straight]
    deadline = time.monotonic() + 300
    while not task_end_checkpoint.exists() and victim.poll() is None:
        assert time.monotonic() < deadline, output_of(resumed_dir)[-3000:]
        time.sleep(0.005)
    time.sleep(0.3)  # most likely inside task 1 now; its start is mid-stream too
    victim.send_signal(signal.SIGTERM)
    assert victim.wait(timeout=300) == 128 + signal.SIGTERM, output_of(resumed_dir)[-3000:]
    said = output_of(resumed_dir)
    assert "Traceback" not in said
    (line,) = [x for x in said.splitlines() if x.startswith("interrupted")]
    mid_task, task_end = "task 2 of 2, after ", "the end of task 1 of 2 "
    assert line.startswith(
        (f"interrupted (SIGTERM) at {mid_task}", f"interrupted (SIGTERM) at {task_end}")
    )
    where = task_end_checkpoint.resolve()
    size = human_bytes(where.stat().st_size)
    assert line.endswith(
        f"checkpoint {where} ({size}); rerun the same command to resume, or "
        f"`pilot-online clean {where}` to delete it"
    )
    # The first signal's line came at once, before it, through PILOT's logging and on stderr.
    warned = [x for x in said.splitlines() if "SIGTERM: the run stops after this batch" in x]
    assert warned and said.index(warned[0]) < said.index(line)
    assert not list(task_end_checkpoint.parent.glob("*results.json"))  # no partial file either

    rerun = start_main(pilot, config, resumed_dir, tmp_path)
    processes.append(rerun)
    assert rerun.wait(timeout=300) == 0, output_of(resumed_dir)[-3000:]
    assert straight.wait(timeout=300) == 0, output_of(straight_dir)[-3000:]
    assert "resuming from" in output_of(resumed_dir)

    resumed = load_results(resumed_dir / f"{RUN_FILES}.results.json")
    uninterrupted = load_results(straight_dir / f"{RUN_FILES}.results.json")
    (position,) = resumed["extra"]["resumed_from"]
    assert position["task"] == 1 and position["samples_seen"] >= 80, position
    assert resumed["extra"]["diagnostics"]["fgh"]["alpha"]  # P + FGH ran
    assert resumed["metrics"]["accuracy_matrix"] == uninterrupted["metrics"]["accuracy_matrix"]
    assert json.dumps(comparable(resumed), sort_keys=True) == json.dumps(
        comparable(uninterrupted), sort_keys=True
    )
    trace = f"{RUN_FILES}.results.gradtrace.npy"
    assert (resumed_dir / trace).read_bytes() == (straight_dir / trace).read_bytes()
    assert not task_end_checkpoint.exists()


@requires_pilot
def test_a_skipped_seed_shows_its_runs_parameter_counts(pilot_on_path):
    """PILOT's trainer logs count_parameters(_network) at every task: for a seed whose results
    are complete it counted an empty stand-in ("All params: 0"); now the stored run's counts."""
    from utils.toolkit import count_parameters  # PILOT's

    from pilot_online.pilot.learner import parameter_counts_only

    network = parameter_counts_only({"counters": {"trainable_parameters": 7, "parameters": 100}})
    assert count_parameters(network) == 100 and count_parameters(network, True) == 7
    assert sum(p.numel() * p.element_size() for p in network.parameters() if not p.is_meta) == 0


@requires_pilot
def test_main_py_checks_the_config_before_any_data_and_ends_in_one_line(pilot, tmp_path, processes):
    """Through the patch, a config error stops before the data loads (here: before CUB's
    missing folders are even looked at) and a missing dataset ends in its message alone."""
    cases = {
        "typo": (
            {"online_prototype": True},
            "pilot-online: unknown config key 'online_prototype' (did you mean "
            "'online_prototypes'?)",
        ),
        "upstream_name": (
            {"model_name": "coda_prompt"},
            "pilot-online: model_name 'coda_prompt' is PILOT's own offline learner",
        ),
        "missing_data": ({}, "pilot-online: dataset 'cub' could not be loaded"),
    }
    for name, (change, _) in cases.items():  # all three on CUB, whose folders do not exist here
        (tmp_path / f"{name}.json").write_text(
            json.dumps({**tiny_stream_config(), "dataset": "cub", **change})
        )
        processes.append(start_main(pilot, tmp_path / f"{name}.json", tmp_path / name, tmp_path))
    for process, (name, (_, line)) in zip(processes, cases.items()):
        assert process.wait(timeout=300) == 1, output_of(tmp_path / name)[-3000:]
        said = output_of(tmp_path / name)
        assert "Traceback" not in said, said[-3000:]
        assert said.strip().splitlines()[-1].startswith(line), said[-3000:]
    # The config errors came before the data: no data folder was named.
    assert "data/cub" not in output_of(tmp_path / "typo") + output_of(tmp_path / "upstream_name")


def test_upstream_names_and_typos_say_what_to_use():
    raw = raw_smoke_config("coda_online")
    with pytest.raises(ConfigError) as err:
        resolve_config({**raw, "model_name": "coda_prompt"})
    assert "for online training set model_name to 'coda_online'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        resolve_config({**raw, "model_name": "dualprompt"})
    assert str(err.value).endswith("set model_name to 'dualprompt_online'")
    with pytest.raises(ConfigError, match=r"unknown model_name 'coda_onlin' \(did you mean "):
        resolve_config({**raw, "model_name": "coda_onlin"})


def test_a_pilot_run_of_a_pilot_method_with_an_offline_config_is_left_to_pilot():
    """PILOT's own configs (no online keys) run PILOT's learners untouched through the patch."""
    from pilot_online.pilot.data import check_run

    check_run({"config": "exps/coda_prompt.json", "model_name": "coda_prompt", "num_workers": 8})
    with pytest.raises(ConfigError, match="offline learner"):
        check_run({"config": "x.json", "model_name": "coda_prompt", "stream": "clear"})


def test_the_hook_shows_user_errors_as_one_line_and_bugs_with_their_traceback(monkeypatch, capsys):
    from pilot_online.pilot import errors

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[1]))
    monkeypatch.delenv(errors.TRACEBACK_FLAG, raising=False)
    errors.install_excepthook()
    errors.install_excepthook()  # idempotent: one hook
    user, bug = ConfigError("unknown config key 'x'"), KeyError("min_lr")
    sys.excepthook(ConfigError, user, None)
    sys.excepthook(KeyError, bug, None)
    assert capsys.readouterr().err == "pilot-online: unknown config key 'x'\n"
    assert seen == [bug]
    monkeypatch.setenv(errors.TRACEBACK_FLAG, "1")
    sys.excepthook(ConfigError, user, None)
    assert seen == [bug, user]


def test_the_cli_ends_user_errors_in_one_line_with_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PILOT_ONLINE_TRACEBACK", raising=False)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(raw_smoke_config("coda_online")))
    code = main(["run", "--config", str(config), "--pilot-root", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"pilot-online run: PILOT_ROOT {tmp_path / 'nowhere'} does not exist")
    missing = ["sweep", "--config", str(tmp_path / "missing.json"), "--out", str(tmp_path)]
    assert main(missing) == 2
    said = capsys.readouterr().err
    assert said == f"pilot-online sweep: config file {missing[2]} does not exist\n"
    with pytest.raises(ConfigError):  # --verbose: the exception, with its traceback
        main(["--verbose", *missing])


def test_an_unpatched_checkout_is_one_line_per_problem_not_per_config(capsys):
    names = [f"method{i:03d}_online.json" for i in range(243)]
    state = patching.CheckoutState(
        root=Path("/pilot"),
        files=[patching.FileState(rel, "upstream") for rel, _ in patching.PATCHES],
        linked_configs=[],
        missing_links=names,
        foreign_links=[],
    )
    problems = patching._problems_for_run(state)
    assert len(problems) == len(patching.PATCHES) + 1  # a line a file, one for the 243 links
    assert problems[-1] == (
        "243 of pilot-online's configs are not linked into exps/ yet (method000_online.json, "
        "method001_online.json, method002_online.json and 240 more)"
    )
    setup_command._print_report(state)
    report = capsys.readouterr().out
    assert report.count("not linked") == 1
    assert len(report.splitlines()) == len(patching.PATCHES) + 3  # root, files, links, status


def parse_run(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", "--config", "c.json", *flags])


def test_run_takes_set_seed_and_device():
    args = parse_run("--set", "init_lr=0.01", "--set", "stream=si_blurry", "--seed", "1", "2")
    assert run_overrides(args) == {"init_lr": 0.01, "stream": "si_blurry", "seed": [1, 2]}
    assert run_overrides(parse_run("--device", "cpu")) == {"device": [-1]}
    assert run_overrides(parse_run("--device", "cuda:1")) == {"device": ["1"]}
    assert run_overrides(parse_run("--device", "cuda")) == {"device": ["0"]}
    assert run_overrides(parse_run("--device", "2")) == {"device": ["2"]}
    with pytest.raises(SystemExit):
        parse_run("--device", "gpu1")
    resolved = resolve_config({**raw_smoke_config("coda_online"), **run_overrides(args)})
    assert resolved["seed"] == [1, 2] and resolved["init_lr"] == 0.01


def test_reproduce_and_sweep_configs_checkpoint_so_retries_resume(tmp_path):
    """reproduce --retries says a retried run resumes from its checkpoint: the configs it
    writes (through sweep's build_configs) must checkpoint, with no flag."""
    from pilot_online.harness.points import build_configs

    base = {**raw_smoke_config("coda_online")}
    (path,) = build_configs(base, {"seed": [[1993]]}, tmp_path)
    written = json.loads(path.read_text())
    assert resolve_config(written)["checkpoint_every"] == "auto"

"""Checkpoints and resume (``checkpoint_every``): a run killed mid-stream and rerun ends with the
same results file as an uninterrupted run, bit for bit on the CPU.

PILOT-free runs drive an :class:`OnlineSession` in-process; a "kill" is an exception raised by
the data source at a chosen stream batch, after which everything is rebuilt from scratch (a
fresh network, loop and session, with the global generators reseeded), as a rerun would. The
models draw random numbers while training (dropout, noise augmentations, replay draws, LoRA
re-initialisation), so a resume that lost an RNG state or any training state would show up.
The PILOT test kills a real ``pilot-online run`` with SIGKILL and reruns the same command.

What the comparisons leave out, and why (every other field of the results file must be equal):
``timing`` (wall-clock seconds, throughput and peak memory of each process), ``created_utc``
(when the file was written) and ``extra.resumed_from`` (present only in a resumed run: where it
resumed). Paths: the compared runs write into folders of the same layout, so names are equal.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import offline_env, requires_pilot
from torch import nn

from pilot_online.core.files import human_bytes, write_atomic_with
from pilot_online.core.results import load_results
from pilot_online.core.streams import clear_stream, si_blurry_stream
from pilot_online.engine.adapter import MethodAdapter, StepOutput
from pilot_online.engine.checkpoint import (
    IGNORED_KEYS,
    CheckpointError,
    checkpoint_path_for,
    comparable_config,
)
from pilot_online.engine.config import ONLINE_KEYS, PAPER_FGH, ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.session import OnlineSession
from pilot_online.version import __version__

HERE = Path(__file__).resolve().parent
EXPS = HERE.parent / "exps"
C = 6


class Killed(Exception):
    """Stands for SIGKILL in the in-process tests: everything after the last checkpoint is lost."""


# -- a small model that draws random numbers while training ---------------------------------------
class DropoutNet(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Linear(d_in, hidden)
        self.dropout = nn.Dropout(0.3)
        self.fc = nn.Linear(hidden, C)


class DropoutAdapter(MethodAdapter):
    """relu(body(x)) with dropout in training (torch's global generator), then fc."""

    base_model_name = "dropout_tiny"

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = network.dropout(torch.relu(network.body(x)))
        return StepOutput(network.fc(features), features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc


class NoisySource:
    """A DataSource over tensors whose training samples get Gaussian noise from torch's global
    generator (an augmentation run in the training process); ``kill_after`` raises
    :class:`Killed` instead of yielding stream batch number ``kill_after + 1`` (1-based, counted
    over the whole session)."""

    def __init__(self, train_x, train_y, test_x, test_y, kill_after: int | None = None) -> None:
        self.train_x, self.train_y = train_x, torch.as_tensor(train_y)
        self.test_x, self.test_y = test_x, torch.as_tensor(test_y)
        self.test_labels = np.asarray(test_y)
        self.kill_after = kill_after
        self.batches_yielded = 0

    def _noisy(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.from_numpy(np.array(index, dtype=np.int64))
        x = self.train_x[index]
        return x + 0.1 * torch.randn_like(x), self.train_y[index]

    def train_batches(self, batches):
        for indices in batches:
            if self.kill_after is not None and self.batches_yielded == self.kill_after:
                raise Killed(f"killed before stream batch {self.batches_yielded + 1}")
            self.batches_yielded += 1
            yield self._noisy(indices)

    def train_samples(self, indices):
        return self._noisy(indices)

    def eval_batches(self, indices):
        for start in range(0, len(indices), 16):
            index = torch.from_numpy(np.array(indices[start : start + 16]))
            yield self.test_x[index], self.test_y[index]


def vector_data(per_class: int = 16, test_per_class: int = 5, d_in: int = 8):
    """Class c's vectors scatter around a random centre: learnable, not trivially."""
    g = torch.Generator().manual_seed(7)
    centres = 1.5 * torch.randn(C, d_in, generator=g)
    train_y = np.repeat(np.arange(C), per_class)
    test_y = np.repeat(np.arange(C), test_per_class)
    train_x = centres[train_y] + torch.randn(len(train_y), d_in, generator=g)
    test_x = centres[test_y] + torch.randn(len(test_y), d_in, generator=g)
    return train_x, train_y, test_x, test_y


def image_data(per_class: int = 6, test_per_class: int = 2):
    g = torch.Generator().manual_seed(7)
    train_y = np.repeat(np.arange(C), per_class)
    test_y = np.repeat(np.arange(C), test_per_class)
    pattern = torch.rand(C, 3, 32, 32, generator=g)
    train_x = pattern[train_y] + 0.3 * torch.rand(len(train_y), 3, 32, 32, generator=g)
    test_x = pattern[test_y] + 0.3 * torch.rand(len(test_y), 3, 32, 32, generator=g)
    return train_x, train_y, test_x, test_y


def base_config(**overrides) -> dict:
    config = {key: spec.default for key, spec in ONLINE_KEYS.items()}
    config.update(
        model_name="dropout_tiny",
        optimizer="adam",
        init_lr=0.01,
        weight_decay=0.0,
        seed=3,
        checkpoint_every=3,
    )
    config.update(overrides)
    return config


def reseed(seed: int = 0) -> None:
    """What a fresh process gets before it builds anything (PILOT's trainer seeds torch)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def tiny_setup(config: dict):
    reseed()
    adapter = DropoutAdapter(args=config)
    return adapter, DropoutNet()


class Run:
    """One scenario (model, stream, data, config) that can be run straight or with kills."""

    def __init__(self, setup, config: dict, stream, data, device="cpu") -> None:
        self.setup, self.config, self.stream, self.data = setup, config, stream, data
        self.device = torch.device(device)

    def session(self, folder: Path, kill_after: int | None = None, config: dict | None = None):
        config = self.config if config is None else config
        adapter, network = self.setup(config)
        loop = build_loop(adapter, network, config, C, self.device)
        source = NoisySource(*self.data, kill_after=kill_after)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "run.results.json"
        return OnlineSession(loop, self.stream, source, config, path, progress=False)

    def straight(self, folder: Path):
        session = self.session(folder)
        return session, session.run()

    def killed_then_resumed(self, folder: Path, kills: list[int]):
        """Kill at each stream batch in ``kills`` (counted in that attempt), then finish."""
        for kill in kills:
            session = self.session(folder, kill_after=kill)
            with pytest.raises(Killed):
                session.run()
            assert session.checkpoint_path.exists()
        session = self.session(folder)
        return session, session.run()


def comparable(results: dict) -> dict:
    """The results without the fields a resume may change (see the module docstring)."""
    results = copy.deepcopy(results)
    results.pop("timing"), results.pop("created_utc")
    results["extra"].pop("resumed_from", None)
    return results


def assert_same_run(straight, resumed) -> None:
    (s_session, s_results), (r_session, r_results) = straight, resumed
    assert json.dumps(comparable(r_results), sort_keys=True) == json.dumps(
        comparable(s_results), sort_keys=True
    )
    s_trace = s_session.written_path.with_name("run.results.gradtrace.npy").read_bytes()
    r_trace = r_session.written_path.with_name("run.results.gradtrace.npy").read_bytes()
    assert s_trace == r_trace
    s_state, r_state = s_session.loop.state_dict(), r_session.loop.state_dict()
    for name, p in s_state["parameters"].items():
        assert torch.equal(p, r_state["parameters"][name]), name
    for name, b in s_state["buffers"].items():
        assert torch.equal(b, r_state["buffers"][name]), name
    if "fgh" in s_state:  # every alpha, not only the results file's summary of them
        s_alpha, r_alpha = s_session.loop.fgh.coefficients(), r_session.loop.fgh.coefficients()
        assert s_alpha.keys() == r_alpha.keys()
        assert all(torch.equal(s_alpha[n], r_alpha[n]) for n in s_alpha)
    if "prototypes" in s_state:
        assert torch.equal(s_state["prototypes"]["means"], r_state["prototypes"]["means"])
        assert torch.equal(s_state["prototypes"]["counts"], r_state["prototypes"]["counts"])


def p_fgh_run(stream: str = "clear", device="cpu") -> Run:
    data = vector_data()
    if stream == "clear":
        # 3 tasks of 2 classes (32 samples), batch 8: 4 stream batches per task, 12 in all.
        built = clear_stream(data[1], init_cls=2, increment=2, batch_size=8, seed=3)
        config = base_config(online_prototypes=True, fgh=dict(PAPER_FGH))
    else:
        built = si_blurry_stream(data[1], num_tasks=3, n=50, m=10, seed=3, batch_size=8)
        config = base_config(online_prototypes=True, fgh=dict(PAPER_FGH), eval_period=20)
    return Run(tiny_setup, config, built, data, device)


def er_run(device="cpu") -> Run:
    data = vector_data()
    built = clear_stream(data[1], init_cls=2, increment=2, batch_size=8, seed=3)
    config = base_config(er_memory_size=20, er_batch_size=6, allow_memory=True)
    return Run(tiny_setup, config, built, data, device)


# -- PILOT-free: session-level resume equals the uninterrupted run --------------------------------
@pytest.mark.parametrize(
    "kills",
    [
        # Checkpoints: after stream batches 3, 6, 9, 12 and at the ends of tasks 0 and 1.
        [5],  # in task 1 after its first batch: resumes from task 0's end, one batch redone
        [4],  # right after task 0's end-of-task checkpoint: nothing lost
        [7, 2],  # killed twice: from (task 1, batch 2), then from task 1's end
        [11],  # in the last task: resumes from (task 2, batch 1), two batches redone
    ],
)
def test_p_fgh_resume_equals_the_uninterrupted_run(tmp_path, kills, device):
    run = p_fgh_run(device=device)
    straight = run.straight(tmp_path / "straight")
    resumed = run.killed_then_resumed(tmp_path / "resumed", kills)
    assert_same_run(straight, resumed)
    results = resumed[1]
    # The last attempt resumed from the last checkpoint before its kill.
    assert results["extra"]["resumed_from"][-1]["samples_seen"] > 0
    assert len(results["extra"]["resumed_from"]) == len(kills)
    assert "resumed_from" not in straight[1]["extra"]
    # FGH moved alphas and prototypes covered every stream sample (the run is not trivial).
    alphas = results["extra"]["diagnostics"]["fgh"]["alpha"]
    assert any(a["min"] != 1.0 or a["max"] != 1.0 for a in alphas.values())
    assert results["extra"]["diagnostics"]["prototypes"]["samples"] == 96
    assert results["counters"]["optimizer_steps"] == 12
    # The finished run removed its checkpoint.
    assert not resumed[0].checkpoint_path.exists()


def test_si_blurry_resume_keeps_the_periodic_evaluations(tmp_path):
    run = p_fgh_run("si_blurry")
    straight = run.straight(tmp_path / "straight")
    resumed = run.killed_then_resumed(tmp_path / "resumed", [5])
    assert_same_run(straight, resumed)
    # 96 stream samples, evaluated every 20: 4 periodic evaluations, kept across the resume.
    assert len(resumed[1]["extra"]["periodic_evaluations"]) == 4
    assert resumed[1]["metrics"]["A_auc"] is not None


def test_experience_replay_resume_equals_the_uninterrupted_run(tmp_path, device):
    run = er_run(device)
    straight = run.straight(tmp_path / "straight")
    resumed = run.killed_then_resumed(tmp_path / "resumed", [7])  # from (task 1, batch 2)
    assert_same_run(straight, resumed)
    replay = resumed[1]["extra"]["diagnostics"]["experience_replay"]
    assert replay["size"] == 20 and replay["stream_samples_offered"] == 96


def test_resume_without_restoring_the_generators_would_differ(tmp_path, monkeypatch):
    """The test can fail: a resume that loses the RNG state (dropout, noise) ends elsewhere."""
    from pilot_online.engine import session as session_module

    run = p_fgh_run()
    straight = run.straight(tmp_path / "straight")
    monkeypatch.setattr(session_module, "restore_rng_state", lambda state, device=None: None)
    resumed = run.killed_then_resumed(tmp_path / "resumed", [5])
    resumed_parameters = resumed[0].loop.state_dict()["parameters"]
    assert not all(
        torch.equal(p, resumed_parameters[name])
        for name, p in straight[0].loop.state_dict()["parameters"].items()
    )


# -- methods with state of their own: MVP (key-use counts), oLoRA (merges, buffer, importance) ---
def test_mvp_resume_restores_the_key_use_counts(tmp_path):
    pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer

    from pilot_online.core.networks import MVPNet
    from pilot_online.engine.config import load_json
    from pilot_online.methods.mvp import MVPOnline

    config = resolve_config({**load_json(EXPS / "smoke_mvp_online.json"), "checkpoint_every": 2})
    config["fgh"] = dict(PAPER_FGH)

    def setup(config):
        reseed()
        vit = VisionTransformer(
            img_size=32, patch_size=16, embed_dim=16, depth=4, num_heads=2, num_classes=C
        )
        network = MVPNet(vit, C, pool_size=4, g_positions=(0, 1), g_length=2,
                         e_positions=(2, 3), e_length=3)  # fmt: skip
        return MVPOnline(args=config), network

    data = image_data()
    # 2 tasks of 3 batches; checkpoints after batches 2, 4 and task 0's end: resumes at (1, 1).
    built = clear_stream(data[1], init_cls=3, increment=3, batch_size=6, seed=3)
    run = Run(setup, config, built, data)
    straight = run.straight(tmp_path / "straight")
    resumed = run.killed_then_resumed(tmp_path / "resumed", [5])
    assert_same_run(straight, resumed)
    counts = resumed[0].loop.network.key_counts
    assert counts.sum().item() == 36  # every stream sample counted once, across the resume


def test_olora_resume_restores_merges_buffer_and_importance(tmp_path, monkeypatch):
    timm = pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer

    from pilot_online.engine.registry import get_method

    # A tiny ViT stands in for ViT-B (the adapter builds it with timm.create_model).
    monkeypatch.setattr(
        timm,
        "create_model",
        lambda name, **kwargs: VisionTransformer(
            img_size=32, patch_size=16, embed_dim=16, depth=2, num_heads=2, num_classes=0
        ),
    )
    raw = {
        "model_name": "olora_online",
        "backbone_type": "vit_base_patch16_224",
        "dataset": "synthetic_tiny",
        "init_lr": 0.01,
        "pretrained": False,
        "checkpoint_every": 2,
        # A plateau whenever the detector is armed; the window of 2 re-arms it on a rising loss.
        "loss_window_length": 2,
        "loss_window_mean_threshold": 1e9,
        "loss_window_variance_threshold": 1e9,
        "hard_buffer_size": 2,
        "mas_weight": 10.0,
    }
    config = {**resolve_config(raw), "nb_classes": C, "fgh": dict(PAPER_FGH)}

    def setup(config):
        reseed()
        adapter = get_method("olora_online")(args=config)
        return adapter, adapter.build_network(config)

    data = image_data()
    built = clear_stream(data[1], init_cls=3, increment=3, batch_size=6, seed=3)
    run = Run(setup, config, built, data)
    straight = run.straight(tmp_path / "straight")
    resumed = run.killed_then_resumed(tmp_path / "resumed", [5])  # from (task 1, batch 1)
    assert_same_run(straight, resumed)
    s_net, r_net = straight[0].loop.network, resumed[0].loop.network
    # The merges (upstream's factor sums, the default) filled the merged factors, identically in
    # both runs; the frozen qkv weights stay as built.
    for s_adapter, r_adapter in zip(s_net.adapters, r_net.adapters):
        assert torch.equal(s_adapter.qkv.weight, r_adapter.qkv.weight)
        assert s_adapter.merged_a_q.abs().sum() > 0
        assert torch.equal(s_adapter.merged_a_q, r_adapter.merged_a_q)
        assert torch.equal(s_adapter.merged_b_v, r_adapter.merged_b_v)
    report = resumed[1]["extra"]["diagnostics"]["method"]["olora"]
    assert report["plateaus"] >= 1 and report["hard_buffer_batches"] == 2


# -- refusals -----------------------------------------------------------------------------------
def killed_checkpoint(tmp_path: Path, kill_after: int = 5) -> tuple[Run, Path]:
    run = p_fgh_run()
    session = run.session(tmp_path, kill_after=kill_after)
    with pytest.raises(Killed):
        session.run()
    return run, session.checkpoint_path


def test_a_checkpoint_of_another_config_is_refused(tmp_path):
    run, path = killed_checkpoint(tmp_path)
    changed = {**run.config, "init_lr": 0.02}
    with pytest.raises(CheckpointError) as err:
        run.session(tmp_path, config=changed)
    message = str(err.value)
    assert str(path) in message
    assert "init_lr: 0.01 in the checkpoint, 0.02 now" in message
    assert "Rerun with the config that started the run" in message and "delete" in message
    assert path.exists()  # a refusal deletes nothing


def test_a_checkpoint_of_another_stream_is_refused(tmp_path):
    """Same config, other data (here: the stream of another shuffle): the saved position would
    point into a different sequence of batches."""
    run, path = killed_checkpoint(tmp_path)
    other = clear_stream(run.data[1], init_cls=2, increment=2, batch_size=8, seed=4)
    moved = Run(run.setup, run.config, other, run.data)
    with pytest.raises(CheckpointError, match="another stream") as err:
        moved.session(tmp_path)
    assert str(path) in str(err.value) and "delete" in str(err.value)


def test_keys_that_cannot_change_results_do_not_block_a_resume(tmp_path):
    run, _ = killed_checkpoint(tmp_path)
    relaxed = {**run.config, "log_interval": 1, "num_workers": 7, "checkpoint_every": 5}
    relaxed.update(pin_memory=True, eval_pixel_cache="off")
    relaxed["config"] = "/elsewhere/the_same_config.json"
    session = run.session(tmp_path, config=relaxed)
    assert session.resume_position == (1, 0)  # the end-of-task checkpoint of task 0
    assert set(IGNORED_KEYS) == {
        "config", "results_dir", "log_interval", "num_workers", "checkpoint_every", "logger",
        "logger_dir", "pin_memory", "eval_pixel_cache",
    }  # fmt: skip


def test_devices_are_compared_by_kind():
    assert comparable_config({"device": ["0"]}) == comparable_config({"device": ["cuda:1"]})
    assert comparable_config({"device": [-1]}) == comparable_config({"device": ["cpu"]})
    assert comparable_config({"device": [-1]}) != comparable_config({"device": ["0"]})


def test_a_checkpoint_of_another_version_is_refused(tmp_path):
    run, path = killed_checkpoint(tmp_path)
    payload = torch.load(path, weights_only=True)
    assert payload["pilot_online_version"] == __version__
    payload["pilot_online_version"] = "0.0.1"
    torch.save(payload, path)
    with pytest.raises(CheckpointError) as err:
        run.session(tmp_path)
    message = str(err.value)
    assert f"written by pilot-online 0.0.1, this is {__version__}" in message
    assert str(path) in message and "delete" in message


def test_a_truncated_checkpoint_is_refused_clearly(tmp_path):
    run, path = killed_checkpoint(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot be read .*corrupt, truncated") as err:
        run.session(tmp_path)
    assert str(path) in str(err.value)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="delete"):
        run.session(tmp_path)


def test_checkpoint_every_is_validated():
    raw = json.loads((EXPS / "smoke_coda_online.json").read_text())
    assert resolve_config(raw)["checkpoint_every"] == "auto"  # on by default
    assert resolve_config({**raw, "checkpoint_every": 50})["checkpoint_every"] == 50
    assert resolve_config({**raw, "checkpoint_every": None})["checkpoint_every"] is None
    for bad in (0, -3, 2.5, True, "10", "Auto"):
        with pytest.raises(ConfigError, match='must be null, "auto" or a positive integer'):
            resolve_config({**raw, "checkpoint_every": bad})


def test_every_shipped_config_checkpoints():
    """The README promises that a rerun resumes an interrupted run: no shipped config may turn
    checkpoints off (before, the default was null and every config ran without them)."""
    configs = sorted(EXPS.glob("*.json"))
    assert configs
    off = [p.name for p in configs if json.loads(p.read_text()).get("checkpoint_every", 1) is None]
    assert off == []
    assert ONLINE_KEYS["checkpoint_every"].default == "auto"


def test_auto_checkpoints_at_task_ends_and_on_the_interval(tmp_path, monkeypatch):
    """``"auto"``: a checkpoint at each task end, and one after any step once the interval has
    passed since the last; a resume from either ends as the uninterrupted run."""
    from pilot_online.engine import checkpointer

    run = p_fgh_run()
    run.config = {**run.config, "checkpoint_every": "auto"}
    straight = run.straight(tmp_path / "straight")
    # A long interval: only task ends. Killed in task 1 after 1 batch: resumes at its start.
    session = run.session(tmp_path / "long", kill_after=5)
    with pytest.raises(Killed):
        session.run()
    assert run.session(tmp_path / "long").resume_position == (1, 0)
    # An interval already passed at every step: a checkpoint after each one.
    monkeypatch.setattr(checkpointer, "AUTO_CHECKPOINT_SECONDS", 0.0)
    resumed = run.killed_then_resumed(tmp_path / "short", [5])
    assert resumed[1]["extra"]["resumed_from"] == [{"task": 1, "step": 1, "samples_seen": 40}]
    assert_same_run(straight, resumed)


def test_auto_without_a_results_path_keeps_the_run_in_memory():
    run = p_fgh_run()
    config = {**run.config, "checkpoint_every": "auto"}
    adapter, network = run.setup(config)
    loop = build_loop(adapter, network, config, C)
    session = OnlineSession(loop, run.stream, NoisySource(*run.data), config, None, progress=False)
    assert session.checkpoint_path is None
    assert session.run()["counters"]["optimizer_steps"] == 12


# -- SIGINT / SIGTERM: checkpoint, one line, a non-zero exit; the rerun resumes ------------------
class SignalSource(NoisySource):
    """Sends ``signum`` to this process while yielding stream batch ``at`` (1-based), as Ctrl-C
    or a scheduler's SIGTERM would arrive in the middle of a step."""

    def __init__(self, *data, signum: int, at: int) -> None:
        super().__init__(*data)
        self.signum, self.at = signum, at

    def train_batches(self, batches):
        for batch in super().train_batches(batches):
            if self.batches_yielded == self.at:
                os.kill(os.getpid(), self.signum)
            yield batch


@pytest.fixture
def sigterm_is_not_fatal():
    """Without the session's handler a SIGTERM would end pytest itself: here it raises."""

    def refuse(signum, frame):
        raise AssertionError("SIGTERM reached the process's own handler: the run did not catch it")

    previous = signal.signal(signal.SIGTERM, refuse)
    yield refuse
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_checkpoints_says_where_and_the_rerun_resumes(
    tmp_path, signum, sigterm_is_not_fatal, capsys, caplog
):
    from pilot_online.engine.checkpointer import RunInterrupted

    run = p_fgh_run()
    run.config = {**run.config, "checkpoint_every": "auto"}  # task ends only, in this test
    straight = run.straight(tmp_path / "straight")
    folder = tmp_path / "resumed"
    session = run.session(folder)
    session.data = SignalSource(*run.data, signum=signum, at=6)  # task 1, its second batch
    with pytest.raises(RunInterrupted) as stopped:
        session.run()
    assert stopped.value.code == 128 + signum
    *first, line = capsys.readouterr().err.strip().splitlines()
    assert all(x.startswith("SIG") for x in first)  # the first signal's line
    name = signal.Signals(signum).name
    checkpoint = session.checkpoint_path
    size = human_bytes(checkpoint.stat().st_size)
    assert line == (
        f"interrupted ({name}) at task 2 of 3, after 2 of its 4 batches (48 stream samples "
        f"trained); checkpoint {checkpoint} ({size}); rerun the same command to resume, or "
        f"`pilot-online clean {checkpoint}` to delete it"
    )
    assert checkpoint.exists() and not list(folder.glob("*.results.json"))  # no partial file
    # The process's own handlers are back once the session's call is over.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is sigterm_is_not_fatal
    caplog.clear()
    with caplog.at_level("WARNING"):
        rerun = run.session(folder)
    assert f"resuming from {checkpoint} at task 2 of 3, after 2 of its 4 batches" in caplog.text
    resumed = (rerun, rerun.run())
    assert resumed[1]["extra"]["resumed_from"] == [{"task": 1, "step": 2, "samples_seen": 48}]
    assert_same_run(straight, resumed)


class TwoSignalSource(NoisySource):
    """Ctrl-C at stream batch ``at``, then again ``after`` seconds later from another thread
    (the user who saw nothing happen), while the step in between is made ``slow``."""

    def __init__(self, *data, at: int, after: float | None = None) -> None:
        super().__init__(*data)
        self.at, self.after = at, after
        self.second_sent: float | None = None

    def _second(self) -> None:
        self.second_sent = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    def train_batches(self, batches):
        for batch in super().train_batches(batches):
            if self.batches_yielded == self.at:
                os.kill(os.getpid(), signal.SIGINT)
                if self.after is None:
                    self._second()
                else:
                    threading.Timer(self.after, self._second).start()
            yield batch


def test_the_first_signal_says_at_once_what_happens(tmp_path, caplog):
    """The warning is logged from the handler, before the step that was running finishes."""
    from pilot_online.engine.checkpointer import RunInterrupted

    run = p_fgh_run()
    session = run.session(tmp_path)
    session.data = SignalSource(*run.data, signum=signal.SIGINT, at=6)
    events = []
    train_step = session.loop.train_step

    def logged_step(*args):
        out = train_step(*args)
        events.append("step")
        return out

    session.loop.train_step = logged_step
    handler = logging.Handler()
    handler.emit = lambda record: events.append(record.getMessage())
    logging.getLogger("pilot_online.engine.checkpointer").addHandler(handler)
    try:
        with caplog.at_level("WARNING"), pytest.raises(RunInterrupted):
            session.run()
    finally:
        logging.getLogger("pilot_online.engine.checkpointer").removeHandler(handler)
    line = (
        f"SIGINT: the run stops after this batch (or evaluation) and writes a checkpoint to "
        f"{session.checkpoint_path.resolve()}; press Ctrl-C again to stop at once (within 2 s), "
        "keeping the last checkpoint on disk"
    )
    assert [r.levelname for r in caplog.records if r.getMessage() == line] == ["WARNING"]
    # Batch 6 is the second of task 2: five steps ran before the signal, the sixth after it.
    assert [e for e in events if e == "step" or e == line][-2:] == [line, "step"]


def test_the_first_signal_line_reaches_stderr_when_logs_go_to_stdout(tmp_path, capsys):
    """PILOT's main.py logs to a file and stdout: the lines then reach stderr too."""
    from pilot_online.engine.checkpointer import RunInterrupted

    run = p_fgh_run()
    session = run.session(tmp_path)
    session.data = SignalSource(*run.data, signum=signal.SIGINT, at=6)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [logging.StreamHandler(sys.stdout)]
    try:
        with pytest.raises(RunInterrupted):
            session.run()
    finally:
        root.handlers = saved
    said = capsys.readouterr()
    err = said.err.splitlines()
    assert err[0].startswith("SIGINT: the run stops after this batch (or evaluation)")
    assert err[1].startswith("interrupted (SIGINT) at task 2 of 3")
    # Both are log records: the run's own handler (PILOT's: stdout and its log file) has them.
    logged = said.out.splitlines()
    assert logged[-2:] == err[:2]


def test_a_second_signal_stops_at_once_and_the_checkpoint_is_whole(tmp_path, capsys):
    """Ctrl-C twice within one slow step: out in well under 2 s, with the line that says how old
    the checkpoint is; the rerun resumes from it and ends as the uninterrupted run."""
    from pilot_online.engine.checkpointer import RunInterrupted

    run = p_fgh_run()
    run.config = {**run.config, "checkpoint_every": "auto"}  # task ends only
    straight = run.straight(tmp_path / "straight")
    folder = tmp_path / "twice"
    session = run.session(folder)
    session.data = source = TwoSignalSource(*run.data, at=6, after=0.3)
    train_step = session.loop.train_step

    def slow_step(*args):
        if source.batches_yielded == 6:  # a 20 s step: the first signal waits for its end
            a = torch.randn(200, 200)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                a = torch.tanh(a @ a.T / 200)
        return train_step(*args)

    session.loop.train_step = slow_step
    with pytest.raises(RunInterrupted) as stopped:
        session.run()
    waited = time.monotonic() - source.second_sent
    assert waited < 2.0
    assert stopped.value.code == 130
    checkpoint = session.checkpoint_path.resolve()
    *first, line = capsys.readouterr().err.strip().splitlines()
    assert all(x.startswith("SIG") for x in first)  # the first signal's line
    prefix = "stopped at once (SIGINT twice); the last checkpoint is whole, written "
    assert line.startswith(prefix)
    age, rest = line[len(prefix) :].split(" s ago", 1)
    assert 0 <= int(age) <= 25
    assert rest == (
        f", at the end of task 1 of 3 (32 stream samples trained): checkpoint {checkpoint} "
        f"({human_bytes(checkpoint.stat().st_size)}); rerun the same command to resume, or "
        f"`pilot-online clean {checkpoint}` to delete it"
    )
    assert run.session(folder).resume_position == (1, 0)
    assert_same_run(straight, (rerun := run.session(folder), rerun.run()))


def test_a_second_signal_during_the_checkpoint_write_keeps_the_previous_one(
    tmp_path, monkeypatch, capsys
):
    """The first signal's checkpoint is being written when the second comes: the write is
    abandoned, its temporary file removed, and the task-end checkpoint before it stays whole."""
    from pilot_online.engine import checkpointer
    from pilot_online.engine.checkpointer import RunInterrupted

    run = p_fgh_run()
    run.config = {**run.config, "checkpoint_every": "auto"}
    straight = run.straight(tmp_path / "straight")
    folder = tmp_path / "mid-write"
    session = run.session(folder)
    session.data = SignalSource(*run.data, signum=signal.SIGINT, at=6)
    real_save = checkpointer.save_checkpoint

    def save_then_interrupted(path, state, config):
        if state["position"] == {"task": 1, "step": 2}:  # the first signal's checkpoint

            def writer(handle):
                handle.write(b"half a checkpoint")
                os.kill(os.getpid(), signal.SIGINT)

            write_atomic_with(path, writer)
        real_save(path, state, config)

    monkeypatch.setattr(checkpointer, "save_checkpoint", save_then_interrupted)
    with pytest.raises(RunInterrupted):
        session.run()
    assert "the last checkpoint is whole" in capsys.readouterr().err
    assert [p.name for p in folder.iterdir() if "ckpt" in p.name] == ["run.ckpt.pt"]
    monkeypatch.undo()
    assert run.session(folder).resume_position == (1, 0)
    assert_same_run(straight, (rerun := run.session(folder), rerun.run()))


def test_every_line_counts_tasks_from_one(tmp_path, caplog, capsys):
    """The checkpoint lines, the progress bar and the interrupt line describe one moment alike:
    the second batch of task 2 of 3 (PILOT's own lines and files keep its 0-based keys)."""
    from pilot_online.engine.checkpointer import RunInterrupted

    run = p_fgh_run()
    run.config = {**run.config, "checkpoint_every": 1}
    session = run.session(tmp_path)
    session.progress = True
    session.data = SignalSource(*run.data, signum=signal.SIGINT, at=6)
    with caplog.at_level("INFO", logger="pilot_online"), pytest.raises(RunInterrupted):
        session.run()
    lines = [r.getMessage() for r in caplog.records]
    saved = [line.split(":")[0] for line in lines if line.startswith("checkpoint at")]
    assert (
        saved[0] == "checkpoint at task 1 of 3, after 1 of its 4 batches (8 stream samples trained)"
    )
    assert "checkpoint at the end of task 1 of 3 (32 stream samples trained)" in saved
    assert saved[-1].startswith("checkpoint at task 2 of 3, after 2 of its 4 batches")
    err = capsys.readouterr().err
    assert "task 1/3" in err and "task 2/3" in err and "task 0" not in err
    assert "interrupted (SIGINT) at task 2 of 3, after 2 of its 4 batches" in err
    assert not [line for line in lines if "task 0" in line]


def test_a_signal_at_a_task_end_stops_after_its_evaluation(tmp_path, capsys):
    """A signal during the evaluation: the task-end checkpoint is the whole state to stop at."""
    from pilot_online.engine.checkpointer import RunInterrupted

    run = p_fgh_run()
    session = run.session(tmp_path)
    evaluate = session.evaluate_task_end

    def evaluate_then_signal(task):
        report = evaluate(task)
        os.kill(os.getpid(), signal.SIGINT)
        return report

    session.evaluate_task_end = evaluate_then_signal
    with pytest.raises(RunInterrupted):
        session.run()
    assert "interrupted (SIGINT) at the end of task 1 of 3 (32 stream" in capsys.readouterr().err
    assert run.session(tmp_path).resume_position == (1, 0)


def test_a_signal_without_checkpoints_says_the_rerun_starts_over(tmp_path, capsys, caplog):
    from pilot_online.engine.checkpointer import RunInterrupted

    run = p_fgh_run()
    config = {**run.config, "checkpoint_every": None}
    session = run.session(tmp_path, config=config)
    session.data = SignalSource(*run.data, signum=signal.SIGINT, at=2)
    with pytest.raises(RunInterrupted):
        session.run()
    assert "checkpoint_every is null, so nothing was saved; a rerun starts over" in (
        capsys.readouterr().err
    )
    assert not list(tmp_path.glob("*.ckpt.pt"))


def test_a_rerun_that_finds_partial_results_but_no_checkpoint_says_it_starts_over(tmp_path, caplog):
    run = p_fgh_run()
    session = run.session(tmp_path, kill_after=2)  # before the first checkpoint (batch 3)
    with pytest.raises(Killed):
        session.run()
    partial = tmp_path / "run.partial.results.json"
    assert partial.exists() and not session.checkpoint_path.exists()
    with caplog.at_level("WARNING"):
        assert run.session(tmp_path).resume_position == (0, 0)
    assert f"starting over from the first batch: {partial} is an earlier attempt's" in caplog.text
    assert "it stopped before its first checkpoint" in caplog.text


def test_checkpoint_path_sits_beside_the_results_file(tmp_path):
    path = tmp_path / "smoke_1993_vit.results.json"
    assert checkpoint_path_for(path) == tmp_path / "smoke_1993_vit.ckpt.pt"
    run = p_fgh_run()
    config = {**run.config}
    adapter, network = run.setup(config)
    loop = build_loop(adapter, network, config, C)
    with pytest.raises(ValueError, match=r"checkpoint_every is set but .* no results_path"):
        OnlineSession(loop, run.stream, NoisySource(*run.data), config, None, progress=False)


def test_checkpoint_every_null_leaves_a_checkpoint_alone(tmp_path, caplog):
    run, path = killed_checkpoint(tmp_path)
    before = path.read_bytes()
    session = run.session(tmp_path, config={**run.config, "checkpoint_every": None})
    assert session.checkpoint_path is None and session.resume_position == (0, 0)
    assert "starting over: checkpoint_every is null" in caplog.text
    assert path.read_bytes() == before


# -- atomic writes --------------------------------------------------------------------------------
def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A write that dies half-way (here: torch.save raising after some bytes) leaves the old
    checkpoint and no other file: readers never see a partial checkpoint."""
    from pilot_online.engine import checkpoint as checkpoint_module

    run, path = killed_checkpoint(tmp_path)
    before = path.read_bytes()
    real_save = torch.save

    def dying_save(payload, handle):
        real_save(payload, handle)
        handle.seek(len(before) // 3)
        handle.truncate()
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.torch, "save", dying_save)
    session = run.session(tmp_path)  # resumes at task 1
    with pytest.raises(OSError, match="disk full"):
        session.run()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if ".ckpt" in p.name) == [path.name]


def test_a_killed_writer_leaves_only_a_temporary_file_which_is_cleaned(tmp_path):
    """SIGKILL during a write leaves ``.<name>.*.tmp`` beside a complete checkpoint; the next
    session ignores its contents, deletes it and resumes from the complete checkpoint."""
    run, path = killed_checkpoint(tmp_path)
    stale = tmp_path / f".{path.name}.abc123.tmp"
    stale.write_bytes(path.read_bytes()[:100])
    session = run.session(tmp_path)
    assert not stale.exists()
    assert session.resume_position == (1, 0)


# -- seeded augmentations (the PILOT data source) -------------------------------------------------
class RandomDataset(torch.utils.data.Dataset):
    """Each item draws from torch's, numpy's and Python's global generators."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index):
        return torch.tensor([torch.rand(()).item(), np.random.rand(), random.random(), index])


def test_seeded_samples_do_not_depend_on_workers_order_or_iterator():
    from pilot_online.pilot.data import SeededSamples

    dataset = SeededSamples(RandomDataset(), seed=5)

    def load(batches, workers):
        # The loader's own worker seeds come from a generator of its own (as PilotDataSource's).
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=batches, num_workers=workers, generator=torch.Generator()
        )
        return torch.cat(list(loader))

    order = [[3, 0, 7], [11, 2], [5, 9, 1, 4]]
    reseed(123)
    state = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    single = load(order, 0)  # loaded in this process
    # The caller's generators are where they were.
    assert torch.equal(torch.get_rng_state(), state[0])
    assert (np.random.get_state()[1] == state[1]).all() and random.getstate() == state[2]
    assert torch.equal(load(order, 2), single)  # two workers: the same draws
    # A fresh iterator over the last two batches (a resume) draws what the full pass drew.
    assert torch.equal(load(order[1:], 2), single[3:])
    # Each sample's draws depend on the seed and the sample.
    assert len(set(single[:, 0].tolist())) == len(single) == 9
    other_seed = torch.utils.data.DataLoader(SeededSamples(RandomDataset(), 6), batch_sampler=order)
    assert not torch.equal(torch.cat(list(other_seed)), single)


def test_seeded_never_reseeds_a_cuda_generator(monkeypatch):
    """torch.manual_seed reseeds every GPU's generator (lazily, even before CUDA starts) and
    nothing restored them: GPU dropout then depended on how many samples the main process
    loaded, i.e. on num_workers. seeded() must touch torch's CPU generator only."""
    from pilot_online.core.rng import key_seed, seeded

    def refuse(*args, **kwargs):
        raise AssertionError("seeded() reseeded a CUDA generator")

    for name in ("manual_seed", "manual_seed_all", "set_rng_state", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    with seeded(5, 11):
        drawn = torch.rand(4)
    # The CPU draws are those of a generator seeded with the key (as torch.manual_seed gave).
    assert torch.equal(
        drawn, torch.rand(4, generator=torch.Generator().manual_seed(key_seed(5, 11)))
    )


def test_seeded_leaves_every_global_generator_where_it_was(device):
    from pilot_online.core.rng import seeded

    reseed(9)
    cpu_before = torch.get_rng_state()
    cuda_before = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    with seeded(1, 2):
        torch.rand(3), np.random.rand(), random.random()
    assert torch.equal(torch.get_rng_state(), cpu_before)
    if cuda_before is not None:
        assert torch.equal(torch.cuda.get_rng_state(device), cuda_before)
        # And the GPU's next draws are those it would have made without the block.
        after = torch.rand(5, device=device)
        torch.cuda.set_rng_state(cuda_before, device)
        assert torch.equal(after, torch.rand(5, device=device))


class FakeCuda:
    """torch.cuda's generator functions over 4 fake GPUs: reading or writing every GPU's state
    at once fails, so only the run's own device may be touched."""

    def __init__(self, monkeypatch) -> None:
        self.states = {k: torch.full((8,), k, dtype=torch.uint8) for k in range(4)}
        self.set_on: list[int] = []
        for name, value in {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "current_device": lambda: 2,
            "get_rng_state": self.get,
            "set_rng_state": self.set,
            "get_rng_state_all": self.refuse,
            "set_rng_state_all": self.refuse,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def get(self, device="cuda"):
        return self.states[torch.device(device).index].clone()

    def set(self, state, device="cuda"):
        self.set_on.append(torch.device(device).index)
        self.states[torch.device(device).index] = state.clone()

    def refuse(self, *args):
        raise AssertionError("every visible GPU's generator was read or written")


def test_rng_state_holds_the_training_devices_generator_only(monkeypatch):
    from pilot_online.core.rng import capture_rng_state, restore_rng_state

    cuda = FakeCuda(monkeypatch)
    state = capture_rng_state(torch.device("cuda:1"))  # trained on cuda:1 of 4 visible GPUs
    assert torch.equal(state["cuda"], torch.full((8,), 1, dtype=torch.uint8))
    assert "cuda" not in capture_rng_state(torch.device("cpu"))
    # "cuda" alone is the current device (2 here), as torch reads it.
    assert torch.equal(capture_rng_state("cuda")["cuda"], torch.full((8,), 2, dtype=torch.uint8))
    # Resumed under the sweep, which shows the run one GPU: it is cuda:0 now.
    restore_rng_state(state, torch.device("cuda:0"))
    assert cuda.set_on == [0] and torch.equal(cuda.states[0], state["cuda"])
    # A CPU resume of a CUDA checkpoint does not touch any GPU.
    restore_rng_state(state, torch.device("cpu"))
    assert cuda.set_on == [0]
    with pytest.raises(ValueError, match="every visible GPU"):
        restore_rng_state({**state, "cuda": [state["cuda"]]}, torch.device("cuda:0"))


def test_a_session_checkpoint_saves_its_devices_generator(tmp_path, monkeypatch):
    """The session passes its loop's device to the RNG capture (CPU here: no CUDA state)."""
    from pilot_online.engine import session as session_module

    seen = []
    capture = session_module.capture_rng_state
    monkeypatch.setattr(
        session_module, "capture_rng_state", lambda device=None: seen.append(device) or capture()
    )
    run = p_fgh_run()
    run.straight(tmp_path)
    assert seen and all(device == torch.device("cpu") for device in seen)


def test_unsigned_numpy_state_is_stored_as_signed_tensors():
    """numpy's generator key is uint32, which torch < 2.3 (the floor is 2.1) cannot hold."""
    from pilot_online.engine.checkpoint import _decode, _encode

    key = np.array([0, 1, 2**32 - 1, 2**31], dtype=np.uint32)
    encoded = _encode({"key": key, "u8": np.array([255], dtype=np.uint8)})
    assert encoded["key"]["__numpy_array__"].dtype == torch.int32
    decoded = _decode(encoded)
    assert decoded["key"].dtype == np.uint32 and (decoded["key"] == key).all()
    assert decoded["u8"].dtype == np.uint8 and decoded["u8"][0] == 255


@requires_pilot
def test_pilot_data_source_augments_each_stream_sample_the_same_way(pilot, monkeypatch):
    """PILOT's DummyDataset with random crops and flips, through PilotDataSource: the stream
    batches are the same with 0 or 2 workers, and a fresh loader over the remaining batches (a
    resume) yields what the full pass yielded for them."""
    from types import SimpleNamespace

    from torchvision import transforms

    monkeypatch.syspath_prepend(str(pilot))
    from pilot_online.pilot.data import PilotDataSource

    try:
        images = np.random.default_rng(0).integers(0, 256, (12, 16, 16, 3), dtype=np.uint8)
        manager = SimpleNamespace(
            _train_data=images,
            _train_targets=np.arange(12) % 3,
            _test_data=images[:3],
            _test_targets=np.arange(3),
            _train_trsf=[transforms.RandomCrop(16, padding=4), transforms.RandomHorizontalFlip()],
            _test_trsf=[],
            _common_trsf=[transforms.ToTensor()],
            use_path=False,
        )
        batches = [np.array([4, 0, 9]), np.array([11, 2, 7]), np.array([5, 1])]

        def stream(workers: int, batches=batches) -> torch.Tensor:
            config = {"num_workers": workers, "eval_batch_size": 4}
            source = PilotDataSource(manager, config, seed=1993)
            return torch.cat([x for x, _ in source.train_batches(batches)])

        single = stream(0)
        assert torch.equal(stream(2), single)
        assert torch.equal(stream(2, batches[1:]), single[3:])
        # The augmentations are random (a plain pass over the same images differs from them).
        plain = torch.stack([transforms.ToTensor()(images[i]) for b in batches for i in b])
        assert not torch.equal(single, plain)
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] in ("models", "utils", "backbone")]:
            del sys.modules[name]


# -- the real thing: SIGKILL a `pilot-online run` through PILOT and rerun the same command ---------
PILOT_CHECKPOINT = "logs/coda_online/synthetic_tiny/0/4/smoke_1993_vit_base_patch16_224_coda_prompt"


def pilot_config() -> dict:
    config = json.loads((EXPS / "smoke_coda_online.json").read_text())  # CODA + P + FGH
    config.update(
        dataset="synthetic_tiny",  # 2 tasks of 4 classes x 20 samples
        init_cls=4,
        increment=4,
        batch_size=20,  # 4 stream batches per task
        eval_batch_size=40,
        checkpoint_every=3,  # after batch 3 of task 0, at task 0's end, after batch 2 of task 1
    )
    return config


def cli_run(pilot: Path, config_path: Path, tmp_path: Path, workdir: Path) -> subprocess.Popen:
    """``pilot-online run`` in ``workdir`` (PILOT's logs/ and our files go there), output to a
    file (a pipe nobody reads could fill up and stall the run)."""
    workdir.mkdir(exist_ok=True)
    with open(workdir / "output.txt", "a") as output:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pilot_online.cli",
                "run",
                "--config",
                str(config_path),
                "--pilot-root",
                str(pilot),
            ],
            cwd=workdir,
            env=offline_env(tmp_path),
            stdout=output,
            stderr=subprocess.STDOUT,
        )


@requires_pilot
def test_pilot_run_killed_mid_task_resumes_bit_identical(pilot, tmp_path):
    """The same command (same config file, results under each working directory's logs/) runs
    uninterrupted in one folder and is SIGKILLed once a mid-task checkpoint exists, then rerun,
    in another; the two results files may differ only in timing, date and the resume record."""
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(pilot_config()))
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    checkpoint = resumed_dir / f"{PILOT_CHECKPOINT}.ckpt.pt"

    victim = cli_run(pilot, config_path, tmp_path, resumed_dir)
    straight = cli_run(pilot, config_path, tmp_path, straight_dir)  # meanwhile, uninterrupted
    deadline = time.monotonic() + 600
    while not checkpoint.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert checkpoint.exists(), (resumed_dir / "output.txt").read_text()[-3000:]
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    results_dir = checkpoint.parent
    assert not list(results_dir.glob("*.results.json"))  # killed before any results

    rerun = cli_run(pilot, config_path, tmp_path, resumed_dir)
    assert rerun.wait(timeout=600) == 0, (resumed_dir / "output.txt").read_text()[-3000:]
    assert straight.wait(timeout=600) == 0, (straight_dir / "output.txt").read_text()[-3000:]

    name = f"{PILOT_CHECKPOINT}.results.json"
    resumed = load_results(resumed_dir / name)
    uninterrupted = load_results(straight_dir / name)
    # It resumed mid-task: the first checkpoint is after batch 3 of task 0's 4 (polled every
    # 10 ms, it is the newest when the kill lands; task 0's end-of-task one would have step 0).
    (position,) = resumed["extra"]["resumed_from"]
    assert position["step"] > 0 and position["samples_seen"] > 0, position
    assert "resuming from" in (resumed_dir / "output.txt").read_text()
    assert json.dumps(comparable(resumed), sort_keys=True) == json.dumps(
        comparable(uninterrupted), sort_keys=True
    )
    assert resumed["metrics"]["accuracy_matrix"] == uninterrupted["metrics"]["accuracy_matrix"]
    assert resumed["extra"]["diagnostics"]["fgh"]["alpha"]  # FGH ran (P + FGH config)
    trace = f"{PILOT_CHECKPOINT}.results.gradtrace.npy"
    assert (resumed_dir / trace).read_bytes() == (straight_dir / trace).read_bytes()
    assert not checkpoint.exists()  # removed once the results were written
    assert not [p for p in results_dir.iterdir() if p.name.endswith(".tmp")]

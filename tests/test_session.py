"""OnlineSession: task-end and periodic evaluation, the accuracy matrix, the results file.

Predictions come from "lookup" adapters whose logits are fixed scores (plus a tiny trainable
classifier so the loop has something to train), so every accuracy is worked out by hand:

* ``perfect``: a score of 1000 on the true class (encoded in the input's first entry);
* ``min_class``: score -1000 * c, so the prediction is the smallest allowed class id and the
  top-k list is the k smallest allowed ids.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet, VectorSource
from torch import nn

from pilot_online.core.results import load_results
from pilot_online.core.streams import clear_stream, si_blurry_stream
from pilot_online.engine import events
from pilot_online.engine import session as session_module
from pilot_online.engine.adapter import Consolidated, StepOutput
from pilot_online.engine.events import RunListener, StepEvent
from pilot_online.engine.loop import OnlineLoop
from pilot_online.engine.session import ArrayDataSource, OnlineSession, unique_results_path

C, D_IN, HIDDEN = 6, 4, 3
# Training samples per class; test samples per class (class 0 has two test samples).
TRAIN_COUNTS = [5, 3, 4, 6, 2, 7]
TEST_COUNTS = [2, 1, 1, 1, 1, 1]
TEST_Y = np.repeat(np.arange(C), TEST_COUNTS)  # [0, 0, 1, 2, 3, 4, 5]
CONFIG = {"optimizer": "adam", "init_lr": 0.01, "logit_mask": "batch", "model_name": "lookup"}


def perfect(x: torch.Tensor) -> torch.Tensor:
    return 1000.0 * nn.functional.one_hot(x[:, 0].round().long(), C).float()


def min_class(x: torch.Tensor) -> torch.Tensor:
    return (-1000.0 * torch.arange(C, dtype=torch.float32, device=x.device)).expand(len(x), C)


def boost_class_5(x: torch.Tensor) -> torch.Tensor:
    """Perfect, except that class 5 always gets a far larger logit."""
    five = torch.full((len(x),), 5, device=x.device)
    return perfect(x) + 5000.0 * nn.functional.one_hot(five, C).float()


class LookupAdapter(TinyAdapter):
    """logits = fixed scores(x) + fc(features); |fc| << 1000, so the scores decide."""

    base_model_name = "lookup"
    scores = staticmethod(perfect)

    def build_network(self, args: dict) -> nn.Module:
        return small_net()

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        out = super().forward(network, x, train)
        return StepOutput(out.logits + self.scores(x), out.features)


def small_net() -> TinyNet:
    return TinyNet(d_in=D_IN, hidden=HIDDEN, num_classes=C)


def label_source(train_y: np.ndarray, test_y: np.ndarray = TEST_Y) -> VectorSource:
    """A VectorSource whose vectors carry their label in the first entry (evaluated 3 at a time)."""
    generator = torch.Generator().manual_seed(0)

    def encode(labels: np.ndarray) -> torch.Tensor:
        x = torch.randn(len(labels), D_IN, generator=generator)
        x[:, 0] = torch.tensor(labels, dtype=torch.float32)
        return x

    return VectorSource(encode(train_y), train_y, encode(test_y), test_y, eval_batch_size=3)


def train_labels() -> np.ndarray:
    return np.repeat(np.arange(C), TRAIN_COUNTS)


def make_session(
    stream, scores=perfect, config=None, results_path=None, seed=0, source=None, device="cpu"
):
    config = {**CONFIG, **(config or {})}
    torch.manual_seed(seed)
    adapter = LookupAdapter()
    adapter.scores = scores
    loop = OnlineLoop(adapter, small_net(), config, C, device)
    source = source or label_source(stream.labels)
    return OnlineSession(loop, stream, source, config, results_path, progress=False)


def run_all(session) -> list[dict]:
    outputs = []
    for task in range(session.stream.num_tasks):
        session.train_task(task)
        outputs.append(session.evaluate_task_end(task))
    return outputs


def two_task_stream():
    # Tasks: classes {0, 1, 2} (5 + 3 + 4 = 12 samples) and {3, 4, 5} (6 + 2 + 7 = 15).
    return clear_stream(train_labels(), init_cls=3, increment=3, batch_size=4, seed=0)


def three_task_stream():
    # Tasks: {0, 1} (8 samples), {2, 3} (10), {4, 5} (9); batch 4 -> steps end at cumulative
    # sample counts 4, 8 | 12, 16, 18 | 22, 26, 27.
    return clear_stream(train_labels(), init_cls=2, increment=2, batch_size=4, seed=0)


# --------------------------------------------------------------------------- task-end evaluation


def test_evaluate_task_end_structure_and_values_by_hand(device) -> None:
    session = make_session(two_task_stream(), scores=min_class, device=device)
    session.train_task(0)
    first = session.evaluate_task_end(0)
    # Exposed {0, 1, 2}: test samples 0, 0, 1, 2; the model predicts 0 -> 2 / 4 = 50 %.
    # top5 is top-min(5, 3): the three allowed classes always contain the label -> 100 %.
    assert first == {
        "grouped": {"task-00": 50.0, "total": 50.0, "old": 0.0, "new": 50.0},
        "top1": 50.0,
        "top5": 100.0,
    }
    session.train_task(1)
    second = session.evaluate_task_end(1)
    # All 7 test samples; predictions 0: task 0 = 2 / 4 = 50, task 1 = 0 / 3 = 0,
    # total = 2 / 7 = 28.57; top-5 = {0..4} misses only the class-5 sample: 6 / 7 = 85.71.
    assert second == {
        "grouped": {"task-00": 50.0, "task-01": 0.0, "total": 28.57, "old": 50.0, "new": 0.0},
        "top1": 28.57,
        "top5": 85.71,
    }
    metrics = session.results()["metrics"]
    assert metrics["accuracy_matrix"] == [[50.0, 50.0], [None, 0.0]]
    assert metrics["A_k"] == [50.0, 25.0]  # (50) and (50 + 0) / 2
    assert metrics["AP"] == pytest.approx(37.5)
    assert metrics["A_T"] == pytest.approx(25.0)
    assert metrics["forgetting"] == pytest.approx(0.0)  # task 0: max(50) - 50
    assert metrics["A_last"] == pytest.approx(28.57)
    assert metrics["A_avg"] == pytest.approx((50.0 + 28.57) / 2)


def test_only_exposed_classes_are_evaluated() -> None:
    stream = two_task_stream()
    source = label_source(stream.labels)
    session = make_session(stream, source=source)
    session.train_task(0)
    result = session.evaluate_task_end(0)
    # Test positions of classes 0, 1, 2 in TEST_Y = [0, 0, 1, 2, 3, 4, 5].
    assert source.requests[-1].tolist() == [0, 1, 2, 3]
    assert result["top1"] == 100.0
    assert "task-01" not in result["grouped"]


def test_logits_of_unexposed_classes_never_win(device) -> None:
    session = make_session(two_task_stream(), scores=boost_class_5, device=device)
    session.train_task(0)
    assert session.evaluate_task_end(0)["top1"] == 100.0  # class 5 (huge logit) is masked
    y_pred, _ = session.loop.predict(
        session.data.eval_batches(np.arange(len(TEST_Y))),
        torch.tensor([True, True, True, True, True, False]),
        topk=1,
    )
    assert 5 not in y_pred
    session.train_task(1)
    result = session.evaluate_task_end(1)
    # Now class 5 is allowed and wins everywhere: 1 / 7 = 14.29; task 1: 1 / 3 = 33.33.
    assert result["grouped"] == {
        "task-00": 0.0,
        "task-01": 33.33,
        "total": 14.29,
        "old": 0.0,
        "new": 33.33,
    }


def test_accuracy_matrix_of_a_perfect_and_a_constant_model() -> None:
    perfect_session = make_session(three_task_stream(), scores=perfect)
    run_all(perfect_session)
    matrix = perfect_session.results()["metrics"]["accuracy_matrix"]
    assert matrix == [[100.0, 100.0, 100.0], [None, 100.0, 100.0], [None, None, 100.0]]

    constant = make_session(three_task_stream(), scores=min_class)
    run_all(constant)
    metrics = constant.results()["metrics"]
    # Predicts 0 always: task 0 ({0, 1}: 3 test samples, 2 of class 0) = 66.67; others 0.
    a = 200 / 3
    expected = [[a, a, a], [None, 0.0, 0.0], [None, None, 0.0]]
    for row, expected_row in zip(metrics["accuracy_matrix"], expected):
        assert row == pytest.approx(expected_row)
    assert metrics["A_k"] == pytest.approx([a, a / 2, a / 3])
    assert metrics["AP"] == pytest.approx((a + a / 2 + a / 3) / 3)


def _blurry_stream():
    stream = si_blurry_stream(train_labels(), num_tasks=3, n=50, m=30, seed=3, batch_size=4)
    exposure = stream.exposure_task()
    present = [set(stream.labels[t].tolist()) for t in stream.tasks]
    # Blurry for this seed: some task streams a class first exposed in an earlier task, so
    # grouping by "classes present" and grouping by first exposure differ.
    assert any(exposure[c] < t for t, classes in enumerate(present) for c in classes)
    return stream, exposure


def test_si_blurry_grouping_follows_first_exposure() -> None:
    stream, exposure = _blurry_stream()
    perfect_session = make_session(stream, scores=perfect)
    run_all(perfect_session)
    matrix = perfect_session.results()["metrics"]["accuracy_matrix"]
    for task in range(3):
        owns = bool(np.any(exposure == task))
        for after in range(3):
            assert matrix[task][after] == (100.0 if owns and task <= after else None)

    constant = make_session(stream, scores=min_class)
    run_all(constant)
    matrix = constant.results()["metrics"]["accuracy_matrix"]
    test_counts = np.array(TEST_COUNTS)
    for after in range(3):
        allowed = np.flatnonzero((exposure >= 0) & (exposure <= after))
        winner = allowed.min()  # the model predicts the smallest allowed class
        for task in range(3):
            owned = np.flatnonzero(exposure == task)
            if task > after or not len(owned):
                assert matrix[task][after] is None
                continue
            # a[task][after] = share of task's test samples whose class is the winner.
            hits = test_counts[winner] if exposure[winner] == task else 0
            expected = 100.0 * hits / test_counts[owned].sum()
            assert matrix[task][after] == pytest.approx(expected)


# --------------------------------------------------------------------------- periodic evaluation


@pytest.mark.parametrize(
    ("period", "evaluated_at"),
    [
        # Steps end at 4, 8, 12, 16, 18, 22, 26, 27 samples. An evaluation runs after the first
        # step that reaches the next multiple of the period; one step crossing two multiples
        # runs one evaluation.
        (5, [8, 12, 16, 22, 26]),  # floor(27 / 5) = 5
        (10, [12, 22]),  # floor(27 / 10) = 2
        (3, [4, 8, 12, 16, 18, 22, 26, 27]),  # 8 < floor(27 / 3) = 9: 12 crosses 9 and 12
    ],
)
def test_periodic_evaluation_count_and_auc(period: int, evaluated_at: list[int]) -> None:
    stream = three_task_stream()
    session = make_session(stream, scores=min_class, config={"eval_period": period})
    run_all(session)
    assert [p["samples_seen"] for p in session.periodic] == evaluated_at

    # By hand: after a step, allowed = classes streamed so far; prediction = the smallest one.
    test_counts = np.array(TEST_COUNTS)
    seen: set[int] = set()
    done, expected = 0, []
    for batch in stream.batches():
        seen |= set(stream.labels[batch.indices].tolist())
        done += len(batch)
        if done in evaluated_at:
            classes = sorted(seen)
            expected.append(100.0 * test_counts[classes[0]] / test_counts[classes].sum())
    accuracies = [p["accuracy"] for p in session.periodic]
    assert accuracies == pytest.approx(expected)
    results = session.results()
    assert results["metrics"]["A_auc"] == pytest.approx(float(np.mean(expected)))
    assert results["extra"]["periodic_evaluations"] == session.periodic


def test_no_periodic_evaluation_without_eval_period() -> None:
    session = make_session(three_task_stream())
    run_all(session)
    assert session.periodic == []
    assert session.results()["metrics"]["A_auc"] is None


# --------------------------------------------------------------------------- results file


def test_write_complete_partial_and_never_overwrite(tmp_path, device) -> None:
    stream = three_task_stream()
    path = tmp_path / "run_0.results.json"
    session = make_session(stream, results_path=path, device=device)
    run_all(session)
    written = session.write()
    assert session.written_path == path
    loaded = load_results(path)
    assert loaded == json.loads(json.dumps(written))
    assert loaded["status"] == "complete"
    assert loaded["counters"]["samples_seen"] == len(stream) == 27
    assert loaded["counters"]["optimizer_steps"] == 8  # 2 + 3 + 3 batches of 4
    assert loaded["counters"]["tasks_trained"] == 3
    assert loaded["config"]["model_name"] == "lookup"
    assert loaded["stream"]["kind"] == "clear" and loaded["stream"]["num_samples"] == 27
    trace_path = tmp_path / "run_0.results.gradtrace.npy"
    assert loaded["extra"]["gradient_imbalance"]["trace_file"] == trace_path.name
    trace = np.load(trace_path)
    assert trace.shape == (8, C)  # [optimizer_steps, classes]
    assert trace.dtype == np.float32

    partial = tmp_path / "run_0.partial.results.json"
    session.write(status="failed", error="boom")
    assert load_results(partial)["status"] == "failed"
    assert load_results(partial)["error"] == "boom"
    session.write(status="failed", error="again")  # partial files may be rewritten
    assert load_results(partial)["error"] == "again"
    assert (tmp_path / "run_0.partial.results.gradtrace.npy").exists()

    # A second complete write must not replace the finished run's results or its trace.
    results_bytes, trace_bytes = path.read_bytes(), trace_path.read_bytes()
    other = make_session(stream, results_path=path, seed=1)
    other.train_task(0)
    with pytest.raises(FileExistsError):
        other.write()
    assert path.read_bytes() == results_bytes
    assert trace_path.read_bytes() == trace_bytes


def test_write_without_a_path_returns_the_results() -> None:
    session = make_session(three_task_stream())
    session.train_task(0)
    results = session.write()
    assert session.written_path is None
    assert results["counters"]["samples_seen"] == 8  # task 0 only
    assert results["counters"]["tasks_trained"] == 1
    # Only column 0 was measured: later columns are None.
    assert [row[1:] for row in results["metrics"]["accuracy_matrix"]] == [[None, None]] * 3


def test_unique_results_path(tmp_path) -> None:
    path = tmp_path / "run_0.results.json"
    assert unique_results_path(path) == path
    path.write_text("{}")
    other = unique_results_path(path)
    assert other != path and not other.exists()
    assert other.parent == tmp_path
    assert other.name.startswith("run_0.") and other.name.endswith(".results.json")


def test_unique_results_path_never_returns_an_existing_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(session_module.time, "strftime", lambda *args: "STAMP")
    path = tmp_path / "run_0.results.json"
    path.write_text("{}")
    stamped = tmp_path / "run_0.STAMP.results.json"
    assert unique_results_path(path) == stamped
    stamped.write_text("{}")  # a second run within the same second
    third = unique_results_path(path)
    assert third not in (path, stamped) and not third.exists()
    assert third.name.endswith(".results.json")


# --------------------------------------------------------------------------- input checks


def test_labels_outside_the_model_raise_at_construction() -> None:
    stream = two_task_stream()
    adapter = LookupAdapter()
    narrow = TinyNet(d_in=D_IN, hidden=HIDDEN, num_classes=C - 1)
    loop = OnlineLoop(adapter, narrow, CONFIG, num_classes=C - 1)  # labels go up to 5
    with pytest.raises(ValueError, match="training labels"):
        OnlineSession(loop, stream, label_source(stream.labels), CONFIG, progress=False)
    loop = OnlineLoop(adapter, small_net(), CONFIG, num_classes=C)
    bad_test = label_source(stream.labels, test_y=np.array([0, 1, -1]))
    with pytest.raises(ValueError, match="test labels"):
        OnlineSession(loop, stream, bad_test, CONFIG, progress=False)
    bad_test = label_source(stream.labels, test_y=np.array([0, 6]))
    with pytest.raises(ValueError, match="test labels"):
        OnlineSession(loop, stream, bad_test, CONFIG, progress=False)


def test_array_data_source_yields_stream_batches_in_order() -> None:
    images = np.arange(5 * 2 * 2 * 3, dtype=np.uint8).reshape(5, 2, 2, 3)
    labels = np.array([0, 1, 2, 3, 4])
    source = ArrayDataSource(images, labels, images[:3], labels[:3], eval_batch_size=2)
    batches = list(source.train_batches([np.array([3, 1]), np.array([4])]))
    assert [y.tolist() for _, y in batches] == [[3, 1], [4]]
    x, _ = batches[0]
    assert x.shape == (2, 3, 2, 2)  # NCHW
    # Pixel (h=0, w=0, channel 1) of image 3: byte 3 * 12 + 1 = 37 -> 37 / 255.
    assert x[0, 1, 0, 0].item() == pytest.approx(37 / 255)
    test = list(source.eval_batches(np.array([0, 1, 2])))
    assert [y.tolist() for _, y in test] == [[0, 1], [2]]


# --------------------------------------------------------------- the seeds of one config (issue 15)


def test_reset_peak_memory_collects_then_resets_the_runs_device(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(events.gc, "collect", lambda: calls.append("gc") or 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(d))
    events.reset_peak_memory(torch.device("cuda:1"))
    assert calls == ["gc", torch.device("cuda:1")]  # freed first, then counted from here
    events.reset_peak_memory(torch.device("cpu"))
    assert calls == ["gc", torch.device("cuda:1"), "gc"]  # no CUDA call for a CPU run


def test_every_seeds_session_starts_its_own_peak_memory_count(monkeypatch, device) -> None:
    """PILOT runs all seeds in one process: each session (one seed) resets the peak."""
    resets = []
    monkeypatch.setattr(session_module, "reset_peak_memory", resets.append)
    for seed in (0, 1):
        run_all(make_session(three_task_stream(), seed=seed, device=device))
    assert resets == [device, device]


class Attention(nn.Module):
    """A timm-style attention module (what ``use_sdpa`` recognises), without prompts."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.num_heads, self.scale = heads, (width // heads) ** -0.5
        self.attn_drop, self.proj_drop = nn.Dropout(0.0), nn.Dropout(0.0)


def test_a_network_with_sdpa_attention_is_freed_without_the_garbage_collector() -> None:
    """``module.forward = MethodType(f, module)`` was a reference cycle: a dropped network's
    weights stayed allocated until a collection, into the next seed's peak memory."""
    import gc
    import weakref

    from pilot_online.pilot.attention import plain_forward, use_sdpa

    network = nn.Sequential(Attention(), Attention())
    assert use_sdpa(network) == 2
    assert network[0].forward.__func__ is plain_forward and "forward" not in vars(network[0])
    out = network(torch.randn(2, 5, 8))
    assert out.shape == (2, 5, 8)
    del out
    weights = [weakref.ref(p) for p in network.parameters()]
    modules = [weakref.ref(m) for m in network.modules()]
    gc.collect()
    gc.disable()
    try:
        del network
        assert all(ref() is None for ref in modules + weights)
    finally:
        gc.enable()


def test_a_finished_sessions_network_is_freed_without_the_garbage_collector(device) -> None:
    import gc
    import weakref

    from pilot_online.engine.config import PAPER_FGH

    config = {"online_prototypes": True, "fgh": dict(PAPER_FGH)}
    session = make_session(three_task_stream(), config=config, device=device)
    run_all(session)
    session.results()
    network = weakref.ref(session.loop.network)
    gc.collect()
    gc.disable()
    try:
        del session
        assert network() is None
    finally:
        gc.enable()


def seed_config(**overrides) -> dict:
    return {**CONFIG, "checkpoint_every": 2, "prefix": "p", **overrides}


class CountingSource(VectorSource):
    """Counts the stream batches it yields; ``kill_after`` raises instead of yielding more."""

    def __init__(self, *args, kill_after: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kill_after, self.yielded = kill_after, 0

    def train_batches(self, batches):
        for batch in super().train_batches(batches):
            if self.kill_after is not None and self.yielded == self.kill_after:
                raise KeyboardInterrupt("killed")
            self.yielded += 1
            yield batch


def run_seeds(folder, seeds, config=None, kill=None) -> dict[int, dict]:
    """What PILOT's trainer does with ``OnlineLearner`` for each seed of a config, in one
    process: the learner's choice between a :class:`CompletedRun` and a (resuming) session,
    then train/evaluate every task. ``kill``: (seed, batch) at which that seed is killed.
    Returns, per seed, the batches trained, the reports PILOT received and the results."""
    from pilot_online.core.results import results_path
    from pilot_online.engine.checkpoint import CompletedRun, checkpoint_path_for, completed_results

    out = {}
    for seed in seeds:
        cfg = seed_config(seed=seed, **(config or {}))
        stream = three_task_stream()
        path = results_path(folder, cfg["prefix"], seed, "tiny")
        completed = completed_results(path, cfg)
        base = label_source(stream.labels)
        source = CountingSource(
            base.train_x,
            np.asarray(base.train_y),
            base.test_x,
            np.asarray(base.test_y),
            eval_batch_size=3,
            kill_after=kill[1] if kill and kill[0] == seed else None,
        )
        if completed is not None:
            session = CompletedRun(path, completed)
        else:
            torch.manual_seed(seed)
            adapter = LookupAdapter()
            loop = OnlineLoop(adapter, small_net(), cfg, C)
            session = OnlineSession(
                loop,
                stream,
                source,
                cfg,
                unique_results_path(path),
                progress=False,
                checkpoint_path=checkpoint_path_for(path),
            )
        reports = []
        for task in range(stream.num_tasks):
            session.train_task(task)
            reports.append(session.complete_task(task))
        results = session.finish()
        out[seed] = {"batches": source.yielded, "reports": reports, "results": results}
    return out


def test_rerunning_a_config_skips_finished_seeds_and_resumes_the_interrupted_one(tmp_path):
    with pytest.raises(KeyboardInterrupt):  # seed 1 killed before its 6th stream batch
        run_seeds(tmp_path, [0, 1], kill=(1, 5))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [
        "p_0_tiny.results.gradtrace.npy",
        "p_0_tiny.results.json",
        "p_1_tiny.ckpt.pt",
    ]
    straight = run_seeds(tmp_path / "straight", [0, 1])
    rerun = run_seeds(tmp_path, [0, 1])
    # Seed 0 trains nothing. Seed 1 (batches per task 2, 3, 3) was killed before its 6th
    # batch, after task 1's end-of-task checkpoint: it trains task 2's 3 batches only.
    assert [rerun[s]["batches"] for s in (0, 1)] == [0, 3]
    # No timestamped copies: the same files, seed 1's results in place of its checkpoint.
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        f"p_{s}_tiny.results.{ext}" for s in (0, 1) for ext in ("gradtrace.npy", "json")
    ]
    for seed in (0, 1):
        # PILOT's trainer received each task's evaluation, as in an uninterrupted run.
        assert rerun[seed]["reports"] == straight[seed]["reports"]
        assert rerun[seed]["results"]["metrics"] == straight[seed]["results"]["metrics"]
    assert rerun[0]["reports"][2]["grouped"]["task-02"] == 100.0  # the perfect lookup model


def test_a_seed_is_trained_again_when_its_results_are_of_another_config(tmp_path, caplog):
    run_seeds(tmp_path, [0])
    rerun = run_seeds(tmp_path, [0], config={"init_lr": 0.02})
    assert rerun[0]["batches"] == 8
    assert "init_lr: 0.01 in the results, 0.02 now" in caplog.text
    # The first run's file stays; the new run's results go beside it, timestamped.
    assert json.loads((tmp_path / "p_0_tiny.results.json").read_text())["config"]["init_lr"] == 0.01
    timestamped = list(tmp_path.glob("p_0_tiny.*.results.json"))
    assert len(timestamped) == 1 and load_results(timestamped[0])["config"]["init_lr"] == 0.02


def test_completed_results_refuses_partial_other_version_and_reportless_files(tmp_path):
    from pilot_online.engine.checkpoint import completed_results

    run_seeds(tmp_path, [0])
    path = tmp_path / "p_0_tiny.results.json"
    config = seed_config(seed=0)
    stored = json.loads(path.read_text())
    assert (
        completed_results(path, config)["extra"]["task_reports"] == stored["extra"]["task_reports"]
    )
    # Keys that cannot change a result (e.g. num_workers) do not block the skip.
    assert completed_results(path, {**config, "num_workers": 7}) is not None
    for change in (
        {"status": "failed"},
        {"pilot_online_version": "0.0.0"},
        {"extra": {k: v for k, v in stored["extra"].items() if k != "task_reports"}},
    ):
        path.write_text(json.dumps({**stored, **change}))
        assert completed_results(path, config) is None, change
    path.write_text("{not json")
    assert completed_results(path, config) is None
    assert completed_results(tmp_path / "absent.results.json", config) is None


def test_the_shipped_backbone_is_the_same_config_from_another_checkout(tmp_path):
    """A results file records the shipped backbone's resolved path, which is the checkout's that
    ran it: the same file under another checkout (a frozen copy for a long grid) is the same
    config, and its seeds are not trained again; another file is another config."""
    from pilot_online.core.scale_backbone import CONFIG_NAME, WEIGHTS
    from pilot_online.engine.checkpoint import completed_results

    run_seeds(tmp_path, [0])
    path = tmp_path / "p_0_tiny.results.json"
    stored = json.loads(path.read_text())
    elsewhere = f"/elsewhere/checkout/{CONFIG_NAME}"
    path.write_text(
        json.dumps({**stored, "config": {**stored["config"], "pretrained_path": elsewhere}})
    )
    config = seed_config(seed=0)
    assert completed_results(path, {**config, "pretrained_path": str(WEIGHTS)}) is not None
    assert completed_results(path, {**config, "pretrained_path": "/my/vit.safetensors"}) is None


def test_the_results_keep_every_tasks_report(device) -> None:
    session = make_session(three_task_stream(), device=device)
    reports = [session.complete_task(t) for t in range(3) if session.train_task(t) is None]
    assert session.results()["extra"]["task_reports"] == reports
    assert [r["top1"] for r in reports] == [100.0, 100.0, 100.0]


def test_each_task_end_logs_the_whole_runs_progress(caplog) -> None:
    """After each task the log says how far the whole run is and, at the pace so far, how long
    the rest takes: with 6 min of training and evaluation after task 1 of 3, about 12 min left
    (whole seconds, so the milliseconds the real evaluation adds do not show)."""
    import logging

    session = make_session(three_task_stream())
    with caplog.at_level(logging.INFO, logger="pilot_online.engine.console"):
        for task in range(3):
            session.train_task(task)
            session.clock.train_seconds = 240.0 * (task + 1)
            session.clock.eval_seconds = 120.0 * (task + 1)
            session.complete_task(task)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run: ")]
    assert lines == [
        "run: 1/3 tasks, 6m00s elapsed, about 12m00s left",
        "run: 2/3 tasks, 12m00s elapsed, about 6m00s left",
        "run: 3/3 tasks, 18m00s elapsed, done",
    ]


# ------------------------------------------------------------------ the driver's events (issue 35)


class ConsolidatingLookup(LookupAdapter):
    """LookupAdapter with a boundary step that changes nothing: any trigger may fire it."""

    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        return Consolidated()


class Recorder(RunListener):
    def __init__(self) -> None:
        self.heard: list[tuple] = []

    def on_task_start(self, task: int, first: int) -> None:
        self.heard.append(("start", task, first))

    def on_firing(self, event: StepEvent) -> None:
        self.heard.append(("firing", event.task, event.step, event.stats.firing))

    def on_step(self, event: StepEvent) -> None:
        self.heard.append(("step", event.task, event.step))

    def on_task_trained(self, task: int) -> None:
        self.heard.append(("trained", task))


def test_listeners_hear_tasks_steps_and_firings_in_order() -> None:
    """Three tasks of 2, 3 and 3 batches (samples 4, 4 | 4, 4, 2 | 4, 4, 1); every 8 samples the
    trigger fires before the next step: before step 3 (8 samples since the start), step 5 (8
    since), and step 8 (4 + 2 + 4 = 10 since), each heard just before its step."""
    config = {**CONFIG, "consolidation": "every_n_samples", "consolidation_every_n_samples": 8}
    adapter = ConsolidatingLookup()
    loop = OnlineLoop(adapter, small_net(), config, C, "cpu")
    stream = three_task_stream()
    session = OnlineSession(loop, stream, label_source(stream.labels), config, progress=False)
    recorder = Recorder()
    session.listeners.append(recorder)
    run_all(session)
    assert recorder.heard == [
        ("start", 0, 0), ("step", 0, 1), ("step", 0, 2), ("trained", 0),
        ("start", 1, 0), ("firing", 1, 1, 0), ("step", 1, 1), ("step", 1, 2),
        ("firing", 1, 3, 1), ("step", 1, 3), ("trained", 1),
        ("start", 2, 0), ("step", 2, 1), ("step", 2, 2), ("firing", 2, 3, 2), ("step", 2, 3),
        ("trained", 2),
    ]  # fmt: skip
    assert loop.trigger.firings == [8, 16, 26]

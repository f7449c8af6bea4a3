"""Real-time mode (issue 29; docs/protocol.md): the stream does not wait for the learner.

A step of cost C trains on one batch in every C; the batches that pass while it runs are scored
by the model the step starts from and never trained on (Ghunaim et al., CVPR 2023; their code,
RealtimeOCL's ``Delay``, writes the fractional cases out by hand: 3 of every 4 batches for LwF's
C = 4/3, batches 0 and 2 of every 5 for MIR's C = 5/2). The hand-computed stream is
test_online_accuracy.py's class-sum model, whose every prediction can be worked out on paper.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet, VectorSource
from test_online_accuracy import CONFIG, TRAIN_X, TRAIN_Y, ClassSumAdapter, stream
from test_resume import Run, assert_same_run, base_config, tiny_setup, vector_data

from pilot_online.core.realtime import RealtimeSchedule, check_realtime
from pilot_online.core.streams import Stream, clear_stream
from pilot_online.engine import flops, scoring
from pilot_online.engine import session as session_module
from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.engine.loop import OnlineLoop
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.session import OnlineSession
from pilot_online.harness import estimate

EXPS = Path(__file__).resolve().parent.parent / "exps"


def trained(cost, batches: int) -> list[int]:
    schedule = RealtimeSchedule(Fraction(cost), "given")
    return [i for i in range(batches) if schedule.trains(i)]


# ------------------------------------------------------------------ the schedule


def test_the_schedule_trains_every_cth_batch_and_ghunaims_fractional_cases() -> None:
    assert trained(1, 6) == [0, 1, 2, 3, 4, 5]
    assert trained(2, 7) == [0, 2, 4, 6]
    assert trained(3, 10) == [0, 3, 6, 9]
    # RealtimeOCL's LwF (C = 4/3): (i % 4) < 3; MIR (C = 5/2): i % 5 in {0, 2}.
    assert trained(Fraction(4, 3), 12) == [i for i in range(12) if i % 4 < 3]
    assert trained(Fraction(5, 2), 15) == [i for i in range(15) if i % 5 in (0, 2)]
    for cost in (1, 2, 3, Fraction(4, 3), Fraction(5, 2), Fraction(146, 100)):
        schedule = RealtimeSchedule(Fraction(cost), "given")
        for batches in range(1, 30):
            assert schedule.trained_count(batches) == len(trained(cost, batches))


def test_a_cost_is_clamped_to_one_and_kept_as_a_small_fraction() -> None:
    cheap = RealtimeSchedule.from_value(0.333, "flops", "finetune_online")
    assert cheap.cost == 1 and cheap.raw == pytest.approx(0.333)
    assert RealtimeSchedule.from_value(1.3334, "flops").cost == Fraction(4, 3)
    assert RealtimeSchedule.from_value(1.46, "given").cost == Fraction(73, 50)
    state = RealtimeSchedule.from_value(2.5, "measured", "finetune_online", {"a": 1}).state_dict()
    assert RealtimeSchedule.from_state(state).cost == Fraction(5, 2)
    with pytest.raises(ValueError, match="source"):
        RealtimeSchedule(Fraction(2), "guessed")


# ------------------------------------------------------------------ C = 2 in a session


def class_sum_session(cost) -> tuple[OnlineSession, dict]:
    config = {**CONFIG, "online_accuracy": None, "realtime": cost}
    adapter = ClassSumAdapter()
    loop = OnlineLoop(adapter, adapter.build_network({}), config, 3)
    source = VectorSource(TRAIN_X, TRAIN_Y, TRAIN_X[:3], np.array([0, 1, 2]))
    session = OnlineSession(loop, stream(), source, config, progress=False)
    return session, session.run()


def test_with_c_2_every_other_batch_trains_and_the_others_are_scored(monkeypatch) -> None:
    """Stream batches 0..3 (two tasks of two): the steps train on batches 0 and 2 only, and
    all 8 samples are scored."""
    steps = []
    original = OnlineLoop.train_step

    def recording(self, inputs, labels, indices=None):
        steps.append(labels.tolist())
        return original(self, inputs, labels, indices)

    monkeypatch.setattr(OnlineLoop, "train_step", recording)
    _, results = class_sum_session(2)
    assert steps == [TRAIN_Y[0:2].tolist(), TRAIN_Y[4:6].tolist()]
    assert results["counters"]["batches_trained"] == 2
    assert results["counters"]["batches_skipped"] == 2
    assert results["counters"]["online_scored_samples"] == 8
    assert results["counters"]["samples_seen"] == 4  # trained samples
    realtime = results["extra"]["realtime"]
    assert (realtime["C"], realtime["source"], realtime["stream_batches"]) == (2.0, "given", 4)


def test_a_online_in_real_time_by_hand() -> None:
    """C = 2. Step 1 (batch 1) meets an empty model: batch 1 and batch 2, which passes while
    step 1 runs, are all wrong. Step 1 trains W0 = a, W1 = b. Step 2 (batch 3): c - a is of
    class 2, unseen: wrong; b -> 1 right. Batch 4 passes, scored by that same model: c is of
    class 2, still unseen: wrong; a -> 0 right. 2 of 8: 25%. Scoring the passing batches by the
    model after the step (the stale model's opposite) would give 4 of 8; the weights hold the
    trained batches only (W1 = 2b: batch 2's a, of class 1, never trained)."""
    session, results = class_sum_session(2)
    assert results["metrics"]["A_online"] == pytest.approx(25.0)
    a, b, c = torch.eye(3)
    expected = torch.stack([a, 2 * b, c - a])
    assert torch.equal(session.loop.network.fc.weight, expected)


def test_skipped_batches_reach_no_memory_prototype_or_statistic() -> None:
    """C = 2 with experience replay and prototypes, on a stream whose odd batches hold class 5
    alone: class 5 is never seen, stored, prototyped or counted by the trigger."""
    x = torch.randn(24, 5, generator=torch.Generator().manual_seed(0))
    y = np.array(([0, 1, 2, 3] + [5] * 4) * 3)  # batches of 4: classes 0-3, then 5 alone
    built = Stream("clear", [np.arange(24)], y, batch_size=4, seed=0, params={})
    config = {
        **CONFIG,
        "online_accuracy": None,
        "realtime": 2,
        "er_memory_size": 100,
        "er_batch_size": 4,
        "online_prototypes": True,
        "seed": 0,
        "consolidation": "never",
    }
    adapter = TinyAdapter()
    loop = build_loop(adapter, TinyNet(), config, 6)
    source = VectorSource(x, y, x[:6], y[:6])
    source.train_samples = lambda indices: (
        x[torch.as_tensor(indices)],
        torch.as_tensor(y[indices]),
    )
    session = OnlineSession(loop, built, source, config, progress=False)
    results = session.run()
    trained_indices = np.array([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19])
    assert np.array_equal(np.sort(loop.memory.indices[: loop.memory.size]), trained_indices)
    assert not loop.seen[5] and not loop.prototypes.seen[5]
    assert int(loop.prototypes.counts.sum()) == 12 == loop.samples_seen
    assert results["counters"]["online_scored_samples"] == 24
    assert results["counters"]["batches_skipped"] == 3


def test_the_stream_does_not_wait_at_a_task_end(tmp_path) -> None:
    """C = 3 over 3 tasks of 4 batches: steps on batches 0, 3, 6, 9; batches 4 and 5 (task 1)
    pass during the step on batch 3 (task 0) and are scored before task 0's evaluation."""
    data = vector_data()
    built = clear_stream(data[1], init_cls=2, increment=2, batch_size=8, seed=3)
    config = base_config(realtime=3, checkpoint_every=None)
    session = Run(tiny_setup, config, built, data).session(tmp_path)
    groups = session._step_groups(0, 4)
    assert groups == [(0, [1, 2]), (3, [4, 5])]
    session.run()
    assert (session.batches_trained, session.batches_skipped) == (4, 8)
    assert session.scoring.samples == 96


# ------------------------------------------------------------------ resume mid-stream


@pytest.mark.parametrize(
    ("cost", "kills"),
    [
        (3, [4]),  # inside the step on batch 3, whose passing batches are task 1's first two
        (3, [8, 3]),  # killed twice
        (1.5, [6]),  # C = 3/2: batch 8 (task 2) passes during the step on batch 7 (task 1)
    ],
)
def test_a_real_time_resume_mid_stream_equals_the_uninterrupted_run(tmp_path, cost, kills):
    """The session's position, scored frontier, counts and C come back from the checkpoint;
    replay and prototypes and FGH ride along (test_resume's machinery, kills in the data)."""
    data = vector_data()
    built = clear_stream(data[1], init_cls=2, increment=2, batch_size=8, seed=3)
    config = base_config(
        realtime=cost,
        er_memory_size=20,
        er_batch_size=6,
        allow_memory=True,
        online_prototypes=True,
        online_iter=2,
        checkpoint_every=1,
    )
    run = Run(tiny_setup, config, built, data)
    straight = run.straight(tmp_path / "straight")
    resumed = run.killed_then_resumed(tmp_path / "resumed", kills)
    assert_same_run(straight, resumed)
    counters = resumed[1]["counters"]
    assert counters["batches_trained"] == RealtimeSchedule.from_value(cost, "given").trained_count(
        12
    )
    assert counters["batches_trained"] + counters["batches_skipped"] == 12
    assert counters["online_scored_samples"] == 96


# ------------------------------------------------------------------ C from the FLOP model


def pass_counted_step(counts: dict) -> float:
    """Per image, by hand: the query pass, the trained forward and twice it for the backward."""
    query = counts["query_flops_per_image"]
    return query + 3 * (counts["train_forward_flops_per_image"] - query)


def test_c_from_the_flop_model_by_hand() -> None:
    """CODA over fine-tuning, from flops.json's own numbers: (q + 3 (F - q)) / 3 F'; ER trains
    1 + er_batch_size / batch_size images per stream image; the counted backward is the other
    reading; the linear probe, cheaper than the reference, is clamped to 1 by the schedule."""
    methods = estimate.load_flops()["methods"]
    reference = pass_counted_step(methods["finetune_online"])
    coda = load_json(EXPS / "smoke_coda_online.json")
    cost, detail = estimate.realtime_flop_cost(coda)
    assert cost == pytest.approx(pass_counted_step(methods["coda_online"]) / reference)
    assert detail["backward"] == "2x forward"
    counted, _ = estimate.realtime_flop_cost(coda, counted=True)
    assert counted == pytest.approx(
        methods["coda_online"]["train_flops_per_image"]
        / methods["finetune_online"]["train_flops_per_image"]
    )
    er = load_json(EXPS / "smoke_er_online.json")  # er_batch_size 50 of 100
    assert estimate.realtime_flop_cost(er)[0] == pytest.approx(
        1.5 * pass_counted_step(methods["er_online"]) / reference
    )
    probe = {**coda, "model_name": "linear_probe_online", "backbone_type": "vit_base_patch16_224"}
    cost, _ = estimate.realtime_flop_cost(probe)
    assert cost < 1 and RealtimeSchedule.from_value(cost, "flops").cost == 1
    # online_iter k multiplies the training FLOPs, so C.
    assert estimate.realtime_flop_cost({**coda, "online_iter": 3})[0] == pytest.approx(
        3 * estimate.realtime_flop_cost(coda)[0]
    )


def test_the_flop_model_prices_real_time_runs_and_a_online() -> None:
    """A real-time run's training FLOPs shrink to the batches it trains (ceil(B / C) of B);
    A_online's passes add a test forward per stream image."""
    coda = load_json(EXPS / "smoke_coda_online.json")
    normal = estimate.run_flops(coda)
    fast = estimate.run_flops({**coda, "realtime": 2})
    batches = 8  # synthetic_small: 800 training images, batch 100
    assert fast["train"] == pytest.approx(normal["train"] * 4 / batches)
    per_image = estimate.load_flops()["methods"]["coda_online"]["test_flops_per_image"]
    scale = estimate._tokens(32) / estimate._tokens(224)
    assert fast["eval"] - normal["eval"] == pytest.approx(800 * per_image * scale)


def test_a_session_takes_c_from_the_flop_model(tmp_path) -> None:
    data = vector_data()
    built = clear_stream(data[1], init_cls=2, increment=2, batch_size=8, seed=3)
    config = {**base_config(checkpoint_every=None), "model_name": "coda_online"}
    config.update(realtime="flops", dataset="synthetic_small", batch_size=100)
    adapter, network = tiny_setup(config)
    loop = build_loop(adapter, network, config, 6)
    session = OnlineSession(loop, built, VectorSource(*data), config, progress=False)
    expected = estimate.realtime_flop_cost(config)[0]
    assert float(session.realtime.cost) == pytest.approx(expected, abs=0.005)
    assert session.realtime.source == "flops" and session.realtime.reference == "finetune_online"


# ------------------------------------------------------------------ measured C


def test_measured_c_times_both_loops_and_leaves_the_run_as_it_was(tmp_path, monkeypatch):
    """A loop factory builds the method's and the reference's loops; their step times (here
    fixed: 0.3 s and 0.1 s, after real steps that draw random numbers) give C = 3; the run then
    equals the same run with C = 3 given, bit for bit: the measurement moved no generator."""
    data = vector_data()
    built = clear_stream(data[1], init_cls=2, increment=2, batch_size=8, seed=3)
    real_fastest = scoring._fastest_step
    built_for = []

    def fastest(loop, *args):
        real_fastest(loop, *args)
        return 0.3 if loop.config["model_name"] == "dropout_tiny" else 0.1

    def factory(config):
        built_for.append(config["model_name"])
        adapter, network = tiny_setup(config)
        return build_loop(adapter, network, config, 6)

    monkeypatch.setattr(scoring, "_fastest_step", fastest)
    monkeypatch.setattr(
        session_module,
        "reference_run_config",
        lambda config, reference: {**config, "model_name": reference},
    )

    def run(cost, folder):
        config = base_config(realtime=cost, checkpoint_every=None)
        adapter, network = tiny_setup(config)
        loop = build_loop(adapter, network, config, 6)
        (tmp_path / folder).mkdir()
        session = OnlineSession(
            loop, built, VectorSource(*data), config, tmp_path / folder / "run.results.json",
            progress=False, loop_factory=factory,
        )  # fmt: skip
        return session.run()

    measured = run("measured", "measured")
    given = run(3, "given")
    assert built_for == ["dropout_tiny", "finetune_online"]
    realtime = measured["extra"].pop("realtime")
    assert (realtime["C"], realtime["source"]) == (3.0, "measured")
    assert realtime["detail"]["method_step_seconds"] == 0.3
    given["extra"].pop("realtime")
    for results in (measured, given):
        results.pop("timing"), results.pop("created_utc"), results.pop("config")
    assert json.dumps(measured, sort_keys=True) == json.dumps(given, sort_keys=True)


def test_a_session_whose_loop_scores_nothing_is_refused_in_real_time_mode() -> None:
    data = vector_data()
    built = clear_stream(data[1], init_cls=2, increment=2, batch_size=8, seed=3)
    config = base_config(realtime=2, online_accuracy=False, checkpoint_every=None)
    adapter, network = tiny_setup(config)
    loop = build_loop(adapter, network, config, 6)
    with pytest.raises(ValueError, match="remove online_accuracy or set it true"):
        OnlineSession(loop, built, VectorSource(*data), config, progress=False)


def test_measured_c_without_a_loop_factory_is_refused() -> None:
    data = vector_data()
    built = clear_stream(data[1], init_cls=2, increment=2, batch_size=8, seed=3)
    config = base_config(realtime="measured", checkpoint_every=None)
    adapter, network = tiny_setup(config)
    with pytest.raises(ValueError, match='"flops" or to a number'):
        OnlineSession(build_loop(adapter, network, config, 6), built, VectorSource(*data), config)


# ------------------------------------------------------------------ bad values


def coda(**overrides) -> dict:
    return {**load_json(EXPS / "smoke_coda_online.json"), **overrides}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"realtime": "fast"}, "a mode computes C, a number gives it"),
        ({"realtime": 0.5}, "a method cheaper than the stream"),
        ({"realtime": True}, 'must be null, "flops"'),
        ({"online_iter": 0}, "online_iter must be a positive integer"),
        ({"realtime": "flops", "online_accuracy": False}, "Remove online_accuracy"),
        ({"realtime_reference": "finetune"}, "is no registered method"),
        ({"realtime": "flops", "dataset": "objectnet"}, "knows no image counts.*measured"),
    ],
)
def test_bad_values_are_refused_with_the_fix(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_config(coda(**overrides))


def test_online_iter_is_refused_for_a_method_that_trains_nothing() -> None:
    simplecil = load_json(EXPS / "smoke_simplecil_online.json")
    with pytest.raises(ConfigError, match="Remove online_iter"):
        resolve_config({**simplecil, "online_iter": 3})


def test_a_method_the_flop_model_does_not_count_is_refused_with_the_other_modes(monkeypatch):
    table = estimate.load_flops()
    uncounted = {
        **table,
        "methods": {k: v for k, v in table["methods"].items() if k != "coda_online"},
    }
    monkeypatch.setattr(flops, "load_flops", lambda: uncounted)
    with pytest.raises(ConfigError, match=r'benchmarks/flops\.py.*"measured".*a number'):
        resolve_config(coda(realtime="flops"))
    assert resolve_config(coda(realtime="measured"))["realtime"] == "measured"
    assert resolve_config(coda(realtime=1.5))["realtime"] == 1.5


def test_the_realtime_check_states_what_it_accepts() -> None:
    assert check_realtime("realtime", None) is None
    assert check_realtime("realtime", "flops_counted") == "flops_counted"
    assert check_realtime("realtime", 1) == 1
    with pytest.raises(ValueError, match=r"got nan"):
        check_realtime("realtime", float("nan"))


# ------------------------------------------------------------------ tables and report


def real_time_run(folder, *, row: str, seed: int, ap: float, online: float, trained: int, cost):
    """A results file as a real-time run writes it (test_tables's builder, then the fields)."""
    from test_tables import write_run

    path = write_run(folder, lr=5e-3, row=row, seed=seed, ap=ap, tag="_rt")
    results = json.loads(path.read_text())
    results["config"].update(realtime="flops", realtime_reference="finetune_online")
    results["metrics"]["A_online"] = online
    results["counters"].update(batches_trained=trained, batches_skipped=8 - trained)
    results["extra"]["realtime"] = {"C": cost, "source": "flops", "reference": "finetune_online"}
    path.write_text(json.dumps(results))
    return path


def test_the_compute_aware_table_and_the_paper_tables_keep_apart(tmp_path) -> None:
    """Two seeds of CODA and of CODA + ours in real-time mode (C 1.33, 6 of 8 batches trained)
    fill realtime_clear; the paper's tables take only the normal run, with a note."""
    from test_tables import write_run

    from pilot_online.harness import tables
    from pilot_online.harness.report import collect, format_table

    folder = tmp_path / "results"
    write_run(folder, lr=5e-3, seed=0, ap=70.0)
    for seed, (ap, online) in enumerate(((40.0, 20.0), (44.0, 24.0))):
        real_time_run(folder, row="base", seed=seed, ap=ap, online=online, trained=6, cost=1.33)
        real_time_run(
            folder, row="ours", seed=seed, ap=ap + 10, online=online + 10, trained=6, cost=1.33
        )
    built = {t.name: t for t in tables.build_tables(tables.load_rows([folder]))}
    main = built["all_acc_clear"]
    assert main.cell("CODA", "", 1).values == [70.0]  # the 5e-3 column: the normal run only
    assert any("4 runs of another protocol" in note for note in main.notes)
    realtime = built["realtime_clear"]
    assert [g for g, _ in realtime.groups] == ["CIFAR100"]
    c, trained, online, ap = (realtime.cell("CODA", "", i) for i in range(4))
    assert (c.mean, trained.mean, online.mean, ap.mean) == (1.33, 75.0, 22.0, 42.0)
    ours = [realtime.cell("CODA", "+ ours", i).mean for i in range(4)]
    assert ours == [1.33, 75.0, 32.0, 52.0]
    assert realtime.cell("CODA", "+ ours", 2).bold and not realtime.cell("CODA", "+ ours", 0).bold
    markdown = tables.to_markdown(realtime)
    assert "trained %" in markdown and "A_online" in markdown and "$" not in markdown
    assert "\\begin{table*}" in tables.to_latex(realtime)
    report = format_table(collect([folder]))
    assert "base, real-time (flops)" in report and "+ P + FGH, real-time (flops)" in report


def test_measured_c_through_pilot_main(pilot, tmp_path) -> None:
    """``realtime: "measured"`` through PILOT's ``main.py``: the learner's loop factory builds
    CODA's and fine-tuning's networks, their steps are timed, and C is the ratio it records."""
    from test_pilot_integration import run_driver, tiny_config

    config = tiny_config("coda", "p_fgh", "clear", tmp_path / "results")
    config["realtime"] = "measured"
    _, results = run_driver(pilot, config, tmp_path)
    realtime = results["extra"]["realtime"]
    detail = realtime["detail"]
    assert (realtime["source"], realtime["reference"]) == ("measured", "finetune_online")
    ratio = detail["method_step_seconds"] / detail["reference_step_seconds"]
    assert realtime["C_unclamped"] == pytest.approx(ratio)
    assert realtime["C"] == float(RealtimeSchedule.from_value(ratio, "measured").cost)
    counters = results["counters"]
    assert counters["batches_trained"] + counters["batches_skipped"] == 4
    assert counters["online_scored_samples"] == 160

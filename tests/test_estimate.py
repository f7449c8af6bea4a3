"""The FLOP model's run estimate (``pilot_online/harness/estimate.py``) against hand-worked runs.

A made-up FLOP table (3 GFLOP a training image, 2 of them the forward; 2 a test image, 1 of them
the query pass) and CUB's 9,430 training and 2,358 test images over 20 tasks of 10 classes: the
evaluations see 2,358 x (1 + 2 + ... + 20) / 20 = 24,759 test images.
"""

from __future__ import annotations

import pytest

from pilot_online.engine import flops
from pilot_online.harness import estimate

TABLE = {
    "methods": {
        name: {
            "train_flops_per_image": 3e9,
            "train_forward_flops_per_image": 2e9,
            "query_flops_per_image": 1e9 if name == "coda_online" else 0.0,
            "test_flops_per_image": 2e9,
        }
        for name in ("coda_online", "er_online", "olora_online")
    }
}


def use_table(monkeypatch, table: dict) -> None:
    """Read ``table`` as the FLOP counts: in engine/flops.py, where the arithmetic lives, and
    here, where the calibration reads them."""
    monkeypatch.setattr(flops, "load_flops", lambda: table)
    monkeypatch.setattr(estimate, "load_flops", lambda: table)


@pytest.fixture
def table(monkeypatch):
    use_table(monkeypatch, TABLE)


def cub(method: str, **overrides) -> dict:
    return estimate.paper_run_config(method, "cub", **overrides)


def test_seen_fractions_of_a_clear_stream():
    assert estimate.seen_fractions(200, 10, 10) == [t / 20 for t in range(1, 21)]
    assert estimate.seen_fractions(50, 10, 20) == [0.2, 0.6, 1.0]  # the last task is short
    with pytest.raises(ValueError, match="increment"):
        estimate.seen_fractions(100, 10, 0)


def test_a_cub_run_with_the_query_cache(table):
    flops = estimate.run_flops(cub("coda_online"))
    assert flops["train"] == pytest.approx(9430 * 3e9)  # 2.829e13
    # 24,759 evaluated images x the prompted pass (1 GFLOP) + 2,358 query passes (1 GFLOP).
    assert flops["eval"] == pytest.approx(24759 * 1e9 + 2358 * 1e9)  # 2.7117e13
    assert estimate.estimate_run_seconds(cub("coda_online"), sustained_tflops=1.0) == (
        pytest.approx(55.407)
    )


def test_without_the_query_cache_every_evaluation_runs_the_query_pass(table):
    flops = estimate.run_flops(cub("coda_online", eval_query_cache="off"))
    assert flops["eval"] == pytest.approx(24759 * 2e9)
    assert estimate.estimate_run_seconds(
        cub("coda_online", eval_query_cache="off"), sustained_tflops=2.0
    ) == pytest.approx((9430 * 3e9 + 24759 * 2e9) / 2e12)  # 38.904 s


def test_replay_and_the_hard_buffer_add_passes(table):
    # ER: 100 replayed beside each stream batch of 100: twice the step's FLOPs per image.
    er = estimate.run_flops(cub("er_online", er_memory_size=1000, er_batch_size=100))
    assert er["train"] == pytest.approx(9430 * 2 * 3e9)
    # oLoRA: 4 buffered batches, forward and backward with hard_loss, forward only without.
    assert estimate.run_flops(cub("olora_online", hard_buffer_size=4))["train"] == (
        pytest.approx(9430 * 5 * 3e9)
    )
    no_loss = estimate.run_flops(cub("olora_online", hard_buffer_size=4, hard_loss=False))
    assert no_loss["train"] == pytest.approx(9430 * (3e9 + 4 * 2e9))


def test_a_growing_network_costs_more_each_task(monkeypatch):
    """Counted after 0, 1 and 2 firings at 3, 5 and 7 GFLOP a training image (2, 3, 4 a test
    image): task t of CUB's 20 (one firing at each boundary) trains 9,430 / 20 images at
    3 + 2t GFLOP and evaluates 2,358 (t + 1) / 20 images at 2 + t."""
    counts = [
        {"train_flops_per_image": 3e9 + 2e9 * k, "train_forward_flops_per_image": 1e9,
         "query_flops_per_image": 0.0, "test_flops_per_image": 2e9 + 1e9 * k}
        for k in range(3)
    ]  # fmt: skip
    grows = {"methods": {"er_online": {**counts[0], "by_firings": counts}}}
    use_table(monkeypatch, grows)
    assert estimate.flops_at(grows["methods"]["er_online"], 5)["train_flops_per_image"] == 13e9
    flops = estimate.run_flops(cub("er_online", er_memory_size=0))
    train = sum(9430 / 20 * (3e9 + 2e9 * t) for t in range(20))
    evaluation = sum(2358 * (t + 1) / 20 * (2e9 + 1e9 * t) for t in range(20))
    assert flops["train"] == pytest.approx(train)
    assert flops["eval"] == pytest.approx(evaluation)


def test_image_size_scales_by_tokens_and_unknowns_are_refused(table):
    small = estimate.run_flops(cub("coda_online", backbone_kwargs={"img_size": 32}))
    full = estimate.run_flops(cub("coda_online"))
    assert small["total"] == pytest.approx(full["total"] * 5 / 197)  # 1 + 2 x 2 of 1 + 14 x 14
    with pytest.raises(ValueError, match=r"no counts for 'l2p_online'.*benchmarks/flops\.py"):
        estimate.run_flops(cub("l2p_online"))
    with pytest.raises(ValueError, match="no image counts for dataset 'mnist'"):
        estimate.run_flops({**cub("coda_online"), "dataset": "mnist"})
    with pytest.raises(ValueError, match="sustained_tflops"):
        estimate.estimate_run_seconds(cub("coda_online"), sustained_tflops=0)


def test_synthetic_datasets_use_their_spec(table):
    # synthetic_small: 20 classes x 40 training, x 10 test; tasks of 4 classes: 5 evaluations
    # over 0.2 + 0.4 + ... + 1.0 = 3 test sets of 200 images.
    flops = estimate.run_flops(
        {"model_name": "coda_online", "dataset": "synthetic_small", "init_cls": 4, "increment": 4}
    )
    assert flops["train"] == pytest.approx(800 * 3e9)
    assert flops["eval"] == pytest.approx(600 * 1e9 + 200 * 1e9)


def test_the_shipped_table_meets_the_h100_target():
    """The package data: a CODA CUB run within 20 s on an H100 at 40% of its bf16 peak."""
    rows = {r["method"]: r for r in estimate.predicted_time_table(dataset="cub")}
    assert rows["coda_online"]["seconds"] <= 20
    assert estimate.DEFAULT_SUSTAINED_TFLOPS == pytest.approx(395.76)
    table = estimate.load_flops()
    assert table["img_size"] == 224 and table["torch"] and table["timm"]


#: Two paper methods at the same FLOPs (CODA, DualPrompt), and the two the fit leaves out.
PAPER_FIT_TABLE = {
    "methods": {
        name: TABLE["methods"]["coda_online"]
        for name in ("coda_online", "dualprompt_online", "olora_online", "convprompt_online")
    }
}


def test_calibration_fits_the_paper_time_table(monkeypatch):
    """Equal FLOPs (55.407 TFLOP a CUB run): the median of two throughputs is their mean, so the
    calibrated time is the harmonic mean of CODA's rows (337, 347, 354, 355 s: 348.25 s) and
    DualPrompt's (312, 314, 323, 318 s: 316.75 s): 331.77 s. oLoRA (two GPUs) and ConvPrompt
    (an hour its FLOPs do not explain) stay out of the fit although counted."""
    use_table(monkeypatch, PAPER_FIT_TABLE)
    fit = estimate.calibration()
    assert set(fit.points) == {"CODA", "DualPrompt"}
    assert fit.points["CODA"][1] == pytest.approx(348.25)
    assert fit.tflops == pytest.approx((55.407 / 348.25 + 55.407 / 316.75) / 2)
    run = estimate.estimate_config(cub("coda_online", online_prototypes=True, fgh={}, seed=[0, 1]))
    assert run.calibrated_seconds == pytest.approx(2 / (1 / 348.25 + 1 / 316.75), rel=1e-6)
    assert run.ideal_seconds == pytest.approx(55.407 / 395.76, rel=1e-4)
    assert run.paper == (355.0, "CODA ours")
    assert run.seeds == 2


def test_every_estimate_says_what_it_assumes(monkeypatch):
    """The issue's complaint: a bare "est. 3.2 min". Each line names hardware, seeds and metric,
    and a CUB run sits beside the paper's measured time."""
    use_table(monkeypatch, PAPER_FIT_TABLE)
    text = "\n".join(
        estimate.estimate_config(
            cub("coda_online", online_prototypes=True, fgh={}, seed=list(range(10)))
        ).describe()
    )
    for needed in ("H100", "40%", "Quadro RTX 8000", "x 10 seeds", "AP", "A_T", "5m55s", "floor"):
        assert needed in text, needed
    assert estimate.duration(355) == "5m55s" and estimate.duration(4344) == "1h12m24s"


def test_doctor_marks_compute_unknown_without_a_gpu(monkeypatch):
    """Before: "[ ok ] compute: 19 s of GPU compute per seed" right after "[FAIL] cuda"."""
    import torch

    from pilot_online.cli.doctor import check_compute

    use_table(monkeypatch, PAPER_FIT_TABLE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (check,) = check_compute(cub("coda_online", device=[-1]))
    assert check.detail.startswith("unknown on this machine: no CUDA device")
    assert "calibrated" in check.detail and "ideal" in check.detail


def test_progress_line_gives_the_eta_at_the_pace_so_far():
    assert estimate.progress_line("run", 3, 5, 12.0) == (
        "run: 3/5 tasks, 12.0 s elapsed, about 8.0 s left"
    )
    assert estimate.progress_line("sweep", 4, 4, 600.0, unit="runs") == (
        "sweep: 4/4 runs, 10m00s elapsed, done"
    )

"""``pilot-online scale-model``: the grid's runs, the paired verdicts, and the report.

The verdict arithmetic is checked against a paired t interval worked by hand; the report is
written from results files made here (no training), and must carry the verdict lines.
"""

from __future__ import annotations

import json

import pytest

from pilot_online.harness import scale_model
from pilot_online.harness.scale.grid import LRS, Run, runs

pytest.importorskip("scipy", reason="the t quantile comes from scipy (the pilot extra)")


def test_paired_interval_worked_by_hand():
    # Differences 5, 6, 3: mean 14/3, sample sd sqrt(7/3), t(0.975, 2) = 4.302653.
    diff = scale_model.paired({0: 55, 1: 58, 2: 57}, {0: 50, 1: 52, 2: 54})
    assert diff.n == 3 and diff.mean == pytest.approx(14 / 3)
    assert diff.half_width == pytest.approx(4.302653 * (7 / 3) ** 0.5 / 3**0.5, rel=1e-6)
    assert scale_model.verdict(diff) == "holds"
    assert scale_model.verdict(diff, "<") == "does not hold"
    wide = scale_model.paired({0: 51, 1: 49, 2: 53}, {0: 50, 1: 50, 2: 50})
    assert wide.mean == pytest.approx(1.0)
    assert scale_model.verdict(wide).startswith("inconclusive (these seeds detect effects beyond")
    assert scale_model.verdict(wide).endswith(" points)")  # AP points, unless told otherwise
    assert scale_model.verdict(wide, unit="").endswith(f"±{wide.half_width:.2f})")  # a slope
    # One paired seed has no interval: pending, not a verdict; no paired seed: not run yet.
    one = scale_model.verdict(scale_model.paired({0: 1.0}, {0: 0.0}))
    assert one == "pending, 1 of 3 seeds (so far: one seed gives no interval)"
    assert scale_model.verdict_kind(f"- a − b +1.00 (one seed), n=1: {one}") == "pending"
    assert scale_model.verdict(scale_model.paired({}, {0: 0.0})) == "not run yet"
    assert scale_model.verdict_kind("- a − b (no paired seeds): not run yet") == "not run yet"
    # Differences 5 and 5.2: mean 5.1, sd 0.1 * sqrt(2), t(0.975, 1) = 12.7062: [3.83, 6.37]
    # excludes 0, but two seeds are under the floor of three.
    two = scale_model.paired({0: 55.0, 1: 57.2}, {0: 50.0, 1: 52.0})
    assert two.half_width == pytest.approx(12.7062 * 0.1, rel=1e-4)
    assert scale_model.verdict(two) == "pending, 2 of 3 seeds (so far: holds)"
    # Counted as pending, not as the verdict so far.
    assert scale_model.verdict_kind(f"- a − b {two.text()}: {scale_model.verdict(two)}") == (
        "pending"
    )
    # Only seeds both sides have are paired.
    assert scale_model.paired({0: 1.0, 1: 2.0}, {1: 0.0, 2: 5.0}).n == 1


def test_identical_runs_have_no_interval_and_hold_only_a_no_gain_claim():
    """gamma 10 and gamma 1 gave the same AP at every seed: a width-0 interval is no evidence
    of a detectable effect, and 'no further gain' is the one reading it supports."""
    same = scale_model.paired({0: 60.5, 1: 61.0, 2: 59.0}, {0: 60.5, 1: 61.0, 2: 59.0})
    assert same.identical and same.text() == "0 at every seed (the same value), n=3"
    assert scale_model.verdict(same) == "does not hold (no difference at any seed)"
    assert scale_model.verdict(same, "<") == "does not hold (no difference at any seed)"
    assert scale_model.verdict(same, "<=") == "holds"
    assert scale_model.verdict_kind(f"- a − b {same.text()}: {scale_model.verdict(same)}") == (
        "does not hold"
    )
    # "<=" on a spread: differences -5, -6, -3 lie below 0 (holds); -1, 0, +1 straddle it.
    below = scale_model.paired({0: 50, 1: 52, 2: 54}, {0: 55, 1: 58, 2: 57})
    assert not below.identical and scale_model.verdict(below, "<=") == "holds"
    level = scale_model.paired({0: 49, 1: 50, 2: 51}, {0: 50, 1: 50, 2: 50})
    assert scale_model.verdict(level, "<=").startswith("inconclusive")
    above = scale_model.paired({0: 55, 1: 58, 2: 57}, {0: 50, 1: 52, 2: 54})
    assert scale_model.verdict(above, "<=") == "does not hold"


def test_final_alpha_weights_each_group_by_its_coefficients():
    # Groups of 10 and 30 coefficients, final means 2 and 6: (20 + 180) / 40 = 5.
    groups = [
        {"coefficients": 10, "final": {"mean": 2.0}},
        {"coefficients": 30, "final": {"mean": 6.0}},
    ]
    results = {"extra": {"diagnostics": {"fgh": {"alpha_bounds": groups}}}}
    assert scale_model.final_alpha(results) == pytest.approx(5.0)
    assert scale_model.final_alpha({"extra": {}}) is None


def test_the_grid_is_the_issue_s_minimum():
    grid = runs()
    names = [r.name for r in grid]
    assert len(names) == len(set(names))
    parts = [r.part for r in grid]
    assert parts == sorted(parts, key=("ablation", "figures", "rest").index)  # the order asked
    ablation = [r for r in grid if r.part == "ablation"]
    assert {(r.dataset, r.stream) for r in ablation} == {
        ("fashion_mnist", "si_blurry"), ("fractal", "si_blurry"), ("fashion_mnist", "clear")
    }  # fmt: skip
    assert len([r for r in ablation if not r.still_masked_rows]) == 3 * len(LRS) * 4
    still = [r for r in ablation if r.still_masked_rows]
    assert {(r.variant, r.lr, r.stream) for r in still} == {
        (v, lr, "clear") for v in ("base", "fgh") for lr in LRS
    }
    gammas = [r for r in grid if r.tag.startswith("gamma")]
    assert len(gammas) == 4 and all(r.lr == 5e-5 for r in gammas)  # + gamma 1, the ablation's
    methods = {r.method for r in grid if r.part == "rest"}
    assert {"l2p", "dualprompt", "finetune", "linear_probe", "er", "er_linear_probe"} <= methods
    assert {r.tag for r in grid} >= {"fgh_global", "fgh_element", "sgd"}


def results(run: Run, seed: int, ap: float) -> dict:
    from pilot_online.core.results import build_results

    return build_results(
        config={"prefix": run.name, "seed": seed, "model_name": f"{run.method}_online"},
        stream={"tasks": []},
        metrics={"accuracy_matrix": [[ap]], "A_k": [ap], "AP": ap, "A_T": ap - 10},
        timing={
            "train_seconds": 100.0,
            "eval_seconds": 20.0,
            "samples_per_second": 1.0,
            "peak_memory_bytes": None,
        },
        counters={
            "optimizer_steps": 1,
            "samples_seen": 1,
            "skipped_nonfinite_steps": 0,
            "skipped_nonfinite_hypergradients": 0,
        },
    )


def test_the_report_gives_each_claim_its_verdict(tmp_path, monkeypatch):
    base = Run("ablation", "fashion_mnist", "si_blurry", "coda", "base", 5e-3)
    plus_p = Run("ablation", "fashion_mnist", "si_blurry", "coda", "p", 5e-3)
    folder = tmp_path / "results"
    folder.mkdir()
    for run, values in ((base, (50, 52, 54)), (plus_p, (55, 58, 57))):
        for seed, ap in enumerate(values):
            path = folder / f"{run.name}_{seed}.results.json"
            path.write_text(json.dumps(results(run, seed, ap)))
    doc = tmp_path / "docs" / "scale-model.md"
    scale_model.write_report(folder, doc)
    text = doc.read_text()
    assert (
        "- CODA, fashion_mnist si_blurry, 0.005: + P − base +4.67 [+0.87, +8.46], n=3: holds"
        in (text)
    )
    assert "| + P | - | 56.67 ± 1.53 | - |" in text  # the ablation table
    assert "6 seeded runs, 0.20 h of training and evaluation in all." in text
    assert "(no paired seeds): not run yet" in text  # the claims without runs yet
    assert "Fig. 2" in text and "no results yet" in text


def test_a_figure_short_of_runs_is_named_not_drawn_and_the_report_still_writes(tmp_path):
    """The ablation's + P + FGH at 5e-5 is Fig. 4's gamma-1 point: until another gamma has run,
    the gamma figure cannot be drawn; the report says so instead of stopping."""
    fgh = Run("ablation", "fashion_mnist", "si_blurry", "coda", "fgh", 5e-5)
    folder = tmp_path / "results"
    folder.mkdir()
    for seed, ap in enumerate((60, 62, 64)):
        record = results(fgh, seed, ap)
        record["config"]["fgh"] = {"gamma": 1.0, "granularity": "class", "direction": "adam"}
        (folder / f"{fgh.name}_{seed}.results.json").write_text(json.dumps(record))
    doc = tmp_path / "docs" / "scale-model.md"
    scale_model.write_report(folder, doc)
    text = doc.read_text()
    # Fig. 4's five gammas: only gamma 1's cell (the ablation's) has results.
    assert (
        "- Fig. 4: AP against gamma (CODA + P + FGH, Si-Blurry Fashion-MNIST, 5e-5): not drawn "
        "yet (1 of its 5 runs have results)" in text
    )
    assert "| + P + FGH | 62.00 ± 2.00 |" in text


def test_dry_run_lists_the_runs_it_would_start(tmp_path, capsys):
    from pilot_online.cli.main import main

    exps = tmp_path / "exps"
    exps.mkdir()
    selected = [r for r in runs() if r.part == "figures"]
    source = scale_model.REPO / "exps" / "scale"
    for run in selected:
        (exps / f"{run.name}.json").write_text((source / f"{run.name}.json").read_text())
    code = main(
        ["scale-model", "--out", str(tmp_path / "out"), "--part", "figures", "--exps", str(exps),
         "--results", str(tmp_path / "results"), "--dry-run"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert f"{len(selected)} runs of 3 seeds; 0 finished already" in out
    assert all(f"to run: {r.name}" in out for r in selected)


def test_only_picks_runs_by_name_and_refuses_unknown_ones(tmp_path, capsys):
    from pilot_online.cli.main import main

    name = next(r.name for r in runs() if r.part == "figures")
    args = ["scale-model", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "results"),
            "--dry-run", "--only"]  # fmt: skip
    assert main([*args, name]) == 0
    out = capsys.readouterr().out
    assert "1 run of 3 seeds; 0 finished already" in out and f"to run: {name}" in out
    with pytest.raises(SystemExit, match="no run named nope"):
        main([*args, "nope"])


def test_results_go_to_the_committed_folder_unless_told_otherwise(tmp_path, capsys):
    """The grid outlasts a sitting on one machine: its results default to a folder in the
    repository (committed as runs finish), and every copied config points there."""
    from pilot_online.cli.main import main

    assert scale_model.DEFAULT_RESULTS == scale_model.REPO / "docs" / "scale-model" / "results"
    name = next(r.name for r in runs() if r.part == "figures")
    out, results = tmp_path / "out", tmp_path / "results"
    args = ["scale-model", "--out", str(out), "--dry-run", "--only", name]
    assert main([*args, "--results", str(results)]) == 0
    copied = json.loads((out / "configs" / f"{name}.json").read_text())
    assert copied["results_dir"] == str(results.resolve())
    assert not results.exists()  # a dry run stamps nothing
    assert main(args) == 0
    copied = json.loads((out / "configs" / f"{name}.json").read_text())
    assert copied["results_dir"] == str(scale_model.DEFAULT_RESULTS)
    capsys.readouterr()


def test_the_committed_results_are_of_the_shipped_backbone():
    """The stamp beside the committed results names the shipped file: a new backbone needs
    its own grid (``check_backbone_of`` refuses to mix them)."""
    from pilot_online.core import scale_backbone as backbone

    stamp = scale_model.DEFAULT_RESULTS / scale_model.BACKBONE_STAMP
    assert stamp.read_text().strip() == backbone.record()["sha256"]


def test_a_results_folder_of_another_backbone_is_refused(tmp_path):
    """The configs name the shipped file, not its hash: runs of an earlier backbone in --results
    would count as finished. The folder is stamped with the hash and refused once it differs."""
    from pilot_online.core import scale_backbone as backbone

    out = tmp_path / "out"
    scale_model.check_backbone_of(out)
    stamp = out / scale_model.BACKBONE_STAMP
    assert stamp.read_text().strip() == backbone.record()["sha256"]
    scale_model.check_backbone_of(out)  # the same file: accepted
    stamp.write_text("0" * 64 + "\n")
    with pytest.raises(SystemExit, match=r"holds runs of another backbone .*move the folder away"):
        scale_model.check_backbone_of(out)
    fresh = tmp_path / "fresh"
    scale_model.check_backbone_of(fresh, write=False)  # a dry run writes nothing
    assert not fresh.exists()


def test_newest_task_reads_the_diagonal():
    by_seed = {0: {"metrics": {"accuracy_matrix": [[90.0, 10.0], [None, 30.0]]}}}
    assert scale_model.newest_task(by_seed) == {0: 60.0}


def test_the_lowest_newest_task_names_its_seed_and_task():
    by_seed = {
        0: {"metrics": {"accuracy_matrix": [[90.0, 10.0], [None, 30.0]]}},
        1: {"metrics": {"accuracy_matrix": [[0.7, None], [50.0, 95.0]]}},
        2: {"metrics": {"accuracy_matrix": [[None, None], [1.0, None]]}},  # no diagonal cell
    }
    assert scale_model.lowest_newest_task(by_seed) == (0.7, 1, 1)
    assert scale_model.lowest_newest_task({}) is None


def test_matches_or_beats_is_claim_7_s_reading():
    """Non-inferiority with a 3-point margin; t(0.975, 2) = 4.303 throughout."""
    assert scale_model.MATCH_MARGIN == 3.0
    # Differences -1, 0, +1: mean 0, half-width 4.303 * 1 / sqrt(3) = 2.48: [-2.48, +2.48]
    # lies above -3: ours matches ER.
    level = scale_model.paired({0: 49, 1: 50, 2: 51}, {0: 50, 1: 50, 2: 50})
    assert scale_model.matches_or_beats(level).startswith("holds (matches")
    # Differences -10, 0, +10: [-24.84, +24.84] reaches 0 but also -3: no reading either way.
    wide = scale_model.paired({0: 40, 1: 50, 2: 60}, {0: 50, 1: 50, 2: 50})
    assert scale_model.matches_or_beats(wide).startswith("inconclusive (the interval spans -3;")
    assert "beyond ±24.84 points" in scale_model.matches_or_beats(wide)
    # Differences 5, 6, 3: mean 4.67, sd 1.53, half-width 3.79: [+0.87, +8.46]: beats.
    above = scale_model.paired({0: 55, 1: 58, 2: 57}, {0: 50, 1: 52, 2: 54})
    assert scale_model.matches_or_beats(above) == "holds (beats)"
    # The mirror, [-8.46, -0.87]: worse, yet not beyond the margin: inconclusive.
    below = scale_model.paired({0: 50, 1: 52, 2: 54}, {0: 55, 1: 58, 2: 57})
    assert scale_model.matches_or_beats(below).startswith("inconclusive")
    # Differences -10, -11, -9: [-12.48, -7.52] lies below -3: does not hold.
    far_below = scale_model.paired({0: 40, 1: 40, 2: 40}, {0: 50, 1: 51, 2: 49})
    assert scale_model.matches_or_beats(far_below) == "does not hold"
    same = scale_model.paired({0: 50, 1: 51, 2: 52}, {0: 50, 1: 51, 2: 52})
    assert scale_model.matches_or_beats(same).startswith("holds (matches")
    assert scale_model.matches_or_beats(scale_model.paired({0: 1}, {0: 0})).startswith("pending")


def test_claim_7_is_read_against_the_paper_s_own_table():
    """The paper's Si-Blurry table, read by hand from its LaTeX: at 5e-5 ER (81.33 CIFAR100,
    52.45 CUB, 55.06 Imagenet-R) is above every + ours row (best: ConvPrompt 44.23, DualPrompt
    5.43 and 10.11); at 5e-3 and Best HP + ours is above (ConvPrompt 86.34, ...)."""
    (text, blank) = scale_model._paper_er_lines()
    assert blank == ""
    assert "5e-05: ER 81.33 / 52.45 / 55.06 against 44.23 / 5.43 / 10.11, ER ahead" in text
    assert "0.005: ER 3.14 / 1.56 / 2.00 against 86.34 / 74.89 / 62.62, ours ahead" in text
    assert "Best HP: ER 81.33 / 52.45 / 55.06 against 86.34 / 73.88 / 62.62, ours ahead" in text
    assert "holds in its table at 0.005 and Best HP, not at 5e-05." in text


def test_better_lr_waits_for_every_seed_and_takes_the_higher_mean():
    full = {5e-5: {0: 70, 1: 80, 2: 90}, 5e-3: {0: 78, 1: 79, 2: 80}}  # means 80 and 79
    assert scale_model.better_lr(full) == 5e-5
    assert scale_model.better_lr({**full, 5e-3: {0: 90, 1: 91}}) is None  # 2 of 3 seeds


def test_the_report_has_table_2_the_reviewers_questions_and_the_overhead(tmp_path):
    blurry = ("rest", "fashion_mnist", "si_blurry")
    cells = {
        Run(*blurry, "l2p", "base", 5e-3): (40, 42, 44),
        Run(*blurry, "l2p", "fgh", 5e-3): (45, 48, 47),
        Run(*blurry, "er", "base", 5e-3): (55, 57, 59),
        Run(*blurry, "coda", "fgh", 5e-3, tag="fgh_global"): (60, 61, 62),
        Run(*blurry, "coda", "fgh", 5e-3): (62, 64, 63),
    }
    folder = tmp_path / "results"
    folder.mkdir()
    for run, values in cells.items():
        for seed, ap in enumerate(values):
            path = folder / f"{run.name}_{seed}.results.json"
            path.write_text(json.dumps(results(run, seed, ap)))
    step = {"step_seconds": 0.5, "images_per_second": 200.0, "eval_seconds": 0.1}
    overhead = {
        "setting": {"device": "cpu", "img_size": 32, "batch_size": 100, "threads": 2,
                    "repeats": 5, "torch": "2.x", "config": None},
        "methods": {"coda": {"variants": {
            "base": {**step, "step_ratio": 1.0, "state_bytes": 2**20},
            "+P+FGH": {**step, "step_seconds": 0.55, "step_ratio": 1.1, "state_bytes": 2**21},
        }, "upstream_step_seconds": 0.25}},
    }  # fmt: skip
    (folder / scale_model.OVERHEAD_FILE).write_text(json.dumps(overhead))
    doc = tmp_path / "docs" / "scale-model.md"
    scale_model.write_report(folder, doc)
    text = doc.read_text()
    # Table 2's rows: mean ± sample std by hand; A_T is AP - 10 in these files.
    assert "| L2P | - | 42.00 ± 2.00 | - | 32.00 ± 2.00 |" in text
    assert "| L2P + ours | - | 46.67 ± 1.53 | - | 36.67 ± 1.53 |" in text
    # L2P + ours − base: differences 5, 6, 3, as worked in the first test.
    assert "- L2P, 0.005: +4.67 [+0.87, +8.46], n=3: holds" in text
    # Claim 7: L2P + ours − ER: differences -10, -9, -12: mean -10.33, half-width
    # 4.303 * 1.53 / sqrt(3) = 3.79: [-14.13, -6.54] lies below the -3 margin.
    assert "- 0.005: L2P + ours − ER -10.33 [-14.13, -6.54], n=3: does not hold" in text
    # The granularity question: class-wise − global, differences 2, 3, 1.
    assert "| global | 61.00 ± 1.00 |" in text
    assert "- class-wise − global: +2.00 [-0.48, +4.48], n=3: inconclusive" in text
    # The overhead table, read from the measurement's file.
    assert "| coda +P+FGH | 550 | 1.100 | 200.0 | 2.0 |" in text
    assert "upstream PILOT's own training step on the same network: 2.000 (250 ms upstream)" in text


def test_claims_1_to_3_read_the_feature_proxy_s_paired_seeds(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    records = [
        {"stream": "si_blurry", "lr": 5e-5, "row": "base", "form": "-", "AP": [50, 52, 54]},
        {"stream": "si_blurry", "lr": 5e-5, "row": "+ P", "form": "-", "AP": [55, 58, 57]},
        # another FGH form than the paper configs' is not read
        {"stream": "si_blurry", "lr": 5e-5, "row": "+ P + FGH", "form": "eq8", "AP": [0, 0, 0]},
        *(
            {"sweep": True, "stream": "si_blurry", "lr": 5e-5, "row": "+ P + FGH",
             "form": form, "gamma": gamma, "AP": aps}
            for form, gamma, aps in (
                ("nobound", 1e-6, [50, 52, 54]), ("nobound", 1.0, [55, 58, 57]),
                ("nobound", 10.0, [55, 58, 57]), ("clamp10", 1.0, [0, 0, 0]),
            )
        ),
    ]  # fmt: skip
    (folder / scale_model.PROXY_FILE).write_text(json.dumps(records))
    doc = tmp_path / "docs" / "scale-model.md"
    scale_model.write_report(folder, doc)
    text = doc.read_text()
    # Differences 5, 6, 3, as worked by hand in the first test.
    assert (
        "- on the feature proxy, si_blurry, 5e-05: + P − base +4.67 [+0.87, +8.46], n=3: holds"
        in text
    )
    assert "- on the feature proxy, si_blurry, 5e-05: + P + FGH − + P (no paired seeds)" in text
    # Claim 6 on the proxy's sweep of the paper's form (the clamped form's records are not read):
    # gamma 1 − 1e-6 is the same 5, 6, 3; gamma 10 − 1 is 0, 0, 0 (no further gain: sd 0).
    assert "- on the feature proxy: gamma 1 − gamma 1e-06 +4.67 [+0.87, +8.46], n=3: holds" in text
    assert (
        "- on the feature proxy: gamma 10 − gamma 1 (no further gain) 0 at every seed (the same "
        "value), n=3: holds"
    ) in text
    # The summary table counts each claim's lines by verdict: claim 1 has one proxy line that
    # holds (si_blurry 5e-5) and three with no seeds; claim 6's two proxy lines hold.
    assert "| 1. + P improves each base method | 0 / 0 / 0 / 0 / 10 | 1 / 0 / 0 / 0 / 3 |" in text
    assert (
        "| 6. A larger gamma helps, up to about 1 | 0 / 0 / 0 / 0 / 2 | 2 / 0 / 0 / 0 / 0 |" in text
    )

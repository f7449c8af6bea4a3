"""The paper's protocol: the hp_grid table, ``sweep --preset hp_grid``, ``best`` and
``sweep --hp-from`` (no PILOT: configs are written with --dry-run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tables import write_run

from pilot_online.cli.main import main
from pilot_online.engine.config import PAPER_FGH, load_json
from pilot_online.harness import paper
from pilot_online.harness.protocol import FIXED_LRS, HP_GRID, hp_grid_points, select_best

EXPS = Path(__file__).resolve().parent.parent / "exps"
SMOKE = str(EXPS / "smoke_{method}_online.json")
PAPER = str(EXPS / "{method}_online_base.json")

# Typed from the paper's appendix table hp_grid (tables/hp_grid.tex); bold values second.
PROMPT_LRS = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1]
GAMMAS = [0.00001, 0.0001, 0.001, 0.01, 0.1, 1, 10]
PAPER_HP_GRID = {
    "finetune": ([0.001, 0.005, 0.01, 0.05, 0.1], 0.01, [], None),
    "linear_probe": ([0.001, 0.005, 0.01, 0.05, 0.1], 0.005, [], None),
    "er": (
        [0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1],
        0.00005,
        [],
        None,
    ),
    "er_linear_probe": ([0.001, 0.005, 0.01, 0.05, 0.1], 0.01, [], None),
    "mvp": (PROMPT_LRS, 0.005, [], None),
    "olora": ([0.001, 0.005, 0.01, 0.05, 0.1], 0.005, [], None),
    "coda": (PROMPT_LRS, 0.01, GAMMAS, 0.1),
    "convprompt": (PROMPT_LRS, 0.005, GAMMAS, 1),
    "dualprompt": (PROMPT_LRS, 0.01, GAMMAS, 1),
    "l2p": (PROMPT_LRS, 0.01, GAMMAS, 1),
}


def test_hp_grid_is_the_papers_table():
    assert list(HP_GRID) == list(PAPER_HP_GRID)
    for method, (lrs, best_lr, gammas, best_gamma) in PAPER_HP_GRID.items():
        row = HP_GRID[method]
        assert list(row.learning_rates) == lrs and row.best_lr == best_lr, method
        assert list(row.gammas) == gammas and row.best_gamma == best_gamma, method


def test_hp_grid_is_read_from_the_package_data_one_copy():
    """protocol.HP_GRID is the data file's hp_grid, through the registry's paper names."""
    rows = paper.hp_grid_rows()
    assert [r["method"] for r in rows][:3] == ["Fine-tuning", "Linear probe", "ER"]
    names = paper.registered_names()
    assert names["CODA"] == "coda_online" and names["ER + Linear probe"] == "er_linear_probe_online"
    for row in rows:
        grid = HP_GRID[names[row["method"]].removesuffix("_online")]
        assert list(grid.learning_rates) == row["learning_rates"]
        assert (grid.best_lr, grid.best_gamma) == (row["best_lr"], row["best_gamma"])
        assert list(grid.gammas) == (row["gammas"] or [])


# --- the paper's numbers (pilot_online/data/paper_tables.json), checked against the LaTeX by hand


def test_paper_data_names_its_source_and_seed_counts():
    data = paper.paper_data()
    assert "fgh_online_cl_paper.tex" in data["source"]["file"]
    assert "only $3$ runs" in data["source"]["seeds"]
    assert paper.paper_seed_count("CODA") == 10
    assert paper.paper_seed_count("ConvPrompt") == paper.paper_seed_count("oLoRA") == 3
    assert paper.paper_datasets() == {
        "cifar224": "CIFAR100",
        "cub": "CUB",
        "imagenetr": "Imagenet-R",
    }


@pytest.mark.parametrize(
    "keys, expected",
    [  # read off the .tex by hand: (table, dataset, stream, method, row, column) -> mean, std, n
        (("all_acc_blurry", "cifar224", "si_blurry", "CODA", "ours", 5e-5), (44.21, 8.04, 10)),
        (("all_acc_blurry", "cifar224", "si_blurry", "CODA", "ours", 5e-3), (79.47, 2.23, 10)),
        (
            ("all_acc_blurry", "imagenetr", "si_blurry", "ConvPrompt", "ours", "best"),
            (62.62, 0.11, 3),
        ),
        (("all_acc_clear", "imagenetr", "clear", "oLoRA", "base", "best"), (48.9, 1.73, 3)),
        (("all_acc_clear", "cifar224", "clear", "Fine-tuning", "base", 5e-3), (2.93, 0.0, 10)),
        (("all_acc_clear", "cub", "clear", "DualPrompt", "ours", 5e-3), (78.56, 0.87, 10)),
        (("all_acc_clear", "cub", "clear", "ER + Linear probe", "base", "best"), (62.81, 0.93, 10)),
        (("all_ablation_blurry", "cifar224", "si_blurry", "CODA", "p", 5e-5), (31.27, 6.95, 10)),
        (("all_ablation_blurry", "cub", "si_blurry", "L2P", "fgh_only", 5e-3), (27.68, 3.64, 10)),
        # printed 1\textbf{0.11...} (a misplaced brace); Table 2 gives the same cell as 10.11
        (
            ("all_ablation_blurry", "imagenetr", "si_blurry", "DualPrompt", "ours", 5e-5),
            (10.11, 1.38, 10),
        ),
        (
            ("all_ablation_blurry", "imagenetr", "si_blurry", "ConvPrompt", "fgh_only", 5e-3),
            (49.39, 0.69, 3),
        ),
    ],
)
def test_paper_cells_match_the_latex(keys, expected):
    cell = paper.find_paper_cell(*keys)
    assert (cell.mean, cell.std, cell.n) == expected


def test_paper_tables_have_every_row_and_column():
    cells = paper.paper_cells()
    for table, rows, columns in (
        ("all_acc_clear", 14, 9),
        ("all_acc_blurry", 14, 9),
        ("all_ablation_blurry", 16, 6),
    ):
        assert sum(c.table == table for c in cells) == rows * columns, table
    assert paper.find_paper_cell("all_acc_clear", "cifar224", "clear", "MVP", "ours", 5e-3) is None
    assert (
        paper.find_paper_cell("all_acc_blurry", "vtab", "si_blurry", "CODA", "base", 5e-3) is None
    )
    # The fixed-LR columns of the data are the protocol's.
    data = paper.paper_data()["tables"]
    assert [float(c) for c in data["all_ablation_blurry"]["columns"]] == list(FIXED_LRS)


def test_time_consumption_as_printed():
    table = paper.time_consumption()
    assert (table["dataset"], table["stream"], table["batch_size"]) == ("cub", "clear", 100)
    rows = {(r["method"], r["row"]): r for r in table["rows"]}
    assert len(rows) == 22
    assert rows[("ConvPrompt", "ours")] == {
        "method": "ConvPrompt", "row": "ours", "time": "1h12m40s", "seconds": 4360,
        "memory_mb": 11709,
    }  # fmt: skip
    assert (rows[("oLoRA", "base")]["seconds"], rows[("oLoRA", "base")]["memory_mb"]) == (
        320,
        56357,
    )
    assert rows[("CODA", "fgh_only")]["time"] == "5m54s"


def test_best_hp_discrepancies_between_hp_grid_and_tables():
    """L2P: bold 0.01 in hp_grid, yet its 12 Best HP cells are its 5e-3 cells; MVP and oLoRA:
    bold 0.005 (the 5e-3 column), yet all 6 of their Best HP cells differ from it."""
    info = paper.best_hp_columns()
    assert info["L2P"]["equal_to"] == 5e-3 and info["L2P"]["bold_lr"] == 0.01
    assert info["ConvPrompt"]["equal_to"] == 5e-3 == info["ConvPrompt"]["bold_lr"]
    assert info["ER"]["equal_to"] == 5e-5 == info["ER"]["bold_lr"]
    assert info["CODA"]["equal_to"] is None
    assert paper.best_hp_discrepancies() == [
        "MVP: hp_grid's bold LR is 0.005, a fixed-LR column, but 6 of its 6 Best HP cells differ "
        "from that column (the paper does not say which other setting ran)",
        "oLoRA: hp_grid's bold LR is 0.005, a fixed-LR column, but 6 of its 6 Best HP cells "
        "differ from that column (the paper does not say which other setting ran)",
        "L2P: hp_grid's bold LR is 0.01, but all 12 of its Best HP cells in Tables 1-2 equal its "
        "0.005 cells",
    ]


def test_grid_points_are_lrs_for_base_and_lrs_times_gammas_for_ours():
    points = hp_grid_points("coda")
    assert len(points) == 7 + 7 * 7
    base = [p for p in points if p["variant"] == "base"]
    ours = [p for p in points if p["variant"] == "fgh"]
    assert [p["init_lr"] for p in base] == PROMPT_LRS
    assert {(p["init_lr"], p["fgh.gamma"]) for p in ours} == {
        (lr, g) for lr in PROMPT_LRS for g in GAMMAS
    }
    assert [p["init_lr"] for p in hp_grid_points("finetune")] == [0.001, 0.005, 0.01, 0.05, 0.1]
    with pytest.raises(ValueError, match="no row in the hp_grid table"):
        hp_grid_points("nope")


def test_preset_writes_exactly_the_table_points_on_vtab(tmp_path, capsys):
    out = tmp_path / "hp"
    code = main(
        [
            "sweep",
            "--preset",
            "hp_grid",
            "--methods",
            "coda,finetune",
            "--config",
            PAPER,
            "--out",
            str(out),
            "--dry-run",
        ]
    )
    assert code == 0
    configs = [load_json(p) for p in sorted((out / "configs").glob("*.json"))]
    assert len(configs) == 7 + 49 + 5
    for config in configs:
        assert (config["dataset"], config["stream"]) == ("vtab", "clear")
        assert (config["init_cls"], config["increment"]) == (5, 5)
        assert config["prefix"].startswith(config["model_name"].removesuffix("_online") + "__")
    coda_ours = {
        (c["init_lr"], c["fgh"]["gamma"])
        for c in configs
        if c["model_name"] == "coda_online" and c["online_prototypes"]
    }
    assert coda_ours == {(lr, g) for lr in PROMPT_LRS for g in GAMMAS}
    coda_base = sorted(
        c["init_lr"] for c in configs if c["model_name"] == "coda_online" and c["fgh"] is None
    )
    assert coda_base == PROMPT_LRS
    finetune = [c for c in configs if c["model_name"] == "finetune_online"]
    assert sorted(c["init_lr"] for c in finetune) == [0.001, 0.005, 0.01, 0.05, 0.1]
    assert all(c["fgh"] is None and not c["online_prototypes"] for c in finetune)


def test_preset_smoke_overrides(tmp_path, capsys):
    out = tmp_path / "hp"
    argv = ["sweep", "--preset", "hp_grid", "--methods", "coda", "--config", SMOKE]
    argv += ["--set", "dataset=synthetic_small", "--set", "init_cls=4", "--set", "increment=4"]
    argv += ["--set", "seed=[1993,1994]", "--grid", "init_lr=5e-5,5e-3", "--grid", "fgh.gamma=1"]
    assert main([*argv, "--out", str(out), "--dry-run"]) == 0
    configs = [load_json(p) for p in sorted((out / "configs").glob("*.json"))]
    assert len(configs) == 4  # 2 LRs x (base, + P + FGH at gamma 1)
    assert {c["dataset"] for c in configs} == {"synthetic_small"}
    assert all(c["seed"] == [1993, 1994] and c["init_cls"] == 4 for c in configs)
    assert "replace the hp_grid table's values" in capsys.readouterr().out


def test_select_best_ties_go_to_the_smaller_lr_then_gamma():
    base = select_best(
        [
            {"init_lr": 0.01, "gamma": None, "ap": {0: 56.0, 1: 56.0}},
            {"init_lr": 0.001, "gamma": None, "ap": {0: 55.0, 1: 57.0}},
        ]
    )
    assert base["init_lr"] == 0.001 and base["AP_mean"] == 56.0
    ours = select_best(
        [
            {"init_lr": 0.001, "gamma": 1, "ap": {0: 71.0, 1: 71.0}},
            {"init_lr": 0.001, "gamma": 0.1, "ap": {0: 70.0, 1: 72.0}},
        ]
    )
    assert (ours["init_lr"], ours["gamma"], ours["AP_std"]) == (0.001, 0.1, 1.0)


def test_best_picks_the_argmax_of_mean_ap_and_flags_fewer_seeds(tmp_path, capsys):
    folder = tmp_path / "hp_grid" / "results"
    grid = {  # (row, lr, gamma): APs of seeds 0, 1
        ("base", 0.001, None): (50.0, 60.0),  # 55
        ("base", 0.01, None): (58.0, 54.0),  # 56 <- best
        ("base", 0.1, None): (10.0, 12.0),
        ("ours", 0.001, 0.1): (70.0, 74.0),  # 72 <- best
        ("ours", 0.001, 1): (71.0, 71.0),
        ("ours", 0.01, 1): (65.0,),  # one seed: flagged
    }
    for (row, lr, gamma), aps in grid.items():
        for seed, ap in enumerate(aps):
            write_run(folder, dataset="vtab", lr=lr, row=row, gamma=gamma, seed=seed, ap=ap)
    write_run(folder, dataset="vtab", lr=0.5, row="p", ap=99.0)  # not a searched row: ignored
    out = tmp_path / "best.json"
    assert main(["best", str(tmp_path / "hp_grid"), "--out", str(out)]) == 0
    best = json.loads(out.read_text())
    assert "highest AP averaged over its seeds" in best["selection_rule"]
    assert best["search"] == [{"dataset": "vtab", "stream": "clear"}]
    coda = best["methods"]["coda"]
    assert (coda["base"]["init_lr"], coda["base"]["AP_mean"]) == (0.01, 56.0)
    assert coda["base"]["seeds"] == [0, 1] and not coda["base"]["fewer_seeds"]
    assert (coda["ours"]["init_lr"], coda["ours"]["fgh.gamma"]) == (0.001, 0.1)
    assert coda["ours"]["AP_mean"] == 72.0 and coda["ours"]["AP_std"] == 2.0
    flagged = [(p["init_lr"], p["gamma"]) for p in coda["ours"]["grid"] if p["fewer_seeds"]]
    assert flagged == [(0.01, 1)]
    md = out.with_suffix(".md").read_text()
    assert "Selection rule" in md and "coda ours LR 0.01 gamma 1" in md


def test_ours_of_a_method_without_gammas_takes_the_base_rows_lr(tmp_path, capsys):
    """hp_grid lists no gamma for the linear probe (N/A): its + ours Best HP is the base row's
    LR with the paper configs' gamma (``PAPER_FGH``), marked as not searched; CODA (gammas
    listed) gets no derived row."""
    folder = tmp_path / "hp_grid" / "results"
    for lr, aps in ((0.001, (30.0, 34.0)), (0.005, (40.0, 42.0))):  # means 32, 41 <- best
        for seed, ap in enumerate(aps):
            write_run(folder, method="linear_probe_online", dataset="vtab", lr=lr, seed=seed, ap=ap)
    write_run(folder, dataset="vtab", lr=0.01, ap=50.0)  # CODA, base row only
    out = tmp_path / "best.json"
    assert main(["best", str(tmp_path / "hp_grid"), "--out", str(out)]) == 0
    methods = json.loads(out.read_text())["methods"]
    probe = methods["linear_probe"]
    assert (probe["base"]["init_lr"], probe["base"]["AP_mean"]) == (0.005, 41.0)
    assert probe["ours"]["init_lr"] == 0.005
    assert probe["ours"]["fgh.gamma"] == PAPER_FGH["gamma"]
    assert probe["ours"]["derived_from"] == "base" and probe["ours"]["AP_mean"] is None
    assert set(methods["coda"]) == {"base"}
    assert "not searched" in out.with_suffix(".md").read_text()


def test_hp_from_runs_the_chosen_lr_and_gamma_tagged_best(tmp_path, capsys):
    best = tmp_path / "best.json"
    best.write_text(
        json.dumps(
            {
                "methods": {
                    "coda": {
                        "base": {"init_lr": 0.01},
                        "ours": {"init_lr": 0.001, "fgh.gamma": 0.1},
                    }
                }
            }
        )
    )
    out = tmp_path / "best_runs"
    argv = ["sweep", "--hp-from", str(best), "--config", PAPER, "--grid", "dataset=cifar224,cub"]
    assert main([*argv, "--grid", "stream=clear,si_blurry", "--out", str(out), "--dry-run"]) == 0
    configs = {p.stem: load_json(p) for p in (out / "configs").glob("*.json")}
    assert len(configs) == 2 * 2 * 2
    base = configs["coda__best-base__dataset-cub__stream-si_blurry"]
    assert (base["init_lr"], base["fgh"], base["online_prototypes"]) == (0.01, None, False)
    ours = configs["coda__best-ours__dataset-cifar224__stream-clear"]
    assert (ours["init_lr"], ours["fgh"]["gamma"], ours["online_prototypes"]) == (0.001, 0.1, True)
    assert {c["hp_column"] for c in configs.values()} == {"best"}
    argv = ["sweep", "--hp-from", str(best), "--config", PAPER, "--grid", "init_lr=1"]
    assert main([*argv, "--out", str(out), "--dry-run"]) == 2
    assert "--hp-from sets init_lr itself" in capsys.readouterr().err


def test_a_template_needs_methods_and_a_matching_file(tmp_path, capsys):
    assert main(["sweep", "--config", SMOKE, "--out", str(tmp_path), "--dry-run"]) == 2
    assert "name the methods with --methods" in capsys.readouterr().err
    argv = ["sweep", "--config", SMOKE, "--methods", "nope", "--out", str(tmp_path), "--dry-run"]
    assert main(argv) == 2
    assert "no base config for method 'nope'" in capsys.readouterr().err

"""``pilot-online reproduce``: cells of the paper's tables as configs, the dry-run listing, and
the comparison printed after a run (no PILOT: configs are planned, as --dry-run plans them
without writing anything, results are written by hand)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import make_exps
from test_tables import write_run

from pilot_online.cli.main import main
from pilot_online.engine.config import ConfigError
from pilot_online.harness import paper, reproduce

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def exps(tmp_path_factory) -> Path:
    """The paper configs as scripts/make_exps.py writes them (exps/ is checked against it by
    test_config.py), so these tests read the generator's current output."""
    generator = make_exps()
    folder = tmp_path_factory.mktemp("exps")
    for name, config in generator.all_configs().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)  # scale/: the scale model's
        (folder / name).write_text(generator.render(config))
    return folder


def planned_configs(argv: list[str]) -> dict[str, dict]:
    """The configs ``pilot-online reproduce ARGV`` would write, by name (``plan`` writes none)."""
    _, configs = reproduce.plan(reproduce_args(argv))
    return {
        path.stem: config for planned, _ in configs.values() for path, config in planned.items()
    }


def test_cells_parse_into_their_keys():
    cell = reproduce.parse_cell("cifar224/si_blurry/coda/ours/5e-3")
    assert cell == reproduce.CellSpec("cifar224", "si_blurry", "coda", "ours", 5e-3)
    assert cell.name == "cifar224__si_blurry__coda__ours__5e-3"
    assert reproduce.parse_cell("cub/clear/l2p/base/best").column == "best"
    assert reproduce.parse_cell("imagenetr/clear/er/base/0.00005").column == 5e-5


METHODS = "finetune, linear_probe, er, er_linear_probe, mvp, olora, coda, convprompt, dualprompt"
BAD_CELLS = [
    ("cifar224/si_blurry/coda/ours", "write DATASET/STREAM/METHOD/ROW/COLUMN"),
    ("cifar100/clear/coda/base/5e-3", "dataset 'cifar100'; choose from cifar224, cub, imagenetr"),
    ("cifar224/blurry/coda/base/5e-3", "unknown stream 'blurry'; choose from clear, si_blurry"),
    ("cifar224/clear/coda_prompt/base/5e-3", f"method 'coda_prompt'; choose from {METHODS}, l2p"),
    ("cifar224/clear/coda/fgh/5e-3", "unknown row 'fgh'; choose from base, ours, p, fgh_only"),
    ("cifar224/clear/coda/base/1e-3", "column '1e-3'; choose from 5e-5, 5e-3, best"),
    ("cifar224/clear/mvp/ours/5e-3", "the paper has no such cell; MVP has the rows base on clear"),
    ("cifar224/clear/coda/p/5e-5", "CODA has the rows base, ours on clear"),
    ("cifar224/si_blurry/coda/p/best", "CODA has the rows base, fgh_only, ours, p on si_blurry"),
]


@pytest.mark.parametrize("text, message", BAD_CELLS)
def test_bad_cells_say_what_is_valid(text, message):
    with pytest.raises(ConfigError) as err:
        reproduce.parse_cell(text)
    assert message in str(err.value)


def test_configs_are_the_paper_rows_with_the_cells_keys_and_the_papers_seeds(
    tmp_path, capsys, exps
):
    out = tmp_path / "r"
    cells = [
        "cifar224/si_blurry/coda/ours/5e-5",
        "cub/clear/l2p/ours/best",
        "imagenetr/clear/coda/ours/best",
        "cub/clear/convprompt/base/5e-3",
        "cifar224/si_blurry/dualprompt/fgh_only/5e-3",
    ]
    argv = ["reproduce", *cells, "--out", str(out), "--exps", str(exps)]
    assert main([*argv, "--dry-run"]) == 0
    assert not out.exists()  # a dry run writes nothing
    configs = planned_configs(argv)
    names = sorted(configs)
    assert len(names) == 10 + 10 + 10 + 3 + 10  # ConvPrompt: the paper's 3 seeds

    coda = configs["cifar224__si_blurry__coda__ours__5e-5__seed-9"]
    paper_row = json.loads((exps / "coda_online_fgh_blurry.json").read_text())
    assert coda["seed"] == [9] and coda["init_lr"] == 5e-5 and coda["dataset"] == "cifar224"
    assert coda["fgh"] == paper_row["fgh"] and coda["online_prototypes"] is True
    assert coda["stream"] == "si_blurry" and "hp_column" not in coda
    assert coda["prefix"] == "cifar224__si_blurry__coda__ours__5e-5__seed-9"

    # Best HP: tagged for the column; L2P repeats its 5e-3 config, FGH included (its Best HP
    # cells are its 5e-3 cells); CODA runs hp_grid's 0.01 and gamma 0.1.
    l2p = configs["cub__clear__l2p__ours__best__seed-0"]
    assert (l2p["init_lr"], l2p["hp_column"]) == (0.005, "best")
    assert l2p["fgh"] == json.loads((exps / "l2p_online_fgh.json").read_text())["fgh"]
    coda_best = configs["imagenetr__clear__coda__ours__best__seed-0"]
    assert (coda_best["init_lr"], coda_best["fgh"]["gamma"]) == (0.01, 0.1)

    conv = sorted(n for n in names if "convprompt" in n)
    assert [configs[n]["seed"] for n in conv] == [[0], [1], [2]]
    dual = configs["cifar224__si_blurry__dualprompt__fgh_only__5e-3__seed-0"]
    assert dual["online_prototypes"] is False
    assert (
        dual["fgh"]
        == json.loads((exps / "dualprompt_online_fgh_only_blurry.json").read_text())["fgh"]
    )

    printed = capsys.readouterr().out
    assert "reproduce: 5 cells, 43 runs (one per seed)" in printed
    assert "L2P: hp_grid's bold LR is 0.01, but all 12 of its Best HP cells" in printed
    assert "paper 44.21 ± 8.04 (n=10)" in printed  # CODA + ours, Si-Blurry CIFAR100 5e-5


def test_best_hp_hp_grid_runs_the_bold_lr(tmp_path, capsys, exps):
    out = tmp_path / "r"
    args = ["reproduce", "cub/clear/l2p/base/best", "--out", str(out), "--exps", str(exps)]
    assert main([*args, "--best-hp", "hp_grid", "--dry-run"]) == 0
    configs = planned_configs([*args, "--best-hp", "hp_grid"])
    assert configs["cub__clear__l2p__base__best__seed-0"]["init_lr"] == 0.01


def test_dry_run_lists_every_run_of_table_2_with_its_estimate(tmp_path, capsys, exps):
    out = tmp_path / "r"
    args = ["reproduce", "--table", "all_acc_blurry", "--out", str(out), "--exps", str(exps)]
    assert main([*args, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    # 14 rows x 3 datasets x 3 columns; 10 seeds each, 3 for oLoRA and ConvPrompt (3 rows).
    assert "reproduce: 126 cells, 1071 runs (one per seed)" in printed
    assert not out.exists()  # 11 x 9 x 10 + 3 x 9 x 3 runs listed, none written
    lines = printed.splitlines()
    for cell in paper.paper_cells():
        if cell.table != "all_acc_blurry":
            continue
        method = paper.registered_names()[cell.method].removesuffix("_online")
        spec = reproduce.CellSpec(cell.dataset, cell.stream, method, cell.row, cell.column)
        line = next(x for x in lines if x.startswith(spec.text + " "))
        assert f"{cell.n:>2} runs" in line and f"paper {cell.mean:.2f}" in line
        assert "batch passes/run" in line or "est." in line
    # Stream steps: CIFAR100 50,000 / 100 = 500, CUB 9,430 / 100 -> 95 (PILOT's APER split),
    # ImageNet-R 24,000 / 100 = 240; ER adds its replay batch (2 passes), oLoRA its 4
    # hard-buffer batches (5).
    assert any(x.startswith("cifar224/si_blurry/finetune/base/5e-5 ") and "500 steps x 1 " in x
               for x in lines)  # fmt: skip
    assert any(x.startswith("cub/si_blurry/er/base/5e-3 ") and "95 steps x 2 " in x for x in lines)
    assert "estimate: " in printed
    # Honest estimates: each priced cell says both figures for all its seeds, and the footer what
    # they assume (the ideal one is a floor) and that AP is the metric.
    priced = [x for x in lines if " est. " in x]
    assert priced and all(" ideal / " in x and " calibrated" in x for x in priced)
    assert "a floor, not a prediction" in printed and "Quadro RTX 8000" in printed
    assert "AP, the paper's metric" in printed
    # per row and seed: (500 + 95 + 240) x 3 columns = 2,505 batch passes at 1 pass per step:
    # 9 rows x 10 seeds x 2,505 + ER, ER + LP: 2 x 10 x 5,010 + oLoRA: 3 x 12,525
    # + ConvPrompt: 2 x 3 x 2,505 = 225,450 + 100,200 + 37,575 + 15,030
    assert "total: 1071 runs, 378,255 training batch passes" in printed


def test_set_cannot_change_the_cell(tmp_path, exps):
    args = ["reproduce", "cub/clear/l2p/base/5e-3", "--out", str(tmp_path), "--exps", str(exps)]
    with pytest.raises(ConfigError, match="--set init_lr: that changes which cell runs"):
        reproduce.plan(reproduce_args([*args, "--set", "init_lr=0.1"]))
    with pytest.raises(ConfigError, match="--table 'table_9': choose from all_acc_clear"):
        reproduce.plan(reproduce_args(["reproduce", "--table", "table_9"]))
    with pytest.raises(ConfigError, match="name cells"):
        reproduce.plan(reproduce_args(["reproduce"]))


def reproduce_args(argv: list[str]):
    from pilot_online.cli.main import build_parser

    return build_parser().parse_args(argv)


def test_after_a_run_the_cells_are_compared_with_the_paper(tmp_path):
    """Results named as reproduce names them (a smoke run: dataset replaced by --set) are
    compared as their cell, with a note saying the paper's configs were overridden."""
    out = tmp_path / "r"
    cell = reproduce.parse_cell("cifar224/si_blurry/coda/ours/5e-5")
    for seed, ap in enumerate((40.0, 44.0, 48.0)):  # 44 ± 3.27 against 44.21 ± 8.04: -0.21
        write_run(out / "results", dataset="synthetic_tiny", stream="si_blurry", lr=5e-5,
                  row="ours", seed=seed, ap=ap, prefix=f"{cell.name}__seed-{seed}")  # fmt: skip
    # A run of another cell in the same folder is not compared.
    write_run(out / "results", stream="si_blurry", lr=5e-3, seed=0, ap=1.0, prefix="other")
    text = reproduce.vs_paper_for([cell], out, {"dataset": "synthetic_tiny"})
    assert (
        "| all_acc_blurry | CIFAR100 | CODA + ours | 5e-5 | 44.00 ± 3.27 (n=3) | "
        "44.21 ± 8.04 (n=10) | -0.21 | within std |" in text
    )
    assert "override the paper's configs (dataset=synthetic_tiny)" in text
    assert "Summary (1 cell): within std: 1, within 2 std: 0, differs: 0" in text
    assert (out / "vs_paper.md").read_text() == text
    assert (out / "vs_paper.tex").is_file()


def test_a_stale_paper_config_is_refused_before_anything_runs(tmp_path, exps):
    """A "+ ours" config whose FGH is not the paper configs' would fill no table cell."""
    stale = tmp_path / "exps"
    stale.mkdir()
    config = json.loads((exps / "coda_online_fgh_blurry.json").read_text())
    config["fgh"] = {"gamma": 7, "granularity": "element", "direction": "grad", "apply": "grad"}
    (stale / "coda_online_fgh_blurry.json").write_text(json.dumps(config))
    args = ["reproduce", "cifar224/si_blurry/coda/ours/5e-3", "--exps", str(stale), "--dry-run"]
    with pytest.raises(ConfigError, match=r"regenerate exps/ with python scripts/make_exps\.py"):
        reproduce.plan(reproduce_args([*args, "--out", str(tmp_path / "r")]))


@pytest.mark.parametrize(
    ("seeds", "runs"),
    [([0, 1], None), ([0, 1, 2], [0, 1, 2]), ([5, 6, 7, 8], [5, 6, 7]), ([0, 1, 0], None)],
    ids=["one-too-few", "exactly-the-papers", "one-more", "a-repeat"],
)
def test_a_config_runs_the_papers_seed_count_or_is_refused(tmp_path, exps, seeds, runs):
    """ConvPrompt's paper count is 3: two seeds are refused, three run, a fourth is left out; a
    repeated seed is refused naming it (three listed, two distinct: it would run two)."""
    folder = tmp_path / "exps"
    folder.mkdir()
    config = json.loads((exps / "convprompt_online_base.json").read_text())
    (folder / "convprompt_online_base.json").write_text(json.dumps({**config, "seed": seeds}))
    cell = reproduce.parse_cell("cub/clear/convprompt/base/5e-3")
    assert reproduce.paper_seeds(cell) == 3
    if runs is None:
        message = "lists 2 seeds; the paper ran 3" if len(seeds) == 2 else "lists a seed twice (0)"
        with pytest.raises(ConfigError, match=re.escape(message)):
            reproduce.cell_configs(cell, folder, tmp_path / "out", {})
        return
    planned, _ = reproduce.cell_configs(cell, folder, tmp_path / "out", {})
    assert sorted(config["seed"][0] for config in planned.values()) == runs


def test_dry_run_prices_real_time_runs(tmp_path, capsys, exps):
    """``--set realtime=flops``: the line names C and counts the steps its schedule trains,
    ceil(95 / C) of CUB's 95 batches, with C worked out from flops.json by hand (CODA over
    fine-tuning, backward = 2 x the trained forward)."""
    import math
    from fractions import Fraction

    from pilot_online.harness.estimate import load_flops

    counts = load_flops()["methods"]

    def step(c):
        query = c["query_flops_per_image"]
        return query + 3 * (c["train_forward_flops_per_image"] - query)

    cost = Fraction(step(counts["coda_online"]) / step(counts["finetune_online"]))
    cost = cost.limit_denominator(100)
    out = tmp_path / "r"
    cell = "cub/clear/coda/base/5e-3"
    args = ["reproduce", cell, "--out", str(out), "--exps", str(exps), "--dry-run"]
    assert main([*args, "--set", "realtime=flops"]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith(cell + " "))
    assert f"real-time C={float(cost):.2f} (flops)" in line
    assert f"{math.ceil(95 / cost)} steps x 1 " in line
    assert "real-time runs (realtime)" in printed
    configs = planned_configs([*args[:-1], "--set", "realtime=flops"])
    assert configs["cub__clear__coda__base__5e-3__seed-0"]["realtime"] == "flops"

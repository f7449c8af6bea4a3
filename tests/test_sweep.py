"""``pilot-online sweep``: grid parsing, config generation, and how runs are launched (no PILOT)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pilot_online.engine.config import PAPER_FGH, ConfigError, load_json
from pilot_online.harness import engines, points, sweep

EXPS = Path(__file__).resolve().parent.parent / "exps"
SMOKE = EXPS / "smoke_coda_online.json"


def test_grid_values_are_json_or_bare_strings():
    grid = points.parse_grid(["init_lr=5e-5,0.005", "stream=clear,si_blurry", "grad_trace=false"])
    assert grid == {
        "init_lr": [5e-5, 0.005],
        "stream": ["clear", "si_blurry"],
        "grad_trace": [False],
    }
    with pytest.raises(ConfigError, match="KEY=V1,V2"):
        points.parse_grid(["init_lr"])


def test_variants_expand_to_the_paper_rows_and_gamma_only_where_fgh_runs(tmp_path):
    grid = points.parse_grid(["variant=base,p,fgh_only,fgh", "fgh.gamma=0.1,1"])
    paths = points.build_configs(load_json(SMOKE), grid, tmp_path)
    # base and + P have no FGH, so no gamma axis: 1 + 1 + 2 + 2 runs.
    assert [p.stem for p in paths] == [
        "variant-base",
        "variant-p",
        "variant-fgh_only__fgh.gamma-0.1",
        "variant-fgh_only__fgh.gamma-1",
        "variant-fgh__fgh.gamma-0.1",
        "variant-fgh__fgh.gamma-1",
    ]
    configs = {p.stem: json.loads(p.read_text()) for p in paths}
    assert configs["variant-base"]["online_prototypes"] is False
    assert configs["variant-base"]["fgh"] is None
    assert configs["variant-p"]["online_prototypes"] is True
    assert configs["variant-fgh_only__fgh.gamma-0.1"]["fgh"] == {**PAPER_FGH, "gamma": 0.1}
    assert configs["variant-fgh__fgh.gamma-1"]["online_prototypes"] is True
    for name, config in configs.items():
        assert config["prefix"] == name
        assert config["results_dir"] == str((tmp_path / "results").resolve())
    # The shared table was not mutated by the gamma axis: still the paper's gamma and clamp.
    assert (PAPER_FGH["gamma"], PAPER_FGH["clamp"]) == (1.0, [0.0, None])
    assert configs["variant-fgh__fgh.gamma-0.1"]["fgh"]["gamma"] == 0.1


def test_a_bad_grid_value_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="stream"):
        points.build_configs(load_json(SMOKE), points.parse_grid(["stream=clear,blurry"]), tmp_path)
    with pytest.raises(ConfigError, match="variant 'ours'"):
        points.build_configs(load_json(SMOKE), points.parse_grid(["variant=ours"]), tmp_path)


def test_runs_get_absolute_paths_from_a_relative_out_dir(tmp_path, monkeypatch):
    """Each run's process works inside --out, so relative paths from the caller would break."""
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_call(command, stdout, stderr, cwd, env):
        config = Path(command[command.index("--config") + 1])
        root = Path(command[command.index("--pilot-root") + 1])
        calls.append((config, root, Path(cwd)))
        return 0 if len(calls) == 1 else 3  # the second run fails

    monkeypatch.setattr(engines.subprocess, "call", fake_call)
    args = argparse.Namespace(
        config=SMOKE,
        grid=["variant=base,fgh"],
        out=Path("runs/sweep"),
        pilot_root="pilot",
        dry_run=False,
        retries=0,
    )
    assert sweep.run_sweep(args) == 1  # a failed run is reported, the others still ran
    assert len(calls) == 2
    for config, root, cwd in calls:
        assert cwd == tmp_path / "runs" / "sweep"
        assert config.is_absolute() and (cwd / config).is_file()
        assert root == tmp_path / "pilot"

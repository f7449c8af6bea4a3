"""Results files: round trip, NaN handling, atomic writes, no lost results, schema checks."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from pilot_online.core import results as results_module
from pilot_online.core.results import (
    SCHEMA_VERSION,
    build_results,
    load_results,
    results_path,
    to_jsonable,
    write_results,
)
from pilot_online.version import __version__


def _sample(**overrides):
    arguments = {
        "config": {"model_name": "l2p_online", "lr": np.float32(0.005), "seeds": (1993,)},
        "stream": {"setting": "si_blurry", "num_tasks": np.int64(2), "path": Path("/tmp/x")},
        "metrics": {
            "accuracy_matrix": np.array([[90.0, 80.0], [np.nan, 70.0]]),
            "A_k": [90.0, 75.0],
            "AP": 82.5,
            "A_T": 75.0,
            "A_auc": float("nan"),
        },
        "timing": {
            "train_seconds": 12.5,
            "eval_seconds": 1.5,
            "samples_per_second": 400.0,
            "peak_memory_bytes": None,
        },
        "counters": {
            "optimizer_steps": 50,
            "samples_seen": 5000,
            "skipped_nonfinite_steps": 0,
            "skipped_nonfinite_hypergradients": 1,
        },
    }
    arguments.update(overrides)
    return build_results(**arguments)


def test_build_results_adds_header():
    built = _sample()
    assert built["schema_version"] == SCHEMA_VERSION == 2
    assert built["pilot_online_version"] == __version__
    assert built["status"] == "complete"
    assert built["created_utc"].endswith("+00:00")
    assert built["extra"] == {}


def test_round_trip_and_nan_to_null(tmp_path):
    built = _sample(extra={"note": "ok"})
    path = write_results(tmp_path / "run.results.json", built)
    loaded = load_results(path)
    assert loaded == json.loads(json.dumps(to_jsonable(built)))
    # Spot checks by hand: NaN -> None, numpy -> Python, tuple -> list, Path -> str.
    assert loaded["metrics"]["accuracy_matrix"] == [[90.0, 80.0], [None, 70.0]]
    assert loaded["metrics"]["A_auc"] is None
    assert loaded["config"]["lr"] == pytest.approx(0.005)
    assert loaded["config"]["seeds"] == [1993]
    assert loaded["stream"]["num_tasks"] == 2 and loaded["stream"]["path"] == "/tmp/x"
    assert "NaN" not in path.read_text()


def test_to_jsonable_scalars():
    assert to_jsonable(np.float64(math.inf)) is None
    assert to_jsonable(-math.inf) is None
    assert to_jsonable(np.bool_(True)) is True
    assert to_jsonable({1: np.arange(2)}) == {"1": [0, 1]}
    assert to_jsonable(np.array(3.5)) == 3.5
    with pytest.raises(TypeError, match="cannot store"):
        to_jsonable(object())


def test_refuses_to_overwrite(tmp_path):
    path = tmp_path / "run.results.json"
    write_results(path, _sample(extra={"run": 1}))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_results(path, _sample(extra={"run": 2}))
    assert load_results(path)["extra"] == {"run": 1}
    write_results(path, _sample(extra={"run": 2}), overwrite=True)
    assert load_results(path)["extra"] == {"run": 2}


def test_failed_replace_leaves_no_file_and_no_temp(tmp_path, monkeypatch):
    def broken_replace(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    path = tmp_path / "run.results.json"
    with pytest.raises(OSError, match="disk full"):
        write_results(path, _sample())
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_failed_replace_keeps_existing_file(tmp_path, monkeypatch):
    path = tmp_path / "run.results.json"
    write_results(path, _sample(extra={"run": 1}))
    before = path.read_bytes()

    def broken_replace(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_results(path, _sample(extra={"run": 2}), overwrite=True)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.results.json"]


def test_unserialisable_results_leave_nothing(tmp_path):
    path = tmp_path / "run.results.json"
    with pytest.raises(TypeError):
        write_results(path, _sample(extra={"bad": object()}))
    assert list(tmp_path.iterdir()) == []


def test_unknown_or_missing_schema_version(tmp_path):
    path = tmp_path / "future.results.json"
    data = to_jsonable(_sample())
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown results schema_version 99"):
        load_results(path)
    del data["schema_version"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no 'schema_version'"):
        load_results(path)


def test_missing_keys_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"timing\.eval_seconds.*counters\.samples_seen"):
        _sample(
            timing={"train_seconds": 1.0, "samples_per_second": 1.0, "peak_memory_bytes": None},
            counters={
                "optimizer_steps": 1,
                "skipped_nonfinite_steps": 0,
                "skipped_nonfinite_hypergradients": 0,
            },
        )
    path = tmp_path / "partial.results.json"
    data = to_jsonable(_sample())
    del data["metrics"]["AP"]
    del data["stream"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"stream.*metrics\.AP"):
        load_results(path)


def test_results_path_strips_prefix():
    # PILOT configs use "prefix": " " -> "_1993_vit..." ; a real prefix keeps its text.
    expected = Path("logs/l2p") / "_1993_vit_base_patch16_224.results.json"
    assert results_path("logs/l2p", " ", 1993, "vit_base_patch16_224") == expected
    assert results_path(Path("d"), " exp ", 1, "b").name == "exp_1_b.results.json"
    assert results_module.RESULTS_SUFFIX == ".results.json"

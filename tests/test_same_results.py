"""``scripts/same_results.py``, the before/after check of a refactoring: runs of two methods share
file names, so folders pair by the path under each; the clock may differ, a number may not."""

from __future__ import annotations

import json
import shutil
import sys

from conftest import REPO, load_script

SAMPLE = next(
    (REPO / "docs" / "scale-model" / "results").glob(
        "fashion_mnist_blurry_linear_probe_base_lr0.005_0_*.results.json"
    )
)


def _matrix(root, edit=None):
    """Two methods' folders holding a results file of the same name (and its gradient trace)."""
    for method in ("first", "second"):
        folder = root / method / "results"
        folder.mkdir(parents=True)
        results = json.loads(SAMPLE.read_text(encoding="utf-8"))
        if edit is not None and method == "second":
            edit(results)
        (folder / SAMPLE.name).write_text(json.dumps(results), encoding="utf-8")
        for trace in SAMPLE.parent.glob(f"{SAMPLE.name.removesuffix('.json')}.*.npy"):
            shutil.copy(trace, folder / trace.name)


def _compare(tmp_path, capsys, edit):
    _matrix(tmp_path / "old")
    _matrix(tmp_path / "new", edit)
    script = load_script("same_results")
    argv = ["same_results.py", str(tmp_path / "old"), str(tmp_path / "new")]
    saved, sys.argv = sys.argv, argv
    try:
        code = script.main()
    finally:
        sys.argv = saved
    return code, capsys.readouterr().out


def test_a_changed_number_in_one_method_s_run_is_found_by_its_path(tmp_path, capsys):
    def nudge(results):
        results["metrics"]["AP"] += 1e-12

    code, out = _compare(tmp_path, capsys, nudge)
    assert code == 1
    assert f"second/results/{SAMPLE.name}: 1 differences" in out
    assert f"first/results/{SAMPLE.name}: identical" in out
    assert "metrics.AP:" in out and "2 pairs compared, some differ" in out


def test_the_clock_and_the_paths_may_differ(tmp_path, capsys):
    def elsewhere(results):
        results["timing"]["train_seconds"] += 5
        results["created_utc"] = "2030-01-01T00:00:00Z"
        results["config"]["results_dir"] = "/somewhere/else"
        results["environment"] = {"torch": "2.99.0", "threads": 16}

    code, out = _compare(tmp_path, capsys, elsewhere)
    assert code == 0, out
    assert "2 pairs compared, all identical" in out

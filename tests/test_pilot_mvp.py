"""MVP end to end through a real, patched PILOT (``PILOT_ROOT``): PILOT's own ``main.py`` on the
synthetic dataset at 32 px with random weights. CI runs (clear, base) and (Si-Blurry, + P + FGH);
``PILOT_FULL_MATRIX=1`` runs all four stream x variant pairs."""

from __future__ import annotations

import os

import pytest
from conftest import requires_pilot
from test_pilot_integration import assert_single_pass

pytestmark = requires_pilot
MVP_PARAMETERS = ("keys", "class_masks", "g_prompts", "e_prompts", "backbone.head.weight")


RUNS = [("base", "clear"), ("p_fgh", "si_blurry")]
if os.environ.get("PILOT_FULL_MATRIX") == "1":
    RUNS += [("p_fgh", "clear"), ("base", "si_blurry")]


@pytest.mark.parametrize(("variant", "stream"), RUNS)
def test_mvp_online_run_through_pilot_main(pilot_main_run, variant, stream):
    # The smoke config's 2-token prompts (the card's smoke_overrides): 20-token ones cost 5x.
    report, results = pilot_main_run("mvp", variant, stream)
    sizes = assert_single_pass(results)
    assert report["boundary_calls"] == [] and report["task_ids"] == []
    assert report["learner_calls"] == ["eval_task"] * 2

    # MVP's keys, masks, prompts and head trained; PILOT's ViT untouched.
    changed = report["changed"]
    trainable = {n for n, c in changed.items() if c["trainable"]}
    assert trainable == {*MVP_PARAMETERS, "backbone.head.bias"}
    assert all(changed[n]["changed"] for n in trainable)
    assert not [n for n, c in changed.items() if not c["trainable"] and c["changed"]]

    metrics = results["metrics"]
    assert len(metrics["accuracy_matrix"]) == 2
    assert metrics["AP"] is not None and metrics["A_T"] is not None
    assert results["config"]["model_name"] == "mvp_online"
    if stream == "si_blurry":
        assert metrics["A_auc"] is not None
    diagnostics = results["extra"]["diagnostics"]
    if variant == "p_fgh":
        # the paper's FGH (class-wise) reweights the classifier's rows only
        assert set(diagnostics["fgh"]["alpha"]) == {"backbone.head.weight", "backbone.head.bias"}
        assert diagnostics["prototypes"]["samples"] == sum(sizes)
    else:
        assert "fgh" not in diagnostics and "prototypes" not in diagnostics

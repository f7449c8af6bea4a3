"""Online-LoRA end to end through a real, patched PILOT (``PILOT_ROOT``): PILOT's own ``main.py``
on the synthetic dataset at 32 px with random weights, clear + base and Si-Blurry + P + FGH."""

from __future__ import annotations

import pytest
from conftest import TEST_VIT_DEPTH, requires_pilot
from test_pilot_integration import assert_single_pass

pytestmark = requires_pilot

# synthetic_tiny has 8 classes. Trainable: the tests' blocks x q, v x (A 4x768 + B 768x4)
# + head 768x8 + 8
TRAINABLE = TEST_VIT_DEPTH * 2 * 2 * 4 * 768 + 768 * 8 + 8


@pytest.mark.parametrize(("variant", "stream"), [("base", "clear"), ("p_fgh", "si_blurry")])
def test_olora_runs_through_pilot_main(pilot_main_run, variant, stream):
    # The smoke config's one buffered batch (the card's smoke_overrides): the same code paths.
    report, results = pilot_main_run("olora", variant, stream)
    counters = results["counters"]
    sizes = assert_single_pass(results)
    assert counters["trainable_parameters"] == TRAINABLE
    assert report["learner_calls"] == ["eval_task"] * 2

    # Plateaus are counted in the results file, with the window and thresholds that found them.
    olora = results["extra"]["diagnostics"]["method"]["olora"]
    assert olora["loss_window_length"] == 5 and olora["loss_window_mean_threshold"] == 6.0
    assert olora["plateaus"] == len(olora["plateau_steps"])
    # Upstream reads the window before it is full: step 1's CE (unmasked, as upstream: about log 8
    # with random weights) is under the mean threshold 6 with zero variance, so the first step is
    # always a plateau.
    assert olora["plateau_steps"][0] == 1
    assert all(1 <= s <= counters["optimizer_steps"] for s in olora["plateau_steps"])

    # LoRA factors and the head trained; no frozen weight moved: upstream's merge (the default
    # olora_merge) adds the factors to the merged-factor buffers, not to the qkv projections.
    changed = report["changed"]
    trainable = {n for n, c in changed.items() if c["trainable"]}
    assert trainable and all(changed[n]["changed"] for n in trainable - _b_factors(trainable))
    moved_frozen = {n for n, c in changed.items() if not c["trainable"] and c["changed"]}
    assert moved_frozen == set()

    matrix = results["metrics"]["accuracy_matrix"]
    assert len(matrix) == 2 and matrix[1][0] is None
    assert results["metrics"]["AP"] is not None and results["metrics"]["A_T"] is not None
    diagnostics = results["extra"]["diagnostics"]
    if variant == "p_fgh":
        assert diagnostics["prototypes"]["samples"] == sum(sizes)
        # the paper's FGH (class-wise) reweights the classifier's rows only
        assert set(diagnostics["fgh"]["alpha"]) == {"fc.weight", "fc.bias"}
    else:
        assert "fgh" not in diagnostics and "prototypes" not in diagnostics


def _b_factors(names: set[str]) -> set[str]:
    """B factors restart at zero at each merge: one that merged on the last step is zero again."""
    return {n for n in names if n.endswith((".b_q", ".b_v"))}

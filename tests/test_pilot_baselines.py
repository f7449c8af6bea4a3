"""End-to-end runs of the baseline rows (fine-tuning, linear probe, ER, ER + linear probe) through
a real, patched PILOT (``PILOT_ROOT``), with the helpers of test_pilot_integration.py.

A full ViT-B/16 trains in the fine-tuning rows: on 2 CPU cores one such run costs over a minute,
far more than a prompt run. CI checks each row's two contract runs (clear + base, Si-Blurry
+ P + FGH: test_contract.py makes them, ``pilot_main_run`` shares them); ``PILOT_FULL_MATRIX=1``
runs all 16 (row x variant x stream). The runs left out are not collected at all (never
skipped), so CI's rule that no PILOT test is skipped holds.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from conftest import TEST_VIT_DEPTH, requires_pilot
from test_pilot_integration import MEMORY, REPLAYED

pytestmark = requires_pilot
ROWS = ("finetune", "linear_probe", "er", "er_linear_probe")
CI_RUNS = {(row, *pair) for row in ROWS for pair in (("base", "clear"), ("p_fgh", "si_blurry"))}
FULL = os.environ.get("PILOT_FULL_MATRIX") == "1"


def matrix():
    for row in ROWS:
        for variant in ("base", "p_fgh"):
            for stream in ("clear", "si_blurry"):
                if FULL or (row, variant, stream) in CI_RUNS:
                    yield pytest.param(row, variant, stream, id=f"{row}-{variant}-{stream}")


@pytest.mark.parametrize(("row", "variant", "stream"), list(matrix()))
def test_baseline_row_through_pilot_main(pilot_main_run, row, variant, stream):
    replay = row.startswith("er")  # tiny_config sets MEMORY and REPLAYED for the memory rows
    report, results = pilot_main_run(row, variant, stream)
    counters, tasks = results["counters"], results["stream"]["tasks"]
    sizes = [t["num_samples"] for t in tasks]

    # One pass; replayed samples are not stream samples: counters count the stream only.
    assert counters["samples_seen"] == counters["stream_length"] == sum(sizes) == 160
    assert counters["optimizer_steps"] == sum(math.ceil(n / 40) for n in sizes)
    assert counters["skipped_nonfinite_steps"] == 0
    assert report["boundary_calls"] == [] and report["learner_calls"] == ["eval_task"] * 2

    # Fine-tuning trains every parameter, the linear probe only the final FC layer.
    changed = report["changed"]
    trainable = {n for n, c in changed.items() if c["trainable"]}
    assert trainable and all(changed[n]["changed"] for n in trainable)
    assert not [n for n, c in changed.items() if not c["trainable"] and c["changed"]]
    if "linear_probe" in row:
        assert trainable == {"fc.weight", "fc.bias"}
    else:
        # The whole ViT and fc: 12 tensors a block; patch embedding, class token, positions,
        # final norm and fc: 8.
        assert trainable == set(changed) and len(trainable) == 12 * TEST_VIT_DEPTH + 8

    matrix = results["metrics"]["accuracy_matrix"]
    assert len(matrix) == 2 and matrix[1][0] is None
    assert results["metrics"]["AP"] is not None and results["metrics"]["A_T"] is not None
    if stream == "si_blurry":
        assert len(results["extra"]["periodic_evaluations"]) == 160 // 80

    diagnostics = results["extra"]["diagnostics"]
    if replay:
        memory = diagnostics["experience_replay"]
        assert memory["capacity"] == MEMORY and memory["batch_size"] == REPLAYED
        assert memory["size"] == MEMORY and memory["stream_samples_offered"] == 160
        histogram = np.array(memory["class_histogram"])
        assert histogram.sum() == MEMORY and len(histogram) == 8
        streamed = sorted({c for t in tasks for c in t["classes"]})
        assert set(np.flatnonzero(histogram)) <= set(streamed)
    else:
        assert "experience_replay" not in diagnostics
    if variant == "p_fgh":
        # Prototypes average stream samples only, never the replayed ones.
        assert diagnostics["prototypes"]["samples"] == 160
        assert diagnostics["fgh"]["alpha"]
    else:
        assert "fgh" not in diagnostics and "prototypes" not in diagnostics

"""ConvPrompt (``convprompt_online``) end to end through a real, patched PILOT (``PILOT_ROOT``).

ConvPrompt's own checks on its (clear, base) contract run (test_contract.py makes it, with the
shared end-to-end checks of both its runs; ``pilot_main_run`` shares it).
"""

from __future__ import annotations

import re

from conftest import requires_pilot

pytestmark = requires_pilot

CLASSES = 8  # synthetic_tiny
# Upstream sizes (CVIR/convprompt configs): 7 prompted layers, 12 heads of 64, prefix length 20,
# 17 x 17 kernels, and the paper's 5 generators; matcher 768 -> 384 -> 192.
LAYERS, HEADS, HEAD_DIM, LENGTH, K, GENERATORS, DIM = 7, 12, 64, 20, 17, 5, 768
EXPECTED_TRAINABLE = {
    "prompt.embeddings": LAYERS * 2 * HEADS * (LENGTH + K - 1) * (HEAD_DIM + K - 1),
    "prompt.kernels": LAYERS * 2 * HEADS * GENERATORS * K * K,
    "prompt.biases": LAYERS * 2 * HEADS * GENERATORS,
    "prompt.keys": GENERATORS * DIM // 4,
    "prompt.matcher": DIM * DIM // 2 + DIM // 2 + DIM // 2 * DIM // 4 + DIM // 4,
    # norm1 and norm2 of the frozen blocks (upstream): 7 in the tests (conftest.py,
    # vit_depth_for_tests: as deep as the last prompted layer)
    "block norms": LAYERS * 2 * 2 * DIM,
    "final norm": 2 * DIM,
    "fc_norm": 2 * DIM,
    "fc": DIM * CLASSES + CLASSES,
}


def test_clear_base_run_trains_only_convprompt_parameters(pilot_main_run):
    report, results = pilot_main_run("convprompt", "base", "clear")

    assert report["boundary_calls"] == [] and report["learner_calls"] == ["eval_task"] * 2
    assert results["config"]["num_generators"] == GENERATORS
    assert results["counters"]["trainable_parameters"] == sum(EXPECTED_TRAINABLE.values())

    changed = report["changed"]
    trainable = {n for n, c in changed.items() if c["trainable"]}
    block_norm = re.compile(r"backbone\.blocks\.\d+\.norm[12]\.(weight|bias)")
    expected = {
        n for n in changed if n.startswith(("prompt.", "fc_norm.", "fc.", "backbone.norm."))
    }
    expected |= {n for n in changed if block_norm.fullmatch(n)}
    assert trainable == expected
    assert all(changed[n]["changed"] for n in trainable)  # every generator tensor learned
    assert not [n for n, c in changed.items() if not c["trainable"] and c["changed"]]

    counters = results["counters"]
    assert counters["samples_seen"] == counters["stream_length"] == CLASSES * 20
    assert counters["skipped_nonfinite_steps"] == 0
    assert results["metrics"]["AP"] is not None and results["metrics"]["A_T"] is not None

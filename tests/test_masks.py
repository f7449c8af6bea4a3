"""Logit masks worked out by hand on tiny tensors (paper appendix "Batch Wise Logits Mask")."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pilot_online.core.masks import (
    LOGIT_MASKS,
    batch_mask,
    classes_present,
    mask_logits,
    seen_mask,
    training_mask,
)

INF = float("inf")


def test_classes_present() -> None:
    assert classes_present(torch.tensor([2, 0, 2]), 4).tolist() == [True, False, True, False]
    assert classes_present(torch.tensor([[3], [3]]), 4).tolist() == [False, False, False, True]
    assert classes_present(torch.zeros(0, dtype=torch.long), 2).tolist() == [False, False]


def test_classes_present_rejects_bad_labels() -> None:
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        classes_present(torch.tensor([4]), 4)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        classes_present(torch.tensor([-1]), 4)
    with pytest.raises(TypeError, match="integer"):
        classes_present(torch.tensor([1.0]), 4)


def test_mask_logits_out_of_place() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    masked = mask_logits(logits, torch.tensor([True, False, True]))
    assert masked.tolist() == [[1.0, -INF, 3.0], [4.0, -INF, 6.0]]
    assert logits.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]  # input untouched


def test_mask_logits_rejects_bad_masks() -> None:
    logits = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="bool"):
        mask_logits(logits, torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="last dimension"):
        mask_logits(logits, torch.tensor([True, False]))


def test_batch_mask_cross_entropy_by_hand() -> None:
    # Batch labels {0, 2}: class 1 is masked for every row.
    labels = torch.tensor([0, 2])
    mask = batch_mask(labels, 3)
    assert mask.tolist() == [True, False, True]
    logits = torch.tensor([[1.0, 5.0, 0.0], [0.0, 5.0, 2.0]], requires_grad=True)
    loss = F.cross_entropy(mask_logits(logits, mask), labels)
    # Row 0: -log(e^1 / (e^1 + e^0)); row 1: -log(e^2 / (e^0 + e^2)); mean of the two.
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(-2))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert logits.grad[:, 1].tolist() == [0.0, 0.0]  # a masked logit gets no gradient


def test_seen_mask_from_bool_and_indices() -> None:
    seen = torch.tensor([True, False, False, True])
    from_bool = seen_mask(seen, 4)
    assert from_bool.tolist() == [True, False, False, True]
    from_bool[1] = True
    assert seen.tolist() == [True, False, False, True]  # a copy, not a view
    assert seen_mask(torch.tensor([1, 3]), 4).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        seen_mask(torch.tensor([True, False]), 4)


def test_training_mask_kinds() -> None:
    labels = torch.tensor([2, 2])
    seen = torch.tensor([True, False, False, False])  # recorded before this batch
    assert training_mask("batch", labels, seen, 4).tolist() == [False, False, True, False]
    # "seen" = seen classes OR the current batch's: {0} | {2}.
    assert training_mask("seen", labels, seen, 4).tolist() == [True, False, True, False]
    assert training_mask("seen", labels, torch.tensor([0, 3]), 4).tolist() == [
        True,
        False,
        True,
        True,
    ]
    assert training_mask("none", labels, seen, 4) is None
    assert LOGIT_MASKS == ("batch", "seen", "none")


def test_training_mask_unknown_kind_lists_choices() -> None:
    with pytest.raises(ValueError, match="batch, seen, none"):
        training_mask("task", torch.tensor([0]), torch.tensor([True]), 1)

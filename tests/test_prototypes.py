"""PrototypeBank against the paper's Eq. 1 (running class means) and Eq. 2 (prototype CE)."""

from __future__ import annotations

import math

import pytest
import torch

from pilot_online.core.prototypes import PrototypeBank, class_sums


def _tiny_classifier(rows: list[list[float]]) -> torch.nn.Linear:
    """A bias-free linear classifier whose weight row j scores class j."""
    fc = torch.nn.Linear(len(rows[0]), len(rows), bias=False)
    with torch.no_grad():
        fc.weight.copy_(torch.tensor(rows))
    return fc


def test_eq1_by_hand_two_updates(device: torch.device) -> None:
    bank = PrototypeBank(3, 2, device=device)
    bank.update(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 0]))
    # After the first batch: class 0 = ([1, 2] + [3, 4]) / 2 = [2, 3], k = 2.
    torch.testing.assert_close(bank.means[0].cpu(), torch.tensor([2.0, 3.0]))
    bank.update(torch.tensor([[5.0, 6.0], [0.0, 2.0]]), torch.tensor([0, 2]))
    # Class 0: (2 * [2, 3] + [5, 6]) / 3 = ([1+3+5, 2+4+6]) / 3 = [3, 4]. Class 2: [0, 2].
    # Class 1 never seen: stays p_0 = 0.
    expected = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 2.0]])
    torch.testing.assert_close(bank.means.cpu(), expected)
    assert bank.counts.tolist() == [3, 0, 1]
    assert bank.counts.dtype == torch.int64
    assert bank.seen.tolist() == [True, False, True]


def test_batched_update_equals_sequential_eq1(device: torch.device) -> None:
    generator = torch.Generator().manual_seed(0)
    num_classes, dim = 5, 4
    bank = PrototypeBank(num_classes, dim, dtype=torch.float64, device=device)
    reference = torch.zeros(num_classes, dim, dtype=torch.float64)
    k = [0] * num_classes
    for _ in range(4):
        features = torch.randn(16, dim, generator=generator, dtype=torch.float64)
        labels = torch.randint(0, num_classes - 1, (16,), generator=generator)  # class 4 unseen
        bank.update(features, labels)
        for x, j in zip(features, labels.tolist()):  # Eq. 1, one sample at a time
            reference[j] = (k[j] * reference[j] + x) / (k[j] + 1)
            k[j] += 1
    torch.testing.assert_close(bank.means.cpu(), reference)
    assert bank.counts.tolist() == k
    assert k[4] == 0 and bank.seen.tolist() == [c > 0 for c in k]


def test_update_detaches_and_casts_features() -> None:
    bank = PrototypeBank(2, 2)
    features = torch.tensor([[1.0, 3.0]], dtype=torch.float16, requires_grad=True)
    bank.update(features, torch.tensor([1]))
    assert bank.means.dtype == torch.float32 and not bank.means.requires_grad
    torch.testing.assert_close(bank.means[1], torch.tensor([1.0, 3.0]))


def test_update_rejects_bad_input() -> None:
    bank = PrototypeBank(3, 2)
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        bank.update(torch.zeros(1, 2), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        bank.update(torch.zeros(1, 2), torch.tensor([-1]))
    with pytest.raises(TypeError, match="integer"):
        bank.update(torch.zeros(1, 2), torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"\[B, 2\]"):
        bank.update(torch.zeros(1, 5), torch.tensor([0]))
    with pytest.raises(ValueError, match="labels must have shape"):
        bank.update(torch.zeros(2, 2), torch.tensor([0]))
    assert bank.counts.tolist() == [0, 0, 0]  # nothing was half-applied
    bank.update(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))  # an empty batch is a no-op
    assert bank.counts.tolist() == [0, 0, 0]


def test_prototypes_returns_seen_classes_in_order() -> None:
    bank = PrototypeBank(4, 2)
    bank.update(torch.tensor([[1.0, 1.0], [2.0, 0.0]]), torch.tensor([3, 1]))
    means, labels = bank.prototypes()
    assert labels.tolist() == [1, 3]
    torch.testing.assert_close(means, torch.tensor([[2.0, 0.0], [1.0, 1.0]]))


def _hand_bank() -> PrototypeBank:
    """Class 0 prototype [1, 0], class 2 prototype [0, 1]; class 1 unseen."""
    bank = PrototypeBank(3, 2)
    bank.update(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 2]))
    return bank


def test_loss_by_hand_with_unseen_class_masked() -> None:
    bank = _hand_bank()
    fc = _tiny_classifier([[1.0, 0.0], [5.0, 5.0], [0.0, 2.0]])
    # p0 = [1, 0]: logits [1, 5, 0] -> masked [1, -inf, 0]; CE = -log(e^1 / (e^1 + e^0)).
    # p2 = [0, 1]: logits [0, 5, 2] -> masked [0, -inf, 2]; CE = -log(e^2 / (e^0 + e^2)).
    ce_0 = -math.log(math.exp(1) / (math.exp(1) + math.exp(0)))
    ce_2 = -math.log(math.exp(2) / (math.exp(0) + math.exp(2)))
    expected = (ce_0 + ce_2) / 2  # pseudo-code: mean over the 2 seen prototypes (not 1/c = 1/3)
    assert bank.loss(fc).item() == pytest.approx(expected, rel=1e-6)
    # Unmasked, class 1's logit 5 would dominate: CE_0 = -log(e / (e + e^5 + 1)) > 4.
    # The unseen class's row must not matter at all.
    with torch.no_grad():
        fc.weight[1] = torch.tensor([-7.0, 30.0])
    assert bank.loss(fc).item() == pytest.approx(expected, rel=1e-6)


def test_loss_gradient_reaches_classifier_not_bank() -> None:
    bank = _hand_bank()
    fc = _tiny_classifier([[1.0, 0.0], [5.0, 5.0], [0.0, 2.0]])
    bank.loss(fc).backward()
    # dCE/dlogits = softmax - onehot over the unmasked classes, then / 2 for the mean;
    # dW_j = sum over prototypes of g_j * p.
    # p0 = [1, 0]: softmax over {0, 2} of [1, 0] -> g = [-1/(e+1), 0, 1/(e+1)].
    # p2 = [0, 1]: softmax over {0, 2} of [0, 2] -> g = [1/(1+e^2), 0, -1/(1+e^2)].
    a = 1 / (math.e + 1)
    b = 1 / (1 + math.e**2)
    expected = torch.tensor([[-a / 2, b / 2], [0.0, 0.0], [a / 2, -b / 2]])
    torch.testing.assert_close(fc.weight.grad, expected)
    assert not bank.means.requires_grad and bank.means.grad is None


def test_loss_is_safe_zero_before_any_update() -> None:
    bank = PrototypeBank(3, 2)
    fc = _tiny_classifier([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    zero = bank.loss(fc)
    assert zero.dim() == 0 and zero.item() == 0.0 and torch.isfinite(zero)
    x = torch.tensor([[1.0, 2.0]])
    (fc(x).sum() + zero).backward()
    # d(sum of logits)/dW_j = x for every row j: the zero term adds nothing (no NaN either).
    torch.testing.assert_close(fc.weight.grad, torch.tensor([[1.0, 2.0]] * 3))
    fc.weight.grad = None
    bank.loss(fc).backward()
    torch.testing.assert_close(fc.weight.grad, torch.zeros(3, 2))


def test_loss_rejects_classifier_with_wrong_width() -> None:
    bank = _hand_bank()
    wide = torch.nn.Linear(2, 4, bias=False)
    with pytest.raises(ValueError, match=r"\[S, 3\] logits"):
        bank.loss(wide)


def test_state_dict_round_trip_and_to_dtype() -> None:
    bank = PrototypeBank(3, 2)
    bank.update(torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 2.0]]), torch.tensor([0, 0, 2]))
    restored = PrototypeBank(3, 2)
    restored.load_state_dict(bank.state_dict())
    torch.testing.assert_close(restored.means, torch.tensor([[2.0, 3.0], [0.0, 0.0], [0.0, 2.0]]))
    assert restored.counts.tolist() == [2, 0, 1]
    # The restored bank continues Eq. 1 from k = 2: ([2, 3] * 2 + [5, 6]) / 3 = [3, 4].
    restored.update(torch.tensor([[5.0, 6.0]]), torch.tensor([0]))
    torch.testing.assert_close(restored.means[0], torch.tensor([3.0, 4.0]))

    bank64 = bank.to(torch.float64)
    assert bank64.means.dtype == torch.float64
    assert bank64.counts.dtype == torch.int64  # integer buffers are not cast


def test_load_state_dict_rejects_shape_mismatch() -> None:
    bigger = PrototypeBank(4, 2)
    with pytest.raises(RuntimeError, match="size mismatch"):
        bigger.load_state_dict(PrototypeBank(3, 2).state_dict())


def test_constructor_rejects_empty_bank() -> None:
    with pytest.raises(ValueError, match="num_classes must be >= 1"):
        PrototypeBank(0, 2)


# -- deterministic accumulation on every device (issue 15) -----------------------------------


@pytest.mark.parametrize("dense", [False, True], ids=["index_add", "dense"])
def test_class_sums_by_hand(dense: bool) -> None:
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [float("nan"), 1.0]])
    labels = torch.tensor([2, 0, 2, 3])
    sums, counts = class_sums(features, labels, 5, dense=dense)
    # class 0: [3, 4]; class 2: [1+5, 2+6]; class 3: the NaN row alone; classes 1, 4: none.
    expected = torch.tensor([[3.0, 4.0], [0.0, 0.0], [6.0, 8.0], [float("nan"), 1.0], [0, 0]])
    torch.testing.assert_close(sums, expected, equal_nan=True)
    assert counts.tolist() == [1, 0, 2, 1, 0] and counts.dtype == torch.int64


def test_cpu_update_is_bit_identical_to_sample_order_index_add() -> None:
    """On the CPU the bank still sums with index_add_ in sample order: the same bits as before
    the deterministic path existed (float32, many samples per class: order would show)."""
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(64, 16, generator=generator) * 1000
    labels = torch.randint(0, 3, (64,), generator=generator)
    bank = PrototypeBank(4, 16)
    bank.update(features, labels)
    sums = torch.zeros(4, 16).index_add_(0, labels, features)
    counts = torch.zeros(4, dtype=torch.int64).index_add_(0, labels, torch.ones_like(labels))
    expected = sums / counts.clamp(min=1).float().unsqueeze(1)  # p_0 = 0: (S - n 0) / n
    assert torch.equal(bank.means, expected)


def test_update_off_the_cpu_never_uses_index_add(monkeypatch) -> None:
    """index_add_ on CUDA floating point adds atomically, in a run-dependent order: off the CPU
    the bank must not call it. The meta device stands in for a GPU (no values, same code)."""

    def refuse(*args, **kwargs):
        raise AssertionError("index_add_ called off the CPU: nondeterministic on CUDA")

    monkeypatch.setattr(torch.Tensor, "index_add_", refuse)
    bank = PrototypeBank(3, 4, device="meta")
    bank.update(
        torch.empty(5, 4, device="meta"),
        torch.empty(5, dtype=torch.long, device="meta"),
        validate=False,
    )
    assert bank.means.shape == (3, 4)


def test_update_runs_under_deterministic_algorithms_and_repeats_exactly(device) -> None:
    generator = torch.Generator().manual_seed(7)
    features = torch.randn(100, 32, generator=generator)
    labels = torch.randint(0, 10, (100,), generator=generator)
    results = []
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            bank = PrototypeBank(10, 32, device=device)
            bank.update(features.to(device), labels.to(device))
            bank.update(features.flip(0).to(device), labels.flip(0).to(device))
            results.append(bank.means.cpu())
    finally:
        torch.use_deterministic_algorithms(previous)
    assert torch.equal(results[0], results[1])
    # Hand check: both batches hold the same samples, so each mean is the plain class mean.
    for j in range(10):
        torch.testing.assert_close(results[0][j], features[labels == j].mean(0))

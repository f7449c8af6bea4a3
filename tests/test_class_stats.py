"""The shared online class Gaussians and classifier alignment (``pilot_online/core/class_stats.py``)
against numpy's mean and covariance of the stacked features, and the alignment's draws against
the Gaussian they come from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pilot_online.core.class_stats import (
    ClassGaussians,
    align_classifier,
    normalised_logits,
    sampling_factors,
)


def stream(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """70 features in 6-D, three classes of distinct spread and a class seen once (3), shuffled."""
    rng = np.random.default_rng(seed)
    scale = np.array([0.5, 1.0, 2.0, 3.0, 1.5, 0.25])
    x = rng.normal(size=(70, 6)) * scale + rng.normal(0.0, 5.0, size=6)
    y = np.array([0] * 30 + [1] * 25 + [2] * 14 + [3])
    order = rng.permutation(70)
    return x[order].astype(np.float32), y[order]


def fill(stats: ClassGaussians, x: np.ndarray, y: np.ndarray) -> None:
    """Feed the stream in uneven batches (1, 2, 5, 9, ... samples), a session per batch."""
    edges = [0, 1, 3, 8, 17, 29, 45, 70]
    for session, (a, b) in enumerate(zip(edges, edges[1:])):
        stats.update(torch.from_numpy(x[a:b]), torch.from_numpy(y[a:b]), session)


@pytest.mark.parametrize("diagonal", [False, True])
def test_statistics_equal_numpy_over_uneven_batches(diagonal):
    x, y = stream()
    stats = ClassGaussians(5, 6, diagonal)
    fill(stats, x, y)
    assert stats.counts.tolist() == [30, 25, 14, 1, 0]
    assert stats.seen().tolist() == [0, 1, 2, 3]
    covariances = stats.covariances(torch.arange(4)).numpy()
    for c in range(3):
        rows = x[y == c].astype(np.float64)
        np.testing.assert_allclose(stats.means[c].numpy(), np.mean(rows, 0), rtol=0, atol=1e-5)
        want = np.cov(rows.T, ddof=1) + 1e-4 * np.eye(6)
        if diagonal:
            want = np.diag(want)
        np.testing.assert_allclose(covariances[c], want, rtol=1e-5, atol=1e-5)
    # One sample: np.cov is NaN there; the statistics give the ridge alone.
    ridge = np.full(6, 1e-4) if diagonal else 1e-4 * np.eye(6)
    np.testing.assert_allclose(covariances[3], ridge, rtol=0, atol=0)
    edges = np.array([0, 1, 3, 8, 17, 29, 45])  # each class's session: its first sample's batch
    for c in range(4):
        first = int(np.flatnonzero(y == c)[0])
        assert stats.session[c] == np.searchsorted(edges, first, side="right") - 1
    assert stats.session[4] == -1


def test_a_session_is_kept_from_the_first_sample_and_only_when_given():
    stats = ClassGaussians(3, 2)
    stats.update(torch.ones(2, 2), torch.tensor([0, 0]))  # no session: none recorded
    stats.update(torch.ones(2, 2), torch.tensor([0, 1]), 4)
    stats.update(torch.ones(2, 2), torch.tensor([1, 2]), 7)
    assert stats.session.tolist() == [4, 4, 7]


def test_state_round_trips_and_a_mismatched_checkpoint_is_refused():
    x, y = stream(1)
    stats = ClassGaussians(5, 6)
    fill(stats, x, y)
    twin = ClassGaussians(5, 6)
    twin.load_state_dict(dict(stats.state_dict()))
    for key, value in stats.state_dict().items():
        assert torch.equal(twin.state_dict()[key], value), key
    with pytest.raises(ValueError, match=r"scatter have shape .* resume with the config"):
        ClassGaussians(5, 6, diagonal=True).load_state_dict(dict(stats.state_dict()))


def test_bad_shapes_are_refused_before_any_update():
    stats = ClassGaussians(3, 4)
    with pytest.raises(ValueError, match=r"features must have shape \[B, 4\]"):
        stats.update(torch.zeros(2, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"labels must have shape \[2\]"):
        stats.update(torch.zeros(2, 4), torch.tensor([0, 1, 2]))
    assert stats.counts.sum() == 0
    with pytest.raises(TypeError, match="dim must be an integer"):
        ClassGaussians(3, 4.0)


def test_factors_reproduce_the_covariances_chunk_by_chunk():
    """40 classes (three chunks of 16): L L^T is each class's covariance; a matrix Cholesky
    refuses (singular, one negative rounding eigenvalue) falls back to clamped eigenvalues."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(400, 3)).astype(np.float32)
    y = np.repeat(np.arange(40), 10)
    stats = ClassGaussians(40, 3)
    stats.update(torch.from_numpy(x), torch.from_numpy(y))
    factors = stats.factors(torch.arange(40)).double()
    covariances = stats.covariances(torch.arange(40))
    torch.testing.assert_close(factors @ factors.transpose(1, 2), covariances, rtol=1e-5, atol=1e-6)
    singular = torch.tensor([[[1.0, 1.0], [1.0, 1.0 - 1e-12]]], dtype=torch.float64)
    factor = sampling_factors(singular).double()[0]
    # Eigenvalues ~2 and ~0, the latter clamped at 1e-4: L L^T = Sigma + 1e-4 v v^T.
    v = torch.tensor([1.0, -1.0], dtype=torch.float64) / 2**0.5
    want = singular[0] + 1e-4 * torch.outer(v, v)
    torch.testing.assert_close(factor @ factor.T, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("diagonal", [False, True])
def test_an_alignment_draw_has_the_class_mean_and_covariance(diagonal):
    """The features one seeded alignment epoch feeds the head (lr 0: the head stays put) have,
    per class, ``samples_per_class`` rows with numpy's mean and covariance within a few standard
    errors of the class's Gaussian. The means are 40 apart: the sign of x0 tells the class."""
    mean = torch.tensor([[20.0, -1.0], [-20.0, 5.0]])
    sigma = np.array([[[2.0, 0.6], [0.6, 1.0]], [[0.5, -0.2], [-0.2, 0.3]]])
    if diagonal:
        sigma = np.stack([np.diag(np.diag(s)) for s in sigma])
        factors = torch.tensor(np.sqrt(np.diagonal(sigma, axis1=1, axis2=2))).float()
    else:
        factors = torch.linalg.cholesky(torch.tensor(sigma)).float()
    head = nn.Linear(2, 2)
    drawn: list[torch.Tensor] = []
    head.register_forward_hook(lambda module, args, out: drawn.append(args[0].detach()))
    n = 4000
    align_classifier(
        head,
        torch.tensor([0, 1]),
        mean,
        factors,
        epochs=1,
        lr=0.0,
        weight_decay=0.0,
        samples_per_class=n,
        generator=torch.Generator().manual_seed(0),
    )
    inputs = torch.cat(drawn).double().numpy()
    assert inputs.shape == (2 * n, 2)
    for c, rows in enumerate((inputs[inputs[:, 0] > 0], inputs[inputs[:, 0] < 0])):
        assert len(rows) == n
        # Standard errors: sqrt(var / n) <= 0.023 for the means, about 0.03 for the covariances.
        np.testing.assert_allclose(np.mean(rows, 0), mean[c].numpy(), atol=0.08)
        np.testing.assert_allclose(np.cov(rows.T), sigma[c], atol=0.1)


def test_alignment_normalises_logits_over_blocks_and_needs_them():
    logits = torch.tensor([[3.0, 4.0, 1.0, 0.0]])
    blocks = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    # Block norms 5 and 1 (each + 1e-7): mean 3; over the temperature 0.5: divide by 1.5.
    want = torch.tensor([[2.0, 8 / 3, 2 / 3, 0.0]])
    torch.testing.assert_close(normalised_logits(logits, blocks, 0.5), want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="blocks"):
        align_classifier(
            nn.Linear(2, 2),
            torch.tensor([0, 1]),
            torch.zeros(2, 2),
            torch.ones(2, 2),
            epochs=1,
            lr=0.1,
            weight_decay=0.0,
            samples_per_class=4,
            generator=torch.Generator(),
            temperature=0.1,
        )


def test_weight_decay_alone_moves_the_aligned_rows_and_no_other_row():
    """Zero features (zero means and spreads): the CE gives the weights no gradient, so they move
    by the weight decay alone, through SGD's momentum, by hand: v1 = wd w0, w1 = w0 (1 - lr wd),
    v2 = 0.9 v1 + wd w1, w2 = w1 - lr v2 = w0 (1 - lr wd - lr wd (1.9 - lr wd)) = 0.8575 w0 at
    lr 0.1, wd 0.5 (one epoch: the cosine schedule's lr is lr; 2 classes x 4 samples, batches of
    4: two steps). Row 2, of a class not aligned, keeps its weight and bias (upstream's head has
    no such row for its decay to reach)."""
    torch.manual_seed(0)
    head = nn.Linear(2, 3)
    before = head.weight.detach().clone(), head.bias.detach().clone()
    align_classifier(
        head,
        torch.tensor([0, 1]),
        torch.zeros(2, 2),
        torch.zeros(2, 2),
        epochs=1,
        lr=0.1,
        weight_decay=0.5,
        samples_per_class=4,
        generator=torch.Generator().manual_seed(0),
    )
    torch.testing.assert_close(head.weight[:2], 0.8575 * before[0][:2], rtol=1e-6, atol=1e-7)
    assert torch.equal(head.weight[2], before[0][2]) and head.bias[2] == before[1][2]
    assert not torch.equal(head.bias[:2], before[1][:2])  # the CE moves the biases


def test_alignment_batches_mix_the_classes():
    """Upstream shuffles the drawn features before it cuts them into batches: with two classes 40
    apart (the sign of x0 tells them), every batch of 64 holds both, about half each (a batch of
    one class has probability 2^-63 when shuffled; unshuffled, every batch is one class)."""
    head = nn.Linear(2, 2)
    drawn: list[torch.Tensor] = []
    head.register_forward_hook(lambda module, args, out: drawn.append(args[0].detach()))
    align_classifier(
        head,
        torch.tensor([0, 1]),
        torch.tensor([[20.0, 0.0], [-20.0, 0.0]]),
        torch.ones(2, 2),
        epochs=2,
        lr=0.0,
        weight_decay=0.0,
        samples_per_class=64,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(drawn) == 4  # 2 epochs x 2 batches
    for batch in drawn:
        share = float((batch[:, 0] > 0).double().mean())
        assert 0.3 < share < 0.7, share

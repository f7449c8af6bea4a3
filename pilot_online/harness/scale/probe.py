"""How good a frozen backbone's features are: a linear probe and nearest-class-mean accuracy.

Both read the features PILOT's methods read (the class token after the ViT's final norm,
``forward_features(x)[:, 0]``). The probe is multinomial logistic regression on standardised
features, fitted full-batch by L-BFGS for a fixed number of iterations, its L2 strength chosen
on a held-out fifth of the training set: no randomness, so the same features give the same
accuracy. Nearest class mean is cosine, as SimpleCIL's and the
paper's prototype classifiers are. Raw pixels go through the same probe, as the floor a
pretrained backbone must beat.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

#: The images' normalisation the scale model is trained and evaluated with (grey on [0, 1]
#: mapped to roughly zero mean and unit spread), as the plugin's datasets feed it.
MEAN, STD = 0.5, 0.25


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 ``[N, S, S, 3]`` to normalised float ``[N, 3, S, S]``."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0
    return (x - MEAN) / STD


@torch.no_grad()
def features(model: torch.nn.Module, images: np.ndarray, batch: int = 250) -> torch.Tensor:
    """The class token after the final norm, ``[N, D]``, in eval mode."""
    was_training = model.training
    model.eval()
    out = [
        model.forward_features(to_tensor(images[i : i + batch]))[:, 0]
        for i in range(0, len(images), batch)
    ]
    model.train(was_training)
    return torch.cat(out).float()


def pixels(images: np.ndarray) -> torch.Tensor:
    """Raw pixels as features (one grey channel: the three are copies)."""
    return to_tensor(images)[:, 0].flatten(1)


#: The L2 strengths a probe chooses from, on a held-out fifth of its training set: raw pixels
#: and features each get their best (a fixed strength favours one or the other: at 100
#: iterations, 1e-4 under-regularises pixels, 1e-3 suits them).
WEIGHT_DECAYS = (1e-5, 1e-4, 1e-3, 1e-2)
ITERATIONS = 200


def tuned_linear_probe(
    train: torch.Tensor, train_y: np.ndarray, test: torch.Tensor, test_y: np.ndarray
) -> float:
    """Test accuracy (%) of logistic regression whose L2 strength is chosen on the last fifth of
    the training set (in its given order), then refitted on all of it."""
    cut = len(train) * 4 // 5
    scores = [
        linear_probe(train[:cut], train_y[:cut], train[cut:], train_y[cut:], wd, ITERATIONS)
        for wd in WEIGHT_DECAYS
    ]
    best = WEIGHT_DECAYS[int(np.argmax(scores))]
    return linear_probe(train, train_y, test, test_y, best, ITERATIONS)


def linear_probe(
    train: torch.Tensor,
    train_y: np.ndarray,
    test: torch.Tensor,
    test_y: np.ndarray,
    weight_decay: float = 1e-4,
    iterations: int = ITERATIONS,
) -> float:
    """Test accuracy (%) of logistic regression fitted on ``train`` (standardised by its own
    mean and std)."""
    mean, std = train.mean(0), train.std(0).clamp_min(1e-6)
    a, b = ((train - mean) / std).double(), ((test - mean) / std).double()
    y = torch.as_tensor(train_y)
    classes = int(max(train_y.max(), test_y.max())) + 1
    weight = torch.zeros(a.shape[1], classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS(
        [weight, bias], lr=1.0, max_iter=iterations, history_size=20,
        line_search_fn="strong_wolfe",
    )  # fmt: skip

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        loss = F.cross_entropy(a @ weight + bias, y) + weight_decay * weight.pow(2).sum()
        loss.backward()
        return loss

    optimiser.step(closure)
    with torch.no_grad():
        predicted = (b @ weight + bias).argmax(1).numpy()
    return float((predicted == test_y).mean() * 100)


def nearest_class_mean(
    train: torch.Tensor, train_y: np.ndarray, test: torch.Tensor, test_y: np.ndarray
) -> float:
    """Test accuracy (%) of the cosine nearest class mean."""
    y = torch.as_tensor(train_y)
    classes = int(train_y.max()) + 1
    means = torch.stack([train[y == c].mean(0) for c in range(classes)])
    scores = F.normalize(test, dim=1) @ F.normalize(means, dim=1).T
    return float((scores.argmax(1).numpy() == test_y).mean() * 100)


@dataclass(frozen=True)
class Quality:
    """Probe and nearest-class-mean accuracies (%) on one benchmark."""

    probe: float
    ncm: float


def quality(model: torch.nn.Module | None, data: dict[str, np.ndarray]) -> Quality:
    """A backbone's (or, with ``model=None``, raw pixels') accuracies on ``data``; the training
    set is shuffled once (a fixed permutation), so that the probe's held-out fifth holds every
    class."""
    order = np.random.default_rng(0).permutation(len(data["train_y"]))
    train_x, train_y = data["train_x"][order], data["train_y"][order]
    if model is None:
        train, test = pixels(train_x), pixels(data["test_x"])
    else:
        train, test = features(model, train_x), features(model, data["test_x"])
    return Quality(
        tuned_linear_probe(train, train_y, test, data["test_y"]),
        nearest_class_mean(train, train_y, test, data["test_y"]),
    )

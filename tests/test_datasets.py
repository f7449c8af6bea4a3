"""The embedded synthetic dataset: shapes, determinism, split hygiene and difficulty
(generation speed: benchmarks/bench_datasets.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pilot_online.core.datasets import DATASETS, SyntheticSpec, dataset_spec, make_synthetic


@pytest.fixture(scope="module")
def default_data() -> dict[str, np.ndarray]:
    return make_synthetic()


def test_shapes_dtypes_and_balance(default_data: dict[str, np.ndarray]) -> None:
    # Default spec: 100 classes x 50 train and x 10 test images of 32x32 RGB.
    assert default_data["train_x"].shape == (5000, 32, 32, 3)
    assert default_data["test_x"].shape == (1000, 32, 32, 3)
    assert default_data["train_x"].dtype == np.uint8 and default_data["test_x"].dtype == np.uint8
    assert default_data["train_y"].dtype == np.int64 and default_data["test_y"].dtype == np.int64
    assert np.bincount(default_data["train_y"]).tolist() == [50] * 100
    assert np.bincount(default_data["test_y"]).tolist() == [10] * 100
    assert np.all(np.diff(default_data["train_y"]) >= 0)  # ordered by class
    # Pixels span the range rather than sitting saturated or flat.
    pixels = default_data["train_x"]
    assert 90 < pixels.mean() < 170 and pixels.std() > 20


def test_same_spec_gives_identical_bytes(default_data: dict[str, np.ndarray]) -> None:
    again = make_synthetic(SyntheticSpec())
    for key, value in default_data.items():
        assert again[key].tobytes() == value.tobytes(), key


def test_different_seed_gives_different_images(default_data: dict[str, np.ndarray]) -> None:
    other = make_synthetic(seed=1)
    assert not np.array_equal(other["train_x"], default_data["train_x"])
    assert not np.array_equal(other["test_x"], default_data["test_x"])


def test_train_split_does_not_depend_on_test_size() -> None:
    small = dict(num_classes=5, train_per_class=4)
    a = make_synthetic(test_per_class=2, **small)
    b = make_synthetic(test_per_class=7, **small)
    assert np.array_equal(a["train_x"], b["train_x"])


def test_train_and_test_share_no_image(default_data: dict[str, np.ndarray]) -> None:
    train = {image.tobytes() for image in default_data["train_x"]}
    test = {image.tobytes() for image in default_data["test_x"]}
    assert len(train) == 5000 and len(test) == 1000  # no duplicates inside a split either
    assert not train & test


def test_linear_probe_beats_chance_but_not_perfect(default_data: dict[str, np.ndarray]) -> None:
    # Closed-form ridge regression onto one-hot targets, raw pixels scaled to [0, 1].
    train_x = torch.from_numpy(default_data["train_x"]).reshape(5000, -1).float() / 255
    test_x = torch.from_numpy(default_data["test_x"]).reshape(1000, -1).float() / 255
    centre = train_x.mean(0)
    train_x, test_x = train_x - centre, test_x - centre
    targets = torch.nn.functional.one_hot(torch.from_numpy(default_data["train_y"]), 100).float()
    gram = train_x.T @ train_x + 100.0 * torch.eye(train_x.shape[1])
    weights = torch.linalg.solve(gram, train_x.T @ targets)
    predicted = (test_x @ weights).argmax(1).numpy()
    accuracy = float((predicted == default_data["test_y"]).mean())
    # Chance is 1/100; "clearly beats chance" = above 3x chance. Shifted gratings and class
    # mixing keep a linear model well short of perfect (about 0.6 when this was written).
    assert 0.03 < accuracy < 0.9, accuracy


def test_spec_overrides_and_image_size() -> None:
    data = make_synthetic(num_classes=3, train_per_class=2, test_per_class=1, image_size=16)
    assert data["train_x"].shape == (6, 16, 16, 3) and data["test_x"].shape == (3, 16, 16, 3)
    assert data["train_y"].tolist() == [0, 0, 1, 1, 2, 2]


def test_named_specs() -> None:
    assert dataset_spec("synthetic") == SyntheticSpec()
    small = dataset_spec("synthetic_small", seed=3)
    assert (small.num_classes, small.train_per_class, small.test_per_class, small.seed) == (
        20,
        40,
        10,
        3,
    )
    assert set(DATASETS) == {"synthetic", "synthetic_small", "synthetic_tiny"}
    tiny = dataset_spec("synthetic_tiny")
    assert (tiny.num_classes, tiny.train_per_class, tiny.test_per_class) == (8, 20, 5)
    with pytest.raises(ValueError, match="synthetic_small"):
        dataset_spec("cifar224")


def test_bad_specs_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="valid fields"):
        make_synthetic(classes=10)
    with pytest.raises(ValueError, match="num_classes"):
        SyntheticSpec(num_classes=0)
    with pytest.raises(ValueError, match="image_size"):
        SyntheticSpec(image_size=4)
    with pytest.raises(ValueError, match="noise"):
        SyntheticSpec(noise=-1.0)
    with pytest.raises(ValueError, match="seed"):
        SyntheticSpec(seed=-1)

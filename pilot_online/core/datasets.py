"""The embedded synthetic image-classification dataset (no download).

It exists so that tests and offline smoke runs have a class-incremental image stream without
network access. Every class owns a template made of a few oriented colour gratings, a colour
blob and a background tint. A sample is its class template shifted by a few pixels, with random
contrast and brightness, mixed with a (usually weaker) copy of a random class's template shifted
independently (structure shared across classes, so classes overlap), plus pixel noise. Shifts
move the gratings' phase, so a linear probe on raw pixels clearly beats chance but stays far
from 100% (about 60% on the default spec), while a convolutional or ViT feature extractor can
still separate the classes.

Generation is vectorised numpy, seeded by dedicated ``np.random.Generator`` objects, and
deterministic: the same ``SyntheticSpec`` always yields identical arrays.

This module also holds the one list of dataset names a config may use: the plugin's synthetic
``DATASETS`` and ``PILOT_DATASETS``, the names PILOT 5240714's ``utils/data.py`` defines, with the
folders it reads them from and where the data comes from (plain data: no PILOT import).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import as_strided

_LOG = logging.getLogger(__name__)

# Template structure (in grey levels on the 0..255 scale, before the 128 offset).
_GRATINGS_PER_CLASS = 3
_GRATING_FREQ_RANGE = (1.0, 4.0)  # cycles per image side
_GRATING_AMPLITUDE_RANGE = (20.0, 45.0)
_BLOB_AMPLITUDE_RANGE = (40.0, 80.0)
_BLOB_CENTRE_RANGE = (0.2, 0.8)  # fraction of the image side
_BLOB_WIDTH_RANGE = (0.1, 0.2)  # Gaussian sigma, fraction of the image side
_BACKGROUND_STD = 10.0

# Per-sample nuisance.
_SHIFT_FRACTION = 1 / 6  # max shift = image_size * fraction pixels, in each direction
# Contrast and distractor weight take _LEVELS evenly spaced values, so that scaling is done once
# on the small templates instead of once per sample (brightness and noise stay continuous).
_LEVELS = 8
_CONTRAST_RANGE = (0.6, 1.2)
_DISTRACTOR_WEIGHT_RANGE = (0.2, 0.8)  # weight of a random class's template mixed in
_BRIGHTNESS_STD = 12.0
_CHANNEL_JITTER_STD = 6.0

# Pixel noise comes from a pool of i.i.d. Gaussian images picked at random per sample: drawing
# fresh Gaussian noise for every pixel dominated the generation time.
_NOISE_POOL_SIZE = 1024
_CHUNK = 256  # samples composed at once: the float32 working set (3 MB at 32x32) stays in cache


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SyntheticSpec:
    """Size and seed of a synthetic dataset; ``noise`` is the pixel-noise std in grey levels."""

    num_classes: int = 100
    train_per_class: int = 50
    test_per_class: int = 10
    image_size: int = 32
    noise: float = 24.0
    seed: int = 0

    def __post_init__(self) -> None:
        positive = {
            "num_classes": self.num_classes,
            "train_per_class": self.train_per_class,
            "test_per_class": self.test_per_class,
        }
        for name, value in positive.items():
            if not _is_int(value) or value < 1:
                raise ValueError(f"SyntheticSpec.{name} must be a positive int, got {value!r}")
        if not _is_int(self.image_size) or self.image_size < 8:
            raise ValueError(
                f"SyntheticSpec.image_size must be an int >= 8, got {self.image_size!r}"
            )
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"SyntheticSpec.seed must be a non-negative int, got {self.seed!r}")
        is_number = isinstance(self.noise, (int, float)) and not isinstance(self.noise, bool)
        if not is_number or self.noise < 0:
            raise ValueError(f"SyntheticSpec.noise must be a number >= 0, got {self.noise!r}")


DATASETS: dict[str, SyntheticSpec] = {
    "synthetic": SyntheticSpec(),
    "synthetic_small": SyntheticSpec(num_classes=20, train_per_class=40, test_per_class=10),
    # For end-to-end tests through PILOT: two tasks of four classes, four steps of 40.
    "synthetic_tiny": SyntheticSpec(num_classes=8, train_per_class=20, test_per_class=5),
}


@dataclass(frozen=True)
class PilotDataset:
    """Where PILOT's ``utils/data.py`` reads one dataset: ``folders`` are relative to the working
    directory PILOT runs in; ``source`` says where the data comes from."""

    folders: tuple[str, ...]
    source: str


_CIFAR_SOURCE = (
    "torchvision downloads it (download=True) from https://www.cs.toronto.edu/~kriz/cifar.html; "
    "offline, extract {archive} into ./data"
)
_README_SOURCE = (
    "the {what} split linked in the Datasets section of PILOT's README.md, unpacked as "
    "ImageFolders (one sub-folder of images per class)"
)
_IMAGENET_SOURCE = (
    "{what} as ImageFolders. PILOT's utils/data.py stops on purpose (`assert 0, \"You should "
    'specify the folder of your dataset"`) until you edit {cls}.download_data: delete the assert '
    "and set train_dir/test_dir to your folders, or create the placeholder folders above"
)

#: Every dataset name PILOT 5240714's ``utils/data.py`` defines (``_get_idata``).
PILOT_DATASETS: dict[str, PilotDataset] = {
    "cifar10": PilotDataset(
        ("data/cifar-10-batches-py",), _CIFAR_SOURCE.format(archive="cifar-10-python.tar.gz")
    ),
    "cifar100": PilotDataset(
        ("data/cifar-100-python",), _CIFAR_SOURCE.format(archive="cifar-100-python.tar.gz")
    ),
    "cifar224": PilotDataset(
        ("data/cifar-100-python",), _CIFAR_SOURCE.format(archive="cifar-100-python.tar.gz")
    ),
    "cub": PilotDataset(("data/cub/train", "data/cub/test"), _README_SOURCE.format(what="CUB-200")),
    "imagenetr": PilotDataset(
        ("data/imagenet-r/train", "data/imagenet-r/test"),
        _README_SOURCE.format(what="ImageNet-R"),
    ),
    "imageneta": PilotDataset(
        ("data/imagenet-a/train", "data/imagenet-a/test"),
        _README_SOURCE.format(what="ImageNet-A"),
    ),
    "objectnet": PilotDataset(
        ("data/objectnet/train", "data/objectnet/test"),
        _README_SOURCE.format(what="ObjectNet"),
    ),
    "omnibenchmark": PilotDataset(
        ("data/omnibenchmark/train", "data/omnibenchmark/test"),
        _README_SOURCE.format(what="OmniBenchmark"),
    ),
    "vtab": PilotDataset(
        ("data/vtab-cil/vtab/train", "data/vtab-cil/vtab/test"),
        _README_SOURCE.format(what="VTAB"),
    ),
    "imagenet100": PilotDataset(
        ("[DATA-PATH]/train", "[DATA-PATH]/val"),
        _IMAGENET_SOURCE.format(what="ImageNet-100", cls="iImageNet100"),
    ),
    "imagenet1000": PilotDataset(
        ("[DATA-PATH]/train", "[DATA-PATH]/val"),
        _IMAGENET_SOURCE.format(what="ImageNet-1k (https://image-net.org)", cls="iImageNet1000"),
    ),
}


@dataclass(frozen=True)
class ScaleDataset:
    """One of the scale model's benchmarks of real or held-out images (``docs/scale-model.md``):
    ``per_class`` counts are what the benchmark takes; ``source`` says where the images come
    from."""

    num_classes: int
    train_per_class: int
    test_per_class: int
    source: str


#: The scale model's benchmarks. The grid's training sets give 200 optimiser steps at batch 100
#: (the least the paper's FGH needs to move; the paper's runs have about 60 on CUB, 500 on
#: CIFAR-100); their test sets, 3,000 images each, keep evaluation a small share of a run.
SCALE_DATASETS: dict[str, ScaleDataset] = {
    "fashion_mnist": ScaleDataset(
        10, 2000, 300, "Fashion-MNIST's IDX files (the second half of its training split)"
    ),
    # The quickstart's: a quarter of the stream (50 steps), so that two runs take minutes.
    "fashion_mnist_quick": ScaleDataset(
        10, 500, 200, "Fashion-MNIST's IDX files (the second half of its training split)"
    ),
    "fractal": ScaleDataset(
        50, 400, 60, "formula-driven classes never used in pretraining (generated, no files)"
    ),
}


def first_of_each_class(labels: np.ndarray, per_class: int) -> np.ndarray:
    """Indices of the first ``per_class`` samples of each class in ``labels``, class by class."""
    return np.concatenate(
        [np.flatnonzero(labels == c)[:per_class] for c in range(int(labels.max()) + 1)]
    )


def fashion_mnist_benchmark(
    train_per_class: int, test_per_class: int, image_size: int, root: str | Path = "."
) -> dict[str, np.ndarray]:
    """The ``fashion_mnist`` benchmarks: the first ``train_per_class`` images of each class in
    the stream half (file order) and the first ``test_per_class`` of each class in the test
    split, resized to ``image_size``, ordered by class."""
    from . import fashion_mnist

    data = fashion_mnist.load(root)
    arrays: dict[str, np.ndarray] = {}
    for split, part, per_class in (
        ("train", fashion_mnist.STREAM_HALF, train_per_class),
        ("test", slice(None), test_per_class),
    ):
        labels = data[f"{split}_y"][part]
        chosen = first_of_each_class(labels, per_class)
        arrays[f"{split}_x"] = fashion_mnist.resize(data[f"{split}_x"][part][chosen], image_size)
        arrays[f"{split}_y"] = labels[chosen]
    return arrays


def load_scale_dataset(name: str, image_size: int, root: str = ".") -> dict[str, np.ndarray]:
    """``{"train_x", "train_y", "test_x", "test_y"}`` of a :data:`SCALE_DATASETS` benchmark at
    ``image_size`` (uint8 RGB images ordered by class, int64 labels)."""
    from . import fractals

    spec = SCALE_DATASETS[name]
    if name.startswith("fashion_mnist"):
        return fashion_mnist_benchmark(spec.train_per_class, spec.test_per_class, image_size, root)
    return fractals.make_split(
        fractals.FractalSplit(
            fractals.BENCHMARK_FIRST_CLASS,
            spec.num_classes,
            spec.train_per_class,
            spec.test_per_class,
            image_size,
        )
    )


def dataset_names() -> dict[str, list[str]]:
    """Valid ``dataset`` values by owner, sorted: ``{"PILOT": [...], "pilot-online": [...]}``."""
    return {"PILOT": sorted(PILOT_DATASETS), "pilot-online": sorted({*DATASETS, *SCALE_DATASETS})}


def plugin_datasets() -> set[str]:
    """The names the plugin resolves itself (synthetic and scale-model benchmarks)."""
    return {*DATASETS, *SCALE_DATASETS}


def dataset_spec(name: str, **overrides: object) -> SyntheticSpec:
    """Look up a named spec, optionally overriding fields (e.g. ``seed=3``)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}")
    return _with_overrides(DATASETS[name], overrides)


def make_synthetic(spec: SyntheticSpec | None = None, **overrides: object) -> dict[str, np.ndarray]:
    """Generate the dataset described by ``spec`` (default ``SyntheticSpec()``) and ``overrides``.

    Returns ``{"train_x", "train_y", "test_x", "test_y"}``: images are uint8 ``[N, H, W, 3]``,
    labels int64 ``[N]``, both splits ordered by class. Class templates, the train split and the
    test split each draw from their own child of ``SeedSequence(seed)``, so the train images do
    not change when only ``test_per_class`` changes (and vice versa).
    """
    spec = _with_overrides(spec if spec is not None else SyntheticSpec(), overrides)
    template_seq, train_seq, test_seq = np.random.SeedSequence(spec.seed).spawn(3)
    max_shift = max(1, int(spec.image_size * _SHIFT_FRACTION))
    templates = _class_templates(
        np.random.default_rng(template_seq), spec.num_classes, spec.image_size, max_shift
    )
    train_x, train_y = _compose_split(
        np.random.default_rng(train_seq), templates, spec.train_per_class, spec
    )
    test_x, test_y = _compose_split(
        np.random.default_rng(test_seq), templates, spec.test_per_class, spec
    )
    _LOG.debug("generated synthetic dataset %s: %d train, %d test", spec, len(train_y), len(test_y))
    return {"train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_y}


def _with_overrides(spec: SyntheticSpec, overrides: dict[str, object]) -> SyntheticSpec:
    if not isinstance(spec, SyntheticSpec):
        raise TypeError(f"spec must be a SyntheticSpec or None, got {type(spec).__name__}")
    valid = [field.name for field in dataclasses.fields(SyntheticSpec)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise TypeError(f"unknown SyntheticSpec field(s) {unknown}; valid fields are {valid}")
    return dataclasses.replace(spec, **overrides) if overrides else spec


def _class_templates(
    rng: np.random.Generator, num_classes: int, image_size: int, max_shift: int
) -> np.ndarray:
    """Render channels-last templates ``[C, S, S, 3]`` on a grid padded by ``max_shift``.

    The padding lets a shifted sample be a plain window of the template (no wrap-around seams).
    """
    side = image_size + 2 * max_shift
    coords = (np.arange(side, dtype=np.float64) - max_shift + 0.5) / image_size
    grid_y, grid_x = coords[:, None], coords[None, :]
    shape = (num_classes, _GRATINGS_PER_CLASS)

    freq = rng.uniform(*_GRATING_FREQ_RANGE, size=shape)
    angle = rng.uniform(0.0, np.pi, size=shape)
    phase = rng.uniform(0.0, 2 * np.pi, size=shape)
    amplitude = rng.uniform(*_GRATING_AMPLITUDE_RANGE, size=shape)
    grating_colour = _unit_colours(rng, shape) * amplitude[..., None]  # [C, K, 3]
    fx = (2 * np.pi * freq * np.cos(angle))[..., None, None]
    fy = (2 * np.pi * freq * np.sin(angle))[..., None, None]
    waves = np.cos(fx * grid_x + fy * grid_y + phase[..., None, None])  # [C, K, S, S]
    templates = np.einsum("ckyx,ckr->cyxr", waves, grating_colour)

    centre = rng.uniform(*_BLOB_CENTRE_RANGE, size=(num_classes, 2))
    width = rng.uniform(*_BLOB_WIDTH_RANGE, size=num_classes)
    blob_colour = _unit_colours(rng, (num_classes,)) * rng.uniform(
        *_BLOB_AMPLITUDE_RANGE, size=(num_classes, 1)
    )
    sq_dist = (grid_y - centre[:, 0, None, None]) ** 2 + (grid_x - centre[:, 1, None, None]) ** 2
    blob = np.exp(-sq_dist / (2 * width[:, None, None] ** 2))  # [C, S, S]
    templates += blob[..., None] * blob_colour[:, None, None, :]

    templates += rng.normal(0.0, _BACKGROUND_STD, size=(num_classes, 1, 1, 3))
    return templates.astype(np.float32)


def _unit_colours(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    colours = rng.normal(size=(*shape, 3))
    return colours / np.linalg.norm(colours, axis=-1, keepdims=True).clip(min=1e-6)


def _scaled_windows(templates: np.ndarray, scales: np.ndarray, image_size: int) -> np.ndarray:
    """Read-only view ``[C, L, dy, dx, H, W*3]``: every shifted window of every scaled template.

    Pre-scaling the small templates by ``L`` levels replaces a full-size multiply per sample, and
    rows of ``W*3`` contiguous floats keep the per-sample gather cheap.
    """
    scales = scales.astype(templates.dtype)
    bank = np.ascontiguousarray(templates[:, None] * scales[None, :, None, None, None])
    num_classes, num_levels, side, _, channels = bank.shape
    num_shifts = side - image_size + 1
    s_class, s_level, s_row, s_col, s_chan = bank.strides
    return as_strided(
        bank,
        shape=(num_classes, num_levels, num_shifts, num_shifts, image_size, image_size * channels),
        strides=(s_class, s_level, s_row, s_col, s_row, s_chan),
        writeable=False,
    )


def _compose_split(
    rng: np.random.Generator, templates: np.ndarray, per_class: int, spec: SyntheticSpec
) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``per_class`` samples of every class, ordered by class."""
    num_classes, side = templates.shape[:2]
    size = spec.image_size
    num_shifts = side - size + 1
    n = num_classes * per_class
    labels = np.repeat(np.arange(num_classes, dtype=np.int64), per_class)

    # Every per-sample random choice is drawn up front, so chunking cannot change the result.
    shift = rng.integers(0, num_shifts, size=(n, 2))
    contrast_level = rng.integers(0, _LEVELS, size=n)
    distractor = rng.integers(0, num_classes, size=n)
    distractor_shift = rng.integers(0, num_shifts, size=(n, 2))
    distractor_level = rng.integers(0, _LEVELS, size=n)
    # Noise pool entries carry their own brightness and colour offset, drawn once per entry.
    pool_size = min(n, _NOISE_POOL_SIZE)
    noise_pool = rng.standard_normal((pool_size, size, size * 3), dtype=np.float32)
    noise_pool *= np.float32(spec.noise)
    offset = (
        128.0
        + rng.normal(0.0, _BRIGHTNESS_STD, size=(pool_size, 1))
        + rng.normal(0.0, _CHANNEL_JITTER_STD, size=(pool_size, 3))
    )
    noise_pool += np.tile(offset.astype(np.float32), (1, size))[:, None, :]
    noise_index = rng.integers(0, pool_size, size=n)

    contrast = _scaled_windows(templates, np.linspace(*_CONTRAST_RANGE, _LEVELS), size)
    mixed = _scaled_windows(templates, np.linspace(*_DISTRACTOR_WEIGHT_RANGE, _LEVELS), size)
    images = np.empty((n, size, size * 3), dtype=np.uint8)
    for start in range(0, n, _CHUNK):
        part = slice(start, min(start + _CHUNK, n))
        x = contrast[labels[part], contrast_level[part], shift[part, 0], shift[part, 1]]
        x += mixed[
            distractor[part],
            distractor_level[part],
            distractor_shift[part, 0],
            distractor_shift[part, 1],
        ]
        x += noise_pool[noise_index[part]]
        np.clip(x, 0.0, 255.0, out=images[part], casting="unsafe")  # clip + cast in one pass
    return images.reshape(n, size, size, 3), labels

"""Formula-driven image classes: iterated function systems in the manner of FractalDB.

Kataoka et al. (FractalDB, ACCV 2020) and Nakashima et al. (ViTs, AAAI 2022) pretrain image
models on images rendered from random iterated function systems (IFS), one class per system,
with no natural image and no human label. pilot-online pretrains its scale-model backbone this
way (``pilot_online/scale``) and keeps a second set of systems, never seen in pretraining, as
the ``fractal`` benchmark: a class-incremental stream of the paper's shape whose features the
backbone has to transfer to.

A class is an IFS of 2 to 4 contractive affine maps ``x -> A x + b`` (each map picked with
probability proportional to ``|det A|``, FractalDB's rule), kept only when its canonical
rendering fills a moderate share of the canvas (FractalDB's filling-rate filter). A sample is
the chaos game of its class's system with every coefficient jittered, drawn into the canvas at a
random scale, rotation, shift and mirror, with a random intensity: classes differ in shape, and
one class's samples differ enough that a raw-pixel classifier is far from perfect.

Everything is a pure function of integer seeds (``np.random.SeedSequence`` keys), so a class
index means the same system in every process, and a batch depends only on its key.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

#: Maps per system (inclusive range) and the chaos game's length.
MAPS_RANGE = (2, 4)
POINTS = 1200
BURN_IN = 16
#: A system is kept when its canonical rendering covers this share of the canvas.
FILL_RANGE = (0.12, 0.55)
#: Largest singular value a map may have: the system contracts, so the game converges.
MAX_CONTRACTION = 0.9
#: Per-sample jitter: coefficients (additive std), scale of the drawing (share of the canvas),
#: rotation (radians, either way), intensity.
COEFF_JITTER = 0.04
SCALE_RANGE = (0.65, 0.95)
MAX_ROTATION = np.pi / 6
INTENSITY_RANGE = (0.55, 1.0)

#: Class ranges: pretraining uses ``0 .. pretrain_classes - 1`` (``harness/scale/pretrain.py``); its
#: stopping rule reads the validation systems; the ``fractal`` benchmark streams its own.
VALIDATION_FIRST_CLASS = 100_000
BENCHMARK_FIRST_CLASS = 200_000

#: Key spaces of ``SeedSequence``: systems, then samples. Pretraining and benchmark classes are
#: both "class k of the system space": disjoint because they use disjoint ranges of k.
_SYSTEM_KEY = 0x1F5
_SAMPLE_KEY = 0x5A7


@dataclass(frozen=True)
class System:
    """One IFS: ``matrices`` [M, 2, 2], ``offsets`` [M, 2], ``probabilities`` [M]."""

    matrices: np.ndarray
    offsets: np.ndarray
    probabilities: np.ndarray


def _draw_system(rng: np.random.Generator) -> System:
    """A random contractive system (FractalDB draws coefficients from U(-1, 1))."""
    count = int(rng.integers(MAPS_RANGE[0], MAPS_RANGE[1] + 1))
    matrices = np.empty((count, 2, 2))
    for m in range(count):
        while True:
            candidate = rng.uniform(-1.0, 1.0, size=(2, 2))
            if np.linalg.svd(candidate, compute_uv=False)[0] <= MAX_CONTRACTION:
                matrices[m] = candidate
                break
    offsets = rng.uniform(-1.0, 1.0, size=(count, 2))
    weights = np.abs(np.linalg.det(matrices)) + 1e-3
    return System(matrices, offsets, weights / weights.sum())


def system(class_index: int, seed: int = 0, image_size: int = 32) -> System:
    """The IFS of class ``class_index``: the first drawn system whose canonical rendering fills
    :data:`FILL_RANGE` of the canvas (the same for a given index and seed, in every process)."""
    return _system(int(class_index), int(seed), int(image_size))


@functools.lru_cache(maxsize=4096)
def _system(class_index: int, seed: int, image_size: int) -> System:
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SYSTEM_KEY, class_index]))
    while True:
        candidate = _draw_system(rng)
        canonical = _render([candidate], np.random.default_rng(0), image_size, jitter=False)[0]
        fill = float((canonical > 0).mean())
        if FILL_RANGE[0] <= fill <= FILL_RANGE[1]:
            return candidate


def _pad(systems: list[System]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack systems of different map counts: absent maps get probability 0."""
    width = MAPS_RANGE[1]
    n = len(systems)
    matrices = np.zeros((n, width, 2, 2))
    offsets = np.zeros((n, width, 2))
    cumulative = np.ones((n, width))
    for i, s in enumerate(systems):
        count = len(s.probabilities)
        matrices[i, :count] = s.matrices
        offsets[i, :count] = s.offsets
        cumulative[i, :count] = np.cumsum(s.probabilities)
    cumulative[:, -1] = 1.0
    return matrices, offsets, cumulative


def _render(
    systems: list[System], rng: np.random.Generator, image_size: int, jitter: bool = True
) -> np.ndarray:
    """Grey images ``[N, S, S]`` in ``[0, 1]``: one chaos game per system, run together."""
    matrices, offsets, cumulative = _pad(systems)
    n = len(systems)
    if jitter:
        matrices = matrices + rng.normal(0.0, COEFF_JITTER, size=matrices.shape)
        offsets = offsets + rng.normal(0.0, COEFF_JITTER, size=offsets.shape)
    picks = rng.random((POINTS + BURN_IN, n))
    choice = (picks[..., None] > cumulative[None]).sum(-1).clip(max=MAPS_RANGE[1] - 1)
    rows = np.arange(n)
    # Every step's coefficients gathered at once: [steps, 6, N] (a, b, c, d, e, f per image).
    table = np.concatenate([matrices.reshape(n, -1, 4), offsets], axis=-1)  # [N, M, 6]
    coeff = table[rows[None], choice].transpose(0, 2, 1)
    x, y = np.zeros(n), np.zeros(n)
    trace = np.empty((POINTS, 2, n))
    for step, (a, b, c, d, e, f) in enumerate(coeff):
        x, y = a * x + b * y + e, c * x + d * y + f
        if step >= BURN_IN:
            trace[step - BURN_IN, 0], trace[step - BURN_IN, 1] = x, y
    trace = trace.transpose(2, 0, 1)  # [N, P, 2]
    # Into the canvas: centre, a random rotation and mirror, scale the extent to a share of it.
    trace = np.nan_to_num(trace, nan=0.0, posinf=0.0, neginf=0.0)
    low, high = np.percentile(trace, [1, 99], axis=1)  # [N, 2] each: robust extent
    centre = (low + high) / 2
    extent = np.maximum((high - low).max(-1), 1e-6)  # [N]
    trace = (trace - centre[:, None]) / extent[:, None, None]
    if jitter:
        angle = rng.uniform(-MAX_ROTATION, MAX_ROTATION, size=n)
        mirror = np.where(rng.random(n) < 0.5, -1.0, 1.0)
        scale = rng.uniform(*SCALE_RANGE, size=n)
        intensity = rng.uniform(*INTENSITY_RANGE, size=n)
    else:
        angle, mirror = np.zeros(n), np.ones(n)
        scale, intensity = np.full(n, np.mean(SCALE_RANGE)), np.ones(n)
    cos, sin = np.cos(angle), np.sin(angle)
    x = trace[..., 0] * mirror[:, None]
    y = trace[..., 1]
    x, y = cos[:, None] * x - sin[:, None] * y, sin[:, None] * x + cos[:, None] * y
    room = (1 - scale) / 2  # the drawing may shift within what its scale leaves free
    shift = rng.uniform(-1, 1, size=(n, 2)) * room[:, None] if jitter else np.zeros((n, 2))
    cols = ((x * scale[:, None] + 0.5 + shift[:, :1]) * image_size).astype(np.int64)
    lines = ((y * scale[:, None] + 0.5 + shift[:, 1:]) * image_size).astype(np.int64)
    inside = (cols >= 0) & (cols < image_size) & (lines >= 0) & (lines < image_size)
    flat = (rows[:, None] * image_size + lines) * image_size + cols
    counts = np.bincount(flat[inside], minlength=n * image_size * image_size).astype(np.float64)
    counts = counts.reshape(n, image_size, image_size)
    # Density on a log scale, saturating at the 95th percentile of lit pixels: filled shapes.
    lit = np.where(counts > 0, counts, np.nan)
    top = np.nan_to_num(np.nanpercentile(lit.reshape(n, -1), 95, axis=1), nan=1.0)
    level = np.log1p(counts) / np.log1p(np.maximum(top, 1.0))[:, None, None]
    return np.clip(level, 0.0, 1.0) * intensity[:, None, None]


def render(
    class_indices: np.ndarray, key: tuple[int, ...], seed: int = 0, image_size: int = 32
) -> np.ndarray:
    """uint8 images ``[N, S, S, 3]`` (grey, as Fashion-MNIST's are) of the given classes; the
    samples' randomness depends only on ``key`` and ``seed``."""
    if len(class_indices) == 0:
        return np.zeros((0, image_size, image_size, 3), np.uint8)
    systems = [system(int(c), seed, image_size) for c in class_indices]
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SAMPLE_KEY, *key]))
    grey = _render(systems, rng, image_size)
    pixels = np.rint(grey * 255).astype(np.uint8)
    return np.repeat(pixels[..., None], 3, axis=-1)


@dataclass(frozen=True)
class FractalSplit:
    """A labelled set of samples of classes ``first_class .. first_class + num_classes - 1``."""

    first_class: int
    num_classes: int
    train_per_class: int
    test_per_class: int
    image_size: int = 32
    seed: int = 0


def make_split(spec: FractalSplit) -> dict[str, np.ndarray]:
    """``{"train_x", "train_y", "test_x", "test_y"}`` with labels ``0 .. num_classes - 1``,
    ordered by class; train and test samples come from distinct keys."""
    arrays: dict[str, np.ndarray] = {}
    for part, per_class, tag in (
        ("train", spec.train_per_class, 1),
        ("test", spec.test_per_class, 2),
    ):
        images, labels = [], []
        for label in range(spec.num_classes):
            cls = spec.first_class + label
            images.append(render(np.full(per_class, cls), (tag, cls), spec.seed, spec.image_size))
            labels.append(np.full(per_class, label, dtype=np.int64))
        arrays[f"{part}_x"] = np.concatenate(images)
        arrays[f"{part}_y"] = np.concatenate(labels)
    return arrays

"""Replay memories: dataset indices and labels, never image tensors.

Keeping indices instead of tensors means a replayed image goes through the training transforms
again at every draw, exactly like a stream image, and the memory costs two integers per slot.
Three memories, by the config's ``er_memory`` (:data:`MEMORIES`):

- ``reservoir`` (:class:`ReservoirMemory`, the paper's ER): Vitter's algorithm R over the whole
  stream. The first ``capacity`` stream samples fill the slots; stream sample ``i`` (0-based,
  ``i >= capacity``) draws ``j`` uniformly in ``[0, i]`` and replaces slot ``j`` iff
  ``j < capacity``. Every stream sample so far is then in memory with probability
  ``capacity / (i + 1)``. Draws for a whole batch are made at once (one vectorised call).
- ``class_balanced`` and ``herding`` (:class:`ClassBalancedMemory`): upstream PILOT's exemplar
  memory (``models/base.py``), online. Each class seen so far gets the same quota, upstream's
  ``samples_per_class``: ``capacity // classes seen`` (its ``fixed_memory: false``), or at most
  ``per_class`` (``fixed_memory: true`` with ``memory_per_class``). ``class_balanced`` keeps in
  each class's share a uniform sample of that class's stream samples (a reservoir per class, as
  Chrysakis and Moens' class-balancing reservoir); ``herding`` keeps the herding selection
  (:func:`herding_order`) over what it can still see: the class's stored exemplars and its
  samples in the current batch, against the running mean of every L2-normalised feature the
  class has streamed so far.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

#: ``er_memory`` values (``docs/configuration.md``): see the module docstring.
MEMORIES = ("reservoir", "class_balanced", "herding")
#: Upstream's guard against a zero norm when it L2-normalises features (``models/base.py``).
EPSILON = 1e-8


class IntegerSource(Protocol):
    """What the memory needs from a random generator (``numpy.random.Generator`` has both)."""

    def integers(self, low: Any, high: Any) -> np.ndarray: ...

    def choice(self, a: int, size: int, replace: bool) -> np.ndarray: ...


class ReservoirMemory:
    """A fixed-capacity reservoir of (dataset index, label) pairs, seeded and deterministic."""

    def __init__(self, capacity: int, seed: int = 0, rng: IntegerSource | None = None) -> None:
        if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool):
            raise TypeError(f"capacity must be an integer, got {capacity!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.rng = np.random.default_rng(seed) if rng is None else rng
        self.indices = np.full(self.capacity, -1, dtype=np.int64)
        self.labels = np.full(self.capacity, -1, dtype=np.int64)
        self.num_seen = 0  # stream samples offered so far
        self.size = 0

    def add(self, indices: np.ndarray, labels: np.ndarray) -> None:
        """Offer a batch of stream samples to the reservoir, in stream order."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if indices.shape != labels.shape:
            raise ValueError(
                f"indices and labels must have the same length, got {len(indices)} "
                f"and {len(labels)}"
            )
        positions = self.num_seen + np.arange(len(indices))  # each sample's 0-based stream index
        self.num_seen += len(indices)
        fill = positions < self.capacity
        slots = positions[fill]
        later = positions[~fill]
        if len(later):
            drawn = np.asarray(self.rng.integers(0, later + 1), dtype=np.int64)  # j in [0, i]
            kept = drawn < self.capacity
            slots = np.concatenate([slots, drawn[kept]])
            chosen = np.concatenate([np.flatnonzero(fill), np.flatnonzero(~fill)[kept]])
        else:
            chosen = np.flatnonzero(fill)
        # A slot drawn twice in one batch ends with the later sample, as one-at-a-time would.
        reversed_slots = slots[::-1]
        unique_slots, first_in_reverse = np.unique(reversed_slots, return_index=True)
        last = chosen[::-1][first_in_reverse]
        self.indices[unique_slots] = indices[last]
        self.labels[unique_slots] = labels[last]
        self.size = min(self.num_seen, self.capacity)

    def sample(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``min(batch_size, size)`` distinct stored samples, drawn uniformly: (indices, labels)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        count = min(int(batch_size), self.size)
        if count == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        slots = np.asarray(self.rng.choice(self.size, size=count, replace=False), dtype=np.int64)
        return self.indices[slots].copy(), self.labels[slots].copy()

    def class_histogram(self, num_classes: int) -> np.ndarray:
        """Stored samples per class, ``[num_classes]``."""
        return np.bincount(self.labels[: self.size], minlength=num_classes)[:num_classes]

    def state_dict(self) -> dict[str, Any]:
        state = {
            "capacity": self.capacity,
            "num_seen": self.num_seen,
            "indices": self.indices[: self.size].copy(),
            "labels": self.labels[: self.size].copy(),
        }
        if isinstance(self.rng, np.random.Generator):
            state["rng"] = self.rng.bit_generator.state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(
                f"state has capacity {state['capacity']}, this memory {self.capacity}: "
                "build the memory with the saved er_memory_size"
            )
        stored = np.asarray(state["indices"], dtype=np.int64)
        labels = np.asarray(state["labels"], dtype=np.int64)
        if len(stored) != len(labels) or len(stored) != min(int(state["num_seen"]), self.capacity):
            raise ValueError("inconsistent memory state: sizes of indices, labels and num_seen")
        self.indices[:] = -1
        self.labels[:] = -1
        self.indices[: len(stored)] = stored
        self.labels[: len(labels)] = labels
        self.num_seen = int(state["num_seen"])
        self.size = len(stored)
        if "rng" in state and isinstance(self.rng, np.random.Generator):
            self.rng.bit_generator.state = state["rng"]


def herding_order(vectors: np.ndarray, target: np.ndarray, count: int) -> np.ndarray:
    """Upstream's herding (``BaseLearner._construct_exemplar``): pick ``count`` rows of
    ``vectors`` one at a time, each the row that brings the picked rows' mean closest (Euclidean)
    to ``target``; ties go to the earlier row. Returns the picks in order, so every prefix is the
    herding selection of its size (upstream's ``_reduce_exemplar`` keeps ``[:m]``)."""
    vectors = np.asarray(vectors, dtype=np.float64)
    target = np.asarray(target, dtype=np.float64)
    count = min(int(count), len(vectors))
    picked = np.zeros(len(vectors), dtype=bool)
    order = np.empty(count, dtype=np.int64)
    total = np.zeros(vectors.shape[1], dtype=np.float64)
    for k in range(1, count + 1):
        distances = np.sqrt(np.sum((target - (vectors + total) / k) ** 2, axis=1))
        distances[picked] = np.inf
        chosen = int(np.argmin(distances))
        order[k - 1] = chosen
        picked[chosen] = True
        total += vectors[chosen]
    return order


def normalized(features: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm as upstream does it: ``v / (||v|| + 1e-8)``."""
    features = np.asarray(features, dtype=np.float64)
    return features / (np.linalg.norm(features, axis=1, keepdims=True) + EPSILON)


class ClassBalancedMemory:
    """Upstream's exemplar memory online: a quota per class seen, each class's share chosen as
    its samples stream past (module docstring). ``selection``: ``"random"`` (a uniform sample of
    the class's stream samples) or ``"herding"`` (:func:`herding_order`, which needs each stream
    sample's features: :attr:`needs_features`). Draws for replay are uniform over everything
    stored, as upstream appends the exemplars to each task's training set."""

    def __init__(
        self,
        capacity: int,
        num_classes: int,
        per_class: int | None = None,
        selection: str = "random",
        seed: int = 0,
        rng: IntegerSource | None = None,
    ) -> None:
        if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool):
            raise TypeError(f"capacity must be an integer, got {capacity!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if per_class is not None and per_class < 1:
            raise ValueError(f"per_class must be >= 1 or None, got {per_class}")
        if selection not in ("random", "herding"):
            raise ValueError(f'selection must be "random" or "herding", got {selection!r}')
        self.capacity = int(capacity)
        self.num_classes = int(num_classes)
        self.per_class = None if per_class is None else int(per_class)
        self.selection = selection
        self.rng = np.random.default_rng(seed) if rng is None else rng
        self.num_seen = 0  # stream samples offered so far
        self.class_counts = np.zeros(self.num_classes, dtype=np.int64)  # offered, per class
        self.stored: dict[int, np.ndarray] = {}  # class -> dataset indices, in selection order
        self.features: dict[int, np.ndarray] = {}  # herding: class -> normalised features
        self.means: dict[int, np.ndarray] = {}  # herding: class -> running mean of those

    @property
    def needs_features(self) -> bool:
        """Whether :meth:`add` needs the stream samples' features (herding)."""
        return self.selection == "herding"

    @property
    def quota(self) -> int:
        """Samples kept per class: upstream's ``samples_per_class``."""
        classes = int((self.class_counts > 0).sum())
        share = self.capacity // max(classes, 1)
        return share if self.per_class is None else min(self.per_class, share)

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.stored.values())

    def add(
        self, indices: np.ndarray, labels: np.ndarray, features: np.ndarray | None = None
    ) -> None:
        """Offer a batch of stream samples, in stream order (``features``: ``[B, D]``, herding)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if indices.shape != labels.shape:
            raise ValueError(
                f"indices and labels must have the same length, got {len(indices)} "
                f"and {len(labels)}"
            )
        if self.needs_features and (features is None or len(features) != len(indices)):
            raise ValueError("herding needs the features of every offered sample")
        self.num_seen += len(indices)
        before = self.class_counts.copy()
        np.add.at(self.class_counts, labels, 1)
        quota = self.quota
        for c in list(self.stored):  # a new class lowers every class's share
            self._trim(c, quota)
        classes = list(dict.fromkeys(labels.tolist()))  # each class once, in stream order
        for c in classes:
            rows = np.flatnonzero(labels == c)
            if self.selection == "herding":
                self._herd(c, indices[rows], normalized(features[rows]), int(before[c]), quota)
            else:
                self._reservoir(c, indices[rows], int(before[c]), quota)

    def _trim(self, c: int, quota: int) -> None:
        """Keep ``quota`` of class ``c``: herding's prefix, or a uniform random subset."""
        kept = self.stored[c]
        if len(kept) <= quota:
            return
        if self.selection == "herding":
            self.stored[c], self.features[c] = kept[:quota], self.features[c][:quota]
        else:
            chosen = np.sort(np.asarray(self.rng.choice(len(kept), quota, replace=False)))
            self.stored[c] = kept[chosen]

    def _reservoir(self, c: int, indices: np.ndarray, offered: int, quota: int) -> None:
        """Algorithm R within class ``c``: its ``n``-th sample (0-based) fills a free slot, else
        replaces slot ``j ~ U[0, n]`` iff ``j < quota``."""
        kept = list(self.stored.get(c, np.zeros(0, dtype=np.int64)))
        for offset, index in enumerate(indices):
            if len(kept) < quota:
                kept.append(int(index))
                continue
            j = int(np.asarray(self.rng.integers(0, offered + offset + 1)).reshape(-1)[0])
            if j < quota:
                kept[j] = int(index)
        self.stored[c] = np.asarray(kept, dtype=np.int64)

    def _herd(
        self, c: int, indices: np.ndarray, vectors: np.ndarray, offered: int, quota: int
    ) -> None:
        """The class's running mean takes the new samples; then herding re-picks the class's
        share from its stored exemplars and these samples."""
        mean = self.means.get(c, np.zeros(vectors.shape[1]))
        self.means[c] = mean + (vectors.sum(0) - len(vectors) * mean) / (offered + len(vectors))
        candidates = np.concatenate([self.stored.get(c, np.zeros(0, dtype=np.int64)), indices])
        candidate_vectors = np.concatenate(
            [self.features.get(c, np.zeros((0, vectors.shape[1]))), vectors]
        )
        order = herding_order(candidate_vectors, self.means[c], quota)
        self.stored[c], self.features[c] = candidates[order], candidate_vectors[order]

    def map_features(self, mapping: Callable[[np.ndarray], np.ndarray]) -> None:
        """The network's features widened at a firing (DER adds a branch): ``mapping`` takes
        rows of the old feature space to the new one, each row alike (the adapter's
        feature map). A stored vector becomes its mapped row renormalised: exact for a
        linear mapping, as normalising ignores the scale. A class mean (of normalised vectors)
        is mapped and rescaled to its old norm: exact where the class's vectors all keep the
        same share of their norm under ``mapping``, as at DER's first firing, which repeats the
        only branch; the mean of differently rescaled vectors is not kept otherwise."""
        if not self.needs_features:
            return
        for c, vectors in self.features.items():
            self.features[c] = normalized(mapping(vectors))
        for c, mean in self.means.items():
            mapped = np.asarray(mapping(mean[None]), dtype=np.float64)[0]
            norm = np.linalg.norm(mapped)
            self.means[c] = mapped * (np.linalg.norm(mean) / norm) if norm > 0 else mapped

    def sample(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``min(batch_size, size)`` distinct stored samples, drawn uniformly: (indices, labels)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        indices, labels = self._flat()
        count = min(int(batch_size), len(indices))
        if count == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        slots = np.asarray(self.rng.choice(len(indices), size=count, replace=False))
        return indices[slots].copy(), labels[slots].copy()

    def _flat(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stored sample, classes in ascending order: (indices, labels)."""
        classes = sorted(self.stored)
        if not classes:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        indices = np.concatenate([self.stored[c] for c in classes])
        labels = np.concatenate([np.full(len(self.stored[c]), c) for c in classes])
        return indices.astype(np.int64), labels.astype(np.int64)

    def class_histogram(self, num_classes: int) -> np.ndarray:
        """Stored samples per class, ``[num_classes]``."""
        histogram = np.zeros(num_classes, dtype=np.int64)
        for c, kept in self.stored.items():
            if c < num_classes:
                histogram[c] = len(kept)
        return histogram

    def state_dict(self) -> dict[str, Any]:
        indices, labels = self._flat()
        state: dict[str, Any] = {
            "capacity": self.capacity,
            "per_class": self.per_class,
            "selection": self.selection,
            "num_seen": self.num_seen,
            "class_counts": self.class_counts.copy(),
            "indices": indices,
            "labels": labels,
        }
        if self.needs_features:
            classes = sorted(self.stored)
            width = next(iter(self.means.values())).shape[0] if self.means else 0
            state["features"] = (
                np.concatenate([self.features[c] for c in classes])
                if classes
                else np.zeros((0, width))
            )
            state["mean_classes"] = np.asarray(sorted(self.means), dtype=np.int64)
            state["means"] = (
                np.stack([self.means[c] for c in sorted(self.means)])
                if self.means
                else np.zeros((0, width))
            )
        if isinstance(self.rng, np.random.Generator):
            state["rng"] = self.rng.bit_generator.state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (int(state["capacity"]), state["per_class"], state["selection"])
        if saved != (self.capacity, self.per_class, self.selection):
            raise ValueError(
                f"state has capacity, per-class quota and selection {saved}, this memory "
                f"{(self.capacity, self.per_class, self.selection)}: build the memory with the "
                "saved er_memory_size, er_memory_per_class and er_memory"
            )
        indices = np.asarray(state["indices"], dtype=np.int64)
        labels = np.asarray(state["labels"], dtype=np.int64)
        if len(indices) != len(labels):
            raise ValueError("inconsistent memory state: sizes of indices and labels")
        self.num_seen = int(state["num_seen"])
        self.class_counts = np.asarray(state["class_counts"], dtype=np.int64).copy()
        self.stored = {int(c): indices[labels == c] for c in np.unique(labels)}
        self.features, self.means = {}, {}
        if self.needs_features:
            features = np.asarray(state["features"], dtype=np.float64)
            self.features = {c: features[labels == c] for c in self.stored}
            for c, mean in zip(np.asarray(state["mean_classes"]).tolist(), state["means"]):
                self.means[int(c)] = np.asarray(mean, dtype=np.float64)
        if "rng" in state and isinstance(self.rng, np.random.Generator):
            self.rng.bit_generator.state = state["rng"]


def make_memory(
    kind: str, capacity: int, num_classes: int, per_class: int | None = None, seed: int = 0
) -> ReservoirMemory | ClassBalancedMemory:
    """The replay memory the config's ``er_memory`` names (:data:`MEMORIES`)."""
    if kind == "reservoir":
        if per_class is not None:
            raise ValueError(
                "er_memory_per_class is a quota of the class-balanced memories: set er_memory "
                'to "class_balanced" or "herding", or remove it'
            )
        return ReservoirMemory(capacity, seed=seed)
    if kind not in MEMORIES:
        raise ValueError(f"er_memory must be one of {', '.join(MEMORIES)}, got {kind!r}")
    selection = "herding" if kind == "herding" else "random"
    return ClassBalancedMemory(capacity, num_classes, per_class, selection, seed=seed)

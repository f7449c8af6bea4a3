"""Reservoir memory for experience replay: dataset indices and labels, never image tensors.

Keeping indices instead of tensors means a replayed image goes through the training transforms
again at every draw, exactly like a stream image, and the memory costs two integers per slot.

Reservoir sampling (Vitter's algorithm R): the first ``capacity`` stream samples fill the slots;
stream sample ``i`` (0-based, ``i >= capacity``) draws ``j`` uniformly in ``[0, i]`` and replaces
slot ``j`` iff ``j < capacity``. Every stream sample so far is then in memory with probability
``capacity / (i + 1)``. Draws for a whole batch are made at once (one vectorised call).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


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

"""The reservoir memory of experience replay (core/memory.py), against the algorithm's definition:
stream sample i (0-based) fills slot i while i < capacity; later, it draws j uniformly in [0, i]
and replaces slot j iff j < capacity. A scripted generator supplies the draws, so the expected
contents below are worked out by hand from the definition, not from the code.
"""

from __future__ import annotations

import numpy as np
import pytest

from pilot_online.core.memory import ReservoirMemory


class ScriptedDraws:
    """A generator whose ``integers`` returns the next scripted values and records the bounds."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)
        self.highs: list[int] = []

    def integers(self, low, high):
        high = np.atleast_1d(high)
        assert low == 0
        self.highs += high.tolist()
        drawn, self.values = self.values[: len(high)], self.values[len(high) :]
        return np.array(drawn)

    def choice(self, a, size, replace):
        return np.arange(size)


def test_item_i_replaces_slot_j_iff_j_is_below_capacity():
    draws = ScriptedDraws([1, 4, 0, 2])
    memory = ReservoirMemory(3, rng=draws)
    memory.add(np.arange(10, 17), np.arange(7))
    # Items 0-2 fill slots 0-2. Item 3 draws j in [0, 3] (high 4): 1 -> slot 1 := item 3.
    # Item 4 (high 5) draws 4 >= 3: dropped. Item 5 (high 6): 0 -> slot 0 := item 5.
    # Item 6 (high 7): 2 -> slot 2 := item 6.
    assert draws.highs == [4, 5, 6, 7]
    assert memory.indices.tolist() == [15, 13, 16]
    assert memory.labels.tolist() == [5, 3, 6]
    assert memory.size == 3 and memory.num_seen == 7


def test_a_slot_drawn_twice_in_one_batch_keeps_the_later_sample():
    memory = ReservoirMemory(2, rng=ScriptedDraws([1, 1]))
    memory.add(np.array([100, 101, 102, 103]), np.array([0, 1, 2, 3]))
    assert memory.indices.tolist() == [100, 103]  # items 2 and 3 both drew slot 1


@pytest.mark.parametrize("splits", [[7], [1] * 7, [2, 5], [3, 1, 3]])
def test_batching_of_the_stream_does_not_change_the_contents(splits):
    memory = ReservoirMemory(3, rng=ScriptedDraws([1, 4, 0, 2]))
    start = 0
    for size in splits:
        memory.add(np.arange(10 + start, 10 + start + size), np.arange(start, start + size))
        start += size
    assert memory.indices.tolist() == [15, 13, 16]


def test_size_never_exceeds_capacity_and_counts_every_offered_sample():
    memory = ReservoirMemory(5, seed=3)
    sizes = []
    for start in range(0, 40, 4):
        memory.add(np.arange(start, start + 4), np.arange(start, start + 4) % 3)
        sizes.append(memory.size)
    assert sizes == [4, 5, 5, 5, 5, 5, 5, 5, 5, 5]
    assert memory.num_seen == 40
    assert len(set(memory.indices.tolist())) == 5  # distinct stream samples


def test_every_stream_sample_is_kept_with_probability_capacity_over_n():
    # 10 samples, capacity 2: each is in memory at the end with probability 2 / 10.
    kept = np.zeros(10)
    runs = 2000
    for seed in range(runs):
        memory = ReservoirMemory(2, seed=seed)
        memory.add(np.arange(10), np.zeros(10, dtype=int))
        kept[memory.indices] += 1
    np.testing.assert_allclose(kept / runs, 0.2, atol=0.04)  # binomial std 0.009


def test_same_seed_same_memory_and_draws():
    def run(seed):
        memory = ReservoirMemory(4, seed=seed)
        memory.add(np.arange(20), np.arange(20) % 5)
        return memory.indices.tolist(), memory.sample(3)[0].tolist()

    assert run(7) == run(7)


def test_sample_returns_distinct_stored_samples_with_their_labels():
    memory = ReservoirMemory(6, seed=0)
    assert [len(a) for a in memory.sample(4)] == [0, 0]  # empty memory: nothing to replay
    memory.add(np.array([40, 41, 42, 43]), np.array([4, 1, 4, 2]))
    indices, labels = memory.sample(10)  # more than stored: all four
    assert sorted(indices.tolist()) == [40, 41, 42, 43]
    label_of = {40: 4, 41: 1, 42: 4, 43: 2}
    assert labels.tolist() == [label_of[i] for i in indices.tolist()]
    assert len(set(memory.sample(3)[0].tolist())) == 3


def test_class_histogram_counts_stored_labels():
    memory = ReservoirMemory(10, seed=0)
    memory.add(np.arange(6), np.array([2, 0, 2, 2, 3, 0]))
    assert memory.class_histogram(5).tolist() == [2, 0, 3, 1, 0]


def test_state_dict_round_trip_continues_identically():
    reference = ReservoirMemory(4, seed=1)
    reference.add(np.arange(10), np.arange(10) % 3)
    restored = ReservoirMemory(4, seed=99)
    restored.load_state_dict(reference.state_dict())
    for memory in (reference, restored):
        memory.add(np.arange(10, 30), np.arange(10, 30) % 3)
    assert restored.indices.tolist() == reference.indices.tolist()
    assert restored.num_seen == reference.num_seen == 30
    with pytest.raises(ValueError, match="capacity"):
        ReservoirMemory(5).load_state_dict(reference.state_dict())


def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        ReservoirMemory(0)
    with pytest.raises(TypeError, match="capacity must be an integer"):
        ReservoirMemory(2.5)
    with pytest.raises(ValueError, match="same length"):
        ReservoirMemory(2).add(np.arange(3), np.arange(2))

"""The reservoir memory of experience replay (core/memory.py), against the algorithm's definition:
stream sample i (0-based) fills slot i while i < capacity; later, it draws j uniformly in [0, i]
and replaces slot j iff j < capacity. A scripted generator supplies the draws, so the expected
contents below are worked out by hand from the definition, not from the code.
"""

from __future__ import annotations

import numpy as np
import pytest

from pilot_online.core.memory import (
    ClassBalancedMemory,
    ReservoirMemory,
    herding_order,
    make_memory,
    normalized,
)


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


# -- the class-balanced memories (upstream's exemplar quota, online) ---------------------------


def test_the_quota_is_upstreams_samples_per_class():
    """fixed_memory false: memory_size // classes seen; fixed: memory_per_class, never more than
    the memory's size allows (10 // 3 = 3 < 4)."""
    memory = ClassBalancedMemory(10, num_classes=5, seed=0)
    memory.add(np.arange(4), np.array([0, 0, 1, 1]))
    assert memory.quota == 5
    memory.add(np.arange(4, 6), np.array([2, 2]))
    assert memory.quota == 3
    fixed = ClassBalancedMemory(10, num_classes=5, per_class=4, seed=0)
    fixed.add(np.arange(4), np.array([0, 0, 1, 1]))
    assert fixed.quota == 4
    fixed.add(np.arange(4, 6), np.array([2, 2]))
    assert fixed.quota == 3


def test_a_class_share_is_a_reservoir_of_that_class():
    """Class 0's stream samples 100..105 with quota 2 (capacity 4, two classes): 100 and 101
    fill the share; sample n = 2 draws j in [0, 2] (high 3): 1 -> slot 1 := 102; n = 3: 3 >= 2,
    dropped; n = 4: 0 -> slot 0 := 104; n = 5: 5, dropped. Class 1 never exceeds its quota."""
    draws = ScriptedDraws([1, 3, 0, 5])
    memory = ClassBalancedMemory(4, num_classes=3, rng=draws)
    memory.add(np.array([100, 200, 101, 102, 103]), np.array([0, 1, 0, 0, 0]))
    memory.add(np.array([104, 105, 201]), np.array([0, 0, 1]))
    assert draws.highs == [3, 4, 5, 6]
    assert memory.stored[0].tolist() == [104, 102]
    assert memory.stored[1].tolist() == [200, 201]
    assert memory.class_histogram(3).tolist() == [2, 2, 0]
    assert memory.size == 4 and memory.num_seen == 8


def test_a_new_class_trims_every_share_to_the_new_quota():
    memory = ClassBalancedMemory(6, num_classes=4, seed=0)
    memory.add(np.arange(8), np.array([0, 0, 0, 0, 1, 1, 1, 1]))
    assert memory.class_histogram(4).tolist() == [3, 3, 0, 0]
    memory.add(np.array([8]), np.array([2]))  # a third class: 6 // 3 = 2 each
    assert memory.class_histogram(4).tolist() == [2, 2, 1, 0]
    assert set(memory.stored[0].tolist()) <= {0, 1, 2, 3}


def test_herding_order_by_hand():
    """Target (1, 0): the first pick is the row nearest it, (1, 0.2); the second minimises
    |target - (pick1 + x) / 2|: (1, -0.2) gives the mean (1, 0) exactly."""
    vectors = np.array([[0.0, 1.0], [1.0, 0.2], [0.6, 0.0], [1.0, -0.2]])
    assert herding_order(vectors, np.array([1.0, 0.0]), 2).tolist() == [1, 3]
    assert herding_order(vectors, np.array([1.0, 0.0]), 9).tolist()[:2] == [1, 3]  # all four


def test_herding_keeps_the_herding_selection_and_trims_to_its_prefix():
    """Unit vectors at angles 0, 10, 80 and 90 degrees of one class, quota 2 (capacity 2, one
    class): the class mean points at 45 degrees, 0.76 long; 10 and 80 degrees are nearest it (0.58
    each, 0.71 for the others), and the tie goes to the earlier row, as upstream's argmin; then
    80 degrees (the pair's mean lies 0.06 from the class mean). A second class halves the quota
    to 1 and keeps the first pick."""
    angles = np.deg2rad([0.0, 10.0, 80.0, 90.0])
    features = np.stack([np.cos(angles), np.sin(angles)], 1) * 3.0  # normalised by the memory
    memory = ClassBalancedMemory(2, num_classes=2, selection="herding", seed=0)
    memory.add(np.array([10, 11, 12, 13]), np.zeros(4, dtype=int), features)
    mean = normalized(features).mean(0)
    assert herding_order(normalized(features), mean, 2).tolist() == [1, 2]
    assert memory.stored[0].tolist() == [11, 12]
    memory.add(np.array([20]), np.array([1]), np.array([[0.0, 1.0]]))
    assert memory.stored[0].tolist() == [11] and memory.stored[1].tolist() == [20]


def test_herding_chooses_among_the_stored_exemplars_and_the_new_samples():
    """Two batches of one class give the same selection as one batch of both when every sample
    stays a candidate (quota >= samples)."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(6, 3))
    one = ClassBalancedMemory(8, num_classes=1, selection="herding", seed=0)
    one.add(np.arange(6), np.zeros(6, dtype=int), features)
    two = ClassBalancedMemory(8, num_classes=1, selection="herding", seed=0)
    two.add(np.arange(3), np.zeros(3, dtype=int), features[:3])
    two.add(np.arange(3, 6), np.zeros(3, dtype=int), features[3:])
    assert one.stored[0].tolist() == two.stored[0].tolist()
    np.testing.assert_allclose(one.means[0], normalized(features).mean(0))


@pytest.mark.parametrize("selection", ["random", "herding"])
def test_class_balanced_state_round_trip_continues_identically(selection):
    rng = np.random.default_rng(1)
    labels, features = rng.integers(0, 3, 30), rng.normal(size=(30, 4))
    reference = ClassBalancedMemory(6, num_classes=3, selection=selection, seed=1)
    reference.add(np.arange(15), labels[:15], features[:15])
    restored = ClassBalancedMemory(6, num_classes=3, selection=selection, seed=99)
    restored.load_state_dict(reference.state_dict())
    for memory in (reference, restored):
        memory.add(np.arange(15, 30), labels[15:], features[15:])
    for c in range(3):
        assert restored.stored[c].tolist() == reference.stored[c].tolist()
    assert restored.sample(4)[0].tolist() == reference.sample(4)[0].tolist()
    with pytest.raises(ValueError, match="er_memory_per_class"):
        ClassBalancedMemory(6, 3, per_class=2, selection=selection).load_state_dict(
            reference.state_dict()
        )


def test_class_balanced_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="herding needs the features"):
        ClassBalancedMemory(4, 2, selection="herding").add(np.arange(2), np.zeros(2, dtype=int))
    with pytest.raises(ValueError, match='"random" or "herding"'):
        ClassBalancedMemory(4, 2, selection="best")
    with pytest.raises(ValueError, match="er_memory_per_class is a quota"):
        make_memory("reservoir", 4, 2, per_class=2)
    assert isinstance(make_memory("herding", 4, 2), ClassBalancedMemory)

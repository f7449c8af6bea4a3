"""Tests for pilot_online.core.streams: PILOT's clear split and the Si-Blurry stream.

Expected numbers are worked out by hand in the comments (SI_BLURRY.md steps 2 and 6; PILOT
DataManager's increments), never taken from the code's own output.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pilot_online.core.streams import (
    SI_BLURRY_STREAM_VERSION,
    STREAMS,
    Batch,
    Stream,
    _blur,
    build_stream,
    clear_stream,
    pilot_increments,
    si_blurry_stream,
)

# ----------------------------------------------------------------------------- helpers


def class_sorted_labels(num_classes: int, per_class: int) -> np.ndarray:
    """Labels laid out class by class, like ImageNet-R / CUB folders."""
    return np.repeat(np.arange(num_classes), per_class)


def shuffled_labels(num_classes: int, per_class: int, seed: int = 123) -> np.ndarray:
    """Labels in a random dataset order, like CIFAR."""
    return np.random.default_rng(seed).permutation(class_sorted_labels(num_classes, per_class))


def streamed(stream: Stream, task: int | None = None) -> np.ndarray:
    parts = [b.indices for b in stream.batches(task)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def task_class_sets(stream: Stream) -> list[set[int]]:
    return [set(np.unique(stream.labels[t]).tolist()) for t in stream.tasks]


def check_batches(stream: Stream, expected_indices: np.ndarray) -> None:
    """Whole-stream and per-task iteration: each expected index exactly once, sizes and flags."""
    whole = streamed(stream)
    assert whole.dtype == np.int64
    assert np.array_equal(np.sort(whole), np.sort(expected_indices))
    assert np.unique(whole).size == whole.size  # no index twice
    assert np.array_equal(whole, np.concatenate(stream.tasks))  # stream order is task order
    assert len(stream) == expected_indices.size
    batches = list(stream.batches())
    assert len(batches) == stream.num_batches()
    for t in range(stream.num_tasks):
        mine = [b for b in batches if b.task == t]
        assert np.array_equal(streamed(stream, t), stream.tasks[t])
        assert len(mine) == stream.num_batches(t) == -(-stream.tasks[t].size // stream.batch_size)
        for i, b in enumerate(mine):
            assert isinstance(b, Batch)
            # a batch never crosses tasks: all its indices belong to task t
            assert np.isin(b.indices, stream.tasks[t]).all()
            assert b.first_in_task == (i == 0)
            assert b.last_in_task == (i == len(mine) - 1)
            if i < len(mine) - 1:
                assert len(b) == stream.batch_size
            else:
                assert 1 <= len(b) <= stream.batch_size


# ----------------------------------------------------------------------------- pilot_increments


@pytest.mark.parametrize(
    ("num_classes", "init_cls", "increment", "expected"),
    [
        (100, 10, 10, [10] * 10),  # 10 + 9*10 = 100; at sum 90, 90+10 < 100 fails, rest 10
        (100, 50, 10, [50, 10, 10, 10, 10, 10]),  # 50 + 4*10 = 90, rest 10
        (10, 4, 4, [4, 4, 2]),  # 4+4 = 8 < 10 -> [4,4]; 8+4 = 12 !< 10; rest 2
        (5, 5, 3, [5]),  # init holds every class, rest 0
        (7, 2, 3, [2, 3, 2]),  # 2+3 = 5 < 7; 5+3 = 8 !< 7; rest 2
        (10, 3, 7, [3, 7]),  # 3+7 = 10 !< 10; rest 7
        (200, 100, 20, [100, 20, 20, 20, 20, 20]),  # sums 120..180; 180+20 !< 200; rest 20
    ],
)
def test_pilot_increments_hand_worked(num_classes, init_cls, increment, expected):
    assert pilot_increments(num_classes, init_cls, increment) == expected


def test_pilot_increments_rejects_bad_values():
    with pytest.raises(ValueError, match="init_cls"):
        pilot_increments(10, 11, 1)
    with pytest.raises(ValueError, match="increment"):
        pilot_increments(10, 2, 0)
    with pytest.raises(ValueError, match="init_cls"):
        pilot_increments(10, 0, 2)


# ----------------------------------------------------------------------------- clear


def test_clear_identity_order_matches_pilot_split():
    labels = shuffled_labels(10, 30)
    stream = clear_stream(labels, init_cls=4, increment=4, batch_size=32, seed=0)
    # increments [4, 4, 2] -> tasks own [0,4), [4,8), [8,10)
    assert task_class_sets(stream) == [{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}]
    assert [t.size for t in stream.tasks] == [120, 120, 60]  # 4*30, 4*30, 2*30
    # batches: ceil(120/32) = 4, 4, ceil(60/32) = 2 -> 10; last sizes 120-96 = 24, 24, 60-32 = 28
    assert stream.num_batches() == 10
    assert [len(b) for b in stream.batches() if b.last_in_task] == [24, 24, 28]
    check_batches(stream, np.arange(300))
    assert stream.num_tasks == 3 and stream.kind == "clear"


def test_clear_respects_class_order():
    labels = shuffled_labels(10, 20)
    order = [9, 3, 5, 0, 7, 1, 8, 2, 6, 4]
    stream = clear_stream(labels, order, init_cls=5, increment=3, seed=1)
    # increments [5, 3, 2]: order[0:5], order[5:8], order[8:10]
    assert task_class_sets(stream) == [{9, 3, 5, 0, 7}, {1, 8, 2}, {6, 4}]
    # exposure per class id: position j of the order -> its task
    expected = np.empty(10, dtype=np.int64)
    expected[[9, 3, 5, 0, 7]] = 0
    expected[[1, 8, 2]] = 1
    expected[[6, 4]] = 2
    assert np.array_equal(stream.exposure_task(), expected)
    assert stream.params["class_order"] == order


def test_clear_subset_class_order_leaves_other_classes_out():
    labels = shuffled_labels(6, 10)
    stream = clear_stream(labels, [4, 2, 0], init_cls=2, increment=2)
    # increments [2, 1]: {4, 2}, {0}; classes 1, 3, 5 never streamed
    assert task_class_sets(stream) == [{2, 4}, {0}]
    assert np.array_equal(stream.exposure_task(), [1, -1, 0, -1, 0, -1])
    check_batches(stream, np.flatnonzero(np.isin(labels, [0, 2, 4])))


def test_clear_shuffle_is_seeded():
    labels = class_sorted_labels(10, 50)
    a = clear_stream(labels, init_cls=5, increment=5, seed=3)
    b = clear_stream(labels, init_cls=5, increment=5, seed=3)
    c = clear_stream(labels, init_cls=5, increment=5, seed=4)
    for ta, tb, tc in zip(a.tasks, b.tasks, c.tasks):
        assert not np.array_equal(ta, np.sort(ta))  # shuffled, not dataset order
        assert np.array_equal(ta, tb)  # same seed, same stream
        assert not np.array_equal(ta, tc)  # different seed, different order ...
        assert np.array_equal(np.sort(ta), np.sort(tc))  # ... same task contents
    # task 0 of class-sorted labels holds classes 0..4, i.e. indices 0..249
    assert np.array_equal(np.sort(a.tasks[0]), np.arange(250))


def test_clear_summary_and_dict():
    labels = shuffled_labels(10, 30)
    stream = clear_stream(labels, init_cls=4, increment=4)
    summary = stream.summary()
    assert [s.num_samples for s in summary] == [120, 120, 60]
    assert [s.classes for s in summary] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [s.new_classes for s in summary] == [s.classes for s in summary]
    assert [s.disjoint_classes for s in summary] == [s.classes for s in summary]
    assert all(s.blurry_classes == [] for s in summary)
    assert np.array_equal(stream.trained_classes, np.arange(10))
    # class c first streamed in task c // 4 (capped at the last task)
    assert np.array_equal(stream.exposure_task(), [0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    as_dict = json.loads(json.dumps(stream.to_dict()))
    assert as_dict["kind"] == "clear"
    assert as_dict["params"]["init_cls"] == 4 and as_dict["params"]["increment"] == 4
    assert [t["num_samples"] for t in as_dict["tasks"]] == [120, 120, 60]
    assert "indices" not in json.dumps(as_dict)


# ----------------------------------------------------------------------------- Si-Blurry


def owner_of(stream: Stream, which: str) -> np.ndarray:
    """Class id -> owning task from the summary's disjoint or blurry lists (-1 if none)."""
    owner = np.full(int(stream.labels.max()) + 1, -1)
    for s in stream.summary():
        owner[getattr(s, which)] = s.task
    return owner


def check_si_blurry_structure(stream: Stream, disjoint: int, blurry: int, quota: int) -> None:
    """Structural invariants of SI_BLURRY.md against the hand-computed D, B, K."""
    labels, summary = stream.labels, stream.summary()
    num_labels = int(labels.max()) + 1
    disjoint_classes = np.concatenate([s.disjoint_classes for s in summary]).astype(int)
    blurry_classes = np.concatenate([s.blurry_classes for s in summary]).astype(int)
    assert disjoint_classes.size == disjoint and blurry_classes.size == blurry
    assert np.intersect1d(disjoint_classes, blurry_classes).size == 0  # pools are disjoint
    assert np.unique(disjoint_classes).size == disjoint and np.unique(blurry_classes).size == blurry
    pooled = np.union1d(disjoint_classes, blurry_classes)
    leftover = np.setdiff1d(np.unique(labels), pooled)

    # every class's samples sum correctly; leftover classes never appear
    whole = streamed(stream)
    check_batches(stream, np.flatnonzero(np.isin(labels, pooled)))
    counts = np.bincount(labels[whole], minlength=num_labels)
    full = np.bincount(labels, minlength=num_labels)
    assert np.array_equal(counts[pooled], full[pooled])
    assert (counts[leftover] == 0).all()
    assert np.array_equal(stream.trained_classes, pooled)

    task_of = np.full(labels.size, -1)
    for t, idx in enumerate(stream.tasks):
        task_of[idx] = t
    # each disjoint class's samples all land in exactly one task: its owner
    d_owner = owner_of(stream, "disjoint_classes")
    d_mask = np.isin(labels, disjoint_classes)
    assert np.array_equal(task_of[d_mask], d_owner[labels[d_mask]])

    # blurred samples: at most K went through the pool; every off-owner sample came from it
    b_owner = owner_of(stream, "blurry_classes")
    b_mask = np.isin(labels, blurry_classes)
    off_owner = np.flatnonzero(b_mask & (task_of != b_owner[labels]))
    moved = stream.blurred_indices
    assert moved.size <= quota
    assert np.isin(off_owner, moved).all()
    assert off_owner.size <= moved.size  # a pooled sample may land back in its owner task
    assert np.isin(labels[moved], blurry_classes).all()  # only blurry-class samples are blurred
    assert sum(s.blurred_out for s in summary) == sum(s.blurred_in for s in summary) == moved.size

    # quota pool refill (step 6): task t gives min(k_t, n_t), receives what is left of k_t
    quotas = np.asarray(stream.info["quotas"])
    assert quotas.size == stream.num_tasks and quotas.sum() == quota
    sizes = np.array([full[s.blurry_classes].sum() for s in summary])
    assert [s.blurred_out for s in summary] == np.minimum(quotas, sizes).tolist()
    given = np.minimum(np.concatenate(([0], np.cumsum(quotas))), moved.size)
    assert [s.blurred_in for s in summary] == np.diff(given).tolist()


@pytest.mark.parametrize("selection", ["dataset_order", "random"])
def test_si_blurry_small_structure(selection):
    labels = shuffled_labels(20, 30)
    stream = si_blurry_stream(labels, num_tasks=5, n=50, m=10, seed=7, blurred_selection=selection)
    # C = 20: D = floor(20*50/100) = 10 -> multiple of 5: 10; B = 20 - 10 = 10 -> 10; no leftover
    # blurry samples = 10 classes * 30 = 300; K = floor(300 * 10/100) = 30
    check_si_blurry_structure(stream, disjoint=10, blurry=10, quota=30)
    assert stream.info["disjoint_pool_size"] == 10 and stream.info["blurry_pool_size"] == 10
    assert stream.info["blur_quota"] == 30 and stream.info["leftover_classes"] == []
    assert len(stream) == 600  # 20 * 30, everything streamed


def test_si_blurry_leftover_classes_never_streamed():
    labels = shuffled_labels(23, 30)
    stream = si_blurry_stream(labels, num_tasks=5, n=50, m=10, seed=0, batch_size=16)
    # C = 23: D = floor(23*50/100) = 11 -> 10; B = 23 - 10 = 13 -> 10; leftover 23 - 20 = 3
    # K = floor(10 * 30 * 10/100) = 30; streamed samples = 20 * 30 = 600
    check_si_blurry_structure(stream, disjoint=10, blurry=10, quota=30)
    leftover = stream.info["leftover_classes"]
    assert len(leftover) == 3 and len(stream) == 600
    assert (stream.exposure_task()[leftover] == -1).all()
    assert not np.isin(streamed(stream), np.flatnonzero(np.isin(labels, leftover))).any()


@pytest.mark.parametrize(
    ("num_tasks", "disjoint", "blurry", "quota"),
    [
        # D = 50 -> 50; B = 50 -> 50; K = floor(50*500 * 10/100) = 2500
        (5, 50, 50, 2500),
        # D = 50 -> 48 (multiple of 3); B = 100 - 48 = 52 -> 51; leftover 1; K = 51*500/10 = 2550
        (3, 48, 51, 2550),
    ],
)
def test_si_blurry_cifar_like(num_tasks, disjoint, blurry, quota):
    labels = shuffled_labels(100, 500)
    stream = si_blurry_stream(labels, num_tasks=num_tasks, n=50, m=10, seed=1)
    check_si_blurry_structure(stream, disjoint=disjoint, blurry=blurry, quota=quota)
    assert len(stream) == (disjoint + blurry) * 500


def test_si_blurry_dataset_order_blurs_the_first_entries():
    # class-sorted labels: upstream's dataset-order choice takes each task's first blurry entries
    labels = class_sorted_labels(20, 30)
    stream = si_blurry_stream(labels, num_tasks=5, n=50, m=30, seed=2)
    # blurry samples = 10 * 30 = 300; K = floor(300 * 30/100) = 90
    check_si_blurry_structure(stream, disjoint=10, blurry=10, quota=90)
    moved = set(stream.blurred_indices.tolist())
    for s in stream.summary():
        own = np.flatnonzero(np.isin(labels, s.blurry_classes))  # dataset order
        assert set(own[: s.blurred_out].tolist()) == moved & set(own.tolist())


def test_si_blurry_random_selection_differs_with_same_pools():
    labels = class_sorted_labels(20, 30)
    first = si_blurry_stream(labels, num_tasks=5, m=30, seed=2)
    rand = si_blurry_stream(labels, num_tasks=5, m=30, seed=2, blurred_selection="random")
    check_si_blurry_structure(rand, disjoint=10, blurry=10, quota=90)
    # same generator draws before step 6: same pools, same K and quotas
    for a, b in zip(first.summary(), rand.summary()):
        assert a.disjoint_classes == b.disjoint_classes and a.blurry_classes == b.blurry_classes
    assert rand.info["blur_quota"] == first.info["blur_quota"] == 90
    assert rand.info["quotas"] == first.info["quotas"]
    assert not np.array_equal(rand.blurred_indices, first.blurred_indices)
    # random picks are not the dataset-order prefix of some task's blurry list
    moved = set(rand.blurred_indices.tolist())
    prefixes = [
        set(np.flatnonzero(np.isin(labels, s.blurry_classes))[: s.blurred_out].tolist())
        for s in rand.summary()
    ]
    assert moved != set().union(*prefixes)


def test_si_blurry_seeded():
    labels = shuffled_labels(20, 30)
    a = si_blurry_stream(labels, num_tasks=5, seed=11)
    b = si_blurry_stream(labels, num_tasks=5, seed=11)
    c = si_blurry_stream(labels, num_tasks=5, seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a.tasks, b.tasks))
    assert a.to_dict() == b.to_dict()
    assert any(x.size != y.size or not np.array_equal(x, y) for x, y in zip(a.tasks, c.tasks))
    # class_order only defines the class set: any order of the same set gives the same stream
    d = si_blurry_stream(labels, list(range(19, -1, -1)), num_tasks=5, seed=11)
    assert all(np.array_equal(x, y) for x, y in zip(a.tasks, d.tasks))


def test_si_blurry_pure_pools():
    labels = shuffled_labels(10, 20)
    # N = 100: D = 10 -> 10, B = 0; nothing blurred, every class in exactly one task
    disjoint_only = si_blurry_stream(labels, num_tasks=5, n=100, m=10, seed=0)
    check_si_blurry_structure(disjoint_only, disjoint=10, blurry=0, quota=0)
    assert disjoint_only.blurred_indices.size == 0
    # N = 0: D = 0, B = 10; K = floor(200 * 10/100) = 20
    blurry_only = si_blurry_stream(labels, num_tasks=5, n=0, m=10, seed=0)
    check_si_blurry_structure(blurry_only, disjoint=0, blurry=10, quota=20)
    # M = 0: K = 0, nothing moves, every blurry sample stays with its owner
    unblurred = si_blurry_stream(labels, num_tasks=5, n=50, m=0, seed=0)
    check_si_blurry_structure(unblurred, disjoint=5, blurry=5, quota=0)
    assert unblurred.info["quotas"] == [0] * 5


# ----------------------------------------------------------------------------- upstream draws
#
# Upstream's OnlineSampler (varing_NM branch) draws from torch.Generator().manual_seed(seed), in
# this order: randperm(C) of the classes; randint(0, D, (T-1,)) cuts of the disjoint pool (if
# D > 0); randint(0, B, (T-1,)) of the blurry pool (if B > 0); randint(0, K, (T-1,)) blur
# quotas and randperm(len(pool)) of the blur pool (if K > 0); randperm(len(task)) per task.
# The draws are pinned literally below, and each expected task list is worked out by hand from
# them. Labels: class c at dataset indices c, c + 4, c + 8 (12 samples, 4 classes, T = 2).

TILED = np.tile(np.arange(4), 3)


def draws(seed: int, calls: list[tuple]) -> list[list[int]]:
    """The generator's draws for ``calls``: ("perm", n) or ("int", high)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for kind, n in calls:
        if kind == "perm":
            out.append(torch.randperm(n, generator=generator).tolist())
        else:
            out.append(torch.randint(0, n, (1,), generator=generator).tolist())
    return out


def test_si_blurry_upstream_draws_hand_worked_m50():
    # D = 4*50//100 = 2, B = 2; blurry samples 6, K = 6*50//100 = 3
    calls = [("perm", 4), ("int", 2), ("int", 2), ("int", 3), ("perm", 3), ("perm", 6), ("perm", 6)]
    assert draws(4, calls) == [
        [2, 1, 3, 0],  # shuffled classes: disjoint pool [2, 1], blurry pool [3, 0]
        [1],  # disjoint cut: task 0 owns class 2, task 1 class 1
        [1],  # blurry cut: task 0 owns class 3, task 1 class 0
        [2],  # quota cut: k = [2, 1]
        [2, 1, 0],  # blur-pool shuffle
        [0, 2, 4, 5, 3, 1],  # task 0's permutation
        [1, 0, 5, 2, 3, 4],  # task 1's permutation
    ]
    stream = si_blurry_stream(TILED, num_tasks=2, n=50, m=50, seed=4)
    # blurry lists: task 0 class 3 -> [3, 7, 11]; task 1 class 0 -> [0, 4, 8]
    # task 0 gives [3, 7] (keeps [11]), task 1 gives [0] (keeps [4, 8]); pool [3, 7, 0]
    # shuffled by [2, 1, 0] -> [0, 7, 3]; task 0 receives [0, 7], task 1 [3]
    # task 0: [2, 6, 10] + [11] + [0, 7] = [2, 6, 10, 11, 0, 7], by [0, 2, 4, 5, 3, 1]
    # task 1: [1, 5, 9] + [4, 8] + [3] = [1, 5, 9, 4, 8, 3], by [1, 0, 5, 2, 3, 4]
    assert [t.tolist() for t in stream.tasks] == [[2, 10, 0, 7, 11, 6], [5, 1, 3, 9, 4, 8]]
    assert stream.info["quotas"] == [2, 1] and stream.info["blur_quota"] == 3
    assert stream.blurred_indices.tolist() == [0, 3, 7]
    assert [s.disjoint_classes for s in stream.summary()] == [[2], [1]]
    assert [s.blurry_classes for s in stream.summary()] == [[3], [0]]
    assert stream.info["stream_version"] == SI_BLURRY_STREAM_VERSION == 2


def test_si_blurry_upstream_draws_hand_worked_short_pool():
    # m = 100: K = 6; a quota above a task's blurry list leaves the pool short for later tasks
    calls = [("perm", 4), ("int", 2), ("int", 2), ("int", 6), ("perm", 4), ("perm", 7), ("perm", 5)]
    assert draws(53, calls) == [
        [1, 3, 0, 2],  # disjoint pool [1, 3], blurry pool [0, 2]
        [1],  # task 0 owns disjoint class 1, task 1 class 3
        [1],  # task 0 owns blurry class 0, task 1 class 2
        [5],  # quotas k = [5, 1]
        [2, 1, 3, 0],  # blur-pool shuffle
        [5, 3, 1, 0, 4, 6, 2],
        [4, 2, 3, 1, 0],
    ]
    stream = si_blurry_stream(TILED, num_tasks=2, n=50, m=100, seed=53)
    # task 0 gives all of [0, 4, 8] (3 < 5); task 1 gives [2], keeps [6, 10]; pool [0, 4, 8, 2]
    # shuffled -> [8, 4, 2, 0]; task 0 wants 5 and takes all 4, task 1 wants 1 and gets none
    # task 0: [1, 5, 9] + [] + [8, 4, 2, 0] by [5, 3, 1, 0, 4, 6, 2] -> [2, 8, 5, 1, 4, 0, 9]
    # task 1: [3, 7, 11] + [6, 10] + [] by [4, 2, 3, 1, 0] -> [10, 11, 6, 7, 3]
    assert [t.tolist() for t in stream.tasks] == [[2, 8, 5, 1, 4, 0, 9], [10, 11, 6, 7, 3]]
    assert [s.blurred_out for s in stream.summary()] == [3, 1]
    assert [s.blurred_in for s in stream.summary()] == [4, 0]


@pytest.mark.parametrize(
    ("per_class", "expected"),
    [
        # issue 16's figure for upstream's OnlineSampler, seed 0, T = 5, N = 50, M = 10 (its sizes
        # sum to 5,000: 100 classes x 50 samples; task sizes do not depend on the dataset order)
        (50, [321, 450, 650, 2650, 929]),
        # the same, CIFAR-100's 500 per class: upstream's OnlineSampler run on these labels
        (500, [3071, 4500, 6500, 26321, 9608]),
    ],
)
def test_si_blurry_task_sizes_match_upstream(per_class, expected):
    labels = shuffled_labels(100, per_class)
    stream = si_blurry_stream(labels, num_tasks=5, n=50, m=10, seed=0)
    assert [t.size for t in stream.tasks] == expected


def test_blur_pool_refill_hand_worked():
    lists = [np.arange(0, 5), np.zeros(0, dtype=np.int64), np.arange(10, 15)]
    bounds = np.array([0, 2, 5, 6])  # quotas k = [2, 3, 1], K = 6
    kept, received, pool = _blur(lists, bounds, torch.Generator().manual_seed(0), "dataset_order")
    # out: task 0 gives its first 2 -> {0, 1}; task 1 has none; task 2 gives its first 1 -> {10}
    assert np.array_equal(kept[0], [2, 3, 4])
    assert kept[1].size == 0
    assert np.array_equal(kept[2], [11, 12, 13, 14])
    assert sorted(pool.tolist()) == [0, 1, 10]
    # hand back in order: task 0 takes 2, task 1 wants 3 but 1 is left, task 2 gets nothing
    assert [r.size for r in received] == [2, 1, 0]
    assert sorted(np.concatenate(received).tolist()) == [0, 1, 10]


def test_si_blurry_summary_and_exposure():
    labels = shuffled_labels(23, 30)
    stream = si_blurry_stream(labels, num_tasks=5, seed=5)
    summary = stream.summary()
    present = task_class_sets(stream)
    seen: set[int] = set()
    for s, classes in zip(summary, present):
        assert s.num_samples == stream.tasks[s.task].size
        assert s.classes == sorted(classes)
        assert s.new_classes == sorted(classes - seen)  # first exposed here
        assert set(s.disjoint_classes) <= set(s.new_classes)  # disjoint classes live only here
        seen |= classes
    news = [set(s.new_classes) for s in summary]
    assert set().union(*news) == set(stream.trained_classes.tolist())
    assert sum(len(x) for x in news) == len(set().union(*news))  # pairwise disjoint
    # exposure: first task holding the class, by brute force; -1 for leftovers
    exposure = stream.exposure_task()
    assert exposure.shape == (23,)
    for c in range(23):
        tasks_with_c = [t for t, classes in enumerate(present) if c in classes]
        assert exposure[c] == (tasks_with_c[0] if tasks_with_c else -1)
    d_owner = owner_of(stream, "disjoint_classes")
    assert np.array_equal(exposure[d_owner >= 0], d_owner[d_owner >= 0])
    as_dict = json.loads(json.dumps(stream.to_dict()))
    assert as_dict["kind"] == "si_blurry"
    assert as_dict["params"]["n"] == 50 and as_dict["params"]["m"] == 10
    assert sum(t["num_samples"] for t in as_dict["tasks"]) == 600  # 20 pooled classes * 30


def test_empty_task_yields_no_batches():
    # 5 classes, 5 tasks, N = 100: D = 5; cut points in [0, 4] with replacement often repeat,
    # leaving tasks with no class; find a seed where that happens and check iteration skips it
    labels = shuffled_labels(5, 4)
    for seed in range(50):
        stream = si_blurry_stream(labels, num_tasks=5, n=100, seed=seed, batch_size=3)
        if any(t.size == 0 for t in stream.tasks):
            break
    else:
        pytest.fail("no seed produced an empty task")
    empty = [t for t in range(5) if stream.tasks[t].size == 0]
    assert list(stream.batches(empty[0])) == []
    assert stream.num_batches(empty[0]) == 0
    check_batches(stream, np.arange(20))


# ----------------------------------------------------------------------------- build / validation


def test_build_stream_dispatch():
    labels = shuffled_labels(10, 10)
    assert set(STREAMS) == {"clear", "si_blurry"}
    clear = build_stream("clear", labels, init_cls=5, increment=5, batch_size=7)
    assert clear.kind == "clear" and clear.num_tasks == 2 and clear.batch_size == 7
    blurry = build_stream("si_blurry", labels, num_tasks=2, seed=3)
    assert blurry.kind == "si_blurry" and blurry.num_tasks == 2


def test_torch_labels_accepted():
    torch = pytest.importorskip("torch")
    labels = shuffled_labels(10, 10)
    a = clear_stream(torch.as_tensor(labels), init_cls=5, increment=5)
    b = clear_stream(labels, init_cls=5, increment=5)
    assert all(np.array_equal(x, y) for x, y in zip(a.tasks, b.tasks))


def test_build_stream_reads_the_kinds_config_keys():
    """A run config names each option once; the kind picks the keys it declares, explicit
    arguments win, and keys of the other kind are ignored."""
    labels = shuffled_labels(10, 10)
    config = {
        "stream": "si_blurry",
        "init_cls": 4,
        "increment": 3,  # 10 classes: 4 + 3 + 3 = 3 tasks
        "batch_size": 7,
        "seed": 5,
        "si_blurry_n": 40,
        "si_blurry_m": 20,
        "si_blurry_selection": "random",
    }
    clear = build_stream("clear", labels, config=config)
    assert clear.params["init_cls"] == 4 and clear.params["batch_size"] == 7
    assert clear.num_tasks == 3 and clear.seed == 5
    blurry = build_stream(config["stream"], labels, config=config, num_tasks=2, seed=6)
    expected = si_blurry_stream(
        labels, num_tasks=2, n=40, m=20, seed=6, batch_size=7, blurred_selection="random"
    )
    assert all(np.array_equal(x, y) for x, y in zip(blurry.tasks, expected.tasks))
    assert blurry.params == expected.params


@pytest.mark.parametrize(
    ("kind", "kwargs", "error", "match"),
    [
        ("offline", {}, ValueError, "clear.*si_blurry"),
        ("clear", {"n": 50}, TypeError, "does not take"),
        # 10 classes split 2 + 2 + 2 + 2 + 2 = 5 tasks, not the 4 the trainer expects
        ("clear", {"init_cls": 2, "increment": 2, "num_tasks": 4}, ValueError, "5 tasks, but 4"),
        ("clear", {"init_cls": 0, "increment": 2}, ValueError, "init_cls"),
        ("clear", {"init_cls": 11, "increment": 2}, ValueError, "init_cls"),
        ("clear", {"init_cls": 2, "increment": 0}, ValueError, "increment"),
        ("clear", {"init_cls": 2, "increment": 2, "batch_size": 0}, ValueError, "batch_size"),
        ("si_blurry", {"num_tasks": 0}, ValueError, "num_tasks"),
        ("si_blurry", {"num_tasks": 2, "n": 101}, ValueError, "n must be in"),
        ("si_blurry", {"num_tasks": 2, "n": -1}, ValueError, "n must be in"),
        ("si_blurry", {"num_tasks": 2, "m": 150}, ValueError, "m must be in"),
        ("si_blurry", {"num_tasks": 2, "n": 50.5}, TypeError, "integer"),
        ("si_blurry", {"num_tasks": 2, "blurred_selection": "first"}, ValueError, "dataset_order"),
        ("si_blurry", {"num_tasks": 2, "batch_size": -3}, ValueError, "batch_size"),
        # 10 classes, T = 11, N = 50: 5 disjoint classes < 11 tasks -> pool rounds to 0
        ("si_blurry", {"num_tasks": 11}, ValueError, "disjoint pool"),
        # N = 0, T = 11: blurry pool 10 < 11 -> rounds to 0
        ("si_blurry", {"num_tasks": 11, "n": 0}, ValueError, "blurry pool"),
        # N = 50, T = 4: D = 5 -> 4, B = 6 -> 4 fine; N = 90, T = 4: D = 9 -> 8, B = 2 -> 0
        ("si_blurry", {"num_tasks": 4, "n": 90}, ValueError, "blurry pool"),
    ],
)
def test_validation_errors(kind, kwargs, error, match):
    labels = shuffled_labels(10, 10)
    with pytest.raises(error, match=match):
        build_stream(kind, labels, **kwargs)


def test_label_validation():
    with pytest.raises(ValueError, match="1-D"):
        clear_stream(np.zeros((4, 2), dtype=int), init_cls=1, increment=1)
    with pytest.raises(TypeError, match="integer"):
        clear_stream(np.zeros(4), init_cls=1, increment=1)
    with pytest.raises(ValueError, match="empty"):
        clear_stream(np.zeros(0, dtype=int), init_cls=1, increment=1)
    with pytest.raises(ValueError, match="non-negative"):
        clear_stream(np.array([0, -1]), init_cls=1, increment=1)
    labels = shuffled_labels(4, 5)
    with pytest.raises(ValueError, match="repeats"):
        clear_stream(labels, [0, 1, 1], init_cls=1, increment=1)
    with pytest.raises(ValueError, match="no training sample"):
        clear_stream(labels, [0, 1, 7], init_cls=1, increment=1)
    stream = clear_stream(labels, init_cls=2, increment=2)
    with pytest.raises(ValueError, match="task"):
        list(stream.batches(2))


# ----------------------------------------------------------------------------- results versions


def _results(schema_version: int, kind: str) -> dict:
    from pilot_online.core.results import build_results

    built = build_results(
        config={"stream": kind},
        stream={"kind": kind, "tasks": []},
        metrics={"accuracy_matrix": [[1.0]], "A_k": [1.0], "AP": 1.0, "A_T": 1.0},
        timing={
            "train_seconds": 1.0,
            "eval_seconds": 1.0,
            "samples_per_second": 1.0,
            "peak_memory_bytes": None,
        },
        counters={
            "optimizer_steps": 1,
            "samples_seen": 1,
            "skipped_nonfinite_steps": 0,
            "skipped_nonfinite_hypergradients": 0,
        },
    )
    return {**built, "schema_version": schema_version}


def test_schema_1_si_blurry_results_are_marked_old_stream(tmp_path, caplog):
    from pilot_online.core.results import SCHEMA_VERSION, load_results, old_si_blurry_stream

    assert SCHEMA_VERSION == 2  # bumped with the upstream-identical si_blurry draws
    assert old_si_blurry_stream(_results(1, "si_blurry"))
    assert not old_si_blurry_stream(_results(2, "si_blurry"))
    assert not old_si_blurry_stream(_results(1, "clear"))  # the clear stream did not change
    old = tmp_path / "old.results.json"
    old.write_text(json.dumps(_results(1, "si_blurry")))
    with caplog.at_level("WARNING"):
        assert load_results(old)["schema_version"] == 1  # still read
    assert "old stream" in caplog.text
    current = tmp_path / "new.results.json"
    current.write_text(json.dumps(_results(2, "si_blurry")))
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_results(current)
    assert "old stream" not in caplog.text

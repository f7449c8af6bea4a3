"""The run's data path (issue 15): uint8 batches made float on the device, persistent loaders,
the test-pixel cache and replay draws prefetched by a worker.

References are computed the way the data path worked before: every transform of the list, on
the CPU, per image (``Compose`` of PILOT's transforms, ``ToTensor`` and ``Normalize`` included),
with the stream samples' generators seeded by ``(seed, index)``. The new path must give the very
same floats (``torch.equal``), on every device the ``device`` fixture gives.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, devices_under_test
from test_resume import comparable
from torch import nn
from torchvision import transforms as T

from pilot_online.core.rng import seeded
from pilot_online.engine.adapter import StepOutput
from pilot_online.engine.eval_cache import DEVICE_FRACTION
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.pixel_cache import DeviceEnd, PixelCache
from pilot_online.pilot import data as data_module
from pilot_online.pilot.data import PilotDataSource, split_transforms

CIFAR100_NORM = T.Normalize((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))
SIDE = 16


class Resize(T.Resize):
    """torchvision's Resize (so the test transforms count as deterministic, by name), counting
    its calls in this process."""

    calls = 0

    def forward(self, image):
        Resize.calls += 1
        return super().forward(image)


def images(count: int, side: int = 20, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, side, side, 3), dtype=np.uint8)


def manager(train: np.ndarray, test: np.ndarray, use_path: bool = False, normalize: bool = True):
    """A DataManager's fields, CIFAR-100-like: random training augmentations, deterministic test
    ones, a Normalize common to both."""
    return SimpleNamespace(
        _train_data=train,
        _train_targets=np.arange(len(train)) % 4,
        _test_data=test,
        _test_targets=np.arange(len(test)) % 4,
        _train_trsf=[
            T.RandomResizedCrop(SIDE, scale=(0.3, 1.0)),
            T.RandomHorizontalFlip(),
            T.ColorJitter(brightness=63 / 255),
            T.ToTensor(),
        ],
        _test_trsf=[Resize(SIDE + 2), T.CenterCrop(SIDE), T.ToTensor()],
        _common_trsf=[CIFAR100_NORM] if normalize else [],
        use_path=use_path,
    )


def as_picture(image):
    """An array as PILOT's DummyDataset makes it a picture, or a file as its pil_loader reads it."""
    from PIL import Image

    if isinstance(image, str | np.str_):
        with open(image, "rb") as handle:
            return Image.open(handle).convert("RGB")
    return Image.fromarray(image)


def reference_train(dm, seed: int, indices) -> torch.Tensor:
    """Before issue 15: the whole list on the CPU, per sample seeded by (seed, index)."""
    compose = T.Compose([*dm._train_trsf, *dm._common_trsf])
    out = []
    for i in indices:
        with seeded(seed, int(i)):
            out.append(compose(as_picture(dm._train_data[i])))
    return torch.stack(out)


def reference_test(dm, indices) -> torch.Tensor:
    compose = T.Compose([*dm._test_trsf, *dm._common_trsf])
    return torch.stack([compose(as_picture(dm._test_data[i])) for i in indices])


def source(dm, workers: int = 0, device="cpu", **config) -> PilotDataSource:
    config = {"num_workers": workers, "eval_batch_size": 4, **config}
    data = PilotDataSource(dm, config, seed=11)
    data.attach_device(device)
    return data


class PixelNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3 * SIDE * SIDE, 4)


class PixelAdapter(TinyAdapter):
    """A linear classifier over the flattened image."""

    def build_network(self, args: dict) -> nn.Module:
        return PixelNet()

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = x.flatten(1)
        return StepOutput(network.fc(features), features)


# -- uint8 across, float on the device ------------------------------------------------------------
def test_every_byte_becomes_the_float_totensor_and_normalize_give():
    """All 256 values in each channel, both device-side ways (the CPU's operations and the lookup
    table other devices use), against torchvision on one image."""
    values = torch.arange(256, dtype=torch.uint8).view(16, 16)
    batch = torch.stack([values, values.flip(0), values.t()])[None]  # 1 x 3 x 16 x 16
    expected = CIFAR100_NORM(T.ToTensor()(batch[0].permute(1, 2, 0).numpy()))
    end = DeviceEnd([(CIFAR100_NORM.mean, CIFAR100_NORM.std)])
    assert torch.equal(end(batch, "cpu")[0], expected)
    assert torch.equal(end(batch, "cpu", lookup=True)[0], expected)
    plain = T.ToTensor()(batch[0].permute(1, 2, 0).numpy())
    assert torch.equal(DeviceEnd()(batch, "cpu", lookup=True)[0], plain)
    # A value off by one level would be off by 1/255/std: the test can tell.
    assert not torch.equal(end(batch.clamp(max=254) + 1, "cpu")[0], expected)


def test_channels_last_and_split_batches_give_the_same_contiguous_floats():
    """What the workers send: images laid out HWC (``ToUInt8`` makes CHW views of them, and the
    batch keeps that layout), possibly in several parts. Both device-side ways must give
    ToTensor + Normalize's numbers in the usual contiguous layout."""
    rng = np.random.default_rng(3)
    pictures = rng.integers(0, 256, (5, 7, 6, 3), dtype=np.uint8)  # N, H, W, C
    expected = torch.stack([CIFAR100_NORM(T.ToTensor()(p)) for p in pictures])
    images = [data_module.ToUInt8()(as_picture(p)) for p in pictures]
    assert images[0].shape == (3, 7, 6) and not images[0].is_contiguous()  # a view, no transpose
    _, batch, _ = data_module.collate_samples([(i, image, 0) for i, image in enumerate(images)])
    assert batch.shape == (5, 3, 7, 6) and batch.permute(0, 2, 3, 1).is_contiguous()
    end = DeviceEnd([(CIFAR100_NORM.mean, CIFAR100_NORM.std)])
    for lookup in (False, True):
        for given in (batch, [batch[:2], batch[2:3], batch[3:]]):
            got = end(given, "cpu", lookup=lookup)
            assert got.is_contiguous() and torch.equal(got, expected)
    # Images of another layout are stacked as default_collate stacks them.
    _, plain, _ = data_module.collate_samples([(0, expected[0], 0), (1, expected[1], 1)])
    assert torch.equal(plain, expected[:2])


def test_transforms_split_only_where_the_numbers_stay_the_same():
    host, end = split_transforms([T.CenterCrop(4), T.ToTensor(), CIFAR100_NORM])
    assert type(host.transforms[-1]).__name__ == "ToUInt8"
    assert end.normalizations == [(tuple(CIFAR100_NORM.mean), tuple(CIFAR100_NORM.std))]
    # A tensor transform after ToTensor: the list stays whole on the workers (float batches).
    whole = [T.ToTensor(), T.Resize((4, 4), antialias=True)]
    host, end = split_transforms(whole)
    assert host.transforms == whole and end.normalizations == []


@pytest.mark.parametrize("workers", [0, 1])
def test_stream_batches_cross_as_uint8_and_equal_the_float_path(device, workers, monkeypatch):
    dm = manager(images(12), images(6, seed=1))
    crossed = []
    original = DeviceEnd.__call__

    def spy(self, batch, device, lookup=None):
        parts = [batch] if isinstance(batch, torch.Tensor) else batch
        crossed.extend({part.dtype for part in parts})
        return original(self, batch, device, lookup)

    monkeypatch.setattr(DeviceEnd, "__call__", spy)
    data = source(dm, workers=workers, device=device)  # a worker: reused (and pinned) buffers
    batches = [np.array([4, 0, 9]), np.array([11, 2, 7, 5])]
    got = torch.cat([x for x, _ in data.train_batches(batches)])
    assert got.device.type == device.type and got.dtype == torch.float32
    assert crossed == [torch.uint8, torch.uint8]
    assert torch.equal(got.cpu(), reference_train(dm, 11, [4, 0, 9, 11, 2, 7, 5]))
    test = torch.cat([x for x, _ in data.eval_batches(np.arange(6))])
    assert torch.equal(test.cpu(), reference_test(dm, range(6)))
    data.close()


# -- persistent loaders ----------------------------------------------------------------------------
def worker_pids(loader) -> list[int]:
    return [process.pid for process in loader.loader._iterator._workers]


def test_one_persistent_loader_serves_every_task_and_evaluation():
    dm = manager(images(12), images(6, seed=1))
    data = source(dm, workers=1, eval_pixel_cache="off")
    try:
        first = [x for x, _ in data.train_batches([np.array([0, 1]), np.array([2, 3])])]
        loader, pids = data._stream.loader, worker_pids(data._stream)
        second = [x for x, _ in data.train_batches([np.array([4, 5, 6])])]  # the next task
        assert data._stream.loader is loader and worker_pids(data._stream) == pids
        assert torch.equal(torch.cat(first + second), reference_train(dm, 11, range(7)))
        for _ in range(2):
            list(data.eval_batches(np.arange(6)))
        eval_loader, eval_pids = data._eval.loader, worker_pids(data._eval)
        list(data.eval_batches(np.arange(3)))
        assert data._eval.loader is eval_loader and worker_pids(data._eval) == eval_pids
        assert eval_loader is not loader and all(
            p.is_alive() for p in eval_loader._iterator._workers
        )
    finally:
        data.close()
    assert data._stream.loader is None and data._eval.loader is None  # workers stopped


class Filled(torch.utils.data.Dataset):
    """Sample ``i``: a 4 x 4 uint8 image of value ``i``, channels-last as ToUInt8 makes it."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        return index, torch.full((4, 4, 3), index, dtype=torch.uint8).permute(2, 0, 1), index % 3


def filled_values(batch) -> list[int]:
    return batch[1].amax(dim=(1, 2, 3)).tolist()


def test_a_worker_reuses_a_released_buffer_and_never_an_unreleased_one():
    loader = data_module._Loader(Filled(), workers=1, pin_memory=False, seed=0)
    batches = [[2 * i, 2 * i + 1] for i in range(12)]
    try:
        # Released after each batch: the worker stacks into the same few buffers. A batch kept
        # past its release (which a consumer must not do) shows a later batch's images.
        kept = None
        for number, batch in enumerate(loader.run(batches)):
            assert filled_values(batch) == batches[number]
            assert batch[0].tolist() == batches[number] and batch[2].tolist() == [
                i % 3 for i in batches[number]
            ]
            kept = batch if kept is None else kept
            loader.release()
        assert filled_values(kept) != [0, 1]
        # Never released: every batch keeps its images (the worker stacks into fresh buffers once
        # its own are all held).
        taken = list(loader.run(batches))
        assert [filled_values(batch) for batch in taken] == batches
        # A pass left after one batch, then whole ones: the right images. The next pass drops
        # the batches the left one had loaded ahead, unreleased; their buffers are freed when
        # the pass after it starts.
        next(loader.run(batches))
        for _ in range(2):
            for number, batch in enumerate(loader.run(batches[:6])):
                assert filled_values(batch) == batches[number]
                loader.release()
        assert not loader.buffers.busy.any()
    finally:
        loader.close()


def test_evaluation_workers_stop_once_every_test_image_is_cached():
    data = source(manager(images(4), images(6, seed=1)), workers=1)
    first = torch.cat([x for x, _ in data.eval_batches(np.arange(3))])
    assert data.pixel_cache.complete and data._eval.loader is None  # no idle workers left
    again = torch.cat([x for x, _ in data.eval_batches(np.arange(3))])
    assert data._eval.loader is None and torch.equal(first, again)


def test_worker_count_and_pinned_memory_are_automatic_by_default(monkeypatch):
    monkeypatch.setattr(data_module.os, "sched_getaffinity", lambda _: set(range(6)))
    dm = manager(images(4), images(2))
    data = PilotDataSource(dm, {"num_workers": None, "eval_batch_size": 4}, seed=0)
    assert data.num_workers == 5 and data.pin_memory is False  # CPU: nothing to pin for
    monkeypatch.setattr(data_module.os, "sched_getaffinity", lambda _: {0})
    assert data_module.auto_workers() == 0  # one CPU: load in the training process
    monkeypatch.setattr(data_module.os, "sched_getaffinity", lambda _: set(range(64)))
    assert data_module.auto_workers() == 16


# -- the test-pixel cache ------------------------------------------------------------------------
def write_jpegs(folder, pixels: np.ndarray) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(pixels):
        path = folder / f"{i}.jpg"
        as_picture(image).save(path)
        paths.append(str(path))
    return paths


def test_second_evaluation_reads_no_file_and_runs_no_transform(device, tmp_path, monkeypatch):
    """A CUB-like folder dataset; the first evaluation asks for 5 of 9 test images, and stores
    all 9; the next ones (other and more images) open no file and call no transform, and every
    batch equals the uncached path's, and so do the logits."""
    train = write_jpegs(tmp_path / "train", images(6))
    test = write_jpegs(tmp_path / "test", images(9, seed=2))
    dm = manager(np.array(train), np.array(test), use_path=True)
    opened = []
    open_image = data_module.open_image
    monkeypatch.setattr(data_module, "open_image", lambda p: opened.append(p) or open_image(p))
    cached, plain = source(dm, device=device), source(dm, device=device, eval_pixel_cache="off")
    assert cached.deterministic_eval and cached.pixel_cache.enabled
    loop = build_loop(PixelAdapter(), PixelNet(), {"grad_trace": False}, 4, device)
    allowed = torch.ones(4, dtype=torch.bool)

    Resize.calls = 0
    first = list(cached.eval_batches(np.array([0, 2, 3, 5, 8])))
    assert Resize.calls == len(opened) == 9  # the 5 asked for, then the other 4
    assert cached.pixel_cache.complete
    expected = reference_test(dm, [0, 2, 3, 5, 8])
    assert torch.equal(torch.cat([x for x, _ in first]).cpu(), expected)

    for asked in (np.arange(9), np.array([7, 1, 4])):
        Resize.calls, opened[:] = 0, []
        got = list(cached.eval_batches(asked))
        assert Resize.calls == 0 and opened == []  # nothing read, nothing transformed
        uncached = list(plain.eval_batches(asked))
        assert Resize.calls == len(asked)  # the counter does count the uncached path
        for (x, y), (x_ref, y_ref) in zip(got, uncached, strict=True):
            assert x.device.type == device.type and torch.equal(x, x_ref)
            assert torch.equal(y, y_ref)
        logits = [loop.adapter.forward(loop.network, x, train=False).logits for x, _ in got]
        reference = [loop.adapter.forward(loop.network, x, train=False).logits for x, _ in uncached]
        assert all(torch.equal(a, b) for a, b in zip(logits, reference))
        assert np.array_equal(
            loop.predict(iter(got), allowed, 2)[0], loop.predict(iter(uncached), allowed, 2)[0]
        )
    place = cached.pixel_cache.store
    assert place.dtype == torch.uint8 and place.device.type == device.type  # fits: on the device


def test_random_test_transforms_get_no_pixel_cache():
    dm = manager(images(4), images(4))
    dm._test_trsf = [T.RandomCrop(SIDE), T.ToTensor()]
    data = source(dm)
    assert not data.deterministic_eval and not data.pixel_cache.enabled
    list(data.eval_batches(np.arange(4)))
    assert data.pixel_cache.store is None


def test_cached_runs_are_views_and_other_stores_are_copies():
    """A uint8 store hands out its runs of consecutive indices without copying them; a float
    store (transforms that could not be split) hands out a copy, so a model that changes its
    inputs in place cannot change the cache."""
    pixels = torch.arange(6 * 3 * 2 * 2, dtype=torch.uint8).view(6, 3, 2, 2)
    cache = PixelCache(6, "cpu", "cpu")
    cache.put(np.arange(6), pixels)
    parts = cache.get(np.array([1, 2, 3, 5, 0]))
    assert [len(part) for part in parts] == [3, 1, 1]
    assert [part.data_ptr() for part in parts] == [
        cache.store[i].data_ptr() for i in (1, 5, 0)
    ]  # views of the store, in the order asked
    assert torch.equal(torch.cat(parts), pixels[[1, 2, 3, 5, 0]])
    floats = PixelCache(6, "cpu", "cpu")
    floats.put(np.arange(6), pixels.float())
    (copy,) = floats.get(np.array([1, 2]))
    copy.zero_()
    assert torch.equal(floats.store[1:3], pixels[1:3].float())


def test_keyed_draws_are_the_same_in_a_worker_which_keeps_no_state(monkeypatch):
    """In a DataLoader worker the generators are seeded and not restored (nothing else draws
    there); the draws equal those in the training process, whose generators are restored."""

    def draws() -> tuple:
        return (
            torch.rand(3).tolist(),
            np.random.rand(2).tolist(),
            __import__("random").random(),
        )

    torch.manual_seed(123)
    before = torch.get_rng_state()
    with data_module.keyed_draws(11, 4):
        in_process = draws()
    assert torch.equal(torch.get_rng_state(), before)  # restored
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    with data_module.keyed_draws(11, 4):
        in_worker = draws()
    assert in_worker == in_process
    assert not torch.equal(torch.get_rng_state(), before)  # left seeded: nothing restored
    with data_module.keyed_draws(11, 5):
        assert draws() != in_process  # another key, other draws


def test_pixel_cache_follows_the_query_cache_placement_rule(monkeypatch):
    """auto: on the GPU when it takes at most DEVICE_FRACTION of the free memory, else pinned
    host memory (faked CUDA: the placement is decided before any allocation on the device)."""
    batch = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    nbytes = 10 * batch[0].numel()
    allocations = []

    def fake_empty(shape, dtype, device, pin_memory):
        allocations.append((torch.device(device).type, pin_memory))
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(torch, "empty", fake_empty)
    for free, expected in ((nbytes / DEVICE_FRACTION, ("cuda", False)), (nbytes, ("cpu", True))):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 2 * free))
        cache = PixelCache(10, "auto", torch.device("cuda"))
        cache._allocate(batch)
        assert allocations[-1] == expected
    with pytest.raises(ValueError, match="eval_pixel_cache='gpu' is not one of"):
        PixelCache(10, "gpu", "cpu")


# -- replay draws prefetched by a worker -----------------------------------------------------------
def test_replay_draws_do_not_depend_on_workers_or_prefetching():
    dm = manager(images(12), images(2))
    draws = [(np.array([3, 1, 4]), 7), (np.array([1, 5]), 9), (np.array([3, 1, 4]), 11)]

    def load(workers: int, prefetch: bool) -> list[torch.Tensor]:
        data = source(dm, workers=workers)
        out = []
        try:
            for i, (indices, step) in enumerate(draws):
                out.append(data.train_samples(indices, step)[0])
                if prefetch and i + 1 < len(draws):
                    data.train_samples.prefetch(*draws[i + 1])
            assert data.train_samples.prefetched == (len(draws) - 1 if prefetch and workers else 0)
        finally:
            data.close()
        return out

    single = load(0, prefetch=False)
    for workers, prefetch in ((0, True), (2, True), (2, False)):
        got = load(workers, prefetch)
        assert all(torch.equal(a, b) for a, b in zip(got, single)), (workers, prefetch)
    # The same samples drawn at another step get other augmentations, and the keys are not the
    # stream's: a replayed image is not augmented as it was in the stream.
    assert not torch.equal(single[0], single[2])
    stream = reference_train(dm, 11, [3, 1, 4])
    assert not torch.equal(single[0], stream)


def test_replay_loop_prefetches_the_next_draw_and_matches_loading_in_process():
    """Experience replay through the loop: with 1 worker, every draw after the first was
    prefetched, and the run's parameters equal those of a run loading in the training process."""
    dm = manager(images(24, side=SIDE), images(2, side=SIDE), normalize=False)
    stream = [np.arange(i, i + 4) for i in range(0, 24, 4)]
    config = {"er_memory_size": 8, "er_batch_size": 3, "seed": 5, "grad_trace": False}

    def run(workers: int):
        data = source(dm, workers=workers)
        loop = build_loop(PixelAdapter(), PixelNet(), config, 4)
        loop.attach_samples(data.train_samples)
        try:
            for (x, y), indices in zip(data.train_batches(stream), stream):
                loop.train_step(x, y, indices)
        finally:
            data.close()
        return loop, data.train_samples

    in_process, _ = run(0)
    prefetched, loader = run(1)
    # The first step replays nothing (empty memory); each later draw was made and handed to a
    # worker one step ahead.
    assert loader.loaded == loader.prefetched == len(stream) - 1
    assert torch.equal(in_process.network.fc.weight, prefetched.network.fc.weight)
    assert np.array_equal(in_process.memory.indices, prefetched.memory.indices)


# -- resume: the replay prefetch is checkpointed, the pixel cache is refilled ----------------------
class Killed(RuntimeError):
    pass


class KillableSource(PilotDataSource):
    """Raises :class:`Killed` instead of yielding stream batch ``kill_after + 1`` (counted over
    the session)."""

    kill_after: int | None = None
    yielded = 0

    def train_batches(self, batches):
        for batch in super().train_batches(batches):
            if self.yielded == self.kill_after:
                raise Killed
            self.yielded += 1
            yield batch


def test_replay_run_resumes_bit_identical_whatever_the_workers(tmp_path):
    """An ER run over images, evaluated through the pixel cache, killed mid-task (after the
    checkpoint after batch 4, whose next replay draw was already made and prefetched) and resumed
    with another number of workers: the same results and parameters as the straight run."""
    import json

    from pilot_online.core.streams import clear_stream
    from pilot_online.engine.config import ONLINE_KEYS
    from pilot_online.engine.session import OnlineSession

    dm = manager(images(24, side=SIDE), images(8, side=SIDE, seed=3), normalize=False)
    stream = clear_stream(dm._train_targets, init_cls=2, increment=2, batch_size=4, seed=1)
    config = {key: spec.default for key, spec in ONLINE_KEYS.items()}
    config.update(
        model_name="pixel", seed=5, init_lr=0.05, er_memory_size=6, er_batch_size=3,
        allow_memory=True, checkpoint_every=2, eval_batch_size=4,
    )  # fmt: skip

    def session(folder, workers: int, kill_after: int | None = None) -> OnlineSession:
        torch.manual_seed(0)
        loop = build_loop(PixelAdapter(), PixelNet(), config, 4)
        data = KillableSource(dm, {**config, "num_workers": workers}, seed=11)
        data.kill_after = kill_after
        folder.mkdir(parents=True, exist_ok=True)
        return OnlineSession(
            loop, stream, data, config, folder / "run.results.json", progress=False
        )

    straight = session(tmp_path / "straight", workers=0)
    straight_results = straight.run()
    killed = session(tmp_path / "resumed", workers=1, kill_after=5)  # task 1, after batch 2
    with pytest.raises(Killed):
        killed.run()
    killed.data.close()
    assert killed.loop.next_draw is not None and len(killed.loop.next_draw)  # was checkpointed
    resumed = session(tmp_path / "resumed", workers=1)
    assert resumed.resume_position == (1, 1)  # the checkpoint after 4 batches
    resumed_results = resumed.run()

    assert "resumed_from" in resumed_results["extra"]
    assert json.dumps(comparable(resumed_results), sort_keys=True) == json.dumps(
        comparable(straight_results), sort_keys=True
    )
    assert torch.equal(straight.loop.network.fc.weight, resumed.loop.network.fc.weight)
    assert resumed.data.train_samples.prefetched > 0 and resumed.data.pixel_cache.complete


# -- the benchmark ---------------------------------------------------------------------------------
def test_pipeline_benchmark_prints_its_table_and_speedup_line():
    """benchmarks/pipeline.py on tiny data, one worker: a row per dataset with every rate, and the
    speedup line last (its value is the cub row's cache rate over today's)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline.py"
    tiny = ["--classes", "2", "--train-per-class", "8", "--test-per-class", "3"]
    tiny += ["--batch-size", "4", "--eval-batch-size", "4", "--evaluations", "3", "--workers", "1"]
    done = subprocess.run(
        [sys.executable, str(script), *tiny], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    rows = {line[:13].strip(): line[13:].split() for line in lines if line[:4] in ("cifa", "cub ")}
    assert set(rows) == {"cifar arrays", "cub jpegs"}
    for values in rows.values():
        assert values[0] == "1" and len(values) == 10  # workers, 8 rates and ratios, speedup
        assert all(float(v) > 0 for v in values[1:-1])
        assert float(values[9][:-1]) == pytest.approx(
            float(values[6]) / float(values[8]), rel=0.01, abs=0.01
        )  # cache over today
    speedup = re.fullmatch(r"eval speedup from the 2nd evaluation: (\d+\.\d\d)x", lines[-1])
    assert speedup and speedup.group(1) + "x" == rows["cub jpegs"][9]


# -- buffer ownership: a batch is read before its buffer is released ------------------------------
#: How long a slow consumer takes before it reads a batch: far longer than a worker needs to
#: stack the next one of these tiny batches into a free buffer.
SLOW = 0.03


def slowed(monkeypatch, cls, name: str, seconds: float = SLOW) -> None:
    """``cls.name`` waits ``seconds`` before it reads its arguments."""
    import time

    original = getattr(cls, name)

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, slow)


def test_a_slow_stream_consumer_copies_each_batch_before_its_buffer_is_reused(monkeypatch):
    """One worker loading one batch ahead, in two buffers: while ``DeviceEnd`` takes 30 ms to
    read batch k, the worker stacks batch k + 1 into the other buffer. A release before the copy
    would free the buffer being read, the only one already large enough: the worker would stack
    batch k + 1 into it, under the reader."""
    dm = manager(images(24), images(2, seed=1))
    monkeypatch.setattr(data_module._Loader, "PREFETCH", 1)
    # The worker takes a few ms a sample, so that a (wrong) early release would come before it
    # claims a buffer for batch k + 1 even on a loaded machine; the reader takes 100 ms.
    slowed(monkeypatch, data_module.Images, "__getitem__", 0.003)
    slowed(monkeypatch, DeviceEnd, "__call__", 0.1)
    data = source(dm, workers=1)
    batches = [np.arange(i, i + 3) for i in range(0, 24, 3)]
    try:
        got = torch.cat([x for x, _ in data.train_batches(batches)])
        assert data._stream.fresh_batches == 0  # the buffers were reused
    finally:
        data.close()
    assert torch.equal(got, reference_train(dm, 11, range(24)))


def test_a_slow_pixel_cache_fill_stores_each_batch_before_its_buffer_is_reused(monkeypatch):
    """The first evaluation fills the pixel cache while the worker loads ahead: a ``put`` taking
    30 ms must have stored its batch before the buffer is released, or the cache keeps a later
    batch's images for good (every evaluation after reads only the cache). One batch ahead, two
    buffers, as for the stream."""
    dm = manager(images(2), images(20, seed=1))
    monkeypatch.setattr(data_module._Loader, "PREFETCH", 1)
    # The worker takes a few ms a sample, so that a (wrong) early release would come before it
    # claims a buffer for batch k + 1 even on a loaded machine; the reader takes 100 ms.
    slowed(monkeypatch, data_module.Images, "__getitem__", 0.003)
    slowed(monkeypatch, PixelCache, "put", 0.1)
    data = source(dm, workers=1)
    try:
        first = torch.cat([x for x, _ in data.eval_batches(np.arange(20))])
        assert data.pixel_cache.complete and data._eval.fresh_batches == 0
        second = torch.cat([x for x, _ in data.eval_batches(np.arange(20))])
    finally:
        data.close()
    reference = reference_test(dm, range(20))
    assert torch.equal(first, reference) and torch.equal(second, reference)


def test_a_slow_replay_consumer_gets_each_draw_as_loaded_in_process(monkeypatch):
    """Replay draws loaded by two workers (one part each) and prefetched, read by a consumer
    taking 30 ms per draw: the same tensors as loading in the training process."""
    dm = manager(images(12), images(2))
    draws = [(np.array([3, 1, 4, 0]), s) for s in range(7, 13)]
    data = source(dm, workers=0)
    single = [data.train_samples(indices, step)[0] for indices, step in draws]
    data.close()
    slowed(monkeypatch, DeviceEnd, "__call__")
    data = source(dm, workers=2)
    try:
        got = []
        for i, (indices, step) in enumerate(draws):
            got.append(data.train_samples(indices, step)[0])
            if i + 1 < len(draws):
                data.train_samples.prefetch(*draws[i + 1])
        assert data.train_samples.prefetched == len(draws) - 1
        assert data._replay.fresh_batches == 0
    finally:
        data.close()
    assert all(torch.equal(a, b) for a, b in zip(got, single))


class SlowFilled(Filled):
    """:class:`Filled`, 5 ms a sample: a worker is still loading when the next pass starts."""

    def __getitem__(self, index: int):
        import time

        time.sleep(0.005)
        return super().__getitem__(index)


def test_a_new_pass_frees_the_last_pass_stragglers_and_none_of_its_own():
    """A pass left after one batch, with two loaded ahead still being stacked: the next pass
    starts once the DataLoader has drained them, and only then frees every buffer. Freed
    earlier, the stragglers' flags would stay set and the new pass would stack its batches into
    fresh segments; freed later, a batch of the new pass could be overwritten while it is read."""
    import time

    loader = data_module._Loader(SlowFilled(), workers=1, pin_memory=False, seed=0)
    batches = [[4 * i + j for j in range(4)] for i in range(12)]
    try:
        for _ in range(3):
            next(loader.run(batches))  # left midway, never released
            for number, batch in enumerate(loader.run(batches[2:])):
                time.sleep(SLOW)  # a slow consumer: the worker stacks ahead meanwhile
                assert filled_values(batch) == batches[2 + number]
                loader.release()
        assert loader.fresh_batches == 0
    finally:
        loader.close()


@pytest.mark.parametrize(
    "pinned",
    # Pinning needs a CUDA driver: the pinned case runs where the device tests run on CUDA
    # (conftest's devices_under_test), as they do, rather than skipping elsewhere.
    [False] + [True] * ("cuda" in devices_under_test()),
    ids=lambda pinned: "pinned" if pinned else "pageable",
)
def test_two_workers_reuse_their_own_buffers_with_and_without_pinned_memory(pinned):
    """Two workers, each with its own row of flags: a slow consumer releasing after each batch
    gets the right images, and neither worker falls back to a fresh segment (a release that
    cleared the other worker's flag would leave its own set, or free a buffer in use)."""
    import time

    loader = data_module._Loader(Filled(), workers=2, pin_memory=pinned, seed=0)
    batches = [[2 * i, 2 * i + 1] for i in range(24)]
    try:
        for _ in range(2):
            for number, batch in enumerate(loader.run(batches)):
                assert batch[1].is_pinned() == pinned
                time.sleep(SLOW / 3)
                assert filled_values(batch) == batches[number]
                loader.release()
        assert loader.fresh_batches == 0 and not loader.buffers.busy.any()
    finally:
        loader.close()


def test_an_iteration_left_by_an_exception_releases_the_batch_it_took(monkeypatch):
    """The stream's consumer fails while reading its second batch: that batch's buffer is
    released (only the batches loaded ahead, never taken, stay busy until the next pass)."""
    import time

    dm = manager(images(18), images(2, seed=1))
    calls = []
    original = DeviceEnd.__call__

    def failing(self, batch, device, lookup=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the device is gone")
        return original(self, batch, device, lookup)

    monkeypatch.setattr(DeviceEnd, "__call__", failing)
    data = source(dm, workers=1)
    try:
        with pytest.raises(RuntimeError, match="the device is gone"):
            for _ in data.train_batches([np.arange(i, i + 3) for i in range(0, 18, 3)]):
                pass
        time.sleep(0.5)  # the worker finishes the two batches it was asked for ahead
        assert not data._stream._held
        assert int(data._stream.buffers.busy.sum()) == data_module._Loader.PREFETCH
    finally:
        data.close()


def test_an_unsplit_transform_list_ending_in_piltotensor_is_only_moved(device):
    """A list ending in ``PILToTensor`` is not split (no ``ToTensor``): its uint8 batches are
    the model's inputs as they are, moved to the device, never divided by 255."""
    host, end = split_transforms([T.CenterCrop(4), T.PILToTensor()])
    assert [type(t).__name__ for t in host.transforms] == ["CenterCrop", "PILToTensor"]
    batch = torch.arange(2 * 3 * 4 * 4, dtype=torch.uint8).view(2, 3, 4, 4)
    out = end([batch[:1], batch[1:]], device)
    assert out.dtype == torch.uint8 and out.device.type == device.type
    assert torch.equal(out.cpu(), batch) and out.max().item() == 95


def test_closing_a_left_pass_late_frees_none_of_the_next_passes_batches():
    """An iterator of a pass left midway, closed (or collected) only once the next pass has
    handed out a batch, must not release that batch: it is the next pass's consumer's."""
    loader = data_module._Loader(Filled(), workers=1, pin_memory=False, seed=0)
    batches = [[2 * i, 2 * i + 1] for i in range(6)]
    try:
        left = loader.run(batches)
        next(left)
        current = loader.run(batches)
        batch = next(current)
        (slot,) = loader._held
        left.close()
        assert loader._held == [slot] and loader.buffers.busy.view(-1)[slot] == 1
        assert filled_values(batch) == batches[0]
        current.close()  # its own close releases it
        assert not loader._held and loader.buffers.busy.view(-1)[slot] == 0
    finally:
        loader.close()

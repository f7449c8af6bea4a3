"""PILOT data glue: plugin datasets, clear errors for missing or incomplete data, one data path.

PILOT's patched ``utils/data_manager.py`` calls :func:`get_idata` for dataset names it does not know
and :func:`prepare` instead of ``idata.download_data()``. :class:`PilotDataSource` serves a
:class:`~pilot_online.engine.session.OnlineSession` from a ``DataManager``'s raw arrays, in
stream order (``DataManager.get_dataset`` concatenates class by class and would lose that order).

The data path of a run (issue 15): one DataLoader for the stream, one for evaluation and one for
replay draws, each built once with persistent workers and fed the batches of each pass; the
transforms end in a uint8 tensor on the workers (``ToTensor``'s division and ``Normalize`` run on
the device, :class:`~pilot_online.engine.pixel_cache.DeviceEnd`, with the same numbers); the test
images are transformed once per run (:class:`~pilot_online.engine.pixel_cache.PixelCache`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from ..core.datasets import (
    DATASETS,
    PILOT_DATASETS,
    SCALE_DATASETS,
    dataset_names,
    dataset_spec,
    load_scale_dataset,
    make_synthetic,
    plugin_datasets,
)
from ..core.rng import seed_generators, seeded
from ..engine.pixel_cache import DeviceEnd, Normalization, PixelCache, PixelCacheOptions
from .errors import DatasetUnavailableError, install_excepthook

logger = logging.getLogger(__name__)


class IncompleteDatasetError(DatasetUnavailableError):
    """The dataset's files hold fewer (or more) classes than PILOT's class order names."""


#: The classes each PILOT 5240714 dataset has (read from its ``utils/data.py``: the length of each
#: iData's ``class_order``, but 100 for imagenet100, whose ``class_order`` lists 1000).
EXPECTED_CLASSES: dict[str, int] = {
    "cifar10": 10,
    "cifar100": 100,
    "cifar224": 100,
    "cub": 200,
    "imagenetr": 200,
    "imageneta": 200,
    "objectnet": 200,
    "omnibenchmark": 300,
    "vtab": 50,
    "imagenet100": 100,
    "imagenet1000": 1000,
}
#: PILOT datasets torchvision reads from (and downloads into) a CIFAR folder, not ImageFolders.
ARRAY_DATASETS = ("cifar10", "cifar100", "cifar224")
#: PILOT datasets whose folders the user writes into PILOT's ``utils/data.py`` (upstream stops
#: with an assert until then): their folders are not known here, only their loaded labels.
USER_FOLDER_DATASETS = ("imagenet100", "imagenet1000")


class SyntheticIData:
    """PILOT's ``iData`` interface over the embedded synthetic dataset (see ``datasets.py``)."""

    use_path = False

    def __init__(self, name: str) -> None:
        from torchvision import transforms

        self.spec = dataset_spec(name)
        self.class_order = list(range(self.spec.num_classes))
        # Images are generated at the backbone's size: no resizing, no augmentation to undo.
        # Roughly standardised pixels give randomly initialised patch embeddings some spread.
        self.train_trsf: list = []
        self.test_trsf: list = []
        self.common_trsf = [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.25,) * 3)]

    def download_data(self) -> None:
        arrays = make_synthetic(self.spec)
        self.train_data, self.train_targets = arrays["train_x"], arrays["train_y"]
        self.test_data, self.test_targets = arrays["test_x"], arrays["test_y"]


class ScaleIData(SyntheticIData):
    """PILOT's ``iData`` over a scale-model benchmark (``fashion_mnist``, ``fractal``): images
    at the backbone's ``img_size`` (``backbone_kwargs``), normalised as the shipped backbone was
    pretrained (``harness/scale/probe.py``), no augmentation."""

    def __init__(self, name: str, args: dict[str, Any] | None = None) -> None:
        from torchvision import transforms

        self.name = name
        self.spec = SCALE_DATASETS[name]
        kwargs = (args or {}).get("backbone_kwargs") or {}
        self.image_size = int(kwargs.get("img_size", 224))
        self.class_order = list(range(self.spec.num_classes))
        self.train_trsf: list = []
        self.test_trsf: list = []
        self.common_trsf = [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.25,) * 3)]

    def download_data(self) -> None:
        arrays = load_scale_dataset(self.name, self.image_size, str(dataset_root()))
        self.train_data, self.train_targets = arrays["train_x"], arrays["train_y"]
        self.test_data, self.test_targets = arrays["test_x"], arrays["test_y"]


#: Online keys that PILOT 5240714's own configs (``exps/*.json``) set too: they do not mark a
#: config as meant for pilot-online.
UPSTREAM_KEYS = {"num_workers"}


def check_run(args: dict[str, Any] | None) -> None:
    """Before any data loads, the checks a run of PILOT's ``main.py`` would otherwise meet only
    after loading it: the whole config for a pilot-online method, and one line for a method name
    that is none (a typo, or PILOT's own offline learner given an online config). User errors
    from here on end in their message alone (:func:`~pilot_online.pilot.errors.install_excepthook`).

    Runs for a run's arguments (PILOT's ``main.py`` and ``pilot-online run`` put the config file
    under ``config``); a PILOT method with an offline config is left to PILOT."""
    install_excepthook()
    if not args or "config" not in args or not args.get("model_name"):
        return
    from ..engine.config import ONLINE_KEYS, PILOT_MODEL_NAMES, ConfigError, resolve_config
    from ..engine.registry import list_methods

    name = str(args["model_name"]).lower()
    if name in list_methods():
        resolve_config(args)
    elif name not in PILOT_MODEL_NAMES or set(args) & (set(ONLINE_KEYS) - UPSTREAM_KEYS):
        from ..engine.config import unknown_method

        raise ConfigError(unknown_method(str(args["model_name"])))


def get_idata(dataset_name: str, args: dict[str, Any] | None = None) -> SyntheticIData:
    """Resolve a dataset name PILOT does not know (called by the patched ``_get_idata``)."""
    check_run(args)
    name = dataset_name.lower()
    if name in DATASETS:
        return SyntheticIData(name)
    if name in SCALE_DATASETS:
        return ScaleIData(name, args)
    listing = "; ".join(f"{owner} datasets: {', '.join(n)}" for owner, n in dataset_names().items())
    raise NotImplementedError(f"Unknown dataset {dataset_name!r}. {listing}")


def prepare(idata: Any, dataset_name: str, args: dict[str, Any]) -> None:
    """Load the data, and give online learners the transforms upstream gives their base method.

    Called by the patched ``DataManager._setup_data`` instead of ``idata.download_data()``, so a
    missing dataset, or one that lacks classes (:data:`EXPECTED_CLASSES`,
    :func:`check_dataset_folders`), stops here, before PILOT's trainer builds any network. PILOT
    picks some transforms by the literal model name (``coda_prompt`` on cifar224/imagenetr): the
    iData is rebuilt the way upstream's own ``_get_idata`` builds it, with the base method's name.
    The run's config is checked first (:func:`check_run`).
    """
    check_run(args)
    try:
        idata.download_data()
    except (AssertionError, OSError, RuntimeError) as err:
        # ImageFolder raises FileNotFoundError, a failed CIFAR download URLError or RuntimeError,
        # and PILOT's imagenet100/imagenet1000 an AssertionError until their folders are set.
        raise DatasetUnavailableError(_unavailable_message(dataset_name, err)) from err
    problems = _class_count_problems(dataset_name, idata)
    if not problems and getattr(idata, "use_path", False):
        problems = check_dataset_folders({"dataset": dataset_name})
    if problems:
        raise IncompleteDatasetError(" ".join(problems))
    base = _base_model_name(args)
    if base and dataset_name.lower() not in plugin_datasets():
        from utils.data_manager import _get_idata  # PILOT (the caller's own module)

        upstream = _get_idata(dataset_name, {**args, "model_name": base})
        idata.train_trsf, idata.test_trsf = upstream.train_trsf, upstream.test_trsf
        idata.common_trsf = upstream.common_trsf


def _unavailable_message(dataset_name: str, err: BaseException) -> str:
    cwd = dataset_root()
    message = f"dataset {dataset_name!r} could not be loaded (working directory {cwd}): {err}."
    where = PILOT_DATASETS.get(dataset_name.lower())
    if dataset_name.lower() in SCALE_DATASETS:
        return message  # the error names the folders searched and the fix
    if where is None:
        message += " See PILOT's utils/data.py for the folders it reads."
    else:
        folders = " and ".join(str(cwd / folder) for folder in where.folders)
        message += f" PILOT reads it from {folders}: {where.source}."
    return message + ' To try the pipeline offline, use "dataset": "synthetic".'


def _base_model_name(args: dict[str, Any] | None) -> str | None:
    if not args or not args.get("model_name"):
        return None
    from ..engine.registry import get_method

    try:
        return get_method(str(args["model_name"])).base_model_name
    except ValueError:
        return None  # an upstream method: keep PILOT's own choice


def _class_count_problems(dataset_name: str, idata: Any) -> list[str]:
    """The loaded labels against :data:`EXPECTED_CLASSES` (counts only; names: the folders)."""
    name = dataset_name.lower()
    expected = EXPECTED_CLASSES.get(name)
    if expected is None:
        return []
    found = {
        "training": len(np.unique(np.asarray(idata.train_targets))),
        "test": len(np.unique(np.asarray(idata.test_targets))),
    }
    if all(count == expected for count in found.values()):
        return []
    cwd = dataset_root()
    where = PILOT_DATASETS[name]
    if getattr(idata, "use_path", False) and name not in USER_FOLDER_DATASETS:
        holds = ", ".join(
            f"{cwd / folder} holds {found[split]}"
            for split, folder in zip(("training", "test"), where.folders)
        )
        places = "class folders (ImageFolder: one sub-folder per class)"
    else:
        holds = f"the training data holds {found['training']}, the test data {found['test']}"
        if name in USER_FOLDER_DATASETS:
            places = "classes (the folders set in PILOT's utils/data.py download_data)"
        else:
            places = f"classes ({cwd / where.folders[0]})"
    return [
        f"dataset {dataset_name!r} lacks classes: {holds} {places}, but PILOT's class order for "
        f"{name} names {expected}. A run over the classes present would silently be another "
        f"benchmark (other tasks, other class order). Fix: put all {expected} classes in place "
        f"({where.source}), then rerun."
    ]


def dataset_root() -> Path:
    """The one rule for dataset folders: PILOT's ``utils/data.py`` reads ``./data/...``, relative
    to the working directory the run starts in, whether ``python main.py`` (usually in the PILOT
    checkout) or ``pilot-online run`` (wherever it is started; ``--pilot-root`` only says where
    PILOT's code is). ``pilot-online doctor`` checks ``--pilot-root``'s ``data/`` when given
    (where ``python main.py`` runs), else the directory it runs in."""
    return Path.cwd()


def check_dataset_folders(args: dict[str, Any], root: Path | None = None) -> list[str]:
    """Problems, each with its fix, in the folders PILOT will read ``args["dataset"]`` from
    (under :func:`dataset_root`); empty when they are fine.

    Checks the ImageFolder datasets without loading an image: both folders exist, each holds the
    :data:`EXPECTED_CLASSES` class folders, and the test folder's classes are the training
    folder's (ImageFolder numbers classes by sorted folder name, so a class missing on one side
    would shift every later label). CIFAR (torchvision downloads it) and the plugin's synthetic
    datasets have nothing to check, nor imagenet100/imagenet1000, whose folders the user sets in
    PILOT's ``utils/data.py`` (:func:`prepare` checks their class counts once they are loaded).
    ``pilot-online doctor`` (``root``: the folder the run will start in) and :func:`prepare`
    call it.
    """
    name = str(args.get("dataset") or "").lower()
    where = PILOT_DATASETS.get(name)
    if where is None or name in (*ARRAY_DATASETS, *USER_FOLDER_DATASETS):
        return []
    cwd, expected = root or dataset_root(), EXPECTED_CLASSES[name]
    reads_from = f"the working directory {cwd}, where the run starts"
    problems: list[str] = []
    classes: dict[str, list[str]] = {}
    for split, relative in zip(("training", "test"), where.folders):
        folder = cwd / relative
        if not folder.is_dir():
            problems.append(
                f"dataset {name!r}: the {split} folder {folder} does not exist (PILOT reads it "
                f"relative to {reads_from}). Fix: "
                + f"run from the folder that holds data/, or put {where.source} there."
            )
            continue
        classes[split] = sorted(entry.name for entry in folder.iterdir() if entry.is_dir())
        if len(classes[split]) != expected:
            problems.append(
                f"dataset {name!r} lacks classes: the {split} folder {folder} holds "
                f"{len(classes[split])} class folders, but PILOT's class order for {name} names "
                f"{expected}. Fix: put all {expected} class folders there ({where.source})."
            )
    if len(classes) == 2 and classes["training"] != classes["test"]:
        only_train = sorted(set(classes["training"]) - set(classes["test"]))
        only_test = sorted(set(classes["test"]) - set(classes["training"]))
        train_dir, test_dir = (cwd / folder for folder in where.folders)
        problems.append(
            f"dataset {name!r}: the class folders of {train_dir} and {test_dir} differ (only in "
            f"training: {only_train[:5]}, only in test: {only_test[:5]}); ImageFolder numbers "
            "classes by sorted folder name, so every later label would be shifted. Fix: give "
            "both folders the same class folders."
        )
    return problems


def _exit_quietly(signum: int, frame: Any) -> None:
    os._exit(0)


def quiet_on_stop_signals(worker_id: int) -> None:
    """In a DataLoader worker: ignore SIGINT, and exit with status 0 on SIGTERM. Ctrl-C and a
    scheduler's SIGTERM reach the whole process group; a worker killed by a signal makes torch's
    SIGCHLD handler raise in the training process wherever it stands, possibly mid-step, before
    the session can checkpoint a whole state. A worker that exits cleanly is noticed only at the
    next batch fetch, where the session checkpoints the last whole step. (SIGTERM must still end
    a worker: torch's loader shutdown terminates workers that do not stop in time.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_quietly)


def auto_workers() -> int:
    """``num_workers: null``: one DataLoader worker per CPU this process may run on, less one for
    the training process itself (0 on a single CPU: load in the main process), at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(0, min(cpus - 1, 16))


def keyed_draws(*key: int) -> contextlib.AbstractContextManager:
    """The generators seeded by ``key`` for one sample's load, as :func:`seeded` seeds them.

    In a DataLoader worker they are seeded and not restored: every draw there is a keyed sample's,
    so there is nothing to restore, and restoring numpy's state would cost about 50 us a sample
    (a sixth of a CIFAR image's whole training transform). The draws are the same either way."""
    if torch.utils.data.get_worker_info() is None:
        return seeded(*key)
    seed_generators(*key)
    return contextlib.nullcontext()


class SeededSamples(torch.utils.data.Dataset):
    """A dataset whose sample ``i`` is loaded with the random generators seeded by ``(seed, i)``.

    A stream shows each training sample once, so its random augmentation is a function of the run
    seed and the sample alone: the same whichever DataLoader worker loads it, however many
    workers there are, and whether or not the run resumed mid-task with a fresh iterator (whose
    worker seeds are drawn anew). The caller's generators are left as they were.
    """

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        with keyed_draws(self.seed, int(index)):
            return self.dataset[index]


#: Ends the key of a replay draw's seed, so that it never equals a stream sample's key.
REPLAY_KEY = 0x5245504C


class ReplaySamples(SeededSamples):
    """Training samples keyed ``(step, index)``: sample ``index`` replayed at ``step`` is loaded
    with the generators seeded by ``(seed, step, index)``, so a replayed image gets a new
    augmentation at each draw, the same in whichever worker and however many there are."""

    def __getitem__(self, key: tuple[int, int]) -> Any:
        step, index = key
        with keyed_draws(self.seed, int(step), int(index), REPLAY_KEY):
            return self.dataset[int(index)]


#: torchvision transforms that map an image to the same tensor every time (PILOT's test ones).
DETERMINISTIC_TRANSFORMS = frozenset(
    {"Resize", "CenterCrop", "ToTensor", "PILToTensor", "Normalize", "ConvertImageDtype"}
)


def deterministic_transforms(transforms: Sequence[Any]) -> bool:
    """Whether every transform is one of :data:`DETERMINISTIC_TRANSFORMS` (an unknown one may be
    random: the evaluation query and pixel caches, which need the same input at every evaluation,
    are then not used)."""
    unknown = [type(t).__name__ for t in transforms]
    unknown = [name for name in unknown if name not in DETERMINISTIC_TRANSFORMS]
    if unknown:
        logger.info("test transforms %s may be random: no evaluation query or pixel cache", unknown)
    return not unknown


class ToUInt8:
    """``ToTensor`` without its division: a PIL image (or HWC uint8 array) as a CHW uint8 tensor.

    The division by 255 (and any ``Normalize``) then runs on the device (``DeviceEnd``), on a
    quarter of the bytes; for 8-bit images the numbers equal ``ToTensor``'s. The tensor is a CHW
    view of the image's HWC bytes (channels-last strides), and :func:`collate_samples` keeps that
    layout: the transposition, which cost a worker more than the copy itself, happens once per
    batch on the device, in ``DeviceEnd``."""

    def __call__(self, picture: Any) -> torch.Tensor:
        if isinstance(picture, np.ndarray):
            array = picture
        else:
            if picture.mode not in ("L", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV", "P"):
                raise TypeError(
                    f"a {picture.mode!r} image is not 8-bit: the uint8 data path reads 8-bit "
                    "images only (PILOT's loaders give RGB)"
                )
            array = np.asarray(picture)
        if array.dtype != np.uint8:
            raise TypeError(f"the uint8 data path needs uint8 images, got {array.dtype}")
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(np.array(array)).permute(2, 0, 1)  # our own (writable) copy

    def __repr__(self) -> str:
        return "ToUInt8()"


def channels_last_images(images: Sequence[Any]) -> bool:
    """Whether every image is a uint8 CHW tensor laid out HWC in memory (as :class:`ToUInt8`
    makes them)."""
    return all(
        isinstance(image, torch.Tensor)
        and image.dtype == torch.uint8
        and image.dim() == 3
        and image.permute(1, 2, 0).is_contiguous()
        for image in images
    )


def collate_samples(samples: Sequence[tuple[int, Any, Any]]) -> list[Any]:
    """``default_collate`` of ``(index, image, label)`` samples, except that :class:`ToUInt8`'s
    images are stacked in their HWC layout: one plain copy each into the (shared-memory) batch,
    which is an N x C x H x W tensor with channels-last strides. Stacking them into the usual
    layout would transpose every image on the worker, at several times the cost."""
    images = [sample[1] for sample in samples]
    if not channels_last_images(images):
        return default_collate(samples)
    hwc = default_collate([image.permute(1, 2, 0) for image in images])
    indices, labels = default_collate([(sample[0], sample[2]) for sample in samples])
    return [indices, hwc.permute(0, 3, 1, 2), labels]


class BatchBuffers:
    """The collate function of a run's loaders: :func:`collate_samples`, except that in a worker
    the :class:`ToUInt8` images are stacked into shared-memory buffers the worker reuses.

    A fresh shared-memory batch costs its worker a page fault per 4 KiB it writes (about 3 us
    each measured here, 117 us per 224-px image: a third of a CIFAR image's training transform).
    A reused buffer's pages are in place. A worker writes only the buffers whose flag in ``busy``
    (shared with the training process, one row per worker) is clear, and sets the flag when it
    fills one; the training process clears it once it has copied the batch out
    (:meth:`_Loader.release`), and clears them all when the loader's next pass starts, once the
    DataLoader has drained the last pass (every batch of it is loaded, and consumed or dropped,
    by then) and before any batch of the new pass is asked for. With no clear buffer the worker
    stacks into a fresh one, as ``default_collate`` does: slower, never wrong. A batch says which
    buffer it is in by a fourth item, its flag's index (``None`` for a fresh batch); its indices and
    labels are then lists, which :meth:`_Loader.run` collates.
    """

    def __init__(self, workers: int, slots: int) -> None:
        self.busy = torch.zeros((max(1, workers), slots), dtype=torch.uint8).share_memory_()
        self._buffers: dict[int, torch.Tensor] = {}  # in a worker: slot -> its flat uint8 buffer

    def __getstate__(self) -> dict[str, Any]:  # workers started by spawn get no buffers
        return {"busy": self.busy, "_buffers": {}}

    def __call__(self, samples: Sequence[tuple[int, Any, Any]]) -> list[Any]:
        worker = torch.utils.data.get_worker_info()
        images = [sample[1] for sample in samples]
        if worker is None or not channels_last_images(images):
            return [*collate_samples(samples), None]
        shape = (len(images), *images[0].permute(1, 2, 0).shape)
        nbytes = int(np.prod(shape))
        slot = self._claim(worker.id, nbytes)
        if slot is None:
            return [*collate_samples(samples), None]
        hwc = self._buffers[slot][:nbytes].view(shape)
        torch.stack([image.permute(1, 2, 0) for image in images], out=hwc)
        # Indices and labels cross as lists (a tensor would cost a shared-memory segment each).
        indices, labels = [sample[0] for sample in samples], [sample[2] for sample in samples]
        return [indices, hwc.permute(0, 3, 1, 2), labels, worker.id * self.busy.shape[1] + slot]

    def _claim(self, worker: int, nbytes: int) -> int | None:
        """A clear buffer of at least ``nbytes`` (the smallest; a clear slot's buffer is made or
        grown when none is that large), flagged busy; ``None`` when every buffer is busy."""
        free = [slot for slot, busy in enumerate(self.busy[worker].tolist()) if not busy]
        if not free:
            return None
        fitting = [s for s in free if s in self._buffers and len(self._buffers[s]) >= nbytes]
        if fitting:
            slot = min(fitting, key=lambda s: len(self._buffers[s]))
        else:
            slot = min(free, key=lambda s: s in self._buffers)  # an empty slot first
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
        self.busy[worker, slot] = 1
        return slot


def split_transforms(transforms: Sequence[Any]) -> tuple[Any, DeviceEnd]:
    """``[PIL transforms..., ToTensor, Normalize...]`` -> (the worker's part, ending in
    :class:`ToUInt8`; the device's part). Lists of any other shape (a tensor transform after
    ``ToTensor``, no ``ToTensor``) stay whole on the workers and cross as float."""
    from torchvision import transforms as T

    names = [type(t).__name__ for t in transforms]
    if names.count("ToTensor") == 1:
        cut = names.index("ToTensor")
        tail = transforms[cut + 1 :]
        if all(isinstance(t, T.Normalize) for t in tail):
            normalizations: list[Normalization] = [(t.mean, t.std) for t in tail]
            return T.Compose([*transforms[:cut], ToUInt8()]), DeviceEnd(normalizations)
    logger.info("transforms %s stay whole on the workers: batches cross as float", names)
    return T.Compose(list(transforms)), DeviceEnd(convert=False)


def open_image(path: str) -> Any:
    """An image file as an RGB PIL image (as PILOT's ``pil_loader`` reads it)."""
    from PIL import Image

    with open(path, "rb") as handle:
        return Image.open(handle).convert("RGB")


class Images(torch.utils.data.Dataset):
    """``(index, transform(image), label)`` per sample, as PILOT's ``DummyDataset`` yields them,
    from uint8 HWC arrays or (``use_path``) image files."""

    def __init__(self, images: Any, labels: Any, transform: Any, use_path: bool) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels
        self.transform, self.use_path = transform, bool(use_path)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[int, Any, Any]:
        if self.use_path:
            image = open_image(self.images[index])
        else:
            from PIL import Image

            image = Image.fromarray(self.images[index])
        return index, self.transform(image), self.labels[index]


class _Feed:
    """A DataLoader's batch sampler whose batches are set before each pass, so that one loader
    (and its persistent workers) serves every task and every evaluation of a run.

    ``on_start`` runs when the DataLoader asks for the pass's first batch: after it has drained
    the last pass from its persistent workers, before any worker gets a batch of this one."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.on_start: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[list[Any]]:
        if self.on_start is not None:
            self.on_start()
        yield from self.batches

    def __len__(self) -> int:
        return len(self.batches)


class _Loader:
    """One DataLoader of the run, built on first use, fed one pass at a time.

    Its batches may sit in buffers their worker reuses (:class:`BatchBuffers`): a batch is valid
    until :meth:`release` or the loader's next :meth:`run`, whichever comes first. The consumer
    calls :meth:`release` once it has copied the batches it took (to the device, the float
    inputs, the pixel cache), and must not read them after that; :meth:`run` frees the batches
    of the last pass that were never released, and an iteration left midway (an exception, or
    ``close()`` on its iterator) releases the batches it took."""

    #: Batches a worker has loaded ahead (DataLoader's ``prefetch_factor``).
    PREFETCH = 2

    def __init__(self, dataset: Any, workers: int, pin_memory: bool, seed: int) -> None:
        self.dataset, self.workers, self.pin_memory = dataset, workers, pin_memory
        # Worker seeds come from here, never from the global generator (which an iterator would
        # otherwise draw from); the samples' augmentations do not depend on them.
        self.generator = torch.Generator().manual_seed(seed)
        self.feed = _Feed()
        self.loader: torch.utils.data.DataLoader | None = None
        self.buffers: BatchBuffers | None = None
        self._held: list[int] = []
        #: Batches a worker stacked into a fresh segment (every buffer of its was busy).
        self.fresh_batches = 0
        self._passes = 0  # passes started: an old pass's iterator, closed late, frees nothing

    def run(self, batches: Sequence[list[Any]]) -> Iterator:
        """Start a pass over ``batches`` (workers start loading now) and return its iterator."""
        if self.loader is None:
            # A worker's buffers: the batches it loads ahead, and the one being consumed.
            self.buffers = BatchBuffers(self.workers, self.PREFETCH + 1)
            self.loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=self.feed,
                num_workers=self.workers,
                collate_fn=self.buffers,
                pin_memory=self.pin_memory,
                generator=self.generator,
                persistent_workers=self.workers > 0,
                prefetch_factor=self.PREFETCH if self.workers > 0 else None,
                worker_init_fn=quiet_on_stop_signals,
            )
        self.feed.batches = list(batches)
        self.feed.on_start = self._free_all
        self._passes += 1
        return self._batches(iter(self.loader), self._passes)

    def _free_all(self) -> None:
        """Every buffer is free: the last pass is drained (its stragglers included: clearing
        before the drain would leave their flags set), and no batch of the new pass is asked for
        yet (clearing later could free one the consumer is about to read)."""
        self._held.clear()
        self.buffers.busy.zero_()

    def _batches(self, iterator: Iterator, number: int) -> Iterator[list[Any]]:
        try:
            for indices, inputs, labels, slot in iterator:
                if slot is not None:
                    self._held.append(slot)
                    indices, labels = default_collate(indices), default_collate(labels)
                elif self.workers:
                    self.fresh_batches += 1
                yield [indices, inputs, labels]
        finally:  # the pass ends, or is left midway: its consumer is done with what it took
            if number == self._passes:  # (a later pass's batches are not this one's to free)
                self.release()

    def release(self) -> None:
        """The batches taken so far are copied: their workers may reuse their buffers."""
        flags = self.buffers.busy.view(-1)
        for slot in self._held:
            flags[slot] = 0
        self._held.clear()

    def close(self) -> None:
        """Stop the workers (a new pass would start new ones)."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.loader = None


class SampleLoader:
    """Replay's memory draws: ``loader(indices, step)`` loads training samples through the
    training transforms, keyed by ``step`` (:class:`ReplaySamples`); ``prefetch(indices, step)``
    hands the next draw to a worker, so that it loads while this step computes."""

    keyed = True

    def __init__(self, source: PilotDataSource) -> None:
        self.source = source
        self._pending: tuple[int, tuple[int, ...], tuple[int, Iterator]] | None = None
        self.prefetched = self.loaded = 0

    def _start(self, key: tuple[int, ...], step: int) -> tuple[int, Iterator]:
        """Hand the draw to the workers, split in one part per worker so that they load it
        together (the parts are joined in order; each sample's augmentation is keyed, so the
        split changes nothing): (number of parts, the pass's iterator)."""
        parts = np.array_split(np.asarray(key, dtype=np.int64), max(1, self.source._replay.workers))
        parts = [[(int(step), int(i)) for i in part] for part in parts if len(part)]
        return len(parts), self.source._replay.run(parts)

    def prefetch(self, indices: np.ndarray, step: int) -> None:
        if self.source._replay.workers == 0 or not len(indices):
            return  # in-process loading gains nothing from starting early
        key = tuple(int(i) for i in indices)
        self._pending = (int(step), key, self._start(key, step))

    def __call__(
        self, indices: np.ndarray, step: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(int(i) for i in indices)
        if step is None:  # an unkeyed draw: in this process, with the global generators
            _, inputs, labels = collate_samples([self.source._train[i] for i in key])
            return self.source.model_inputs(inputs), torch.as_tensor(labels).long()
        pending, self._pending = self._pending, None
        if pending is not None and pending[:2] == (int(step), key):
            count, iterator = pending[2]
            self.prefetched += 1
        else:
            count, iterator = self._start(key, step)
        self.loaded += 1
        try:
            parts = [next(iterator) for _ in range(count)]  # each (indices, inputs, labels)
            # Each part crosses on its own (pinned, asynchronous) and is joined on the device.
            inputs = self.source.model_inputs([part[1] for part in parts])
        finally:
            self.source._replay.release()
        labels = torch.cat([part[2] for part in parts])
        return inputs, labels.long()


class PilotDataSource:
    """Stream-ordered training batches and test batches from a PILOT ``DataManager``.

    Batches come out on the device :meth:`attach_device` names (the CPU until then), as the model's
    float inputs. ``num_workers`` and ``pin_memory`` null mean: :func:`auto_workers`, and pinned
    memory when the device is a GPU.
    """

    def __init__(self, data_manager: Any, config: dict[str, Any], seed: int) -> None:
        dm = data_manager
        train_host, self._train_end = split_transforms([*dm._train_trsf, *dm._common_trsf])
        test_host, self._test_end = split_transforms([*dm._test_trsf, *dm._common_trsf])
        self._train = Images(dm._train_data, dm._train_targets, train_host, dm.use_path)
        self._test = Images(dm._test_data, dm._test_targets, test_host, dm.use_path)
        self.deterministic_eval = deterministic_transforms([*dm._test_trsf, *dm._common_trsf])
        self.train_labels = np.asarray(dm._train_targets)
        self.test_labels = np.asarray(dm._test_targets)
        workers = config.get("num_workers")
        self.num_workers = auto_workers() if workers is None else int(workers)
        self.eval_batch_size = int(config["eval_batch_size"])
        self._pin_memory = config.get("pin_memory")
        self._pixel_mode = PixelCacheOptions.of(config).eval_pixel_cache
        self.seed = int(seed)
        self.device = torch.device("cpu")
        self._loaders: list[_Loader] = []
        self._stream = self._replay = self._eval = None
        self.pixel_cache: PixelCache | None = None
        self.train_samples = SampleLoader(self)
        self.attach_device(self.device)

    def attach_device(self, device: torch.device | str) -> None:
        """Where batches go (the session calls it with the loop's device before any pass)."""
        self.close()
        self.device = torch.device(device)
        pin = self._pin_memory
        pin = self.device.type == "cuda" if pin is None else bool(pin)
        self.pin_memory = pin and torch.cuda.is_available()
        seed, workers = self.seed, self.num_workers
        self._stream = _Loader(SeededSamples(self._train, seed), workers, self.pin_memory, seed)
        self._replay = _Loader(ReplaySamples(self._train, seed), workers, self.pin_memory, seed)
        self._eval = _Loader(self._test, workers, self.pin_memory, seed)
        self._loaders = [self._stream, self._replay, self._eval]
        mode = self._pixel_mode if self.deterministic_eval else "off"
        self.pixel_cache = PixelCache(len(self.test_labels), mode, self.device)

    def close(self) -> None:
        """Stop every loader's workers (the end of the run)."""
        for loader in self._loaders:
            loader.close()
        if self._loaders and (self.pixel_cache.store is not None or self.train_samples.loaded):
            logger.info("data path: %s", self.report())

    def report(self) -> dict[str, Any]:
        """What the data path did: workers, pinned memory, the pixel cache, replay prefetches."""
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "pixel_cache": self.pixel_cache.report(),
            "replay_draws": self.train_samples.loaded,
            "replay_draws_prefetched": self.train_samples.prefetched,
        }

    def model_inputs(
        self, inputs: torch.Tensor | Sequence[torch.Tensor], end: DeviceEnd | None = None
    ) -> torch.Tensor:
        """A batch from the workers (or its consecutive parts) as the model's inputs, on the
        device."""
        return (end or self._train_end)(inputs, self.device)

    def train_batches(self, batches: Sequence[np.ndarray]) -> Iterator:
        with contextlib.closing(self._stream.run([b.tolist() for b in batches])) as loaded:
            for _, inputs, labels in loaded:
                inputs = self.model_inputs(inputs)
                self._stream.release()  # after the copy: the worker may now reuse the buffer
                yield inputs, labels

    def eval_batches(self, indices: np.ndarray) -> Iterator:
        """Test batches of ``eval_batch_size`` over ``indices``, in order. With the pixel cache,
        the first evaluation stores every test image (those asked for as they are yielded, then
        the rest), and later ones read only the cache."""
        size = self.eval_batch_size
        indices = np.asarray(indices, dtype=np.int64)
        chunks = [indices[i : i + size] for i in range(0, len(indices), size)]
        cache = self.pixel_cache
        if cache is None or not cache.enabled:
            with contextlib.closing(self._eval.run([c.tolist() for c in chunks])) as loaded:
                for _, inputs, labels in loaded:
                    inputs = self.model_inputs(inputs, self._test_end)
                    self._eval.release()
                    yield inputs, labels
            return
        needed = [cache.missing(chunk) for chunk in chunks]
        asked = np.zeros(len(self.test_labels), dtype=bool)
        asked[indices] = True
        rest = cache.missing(np.flatnonzero(~asked))
        loads = [n for n in needed if len(n)] + [
            rest[i : i + size] for i in range(0, len(rest), size)
        ]
        batches = self._eval.run([n.tolist() for n in loads]) if loads else (b for b in ())
        with contextlib.closing(batches):
            for chunk, need in zip(chunks, needed):
                if len(need):
                    _, inputs, _ = next(batches)
                    cache.put(need, inputs)
                    self._eval.release()  # after the copy into the cache
                labels = torch.from_numpy(self.test_labels[chunk])
                yield self.model_inputs(cache.get(chunk), self._test_end), labels
            for start in range(0, len(rest), size):  # the images no evaluation asked for yet
                _, inputs, _ = next(batches)
                cache.put(rest[start : start + size], inputs)
                self._eval.release()
        if loads and cache.complete:  # evaluation reads only the cache from now on
            self._eval.close()

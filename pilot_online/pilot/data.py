"""PILOT data glue: plugin datasets, clear errors for missing data, stream-ordered loaders.

PILOT's patched ``utils/data_manager.py`` calls :func:`get_idata` for dataset names it does not know
and :func:`prepare` instead of ``idata.download_data()``. :class:`PilotDataSource` serves a
:class:`~pilot_online.engine.session.OnlineSession` from a ``DataManager``'s raw arrays, in
stream order (``DataManager.get_dataset`` concatenates class by class and would lose that order).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.datasets import DATASETS, PILOT_DATASETS, dataset_names, dataset_spec, make_synthetic
from ..core.rng import seeded

logger = logging.getLogger(__name__)


class DatasetUnavailableError(RuntimeError):
    """The dataset's files are missing and could not be downloaded."""


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


def get_idata(dataset_name: str, args: dict[str, Any] | None = None) -> SyntheticIData:
    """Resolve a dataset name PILOT does not know (called by the patched ``_get_idata``)."""
    name = dataset_name.lower()
    if name in DATASETS:
        return SyntheticIData(name)
    listing = "; ".join(f"{owner} datasets: {', '.join(n)}" for owner, n in dataset_names().items())
    raise NotImplementedError(f"Unknown dataset {dataset_name!r}. {listing}")


def prepare(idata: Any, dataset_name: str, args: dict[str, Any]) -> None:
    """Load the data, and give online learners the transforms upstream gives their base method.

    Called by the patched ``DataManager._setup_data`` instead of ``idata.download_data()``, so a
    missing dataset stops here, before PILOT's trainer builds any network. PILOT picks some
    transforms by the literal model name (``coda_prompt`` on cifar224/imagenetr): the iData is
    rebuilt the way upstream's own ``_get_idata`` builds it, with the base method's name.
    """
    try:
        idata.download_data()
    except (AssertionError, OSError, RuntimeError) as err:
        # ImageFolder raises FileNotFoundError, a failed CIFAR download URLError or RuntimeError,
        # and PILOT's imagenet100/imagenet1000 an AssertionError until their folders are set.
        raise DatasetUnavailableError(_unavailable_message(dataset_name, err)) from err
    base = _base_model_name(args)
    if base and dataset_name.lower() not in DATASETS:
        from utils.data_manager import _get_idata  # PILOT (the caller's own module)

        upstream = _get_idata(dataset_name, {**args, "model_name": base})
        idata.train_trsf, idata.test_trsf = upstream.train_trsf, upstream.test_trsf
        idata.common_trsf = upstream.common_trsf


def _unavailable_message(dataset_name: str, err: BaseException) -> str:
    cwd = Path.cwd()
    message = f"dataset {dataset_name!r} could not be loaded (working directory {cwd}): {err}."
    where = PILOT_DATASETS.get(dataset_name.lower())
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
        with seeded(self.seed, int(index)):
            return self.dataset[index]


#: torchvision transforms that map an image to the same tensor every time (PILOT's test ones).
DETERMINISTIC_TRANSFORMS = frozenset(
    {"Resize", "CenterCrop", "ToTensor", "PILToTensor", "Normalize", "ConvertImageDtype"}
)


def deterministic_transforms(transforms: Sequence[Any]) -> bool:
    """Whether every transform is one of :data:`DETERMINISTIC_TRANSFORMS` (an unknown one may be
    random: the evaluation query cache, which needs the same input at every evaluation, is then
    not used)."""
    unknown = [type(t).__name__ for t in transforms]
    unknown = [name for name in unknown if name not in DETERMINISTIC_TRANSFORMS]
    if unknown:
        logger.info("test transforms %s may be random: no evaluation query cache", unknown)
    return not unknown


class PilotDataSource:
    """Stream-ordered training batches and test batches from a PILOT ``DataManager``."""

    def __init__(self, data_manager: Any, config: dict[str, Any], seed: int) -> None:
        from torchvision import transforms
        from utils.data_manager import DummyDataset

        dm = data_manager
        self._train = DummyDataset(
            dm._train_data,
            dm._train_targets,
            transforms.Compose([*dm._train_trsf, *dm._common_trsf]),
            dm.use_path,
        )
        self._stream_samples = SeededSamples(self._train, seed)
        self._test = DummyDataset(
            dm._test_data,
            dm._test_targets,
            transforms.Compose([*dm._test_trsf, *dm._common_trsf]),
            dm.use_path,
        )
        self.deterministic_eval = deterministic_transforms([*dm._test_trsf, *dm._common_trsf])
        self.train_labels = np.asarray(dm._train_targets)
        self.test_labels = np.asarray(dm._test_targets)
        self.num_workers = int(config["num_workers"])
        self.eval_batch_size = int(config["eval_batch_size"])
        # Worker seeds come from here, not from the global generator; augmentations of stream
        # samples do not depend on them (``SeededSamples``).
        self._generator = torch.Generator().manual_seed(seed)
        self.pin_memory = bool(config.get("pin_memory", False)) and torch.cuda.is_available()

    def _loader(self, dataset, batch_sampler, generator=None) -> Iterator:
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=generator,
        )
        for _, inputs, labels in loader:
            yield inputs, labels

    def train_batches(self, batches: Sequence[np.ndarray]) -> Iterator:
        return self._loader(self._stream_samples, [b.tolist() for b in batches], self._generator)

    def train_samples(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Training samples by index, through the training transforms (replay's memory draws).

        Loaded in this process: a worker pool per 100-sample draw would cost more than it saves.
        Random augmentations use torch's global generator, which PILOT seeds per run and a
        checkpoint saves (a replayed sample is augmented anew at each draw)."""
        samples = [self._train[int(i)] for i in indices]
        inputs = torch.stack([image for _, image, _ in samples])
        labels = torch.as_tensor(np.asarray([label for _, _, label in samples]), dtype=torch.long)
        return inputs, labels

    def eval_batches(self, indices: np.ndarray) -> Iterator:
        size = self.eval_batch_size
        chunks = [indices[i : i + size].tolist() for i in range(0, len(indices), size)]
        return self._loader(self._test, chunks)

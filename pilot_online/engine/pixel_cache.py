"""Test pixels decoded once per run, and the end of the transforms that runs on the device.

Why: decoding a JPEG and running PILOT's test transform (resize 256, crop 224) costs several
milliseconds of CPU per image, and a class-incremental run evaluates the same test images again
and again: on a GPU, evaluation was bound by the data path, not by the model.

- :class:`DeviceEnd` turns the uint8 images the DataLoader workers produce into the float inputs
  ``ToTensor`` (and any ``Normalize`` after it) would have produced, on the model's device. The
  numbers are those of the CPU path bit for bit: on the CPU it runs the same operations as
  torchvision; on another device it looks every value up in a table computed on the CPU by those
  same operations (a GPU divides by a scalar through its reciprocal, which can differ by an ulp).
- :class:`PixelCache` keeps each test image, once transformed, as the worker produced it (uint8
  when the transforms end with ``ToTensor`` and ``Normalize``), by test-sample index. Only valid
  when the test transforms are deterministic (the data source decides). Where it lives
  (``eval_pixel_cache``): ``auto`` on the evaluation device when it takes at most
  :data:`~pilot_online.engine.eval_cache.DEVICE_FRACTION` of the device's free memory (the query
  cache's rule), else in pinned host memory (plain host memory on a CPU run); ``device`` and
  ``cpu`` force a place; ``off`` disables it.

It is not checkpointed: the pixels are a deterministic function of the files and the transforms,
and the float conversion is exact, so a resumed run that refills it evaluates on the same inputs.

Needs no PILOT.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..core.lazy import torch
from .eval_cache import CACHE_MODES, cache_placement
from .options import ConfigKey, Options, option

logger = logging.getLogger(__name__)

#: ``eval_pixel_cache`` values: the query cache's, as it follows the same placement rule.
PIXEL_CACHE_MODES = CACHE_MODES


@dataclass(frozen=True)
class PixelCacheOptions(Options):
    """The pixel cache's config key (``engine/config.py`` gathers every component's)."""

    eval_pixel_cache: str = option(
        ConfigKey(
            "auto",
            "keep each test image, decoded and transformed once per run, as uint8 (deterministic "
            "test transforms only); auto: on the GPU if it fits, else pinned host memory; "
            "identical",
            choices=PIXEL_CACHE_MODES,
        )
    )


#: A ``Normalize``'s (mean, std), per channel.
Normalization = tuple[Sequence[float], Sequence[float]]


def _normalize(values: torch.Tensor, normalizations: Sequence[Normalization]) -> torch.Tensor:
    """torchvision's ``Normalize`` arithmetic on ``(..., C, H, W)``: subtract, then divide."""
    for mean, std in normalizations:
        mean_t = torch.as_tensor(mean, dtype=values.dtype, device=values.device)
        std_t = torch.as_tensor(std, dtype=values.dtype, device=values.device)
        if (std_t == 0).any():
            raise ValueError(f"Normalize with std {list(std)} divides by zero")
        values = values.sub_(mean_t.view(-1, 1, 1)).div_(std_t.view(-1, 1, 1))
    return values


def _joined_on(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The parts, each moved to ``device`` (asynchronously from pinned memory), in one tensor."""
    moved = [part.to(device, non_blocking=True) for part in parts]
    return moved[0] if len(moved) == 1 else torch.cat(moved)


class DeviceEnd:
    """uint8 images (N, C, H, W) -> the float inputs of ``ToTensor`` + ``Normalize``s, on a device.

    A batch may come in parts (a replay draw loaded by several workers, a cache's runs of
    consecutive images): they are joined in order, into the one output tensor. The uint8 images
    may have any strides (the workers' are channels-last); the output is contiguous N x C x H x W,
    as ``ToTensor`` makes it. With ``convert=False`` (a data source whose transforms could not be
    split: they end on the workers, in whatever dtype, e.g. ``PILToTensor``'s uint8), and for any
    batch not uint8, the batch is only moved to the device and joined.
    """

    def __init__(
        self, normalizations: Sequence[Normalization] = (), *, convert: bool = True
    ) -> None:
        if normalizations and not convert:
            raise ValueError("DeviceEnd(convert=False) only moves batches: it has no Normalize")
        self.normalizations = [(tuple(m), tuple(s)) for m, s in normalizations]
        self.convert = convert
        self._tables: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self,
        batch: torch.Tensor | Sequence[torch.Tensor],
        device: torch.device | str,
        lookup: bool | None = None,
    ) -> torch.Tensor:
        """``batch`` on ``device`` as model inputs. ``lookup``: use the table (default: off the
        CPU only; the tests force it on the CPU to compare both ways)."""
        device = torch.device(device)
        parts = [batch] if isinstance(batch, torch.Tensor) else list(batch)
        if not self.convert or any(part.dtype != torch.uint8 for part in parts):
            return _joined_on(parts, device)
        if lookup is None:
            lookup = device.type != "cpu"
        if not lookup:  # ToTensor's cast and division, then Normalize's operations, as the
            # CPU path was: each part is cast into its rows of one new tensor (no gathered uint8
            # copy; the cast also transposes a channels-last part, the fastest way measured on a
            # CPU), then everything is divided in place.
            out = torch.empty(
                (sum(len(part) for part in parts), *parts[0].shape[1:]),
                dtype=torch.get_default_dtype(),
                device=device,
            )
            row = 0
            for part in parts:
                out[row : row + len(part)].copy_(part)
                row += len(part)
            return _normalize(out.div_(255), self.normalizations)
        joined = _joined_on(parts, device).contiguous()
        table, offsets = self._table(joined.shape[1], device)
        return table[joined.int() + offsets]

    def _table(self, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each channel's 256 output values (computed on the CPU like the plain path), flat, and
        each channel's offset into it."""
        key = (str(device), channels)
        if key not in self._tables:
            levels = torch.arange(256, dtype=torch.uint8).to(torch.get_default_dtype()).div(255)
            values = _normalize(levels.repeat(channels, 1, 1), self.normalizations)  # (C, 1, 256)
            offsets = (torch.arange(values.shape[0], dtype=torch.int32) * 256).view(1, -1, 1, 1)
            self._tables[key] = (values.reshape(-1).to(device), offsets.to(device))
        return self._tables[key]


class PixelCache:
    """Transformed test images by test-sample index, filled once and read at every evaluation."""

    def __init__(self, size: int, mode: str, device: torch.device | str) -> None:
        if mode not in PIXEL_CACHE_MODES:
            raise ValueError(
                f"eval_pixel_cache={mode!r} is not one of {', '.join(PIXEL_CACHE_MODES)}"
            )
        self.size, self.mode, self.device = int(size), mode, torch.device(device)
        self.store: torch.Tensor | None = None
        self.filled = np.zeros(self.size, dtype=bool)
        self.hits = self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def missing(self, indices: np.ndarray) -> np.ndarray:
        """The indices among ``indices`` not stored yet, in their order."""
        indices = np.asarray(indices, dtype=np.int64)
        return indices[~self.filled[indices]]

    def _allocate(self, like: torch.Tensor) -> None:
        shape = (self.size, *like.shape[1:])
        nbytes = int(np.prod(shape)) * like.element_size()
        place = cache_placement(self.mode, nbytes, self.device, "eval_pixel_cache")
        pinned = place.type == "cpu" and self.device.type == "cuda"
        self.store = torch.empty(shape, dtype=like.dtype, device=place, pin_memory=pinned)
        logger.info(
            "eval_pixel_cache: %d test images, %d MiB of %s on %s%s",
            self.size,
            nbytes >> 20,
            like.dtype,
            place,
            " (pinned)" if pinned else "",
        )

    def put(self, indices: np.ndarray, batch: torch.Tensor) -> None:
        """Store ``batch``, the transformed images of ``indices`` in order."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) != len(batch):
            raise ValueError(f"{len(indices)} indices for a batch of {len(batch)} images")
        if self.store is None:
            self._allocate(batch)
        if batch.shape[1:] != self.store.shape[1:] or batch.dtype != self.store.dtype:
            raise ValueError(
                f"test images of shape {tuple(batch.shape[1:])} ({batch.dtype}) after "
                f"{tuple(self.store.shape[1:])} ({self.store.dtype}): the test transforms must "
                "give every image the same size for the pixel cache; set eval_pixel_cache to off"
            )
        index = torch.from_numpy(indices).to(self.store.device)
        self.store.index_copy_(0, index, batch.to(self.store.device))
        self.filled[indices] = True
        self.misses += len(indices)

    def get(self, indices: np.ndarray) -> list[torch.Tensor]:
        """The stored images of ``indices``, in order, as consecutive parts (on the store's
        device; pinned if it is), for :class:`DeviceEnd`, which joins them. A uint8 store gives
        views of its runs of consecutive indices: no copy here, and ``DeviceEnd`` writes its
        output without touching them. Other stores give one gathered copy, which the model may
        change without changing the cache."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.store is None or not self.filled[indices].all():
            raise KeyError("eval_pixel_cache: some of these test images are not stored yet")
        self.hits += len(indices)
        if self.store.dtype == torch.uint8 and len(indices):
            breaks = np.flatnonzero(np.diff(indices) != 1) + 1
            return [self.store[run[0] : run[-1] + 1] for run in np.split(indices, breaks)]
        index = torch.from_numpy(indices).to(self.store.device)
        if self.store.is_pinned():  # gather into pinned memory: the copy to the GPU stays async
            out = torch.empty(
                (len(indices), *self.store.shape[1:]), dtype=self.store.dtype, pin_memory=True
            )
            return [torch.index_select(self.store, 0, index, out=out)]
        return [self.store.index_select(0, index)]

    def report(self) -> dict[str, object]:
        """Entries for the results' diagnostics."""
        return {
            "mode": self.mode,
            "place": None if self.store is None else str(self.store.device),
            "stored": int(self.filled.sum()),
            "hits": self.hits,
            "misses": self.misses,
        }

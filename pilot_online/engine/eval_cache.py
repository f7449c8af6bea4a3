"""The evaluation query cache: a frozen query pass computed once per test image.

L2P, DualPrompt, CODA and MVP select prompts from a query computed by a frozen, prompt-free pass of
a ViT. At test time that pass sees the same image through the same deterministic transforms at
every evaluation, so its output never changes: :class:`QueryCache` keeps it per test-sample index
and the later evaluations run only the prompted pass.

It is valid only while (1) the test transforms are deterministic (the data source says so with
``deterministic_eval = True``; the session hands no sample indices otherwise) and (2) the query
parameters do not change. (2) is checked at every evaluation: a query parameter that requires grad
turns the cache off for the run (logged once), and any in-place change of a query parameter
(``Tensor._version``: an optimiser step, ``load_state_dict``) empties it.

Where it lives (``eval_query_cache``): ``auto`` keeps it on the evaluation device when it takes at
most :data:`DEVICE_FRACTION` of the device's free memory, else on the CPU; ``device`` and ``cpu``
force a place; ``off`` disables it. Lookups return the stored tensors themselves, so predictions are
bit-identical to an uncached evaluation that fills with the same batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..core.lazy import nn, torch
from .options import ConfigKey, Options, option

logger = logging.getLogger(__name__)

#: ``eval_query_cache`` values.
CACHE_MODES = ("auto", "device", "cpu", "off")
#: ``auto``: the share of the device's free memory the cache may take.
DEVICE_FRACTION = 0.25


@dataclass(frozen=True)
class QueryCacheOptions(Options):
    """The query cache's config key (``engine/config.py`` gathers every component's)."""

    eval_query_cache: str = option(
        ConfigKey(
            "auto",
            "cache the frozen query pass per test image (L2P, DualPrompt, CODA, MVP); "
            "bit-identical",
            choices=CACHE_MODES,
        )
    )


def cache_placement(mode: str, nbytes: int, device: torch.device, key: str) -> torch.device:
    """Where a cache of ``nbytes`` goes under ``mode`` (:data:`CACHE_MODES` but ``off``): the CPU
    for ``cpu`` or a CPU run, ``device`` itself for ``device``, and for ``auto`` the CUDA device
    when ``nbytes`` is at most :data:`DEVICE_FRACTION` of its free memory, else the CPU (logged,
    naming the config ``key``). Shared by every evaluation cache, so they follow one rule."""
    device = torch.device(device)
    if mode == "cpu" or device.type == "cpu":
        return torch.device("cpu")
    if mode == "device":
        return device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes <= DEVICE_FRACTION * free:
            return device
        logger.info(
            "%s on the CPU: %d MiB exceed %.0f%% of the device's free memory",
            key,
            nbytes >> 20,
            100 * DEVICE_FRACTION,
        )
        return torch.device("cpu")
    return device


def _versions(params: list[nn.Parameter]) -> tuple[int, ...]:
    return tuple(p._version for p in params)


class QueryCache:
    """Query features by test-sample index, filled on first sight and reused after."""

    def __init__(self, mode: str, device: torch.device) -> None:
        if mode not in CACHE_MODES:
            raise ValueError(f"eval_query_cache={mode!r} is not one of {', '.join(CACHE_MODES)}")
        self.mode = mode
        self.device = torch.device(device)
        self.store: torch.Tensor | None = None
        self.filled = np.zeros(0, dtype=bool)
        self.refused = False
        self.hits = self.misses = 0
        self._params: list[nn.Parameter] = []
        self._versions: tuple[int, ...] = ()

    # -- validity ----------------------------------------------------------------------------
    def usable(self, params: list[nn.Parameter]) -> bool:
        """Whether the cache may serve an evaluation with these query parameters (empties it when
        a parameter changed since it was filled, refuses for good when one is trainable)."""
        if self.mode == "off" or self.refused or not params:
            return False
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        if trainable:
            self.refused = True
            logger.info(
                "eval_query_cache off: %d query parameter(s) require grad, so the query pass "
                "is not frozen and is recomputed at every evaluation",
                len(trainable),
            )
            self.clear()
            return False
        versions = _versions(params)
        if len(params) != len(self._params) or any(
            a is not b for a, b in zip(params, self._params)
        ):
            self.clear()
        elif versions != self._versions:
            logger.info("eval_query_cache emptied: a query parameter changed since it was filled")
            self.clear()
        self._params, self._versions = list(params), versions
        return True

    def clear(self) -> None:
        self.store = None
        self.filled = np.zeros(0, dtype=bool)

    # -- storage -----------------------------------------------------------------------------
    def _place(self, nbytes: int) -> torch.device:
        return cache_placement(self.mode, nbytes, self.device, "eval_query_cache")

    def _reserve(self, size: int, like: torch.Tensor) -> None:
        """Room for indices ``< size``, shaped and typed like one query row of ``like``."""
        if self.store is not None and len(self.store) >= size:
            return
        capacity = max(size, 2 * len(self.filled))
        shape = (capacity, *like.shape[1:])
        place = self._place(int(np.prod(shape)) * like.element_size())
        store = torch.empty(shape, dtype=like.dtype, device=place)
        if self.store is not None:
            store[: len(self.store)] = self.store.to(place)
        filled = np.zeros(capacity, dtype=bool)
        filled[: len(self.filled)] = self.filled
        self.store, self.filled = store, filled

    def get(
        self, sample_ids: np.ndarray, compute: Callable[[], torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        """The queries of ``sample_ids`` on ``device``; ``compute()`` (the whole batch's query) runs
        only when some are missing, and fills them."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        missing = ids >= len(self.filled)
        missing[~missing] = ~self.filled[ids[~missing]]
        if missing.any():
            self.misses += int(missing.sum())
            query = compute()
            self._reserve(int(ids.max()) + 1, query)
            rows = torch.from_numpy(np.flatnonzero(missing))
            store_index = torch.from_numpy(ids[missing]).to(self.store.device)
            self.store[store_index] = query[rows.to(query.device)].to(self.store.device)
            self.filled[ids[missing]] = True
        self.hits += int((~missing).sum())
        index = torch.from_numpy(ids).to(self.store.device)
        return self.store[index].to(device, non_blocking=True)

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """The filled queries, for a checkpoint. A query depends in its last bits on the batch it
        was computed in, so a resumed run must reuse the very tensors the uninterrupted run would
        (a cold cache would refill them in other batches)."""
        if self.store is None:
            return {"store": None, "filled": torch.zeros(0, dtype=torch.bool)}
        return {
            "store": self.store[: len(self.filled)].cpu(),
            "filled": torch.from_numpy(self.filled.copy()),
        }

    def load_state_dict(self, state: dict[str, object], params: list[nn.Parameter]) -> None:
        """Restore :meth:`state_dict`, valid for the query parameters ``params`` as they are now."""
        self.clear()
        store = state["store"]
        if store is not None and self.mode != "off":
            place = self._place(store.numel() * store.element_size())
            self.store = store.to(place)
            self.filled = state["filled"].numpy().astype(bool)
        self._params, self._versions = list(params), _versions(params)

    def report(self) -> dict[str, object]:
        """Entries for the results' diagnostics."""
        return {
            "mode": self.mode,
            "refused": self.refused,
            "hits": self.hits,
            "misses": self.misses,
            "place": None if self.store is None else str(self.store.device),
        }

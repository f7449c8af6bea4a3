"""Random-number state: capture and restore all of it, and seed one sample's draws by a key.

Why: a resumed run must draw the same random numbers as an uninterrupted one. Two tools do it:

- :func:`capture_rng_state` / :func:`restore_rng_state` save and put back every generator the
  run draws from (Python's ``random``, numpy's global one, torch's CPU one and the generator of
  the one CUDA device the run trains on), so a checkpoint can continue the exact sequence. Only
  that device's: the other visible GPUs are not the run's (a sweep shows each run one GPU, so a
  checkpoint holding every visible GPU's state would not resume there), and the state is put
  back on the run's device, whatever its index (``cuda:1`` then, ``cuda:0`` on resume).
- :func:`seeded` runs a block with the host generators (Python, numpy, torch's CPU one) seeded by
  a key (e.g. the run's seed and a dataset index) and restores them afterwards. A random
  augmentation drawn under it is a function of the key alone: it does not depend on which
  DataLoader worker loads the sample, on how many there are, or on whether the run resumed with
  a fresh iterator (whose worker seeds are new). It never touches a CUDA generator:
  ``torch.manual_seed`` would reseed every GPU's (and never restore them), making dropout and
  drop-path on the GPU depend on how many samples the main process loaded, i.e. on
  ``num_workers``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np

from .lazy import torch


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    """The CUDA device whose generator the run owns (None for a CPU run)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device.index is None:  # "cuda" means the current device, as torch reads it
        return torch.device("cuda", torch.cuda.current_device())
    return device


def capture_rng_state(device: torch.device | str | None = None) -> dict[str, Any]:
    """Every host generator's state, and the CUDA generator of ``device`` (the run's training
    device) when it is a CUDA device and CUDA is initialised; no other GPU's."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
    }
    cuda = _cuda_device(device)
    if cuda is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(cuda)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device | str | None = None) -> None:
    """Put back what :func:`capture_rng_state` returned; a saved CUDA state goes to ``device``
    (the resumed run's training device, whichever index it has now)."""
    random.setstate(_as_python_state(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = _cuda_device(device)
    if "cuda" in state and cuda is not None:
        saved = state["cuda"]
        if not isinstance(saved, torch.Tensor):
            raise ValueError(
                "the saved CUDA generator state is not one device's state (a list: written by a "
                "version that saved every visible GPU's); start the run over"
            )
        torch.cuda.set_rng_state(saved, cuda)


def _as_python_state(state: Any) -> tuple:
    """``random.setstate`` needs tuples; a saved state may come back with lists."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def key_seed(*key: int) -> int:
    """A 63-bit seed that depends on every integer of ``key`` (numpy's ``SeedSequence`` mixing)."""
    words = np.random.SeedSequence([int(k) for k in key]).generate_state(2, np.uint32)
    return (int(words[0]) << 31 | int(words[1]) >> 1) & (2**63 - 1)


@contextlib.contextmanager
def seeded(*key: int) -> Iterator[None]:
    """Run the block with Python's, numpy's and torch's CPU generators seeded by ``key``; their
    previous states are restored on exit, so the surrounding sequence is not disturbed.

    Only the CPU generator of torch: ``torch.manual_seed`` would also reseed every CUDA device's
    generator (lazily, even before CUDA starts), and ``fork_rng(devices=[])`` restores the CPU's
    alone. The CPU draws are the same as ``torch.manual_seed`` gave."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        seed_generators(*key)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def seed_generators(*key: int) -> None:
    """Seed Python's, numpy's and torch's CPU generators by ``key`` as :func:`seeded` does, and
    keep nothing to restore: for a process in which every draw is keyed (a DataLoader worker of
    :class:`~pilot_online.pilot.data.SeededSamples`), where saving and restoring numpy's state
    would cost five times the seeding."""
    seed = key_seed(*key)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)


def run_seed(seed: Any) -> int:
    """A run's integer seed: ``seed``, or the one element of a list (PILOT's trainer hands each
    run one seed of the config's list; a longer list here is a config that never reached it)."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != 1:
            raise ValueError(f"a run has one seed, got the list {list(seed)}")
        seed = seed[0]
    return int(seed)

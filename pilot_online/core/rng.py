"""Random-number state: capture and restore all of it, and seed one sample's draws by a key.

Why: a resumed run must draw the same random numbers as an uninterrupted one. Two tools do it:

- :func:`capture_rng_state` / :func:`restore_rng_state` save and put back every generator the
  process draws from (Python's ``random``, numpy's global one, torch's CPU one and every CUDA
  device's), so a checkpoint can continue the exact sequence.
- :func:`seeded` runs a block with those generators seeded by a key (e.g. the run's seed and a
  dataset index) and restores them afterwards. A random augmentation drawn under it is a function
  of the key alone: it does not depend on which DataLoader worker loads the sample, on how many
  there are, or on whether the run resumed with a fresh iterator (whose worker seeds are new).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """Every global generator's state (CUDA's only when CUDA is initialised)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned."""
    random.setstate(_as_python_state(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    previous states are restored on exit, so the surrounding sequence is not disturbed."""
    seed = key_seed(*key)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)

"""pilot-online: online, task-free, memory-free training for LAMDA-PILOT's learners.

Importing this package imports nothing but the standard library: its names load on first use
(PEP 562), so ``pilot-online --help`` and ``check-config`` answer without importing torch. The
core components (``core/``) work on any PyTorch model:

- :class:`FineGrainedHypergradients` (``core/fgh.py``): learned per-parameter gradient weights.
- :class:`PrototypeBank` (``core/prototypes.py``): online class means replayed through the
  classifier.
- streams, metrics, results and the synthetic dataset (``core/streams.py``, ...).

The PILOT learners (:func:`list_methods`: the paper's rows, from fine-tuning to ConvPrompt) are
built by :func:`create_learner`, which PILOT's patched factory calls.

Importing it also silences one warning nobody can act on (:data:`TORCH_JIT_SCRIPT_DEPRECATED`).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .version import __version__

#: timm 0.6, the version PILOT needs, calls ``torch.jit.script`` when it is imported, which recent
#: torch deprecates with a FutureWarning on every run that no user can act on. Only that warning
#: (its message and category) is ignored; ``pilot-online`` and PILOT's patched ``main.py`` import
#: this package before anything imports timm, and importing it imports no timm.
TORCH_JIT_SCRIPT_DEPRECATED = r"`torch\.jit\.script` is deprecated"
warnings.filterwarnings("ignore", message=TORCH_JIT_SCRIPT_DEPRECATED, category=FutureWarning)

#: The public names, by the module that defines them (loaded on first access).
_LAZY = {
    "FineGrainedHypergradients": ".core.fgh",
    "PrototypeBank": ".core.prototypes",
    "class_grad_norms": ".core.grad_norms",
    "create_learner": ".pilot",
    "get_method": ".engine.registry",
    "list_methods": ".engine.registry",
    "register_method": ".engine.registry",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "FineGrainedHypergradients",
    "PrototypeBank",
    "__version__",
    "class_grad_norms",
    "create_learner",
    "get_method",
    "list_methods",
    "register_method",
]

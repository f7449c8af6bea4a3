"""pilot-online: online, task-free, memory-free training for LAMDA-PILOT's learners.

Importing this package imports nothing from PILOT, timm or torchvision. The core components
(``core/``) work on any PyTorch model:

- :class:`FineGrainedHypergradients` (``core/fgh.py``): learned per-parameter gradient weights.
- :class:`PrototypeBank` (``core/prototypes.py``): online class means replayed through the
  classifier.
- streams, metrics, results and the synthetic dataset (``core/streams.py``, ...).

The PILOT learners (:func:`list_methods`: the paper's rows, from fine-tuning to ConvPrompt) are
built by :func:`create_learner`, which PILOT's patched factory calls.

Importing it also silences one warning nobody can act on (:data:`TORCH_JIT_SCRIPT_DEPRECATED`).
"""

import warnings

from . import methods  # noqa: F401  (importing it registers the built-in methods)
from .core.fgh import FineGrainedHypergradients
from .core.grad_norms import class_grad_norms
from .core.prototypes import PrototypeBank
from .engine.registry import get_method, list_methods, register_method
from .pilot import create_learner
from .version import __version__

#: timm 0.6, the version PILOT needs, calls ``torch.jit.script`` when it is imported, which recent
#: torch deprecates with a FutureWarning on every run that no user can act on. Only that warning
#: (its message and category) is ignored; ``pilot-online`` and PILOT's patched ``main.py`` import
#: this package before anything imports timm, and importing it imports no timm.
TORCH_JIT_SCRIPT_DEPRECATED = r"`torch\.jit\.script` is deprecated"
warnings.filterwarnings("ignore", message=TORCH_JIT_SCRIPT_DEPRECATED, category=FutureWarning)

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

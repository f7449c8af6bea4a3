"""The pure pieces of Online-LoRA (Wei et al., WACV 2025): the merge rules of LoRA on a ViT's q
and v projections (the layer itself, :class:`~pilot_online.core.networks.LoRAQKV`, is in
``core/networks.py``), the loss-plateau detector, the importance-weighted regulariser and the hard
buffer. Torch and the standard library only; ``methods/olora.py`` wires them into the loop.

Written from a reading of christina200/online-lora-official (commit 96e7de0f,
``Si-blurry/online_lora.py``, ``Si-blurry/utils/lora.py``, ``Disjoint/engine.py``); no code copied.
Where upstream's code does something other than what the paper describes, both exist here, and
the method's config picks (``methods/olora.py``; defaults reproduce upstream):

* **Merge** (``LoRAQKV``, ``merge``). Upstream "merges" by adding the new factors to the old
  ones (``A_old += A_new``, ``B_old += B_new``; ``"upstream"``), which changes the network's
  function by the cross terms ``B_old A_new + B_new A_old`` from the second merge on. ``"exact"``
  adds the product ``B A`` to the frozen projection weight, so the outputs just before and just
  after a merge agree to float rounding.
* **Importance pseudo-labels** (:func:`importance_loss`). Upstream flattens a whole buffered
  batch to one row (``output.view(1, -1)``) and takes one arg-max over it (``"upstream"``);
  ``"per_sample"`` gives each sample its own arg-max label.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .checks import check_int, check_real
from .lazy import F, no_grad, torch

#: How :meth:`LoRAQKV.merge_` folds a finished adapter in: upstream's factor sums, or exactly.
LORA_MERGES = ("upstream", "exact")
#: The pseudo-labels of the importance loss: upstream's one arg-max per batch, or per sample.
IMPORTANCE_LABELS = ("upstream", "per_sample")


class LossPlateauDetector:
    """Upstream's loss-surface trigger, on a moving window of training losses.

    Each :meth:`update` appends one loss (the window keeps the last ``window`` values; it is used
    before it is full, as upstream does) and computes its mean and population variance. A plateau
    fires when ``mean < mean_threshold`` and ``variance < variance_threshold`` and a new peak has
    been seen since the last plateau. A new peak is a window mean above
    ``last_mean + sqrt(last_variance)`` (the statistics at the last plateau); the detector starts
    armed, so the first plateau needs no peak.

    The window counts steps, not samples: at batch 100 a window of 5 spans 500 samples, more than
    a whole CUB task of 400 images (paper appendix), so the thresholds depend on the stream.
    """

    def __init__(self, window: int, mean_threshold: float, variance_threshold: float) -> None:
        self.window = check_int("loss_window_length", window, 1)
        self.mean_threshold = check_real("loss_window_mean_threshold", mean_threshold)
        self.variance_threshold = check_real("loss_window_variance_threshold", variance_threshold)
        self.losses: deque[float] = deque(maxlen=self.window)
        self.armed = True  # upstream's new_peak_detected
        self.last_mean = math.inf
        self.last_variance = 0.0
        self.plateaus = 0
        self.plateau_steps: list[int] = []
        self.steps = 0

    def update(self, loss: float) -> bool:
        """Add one step's loss; True when this step ends a plateau (merge now)."""
        if not math.isfinite(loss):
            raise ValueError(f"the plateau detector needs a finite loss, got {loss}")
        self.steps += 1
        self.losses.append(float(loss))
        n = len(self.losses)
        mean = sum(self.losses) / n
        variance = sum((x - mean) ** 2 for x in self.losses) / n
        if not self.armed and mean > self.last_mean + math.sqrt(self.last_variance):
            self.armed = True
        if self.armed and mean < self.mean_threshold and variance < self.variance_threshold:
            self.armed = False
            self.last_mean, self.last_variance = mean, variance
            self.plateaus += 1
            self.plateau_steps.append(self.steps)
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self.losses),
            "armed": self.armed,
            "last_mean": self.last_mean,
            "last_variance": self.last_variance,
            "plateaus": self.plateaus,
            "plateau_steps": list(self.plateau_steps),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque(state["losses"], maxlen=self.window)
        self.armed = bool(state["armed"])
        self.last_mean = float(state["last_mean"])
        self.last_variance = float(state["last_variance"])
        self.plateaus = int(state["plateaus"])
        self.plateau_steps = list(state["plateau_steps"])
        self.steps = int(state["steps"])


class ImportanceRegularizer:
    """Importance-weighted penalty on the current LoRA factors (upstream's "MAS" term):

        penalty = weight / 2 * sum_i sum(omega_i * p_i^2)

    ``omega_i`` is a running average over plateaus of squared gradients: at the k-th plateau,
    ``omega <- g / k + (1 - 1/k) * omega`` (the first one is ``g`` itself). Until the first
    plateau there is no penalty.
    """

    def __init__(self, weight: float) -> None:
        self.weight = check_real("mas_weight", weight)
        if self.weight < 0:
            raise ValueError(f"mas_weight must be >= 0, got {self.weight}")
        self.omegas: list[torch.Tensor] = []
        self.updates = 0

    @no_grad
    def update(self, squared_grads: Sequence[torch.Tensor]) -> None:
        """Fold one plateau's summed squared gradients (one tensor per LoRA factor) in."""
        self.updates += 1
        if not self.omegas:
            self.omegas = [g.detach().clone() for g in squared_grads]
            return
        if len(squared_grads) != len(self.omegas):
            raise ValueError(
                f"expected {len(self.omegas)} importance tensors, got {len(squared_grads)}"
            )
        k = self.updates
        self.omegas = [g / k + (1 - 1 / k) * o for g, o in zip(squared_grads, self.omegas)]

    def penalty(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The penalty on ``params`` (same order as the importance tensors); None before any."""
        if not self.omegas or self.weight == 0:
            return None
        if len(params) != len(self.omegas):
            raise ValueError(f"expected {len(self.omegas)} LoRA factors, got {len(params)}")
        total = sum((o * p.square()).sum() for o, p in zip(self.omegas, params))
        return self.weight / 2 * total

    def state_dict(self) -> dict[str, Any]:
        return {"omegas": list(self.omegas), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.omegas = list(state["omegas"])
        self.updates = int(state["updates"])


def importance_loss(logits: torch.Tensor, labels: str) -> torch.Tensor:
    """The loss whose squared gradients are the importance: cross-entropy against arg-max
    pseudo-labels. ``"per_sample"``: each row's own arg-max, mean over the batch. ``"upstream"``:
    the batch flattened to one row of ``B * C`` logits (``output.view(1, -1)``) and one arg-max
    over it, i.e. ``-log softmax`` of the batch's single largest logit among all ``B * C``."""
    if labels not in IMPORTANCE_LABELS:
        raise ValueError(f"importance labels must be one of {IMPORTANCE_LABELS}, got {labels!r}")
    if labels == "upstream":
        logits = logits.reshape(1, -1)
    return F.cross_entropy(logits, logits.detach().argmax(1))


@dataclass
class BufferEntry:
    """One buffered mini-batch and its loss when last evaluated (a float, read once per step)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    loss: float


class HardBuffer:
    """Upstream's hard buffer: the ``size`` highest-loss mini-batches among the current batch and
    the buffer itself, refreshed after every step (whole batches, as upstream keeps them)."""

    def __init__(self, size: int) -> None:
        self.size = check_int("hard_buffer_size", size, 0)
        self.entries: list[BufferEntry] = []

    def update(self, candidates: Sequence[BufferEntry]) -> None:
        """Keep the ``size`` candidates with the highest loss (ties keep the earlier one)."""
        order = sorted(range(len(candidates)), key=lambda i: -candidates[i].loss)
        self.entries = [candidates[i] for i in order[: self.size]]

    def __len__(self) -> int:
        return len(self.entries)


#: How the hard-buffer refresh pairs batches with losses: upstream's shifted zip, or aligned.
BUFFER_PAIRINGS = ("upstream", "aligned")


def hard_buffer_candidates(
    batch: tuple[torch.Tensor, torch.Tensor],
    buffered: Sequence[BufferEntry],
    batch_loss: float,
    buffered_losses: Sequence[float],
    pairing: str,
) -> list[BufferEntry]:
    """The candidates of one hard-buffer refresh (for :meth:`HardBuffer.update`): the stream
    batch and the buffered batches, each with the loss it is ranked by.

    ``"aligned"``: each batch with its own loss (ties keep the stream batch first).
    ``"upstream"``: upstream zips the losses ``[L(x), L(h_0), ..., L(h_{k-1})]`` with the batches
    ``[h_0, ..., h_{k-1}, x]``, so ``h_0`` is ranked by the stream batch's loss, ``h_i`` by
    ``h_{i-1}``'s and the stream batch by ``h_{k-1}``'s; and its ``reversed(sorted(...))`` keeps
    the later of tied candidates, hence the reversed list here.
    """
    if pairing not in BUFFER_PAIRINGS:
        raise ValueError(f"hard-buffer pairing must be one of {BUFFER_PAIRINGS}, got {pairing!r}")
    if len(buffered_losses) != len(buffered):
        raise ValueError(f"{len(buffered)} buffered batches but {len(buffered_losses)} losses")
    losses = [batch_loss, *buffered_losses]
    if pairing == "aligned":
        batches = [batch, *((e.inputs, e.labels) for e in buffered)]
        return [BufferEntry(x, y, loss) for (x, y), loss in zip(batches, losses)]
    batches = [*((e.inputs, e.labels) for e in buffered), batch]
    return [BufferEntry(x, y, loss) for (x, y), loss in zip(batches, losses)][::-1]

"""The pure pieces of Online-LoRA (Wei et al., WACV 2025): LoRA on a ViT's q and v projections
with an exact merge, the loss-plateau detector, the importance-weighted regulariser and the hard
buffer. Torch and the standard library only; ``methods/olora.py`` wires them into the loop.

Written from a reading of christina200/online-lora-official (commit 96e7de0f,
``Si-blurry/online_lora.py``, ``Si-blurry/utils/lora.py``, ``Disjoint/engine.py``); no code copied.
Where upstream's code does something other than what the paper describes, both exist here, and
the method's config picks (``methods/olora.py``; defaults reproduce upstream):

* **Merge** (:class:`LoRAQKV`, ``merge``). Upstream "merges" by adding the new factors to the old
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

import torch
import torch.nn.functional as F
from torch import nn

from .checks import check_int, check_real

#: How :meth:`LoRAQKV.merge_` folds a finished adapter in: upstream's factor sums, or exactly.
LORA_MERGES = ("upstream", "exact")
#: The pseudo-labels of the importance loss: upstream's one arg-max per batch, or per sample.
IMPORTANCE_LABELS = ("upstream", "per_sample")


class LoRAQKV(nn.Module):
    """A fused ``qkv`` projection (``nn.Linear(d, 3d)``, timm's layout) plus rank-``r`` deltas on
    its q and v thirds: ``q += B_q A_q x``, ``v += B_v A_v x`` (k untouched, as upstream).

    ``A`` starts Kaiming-uniform and ``B`` at zero (LoRA's init), so a fresh adapter leaves the
    projection unchanged. :meth:`merge_` folds the adapter in and restarts it: ``merge="exact"``
    adds ``B A`` to the frozen weight; ``merge="upstream"`` adds the factors to frozen merged
    factors (buffers ``merged_*``, zero at first), which then act as ``q += B_m A_m x`` beside
    the trainable adapter, as upstream's ``w_As``/``w_Bs`` do.
    """

    def __init__(self, qkv: nn.Linear, rank: int, merge: str = "exact") -> None:
        super().__init__()
        rank = check_int("LoRA rank", rank, 1)
        if merge not in LORA_MERGES:
            raise ValueError(f"LoRA merge must be one of {LORA_MERGES}, got {merge!r}")
        self.merge = merge
        if qkv.out_features != 3 * qkv.in_features:
            raise ValueError(
                f"LoRAQKV wraps a fused qkv projection d -> 3d; got {qkv.in_features} -> "
                f"{qkv.out_features}"
            )
        self.qkv = qkv
        self.dim = qkv.in_features
        factory = {"device": qkv.weight.device, "dtype": qkv.weight.dtype}
        self.a_q = nn.Parameter(torch.empty(rank, self.dim, **factory))
        self.b_q = nn.Parameter(torch.empty(self.dim, rank, **factory))
        self.a_v = nn.Parameter(torch.empty(rank, self.dim, **factory))
        self.b_v = nn.Parameter(torch.empty(self.dim, rank, **factory))
        if merge == "upstream":  # frozen sums of the merged factors (checkpointed as buffers)
            for name in ("merged_a_q", "merged_a_v"):
                self.register_buffer(name, torch.zeros(rank, self.dim, **factory))
            for name in ("merged_b_q", "merged_b_v"):
                self.register_buffer(name, torch.zeros(self.dim, rank, **factory))
        self.reset_adapter()

    def lora_parameters(self) -> list[nn.Parameter]:
        """The trainable factors, in a fixed order (A_q, B_q, A_v, B_v)."""
        return [self.a_q, self.b_q, self.a_v, self.b_v]

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """A fresh adapter (in place, so optimiser state keyed by the parameters stays valid)."""
        for a, b in ((self.a_q, self.b_q), (self.a_v, self.b_v)):
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            nn.init.zeros_(b)

    def delta_weight(self) -> torch.Tensor:
        """``[3d, d]``: what the adapter adds to the projection weight (zero rows for k)."""
        zeros = torch.zeros(self.dim, self.dim, device=self.a_q.device, dtype=self.a_q.dtype)
        return torch.cat([self.b_q @ self.a_q, zeros, self.b_v @ self.a_v])

    @torch.no_grad()
    def merge_(self) -> None:
        """Fold the adapter in (exact: W <- W + B A; upstream: A_m += A, B_m += B) and start a
        fresh one."""
        if self.merge == "exact":
            self.qkv.weight.add_(self.delta_weight().to(self.qkv.weight.dtype))
        else:
            self.merged_a_q.add_(self.a_q)
            self.merged_b_q.add_(self.b_q)
            self.merged_a_v.add_(self.a_v)
            self.merged_b_v.add_(self.b_v)
        self.reset_adapter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.dim, dim=-1)
        if self.merge == "upstream":
            q = q + (x @ self.merged_a_q.T) @ self.merged_b_q.T
            v = v + (x @ self.merged_a_v.T) @ self.merged_b_v.T
        q = q + (x @ self.a_q.T) @ self.b_q.T
        v = v + (x @ self.a_v.T) @ self.b_v.T
        return torch.cat([q, k, v], dim=-1)


def add_lora(
    vit: nn.Module, rank: int, blocks: Sequence[int] | None = None, merge: str = "exact"
) -> list[LoRAQKV]:
    """Freeze ``vit`` and wrap ``vit.blocks[i].attn.qkv`` with :class:`LoRAQKV` for each ``i`` in
    ``blocks`` (``None``: every block, upstream's default) and the given ``merge``. Returns the
    adapters in block order."""
    if not hasattr(vit, "blocks"):
        raise TypeError(f"add_lora needs a timm-style ViT with .blocks; got {type(vit).__name__}")
    count = len(vit.blocks)
    chosen = list(range(count)) if blocks is None else sorted(set(blocks))
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
    if bad or not chosen:
        raise ValueError(
            f"LoRA blocks must be distinct block indices in [0, {count - 1}] (or null for all), "
            f"got {blocks!r}"
        )
    vit.requires_grad_(False)
    adapters = []
    for i in chosen:
        attn = vit.blocks[i].attn
        if not isinstance(getattr(attn, "qkv", None), nn.Linear):
            raise TypeError(f"block {i} has no fused nn.Linear attn.qkv to adapt")
        attn.qkv = LoRAQKV(attn.qkv, rank, merge)
        adapters.append(attn.qkv)
    return adapters


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

    @torch.no_grad()
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

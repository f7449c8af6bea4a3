"""DGR online (``dgr_online``): gradient reweighting for class imbalance, with experience replay.

DGR (He, "Gradient Reweighting: Towards Imbalanced Class-Incremental Learning", CVPR 2024;
PILOT's ``models/dgr.py``) fine-tunes the whole ViT with a linear head and an exemplar memory.
What the online port keeps:

* **Logit adjustment** (upstream ``regularized_cn``): the cross-entropy reads
  ``logits + log(prior)``, ``prior`` the label frequencies of what was trained on. Upstream counts
  the task's training set (new data plus exemplars); online, the labels of every training batch
  (stream plus replayed samples) since the last consolidation.
* **Gradient reweighting**: after backward, the per-class norms ``||grad W_c||`` of the head's
  rows are added to a running sum ``G`` (restarted at each consolidation, as upstream restarts it
  with each task) and the rows of the weight and bias gradients are scaled by
  :func:`class_weights`: ``min(G) / G_c`` before the first consolidation (upstream's first task),
  then old and new classes each within their group, times ``rs_old`` / ``rs_new`` (its later
  tasks). It runs in :meth:`DGROnline.transform_gradients`, before FGH: FGH pairs and scales the
  reweighted gradient, so the applied gradient is ``alpha * w * g``.
* **Memory**: the loop's reservoir (``ReplayMixin``) at upstream's ``memory_size`` of 2,000.

The default trigger, ``new_classes``, fires at each task boundary of a clear stream whose tasks
hold ``consolidation_new_classes`` classes. Upstream's distillation from the previous task's
network is not ported (docs/methods.md says why).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checks import integer, real
from ..core.masks import mask_logits
from ..engine.adapter import ConfigKey, StepOutput, UpstreamDifference
from ..engine.registry import register_method
from .finetune import EROnline

#: Upstream's exps/dgr.json: ``memory_size`` 2000 (ER's rows keep 1,000).
DGR_MEMORY_SIZE = 2000


def _min_ratio(grad_sums: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """``min(G over group) / G_c`` inside ``group``, 1 outside it."""
    floor = grad_sums.masked_fill(~group, float("inf")).min()
    return torch.where(group, floor / grad_sums.clamp_min(torch.finfo(grad_sums.dtype).tiny), 1.0)


def class_weights(
    grad_sums: torch.Tensor, known: torch.Tensor | None = None, gammar_r: float = 1.0
) -> torch.Tensor:
    """DGR's per-class gradient weights from the accumulated row-gradient norms ``G``.

    Without ``known`` classes (upstream's first task): ``min(G) / G_c``. With them (classes seen
    before the last consolidation, upstream's ``_known_classes``): old and new classes are
    normalised each within its group, then scaled by ``rs_old = min(1, mean_new / mean_old)`` and
    ``rs_new = min(1, mean_new / mean_old * exp(-gammar_r * known / total))``; while one group
    has no gradient yet, the first-task rule. Classes whose sum is 0 (no gradient yet) are left
    out of minima and means (their gradient is 0 anyway). No host sync."""
    active = grad_sums > 0
    single = _min_ratio(grad_sums, active)
    if known is None:
        return single
    old, new = active & known, active & ~known
    within = torch.where(known, _min_ratio(grad_sums, old), _min_ratio(grad_sums, new))
    mean_old = (grad_sums * old).sum() / old.sum().clamp_min(1)
    mean_new = (grad_sums * new).sum() / new.sum().clamp_min(1)
    ratio = mean_new / mean_old.clamp_min(torch.finfo(grad_sums.dtype).tiny)
    share = (known.sum() / (known | active).sum().clamp_min(1)).to(grad_sums.dtype)
    rs_old = ratio.clamp(max=1.0)
    rs_new = (ratio * torch.exp(-gammar_r * share)).clamp(max=1.0)
    grouped = torch.where(active, within * torch.where(known, rs_old, rs_new), 1.0)
    return torch.where(old.any() & new.any(), grouped, single)


def adjusted_logits(logits: torch.Tensor, label_counts: torch.Tensor) -> torch.Tensor:
    """``logits + log(prior)``, ``prior`` the normalised label counts (upstream's
    ``regularized_cn``); a class never trained on gets ``-inf``, as upstream's ``log(0)``."""
    prior = label_counts / label_counts.sum()
    return logits + torch.log(prior).to(logits.dtype)


@register_method("dgr_online")
class DGROnline(EROnline):
    """Full fine-tuning with logit adjustment, per-class gradient reweighting and replay."""

    paper_name: ClassVar[str] = "DGR"
    base_model_name: ClassVar[str] = "dgr"  # PILOT's transforms for its DGR learner
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "er_memory_size": ConfigKey(
            DGR_MEMORY_SIZE,
            "replay reservoir size (DGR's memory_size: 2000; ER's rows: 1000)",
            check=integer(0),
        ),
        "gammar_r": ConfigKey(
            1.0,
            "DGR's new-class damping exp(-gammar_r * known / total) (upstream key and value: 1)",
            check=real(0),
        ),
    }
    upstream_differences: ClassVar[tuple[UpstreamDifference, ...]] = (
        UpstreamDifference(
            "no_distillation",
            "No distillation from the previous task's network, where upstream adds lambda times "
            "the KD loss to the loss and ratio_kd times its gradient to the old classes' head "
            "rows.",
            "It needs a frozen copy of the network taken at each task end, which the engine "
            "teacher of the issue on PILOT's classic methods will keep; it is ported there.",
        ),
        UpstreamDifference(
            "running_label_prior",
            "The logit adjustment's prior counts the labels trained on since the last "
            "consolidation (stream and replay), batch by batch, where upstream's is the whole "
            "task's label distribution with its exemplars.",
            "Online a task's data is not known before it has streamed past.",
        ),
        UpstreamDifference(
            "reservoir_memory",
            "Replay draws from a reservoir of stream samples of upstream's size (2,000), where "
            "upstream keeps herding-selected exemplars per class, chosen at each task end.",
            "There is no task end to select exemplars at; the reservoir is the paper's ER memory.",
        ),
    )
    #: The smoke stream's tasks hold 4 classes: a firing at each of its task boundaries.
    smoke_overrides: ClassVar[dict[str, Any]] = {"consolidation_new_classes": 4}
    #: In a clear stream with consolidation_new_classes = a task's classes (10, as CIFAR-100's
    #: 10 tasks), it fires at each task boundary: upstream's per-task statistics.
    default_consolidation: ClassVar[str] = "new_classes"
    # Per-class statistics (on the head's device, made at the first use; build_network starts
    # them afresh): G and the label counts since the last consolidation (float64), the classes
    # trained on so far and those seen before the last consolidation (bool).
    grad_sums: torch.Tensor | None = None
    label_counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    known: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # the last step's w, for the report
    resets: int = 0

    def build_network(self, args: dict) -> nn.Module:
        self.clear_statistics()
        return super().build_network(args)

    def clear_statistics(self) -> None:
        """A new network starts with no statistics (made on the head's device at first use)."""
        self.grad_sums = self.label_counts = self.seen = self.known = self.weights = None
        self.resets = 0

    def _statistics(self, network: nn.Module) -> dict[str, torch.Tensor]:
        if self.grad_sums is None:
            fc = self.classifier(network)
            zeros = torch.zeros(fc.out_features, dtype=torch.float64, device=fc.weight.device)
            self.grad_sums, self.label_counts = zeros, zeros.clone()
            self.seen, self.known = zeros.bool(), zeros.bool()
        return {
            "grad_sums": self.grad_sums,
            "label_counts": self.label_counts,
            "seen": self.seen,
            "known": self.known,
        }

    def classification_loss(
        self,
        network: nn.Module,
        out: StepOutput,
        labels: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Logit-adjusted cross-entropy; this step's labels (stream and replay) join the counts
        first, so every target's prior is positive. Called once per training step only."""
        stats = self._statistics(network)
        counts = stats["label_counts"]
        # index_add_, not bincount: bincount reads the largest label back to the host (a sync).
        counts.index_add_(0, labels, torch.ones_like(labels, dtype=counts.dtype))
        stats["seen"][labels] = True
        logits = adjusted_logits(out.logits, counts)
        return F.cross_entropy(logits if mask is None else mask_logits(logits, mask), labels)

    @torch.no_grad()
    def transform_gradients(self, network: nn.Module) -> None:
        """Add this step's row-gradient norms to ``G`` and scale each row by its weight
        (:func:`class_weights`): upstream's rule, on the head's gradient before FGH."""
        fc = self.classifier(network)
        if fc.weight.grad is None:
            return
        stats = self._statistics(network)
        stats["grad_sums"] += fc.weight.grad.norm(dim=1).to(torch.float64)
        self.weights = class_weights(
            stats["grad_sums"], stats["known"], float(self.args.get("gammar_r", 1.0))
        )
        fc.weight.grad.mul_(self.weights.to(fc.weight.grad.dtype)[:, None])
        if fc.bias is not None and fc.bias.grad is not None:
            fc.bias.grad.mul_(self.weights.to(fc.bias.grad.dtype))

    def consolidate(self, network: nn.Module, firing: int) -> tuple[nn.Parameter, ...]:
        """Upstream's task start: the classes trained on so far become the old group, and ``G``
        and the label counts start again. No parameter restarts."""
        stats = self._statistics(network)
        stats["known"].copy_(stats["seen"])
        stats["grad_sums"].zero_()
        stats["label_counts"].zero_()
        self.resets += 1
        return ()

    def extra_state(self, network: nn.Module) -> dict[str, Any]:
        stats = {name: t.clone() for name, t in self._statistics(network).items()}
        return {
            **stats,
            "weights": None if self.weights is None else self.weights.clone(),
            "resets": self.resets,
        }

    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        for name, target in self._statistics(network).items():
            if tuple(state[name].shape) != tuple(target.shape):
                raise ValueError(
                    f"the checkpoint's DGR {name} cover {state[name].numel()} classes, the "
                    f"network's head {target.numel()}: resume with the config that wrote it"
                )
            target.copy_(state[name])
        weights = state.get("weights")
        self.weights = None if weights is None else weights.to(target.device).clone()
        self.resets = int(state["resets"])

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {"resets": self.resets}
        if self.grad_sums is not None and self.known is not None and self.weights is not None:
            active = self.grad_sums > 0
            weights = self.weights[active]
            report.update(
                known_classes=int(self.known.sum()),
                classes_reweighted=int(active.sum()),
                weight_min=float(weights.min()) if len(weights) else 1.0,
                weight_mean=float(weights.mean()) if len(weights) else 1.0,
            )
        return {"dgr": report}

"""DGR online (``dgr_online``): gradient reweighting for class imbalance, with distillation and
herding replay.

DGR (He, "Gradient Reweighting: Towards Imbalanced Class-Incremental Learning", CVPR 2024;
PILOT's ``models/dgr.py``) fine-tunes the whole ViT with a linear head and an exemplar memory.
What the online port keeps:

* **Logit adjustment** (upstream ``regularized_cn``): the cross-entropy reads
  ``logits + log(prior)``, ``prior`` the label frequencies of what was trained on. Upstream counts
  the task's training set (new data plus exemplars); online, the labels of every training batch
  (stream plus replayed samples) since the last consolidation.
* **Distillation** (upstream ``_KD_loss``, from the second task on): ``lambda * known / new``
  times the KD loss at temperature ``T`` between the logits of the classes known at the last
  firing and those of the engine teacher (the network at that firing,
  ``Consolidation(teacher=True)``);
  ``new`` counts the classes first seen since the firing (upstream: the task's classes).
* **Gradient reweighting**: after backward, the head's gradient (the cross-entropy's, and L_P's
  with + P; the distillation's reaches the backbone only) has its row norms added to a running
  sum ``G`` (restarted at each consolidation, as upstream restarts it with each task) and its
  rows scaled by :func:`class_weights`; from the first firing on, the distillation's own head
  gradient is added, scaled by :func:`kd_ratio` (upstream replaces the head's gradient rows with
  ``w * g_ce + ratio_kd * g_kd``). It runs in :meth:`DGROnline.after_backward`, before FGH,
  which pairs and scales the result.
* **Memory**: declared replay (``replay = Replay(...)``): upstream's herding memory of
  ``memory_size`` 2,000, a quota of 2000 // classes seen, re-picked online.

The default trigger, ``new_classes``, fires at each task boundary of a clear stream whose tasks
hold ``consolidation_new_classes`` classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.checks import real
from ..core.lazy import F, nn, no_grad, torch
from ..engine.adapter import (
    Autocast,
    ConfigKey,
    Consolidated,
    Consolidation,
    Replay,
    StepOutput,
    TrainingBatch,
)
from ..engine.backbone_names import PLAIN_VIT
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.differences import (
    ONE_LINEAR_HEAD,
    ONLINE_HERDING,
    REPLAY_LOGIT_MASK,
    TEACHER_AT_FIRING,
)
from ..engine.registry import register_method
from ..engine.teacher import distillation_loss
from .finetune import FinetuneOnline

#: Upstream's exps/dgr.json: ``memory_size`` 2000 (``fixed_memory`` false), ``lambda`` 1, ``T`` 2.
DGR_MEMORY_SIZE = 2000
DGR_LAMBDA = 1.0
DGR_TEMPERATURE = 2.0


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
    ``rs_new = min(1, mean_new / mean_old * exp(-gammar_r * known / total))``, ``total`` the known
    classes and those trained on since (the classes seen so far); while one group has no gradient
    yet, the first-task rule. Classes whose sum is 0 (no gradient yet) are left out of minima and
    means (their gradient is 0 anyway). No host sync."""
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


def distillation_weight(known: torch.Tensor, seen: torch.Tensor, lam: float) -> torch.Tensor:
    """Upstream's ``lambda * known / (total - known)`` with ``total`` the classes seen so far
    (bool ``[C]`` masks): ``total - known`` counts the classes first seen since the last firing,
    at least 1 (a trigger other than ``new_classes`` may fire before any new class). No sync."""
    new = (seen & ~known).sum().clamp_min(1)
    return lam * known.sum() / new


def kd_ratio(weighted_norms: torch.Tensor, kd_weight_grad: torch.Tensor) -> torch.Tensor:
    """Upstream's ``ratio_kd = ||w_c * ||g_ce,c|| || / || ||g_kd,c|| ||``: the norm of the
    reweighted cross-entropy row norms (``weighted_norms``) over that of the distillation's
    weight-gradient rows. 0 where the distillation has no head gradient at all (one known class),
    where upstream's division by 0 gives NaN. At the step right after a firing the network is
    its teacher and the gradient is rounding noise, which the ratio scales up as upstream's
    does at each task's first batch."""
    numerator = weighted_norms.norm()
    denominator = kd_weight_grad.norm(dim=1).to(numerator.dtype).norm()
    tiny = torch.finfo(numerator.dtype).tiny
    return torch.where(denominator > 0, numerator / denominator.clamp_min(tiny), 0.0)


@dataclass
class HeadDistillation:
    """One step's distillation gradient on the head, from :meth:`DGROnline.loss_terms` to
    :meth:`DGROnline.after_backward` (detached; dropped there, or by the next step's
    ``loss_terms`` when a non-finite step skipped the transform)."""

    weight: torch.Tensor  # d KD / d W of the unweighted KD loss
    bias: torch.Tensor | None  # d KD / d b


CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="DGR",
    # The smoke stream's tasks hold 4 classes: a firing, and a teacher, at each task boundary.
    smoke_overrides={"consolidation_new_classes": 4},
    # No hp_grid row for DGR; the whole-ViT rows that the paper searched low enough, ER's, chose
    # 5e-5, and both whole-ViT rows collapse at 5e-3 (docs/methods.md).
    default_lr=5e-5,
    upstream_differences=(
        UpstreamDifference(
            "running_label_prior",
            "The logit adjustment's prior counts the labels trained on since the last "
            "consolidation (stream and replay), batch by batch, where upstream's is the whole "
            "task's label distribution with its exemplars.",
            "Online a task's data is not known before it has streamed past.",
        ),
        UpstreamDifference(
            "new_classes_counted_online",
            "The distillation weight lambda * known / (total - known) counts as total the "
            "classes seen so far, so total - known grows from 1 as a task's classes appear "
            "(at least 1), where upstream's total is known plus the task's whole increment.",
            "Online a task's classes are not known before they appear; rs_new's known / total "
            "counts the same classes.",
        ),
        UpstreamDifference(
            "kd_ratio_without_gradient",
            "ratio_kd is 0 when the distillation's head gradient is exactly 0 (one known class: "
            "the softmax over one logit is 1 for student and teacher alike), where upstream "
            "divides by 0 and writes NaN into the known class's head row.",
            "A trigger may fire once one class has been seen (Si-Blurry, every_n_samples), and a "
            "NaN head would end the run.",
        ),
        ONLINE_HERDING,
        REPLAY_LOGIT_MASK,
        ONE_LINEAR_HEAD,
        TEACHER_AT_FIRING,
    ),
)


@register_method("dgr_online", card=CARD)
class DGROnline(FinetuneOnline):
    """Full fine-tuning with logit adjustment, distillation, per-class gradient reweighting and
    herding replay."""

    base_model_name: ClassVar[str] = "dgr"  # PILOT's transforms for its DGR learner
    replay: ClassVar[Replay | None] = Replay(
        DGR_MEMORY_SIZE,
        memory="herding",
        why="DGR's memory_size 2000, fixed_memory false: a quota of 2000 // classes seen",
    )
    consolidation: ClassVar[Consolidation] = Consolidation(trigger="new_classes", teacher=True)
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "gammar_r": ConfigKey(
            1.0,
            "DGR's new-class damping exp(-gammar_r * known / total) (upstream key and value: 1)",
            check=real(0),
        ),
        "lambda": ConfigKey(
            DGR_LAMBDA,
            "DGR's distillation weight: lambda * known / new times the KD loss (upstream key "
            "and value: 1)",
            check=real(0),
        ),
        "T": ConfigKey(
            DGR_TEMPERATURE,
            "distillation temperature (upstream's key and value: 2)",
            check=real(positive=True),
        ),
    }
    #: In a clear stream with consolidation_new_classes = a task's classes (10, as CIFAR-100's
    #: 10 tasks), it fires at each task boundary: upstream's per-task statistics and teacher.
    # Per-class statistics (on the head's device, made at the first use; build_network starts
    # them afresh): G and the label counts since the last consolidation (float64), the classes
    # trained on so far and those seen before the last consolidation (bool).
    grad_sums: torch.Tensor | None = None
    label_counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    known: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # the last step's w, for the report
    resets: int = 0
    distillation: HeadDistillation | None = None  # this step's, between loss and transform

    def build_network(self, args: dict) -> nn.Module:
        self.clear_statistics()
        return super().build_network(args)

    def clear_statistics(self) -> None:
        """A new network starts with no statistics (made on the head's device at first use)."""
        self.grad_sums = self.label_counts = self.seen = self.known = self.weights = None
        self.distillation = None
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

    def loss_terms(
        self, network: nn.Module, out: StepOutput, batch: TrainingBatch
    ) -> dict[str, torch.Tensor]:
        """``ce``: the logit-adjusted cross-entropy; this step's labels (stream and replay) join
        the counts first, so every target's prior is positive. Called once per training step
        only. Then upstream's distillation once a firing has taken a teacher: ``lambda * known /
        new`` times ``_KD_loss`` over the known classes (:func:`distillation_weight`).

        Upstream's head gets the distillation's gradient apart from the loss's (it replaces the
        head's rows after backward), so the term is split: the loss's term reads the head's
        output with the head held fixed (``features @ W.detach().T + b.detach()``, the same
        logits), so its gradient reaches the backbone alone, as upstream's ``loss.backward()``
        gives it; the head's gradient of the KD loss alone is taken here from the head's part of
        the graph (``autograd.grad``, the graph kept for the loop's backward) and kept for
        :meth:`after_backward`. The head's ``.grad`` then holds exactly the other terms'."""
        stats = self._statistics(network)
        counts = stats["label_counts"]
        # index_add_, not bincount: bincount reads the largest label back to the host (a sync).
        counts.index_add_(0, batch.labels, torch.ones_like(batch.labels, dtype=counts.dtype))
        stats["seen"][batch.labels] = True
        ce = F.cross_entropy(batch.masked(adjusted_logits(out.logits, counts)), batch.labels)
        self.distillation = None  # a skipped step's is never read
        if batch.teacher is None:
            return {"ce": ce}
        temperature = float(self.args.get("T", DGR_TEMPERATURE))
        teacher = batch.teacher.logits
        fc = self.classifier(network)
        kd = distillation_loss(out.logits, teacher, batch.known, temperature)
        head = [p for p in (fc.weight, fc.bias) if p is not None]
        grads = torch.autograd.grad(kd, head, retain_graph=True)
        self.distillation = HeadDistillation(grads[0], grads[1] if len(grads) > 1 else None)
        bias = None if fc.bias is None else fc.bias.detach()
        held = F.linear(out.features, fc.weight.detach(), bias)  # DGR's logits: fc(features)
        scale = distillation_weight(
            batch.known, batch.seen, float(self.args.get("lambda", DGR_LAMBDA))
        )
        return {"ce": ce, "kd": scale * distillation_loss(held, teacher, batch.known, temperature)}

    @no_grad
    def after_backward(self, network: nn.Module, autocast: Autocast) -> dict[str, torch.Tensor]:
        """Upstream's head gradient: the loss's (the cross-entropy's, and L_P's with + P; the
        distillation's reaches the backbone only, :meth:`loss_terms`) joins ``G`` by its row
        norms and is scaled by its class weights (:func:`class_weights`); the distillation's is
        added times :func:`kd_ratio`. The rest of the network keeps the loss's gradient. Runs
        before FGH."""
        fc = self.classifier(network)
        distillation, self.distillation = self.distillation, None
        if fc.weight.grad is None:
            return {}
        weight_grad = fc.weight.grad
        bias_grad = None if fc.bias is None else fc.bias.grad
        stats = self._statistics(network)
        norms = weight_grad.norm(dim=1).to(torch.float64)
        stats["grad_sums"] += norms
        self.weights = class_weights(
            stats["grad_sums"], stats["known"], float(self.args.get("gammar_r", 1.0))
        )
        weight_grad.mul_(self.weights.to(weight_grad.dtype)[:, None])
        if bias_grad is not None:
            bias_grad.mul_(self.weights.to(bias_grad.dtype))
        if distillation is not None:
            ratio = kd_ratio(self.weights * norms, distillation.weight)
            weight_grad.add_(ratio.to(weight_grad.dtype) * distillation.weight)
            if bias_grad is not None and distillation.bias is not None:
                bias_grad.add_(ratio.to(bias_grad.dtype) * distillation.bias)
        return {}

    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Upstream's task start: the classes trained on so far become the old group, and ``G``
        and the label counts start again (the loop took the teacher just before). No parameter
        restarts."""
        stats = self._statistics(network)
        stats["known"].copy_(stats["seen"])
        stats["grad_sums"].zero_()
        stats["label_counts"].zero_()
        self.resets += 1
        return Consolidated()

    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        stats = {name: t.clone() for name, t in self._statistics(network).items()}
        return {
            **stats,
            "weights": None if self.weights is None else self.weights.clone(),
            "resets": self.resets,
        }

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
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
        self.distillation = None

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

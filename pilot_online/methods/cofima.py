"""CoFiMA online (``cofima_online``): Continual Fine-tuning with Model Averaging (Marouf et al.,
2024), PILOT's ``models/cofima.py``, task-free.

Upstream CoFiMA is SLCA (slow learner, classifier alignment) plus model averaging. At each task
end: the diagonal Fisher of the trained model on the task's data (mean over batches of the squared
gradient of the CE, clamped at ``fishermax`` = 1e-4); from the second task on, the weights
(backbone and head) are averaged with the previous task's final ones, per scalar weighted by the
two Fishers (:func:`fisher_average`); then the new classes' means and covariances, and from the
second task on, classifier alignment (CA) of the head on features drawn from every class's
Gaussian.

Online, :class:`CoFiMAOnline` is :class:`~pilot_online.methods.slca.SLCAOnline` (its slow learner
through the loop's per-group LRs, its running class Gaussians and its CA, reused) plus the merge.
A consolidation firing closes a *period* (the stream since the last firing) and stands for a task
end. The Fisher is accumulated at every step of the period from the gradient the step trains on
(the whole loss, CE plus P's term when on, before FGH reweights it: read in
:meth:`CoFiMAOnline.after_backward`), its mean over the period's steps clamped at
``cofima_fisher_max``. The merged and aligned weights after the last firing and that period's
Fisher are kept (``state_dict``) for the next merge.

Which part of upstream's task end changes training: upstream backs the head up before the merge
(``fc.backup()``), merges, aligns, evaluates and restores the head (``fc.recall()`` in
``after_task``), so the merged backbone trains on while the merged, aligned head serves
evaluation and the next merge. A firing does the same (:meth:`CoFiMAOnline.consolidate`). Online
that firing comes with the next task's first batch, after the task-end evaluation, so
:meth:`CoFiMAOnline.evaluation` shows evaluation the merged, aligned model a firing now
would make.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ..core.checks import boolean, real
from ..core.lazy import nn, no_grad, torch
from ..engine.adapter import (
    Autocast,
    ConfigKey,
    Consolidated,
    Consolidation,
    Evaluation,
    trained_parameters,
)
from ..engine.backbone_names import PLAIN_VIT, VIT_B16_PARAMETERS, VIT_B16_WIDTH
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.checkpoint import tensors_to
from ..engine.registry import register_method
from .slca import CARD as SLCA_CARD
from .slca import SLCAOnline


@no_grad
def fisher_average(
    theta0: Sequence[torch.Tensor],
    fisher0: Sequence[torch.Tensor],
    theta1: Sequence[torch.Tensor],
    fisher1: Sequence[torch.Tensor],
    alpha: float,
) -> list[torch.Tensor]:
    """Upstream's ``interpolate_weights(..., fisher=True)`` on the keys both models hold: per
    scalar ``((1-a) F0 t0 + a F1 t1) / ((1-a) F0 + a F1)``, in float64 and returned in each
    ``t1``'s dtype. Why float64: Fishers are mean squared gradients, at times float32 subnormals,
    whose products with the weights lose their digits or underflow to 0 in float32 and shrink
    the weight (as would a float32 denominator clamped away from 0); in float64 the formula's
    value comes out. Where both Fishers are 0 upstream divides 0 by 0 (NaN); here the weight
    keeps ``t1``, the current value."""
    merged = []
    for t0, f0, t1, f1 in zip(theta0, fisher0, theta1, fisher1):
        f0, f1 = f0.double(), f1.double()
        denominator = (1 - alpha) * f0 + alpha * f1
        numerator = (1 - alpha) * f0 * t0.double() + alpha * f1 * t1.double()
        merged.append(torch.where(denominator > 0, numerator / denominator, t1.double()).to(t1))
    return merged


def cofima_state_bytes(args: Mapping[str, Any]) -> int:
    """SLCA's class statistics and three fp32 copies of the trainable weights (the anchor,
    the previous Fisher and the period's Fisher sum)."""
    weights = VIT_B16_PARAMETERS + int(args["nb_classes"]) * (VIT_B16_WIDTH + 1)
    return SLCA_CARD.memory_bytes(args) + 3 * 4 * weights


CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="CoFiMA",
    # 4 classes per smoke task: a firing per task; SLCA's short CA (CI time).
    smoke_overrides={
        "consolidation_new_classes": 4,
        "ca_samples_per_class": 16,
        "ca_epochs": 1,
    },
    # SLCA's (class statistics, sessions, one head: upstream's ``cofima.py`` repeats SLCA's code
    # there) and the merge's own.
    upstream_differences=(
        *SLCA_CARD.upstream_differences,
        UpstreamDifference(
            "fisher_from_training_steps",
            "A period's Fisher is the mean over its training steps of the squared gradient each "
            "step trained on (the whole loss, P's term included, as the weights move), where "
            "upstream passes the task's data once more through the trained model with the CE.",
            "One pass keeps no data for a second pass; each step's gradient is upstream's "
            "estimator (a batch's squared CE gradient) at the weights the step saw.",
        ),
        UpstreamDifference(
            "zero_fisher_keeps_current",
            "Where both Fishers of a scalar are 0 the merge keeps the current value; upstream "
            "divides 0 by 0 (NaN).",
            "A NaN weight would make every later prediction NaN.",
        ),
        UpstreamDifference(
            "merge_in_float64",
            "The Fisher average is computed in float64, where upstream's float32 products of "
            "subnormal Fishers and weights lose digits or underflow to 0 and shrink the weight.",
            "A parameter that barely gets gradient has a mean squared gradient below float32's "
            "normal range (1e-38); float64 gives the formula's value there.",
        ),
        UpstreamDifference(
            "unseen_class_rows_kept",
            "Head rows of classes never seen keep their current value in the merge.",
            "The online head holds every class of the stream from the start; upstream has no "
            "rows for classes to come.",
        ),
    ),
    state_bytes=cofima_state_bytes,
)


@register_method("cofima_online", card=CARD)
class CoFiMAOnline(SLCAOnline):
    """CoFiMA: SLCA (slow learner, class Gaussians, classifier alignment) whose weights are
    Fisher-averaged with the last firing's at each firing (module docstring)."""

    base_model_name: ClassVar[str] = "cofima"
    #: Upstream merges once per task: a firing per ``consolidation_new_classes`` new classes is
    #: the stream's sign of one; a merge every N samples would average several times per task,
    #: each pulling the weights back towards the last firing's.
    consolidation: ClassVar[Consolidation] = Consolidation(trigger="new_classes")
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        **SLCAOnline.config_keys,
        "wt_lambda": ConfigKey(
            0.4, "weight of the current model in the average (upstream 0.4)", check=real(0, 1)
        ),
        "fisher_weighting": ConfigKey(
            True, "weight the average per scalar by the Fishers (upstream true)", check=boolean
        ),
        "cofima_fisher_max": ConfigKey(
            1e-4,
            "clamp of the period's mean squared gradient (upstream's fishermax 1e-4)",
            check=real(positive=True),
        ),
    }

    def build_network(self, args: dict) -> nn.Module:
        network = super().build_network(args)  # SLCANet, the online head, SLCA's statistics
        self.setup_state(network)
        return network

    def setup_state(self, network: nn.Module) -> None:
        """The merge's state, empty (tests call it on tiny networks)."""
        self._named = trained_parameters(network)
        self.fisher_sum: list[torch.Tensor] | None = None
        self.fisher_steps = 0
        self.prev_fisher: list[torch.Tensor] | None = None
        self.anchor: list[torch.Tensor] | None = None
        self.merges: list[int] = []

    # -- the Fisher, accumulated online --------------------------------------------------------
    @no_grad
    def after_backward(self, network: nn.Module, autocast: Autocast) -> dict[str, torch.Tensor]:
        """Adds the step's squared gradient (the full loss's, before FGH reweights it) to the
        period's Fisher sum. The loop calls this hook only for finite steps, so a skipped step
        adds nothing without a check of our own. Without a trigger, nothing."""
        if self.args.get("consolidation") == "never":
            return {}
        if self.fisher_sum is None:
            self.fisher_sum = [torch.zeros_like(p) for _, p in self._named]
        present = [
            (s, p.grad) for s, (_, p) in zip(self.fisher_sum, self._named) if p.grad is not None
        ]
        if present:
            sums, grads = (list(t) for t in zip(*present))
            torch._foreach_addcmul_(sums, grads, grads)
            self.fisher_steps += 1
        return {}

    def current_fisher(self) -> list[torch.Tensor]:
        """The open period's Fisher so far: its mean squared gradient, clamped at
        ``cofima_fisher_max`` (zeros before its first step)."""
        steps = max(self.fisher_steps, 1)
        limit = float(self.args["cofima_fisher_max"])
        sums = self.fisher_sum or [torch.zeros_like(p) for _, p in self._named]
        return [(s / steps).clamp(max=limit) for s in sums]

    def period_fisher(self) -> list[torch.Tensor]:
        """The closing period's Fisher (:meth:`current_fisher`); a fresh sum starts."""
        fisher = self.current_fisher()
        self.fisher_sum, self.fisher_steps = None, 0
        return fisher

    # -- the merge, the firing and the evaluation view ----------------------------------------
    @no_grad
    def merged(self, network: nn.Module, fisher: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Upstream's ``interpolate_weights`` of the kept model (``t0``: the anchor, with the last
        period's Fisher) and the current weights (``t1``, with ``fisher``), in the order of the
        trainable parameters, as new tensors. Keys both models hold: :func:`fisher_average`, or
        ``(1-a) t0 + a t1`` without ``fisher_weighting``. Upstream's new task head exists only in
        the current model, and upstream sets such keys to ``F1 t1`` (``t1`` without
        ``fisher_weighting``): here the head rows of the classes first seen since the last
        firing. Rows of classes never seen (upstream has none) keep ``t1``."""
        alpha = float(self.args["wt_lambda"])
        current = [p.detach() for _, p in self._named]
        weighted = bool(self.args["fisher_weighting"])
        if weighted:
            merged = fisher_average(self.anchor, self.prev_fisher, current, fisher, alpha)
        else:
            merged = [(1 - alpha) * t0 + alpha * t1 for t0, t1 in zip(self.anchor, current)]
        session = self.stats.session.to(current[0].device)
        new = session == self.sessions_closed
        unseen = session < 0
        head = {id(p) for p in self.classifier(network).parameters()}
        for i, (_, p) in enumerate(self._named):
            if id(p) in head:
                t1 = current[i]
                merged[i][new] = fisher[i][new] * t1[new] if weighted else t1[new]
                merged[i][unseen] = t1[unseen]
        return merged

    def aligned(self, network: nn.Module, values: dict[str, torch.Tensor], session: int) -> None:
        """The head's entries of ``values`` (by parameter name) replaced by a copy of the head
        holding them, aligned by SLCA's CA (:meth:`~SLCAOnline.align`) as upstream aligns its
        merged head; with ``ca_epochs`` 0, left as they are."""
        if self.args["ca_epochs"] <= 0:
            return
        head = self.classifier(network)
        names = {id(p): name for name, p in network.named_parameters()}
        aligned_head = nn.Linear(
            head.in_features,
            head.out_features,
            bias=head.bias is not None,
            device=head.weight.device,
            dtype=head.weight.dtype,
        )
        for p, q in zip(head.parameters(), aligned_head.parameters()):
            q.data.copy_(values[names[id(p)]])
        self.align(aligned_head, session, int(self.stats.counts.sum()))
        for p, q in zip(head.parameters(), aligned_head.parameters()):
            values[names[id(p)]] = q.detach()

    def upstream_task_end(
        self, network: nn.Module, fisher: Sequence[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """What upstream's task end makes of the model, by parameter name, changing nothing: the
        merge (:meth:`merged`), then CA of the merged head (:meth:`aligned`) in the session
        that closes."""
        values = dict(zip((n for n, _ in self._named), self.merged(network, fisher)))
        self.aligned(network, values, self.sessions_closed)
        return values

    @no_grad
    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Upstream's task end for training. The first firing keeps the weights and the period's
        Fisher as the previous model (no merge, no CA). Each later firing makes upstream's task
        end (:meth:`upstream_task_end`): the merged backbone is the backbone from now on, the
        merged and aligned model (head included) the next merge's previous model, and the head
        trains on as it was (upstream backs the head up before the merge and restores it after
        evaluating: ``fc.backup()``, ``fc.recall()``)."""
        fisher = self.period_fisher()
        if self.anchor is None:
            self.anchor = [p.detach().clone() for _, p in self._named]
        else:
            values = self.upstream_task_end(network, fisher)
            head = {id(p) for p in self.classifier(network).parameters()}
            for name, p in self._named:
                if id(p) not in head:
                    p.copy_(values[name])
            self.anchor = [values[name] for name, _ in self._named]
            self.merges.append(firing)
        self.prev_fisher = fisher
        self.sessions_closed = firing + 1  # SLCA's session of a newly seen class
        return Consolidated()

    def evaluation(self, network: nn.Module) -> Evaluation:
        """A view of the model upstream evaluates at a task end: the open period merged with the
        kept model and the merged head aligned, as the next firing would
        (:meth:`upstream_task_end`), from the Fisher so far; nothing is written back. Online that
        firing comes with the next task's first batch, after the task-end evaluation. Before the
        first firing (upstream's first task: no merge, no CA) and without a trigger: nothing."""
        if self.anchor is None or self.prev_fisher is None:
            return Evaluation()
        return Evaluation(view=self.upstream_task_end(network, self.current_fisher()))

    # -- checkpoints and reports -----------------------------------------------------------------
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        return {
            **super().state_dict(network),
            "fisher_sum": self.fisher_sum,
            "fisher_steps": self.fisher_steps,
            "prev_fisher": self.prev_fisher,
            "anchor": self.anchor,
            "merges": list(self.merges),
        }

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        super().load_state_dict(network, state)
        device = self.classifier(network).weight.device
        self.fisher_sum = tensors_to(state["fisher_sum"], device)
        self.fisher_steps = int(state["fisher_steps"])
        self.prev_fisher = tensors_to(state["prev_fisher"], device)
        self.anchor = tensors_to(state["anchor"], device)
        self.merges = [int(f) for f in state["merges"]]

    def report(self) -> dict[str, Any]:
        return {**super().report(), "cofima": {"merges": list(getattr(self, "merges", []))}}

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
:meth:`CoFiMAOnline.transform_gradients`), its mean over the period's steps clamped at
``cofima_fisher_max``. The weights after the last firing and that period's Fisher are kept
(``extra_state``) for the next merge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..core.checks import boolean, real
from ..engine.adapter import ConfigKey
from ..engine.backbone_names import PLAIN_VIT
from ..engine.registry import register_method
from .slca import SLCAOnline

#: Parameters of a ViT-B/16 without a head (timm ``vit_base_patch16_224``, ``num_classes=0``)
#: and its feature width: every ``backbone_type`` of these methods is one (``state_bytes``).
VIT_B16_PARAMETERS = 85_798_656
VIT_B16_FEATURES = 768


@torch.no_grad()
def fisher_average(
    theta0: Sequence[torch.Tensor],
    fisher0: Sequence[torch.Tensor],
    theta1: Sequence[torch.Tensor],
    fisher1: Sequence[torch.Tensor],
    alpha: float,
) -> list[torch.Tensor]:
    """Upstream's ``interpolate_weights(..., fisher=True)``: per scalar
    ``((1-a) F0 t0 + a F1 t1) / ((1-a) F0 + a F1)``. Where both Fishers are 0 upstream divides 0
    by 0; here the weight keeps ``t1`` (the current value)."""
    merged = []
    for t0, f0, t1, f1 in zip(theta0, fisher0, theta1, fisher1):
        denominator = (1 - alpha) * f0 + alpha * f1
        numerator = (1 - alpha) * f0 * t0 + alpha * f1 * t1
        merged.append(torch.where(denominator > 0, numerator / denominator.clamp(min=1e-38), t1))
    return merged


@register_method("cofima_online")
class CoFiMAOnline(SLCAOnline):
    """CoFiMA: SLCA (slow learner, class Gaussians, classifier alignment) whose weights are
    Fisher-averaged with the last firing's at each firing (module docstring)."""

    paper_name: ClassVar[str] = "CoFiMA"
    base_model_name: ClassVar[str] = "cofima"
    backbone_types: ClassVar[tuple[str, ...]] = PLAIN_VIT
    #: Upstream merges once per task: a firing per ``consolidation_new_classes`` new classes is
    #: the stream's sign of one; a merge every N samples would average several times per task,
    #: each pulling the weights back towards the last firing's.
    default_consolidation: ClassVar[str] = "new_classes"
    #: 4 classes per smoke task: a firing per task; SLCA's short CA (CI time).
    smoke_overrides: ClassVar[dict[str, Any]] = {
        "consolidation_new_classes": 4,
        "ca_samples_per_class": 16,
        "ca_epochs": 1,
    }
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
        self._named = list(self.trainable_parameters(network))
        self.fisher_sum: list[torch.Tensor] | None = None
        self.fisher_steps = 0
        self.prev_fisher: list[torch.Tensor] | None = None
        self.anchor: list[torch.Tensor] | None = None
        self.merges: list[int] = []

    # -- the Fisher, accumulated online --------------------------------------------------------
    @torch.no_grad()
    def transform_gradients(self, network: nn.Module) -> None:
        """Adds the step's squared gradient (the full loss's, before FGH reweights it) to the
        period's Fisher sum. The loop calls this hook only for finite steps, so a skipped step
        adds nothing without a check of our own. Without a trigger, nothing."""
        if self.args.get("consolidation") == "never":
            return
        if self.fisher_sum is None:
            self.fisher_sum = [torch.zeros_like(p) for _, p in self._named]
        present = [
            (s, p.grad) for s, (_, p) in zip(self.fisher_sum, self._named) if p.grad is not None
        ]
        if present:
            sums, grads = (list(t) for t in zip(*present))
            torch._foreach_addcmul_(sums, grads, grads)
            self.fisher_steps += 1

    def period_fisher(self) -> list[torch.Tensor]:
        """The closing period's Fisher (mean squared gradient, clamped); a fresh sum starts."""
        steps = max(self.fisher_steps, 1)
        limit = float(self.args["cofima_fisher_max"])
        sums = self.fisher_sum or [torch.zeros_like(p) for _, p in self._named]
        fisher = [(s / steps).clamp(max=limit) for s in sums]
        self.fisher_sum, self.fisher_steps = None, 0
        return fisher

    # -- the firing ----------------------------------------------------------------------------
    @torch.no_grad()
    def consolidate(self, network: nn.Module, firing: int) -> Iterable[nn.Parameter]:
        """The first firing keeps the weights and the period's Fisher as the previous model
        (upstream's first task end: no merge, no CA). Each later firing merges the weights with
        the previous model's (:func:`fisher_average`, or ``(1-a) t0 + a t1`` without
        ``fisher_weighting``), realigns the head (SLCA's CA), and keeps the result and the
        period's Fisher as the previous model."""
        self.sessions_closed = firing + 1  # SLCA's session of a newly seen class
        fisher = self.period_fisher()
        params = [p for _, p in self._named]
        if self.prev_fisher is not None and self.anchor is not None:
            alpha = float(self.args["wt_lambda"])
            current = [p.detach() for p in params]
            if self.args["fisher_weighting"]:
                merged = fisher_average(self.anchor, self.prev_fisher, current, fisher, alpha)
            else:
                merged = [(1 - alpha) * t0 + alpha * t1 for t0, t1 in zip(self.anchor, current)]
            for p, value in zip(current, merged):
                p.copy_(value)
            if self.args["ca_epochs"] > 0:
                self.align(self.classifier(network), firing)
            self.merges.append(firing)
        self.anchor = [p.detach().clone() for p in params]
        self.prev_fisher = fisher
        return ()

    # -- checkpoints and reports -----------------------------------------------------------------
    def extra_state(self, network: nn.Module) -> dict[str, Any]:
        return {
            **super().extra_state(network),
            "fisher_sum": self.fisher_sum,
            "fisher_steps": self.fisher_steps,
            "prev_fisher": self.prev_fisher,
            "anchor": self.anchor,
            "merges": list(self.merges),
        }

    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        super().load_extra_state(network, state)
        device = self.classifier(network).weight.device
        self.fisher_sum = _to(state["fisher_sum"], device)
        self.fisher_steps = int(state["fisher_steps"])
        self.prev_fisher = _to(state["prev_fisher"], device)
        self.anchor = _to(state["anchor"], device)
        self.merges = [int(f) for f in state["merges"]]

    @classmethod
    def state_bytes(cls, args: Mapping[str, Any]) -> int:
        """SLCA's class statistics and three fp32 copies of the trainable weights (the anchor,
        the previous Fisher and the period's Fisher sum)."""
        weights = VIT_B16_PARAMETERS + int(args["nb_classes"]) * (VIT_B16_FEATURES + 1)
        return super().state_bytes(args) + 3 * 4 * weights

    def report(self) -> dict[str, Any]:
        return {**super().report(), "cofima": {"merges": list(getattr(self, "merges", []))}}


def _to(value: Any, device: torch.device) -> Any:
    """``value`` (tensors, lists and dicts of them, None) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value

"""DUCT online (``duct_online``): Dual Consolidation (Zhou et al., 2024), PILOT's
``models/duct.py``, task-free.

Upstream, per task: the backbone restarts from the pre-trained weights and fine-tunes with the
head; at the task end (1) representation consolidation: the task vector (trained minus
pre-trained backbone), scaled by ``merge_scalar`` and by the mean cosine between the task's class
means under the pre-trained and the trained backbone, is added to the running sum of task
vectors, and the backbone becomes pre-trained + that sum; the head then retrains on the task for
``epc_re`` epochs; (2) classifier consolidation: for each earlier task, an entropic optimal
transport (Sinkhorn, ``ot_reg``) between the current and that task's class means carries the
current head rows to the old classes, blended in by ``head_merge_ratio``.

Online, a firing closes a period (the stream since the last firing; :class:`ClassPeriods`). The
backbone is not reset between periods (there is no task start to reset at): the period's task
vector is taken from the backbone at the last firing (the *anchor*, kept in ``extra_state``;
before the first firing, the backbone as built), so the merge pulls the backbone back towards
the anchor: ``b <- a + merge_scalar * s * (b - a)``, and the anchor becomes the result. ``s``
(``duct_adjust_ratio``) compares the period's class means under the anchor (an extra no-grad
forward of each step's batch through the anchor weights) with those under the training backbone
(the step's own features). The head keeps training on the stream instead of retraining. The
transport uses running class means of the step's features.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checks import boolean, real
from ..core.prototypes import PrototypeBank
from ..engine.adapter import ConfigKey, StepOutput
from ..engine.backbone_names import PLAIN_VIT
from ..engine.registry import register_method
from .cofima import VIT_B16_FEATURES, VIT_B16_PARAMETERS, _to
from .finetune import FinetuneOnline


class ClassPeriods:
    """Which classes each consolidation period trained: upstream's "current task" at a firing.

    A period's classes are those observed since the last firing (a firing comes before the step
    that would start the next period). ``group[c]`` is the last firing at which class ``c`` was
    current (-1: never yet): the old "tasks" of the head transport.
    """

    KEYS = ("period_counts", "group")

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.period_counts = torch.zeros(num_classes, dtype=torch.int64)
        self.group = torch.full((num_classes,), -1, dtype=torch.int64)

    def observe(self, labels: torch.Tensor) -> None:
        """One step's stream labels (no host sync)."""
        if self.group.device != labels.device:
            self.load_state_dict(_to(self.state_dict(), labels.device))
        self.period_counts.index_add_(0, labels, torch.ones_like(labels))

    def close(self, firing: int) -> torch.Tensor:
        """End the period at ``firing``: the bool mask of its classes (now in group ``firing``)."""
        current = self.period_counts > 0
        self.group[current] = firing
        self.period_counts = torch.zeros_like(self.period_counts)
        return current

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: getattr(self, key) for key in self.KEYS}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for key in self.KEYS:
            setattr(self, key, state[key])


def sinkhorn(
    a: torch.Tensor, b: torch.Tensor, cost: torch.Tensor, reg: float, iterations: int = 1000
) -> torch.Tensor:
    """The entropic OT plan between histograms ``a`` and ``b`` (POT's ``ot.sinkhorn``: same
    fixed point, 1000 iterations at most, stopping once the marginal error is below 1e-9),
    iterated in the log domain: with ViT feature distances over ``reg = 0.02``, POT's
    ``exp(-M / reg)`` underflows to 0."""
    cost, a, b = cost.double(), a.double(), b.double()
    log_a, log_b = a.log(), b.log()
    f = torch.zeros_like(a)
    g = torch.zeros_like(b)
    for _ in range(iterations):
        f = reg * (log_a - torch.logsumexp((g.unsqueeze(0) - cost) / reg, dim=1))
        g = reg * (log_b - torch.logsumexp((f.unsqueeze(1) - cost) / reg, dim=0))
        plan = torch.exp((f.unsqueeze(1) + g.unsqueeze(0) - cost) / reg)
        if (plan.sum(1) - a).abs().sum() < 1e-9:
            break
    return plan


@torch.no_grad()
def transport_head(
    layer: nn.Linear,
    current: torch.Tensor,
    old: torch.Tensor,
    means: torch.Tensor,
    ratio: float,
    reg: float,
) -> None:
    """Upstream's ``_stage2_transport_classifier`` for one old group: the plan ``T`` between the
    ``current`` and ``old`` classes' means (Euclidean costs, uniform marginals) carries the current
    rows to the old ones, ``W_old <- (1 - ratio) W_old + ratio T^T W_cur`` (upstream's cosine head
    has weights only; our linear head's bias rows move the same way)."""
    cost = torch.cdist(means[current].double(), means[old].double())
    a = torch.full((len(current),), 1 / len(current), dtype=torch.float64, device=cost.device)
    b = torch.full((len(old),), 1 / len(old), dtype=torch.float64, device=cost.device)
    plan = sinkhorn(a, b, cost, reg).to(layer.weight.dtype)
    for tensor in (layer.weight, layer.bias):
        if tensor is not None:
            carried = plan.T @ tensor[current]
            tensor[old] = (1 - ratio) * tensor[old] + ratio * carried


@register_method("duct_online")
class DUCTOnline(FinetuneOnline):
    """DUCT: fine-tuning whose backbone is merged by task vectors and whose head is consolidated
    by optimal transport at each firing (module docstring)."""

    paper_name: ClassVar[str] = "DUCT"
    base_model_name: ClassVar[str] = "duct"
    backbone_types: ClassVar[tuple[str, ...]] = PLAIN_VIT
    default_consolidation: ClassVar[str] = "new_classes"
    #: 4 classes per smoke task: a firing per task.
    smoke_overrides: ClassVar[dict[str, Any]] = {"consolidation_new_classes": 4}
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "bcb_lr_scale": ConfigKey(
            0.01,
            "backbone LR = bcb_lr_scale x init_lr (upstream 0.01; the head at init_lr)",
            check=real(positive=True),
        ),
        "merge_scalar": ConfigKey(
            0.25, "scale of a period's task vector (upstream exps/duct.json 0.25)", check=real(0)
        ),
        "head_merge_ratio": ConfigKey(
            0.25,
            "weight of the transported rows in an old class's head row (upstream 0.25)",
            check=real(0, 1),
        ),
        "ot_reg": ConfigKey(
            0.02, "Sinkhorn's entropic regularisation (upstream 0.02)", check=real(positive=True)
        ),
        "duct_adjust_ratio": ConfigKey(
            True,
            "scale the task vector by the period's class-mean cosine between anchor and trained "
            "backbone (upstream; costs a no-grad anchor forward per step); false: scale 1",
            check=boolean,
        ),
    }

    def build_network(self, args: dict) -> nn.Module:
        network = super().build_network(args)  # upstream's SimpleVitNet with the online head
        self.setup_state(network, args)
        return network

    def lr_scale(self, name: str, parameter: nn.Parameter) -> float:
        """Upstream's slow learner: the backbone at ``bcb_lr_scale`` x the head's LR."""
        return float(self.args["bcb_lr_scale"]) if name.startswith("backbone.") else 1.0

    def backbone(self, network: nn.Module) -> nn.Module:
        """The merged part (upstream's task vectors leave out the head)."""
        return network.backbone

    def features(
        self, network: nn.Module, x: torch.Tensor, params: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The head's input, through the backbone's own weights or ``params`` (the anchor)."""
        module = self.backbone(network)
        if params is None:
            return module(x)
        return torch.func.functional_call(module, params, (x,))

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = self.features(network, x)
        return StepOutput(network.fc(features), features)

    def setup_state(self, network: nn.Module, args: Mapping[str, Any]) -> None:
        """The method's state, fresh: called by ``build_network`` (tests call it on tiny nets)."""
        self._named = [
            (n, p) for n, p in self.backbone(network).named_parameters() if p.requires_grad
        ]
        num_classes, dim = int(args["nb_classes"]), self.classifier(network).in_features
        # Running class means (Eq. 1's bank): over the stream, and the period's under the
        # training backbone and under the anchor.
        self.means = PrototypeBank(num_classes, dim)
        self.trained = PrototypeBank(num_classes, dim)
        self.anchored = PrototypeBank(num_classes, dim)
        self.periods = ClassPeriods(num_classes)
        # The backbone at the last firing; before the first, as built (upstream's pre-trained).
        self.anchor = [p.detach().clone() for _, p in self._named]
        self.ratios: list[float] = []
        self.transports = 0

    # -- online accumulation -------------------------------------------------------------------
    @torch.no_grad()
    def after_step(
        self,
        network: nn.Module,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        terms: Mapping[str, torch.Tensor],
    ) -> list[nn.Parameter]:
        """With ``duct_adjust_ratio`` and a trigger: the batch's features under the anchor."""
        if self._ratio_needed():
            device = inputs.device
            if self.anchor[0].device != device:  # built on the CPU, before the loop moved it
                self.anchor = [a.to(device) for a in self.anchor]
            params = {name: value for (name, _), value in zip(self._named, self.anchor)}
            features = self.features(network, inputs, params)
            self.anchored.to(device).update(features, labels, validate=False)
        return []

    def observe(self, network: nn.Module, out: StepOutput, labels: torch.Tensor) -> None:
        features = out.features.detach()
        self.means.to(features.device).update(features, labels, validate=False)
        if self._ratio_needed():
            self.trained.to(features.device).update(features, labels, validate=False)
        self.periods.observe(labels)

    def _ratio_needed(self) -> bool:
        return bool(self.args["duct_adjust_ratio"]) and self.args.get("consolidation") != "never"

    def adjust_ratio(self, current: torch.Tensor) -> float:
        """Mean cosine over the period's classes between their means under the anchor and under
        the training backbone (upstream's ``_calculate_adjust_ratio``); 1 without classes."""
        if not self._ratio_needed():
            return 1.0
        current = current.to(self.trained.counts.device)
        current = current & (self.anchored.counts > 0) & (self.trained.counts > 0)
        if not bool(current.any()):
            return 1.0
        cos = F.cosine_similarity(self.anchored.means[current], self.trained.means[current])
        return float(cos.mean())

    # -- the firing ----------------------------------------------------------------------------
    @torch.no_grad()
    def consolidate(self, network: nn.Module, firing: int) -> Iterable[nn.Parameter]:
        """Merges the period's task vector into the anchor, then transports the head rows of the
        period's classes to each older group's classes; the result is the next anchor."""
        current = self.periods.close(firing)
        params = [p for _, p in self._named]
        ratio = self.adjust_ratio(current)
        scale = float(self.args["merge_scalar"]) * ratio
        for p, a in zip(params, self.anchor):
            p.copy_(a.to(p.device) + scale * (p - a.to(p.device)))
        self.ratios.append(ratio)
        self.transport(network, current, firing)
        self.anchor = [p.detach().clone() for p in params]
        for bank in (self.trained, self.anchored):
            bank.means.zero_()
            bank.counts.zero_()
        return ()

    def transport(self, network: nn.Module, current: torch.Tensor, firing: int) -> None:
        layer = self.classifier(network)
        device = layer.weight.device
        groups = self.periods.group.to(device)
        current_ids = torch.nonzero(current.to(device)).flatten()
        if not len(current_ids):
            return
        means = self.means.means.to(device)
        for group in range(firing):
            old = torch.nonzero((groups == group) & ~current.to(device)).flatten()
            if len(old):
                transport_head(
                    layer,
                    current_ids,
                    old,
                    means,
                    float(self.args["head_merge_ratio"]),
                    float(self.args["ot_reg"]),
                )
                self.transports += 1

    # -- checkpoints and reports -----------------------------------------------------------------
    def extra_state(self, network: nn.Module) -> dict[str, Any]:
        return {
            "means": dict(self.means.state_dict()),
            "trained": dict(self.trained.state_dict()),
            "anchored": dict(self.anchored.state_dict()),
            "periods": self.periods.state_dict(),
            "anchor": self.anchor,
            "ratios": list(self.ratios),
            "transports": self.transports,
        }

    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        device = self.classifier(network).weight.device
        for key in ("means", "trained", "anchored"):
            getattr(self, key).to(device).load_state_dict(state[key])
        self.periods.load_state_dict(_to(state["periods"], device))
        self.anchor = _to(state["anchor"], device)
        self.ratios = [float(r) for r in state["ratios"]]
        self.transports = int(state["transports"])

    @classmethod
    def state_bytes(cls, args: Mapping[str, Any]) -> int:
        """One fp32 copy of the backbone (the anchor) and three fp32 ``C x D`` class means."""
        return 4 * VIT_B16_PARAMETERS + 3 * 4 * int(args["nb_classes"]) * VIT_B16_FEATURES

    def report(self) -> dict[str, Any]:
        return {
            "duct": {
                "merges": len(getattr(self, "ratios", [])),
                "adjust_ratios": list(getattr(self, "ratios", [])),
                "head_transports": getattr(self, "transports", 0),
            }
        }

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
vector is taken from the backbone at the last firing (the *anchor*, kept in ``state_dict``;
before the first firing, the backbone as built), so the merge pulls the backbone back towards
the anchor: ``b <- a + merge_scalar * s * (b - a)``, and the anchor becomes the result. ``s``
(``duct_adjust_ratio``) compares the period's class means under the anchor (an extra no-grad
forward of each step's batch through the anchor weights) with those under the training backbone
(the step's own features). The head keeps training on the stream instead of retraining. The
transport uses running class means of the step's features; upstream's head is a
``CosineLinear``, so its transport changes only row directions, and on our linear head each
transported row keeps its norm (:func:`transported_rows`).

Upstream evaluates each task right after its merge and transport, both of which it keeps for
training. Online the firing comes with the next task's first batch, after the task-end
evaluation, so :meth:`DUCTOnline.evaluation` shows evaluation what a firing now would make
of the network, and the firing then does the same to the training state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..core.checks import boolean, real
from ..core.lazy import F, nn, no_grad, torch
from ..engine.adapter import (
    ConfigKey,
    Consolidated,
    Consolidation,
    Evaluation,
    StepOutput,
    TrainedStep,
)
from ..engine.backbone_names import PLAIN_VIT, VIT_B16_PARAMETERS, VIT_B16_WIDTH
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.checkpoint import tensors_to
from ..engine.registry import register_method
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
            self.load_state_dict(tensors_to(self.state_dict(), labels.device))
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


@no_grad
def transported_rows(
    weight: torch.Tensor,
    current: torch.Tensor,
    old: torch.Tensor,
    means: torch.Tensor,
    ratio: float,
    reg: float,
) -> torch.Tensor:
    """Upstream's ``_stage2_transport_classifier`` for one old group: the new head rows of the
    ``old`` classes. The plan ``T`` between the ``current`` and ``old`` classes' means (Euclidean
    costs, uniform marginals) carries the current rows to the old ones; each old row takes the
    direction of ``(1 - ratio) W_old + ratio T^T W_cur`` at its own norm.

    Why the norm: upstream's head is a ``CosineLinear``, which normalises its rows when it is
    used, so there the update changes only their directions. On our linear head the raw update
    would also shrink every old row (x0.75 at ``ratio`` 0.25: the plan's columns sum to 1/n), and
    with it the old classes' logits, once more at every firing."""
    cost = torch.cdist(means[current].double(), means[old].double())
    a = torch.full((len(current),), 1 / len(current), dtype=torch.float64, device=cost.device)
    b = torch.full((len(old),), 1 / len(old), dtype=torch.float64, device=cost.device)
    plan = sinkhorn(a, b, cost, reg)
    rows = weight[old].double()
    moved = (1 - ratio) * rows + ratio * (plan.T @ weight[current].double())
    return (F.normalize(moved, dim=1) * rows.norm(dim=1, keepdim=True)).to(weight.dtype)


def duct_state_bytes(args: Mapping[str, Any]) -> int:
    """One fp32 copy of the backbone (the anchor) and three fp32 ``C x D`` class means."""
    return 4 * VIT_B16_PARAMETERS + 3 * 4 * int(args["nb_classes"]) * VIT_B16_WIDTH


CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="DUCT",
    # 4 classes per smoke task: a firing per task.
    smoke_overrides={"consolidation_new_classes": 4},
    upstream_differences=(
        UpstreamDifference(
            "task_vector_from_last_firing",
            "The backbone is never reset to the pre-trained weights: a firing merges the task "
            "vector from the last firing's backbone (the anchor), b <- a + merge_scalar * s * "
            "(b - a), with s from class means under the anchor, where upstream adds the task "
            "vector from the pre-trained weights to a sum of task vectors.",
            "A stream has no task start to reset the backbone at, so a period's training starts "
            "from the last merge and its task vector can only be measured from there.",
        ),
        UpstreamDifference(
            "no_head_retraining",
            "A firing does not retrain the head on the task (upstream's epc_re epochs at lr_re "
            "after the merge); the head keeps training on the stream.",
            "Online there is no second pass over a finished task's data.",
        ),
        UpstreamDifference(
            "class_means_from_training_features",
            "The transport's class means are running means of the training steps' features as "
            "the backbone moves, not a pass of the task's data through a fixed backbone.",
            "Online there is no second pass over a finished task's data.",
        ),
        UpstreamDifference(
            "linear_head_rows_keep_norms",
            "The transport sets each old row of the linear head to upstream's transported "
            "direction at the row's own norm and leaves its bias.",
            "Upstream's CosineLinear head normalises its rows, so its transport changes only "
            "directions; on a linear head the raw update would shrink the old classes' rows "
            "and logits (x0.75 per firing at head_merge_ratio 0.25).",
        ),
        UpstreamDifference(
            "groups_from_periods",
            "The transport's old tasks are the classes grouped by the firing at which each was "
            "last seen, with uniform marginals over each group's size, not fixed ranges of "
            "increment classes.",
            "A stream gives no task ids; the classes a period observed stand for its task.",
        ),
        UpstreamDifference(
            "log_domain_sinkhorn",
            "Sinkhorn iterates in the log domain instead of POT's ot.sinkhorn, which multiplies "
            "the kernel exp(-M / reg).",
            "At ot_reg 0.02 that kernel underflows to 0 in float64 once distances exceed about "
            "15 (ViT class means can be that far apart) and POT stops with a degenerate plan; "
            "where it does not underflow, the log domain gives POT's plan.",
        ),
    ),
    state_bytes=duct_state_bytes,
)


@register_method("duct_online", card=CARD)
class DUCTOnline(FinetuneOnline):
    """DUCT: fine-tuning whose backbone is merged by task vectors and whose head is consolidated
    by optimal transport at each firing (module docstring)."""

    base_model_name: ClassVar[str] = "duct"
    consolidation: ClassVar[Consolidation] = Consolidation(trigger="new_classes")
    #: Upstream's slow learner: the backbone at bcb_lr_scale x the head's LR.
    lr_scales: ClassVar[dict[str, float | str]] = {"backbone.": "bcb_lr_scale"}
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
        from ..core.prototypes import PrototypeBank

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
    @no_grad
    def after_step(self, network: nn.Module, step: TrainedStep) -> tuple[nn.Parameter, ...]:
        """With ``duct_adjust_ratio`` and a trigger: the batch's features under the anchor. At
        the batch's own step, the stream batch joins the class means."""
        inputs, labels = step.inputs, step.labels
        if self._ratio_needed():
            device = inputs.device
            if self.anchor[0].device != device:  # built on the CPU, before the loop moved it
                self.anchor = [a.to(device) for a in self.anchor]
            params = {name: value for (name, _), value in zip(self._named, self.anchor)}
            features = self.features(network, inputs, params)
            self.anchored.to(device).update(features, labels, validate=False)
        if step.stream is not None:
            features, labels = step.stream.features.detach(), step.stream_labels
            self.means.to(features.device).update(features, labels, validate=False)
            if self._ratio_needed():
                self.trained.to(features.device).update(features, labels, validate=False)
            self.periods.observe(labels)
        return ()

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

    # -- the firing and the evaluation view ----------------------------------------------------
    @no_grad
    def consolidated(
        self, network: nn.Module, current: torch.Tensor, firing: int
    ) -> tuple[float, int, dict[str, torch.Tensor]]:
        """What a firing now makes of the network, computed without changing anything: the
        adjust ratio, the number of old groups transported, and new values by parameter name:
        the backbone merged (``a + merge_scalar * s * (b - a)``) and, with older groups, the head
        weight with their rows transported (:func:`transported_rows`; the bias stays, as upstream's
        cosine head has none). ``current``: the closing period's classes."""
        names = {id(p): name for name, p in network.named_parameters()}
        ratio = self.adjust_ratio(current)
        scale = float(self.args["merge_scalar"]) * ratio
        values = {}
        for (_, p), a in zip(self._named, self.anchor):
            a = a.to(p.device)
            values[names[id(p)]] = a + scale * (p.detach() - a)
        weight = self.classifier(network).weight
        moved, transports = self.transported(weight.detach(), current, firing)
        if transports:
            values[names[id(weight)]] = moved
        return ratio, transports, values

    def transported(
        self, weight: torch.Tensor, current: torch.Tensor, firing: int
    ) -> tuple[torch.Tensor, int]:
        """A copy of ``weight`` with the rows of each older group (the classes last current at an
        earlier firing, not in ``current``) transported from the ``current`` rows, and how many
        groups moved."""
        weight, device = weight.clone(), weight.device
        current = current.to(device)
        groups = self.periods.group.to(device)
        current_ids = torch.nonzero(current).flatten()
        means = self.means.means.to(device)
        transports = 0
        for group in range(firing if len(current_ids) else 0):
            old = torch.nonzero((groups == group) & ~current).flatten()
            if len(old):
                weight[old] = transported_rows(
                    weight,
                    current_ids,
                    old,
                    means,
                    float(self.args["head_merge_ratio"]),
                    float(self.args["ot_reg"]),
                )
                transports += 1
        return weight, transports

    @no_grad
    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Merges the period's task vector into the anchor and transports the head rows of the
        period's classes to each older group's classes (:meth:`consolidated`); the merged
        backbone is the next anchor. Upstream keeps both for training: its next task trains the
        transported head, and the merged backbone is what its head retrains on."""
        current = self.periods.close(firing)
        ratio, transports, values = self.consolidated(network, current, firing)
        parameters = dict(network.named_parameters())
        for name, value in values.items():
            parameters[name].copy_(value)
        self.ratios.append(ratio)
        self.transports += transports
        self.anchor = [p.detach().clone() for _, p in self._named]
        for bank in (self.trained, self.anchored):
            bank.means.zero_()
            bank.counts.zero_()
        return Consolidated()

    def evaluation(self, network: nn.Module) -> Evaluation:
        """A view of the network as upstream evaluates it at a task end: the period so far merged
        and transported as a firing now would (:meth:`consolidated`), nothing written back. Online
        the firing comes with the next task's first batch, after the task-end evaluation; this
        view shows that evaluation what upstream's would see. Without a trigger, nothing."""
        if self.args.get("consolidation") == "never":
            return Evaluation()
        current = self.periods.period_counts > 0
        return Evaluation(view=self.consolidated(network, current, len(self.ratios))[2])

    # -- checkpoints and reports -----------------------------------------------------------------
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        return {
            "means": dict(self.means.state_dict()),
            "trained": dict(self.trained.state_dict()),
            "anchored": dict(self.anchored.state_dict()),
            "periods": self.periods.state_dict(),
            "anchor": self.anchor,
            "ratios": list(self.ratios),
            "transports": self.transports,
        }

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        device = self.classifier(network).weight.device
        for key in ("means", "trained", "anchored"):
            getattr(self, key).to(device).load_state_dict(state[key])
        self.periods.load_state_dict(tensors_to(state["periods"], device))
        self.anchor = tensors_to(state["anchor"], device)
        self.ratios = [float(r) for r in state["ratios"]]
        self.transports = int(state["transports"])

    def report(self) -> dict[str, Any]:
        return {
            "duct": {
                "merges": len(getattr(self, "ratios", [])),
                "adjust_ratios": list(getattr(self, "ratios", [])),
                "head_transports": getattr(self, "transports", 0),
            }
        }

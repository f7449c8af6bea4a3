"""DER online (``der_online``): Dynamically Expandable Representation (Yan et al., CVPR 2021),
one whole ViT per consolidation firing (PILOT's ``models/der.py``, ``exps/der.json``).

Upstream (``DERNet`` in ``utils/inc_net.py``): at each task's start ``update_fc`` appends a new
backbone loaded from the last, and the learner freezes the older ones (no gradient, eval mode in
``train()``). The head is rebuilt over the concatenated features of all backbones, the old
weights copied into its first rows and columns, the rest drawn fresh (``SimpleLinear``); an
auxiliary head over the new backbone's features has ``new_task_size + 1`` outputs, "old" and one
per new class. From the second task on the loss is ``CE(logits, y) + CE(aux_logits, aux_y)``
with ``aux_y = y - known + 1`` for the new classes and 0 for the old ones; no distillation (PILOT
leaves out DER's masking and pruning). Replay: a herding memory of 2000 (``fixed_memory: false``).

Online (the choices are in docs/methods.md, "DER"): the build is upstream's first ``update_fc``
with one head over every class of the stream; a consolidation firing (default ``new_classes``)
does what ``update_fc`` and the freezing do at a task start: a branch copied from the last, the
old ones frozen, the head widened (its parameters replaced: the loop swaps them into the
optimiser and maps the online prototypes and herding features, :meth:`DEROnline.widened`)
and the auxiliary head restarted. The auxiliary head covers every class plus "old": its targets
are the class for the classes unknown at the last firing, "old" for the known ones.
:class:`~pilot_online.methods.memo.MEMOOnline` subclasses this adapter.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from functools import partial
from typing import Any, ClassVar

from ..core.lazy import F, nn, no_grad, torch
from ..core.masks import mask_logits, training_mask
from ..engine.adapter import (
    Consolidated,
    Consolidation,
    MethodAdapter,
    Replay,
    StepOutput,
    TrainingBatch,
)
from ..engine.backbone_names import PLAIN_VIT, VIT_B16_PARAMETERS
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.differences import ONLINE_HERDING, REPLAY_LOGIT_MASK
from ..engine.registry import register_method

#: Upstream's ``exps/der.json`` and ``exps/memo.json``: ``memory_size`` 2000, ``fixed_memory``
#: false (a quota of 2000 // classes seen).
MEMORY_SIZE = 2000


def auxiliary_loss(
    aux_logits: torch.Tensor,
    labels: torch.Tensor,
    known: torch.Tensor,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Upstream's ``loss_aux`` online: ``aux_logits`` ``[B, C + 1]`` are "old" (column 0) and
    one column per class (class y: column y + 1); a sample of a class in ``known`` (bool ``[C]``,
    the classes seen before the last firing) targets "old", any other its own column. The
    softmax covers "old" and the ``allowed`` classes (the training logit mask; None: all) that
    are not known: upstream's "old" and the task's new classes, on a clear stream whose batch
    holds every class of the task."""
    new = ~known if allowed is None else allowed & ~known
    outputs = torch.cat([new.new_ones(1), new])
    targets = torch.where(known[labels], torch.zeros_like(labels), labels + 1)
    return F.cross_entropy(mask_logits(aux_logits, outputs), targets)


def repeat_last_branch(rows: torch.Tensor, branch_width: int, branches: int) -> torch.Tensor:
    """Rows of the feature space of fewer branches (``[N, k * branch_width]``) in that of
    ``branches``: each added branch starts as a copy of the last, so its features are the last
    branch's columns, repeated."""
    have = rows.shape[1] // branch_width
    if have * branch_width != rows.shape[1] or not 0 < have <= branches:
        raise ValueError(
            f"rows of width {rows.shape[1]} are no whole number of branches of width "
            f"{branch_width} up to {branches}"
        )
    last = rows[:, -branch_width:]
    return torch.cat([rows, *[last] * (branches - have)], dim=1)


def simple_linear_weight(
    rows: int, columns: int, generator: torch.Generator, like: torch.Tensor
) -> torch.Tensor:
    """A weight as upstream's ``SimpleLinear.reset_parameters`` draws it (Kaiming uniform,
    linear gain: U(-sqrt(3 / columns), sqrt(3 / columns))), from ``generator``, then moved to
    ``like``'s device and dtype."""
    weight = torch.empty(rows, columns)
    nn.init.kaiming_uniform_(weight, nonlinearity="linear", generator=generator)
    return weight.to(like)


def linear_from(layer: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` holding ``layer``'s own weight and bias parameters (PILOT's
    ``SimpleLinear`` returns a dict; the loop's classifier is a plain linear layer)."""
    linear = nn.Linear(layer.in_features, layer.out_features, device="meta")
    linear.weight, linear.bias = layer.weight, layer.bias
    return linear


@no_grad
def widened_head(head: nn.Linear, in_features: int, generator: torch.Generator) -> nn.Linear:
    """Upstream's ``update_fc`` for a head over every class: a new head over ``in_features``
    inputs drawn as ``SimpleLinear`` draws one, with the old weight in its first columns and the
    old bias (every row is an old row here)."""
    weight = simple_linear_weight(head.out_features, in_features, generator, head.weight)
    weight[:, : head.in_features] = head.weight
    wide = nn.Linear(in_features, head.out_features, device="meta")
    wide.weight = nn.Parameter(weight, requires_grad=head.weight.requires_grad)
    wide.bias = nn.Parameter(head.bias.detach().clone(), requires_grad=head.bias.requires_grad)
    return wide


@no_grad
def restart_linear(layer: nn.Linear, generator: torch.Generator) -> None:
    """``SimpleLinear.reset_parameters`` in place: a fresh weight from ``generator``, zero bias
    (upstream builds a new auxiliary head at each task)."""
    layer.weight.copy_(simple_linear_weight(*layer.weight.shape, generator, layer.weight))
    layer.bias.zero_()


def branch_state_bytes(args: Mapping[str, Any], branch_parameters: int = VIT_B16_PARAMETERS) -> int:
    """The branches the firings add, of ``branch_parameters`` each (DER: a ViT-B/16 without a
    head; fp32, frozen once the next one comes, so without optimiser state): one per firing,
    ``ceil(classes / consolidation_new_classes) - 1`` with ``new_classes`` (the clear stream's
    task count minus one), else upstream's task count minus one. Upstream holds the same: one
    branch per task."""
    return 4 * branch_parameters * (DEROnline.expected_branches(args) - 1)


CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="DER",
    # Each firing adds a ViT branch: one more frozen forward per image (the FLOP model).
    grows=True,
    # The paper's hp_grid has no DER row; its ER row (a whole ViT trained with a replay memory,
    # the nearest it searched) chose 5e-5. Adam at 5e-3 ruins a whole ViT (docs/methods.md).
    default_lr=5e-5,
    # The smoke stream's tasks hold 4 classes: a firing at each of its task boundaries; two
    # blocks per ViT keep the CPU tests' time and memory small as branches are added.
    smoke_overrides={"consolidation_new_classes": 4, "vit_depth": 2},
    state_bytes=branch_state_bytes,
    upstream_differences=(
        UpstreamDifference(
            "one_linear_head_over_every_class",
            "The head is one linear layer over every class of the stream from the build; a "
            "firing widens its input only, every row keeping its weights on the old features and "
            "its bias, where upstream's update_fc adds the new task's rows and draws them whole.",
            "Online the stream's classes are known up front but no task start is seen; a row of "
            "a class not seen yet has had no gradient under the batch mask, so it still holds "
            "its initial draw.",
        ),
        UpstreamDifference(
            "auxiliary_head_over_every_class",
            "The auxiliary head has one output per class of the stream plus 'old'; a class "
            "known at the last firing targets 'old', any other its own output, and the softmax "
            "covers 'old' and the training mask's classes that are not known, where upstream's "
            "has 'old' plus one output per class of the new task.",
            "The new task's classes are not known at a firing: they arrive over the stream. On a "
            "clear stream, with a batch holding every class of the task, it is upstream's loss.",
        ),
        REPLAY_LOGIT_MASK,
        ONLINE_HERDING,
        UpstreamDifference(
            "adam_constant_lr",
            "The optimiser is the protocol's Adam at a constant learning rate (5e-5 in the paper "
            "configs), where upstream runs SGD (momentum 0.9, LR 1e-3, weight decay) for 10 or "
            "20 epochs per task with a step schedule.",
            "Online there is one pass and no task length to schedule over; the paper trains "
            "every method with Adam, and `optimizer: sgd` is one key away.",
        ),
        UpstreamDifference(
            "seeded_growth",
            "A firing draws the widened head's new columns and the restarted auxiliary head from "
            "a generator seeded by the run's seed and the firing, where upstream draws them from "
            "the global random stream.",
            "A resumed run rebuilds the same network, and nothing an evaluation draws can change "
            "what a firing draws.",
        ),
    ),
)


@register_method("der_online", card=CARD)
class DEROnline(MethodAdapter):
    """One ViT per firing, the older frozen, a widened head and an auxiliary head."""

    base_model_name: ClassVar[str] = "der"
    replay: ClassVar[Replay | None] = Replay(
        MEMORY_SIZE,
        memory="herding",
        why="DER's and MEMO's memory_size 2000, fixed_memory false: 2000 // classes seen",
    )
    #: Upstream grows at each task start: a firing at each task boundary of a clear stream whose
    #: tasks hold ``consolidation_new_classes`` classes.
    consolidation: ClassVar[Consolidation] = Consolidation(
        trigger="new_classes",
        required="never adds a branch, so the method would be one network with replay",
    )

    @classmethod
    def expected_branches(cls, args: Mapping[str, Any]) -> int:
        """Branches at the end of a run (for :func:`branch_state_bytes` and the FLOP model)."""
        classes = int(args["nb_classes"])
        trigger = args.get("consolidation") or cls.consolidation.trigger
        if trigger == "new_classes":
            return max(1, math.ceil(classes / int(args.get("consolidation_new_classes", 10))))
        first, increment = int(args.get("init_cls", 10)), int(args.get("increment", 10))
        return 1 + max(0, math.ceil((classes - first) / increment))

    # -- the network -------------------------------------------------------------------------
    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import DERNet  # PILOT, imported lazily

        return self.first_update_fc(DERNet(self.pilot_args(args), True), args)

    def first_update_fc(self, network: nn.Module, args: Mapping[str, Any]) -> nn.Module:
        """Upstream's first ``update_fc`` with every class of the stream: one branch, the head
        over all classes and the auxiliary head over all of them plus "old", as upstream draws
        them, each held by an ``nn.Linear``; everything trains."""
        network.update_fc(int(args["nb_classes"]))
        network.fc, network.aux_fc = linear_from(network.fc), linear_from(network.aux_fc)
        self.grown_at: list[int] = []  # the firing of each added branch, for state and report
        return network.requires_grad_(True)

    def branches(self, network: nn.Module) -> nn.ModuleList:
        """The branches whose features are concatenated, oldest first (DER: the backbones)."""
        return network.backbones

    def branch_features(self, network: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        """Each branch's features of ``x`` (the timm ViT's pooled, normed token)."""
        return [backbone(x) for backbone in network.backbones]

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        """``DERNet.forward``: the head on the concatenated features; in training also the
        auxiliary head on the newest branch's (frozen branches build no graph)."""
        features = torch.cat(self.branch_features(network, x), dim=1)
        out = StepOutput(network.fc(features), features)
        if train:
            out.extras["aux_logits"] = network.aux_fc(features[:, -int(network.out_dim) :])
        return out

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc

    def set_mode(self, network: nn.Module, train: bool) -> None:
        """Upstream's ``train()``: the newest branch trains, the frozen ones run in eval mode."""
        network.train(train)
        if train:
            for branch in self.branches(network)[:-1]:
                branch.eval()

    def loss_terms(
        self, network: nn.Module, out: StepOutput, batch: TrainingBatch
    ) -> dict[str, torch.Tensor]:
        """The auxiliary loss once a firing has added a branch (upstream's first task trains the
        head alone, ``_init_train``), over the whole training batch, beside the CE."""
        terms = super().loss_terms(network, out, batch)
        if len(self.branches(network)) < 2:
            return terms
        allowed = training_mask(
            self.args.get("logit_mask", "batch"),
            batch.labels,
            batch.seen,
            batch.seen.shape[0],
            validate=False,
        )
        loss = auxiliary_loss(out.extras["aux_logits"], batch.labels, batch.known, allowed)
        terms["aux"] = self.aux_weight() * loss
        return terms

    def aux_weight(self) -> float:
        """The auxiliary loss's weight: 1 in DER (MEMO's ``alpha_aux``)."""
        return 1.0

    # -- the task-boundary step ----------------------------------------------------------------
    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Upstream's ``update_fc`` and freezing at a task start: a new branch copied from the
        last, the older frozen, the head widened, the auxiliary head restarted. Returns every
        parameter that trained before except the replaced head (the loop swaps that in with
        fresh state): upstream starts a new optimiser at each task."""
        head = {id(p) for p in network.fc.parameters()}
        restarted = [p for p in network.parameters() if p.requires_grad and id(p) not in head]
        self.grow(network, firing)
        self.grown_at = [*getattr(self, "grown_at", []), firing]
        return Consolidated(restarted=restarted, feature_map=partial(self.widened, network))

    def grow(self, network: nn.Module, firing: int) -> None:
        """Add one branch (a trainable copy of the last), freeze the older ones, widen the head
        and restart the auxiliary head, drawing from the run's seed and ``firing``."""
        generator = torch.Generator().manual_seed(self.run_seed() * 1_000_003 + firing)
        branches = self.branches(network)
        branches.append(self.new_branch(branches[-1]))
        self.freeze_old(network)
        width = int(network.out_dim) * len(branches)
        network.fc = widened_head(network.fc, width, generator)
        restart_linear(network.aux_fc, generator)

    def new_branch(self, last: nn.Module) -> nn.Module:
        """The added branch: a copy of the last (upstream loads the last's state dict into a new
        backbone), every parameter trainable."""
        return copy.deepcopy(last).requires_grad_(True)

    def freeze_old(self, network: nn.Module) -> None:
        """Upstream's ``incremental_train``: every branch but the newest gets no gradient."""
        for branch in self.branches(network)[:-1]:
            branch.requires_grad_(False)

    def widened(self, network: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """A firing's feature map: the new branch is a copy of the last, so at the firing its
        features are the last branch's: feature rows (the class means, the stored herding
        features) extend by the last branch's columns, exactly."""
        return repeat_last_branch(rows, int(network.out_dim), len(self.branches(network)))

    # -- checkpoints and the report -------------------------------------------------------------
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        return {"grown_at": list(getattr(self, "grown_at", []))}

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        """Rebuild the branches, the head's width and the frozen set the firings made (their
        values load afterwards)."""
        grown_at = [int(firing) for firing in state["grown_at"]]
        for firing in grown_at[len(self.branches(network)) - 1 :]:
            self.grow(network, firing)
        self.grown_at = grown_at

    def report(self) -> dict[str, Any]:
        grown_at = list(getattr(self, "grown_at", []))
        return {"branches": {"count": 1 + len(grown_at), "added_at_firings": grown_at}}

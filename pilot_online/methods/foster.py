"""FOSTER online (``foster_online``): feature boosting and compression (Wang et al., ECCV 2022;
PILOT's ``models/foster.py``, ``exps/foster.json``, ``FOSTERNet`` in ``utils/inc_net.py``).

Upstream trains one ViT with a linear head on the first task. At each later task, ``update_fc``
appends a copy of the last backbone, freezes the old one and the old head (``oldfc``), grows the
head over the concatenated features and adds ``fe_fc`` over the new backbone's; boosting trains
``CE(logits / per_cls_weights) + CE(fe_logits) + lambda_okd * KD(logits[:, :known], old_logits,
T)``, the weights from the effective number of samples per class (``beta1``). Compression then
trains a one-backbone student (``_snet``: the old backbone, a head from ``oldfc`` by ``copy_fc``)
to match the boosted network's logits with ``BKD`` (``beta2`` weights); the next task starts from
the student. Evaluation reports the boosted network.

Online (docs/methods.md, "FOSTER", says why):

- Before the first consolidation firing the network is one backbone and ``fc``, trained with CE
  (upstream's first task). The first firing builds the boosting structure: a second branch copied
  from the first, which freezes with the old head (``oldfc``), a new ``fc`` over both branches
  (its old-feature block of the classes known so far from the old head, the rest drawn as
  PILOT's ``SimpleLinear``), a new ``fe_fc``, and the student ``snet`` (the old backbone, a head
  from ``oldfc``). Later firings copy the student into both branches and ``oldfc``, then draw the
  heads again: upstream's next ``update_fc`` on ``_snet``.
- The student trains concurrently: each step it distils the boosted logits of the same training
  batch, detached (``BKD``). The boosted network is what evaluation reports, as upstream's.
- The per-class counts behind both weightings are distinct samples since the last firing: the
  memory's per-class quota for a class known then, plus its stream samples since.
- Memory: declared herding replay (upstream's ``fixed_memory``, ``memory_per_class`` 20), ranked
  by the student's features (``Replay.herding_features``), the network each next segment starts
  from.
- Online prototypes: after a firing the branches are the student, so P's class means become the
  running means of the student's lineage features (kept every step), twice side by side.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from functools import partial
from typing import Any, ClassVar

from ..core.checks import real
from ..core.lazy import F, nn, no_grad, torch
from ..core.masks import classes_present, mask_logits, training_mask
from ..engine.adapter import (
    Autocast,
    ConfigKey,
    Consolidated,
    Consolidation,
    MethodAdapter,
    Replay,
    StepOutput,
    TrainedStep,
    TrainingBatch,
)
from ..engine.backbone_names import PLAIN_VIT, VIT_B16_PARAMETERS
from ..engine.card import MethodCard
from ..engine.card import UpstreamDifference as Difference
from ..engine.registry import register_method
from ..engine.teacher import distillation_loss

#: Upstream's ``exps/foster.json``: ``memory_size`` 2000, ``fixed_memory`` true, 20 per class.
FOSTER_MEMORY_SIZE, FOSTER_PER_CLASS = 2000, 20
#: The ``StepOutput.extras`` entry herding ranks stream samples by (``Replay.herding_features``).
HERDING_FEATURES = "lineage_features"


def effective_number_weights(counts: torch.Tensor, classes: torch.Tensor, beta: float):
    """Upstream's ``per_cls_weights`` (Cui et al.'s class-balanced weights) over ``classes``
    (bool ``[C]``): ``w_c = (1 - beta) / (1 - beta ** n_c)``, scaled to sum to the number of
    classes; other classes get 1. Counts below 1 count as 1 (the largest weight a class with a
    sample has), so the weights stay finite. float64 as upstream's numpy, returned as float32."""
    effective = 1.0 - beta ** counts.to(torch.float64).clamp_min(1.0)
    raw = torch.where(classes, (1.0 - beta) / effective, 0.0)
    scaled = raw / raw.sum().clamp_min(torch.finfo(torch.float64).tiny) * classes.sum()
    return torch.where(classes, scaled, 1.0).to(torch.float32)


def simple_linear(
    in_features: int,
    out_features: int,
    like: torch.Tensor,
    generator: torch.Generator | None = None,
) -> nn.Linear:
    """An ``nn.Linear`` drawn as PILOT's ``SimpleLinear``: a kaiming-uniform weight (gain 1:
    bound ``sqrt(3 / in_features)``) from ``generator`` (on the CPU) and a zero bias, on
    ``like``'s device and dtype; without a generator, zeros (no draw)."""
    layer = nn.utils.skip_init(
        nn.Linear, in_features, out_features, device=like.device, dtype=like.dtype
    )
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.zero_()
        if generator is not None:
            bound = math.sqrt(3.0 / in_features)
            drawn = torch.empty(out_features, in_features).uniform_(
                -bound, bound, generator=generator
            )
            layer.weight.copy_(drawn)
    return layer


def state_bytes(args: Mapping[str, Any]) -> int:
    """From the first firing on: two more ViTs (the branch and the student) that train, each
    with its gradient and Adam's two moments, while the first drops its own three."""
    return 4 * 5 * VIT_B16_PARAMETERS


def _below_one(cfg: Mapping[str, Any], key: str) -> None:
    """An effective-number beta below 1: at 1 the effective number ``1 - beta**n`` is 0."""
    if cfg[key] >= 1:
        raise ValueError(
            f"{key} must be below 1 (the effective number 1 - beta**n is 0 at 1); "
            f"got {cfg[key]}: upstream uses 0.96 and 0.97"
        )


CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="FOSTER",
    grows=True,  # a second branch and the student from the first firing on
    # The paper's hp_grid has no FOSTER row; its ER row (the whole ViT with a replay memory, the
    # nearest method it searched) chose 5e-5. Adam at 5e-3 ruins a whole ViT.
    default_lr=5e-5,
    # The smoke stream's tasks hold 4 classes: a firing at each of its task boundaries.
    smoke_overrides={"consolidation_new_classes": 4},
    state_bytes=state_bytes,
    upstream_differences=(
        Difference(
            "batch_logit_mask",
            "The boosting cross-entropies (of the whole head and of fe_fc) mask the logits of the "
            "classes absent from the training batch (stream and replayed rows), where upstream's "
            "cover every class its heads have grown to.",
            "The paper trains every method with the batch-wise mask (its appendix); with replay "
            "the batch holds old classes, and `logit_mask: seen` is upstream's reading.",
        ),
        Difference(
            "one_linear_head_over_every_class",
            "Every head is one linear layer over every class of the stream; at a firing the rows "
            "of classes not seen yet are drawn afresh, where upstream's update_fc grows each head "
            "by the task's classes.",
            "Online the classes of the stream are known up front but no task start is seen.",
        ),
        Difference(
            "concurrent_compression",
            "The student trains from the firing on, each step distilling the boosted network's "
            "logits on the same training batch as it boosts, where upstream compresses after "
            "boosting, for compression_epochs, against the final boosted network.",
            "One pass has no after-boosting: the segment's data is seen once, and the student "
            "must be ready when the next firing makes it the old branch.",
        ),
        Difference(
            "running_class_counts",
            "The class counts behind per_cls_weights grow through the segment: the memory's "
            "per-class quota for a class known at the last firing plus its stream samples since "
            "then, where upstream uses memory_per_class and the class's training-set size.",
            "Online a class's data is known only as far as it has streamed past; on a clear "
            "stream the counts reach upstream's at the segment's end.",
        ),
        Difference(
            "online_herding_on_student_features",
            "The memory re-picks each class's exemplars by herding as its samples stream past, "
            "ranked by the student's features, where upstream herds once at the task end over "
            "the class's data through the boosted network's concatenated features.",
            "One pass keeps no images beyond the memory; the student is the network each next "
            "segment starts from, so its feature space stays continuous across firings.",
        ),
        Difference(
            "seeded_heads",
            "A firing draws its new heads (fc's new entries, fe_fc, the student's new rows) from "
            "a generator seeded by the run's seed and the firing, where upstream draws them from "
            "the global random stream.",
            "A resumed run rebuilds the same heads, and nothing an evaluation draws can change "
            "what a firing draws.",
        ),
        Difference(
            "adam_constant_lr",
            "One optimiser, the protocol's Adam at a constant learning rate (5e-5 in the paper "
            "configs), trains the branch, heads and student, where upstream runs SGD (momentum "
            "0.9, LR 1e-3, cosine) per phase, the student without weight decay.",
            "Online there is one pass and no phase length to schedule over; the paper trains "
            "every method with Adam, and `optimizer: sgd` is one key away.",
        ),
    ),
    removed_keys={
        "boosting_epochs": "online training makes one pass: boosting trains on each step",
        "compression_epochs": "online training makes one pass: the student trains on each step",
        "lr": "online training has one learning rate, init_lr: set that",
    },
)


@register_method("foster_online", card=CARD)
class FosterOnline(MethodAdapter):
    """Boosting a second branch after each firing, a student compressing it concurrently."""

    base_model_name: ClassVar[str] = "foster"  # PILOT's transforms for its FOSTER learner
    #: Herding ranks by the lineage's features (the first backbone, then the student): one
    #: width and a continuous space across firings, where the boosted features change both.
    replay: ClassVar[Replay | None] = Replay(
        FOSTER_MEMORY_SIZE,
        memory="herding",
        per_class=FOSTER_PER_CLASS,
        why="FOSTER's memory_size 2000, fixed_memory true, memory_per_class 20",
        herding_features=HERDING_FEATURES,
    )
    consolidation: ClassVar[Consolidation] = Consolidation(
        trigger="new_classes",
        required="never boosts, so FOSTER would be fine-tuning with replay",
    )
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "beta1": ConfigKey(
            0.96,
            "effective-number beta of the boosting CE's class weights",
            check=real(0, 1),
            cross_check=lambda cfg: _below_one(cfg, "beta1"),
        ),
        "beta2": ConfigKey(
            0.97,
            "effective-number beta of the compression BKD's class weights",
            check=real(0, 1),
            cross_check=lambda cfg: _below_one(cfg, "beta2"),
        ),
        "lambda_okd": ConfigKey(1.0, "weight of the old branch's distillation", check=real(0)),
        "T": ConfigKey(2.0, "distillation temperature (KD and BKD)", check=real(positive=True)),
        "oofc": ConfigKey(
            "ft",
            "the new classes' old-feature block of the head: ft trains it, az keeps it at zero",
            choices=("ft", "az"),
        ),
        "is_teacher_wa": ConfigKey(
            False, "weight aligning is not ported (upstream's config: false)", forced=True
        ),
        "is_student_wa": ConfigKey(
            False, "weight aligning is not ported (upstream's config: false)", forced=True
        ),
        "wa_value": ConfigKey(1, "weight aligning is not ported", forced=True),
    }

    # -- the network ------------------------------------------------------------------------------
    def build_network(self, args: dict) -> nn.Module:
        """PILOT's ``FOSTERNet`` after its first ``update_fc`` (one backbone, ``fc`` drawn as
        upstream's), the head an ``nn.Linear`` over every class; an empty ``FOSTERNet`` for the
        student; the class statistics as buffers (checkpointed with the network)."""
        from utils.inc_net import FOSTERNet  # PILOT, imported lazily

        from ..core.prototypes import PrototypeBank

        classes = int(args["nb_classes"])
        network = FOSTERNet(self.pilot_args(args), True)
        network.update_fc(classes)
        drawn = network.fc
        network.fc = simple_linear(network.feature_dim, classes, drawn.weight)
        with torch.no_grad():
            network.fc.weight.copy_(drawn.weight)
        network.fe_fc = None  # upstream's first task never trains it; each firing draws one
        network.requires_grad_(True)
        network.snet = FOSTERNet(self.pilot_args(args), True)  # upstream's _snet, filled later
        network.register_buffer("seen_classes", torch.zeros(classes, dtype=torch.bool))
        network.register_buffer("known_classes", torch.zeros(classes, dtype=torch.bool))
        network.register_buffer("stream_counts", torch.zeros(classes, dtype=torch.int64))
        # Running class means of the lineage's features: the first backbone, then each student.
        network.lineage_means = PrototypeBank(classes, int(network.out_dim))
        self.firings = 0
        return network

    @staticmethod
    def boosting(network: nn.Module) -> bool:
        """Whether the network has the two branches (from the first firing on)."""
        return len(network.backbones) > 1

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        backbones = network.backbones
        if not self.boosting(network):
            features = backbones[0](x)  # timm ViT with num_classes=0: the pooled, normed token
            extras = {HERDING_FEATURES: features.detach()} if train else {}
            return StepOutput(network.fc(features), features, extras=extras)
        old, new = backbones[0](x), backbones[1](x)
        features = torch.cat([old, new], dim=1)
        logits = network.fc(features)
        if not train:
            return StepOutput(logits, features)
        student = network.snet.backbones[0](x)
        extras = {
            "fe_logits": network.fe_fc(new),
            "old_logits": network.oldfc(old).detach(),
            "student_logits": network.snet.fc(student),
            HERDING_FEATURES: student.detach(),
        }
        return StepOutput(logits, features, extras=extras)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc

    def set_mode(self, network: nn.Module, train: bool) -> None:
        network.train(train)
        if train and self.boosting(network):
            network.backbones[0].eval()  # upstream's train(): the old branch in eval mode

    # -- the losses -----------------------------------------------------------------------------
    def class_weights(self, network: nn.Module, beta: float) -> torch.Tensor:
        """``per_cls_weights`` from the distinct samples of each class seen since the last firing:
        the memory's quota (upstream's ``samples_old_class``) for a class known then, plus its
        stream samples since (``samples_new_class``, so far)."""
        seen, known = network.seen_classes, network.known_classes
        size, per_class = int(self.args["er_memory_size"]), self.args.get("er_memory_per_class")
        quota = size // seen.sum().clamp_min(1)  # the memory's share per class seen
        if per_class is not None:
            quota = quota.clamp_max(int(per_class))
        counts = network.stream_counts + known * quota
        return effective_number_weights(counts, seen, beta)

    def loss_terms(
        self, network: nn.Module, out: StepOutput, batch: TrainingBatch
    ) -> dict[str, torch.Tensor]:
        """``ce``: CE on the first segment; from the first firing on, upstream's ``CE(logits /
        per_cls_weights)`` (``beta1``). The batch's classes join the seen ones first.

        From the first firing on, also: ``CE(fe_logits)`` under the training mask,
        ``lambda_okd`` times ``_KD_loss`` of the known classes against the old branch, and the
        student's ``BKD`` against the boosted logits (detached) over the classes seen
        (``beta2``)."""
        labels, seen = batch.labels, network.seen_classes
        seen |= classes_present(labels, len(seen), validate=False)
        logits = out.logits
        if self.boosting(network):
            logits = logits / self.class_weights(network, float(self.args["beta1"])).to(
                logits.dtype
            )
        ce = F.cross_entropy(batch.masked(logits), labels)
        if not self.boosting(network):
            return {"ce": ce}
        mask = training_mask(self.args["logit_mask"], labels, seen, len(seen), validate=False)
        fe_logits = out.extras["fe_logits"]
        temperature = float(self.args["T"])
        old = out.extras["old_logits"]
        weights = self.class_weights(network, float(self.args["beta2"]))
        if mask is not None:
            fe_logits = mask_logits(fe_logits, mask)
        return {
            "ce": ce,
            "fe": F.cross_entropy(fe_logits, labels),
            "kd": float(self.args["lambda_okd"])
            * distillation_loss(out.logits, old, network.known_classes, temperature),
            "bkd": distillation_loss(
                out.extras["student_logits"], out.logits.detach(), seen, temperature, weights
            ),
        }

    @no_grad
    def after_backward(self, network: nn.Module, autocast: Autocast) -> dict[str, torch.Tensor]:
        """``oofc: az``: the new classes' rows of the old-feature block get no gradient."""
        if self.args["oofc"] == "az" and self.boosting(network):
            grad = network.fc.weight.grad
            if grad is not None:
                grad[:, : network.out_dim].masked_fill_(~network.known_classes[:, None], 0.0)
        return {}

    @no_grad
    def after_step(self, network: nn.Module, step: TrainedStep) -> tuple[nn.Parameter, ...]:
        """The stream batch joins the class counts and the lineage's class means."""
        if step.stream is None:  # an extra step of online_iter: the batch is observed once
            return ()
        out, labels = step.stream, step.stream_labels
        network.stream_counts.index_add_(0, labels, torch.ones_like(labels))
        lineage = out.extras[HERDING_FEATURES][: len(labels)]
        network.lineage_means.update(lineage, labels, validate=False)
        return ()

    # -- the firing -----------------------------------------------------------------------------
    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Upstream's next ``update_fc`` (and ``_snet``'s build): the first firing adds the second
        branch and the student; later ones copy the student into both branches. Then every head
        is drawn again (``fc``, ``fe_fc``, the student's), ``oldfc`` takes the last head. Returns
        the branch and student parameters kept in place, whose optimiser state restarts."""
        known = network.known_classes
        known.copy_(network.seen_classes)
        network.stream_counts.zero_()
        if self.boosting(network):
            source = network.snet
            for branch in network.backbones:
                branch.load_state_dict(source.backbones[0].state_dict())
            last_head = network.snet.fc
        else:
            self._grow(network)
            last_head = network.fc
        generator = torch.Generator().manual_seed(self.run_seed() * 1_000_003 + firing)
        self._draw_heads(network, last_head, known, generator)
        self.firings += 1
        return Consolidated(
            restarted=[*network.backbones.parameters(), *network.snet.backbones.parameters()],
            feature_map=partial(self.lineage_twice, network),
        )

    def _grow(self, network: nn.Module) -> None:
        """The first firing's structure: a second branch and the student's backbone, both
        copies of the first branch, which freezes."""
        old = network.backbones[0]
        network.backbones.append(copy.deepcopy(old))
        network.snet.backbones.append(copy.deepcopy(old))
        network.snet.out_dim = network.out_dim
        old.requires_grad_(False)

    def _draw_heads(
        self,
        network: nn.Module,
        last: nn.Linear,
        known: torch.Tensor,
        generator: torch.Generator | None,
    ) -> None:
        """``oldfc`` := a frozen copy of ``last``; ``fc`` over both branches with ``last``'s rows
        of the ``known`` classes in its old-feature block (``update_fc``), the rest drawn as
        ``SimpleLinear`` from ``generator`` (``oofc: az``: that block's other rows 0); a new
        ``fe_fc``; the student's head with ``oldfc``'s known rows (``copy_fc``)."""
        width, classes = int(network.out_dim), last.out_features
        like = last.weight
        network.oldfc = copy.deepcopy(last).requires_grad_(False)
        fc = simple_linear(2 * width, classes, like, generator)
        fe_fc = simple_linear(width, classes, like, generator)
        student = simple_linear(width, classes, like, generator)
        rows = known[:, None]
        with torch.no_grad():
            others = 0.0 if self.args["oofc"] == "az" else fc.weight[:, :width]
            fc.weight[:, :width] = torch.where(rows, last.weight, others)
            fc.bias.copy_(torch.where(known, last.bias, fc.bias))
            student.weight.copy_(torch.where(rows, last.weight, student.weight))
            student.bias.copy_(torch.where(known, last.bias, student.bias))
        network.fc, network.fe_fc, network.snet.fc = fc, fe_fc, student

    def lineage_twice(self, network: nn.Module, means: torch.Tensor) -> torch.Tensor:
        """A firing's feature map of the class means: after a firing both branches are the
        student (the first branch at the first firing), so a class's mean of the concatenated
        features is its lineage mean twice: the running mean of the student lineage's features,
        with the P bank's own counts."""
        lineage = network.lineage_means.means
        return torch.cat([lineage, lineage], dim=1).to(means.dtype)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        oldfc = getattr(network, "oldfc", None)
        state = None if oldfc is None else {k: v.clone() for k, v in oldfc.state_dict().items()}
        return {"firings": self.firings, "oldfc": state}

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        """Rebuild the boosting structure (its values load afterwards) and ``oldfc``."""
        self.firings = int(state["firings"])
        if self.firings and not self.boosting(network):
            self._grow(network)
            self._draw_heads(network, network.fc, network.known_classes, generator=None)
        if state["oldfc"] is not None:
            network.oldfc.load_state_dict(state["oldfc"])

    def report(self) -> dict[str, Any]:
        return {"foster": {"firings": getattr(self, "firings", 0)}}

"""COIL online (``coil_online``): Co-Transport for Class-Incremental Learning (Zhou et al., ACM MM
2021; PILOT's ``models/coil.py``, ``exps/coil.json``).

Upstream trains the whole ViT-B with a cosine head (``SimpleCosineIncrementalNet``: ``sigma *
cos(features, row)``, learnable ``sigma``) on each task's data and a herding memory of 2000
(``fixed_memory: false``). At each task end (``after_task``) the *prospective* transport
(``solving_ot``) solves a Sinkhorn plan from the old classes' feature means to the next task's
(which it reads ahead) and carries the old rows over: the next head's new rows start at
``T^T normalize(W_old) * n_old * calibration`` (``update_fc(..., nextperiod_initialization)``);
then the network is frozen as the teacher. In a task's first epoch the loss is
``KD * lamda + CE * (1 - lamda) + 0.001 * new_branch`` (``lamda`` = known / total;
``new_branch``: the new columns distilled towards the transported rows' cosine predictions); later
epochs replace the new branch by the *retrospective* transport (``solving_ot_to_old``, every 30
batches) weighted ``reg_term * (epoch / epochs) ** 2``.

Online, one pass is upstream's first epoch: every step after a firing trains on that loss and the
retrospective branch never runs (its weight is 0 at epoch 0). The teacher is the engine's
(``Consolidation(teacher=True)``), replay is declared (herding, 2000). The next classes cannot be
read ahead at a firing: a class's mean exists from the step that first brings it, so after that
step the transport runs over every class arrived since the firing (:meth:`COILOnline.after_step`),
sets the arrivals' rows and replaces the new branch's rows of all of them. Class means are
running means of the stream's L2-normalised features
(:class:`~pilot_online.core.networks.CoTransportState`). The Sinkhorn solver is
``core/transport.py``'s, equal to POT's ``ot.sinkhorn``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..core.checks import real
from ..core.lazy import F, nn, no_grad, torch
from ..core.masks import classes_present
from ..core.transport import prospective_rows
from ..engine.adapter import (
    ConfigKey,
    Consolidated,
    Consolidation,
    MethodAdapter,
    Replay,
    StepOutput,
    TrainedStep,
    TrainingBatch,
)
from ..engine.backbone_names import PLAIN_VIT
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.differences import (
    LOGITS_ONLY_EVALUATION,
    ONLINE_HERDING,
    REPLAY_LOGIT_MASK,
    TEACHER_AT_FIRING,
)
from ..engine.registry import register_method
from ..engine.teacher import distillation_loss

if TYPE_CHECKING:
    from ..core.cosine_head import CosineHead


#: Upstream's ``exps/coil.json``: ``memory_size`` 2000 (``fixed_memory`` false), ``sinkhorn``
#: 0.464, ``norm_term`` 3, ``T`` 2.
COIL_MEMORY_SIZE = 2000
#: The new-branch distillation's weight, hard-coded upstream: ``0.001 * weight_ot_init``, and
#: ``weight_ot_init = max(1 - (epoch / 2) ** 2, 0)`` is 1 at epoch 0.
NEW_BRANCH_WEIGHT = 1e-3


def attach_coil_head(network: nn.Module, feature_dim: int, num_classes: int) -> CosineHead:
    """Give ``network`` COIL's online head, a cosine head over every class (``fc``, its sigma
    ``fc_sigma``: upstream's ``CosineLinear`` draw), and its transport state
    (:class:`~pilot_online.core.networks.CoTransportState`)."""
    from ..core.cosine_head import attach_cosine_head
    from ..core.networks import CoTransportState

    head = attach_cosine_head(network, feature_dim, num_classes)
    network.co_transport = CoTransportState(num_classes, feature_dim)
    return head


CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="COIL",
    # All four rows: the cosine head is a classifier with a row per class (an ``nn.Linear``
    # without bias whose forward is ``sigma * cos``), so + P replays the prototypes through the
    # network's own cosine logits and class-wise FGH weights its rows (sigma, one scalar shared
    # by every class, is left to the optimiser, as the backbone is).
    variants=("base", "p", "fgh_only", "fgh"),
    # Upstream: SGD at 1e-3 on the whole ViT. The paper's hp_grid has no COIL row; its ER row
    # (the whole ViT with a replay memory, the nearest method it searched) chose Adam at 5e-5.
    default_lr=5e-5,
    # The smoke stream's tasks hold 4 classes: a firing at each of its task boundaries.
    smoke_overrides={"consolidation_new_classes": 4},
    upstream_differences=(
        REPLAY_LOGIT_MASK,
        UpstreamDifference(
            "one_cosine_head_over_every_class",
            "The cosine head (upstream's CosineLinear: sigma times the cosine, rows drawn alike) "
            "has a row for every class of the stream from the build, where upstream's update_fc "
            "grows it by each task's classes at the task's start (zero rows without a transport).",
            "Online the classes of the stream are known up front but no task start is seen; a "
            "row trains only once its class is in a batch (the logit mask).",
        ),
        UpstreamDifference(
            "first_epoch_loss",
            "Every step after a firing trains on upstream's first-epoch loss (KD * lamda + CE * "
            "(1 - lamda) + 0.001 * the new-branch distillation), never the later epochs' "
            "retrospective transport (solving_ot_to_old every 30 batches, weighted reg_term * "
            "(epoch / epochs) ** 2).",
            "One pass is one epoch, and upstream's retrospective weight is 0 at epoch 0; its "
            "old-class means would need a pass over the memory every 30 steps.",
        ),
        UpstreamDifference(
            "transport_at_arrival",
            "The prospective transport runs after the step that first brings a class since the "
            "last firing, over every class arrived since then: it sets the arrivals' rows (the "
            "step itself trained the rows drawn at build) and replaces the new-branch rows of "
            "all of them; upstream runs it once, at the task end, over the whole next task, "
            "before the task's first step.",
            "A firing cannot read the next task ahead: a class's mean exists from its first "
            "batch, and the transport separates new classes only jointly (one class alone gets "
            "the old rows' mean direction).",
        ),
        UpstreamDifference(
            "stream_class_means",
            "Class means are running means of each class's L2-normalised stream features (the "
            "training forward's, before each step's update), where upstream extracts them from "
            "all the class's training data with the task-end network (eval mode, test "
            "transforms), for the old classes and the next task's.",
            "One pass keeps no images beyond the replay memory, so a class's data is seen once, "
            "by the network of its step.",
        ),
        UpstreamDifference(
            "lamda_over_seen_classes",
            "lamda is (classes known at the last firing) / (classes seen so far), which grows "
            "as the period's classes arrive, where upstream's is known / total with the whole "
            "task's classes counted from its start.",
            "No task size is known online; on the paper's clear streams (100 samples a batch, "
            "10 classes a task) the first batch after a firing brings the whole task.",
        ),
        ONLINE_HERDING,
        TEACHER_AT_FIRING,
        LOGITS_ONLY_EVALUATION,
        UpstreamDifference(
            "adam_constant_lr",
            "The optimiser is the protocol's Adam at a constant learning rate (5e-5 in the paper "
            "configs), where upstream runs SGD (momentum 0.9, LR 1e-3, weight decay 5e-4) for "
            "10 epochs per task with a step schedule.",
            "Online there is one pass and no task length to schedule over; the paper trains "
            "every method with Adam, and `optimizer: sgd` is one key away.",
        ),
    ),
)


@register_method("coil_online", card=CARD)
class COILOnline(MethodAdapter):
    """The whole ViT and a cosine head, herding replay, distillation from the last firing and
    the prospective co-transport (module docstring)."""

    base_model_name: ClassVar[str] = "coil"  # PILOT's transforms for its COIL learner
    replay: ClassVar[Replay | None] = Replay(
        COIL_MEMORY_SIZE,
        memory="herding",
        why="COIL's memory_size 2000, fixed_memory false: a quota of 2000 // classes seen",
    )
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "sinkhorn": ConfigKey(
            0.464,
            "entropic regularisation of the transport's Sinkhorn plan (upstream's key and value)",
            check=real(positive=True),
        ),
        "norm_term": ConfigKey(
            3.0,
            "p of the transport's cost, the p-norm distance between class means (upstream's key "
            "and value)",
            check=real(minimum=1),
        ),
        "T": ConfigKey(
            2.0,
            "temperature of both distillation terms (upstream's key and value)",
            check=real(positive=True),
        ),
    }
    #: Upstream acts at task ends: a firing at each task boundary of a clear stream whose tasks
    #: hold ``consolidation_new_classes`` classes takes the teacher and the old classes' means
    #: and rows where ``after_task`` does.
    consolidation: ClassVar[Consolidation] = Consolidation(
        trigger="new_classes",
        required="takes no teacher and no transport, so COIL would be replay with a cosine head",
        teacher=True,
    )

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import SimpleCosineIncrementalNet  # PILOT, imported lazily

        network = SimpleCosineIncrementalNet(self.pilot_args(args), True)
        attach_coil_head(network, network.feature_dim, int(args["nb_classes"]))
        network.requires_grad_(True)  # upstream trains the whole network
        self._state = network.co_transport
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = network.backbone(x)  # timm ViT with num_classes=0: the pooled, normed token
        return StepOutput(network.fc(features), features)

    def classifier(self, network: nn.Module) -> CosineHead:
        return network.fc

    # -- the loss -----------------------------------------------------------------------------
    def loss_terms(
        self, network: nn.Module, out: StepOutput, batch: TrainingBatch
    ) -> dict[str, torch.Tensor]:
        """``ce``: the masked cross-entropy times ``1 - lamda``, ``lamda`` = known / seen (0
        before the first firing, where upstream's loss is the plain cross-entropy); ``seen``: the
        classes seen before this step and those of its rows (stream and replay).

        After a firing, upstream's first-epoch terms on every row: ``lamda`` x the distillation
        of the known classes from the teacher, and 0.001 x the new branch, the transported
        classes' logits distilled towards the cosines of the normalised features with the
        transported rows."""
        state = network.co_transport
        seen = state.seen | classes_present(batch.labels, len(state.seen), validate=False)
        ce = super().loss_terms(network, out, batch)["ce"]
        ce = ce * (1 - state.known.sum() / seen.sum())
        state.seen.copy_(batch.seen)
        if batch.teacher is None:
            return {"ce": ce}
        temperature = float(self.args["T"])
        lamda = batch.known.sum() / batch.seen.sum()
        distillation = distillation_loss(out.logits, batch.teacher.logits, batch.known, temperature)
        rows = F.normalize(state.new_branch, dim=1).to(out.features.dtype)
        prospective = F.linear(F.normalize(out.features, dim=1), rows)
        new_branch = distillation_loss(out.logits, prospective, state.transported, temperature)
        return {
            "ce": ce,
            "distillation": lamda * distillation,
            "new_branch": NEW_BRANCH_WEIGHT * new_branch,
        }

    # -- the co-transport ---------------------------------------------------------------------
    @no_grad
    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Upstream's ``after_task``: the loop has taken the teacher and moved ``known``; keep
        the old classes' means and rows for the transports of the period that starts. Nothing
        restarts."""
        state = network.co_transport
        state.known.copy_(state.seen)
        state.anchor_means.copy_(F.normalize(state.class_means.means, dim=1))
        state.anchor_rows.copy_(network.fc.weight)
        state.transported.zero_()
        state.new_branch.zero_()
        return Consolidated()

    @no_grad
    def after_step(self, network: nn.Module, step: TrainedStep) -> tuple[nn.Parameter, ...]:
        """Fold the stream batch's normalised features into the class means; after a firing,
        transport when the batch brought classes not known at it and not transported yet (one
        host read per step)."""
        if step.stream is None:  # an extra step of online_iter: the batch is observed once
            return ()
        out, labels = step.stream, step.stream_labels
        state = network.co_transport
        self._state = state
        state.class_means.update(F.normalize(out.features.float(), dim=1), labels, validate=False)
        present = classes_present(labels, len(state.seen), validate=False)
        arrivals = present & ~state.known & ~state.transported
        if bool(arrivals.any() & state.known.any()):
            self._transport(network, arrivals)
        return ()

    def _transport(self, network: nn.Module, arrivals: torch.Tensor) -> None:
        """The prospective transport from the known classes to every class arrived since the
        firing (on the CPU in float64, as upstream's POT call): the arrivals' head rows and every
        arrived class's new-branch row."""
        state = network.co_transport
        old = state.known.nonzero().squeeze(1)
        arrived = (state.transported | arrivals).nonzero().squeeze(1)
        host = {"device": "cpu", "dtype": torch.float64}
        rows, gamma = prospective_rows(
            state.anchor_means[old].to(**host),
            F.normalize(state.class_means.means[arrived].to(**host), dim=1),
            state.anchor_rows[old].to(**host),
            reg=float(self.args["sinkhorn"]),
            p=float(self.args["norm_term"]),
        )
        weight = network.fc.weight
        rows = rows.to(weight.device, weight.dtype)
        state.new_branch[arrived] = rows
        fresh = arrivals[arrived]
        weight[arrived[fresh]] = rows[fresh]
        state.transported |= arrivals
        state.calibration.fill_(float(gamma))
        state.transports += 1

    def report(self) -> dict[str, Any]:
        state = getattr(self, "_state", None)
        if state is None:
            return {}
        return {
            "coil": {
                "transports": int(state.transports),
                "calibration": float(state.calibration),
                "known": int(state.known.sum()),
                "transported": int(state.transported.sum()),
            }
        }

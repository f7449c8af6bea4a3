"""iCaRL online (``icarl_online``): herding replay and distillation from the network at the last
task end (Rebuffi et al., CVPR 2017; PILOT's ``models/icarl.py``, ``exps/icarl.json``).

Upstream trains the whole ViT-B (``IncrementalNet``: the backbone's pooled token, a linear head
grown per task) on each task's data plus its exemplars, with the cross-entropy over every class
its head has and, from the second task on, ``_KD_loss(logits[:, :known], old(x), T=2)`` against
a frozen copy of the network taken at the previous task's end (``after_task``). At each task end
it rebuilds a herding memory of ``memory_size`` 2000 (``build_rehearsal_memory``).

The online port is three declarations on the engine: the network is PILOT's ``IncrementalNet``
with one linear head over every class (``online_head``); replay is declared (``replay =
Replay(2000, memory="herding")``: a herding memory of 2000, upstream's ``memory_size`` with
``fixed_memory: false``); the teacher is the engine's (``Consolidation(teacher=True)``: a frozen
snapshot at each consolidation firing). What the adapter itself computes is the distillation
term, in :meth:`loss_terms`, over the classes known at the last firing (a mask: in a Si-Blurry
stream they are no prefix).
"""

from __future__ import annotations

from typing import ClassVar

from ..core.checks import real
from ..core.lazy import nn, torch
from ..engine.adapter import (
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
    LOGITS_ONLY_EVALUATION,
    ONE_LINEAR_HEAD,
    ONLINE_HERDING,
    REPLAY_LOGIT_MASK,
    TEACHER_AT_FIRING,
)
from ..engine.registry import register_method
from ..engine.teacher import distillation_loss
from .finetune import FinetuneOnline

#: Upstream's ``exps/icarl.json``: ``memory_size`` 2000, ``fixed_memory`` false, ``T`` 2.
ICARL_MEMORY_SIZE = 2000
ICARL_TEMPERATURE = 2.0


CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="iCaRL",
    # The paper's hp_grid has no iCaRL row; its ER row (the whole ViT with a replay memory, the
    # nearest method it searched) chose 5e-5 (docs/methods.md). Adam at 5e-3 ruins a whole ViT.
    default_lr=5e-5,
    # The smoke stream's tasks hold 4 classes: a firing at each of its task boundaries.
    smoke_overrides={"consolidation_new_classes": 4},
    upstream_differences=(
        REPLAY_LOGIT_MASK,
        ONE_LINEAR_HEAD,
        ONLINE_HERDING,
        LOGITS_ONLY_EVALUATION,
        UpstreamDifference(
            "adam_constant_lr",
            "The optimiser is the protocol's Adam at a constant learning rate (5e-5 in the paper "
            "configs), where upstream runs SGD (momentum 0.9, LR 1e-3, weight decay 5e-4 then "
            "2e-4) for 20 epochs per task, under step schedules whose milestones lie past them.",
            "Online there is one pass and no task length to schedule over; the paper trains "
            "every method with Adam, and `optimizer: sgd` is one key away.",
        ),
        TEACHER_AT_FIRING,
    ),
)


@register_method("icarl_online", card=CARD)
class ICaRLOnline(FinetuneOnline):
    """The whole ViT and a linear head, herding replay, distillation from the last firing."""

    base_model_name: ClassVar[str] = "icarl"  # PILOT's transforms for its iCaRL learner
    replay: ClassVar[Replay | None] = Replay(
        ICARL_MEMORY_SIZE,
        memory="herding",
        why="iCaRL's memory_size 2000, fixed_memory false: a quota of 2000 // classes seen",
    )
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "T": ConfigKey(
            ICARL_TEMPERATURE,
            "distillation temperature (upstream's key and value: 2)",
            check=real(positive=True),
        ),
    }
    #: Upstream acts at task ends: a firing at each task boundary of a clear stream whose tasks
    #: hold ``consolidation_new_classes`` classes takes the teacher where ``after_task`` does.
    consolidation: ClassVar[Consolidation] = Consolidation(
        trigger="new_classes",
        required="takes no teacher, so iCaRL would never distil",
        teacher=True,
    )

    def build_network(self, args: dict) -> nn.Module:
        # PILOT's IncrementalNet (its forward expects SimpleLinear's dict: the inherited forward
        # reads the backbone's pooled token through this nn.Linear head instead).
        from utils.inc_net import IncrementalNet  # PILOT, imported lazily

        network = IncrementalNet(self.pilot_args(args), True)
        self.online_head(network, args)  # not update_fc: one nn.Linear over every class
        network.requires_grad_(True)  # upstream trains the whole network
        return network

    def loss_terms(
        self, network: nn.Module, out: StepOutput, batch: TrainingBatch
    ) -> dict[str, torch.Tensor]:
        """Upstream's ``_KD_loss`` on every row (stream and replay) against the teacher, over the
        classes known at the last firing, beside the CE; none before the first firing (upstream's
        first task)."""
        terms = super().loss_terms(network, out, batch)
        if batch.teacher is None:
            return terms
        temperature = float(self.args.get("T", ICARL_TEMPERATURE))
        terms["kd"] = distillation_loss(out.logits, batch.teacher.logits, batch.known, temperature)
        return terms

    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Upstream's ``after_task`` copies the network and moves ``_known_classes``: the loop
        does both (the engine teacher, ``known``) before calling this. Nothing restarts."""
        return Consolidated()

"""Fine-tuning online (``finetune_online``) and experience replay (``er_online``): the paper's
memory-free lower bound and its memory-based baseline.

The network is PILOT's own plain-ViT class, ``SimpleVitNet`` (``utils/inc_net.py``), on PILOT's
``vit_base_patch16_224`` backbone; every parameter trains. Upstream's fine-tuning learner
(``models/finetune.py``) builds an ``IncrementalNet`` on the same backbone, whose forward is the
same: the backbone's pooled token, then a linear head. Two things differ from upstream:

- Upstream grows its linear head (``SimpleLinear``) task by task (``update_fc``). Online there
  are no tasks, so the head is one ``nn.Linear`` over all classes, set once at build:
  prototypes are replayed through it and FGH's class mode reweights its rows. The loss masks the
  classes absent from the batch where upstream masks those outside the task
  (the card's ``upstream_differences``).
- PILOT's factory builds the plain ViT with ``pretrained=True`` and no dropout arguments
  hard-coded; the engine forces the config's ``pretrained``, ``drop`` and ``drop_path`` onto that
  ``timm.create_model`` call instead (``engine/backbone_names.py``: ``factory_overrides``).

``er_online`` is the same model with the ``ReplayMixin`` of the loop (a reservoir of 1,000 stream
samples, 100 replayed per step): replay is a mechanism, so it composes with any method.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..core.lazy import nn, torch
from ..engine.adapter import MethodAdapter, Replay, StepOutput
from ..engine.backbone_names import PLAIN_VIT
from ..engine.card import MethodCard
from ..engine.differences import BATCH_LOGIT_MASK, ONE_LINEAR_HEAD
from ..engine.registry import register_method

CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="Fine-tuning",
    upstream_differences=(
        BATCH_LOGIT_MASK,
        ONE_LINEAR_HEAD,
    ),
)


@register_method("finetune_online", card=CARD)
class FinetuneOnline(MethodAdapter):
    base_model_name: ClassVar[str] = "finetune"  # PILOT's transforms for its fine-tuning learner

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import SimpleVitNet

        network = SimpleVitNet(self.pilot_args(args), True)
        self.online_head(network, args)
        network.requires_grad_(True)
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = network.backbone(x)  # timm ViT with num_classes=0: the pooled, normed token
        return StepOutput(network.fc(features), features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc


ER_CARD = dataclasses.replace(
    CARD,
    paper_name="ER",
    upstream_model="",  # not a PILOT model (PILOT has no replay row)
)


@register_method("er_online", card=ER_CARD)
class EROnline(FinetuneOnline):
    """Fine-tuning plus experience replay (the loop's ``ReplayMixin``, on by default here)."""

    #: The paper's replay settings: 1,000 samples in a reservoir, 100 replayed per step.
    replay: ClassVar[Replay | None] = Replay(1000, why="paper: 1000")

"""Linear probe online (``linear_probe_online``) and ER + linear probe
(``er_linear_probe_online``).

The fine-tuning network (PILOT's ``SimpleVitNet`` with one ``nn.Linear`` head, see
``finetune.py``) with the whole backbone frozen: only the final FC layer trains. Features are
computed afresh at every step, under ``no_grad`` (nothing needs their gradient) and never cached:
training transforms are random for real datasets, so cached features would change the result.
The frozen backbone stays in eval mode (a fixed feature extractor: no dropout).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..core.lazy import nn, torch
from ..engine.adapter import Replay, StepOutput
from ..engine.registry import register_method
from .finetune import CARD as FINETUNE_CARD
from .finetune import EROnline, FinetuneOnline

CARD = dataclasses.replace(
    FINETUNE_CARD,
    paper_name="Linear probe",
    upstream_model="",  # not a PILOT model (PILOT has no replay row)
)


@register_method("linear_probe_online", card=CARD)
class LinearProbeOnline(FinetuneOnline):
    def build_network(self, args: dict) -> nn.Module:
        network = super().build_network(args)
        network.backbone.requires_grad_(False)
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        with torch.no_grad():
            features = network.backbone(x)
        return StepOutput(network.fc(features), features)

    def set_mode(self, network: nn.Module, train: bool) -> None:
        network.eval()  # a frozen extractor: only the head trains
        network.fc.train(train)


ER_CARD = dataclasses.replace(CARD, paper_name="ER + Linear probe")


@register_method("er_linear_probe_online", card=ER_CARD)
class ERLinearProbeOnline(LinearProbeOnline):
    """Linear probe plus experience replay (the loop's ``ReplayMixin``, on by default here)."""

    replay: ClassVar[Replay | None] = EROnline.replay

"""APER with AdaptFormer adapters online (``aper_adapter_online``): the APER network of
``aper_finetune.py`` whose adapted branch is PILOT's adapter ViT (``backbone/vit_adapter.py``,
parallel bottleneck MLPs of width ``ffn_num``), training only the adapters, as upstream's
``models/aper_adapter.py`` does on its first task. PILOT hard-codes the adapters' dropout (0.1);
``adapter_dropout`` sets it. What upstream does at the first task boundary and what the port does
instead: see ``aper_finetune.py``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..core.checks import integer, real
from ..core.lazy import nn
from ..engine.adapter import ConfigKey
from ..engine.backbone_names import pilot_backbones
from ..engine.registry import register_method
from .aper_finetune import CARD as APER_CARD
from .aper_finetune import AperFinetuneOnline

CARD = dataclasses.replace(
    APER_CARD,
    paper_name="APER w/ Adapter",
    backbone_types=pilot_backbones("aper_adapter"),
    #: No dropout in the smoke runs (as their ``drop``), so one step is a function of the state.
    smoke_overrides={"adapter_dropout": 0.0},
)


@register_method("aper_adapter_online", card=CARD)
class AperAdapterOnline(AperFinetuneOnline):
    base_model_name: ClassVar[str] = "aper_adapter"
    tuned_parameters: ClassVar[tuple[str, ...]] = ("adaptmlp",)
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "ffn_num": ConfigKey(64, "adapter bottleneck width (PILOT: 64)", check=integer(minimum=1)),
        "adapter_dropout": ConfigKey(
            0.1, "dropout inside the adapters (PILOT hard-codes 0.1)", check=real(0, 1)
        ),
    }

    def build_network(self, args: dict) -> nn.Module:
        network = super().build_network(args)
        for block in network.backbones[1].blocks:
            block.adaptmlp.dropout = float(args["adapter_dropout"])  # a float attribute upstream
        return network

"""APER with AdaptFormer adapters online (``aper_adapter_online``): the APER network of
``aper_finetune.py`` whose adapted branch is PILOT's adapter ViT (``backbone/vit_adapter.py``,
parallel bottleneck MLPs of width ``ffn_num``), training only the adapters, as upstream's
``models/aper_adapter.py`` does on its first task. What upstream does at the first task boundary
and what the port does instead: see ``aper_finetune.py``.
"""

from __future__ import annotations

from typing import ClassVar

from ..core.checks import integer
from ..engine.adapter import ConfigKey
from ..engine.registry import register_method
from ..pilot.backbone_names import pilot_backbones
from .aper_finetune import AperFinetuneOnline


@register_method("aper_adapter_online")
class AperAdapterOnline(AperFinetuneOnline):
    base_model_name: ClassVar[str] = "aper_adapter"
    backbone_types: ClassVar[tuple[str, ...]] = pilot_backbones("aper_adapter")
    tuned_parameters: ClassVar[tuple[str, ...]] = ("adaptmlp",)
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "ffn_num": ConfigKey(64, "adapter bottleneck width (PILOT: 64)", check=integer(minimum=1)),
    }

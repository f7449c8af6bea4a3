"""APER with VPT online (``aper_vpt_online``): the APER network of ``aper_finetune.py`` whose
adapted branch is PILOT's VPT ViT (``backbone/vpt.py``), training only its prompt tokens, as
upstream's ``models/aper_vpt.py`` does on its first task. As in PILOT, ``vpt_type`` picks deep
prompts (one set per block) or shallow ones (before the first block), and ``prompt_token_num``
their length. What upstream does at the first task boundary and what the port does instead: see
``aper_finetune.py``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..core.checks import integer
from ..engine.adapter import ConfigKey
from ..engine.backbone_names import pilot_backbones
from ..engine.registry import register_method
from .aper_finetune import CARD as APER_CARD
from .aper_finetune import AperFinetuneOnline

#: PILOT's ``vpt_type`` values (``get_backbone``: "shallow", anything else is deep).
VPT_TYPES = ("deep", "shallow")

CARD = dataclasses.replace(
    APER_CARD, paper_name="APER w/ VPT", backbone_types=pilot_backbones("aper_vpt")
)


@register_method("aper_vpt_online", card=CARD)
class AperVPTOnline(AperFinetuneOnline):
    base_model_name: ClassVar[str] = "aper_vpt"
    tuned_parameters: ClassVar[tuple[str, ...]] = ("Prompt_Tokens",)
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "vpt_type": ConfigKey(
            "deep", "VPT prompts: deep (every block) or shallow", choices=VPT_TYPES
        ),
        "prompt_token_num": ConfigKey(5, "VPT prompt tokens per layer", check=integer(minimum=1)),
    }

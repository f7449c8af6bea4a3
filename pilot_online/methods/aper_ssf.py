"""APER with SSF online (``aper_ssf_online``): the APER network of ``aper_finetune.py`` whose
adapted branch is PILOT's SSF ViT (``backbone/vit_ssf.py``), training only its scale and shift
parameters, as upstream's ``models/aper_ssf.py`` does on its first task. What upstream does at
the first task boundary and what the port does instead: see ``aper_finetune.py``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..engine.backbone_names import pilot_backbones
from ..engine.registry import register_method
from .aper_finetune import CARD as APER_CARD
from .aper_finetune import AperFinetuneOnline

CARD = dataclasses.replace(
    APER_CARD, paper_name="APER w/ SSF", backbone_types=pilot_backbones("aper_ssf")
)


@register_method("aper_ssf_online", card=CARD)
class AperSSFOnline(AperFinetuneOnline):
    base_model_name: ClassVar[str] = "aper_ssf"
    tuned_parameters: ClassVar[tuple[str, ...]] = ("ssf_scale", "ssf_shift_")

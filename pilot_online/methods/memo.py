"""MEMO online (``memo_online``): Memory-efficient Expandable MOdel (Zhou et al., ICLR 2023), one
specialized block per consolidation firing on shared generalized blocks (PILOT's
``models/memo.py``, ``exps/memo.json``, ``AdaptiveNet`` in ``utils/inc_net.py``,
``backbone/vit_memo.py``).

Upstream splits a ViT-B: ``Generalized_Vit`` (the patch embedding and the first 11 blocks, the
``TaskAgnosticExtractor``) trains in the first task and is frozen after it unless
``train_base``; each task appends a ``Specialized_Vit`` (the 12th block, the final norm and the
class token's readout) loaded from the last, the older ones frozen unless ``train_adaptive``. The
head and the auxiliary head grow as DER's, and the loss is
``CE(logits, y) + alpha_aux * CE(aux_logits, aux_y)`` from the second task on. Replay: a herding
memory of 2000.

Online this is :class:`~pilot_online.methods.der.DEROnline` with these branches: a firing freezes
the generalized blocks (unless ``train_base``), adds a specialized extractor copied from the last
and freezes the older (unless ``train_adaptive``). ``Specialized_Vit`` subclasses the whole
``VisionTransformer``, so each also builds 12 blocks, a patch embedding and position embeddings it
never runs; the port drops those blocks and freezes the embeddings (:func:`trim_specialized`):
about 86M dead parameters per firing that upstream holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ..core.checks import boolean, real
from ..core.lazy import nn, torch
from ..engine.adapter import ConfigKey
from ..engine.backbone_names import pilot_backbones
from ..engine.card import UpstreamDifference
from ..engine.registry import register_method
from .der import CARD as DER_CARD
from .der import DEROnline

#: Parameters one specialized extractor keeps after :func:`trim_specialized` (ViT-B/16 at
#: 224 px): its block and final norm, which train, and the unused patch and position
#: embeddings and class token, frozen.
MEMO_BRANCH_PARAMETERS = 7_832_064


def trim_specialized(extractor: nn.Module) -> nn.Module:
    """Drop the blocks a ``Specialized_Vit`` builds but never runs (its ``forward`` reads only
    ``last_block``, ``norm`` and the head's pooling) and leave trainable only what it runs."""
    extractor.blocks = nn.Sequential()
    return specialized_trainable(extractor)


def specialized_trainable(extractor: nn.Module) -> nn.Module:
    """``extractor`` with its block and final norm trainable, the embeddings it never reads
    frozen."""
    extractor.requires_grad_(False)
    extractor.last_block.requires_grad_(True)
    extractor.norm.requires_grad_(True)
    return extractor


def memo_state_bytes(args: Mapping[str, Any]) -> int:
    """DER's count with MEMO's branch; older branches that keep training
    (``train_adaptive``) also keep their gradients and Adam's two moments."""
    factor = 4 if args.get("train_adaptive") else 1
    return factor * 4 * MEMO_BRANCH_PARAMETERS * (DEROnline.expected_branches(args) - 1)


def _generalized_blocks_exist(cfg: Mapping[str, Any]) -> None:
    """MEMO splits the ViT into generalized blocks and a last, specialized one: it needs two."""
    if cfg.get("vit_depth") == 1:
        raise ValueError(
            "vit_depth 1 leaves MEMO no generalized block (the specialized extractor is the "
            "last block): set it to 2 or more, or null for upstream's 12"
        )


CARD = dataclasses.replace(
    DER_CARD,
    paper_name="MEMO",
    backbone_types=pilot_backbones("memo"),
    state_bytes=memo_state_bytes,
    upstream_differences=(
        *DER_CARD.upstream_differences,
        UpstreamDifference(
            "unused_blocks_dropped",
            "Each specialized extractor drops the 12 ViT blocks that Specialized_Vit builds as a "
            "VisionTransformer but never runs, and its unused patch and position embeddings, "
            "class token and the generalized blocks' unused final norm are frozen, where "
            "upstream keeps them all trainable.",
            "None of them reaches an output or gets a gradient; kept, they would hold a whole "
            "ViT-B of dead weights per firing in memory and in every checkpoint.",
        ),
    ),
)


@register_method("memo_online", card=CARD)
class MEMOOnline(DEROnline):
    """Frozen generalized blocks after the first firing; one specialized block per firing."""

    base_model_name: ClassVar[str] = "memo"
    config_keys: ClassVar[dict[str, Any]] = {
        **DEROnline.config_keys,
        "train_base": ConfigKey(
            False,
            "keep training the generalized blocks after the first firing (upstream's key: false)",
            check=boolean,
            cross_check=_generalized_blocks_exist,
        ),
        "train_adaptive": ConfigKey(
            False,
            "keep training the older specialized blocks after a firing (upstream's key: false)",
            check=boolean,
        ),
        "alpha_aux": ConfigKey(
            1.0, "weight of the auxiliary loss (upstream's key and value: 1.0)", check=real(0)
        ),
    }

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import AdaptiveNet  # PILOT, imported lazily

        network = self.first_update_fc(AdaptiveNet(self.pilot_args(args), True), args)
        base = network.TaskAgnosticExtractor
        base.norm.requires_grad_(False)  # forward_features skips it
        for extractor in network.AdaptiveExtractors:
            trim_specialized(extractor)
        return network

    def branches(self, network: nn.Module) -> nn.ModuleList:
        return network.AdaptiveExtractors

    def branch_features(self, network: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        """``AdaptiveNet.forward``: the generalized blocks' tokens once, then each specialized
        extractor's pooled token."""
        base = network.TaskAgnosticExtractor(x)
        return [extractor(base) for extractor in network.AdaptiveExtractors]

    def new_branch(self, last: nn.Module) -> nn.Module:
        return specialized_trainable(super().new_branch(last))

    def freeze_old(self, network: nn.Module) -> None:
        """Upstream's ``after_task`` (the generalized blocks, unless ``train_base``) and
        ``incremental_train`` (the older specialized blocks, unless ``train_adaptive``)."""
        if not self.args.get("train_base", False):
            network.TaskAgnosticExtractor.requires_grad_(False)
        if not self.args.get("train_adaptive", False):
            super().freeze_old(network)

    def set_mode(self, network: nn.Module, train: bool) -> None:
        """Upstream's ``set_network``: after the first firing the generalized blocks and the
        older specialized ones run in eval mode unless they still train."""
        network.train(train)
        if not train or len(network.AdaptiveExtractors) < 2:
            return  # upstream's first task: _init_train trains everything
        if not self.args.get("train_base", False):
            network.TaskAgnosticExtractor.eval()
        if not self.args.get("train_adaptive", False):
            for extractor in network.AdaptiveExtractors[:-1]:
                extractor.eval()

    def aux_weight(self) -> float:
        return float(self.args.get("alpha_aux", 1.0))

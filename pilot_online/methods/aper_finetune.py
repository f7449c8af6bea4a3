"""APER with full fine-tuning online (``aper_finetune_online``), and the base of the APER family
(``aper_ssf.py``, ``aper_vpt.py``, ``aper_adapter.py`` subclass it and change what trains).

Upstream (PILOT's ``models/aper_*.py``): on the first task only, the adapted model (PILOT's
``SimpleVitNet``: the pre-trained ViT with a PEFT module, here fully fine-tuned) trains with a
cosine head for ``tuned_epoch`` epochs. At the end of that first task it is frozen and joined to
the untouched pre-trained model in PILOT's ``MultiBranchCosineIncrementalNet``: features are the
two ViTs' outputs concatenated, and the head is a ``CosineLinear`` whose rows are replaced by each
class's mean feature (``replace_fc``), task after task, with no further training.

Online there is no first task boundary at which to stop adapting and switch heads, so the port
builds the two-branch network from the start: the frozen pre-trained branch and the adapted
branch, features concatenated, and one ``nn.Linear`` head over all classes (``online_head``). The
adapted branch's tunable part and the head train through the whole stream. The head is the FC
layer P and FGH act on, and P's prototypes are the running class means of the concatenated
features: the class means APER's prototype classifier is made of, replayed through the head.
"""

from __future__ import annotations

import functools
from typing import ClassVar

from ..core.lazy import nn, no_grad, torch
from ..engine.adapter import Evaluation, QueryPass, StepOutput
from ..engine.backbone_names import PLAIN_VIT
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.registry import register_method
from .finetune import FinetuneOnline

#: The APER family's card: aper_ssf, aper_vpt and aper_adapter replace its paper name and keep
#: its differences.
CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="APER w/ Finetune",
    upstream_differences=(
        UpstreamDifference(
            "no_first_session_phase",
            "The adapted branch trains through the whole stream, where upstream tunes it on the "
            "first task only and then freezes it.",
            "Online there is no first task boundary at which to stop adapting.",
        ),
        UpstreamDifference(
            "linear_head",
            "Predictions come from a linear head over the concatenated features, trained by the "
            "batch-masked cross-entropy, where upstream predicts with a cosine head whose rows are "
            "the class means (replace_fc).",
            "P and FGH act on a trained FC layer; P's running class means of the same features "
            "are replace_fc's prototypes, replayed through that head.",
        ),
    ),
)


@register_method("aper_finetune_online", card=CARD)
class AperFinetuneOnline(FinetuneOnline):
    base_model_name: ClassVar[str] = "aper_finetune"
    #: Substrings of the adapted branch's parameter names that train (PILOT's freezing rule for
    #: the method); empty: every parameter of the adapted branch trains.
    tuned_parameters: ClassVar[tuple[str, ...]] = ()

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import MultiBranchCosineIncrementalNet, SimpleVitNet

        pilot_args = self.pilot_args(args)
        adapted = SimpleVitNet(pilot_args, True)
        network = MultiBranchCosineIncrementalNet(pilot_args, True)
        network.construct_dual_branch_network(adapted)  # [pre-trained ViT, adapted ViT]
        network.requires_grad_(False)
        for name, param in network.backbones[1].named_parameters():
            tuned = not self.tuned_parameters or any(k in name for k in self.tuned_parameters)
            param.requires_grad_(tuned)
        self.online_head(network, args, in_features=network._feature_dim)
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        return self._forward_from_query(network, x, self._query_features(network, x), train)

    def evaluation(self, network: nn.Module) -> Evaluation:
        """The frozen query pass, which evaluation caches per test sample."""
        query = QueryPass(
            list(network.backbones[0].parameters()),
            functools.partial(self._query_features, network),
            functools.partial(self._forward_from_query, network),
        )
        return Evaluation(query=query)

    @no_grad
    def _query_features(self, network: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The frozen pre-trained branch's features (a function of the image alone)."""
        return network.backbones[0](x)

    def _forward_from_query(
        self, network: nn.Module, x: torch.Tensor, query: torch.Tensor, train: bool
    ) -> StepOutput:
        features = torch.cat([query, network.backbones[1](x)], dim=1)
        return StepOutput(network.fc(features), features)

    def set_mode(self, network: nn.Module, train: bool) -> None:
        network.train(train)
        network.backbones[0].eval()  # the frozen branch, in training too

"""SimpleCIL online (``simplecil_online``): the no-training baseline, a nearest-class-mean
classifier on the frozen pre-trained ViT's features.

Upstream (PILOT's ``models/simplecil.py``) never trains: at the end of each task it passes the
task's training data (with test transforms) through the frozen ViT once and replaces the rows of
its ``CosineLinear`` head by the class means (``replace_fc``); prediction is the cosine between
a sample's feature and each class mean. There is no training at the first task boundary either.

Online, the class means are running means updated with every stream batch, by the same
:class:`~pilot_online.core.prototypes.PrototypeBank` (Eq. 1) whose means P replays, and the head
is rebuilt from them before each use: an ``nn.Linear`` without bias whose rows are the
L2-normalised means, applied to the L2-normalised feature (upstream's cosine head with its scale
``sigma`` at 1, which changes no prediction). Nothing takes a gradient step (``trains = False``),
so P and FGH, which act on gradients, have nothing to act on and are refused.
"""

from __future__ import annotations

from typing import ClassVar

from ..core.lazy import F, nn, no_grad, torch
from ..engine.adapter import StepOutput, TrainedStep
from ..engine.backbone_names import PLAIN_VIT
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.registry import register_method
from .linear_probe import LinearProbeOnline

CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="SimpleCIL",
    variants=("base",),  # P and FGH act on gradients: none here
    upstream_differences=(
        UpstreamDifference(
            "running_class_means",
            "The head's rows are running class means over the stream's training batches, "
            "refreshed after every batch, where upstream's replace_fc averages the finished "
            "task's data in one pass with test transforms.",
            "Online there is no task end and no second pass over the data.",
        ),
    ),
)


@register_method("simplecil_online", card=CARD)
class SimpleCILOnline(LinearProbeOnline):
    base_model_name: ClassVar[str] = "simplecil"
    trains: ClassVar[bool] = False

    def build_network(self, args: dict) -> nn.Module:
        from ..core.prototypes import PrototypeBank

        network = super().build_network(args)
        network.fc = nn.Linear(network.feature_dim, int(args["nb_classes"]), bias=False)
        network.requires_grad_(False)
        # A submodule, so its buffers (the means and counts) are checkpointed with the network's.
        network.class_means = PrototypeBank(int(args["nb_classes"]), network.feature_dim)
        return network

    @no_grad
    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = network.backbone(x)
        return StepOutput(network.fc(F.normalize(features, dim=1)), features)

    @no_grad
    def after_step(self, network: nn.Module, step: TrainedStep) -> tuple[nn.Parameter, ...]:
        if step.stream is None:  # an extra step of online_iter: the batch is observed once
            return ()
        out, labels = step.stream, step.stream_labels
        network.class_means.update(out.features, labels, validate=False)
        self.refresh_head(network)  # the network predicts with the new means at once
        return ()

    @no_grad
    def refresh_head(self, network: nn.Module) -> None:
        """Head rows = the L2-normalised class means (zero rows for classes not seen yet)."""
        network.fc.weight.copy_(F.normalize(network.class_means.means, dim=1))

    def set_mode(self, network: nn.Module, train: bool) -> None:
        network.eval()  # a fixed feature extractor, in training too
        self.refresh_head(network)  # e.g. after a checkpoint restored the means

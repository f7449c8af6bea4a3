"""LAE online (``lae_online``): Learning, Accumulation and Ensemble (Gao et al., ICCV 2023;
PILOT's ``models/lae.py``, network ``LAE``).

* **Learning.** The frozen ViT (PILOT's ``backbone/vit_lae.py``) carries a parameter-efficient
  module (``pet_cls``: prefixes of ``pet_length`` tokens, or adapters of width
  ``down_sample_dim``, in blocks 0-4): the *online* PET, trained with a linear head. Upstream
  calibrates the PET's adaptation speed to the head's by freezing the PET for the first
  ``num_freeze_epochs`` epochs of every task (3 of 5 on CIFAR-100): a new task's head rows start
  random, and their gradients would drag the PET before they are trained. Upstream also builds a
  fresh optimiser per task (``reinit_optimizer``). Online, a task start is a consolidation firing
  (default ``new_classes``: it fires before the batch that brings new classes, at each task
  boundary of a clear stream with ``consolidation_new_classes`` classes per task): at the
  stream's start and after each firing the PET is frozen for ``lae_freeze_samples`` stream samples
  while the head trains, and (``lae_reset_optimizer``) the PET's and head's optimiser and FGH state
  are dropped.
* **Accumulation.** After every optimiser step, the *offline* PET is an EMA of the online one
  (``ema_decay``), as upstream (already per step: nothing to change online).
* **Ensemble.** At evaluation each sample goes through the ViT twice, with the online and with
  the offline PET, and the prediction is the class-wise maximum of the two softmaxes, each over
  the classes seen in training so far (upstream: the classes of the tasks so far). The logits
  returned are the log of that maximum (the same ranking), a large negative number for classes
  never seen. Training uses the online PET alone, as upstream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checks import boolean, integer, real
from ..engine.adapter import ConfigKey, MethodAdapter, StepOutput
from ..engine.backbone_names import pilot_backbones
from ..engine.registry import register_method

#: ``pet_cls`` values. Upstream's third, LoRA, cannot run there: ``attach_pets_vit`` reads
#: ``self.cfg``, which PILOT's ``LAE`` never sets.
PET_CLASSES = ("Prefix", "Adapter")


@register_method("lae_online")
class LAEOnline(MethodAdapter):
    paper_name: ClassVar[str] = "LAE"
    base_model_name: ClassVar[str] = "lae"
    backbone_types: ClassVar[tuple[str, ...]] = pilot_backbones("lae")
    default_consolidation: ClassVar[str] = "new_classes"
    #: Stream samples left in the current freeze window (``build_network`` starts one).
    frozen_left: ClassVar[int] = 0
    smoke_overrides: ClassVar[dict[str, Any]] = {
        "consolidation_new_classes": 4,  # the smoke tasks' class count: fires at the boundary
        "lae_freeze_samples": 40,  # one batch of the tiny stream: the PET trains in each task
        "pet_length": 2,
    }
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "pet_cls": ConfigKey("Prefix", "the PET module (upstream Prefix)", choices=PET_CLASSES),
        "pet_length": ConfigKey(10, "prefix tokens per block (upstream 10)", check=integer(1)),
        "down_sample_dim": ConfigKey(5, "adapter bottleneck width (upstream 5)", check=integer(1)),
        "ema_decay": ConfigKey(
            0.9999,
            "offline PET = EMA of the online one, per step (upstream 0.9999)",
            check=real(0, 1),
        ),
        "lae_freeze_samples": ConfigKey(
            1000,
            "stream samples the PET stays frozen (head only) at the start and after each "
            "firing: upstream's num_freeze_epochs of each task",
            check=integer(0),
        ),
        "lae_reset_optimizer": ConfigKey(
            True,
            "drop the PET's and head's optimiser and FGH state at each firing (upstream: a "
            "fresh optimiser per task)",
            check=boolean,
        ),
    }

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any]) -> None:
        if cfg.get("sdpa"):
            raise ValueError(
                "sdpa: true cannot run LAE: its attention adds the PET module's prompts, "
                "prefixes and adapters inside PILOT's forward, which sdpa does not reproduce; "
                'set "sdpa": false'
            )

    def backbone_kwargs(self, args: dict) -> dict[str, Any]:
        # PILOT's "_lae" branch calls timm.create_model(name, pretrained=True): force the config's.
        return {
            "pretrained": bool(args["pretrained"]),
            "drop_rate": float(args["drop"]),
            "drop_path_rate": float(args["drop_path"]),
            **super().backbone_kwargs(args),
        }

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import LAE  # PILOT, imported lazily

        return self.prepare(LAE(self.pilot_args(args), True), args)

    def prepare(self, network: nn.Module, args: Mapping[str, Any]) -> nn.Module:
        """Freeze the ViT and the offline PET, add the head and the seen-class buffer (what any
        network with ``backbone``, ``pets``, ``pets_emas`` and ``attach_pets_vit`` needs)."""
        network.backbone.requires_grad_(False)
        network.pets.requires_grad_(True)
        network.pets_emas.requires_grad_(False)
        self.online_head(network, args)
        # The classes seen in training: the ensemble's softmaxes run over them.
        network.register_buffer("lae_seen", torch.zeros(int(args["nb_classes"]), dtype=torch.bool))
        self.frozen_left = int(args["lae_freeze_samples"])
        return network

    def _logits(self, network: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = network.backbone(x)[:, 0]  # the CLS token, as PILOT's LAE.forward
        return network.fc(features), features

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        if train:
            return StepOutput(*self._train_logits(network, x))
        online, features = self._logits(network, x)
        network.attach_pets_vit(network.pets_emas)
        try:
            offline, _ = self._logits(network, x)
        finally:
            network.attach_pets_vit(network.pets)
        return StepOutput(ensemble(online, offline, network.lae_seen), features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc

    def _train_logits(
        self, network: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The online PET's pass. Inside a freeze window (upstream's first ``num_freeze_epochs``)
        the graph is recorded with the PET's ``requires_grad`` off, so the backward pass gives it
        no gradient (the optimiser and FGH skip it); the flag is back on when the pass returns,
        so the loop's parameter lists never depend on when they are read."""
        if self.frozen_left <= 0:
            return self._logits(network, x)
        network.pets.requires_grad_(False)
        try:
            return self._logits(network, x)
        finally:
            network.pets.requires_grad_(True)

    @torch.no_grad()
    def after_step(
        self,
        network: nn.Module,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        terms: Mapping[str, torch.Tensor],
    ) -> Iterable[nn.Parameter]:
        decay = float(self.args["ema_decay"])
        offline = list(network.pets_emas.parameters())
        torch._foreach_mul_(offline, decay)
        torch._foreach_add_(offline, list(network.pets.parameters()), alpha=1 - decay)
        return ()

    def observe(self, network: nn.Module, out: StepOutput, labels: torch.Tensor) -> None:
        network.lae_seen[labels] = True
        self.frozen_left = max(self.frozen_left - len(labels), 0)

    def consolidate(self, network: nn.Module, firing: int) -> Iterable[nn.Parameter]:
        """A task start: freeze the PET again for ``lae_freeze_samples``; a fresh optimiser."""
        self.frozen_left = int(self.args["lae_freeze_samples"])
        if not self.args["lae_reset_optimizer"]:
            return ()
        return [*network.pets.parameters(), *network.fc.parameters()]

    def extra_state(self, network: nn.Module) -> dict[str, Any]:
        """The offline (EMA) PET, which is no trainable parameter, and the freeze countdown."""
        return {
            "offline_pet": [p.detach() for p in network.pets_emas.parameters()],
            "frozen_left": self.frozen_left,
        }

    @torch.no_grad()
    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        offline = list(network.pets_emas.parameters())
        if len(state["offline_pet"]) != len(offline):
            raise ValueError(
                f"the checkpoint has {len(state['offline_pet'])} offline PET tensors, the network "
                f"{len(offline)}: build it with the config that wrote the checkpoint"
            )
        for p, saved in zip(offline, state["offline_pet"]):
            p.copy_(saved)
        self.frozen_left = int(state["frozen_left"])

    def report(self) -> dict[str, Any]:
        return {"lae": {"pet_frozen_samples_left": getattr(self, "frozen_left", None)}}


def ensemble(online: torch.Tensor, offline: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``log max(softmax(online), softmax(offline))`` class by class, the softmaxes over the
    ``seen`` classes (all, before any is seen); unseen classes get the dtype's lowest value (finite,
    ranked last)."""
    if not bool(seen.any()):
        seen = torch.ones_like(seen)
    floor = torch.finfo(online.dtype).min
    scores = [F.log_softmax(z.masked_fill(~seen, float("-inf")), dim=-1) for z in (online, offline)]
    return torch.maximum(*scores).masked_fill(~seen, floor)

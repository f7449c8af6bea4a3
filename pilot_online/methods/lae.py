"""LAE online (``lae_online``): Learning, Accumulation and Ensemble (Gao et al., ICCV 2023;
PILOT's ``models/lae.py``, network ``LAE``).

* **Learning.** The frozen ViT (PILOT's ``backbone/vit_lae.py``) carries a parameter-efficient
  module (``pet_cls``: prefixes of ``pet_length`` tokens, or adapters of width
  ``down_sample_dim``, in blocks 0-4): the *online* PET, trained with a linear head. Upstream
  calibrates the PET's adaptation speed to the head's by freezing the PET for the first
  ``num_freeze_epochs`` of the ``tuned_epoch`` epochs of every task (3 of 5 on CIFAR-100: the
  PET trains in the last 40% of each task's steps): a new task's head rows start random, and
  their gradients would drag the PET before they are trained. Upstream also builds a fresh
  optimiser per task. Online, a task start is a consolidation firing (default ``new_classes``:
  it fires before the batch that brings new classes, at each task boundary of a clear stream
  with ``consolidation_new_classes`` classes per task). After each firing the PET is frozen for
  ``lae_freeze_fraction`` (0.6 = 3/5) of the samples of the segment that firing closed: the
  stream's own measure of a task's length, so the PET trains in the last 40% of every task of a
  clear stream, of CUB's 470-sample tasks as of CIFAR's 5000-sample ones. The first segment
  has no predecessor: the PET is frozen for its first ``lae_first_freeze_samples``. At each
  firing (``lae_reset_optimizer``) the PET's and head's optimiser and FGH state are dropped.
* **Accumulation.** After every optimiser step the *offline* PET moves towards the online one
  (an EMA), at upstream's rate per training sample: upstream takes ``tuned_epoch / batch_size``
  EMA steps of ``ema_decay`` per sample of a task (5/128 on CIFAR-100), so a step of ``n``
  stream samples decays by ``ema_decay ** (n * lae_ema_steps_per_sample)``. The offline PET then
  moves as far per task as upstream's (1.9% per CIFAR task, 18% over the 10), whatever the
  batch and task size; 0.9999 per online step would move it about 4x less.
* **Ensemble.** At evaluation each sample goes through the ViT twice, with the online and with
  the offline PET, and the prediction is the class-wise maximum of the two softmaxes, each over
  the classes seen in training so far (upstream: the classes of the tasks so far). The logits
  returned are the log of that maximum (the same ranking), a large negative number for classes
  never seen. Training uses the online PET alone, as upstream.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..core.checks import boolean, integer, real
from ..core.lazy import F, nn, no_grad, torch
from ..engine.adapter import (
    ConfigKey,
    Consolidated,
    Consolidation,
    MethodAdapter,
    StepOutput,
    TrainedStep,
)
from ..engine.backbone_names import pilot_backbones
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.registry import register_method

#: ``pet_cls`` values. Upstream's third, LoRA, cannot run there: ``attach_pets_vit`` reads
#: ``self.cfg``, which PILOT's ``LAE`` never sets.
PET_CLASSES = ("Prefix", "Adapter")
#: Upstream's ``exps/lae.json`` (CIFAR-100): epochs per task, epochs the PET is frozen, batch.
UPSTREAM_EPOCHS, UPSTREAM_FREEZE_EPOCHS, UPSTREAM_BATCH = 5, 3, 128


def paper_settings(dataset: str, stream: str) -> dict[str, Any]:
    """Upstream's ``exps/lae.json`` (and ``lae_inr.json`` on ImageNet-R) already train with
    the online protocol's optimiser (Adam, constant LR, weight decay 0): their LR, and their
    EMA steps per sample (``tuned_epoch / batch_size``)."""
    if dataset == "imagenetr":
        return {"init_lr": 0.00046875, "lae_ema_steps_per_sample": 50 / UPSTREAM_BATCH}
    return {"init_lr": 0.0028125}


def _pet_without_sdpa(cfg: Mapping[str, Any]) -> None:
    """The PET module lives inside PILOT's attention, which ``sdpa`` replaces."""
    if cfg.get("sdpa"):
        raise ValueError(
            "sdpa: true cannot run LAE: its attention adds the PET module's prompts, "
            "prefixes and adapters inside PILOT's forward, which sdpa does not reproduce; "
            'set "sdpa": false'
        )


CARD = MethodCard(
    backbone_types=pilot_backbones("lae"),
    paper_name="LAE",
    smoke_overrides={
        "consolidation_new_classes": 4,  # the smoke tasks' class count: fires at the boundary
        "lae_first_freeze_samples": 40,  # one batch of the tiny stream: the PET trains in task 0
        "pet_length": 2,
    },
    paper_settings=paper_settings,
    upstream_differences=(
        UpstreamDifference(
            "freeze_window_per_segment",
            "The PET is frozen for the first lae_freeze_fraction (0.6) of each segment's samples, "
            "the segment's length taken from the previous segment (lae_first_freeze_samples at "
            "the stream's start), where upstream freezes it for num_freeze_epochs of tuned_epoch "
            "epochs (3 of 5) of each task.",
            "One pass has no epochs and no task length: the segment a firing closes is the "
            "stream's measure of a task, so the PET trains in the last 40% of every task of a "
            "clear stream, on CUB-sized tasks as on CIFAR's.",
        ),
        UpstreamDifference(
            "ema_rate_per_sample",
            "A step of n samples decays the offline PET by ema_decay ** (n * "
            "lae_ema_steps_per_sample) where upstream decays it by ema_decay per step.",
            "Upstream takes tuned_epoch / batch_size EMA steps per training sample; one online "
            "pass takes one per batch, so 0.9999 per step would move the offline PET about 4x "
            "less per task: the per-sample rate moves it as far as upstream's per task.",
        ),
        UpstreamDifference(
            "ensemble_over_seen_classes",
            "The ensemble's softmaxes run over the classes seen in training so far, where "
            "upstream's run over every class of the tasks so far.",
            "Task-free: no task's class list; at a task end of a clear stream both are the same "
            "classes.",
        ),
    ),
    removed_keys={
        "lae_freeze_samples": "the PET's freeze window is now a share of the segment each firing "
        "closes (lae_freeze_fraction, upstream's 3 of 5 epochs) and lae_first_freeze_samples"
    },
)


@register_method("lae_online", card=CARD)
class LAEOnline(MethodAdapter):
    base_model_name: ClassVar[str] = "lae"
    consolidation: ClassVar[Consolidation] = Consolidation(trigger="new_classes")
    #: Stream samples left in the current freeze window (``build_network`` starts one).
    frozen_left: ClassVar[int] = 0
    #: Stream samples since the last firing (the stream's start): the open segment's length.
    segment_samples: ClassVar[int] = 0
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "pet_cls": ConfigKey(
            "Prefix",
            "the PET module (upstream Prefix)",
            choices=PET_CLASSES,
            cross_check=_pet_without_sdpa,
        ),
        "pet_length": ConfigKey(10, "prefix tokens per block (upstream 10)", check=integer(1)),
        "down_sample_dim": ConfigKey(5, "adapter bottleneck width (upstream 5)", check=integer(1)),
        "ema_decay": ConfigKey(
            0.9999,
            "the offline PET's EMA decay per upstream step (upstream 0.9999)",
            check=real(0, 1),
        ),
        "lae_ema_steps_per_sample": ConfigKey(
            UPSTREAM_EPOCHS / UPSTREAM_BATCH,
            "upstream EMA steps per stream sample: tuned_epoch / batch_size (CIFAR-100: 5/128); "
            "a step of n samples decays the offline PET by ema_decay ** (n * this)",
            check=real(positive=True),
        ),
        "lae_freeze_fraction": ConfigKey(
            UPSTREAM_FREEZE_EPOCHS / UPSTREAM_EPOCHS,
            "after each firing the PET is frozen (head only) for this fraction of the samples of "
            "the segment the firing closed: upstream's num_freeze_epochs / tuned_epoch (3/5)",
            check=real(0, 1),
        ),
        "lae_first_freeze_samples": ConfigKey(
            300,
            "stream samples the PET is frozen at the stream's start, before any segment has "
            "closed (0.6 x a CUB-sized task of about 500 samples)",
            check=integer(0),
        ),
        "lae_reset_optimizer": ConfigKey(
            True,
            "drop the PET's and head's optimiser and FGH state at each firing (upstream: a "
            "fresh optimiser per task)",
            check=boolean,
        ),
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
        self.frozen_left = int(args["lae_first_freeze_samples"])
        self.segment_samples = 0
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

    @no_grad
    def after_step(self, network: nn.Module, step: TrainedStep) -> tuple[nn.Parameter, ...]:
        """The offline PET's EMA after each update (upstream's, per optimiser step); at the
        batch's own step, its classes are seen and its samples counted."""
        steps = len(step.labels) * float(self.args["lae_ema_steps_per_sample"])
        decay = float(self.args["ema_decay"]) ** steps
        offline = list(network.pets_emas.parameters())
        torch._foreach_mul_(offline, decay)
        torch._foreach_add_(offline, list(network.pets.parameters()), alpha=1 - decay)
        if step.stream is not None:
            labels = step.stream_labels
            network.lae_seen[labels] = True
            self.frozen_left = max(self.frozen_left - len(labels), 0)
            self.segment_samples += len(labels)
        return ()

    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """A task start: the PET frozen for ``lae_freeze_fraction`` of the segment just closed;
        a fresh optimiser."""
        fraction = float(self.args["lae_freeze_fraction"])
        self.frozen_left = round(fraction * self.segment_samples)
        self.segment_samples = 0
        if not self.args["lae_reset_optimizer"]:
            return Consolidated()
        return Consolidated(restarted=[*network.pets.parameters(), *network.fc.parameters()])

    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        """The offline (EMA) PET, which is no trainable parameter, the freeze countdown and the
        open segment's length."""
        return {
            "offline_pet": [p.detach() for p in network.pets_emas.parameters()],
            "frozen_left": self.frozen_left,
            "segment_samples": self.segment_samples,
        }

    @no_grad
    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        offline = list(network.pets_emas.parameters())
        if len(state["offline_pet"]) != len(offline):
            raise ValueError(
                f"the checkpoint has {len(state['offline_pet'])} offline PET tensors, the network "
                f"{len(offline)}: build it with the config that wrote the checkpoint"
            )
        for p, saved in zip(offline, state["offline_pet"]):
            p.copy_(saved)
        self.frozen_left = int(state["frozen_left"])
        self.segment_samples = int(state["segment_samples"])

    def report(self) -> dict[str, Any]:
        return {
            "lae": {
                "pet_frozen_samples_left": getattr(self, "frozen_left", None),
                "segment_samples": getattr(self, "segment_samples", None),
            }
        }


def ensemble(online: torch.Tensor, offline: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``log max(softmax(online), softmax(offline))`` class by class, the softmaxes over the
    ``seen`` classes (all, before any is seen); unseen classes get the dtype's lowest value (finite,
    ranked last)."""
    if not bool(seen.any()):
        seen = torch.ones_like(seen)
    floor = torch.finfo(online.dtype).min
    scores = [F.log_softmax(z.masked_fill(~seen, float("-inf")), dim=-1) for z in (online, offline)]
    return torch.maximum(*scores).masked_fill(~seen, floor)

"""Online-LoRA (``olora_online``): Wei et al., WACV 2025, on the shared online loop.

Our own version, written from a reading of christina200/online-lora-official at commit 96e7de0f
(``Si-blurry/online_lora.py`` and ``Disjoint/engine.py`` for the training step,
``Si-blurry/utils/lora.py`` for the adapters, ``Si-blurry/configuration/config_blurry.py`` and
``Disjoint/configs/*_online_lora.py`` for the defaults). The pure pieces live in ``core/lora.py``.

* **Network.** timm's ViT (``backbone_type``, upstream ``vit_base_patch16_224``), frozen, with
  rank-4 LoRA on the q and v projections of every block (upstream ``r=4``, ``lora_layer=None``),
  and a trainable linear head. Built with ``timm.create_model`` directly (under the learner's
  ``timm_overrides``, so ``backbone_kwargs`` and ``pretrained_path`` apply): PILOT's plain-ViT
  branch of ``get_backbone`` hard-codes ``pretrained=True`` and has no LoRA network to reuse.
* **Step.** CE on the stream batch plus, with ``hard_loss``, CE on each batch of the hard buffer
  (the ``hard_buffer_size`` highest-loss mini-batches seen so far, refreshed every step), plus the
  importance-weighted regulariser ``mas_weight / 2 * sum(omega * p^2)`` on the current LoRA.
* **Plateaus.** After each optimiser step the window loss (batch CE plus the buffer CEs, before
  the regulariser: upstream's ``first_train_loss``) feeds the plateau detector. At a plateau the
  importance ``omega`` is updated from squared gradients on the hard buffer (arg-max pseudo-labels,
  eval mode), the LoRA is merged exactly into the frozen qkv weights, and a fresh LoRA starts.
  The count and steps of plateaus go to ``extra.diagnostics.method`` in the results file.

Cost: the window needs the loss on the host, so this method reads the device once per step (one
``tolist`` of the step's loss terms); the other methods do not. Each step also runs one forward
and backward pass per buffered batch (up to 4 more than the other methods): that, not the LoRA
factors, is where oLoRA's memory goes (``benchmarks/bench_memory.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checks import check_int
from ..core.lora import (
    BufferEntry,
    HardBuffer,
    ImportanceRegularizer,
    LoRAQKV,
    LossPlateauDetector,
    add_lora,
)
from ..engine.adapter import ConfigKey, MethodAdapter, StepOutput
from ..engine.registry import register_method

logger = logging.getLogger(__name__)


class OLoRANet(nn.Module):
    """A frozen ViT with LoRA adapters on q and v, and a linear head over its pooled features."""

    def __init__(self, backbone: nn.Module, num_classes: int, adapters: list[LoRAQKV]) -> None:
        super().__init__()
        self.backbone = backbone
        self.fc = nn.Linear(backbone.num_features, num_classes)
        self.adapters = adapters  # a plain list: the modules are registered inside backbone

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.backbone(x)
        return self.fc(features), features


@register_method("olora_online")
class OLoRAOnline(MethodAdapter):
    base_model_name: ClassVar[str] = "olora"  # no PILOT counterpart: PILOT's default transforms
    backbone_marker: ClassVar[str] = "vit_base_patch16_224"
    backbone_types: ClassVar[tuple[str, ...]] = (
        "vit_base_patch16_224",
        "vit_base_patch16_224_in21k",
    )
    paper_name: ClassVar[str] = "oLoRA"
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "lora_rank": ConfigKey(4, "LoRA rank r on the q and v projections (upstream 4)"),
        "lora_layer": ConfigKey(None, "ViT block indices that get LoRA; null = all (upstream)"),
        "loss_window_length": ConfigKey(
            5, "steps in the loss window (upstream 5; at batch 100, 500 samples: > a CUB task)"
        ),
        "loss_window_mean_threshold": ConfigKey(
            6.0, "plateau when the window mean is below this (upstream 6.0; a sum of <= 5 CEs)"
        ),
        "loss_window_variance_threshold": ConfigKey(
            0.1, "plateau when the window variance is below this too (upstream 0.1)"
        ),
        "hard_buffer_size": ConfigKey(4, "highest-loss mini-batches kept for replay (upstream 4)"),
        "hard_loss": ConfigKey(True, "add the hard buffer's CE to the loss (upstream true)"),
        "mas_weight": ConfigKey(2000.0, "weight of the importance regulariser (upstream 2000)"),
    }

    # -- network -------------------------------------------------------------------------------
    def build_network(self, args: dict) -> nn.Module:
        self._check_options(args)
        import timm  # lazily: methods/ imports no timm when imported

        backbone = timm.create_model(
            args["backbone_type"],
            pretrained=bool(args.get("pretrained", False)),
            num_classes=0,
            drop_rate=float(args.get("drop", 0.0)),
            drop_path_rate=float(args.get("drop_path", 0.0)),
        )
        adapters = add_lora(backbone, args["lora_rank"], args["lora_layer"])
        network = OLoRANet(backbone, int(args["nb_classes"]), adapters)
        self._lora = [p for adapter in adapters for p in adapter.lora_parameters()]
        self.detector = LossPlateauDetector(
            args["loss_window_length"],
            args["loss_window_mean_threshold"],
            args["loss_window_variance_threshold"],
        )
        self.regularizer = ImportanceRegularizer(args["mas_weight"])
        self.buffer = HardBuffer(args["hard_buffer_size"])
        self._hard_losses: list[torch.Tensor] = []
        return network

    @staticmethod
    def _check_options(args: Mapping[str, Any]) -> None:
        try:
            check_int("lora_rank", args["lora_rank"], 1)
            check_int("loss_window_length", args["loss_window_length"], 1)
            check_int("hard_buffer_size", args["hard_buffer_size"], 0)
        except (TypeError, ValueError) as err:
            raise ValueError(f"olora_online: {err}") from None
        if not isinstance(args["hard_loss"], bool):
            raise ValueError(
                f"olora_online: hard_loss must be true or false, got {args['hard_loss']!r}"
            )
        layers = args["lora_layer"]
        if layers is not None and not isinstance(layers, (list, tuple)):
            raise ValueError(
                f"olora_online: lora_layer must be null or a list of block indices, got {layers!r}"
            )

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        logits, features = network(x)
        return StepOutput(logits, features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc

    # -- the method's own loss terms and after-step work ----------------------------------------
    def loss_terms(
        self, network: nn.Module, inputs: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        terms: dict[str, torch.Tensor] = {}
        hard_loss = self.args["hard_loss"]
        with torch.set_grad_enabled(hard_loss and torch.is_grad_enabled()):
            self._hard_losses = [
                F.cross_entropy(network(entry.inputs)[0], entry.labels)
                for entry in self.buffer.entries
            ]
        if hard_loss and self._hard_losses:
            terms["hard_buffer"] = torch.stack(self._hard_losses).sum()
        penalty = self.regularizer.penalty(self._lora)
        if penalty is not None:
            terms["importance"] = penalty
        return terms

    def after_step(
        self,
        network: nn.Module,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        terms: Mapping[str, torch.Tensor],
    ) -> list[nn.Parameter]:
        # The one host read per step: the window needs the loss, the buffer its ordering.
        values = torch.stack([terms["ce"].reshape(()), *(t.detach() for t in self._hard_losses)])
        batch_loss, *hard = values.tolist()
        self._hard_losses = []  # drop the references to this step's graph
        window_loss = batch_loss + (sum(hard) if self.args["hard_loss"] else 0.0)
        restarted: list[nn.Parameter] = []
        if self.detector.update(window_loss):
            self._consolidate(network)
            restarted = list(self._lora)  # a fresh adapter: no momentum from the merged one
        candidates = [BufferEntry(inputs, labels, batch_loss)]
        candidates += [
            BufferEntry(entry.inputs, entry.labels, loss)
            for entry, loss in zip(self.buffer.entries, hard)
        ]
        self.buffer.update(candidates)
        return restarted

    def _consolidate(self, network: nn.Module) -> None:
        """At a plateau: importance from the hard buffer, then merge the LoRA and start afresh."""
        squared = [torch.zeros_like(p) for p in self._lora]
        if self.buffer.entries:
            self.eval_mode(network)
            for entry in self.buffer.entries:
                logits = network(entry.inputs)[0]
                loss = F.cross_entropy(logits, logits.detach().argmax(1))
                grads = torch.autograd.grad(loss, self._lora)
                torch._foreach_addcmul_(squared, grads, grads)
            self.train_mode(network)
        self.regularizer.update(squared)
        for adapter in network.adapters:
            adapter.merge_()
        logger.info(
            "oLoRA plateau %d at step %d: LoRA merged, a fresh one starts",
            self.detector.plateaus,
            self.detector.steps,
        )

    # -- checkpoints ---------------------------------------------------------------------------
    def extra_state(self, network: nn.Module) -> dict[str, Any]:
        """The plateau detector, the importance, the hard buffer (its batches are training
        inputs, kept as tensors) and, once a merge happened, the merged (frozen) qkv weights."""
        state: dict[str, Any] = {
            "detector": self.detector.state_dict(),
            "regularizer": self.regularizer.state_dict(),
            "buffer": [
                {"inputs": e.inputs, "labels": e.labels, "loss": e.loss}
                for e in self.buffer.entries
            ],
        }
        if self.detector.plateaus:  # before any merge the rebuilt network already has them
            state["merged_qkv"] = [adapter.qkv.weight.detach() for adapter in network.adapters]
        return state

    @torch.no_grad()
    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["detector"])
        device = network.fc.weight.device
        regularizer = dict(state["regularizer"])
        regularizer["omegas"] = [omega.to(device) for omega in regularizer["omegas"]]
        self.regularizer.load_state_dict(regularizer)
        self.buffer.entries = [
            BufferEntry(e["inputs"].to(device), e["labels"].to(device), float(e["loss"]))
            for e in state["buffer"]
        ]
        merged = state.get("merged_qkv")
        if merged is not None:
            if len(merged) != len(network.adapters):
                raise ValueError(
                    f"the checkpoint has {len(merged)} merged qkv weights, the network "
                    f"{len(network.adapters)} LoRA adapters"
                )
            for adapter, weight in zip(network.adapters, merged):
                adapter.qkv.weight.copy_(weight)

    def report(self) -> dict[str, Any]:
        detector = getattr(self, "detector", None)
        if detector is None:
            return {}
        return {
            "olora": {
                "plateaus": detector.plateaus,
                "plateau_steps": list(detector.plateau_steps),
                "loss_window_length": detector.window,
                "loss_window_mean_threshold": detector.mean_threshold,
                "loss_window_variance_threshold": detector.variance_threshold,
                "hard_buffer_batches": len(self.buffer),
            }
        }

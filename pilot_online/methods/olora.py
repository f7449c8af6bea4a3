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
  importance-weighted regulariser ``mas_weight / 2 * sum(omega * p^2)`` on the current LoRA. The
  buffered batches are backpropagated one at a time after the stream batch's backward
  (:meth:`OLoRAOnline.after_backward`): the gradients accumulate to the same sum, and at most one
  batch's activations are alive at once (upstream holds one graph over all of them).
* **Plateaus.** After each optimiser step the window loss (batch CE plus the buffer CEs, before
  the regulariser: upstream's ``first_train_loss``) feeds the plateau detector. At a plateau the
  importance ``omega`` is updated from squared gradients on the hard buffer (arg-max pseudo-labels,
  eval mode), the LoRA is merged into the frozen weights, and a fresh LoRA starts.
  The count and steps of plateaus go to ``extra.diagnostics.method`` in the results file.

Six behaviours of upstream's code are config keys. The ``"upstream"`` value (the default: the
paper's numbers came from that code) does what upstream does; the corrected behaviour is the
other value, one key away:

* ``olora_merge``: upstream merges by adding the factors (``A_m += A``, ``B_m += B``), which
  adds cross terms from the second merge on; ``"exact"`` adds ``B A`` to the frozen weight.
* ``olora_merge_optimizer_state``: upstream builds Adam once, so the fresh factors inherit the
  merged ones' moments (and FGH's state); ``"reset"`` drops both at a merge.
* ``olora_importance_batches``: upstream's importance loop uses parameter iterators that run dry
  after the first buffered batch, so only the top-ranked batch counts; ``"all"``: every one.
* ``olora_importance_labels``: upstream flattens a buffered batch to one row
  (``view(1, -1)``) and takes one arg-max; ``"per_sample"``: one arg-max label per sample.
* ``olora_window_loss``: upstream's plateau window and buffer ranking read the stream batch's
  unmasked CE (upstream trains unmasked); ``"masked"``: the loop's training-masked CE.
* ``olora_buffer_pairing``: upstream zips the losses ``[L(x), L(h_0), ...]`` with the batches
  ``[h_0, ..., x]``, one place off; ``"aligned"``: each batch ranked by its own loss.

The paper configs take the values upstream's run scripts set per stream and dataset, not its
code defaults (:func:`paper_settings`: window 5.2 / 0.02 on Si-Blurry, 6.0 / 0.1 on
the clear stream; hard buffer 8 on CUB's clear stream, else 4; aligned buffer pairing on the clear
stream), train with the batch-wise logit mask like every method, and let the window read that
masked loss (docs/upstream-differences.md). Transforms are PILOT's, not upstream's.

Cost: the window needs the loss on the host, so this method reads the device once per step (one
``tolist`` of the step's loss values); the other methods do not. Each step also runs one forward
and backward pass per buffered batch (up to 4 more than the other methods): that, not the LoRA
factors, is where oLoRA's time and memory go (``benchmarks/bench_memory.py``). One batch at a
time, its activation memory is one batch's, not five (at 64 px, batch 32, 4 buffered batches on
the CPU: 603 MiB against 1722 MiB with one graph).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from ..core.checks import boolean, integer, list_of, optional, real, within_vit_depth
from ..core.lazy import F, nn, no_grad, torch
from ..core.lora import (
    BUFFER_PAIRINGS,
    IMPORTANCE_LABELS,
    LORA_MERGES,
    BufferEntry,
    HardBuffer,
    ImportanceRegularizer,
    LossPlateauDetector,
    hard_buffer_candidates,
    importance_loss,
)
from ..engine.adapter import (
    Autocast,
    ConfigKey,
    MethodAdapter,
    StepOutput,
    TrainedStep,
    TrainingBatch,
)
from ..engine.card import MethodCard
from ..engine.registry import register_method

logger = logging.getLogger(__name__)

#: ``olora_merge_optimizer_state``: keep the factors' optimiser state at a merge, or drop it.
MERGE_OPTIMIZER_STATES = ("upstream", "reset")
#: ``olora_importance_batches``: the first buffered batch only, or all of them.
IMPORTANCE_BATCHES = ("upstream", "all")
#: ``olora_window_loss``: the unmasked stream CE, or the loop's masked one.
WINDOW_LOSSES = ("upstream", "masked")


#: Upstream's loss-window thresholds (mean, variance) per stream, from its run scripts rather
#: than its code defaults: ``Si-blurry/scripts/blurry.sh`` passes 5.2 / 0.02 (for every
#: dataset); the clear-stream trainer's ``Disjoint/configs/{cifar100,cub200,imagenetR}_online_
#: lora.py`` keep 6.0 / 0.1 (``Disjoint/scripts/disjoint_cil.sh`` sets 5.6 / 0.04 only for
#: Sketch, not a paper dataset).
UPSTREAM_WINDOW: dict[str, tuple[float, float]] = {
    "clear": (6.0, 0.1),
    "si_blurry": (5.2, 0.02),
}
#: Upstream's clear-stream trainer ranks each batch by its own loss (``Disjoint/engine.py``:
#: ``zip(current_loss + hard_loss, x + xh)``); the Si-Blurry trainer one place off.
UPSTREAM_PAIRING: dict[str, str] = {"clear": "aligned", "si_blurry": "upstream"}


def paper_settings(dataset: str, stream: str) -> dict[str, Any]:
    """Upstream's run-script values for the stream and dataset (docs/upstream-differences.md):
    window thresholds per stream; hard buffer 8 on CUB's clear stream
    (``Disjoint/configs/cub200_online_lora.py``), else 4 (every other config, and the
    Si-Blurry trainer's default); buffer pairing per trainer. The window reads the masked CE
    (``olora_window_loss: "masked"``): the paper configs train with the batch-wise mask, and
    upstream's window reads the loss it trains on."""
    if stream not in UPSTREAM_WINDOW:
        raise ValueError(f"stream must be one of {', '.join(UPSTREAM_WINDOW)}, got {stream!r}")
    mean, variance = UPSTREAM_WINDOW[stream]
    return {
        "loss_window_mean_threshold": mean,
        "loss_window_variance_threshold": variance,
        "hard_buffer_size": 8 if (dataset, stream) == ("cub", "clear") else 4,
        "olora_buffer_pairing": UPSTREAM_PAIRING[stream],
        "olora_window_loss": "masked",
    }


CARD = MethodCard(
    backbone_types=("vit_base_patch16_224", "vit_base_patch16_224_in21k"),
    paper_name="oLoRA",
    full_name="Online-LoRA",
    upstream_model="",  # Online-LoRA-official, not a PILOT model
    # One buffered batch: the same code paths, two passes a step instead of five (CI time).
    smoke_overrides={"hard_buffer_size": 1},
    paper_settings=paper_settings,
)


@register_method("olora_online", card=CARD)
class OLoRAOnline(MethodAdapter):
    base_model_name: ClassVar[str] = "olora"  # no PILOT counterpart: PILOT's default transforms
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "lora_rank": ConfigKey(
            4, "LoRA rank r on the q and v projections (upstream 4)", check=integer(1)
        ),
        "lora_layer": ConfigKey(
            None,
            "ViT block indices that get LoRA; null = all (upstream)",
            check=optional(list_of(integer(0), "a list of distinct block indices", distinct=True)),
            cross_check=within_vit_depth("lora_layer"),
        ),
        "loss_window_length": ConfigKey(
            5,
            "steps in the loss window (upstream 5; at batch 100, 500 samples: > a CUB task)",
            check=integer(1),
        ),
        "loss_window_mean_threshold": ConfigKey(
            6.0,
            "plateau when the window mean is below this (upstream 6.0; a sum of <= 5 CEs)",
            check=real(),
        ),
        "loss_window_variance_threshold": ConfigKey(
            0.1, "plateau when the window variance is below this too (upstream 0.1)", check=real(0)
        ),
        "hard_buffer_size": ConfigKey(
            4, "highest-loss mini-batches kept for replay (upstream 4)", check=integer(0)
        ),
        "hard_loss": ConfigKey(
            True, "add the hard buffer's CE to the loss (upstream true)", check=boolean
        ),
        "mas_weight": ConfigKey(
            2000.0, "weight of the importance regulariser (upstream 2000)", check=real(0)
        ),
        "olora_merge": ConfigKey(
            "upstream",
            "upstream: merge by adding the factors (A += A', B += B'); exact: W += B A",
            choices=LORA_MERGES,
        ),
        "olora_merge_optimizer_state": ConfigKey(
            "upstream",
            "upstream: the fresh factors keep Adam's (and FGH's) state; reset: drop it at a merge",
            choices=MERGE_OPTIMIZER_STATES,
        ),
        "olora_importance_batches": ConfigKey(
            "upstream",
            "upstream: importance from the first (top-ranked) buffered batch; all: every one",
            choices=IMPORTANCE_BATCHES,
        ),
        "olora_importance_labels": ConfigKey(
            "upstream",
            "upstream: one arg-max pseudo-label over the flattened batch; per_sample: one each",
            choices=IMPORTANCE_LABELS,
        ),
        "olora_window_loss": ConfigKey(
            "upstream",
            "upstream: plateau window and buffer ranking read the unmasked stream CE; masked: "
            "the loop's training-masked CE",
            choices=WINDOW_LOSSES,
        ),
        "olora_buffer_pairing": ConfigKey(
            "upstream",
            "upstream: buffer ranking zips losses one place off the batches; aligned: each "
            "batch with its own loss",
            choices=BUFFER_PAIRINGS,
        ),
    }

    # -- network -------------------------------------------------------------------------------
    def build_network(self, args: dict) -> nn.Module:
        import timm  # lazily: methods/ imports no timm (and no torch) when imported

        from ..core.networks import OLoRANet, add_lora

        backbone = timm.create_model(
            args["backbone_type"],
            pretrained=bool(args.get("pretrained", False)),
            num_classes=0,
            drop_rate=float(args.get("drop", 0.0)),
            drop_path_rate=float(args.get("drop_path", 0.0)),
        )
        adapters = add_lora(
            backbone, args["lora_rank"], args["lora_layer"], merge=args["olora_merge"]
        )
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
        self._unmasked_ce: torch.Tensor | None = None
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        logits, features = network(x)
        return StepOutput(logits, features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc

    # -- the method's own loss terms and after-step work ----------------------------------------
    def loss_terms(
        self, network: nn.Module, out: StepOutput, batch: TrainingBatch
    ) -> dict[str, torch.Tensor]:
        """The loop's masked CE, and the importance penalty once there is one. With
        ``olora_window_loss: upstream`` the unmasked CE of the same logits is kept too
        (detached): upstream's window and buffer ranking read that one."""
        if self.args["olora_window_loss"] == "upstream":
            self._unmasked_ce = F.cross_entropy(out.logits.detach().float(), batch.labels)
        terms = super().loss_terms(network, out, batch)
        penalty = self.regularizer.penalty(self._lora)
        if penalty is not None:
            terms["importance"] = penalty
        return terms

    def after_backward(self, network: nn.Module, autocast: Autocast) -> dict[str, torch.Tensor]:
        """The hard buffer's CEs, one batch at a time: with ``hard_loss`` each is backpropagated
        at once (its graph freed before the next forward), else computed without a graph (the
        ranking still needs them)."""
        hard_loss = self.args["hard_loss"]
        values = []
        for entry in self.buffer.entries:
            with torch.set_grad_enabled(hard_loss), autocast():
                loss = F.cross_entropy(network(entry.inputs)[0], entry.labels)
            if hard_loss:
                loss.backward()
            values.append(loss.detach())
        self._hard_losses = values
        return {"hard_buffer": torch.stack(values).sum()} if hard_loss and values else {}

    def after_step(self, network: nn.Module, step: TrainedStep) -> list[nn.Parameter]:
        inputs, labels, terms = step.inputs, step.labels, step.terms
        # The one host read per step: the window needs the loss, the buffer its ordering.
        stream_ce = terms["ce"] if self._unmasked_ce is None else self._unmasked_ce
        values = torch.stack([stream_ce.reshape(()).float(), *self._hard_losses])
        batch_loss, *hard = values.tolist()
        self._hard_losses, self._unmasked_ce = [], None
        window_loss = batch_loss + (sum(hard) if self.args["hard_loss"] else 0.0)
        restarted: list[nn.Parameter] = []
        if self.detector.update(window_loss):
            self._consolidate(network)
            if self.args["olora_merge_optimizer_state"] == "reset":
                restarted = list(self._lora)  # a fresh adapter: no momentum from the merged one
        self.buffer.update(
            hard_buffer_candidates(
                (inputs, labels),
                self.buffer.entries,
                batch_loss,
                hard,
                self.args["olora_buffer_pairing"],
            )
        )
        return restarted

    def _consolidate(self, network: nn.Module) -> None:
        """At a plateau: importance from the hard buffer (its first batch only, as upstream, or
        all of it), then merge the LoRA and start afresh."""
        squared = [torch.zeros_like(p) for p in self._lora]
        entries = self.buffer.entries
        if self.args["olora_importance_batches"] == "upstream":
            entries = entries[:1]  # upstream's parameter iterators run dry after the first batch
        if entries:
            self.set_mode(network, train=False)
            for entry in entries:
                loss = importance_loss(
                    network(entry.inputs)[0], self.args["olora_importance_labels"]
                )
                grads = torch.autograd.grad(loss, self._lora)
                torch._foreach_addcmul_(squared, grads, grads)
            self.set_mode(network, train=True)
        self.regularizer.update(squared)
        for adapter in network.adapters:
            adapter.merge_()
        logger.info(
            "oLoRA plateau %d at step %d: LoRA merged, a fresh one starts",
            self.detector.plateaus,
            self.detector.steps,
        )

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
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
        if self.detector.plateaus and self.args["olora_merge"] == "exact":
            # before any merge the rebuilt network already has them; upstream merges live in
            # the adapters' merged_* buffers, which the loop checkpoints with the network's
            state["merged_qkv"] = [adapter.qkv.weight.detach() for adapter in network.adapters]
        return state

    @no_grad
    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
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

"""MOS online (``mos_online``): Model Surgery for pre-trained-model class-incremental learning
(Sun et al., AAAI 2025; PILOT's ``models/mos.py``, network ``MOSNet``, backbone
``backbone/vit_mos.py``).

Upstream, per task: the ViT's AdaptFormer adapter set (``ffn_num`` wide, parallel to each MLP)
and the linear head train (SGD, CE on the task's classes plus the orthogonality term ``reg``);
before every forward and after every step the adapter is pulled towards the mean of the adapters
of earlier tasks (``adapter_momentum``). At the task end the adapter is stored, each new class's
feature mean and covariance (+ 1e-4 I) are computed with it, and from the second task on the head
is realigned by SGD on features drawn from every class's Gaussian (``crct_epochs``); the head of
adapter 0's class means (``replace_fc``) is updated. The next task's adapter continues from the
stored one with a fresh optimiser. At inference, adapter 0's prototype head predicts a class, its
task's adapter re-predicts, and so on until the task is stable (at most 4 passes: "self-refined
retrieval"); the result is ensembled with the prototype head's softmax.

Online, a consolidation firing stands for upstream's task end and the next task's start. The
default trigger is ``new_classes``: MOS's adapters and its retrieval are organised by classes
(upstream: one adapter per task of new classes, each class retrieved through its task's), and
this trigger fires before the batch that brings a class beyond the ``consolidation_new_classes``
first seen since the last firing: in a clear stream of 10-class tasks, at each task boundary.
``plateau`` and ``every_n_samples`` tie adapters to no class group; they work, but retrieval
then maps classes to whatever sets saw them most.

* **Preallocated adapters.** ``mos_max_adapters`` adapter sets exist from the start (the loop's
  parameter list is fixed when it is built, so it lists them all); only the active one has
  ``requires_grad`` and is used in training, so the others get no gradient (Adam and FGH skip
  them). A firing freezes the active set and activates
  the next, copied from it (upstream's warm start); its optimiser and FGH state are dropped (it
  has none: upstream's fresh optimiser). Once the cap is reached the last set keeps training.
* **Merge.** After every optimiser step the active set becomes ``(1 - m)^2 A + (1 - (1 - m)^2)
  mean(frozen sets)``: upstream's two merges per step (after the step and before the next
  forward) at once, ``m`` = ``adapter_momentum``. Upstream also reweights the stored adapters in
  place at every evaluation batch (so its evaluation changes its weights); we evaluate with them
  as stored.
* **Class statistics** (:class:`~pilot_online.core.class_stats.ClassGaussians`, shared with
  SLCA): running means and scatter matrices of the training features (the active set's, before
  the step's update, training transforms), every sample of a class whichever set was active;
  upstream's per-task pass with test transforms cannot run online.
  ``ca_storage_efficient_method``: ``covariance`` or ``variance`` (upstream's ``multi-centroid``
  needs k-means over all of a class's features: refused).
* **Classifier alignment** (:func:`~pilot_online.core.class_stats.align_classifier`) at each
  firing from the second on (upstream: from the second task on), on the head P and FGH act on,
  with its own SGD (momentum 0.9, ``ca_lr`` cosine-annealed over ``ca_epochs``,
  ``ca_weight_decay``): the loop's optimiser and FGH state of the head are kept.
* **Orthogonality term**: upstream's, against the class means as they stood at the last firing
  (upstream: the means of earlier tasks' classes).
* **Retrieval.** Each class's adapter is the set that saw most of its samples
  (``class_slot_counts``; upstream: its task's). The prototype head is the running mean of set
  0's features per class (after the first firing set 0 is frozen and each training batch passes
  through it once more, without gradient). Evaluation is per sample: every used set's features,
  the self-refined loop, and (``ensemble``) ``softmax(final) + softmax(prototype cosine x sets
  used)``, as upstream's ``softmax(orig / (1 / (task + 1)))``.

One learning rate for adapters and head (upstream: head at 0.1 x), as the loop has one group.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checks import boolean, integer, real
from ..core.class_stats import ClassGaussians, align_classifier
from ..core.prototypes import PrototypeBank
from ..core.rng import key_seed
from ..engine.adapter import ConfigKey, MethodAdapter, StepOutput
from ..engine.mixins import _run_seed
from ..engine.registry import register_method

#: ``ca_storage_efficient_method``: full covariances, or their diagonals.
CA_STATISTICS = ("covariance", "variance")
#: Upstream's cap on self-refined retrieval passes (``MAX_ITER`` in ``_eval_cnn``).
RETRIEVAL_PASSES = 4
#: Upstream's temperature of the orthogonality term.
ORTH_TEMPERATURE = 0.8


def self_refined(
    slot_logits: torch.Tensor, start: torch.Tensor, class_slot: torch.Tensor, passes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's self-refined retrieval, per sample: from adapter ``start`` ``[B]``, predict with
    ``slot_logits[s]`` (``[S, B, C]``), move to the predicted class's adapter (``class_slot``
    ``[C]``), until it stays put or ``passes`` predictions were made. Returns the last logits
    used ``[B, C]`` and their adapter ``[B]``."""
    rows = torch.arange(slot_logits.shape[1], device=slot_logits.device)
    slot, done = start.clone(), torch.zeros_like(start, dtype=torch.bool)
    final = slot_logits[slot, rows]
    for step in range(1, passes + 1):
        logits = slot_logits[slot, rows]
        final = torch.where(done[:, None], final, logits)
        nxt = class_slot[logits.argmax(1)]
        stop = done | (nxt == slot) | (step >= passes)
        slot = torch.where(stop, slot, nxt)
        done = stop
    return final, slot


def merge_toward_mean(active: list[torch.Tensor], frozen: list[list[torch.Tensor]], weight: float):
    """``active <- (1 - weight) active + weight mean(frozen)`` in place (upstream's
    ``reweight_adapter`` with the prefix sums' mean)."""
    for i, tensor in enumerate(active):
        mean = torch.stack([group[i] for group in frozen]).mean(0)
        tensor.mul_(1 - weight).add_(mean, alpha=weight)


def orth_loss(features: torch.Tensor, old_means: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Upstream's ``orth_loss`` without ``reg``: rows ``M`` = the old class means (``old``: bool
    ``[C]``, the classes taken) then the batch features; CE of ``M M^T / 0.8`` against the
    identity, mean over the rows. Masked instead of indexed: no host sync."""
    rows = torch.cat([old_means.to(features), features])
    keep = torch.cat([old, torch.ones(len(features), dtype=torch.bool, device=old.device)])
    sim = (rows @ rows.T) / ORTH_TEMPERATURE
    sim = sim.masked_fill(~keep[None, :], float("-inf"))
    target = torch.arange(len(rows), device=rows.device)
    per_row = F.cross_entropy(sim, target, reduction="none")
    per_row = torch.where(keep, per_row, per_row.new_zeros(()))
    return per_row.sum() / keep.sum()


@register_method("mos_online")
class MOSOnline(MethodAdapter):
    base_model_name: ClassVar[str] = "mos"
    paper_name: ClassVar[str] = "MOS"
    backbone_types: ClassVar[tuple[str, ...]] = (
        "vit_base_patch16_224_mos",
        "vit_base_patch16_224_in21k_mos",
    )
    default_consolidation: ClassVar[str] = "new_classes"
    #: The synthetic stream's groups of 4 classes, 3 adapter sets, and a short CA (CI time).
    smoke_overrides: ClassVar[Mapping[str, Any]] = {
        "adapter_dropout": 0.0,
        "consolidation_new_classes": 4,
        "mos_max_adapters": 3,
        "ca_epochs": 2,
        "ca_samples_per_class": 16,
    }
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "ffn_num": ConfigKey(
            16, "adapter bottleneck width (upstream mos.json: 16)", check=integer(1)
        ),
        "adapter_dropout": ConfigKey(
            0.1, "dropout inside the adapters (PILOT hard-codes 0.1)", check=real(0, 1)
        ),
        "mos_max_adapters": ConfigKey(
            10,
            "adapter sets preallocated; a firing activates the next until all are used "
            "(upstream: one per task)",
            check=integer(1),
        ),
        "adapter_momentum": ConfigKey(
            0.1,
            "merge of the active adapter towards the frozen ones' mean (upstream 0.1)",
            check=real(0, 1),
        ),
        "reg": ConfigKey(0.1, "weight of the orthogonality term (upstream 0.1)", check=real(0)),
        "ensemble": ConfigKey(
            True,
            "add the prototype head's softmax to the retrieved one (upstream true)",
            check=boolean,
        ),
        "ca_epochs": ConfigKey(
            30, "classifier-alignment epochs per firing (upstream crct_epochs 30)", check=integer(0)
        ),
        "ca_lr": ConfigKey(0.005, "classifier-alignment SGD LR (upstream 0.005)", check=real(0)),
        "ca_weight_decay": ConfigKey(
            5e-4, "classifier-alignment weight decay (upstream weight_decay 5e-4)", check=real(0)
        ),
        "ca_samples_per_class": ConfigKey(
            240,
            "features drawn per class per CA epoch, also the CA batch (upstream batch_size x 5)",
            check=integer(1),
        ),
        "ca_storage_efficient_method": ConfigKey(
            "covariance",
            "class statistics for CA: full covariances or their diagonals (upstream's "
            "multi-centroid needs every feature of a class: not online)",
            choices=CA_STATISTICS,
        ),
    }

    @classmethod
    def state_bytes(cls, args: Mapping[str, Any]) -> int:
        """The class statistics (float32 D x D scatter per class, or D with ``variance``) and
        the three D-wide class means (statistics, prototype head, orthogonality snapshot)."""
        classes, dim = int(args["nb_classes"]), 768  # vit_mos hard-codes the width
        scatter = dim if args.get("ca_storage_efficient_method") == "variance" else dim * dim
        return 4 * classes * (scatter + 3 * dim)

    # -- network -------------------------------------------------------------------------------
    def backbone_kwargs(self, args: dict) -> dict[str, Any]:
        # vit_mos's factory hard-codes pretrained=True for the ViT it copies weights from.
        return {"pretrained": bool(args["pretrained"]), **super().backbone_kwargs(args)}

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import MOSNet  # PILOT, imported lazily

        # Built on the CPU (PILOT moves its adapters to args["device"][0]); the loop moves it.
        network = MOSNet(self.pilot_args(args, device=["cpu"]), True)
        backbone = network.backbone
        first = backbone.cur_adapter  # PILOT's initial adapter set (LoRA-style init)
        del backbone.cur_adapter
        slots = int(args["mos_max_adapters"])
        backbone.adapter_list = nn.ModuleList(
            [first] + [copy.deepcopy(first) for _ in range(slots - 1)]
        )
        for group in backbone.adapter_list:
            for adapter in group:
                adapter.dropout = float(args["adapter_dropout"])  # a float attribute upstream
        network.requires_grad_(False)
        backbone.adapter_list[0].requires_grad_(True)  # the others wait for their firing
        backbone.head.requires_grad_(True)
        classes, dim = int(args["nb_classes"]), backbone.embed_dim
        diagonal = args["ca_storage_efficient_method"] == "variance"
        network.class_stats = ClassGaussians(classes, dim, diagonal)
        network.prototypes = PrototypeBank(classes, dim)  # adapter set 0's class means
        network.register_buffer("class_slot_counts", torch.zeros(classes, slots, dtype=torch.long))
        network.register_buffer("orth_means", torch.zeros(classes, dim))
        network.register_buffer("orth_classes", torch.zeros(classes, dtype=torch.bool))
        network.mos_active = 0  # the adapter set in training (extra_state keeps it)
        self.active, self.alignments = 0, 0
        return network

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.backbone.head

    def trainable_parameters(self, network: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """Every adapter set and the head, frozen or not: the loop's list is built once."""
        for name, p in network.named_parameters():
            if name.startswith(("backbone.adapter_list.", "backbone.head.")):
                yield name, p

    @staticmethod
    def features(network: nn.Module, x: torch.Tensor, slot: int) -> torch.Tensor:
        """The [CLS] feature through adapter set ``slot`` (upstream's ``forward_features``
        without its in-place reweighting)."""
        backbone = network.backbone
        tokens = backbone.patch_embed(x)
        cls = backbone.cls_token.expand(tokens.shape[0], -1, -1)
        tokens = backbone.pos_drop(torch.cat([cls, tokens], dim=1) + backbone.pos_embed)
        for block, adapter in zip(backbone.blocks, backbone.adapter_list[slot]):
            tokens = block(tokens, adapter)
        return backbone.norm(tokens)[:, 0]

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        if not train:
            return self.retrieve(network, x)
        active = network.mos_active
        features = self.features(network, x, active)
        extras = {}
        if active > 0:  # set 0 is frozen: its features feed the prototype head
            with torch.no_grad():
                extras["prototype_features"] = self.features(network, x, 0)
        aux = self.args["reg"] * orth_loss(features, network.orth_means, network.orth_classes)
        return StepOutput(network.backbone.head(features), features, aux, extras)

    @torch.no_grad()
    def retrieve(self, network: nn.Module, x: torch.Tensor) -> StepOutput:
        """Upstream's ``_eval_cnn`` over the sets used so far, sample by sample."""
        head, used = network.backbone.head, network.mos_active + 1
        stacked = torch.stack([self.features(network, x, s) for s in range(used)])
        seen = network.prototypes.counts > 0
        if not bool(seen.any()):  # nothing learnt yet: the first set's head
            return StepOutput(head(stacked[0]), stacked[0])
        slot_logits = head(stacked).masked_fill(~seen, float("-inf"))
        cosine = F.normalize(stacked[0], dim=1) @ F.normalize(network.prototypes.means, dim=1).T
        cosine = cosine.masked_fill(~seen, float("-inf"))
        class_slot = network.class_slot_counts.argmax(1)
        start = class_slot[cosine.argmax(1)]
        final, slot = self_refined(slot_logits, start, class_slot, RETRIEVAL_PASSES)
        if self.args["ensemble"]:
            final = final.softmax(1) + (cosine * used).softmax(1)
        rows = torch.arange(len(x), device=x.device)
        return StepOutput(final, stacked[slot, rows])

    def train_mode(self, network: nn.Module) -> None:
        network.eval()  # the frozen ViT: no dropout outside the adapters
        network.backbone.adapter_list.train()

    # -- what MOS learns beyond gradients ------------------------------------------------------
    @torch.no_grad()
    def observe(self, network: nn.Module, out: StepOutput, labels: torch.Tensor) -> None:
        n = len(labels)
        network.class_stats.update(out.features[:n], labels)
        prototype = out.extras.get("prototype_features", out.features)[:n]
        network.prototypes.update(prototype.detach(), labels, validate=False)
        ones = torch.ones_like(labels, dtype=torch.long)
        network.class_slot_counts[:, network.mos_active].index_add_(0, labels, ones)

    @torch.no_grad()
    def after_step(
        self,
        network: nn.Module,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        terms: Mapping[str, torch.Tensor],
    ) -> list[nn.Parameter]:
        active, momentum = network.mos_active, float(self.args["adapter_momentum"])
        if active > 0 and momentum > 0:
            sets = network.backbone.adapter_list
            merge_toward_mean(
                list(sets[active].parameters()),
                [list(sets[s].parameters()) for s in range(active)],
                1 - (1 - momentum) ** 2,  # upstream merges after the step and before the next
            )
        return []

    def consolidate(self, network: nn.Module, firing: int) -> Iterable[nn.Parameter]:
        stats = network.class_stats
        if firing > 0 and self.args["ca_epochs"] > 0:  # upstream aligns from the second task on
            head = self.classifier(network)
            classes = stats.seen()
            generator = torch.Generator(device=head.weight.device)
            generator.manual_seed(key_seed(_run_seed(self.args.get("seed", 0)), firing))
            align_classifier(
                head,
                classes,
                stats.means[classes],
                stats.factors(classes),
                epochs=int(self.args["ca_epochs"]),
                lr=float(self.args["ca_lr"]),
                weight_decay=float(self.args["ca_weight_decay"]),
                samples_per_class=int(self.args["ca_samples_per_class"]),
                generator=generator,
            )
            self.alignments += 1
        with torch.no_grad():
            network.orth_means.copy_(stats.means)
            network.orth_classes.copy_(stats.counts > 0)
        sets = network.backbone.adapter_list
        active = network.mos_active
        if active + 1 >= len(sets):
            return []  # the cap: the last set keeps training
        with torch.no_grad():
            for new, old in zip(sets[active + 1].parameters(), sets[active].parameters()):
                new.copy_(old)
        self._activate(network, active + 1)
        return list(sets[active + 1].parameters())

    def _activate(self, network: nn.Module, active: int) -> None:
        """Set ``active`` trains; the others (frozen, or not yet used) do not."""
        for s, group in enumerate(network.backbone.adapter_list):
            group.requires_grad_(s == active)
        network.mos_active = self.active = active

    # -- checkpoints and report ----------------------------------------------------------------
    def extra_state(self, network: nn.Module) -> dict[str, Any]:
        """The active set and the count of alignments; the statistics are buffers."""
        return {"active": network.mos_active, "alignments": self.alignments}

    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        active = int(state["active"])
        if not 0 <= active < len(network.backbone.adapter_list):
            raise ValueError(
                f"the checkpoint's active adapter set is {active}, but this network has "
                f"{len(network.backbone.adapter_list)} (mos_max_adapters): resume with the config "
                "that wrote it"
            )
        self._activate(network, active)
        self.alignments = int(state["alignments"])

    def report(self) -> dict[str, Any]:
        if not hasattr(self, "active"):
            return {}
        return {
            "mos": {
                "adapter_sets_used": self.active + 1,
                "max_adapter_sets": int(self.args["mos_max_adapters"]),
                "alignments": self.alignments,
            }
        }

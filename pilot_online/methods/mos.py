"""MOS online (``mos_online``): Model Surgery for pre-trained-model class-incremental learning
(Sun et al., AAAI 2025; PILOT's ``models/mos.py``, network ``MOSNet``, backbone
``backbone/vit_mos.py``).

Upstream, per task: a new AdaptFormer adapter set (``ffn_num`` wide, parallel to each MLP) and the
linear head train (SGD, the head at 0.1 x the LR, CE on the task's classes plus the orthogonality
term ``reg``). The training forward (``forward_features`` with ``train=True``) calls
``reweight_adapter`` before each of the D blocks, and each call pulls every layer of the adapter
towards the mean of the stored ones (``adapter_momentum`` m): block l runs with its layer pulled
l + 1 times, the backward reads the values after D pulls, and ``adapter_merge`` pulls once more
after the step. At the task end the adapter is stored; ``_compute_mean`` takes each new class's
feature mean and covariance (+ 1e-4 I) in eval mode with ``train=True``, so every forward of that
pass pulls the adapter D more times towards the mean of the *earlier* stored sets (the next task's
adapter continues from there); from the second task on the head is realigned on features drawn
from every class's Gaussian (``crct_epochs``) and kept; adapter 0's class means become the
prototype head (``replace_fc``). Evaluation pulls each stored set s >= 1 in place, D times per
batch, towards the mean of sets 0..s-1; then adapter 0's prototype head predicts a class, its
task's adapter re-predicts, and so on until stable (at most 4 passes), ensembled with the
prototype head's softmax.

Online, a consolidation firing stands for upstream's task end and the next task's start (default
trigger ``new_classes``: MOS organises adapters and retrieval by classes).

* **Adapter sets, unbounded.** The network starts with one set; each firing freezes the active set
  and adds a new one (the loop adopts its parameters), starting where upstream's next adapter
  starts: the active set pulled ``D x sum_c ceil(n_c / (3 batch_size))`` times (upstream's
  statistics forwards over the set's classes) towards the mean of the sets before it.
* **Merge**, as upstream's per step: D pulls inside the training forward (one before each block,
  on the parameters' storage, so the backward reads the pulled values as upstream's does) and one
  after the optimiser step. Retention of the active set per step: ``(1 - m)^(D + 1)``.
* **Head** at a declared ``lr_scales`` factor of 0.1 (upstream's second parameter group).
* **Class statistics** (:class:`~pilot_online.core.class_stats.ClassGaussians`) and the prototype
  head (set 0's class means): running over the stream batches, each batch passed once more in
  eval mode without gradient; classes of set a >= 1 through the mean of sets 0..a-1 (the limit of
  upstream's statistics pulls). ``ca_storage_efficient_method``: ``covariance`` or ``variance``.
* **Classifier alignment** (:func:`~pilot_online.core.class_stats.align_classifier`) at each
  firing from the second on, kept for training as upstream keeps it.
* **Evaluation view** (:meth:`MOSOnline.evaluation`): what upstream evaluates at a task end,
  derived from the training state without changing it: the head aligned as the next firing will
  align it, and each set s >= 1 replaced by the mean of sets 0..s-1 (the limit of upstream's
  evaluation pulls).
* **Retrieval.** Each class's set is the one that saw most of its samples (``class_slot_counts``;
  upstream: its task's); self-refined retrieval per sample over every set, ensembled as upstream's
  ``softmax(orig / (1 / (task + 1)))``.

Deliberate differences: the card's ``upstream_differences`` (:data:`CARD`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ..core.checks import boolean, integer, real
from ..core.lazy import F, nn, no_grad, torch
from ..core.rng import key_seed
from ..engine.adapter import (
    ConfigKey,
    Consolidated,
    Consolidation,
    Evaluation,
    MethodAdapter,
    StepOutput,
    TrainedStep,
)
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.registry import register_method

#: ``ca_storage_efficient_method``: full covariances, or their diagonals.
CA_STATISTICS = ("covariance", "variance")
#: Upstream's cap on self-refined retrieval passes (``MAX_ITER`` in ``_eval_cnn``).
RETRIEVAL_PASSES = 4
#: Upstream's temperature of the orthogonality term.
ORTH_TEMPERATURE = 0.8
#: Upstream's head learns at 0.1 x the adapters' LR (``get_optimizer``'s second group).
HEAD_LR_SCALE = 0.1
#: Upstream's statistics pass loads ``batch_size * 3`` samples per forward (``_compute_mean``).
STATISTICS_BATCH_FACTOR = 3


def adapter_tensors(adapters: nn.Module) -> list[torch.Tensor]:
    """The values of every parameter of an adapter set (``.data``: no autograd history)."""
    return [p.data for p in adapters.parameters()]


def prefix_sum(sets: Sequence[nn.Module], count: int) -> list[torch.Tensor]:
    """The sum of the first ``count`` sets, added in order (upstream's ``sum_adapter_param``)."""
    total = [t.clone() for t in adapter_tensors(sets[0])]
    for s in range(1, count):
        torch._foreach_add_(total, adapter_tensors(sets[s]))
    return total


def pull_term(sets: Sequence[nn.Module], count: int, momentum: float) -> list[torch.Tensor]:
    """``momentum * sum / count`` over the first ``count`` sets, in upstream's order of operations
    (``momentum * self.down_weight_sum[layer_idx][idx-1] / idx``)."""
    return torch._foreach_div(torch._foreach_mul(prefix_sum(sets, count), momentum), count)


def pull(params: list[nn.Parameter], term: list[torch.Tensor], momentum: float) -> None:
    """One of upstream's ``reweight_adapter`` calls on every layer: ``p <- (1 - m) p + term``,
    assigned to ``.data`` as upstream assigns it: a new tensor, so a graph built before the pull
    keeps the values it ran with (the backward differentiates the forward as it ran), and the
    optimiser then updates the pulled values."""
    pulled = torch._foreach_add(torch._foreach_mul([p.data for p in params], 1 - momentum), term)
    for p, value in zip(params, pulled):
        p.data = value


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


def paper_settings(dataset: str, stream: str) -> dict[str, Any]:
    """Upstream's alignment weight decay is its config's ``weight_decay``: 5e-3 in
    ``exps/mos_inr.json`` (ImageNet-R), 5e-4 (the key's default) elsewhere."""
    return {"ca_weight_decay": 5e-3} if dataset == "imagenetr" else {}


def state_bytes(args: Mapping[str, Any]) -> int:
    """The class statistics (float32 D x D scatter per class, or D with ``variance``) and
    the three D-wide class means (statistics, prototype head, orthogonality snapshot)."""
    classes, dim = int(args["nb_classes"]), 768  # vit_mos hard-codes the width
    scatter = dim if args.get("ca_storage_efficient_method") == "variance" else dim * dim
    return 4 * classes * (scatter + 3 * dim)


CARD = MethodCard(
    backbone_types=("vit_base_patch16_224_mos", "vit_base_patch16_224_in21k_mos"),
    paper_name="MOS",
    # Each firing adds an adapter set, which every forward runs (the FLOP model counts it).
    grows=True,
    # The synthetic stream's groups of 4 classes and a short CA (CI time).
    smoke_overrides={
        "adapter_dropout": 0.0,
        "consolidation_new_classes": 4,
        "ca_epochs": 2,
        "ca_samples_per_class": 16,
    },
    paper_settings=paper_settings,
    state_bytes=state_bytes,
    upstream_differences=(
        UpstreamDifference(
            "running_class_statistics",
            "Class means and covariances and the prototype head fold in each stream batch's "
            "features as it arrives (eval mode, training transforms), where upstream makes a "
            "pass over the task's data with test transforms after training it.",
            "A stream is seen once: there is no task's data to pass over again at a firing.",
        ),
        UpstreamDifference(
            "statistics_at_pull_limit",
            "The statistics of classes trained with set a >= 1 come through the mean of sets "
            "0..a-1 for every batch, where upstream's statistics pass pulls the adapter there D "
            "times per forward, so its first batches see it only partly pulled.",
            "Online the statistics accumulate during training, before the firing that would "
            "pull; the limit is what upstream's pass reaches after its first few forwards.",
        ),
        UpstreamDifference(
            "evaluation_at_pull_limit",
            "Evaluation uses each set s >= 1 as the mean of sets 0..s-1 from its first batch, "
            "where upstream pulls the stored set there in place, D times per test batch, so its "
            "first test batches after a task see it partly pulled.",
            "Evaluation must not change training state nor depend on how often one evaluates; "
            "the limit is what upstream reaches within its first few test batches.",
        ),
        UpstreamDifference(
            "retrieval_by_majority_set",
            "A class is retrieved through the adapter set that saw most of its samples, where "
            "upstream uses its task's adapter.",
            "A task-free stream has no task ids; in a clear stream the two agree.",
        ),
    ),
    removed_keys={
        "mos_max_adapters": "MOS adds one adapter set per consolidation firing, without a cap "
        "(upstream: one per task)"
    },
)


@register_method("mos_online", card=CARD)
class MOSOnline(MethodAdapter):
    base_model_name: ClassVar[str] = "mos"
    consolidation: ClassVar[Consolidation] = Consolidation(trigger="new_classes")
    #: What trains is the active adapter set and the head (build_network, add_set); the head at
    #: upstream's second parameter group's factor.
    lr_scales: ClassVar[dict[str, float | str]] = {"backbone.head.": HEAD_LR_SCALE}
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "ffn_num": ConfigKey(
            16, "adapter bottleneck width (upstream mos.json: 16)", check=integer(1)
        ),
        "adapter_dropout": ConfigKey(
            0.1, "dropout inside the adapters (PILOT hard-codes 0.1)", check=real(0, 1)
        ),
        "adapter_momentum": ConfigKey(
            0.1,
            "pull of the active adapter set towards the mean of the earlier ones, D times per "
            "forward and once per step (upstream 0.1)",
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
            5e-4,
            "classifier-alignment weight decay (upstream: its weight_decay, 5e-4; 5e-3 on "
            "ImageNet-R)",
            check=real(0),
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

    # -- network -------------------------------------------------------------------------------
    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import MOSNet  # PILOT, imported lazily

        # Built on the CPU (PILOT moves its adapters to args["device"][0]); the loop moves it.
        return self.equip(MOSNet(self.pilot_args(args, device=["cpu"]), True), args)

    def equip(self, network: nn.Module, args: Mapping[str, Any]) -> nn.Module:
        """Give a network whose ``backbone`` is PILOT's ``vit_mos`` ViT the online state: its
        initial adapter set becomes set 0 of ``adapter_list`` (the only one until a firing), the
        rest frozen but the head, and the statistics buffers."""
        from ..core.class_stats import ClassGaussians
        from ..core.prototypes import PrototypeBank

        backbone = network.backbone
        first = backbone.cur_adapter  # PILOT's initial adapter set (LoRA-style init)
        del backbone.cur_adapter
        backbone.adapter_list = nn.ModuleList([first])
        for adapter in first:
            adapter.dropout = float(args["adapter_dropout"])  # a float attribute upstream
        network.requires_grad_(False)
        first.requires_grad_(True)
        backbone.head.requires_grad_(True)
        classes, dim = int(args["nb_classes"]), backbone.embed_dim
        diagonal = args["ca_storage_efficient_method"] == "variance"
        network.class_stats = ClassGaussians(classes, dim, diagonal)
        network.prototypes = PrototypeBank(classes, dim)  # adapter set 0's class means
        # Samples per class and set (one column per set, a column added at each firing).
        network.register_buffer("class_slot_counts", torch.zeros(classes, 1, dtype=torch.long))
        network.register_buffer("orth_means", torch.zeros(classes, dim))
        network.register_buffer("orth_classes", torch.zeros(classes, dtype=torch.bool))
        self.sets_used, self.alignments = 1, 0
        return network

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.backbone.head

    @staticmethod
    def active_set(network: nn.Module) -> int:
        """The set in training: the newest."""
        return len(network.backbone.adapter_list) - 1

    @staticmethod
    def features_through(
        network: nn.Module,
        x: torch.Tensor,
        adapters: nn.ModuleList,
        before_block: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The [CLS] feature through the adapter set ``adapters`` (upstream's
        ``forward_features``; ``before_block`` runs before each block, where upstream's
        training forward calls ``reweight_adapter``)."""
        backbone = network.backbone
        tokens = backbone.patch_embed(x)
        cls = backbone.cls_token.expand(tokens.shape[0], -1, -1)
        tokens = backbone.pos_drop(torch.cat([cls, tokens], dim=1) + backbone.pos_embed)
        for block, adapter in zip(backbone.blocks, adapters):
            if before_block is not None:
                before_block()
            tokens = block(tokens, adapter)
        return backbone.norm(tokens)[:, 0]

    def features(self, network: nn.Module, x: torch.Tensor, slot: int) -> torch.Tensor:
        """The [CLS] feature through adapter set ``slot`` as it stands (no pulls)."""
        return self.features_through(network, x, network.backbone.adapter_list[slot])

    def pull_step(self, network: nn.Module) -> Callable[[], None] | None:
        """One upstream ``reweight_adapter`` call on the active set (towards the mean of every
        earlier set), or None where upstream's is a no-op (set 0, or momentum 0)."""
        sets, momentum = network.backbone.adapter_list, float(self.args["adapter_momentum"])
        active = len(sets) - 1
        if active == 0 or momentum == 0:
            return None
        params, term = list(sets[active].parameters()), pull_term(sets, active, momentum)
        return lambda: pull(params, term, momentum)

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        if not train:
            return self.retrieve(network, x)
        sets = network.backbone.adapter_list
        features = self.features_through(network, x, sets[-1], self.pull_step(network))
        # Set 0 in training without dropout: its training features are its eval-mode ones.
        same = len(sets) == 1 and float(self.args["adapter_dropout"]) == 0
        with torch.no_grad():  # upstream's statistics passes, in eval mode: no dropout
            extras = self.statistics_features(network, x, features.detach() if same else None)
        aux = self.args["reg"] * orth_loss(features, network.orth_means, network.orth_classes)
        return StepOutput(network.backbone.head(features), features, aux, extras)

    def statistics_features(
        self, network: nn.Module, x: torch.Tensor, set0: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Eval-mode features of a batch, without gradient: set 0's (``prototype_features``,
        upstream's ``replace_fc``; ``set0`` if given) and those the class statistics take
        (``statistics_features``: set 0's while it trains; for set a >= 1, through the mean of
        sets 0..a-1, where upstream's ``_compute_mean`` pulls it)."""
        sets = network.backbone.adapter_list
        prototype = set0
        if prototype is None:
            training = sets[0].training
            sets[0].eval()
            prototype = self.features_through(network, x, sets[0])
            sets[0].train(training)
        active = len(sets) - 1
        if active <= 1:  # the mean of set 0 alone is set 0
            return {"prototype_features": prototype, "statistics_features": prototype}
        statistics = self.features_through(network, x, self.mean_set(network, active))
        return {"prototype_features": prototype, "statistics_features": statistics}

    def mean_set(self, network: nn.Module, count: int) -> nn.ModuleList:
        """A scratch adapter set (no parameter of the network, eval mode) holding the mean of the
        first ``count`` sets."""
        sets = network.backbone.adapter_list
        scratch = getattr(self, "_mean_set", None)
        reference = sets[0][0].down_proj.weight
        if scratch is None or scratch[0].down_proj.weight.device != reference.device:
            scratch = copy.deepcopy(sets[0]).requires_grad_(False).eval()
            self._mean_set = scratch
        mean = torch._foreach_div(prefix_sum(sets, count), count)
        torch._foreach_copy_(adapter_tensors(scratch), mean)
        return scratch

    @no_grad
    def retrieve(self, network: nn.Module, x: torch.Tensor) -> StepOutput:
        """Upstream's ``_eval_cnn`` over every set, sample by sample."""
        head, used = network.backbone.head, len(network.backbone.adapter_list)
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

    def set_mode(self, network: nn.Module, train: bool) -> None:
        """In training, dropout in the active set only (upstream's ``backbone.train()`` runs no
        other set in training, and its ViT has no dropout)."""
        network.eval()
        if train:
            network.backbone.adapter_list[-1].train()

    # -- what MOS learns beyond gradients ------------------------------------------------------
    @no_grad
    def after_step(self, network: nn.Module, step: TrainedStep) -> tuple[nn.Parameter, ...]:
        """Upstream's ``adapter_merge`` after each optimiser step; at the batch's own step, the
        stream batch joins the class statistics, the prototypes and the slot counts."""
        merge = self.pull_step(network)
        if merge is not None:
            merge()
        if step.stream is not None:
            out, labels = step.stream, step.stream_labels
            n = len(labels)
            network.class_stats.update(out.extras["statistics_features"][:n], labels)
            network.prototypes.update(out.extras["prototype_features"][:n], labels, validate=False)
            ones = torch.ones_like(labels, dtype=torch.long)
            network.class_slot_counts[:, -1].index_add_(0, labels, ones)
        return ()

    def statistics_pulls(self, network: nn.Module) -> int:
        """How often upstream's ``_compute_mean`` pulls the adapter at the end of the active
        set's task: D per forward, ``ceil(n_c / (3 batch_size))`` forwards per class of the set
        (its classes' samples seen while it trained); none for set 0 (upstream's idx 0)."""
        if self.active_set(network) == 0:
            return 0
        per_forward = STATISTICS_BATCH_FACTOR * int(self.args["batch_size"])
        counts = network.class_slot_counts[:, -1].tolist()
        forwards = sum(math.ceil(n / per_forward) for n in counts)
        return len(network.backbone.blocks) * forwards

    def aligned_head(self, network: nn.Module, firing: int, head: nn.Linear) -> bool:
        """Upstream's ``classifer_align`` on ``head`` as firing ``firing`` runs it (from the
        second on, once a class was seen), seeded by the run's seed and the firing; whether it
        ran."""
        from ..core.class_stats import align_classifier

        if firing == 0 or self.args["ca_epochs"] == 0:
            return False
        stats = network.class_stats
        classes = stats.seen()
        if len(classes) == 0:
            return False
        generator = torch.Generator(device=head.weight.device)
        generator.manual_seed(key_seed(self.run_seed(), firing))
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
        return True

    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Upstream's task end and next start: align the head (kept for training), snapshot the
        class means for the orthogonality term, freeze the active set and add the next, started
        where upstream's statistics pass leaves the adapter."""
        self.alignments += self.aligned_head(network, firing, self.classifier(network))
        stats = network.class_stats
        with torch.no_grad():
            network.orth_means.copy_(stats.means)
            network.orth_classes.copy_(stats.counts > 0)
            sets = network.backbone.adapter_list
            new = copy.deepcopy(sets[-1])
            active, momentum = len(sets) - 1, float(self.args["adapter_momentum"])
            pulls = self.statistics_pulls(network) if momentum > 0 else 0
            if pulls:
                params, term = list(new.parameters()), pull_term(sets, active, momentum)
                for _ in range(pulls):
                    pull(params, term, momentum)
        self.add_set(network, new)
        return Consolidated()

    def add_set(self, network: nn.Module, new: nn.ModuleList) -> None:
        """Append ``new`` as the active set: the others frozen, a column of class counts."""
        sets = network.backbone.adapter_list
        sets.requires_grad_(False)
        sets.append(new.requires_grad_(True))
        counts = network.class_slot_counts
        network.class_slot_counts = torch.cat([counts, torch.zeros_like(counts[:, :1])], dim=1)
        self.sets_used = len(sets)

    # -- what evaluation sees ------------------------------------------------------------------
    def evaluation(self, network: nn.Module) -> Evaluation:
        """A view, as upstream evaluates after its task-end step: the head aligned as the next
        firing will align it (upstream keeps that head, and so does :meth:`consolidate`, later),
        and each set s >= 1 as the mean of sets 0..s-1 (where upstream's in-place evaluation
        pulls take it)."""
        view: dict[str, torch.Tensor] = {}
        sets = network.backbone.adapter_list
        if len(sets) > 1:
            total = [t.clone() for t in adapter_tensors(sets[0])]
            for s in range(1, len(sets)):
                mean = torch._foreach_div(total, s)
                for (name, _), tensor in zip(sets[s].named_parameters(), mean):
                    view[f"backbone.adapter_list.{s}.{name}"] = tensor
                torch._foreach_add_(total, adapter_tensors(sets[s]))
        head = copy.deepcopy(self.classifier(network))
        if self.aligned_head(network, len(sets) - 1, head):  # the next firing's index
            view["backbone.head.weight"] = head.weight.detach()
            view["backbone.head.bias"] = head.bias.detach()
        return Evaluation(view=view)

    # -- checkpoints and report ----------------------------------------------------------------
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        """The number of adapter sets (to rebuild them) and of alignments; the rest is buffers."""
        return {"sets": len(network.backbone.adapter_list), "alignments": self.alignments}

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        if "sets" not in state:
            raise ValueError(
                "this MOS checkpoint was written by the former port (preallocated adapter sets, "
                "mos_max_adapters), whose merge and sets differ: start the run again"
            )
        count, sets = int(state["sets"]), network.backbone.adapter_list
        if count < len(sets):
            raise ValueError(
                f"the checkpoint has {count} adapter sets but this network already has "
                f"{len(sets)}: load it into a freshly built network"
            )
        while len(sets) < count:  # values come with the checkpoint's parameters
            self.add_set(network, copy.deepcopy(sets[-1]))
        self.alignments = int(state["alignments"])

    def report(self) -> dict[str, Any]:
        if not hasattr(self, "sets_used"):
            return {}
        return {"mos": {"adapter_sets": self.sets_used, "alignments": self.alignments}}

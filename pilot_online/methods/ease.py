"""EASE online (``ease_online``): Expandable Subspace Ensemble (Zhou et al., CVPR 2024), one
adapter subspace per consolidation firing, predicting with class prototypes in every subspace.

Upstream (PILOT's ``models/ease.py``, ``EaseNet``, ``backbone/vit_ease.py``): each task trains a
fresh set of AdaptFormer adapters (one per ViT block, the old sets frozen) with a fresh cosine
head over that task's classes only. At the task's end it stores the task's class means through
every adapter set (``replace_fc``), synthesises the old classes' means in the new subspace from
their semantic similarity to the new classes (``solve_sim_reset``: a softmax over cosines in the
old class's own subspace weighs the new classes' means in the new one), freezes the set and opens
the next. It predicts with a cosine classifier over all subspaces, weighting a class's own
subspace 1 and the others ``alpha / (subspaces - 1)`` (``forward_reweight``).

Online, task-free (the choices are in docs/methods.md, "EASE"):

- ``adapter_num`` adapter sets are built up front (the loop's parameter list is fixed); one is
  active. A consolidation firing (before the step that would start upstream's next task) freezes
  it and activates the next; at the cap, firings change nothing. The default trigger is
  ``new_classes``: upstream opens a subspace per set of new classes, and that trigger fires
  before the batch that brings a class beyond the last ``consolidation_new_classes`` new ones
  (in a clear stream with that many classes per task, at each task boundary).
- Every subspace keeps running class means (``PrototypeBank``, Eq. 1) of the stream batches'
  features through it: the active one from the training forward, the frozen ones from extra
  no-grad passes of the same batch (what upstream's ``replace_fc`` passes through old adapters).
  A class's own ("home") subspace is the one that was active for most of its samples. Means a
  subspace lacks are synthesised at prediction time from the others, as upstream's complement.
- The gradient-trained head is upstream's proxy head: one ``nn.Linear`` over every class (the
  loop's batch mask limits its loss to the batch's classes), on the active subspace's features,
  restarted at each firing that opens a subspace. It is :meth:`classifier` (P replays the loop's
  prototypes through it, FGH reweights it), so all four rows run; predictions come from the
  prototype classifier, so P and FGH reach them only through the adapters they help train.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checks import integer, real
from ..core.prototypes import PrototypeBank
from ..engine.adapter import ConfigKey, MethodAdapter, StepOutput
from ..engine.registry import register_method

logger = logging.getLogger(__name__)


def complemented_prototypes(
    means: torch.Tensor, counts: torch.Tensor, home: torch.Tensor
) -> torch.Tensor:
    """Class means ``[S, C, D]`` per subspace with the missing ones synthesised (EASE's
    prototype complement, upstream ``solve_sim_reset``).

    ``counts`` ``[S, C]``: samples behind each mean (0: missing); ``home`` ``[C]``: each class's
    own subspace. A class c missing from subspace s takes ``sum_j w_j means[s, j]`` over the
    classes j with a mean in both s and c's home subspace r, with ``w = softmax_j(cos(means[r, c],
    means[r, j]))``: similar in the subspace where c was learnt, so alike in s. With no such j it
    stays zero (a zero prototype scores 0, as upstream's unfilled rows)."""
    real = counts > 0  # [S, C]
    seen = real.any(0)
    normed = F.normalize(means, dim=2)
    rows = torch.arange(means.shape[1], device=means.device)
    reference = (normed @ normed.transpose(1, 2))[home, rows]  # [C, C]: cosines in c's home
    reference_real = real[home]  # [C, C]: j has a mean in c's home subspace
    complemented = means.clone()
    for s in range(means.shape[0]):
        donors = reference_real & real[s].unsqueeze(0)
        weights = reference.masked_fill(~donors, float("-inf")).softmax(dim=1)
        has_donors = donors.any(1)
        weights = torch.where(has_donors.unsqueeze(1), weights, torch.zeros_like(weights))
        missing = (seen & ~real[s] & has_donors).unsqueeze(1)
        complemented[s] = torch.where(missing, weights @ means[s], means[s])
    return complemented


def reweighted_logits(
    features: torch.Tensor, prototypes: torch.Tensor, home: torch.Tensor, alpha: float
) -> torch.Tensor:
    """EASE's prediction (upstream ``forward_reweight``): ``[B, C]`` logits
    ``sum_s w[s, c] cos(features[s], prototypes[s, c])`` with ``w = 1`` in class c's home subspace
    and ``alpha / (S - 1)`` in the other ones. ``features`` ``[S, B, D]``, ``prototypes``
    ``[S, C, D]``, ``home`` ``[C]``."""
    cosines = F.normalize(features, dim=2) @ F.normalize(prototypes, dim=2).transpose(1, 2)
    subspaces = features.shape[0]
    own = home.unsqueeze(0) == torch.arange(subspaces, device=home.device).unsqueeze(1)  # [S, C]
    other = alpha / (subspaces - 1) if subspaces > 1 else 0.0
    weights = torch.where(own, 1.0, other).to(cosines.dtype)
    return (cosines * weights.unsqueeze(1)).sum(0)


@register_method("ease_online")
class EaseOnline(MethodAdapter):
    paper_name: ClassVar[str] = "EASE"
    base_model_name: ClassVar[str] = "ease"
    #: The names PILOT's ``get_backbone`` builds for model ``ease`` (its ``_ease`` branch).
    backbone_types: ClassVar[tuple[str, ...]] = (
        "vit_base_patch16_224_ease",
        "vit_base_patch16_224_in21k_ease",
    )
    default_consolidation: ClassVar[str] = "new_classes"
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "ffn_num": ConfigKey(64, "adapter bottleneck width (PILOT: 64)", check=integer(minimum=1)),
        "adapter_num": ConfigKey(
            10,
            "most adapter subspaces the stream opens, built up front (one per consolidation "
            "firing; later firings change nothing)",
            check=integer(minimum=1),
        ),
        "alpha": ConfigKey(
            0.1, "weight of a class's other subspaces at prediction (PILOT: 0.1)", check=real(0)
        ),
        "adapter_dropout": ConfigKey(
            0.1, "dropout inside the adapters (PILOT hard-codes 0.1)", check=real(0, 1)
        ),
    }
    #: Two subspaces, no dropout (one step is a function of the state). The second subspace
    #: opens after 80 samples: in the contract's main.py runs (4 batches of 40) it then trains for
    #: two steps on both streams. Its adapters' up-projections start at zero (upstream's LoRA
    #: init), so the down-projections first get a gradient at its second step; with new_classes,
    #: the Si-Blurry run would open it before the last step only.
    smoke_overrides: ClassVar[Mapping[str, Any]] = {
        "adapter_num": 2,
        "adapter_dropout": 0.0,
        "consolidation": "every_n_samples",
        "consolidation_every_n_samples": 80,
    }

    def backbone_kwargs(self, args: dict) -> dict[str, Any]:
        # vit_ease loads its weights from timm.create_model(..., pretrained=True), hard-coded.
        return {"pretrained": bool(args["pretrained"]), **super().backbone_kwargs(args)}

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import EaseNet  # PILOT, imported lazily

        # Built on the CPU (PILOT moves its adapters to args["device"][0]); the loop moves it.
        pilot_args = self.pilot_args(args, use_init_ptm=False, beta=0.0, device=["cpu"])
        network = EaseNet(pilot_args, True)
        network.requires_grad_(False)
        backbone = network.backbone
        sets = []
        for _ in range(int(args["adapter_num"])):
            backbone.get_new_adapter()  # PILOT's adapter set: one AdaptFormer MLP per block
            sets.append(backbone.cur_adapter)
        backbone.cur_adapter = nn.ModuleList()  # the subspaces below replace PILOT's one set
        network.subspaces = nn.ModuleList(sets).requires_grad_(True)
        for adapter in network.subspaces.modules():
            if hasattr(adapter, "down_proj"):
                adapter.dropout = float(args["adapter_dropout"])  # a float attribute upstream
        classes, width = int(args["nb_classes"]), int(network.out_dim)
        network.class_means = nn.ModuleList(
            PrototypeBank(classes, width) for _ in range(int(args["adapter_num"]))
        )
        network.ease_active = 0
        # The method's log for report(), set here (the adapter is a dataclass without
        # __post_init__): the firing that opened each subspace after the first, and those ignored.
        self.opened_at: list[int] = []
        self.ignored_firings = 0
        self.online_head(network, args, in_features=width)
        return network

    # -- the forward passes -------------------------------------------------------------------
    @staticmethod
    def _tokens(backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Patch and class tokens with position embeddings: the input of every subspace's pass."""
        tokens = backbone.patch_embed(x)
        cls = backbone.cls_token.expand(tokens.shape[0], -1, -1)
        return backbone.pos_drop(torch.cat([cls, tokens], dim=1) + backbone.pos_embed)

    @staticmethod
    def _through(backbone: nn.Module, tokens: torch.Tensor, adapters: nn.ModuleList):
        """The normed class token of the ViT with one adapter set (upstream ``forward_proto``)."""
        for block, adapter in zip(backbone.blocks, adapters):
            tokens = block(tokens, adapter)
        return backbone.norm(tokens)[:, 0]

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        backbone, active = network.backbone, network.ease_active
        tokens = self._tokens(backbone, x)
        if train:
            features = self._through(backbone, tokens, network.subspaces[active])
            extras = {}
            if active:  # the frozen subspaces' features of this batch, for their class means
                with torch.no_grad():
                    extras["frozen"] = torch.stack(
                        [
                            self._through(backbone, tokens, network.subspaces[i])
                            for i in range(active)
                        ]
                    )
            return StepOutput(network.fc(features), features, extras=extras)
        subspaces = torch.stack(
            [self._through(backbone, tokens, network.subspaces[i]) for i in range(active + 1)]
        )
        logits = self.prototype_logits(network, subspaces)
        return StepOutput(logits, subspaces[active], extras={"subspaces": subspaces})

    def prototype_logits(self, network: nn.Module, subspaces: torch.Tensor) -> torch.Tensor:
        """EASE's prediction from the class means of the open subspaces (``subspaces``: their
        features ``[S, B, D]``). A class with no mean yet (never in the stream) scores the cosine
        with its head row instead: evaluation never allows such a class, but a network that has
        seen nothing still ranks classes by something."""
        count = subspaces.shape[0]
        banks = network.class_means[:count]
        means = torch.stack([bank.means for bank in banks])
        counts = torch.stack([bank.counts for bank in banks])
        # Bank s counts the samples since subspace s opened: those while s was active are its
        # count minus the next subspace's. The home subspace is where most of a class trained.
        trained = torch.cat([counts[:-1] - counts[1:], counts[-1:]])
        home = trained.argmax(0)
        prototypes = complemented_prototypes(means, counts, home)
        logits = reweighted_logits(subspaces, prototypes, home, float(self.args["alpha"]))
        head = F.normalize(subspaces[-1], dim=1) @ F.normalize(network.fc.weight, dim=1).t()
        return torch.where(counts.any(0), logits, head)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc

    def trainable_parameters(self, network: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """The head and every adapter set, frozen or not yet active: the loop's list is fixed at
        build. Only the active set gets gradients; Adam and FGH skip the others."""
        ours = {id(p) for p in (*network.fc.parameters(), *network.subspaces.parameters())}
        return ((n, p) for n, p in network.named_parameters() if id(p) in ours)

    def train_mode(self, network: nn.Module) -> None:
        network.train()
        for index, adapters in enumerate(network.subspaces):
            adapters.train(index == network.ease_active)  # frozen ones: features without dropout

    # -- learning without gradients: the class means ------------------------------------------
    @torch.no_grad()
    def observe(self, network: nn.Module, out: StepOutput, labels: torch.Tensor) -> None:
        active = network.ease_active
        network.class_means[active].update(out.features, labels, validate=False)
        for index in range(active):
            frozen = out.extras["frozen"][index, : len(labels)]
            network.class_means[index].update(frozen, labels, validate=False)

    # -- the task-boundary step ---------------------------------------------------------------
    def consolidate(self, network: nn.Module, firing: int) -> Iterable[nn.Parameter]:
        """Freeze the active adapter set and open the next with a restarted head (upstream's
        ``after_task`` and its new proxy head); returns both sets' and the head's parameters."""
        active = network.ease_active
        if active + 1 >= len(network.subspaces):
            self.ignored_firings += 1
            logger.info("EASE: firing %d at the cap of %d subspaces: ignored", firing, active + 1)
            return ()
        old, new = network.subspaces[active], network.subspaces[active + 1]
        old.requires_grad_(False)
        network.ease_active = active + 1
        self.opened_at.append(firing)
        self._restart_head(network.fc, firing)
        return [*old.parameters(), *new.parameters(), *network.fc.parameters()]

    @torch.no_grad()
    def _restart_head(self, head: nn.Linear, firing: int) -> None:
        """nn.Linear's initial distribution, U(-1/sqrt(D), 1/sqrt(D)), from a generator seeded
        by the run's seed and the firing: the same on every rerun, whatever else drew numbers."""
        seed = self.args.get("seed", 0)
        seed = int(seed[0] if isinstance(seed, (list, tuple)) else seed)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + firing)
        bound = 1 / math.sqrt(head.in_features)
        for param in (head.weight, head.bias):
            fresh = torch.empty(param.shape).uniform_(-bound, bound, generator=generator)
            param.copy_(fresh)

    # -- checkpoints and the report -------------------------------------------------------------
    def extra_state(self, network: nn.Module) -> dict[str, Any]:
        return {
            "active": network.ease_active,
            "opened_at": list(self.opened_at),
            "ignored_firings": self.ignored_firings,
        }

    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        network.ease_active = int(state["active"])
        for index, adapters in enumerate(network.subspaces):
            adapters.requires_grad_(index >= network.ease_active)
        self.opened_at = [int(f) for f in state["opened_at"]]
        self.ignored_firings = int(state["ignored_firings"])

    def report(self) -> dict[str, Any]:
        if not hasattr(self, "opened_at"):
            return {}
        return {
            "ease": {
                "subspaces": 1 + len(self.opened_at),
                "adapter_num": int(self.args.get("adapter_num", 0)),
                "opened_at_firings": list(self.opened_at),
                "ignored_firings": self.ignored_firings,
            }
        }

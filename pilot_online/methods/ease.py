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

- One adapter set is built with the network; each consolidation firing (before the step that
  would start upstream's next task) freezes the active set and adds a fresh one (PILOT's
  ``get_new_adapter``), which the loop then adopts: one subspace per firing, unbounded, as
  upstream opens one per task. The default trigger is ``new_classes``: upstream opens a subspace
  per set of new classes, and that trigger fires before the batch that brings a class beyond the
  last ``consolidation_new_classes`` new ones (in a clear stream with that many classes per task,
  at each task boundary).
- Every subspace keeps running class means (``PrototypeBank``, Eq. 1) of the stream batches'
  features through it: the active one from the training forward, the frozen ones from extra
  no-grad passes of the same batch (what upstream's ``replace_fc`` passes through old adapters).
  A class's own ("home") subspace is the one that was active for most of its samples. Means a
  subspace lacks are synthesised at prediction time from the others, as upstream's complement.
- The gradient-trained head is upstream's proxy head, an ``EaseCosineLinear`` with a learnable
  ``sigma`` (:class:`CosineHead`), over every class (the loop's batch mask limits its loss to the
  batch's classes), on the active subspace's features, restarted at each firing. It is
  :meth:`classifier` (P replays the loop's prototypes through it, FGH reweights its rows), so
  all four rows run; predictions come from the prototype classifier, so P and FGH reach them only
  through the adapters they help train.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

from ..core.checks import integer, real
from ..core.lazy import F, nn, no_grad, torch
from ..engine.adapter import (
    ConfigKey,
    Consolidated,
    Consolidation,
    MethodAdapter,
    StepOutput,
    TrainedStep,
)
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.registry import register_method

if TYPE_CHECKING:
    from ..core.cosine_head import CosineHead


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


CARD = MethodCard(
    backbone_types=("vit_base_patch16_224_ease", "vit_base_patch16_224_in21k_ease"),
    paper_name="EASE",
    # Each firing adds an adapter, which every forward runs (the FLOP model counts it).
    grows=True,
    # No dropout (one step is a function of the state). The second subspace opens after 80
    # samples: in the contract's main.py runs (4 batches of 40) it then trains for two steps on
    # both streams. Its adapters' up-projections start at zero (upstream's LoRA init), so the
    # down-projections first get a gradient at its second step; with new_classes, the Si-Blurry
    # run would open it before the last step only.
    smoke_overrides={
        "adapter_dropout": 0.0,
        "consolidation": "every_n_samples",
        "consolidation_every_n_samples": 80,
    },
    upstream_differences=(
        UpstreamDifference(
            "proxy_head_over_every_class",
            "The proxy head covers every class of the stream, its loss limited to the batch's "
            "classes by the loop's mask; upstream builds one over the current task's classes.",
            "A task-free stream has no current task: the batch's classes stand in for it.",
        ),
        UpstreamDifference(
            "running_class_means",
            "Class means are running means of the stream batches' training-transform features "
            "(the active subspace's from the training forward, adapter dropout on), where "
            "upstream takes them once after the task in eval mode with test transforms.",
            "Online, each sample is seen once: its features must be folded in when it arrives.",
        ),
        UpstreamDifference(
            "home_subspace_by_majority",
            "A class's own subspace is the one active for most of its samples, and a missing "
            "mean is mixed from the classes with a mean both there and in that subspace.",
            "Without task ids a class may span firings (Si-Blurry), so its subspace is counted.",
        ),
        UpstreamDifference(
            "unseen_classes_score_with_the_proxy_head",
            "A class with no mean in any subspace scores the cosine of the newest subspace's "
            "feature with its proxy-head row, where upstream's head has no row for it.",
            "The online heads cover every class of the stream from the start; evaluation never "
            "allows such a class, and a network that has seen nothing still ranks classes.",
        ),
        UpstreamDifference(
            "seeded_new_subspace",
            "A new adapter set and the restarted proxy head are drawn from generators seeded by "
            "the run's seed and the firing, not from the global random stream.",
            "A resumed run rebuilds the same sets, and evaluation timing cannot change the draws.",
        ),
    ),
    removed_keys={
        "adapter_num": "EASE adds one adapter subspace per consolidation firing, without a cap "
        "(upstream: one per task)"
    },
)


@register_method("ease_online", card=CARD)
class EaseOnline(MethodAdapter):
    base_model_name: ClassVar[str] = "ease"
    consolidation: ClassVar[Consolidation] = Consolidation(trigger="new_classes")
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "ffn_num": ConfigKey(64, "adapter bottleneck width (PILOT: 64)", check=integer(minimum=1)),
        "alpha": ConfigKey(
            0.1, "weight of a class's other subspaces at prediction (PILOT: 0.1)", check=real(0)
        ),
        "adapter_dropout": ConfigKey(
            0.1, "dropout inside the adapters (PILOT hard-codes 0.1)", check=real(0, 1)
        ),
    }

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import EaseNet  # PILOT, imported lazily

        from ..core.cosine_head import attach_cosine_head

        # Built on the CPU (PILOT moves its adapters to args["device"][0]); the loop moves it.
        pilot_args = self.pilot_args(args, use_init_ptm=False, beta=0.0, device=["cpu"])
        network = EaseNet(pilot_args, True)
        network.requires_grad_(False)
        network.subspaces = nn.ModuleList()
        network.class_means = nn.ModuleList()
        self._open_subspace(network, firing=None)
        attach_cosine_head(network, int(network.out_dim), int(args["nb_classes"]))
        # The method's log for report(), set here (the adapter is a dataclass without
        # __post_init__): the firing that opened each subspace after the first.
        self.opened_at: list[int] = []
        return network

    def _open_subspace(self, network: nn.Module, firing: int | None) -> None:
        """Add a fresh adapter set (PILOT's ``get_new_adapter``) and its class-mean bank, on the
        network's device, trainable. After the first (``firing`` None: PILOT's own draw at build),
        the set is drawn under a forked RNG seeded by the run's seed and the firing."""
        from ..core.prototypes import PrototypeBank

        backbone = network.backbone
        if firing is None:
            adapters = backbone.cur_adapter  # the set PILOT built with the backbone
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.run_seed() * 1_000_003 + 7919 * (firing + 1))
                backbone.get_new_adapter()
            adapters = backbone.cur_adapter
        backbone.cur_adapter = nn.ModuleList()  # the subspaces replace PILOT's current set
        for adapter in adapters.modules():
            if hasattr(adapter, "down_proj"):
                adapter.dropout = float(self.args["adapter_dropout"])  # a float upstream
        device = network.backbone.cls_token.device
        network.subspaces.append(adapters.to(device).requires_grad_(True))
        width = int(network.out_dim)
        network.class_means.append(
            PrototypeBank(int(self.args["nb_classes"]), width, device=device)
        )

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
        backbone, active = network.backbone, len(network.subspaces) - 1
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
            [self._through(backbone, tokens, adapters) for adapters in network.subspaces]
        )
        logits = self.prototype_logits(network, subspaces)
        return StepOutput(logits, subspaces[active], extras={"subspaces": subspaces})

    def prototype_logits(self, network: nn.Module, subspaces: torch.Tensor) -> torch.Tensor:
        """EASE's prediction from the class means of the open subspaces (``subspaces``: their
        features ``[S, B, D]``). A class with no mean yet (never in the stream) scores the cosine
        with its head row instead: evaluation never allows such a class, but a network that has
        seen nothing still ranks classes by something."""
        banks = network.class_means[: subspaces.shape[0]]
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

    def classifier(self, network: nn.Module) -> CosineHead:
        return network.fc

    def set_mode(self, network: nn.Module, train: bool) -> None:
        network.train(train)
        if train:
            for adapters in network.subspaces[:-1]:
                adapters.eval()  # frozen ones: features without dropout

    # -- learning without gradients: the class means ------------------------------------------
    @no_grad
    def after_step(self, network: nn.Module, step: TrainedStep) -> tuple[nn.Parameter, ...]:
        if step.stream is None:  # an extra step of online_iter: the batch is observed once
            return ()
        out, labels = step.stream, step.stream_labels
        active = len(network.subspaces) - 1
        network.class_means[active].update(out.features, labels, validate=False)
        for index in range(active):
            frozen = out.extras["frozen"][index, : len(labels)]
            network.class_means[index].update(frozen, labels, validate=False)
        return ()

    # -- the task-boundary step ---------------------------------------------------------------
    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Freeze the active adapter set and add the next with a restarted head (upstream's
        ``after_task`` and its new proxy head); the loop adopts the new set. Returns the frozen
        set's and the head's parameters, whose optimiser state is dropped."""
        old = network.subspaces[-1]
        old.requires_grad_(False)
        self._open_subspace(network, firing)
        self.opened_at.append(firing)
        generator = torch.Generator().manual_seed(self.run_seed() * 1_000_003 + firing)
        network.fc.reset_parameters(generator)
        return Consolidated(restarted=[*old.parameters(), network.fc.weight, network.fc_sigma])

    # -- checkpoints and the report -------------------------------------------------------------
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        return {"opened_at": list(self.opened_at)}

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        """Rebuild the subspaces the firings added (their values load afterwards)."""
        self.opened_at = [int(f) for f in state["opened_at"]]
        for firing in self.opened_at[len(network.subspaces) - 1 :]:
            network.subspaces[-1].requires_grad_(False)
            self._open_subspace(network, firing)

    def report(self) -> dict[str, Any]:
        if not hasattr(self, "opened_at"):
            return {}
        return {
            "ease": {
                "subspaces": 1 + len(self.opened_at),
                "opened_at_firings": list(self.opened_at),
            }
        }

"""RanPAC online (``ranpac_online``), and :class:`FirstSessionAnalyticOnline`, the shape it shares
with FeCAM (``fecam.py``): tune a PETL module in a first session, freeze, then classify with an
analytic head built from statistics of the features.

Upstream (PILOT's ``models/ranpac.py``, ``exps/ranpac.json``): on the first task the ViT
(``SimpleVitNet``) and a ``CosineLinear`` head (learnable ``sigma``) train for ``tuned_epoch``
epochs, with every parameter in the optimiser (the adapter and VPT backbones freeze all but their
PETL module when built; the SSF and plain ViTs train whole); at its end the backbone is frozen for
good and a random projection ``W_rand`` (d x M, Gaussian) is drawn. At the end of every task, the
task's features ``h = relu(f W_rand)`` (one pass in eval mode, test transforms) are added to the
Gram matrix ``G = sum h h'`` and the cross matrix ``Q = sum h y'`` (one-hot ``y``); the ridge
``lambda`` is chosen from ``10^-8 .. 10^8`` by fitting on the first 80% of the task's features and
scoring the squared error on the other 20%, and the head is ``W = (G + lambda I)^-1 Q``, used in
the ``CosineLinear`` (``sigma`` times the cosine between ``h`` and each row of ``W'``), which is
what upstream evaluates from its first task on.

Online, task-free (docs/methods.md, "RanPAC"):

- The first session ends at the consolidation trigger's first firing (default ``new_classes``):
  until then the backbone's PETL module (the adapter or the VPT prompts; the whole SSF or plain
  ViT) and upstream's cosine head train by gradient; at the firing they are frozen and ``trains``
  turns False.
- The statistics accumulate in :meth:`after_step` from every stream batch, from the first step on,
  from features of an eval-mode pass (no dropout, as upstream's ``replace_fc``): during the first
  session a no-grad pass beside the training one, afterwards the (eval-mode) training pass
  itself. The first session's samples are gone by its end, so its classes would otherwise have
  no statistics; those early features come from a backbone still training (a deviation).
- Every ``ridge_holdout_every``-th stream sample (by stream position, so batch sizes change
  nothing) goes to held-out statistics ``G_ho``, ``Q_ho``, ``n_ho`` instead of the fitting ones:
  the held-out squared error of a ridge fit is then ``n_ho - 2 tr(W' Q_ho) + tr(W' G_ho W)``
  (``tr(Y'Y) = n_ho`` for one-hot labels), from statistics alone. The head is solved on the sum
  of both, as upstream solves on the whole task.
- Evaluation always predicts with the analytic head, solved from the current statistics by
  :meth:`~FirstSessionAnalyticOnline.evaluation` (the loop caches it until the next step),
  also before the first firing: upstream evaluates its analytic head after its first task.
  Training logits after the first session come from the head solved at the latest firing
  (upstream's per-task ``replace_fc``), kept in the network's ``analytic_*`` buffers; evaluating
  never changes what training computes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ..core.checks import boolean, integer
from ..core.lazy import F, nn, no_grad, torch
from ..engine.adapter import (
    ConfigKey,
    Consolidated,
    Consolidation,
    Evaluation,
    StepOutput,
    TrainedStep,
)
from ..engine.backbone_names import PLAIN_VIT, pilot_backbones
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.differences import FIRST_SESSION_DIFFERENCES
from ..engine.registry import register_method
from .aper_adapter import AperAdapterOnline
from .aper_vpt import AperVPTOnline
from .finetune import FinetuneOnline

#: What trains in the first session, by the backbone name's PETL marker: upstream's adapter and
#: VPT backbones freeze all but their PETL module when built (the APER ports' rules); the SSF and
#: plain ViTs freeze nothing, and upstream's optimiser takes every parameter, so they train whole.
TUNED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "_adapter": AperAdapterOnline.tuned_parameters,
    "_vpt": AperVPTOnline.tuned_parameters,
}

#: The ridge values upstream searches (``optimise_ridge_parameter``): 10^-8 .. 10^8.
RIDGES: tuple[float, ...] = tuple(10.0**k for k in range(-8, 9))

#: Named tensors: a method's statistics, or a solved head.
Tensors = dict[str, "torch.Tensor"]

#: The logit offset of a class without statistics: below any logit of a class with some
#: (RanPAC's sigma x cosines, FeCAM's minus distances). Evaluation never allows such a class; the
#: first session's head ranks them among themselves, so a network that has seen nothing still
#: ranks classes by something (as EASE's unseen classes score with its proxy head).
UNSEEN_LOGIT = -1e4

#: The card facts :class:`FirstSessionAnalyticOnline`'s methods share (RanPAC's and FeCAM's cards
#: start from it).
FIRST_SESSION_CARD = MethodCard(
    variants=("base",),  # analytic heads: no gradient for P or FGH
    backbone_types=(
        *pilot_backbones("aper_adapter"),
        *pilot_backbones("aper_ssf"),
        *pilot_backbones("aper_vpt"),
        *PLAIN_VIT,
    ),
    #: Its cost changes at the first firing (the first session's tuning stops: no backward
    #: after it); the FLOP model counts the network after each firing as for a growing one.
    grows=True,
    #: Smoke stream: 4-class tasks, so the first session ends before the second task's first batch.
    smoke_overrides={
        "adapter_dropout": 0.0,
        "consolidation_new_classes": 4,
    },
)


def _first_session_ends(cfg: Mapping[str, Any]) -> None:
    """The analytic head takes no gradient step, and a tuned first session must end for it to be
    used: P and FGH are refused, and so is the trigger ``never`` with a first session."""
    if cfg.get("online_prototypes") or cfg.get("fgh") is not None:
        raise ValueError(
            "the analytic head takes no gradient step, so P's loss and FGH have nothing to "
            'act on: set "online_prototypes": false and "fgh": null'
        )
    if cfg.get("tune_first_session", True) and cfg.get("consolidation") == "never":
        raise ValueError(
            'consolidation "never" would never end the first session, so the analytic head '
            "would never be used: name a trigger, or set tune_first_session false"
        )


class FirstSessionAnalyticOnline(FinetuneOnline):
    """First-session PETL tuning until the trigger's first firing, then an analytic head from
    feature statistics accumulated in :meth:`after_step`. Subclasses define the statistics
    (:meth:`new_statistics`, :meth:`accumulate`), the head's buffers (:meth:`new_head`), its
    solve from the statistics (:meth:`solve`) and its logits (:meth:`head_logits`)."""

    consolidation: ClassVar[Consolidation] = Consolidation(trigger="new_classes")
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "tune_first_session": ConfigKey(
            True,
            "train the PETL module and a cosine head until the trigger's first firing (upstream: "
            "tuned_epoch epochs on the first task); false: the backbone stays as built",
            check=boolean,
            cross_check=_first_session_ends,
        ),
        **AperAdapterOnline.config_keys,
        "vpt_type": ConfigKey(
            "shallow",
            "VPT prompts (PILOT's ranpac/fecam configs: shallow)",
            choices=AperVPTOnline.config_keys["vpt_type"].choices,
        ),
        "prompt_token_num": ConfigKey(5, "VPT prompt tokens per layer", check=integer(1)),
    }

    #: The network buffers that hold the analytic head (:meth:`new_head`'s names).
    head_names: ClassVar[tuple[str, ...]] = ()

    # -- the network -----------------------------------------------------------------------------
    # The method's state; ``attach`` sets it per instance.
    first_session_done: bool = False
    samples: int = 0  # stream samples observed

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import SimpleVitNet

        from ..core.cosine_head import attach_cosine_head

        network = SimpleVitNet(self.pilot_args(args), True)
        # The first session's head: upstream's CosineLinear with its learnable sigma.
        attach_cosine_head(network, int(network.feature_dim), int(args["nb_classes"]))
        return self.attach(network, args)

    def attach(self, network: nn.Module, args: Mapping[str, Any]) -> nn.Module:
        """Set what trains in the first session, the analytic head's buffers and the method's
        state on a built ``network`` (a ``backbone``, a cosine ``fc`` with ``fc_sigma`` and a
        ``feature_dim``: tests pass a stand-in)."""
        network.requires_grad_(False)
        tune = bool(args["tune_first_session"])
        if tune:
            markers = next(
                (v for k, v in TUNED_PARAMETERS.items() if k in args["backbone_type"]), ()
            )
            for name, param in network.backbone.named_parameters():
                param.requires_grad_(not markers or any(m in name for m in markers))
            network.fc.requires_grad_(True)
            network.fc_sigma.requires_grad_(True)
        for block in getattr(network.backbone, "blocks", ()):
            if hasattr(block, "adaptmlp"):
                block.adaptmlp.dropout = float(args["adapter_dropout"])
        # The method's state, set here (the adapter is a dataclass without __post_init__).
        self.trains = tune
        self.first_session_done = not tune
        self.samples = 0
        self.stats: Tensors = self.new_statistics(network, args)
        for name, zeros in self.new_head(network, args).items():
            network.register_buffer(name, zeros)  # training's head, solved at each firing
        return network

    def head(self, network: nn.Module) -> Tensors:
        """The analytic head the network holds (training's, or evaluation's while the loop's
        view is swapped in)."""
        return {name: getattr(network, name) for name in self.head_names}

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        if train and not self.first_session_done:
            features = network.backbone(x)
            # The statistics' features: an eval-mode pass, as upstream's replace_fc (no dropout).
            training = network.backbone.training
            network.backbone.eval()
            with torch.no_grad():
                observed = network.backbone(x)
            network.backbone.train(training)
            return StepOutput(network.fc(features), features, extras={"observed": observed})
        with torch.no_grad():
            features = network.backbone(x)
            return StepOutput(self.head_logits(network, features), features)

    def set_mode(self, network: nn.Module, train: bool) -> None:
        # After the first session the network is a fixed extractor: eval mode in training too.
        network.train(train and not self.first_session_done)

    # -- learning --------------------------------------------------------------------------------
    @no_grad
    def after_step(self, network: nn.Module, step: TrainedStep) -> tuple[nn.Parameter, ...]:
        if step.stream is None:  # an extra step of online_iter: the batch is observed once
            return ()
        out, labels = step.stream, step.stream_labels
        features = out.extras.get("observed", out.features)[: len(labels)].detach()
        self.stats = {k: v.to(features.device) for k, v in self.stats.items()}
        self.accumulate(network, features, labels, self.samples)
        self.samples += len(labels)
        return ()

    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """The first firing ends the first session (upstream's first task boundary): the backbone
        and the first session's head freeze. Every firing re-solves the training head
        (upstream's ``replace_fc`` at each task's end); without a first session
        (``tune_first_session`` false) that is all a firing does."""
        if not self.first_session_done:
            network.requires_grad_(False)
            self.first_session_done = True
            self.trains = False
        for name, value in self.firing_head().items():
            getattr(network, name).copy_(value)
        return Consolidated()

    def firing_head(self) -> Tensors:
        """The head a firing solves for training (:meth:`solve`; RanPAC also keeps its ridge)."""
        return self.solve()

    def evaluation(self, network: nn.Module) -> Evaluation:
        """A view: the analytic head solved from the current statistics, in the buffers' shapes,
        dtypes and device: what evaluation predicts with at every evaluation (upstream evaluates its
        analytic head from its first task on)."""
        held = self.head(network)
        solved = self.solve()
        return Evaluation(
            view={name: solved[name].to(held[name].device, held[name].dtype) for name in held}
        )

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "first_session_done": self.first_session_done,
            "stats": dict(self.stats),
        }

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        device = next(network.parameters()).device
        self.samples = int(state["samples"])
        self.first_session_done = bool(state["first_session_done"])
        self.stats = {k: v.to(device) for k, v in state["stats"].items()}
        if self.first_session_done:
            network.requires_grad_(False)
            self.trains = False

    # -- to override -----------------------------------------------------------------------------
    def new_statistics(self, network: nn.Module, args: Mapping[str, Any]) -> Tensors:
        """Zeroed statistics (float64 sums: they add up a whole stream)."""
        raise NotImplementedError

    def new_head(self, network: nn.Module, args: Mapping[str, Any]) -> Tensors:
        """The analytic head's buffers, zeroed, by name (``analytic_*``)."""
        raise NotImplementedError

    def accumulate(
        self, network: nn.Module, features: torch.Tensor, labels: torch.Tensor, position: int
    ) -> None:
        """Fold one stream batch (``position``: the stream index of its first sample) in."""
        raise NotImplementedError

    def solve(self) -> Tensors:
        """The analytic head from the current statistics: :meth:`new_head`'s names."""
        raise NotImplementedError

    def head_logits(self, network: nn.Module, features: torch.Tensor) -> torch.Tensor:
        """Logits over all classes from backbone features, with the head in :meth:`head`; the
        classes without statistics (``analytic_seen`` false) score :meth:`unseen_logits`."""
        raise NotImplementedError

    def unseen_logits(self, network: nn.Module, features: torch.Tensor) -> torch.Tensor:
        """``UNSEEN_LOGIT`` plus the first session's head: the logits of classes without
        statistics."""
        return UNSEEN_LOGIT + network.fc(features)


def select_ridge(
    gram_fit: torch.Tensor,
    cross_fit: torch.Tensor,
    gram_ho: torch.Tensor,
    cross_ho: torch.Tensor,
    n_ho: float,
    ridges: tuple[float, ...] = RIDGES,
) -> tuple[float, list[float]]:
    """The ridge with the least held-out squared error, and every ridge's error.

    ``W(l) = (G_fit + l I)^-1 Q_fit``; its squared error on the held-out samples is
    ``||Y - H W||^2 = n_ho - 2 tr(W' Q_ho) + tr(W' G_ho W)``. Without held-out samples every
    error is 0 and the grid's middle (1) is taken. Ties go to the smaller ridge (upstream's
    ``argmin``); upstream's mean over ``n * C`` entries changes no argmin.
    """
    if n_ho <= 0:
        return 1.0, [0.0] * len(ridges)
    eye = torch.eye(gram_fit.shape[0], dtype=gram_fit.dtype, device=gram_fit.device)
    errors = []
    for ridge in ridges:
        w = torch.linalg.solve(gram_fit + ridge * eye, cross_fit)
        errors.append(float(n_ho - 2 * (w * cross_ho).sum() + (w * (gram_ho @ w)).sum()))
    best = min(range(len(ridges)), key=errors.__getitem__)
    return ridges[best], errors


def ranpac_state_bytes(args: Mapping[str, Any]) -> int:
    """Two M x M Grams and two M x C cross matrices (float64), two C x M heads (float32:
    training's buffer and evaluation's view)."""
    m, c = int(args["M"]), int(args["nb_classes"])
    return 2 * m * m * 8 + 2 * m * c * 8 + 2 * c * m * 4


CARD = dataclasses.replace(
    FIRST_SESSION_CARD,
    paper_name="RanPAC",
    smoke_overrides={**FIRST_SESSION_CARD.smoke_overrides, "M": 256},
    upstream_differences=(
        *FIRST_SESSION_DIFFERENCES,
        UpstreamDifference(
            "ridge_from_held_out_statistics",
            "The ridge is chosen on every ridge_holdout_every-th sample of the whole stream so "
            "far (held-out Gram and cross statistics), where upstream holds out the last 20% of "
            "the current task's features.",
            "The features are not kept, so the held-out error must come from statistics.",
        ),
        UpstreamDifference(
            "w_rand_drawn_at_build",
            "W_rand is drawn when the network is built (a checkpointed buffer), where upstream "
            "draws it at the first task boundary.",
            "Statistics accumulate from the first step, which needs the projection; its "
            "distribution does not depend on when it is drawn.",
        ),
    ),
    state_bytes=ranpac_state_bytes,
)


@register_method("ranpac_online", card=CARD)
class RanPACOnline(FirstSessionAnalyticOnline):
    base_model_name: ClassVar[str] = "ranpac"
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        **FirstSessionAnalyticOnline.config_keys,
        "M": ConfigKey(10000, "random-projection width (PILOT: 10000)", check=integer(1)),
        "ridge_holdout_every": ConfigKey(
            5,
            "every k-th stream sample is held out to choose the ridge (5: upstream's 20%)",
            check=integer(2),
        ),
    }
    head_names: ClassVar[tuple[str, ...]] = ("analytic_weight", "analytic_seen")

    def attach(self, network: nn.Module, args: Mapping[str, Any]) -> nn.Module:
        if "W_rand" in vars(network):
            del network.W_rand  # PILOT's plain attribute; a buffer here, so checkpoints keep it
        # Upstream draws it at the first boundary; its distribution does not depend on when.
        network.register_buffer("W_rand", torch.randn(network.feature_dim, int(args["M"])))
        network.RP_dim = int(args["M"])
        self.holdout_every = int(args["ridge_holdout_every"])
        self.ridge: float | None = None  # chosen at the latest firing
        return super().attach(network, args)

    def new_statistics(self, network: nn.Module, args: Mapping[str, Any]) -> Tensors:
        m, c = int(args["M"]), int(args["nb_classes"])
        zeros = torch.zeros
        return {
            "gram": zeros(m, m, dtype=torch.float64),  # every sample, held out or not
            "cross": zeros(m, c, dtype=torch.float64),
            "gram_ho": zeros(m, m, dtype=torch.float64),  # the held-out samples alone
            "cross_ho": zeros(m, c, dtype=torch.float64),
            "n_ho": zeros((), dtype=torch.float64),
        }

    def new_head(self, network: nn.Module, args: Mapping[str, Any]) -> Tensors:
        classes = int(args["nb_classes"])
        return {
            "analytic_weight": torch.zeros(classes, int(args["M"])),
            "analytic_seen": torch.zeros(classes, dtype=torch.bool),
        }

    def project(self, network: nn.Module, features: torch.Tensor) -> torch.Tensor:
        return F.relu(features @ network.W_rand)

    def accumulate(self, network, features, labels, position) -> None:
        h = self.project(network, features).double()
        y = F.one_hot(labels.long(), self.stats["cross"].shape[1]).double()
        positions = torch.arange(position, position + len(labels), device=h.device)
        held = (positions % self.holdout_every == self.holdout_every - 1).double()[:, None]
        self.stats["gram"] += h.T @ h
        self.stats["cross"] += h.T @ y
        self.stats["gram_ho"] += (h * held).T @ h
        self.stats["cross_ho"] += (h * held).T @ y
        self.stats["n_ho"] += held.sum()

    def select(self) -> float:
        """The ridge the current statistics choose (:func:`select_ridge`)."""
        s = self.stats
        ridge, _ = select_ridge(
            s["gram"] - s["gram_ho"],
            s["cross"] - s["cross_ho"],
            s["gram_ho"],
            s["cross_ho"],
            float(s["n_ho"]),
        )
        return ridge

    def solve(self, ridge: float | None = None) -> Tensors:
        """Upstream's ``W = (G + lambda I)^-1 Q``, transposed; ``ridge`` None: :meth:`select`'s."""
        s = self.stats
        ridge = self.select() if ridge is None else ridge
        eye = torch.eye(s["gram"].shape[0], dtype=s["gram"].dtype, device=s["gram"].device)
        weight = torch.linalg.solve(s["gram"] + ridge * eye, s["cross"]).T
        # h >= 0 and a sample's h is never all zero: a class has samples iff its column does.
        return {"analytic_weight": weight.float(), "analytic_seen": s["cross"].sum(0) > 0}

    def firing_head(self) -> Tensors:
        self.ridge = self.select()
        return self.solve(self.ridge)

    def head_logits(self, network, features) -> torch.Tensor:
        """Upstream's ``CosineLinear`` on the projection: ``sigma`` (the first session's, which
        upstream carries over) times the cosines."""
        h = F.normalize(self.project(network, features), dim=1)
        weight = F.normalize(network.analytic_weight, dim=1)
        logits = network.fc_sigma * F.linear(h, weight)
        seen = network.analytic_seen[None]
        return torch.where(seen, logits, self.unseen_logits(network, features))

    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        return {**super().state_dict(network), "ridge": self.ridge}

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        super().load_state_dict(network, state)
        self.ridge = None if state["ridge"] is None else float(state["ridge"])

    def report(self) -> dict[str, Any]:
        return {"ridge": self.ridge, "first_session_done": self.first_session_done}

"""RanPAC online (``ranpac_online``), and :class:`FirstSessionAnalyticOnline`, the shape it shares
with FeCAM (``fecam.py``): tune a PETL module in a first session, freeze, then classify with an
analytic head built from statistics of the features.

Upstream (PILOT's ``models/ranpac.py``, ``exps/ranpac.json``): on the first task the adapter ViT
(``SimpleVitNet``) and a cosine head train for ``tuned_epoch`` epochs; at its end the backbone is
frozen for good and a random projection ``W_rand`` (d x M, Gaussian) is drawn. At the end of
every task, the task's features ``h = relu(f W_rand)`` (one pass, test transforms) are added to
the Gram matrix ``G = sum h h'`` and the cross matrix ``Q = sum h y'`` (one-hot ``y``); the ridge
``lambda`` is chosen from ``10^-8 .. 10^8`` by fitting on the first 80% of the task's features and
scoring the squared error on the other 20%, and the head is ``W = (G + lambda I)^-1 Q``, used as a
``CosineLinear`` (the cosine between ``h`` and each row of ``W'``).

Online, task-free (docs/methods.md, "RanPAC"):

- The first session ends at the consolidation trigger's first firing (default ``new_classes``):
  until then the backbone's PETL module (the adapter by default) and an ``nn.Linear`` head train
  by gradient; at the firing they are frozen and ``trains`` turns False.
- The statistics accumulate in :meth:`observe` from every stream batch, from the first step on:
  the first session's samples are gone by its end, so its classes would otherwise have no
  statistics. Those early features come from a backbone still training (a deviation).
- Every ``ridge_holdout_every``-th stream sample (by stream position, so batch sizes change
  nothing) goes to held-out statistics ``G_ho``, ``Q_ho``, ``n_ho`` instead of the fitting ones:
  the held-out squared error of a ridge fit is then ``n_ho - 2 tr(W' Q_ho) + tr(W' G_ho W)``
  (``tr(Y'Y) = n_ho`` for one-hot labels), from statistics alone. The head is solved on the sum
  of both, as upstream solves on the whole task.
- Until the first session ends, the network predicts with its first-session head (as upstream
  evaluates during its first task). After it, evaluation solves the head from the current
  statistics (cached until they change), while training logits come from the head solved at the
  latest firing (upstream's per-task ``replace_fc``): evaluating never changes what training
  computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checks import boolean, integer
from ..engine.adapter import ConfigKey, StepOutput
from ..engine.backbone_names import PLAIN_VIT, pilot_backbones
from ..engine.registry import register_method
from .aper_adapter import AperAdapterOnline
from .aper_ssf import AperSSFOnline
from .aper_vpt import VPT_TYPES, AperVPTOnline
from .finetune import FinetuneOnline

#: What trains in the first session, by the backbone name's PETL marker (the APER ports' rules,
#: as upstream's ``get_backbone`` builds the same backbones for RanPAC and FeCAM); a plain ViT
#: trains whole (upstream's optimiser takes every parameter).
TUNED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "_adapter": AperAdapterOnline.tuned_parameters,
    "_ssf": AperSSFOnline.tuned_parameters,
    "_vpt": AperVPTOnline.tuned_parameters,
}

#: The ridge values upstream searches (``optimise_ridge_parameter``): 10^-8 .. 10^8.
RIDGES: tuple[float, ...] = tuple(10.0**k for k in range(-8, 9))

#: Named tensors: a method's statistics, or a solved head.
Tensors = dict[str, torch.Tensor]


class FirstSessionAnalyticOnline(FinetuneOnline):
    """First-session PETL tuning until the trigger's first firing, then an analytic head from
    feature statistics accumulated in :meth:`observe`. Subclasses define the statistics
    (:meth:`new_statistics`, :meth:`accumulate`), the head (:meth:`solve`) and its logits
    (:meth:`head_logits`)."""

    paper_name: ClassVar[str] = ""
    backbone_types: ClassVar[tuple[str, ...]] = (
        *pilot_backbones("aper_adapter"),
        *pilot_backbones("aper_ssf"),
        *pilot_backbones("aper_vpt"),
        *PLAIN_VIT,
    )
    variants: ClassVar[tuple[str, ...]] = ("base",)  # analytic heads: no gradient for P or FGH
    default_consolidation: ClassVar[str] = "new_classes"
    #: Smoke stream: 4-class tasks, so the first session ends before the second task's first batch.
    smoke_overrides: ClassVar[Mapping[str, Any]] = {
        "adapter_dropout": 0.0,
        "consolidation_new_classes": 4,
    }
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "tune_first_session": ConfigKey(
            True,
            "train the PETL module and a linear head until the trigger's first firing (upstream: "
            "tuned_epoch epochs on the first task); false: the backbone stays as built",
            check=boolean,
        ),
        **AperAdapterOnline.config_keys,
        "vpt_type": ConfigKey(
            "shallow", "VPT prompts (PILOT's ranpac/fecam configs: shallow)", choices=VPT_TYPES
        ),
        "prompt_token_num": ConfigKey(5, "VPT prompt tokens per layer", check=integer(1)),
    }

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any]) -> None:
        if cfg.get("online_prototypes") or cfg.get("fgh") is not None:
            raise ValueError(
                "the analytic head takes no gradient step, so P's loss and FGH have nothing to "
                'act on: set "online_prototypes": false and "fgh": null'
            )
        tune, trigger = cfg.get("tune_first_session", True), cfg.get("consolidation")
        if tune and trigger == "never":
            raise ValueError(
                'consolidation "never" would never end the first session, so the analytic head '
                "would never be used: name a trigger, or set tune_first_session false"
            )

    # -- the network -----------------------------------------------------------------------------
    # The method's state; ``attach`` sets it per instance (these defaults serve an adapter that
    # only runs forward passes on another's network, as some tests do).
    first_session_done: bool = False
    samples: int = 0  # stream samples observed
    train_head: Tensors | None = None  # solved at the latest firing
    _eval_head: tuple[int, Tensors] | None = None  # (samples, head) of evaluation's solve

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import SimpleVitNet

        network = SimpleVitNet(self.pilot_args(args), True)
        self.online_head(network, args)  # the first session's head (upstream: a CosineLinear)
        return self.attach(network, args)

    def attach(self, network: nn.Module, args: Mapping[str, Any]) -> nn.Module:
        """Set what trains in the first session and the method's state on a built ``network``
        (a ``backbone``, a linear ``fc`` and ``feature_dim``: tests pass a stand-in)."""
        network.requires_grad_(False)
        tune = bool(args["tune_first_session"])
        if tune:
            markers = next(
                (v for k, v in TUNED_PARAMETERS.items() if k in args["backbone_type"]), ()
            )
            for name, param in network.backbone.named_parameters():
                param.requires_grad_(not markers or any(m in name for m in markers))
            network.fc.requires_grad_(True)
        for block in getattr(network.backbone, "blocks", ()):
            if hasattr(block, "adaptmlp"):
                block.adaptmlp.dropout = float(args["adapter_dropout"])
        # The method's state, set here (the adapter is a dataclass without __post_init__).
        self.trains = tune
        self.first_session_done = not tune
        self.samples = 0
        self.stats: Tensors = self.new_statistics(network, args)
        self.train_head = None
        self._eval_head = None
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        if not self.first_session_done:  # upstream evaluates its first session so, too
            features = network.backbone(x)
            return StepOutput(network.fc(features), features)
        with torch.no_grad():
            features = network.backbone(x)
            head = self.train_head if train else self.eval_head()
            return StepOutput(self.head_logits(network, features, head), features)

    def train_mode(self, network: nn.Module) -> None:
        network.train(not self.first_session_done)  # frozen afterwards: a fixed extractor

    # -- learning --------------------------------------------------------------------------------
    @torch.no_grad()
    def observe(self, network: nn.Module, out: StepOutput, labels: torch.Tensor) -> None:
        features = out.features.detach()
        self.stats = {k: v.to(features.device) for k, v in self.stats.items()}
        self.accumulate(network, features, labels, self.samples)
        self.samples += len(labels)

    def consolidate(self, network: nn.Module, firing: int) -> tuple[nn.Parameter, ...]:
        """The first firing ends the first session (upstream's first task boundary): the backbone
        and the first session's head freeze. Every firing re-solves the training head
        (upstream's ``replace_fc`` at each task's end); without a first session
        (``tune_first_session`` false) that is all a firing does."""
        if not self.first_session_done:
            network.requires_grad_(False)
            self.first_session_done = True
            self.trains = False
        self.train_head = self.solve()
        return ()

    def eval_head(self) -> Tensors:
        """The head solved from the current statistics; cached until they change. Training never
        reads it (see the module docstring)."""
        if self._eval_head is None or self._eval_head[0] != self.samples:
            self._eval_head = (self.samples, self.solve())
        return self._eval_head[1]

    # -- state -----------------------------------------------------------------------------------
    def extra_state(self, network: nn.Module) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "first_session_done": self.first_session_done,
            "stats": dict(self.stats),
            "train_head": None if self.train_head is None else dict(self.train_head),
        }

    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        device = next(network.parameters()).device
        self.samples = int(state["samples"])
        self.first_session_done = bool(state["first_session_done"])
        self.stats = {k: v.to(device) for k, v in state["stats"].items()}
        head = state["train_head"]
        self.train_head = None if head is None else {k: v.to(device) for k, v in head.items()}
        self._eval_head = None
        if self.first_session_done:
            network.requires_grad_(False)
            self.trains = False

    # -- to override -----------------------------------------------------------------------------
    def new_statistics(self, network: nn.Module, args: Mapping[str, Any]) -> Tensors:
        """Zeroed statistics (float64 sums: they add up a whole stream)."""
        raise NotImplementedError

    def accumulate(
        self, network: nn.Module, features: torch.Tensor, labels: torch.Tensor, position: int
    ) -> None:
        """Fold one stream batch (``position``: the stream index of its first sample) in."""
        raise NotImplementedError

    def solve(self) -> Tensors:
        """The analytic head from the current statistics."""
        raise NotImplementedError

    def head_logits(
        self, network: nn.Module, features: torch.Tensor, head: Tensors
    ) -> torch.Tensor:
        """Logits over all classes from backbone features."""
        raise NotImplementedError


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


@register_method("ranpac_online")
class RanPACOnline(FirstSessionAnalyticOnline):
    paper_name: ClassVar[str] = "RanPAC"
    base_model_name: ClassVar[str] = "ranpac"
    smoke_overrides: ClassVar[Mapping[str, Any]] = {
        **FirstSessionAnalyticOnline.smoke_overrides,
        "M": 256,
    }
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        **FirstSessionAnalyticOnline.config_keys,
        "M": ConfigKey(10000, "random-projection width (PILOT: 10000)", check=integer(1)),
        "ridge_holdout_every": ConfigKey(
            5,
            "every k-th stream sample is held out to choose the ridge (5: upstream's 20%)",
            check=integer(2),
        ),
    }

    @classmethod
    def state_bytes(cls, args: Mapping[str, Any]) -> int:
        """Two M x M Grams and two M x C cross matrices (float64), two C x M heads (float32)."""
        m, c = int(args["M"]), int(args["nb_classes"])
        return 2 * m * m * 8 + 2 * m * c * 8 + 2 * c * m * 4

    def attach(self, network: nn.Module, args: Mapping[str, Any]) -> nn.Module:
        network = super().attach(network, args)
        if "W_rand" in vars(network):
            del network.W_rand  # PILOT's plain attribute; a buffer here, so checkpoints keep it
        # Upstream draws it at the first boundary; its distribution does not depend on when.
        network.register_buffer("W_rand", torch.randn(network.feature_dim, int(args["M"])))
        network.RP_dim = int(args["M"])
        self.holdout_every = int(args["ridge_holdout_every"])
        self.ridge: float | None = None  # chosen at the latest firing
        return network

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

    def solve(self) -> Tensors:
        s = self.stats
        ridge, _ = select_ridge(
            s["gram"] - s["gram_ho"],
            s["cross"] - s["cross_ho"],
            s["gram_ho"],
            s["cross_ho"],
            float(s["n_ho"]),
        )
        eye = torch.eye(s["gram"].shape[0], dtype=s["gram"].dtype, device=s["gram"].device)
        weight = torch.linalg.solve(s["gram"] + ridge * eye, s["cross"]).T
        return {"weight": weight.float(), "ridge": torch.tensor(ridge)}

    def consolidate(self, network: nn.Module, firing: int) -> tuple[nn.Parameter, ...]:
        restarted = super().consolidate(network, firing)
        self.ridge = float(self.train_head["ridge"])
        return restarted

    def head_logits(self, network, features, head) -> torch.Tensor:
        """Upstream's ``CosineLinear`` (sigma 1): cosines in [-1, 1]; all zero before a solve."""
        h = F.normalize(self.project(network, features), dim=1)
        if head is None:
            return h.new_zeros(len(h), network.fc.out_features)
        return F.linear(h, F.normalize(head["weight"], dim=1))

    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        super().load_extra_state(network, state)
        self.ridge = None if self.train_head is None else float(self.train_head["ridge"])

    def report(self) -> dict[str, Any]:
        return {"ridge": self.ridge, "first_session_done": self.first_session_done}

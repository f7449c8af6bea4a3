"""SLCA online (``slca_online``): Slow Learner with Classifier Alignment (Zhang et al., ICCV 2023;
PILOT's ``models/slca.py``, network ``SLCANet``).

* **Slow learner.** Upstream trains the whole ViT at ``bcb_lrscale`` (0.01) times the head's LR
  (SGD, two param groups). Online: :meth:`SLCAOnline.lr_scale` puts the backbone at
  ``bcb_lrscale`` x ``init_lr`` through the loop's per-group learning rates
  (``MethodAdapter.lr_scale``), with whatever optimiser the config names.
* **Class statistics.** Upstream passes each finished task's data once more through the trained
  backbone (test transforms) and keeps every class's mean and covariance (+ 1e-4 I). Online:
  running means and scatter matrices of the stream batch's features (:class:`ClassGaussians`,
  updated in ``observe`` with the features of the step, computed before its update, under the
  training transforms). Memory: one D x D float32 scatter per class
  (:meth:`SLCAOnline.state_bytes`; 100 classes at D = 768: 236 MB), as upstream keeps them.
* **Classifier alignment (CA)** at each consolidation firing instead of each task end: for
  ``ca_epochs`` epochs, ``ca_samples_per_class`` features per seen class drawn from its Gaussian
  (mean scaled by ``0.9 + 0.1 (s + 1) / (f + 1)``: s the firing count when the class first
  appeared, f this firing's index, upstream's task-age decay with firings for tasks), shuffled,
  and one SGD step (momentum 0.9, cosine-annealed ``ca_lr`` per epoch, as upstream) per batch of
  ``ca_samples_per_class`` on the head alone, with upstream's logit normalisation
  (``ca_with_logit_norm``: logits over the mean of per-session logit norms, over this
  temperature). CA has its own optimiser, made afresh at each firing as upstream's: the loop's
  optimiser (and FGH) state of the head is untouched. Upstream skips CA after the first task;
  online the first firing only closes the first session.

Upstream restores the pre-CA head after evaluating each task (``fc.recall()``), so CA's head
serves evaluation only. Online there is no evaluation point to align before (evaluation must not
change training), so the aligned head is the head: training continues from it.

The class statistics and the alignment step are MOS's too: one copy in
:mod:`pilot_online.core.class_stats`; the session-age mean decay and the per-session logit
blocks are SLCA's, passed in from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from ..core.checks import integer, real
from ..core.class_stats import ClassGaussians, align_classifier
from ..core.rng import key_seed
from ..engine.adapter import ConfigKey, StepOutput
from ..engine.mixins import _run_seed
from ..engine.registry import register_method
from .finetune import FinetuneOnline


def mean_scales(sessions: torch.Tensor, firing: int) -> torch.Tensor:
    """Upstream's task-age decay of the sampled means, ``0.9 + 0.1 (s + 1) / (f + 1)``: 1 for the
    newest session, down to ``0.9 + 0.1 / (f + 1)`` for the oldest."""
    return 0.9 + 0.1 * (sessions.double() + 1) / (firing + 1)


@register_method("slca_online")
class SLCAOnline(FinetuneOnline):
    paper_name: ClassVar[str] = "SLCA"
    base_model_name: ClassVar[str] = "slca"
    #: A regular realignment. Upstream aligns just before it evaluates; online, evaluations come
    #: at points the method cannot see, and the head's bias towards recent classes grows with
    #: every step. A ``new_classes`` firing comes just after a task's last batch, i.e. just after
    #: the protocol's end-of-task evaluation, which would then see the head least recently aligned.
    default_consolidation: ClassVar[str] = "every_n_samples"
    smoke_overrides: ClassVar[dict[str, Any]] = {
        "consolidation_every_n_samples": 200,
        "ca_samples_per_class": 16,
        "ca_epochs": 1,
    }
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "bcb_lrscale": ConfigKey(
            0.01, "backbone LR = bcb_lrscale x init_lr (upstream 0.01; 0 freezes it)", check=real(0)
        ),
        "ca_epochs": ConfigKey(
            3, "classifier-alignment epochs per firing (upstream 3; 0: no CA)", check=integer(0)
        ),
        "ca_samples_per_class": ConfigKey(
            256,
            "features drawn per class per CA epoch, also the CA batch (upstream 256)",
            check=integer(1),
        ),
        "ca_lr": ConfigKey(
            0.01,
            "CA's SGD learning rate, cosine-annealed over its epochs (upstream 0.01)",
            check=real(positive=True),
        ),
        "ca_with_logit_norm": ConfigKey(
            0.1, "CA's logit-normalisation temperature (upstream 0.1; 0: plain CE)", check=real(0)
        ),
    }

    @classmethod
    def state_bytes(cls, args: Mapping[str, Any]) -> int:
        """The class statistics: a D x D float32 scatter, a D mean and 2 counters per class."""
        dim = int((args.get("backbone_kwargs") or {}).get("embed_dim", 768))
        return int(args["nb_classes"]) * (4 * dim * dim + 4 * dim + 16)

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import SLCANet  # PILOT, imported lazily

        network = SLCANet(self.pilot_args(args), True)
        network.requires_grad_(args["bcb_lrscale"] > 0)  # upstream's fix_bcb at scale 0
        self.online_head(network, args)
        self._setup_state(args, network.feature_dim)
        return network

    def _setup_state(self, args: Mapping[str, Any], dim: int) -> None:
        self.stats = ClassGaussians(int(args["nb_classes"]), dim)
        self.sessions_closed = 0  # firings so far: the session a newly seen class belongs to

    def lr_scale(self, name: str, parameter: nn.Parameter) -> float:
        return float(self.args["bcb_lrscale"]) if name.startswith("backbone.") else 1.0

    def observe(self, network: nn.Module, out: StepOutput, labels: torch.Tensor) -> None:
        self.stats.to(out.features.device).update(out.features, labels, self.sessions_closed)

    def consolidate(self, network: nn.Module, firing: int) -> Iterable[nn.Parameter]:
        if firing > 0 and self.args["ca_epochs"] > 0:
            self.align(self.classifier(network), firing)
        self.sessions_closed = firing + 1
        return ()

    def align(self, head: nn.Linear, firing: int) -> None:
        """Classifier alignment (:func:`~pilot_online.core.class_stats.align_classifier`, upstream's
        ``_stage2_compact_classifier``) on the seen classes, their means decayed by session age,
        logits normalised over sessions."""
        args = self.args
        self.stats.to(head.weight.device)
        classes = self.stats.seen()
        sessions = self.stats.session[classes]
        means = (
            self.stats.means[classes].double() * mean_scales(sessions, firing)[:, None]
        ).float()
        generator = torch.Generator(device=head.weight.device)
        generator.manual_seed(key_seed(_run_seed(args.get("seed", 0)), firing))
        align_classifier(
            head,
            classes,
            means,
            self.stats.factors(classes),
            epochs=int(args["ca_epochs"]),
            lr=args["ca_lr"],
            weight_decay=args["weight_decay"],
            samples_per_class=int(args["ca_samples_per_class"]),
            generator=generator,
            blocks=[torch.nonzero(sessions == s).flatten() for s in sessions.unique().tolist()],
            temperature=float(args["ca_with_logit_norm"]),
        )

    def extra_state(self, network: nn.Module) -> dict[str, Any]:
        return {"stats": dict(self.stats.state_dict()), "sessions_closed": self.sessions_closed}

    def load_extra_state(self, network: nn.Module, state: dict[str, Any]) -> None:
        self.stats.to(self.classifier(network).weight.device).load_state_dict(state["stats"])
        self.sessions_closed = int(state["sessions_closed"])

    def report(self) -> dict[str, Any]:
        stats = getattr(self, "stats", None)
        if stats is None:
            return {}
        return {
            "slca": {
                "classes_with_statistics": int((stats.counts > 0).sum()),
                "sessions": self.sessions_closed,
            }
        }

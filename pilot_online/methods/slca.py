"""SLCA online (``slca_online``): Slow Learner with Classifier Alignment (Zhang et al., ICCV 2023;
PILOT's ``models/slca.py``, network ``SLCANet``).

* **Slow learner.** Upstream trains the whole ViT at ``bcb_lrscale`` (0.01) times the head's LR
  (SGD, two param groups). Online: ``lr_scales`` declares the backbone at ``bcb_lrscale`` x
  ``init_lr``, which the loop's per-group learning rates apply (``MethodAdapter.lr_scales``),
  with whatever optimiser the config names.
* **Class statistics.** Upstream passes each finished task's data once more through the trained
  backbone (test transforms) and keeps every class's mean and covariance (+ 1e-4 I). Online:
  running means and scatter matrices of the stream batch's features (:class:`ClassGaussians`,
  updated in ``after_step`` with the features of the step, computed before its update, under the
  training transforms). Memory: one D x D float32 scatter per class
  (:func:`slca_state_bytes`; 100 classes at D = 768: 236 MB), as upstream keeps them.
* **Classifier alignment (CA)**, an evaluation view (:meth:`SLCAOnline.evaluation`), as
  upstream: at each task end upstream backs the head up (``fc.backup()``), aligns it, evaluates,
  and restores the unaligned head (``fc.recall()`` in ``after_task``), so CA serves evaluation
  only and training continues from the head it trained. Online, whenever an evaluation asks,
  a copy of the head is aligned on the current statistics and evaluation predicts with it; the
  training head never changes. CA: for ``ca_epochs`` epochs, ``ca_samples_per_class`` features
  per seen class drawn from its Gaussian (mean scaled by ``0.9 + 0.1 (s + 1) / (f + 1)``: s the
  session of the class, f the current one, upstream's task-age decay with sessions for tasks),
  shuffled, and one SGD step (momentum 0.9, weight decay ``ca_weight_decay`` = upstream's 5e-4,
  cosine-annealed ``ca_lr`` per epoch, as upstream) per batch of ``ca_samples_per_class`` on the
  head alone, with upstream's logit normalisation (``ca_with_logit_norm``: logits over the mean
  of per-session logit norms, over this temperature). Upstream aligns from its second task on:
  the view aligns once a firing has closed the first session.
* **Sessions.** A consolidation firing (default ``new_classes``: each ``consolidation_new_classes``
  new classes, a task boundary of a clear stream, on CUB's 20 tasks as on CIFAR's 10) closes a
  session: a class's session is the number of firings before its first sample. Sessions are
  upstream's tasks in the mean decay and the logit-norm blocks; a firing changes nothing else.

The class statistics and the alignment step are MOS's too: one copy in
:mod:`pilot_online.core.class_stats`; the session-age mean decay and the per-session logit
blocks are SLCA's, passed in from here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, ClassVar

from ..core.checks import integer, real
from ..core.lazy import nn, torch
from ..core.rng import key_seed
from ..engine.adapter import ConfigKey, Consolidated, Consolidation, Evaluation, TrainedStep
from ..engine.backbone_names import PLAIN_VIT
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.registry import register_method
from .finetune import FinetuneOnline


def mean_scales(sessions: torch.Tensor, firing: int) -> torch.Tensor:
    """Upstream's task-age decay of the sampled means, ``0.9 + 0.1 (s + 1) / (f + 1)``: 1 for the
    newest session, down to ``0.9 + 0.1 / (f + 1)`` for the oldest."""
    return 0.9 + 0.1 * (sessions.double() + 1) / (firing + 1)


def slca_state_bytes(args: Mapping[str, Any]) -> int:
    """The class statistics: a D x D float32 scatter, a D mean and 2 counters per class."""
    dim = int((args.get("backbone_kwargs") or {}).get("embed_dim", 768))
    return int(args["nb_classes"]) * (4 * dim * dim + 4 * dim + 16)


CARD = MethodCard(
    backbone_types=PLAIN_VIT,
    paper_name="SLCA",
    smoke_overrides={
        "consolidation_new_classes": 4,  # the smoke tasks' class count: a session per task
        "ca_samples_per_class": 16,
        "ca_epochs": 1,
    },
    upstream_differences=(
        UpstreamDifference(
            "running_class_statistics",
            "Each class's mean and covariance are running statistics of the stream batches' "
            "features (training transforms, the backbone before each step's update) where "
            "upstream passes the finished task's data once more through the trained backbone "
            "(test transforms).",
            "One pass keeps no data for a second pass; the running merge gives upstream's "
            "numbers (torch.cov + 1e-4 I) for the features it is given.",
        ),
        UpstreamDifference(
            "sessions_from_firings",
            "A class's task in CA's mean decay and logit-norm blocks is its session (the "
            "consolidation firings before its first sample), where upstream takes "
            "class_id // task_size.",
            "Task-free: no task ids; on a clear stream with a firing per task the sessions are "
            "upstream's tasks.",
        ),
        UpstreamDifference(
            "old_head_rows_keep_training",
            "One nn.Linear over every class whose rows all stay trainable (under the loop's "
            "logit mask), where upstream adds a head per task and freezes the earlier ones.",
            "No task end to freeze at; with the batch-wise mask an absent class's row gets no "
            "gradient anyway, and on Si-Blurry old classes recur and need their rows.",
        ),
    ),
    state_bytes=slca_state_bytes,
)


@register_method("slca_online", card=CARD)
class SLCAOnline(FinetuneOnline):
    base_model_name: ClassVar[str] = "slca"
    #: Sessions are upstream's tasks (the CA's mean decay and logit-norm blocks): a firing per
    #: ``consolidation_new_classes`` new classes is the stream's sign of a task boundary, on
    #: CUB-sized tasks as on CIFAR's. CA itself runs at each evaluation (the view), whatever the
    #: trigger.
    consolidation: ClassVar[Consolidation] = Consolidation(trigger="new_classes")
    lr_scales: ClassVar[dict[str, float | str]] = {"backbone.": "bcb_lrscale"}  # slow learner
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
        "ca_weight_decay": ConfigKey(
            5e-4,
            "CA's SGD weight decay (upstream's weight_decay, 5e-4 in its configs; the online "
            "optimiser's weight_decay is another key)",
            check=real(0),
        ),
        "ca_with_logit_norm": ConfigKey(
            0.1, "CA's logit-normalisation temperature (upstream 0.1; 0: plain CE)", check=real(0)
        ),
    }

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import SLCANet  # PILOT, imported lazily

        network = SLCANet(self.pilot_args(args), True)
        network.requires_grad_(args["bcb_lrscale"] > 0)  # upstream's fix_bcb at scale 0
        self.online_head(network, args)
        self._setup_state(args, network.feature_dim)
        return network

    def _setup_state(self, args: Mapping[str, Any], dim: int) -> None:
        from ..core.class_stats import ClassGaussians

        self.stats = ClassGaussians(int(args["nb_classes"]), dim)
        self.sessions_closed = 0  # firings so far: the session a newly seen class belongs to

    def after_step(self, network: nn.Module, step: TrainedStep) -> tuple[nn.Parameter, ...]:
        if step.stream is None:  # an extra step of online_iter: the batch is observed once
            return ()
        out, labels = step.stream, step.stream_labels
        self.stats.to(out.features.device).update(out.features, labels, self.sessions_closed)
        return ()

    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """Closes a session; nothing trained changes (upstream's CA is recalled after its
        evaluation: :meth:`evaluation`)."""
        self.sessions_closed = firing + 1
        return Consolidated()

    def evaluation(self, network: nn.Module) -> Evaluation:
        """A view of upstream's ``fc.backup()``, CA, evaluate, ``fc.recall()``: the head aligned
        (:meth:`align`) on the statistics as they are now, for evaluation only. Upstream aligns
        from its second task on: here once the first session is closed. Seeded by the run's seed,
        the session and the samples seen, so a view is a function of the training state."""
        if self.sessions_closed == 0 or self.args["ca_epochs"] <= 0:
            return Evaluation()
        head = self.classifier(network)
        aligned = copy.deepcopy(head)
        samples = int(self.stats.counts.sum())
        self.align(aligned, self.sessions_closed, samples)
        names = {id(p): name for name, p in network.named_parameters()}
        return Evaluation(
            view={names[id(p)]: q.detach() for p, q in zip(head.parameters(), aligned.parameters())}
        )

    def align(self, head: nn.Linear, firing: int, samples: int = 0) -> None:
        """Classifier alignment (:func:`~pilot_online.core.class_stats.align_classifier`, upstream's
        ``_stage2_compact_classifier``) of ``head`` in place on the seen classes, their means
        decayed by session age (``firing``: the current session), logits normalised over
        sessions. Its draws are seeded by the run's seed, ``firing`` and ``samples``."""
        from ..core.class_stats import align_classifier

        args = self.args
        self.stats.to(head.weight.device)
        classes = self.stats.seen()
        sessions = self.stats.session[classes]
        means = (
            self.stats.means[classes].double() * mean_scales(sessions, firing)[:, None]
        ).float()
        generator = torch.Generator(device=head.weight.device)
        generator.manual_seed(key_seed(self.run_seed(), firing, samples))
        align_classifier(
            head,
            classes,
            means,
            self.stats.factors(classes),
            epochs=int(args["ca_epochs"]),
            lr=args["ca_lr"],
            weight_decay=float(args["ca_weight_decay"]),
            samples_per_class=int(args["ca_samples_per_class"]),
            generator=generator,
            blocks=[torch.nonzero(sessions == s).flatten() for s in sessions.unique().tolist()],
            temperature=float(args["ca_with_logit_norm"]),
        )

    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        return {"stats": dict(self.stats.state_dict()), "sessions_closed": self.sessions_closed}

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
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

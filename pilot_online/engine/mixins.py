"""The loop mixins: each adds one mechanism to :class:`~pilot_online.engine.loop.OnlineLoop` by
overriding its hooks (and calling ``super()``). The math lives in plain components under ``core/``
(:class:`PrototypeBank`, :class:`FineGrainedHypergradients`), testable without a loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..core.fgh import FineGrainedHypergradients, validate_options
from ..core.prototypes import PrototypeBank

if TYPE_CHECKING:
    from .adapter import StepOutput
    from .loop import OnlineLoop


class PrototypeMixin:
    """Online-loop mixin: adds L_P (Eq. 2) to the loss and, after the optimiser step, folds the
    step's features (computed before the update, detached) into the prototypes (Eq. 1)."""

    prototypes: PrototypeBank

    def setup(self: OnlineLoop) -> None:
        super().setup()
        layer = self.adapter.classifier(self.network)
        self.prototypes = PrototypeBank(
            self.num_classes,
            layer.in_features,
            device=layer.weight.device,
            dtype=layer.weight.dtype,
        )

    def loss_terms(self: OnlineLoop, out: StepOutput, labels: torch.Tensor) -> dict[str, Any]:
        terms = super().loss_terms(out, labels)
        terms["prototypes"] = self.prototypes.loss(self.adapter.classifier(self.network))
        return terms

    def after_step(self: OnlineLoop, out: StepOutput, labels: torch.Tensor) -> None:
        super().after_step(out, labels)
        self.prototypes.update(out.features, labels, validate=False)

    def report(self: OnlineLoop) -> dict[str, Any]:
        report = super().report()
        report["prototypes"] = {
            "classes": int(self.prototypes.seen.sum()),
            "samples": int(self.prototypes.counts.sum()),
        }
        return report


class FGHMixin:
    """Online-loop mixin: FGH reweights the gradients between backward and the optimiser step.

    ``granularity="class"`` covers the classifier layer only (the appendix algorithm); the other
    granularities cover every trainable parameter (Eq. 8). With ``apply="update"``, setup
    registers FGH's step hooks on the loop's optimizer (see
    :meth:`FineGrainedHypergradients.register_optimizer_hooks`).
    """

    fgh: FineGrainedHypergradients

    def setup(self: OnlineLoop) -> None:
        super().setup()
        options = dict(self.config["fgh"])
        named = self.named_parameters
        if options.get("granularity") == "class":
            layer = {id(p) for p in self.adapter.classifier(self.network).parameters()}
            named = [(name, p) for name, p in named if id(p) in layer]
        self.fgh = FineGrainedHypergradients(named, **options)
        if self.fgh.defaults["apply"] == "update":  # alpha scales the optimizer's update
            self.fgh.register_optimizer_hooks(self.optimizer)

    def transform_gradients(self: OnlineLoop) -> None:
        super().transform_gradients()
        self.fgh.step()

    def report(self: OnlineLoop) -> dict[str, Any]:
        report = super().report()
        alphas = {}
        for name, alpha in self.fgh.coefficients().items():
            alpha = alpha.float()
            alphas[name] = {
                "mean": alpha.mean().item(),
                "std": alpha.std(correction=0).item(),
                "min": alpha.min().item(),
                "max": alpha.max().item(),
            }
        report["fgh"] = {
            "options": validate_options(**self.config["fgh"]),
            "steps": self.fgh.num_steps,
            "skipped_nonfinite": int(self.fgh.num_skipped),
            "alpha": alphas,
        }
        return report

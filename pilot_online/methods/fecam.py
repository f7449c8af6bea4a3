"""FeCAM online (``fecam_online``): a Mahalanobis nearest-class-mean head over running class
means and covariances, after a first session that tunes the PETL module.

Upstream (PILOT's ``models/fecam.py``, ``exps/fecam.json``): the adapter ViT trains on the first
task with a cosine head for ``tuned_epoch`` epochs, then stays frozen. At the end of every task
each new class gets its mean feature and its covariance ``torch.cov`` (unbiased), shrunk as
``cov + alpha I`` (``alpha = 100``, hard-coded) and passed through ``torch.corrcoef`` (which
treats the rows of the shrunk matrix as variables: not ``cov_ij / sqrt(cov_ii cov_jj)``).
Prediction: the class with the least ``(x - mu)' pinv(R) (x - mu)``, ``x`` and ``mu``
L2-normalised.

Online: the first session, its end at the trigger's first firing and the head's timing are those
of :class:`~pilot_online.methods.ranpac.FirstSessionAnalyticOnline` (evaluation always solves the
head from the current statistics). The statistics are per-class counts, feature sums and sums of
outer products (float64), folded in with every stream batch's eval-mode features, so each class's
mean and unbiased covariance equal upstream's over the same features; the head repeats upstream's
shrinkage, ``corrcoef`` and ``pinv`` on them. Logits are minus the distances; a class without
samples gets ``ranpac.UNSEEN_LOGIT`` plus the first session's head (evaluation masks it out
anyway), and a class with one sample a zero covariance (``torch.cov`` would give NaN).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ..core.checks import real
from ..core.lazy import F, nn, torch
from ..engine.adapter import ConfigKey
from ..engine.backbone_names import VIT_B16_WIDTH
from ..engine.card import UpstreamDifference
from ..engine.differences import FIRST_SESSION_DIFFERENCES
from ..engine.registry import register_method
from .ranpac import FIRST_SESSION_CARD, FirstSessionAnalyticOnline

#: The feature width of every backbone FeCAM accepts (ViT-B/16), for :func:`fecam_state_bytes`.


def row_corrcoef(matrices: torch.Tensor) -> torch.Tensor:
    """``torch.corrcoef`` of each ``[..., n, n]`` matrix (rows as variables, columns as
    observations), batched; clamped to [-1, 1] as torch does."""
    centred = matrices - matrices.mean(dim=-1, keepdim=True)
    cov = centred @ centred.transpose(-1, -2)
    std = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    return (cov / (std[..., :, None] * std[..., None, :])).clamp(-1, 1)


def fecam_state_bytes(args: Mapping[str, Any]) -> int:
    """Per class: a d x d outer-product sum and a d-sum (float64), and two heads' means and
    d x d precisions (float32: training's buffers and evaluation's view)."""
    c, d = int(args["nb_classes"]), VIT_B16_WIDTH
    return c * (d * d + d + 1) * 8 + 2 * c * (d * d + d) * 4


CARD = dataclasses.replace(
    FIRST_SESSION_CARD,
    paper_name="FeCAM",
    upstream_differences=(
        *FIRST_SESSION_DIFFERENCES,
        UpstreamDifference(
            "single_sample_class_zero_covariance",
            "A class with one sample gets a zero covariance before shrinkage, where upstream's "
            "torch.cov gives NaN.",
            "In a stream a class can be evaluated after its first sample.",
        ),
    ),
    state_bytes=fecam_state_bytes,
)


@register_method("fecam_online", card=CARD)
class FeCAMOnline(FirstSessionAnalyticOnline):
    base_model_name: ClassVar[str] = "fecam"
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        **FirstSessionAnalyticOnline.config_keys,
        "cov_shrink": ConfigKey(
            100.0, "alpha added to each covariance's diagonal (PILOT hard-codes 100)", check=real(0)
        ),
    }

    head_names: ClassVar[tuple[str, ...]] = (
        "analytic_means",
        "analytic_precision",
        "analytic_seen",
    )

    def attach(self, network: nn.Module, args: Mapping[str, Any]) -> nn.Module:
        network = super().attach(network, args)
        self.alpha = float(args["cov_shrink"])
        return network

    def new_statistics(
        self, network: nn.Module, args: Mapping[str, Any]
    ) -> dict[str, torch.Tensor]:
        c, d = int(args["nb_classes"]), int(network.feature_dim)
        return {
            "count": torch.zeros(c, dtype=torch.float64),
            "sum": torch.zeros(c, d, dtype=torch.float64),
            "outer": torch.zeros(c, d, d, dtype=torch.float64),
        }

    def accumulate(self, network, features, labels, position) -> None:
        x = features.double()
        y = F.one_hot(labels.long(), len(self.stats["count"])).double()
        self.stats["count"] += y.sum(0)
        self.stats["sum"] += y.T @ x
        present = y.sum(0).nonzero().flatten()
        for c in present.tolist():  # at most the batch's classes
            xc = x[labels == c]
            self.stats["outer"][c] += xc.T @ xc

    def new_head(self, network: nn.Module, args: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        c, d = int(args["nb_classes"]), int(network.feature_dim)
        return {
            "analytic_means": torch.zeros(c, d),
            "analytic_precision": torch.zeros(c, d, d),
            "analytic_seen": torch.zeros(c, dtype=torch.bool),
        }

    def solve(self) -> dict[str, torch.Tensor]:
        count, total, outer = self.stats["count"], self.stats["sum"], self.stats["outer"]
        seen = count > 0
        d = total.shape[1]
        means = torch.zeros_like(total)
        precision = torch.zeros_like(outer, dtype=torch.float32)
        idx = seen.nonzero().flatten()
        if len(idx):
            n = count[idx]
            mu = total[idx] / n[:, None]
            # Unbiased covariance from sums; zero for a class seen once (torch.cov: NaN).
            scatter = outer[idx] - n[:, None, None] * mu[:, :, None] * mu[:, None, :]
            cov = scatter / (n - 1).clamp(min=1)[:, None, None]
            cov[n < 2] = 0
            eye = torch.eye(d, dtype=cov.dtype, device=cov.device)
            corr = row_corrcoef(cov + self.alpha * eye)
            precision[idx] = torch.linalg.pinv(corr, hermitian=True).float()
            means[idx] = mu
        return {
            "analytic_means": F.normalize(means, dim=1).float(),
            "analytic_precision": precision,
            "analytic_seen": seen,
        }

    def head_logits(self, network, features) -> torch.Tensor:
        """Minus the Mahalanobis distance of the normalised feature to each normalised mean."""
        means, precision = network.analytic_means, network.analytic_precision
        diff = F.normalize(features.float(), dim=1)[:, None, :] - means[None]  # B C d
        dist = torch.einsum("bcd,cde,bce->bc", diff, precision, diff)
        seen = network.analytic_seen[None]
        return torch.where(seen, -dist, self.unseen_logits(network, features.float()))

    def report(self) -> dict[str, Any]:
        return {"first_session_done": self.first_session_done}

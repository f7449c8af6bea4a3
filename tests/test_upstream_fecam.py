"""``fecam_online`` against upstream's own code (PILOT ``models/fecam.py``).

The port claims upstream's class statistics and classifier: per class the mean and ``torch.cov``,
``shrink_cov``, ``torch.corrcoef`` (``replace_fc``), and the Mahalanobis distance of normalised
features to normalised means through ``pinv`` (``_maha_dist`` / ``_mahalanobis``), evaluated from
the first task on. Upstream's ``Learner`` runs here without its network (``Learner.__new__``), on
the features of an identity backbone that both sides share. The ``test_difference_*`` tests
assert each difference the card's ``upstream_differences`` declares (two shared with RanPAC, by
the helpers of ``test_upstream_ranpac.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from conftest import requires_pilot
from test_upstream_ranpac import (
    CLASSES,
    DIM,
    Extractor,
    attached,
    check_first_session_until_first_firing,
    check_statistics_from_the_first_step,
    check_unseen_classes_below_seen,
    loader,
    stream,
    task_data,
)
from torch import nn

from pilot_online.methods.fecam import FeCAMOnline

pytestmark = requires_pilot


def upstream_fecam(alpha: float):
    """Upstream's ``Learner`` without its network: a head of class means and the list of
    shrunk correlation matrices that ``replace_fc`` fills."""
    from models.fecam import Learner

    learner = Learner.__new__(Learner)
    vars(learner).update(
        _device="cpu",
        _network=SimpleNamespace(fc=nn.Linear(DIM, CLASSES, bias=False), feature_dim=DIM),
        cov_mats=[],
        alpha=alpha,
        _total_classes=0,
    )
    return learner


def upstream_task(learner, backbone: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Upstream's end of a task: ``replace_fc`` on its data (its classes in ``train_dataset``)."""
    learner.train_dataset = SimpleNamespace(labels=y.numpy())
    learner._total_classes = int(y.max()) + 1
    learner.replace_fc(loader(x, y), Extractor(backbone), None)


def test_evaluation_equals_upstreams_replace_fc_and_mahalanobis_from_the_first_task(
    pilot_on_path,
) -> None:
    """Upstream evaluates ``_maha_dist`` after each task; ours evaluates the view of the current
    statistics: after the first task (no firing yet, the first session still on) and after the
    second (the firing at its first batch ended the first session)."""
    adapter, network, loop = attached(FeCAMOnline, nn.Identity(), consolidation_new_classes=2)
    upstream = upstream_fecam(alpha=adapter.alpha)
    queries = torch.randn(6, DIM, generator=torch.Generator().manual_seed(20))
    for classes, seed, firings in (((0, 1), 21, []), ((2, 3), 22, [12])):
        x, y = task_data(classes, 12, seed)
        stream(loop, x, y)
        assert loop.trigger.firings == firings
        upstream_task(upstream, nn.Identity(), x, y)
        with loop.evaluation_view():
            logits = adapter.forward(network, queries, train=False).logits
        distances = upstream._maha_dist(queries.numpy(), upstream._network.fc.weight.data,
                                        upstream.cov_mats)  # fmt: skip
        seen = upstream._total_classes
        np.testing.assert_allclose(-logits[:, :seen].T.numpy(), distances, rtol=1e-4, atol=1e-4)
    assert not adapter.trains


def test_shrinkage_correlation_and_mahalanobis_equal_upstreams(pilot_on_path) -> None:
    """One class with a small shrinkage (so the covariance shapes the distance): our precision is
    ``pinv`` of upstream's ``corrcoef(shrink_cov(torch.cov))``, our distance ``_mahalanobis``."""
    adapter, network, loop = attached(
        FeCAMOnline, nn.Identity(), tune_first_session=False, consolidation="never"
    )
    adapter.alpha = 0.5
    g = torch.Generator().manual_seed(23)
    x = torch.randn(9, DIM, generator=g) * torch.tensor([1.0, 3.0, 0.5, 2.0]) + 1
    y = torch.zeros(9, dtype=torch.long)
    stream(loop, x, y, batch=3)
    upstream = upstream_fecam(alpha=0.5)
    shrunk = upstream.shrink_cov(torch.cov(x.T), 0.5)
    correlation = torch.corrcoef(shrunk)
    view = adapter.evaluation(network).view
    torch.testing.assert_close(
        view["analytic_precision"][0], torch.linalg.pinv(correlation), rtol=1e-4, atol=1e-4
    )
    queries = torch.randn(5, DIM, generator=g)
    with loop.evaluation_view():
        logits = adapter.forward(network, queries, train=False).logits
    theirs = upstream._mahalanobis(queries, x.mean(0), correlation)
    np.testing.assert_allclose(-logits[:, 0].numpy(), theirs, rtol=1e-4, atol=1e-5)


# -- the declared differences ------------------------------------------------------------------
def test_difference_first_session_until_first_firing(pilot_on_path) -> None:
    check_first_session_until_first_firing(FeCAMOnline)


def test_difference_unseen_classes_below_seen(pilot_on_path) -> None:
    check_unseen_classes_below_seen(FeCAMOnline)


def test_difference_statistics_from_the_first_step(pilot_on_path) -> None:
    def upstream_sums(backbone: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-class feature sums from upstream's means (``replace_fc``) and the class sizes."""
        learner = upstream_fecam(alpha=100.0)
        upstream_task(learner, backbone, x, y)
        sizes = torch.bincount(y, minlength=CLASSES).float()
        return learner._network.fc.weight.data * sizes[:, None]

    check_statistics_from_the_first_step(FeCAMOnline, "sum", upstream_sums)


def test_difference_single_sample_class_zero_covariance(pilot_on_path) -> None:
    """Class 1 has one sample: upstream's ``torch.cov`` makes its matrix NaN; ours is the shrunk
    zero covariance through upstream's ``shrink_cov`` and ``corrcoef``."""
    adapter, network, loop = attached(
        FeCAMOnline, nn.Identity(), tune_first_session=False, consolidation="never"
    )
    x, y = task_data((0, 0, 0, 1), 4, 24)
    stream(loop, x, y)
    upstream = upstream_fecam(alpha=adapter.alpha)
    upstream_task(upstream, nn.Identity(), x, y)
    assert torch.isnan(upstream.cov_mats[1]).all()
    precision = adapter.evaluation(network).view["analytic_precision"][1]
    zero = torch.corrcoef(upstream.shrink_cov(torch.zeros(DIM, DIM), adapter.alpha))
    torch.testing.assert_close(precision, torch.linalg.pinv(zero), rtol=1e-4, atol=1e-4)

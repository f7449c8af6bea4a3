"""FeCAM online: running class means and covariances, and upstream's Mahalanobis head on them.

The unit tests drive the real adapter and loop on a stand-in network whose backbone is the
identity on 3-d features, and check the head against numpy on the stacked features of each class
(upstream's ``torch.cov``, ``shrink_cov``, ``torch.corrcoef``, ``pinv`` and ``_mahalanobis``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_smoke_method, requires_pilot, smoke_config
from torch import nn

from pilot_online.core.cosine_head import attach_cosine_head
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.methods.fecam import FeCAMOnline, row_corrcoef
from pilot_online.methods.ranpac import UNSEEN_LOGIT

DIM = 3


def stand_in(config: dict, num_classes: int) -> tuple[FeCAMOnline, nn.Module]:
    network = nn.Module()
    network.backbone = nn.Identity()
    network.feature_dim = DIM
    attach_cosine_head(network, DIM, num_classes)
    adapter = FeCAMOnline(args=config)
    return adapter, adapter.attach(network, config)


def test_row_corrcoef_is_numpys_corrcoef_per_matrix() -> None:
    a = torch.randn(3, 5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for i in range(3):
        np.testing.assert_allclose(
            row_corrcoef(a)[i].numpy(), np.corrcoef(a[i].numpy()), atol=1e-12
        )


@pytest.mark.parametrize("sizes", [[5, 6], [2, 2, 2, 2, 3]], ids=["5-6", "2s"])
def test_head_equals_upstreams_on_stacked_class_features(sizes: list[int]) -> None:
    """Class 0: 6 samples, class 1: 4, class 2: one (zero covariance), class 3: none."""
    config = smoke_config(
        "fecam_online", num_classes=4, tune_first_session=False, consolidation="never"
    )
    config["cov_shrink"] = 0.5  # small, so the covariances shape the distances
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, DIM, generator=g) * torch.tensor([1.0, 3.0, 0.5]) + 1
    y = torch.tensor([0, 1, 0, 0, 1, 2, 0, 1, 0, 1, 0])
    adapter, network = stand_in(config, 4)
    loop = build_loop(adapter, network, config, num_classes=4)
    start = 0
    for size in sizes:
        loop.train_step(x[start : start + size], y[start : start + size])
        start += size
    assert loop.optimizer_steps == 0 and adapter.stats["count"].tolist() == [6, 4, 1, 0]
    queries = torch.randn(5, DIM, generator=g)
    with loop.evaluation_view():
        logits = adapter.forward(network, queries, train=False).logits.double().numpy()
    xs, q = x.double().numpy(), queries.double().numpy()
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    for c in range(3):
        members = xs[y.numpy() == c]
        mean = members.mean(0)
        cov = np.cov(members.T) if len(members) > 1 else np.zeros((DIM, DIM))
        precision = np.linalg.pinv(np.corrcoef(cov + 0.5 * np.eye(DIM)))
        diff = qn - mean / np.linalg.norm(mean)
        expected = -np.einsum("bd,de,be->b", diff, precision, diff)
        np.testing.assert_allclose(logits[:, c], expected, rtol=1e-5, atol=1e-5, err_msg=str(c))
    # Class 3 has no sample: below every seen class, ranked by the first session's head.
    unseen = UNSEEN_LOGIT + network.fc(queries).detach().double().numpy()[:, 3]
    np.testing.assert_allclose(logits[:, 3], unseen)


def test_first_session_trains_the_cosine_head_and_evaluation_is_mahalanobis_throughout() -> None:
    config = smoke_config("fecam_online", num_classes=3, consolidation="new_classes")
    config["consolidation_new_classes"] = 1
    adapter, network = stand_in(config, 3)
    loop = build_loop(adapter, network, config, num_classes=3)
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1))
    loop.train_step(x[:4], torch.tensor([0, 0, 0, 0]))
    assert adapter.trains and loop.optimizer_steps == 1 and not network.analytic_seen.any()
    with loop.evaluation_view():  # the class statistics already, as upstream after its task
        logits = adapter.forward(network, x, False).logits
    assert logits[:, 1:].lt(UNSEEN_LOGIT / 2).all() and (logits[:, 0] <= 0).all()
    # Class 1 is beyond the first class: the first session ends before this batch trains.
    loop.train_step(x[4:], torch.tensor([1, 1, 0, 1]))
    assert loop.trigger.firings == [4] and loop.optimizer_steps == 1
    assert not adapter.trains and not network.fc.weight.requires_grad
    # Training's head was solved at the firing (class 0 only); evaluation's covers classes 0, 1.
    assert network.analytic_seen.tolist() == [True, False, False]
    assert adapter.evaluation(network).view["analytic_seen"].tolist() == [True, True, False]
    train_logits = adapter.forward(network, x, train=True).logits
    assert train_logits[:, 1:].lt(UNSEEN_LOGIT / 2).all() and (train_logits[:, 0] <= 0).all()
    with loop.evaluation_view():
        logits = adapter.forward(network, x, train=False).logits
    assert logits[:, 2].lt(UNSEEN_LOGIT / 2).all() and (logits[:, :2] <= 0).all()


def test_state_bytes_counts_the_per_class_covariances() -> None:
    # float64 sums: 100 x (768^2 + 768 + 1) x 8 = 472,474,400 B; two float32 heads (means and
    # precisions): 2 x 100 x (768^2 + 768) x 4 = 472,473,600 B.
    assert method_card("fecam_online").memory_bytes({"nb_classes": 100}) == 944_948_000


@requires_pilot
def test_pilot_network_tunes_only_the_adapters_and_head(pilot_on_path: Path) -> None:
    _, network, _ = build_smoke_method("fecam_online")
    tuned = {n for n, p in network.named_parameters() if p.requires_grad}
    assert tuned and all("adaptmlp" in n or n.startswith("fc") for n in tuned)

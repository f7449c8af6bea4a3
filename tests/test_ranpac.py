"""RanPAC online: Gram/cross statistics, the held-out ridge choice and the first session's end.

The unit tests drive the real adapter and loop on a stand-in network whose backbone is the
identity on 4-d features, and check every statistic, ridge error and logit against numpy on the
stacked features (upstream's ``replace_fc`` / ``optimise_ridge_parameter`` computed offline).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_smoke_method, requires_pilot, smoke_config
from torch import nn

from pilot_online.core.cosine_head import attach_cosine_head
from pilot_online.engine.config import ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.methods.ranpac import RIDGES, UNSEEN_LOGIT, RanPACOnline, select_ridge

DIM, M = 4, 6


def stand_in(config: dict, num_classes: int) -> tuple[RanPACOnline, nn.Module]:
    """The adapter attached to an identity backbone with a cosine first-session head."""
    network = nn.Module()
    network.backbone = nn.Identity()
    network.feature_dim = DIM
    attach_cosine_head(network, DIM, num_classes)
    adapter = RanPACOnline(args=config)
    torch.manual_seed(0)
    return adapter, adapter.attach(network, config)


def config_for(num_classes: int, **overrides) -> dict:
    config = smoke_config("ranpac_online", num_classes=num_classes, M=M, **overrides)
    config["consolidation_new_classes"] = overrides.get("consolidation_new_classes", 3)
    return config


def stream(n: int = 20, num_classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randint(0, num_classes, (n,), generator=g)


def project(x: torch.Tensor, network: nn.Module) -> np.ndarray:
    """``relu(x W_rand)`` in float64 (the features are float32: agreement to ~1e-7 relative)."""
    return np.maximum(x.double().numpy() @ network.W_rand.double().numpy(), 0)


def numpy_ridge(h: np.ndarray, y: np.ndarray, held: np.ndarray) -> tuple[float, list[float]]:
    """Upstream's search on stacked features: fit on the kept rows, squared error on the held."""
    errors = []
    for ridge in RIDGES:
        w = np.linalg.solve(
            h[~held].T @ h[~held] + ridge * np.eye(h.shape[1]), h[~held].T @ y[~held]
        )
        errors.append(float(((y[held] - h[held] @ w) ** 2).sum()))
    return RIDGES[int(np.argmin(errors))], errors


def run(config: dict, x: torch.Tensor, y: torch.Tensor, sizes: list[int], num_classes: int = 3):
    adapter, network = stand_in(config, num_classes)
    loop = build_loop(adapter, network, config, num_classes=num_classes)
    start = 0
    for size in sizes:
        loop.train_step(x[start : start + size], y[start : start + size])
        start += size
    assert start == len(y)
    return adapter, loop


@pytest.mark.parametrize("sizes", [[7, 5, 8], [3, 3, 3, 3, 3, 5]], ids=["7-5-8", "3s"])
def test_statistics_ridge_and_head_equal_numpy_on_stacked_features(sizes: list[int]) -> None:
    config = config_for(3, tune_first_session=False, consolidation="never", ridge_holdout_every=3)
    x, y = stream()
    adapter, loop = run(config, x, y, sizes)
    h = project(x, loop.network)
    onehot = np.eye(3)[y.numpy()]
    held = np.arange(20) % 3 == 2  # every 3rd stream sample, whatever the batch sizes
    s = {k: v.numpy() for k, v in adapter.stats.items()}
    np.testing.assert_allclose(s["gram"], h.T @ h, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(s["cross"], h.T @ onehot, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(s["gram_ho"], h[held].T @ h[held], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(s["cross_ho"], h[held].T @ onehot[held], rtol=1e-6, atol=1e-9)
    assert float(s["n_ho"]) == 6
    # The held-out error from statistics alone equals the error on the stacked held-out rows.
    expected_ridge, expected_errors = numpy_ridge(h, onehot, held)
    st = adapter.stats
    ridge, errors = select_ridge(
        st["gram"] - st["gram_ho"], st["cross"] - st["cross_ho"], st["gram_ho"], st["cross_ho"], 6
    )
    np.testing.assert_allclose(errors, expected_errors, rtol=1e-6, atol=1e-9)
    assert ridge == expected_ridge
    # Evaluation: upstream's cosine head on W = (G + lambda I)^-1 Q over all 20 samples.
    w = np.linalg.solve(h.T @ h + ridge * np.eye(M), h.T @ onehot).T
    hn = h[:5] / np.linalg.norm(h[:5], axis=1, keepdims=True)
    cosine = hn @ (w / np.linalg.norm(w, axis=1, keepdims=True)).T
    with loop.evaluation_view():
        logits = adapter.forward(loop.network, x[:5], train=False).logits
    np.testing.assert_allclose(logits.numpy(), cosine, atol=1e-5)
    # No firing: evaluation's solve is not training's, which stays unsolved.
    assert not loop.network.analytic_weight.any()


def test_first_session_trains_until_the_first_firing_then_freezes() -> None:
    config = config_for(4, consolidation="new_classes", consolidation_new_classes=2)
    x, _ = stream(16, seed=1)
    y = torch.tensor([0, 1, 0, 1, 0, 1, 1, 0, 2, 0, 1, 2, 3, 3, 2, 0])
    adapter, network = stand_in(config, 4)
    loop = build_loop(adapter, network, config, num_classes=4)
    fc_start = network.fc.weight.detach().clone()
    for step in range(2):  # classes 0 and 1 only: the first session goes on
        loop.train_step(x[4 * step : 4 * step + 4], y[4 * step : 4 * step + 4])
        assert adapter.trains and network.fc.weight.requires_grad
        assert not network.analytic_weight.any() and loop.trigger.firings == []
    assert loop.optimizer_steps == 2 and not torch.equal(network.fc.weight, fc_start)
    # Before the firing, evaluation already uses the analytic head of the 8 samples so far (as
    # upstream evaluates its analytic head after its first task), not the first session's head.
    h8 = project(x[:8], network)
    onehot8 = np.eye(4)[y[:8].numpy()]
    ridge8, _ = numpy_ridge(h8, onehot8, np.arange(8) % 5 == 4)
    w8 = np.linalg.solve(h8.T @ h8 + ridge8 * np.eye(M), h8.T @ onehot8).T
    with loop.evaluation_view():
        logits = adapter.forward(network, x[:3], train=False).logits
    hn = h8[:3] / np.linalg.norm(h8[:3], axis=1, keepdims=True)
    cosine = hn @ (w8[:2] / np.linalg.norm(w8[:2], axis=1, keepdims=True)).T  # classes 0, 1
    sigma = float(network.fc_sigma.detach())  # upstream's head keeps the trained sigma
    np.testing.assert_allclose(logits[:, :2].numpy(), sigma * cosine, atol=1e-5)
    unseen = UNSEEN_LOGIT + network.fc(x[:3]).detach()[:, 2:]  # below the seen: by the fc head
    torch.testing.assert_close(logits[:, 2:], unseen)
    fc_trained = network.fc.weight.detach().clone()
    # Class 2 is beyond the first 2 classes: the first session ends before this batch trains.
    loop.train_step(x[8:12], y[8:12])
    assert loop.trigger.firings == [8] and loop.optimizer_steps == 2
    assert not adapter.trains and not any(p.requires_grad for p in network.parameters())
    assert torch.equal(network.fc.weight, fc_trained)
    # The training head is solved at the firing from the 8 samples trained before it.
    h = project(x[:8], network)
    onehot = np.eye(4)[y[:8].numpy()]
    ridge, _ = numpy_ridge(h, onehot, np.arange(8) % 5 == 4)
    w = np.linalg.solve(h.T @ h + ridge * np.eye(M), h.T @ onehot).T
    np.testing.assert_allclose(network.analytic_weight.numpy(), w, rtol=1e-4, atol=1e-6)
    assert adapter.report()["ridge"] == ridge
    loop.train_step(x[12:], y[12:])  # class 3: one new class of 2, no firing
    assert loop.optimizer_steps == 2 and torch.equal(network.fc.weight, fc_trained)
    assert loop.trigger.firings == [8] and adapter.samples == 16
    np.testing.assert_allclose(network.analytic_weight.numpy(), w, rtol=1e-4, atol=1e-6)
    # Training logits come from that head; evaluation's solve covers all 16 samples.
    h16 = project(x, network)
    onehot16 = np.eye(4)[y.numpy()]
    ridge16, _ = numpy_ridge(h16, onehot16, np.arange(16) % 5 == 4)
    w16 = np.linalg.solve(h16.T @ h16 + ridge16 * np.eye(M), h16.T @ onehot16).T
    view = adapter.evaluation(network).view["analytic_weight"]
    np.testing.assert_allclose(view.numpy(), w16, rtol=1e-4, atol=1e-6)


def test_checkpoint_round_trip_restores_statistics_and_head() -> None:
    config = config_for(3, consolidation="new_classes", consolidation_new_classes=2)
    x, _ = stream()
    y = torch.tensor([0, 1] * 5 + [2, 0, 1, 2, 2, 0, 1, 2, 0, 1])
    adapter, loop = run(config, x, y, [10, 10])
    assert loop.trigger.firings == [10] and not adapter.trains
    fresh_adapter, fresh_network = stand_in(config, 3)
    fresh = build_loop(fresh_adapter, fresh_network, config, num_classes=3)
    fresh.load_state_dict(loop.state_dict())
    assert not fresh_adapter.trains and fresh_adapter.samples == 20
    assert fresh_adapter.ridge == adapter.ridge
    for key, value in adapter.stats.items():
        assert torch.equal(fresh_adapter.stats[key], value), key
    for train in (False, True):
        ours = adapter.forward(loop.network, x[:4], train=train).logits
        torch.testing.assert_close(fresh_adapter.forward(fresh_network, x[:4], train).logits, ours)


def test_a_first_session_that_never_ends_is_refused_with_the_fix() -> None:
    from conftest import raw_smoke_config

    raw = {**raw_smoke_config("ranpac_online"), "consolidation": "never"}
    with pytest.raises(ConfigError, match="set tune_first_session false"):
        resolve_config(raw)
    with pytest.raises(ConfigError, match='"online_prototypes": false and "fgh": null'):
        resolve_config({**raw_smoke_config("ranpac_online"), "online_prototypes": True})
    resolve_config({**raw, "tune_first_session": False})  # no first session: fine


def test_state_bytes_counts_the_float64_grams() -> None:
    # 2 Grams 10^4 x 10^4 x 8 B = 1.6e9; 2 cross 10^4 x 100 x 8 B = 1.6e7; 2 heads x 4 B = 8e6.
    assert (
        method_card("ranpac_online").memory_bytes({"M": 10000, "nb_classes": 100}) == 1_624_000_000
    )


@requires_pilot
def test_pilot_network_tunes_only_the_adapters_and_head(pilot_on_path: Path) -> None:
    _, network, config = build_smoke_method("ranpac_online")
    tuned = {n for n, p in network.named_parameters() if p.requires_grad}
    assert tuned and all("adaptmlp" in n or n.startswith("fc") for n in tuned)
    assert {"fc.weight", "fc_sigma"} <= tuned
    assert network.W_rand.shape == (network.feature_dim, config["M"])
    assert "W_rand" in dict(network.named_buffers())

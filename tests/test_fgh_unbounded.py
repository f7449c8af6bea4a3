"""FGH without an upper bound (the paper configs' form, ``PAPER_FGH``): a coefficient that keeps
growing stays finite, Adam bounds the step it scales, the loop keeps running, and the configs
refuse the combination where a growing coefficient would multiply the step itself (SGD).
docs/fgh.md, "Without an upper bound"."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_loop import BASE_CONFIG, D_IN, make_loop

from pilot_online.core.fgh import FineGrainedHypergradients
from pilot_online.core.fgh_stats import AlphaStream, alpha_statistics
from pilot_online.engine.config import FGH_FORMS, PAPER_FGH, ConfigError, resolve_config

STEPS = 10_000


def test_ten_thousand_steps_of_a_growing_coefficient_stay_finite_and_adam_bounds_the_step():
    """Linear(3 -> 2) under loss = sum(weight) + sum(bias): every gradient entry is 1 at every
    step, whatever the parameters. The appendix form pairs Adam directions of the raw gradient:
    m_hat = 1 and v_hat = 1, so c_t = 1 / (1 + 1e-8), which is 1 in float32, and each class row's
    hypergradient is its 3 + 1 = 4 entries. Alpha is untouched at step 1 and grows by
    gamma * 4 = 4 at each later step: alpha_T = 1 + 4 (T - 1) = 39997 at T = 10^4 (integers,
    exact in float32). Adam receives alpha_t * 1, a gradient growing without bound; its step
    stays below lr (1 - beta1) / sqrt(1 - beta2) = lr * 3.16 (Kingma & Ba, Sec. 2.1), so after T
    steps every parameter has moved by at most T * lr * 3.16, where SGD would have moved
    lr * sum_t alpha_t = lr * (T + 2 T (T - 1)), about 2e5 here."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    start = {n: p.detach().clone() for n, p in layer.named_parameters()}
    lr = 1e-3
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    fgh = FineGrainedHypergradients(layer.named_parameters(), **PAPER_FGH)
    stream = AlphaStream(fgh)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        (layer.weight.sum() + layer.bias.sum()).backward()
        fgh.step()
        stream.observe()
        opt.step()
    alpha = fgh.state[layer.weight]["alpha"]
    assert torch.equal(alpha, torch.full((2,), 1.0 + 4.0 * (STEPS - 1)))
    (bounds,) = stream.bounds()
    assert float(bounds["stream"]["max"]) == 1.0 + 4.0 * (STEPS - 1)  # it only ever grew
    assert bounds["clamp"] == [0.0, None] and float(bounds["final"]["at_hi"]) == 0.0
    assert int(fgh.num_skipped) == 0
    bound = STEPS * lr * (1 - 0.9) / math.sqrt(1 - 0.999)
    for name, p in layer.named_parameters():
        moved = start[name] - p.detach()
        assert torch.isfinite(p).all(), name
        assert (moved > 0).all() and (moved <= bound).all(), (name, moved)


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_the_loop_keeps_running_when_the_coefficient_reaches_its_float_ceiling(amp):
    """At gamma 1e36 a class coefficient leaves any real range at its first pairing; it stops at
    sqrt(float32 max), about 2^64 (the safety net of core/fgh.py), so alpha * g stays finite even
    with gradients in the hundreds (inputs scaled by 1e2), the loop's non-finite guard never
    fires, and the parameters stay finite, in float32 and under bf16 autocast."""
    config = {**BASE_CONFIG, "init_lr": 1e-3, "amp": amp, "fgh": {**PAPER_FGH, "gamma": 1e36}}
    loop = make_loop(config)
    generator = torch.Generator().manual_seed(0)
    x, labels = 1e2 * torch.randn(4, D_IN, generator=generator), torch.tensor([0, 1, 2, 3])
    for _ in range(20):
        assert not loop.train_step(x, labels).skipped
    assert loop.skipped_nonfinite_steps == 0 and loop.optimizer_steps == 20
    (stats,) = alpha_statistics(loop.fgh)
    # sqrt(float32 max) = sqrt((2 - 2^-23) 2^127) = 2^64 - 2^40 (to float32 precision)
    assert float(stats["max"]) == 2.0**64 - 2.0**40
    assert all(torch.isfinite(p).all() for p in loop.network.parameters())


def _paper_config(**overrides) -> dict:
    from conftest import make_exps

    config = copy.deepcopy(make_exps().all_configs()["coda_online_fgh.json"])
    return {**config, **overrides}


def test_no_upper_bound_is_json_null_and_infinity_is_refused_with_the_fix():
    assert PAPER_FGH["clamp"] == [0.0, None]
    resolve_config(_paper_config())
    with pytest.raises(ConfigError, match=r"fgh: clamp\[1\] is inf.*write null"):
        resolve_config(_paper_config(fgh={**PAPER_FGH, "clamp": [0.0, math.inf]}))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"optimizer": "sgd"}, r"optimizer='sgd': SGD does not normalise"),
    ],
)
def test_an_unbounded_coefficient_that_would_scale_the_step_itself_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        resolve_config(_paper_config(**overrides))
    assert "appendix_clamp10" in str(err.value)  # the fix: the bounded form, one key away
    # With the bound, the same config is accepted.
    resolve_config(
        _paper_config(
            **{**overrides, "fgh": {**overrides.get("fgh", PAPER_FGH), "clamp": [0.0, 10.0]}}
        )
    )


def test_the_bounded_form_is_one_key_away():
    """FGH_FORMS["appendix_clamp10"] is the paper form with the former clamp and gamma."""
    bounded = FGH_FORMS["appendix_clamp10"]
    assert {k: v for k, v in bounded.items() if k not in ("clamp", "gamma")} == {
        k: v for k, v in PAPER_FGH.items() if k not in ("clamp", "gamma")
    }
    assert (bounded["clamp"], bounded["gamma"]) == ([0.0, 10.0], 0.001)
    assert PAPER_FGH["gamma"] == 1.0  # "we set gamma=1 for all experiments by default"


@pytest.mark.parametrize("foreach", [False, True])
def test_both_kernels_cap_the_coefficient_at_the_float_ceiling(foreach):
    """The cap is in the per-tensor specification and in the foreach kernels alike: at gamma
    1e36 the second step's pairing (hypergradient 4 per class row, as in the 10^4-step test)
    would take alpha to 4e36, beyond float32's range of a product alpha * g; both kernels stop
    it at sqrt(float32 max) = 2^64 - 2^40."""
    layer = torch.nn.Linear(3, 2)
    fgh = FineGrainedHypergradients(
        layer.named_parameters(), **{**PAPER_FGH, "gamma": 1e36, "foreach": foreach}
    )
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        (layer.weight.sum() + layer.bias.sum()).backward()
        fgh.step()
    assert torch.equal(fgh.state[layer.weight]["alpha"], torch.full((2,), 2.0**64 - 2.0**40))

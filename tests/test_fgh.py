"""Tests for Fine-Grained Hypergradients against values worked out by hand (paper Eq. 8 and the
appendix's class-wise Adam pseudo-code)."""

from __future__ import annotations

import copy
import io
import itertools
import math

import pytest
import torch
from torch import nn

from pilot_online.core import fgh as fgh_module
from pilot_online.core.fgh import FineGrainedHypergradients
from pilot_online.core.grad_norms import class_grad_norms

T = torch.tensor

# --------------------------------------------------------------------------- the 6 modes
#
# Two parameters, W [2, 2] and b [2] (one "final layer", so every granularity applies), driven
# by setting .grad directly:
G1_W, G1_B = T([[1.0, 1.0], [5.0, 2.0]]), T([-1.0, 1.0])
G2_W, G2_B = T([[1.0, -1.0], [-1.0, -1.0]]), T([-1.0, 1.0])
# direction="grad", gamma=0.1: h = g2 * g1 = W [[1, -1], [-5, -2]], b [1, 1].
#   element: alpha = 1 + 0.1 h      = W [[1.1, 0.9], [0.5, 0.8]], b [1.1, 1.1]
#   class:   h_0 = 1-1 + 1 = 1      -> 1.1;  h_1 = -5-2 + 1 = -6 -> 0.4
#   global:  h = -7 + 2 = -5        -> 0.5
# direction="adam", betas=(0.5, 0.5), eps=0, gamma=0.05 (appendix algorithm):
#   step 1: nothing to pair with: the RAW g1 is stored, the moments are not touched.
#   step 2: first moment update, bias correction with count 1: m = 0.5 g2, m_hat = g2,
#           v_hat = g2^2, c2 = g2 / |g2| = g2 (every entry of g2 is +-1).
#   h = c2 * g1 = g2 * g1: W [[1, -1], [-5, -2]], b [1, 1].
#     element: W [[1.05, 0.95], [0.75, 0.9]], b [1.05, 1.05]
#     class:   h_0 = 1 - 1 + 1 = 1 -> 1.05;  h_1 = -5 - 2 + 1 = -6 -> 0.7
#     global:  h = -7 + 2 = -5 -> 0.75
#   (The appendix order matters: the old order, moments from step 1 and c1 = sign(g1) stored,
#   gives h = c2' * sign(g1) with c2' = (g1 + 2 g2) / sqrt(3 (g1^2 + 2 g2^2)), e.g. 1/3 at W[1,0]
#   instead of -5. The three-step test below works the moments through.)
_GRAD_DIRECTION = {
    "element": ([[1.1, 0.9], [0.5, 0.8]], [1.1, 1.1]),
    "class": ([[1.1, 1.1], [0.4, 0.4]], [1.1, 0.4]),
    "global": ([[0.5, 0.5], [0.5, 0.5]], [0.5, 0.5]),
}
_ADAM_DIRECTION = {
    "element": ([[1.05, 0.95], [0.75, 0.9]], [1.05, 1.05]),
    "class": ([[1.05, 1.05], [0.7, 0.7]], [1.05, 0.7]),
    "global": ([[0.75, 0.75], [0.75, 0.75]], [0.75, 0.75]),
}
EXPECTED_ALPHA = {
    **{(g, "grad"): v for g, v in _GRAD_DIRECTION.items()},
    **{(g, "adam"): v for g, v in _ADAM_DIRECTION.items()},
}
ALPHA_SHAPE = {"element": (2, 2), "class": (2,), "global": ()}
MODES = list(itertools.product(("element", "class", "global"), ("grad", "adam")))
LR = 0.5


def _tiny(granularity: str, direction: str, foreach: bool, device="cpu"):
    w = nn.Parameter(torch.zeros(2, 2, device=device))
    b = nn.Parameter(torch.zeros(2, device=device))
    extra = (
        {"gamma": 0.1} if direction == "grad" else {"gamma": 0.05, "betas": (0.5, 0.5), "eps": 0.0}
    )
    fgh = FineGrainedHypergradients(
        [("W", w), ("b", b)],
        granularity=granularity,
        direction=direction,
        foreach=foreach,
        **extra,
    )
    return w, b, fgh, torch.optim.SGD([w, b], lr=LR)


def _drive(w, b, fgh, opt, grads) -> None:
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        fgh.step()
        opt.step()


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(("granularity", "direction"), MODES)
def test_every_mode_against_hand_values(granularity, direction, foreach, device):
    w, b, fgh, opt = _tiny(granularity, direction, foreach, device)
    w.grad, b.grad = G1_W.to(device, copy=True), G1_B.to(device, copy=True)
    fgh.step()
    # First step: nothing to pair with, alpha stays 1 and the gradient is unchanged.
    assert torch.equal(w.grad.cpu(), G1_W) and torch.equal(b.grad.cpu(), G1_B)
    if direction == "adam":  # and the moments start only at step 2
        assert fgh.state[w]["step"] == 0 and not fgh.state[w]["m"].any()
        assert not fgh.state[w]["v"].any()
    opt.step()
    w.grad, b.grad = G2_W.to(device, copy=True), G2_B.to(device, copy=True)
    fgh.step()

    alpha_w, alpha_b = (T(x) for x in EXPECTED_ALPHA[(granularity, direction)])
    coeffs = {name: alpha.cpu() for name, alpha in fgh.coefficients().items()}
    torch.testing.assert_close(coeffs["W"], alpha_w, atol=1e-6, rtol=0)
    torch.testing.assert_close(coeffs["b"], alpha_b, atol=1e-6, rtol=0)
    # The alpha lives in W's state at every granularity (W owns the class rows and is the
    # group's first param, which holds the global alpha); b has its own only element-wise.
    assert tuple(fgh.state[w]["alpha"].shape) == ALPHA_SHAPE[granularity]
    assert ("alpha" in fgh.state[b]) == (granularity == "element")
    # The optimizer receives alpha * g2.
    torch.testing.assert_close(w.grad.cpu(), alpha_w * G2_W, atol=1e-6, rtol=0)
    torch.testing.assert_close(b.grad.cpu(), alpha_b * G2_B, atol=1e-6, rtol=0)
    assert fgh.num_steps == 2


@pytest.mark.parametrize("foreach", [False, True])
def test_previous_signal_is_the_raw_gradient(foreach):
    w, b, fgh, opt = _tiny("element", "grad", foreach)
    _drive(w, b, fgh, opt, [(G1_W, G1_B), (G2_W, G2_B), (G2_W, G2_B)])
    # Step 3 pairs g3 = g2 with the RAW g2 (not alpha * g2): h = g2 * g2 = W [[1,1],[1,1]], b [1,1]
    # alpha_3 = alpha_2 + 0.1 = W [[1.2, 1.0], [0.6, 0.9]], b [1.2, 1.2]
    torch.testing.assert_close(
        fgh.coefficients()["W"], T([[1.2, 1.0], [0.6, 0.9]]), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(fgh.coefficients()["b"], T([1.2, 1.2]), atol=1e-6, rtol=0)
    torch.testing.assert_close(w.grad, T([[1.2, -1.0], [-0.6, -0.9]]), atol=1e-6, rtol=0)


# The appendix's Adam algorithm over three steps, worked by hand. One class of a final layer:
# W [1, 1] and b [1], so the class row (the appendix's cat([W, b])) holds two entries,
# (W, b). betas = (0.5, 0.5), eps = 0, gamma = 0.1.
#   g1 = (0.5, -2),  g2 = (1, -5),  g3 = (-1, -1)
# step 1: prev_grad is None: store the RAW g1 = (0.5, -2); m = v = 0; no update; grad unchanged.
# step 2 (count 1): m = 0.5 * 0 + 0.5 * g2 = (0.5, -2.5);  v = 0.5 * g2^2 = (0.5, 12.5)
#         m_hat = m / (1 - 0.5) = (1, -5);  v_hat = v / 0.5 = (1, 25)
#         c2 = m_hat / sqrt(v_hat) = (1/1, -5/5) = (1, -1)
#         h2 = c2 * g1 = (0.5, 2)
#         element: alpha = 1 + 0.1 h2 = (1.05, 1.2);       grad = alpha * g2 = (1.05, -6)
#         class:   alpha = 1 + 0.1 (0.5 + 2) = 1.25;       grad = 1.25 * g2 = (1.25, -6.25)
#         prev = c2 = (1, -1)
# step 3 (count 2): m = 0.5 (0.5, -2.5) + 0.5 (-1, -1) = (-0.25, -1.75)
#         v = 0.5 (0.5, 12.5) + 0.5 (1, 1) = (0.75, 6.75)
#         m_hat = m / (1 - 0.25) = (-1/3, -7/3);  v_hat = v / 0.75 = (1, 9)
#         c3 = (-1/3, -7/9);  h3 = c3 * c2 = (-1/3, 7/9)
#         element: alpha = (1.05 - 0.1/3, 1.2 + 0.7/9) = (1.016667, 1.277778)
#                  grad = alpha * g3 = (-1.016667, -1.277778)
#         class:   alpha = 1.25 + 0.1 (-1/3 + 7/9) = 1.25 + 0.4/9 = 1.294444
#                  grad = (-1.294444, -1.294444)
#         prev = c3 = (-1/3, -7/9)
# (Moments from step 1 with c1 = sign(g1) stored instead would give h2[W] = sign(0.5) *
#  (5/6) / sqrt(3/4) = 0.962, not 0.5: the first hypergradient ignored g1's size.)
ADAM_GRADS = [(0.5, -2.0), (1.0, -5.0), (-1.0, -1.0)]
ADAM_EXPECTED = {  # per step: (alpha W, alpha b, grad W, grad b, m, v, step count, prev)
    "element": [
        (1.0, 1.0, 0.5, -2.0, (0.0, 0.0), (0.0, 0.0), 0, (0.5, -2.0)),
        (1.05, 1.2, 1.05, -6.0, (0.5, -2.5), (0.5, 12.5), 1, (1.0, -1.0)),
        (
            1.05 - 0.1 / 3,
            1.2 + 0.7 / 9,
            -(1.05 - 0.1 / 3),
            -(1.2 + 0.7 / 9),
            (-0.25, -1.75),
            (0.75, 6.75),
            2,
            (-1 / 3, -7 / 9),
        ),
    ],
    "class": [
        (1.0, 1.0, 0.5, -2.0, (0.0, 0.0), (0.0, 0.0), 0, (0.5, -2.0)),
        (1.25, 1.25, 1.25, -6.25, (0.5, -2.5), (0.5, 12.5), 1, (1.0, -1.0)),
        (
            1.25 + 0.4 / 9,
            1.25 + 0.4 / 9,
            -(1.25 + 0.4 / 9),
            -(1.25 + 0.4 / 9),
            (-0.25, -1.75),
            (0.75, 6.75),
            2,
            (-1 / 3, -7 / 9),
        ),
    ],
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("granularity", ["element", "class"])
def test_adam_direction_three_steps_by_hand(granularity, foreach):
    w, b = nn.Parameter(torch.zeros(1, 1)), nn.Parameter(torch.zeros(1))
    fgh = FineGrainedHypergradients(
        [("W", w), ("b", b)],
        granularity=granularity,
        direction="adam",
        gamma=0.1,
        betas=(0.5, 0.5),
        eps=0.0,
        foreach=foreach,
    )
    for (gw, gb), expected in zip(ADAM_GRADS, ADAM_EXPECTED[granularity]):
        alpha_w, alpha_b, grad_w, grad_b, m, v, count, prev = expected
        w.grad, b.grad = T([[gw]]), T([gb])
        fgh.step()
        coeffs = fgh.coefficients()
        torch.testing.assert_close(coeffs["W"], T([[alpha_w]]), atol=1e-6, rtol=0)
        torch.testing.assert_close(coeffs["b"], T([alpha_b]), atol=1e-6, rtol=0)
        torch.testing.assert_close(w.grad, T([[grad_w]]), atol=1e-6, rtol=0)
        torch.testing.assert_close(b.grad, T([grad_b]), atol=1e-6, rtol=0)
        for param, i in ((w, 0), (b, 1)):
            state = fgh.state[param]
            torch.testing.assert_close(state["m"].flatten(), T([m[i]]), atol=1e-6, rtol=0)
            torch.testing.assert_close(state["v"].flatten(), T([v[i]]), atol=1e-6, rtol=0)
            torch.testing.assert_close(state["prev"].flatten(), T([prev[i]]), atol=1e-6, rtol=0)
            assert state["step"] == count


# --------------------------------------------------------------------------- single behaviours


def _vector_fgh(**options):
    p = nn.Parameter(torch.zeros(2))
    return p, FineGrainedHypergradients([("p", p)], **options)


def _steps(p, fgh, *grads) -> None:
    for g in grads:
        p.grad = T(g)
        fgh.step()


def test_sign_agreeing_gradients_grow_alpha_disagreeing_shrink_it():
    p, fgh = _vector_fgh(gamma=0.1)
    _steps(p, fgh, [1.0, -1.0], [2.0, 2.0])
    # h = [1*2, -1*2] = [2, -2] -> alpha = [1.2, 0.8]
    torch.testing.assert_close(fgh.state[p]["alpha"], T([1.2, 0.8]))
    torch.testing.assert_close(p.grad, T([2.4, 1.6]))


def test_clamp_both_bounds():
    p, fgh = _vector_fgh(gamma=1.0, clamp=(0.5, 1.5))
    _steps(p, fgh, [1.0, 1.0], [3.0, -3.0])
    # 1 + 3 = 4 -> 1.5;  1 - 3 = -2 -> 0.5;  grads [3 * 1.5, -3 * 0.5]
    assert torch.equal(fgh.state[p]["alpha"], T([1.5, 0.5]))
    assert torch.equal(p.grad, T([4.5, -1.5]))
    # Default clamp (0, 10): 1 + 4*4 = 17 -> 10;  1 + 1*(-3) = -2 -> 0 (alpha never negative)
    p, fgh = _vector_fgh(gamma=1.0)
    _steps(p, fgh, [4.0, 1.0], [4.0, -3.0])
    assert torch.equal(fgh.state[p]["alpha"], T([10.0, 0.0]))
    assert torch.equal(p.grad, T([40.0, 0.0]))


@pytest.mark.parametrize("granularity", ["element", "global"])
def test_first_step_leaves_gradient_and_alpha_alone(granularity):
    p, fgh = _vector_fgh(granularity=granularity, direction="adam")
    _steps(p, fgh, [2.0, -4.0])
    assert torch.equal(p.grad, T([2.0, -4.0]))
    assert torch.equal(fgh.coefficients()["p"], T([1.0, 1.0]))
    # Appendix algorithm: the raw g1 is stored as the previous signal; the moments wait for step 2.
    state = fgh.state[p]
    assert torch.equal(state["prev"], T([2.0, -4.0]))
    assert state["step"] == 0
    assert torch.equal(state["m"], T([0.0, 0.0])) and torch.equal(state["v"], T([0.0, 0.0]))


def test_coefficients_does_not_create_state():
    w, b = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    fgh = FineGrainedHypergradients([("W", w), ("b", b)], granularity="class", direction="adam")
    w.grad = G1_W.clone()  # the bias has no gradient
    fgh.step()
    coeffs = fgh.coefficients()
    assert torch.equal(coeffs["b"], torch.ones(2)) and torch.equal(coeffs["W"], torch.ones(2, 2))
    assert len(fgh.state) == 1 and w in fgh.state


def test_gamma_none_resolves_per_direction():
    p = nn.Parameter(torch.zeros(2))
    assert FineGrainedHypergradients([("p", p)]).param_groups[0]["gamma"] == 1.0
    fgh = FineGrainedHypergradients([("p", p)], direction="adam")
    assert fgh.param_groups[0]["gamma"] == 1e-3
    assert fgh.defaults["gamma"] is None


def test_params_without_grad_are_skipped_and_keep_their_state():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    fgh = FineGrainedHypergradients([("a", a), ("b", b)], gamma=0.1, direction="adam")
    a.grad, b.grad = T([1.0, 1.0]), T([1.0, 1.0])
    fgh.step()
    before = copy.deepcopy(fgh.state[b])
    a.grad, b.grad = T([1.0, 1.0]), None
    fgh.step()
    assert fgh.state[a]["step"] == 1 and fgh.state[b]["step"] == 0  # moment updates
    for field in ("m", "v", "prev", "alpha"):
        assert torch.equal(fgh.state[b][field], before[field])


@pytest.mark.parametrize("foreach", [False, True])
def test_non_finite_hypergradients_are_skipped_and_counted(foreach):
    p, fgh = _vector_fgh(gamma=0.1, foreach=foreach)
    _steps(p, fgh, [1.0, 1.0], [math.nan, 2.0])
    # h = [nan, 2]: entry 0 skipped, entry 1 -> 1.2
    assert torch.equal(fgh.state[p]["alpha"], T([1.0, 1.2]))
    _steps(p, fgh, [math.inf, 1.0])
    # h = [inf * nan = nan, 1 * 2 = 2] -> [1.0, 1.4]
    torch.testing.assert_close(fgh.state[p]["alpha"], T([1.0, 1.4]))
    assert fgh.num_skipped.dtype == torch.int64 and int(fgh.num_skipped) == 2
    # A block alpha (global) skips its whole non-finite sum: h = nan*1 + 2*1 = nan -> alpha stays 1.
    p, fgh = _vector_fgh(gamma=0.1, granularity="global", foreach=foreach)
    _steps(p, fgh, [1.0, 1.0], [math.nan, 2.0])
    assert torch.equal(fgh.state[p]["alpha"], T(1.0))
    assert int(fgh.num_skipped) == 1


def test_class_grad_norms_by_hand():
    w, b = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))
    w.grad, b.grad = T([[3.0, 0.0], [1.0, 2.0]]), T([4.0, 2.0])
    # row 0: sqrt(9 + 0 + 16) = 5;  row 1: sqrt(1 + 4 + 4) = 3;  without bias: [3, sqrt(5)]
    torch.testing.assert_close(class_grad_norms(w, b), T([5.0, 3.0]))
    torch.testing.assert_close(class_grad_norms(w), T([3.0, math.sqrt(5.0)]))
    # After a class-wise FGH step with the same gradient twice (gamma=0.1):
    # h_0 = 9 + 0 + 16 = 25 -> alpha 3.5;  h_1 = 1 + 4 + 4 = 9 -> 1.9;  norms [5 * 3.5, 3 * 1.9]
    fgh = FineGrainedHypergradients([("W", w), ("b", b)], granularity="class", gamma=0.1)
    fgh.step()
    w.grad, b.grad = T([[3.0, 0.0], [1.0, 2.0]]), T([4.0, 2.0])
    fgh.step()
    torch.testing.assert_close(class_grad_norms(w, b), T([17.5, 5.7]))
    with pytest.raises(ValueError, match="2-D"):
        class_grad_norms(b)


def test_element_mode_memory_is_two_floats_per_trainable_scalar():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    model[0].bias.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    fgh = FineGrainedHypergradients(model.named_parameters())
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        fgh.step()
        opt.step()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # 20 + 12 + 3 = 35
    stored = sum(v.numel() for s in fgh.state.values() for v in s.values() if torch.is_tensor(v))
    assert trainable == 35
    assert stored == 2 * trainable
    assert {field for s in fgh.state.values() for field in s} == {"alpha", "prev"}


# --------------------------------------------------------------------------- real models


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _make_fgh(model: nn.Module, granularity: str, **options) -> FineGrainedHypergradients:
    """class granularity needs the final layer in its own group; the rest goes element-wise."""
    named = list(model.named_parameters())
    if granularity != "class":
        return FineGrainedHypergradients(named, granularity=granularity, **options)
    groups = [
        {"params": [(n, p) for n, p in named if not n.startswith("2.")], "granularity": "element"},
        {"params": [(n, p) for n, p in named if n.startswith("2.")], "granularity": "class"},
    ]
    return FineGrainedHypergradients(groups, **options)


def _batches(n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(10, 6, generator=gen), torch.randint(0, 3, (10,), generator=gen))
        for _ in range(n)
    ]


def _train(model, opt, fgh, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if fgh is not None:
            fgh.step()
        opt.step()


@pytest.mark.parametrize("direction", ["grad", "adam"])
@pytest.mark.parametrize("granularity", ["element", "class", "global"])
def test_gamma_zero_is_plain_adam(granularity, direction):
    batches = _batches(5)
    ref = _model()
    _train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), None, batches)

    # alpha stays exactly 1, so gradients are multiplied by 1: bit for bit.
    model = _model()
    fgh = _make_fgh(model, granularity, gamma=0.0, direction=direction)
    _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), fgh, batches)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


ROUND_TRIP_MODES = [("element", "grad"), ("class", "adam"), ("global", "adam")]


@pytest.mark.parametrize(("granularity", "direction"), ROUND_TRIP_MODES)
def test_state_dict_round_trip_continues_identically(granularity, direction):
    options = {"gamma": 0.05, "direction": direction}
    batches = _batches(6)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    fgh = _make_fgh(model, granularity, **options)
    _train(model, opt, fgh, batches[:3])

    buffer = io.BytesIO()
    torch.save({"fgh": fgh.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(saved["opt"])
    twin_fgh = _make_fgh(twin, granularity, gamma=0.9)  # options come from the state_dict
    twin_fgh.load_state_dict(saved["fgh"])
    assert twin_fgh.param_groups[-1]["gamma"] == 0.05 and twin_fgh.num_steps == 3

    _train(model, opt, fgh, batches[3:])
    _train(twin, twin_opt, twin_fgh, batches[3:])
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    for name, alpha in fgh.coefficients().items():
        assert torch.equal(alpha, twin_fgh.coefficients()[name])
    assert not torch.equal(fgh.coefficients()["2.weight"], torch.ones(3, 5))  # alpha did move


def test_state_is_keyed_by_parameter_and_saved_by_position():
    model = _model()
    fgh = _make_fgh(model, "class", direction="adam", gamma=0.05)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), fgh, _batches(2))
    layer0_w, layer0_b, head_w, head_b = model.parameters()
    assert all(p in fgh.state for p in (layer0_w, layer0_b, head_w, head_b))
    assert tuple(fgh.state[head_w]["alpha"].shape) == (3,) and "alpha" not in fgh.state[head_b]

    saved = fgh.state_dict()
    # torch.optim's layout: params numbered across groups in order, state keyed by position.
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2, 3]]
    assert [g["names"] for g in saved["param_groups"]] == [
        ["0.weight", "0.bias"],
        ["2.weight", "2.bias"],
    ]
    assert sorted(saved["state"]) == [0, 1, 2, 3]
    assert saved["state"][2]["alpha"] is fgh.state[head_w]["alpha"]  # references, like torch
    assert saved["state"][0]["step"] == 1  # two steps: one moment update

    # Names are metadata: a model with other names but the same layout loads, by position, and
    # the tensors are cast to each parameter's dtype.
    twin = _model().double()
    renamed = [(f"x.{n}", p) for n, p in twin.named_parameters()]
    loaded = FineGrainedHypergradients(
        [{"params": renamed[:2]}, {"params": renamed[2:], "granularity": "class"}]
    )
    loaded.load_state_dict(saved)
    twin_head_w = list(twin.parameters())[2]
    assert loaded.state[twin_head_w]["alpha"].dtype == torch.float64
    assert loaded.state[twin_head_w]["alpha"] is not fgh.state[head_w]["alpha"]  # a copy
    torch.testing.assert_close(
        loaded.coefficients()["x.2.weight"], fgh.coefficients()["2.weight"].double()
    )
    assert loaded.param_groups[1]["direction"] == "adam" and loaded.param_groups[1]["gamma"] == 0.05


def test_load_state_dict_rejects_mismatches():
    model = _model()
    fgh = FineGrainedHypergradients(model.named_parameters())
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), fgh, _batches(2))
    saved = fgh.state_dict()

    torch.manual_seed(0)
    wider = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    with pytest.raises(ValueError, match=r"state\[0\]\['alpha'\] has shape \(5, 6\)"):
        FineGrainedHypergradients(wider.named_parameters()).load_state_dict(saved)

    fewer = [(n, p) for n, p in _model().named_parameters() if n != "2.bias"]
    with pytest.raises(ValueError, match="param group 0 has 3 params but the state_dict's has 4"):
        FineGrainedHypergradients(fewer).load_state_dict(saved)

    two_groups = _make_fgh(_model(), "class")
    with pytest.raises(ValueError, match="2 param groups"):
        FineGrainedHypergradients(_model().named_parameters()).load_state_dict(
            two_groups.state_dict()
        )


@pytest.mark.parametrize(("granularity", "direction"), MODES)
def test_foreach_matches_single_tensor_reference(granularity, direction, device):
    assert _foreach_and_single_tensor_runs(granularity, direction, device)


def _foreach_and_single_tensor_runs(granularity, direction, device="cpu"):
    """Drive the single-tensor and the foreach path alike and check they agree bit for bit."""
    gen = torch.Generator().manual_seed(3)
    shapes = {"fc.weight": (3, 4), "fc.bias": (3,), "e": (2, 3), "f": (4,)}
    grads = [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(4)]
    grads[1]["f"] = None  # a param without gradient for one step
    runs = []
    for foreach in (False, True):
        params = {n: nn.Parameter(torch.zeros(s, device=device)) for n, s in shapes.items()}
        fc = [(n, params[n]) for n in ("fc.weight", "fc.bias")]
        rest = [(n, params[n]) for n in ("e", "f")]
        fgh = FineGrainedHypergradients(
            [
                {"params": fc, "granularity": granularity},
                {
                    "params": rest,
                    "granularity": "global" if granularity == "class" else granularity,
                },
            ],
            gamma=0.5 if direction == "grad" else 0.05,
            direction=direction,
            foreach=foreach,
        )
        opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
        trace = []
        for step_grads in grads:
            for n, g in step_grads.items():
                params[n].grad = None if g is None else g.to(device, copy=True)
            fgh.step()
            opt.step()
            trace.append([p.detach().clone() for p in params.values()])
            trace.append([p.grad.clone() for p in params.values() if p.grad is not None])
            trace.append([alpha.clone() for alpha in fgh.coefficients().values()])
        trace.append([v for s in fgh.state.values() for v in s.values() if torch.is_tensor(v)])
        runs.append(trace)
    single, fast = runs
    assert len(single) == len(fast)
    for a, b in zip(single, fast):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert not torch.equal(single[-2][0].cpu(), torch.ones(3, 4))  # alpha did move
    return True


def test_foreach_path_runs_where_torch_lacks_foreach_copy(monkeypatch):
    """A torch without ``_foreach_copy_``: the foreach path falls back to one copy_ per tensor and
    still equals the single-tensor path (raising=False: not every torch version has it)."""
    monkeypatch.delattr(torch, "_foreach_copy_", raising=False)
    assert _foreach_and_single_tensor_runs("element", "adam")
    assert _foreach_and_single_tensor_runs("class", "grad")


# --------------------------------------------------------------------------- API and errors


def test_docstring_example_runs():
    doc = fgh_module.__doc__
    start = doc.index("Example (plain PyTorch, no PILOT)::")
    block = doc[start:].split("\n\n")[1]
    code = "\n".join(line[4:] for line in block.splitlines())
    assert "fgh.step(); opt.step()" in code
    namespace = {"torch": torch, "FineGrainedHypergradients": FineGrainedHypergradients}
    namespace["x"] = torch.randn(8, 10)
    exec(code, namespace)
    fgh, model = namespace["fgh"], namespace["model"]
    assert fgh.num_steps == 1
    assert len(fgh.state) == 2 and model.weight in fgh.state and model.bias in fgh.state
    assert torch.equal(fgh.state[model.weight]["alpha"], torch.ones(3, 10))  # first step
    assert model.weight.grad is not None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"granularity": "row"}, "valid choices: element, class, global"),
        ({"granularity": "tensor"}, "valid choices: element, class, global"),
        ({"direction": "sgd"}, "valid choices: grad, adam"),
        ({"apply": "update"}, "valid choices: grad"),
        ({"clamp": (1.0, 1.0)}, "0 <= lo < hi"),
        ({"clamp": (-0.5, 1.0)}, "0 <= lo < hi"),
        ({"clamp": (0.0, math.inf)}, r"clamp\[1\] is inf, not a finite number; write null"),
        ({"clamp": (0.0, math.nan)}, r"clamp\[1\] is nan"),
        ({"clamp": (math.inf, None)}, r"clamp\[0\] is inf"),
        ({"clamp": (2.0, 1.0)}, r"\[lo, null\] for no upper bound"),
        ({"clamp": (0.0,)}, "pair"),
        ({"gamma": -1.0}, ">= 0"),
        ({"betas": (0.9, 1.0)}, r"\[0, 1\)"),
    ],
)
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        FineGrainedHypergradients(nn.Linear(2, 2).named_parameters(), **options)


def test_the_keyword_defaults_are_the_options_modules():
    """A config's missing FGH options are filled from ``fgh_options.DEFAULTS``
    (``validate_options``); the component's own keyword defaults must be the same values."""
    from pilot_online.core.fgh_options import DEFAULTS, validate_options

    assert FineGrainedHypergradients.__init__.__kwdefaults__ == DEFAULTS
    assert validate_options()["clamp"] == (0.0, 10.0) and validate_options()["gamma"] == 1.0


def test_bad_params_raise():
    with pytest.raises(TypeError, match="named_parameters"):
        FineGrainedHypergradients(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="no parameters"):
        FineGrainedHypergradients([])
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="more than one group"):
        FineGrainedHypergradients([{"params": [("p", p)]}, {"params": [("q", p)]}])
    with pytest.raises(ValueError, match="unknown param group option"):
        FineGrainedHypergradients([{"params": [("p", p)], "lr": 0.1}])
    two_layers = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    with pytest.raises(ValueError, match="exactly one 2-D weight"):
        FineGrainedHypergradients(two_layers.named_parameters(), granularity="class")


def test_reset_state_makes_the_next_step_a_first_step():
    # Element mode, gamma 1. Step 1 on a and b stores g1; step 2 pairs: alpha = 1 + g2 * g1.
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    fgh = FineGrainedHypergradients([("a", a), ("b", b)], gamma=1.0)
    for grads in ([[1.0, 2.0], [3.0]], [[0.5, 0.5], [1.0]]):
        a.grad, b.grad = torch.tensor(grads[0]), torch.tensor(grads[1])
        fgh.step()
    assert fgh.coefficients()["a"].tolist() == [1.5, 2.0]  # 1 + .5*1, 1 + .5*2
    assert fgh.coefficients()["b"].tolist() == [4.0]  # 1 + 1*3
    fgh.reset_state([a])  # a was restarted (as oLoRA's fresh adapter); b keeps its history
    a.grad, b.grad = torch.tensor([2.0, 2.0]), torch.tensor([1.0])
    fgh.step()
    # a: a first step again: alpha back to 1, untouched; its raw gradient is stored, unscaled.
    assert fgh.coefficients()["a"].tolist() == [1.0, 1.0] and a.grad.tolist() == [2.0, 2.0]
    assert fgh.state[a]["prev"].tolist() == [2.0, 2.0]
    # b: paired with its previous gradient 1: alpha 4 + 1*1 = 5, gradient scaled to 5.
    assert fgh.coefficients()["b"].tolist() == [5.0] and b.grad.tolist() == [5.0]


def test_reset_state_keeps_a_shared_class_alpha():
    layer = nn.Linear(2, 2)
    fgh = FineGrainedHypergradients(layer.named_parameters(), granularity="class")
    for _ in range(2):
        layer.weight.grad, layer.bias.grad = torch.ones(2, 2), torch.ones(2)
        fgh.step()
    alpha = fgh.state[layer.weight]["alpha"]  # per row: 1 + (1*1 + 1*1 + 1*1) = 4
    assert alpha.tolist() == [4.0, 4.0]
    fgh.reset_state([layer.weight])
    assert fgh.state[layer.weight]["alpha"].tolist() == [4.0, 4.0]
    assert "prev" not in fgh.state[layer.weight]

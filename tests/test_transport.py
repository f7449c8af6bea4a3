"""``core/transport.py``: the Sinkhorn plan against hand-worked cases and POT's ``ot.sinkhorn``
(the solver upstream's ``models/coil.py`` calls), and COIL's prospective rows by hand."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import import_pot

from pilot_online.core.transport import prospective_rows, sinkhorn

F64 = torch.float64


def uniform(n: int, mass: float = 1.0) -> torch.Tensor:
    return torch.full((n,), mass / n, dtype=F64)


def test_the_2x2_plan_by_hand():
    """Marginals (1/2, 1/2), cost [[0, 1], [1, 0]]: by symmetry the plan is K scaled to the
    marginals, diagonal 1 / (2 (1 + e)) and off-diagonal e / (2 (1 + e)), e = exp(-1 / reg)."""
    reg = 0.5
    e = math.exp(-1 / reg)
    plan = sinkhorn(uniform(2), uniform(2), torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=F64), reg)
    diagonal, off = 1 / (2 * (1 + e)), e / (2 * (1 + e))
    expected = torch.tensor([[diagonal, off], [off, diagonal]], dtype=F64)
    torch.testing.assert_close(plan, expected, rtol=1e-12, atol=0)


def test_a_lone_target_takes_every_source_whole_mass():
    """One column: the plan's rows sum to ``a``, so the column is ``a`` whatever the costs (and
    whatever ``b``): COIL's transport of one new class alone ignores the class means."""
    cost = torch.tensor([[0.1], [1.7], [0.4]], dtype=F64)
    a = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    plan = sinkhorn(a, torch.tensor([1 / 3], dtype=F64), cost, 0.464)
    torch.testing.assert_close(plan[:, 0], a, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("old", "new", "reg", "unbalanced"),
    [
        (4, 4, 0.464, False),  # COIL's first transport: as many new classes as old
        (8, 4, 0.464, True),  # later ones: b has mass new/old, all 1000 iterations run
        (5, 7, 0.05, False),
        (3, 3, 0.01, False),
    ],
)
def test_the_plan_is_pots(old, new, reg, unbalanced):
    ot = import_pot("this test checks our Sinkhorn against POT's ot.sinkhorn")
    generator = torch.Generator().manual_seed(old * 10 + new)
    cost = 2 * torch.rand(old, new, generator=generator, dtype=F64)
    a, b = uniform(old), uniform(new, new / old if unbalanced else 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # POT warns that the unbalanced case did not converge
        theirs = ot.sinkhorn(a, b, cost, reg)
    ours = sinkhorn(a, b, cost, reg)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-15)
    if unbalanced:
        torch.testing.assert_close(ours.sum(1), a, rtol=1e-12, atol=0)
        assert (ours.sum(0) - b).abs().max() > 1e-3  # never reaches b: no convergence


def test_a_numerical_breakdown_keeps_the_last_good_step_as_pot():
    """A column of costs far above ``reg``: ``exp(-cost / reg)`` underflows to 0, ``K^T u`` has a
    zero at the first step, and POT keeps its starting ``u``, ``v`` (and warns)."""
    ot = import_pot("this test checks our Sinkhorn against POT's ot.sinkhorn")
    cost = torch.tensor([[0.1, 900.0], [0.2, 800.0]], dtype=F64)
    a, b = uniform(2), uniform(2)
    with pytest.warns(UserWarning, match="numerical errors"):
        theirs = ot.sinkhorn(a, b, cost, 0.5)
    ours = sinkhorn(a, b, cost, 0.5)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    kernel = torch.exp(-cost / 0.5)
    torch.testing.assert_close(ours, kernel / 4, rtol=1e-15, atol=0)  # u = v = 1/2


def test_bad_shapes_and_reg_are_refused():
    with pytest.raises(ValueError, match=r"cost must be \[n, m\]"):
        sinkhorn(uniform(2), uniform(3), torch.zeros(2, 2, dtype=F64), 0.5)
    with pytest.raises(ValueError, match="reg must be > 0"):
        sinkhorn(uniform(2), uniform(2), torch.zeros(2, 2, dtype=F64), 0.0)


def test_prospective_rows_by_hand():
    """Old classes with unit means e1, e2 and rows (2, 0), (0, 1); new classes with means e1, e2.
    The cdist costs (p = 3) are 0 on the diagonal and 2^(1/3) off it, the marginals 1/2: the plan
    is [[p, q], [q, p]] as in the 2x2 case. The rows are ``2 T^T normalize(W)``: (2p, 2q) and
    (2q, 2p), of norm 2 sqrt(p^2 + q^2), calibrated to the old rows' mean norm 1.5."""
    reg = 0.464
    e = math.exp(-(2 ** (1 / 3)) / reg)
    p, q = 1 / (2 * (1 + e)), e / (2 * (1 + e))
    eye = torch.eye(2, dtype=F64)
    old_rows = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=F64)
    rows, gamma = prospective_rows(eye, eye, old_rows, reg, p=3.0)
    expected_gamma = 1.5 / (2 * math.sqrt(p * p + q * q))
    assert gamma.item() == pytest.approx(expected_gamma, rel=1e-12)
    expected = expected_gamma * torch.tensor([[2 * p, 2 * q], [2 * q, 2 * p]], dtype=F64)
    torch.testing.assert_close(rows, expected, rtol=1e-12, atol=0)
    assert rows.norm(dim=1).mean().item() == pytest.approx(1.5, rel=1e-12)


def test_prospective_rows_need_both_sides():
    with pytest.raises(ValueError, match="at least one old and one new class"):
        prospective_rows(torch.zeros(0, 2), torch.ones(1, 2), torch.zeros(0, 2), 0.5)

"""Entropic optimal transport between class means, and COIL's prospective transport of head rows.

COIL (Zhou et al., "Co-Transport for Class-Incremental Learning", ACM MM 2021; PILOT's
``models/coil.py``) moves classifier rows between classes by an optimal-transport plan between
their feature means. Upstream solves the plan with POT's ``ot.sinkhorn``; :func:`sinkhorn` is that
solver (method ``"sinkhorn"``, i.e. ``ot.bregman.sinkhorn_knopp``, with its defaults), so the
runtime needs no POT. :func:`prospective_rows` is upstream's ``Learner.solving_ot`` after its class
means are extracted: the plan from the old classes' means to the new classes', and the new rows it
carries over from the old rows.

Torch only. The problems are small (classes x classes), so the iteration is plain matrix-vector
products; it checks for numerical breakdown at every iteration and for convergence at every tenth,
as POT does, and each check reads a value back: run it on CPU tensors.
"""

from __future__ import annotations

from .lazy import F, torch

#: POT's ``ot.sinkhorn`` defaults.
MAX_ITERATIONS = 1000
STOP_THRESHOLD = 1e-9


def sinkhorn(
    a: torch.Tensor,
    b: torch.Tensor,
    cost: torch.Tensor,
    reg: float,
    max_iterations: int = MAX_ITERATIONS,
    stop_threshold: float = STOP_THRESHOLD,
) -> torch.Tensor:
    """The entropic OT plan ``diag(u) K diag(v)``, ``K = exp(-cost / reg)``, between the
    histograms ``a`` ``[n]`` and ``b`` ``[m]`` (POT's ``ot.sinkhorn(a, b, cost, reg)``).

    The same iteration as POT's Sinkhorn-Knopp: from ``u = 1/n``, ``v = 1/m``, each step sets
    ``v = b / K^T u``, then ``u = a / K v`` (so the returned plan's rows sum to ``a``); every tenth
    step (the first included) it stops once ``||v * K^T u - b|| < stop_threshold``. When a step
    breaks down numerically (a zero in ``K^T u``, a non-finite ``u`` or ``v``), the previous
    ``u``, ``v`` are kept and the iteration stops, as POT does. ``a`` and ``b`` need not have the
    same mass (COIL's do not): then the column marginals never reach ``b`` and all
    ``max_iterations`` steps run, as in POT. Computed in ``cost``'s dtype (POT's ``type_as=M``).
    """
    if cost.dim() != 2 or a.shape != cost.shape[:1] or b.shape != cost.shape[1:]:
        raise ValueError(
            f"cost must be [n, m] with a [n] and b [m]; got cost {tuple(cost.shape)}, "
            f"a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if not reg > 0:
        raise ValueError(f"reg must be > 0, got {reg}")
    a, b = a.to(cost.dtype), b.to(cost.dtype)
    kernel = torch.exp(cost / -reg)
    scaled = (1 / a).unsqueeze(1) * kernel  # diag(1/a) K: u = 1 / (scaled @ v) is a / (K v)
    u = torch.full_like(a, 1.0 / len(a))
    v = torch.full_like(b, 1.0 / len(b))
    for iteration in range(max_iterations):
        previous = u, v
        column = kernel.T @ u
        v = b / column
        u = 1.0 / (scaled @ v)
        broken = (column == 0).any() | ~torch.isfinite(u).all() | ~torch.isfinite(v).all()
        if broken:
            u, v = previous
            break
        if iteration % 10 == 0:
            marginal = v * (kernel.T @ u)
            if torch.linalg.vector_norm(marginal - b) < stop_threshold:
                break
    return u.unsqueeze(1) * kernel * v.unsqueeze(0)


def prospective_rows(
    old_means: torch.Tensor,
    new_means: torch.Tensor,
    old_rows: torch.Tensor,
    reg: float,
    p: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """COIL's prospective transport (upstream ``solving_ot``): head rows for new classes carried
    over from the old classes' rows, and the calibration factor applied to them.

    ``old_means`` ``[n, D]`` and ``new_means`` ``[m, D]``: the classes' (unit) feature means;
    ``old_rows`` ``[n, D]``: the old classes' head rows. The cost is ``cdist(old, new, p)``; the
    histograms are ``1/n`` on every old class and ``1/n`` on every new class (upstream's: the new
    side has mass ``m/n``), and the plan ``T`` is :func:`sinkhorn`'s. The rows are
    ``T^T normalize(old_rows) * n``, scaled by ``gamma = mean ||old row|| / mean ||row||`` so that
    they have the old rows' mean norm (upstream's ``calibration_term``). Returns
    ``(rows * gamma, gamma)``.

    One new class alone gets ``T = a`` whatever the costs (the plan's rows sum to ``a``): its row
    is the old rows' mean direction. The transport tells new classes apart only jointly.
    """
    old_count = old_means.shape[0]
    if old_count == 0 or new_means.shape[0] == 0:
        raise ValueError("the transport needs at least one old and one new class")
    cost = torch.cdist(old_means, new_means, p=p)
    a = cost.new_full((old_count,), 1.0 / old_count)
    b = cost.new_full((new_means.shape[0],), 1.0 / old_count)
    plan = sinkhorn(a, b, cost, reg)
    rows = plan.T @ F.normalize(old_rows.to(cost.dtype), dim=1) * old_count
    gamma = old_rows.to(cost.dtype).norm(dim=1).mean() / rows.norm(dim=1).mean()
    return rows * gamma, gamma

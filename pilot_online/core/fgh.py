"""Fine-Grained Hypergradients (FGH): learned gradient weights, updated online.

FGH keeps a coefficient ``alpha`` per scalar parameter (or per class row, tensor or group) and
learns it with the hypergradient of the loss w.r.t. that coefficient, which is the product of
consecutive gradients (paper Eq. 8)::

    alpha_{t+1} = clamp(alpha_t + gamma * g_t * g_{t-1}, lo, hi);    g_t <- alpha_{t+1} * g_t

It is a gradient transform, like ``clip_grad_norm_`` but stateful (STYLE rule 3): call
:meth:`FineGrainedHypergradients.step` between ``loss.backward()`` and ``optimizer.step()``
(after ``GradScaler.unscale_`` under AMP), and any ``torch.optim`` optimizer works unchanged.

Example (plain PyTorch, no PILOT)::

    model = torch.nn.Linear(10, 3); opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    fgh = FineGrainedHypergradients(model.named_parameters())
    loss = model(x).logsumexp(1).mean(); opt.zero_grad(); loss.backward()
    fgh.step(); opt.step()

Code shape (STYLE rules 1-2, after ``torch/optim/adam.py`` and ``optimizer.py``): ``_collect``
gathers the params that have a gradient and creates their state lazily; :func:`_single_tensor_step`
is the readable specification, one parameter at a time; :func:`_foreach_step` is the
``torch._foreach_*`` fast path, tested to give bit-identical results. State is keyed by parameter
and saved by position, as in ``torch.optim``. ``apply="update"`` (alpha scales the optimizer's
update instead of the gradient) reaches the optimizer only through the torch step hooks that
:meth:`FineGrainedHypergradients.register_optimizer_hooks` registers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from .checks import check_choice, check_real

logger = logging.getLogger(__name__)

__all__ = [
    "APPLIES",
    "DEFAULT_GAMMA",
    "DIRECTIONS",
    "GRANULARITIES",
    "FineGrainedHypergradients",
    "class_grad_norms",
    "validate_options",
]

GRANULARITIES = ("element", "class", "tensor", "global")
DIRECTIONS = ("grad", "adam")
APPLIES = ("grad", "update")
# gamma=None resolves per direction: raw-gradient products are tiny, so the paper uses gamma=1;
# Adam-normalised directions are O(1), so the appendix pseudo-code uses gamma=1e-3.
DEFAULT_GAMMA = {"grad": 1.0, "adam": 1e-3}
OPTION_KEYS = ("gamma", "granularity", "direction", "apply", "clamp", "betas", "eps", "foreach")
# Per-parameter state tensors ("step", an int, is the other field). A class or global alpha lives
# in the state of the parameter that owns it (the classifier weight; the group's first param).
_TENSOR_FIELDS = ("alpha", "prev", "m", "v", "u")


# --------------------------------------------------------------------------- validation


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    """Validate one group's options and return them normalised (gamma resolved, tuples)."""
    granularity = check_choice("granularity", options["granularity"], GRANULARITIES)
    direction = check_choice("direction", options["direction"], DIRECTIONS)
    apply = check_choice("apply", options["apply"], APPLIES)

    gamma = options["gamma"]
    gamma = DEFAULT_GAMMA[direction] if gamma is None else check_real("gamma", gamma)
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"gamma must be finite and >= 0 (0 disables learning), got {gamma}")

    lo, hi = _check_clamp(options["clamp"])

    betas = options["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2) in [0, 1), got {betas!r}")
    beta1, beta2 = check_real("betas[0]", betas[0]), check_real("betas[1]", betas[1])
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"betas must be a pair (beta1, beta2) in [0, 1), got {betas!r}")

    eps = check_real("eps", options["eps"])
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")

    foreach = options["foreach"]
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be None, True or False, got {foreach!r}")
    return {
        "gamma": gamma,
        "granularity": granularity,
        "direction": direction,
        "apply": apply,
        "clamp": (lo, hi),
        "betas": (beta1, beta2),
        "eps": eps,
        "foreach": foreach,
    }


def _check_clamp(clamp: Any) -> tuple[float, float | None]:
    """``(lo, hi)`` with finite 0 <= lo < hi, or ``(lo, None)``: no upper bound (JSON ``null``;
    the paper states only alpha > 0). Infinity is refused, so configs and results stay strict JSON.
    """
    usage = "clamp must be a pair [lo, hi] with 0 <= lo < hi, or [lo, null] for no upper bound"
    if not isinstance(clamp, (tuple, list)) or len(clamp) != 2:
        raise ValueError(f"{usage}, got {clamp!r}")
    lo = check_real("clamp[0]", clamp[0])
    hi = None if clamp[1] is None else check_real("clamp[1]", clamp[1])
    for index, bound in enumerate((lo, hi)):
        if bound is not None and not math.isfinite(bound):
            raise ValueError(
                f"clamp[{index}] is {bound}, not a finite number; write null (None) for "
                "'no upper bound', e.g. \"clamp\": [0.0, null], and a finite lower bound >= 0"
            )
    if not (0 <= lo and (hi is None or lo < hi)):
        raise ValueError(f"{usage}, got {clamp!r}")
    return lo, hi


def _check_class_group(names: list[str], params: list[Tensor]) -> None:
    """The class granularity needs one final layer: a 2-D weight [C, D] and an optional bias [C]."""
    weights = [p for p in params if p.ndim == 2]
    biases = [p for p in params if p.ndim == 1]
    ok = (
        len(weights) == 1
        and len(biases) <= 1
        and len(params) == len(weights) + len(biases)
        and all(b.shape[0] == weights[0].shape[0] for b in biases)
    )
    if not ok:
        shapes = {n: tuple(p.shape) for n, p in zip(names, params)}
        raise ValueError(
            "granularity='class' needs a group holding exactly one 2-D weight [C, D] and "
            f"optionally one 1-D bias [C] (the final layer), got {shapes}; put the classifier "
            "in its own group, e.g. {'params': model.fc.named_parameters(), "
            "'granularity': 'class'}"
        )


def _named_pairs(items: Iterable[Any], where: str) -> list[tuple[str, Tensor]]:
    pairs = []
    for item in items:
        if (
            not isinstance(item, (tuple, list))
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], Tensor)
        ):
            raise TypeError(
                f"{where} must hold (name, Parameter) pairs such as model.named_parameters(), "
                f"got {type(item).__name__}: {item!r:.80}"
            )
        pairs.append((item[0], item[1]))
    return pairs


# --------------------------------------------------------------------------- functional core


def _finite_or_zero_(hypergrad: Tensor, num_skipped: Tensor) -> Tensor:
    """Zero non-finite hypergradient entries in place and count them on the device (no sync).

    ``count_nonzero`` + ``nan_to_num_`` rather than a bool mask, ``sum`` and ``masked_fill_``:
    the same result in fewer passes over the tensor (bench_fgh.py measured the mask on CPU).
    """
    finite = torch.isfinite(hypergrad).count_nonzero()
    count = hypergrad.numel() - finite
    num_skipped.add_(count if count.device == num_skipped.device else count.to(num_skipped.device))
    return hypergrad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _sum_into_blocks(
    products: list[Tensor],
    alpha_views: list[Tensor],
    block_of: list[int],
    block_alphas: list[Tensor],
) -> dict[int, Tensor]:
    """Reduce each product c_t * partner to its alpha's shape and add up products sharing a block.

    element: identity; tensor/global: sum of all entries; class: weight rows summed, bias as is.
    Returns block index -> hypergradient shaped like ``block_alphas[index]``.
    """
    hypergrads: dict[int, Tensor] = {}
    for product, view, block in zip(products, alpha_views, block_of):
        contribution = product.sum_to_size(view.shape).view(block_alphas[block].shape)
        hypergrads[block] = (
            contribution if block not in hypergrads else hypergrads[block] + contribution
        )
    return hypergrads


def _upper(hi: float | None, alpha: Tensor) -> float:
    """The clamp's upper bound for ``alpha``. Without one, the square root of the dtype's largest
    value (1.8e19 in float32 and bfloat16): a safety net far above any coefficient measured
    (docs/fgh.md), at which ``alpha * g`` stays finite for every gradient below 1.8e19 and Adam's
    second moment at worst overflows to inf, which makes the step 0, never NaN."""
    return math.sqrt(torch.finfo(alpha.dtype).max) if hi is None else hi


def _single_tensor_step(
    grads: list[Tensor],
    partners: list[Tensor | None],
    alpha_views: list[Tensor],
    block_of: list[int],
    block_alphas: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[int],
    *,
    direction: str,
    apply: str,
    gamma: float,
    clamp: tuple[float, float | None],
    betas: tuple[float, float],
    eps: float,
    num_skipped: Tensor,
) -> list[Tensor] | None:
    """Reference FGH step (the specification), one parameter at a time.

    ``partners[i]`` is the previous signal c_{t-1} (apply="grad") or the previous update
    direction u_{t-1} (apply="update"); None on a parameter's first step, whose alpha is then
    left alone. ``alpha_views[i]`` is a view of ``block_alphas[block_of[i]]`` that broadcasts
    against parameter i. For direction="adam", ``steps[i]`` counts the moment updates including
    this one; it is only read for paired parameters. Returns the signals c_t to pair with next
    step (apply="grad"), or None (apply="update": the optimizer hook stores u_t instead).
    """
    lo, hi = clamp
    beta1, beta2 = betas
    # 1. The signal c_t: the raw gradient, or Adam's normalised direction of the raw gradient.
    #    As in the appendix algorithm, the moments start with the first pairing: a parameter's
    #    first step keeps its raw g_1 (to pair with at step 2) and leaves m, v untouched.
    signals = []
    for i, grad in enumerate(grads):
        if direction == "adam" and partners[i] is not None:
            exp_avgs[i].mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sqs[i].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = exp_avgs[i] / (1 - beta1 ** steps[i])
            v_hat = exp_avg_sqs[i] / (1 - beta2 ** steps[i])
            signals.append(m_hat / (v_hat.sqrt() + eps))
        else:
            signals.append(grad)
    # 2. Hypergradient h = c_t * partner, reduced to each block's alpha (Eq. 8's product).
    paired = [i for i, partner in enumerate(partners) if partner is not None]
    products = [signals[i] * partners[i] for i in paired]
    hypergrads = _sum_into_blocks(
        products, [alpha_views[i] for i in paired], [block_of[i] for i in paired], block_alphas
    )
    # 3. alpha <- clamp(alpha + gamma * h), with non-finite entries of h skipped.
    for block, hypergrad in hypergrads.items():
        hypergrad = _finite_or_zero_(hypergrad, num_skipped)
        alpha = block_alphas[block]
        alpha.add_(hypergrad, alpha=gamma).clamp_(lo, _upper(hi, alpha))
    if apply != "grad":
        return None
    # 4. Keep c_t for the next step (the RAW g_t on a first step or for direction="grad",
    #    saved before the scaling below).
    new_signals = [
        signal.clone() if partner is None else partner.copy_(signal)
        for signal, partner in zip(signals, partners)
    ]
    # 5. The optimizer receives alpha * g_t.
    for grad, view in zip(grads, alpha_views):
        grad.mul_(view)
    return new_signals


def _copy_all_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """``torch._foreach_copy_`` where this torch has it, else one ``copy_`` per tensor (the
    same values): the stated torch floor (setup.py) predates some foreach kernels."""
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is None:
        for target, source in zip(targets, sources):
            target.copy_(source)
    else:
        foreach_copy(targets, sources)


def _clone_all(tensors: list[Tensor]) -> list[Tensor]:
    """``torch._foreach_clone`` where this torch has it, else one ``clone`` per tensor."""
    foreach_clone = getattr(torch, "_foreach_clone", None)
    if foreach_clone is None:
        return [tensor.clone() for tensor in tensors]
    return list(foreach_clone(tensors))


def _foreach_step(
    grads: list[Tensor],
    partners: list[Tensor | None],
    alpha_views: list[Tensor],
    block_of: list[int],
    block_alphas: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[int],
    *,
    direction: str,
    apply: str,
    gamma: float,
    clamp: tuple[float, float | None],
    betas: tuple[float, float],
    eps: float,
    num_skipped: Tensor,
) -> list[Tensor] | None:
    """Same arithmetic as :func:`_single_tensor_step`, in ``torch._foreach_*`` kernels."""
    lo, hi = clamp
    beta1, beta2 = betas
    paired = [i for i, partner in enumerate(partners) if partner is not None]
    signals = list(grads)
    if direction == "adam" and paired:
        moments = [exp_avgs[i] for i in paired]
        squares = [exp_avg_sqs[i] for i in paired]
        paired_grads = [grads[i] for i in paired]
        torch._foreach_mul_(moments, beta1)
        torch._foreach_add_(moments, paired_grads, alpha=1 - beta1)
        torch._foreach_mul_(squares, beta2)
        torch._foreach_addcmul_(squares, paired_grads, paired_grads, value=1 - beta2)
        directions = torch._foreach_div(moments, [1 - beta1 ** steps[i] for i in paired])
        denoms = torch._foreach_div(squares, [1 - beta2 ** steps[i] for i in paired])
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, eps)
        torch._foreach_div_(directions, denoms)
        for i, direction_i in zip(paired, directions):
            signals[i] = direction_i

    if paired:
        products = torch._foreach_mul([signals[i] for i in paired], [partners[i] for i in paired])
        hypergrads = _sum_into_blocks(
            products,
            [alpha_views[i] for i in paired],
            [block_of[i] for i in paired],
            block_alphas,
        )
        blocks = list(hypergrads)
        # isfinite has no foreach kernel: one small loop over the (few) hypergradient tensors.
        finite = [_finite_or_zero_(hypergrads[block], num_skipped) for block in blocks]
        alphas = [block_alphas[block] for block in blocks]
        torch._foreach_add_(alphas, finite, alpha=gamma)
        torch._foreach_clamp_min_(alphas, lo)
        torch._foreach_clamp_max_(alphas, [_upper(hi, alpha) for alpha in alphas])
    if apply != "grad":
        return None

    if paired:
        _copy_all_([partners[i] for i in paired], [signals[i] for i in paired])
    new_signals = [
        signal.clone() if partner is None else partner for signal, partner in zip(signals, partners)
    ]
    torch._foreach_mul_(grads, alpha_views)
    return new_signals


def _single_tensor_rescale_update(
    params: list[Tensor], snapshots: list[Tensor], alpha_views: list[Tensor], lrs: list[float]
) -> list[Tensor]:
    """apply="update": p <- snapshot + alpha * (p - snapshot); return u = -(p - snapshot) / lr."""
    directions = []
    for param, snapshot, view, lr in zip(params, snapshots, alpha_views, lrs):
        delta = param - snapshot
        directions.append(torch.zeros_like(delta) if lr == 0 else delta / -lr)
        param.copy_(delta * view + snapshot)
    return directions


def _foreach_rescale_update(
    params: list[Tensor], snapshots: list[Tensor], alpha_views: list[Tensor], lrs: list[float]
) -> list[Tensor]:
    """Same arithmetic as :func:`_single_tensor_rescale_update`, in foreach kernels."""
    deltas = torch._foreach_sub(params, snapshots)
    moving = [i for i, lr in enumerate(lrs) if lr != 0]
    directions = [torch.zeros_like(delta) for delta in deltas]
    if moving:
        scaled = torch._foreach_div([deltas[i] for i in moving], [-lrs[i] for i in moving])
        for i, direction in zip(moving, scaled):
            directions[i] = direction
    torch._foreach_mul_(deltas, alpha_views)
    torch._foreach_add_(deltas, snapshots)
    _copy_all_(params, deltas)
    return directions


# --------------------------------------------------------------------------- the component


class FineGrainedHypergradients:
    """Learned gradient weights (paper Sec. "Fine-Grained Hypergradients", Eq. 8 and appendix).

    Shaped like a ``torch.optim`` optimizer: ``param_groups`` with defaults and
    ``add_param_group``; per-parameter ``state`` keyed by the parameter tensor itself; and
    ``state_dict``/``load_state_dict`` that save state by integer position, so a checkpoint
    loads into any model with the same parameter layout. Parameter names are metadata only:
    :meth:`coefficients` reports alphas by name (the results file's ``fgh.alpha``).

    Args:
        named_params: ``(name, Parameter)`` pairs (e.g. ``model.named_parameters()``; params with
            ``requires_grad=False`` are skipped), or dicts ``{"params": pairs, <option>: ...}``
            like torch.optim param groups.
        gamma: hypergradient step size (paper: gamma = beta * eta). None picks the direction's
            default: 1.0 for direction="grad" (the paper's default on raw gradients, whose
            products are tiny) and 1e-3 for direction="adam" (the appendix pseudo-code; Adam's
            normalised directions are O(1), so gamma=1 would hit the clamp in one step).
        granularity: what one alpha covers. "element" (Eq. 8, one per scalar), "class"
            (appendix: one per output row of the final layer, weight row and bias entry
            together; the group must hold only that layer), "tensor" (one per parameter
            tensor, Baydin-style) or "global" (one per group).
        direction: the signal c_t paired across steps. "grad": the raw gradient (Eq. 8).
            "adam": m_hat / (sqrt(v_hat) + eps) from Adam moments of the raw gradient, as the
            appendix algorithm runs it: a parameter's first step stores the raw g_1 and leaves
            the moments alone; the moments start at its second step (so h_2 = c_2 * g_1), and
            the bias correction counts the moment updates (1 at the second step).
        apply: "grad" (the paper): the optimizer receives alpha * g_t, and h = c_t * c_{t-1}.
            "update": alpha scales the optimizer's parameter update (a per-parameter learning
            rate, Baydin's Adam-HD); gradients are untouched, h = c_t * u_{t-1} with u the
            previous update direction (-delta / lr). Needs :meth:`register_optimizer_hooks`.
        clamp: (lo, hi), finite, 0 <= lo < hi, or (lo, None): no upper bound (the paper states
            only alpha > 0; docs/fgh.md). alpha is clamped after every update; it starts at 1
            (even outside the bounds, until its first update).
        betas, eps: Adam moments of direction="adam".
        foreach: use the ``torch._foreach_*`` path (None: yes).

    On a parameter's first step (nothing to pair with yet) alpha stays 1, the gradient is
    unchanged and the raw gradient is stored (apply="grad"). Params whose ``.grad`` is None are
    skipped, state untouched. Non-finite hypergradient entries are skipped (treated as 0) and
    counted in ``num_skipped``, a device tensor read without a host sync; alpha never becomes NaN.

    Alpha against the clamp: every :meth:`step` adds, per group, the mean coefficient and the
    fractions of coefficients equal to each clamp bound to device sums (no host sync);
    :meth:`alpha_bounds` returns them averaged over the steps, and the current values. They are
    part of :meth:`state_dict`, so a resumed run reports the same averages.

    Where alphas live: ``state[p]["alpha"]`` for element and tensor; the classifier weight's
    state holds the class alphas (shape [C], shared with the bias); the group's first
    parameter's state holds the global alpha.

    The optimizer hook (apply="update" only) is :meth:`register_optimizer_hooks`: it registers
    torch's public ``register_step_pre_hook``/``register_step_post_hook`` on the optimizer and
    returns their handles; ``optimizer.step`` itself is never replaced.

    Memory per trainable scalar: element/grad/grad holds exactly 2 floats (alpha and the
    previous raw gradient); direction="adam" adds m and v; apply="update" stores u instead of
    the previous signal (grad direction) and holds a transient snapshot of the parameters
    during ``optimizer.step()``. class/tensor/global alphas are C, 1 and 1 floats.

    AMP: call after ``scaler.unscale_(optimizer)``. On an overflow step the scaler skips
    ``optimizer.step()``, but FGH has already stored the non-finite gradient as its previous
    signal (and, for direction="adam", in its moments); the hypergradient entries it touches are
    then skipped and counted in ``num_skipped``, so watch that counter under fp16.
    """

    def __init__(
        self,
        named_params: Iterable[Any],
        *,
        gamma: float | None = None,
        granularity: str = "element",
        direction: str = "grad",
        apply: str = "grad",
        clamp: tuple[float, float | None] = (0.0, 10.0),
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        foreach: bool | None = None,
    ) -> None:
        self.defaults: dict[str, Any] = {
            "gamma": gamma,
            "granularity": granularity,
            "direction": direction,
            "apply": apply,
            "clamp": clamp,
            "betas": betas,
            "eps": eps,
            "foreach": foreach,
        }
        _check_options(self.defaults)  # fail early on bad defaults, even before any group
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Tensor, dict[str, Any]] = {}
        self.num_steps = 0
        self._hook_handles: tuple[RemovableHandle, ...] = ()
        self._pending: list[tuple[dict[str, Any], list[Tensor], list[Tensor], list[float]]] = []

        items = list(named_params)
        if not items:
            raise ValueError(
                "FineGrainedHypergradients got no parameters; pass model.named_parameters()"
            )
        if all(isinstance(item, dict) for item in items):
            groups = items
        elif any(isinstance(item, dict) for item in items):
            raise TypeError("named_params must be all (name, Parameter) pairs or all group dicts")
        else:
            groups = [{"params": items}]
        for group in groups:
            self.add_param_group(group)
        first = self.param_groups[0]["params"][0]
        self.num_skipped = torch.zeros((), dtype=torch.int64, device=first.device)
        # Alpha over the stream: per group, the sums over steps of [mean alpha, fraction of
        # coefficients at the clamp's lower bound, fraction at its upper bound] (float64 on the
        # device, no host sync per step); ``alpha_stream_steps`` steps were summed.
        self.alpha_stream_sums = torch.zeros(
            (len(self.param_groups), 3), dtype=torch.float64, device=first.device
        )
        # The largest alpha seen per group over the stream (every alpha starts at 1).
        self.alpha_stream_max = torch.ones(
            len(self.param_groups), dtype=torch.float64, device=first.device
        )
        self.alpha_stream_steps = 0

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for index, group in enumerate(self.param_groups):
            options = ", ".join(f"{k}={group[k]!r}" for k in OPTION_KEYS)
            lines.append(f"  group {index}: {len(group['params'])} params, {options}")
        return "\n".join([*lines, ")"])

    # ------------------------------------------------------------------ groups

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a group ``{"params": (name, Parameter) pairs, <option overrides>}``."""
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("a param group must be a dict with a 'params' entry of (name, param)")
        unknown = sorted(set(group) - {"params", *OPTION_KEYS})
        if unknown:
            raise ValueError(
                f"unknown param group option(s) {unknown}; valid: params, {', '.join(OPTION_KEYS)}"
            )
        pairs = _named_pairs(group["params"], "a param group's 'params'")
        pairs = [(name, p) for name, p in pairs if p.requires_grad]
        if not pairs:
            raise ValueError("a param group holds no parameter with requires_grad=True")
        options = _check_options({key: group.get(key, self.defaults[key]) for key in OPTION_KEYS})

        self._check_new(pairs)
        names, params = [n for n, _ in pairs], [p for _, p in pairs]
        if options["granularity"] == "class":
            _check_class_group(names, params)
        self.param_groups.append({"params": params, "names": names, **options})
        if hasattr(self, "alpha_stream_sums"):  # a group added after construction
            row = self.alpha_stream_sums.new_zeros((1, 3))
            self.alpha_stream_sums = torch.cat([self.alpha_stream_sums, row])
            self.alpha_stream_max = torch.cat([self.alpha_stream_max, row.new_ones(1)])

    def extend_group(self, index: int, named_params: Iterable[Any]) -> None:
        """Add ``(name, Parameter)`` pairs to group ``index``, as a method's new adapter joins the
        parameters FGH covers (``engine/loop.py``: parameters added at a firing). Their state is
        created at their first gradient (alpha 1), as for any parameter; the group count, and so
        the shape of :meth:`state_dict`, does not depend on how often parameters were added."""
        group = self.param_groups[index]
        if group["granularity"] == "class":
            raise ValueError("a class-wise group covers one final layer; it takes no parameters")
        # Every pair, frozen or not: a resume re-adds, in order, adapters the method has frozen
        # since (they get no gradient, so FGH never touches them).
        pairs = _named_pairs(named_params, "extend_group")
        self._check_new(pairs)
        for name, p in pairs:
            group["params"].append(p)
            group["names"].append(name)

    def _check_new(self, pairs: list[tuple[str, Tensor]]) -> None:
        """Each parameter, by identity and by name, in at most one group, once."""
        seen_ids = {id(p) for g in self.param_groups for p in g["params"]}
        seen_names = {n for g in self.param_groups for n in g["names"]}
        for name, p in pairs:
            if id(p) in seen_ids or name in seen_names:
                raise ValueError(f"parameter {name!r} appears in more than one group (or twice)")
            seen_ids.add(id(p))
            seen_names.add(name)

    # ------------------------------------------------------------------ the optimizer hook

    def register_optimizer_hooks(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[RemovableHandle, RemovableHandle]:
        """Hook apply="update" into ``optimizer.step()``; return the two torch hook handles.

        This is FGH's only contact with an optimizer, through torch's public step hooks:

        * pre-hook (``optimizer.register_step_pre_hook``): snapshot every apply="update"
          parameter that has a gradient and that the optimizer manages, with its group's lr;
        * post-hook (``optimizer.register_step_post_hook``): with ``delta = p - snapshot`` the
          optimizer's own update, set ``p <- snapshot + alpha * delta`` and store
          ``state[p]["u"] = -delta / lr``, the unscaled update direction the next
          :meth:`step` pairs with (0 for lr = 0).

        Call it once before training (the online loop's FGHMixin does). Calling it again (for
        a new optimizer) first removes the previous pair. To stop rescaling, call ``remove()``
        on both handles; :meth:`step` then raises for apply="update" groups.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"register_optimizer_hooks() needs a torch.optim.Optimizer, got {type(optimizer)!r}"
            )
        for handle in self._hook_handles:
            handle.remove()
        managed = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [
            n
            for g in self.param_groups
            if g["apply"] == "update"
            for n, p in zip(g["names"], g["params"])
            if id(p) not in managed
        ]
        if missing:
            logger.warning("FGH apply='update': the optimizer does not manage %s", missing)
        self._pending = []
        self._hook_handles = (
            optimizer.register_step_pre_hook(self._snapshot_before_step),
            optimizer.register_step_post_hook(self._rescale_after_step),
        )
        return self._hook_handles

    def _hooks_registered(self) -> bool:
        """Whether a handle from :meth:`register_optimizer_hooks` is still live (not removed)."""
        return any(handle.id in (handle.hooks_dict_ref() or {}) for handle in self._hook_handles)

    @torch.no_grad()
    def _snapshot_before_step(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> None:
        """Pre-hook of :meth:`register_optimizer_hooks`."""
        lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
        self._pending = []
        for group in self.param_groups:
            if group["apply"] != "update":
                continue
            params = [p for p in group["params"] if p.grad is not None and id(p) in lr_of]
            if not params:
                continue
            snapshots = (
                _clone_all(params)
                if group["foreach"] in (None, True)
                else [p.clone() for p in params]
            )
            lrs = [float(lr_of[id(p)]) for p in params]
            self._pending.append((group, params, snapshots, lrs))

    @torch.no_grad()
    def _rescale_after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Post-hook of :meth:`register_optimizer_hooks`."""
        pending, self._pending = self._pending, []
        for group, params, snapshots, lrs in pending:
            for p in params:  # alpha is 1 if fgh.step() never saw p
                self._ensure_state(group, p)
            views = [self._alpha_view(group, p) for p in params]
            rescale = (
                _single_tensor_rescale_update
                if group["foreach"] is False
                else _foreach_rescale_update
            )
            for p, direction in zip(params, rescale(params, snapshots, views, lrs)):
                self.state[p]["u"] = direction

    # ------------------------------------------------------------------ state

    def reset_state(self, params: Iterable[Tensor]) -> None:
        """Forget what FGH learned about ``params`` (a method restarted them, as oLoRA's fresh
        adapter after a merge): their stored signals and Adam moments, and their alphas where
        each parameter owns its own (element, tensor); an alpha shared with other parameters
        (class, global) is kept. Their next step is a first step again."""
        restarted = {id(p) for p in params}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in restarted or p not in self.state:
                    continue
                state = self.state[p]
                owns_alpha = self._alpha_owner(group, p) is p
                shared_alpha = group["granularity"] in ("class", "global") and owns_alpha
                self.state[p] = (
                    {"alpha": state["alpha"]} if shared_alpha and "alpha" in state else {}
                )

    def replace_parameter(self, old: Tensor, new: Tensor | None) -> None:
        """``new`` takes ``old``'s place in its group (None: ``old`` leaves it), as a method
        replaces its classifier by a wider one at a firing (DER). What FGH stored about ``old``
        (signals, moments) is dropped; an alpha that is not element-wise (one per class row, per
        tensor or global) carries over to ``new`` where its shape still fits."""
        for group in self.param_groups:
            position = next((i for i, p in enumerate(group["params"]) if p is old), None)
            if position is None:
                continue
            state = self.state.pop(old, None) or {}
            if new is None:
                del group["params"][position], group["names"][position]
                return
            group["params"][position] = new
            alpha = state.get("alpha")
            keeps = group["granularity"] != "element" and alpha is not None
            if keeps and (alpha.ndim == 0 or alpha.shape[0] == new.shape[0]):
                self.state[new] = {"alpha": alpha}
            return
        raise ValueError("replace_parameter: the parameter is in no group of this FGH")

    @staticmethod
    def _alpha_owner(group: dict[str, Any], p: Tensor) -> Tensor:
        """The parameter whose state holds the alpha that scales ``p``."""
        if group["granularity"] == "class":
            return next(q for q in group["params"] if q.ndim == 2)
        if group["granularity"] == "global":
            return group["params"][0]
        return p

    def _ensure_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        """Create a param's state (and its alpha owner's) lazily, on the owner's device."""
        state = self.state.setdefault(p, {})
        owner = self._alpha_owner(group, p)
        owner_state = state if owner is p else self.state.setdefault(owner, {})
        if "alpha" not in owner_state:
            granularity = group["granularity"]
            if granularity == "element":
                owner_state["alpha"] = torch.ones_like(owner, memory_format=torch.preserve_format)
            else:  # class: one alpha per row of the weight; tensor and global: one scalar
                shape = (owner.shape[0],) if granularity == "class" else ()
                owner_state["alpha"] = torch.ones(shape, dtype=owner.dtype, device=owner.device)
        if group["direction"] == "adam" and "m" not in state:
            state["step"] = 0
            state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _alpha_view(self, group: dict[str, Any], p: Tensor) -> Tensor:
        """The alpha that scales ``p``, shaped to broadcast against it (state must exist)."""
        alpha = self.state[self._alpha_owner(group, p)]["alpha"]
        return alpha.unsqueeze(1) if group["granularity"] == "class" and p.ndim == 2 else alpha

    def _collect(
        self, group: dict[str, Any]
    ) -> tuple[list[Tensor], list[Tensor], list[dict[str, Any]]]:
        """Params of ``group`` that have a gradient, their grads and (lazily created) state."""
        params, grads, states = [], [], []
        for name, p in zip(group["names"], group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError(f"FGH does not support sparse gradients ({name!r})")
            params.append(p)
            grads.append(p.grad)
            states.append(self._ensure_state(group, p))
        return params, grads, states

    def _blocks(
        self, group: dict[str, Any], params: list[Tensor]
    ) -> tuple[list[int], list[Tensor]]:
        """Index each param's alpha in a list of distinct alphas (shared by class/global)."""
        block_of, block_alphas, index_of = [], [], {}
        for p in params:
            owner = self._alpha_owner(group, p)
            if id(owner) not in index_of:
                index_of[id(owner)] = len(block_alphas)
                block_alphas.append(self.state[owner]["alpha"])
            block_of.append(index_of[id(owner)])
        return block_of, block_alphas

    @torch.no_grad()
    def step(self) -> None:
        """Reweight the current gradients: after ``backward()``, before ``optimizer.step()``."""
        if any(g["apply"] == "update" for g in self.param_groups) and not self._hooks_registered():
            raise RuntimeError(
                "apply='update' rescales the optimizer's update: call "
                "fgh.register_optimizer_hooks(optimizer) once before training"
            )
        for group in self.param_groups:
            params, grads, states = self._collect(group)
            if not grads:
                continue
            partners = [state.get("prev" if group["apply"] == "grad" else "u") for state in states]
            adam = group["direction"] == "adam"
            if adam:  # the moments start with the first pairing (appendix algorithm)
                for state, partner in zip(states, partners):
                    if partner is not None:
                        state["step"] += 1
            block_of, block_alphas = self._blocks(group, params)
            step_fn = _single_tensor_step if group["foreach"] is False else _foreach_step
            new_signals = step_fn(
                grads,
                partners,
                [self._alpha_view(group, p) for p in params],
                block_of,
                block_alphas,
                [state["m"] for state in states] if adam else [],
                [state["v"] for state in states] if adam else [],
                [state["step"] for state in states] if adam else [],
                direction=group["direction"],
                apply=group["apply"],
                gamma=group["gamma"],
                clamp=group["clamp"],
                betas=group["betas"],
                eps=group["eps"],
                num_skipped=self.num_skipped,
            )
            if new_signals is not None:
                for state, signal in zip(states, new_signals):
                    state["prev"] = signal
        self._accumulate_alpha_stream()
        self.num_steps += 1

    @torch.no_grad()
    def _alpha_census(self, group: dict[str, Any]) -> tuple[Tensor, int]:
        """``([sum of alphas, count at clamp lo, count at clamp hi], number of coefficients,
        largest alpha)`` over the group's distinct coefficients, as float64 device tensors (no
        host sync).

        "At a bound" means equal to it: ``clamp_`` writes the bound itself; with no upper bound
        (``hi`` None) nothing is at it. An alpha not created yet is its starting 1 (at a bound
        only if the bound is 1)."""
        lo, hi = group["clamp"]
        owners = {id(o): o for o in (self._alpha_owner(group, p) for p in group["params"])}
        device = self.alpha_stream_sums.device
        parts, peaks, count, missing = [], [], 0, 0
        for owner in owners.values():
            alpha = self.state.get(owner, {}).get("alpha")
            if alpha is None:
                granularity = group["granularity"]
                missing += {"element": owner.numel(), "class": owner.shape[0]}.get(granularity, 1)
                continue
            count += alpha.numel()
            # Float passes only (bool masks and float64 casts cost several times more on CPU):
            # the sum in the alphas' dtype (float32 for half types), and exact integer counts
            # of the entries where alpha - bound is zero, i.e. alpha equals the bound.
            wide = alpha.float() if alpha.element_size() < 4 else alpha
            at_lo = alpha.numel() - torch.count_nonzero(alpha - lo)
            at_hi = (
                alpha.numel() - torch.count_nonzero(alpha - hi)
                if hi is not None
                else torch.zeros((), dtype=torch.int64, device=alpha.device)
            )
            parts.append(
                torch.stack([wide.sum().double(), at_lo.double(), at_hi.double()]).to(device)
            )
            peaks.append(alpha.max().double().to(device))
        if missing:  # filled on the device: no host-to-device copy per step
            values = (missing, missing * (lo == 1), missing * (hi == 1))
            full = [torch.full((), float(v), dtype=torch.float64, device=device) for v in values]
            parts.append(torch.stack(full))
            peaks.append(torch.ones((), dtype=torch.float64, device=device))
        total = torch.stack(parts).sum(0)
        return total, count + missing, torch.stack(peaks).max()

    @torch.no_grad()
    def _accumulate_alpha_stream(self) -> None:
        """Add this step's [mean alpha, fraction at lo, fraction at hi] per group to the sums,
        and keep the largest alpha seen (an unbounded coefficient's growth, docs/fgh.md)."""
        rows, peaks = [], []
        for group in self.param_groups:
            census, count, peak = self._alpha_census(group)
            rows.append(census / count)
            peaks.append(peak)
        self.alpha_stream_sums.add_(torch.stack(rows))
        torch.maximum(self.alpha_stream_max, torch.stack(peaks), out=self.alpha_stream_max)
        self.alpha_stream_steps += 1

    @torch.no_grad()
    def alpha_bounds(self) -> list[dict[str, Any]]:
        """Per param group, how its coefficients sit against the clamp, now and over the stream.

        ``{"clamp": [lo, hi], "coefficients": n, "final": {"mean", "at_lo", "at_hi", "max"},
        "stream": {"mean", "at_lo", "at_hi", "max", "steps"}}``: ``final`` is the current mean
        alpha, fractions of the n coefficients equal to each bound and largest alpha; ``stream``
        averages the first three over every :meth:`step` so far (NaN before the first step) and
        its ``max`` is the largest alpha seen at any step (1, the start, before any). ``hi`` is
        None without an upper bound. Values are 0-d device tensors (read them once, at the end:
        the accumulation itself never syncs).
        """
        steps = self.alpha_stream_steps
        out = []
        for index, group in enumerate(self.param_groups):
            census, count, peak = self._alpha_census(group)
            final = census / count
            stream = (
                self.alpha_stream_sums[index] / steps if steps else torch.full_like(final, math.nan)
            )
            out.append(
                {
                    "clamp": list(group["clamp"]),
                    "coefficients": count,
                    "final": {**dict(zip(("mean", "at_lo", "at_hi"), final.unbind())), "max": peak},
                    "stream": {
                        **dict(zip(("mean", "at_lo", "at_hi"), stream.unbind())),
                        "max": self.alpha_stream_max[index],
                        "steps": steps,
                    },
                }
            )
        return out

    def coefficients(self) -> dict[str, Tensor]:
        """name -> alpha broadcast to the parameter's shape (a copy; 1 before the first step)."""
        out = {}
        for group in self.param_groups:
            for name, p in zip(group["names"], group["params"]):
                if "alpha" not in self.state.get(self._alpha_owner(group, p), {}):
                    out[name] = torch.ones_like(p).detach()
                else:
                    out[name] = self._alpha_view(group, p).expand(p.shape).clone()
        return out

    @torch.no_grad()
    def alpha_statistics(self) -> list[dict[str, Tensor]]:
        """Per param group, ``mean``, ``std``, ``min`` and ``max`` over its distinct coefficients
        (an alpha not created yet counts as its starting 1), as 0-d device tensors: no host sync,
        and no copy of all alphas at once (live logging calls this every few steps)."""
        out = []
        for group in self.param_groups:
            owners = {id(o): o for o in (self._alpha_owner(group, p) for p in group["params"])}
            alphas = []
            for owner in owners.values():
                alpha = self.state.get(owner, {}).get("alpha")
                if alpha is None:  # first step not taken yet: the alphas are still 1
                    granularity = group["granularity"]
                    size = {"element": owner.numel(), "class": owner.shape[0]}.get(granularity, 1)
                    alpha = torch.ones(size, dtype=owner.dtype, device=owner.device)
                alphas.append(alpha.reshape(-1))
            count = sum(a.numel() for a in alphas)
            mean = torch.stack([a.double().sum() for a in alphas]).sum() / count
            var = torch.stack([(a.double() - mean).square().sum() for a in alphas]).sum() / count
            out.append(
                {
                    "mean": mean,
                    "std": var.sqrt(),
                    "min": torch.stack([a.min() for a in alphas]).min(),
                    "max": torch.stack([a.max() for a in alphas]).max(),
                }
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {position: {field: tensor | int}}, "param_groups": [{options, "params",
        "names"}], "num_steps", "num_skipped"}``, laid out like ``torch.optim``'s.

        Parameters are numbered across groups in order; each group's ``"params"`` lists its
        positions and ``"state"`` is keyed by position. ``"names"`` is informational. Tensors
        are references, as in torch.optim; ``torch.save`` or deep-copy to keep a snapshot.
        """
        position_of: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            start = len(position_of)
            position_of.update({id(p): start + i for i, p in enumerate(group["params"])})
            groups.append(
                {
                    **{k: group[k] for k in OPTION_KEYS},
                    "params": list(range(start, len(position_of))),
                    "names": list(group["names"]),
                }
            )
        return {
            "state": {position_of[id(p)]: dict(fields) for p, fields in self.state.items()},
            "param_groups": groups,
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "alpha_stream": {
                "sums": self.alpha_stream_sums,
                "max": self.alpha_stream_max,
                "steps": self.alpha_stream_steps,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` by position, as ``torch.optim`` does.

        Validates the number and sizes of the groups and every state tensor's shape; copies
        each tensor to its parameter's device and dtype. Options come from the state_dict;
        names are not compared (a renamed model with the same layout loads).
        """
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("load_state_dict needs a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this FGH has "
                f"{len(self.param_groups)}"
            )
        new_options = []
        where: dict[Any, tuple[dict[str, Any], dict[str, Any], Tensor]] = {}
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {index} has {len(group['params'])} params but the state_dict's "
                    f"has {len(saved['params'])}; build FGH over the parameters it was saved with"
                )
            options = _check_options({k: saved[k] for k in OPTION_KEYS})
            if options["granularity"] == "class":
                _check_class_group(group["names"], group["params"])
            new_options.append(options)
            for position, p in zip(saved["params"], group["params"]):
                where[position] = (group, options, p)

        new_state: dict[Tensor, dict[str, Any]] = {}
        for position, fields in state_dict["state"].items():
            if position not in where:
                raise ValueError(
                    f"state_dict has state for unknown parameter position {position!r}"
                )
            group, options, p = where[position]
            new_state[p] = {}
            for field, value in fields.items():
                if field == "step":
                    new_state[p][field] = int(value)
                    continue
                expected = self._expected_shape(group, options, p, field)
                if not isinstance(value, Tensor) or tuple(value.shape) != expected:
                    got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                    raise ValueError(
                        f"state_dict entry state[{position}][{field!r}] has shape {got}, "
                        f"expected {expected}"
                    )
                new_state[p][field] = value.detach().to(device=p.device, dtype=p.dtype, copy=True)
        for group, options in zip(self.param_groups, new_options):
            group.update(options)
        self.state = new_state
        self.num_steps = int(state_dict.get("num_steps", 0))
        skipped = state_dict.get("num_skipped", 0)
        self.num_skipped = torch.as_tensor(skipped, dtype=torch.int64).to(
            self.num_skipped.device, copy=True
        )
        self._load_alpha_stream(state_dict.get("alpha_stream"))

    def _load_alpha_stream(self, saved: Any) -> None:
        """Restore the alpha-over-the-stream sums (absent in state_dicts written before them:
        the averages then cover the steps after the load only, with a warning)."""
        device = self.alpha_stream_sums.device
        shape = (len(self.param_groups), 3)
        if saved is None:
            logger.warning(
                "FGH state_dict has no alpha_stream sums (written by an older pilot-online): the "
                "stream averages of alpha will cover only the steps after this load"
            )
            self.alpha_stream_sums = torch.zeros(shape, dtype=torch.float64, device=device)
            self.alpha_stream_max = torch.ones(shape[0], dtype=torch.float64, device=device)
            self.alpha_stream_steps = 0
            return
        sums = saved.get("sums") if isinstance(saved, dict) else None
        if not isinstance(sums, Tensor) or tuple(sums.shape) != shape:
            got = tuple(sums.shape) if isinstance(sums, Tensor) else type(sums).__name__
            raise ValueError(
                f"state_dict entry alpha_stream['sums'] has shape {got}, expected {shape} "
                "(one row of [mean, at_lo, at_hi] sums per param group)"
            )
        self.alpha_stream_sums = sums.detach().to(device=device, dtype=torch.float64, copy=True)
        self.alpha_stream_steps = int(saved.get("steps", 0))
        # The running max (absent before it was recorded: then it restarts from the current
        # alphas, the best lower bound the state holds).
        peak = saved.get("max")
        if isinstance(peak, Tensor) and tuple(peak.shape) == shape[:1]:
            self.alpha_stream_max = peak.detach().to(device=device, dtype=torch.float64, copy=True)
        else:
            self.alpha_stream_max = torch.stack(
                [self._alpha_census(group)[2] for group in self.param_groups]
            )

    def _expected_shape(
        self, group: dict[str, Any], options: dict[str, Any], p: Tensor, field: str
    ) -> tuple[int, ...]:
        if field not in _TENSOR_FIELDS:
            raise ValueError(
                f"state_dict has unknown field {field!r}; valid: "
                f"{', '.join((*_TENSOR_FIELDS, 'step'))}"
            )
        if field != "alpha":
            return tuple(p.shape)
        granularity = options["granularity"]
        if self._alpha_owner({**group, **options}, p) is not p:
            raise ValueError(
                f"state_dict has an alpha for a {granularity!r} parameter that shares another's"
            )
        if granularity == "element":
            return tuple(p.shape)
        if granularity == "class":
            return (p.shape[0],)
        return ()


@torch.no_grad()
def class_grad_norms(weight: torch.nn.Parameter, bias: torch.nn.Parameter | None = None) -> Tensor:
    """Per output row c: sqrt(sum_j weight.grad[c, j]^2 + bias.grad[c]^2).

    Reads the current ``.grad``: called after ``fgh.step()`` it measures the gradient the
    optimizer receives (alpha applied), the quantity the paper's gradient-imbalance plots use.
    """
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [C, D], got shape {tuple(weight.shape)}")
    if weight.grad is None:
        raise ValueError("weight.grad is None; call class_grad_norms after loss.backward()")
    squares = weight.grad.pow(2).sum(dim=1)
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias must have shape ({weight.shape[0]},) to match the weight, "
                f"got {tuple(bias.shape)}"
            )
        if bias.grad is None:
            raise ValueError("bias.grad is None; pass bias=None for a layer without a bias grad")
        squares = squares + bias.grad.pow(2)
    return squares.sqrt()


def validate_options(**options: Any) -> dict[str, Any]:
    """Check FGH options given as keywords (a config's ``"fgh"`` object); return them normalised."""
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise TypeError(f"unknown FGH option(s) {unknown}; valid: {', '.join(OPTION_KEYS)}")
    defaults = FineGrainedHypergradients.__init__.__kwdefaults__
    return _check_options({**defaults, **options})

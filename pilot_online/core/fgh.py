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

Code shape (STYLE rule 1, after ``torch/optim/adam.py``): ``_collect`` gathers the params that
have a gradient and creates their state lazily; :func:`_single_tensor_step` is the readable
specification, one parameter at a time; :func:`_foreach_step` is the ``torch._foreach_*`` fast
path, tested to give bit-identical results.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

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
# Per-parameter state fields; "alpha" also lives under block keys (class: weight name, global).
_TENSOR_FIELDS = ("alpha", "prev", "m", "v", "u")
_GLOBAL_PREFIX = "group:"


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

    clamp = options["clamp"]
    if not isinstance(clamp, (tuple, list)) or len(clamp) != 2:
        raise ValueError(f"clamp must be a finite pair (lo, hi), 0 <= lo < hi, got {clamp!r}")
    lo, hi = check_real("clamp[0]", clamp[0]), check_real("clamp[1]", clamp[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo < hi):
        raise ValueError(f"clamp must be a finite pair (lo, hi), 0 <= lo < hi, got {clamp!r}")

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
    block_keys: list[str],
    block_alphas: dict[str, Tensor],
) -> dict[str, Tensor]:
    """Reduce each product c_t * partner to its alpha's shape and add up products sharing a block.

    element: identity; tensor/global: sum of all entries; class: weight rows summed, bias as is.
    """
    hypergrads: dict[str, Tensor] = {}
    for product, view, key in zip(products, alpha_views, block_keys):
        contribution = product.sum_to_size(view.shape).view(block_alphas[key].shape)
        hypergrads[key] = contribution if key not in hypergrads else hypergrads[key] + contribution
    return hypergrads


def _single_tensor_step(
    grads: list[Tensor],
    partners: list[Tensor | None],
    alpha_views: list[Tensor],
    block_keys: list[str],
    block_alphas: dict[str, Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[int],
    *,
    direction: str,
    apply: str,
    gamma: float,
    clamp: tuple[float, float],
    betas: tuple[float, float],
    eps: float,
    num_skipped: Tensor,
) -> list[Tensor] | None:
    """Reference FGH step (the specification), one parameter at a time.

    ``partners[i]`` is the previous signal c_{t-1} (apply="grad") or the previous update
    direction u_{t-1} (apply="update"); None on a parameter's first step, whose alpha is then
    left alone. ``alpha_views[i]`` is a view of the block alpha ``block_alphas[block_keys[i]]``
    that broadcasts against parameter i. Returns the signals c_t to pair with next step
    (apply="grad"), or None (apply="update": the optimizer hook stores u_t instead).
    """
    lo, hi = clamp
    beta1, beta2 = betas
    # 1. The signal c_t: the raw gradient, or Adam's normalised direction of the raw gradient.
    signals = []
    for i, grad in enumerate(grads):
        if direction == "adam":
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
        products, [alpha_views[i] for i in paired], [block_keys[i] for i in paired], block_alphas
    )
    # 3. alpha <- clamp(alpha + gamma * h), with non-finite entries of h skipped.
    for key, hypergrad in hypergrads.items():
        hypergrad = _finite_or_zero_(hypergrad, num_skipped)
        block_alphas[key].add_(hypergrad, alpha=gamma).clamp_(lo, hi)
    if apply != "grad":
        return None
    # 4. Keep c_t for the next step (for direction="grad" the RAW g_t, saved before scaling).
    new_signals = []
    for signal, partner in zip(signals, partners):
        if direction == "grad":
            signal = signal.clone() if partner is None else partner.copy_(signal)
        new_signals.append(signal)
    # 5. The optimizer receives alpha * g_t.
    for grad, view in zip(grads, alpha_views):
        grad.mul_(view)
    return new_signals


def _foreach_step(
    grads: list[Tensor],
    partners: list[Tensor | None],
    alpha_views: list[Tensor],
    block_keys: list[str],
    block_alphas: dict[str, Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[int],
    *,
    direction: str,
    apply: str,
    gamma: float,
    clamp: tuple[float, float],
    betas: tuple[float, float],
    eps: float,
    num_skipped: Tensor,
) -> list[Tensor] | None:
    """Same arithmetic as :func:`_single_tensor_step`, in ``torch._foreach_*`` kernels."""
    lo, hi = clamp
    beta1, beta2 = betas
    if direction == "adam":
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        signals = list(torch._foreach_div(exp_avgs, [1 - beta1**s for s in steps]))
        denoms = torch._foreach_div(exp_avg_sqs, [1 - beta2**s for s in steps])
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, eps)
        torch._foreach_div_(signals, denoms)
    else:
        signals = list(grads)

    paired = [i for i, partner in enumerate(partners) if partner is not None]
    if paired:
        products = torch._foreach_mul([signals[i] for i in paired], [partners[i] for i in paired])
        hypergrads = _sum_into_blocks(
            products,
            [alpha_views[i] for i in paired],
            [block_keys[i] for i in paired],
            block_alphas,
        )
        keys = list(hypergrads)
        # isfinite has no foreach kernel: one small loop over the (few) hypergradient tensors.
        finite = [_finite_or_zero_(hypergrads[key], num_skipped) for key in keys]
        alphas = [block_alphas[key] for key in keys]
        torch._foreach_add_(alphas, finite, alpha=gamma)
        torch._foreach_clamp_min_(alphas, lo)
        torch._foreach_clamp_max_(alphas, hi)
    if apply != "grad":
        return None

    new_signals = signals
    if direction == "grad":
        if paired:
            torch._foreach_copy_([partners[i] for i in paired], [signals[i] for i in paired])
        new_signals = [
            signal.clone() if partner is None else partner
            for signal, partner in zip(signals, partners)
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
    torch._foreach_copy_(params, deltas)
    return directions


# --------------------------------------------------------------------------- the component


class FineGrainedHypergradients:
    """Learned gradient weights (paper Sec. "Fine-Grained Hypergradients", Eq. 8 and appendix).

    Shaped like a ``torch.optim`` optimizer: ``param_groups`` with defaults, per-parameter
    ``state`` keyed by parameter NAME (names survive CODA's Parameter rebuilds, see
    :meth:`rebind`), ``state_dict``/``load_state_dict``, ``add_param_group``.

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
            "adam": m_hat / (sqrt(v_hat) + eps) from Adam moments of the raw gradient (appendix;
            unlike the pseudo-code, the step count is incremented, starting at 1).
        apply: "grad" (the paper): the optimizer receives alpha * g_t, and h = c_t * c_{t-1}.
            "update": alpha scales the optimizer's parameter update (a per-parameter learning
            rate, Baydin's Adam-HD); gradients are untouched, h = c_t * u_{t-1} with u the
            previous update direction (-delta / lr). Needs :meth:`attach`.
        clamp: finite (lo, hi), 0 <= lo < hi; alpha is clamped after every update; it starts
            at 1 (even outside the bounds, until its first update).
        betas, eps: Adam moments of direction="adam".
        foreach: use the ``torch._foreach_*`` path (None: yes).

    On a parameter's first step (nothing to pair with yet) alpha stays 1, the gradient is
    unchanged and the signal is stored. Params whose ``.grad`` is None are skipped, state
    untouched. Non-finite hypergradient entries are skipped (treated as 0) and counted in
    ``num_skipped``, a device tensor read without a host sync; alpha never becomes NaN.

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
        clamp: tuple[float, float] = (0.0, 10.0),
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
        self.state: dict[str, dict[str, Any]] = {}
        self.num_steps = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._hook_handles: list[Any] = []
        self._pending: list[tuple[int, list[str], list[Tensor], list[Tensor], list[float]]] = []

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

        seen_ids = {id(p) for g in self.param_groups for p in g["params"]}
        seen_names = {n for g in self.param_groups for n in g["names"]}
        for name, p in pairs:
            if name.startswith(_GLOBAL_PREFIX):
                raise ValueError(f"parameter name {name!r} clashes with FGH's block keys 'group:i'")
            if id(p) in seen_ids or name in seen_names:
                raise ValueError(f"parameter {name!r} appears in more than one group (or twice)")
            seen_ids.add(id(p))
            seen_names.add(name)
        names, params = [n for n, _ in pairs], [p for _, p in pairs]
        if options["granularity"] == "class":
            _check_class_group(names, params)
        self.param_groups.append({"params": params, "names": names, **options})

    def rebind(self, named_params: Iterable[Any]) -> None:
        """Point groups at new Parameter objects with the same names; their state carries over.

        CODA rebuilds its prompt Parameters; FGH state is keyed by name, so it survives. Frozen
        params are ignored, names FGH does not track raise.
        """
        where = {
            name: (gi, pi)
            for gi, group in enumerate(self.param_groups)
            for pi, name in enumerate(group["names"])
        }
        for name, p in _named_pairs(named_params, "rebind()'s argument"):
            if not p.requires_grad:
                continue
            if name not in where:
                raise ValueError(
                    f"rebind(): unknown parameter name {name!r}; FGH tracks {sorted(where)}. "
                    "Use add_param_group for new parameters."
                )
            gi, pi = where[name]
            old = self.param_groups[gi]["params"][pi]
            if p.shape != old.shape:
                raise ValueError(
                    f"rebind(): {name!r} has shape {tuple(p.shape)}, FGH's state expects "
                    f"{tuple(old.shape)}; build a new FineGrainedHypergradients instead"
                )
            self.param_groups[gi]["params"][pi] = p
            for key, value in self.state.get(name, {}).items():
                if isinstance(value, Tensor):
                    self.state[name][key] = value.to(device=p.device, dtype=p.dtype)

    # ------------------------------------------------------------------ optimizer hooks

    def attach(self, optimizer: torch.optim.Optimizer) -> FineGrainedHypergradients:
        """Hook into ``optimizer.step()`` so apply="update" can rescale its parameter update."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach() needs a torch.optim.Optimizer, got {type(optimizer)!r}")
        self.detach()
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
        self._optimizer = optimizer
        self._hook_handles = [
            optimizer.register_step_pre_hook(self._snapshot_params),
            optimizer.register_step_post_hook(self._rescale_update),
        ]
        return self

    def detach(self) -> None:
        """Remove the optimizer hooks added by :meth:`attach` (no-op when not attached)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles, self._optimizer, self._pending = [], None, []

    @torch.no_grad()
    def _snapshot_params(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
        self._pending = []
        for index, group in enumerate(self.param_groups):
            if group["apply"] != "update":
                continue
            chosen = [
                (n, p)
                for n, p in zip(group["names"], group["params"])
                if p.grad is not None and id(p) in lr_of
            ]
            if not chosen:
                continue
            names, params = [n for n, _ in chosen], [p for _, p in chosen]
            snapshots = (
                list(torch._foreach_clone(params))
                if group["foreach"] in (None, True)
                else [p.clone() for p in params]
            )
            lrs = [float(lr_of[id(p)]) for p in params]
            self._pending.append((index, names, params, snapshots, lrs))

    @torch.no_grad()
    def _rescale_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending, self._pending = self._pending, []
        for index, names, params, snapshots, lrs in pending:
            group = self.param_groups[index]
            for name, p in zip(names, params):  # alpha is 1 if fgh.step() never saw p
                self._ensure_state(group, index, name, p)
            views = [self._alpha_view(group, index, n, p) for n, p in zip(names, params)]
            rescale = (
                _single_tensor_rescale_update
                if group["foreach"] is False
                else _foreach_rescale_update
            )
            for name, direction in zip(names, rescale(params, snapshots, views, lrs)):
                self.state[name]["u"] = direction

    # ------------------------------------------------------------------ state

    def _block_key(self, group: dict[str, Any], index: int, name: str) -> str:
        if group["granularity"] == "global":
            return f"{_GLOBAL_PREFIX}{index}"
        if group["granularity"] == "class":
            return next(n for n, p in zip(group["names"], group["params"]) if p.ndim == 2)
        return name

    def _ensure_state(self, group: dict[str, Any], index: int, name: str, p: Tensor) -> dict:
        """Create a parameter's state lazily, on the parameter's device and dtype."""
        state = self.state.setdefault(name, {})
        granularity = group["granularity"]
        if granularity == "element" and "alpha" not in state:
            state["alpha"] = torch.ones_like(p, memory_format=torch.preserve_format)
        elif granularity == "tensor" and "alpha" not in state:
            state["alpha"] = torch.ones((), dtype=p.dtype, device=p.device)
        elif granularity in ("class", "global"):
            key = self._block_key(group, index, name)
            block = self.state.setdefault(key, {})
            if "alpha" not in block:
                if granularity == "class":  # one alpha per row of the weight (the block key)
                    ref = group["params"][group["names"].index(key)]
                    shape: tuple[int, ...] = (ref.shape[0],)
                else:
                    ref, shape = p, ()
                block["alpha"] = torch.ones(shape, dtype=ref.dtype, device=ref.device)
        if group["direction"] == "adam" and "m" not in state:
            state["step"] = 0
            state["m"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _alpha_view(self, group: dict[str, Any], index: int, name: str, p: Tensor) -> Tensor:
        """The alpha that scales ``p``, shaped to broadcast against it (state must exist)."""
        alpha = self.state[self._block_key(group, index, name)]["alpha"]
        return alpha.unsqueeze(1) if group["granularity"] == "class" and p.ndim == 2 else alpha

    def _collect(
        self, group: dict[str, Any], index: int
    ) -> tuple[list[str], list[Tensor], list[dict[str, Any]]]:
        """Params of ``group`` that have a gradient, with their (lazily created) state."""
        names, grads, states = [], [], []
        for name, p in zip(group["names"], group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError(f"FGH does not support sparse gradients ({name!r})")
            names.append(name)
            grads.append(p.grad)
            states.append(self._ensure_state(group, index, name, p))
        return names, grads, states

    @torch.no_grad()
    def step(self) -> None:
        """Reweight the current gradients: after ``backward()``, before ``optimizer.step()``."""
        if self._optimizer is None and any(g["apply"] == "update" for g in self.param_groups):
            raise RuntimeError(
                "apply='update' rescales the optimizer's update: call fgh.attach(optimizer) "
                "once before training"
            )
        for index, group in enumerate(self.param_groups):
            names, grads, states = self._collect(group, index)
            if not grads:
                continue
            params = dict(zip(group["names"], group["params"]))
            adam = group["direction"] == "adam"
            if adam:
                for state in states:
                    state["step"] += 1
            partner_key = "prev" if group["apply"] == "grad" else "u"
            keys = [self._block_key(group, index, name) for name in names]
            step_fn = _single_tensor_step if group["foreach"] is False else _foreach_step
            new_signals = step_fn(
                grads,
                [state.get(partner_key) for state in states],
                [self._alpha_view(group, index, name, params[name]) for name in names],
                keys,
                {key: self.state[key]["alpha"] for key in keys},
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
        self.num_steps += 1

    def coefficients(self) -> dict[str, Tensor]:
        """name -> alpha broadcast to the parameter's shape (a copy; 1 before the first step)."""
        out = {}
        for index, group in enumerate(self.param_groups):
            for name, p in zip(group["names"], group["params"]):
                key = self._block_key(group, index, name)
                if "alpha" not in self.state.get(key, {}):
                    out[name] = torch.ones_like(p).detach()
                    continue
                view = self._alpha_view(group, index, name, p)
                out[name] = view.expand(p.shape).clone()
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {key: {field: tensor | int}}, "param_groups": [{options, "names"}]}``.

        Keyed by name, not position, so it loads after CODA rebuilds its Parameters. Tensors are
        references, as in torch.optim; ``torch.save`` or deep-copy to keep a snapshot.
        """
        return {
            "state": {key: dict(fields) for key, fields in self.state.items()},
            "param_groups": [
                {**{k: group[k] for k in OPTION_KEYS}, "names": list(group["names"])}
                for group in self.param_groups
            ],
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; validates groups, names and shapes, casts to each param."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
            raise ValueError("load_state_dict needs a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this FGH has "
                f"{len(self.param_groups)}"
            )
        new_options = []
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if list(saved["names"]) != group["names"]:
                missing = sorted(set(group["names"]) - set(saved["names"]))
                unexpected = sorted(set(saved["names"]) - set(group["names"]))
                raise ValueError(
                    f"param group {index}: state_dict names differ (missing {missing}, "
                    f"unexpected {unexpected}, or a different order)"
                )
            options = _check_options({k: saved[k] for k in OPTION_KEYS})
            if options["granularity"] == "class":
                _check_class_group(group["names"], group["params"])
            new_options.append(options)

        owner = {}  # state key -> (group options, index, reference param)
        for index, (group, options) in enumerate(zip(self.param_groups, new_options)):
            for name, p in zip(group["names"], group["params"]):
                owner[name] = (options, index, p)
            owner[f"{_GLOBAL_PREFIX}{index}"] = (options, index, group["params"][0])

        new_state: dict[str, dict[str, Any]] = {}
        for key, fields in state_dict["state"].items():
            if key not in owner:
                raise ValueError(f"state_dict has state for unknown key {key!r}")
            options, index, p = owner[key]
            new_state[key] = {}
            for field, value in fields.items():
                if field == "step":
                    new_state[key][field] = int(value)
                    continue
                expected = self._expected_shape(options, key, field, p)
                if not isinstance(value, Tensor) or tuple(value.shape) != expected:
                    got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                    raise ValueError(
                        f"state_dict entry state[{key!r}][{field!r}] has shape {got}, "
                        f"expected {expected}"
                    )
                new_state[key][field] = value.detach().to(device=p.device, dtype=p.dtype, copy=True)
        for group, options in zip(self.param_groups, new_options):
            group.update(options)
        self.state = new_state
        self.num_steps = int(state_dict.get("num_steps", 0))
        skipped = state_dict.get("num_skipped", 0)
        self.num_skipped = torch.as_tensor(skipped, dtype=torch.int64).to(
            self.num_skipped.device, copy=True
        )

    def _expected_shape(
        self, options: dict[str, Any], key: str, field: str, p: Tensor
    ) -> tuple[int, ...]:
        granularity = options["granularity"]
        if key.startswith(_GLOBAL_PREFIX):
            if granularity != "global" or field != "alpha":
                raise ValueError(f"state_dict has unexpected field {field!r} for block {key!r}")
            return ()
        if field not in _TENSOR_FIELDS:
            raise ValueError(
                f"state_dict has unknown field {field!r} for {key!r}; valid: "
                f"{', '.join((*_TENSOR_FIELDS, 'step'))}"
            )
        if field != "alpha":
            return tuple(p.shape)
        if granularity == "element":
            return tuple(p.shape)
        if granularity == "class" and p.ndim == 2:
            return (p.shape[0],)
        if granularity == "tensor":
            return ()
        raise ValueError(f"state_dict has an alpha for {key!r}, which has none at {granularity!r}")


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

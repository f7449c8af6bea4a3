"""Fine-Grained Hypergradients (FGH): learned gradient weights, updated online.

FGH keeps a coefficient ``alpha`` per scalar parameter (or per class row, or one per group) and
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

Shaped after ``torch/optim/adam.py``: ``_collect`` gathers the params that have a gradient and
creates their state lazily; the step is ``core/fgh_functional.py``'s (a single-tensor reference
and its ``torch._foreach_*`` twin); options are checked in ``core/fgh_options.py``; state is keyed
by parameter and saved by position. Forms: element-wise (Eq. 8), class-wise (appendix) and one
global coefficient (Baydin et al.'s HD), each on raw gradients or Adam's directions. What the
coefficients do over a run is observed from outside (``core/fgh_stats.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .fgh_functional import foreach_step, single_tensor_step
from .fgh_options import OPTION_KEYS, check_class_group, check_options, named_pairs
from .lazy import no_grad, torch

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["FineGrainedHypergradients"]

# Per-parameter state tensors ("step", an int, is the other field). A class or global alpha lives
# in the state of the parameter that owns it (the classifier weight; the group's first param).
_TENSOR_FIELDS = ("alpha", "prev", "m", "v")


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
            together; the group must hold only that layer) or "global" (one per group,
            Baydin et al.'s single hypergradient).
        direction: the signal c_t paired across steps. "grad": the raw gradient (Eq. 8).
            "adam": m_hat / (sqrt(v_hat) + eps) from Adam moments of the raw gradient, as the
            appendix algorithm runs it: a parameter's first step stores the raw g_1 and leaves
            the moments alone; the moments start at its second step (so h_2 = c_2 * g_1), and
            the bias correction counts the moment updates (1 at the second step).
        apply: "grad", the paper's: the optimizer receives alpha * g_t, h = c_t * c_{t-1}.
        clamp: (lo, hi), finite, 0 <= lo < hi, or (lo, None): no upper bound (the paper states
            only alpha > 0; docs/fgh.md). alpha is clamped after every update; it starts at 1
            (even outside the bounds, until its first update).
        betas, eps: Adam moments of direction="adam".
        foreach: use the ``torch._foreach_*`` path (None: yes).

    On a parameter's first step (nothing to pair with yet) alpha stays 1, the gradient is
    unchanged and the raw gradient is stored. Params whose ``.grad`` is None are
    skipped, state untouched. Non-finite hypergradient entries are skipped (treated as 0) and
    counted in ``num_skipped``, a device tensor read without a host sync; alpha never becomes NaN.

    Where alphas live: ``state[p]["alpha"]`` for element; the classifier weight's
    state holds the class alphas (shape [C], shared with the bias); the group's first
    parameter's state holds the global alpha.

    Memory per trainable scalar: element-wise with raw gradients holds exactly 2 floats (alpha
    and the previous raw gradient); direction="adam" adds m and v. Class and global alphas are C
    and 1 floats.

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
        check_options(self.defaults)  # fail early on bad defaults, even before any group
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Tensor, dict[str, Any]] = {}
        self.num_steps = 0

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
        pairs = named_pairs(group["params"], "a param group's 'params'")
        pairs = [(name, p) for name, p in pairs if p.requires_grad]
        if not pairs:
            raise ValueError("a param group holds no parameter with requires_grad=True")
        options = check_options({key: group.get(key, self.defaults[key]) for key in OPTION_KEYS})

        self._check_new(pairs)
        names, params = [n for n, _ in pairs], [p for _, p in pairs]
        if options["granularity"] == "class":
            check_class_group(names, params)
        self.param_groups.append({"params": params, "names": names, **options})

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
        pairs = named_pairs(named_params, "extend_group")
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

    # ------------------------------------------------------------------ state

    def reset_state(self, params: Iterable[Tensor]) -> None:
        """Forget what FGH learned about ``params`` (a method restarted them, as oLoRA's fresh
        adapter after a merge): their stored signals and Adam moments, and their alphas where
        each parameter owns its own (element); an alpha shared with other parameters
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
        (signals, moments) is dropped; an alpha that is not element-wise (one per class row, or
        the global one) carries over to ``new`` where its shape still fits."""
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
            else:  # class: one alpha per row of the weight; global: one scalar
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

    @no_grad
    def step(self) -> None:
        """Reweight the current gradients: after ``backward()``, before ``optimizer.step()``."""
        for group in self.param_groups:
            params, grads, states = self._collect(group)
            if not grads:
                continue
            partners = [state.get("prev") for state in states]
            adam = group["direction"] == "adam"
            if adam:  # the moments start with the first pairing (appendix algorithm)
                for state, partner in zip(states, partners):
                    if partner is not None:
                        state["step"] += 1
            block_of, block_alphas = self._blocks(group, params)
            step_fn = single_tensor_step if group["foreach"] is False else foreach_step
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
                gamma=group["gamma"],
                clamp=group["clamp"],
                betas=group["betas"],
                eps=group["eps"],
                num_skipped=self.num_skipped,
            )
            for state, signal in zip(states, new_signals):
                state["prev"] = signal
        self.num_steps += 1

    def group_alphas(self, group: dict[str, Any]) -> list[tuple[Tensor, Tensor | None]]:
        """``(owner, alpha)`` for each distinct coefficient block of ``group``, in parameter
        order: the parameter whose state holds it, and the alpha (None before its first step).
        What an observer reads (``core/fgh_stats.py``)."""
        owners = {id(o): o for o in (self._alpha_owner(group, p) for p in group["params"])}
        return [(o, self.state.get(o, {}).get("alpha")) for o in owners.values()]

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
            options = check_options({k: saved[k] for k in OPTION_KEYS})
            if options["granularity"] == "class":
                check_class_group(group["names"], group["params"])
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
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
                    is_tensor = isinstance(value, torch.Tensor)
                    got = tuple(value.shape) if is_tensor else type(value).__name__
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
        return {"element": tuple(p.shape), "class": (p.shape[0],)}.get(granularity, ())

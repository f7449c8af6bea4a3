"""FGH's coefficients, observed: against the clamp over the stream, and their spread.

:class:`~pilot_online.core.fgh.FineGrainedHypergradients` learns the coefficients; this module only
reads them. :class:`AlphaStream` is told after each FGH step (the loop's ``FGHMixin`` calls
:meth:`AlphaStream.observe`) and sums, per param group, the mean coefficient and the fractions
equal to each clamp bound, and keeps the largest one seen: device tensors, no host sync per step,
read once for the results file (``diagnostics.fgh.alpha_bounds``). :func:`alpha_statistics` is
the spread the live log draws every few steps.

"At a bound" means equal to it: ``clamp_`` writes the bound itself; with no upper bound (``hi``
None) nothing is at it. A coefficient not created yet (its parameter had no gradient) is its
starting 1, at a bound only if the bound is 1.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from .fgh import FineGrainedHypergradients
from .lazy import no_grad, torch

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)


def _unborn_size(group: dict[str, Any], owner: Tensor) -> int:
    """How many coefficients a block not created yet holds (each is its starting 1)."""
    return {"element": owner.numel(), "class": owner.shape[0]}.get(group["granularity"], 1)


@no_grad
def census(fgh: FineGrainedHypergradients, group: dict[str, Any]) -> tuple[Tensor, int, Tensor]:
    """``([sum of alphas, count at clamp lo, count at clamp hi], number of coefficients, largest
    alpha)`` over ``group``'s distinct coefficients, as float64 tensors on FGH's device."""
    lo, hi = group["clamp"]
    device = fgh.num_skipped.device
    parts, peaks, count, missing = [], [], 0, 0
    for owner, alpha in fgh.group_alphas(group):
        if alpha is None:
            missing += _unborn_size(group, owner)
            continue
        count += alpha.numel()
        # Float passes only (bool masks and float64 casts cost several times more on CPU): the
        # sum in the alphas' dtype (float32 for half types), and exact integer counts of the
        # entries where alpha - bound is zero, i.e. alpha equals the bound.
        wide = alpha.float() if alpha.element_size() < 4 else alpha
        at_lo = alpha.numel() - torch.count_nonzero(alpha - lo)
        at_hi = (
            alpha.numel() - torch.count_nonzero(alpha - hi)
            if hi is not None
            else torch.zeros((), dtype=torch.int64, device=alpha.device)
        )
        parts.append(torch.stack([wide.sum().double(), at_lo.double(), at_hi.double()]).to(device))
        peaks.append(alpha.max().double().to(device))
    if missing:  # filled on the device: no host-to-device copy per step
        values = (missing, missing * (lo == 1), missing * (hi == 1))
        full = [torch.full((), float(v), dtype=torch.float64, device=device) for v in values]
        parts.append(torch.stack(full))
        peaks.append(torch.ones((), dtype=torch.float64, device=device))
    total = torch.stack(parts).sum(0)
    return total, count + missing, torch.stack(peaks).max()


class AlphaStream:
    """Per FGH param group, the sums over observed steps of [mean alpha, fraction of coefficients
    at the clamp's lower bound, fraction at its upper bound], and the largest alpha seen."""

    def __init__(self, fgh: FineGrainedHypergradients) -> None:
        self.fgh = fgh
        device = fgh.num_skipped.device
        self.sums = torch.zeros((0, 3), dtype=torch.float64, device=device)
        self.max = torch.ones(0, dtype=torch.float64, device=device)  # every alpha starts at 1
        self.steps = 0
        self._grow()

    def _grow(self) -> None:
        """A row for each group FGH gained since (a group added after construction)."""
        more = len(self.fgh.param_groups) - self.sums.shape[0]
        if more > 0:
            self.sums = torch.cat([self.sums, self.sums.new_zeros((more, 3))])
            self.max = torch.cat([self.max, self.max.new_ones(more)])

    @no_grad
    def observe(self) -> None:
        """Add this step's [mean alpha, fraction at lo, fraction at hi] per group to the sums,
        and keep the largest alpha seen (an unbounded coefficient's growth, docs/fgh.md)."""
        self._grow()
        rows, peaks = [], []
        for group in self.fgh.param_groups:
            total, count, peak = census(self.fgh, group)
            rows.append(total / count)
            peaks.append(peak)
        self.sums.add_(torch.stack(rows))
        torch.maximum(self.max, torch.stack(peaks), out=self.max)
        self.steps += 1

    @no_grad
    def bounds(self) -> list[dict[str, Any]]:
        """Per param group, how its coefficients sit against the clamp, now and over the stream.

        ``{"clamp": [lo, hi], "coefficients": n, "final": {"mean", "at_lo", "at_hi", "max"},
        "stream": {"mean", "at_lo", "at_hi", "max", "steps"}}``: ``final`` is the current mean
        alpha, fractions of the n coefficients equal to each bound and largest alpha; ``stream``
        averages the first three over every observed step (NaN before the first) and its ``max``
        is the largest alpha seen at any (1, the start, before any). ``hi`` is None without an
        upper bound. Values are 0-d device tensors: read them once, at the end.
        """
        self._grow()
        out = []
        for index, group in enumerate(self.fgh.param_groups):
            total, count, peak = census(self.fgh, group)
            final = total / count
            stream = (
                self.sums[index] / self.steps if self.steps else torch.full_like(final, math.nan)
            )
            out.append(
                {
                    "clamp": list(group["clamp"]),
                    "coefficients": count,
                    "final": {**dict(zip(("mean", "at_lo", "at_hi"), final.unbind())), "max": peak},
                    "stream": {
                        **dict(zip(("mean", "at_lo", "at_hi"), stream.unbind())),
                        "max": self.max[index],
                        "steps": self.steps,
                    },
                }
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"sums", "max", "steps"}``: checkpointed beside FGH's own state, so that a resumed
        run reports the same averages."""
        self._grow()
        return {"sums": self.sums, "max": self.max, "steps": self.steps}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None, from a checkpoint written before it was kept: the
        averages then cover the steps after the load only, with a warning)."""
        device = self.sums.device
        shape = (len(self.fgh.param_groups), 3)
        if saved is None:
            logger.warning(
                "FGH state_dict has no alpha_stream sums (written by an older pilot-online): the "
                "stream averages of alpha will cover only the steps after this load"
            )
            self.sums = torch.zeros(shape, dtype=torch.float64, device=device)
            self.max = torch.ones(shape[0], dtype=torch.float64, device=device)
            self.steps = 0
            return
        sums = saved.get("sums") if isinstance(saved, dict) else None
        if not isinstance(sums, torch.Tensor) or tuple(sums.shape) != shape:
            got = tuple(sums.shape) if isinstance(sums, torch.Tensor) else type(sums).__name__
            raise ValueError(
                f"state_dict entry alpha_stream['sums'] has shape {got}, expected {shape} "
                "(one row of [mean, at_lo, at_hi] sums per param group)"
            )
        self.sums = sums.detach().to(device=device, dtype=torch.float64, copy=True)
        self.steps = int(saved.get("steps", 0))
        # The running max (absent before it was recorded: then it restarts from the current
        # alphas, the best lower bound the state holds).
        peak = saved.get("max")
        if isinstance(peak, torch.Tensor) and tuple(peak.shape) == shape[:1]:
            self.max = peak.detach().to(device=device, dtype=torch.float64, copy=True)
        else:
            self.max = torch.stack([census(self.fgh, group)[2] for group in self.fgh.param_groups])


@no_grad
def alpha_statistics(fgh: FineGrainedHypergradients) -> list[dict[str, Tensor]]:
    """Per param group, ``mean``, ``std``, ``min`` and ``max`` over its distinct coefficients (one
    not created yet counts as its starting 1), as 0-d device tensors: no host sync, and no copy
    of all alphas at once (live logging calls this every few steps)."""
    out = []
    for group in fgh.param_groups:
        alphas = []
        for owner, alpha in fgh.group_alphas(group):
            if alpha is None:  # first step not taken yet: the alphas are still 1
                alpha = torch.ones(
                    _unborn_size(group, owner), dtype=owner.dtype, device=owner.device
                )
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

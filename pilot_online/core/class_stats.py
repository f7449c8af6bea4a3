"""Online class Gaussians and classifier alignment on features drawn from them.

Methods that realign their head on synthetic features (SLCA, CoFiMA through SLCA, MOS) need each
class's feature mean and covariance. Upstream computes them in a second pass over a finished
task's data; online there is no second pass, so :class:`ClassGaussians` keeps them running, batch
by batch, and :func:`align_classifier` is upstream's alignment step (``classifer_align`` in MOS,
``_stage2_compact_classifier`` in SLCA) on what it holds. One copy here, used by every method.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .checks import check_int
from .lazy import F, nn, no_grad, torch

#: Upstream's ridge on every class covariance (``torch.cov(...) + 1e-4 I``), also the floor of
#: the eigenvalues of a covariance Cholesky refuses.
COVARIANCE_RIDGE = 1e-4
#: Classes whose float64 covariances are formed at once when factorising: bounds the transient
#: memory at 16 D x D doubles (75 MB at D = 768) whatever the number of classes.
FACTOR_CHUNK = 16


class ClassGaussians(nn.Module):
    """Per-class running count, mean and scatter (sum of squared deviations; its diagonal with
    ``diagonal``) of features, merged batch by batch with Chan et al.'s pairwise update: stable
    in float32, unlike raw second moments. ``session[c]`` is the session (the caller's count of
    consolidation firings) of class ``c``'s first sample, -1 before it or when the caller passes
    none. Buffers, so ``.to()`` and ``state_dict()`` carry them, in a network or on their own.
    """

    counts: torch.Tensor
    means: torch.Tensor
    scatter: torch.Tensor
    session: torch.Tensor

    def __init__(
        self,
        num_classes: int,
        dim: int,
        diagonal: bool = False,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        num_classes = check_int("num_classes", num_classes, 1)
        dim = check_int("dim", dim, 1)
        self.diagonal = bool(diagonal)
        self.register_buffer("counts", torch.zeros(num_classes, dtype=torch.int64, device=device))
        self.register_buffer("means", torch.zeros(num_classes, dim, device=device))
        shape = (num_classes, dim) if self.diagonal else (num_classes, dim, dim)
        self.register_buffer("scatter", torch.zeros(shape, device=device))
        self.register_buffer(
            "session", torch.full((num_classes,), -1, dtype=torch.int64, device=device)
        )

    def extra_repr(self) -> str:
        return (
            f"num_classes={len(self.counts)}, dim={self.means.shape[1]}, diagonal={self.diagonal}"
        )

    @no_grad
    def update(
        self, features: torch.Tensor, labels: torch.Tensor, session: int | None = None
    ) -> None:
        """Merge a batch ``[B, D]`` with labels ``[B]`` into its classes' statistics (features
        detached and cast to the buffers'); ``session`` marks classes seen for the first time."""
        if features.dim() != 2 or features.shape[1] != self.means.shape[1]:
            raise ValueError(
                f"features must have shape [B, {self.means.shape[1]}], got {tuple(features.shape)}"
            )
        if labels.shape != features.shape[:1]:
            raise ValueError(
                f"labels must have shape [{features.shape[0]}] to match the features, "
                f"got {tuple(labels.shape)}"
            )
        features = features.detach().to(self.means)
        for c in labels.unique().tolist():  # one host sync per step
            x = features[labels == c]
            n_a, n_b = int(self.counts[c]), x.shape[0]
            n = n_a + n_b
            mean_b = x.mean(0)
            centred, delta = x - mean_b, mean_b - self.means[c]
            if self.diagonal:
                self.scatter[c] += (centred * centred).sum(0) + delta * delta * (n_a * n_b / n)
            else:
                self.scatter[c] += centred.T @ centred + torch.outer(delta, delta) * (n_a * n_b / n)
            self.means[c] += delta * (n_b / n)
            self.counts[c] = n
        if session is not None:
            present = torch.zeros_like(self.session, dtype=torch.bool)
            present[labels.to(self.session.device)] = True
            self.session.masked_fill_(present & (self.session < 0), session)

    def seen(self) -> torch.Tensor:
        """Indices of the classes with at least one sample."""
        return torch.nonzero(self.counts > 0).flatten()

    def covariances(self, classes: torch.Tensor, ridge: float = COVARIANCE_RIDGE) -> torch.Tensor:
        """Unbiased covariances (scatter / (n - 1); zero for one sample, where ``torch.cov`` is
        NaN) plus upstream's ridge, float64: ``[K, D, D]``, or ``[K, D]`` diagonals."""
        scatter = self.scatter[classes].double()
        dof = (self.counts[classes] - 1).clamp(min=1).double()
        if self.diagonal:
            return scatter / dof[:, None] + ridge
        eye = torch.eye(scatter.shape[-1], dtype=torch.float64, device=scatter.device)
        return scatter / dof[:, None, None] + ridge * eye

    def factors(self, classes: torch.Tensor) -> torch.Tensor:
        """:func:`sampling_factors` of the ``classes``' covariances, ``FACTOR_CHUNK`` classes at
        a time (their float64 covariances are transient)."""
        return torch.cat(
            [sampling_factors(self.covariances(c)) for c in classes.split(FACTOR_CHUNK)]
        )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module``'s, after a shape check whose error names the statistic (a checkpoint of
        another class count, width or ``diagonal`` setting)."""
        for key, current in self.state_dict().items():
            if key in state_dict and tuple(state_dict[key].shape) != tuple(current.shape):
                raise ValueError(
                    f"class statistics {key} have shape {tuple(state_dict[key].shape)} in the "
                    f"checkpoint, {tuple(current.shape)} here: resume with the config that wrote it"
                )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def sampling_factors(covariances: torch.Tensor) -> torch.Tensor:
    """``L`` with ``L L^T = Sigma`` per class (float32): Cholesky, or the square roots of
    diagonal variances; a factor Cholesky refuses (rounding) comes from the eigenvalues clamped
    at the ridge."""
    if covariances.ndim == 2:
        return covariances.sqrt().float()
    factors, info = torch.linalg.cholesky_ex(covariances)
    bad = info > 0
    if bad.any():
        values, vectors = torch.linalg.eigh(covariances[bad])
        factors[bad] = vectors * values.clamp(min=COVARIANCE_RIDGE).sqrt()[:, None, :]
    return factors.float()


def normalised_logits(
    logits: torch.Tensor, blocks: Sequence[torch.Tensor], temperature: float
) -> torch.Tensor:
    """SLCA's ``ca_with_logit_norm``: the logits divided by the mean over class blocks (upstream's
    tasks) of each block's logit L2 norm (+ 1e-7), and by ``temperature``: old and new blocks
    then weigh alike in the CE whatever the scale of their head rows."""
    norms = torch.cat([logits[:, b].norm(dim=-1, keepdim=True) + 1e-7 for b in blocks], dim=-1)
    return logits / norms.mean(dim=-1, keepdim=True) / temperature


def align_classifier(
    head: nn.Linear,
    classes: torch.Tensor,
    means: torch.Tensor,
    factors: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    weight_decay: float,
    samples_per_class: int,
    generator: torch.Generator,
    blocks: Sequence[torch.Tensor] | None = None,
    temperature: float = 0.0,
) -> None:
    """Upstream's classifier alignment: per epoch, ``samples_per_class`` features per class drawn
    from ``N(means, L L^T)`` (``factors``: ``[K, D, D]``, or ``[K, D]`` standard deviations),
    shuffled, one SGD step (momentum 0.9, ``lr`` cosine-annealed per epoch) per batch of
    ``samples_per_class``, CE over the logits of ``classes`` only (normalised over ``blocks``,
    positions in ``classes``, when ``temperature`` > 0). Its own optimiser, made here as
    upstream's at each alignment: the caller's optimiser state of the head is untouched. Only the
    rows of ``classes`` change: upstream's head has no others (its weight decay never reaches a
    class not yet seen), so the other rows of ``weight`` and ``bias`` are put back afterwards."""
    if temperature > 0 and blocks is None:
        raise ValueError(
            "align_classifier: temperature > 0 normalises logits over blocks: pass them"
        )
    device = head.weight.device
    means, factors, classes = means.to(device), factors.to(device), classes.to(device)
    others = torch.ones(head.out_features, dtype=torch.bool, device=device)
    others[classes] = False
    kept = {
        name: tensor.detach()[others].clone()
        for name, tensor in (("weight", head.weight), ("bias", head.bias))
        if tensor is not None
    }
    optimizer = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    targets = torch.arange(len(classes), device=device).repeat_interleave(samples_per_class)
    for epoch in range(epochs):
        for group in optimizer.param_groups:  # CosineAnnealingLR(T_max=epochs), eta_min 0
            group["lr"] = lr * (1 + math.cos(math.pi * epoch / epochs)) / 2
        noise = torch.randn(
            len(classes), samples_per_class, means.shape[1], generator=generator, device=device
        )
        if factors.ndim == 2:
            drawn = means[:, None, :] + noise * factors[:, None, :]
        else:
            drawn = means[:, None, :] + noise @ factors.transpose(1, 2)
        inputs = drawn.flatten(0, 1)
        order = torch.randperm(len(targets), generator=generator, device=device)
        for batch in order.split(samples_per_class):
            with torch.enable_grad():
                logits = head(inputs[batch])[:, classes]
                if temperature > 0:
                    logits = normalised_logits(logits, blocks, temperature)
                loss = F.cross_entropy(logits, targets[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    head.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, rows in kept.items():
            getattr(head, name)[others] = rows

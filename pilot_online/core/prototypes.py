"""Online class prototypes as a memory for the classifier only (paper Sec. "Prototypes as a Proxy
for Memory", Eq. 1 and Eq. 2).

The bank keeps one running feature mean per class. Replaying those means through the final
FC layer ("FC recalibration") keeps old classes' logits calibrated without storing any image.
"""

from __future__ import annotations

import logging
from typing import Callable

from .checks import check_int
from .lazy import F, no_grad, torch
from .masks import check_labels

_LOG = logging.getLogger(__name__)


def class_sums(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int, dense: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums of ``features`` ``[B, D]`` and per-class counts (int64), deterministic on
    every device and without a host sync.

    ``dense`` None picks by device. On the CPU, ``index_add_`` (the default): it adds the rows
    in sample order, deterministically. Elsewhere ``index_add_`` uses atomic adds on floating
    point, whose order (and so the rounding) changes from run to run, so the sums are a masked
    ``[B, C, D]`` reduction over the batch instead: a fixed reduction order, no atomics, and no
    matmul (a one-hot matmul would round the features to TF32 under ``matmul_precision: high``
    and needs cuBLAS's workspace setting under ``torch.use_deterministic_algorithms``). Its
    memory is B x C x D elements for the step (100 x 200 x 768 fp32: 61 MB), freed at once.
    """
    if dense is None:
        dense = features.device.type != "cpu"
    if not dense:
        sums = features.new_zeros(num_classes, features.shape[1]).index_add_(0, labels, features)
        # index_add_ rather than bincount: bincount syncs with the host on CUDA.
        counts = torch.zeros(num_classes, dtype=torch.int64, device=labels.device)
        return sums, counts.index_add_(0, labels, torch.ones_like(labels))
    member = labels.unsqueeze(1) == torch.arange(num_classes, device=labels.device)  # [B, C]
    # where, not a product with the mask: a NaN feature stays in its own class's sum.
    picked = torch.where(member.unsqueeze(2), features.unsqueeze(1), features.new_zeros(()))
    return picked.sum(0), member.sum(0)


class PrototypeBank(torch.nn.Module):
    """Online class prototypes (paper Eq. 1) replayed through the classifier (Eq. 2).

    ``means`` ``[C, D]`` start at zero (``p_0 = 0``); ``counts`` ``[C]`` (int64) is ``k``, the
    number of samples averaged so far. Both are buffers, so ``.to()``, ``state_dict()`` and
    ``load_state_dict()`` (which rejects mismatched shapes) come from ``nn.Module``. A class is
    *seen* when its count is positive; the paper's ``p != 0`` test would wrongly drop a class
    whose mean happens to be zero.
    """

    means: torch.Tensor
    counts: torch.Tensor

    def __init__(
        self,
        num_classes: int,
        feature_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_classes = check_int("num_classes", num_classes, 1)
        self.feature_dim = check_int("feature_dim", feature_dim, 1)
        self.register_buffer(
            "means", torch.zeros(num_classes, feature_dim, device=device, dtype=dtype)
        )
        self.register_buffer("counts", torch.zeros(num_classes, device=device, dtype=torch.int64))

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, feature_dim={self.feature_dim}"

    @no_grad
    def update(self, features: torch.Tensor, labels: torch.Tensor, validate: bool = True) -> None:
        """Apply Eq. 1 for a whole batch: ``p <- (k * p + sum of the class's features) / (k + n)``.

        Equal to applying Eq. 1 once per sample in any order, without a loop over samples or
        classes. Features are detached and cast to the bank's device and dtype, so they may come
        from an autocast (fp16/bf16) forward pass.
        """
        if features.dim() != 2 or features.shape[1] != self.feature_dim:
            raise ValueError(
                f"features must have shape [B, {self.feature_dim}], got {tuple(features.shape)}"
            )
        if labels.dim() != 1 or labels.shape[0] != features.shape[0]:
            raise ValueError(
                f"labels must have shape [{features.shape[0]}] to match the features, "
                f"got {tuple(labels.shape)}"
            )
        if validate:  # one host sync; the training loop checks its dataset's labels once instead
            check_labels(labels, self.num_classes)
        if labels.numel() == 0:
            return
        labels = labels.to(device=self.means.device, dtype=torch.long)
        features = features.detach().to(device=self.means.device, dtype=self.means.dtype)

        batch_sums, batch_counts = class_sums(features, labels, self.num_classes)
        new_counts = self.counts + batch_counts
        # (k p + S) / (k + n) written as p + (S - n p) / (k + n): the same value, but it never
        # forms k * p, which loses precision once k is large. Classes absent from the batch get
        # (0 - 0 p) / max(k, 1) = 0 and keep their mean.
        batch_counts_f = batch_counts.to(self.means.dtype).unsqueeze(1)
        new_counts_f = new_counts.clamp(min=1).to(self.means.dtype).unsqueeze(1)
        self.means.add_((batch_sums - batch_counts_f * self.means) / new_counts_f)
        self.counts.copy_(new_counts)

    @no_grad
    def replace_means(self, means: torch.Tensor) -> None:
        """New class means ``[C, D']`` for the same classes and counts: the classifier now reads
        features of width ``D'`` (a method grew its network; the adapter mapped the old means)."""
        if means.dim() != 2 or means.shape[0] != self.num_classes:
            raise ValueError(
                f"means must have shape [{self.num_classes}, D], got {tuple(means.shape)}"
            )
        self.means = means.detach().to(self.means.device).clone()
        self.feature_dim = int(means.shape[1])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """A saved bank of another width (its network grew at a firing) loads at that width."""
        saved = state_dict.get(prefix + "means")
        if saved is not None and saved.shape[1] != self.feature_dim:
            self.replace_means(saved.to(self.means.dtype))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def seen(self) -> torch.Tensor:
        """Bool ``[C]``: classes with at least one sample (the paper's ``C_old``)."""
        return self.counts > 0

    def prototypes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(means of the seen classes [S, D], their class ids [S])``, in class order."""
        labels = self.seen.nonzero().squeeze(1)
        return self.means[labels], labels

    def loss(self, classifier: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Eq. 2: cross-entropy of ``classifier(prototypes)`` against their class ids.

        As in the Adam pseudo-code's "FC recalibration", logits of classes without a prototype
        are masked out (to the most negative finite value: the probabilities of ``-inf``, without
        NaN while no class is seen). Eq. 2 writes the normaliser as ``1/c``; both pseudo-codes
        (what the authors ran) use ``cross_entropy``'s mean over the seen prototypes, as we do.
        The prototypes are buffers, so gradients reach the classifier and never the bank. With
        no class seen yet the result is zero (with zero gradient), safe to add to a loss. The
        classifier receives the bank's dtype; cast inside it if it differs.
        """
        # Every class's row goes through the classifier and unseen rows are dropped with a
        # mask, instead of selecting the seen rows: the same value without a host sync per step.
        seen = self.seen
        logits = classifier(self.means)
        if logits.dim() != 2 or logits.shape != (self.num_classes, self.num_classes):
            raise ValueError(
                f"classifier must map [S, {self.feature_dim}] prototypes to [S, "
                f"{self.num_classes}] logits (one column per bank class), got "
                f"{tuple(logits.shape)} for S={self.num_classes}"
            )
        seen = seen.to(logits.device)
        # The most negative finite value rather than -inf: identical probabilities (exp
        # underflows to 0), but a bank with no class seen yet gives finite rows, not NaN.
        logits = logits.masked_fill(~seen, torch.finfo(logits.dtype).min)
        targets = torch.arange(self.num_classes, device=logits.device)
        per_class = F.cross_entropy(logits, targets, reduction="none")
        per_class = torch.where(seen, per_class, torch.zeros_like(per_class))
        return per_class.sum() / seen.sum().clamp(min=1)

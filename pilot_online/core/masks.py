"""Logit masks (paper appendix "Batch Wise Logits Mask").

A mask is a bool tensor ``[C]``: ``True`` keeps a class's logit, ``False`` sets it to ``-inf``
(the paper's additive mask ``m_j = 0`` or ``-inf``). Training in the blurry setting uses the
batch-wise mask (only the classes present in the current batch); evaluation uses the classes
seen so far. Everything is vectorised over classes.
"""

from __future__ import annotations

from .checks import check_choice
from .lazy import torch

#: Training-loss masks (the config's ``logit_mask`` choices).
LOGIT_MASKS = ("batch", "seen", "none")


def check_labels(labels: torch.Tensor, num_classes: int) -> None:
    """Raise a clear error for class ids outside ``[0, num_classes)``.

    Costs one host sync; without it CUDA indexing would hit a device-side assert instead.
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if labels.numel() == 0:
        return
    low, high = torch.aminmax(labels)  # one host sync for both bounds
    if bool((low < 0) | (high >= num_classes)):
        raise ValueError(
            f"labels must lie in [0, {num_classes - 1}], got values in [{int(low)}, {int(high)}]"
        )


def classes_present(labels: torch.Tensor, num_classes: int, validate: bool = True) -> torch.Tensor:
    """Bool ``[num_classes]``: which classes occur in ``labels`` (any shape).

    ``validate=False`` skips the range check and its host sync (the training loop checks the
    dataset's labels once instead of every step)."""
    if validate:
        check_labels(labels, num_classes)
    present = torch.zeros(num_classes, dtype=torch.bool, device=labels.device)
    return present.index_fill_(0, labels.reshape(-1).long(), True)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Return ``logits`` with the columns of disallowed classes set to ``-inf`` (out of place).

    Out of place so autograd sees the masked tensor and the caller's logits stay intact; masked
    columns then receive a zero gradient.
    """
    if allowed.dtype != torch.bool:
        raise TypeError(f"allowed must be a bool mask, got dtype {allowed.dtype}")
    if allowed.dim() != 1 or logits.dim() < 1 or logits.shape[-1] != allowed.shape[0]:
        raise ValueError(
            f"allowed must be a bool [C] matching the logits' last dimension; got allowed "
            f"{tuple(allowed.shape)} for logits {tuple(logits.shape)}"
        )
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def batch_mask(labels: torch.Tensor, num_classes: int, validate: bool = True) -> torch.Tensor:
    """The paper's batch-wise mask: only the classes present in the current batch."""
    return classes_present(labels, num_classes, validate)


def seen_mask(seen_classes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Evaluation mask from a bool ``[C]`` (returned as a copy) or a tensor of class ids."""
    if not isinstance(seen_classes, torch.Tensor):
        raise TypeError(f"seen_classes must be a torch.Tensor, got {type(seen_classes).__name__}")
    if seen_classes.dtype == torch.bool:
        if seen_classes.shape != (num_classes,):
            raise ValueError(
                f"a bool seen_classes mask must have shape ({num_classes},), "
                f"got {tuple(seen_classes.shape)}"
            )
        return seen_classes.clone()
    return classes_present(seen_classes, num_classes)


def training_mask(
    kind: str, labels: torch.Tensor, seen: torch.Tensor, num_classes: int, validate: bool = True
) -> torch.Tensor | None:
    """The training-time mask named by ``kind`` (one of ``LOGIT_MASKS``); ``None`` means no mask.

    ``"seen"`` includes the current batch's classes, so a sample's own logit is never masked
    even when ``seen`` was recorded before this batch.
    """
    check_choice("logit mask", kind, LOGIT_MASKS)
    if kind == "none":
        return None
    if kind == "batch":
        return batch_mask(labels, num_classes, validate)
    return seen_mask(seen, num_classes).to(labels.device) | batch_mask(
        labels, num_classes, validate
    )

"""The engine teacher: a frozen snapshot of the network, taken at a consolidation firing.

Upstream's distilling methods (iCaRL, COIL, DGR) copy and freeze their network at each task end
(``self._old_network = self._network.copy().freeze()``) and, through the next task, add a loss
between the network's logits and the old network's on the same inputs. Online, a method declares
``Consolidation(teacher=True)`` and the loop keeps that snapshot here: taken at each firing
before the method's ``consolidate`` runs (the task-end state), on the loop's device, run on every
training batch without gradients, and in every checkpoint, so that no method handles copies,
devices or resumes.

Checkpoints store only the snapshot's tensors that differ from the network's own when the
checkpoint is written: the frozen weights (most of a prompt method's ViT) equal the network's,
which the checkpoint restores first, so a snapshot adds what training changed since the firing,
not a second copy of everything. :meth:`Teacher.state_dict` checks each tensor (``torch.equal``)
rather than assuming which ones trained.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from ..core.lazy import nn, no_grad, torch
from .backbone_names import VIT_B16_PARAMETERS, VIT_B16_WIDTH

if TYPE_CHECKING:
    from .adapter import MethodAdapter, StepOutput


class Teacher:
    """A frozen network snapshot, the classes seen when it was taken, and its firing."""

    def __init__(self, module: nn.Module, classes: torch.Tensor, firing: int) -> None:
        self.module = module
        for p in module.parameters():  # gradients of the last step are not part of the snapshot
            p.grad = None
        #: Bool ``[C]``: the classes seen before the snapshot (upstream's ``_known_classes``).
        self.classes = classes.clone()
        self.firing = int(firing)

    @classmethod
    def take(cls, network: nn.Module, classes: torch.Tensor, firing: int) -> Teacher:
        """Snapshot ``network``: a deep copy with no gradients, in eval mode (upstream's
        ``copy().freeze()``). The whole network, as upstream keeps it: no port keeps less."""
        return cls(_frozen_copy(network), classes, firing)

    @no_grad
    def forward(self, adapter: MethodAdapter, inputs: torch.Tensor) -> StepOutput:
        """The snapshot's outputs on a training batch: the method's :meth:`~MethodAdapter.forward`
        with ``train=False``, in eval mode, without gradients, as upstream calls
        ``_old_network(inputs)`` after ``freeze``."""
        self.module.eval()
        return adapter.forward(self.module, inputs, train=False)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @no_grad
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        """The snapshot's tensors that differ from ``network``'s same-named ones now, the names
        of those that equal them, its classes and firing."""
        own = network.state_dict(keep_vars=True)
        differs, same = {}, []
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            mine = own.get(name)
            if (
                mine is not None
                and mine.shape == tensor.shape
                and mine.dtype == tensor.dtype
                and torch.equal(mine.detach(), tensor.detach())
            ):
                same.append(name)
            else:
                differs[name] = tensor.detach().clone()
        return {"differs": differs, "same": same, "classes": self.classes, "firing": self.firing}

    @classmethod
    @no_grad
    def from_state(cls, network: nn.Module, state: dict[str, Any]) -> Teacher:
        """Rebuild the snapshot from :meth:`state_dict` and ``network`` as restored from the same
        checkpoint (which holds the tensors the snapshot shared with it)."""
        module = _frozen_copy(network)
        tensors = module.state_dict(keep_vars=True)
        saved = set(state["differs"]) | set(state["same"])
        if saved != set(tensors):
            raise ValueError(
                "the checkpoint's teacher does not fit the network's structure: missing "
                f"{sorted(set(tensors) - saved)[:5]}, unexpected {sorted(saved - set(tensors))[:5]}"
            )
        for name, value in state["differs"].items():
            if tensors[name].shape != value.shape:
                raise ValueError(
                    f"teacher tensor {name} has shape {tuple(value.shape)} in the checkpoint, "
                    f"{tuple(tensors[name].shape)} in the network"
                )
            tensors[name].copy_(value)
        classes = state["classes"].to(next(iter(tensors.values())).device)
        return cls(module, classes, int(state["firing"]))


def _frozen_copy(network: nn.Module) -> nn.Module:
    teacher = copy.deepcopy(network)
    teacher.requires_grad_(False)
    return teacher.eval()


def teacher_bytes(num_classes: int) -> int:
    """The snapshot's memory for ``doctor``: a ViT-B/16 with a head over ``num_classes``, fp32
    (the distilling ports' networks)."""
    return 4 * (VIT_B16_PARAMETERS + int(num_classes) * (VIT_B16_WIDTH + 1))


def distillation_loss(
    student: torch.Tensor,
    target: torch.Tensor,
    columns: torch.Tensor,
    temperature: float,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Upstream's ``_KD_loss`` over the ``columns`` (bool ``[C]``) of both logit tensors:
    ``-sum(q * log_softmax(student / T)) / rows``, ``q = softmax(target / T)``, no ``T**2``
    factor, in fp32 (iCaRL, DGR, COIL's two terms, FOSTER's ``_KD_loss``). With ``weights``
    (``[C]``), FOSTER's ``BKD``: ``q`` times the class weights, renormalised per row.

    The columns are masked, not gathered (``logits[:, columns]`` would read the mask back to the
    host every step). Hidden columns are filled with the most negative finite value: the same
    softmaxes as gathering, and with no column at all the term is 0 with a zero gradient instead
    of NaN, so no host sync is needed to skip it. Gradients reach ``target`` too where it has
    any (COIL's new branch computes its target from the network's own features)."""
    hidden = ~columns.to(student.device)
    fill = torch.finfo(torch.float32).min
    log_p = torch.log_softmax((student.float() / temperature).masked_fill(hidden, fill), dim=1)
    q = torch.softmax((target.float() / temperature).masked_fill(hidden, fill), dim=1)
    if weights is not None:
        q = q * weights.to(q.device, q.dtype)
        q = q / q.sum(1, keepdim=True)
    return -torch.where(hidden, 0.0, q * log_p).sum() / student.shape[0]

"""Counting a method's FLOPs per image: the numbers the FLOP model, ``doctor`` and real-time
evaluation price a run by.

Why in the package: the built-in methods' counts are package data (``data/flops.json``, written
by ``benchmarks/flops.py`` with these functions), but a method registered from outside needs its
own counts on its card (``MethodCard.flops``), and ``pilot-online flops <name>`` prints them
without a checkout of this repository.

The network is built from the method's paper config (base row, :func:`method_config`) at 224 px
with random weights on the CPU, and counted with ``torch.utils.flop_counter.FlopCounterMode``
(2 FLOPs per multiply-add) on ``batch`` images:

- ``train_forward_flops_per_image``: ``adapter.forward(train=True)``, the query pass included;
- ``train_flops_per_image``: that plus the loss and ``backward`` (forward only for a method that
  trains nothing, such as SimpleCIL);
- ``query_flops_per_image``: the frozen query pass alone (0 without one);
- ``test_flops_per_image``: ``adapter.forward(train=False)``.

P and FGH are element-wise (no matrix products), so the base row stands for all four. A network
that grows at its firings (its card's ``grows``) is also counted after each of
:data:`GROWTH_FIRINGS` firings (``by_firings``), which the FLOP model extends task by task.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..engine.adapter import MethodAdapter, TrainingBatch
from ..engine.config import resolve_config
from ..engine.registry import get_method, method_card
from .configs import paper_config
from .protocol import method_short_name

#: Firings a growing network is counted after: 0, 1 and 2, enough for the FLOP model to extend a
#: linear (DER, MEMO) or settling (FOSTER) growth.
GROWTH_FIRINGS = 2

#: The image size the counts are of (``data/flops.json``'s ``img_size``; the FLOP model scales
#: them to a config's tokens).
COUNTED_IMG_SIZE = 224


def method_config(method: str, classes: int) -> dict[str, Any]:
    """The paper's config of ``method`` (base row) at 224 px, random weights, on the CPU, as one
    run of it: its first seed (a firing's draws read the run's one seed, ``run_seed``)."""
    raw = paper_config(method_short_name(method), "base", blurry=False)
    raw.pop("backbone_kwargs", None)  # 224 px
    seeds = raw.get("seed", 1993)
    raw.update(pretrained=False, device=[-1], online_prototypes=False, fgh=None)
    raw["seed"] = seeds[0] if isinstance(seeds, (list, tuple)) else seeds
    return {**resolve_config(raw), "nb_classes": classes, "nb_tasks": 20}


def counted(fn: Callable[[], Any]) -> tuple[int, Any]:
    """``fn()``'s FLOPs and its result."""
    with FlopCounterMode(display=False) as counter:
        result = fn()
    return counter.get_total_flops(), result


def count_network(
    adapter: MethodAdapter, network: torch.nn.Module, inputs: torch.Tensor, classes: int
) -> dict[str, float]:
    """FLOPs per image of one network as it stands, on ``inputs`` (one batch). The teacher's
    forward of a distilling method is not in it: the FLOP model adds a test forward for it."""
    batch_size = len(inputs)
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, classes, (batch_size,), generator=generator)
    seen = torch.ones(classes, dtype=torch.bool)
    known = torch.arange(classes) < classes // 2  # the first half: old classes

    adapter.set_mode(network, train=True)

    def forward() -> torch.Tensor:
        out = adapter.forward(network, inputs, train=True)
        # The method's terms (its classification loss, DER's auxiliary head, FOSTER's student):
        # part of its step.
        batch = TrainingBatch(inputs, labels, batch_size, seen, known, teacher=None)
        terms = dict(adapter.loss_terms(network, out, batch))
        loss = terms.pop("ce")
        if out.aux_loss is not None:
            loss = loss + out.aux_loss.reshape(())
        for term in terms.values():
            loss = loss + term.reshape(())
        return loss

    forward_flops, loss = counted(forward)
    backward_flops = 0
    if adapter.trains and loss.requires_grad:
        backward_flops, _ = counted(loss.backward)
    network.zero_grad(set_to_none=True)

    adapter.set_mode(network, train=False)
    with torch.no_grad():
        test_flops, _ = counted(lambda: adapter.forward(network, inputs, train=False))
        query_flops = 0
        query_pass = adapter.evaluation(network).query
        if query_pass is not None:
            query_flops, _ = counted(lambda: query_pass.features(inputs))
    return {
        "train_flops_per_image": (forward_flops + backward_flops) / batch_size,
        "train_forward_flops_per_image": forward_flops / batch_size,
        "query_flops_per_image": query_flops / batch_size,
        "test_flops_per_image": test_flops / batch_size,
    }


def count_method(method: str, classes: int = 200, batch: int = 1) -> dict[str, Any]:
    """FLOPs per image of the registered ``method`` (PILOT importable): its training step,
    training forward, query pass and test forward; for a network that grows at its firings, also
    after each of :data:`GROWTH_FIRINGS` firings (``by_firings``)."""
    from ..pilot.backbones import run_overrides

    config = method_config(method, classes)
    adapter = get_method(method)(args=config)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.rand(batch, 3, COUNTED_IMG_SIZE, COUNTED_IMG_SIZE, generator=generator)
    torch.manual_seed(0)
    with run_overrides(config):
        network = adapter.build_network(config)
        counts = count_network(adapter, network, inputs, classes)
        if not method_card(method).grows:
            return counts
        by_firings = [counts]
        for firing in range(GROWTH_FIRINGS):
            adapter.consolidate(network, firing)
            by_firings.append(count_network(adapter, network, inputs, classes))
    return {**counts, "by_firings": by_firings}


def card_literal(method: str, counts: dict[str, Any]) -> str:
    """The counts as the ``flops=`` argument of the method's ``MethodCard``, to paste."""
    width = max(len(k) for k in counts)
    lines = [f"    {k!r}:{' ' * (width - len(k))} {v!r}," for k, v in counts.items()]
    title = f"# {method}: FLOPs per image at {COUNTED_IMG_SIZE} px"
    return "\n".join([title, "flops={", *lines, "}"])

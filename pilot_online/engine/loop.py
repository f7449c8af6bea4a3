"""The one online training step, with named phases and a few hooks.

A step runs replay -> zero_grad -> forward -> loss -> backward -> transform gradients -> optimizer
step -> after-step. Mixins (``engine/mixins.py``: ``PrototypeMixin``, ``FGHMixin``,
``ReplayMixin``) override the hooks and call ``super()``; every hook has a no-op default here.
Hooks return values (loss terms, replayed samples, report entries) instead of writing shared state.

This module needs no PILOT: the PILOT learner and the core demo both drive an :class:`OnlineLoop`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.checks import boolean, check_choice, integer
from ..core.grad_norms import class_grad_norms
from ..core.lazy import nn, no_grad, torch
from ..core.masks import LOGIT_MASKS, classes_present, mask_logits, training_mask
from ..core.realtime import scores_online
from ..core.rng import capture_rng_state, restore_rng_state
from ..core.triggers import make_trigger
from .adapter import (
    Consolidated,
    Evaluation,
    MethodAdapter,
    QueryPass,
    StepOutput,
    TrainedStep,
    TrainingBatch,
    lr_scale,
    trained_parameters,
)
from .eval_cache import QueryCache, QueryCacheOptions
from .options import ConfigKey, Options, option
from .teacher import Teacher

logger = logging.getLogger(__name__)


#: Loads training samples by dataset index through the training transforms (``DataSource``).
SampleLoader = Callable[[np.ndarray], tuple["torch.Tensor", "torch.Tensor"]]


class NonFiniteLossError(FloatingPointError):
    """The loss stayed NaN/inf for too many consecutive steps: training is diverging."""


@dataclass
class StepStats:
    """Device-side statistics of one step; read (synced) only at log intervals."""

    loss: torch.Tensor
    correct: torch.Tensor
    samples: int
    skipped: bool = False
    #: The loss's terms by name (``ce``, ``prototypes``, ``method``, ...), detached.
    terms: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: Stream samples the model predicted right BEFORE this step (A_online, docs/protocol.md).
    online_correct: torch.Tensor | None = None
    #: Wall seconds of this step's A_online pass (0 on the free route), not training time.
    online_seconds: float = 0.0
    #: Samples ``online_correct`` counts (None: ``samples``) and stream batches the step
    #: stands for: in real-time mode also those that passed, scored only, while it ran.
    online_samples: int | None = None
    stream_batches: int = 1
    #: The consolidation firing this step began with (its index from 0), else None.
    firing: int | None = None


#: ``amp`` values: null (fp32) or "bf16" (autocast).
AMP_MODES = (None, "bf16")

#: ``matmul_precision`` values, torch's float32 matmul precisions: "highest" (full fp32, the
#: default), "high" (TF32 matmuls and cuDNN convolutions on Ampere and later GPUs; CPU matmuls
#: unchanged), "medium" (bf16-based matmuls where the hardware has them, CPUs with oneDNN too).
MATMUL_PRECISIONS = ("highest", "high", "medium")


@dataclass(frozen=True)
class LoopOptions(Options):
    """The training loop's own config keys (``engine/config.py`` gathers every component's)."""

    logit_mask: str = option(ConfigKey("batch", "training-loss logit mask", choices=LOGIT_MASKS))
    still_masked_rows: bool = option(
        ConfigKey(
            False,
            "opt-in, not the paper's: classifier rows with exactly zero gradient at a step "
            "(classes the batch mask shuts out) keep their weights and Adam moments, instead of "
            "moving on momentum (docs/scale-model.md measures it); the paper's configs leave it "
            "off",
            check=boolean,
        )
    )
    online_iter: int = option(
        ConfigKey(
            1,
            "optimiser steps per incoming stream batch (Si-Blurry's online_iter; its scripts use "
            "3): 1 is the paper's single pass; each step draws its own replay batch, the batch "
            "enters memory, prototypes and triggers once",
            check=integer(1),
        )
    )
    amp: str | None = option(
        ConfigKey(
            None,
            'null (fp32) or "bf16": bfloat16 autocast in training and evaluation',
            choices=AMP_MODES,
        )
    )
    matmul_precision: str = option(
        ConfigKey(
            "highest",
            'float32 matmuls: "highest" (fp32), "high" (TF32 on Ampere+ GPUs), "medium" '
            "(bf16-based)",
            choices=MATMUL_PRECISIONS,
        )
    )
    max_nonfinite_steps: int = option(
        ConfigKey(10, "consecutive non-finite losses tolerated before stopping", check=integer(0))
    )
    grad_trace: bool = option(
        ConfigKey(
            True,
            "record per-step classifier-row gradient norms (imbalance plots)",
            check=boolean,
        )
    )


#: The constant-LR optimisers of online training, by config name (the ``optimizer`` choices):
#: the ``torch.optim`` class's name (looked up when one is made, so the key table needs no torch)
#: and its fixed extra arguments.
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "sgd": ("SGD", {"momentum": 0.9}),
}


def make_optimizer(
    name: str,
    params: list[nn.Parameter],
    lr: float,
    weight_decay: float,
    lr_scales: list[float] | None = None,
) -> torch.optim.Optimizer:
    """The constant-LR optimiser of online training (no scheduler: stream length is unknown).

    ``lr_scales`` (one per parameter, :func:`~.adapter.lr_scale`; None: all 1) put the
    parameters of each distinct scale in one group at ``lr * scale`` (SLCA's slow backbone), in
    order of first appearance; the group's ``lr_scale`` entry records it. All scales equal: one
    group, so that a method that trains nothing (SimpleCIL) gets an empty one."""
    class_name, extra = OPTIMIZERS[check_choice("optimizer", name, OPTIMIZERS)]
    optimizer_cls = getattr(torch.optim, class_name)
    params = list(params)
    scales = [1.0] * len(params) if lr_scales is None else [float(s) for s in lr_scales]
    if len(scales) != len(params):
        raise ValueError(f"got {len(scales)} lr_scales for {len(params)} parameters")
    bad = [s for s in scales if not (math.isfinite(s) and s > 0)]
    if bad:
        raise ValueError(
            f"lr_scale must be finite and > 0, got {bad[0]}: to freeze a parameter, set "
            "requires_grad_(False) in build_network instead"
        )
    groups: dict[float, list[nn.Parameter]] = {}
    for p, scale in zip(params, scales):
        groups.setdefault(scale, []).append(p)
    param_groups = [
        {"params": ps, "lr": lr * scale, "lr_scale": scale} for scale, ps in groups.items()
    ] or [{"params": [], "lr_scale": 1.0}]
    return optimizer_cls(param_groups, lr=lr, weight_decay=weight_decay, **extra)


def check_classifier(adapter: MethodAdapter, network: nn.Module) -> None:
    """The adapter's :meth:`~MethodAdapter.classifier` must be a built linear layer: prototypes
    are replayed through it, FGH's class mode and the gradient trace read its rows. PILOT builds
    heads in ``update_fc`` at task boundaries, which online training never reaches, so a port
    that reuses a PILOT network as it is finds ``fc = None`` here."""
    name = type(adapter).__name__
    layer = adapter.classifier(network)
    if layer is None:
        raise ValueError(
            f"{name}.classifier() returned None: PILOT builds heads in update_fc at task "
            "boundaries, which online training never calls. Build the head in build_network "
            "with self.online_head(network, args) (one nn.Linear over args['nb_classes']) and "
            "return it from classifier()"
        )
    weight = getattr(layer, "weight", None)
    if not isinstance(getattr(layer, "in_features", None), int) or weight is None:
        raise ValueError(
            f"{name}.classifier() returned {type(layer).__name__}, not a linear layer with "
            "in_features and weight: return the nn.Linear that produces the logits (build one "
            "with self.online_head(network, args))"
        )


@dataclass(frozen=True)
class ParameterChange:
    """What a method did to the trained parameters, as one event: at a firing, after a step (a
    restart), or on a resume. The optimiser, FGH, the prototypes and the replay memory learn of
    it through :meth:`OnlineLoop.parameters_changed` alone, and the loop's list of trained
    parameters (what a checkpoint saves, by name) is updated before it is sent.

    ``restarted``: parameters the method reset, whose history must go (optimiser moments, FGH's
    stored signals); ``replaced``: ``(name, old, new)``, a new tensor under a trained name (new
    None: the name is gone); ``added``: ``(name, parameter)`` pairs the loop did not train yet;
    ``feature_map``: a firing's map of the classifier's old features into its new ones
    (:attr:`Consolidated.feature_map`); ``rebuilding``: a resume's rebuild, whose every value
    (prototypes and memory included) loads right after, so nothing is mapped.
    """

    restarted: tuple[nn.Parameter, ...] = ()
    replaced: tuple[tuple[str, nn.Parameter, nn.Parameter | None], ...] = ()
    added: tuple[tuple[str, nn.Parameter], ...] = ()
    feature_map: Callable[[torch.Tensor], torch.Tensor] | None = None
    rebuilding: bool = False

    def classifier_replaced(self, layer: nn.Linear) -> bool:
        """Whether ``layer``'s weight is a replacement (DER's wider head)."""
        return any(new is layer.weight for *_, new in self.replaced)

    def mapped_features(self, layer: nn.Linear, component: str) -> Callable | None:
        """The feature map a component holding features of ``layer``'s input applies (None: no
        mapping to do); a replaced classifier without one is refused, naming ``component``."""
        if self.rebuilding or not self.classifier_replaced(layer):
            return None
        if self.feature_map is None:
            raise ValueError(
                f"a firing replaced the classifier's weight, so {component} no longer fit it: "
                "return Consolidated(restarted=..., feature_map=<old features -> new>) from "
                "consolidate() (docs/porting.md, Networks that grow at a firing)"
            )
        return self.feature_map

    def __bool__(self) -> bool:
        return bool(self.restarted or self.replaced or self.added)


class StillMaskedRows:
    """``still_masked_rows``: the classifier rows whose gradient is exactly zero at a step keep
    their weights and their optimiser state through it.

    Why: the paper runs one Adam over the whole stream with the batch logit mask. The rows of
    classes the mask shuts out get zero gradient, yet Adam moves them on their momentum, as far
    as the trained rows move; upstream PILOT makes a fresh optimiser at each task, so its masked
    rows stay still. Opt-in, a difference from the paper (``docs/scale-model.md``)."""

    def __init__(self, classifier: nn.Linear, optimizer: torch.optim.Optimizer) -> None:
        self.params = [p for p in (classifier.weight, classifier.bias) if p is not None]
        self.optimizer = optimizer

    def __enter__(self) -> None:
        weight = self.params[0]
        self.saved = []
        if weight.grad is None:
            return
        still = weight.grad.flatten(1).eq(0).all(1)
        for p in self.params[1:]:
            if p.grad is not None:
                still &= p.grad.eq(0)
        # A row mask, no row indices: no host sync in the step (the head is small, C x D).
        self.still = still
        self.saved = [
            (p, p.detach().clone(), {
                k: v.clone()
                for k, v in self.optimizer.state.get(p, {}).items()
                if torch.is_tensor(v) and v.shape[:1] == p.shape[:1] and v.ndim == p.ndim
            })
            for p in self.params
        ]  # fmt: skip

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for p, value, state in self.saved:
                rows = self.still.view(-1, *[1] * (p.ndim - 1))
                p.copy_(torch.where(rows, value, p))
                for key, before in state.items():
                    current = self.optimizer.state[p][key]
                    current.copy_(torch.where(rows, before, current))


class OnlineLoop:
    """Single-pass training mechanics for one method adapter and its network."""

    def __init__(
        self,
        adapter: MethodAdapter,
        network: nn.Module,
        config: Mapping[str, Any],
        num_classes: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.adapter = adapter
        self.network = network.to(device)
        self.config = config
        self.num_classes = num_classes
        self.device = torch.device(device)
        check_classifier(adapter, self.network)
        # What trains (requires_grad), by name; a parameter the method freezes later stays here,
        # in its optimiser group.
        self.named_parameters = trained_parameters(self.network)
        if not self.named_parameters and adapter.trains:
            raise ValueError(
                f"{type(adapter).__name__} exposes no trainable parameters; a method that learns "
                "without gradients sets trains = False and learns in after_step()"
            )
        self.optimizer = make_optimizer(
            config.get("optimizer", "adam"),
            [p for _, p in self.named_parameters],
            lr=float(config.get("init_lr", 5e-3)),
            weight_decay=float(config.get("weight_decay", 0.0)),
            lr_scales=[lr_scale(adapter, name) for name, _ in self.named_parameters],
        )
        options = LoopOptions.of(config)
        self.logit_mask = options.logit_mask
        self.still_masked_rows = bool(options.still_masked_rows)
        # A_online (docs/protocol.md): each stream batch scored before the step trains on it.
        self.online_accuracy = scores_online(config)
        # Optimiser steps per stream batch (``online_iter``, upstream Si-Blurry's).
        self.online_iter = int(options.online_iter)
        self.max_nonfinite_steps = int(options.max_nonfinite_steps)
        self.seen = torch.zeros(num_classes, dtype=torch.bool, device=self.device)
        # Classes seen before the last firing (upstream's _known_classes), and the engine teacher
        # (``engine/teacher.py``) of a method whose Consolidation keeps one: both set at each
        # firing.
        self.known = torch.zeros(num_classes, dtype=torch.bool, device=self.device)
        self.teacher: Teacher | None = None
        self.optimizer_steps = 0
        self.samples_seen = 0
        self.skipped_nonfinite_steps = 0
        self._nonfinite_streak = 0
        self._grad_norm_sum = torch.zeros(num_classes, device=self.device)
        self._grad_trace: list[torch.Tensor] | None = [] if options.grad_trace else None
        # Set by the session (``attach_samples``): replay loads memory samples through it.
        self.sample_loader: SampleLoader | None = None
        # Frozen query features by test-sample index (``engine/eval_cache.py``); methods without a
        # query pass (``Evaluation.query`` None) never use it.
        self.query_cache = QueryCache(QueryCacheOptions.of(config).eval_query_cache, self.device)
        self.amp = options.amp
        check_amp(self.amp, self.device)
        self.matmul_precision = check_choice(
            "matmul_precision", options.matmul_precision, MATMUL_PRECISIONS
        )
        # When the adapter's consolidate() runs: decided from the stream alone.
        self.trigger = make_trigger(config, num_classes)
        # The adapter's evaluation (``adapter.evaluation``: its view and query pass), reused by
        # every evaluation until the training state changes; dropped then, so a view of a whole
        # backbone (CoFiMA's, DUCT's merge) is not held while training goes on.
        self._evaluation: Evaluation | None = None

    def attach_samples(self, loader: SampleLoader) -> None:
        """Give the loop a way to load training samples by index (what replay draws need)."""
        self.sample_loader = loader

    # -- hooks (mixins override and call super()) -------------------------------------------------
    # A mixin builds its component in ``__init__``, after ``super().__init__`` made the optimiser;
    # the step hooks share the adapter's names and moments (``loss_terms``, ``after_backward``,
    # ``after_step``), the state hooks torch's (``state_dict``, ``load_state_dict``).
    def replay_batch(
        self, indices: np.ndarray | None, labels: torch.Tensor, repeat: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Samples trained beside the stream batch (``indices``, ``labels``) in this step, or None.

        Called before the forward pass; experience replay draws its memory batch here. ``repeat``:
        None for the batch's own step (the last), which offers the batch to the memory; k for its
        extra optimiser step k (0-based: ``online_iter`` > 1), which offers nothing."""
        return None

    def loss_terms(self, out: StepOutput, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Extra loss terms, by name, added to the classification loss (``out`` and ``labels``
        cover the whole training batch: the stream batch plus any replayed samples)."""
        return {}

    def after_backward(self) -> None:
        """Between backward and the optimiser step, on finite steps, after the adapter's
        ``after_backward`` (DGR's class reweighting): the mixins' (FGH), which see its result."""

    def after_step(self, step: TrainedStep) -> None:
        """After each optimiser step, once the adapter's ``after_step`` ran and what it restarted
        was dropped: the same :class:`TrainedStep`, whose ``stream`` (the stream batch's
        pre-update outputs, at the batch's own step) is what the prototypes and the herding
        memory observe; replayed samples are not new observations of the stream."""

    def parameters_changed(self, change: ParameterChange) -> None:
        """The one place a change of the trained parameters is applied (mixins call ``super()``
        and update their own component). Here, the optimiser: a restarted parameter loses its
        state (Adam's moments must not carry the old history); a replacement takes its
        predecessor's place in its group with no state (upstream makes a new optimiser at each
        task, and Adam's moments of a differently shaped tensor cannot carry over); an added
        parameter joins the group of its factor (:func:`~.adapter.lr_scale`; a new group for a new
        one)."""
        for p in change.restarted:
            self.optimizer.state.pop(p, None)
        for name, old, new in change.replaced:
            group, position = next(
                (g, i)
                for g in self.optimizer.param_groups
                for i, p in enumerate(g["params"])
                if p is old
            )
            self.optimizer.state.pop(old, None)
            if new is None:
                del group["params"][position]
                continue
            if lr_scale(self.adapter, name) != group["lr_scale"]:
                raise ValueError(
                    f"{name} was replaced by a parameter with another lr_scale: a replacement "
                    "keeps its predecessor's learning rate"
                )
            group["params"][position] = new
        lr = float(self.config.get("init_lr", 5e-3))
        for name, p in change.added:
            scale = lr_scale(self.adapter, name)
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"lr_scale must be finite and > 0, got {scale} for {name}")
            group = next((g for g in self.optimizer.param_groups if g["lr_scale"] == scale), None)
            if group is None:
                self.optimizer.add_param_group({"params": [p], "lr": lr * scale, "lr_scale": scale})
            else:
                group["params"].append(p)

    def _sync_parameters(
        self,
        restarted: Iterable[nn.Parameter] = (),
        saved_names: Iterable[str] = (),
        feature_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """After the method acted (a firing, a restart after a step, a resume's rebuild): re-read
        its trainable parameters, update the loop's list, and send one :class:`ParameterChange`
        with what it ``restarted``, what now stands under a known name and what is new.
        ``saved_names`` (a resume): the checkpoint's parameters, in its order, adopted even if the
        method has frozen them since."""
        everything = dict(self.network.named_parameters())
        replaced = tuple(
            (n, p, everything.get(n))
            for n, p in self.named_parameters
            if everything.get(n) is not p
        )
        if replaced:  # a firing put new tensors under known names (DER's wider head), or none
            self.named_parameters = [
                (n, everything[n]) for n, _ in self.named_parameters if n in everything
            ]
        known = {name for name, _ in self.named_parameters}
        added = [(n, everything[n]) for n in saved_names if n not in known and n in everything]
        known.update(n for n, _ in added)
        added += [(n, p) for n, p in trained_parameters(self.network) if n not in known]
        if added:
            self.named_parameters += added
            logger.info("%d new trainable parameters: %s", len(added), [n for n, _ in added][:4])
        change = ParameterChange(
            tuple(restarted), replaced, tuple(added), feature_map, rebuilding=bool(saved_names)
        )
        if change:
            self.parameters_changed(change)

    def report(self) -> dict[str, Any]:
        """Entries for the results file's ``diagnostics`` (the adapter's under ``method``)."""
        report: dict[str, Any] = {}
        method = self.adapter.report()
        if method:
            report["method"] = method
        if self.trigger.name != "never":
            report["consolidation"] = {
                "trigger": self.trigger.name,
                "firings": list(self.trigger.firings),
            }
        return report

    # -- the step --------------------------------------------------------------------------------
    def train_step(
        self, inputs: torch.Tensor, labels: torch.Tensor, indices: np.ndarray | None = None
    ) -> StepStats:
        """One online step on one stream batch (``indices``: its dataset indices, for replay),
        under the run's ``matmul_precision`` and, on the CPU, torch's deterministic algorithms
        (both put back afterwards: see :func:`matmul_precision`, :func:`deterministic_on_cpu`).
        """
        with matmul_precision(self.matmul_precision), deterministic_on_cpu(self.device):
            return self._train_step(inputs, labels, indices)

    def _train_step(
        self, inputs: torch.Tensor, labels: torch.Tensor, indices: np.ndarray | None = None
    ) -> StepStats:
        """One online step on one stream batch (``indices``: its dataset indices, for replay).

        Replayed samples join the stream batch in one forward pass (a ViT normalises per sample,
        so for the methods without batch-level state this equals two passes, at less cost; with
        the prompt vote of L2P/DualPrompt the replayed samples vote too, and MVP counts their key
        use); the loss is the mean over both. Counters, accuracy and the observation
        (``TrainedStep.stream``) cover the stream batch only. ``online_correct`` is scored before
        anything of the step changes the model (A_online), by :meth:`predict_online`: an
        eval-mode pass under the evaluation view, which the training forward is not (dropout,
        prompt votes, views).

        ``online_iter`` = k (upstream Si-Blurry's ``online_step``: k ``online_train`` calls on
        the same batch) makes k optimiser steps on the batch, each a whole step (forward, loss,
        backward, FGH, optimiser, ``after_step``) with its own replay draw; the trigger, the
        A_online score, the sample counters and the observation (memory insertion, prototypes,
        the adapter's learning from the stream) see the batch once: scored and triggered before
        the first step, observed at the batch's own step (the last: its ``after_step`` carries
        the stream batch's pre-update outputs), if that step is finite. The step's ``loss`` and
        ``terms`` are the means over its finite steps, ``correct`` the first step's (the
        prediction before any update on the batch)."""
        online_correct, online_seconds = None, 0.0
        if self.online_accuracy:
            online_correct, online_seconds = self._score_online(inputs, labels)
        fires = self.trigger.update(labels)
        self._evaluation = None  # derived from the state this step changes
        firing = len(self.trigger.firings) - 1 if fires else None
        if firing is not None:
            self._consolidate(firing)
        stream_size = len(labels)
        host_labels = labels
        inputs = inputs.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True).long()
        steps = self.online_iter if self.adapter.trains else 1
        finished: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        skipped: StepStats | None = None
        for iteration in range(steps):
            # The extra steps' draws first, the batch's own draw (which offers the batch to the
            # memory) last: every draw is from the memory as it was before this batch, as
            # upstream draws all k memory batches before its update_memory.
            last = iteration == steps - 1
            replay = self.replay_batch(indices, host_labels, None if last else iteration)
            out, logits, terms, loss, batch_inputs, batch_labels = self._forward_loss(
                inputs, labels, replay
            )
            if iteration == 0:
                correct = (logits[:stream_size].detach().argmax(1) == labels).sum()
                self.samples_seen += stream_size
                online = {
                    "online_correct": online_correct,
                    "online_seconds": online_seconds,
                    "firing": firing,
                }
            # The batch's own step (the last) observes the stream batch, by its outputs as they
            # are before this step's update.
            stream = _stream_rows(out, stream_size) if last else None
            if not self.adapter.trains:  # it learns in after_step(): no backward, no update
                detached = _detached(terms)
                self._after_step(
                    TrainedStep(batch_inputs, batch_labels, stream_size, detached, stream)
                )
                self._count_for_trigger(stream_size, detached)
                return StepStats(loss.detach(), correct, stream_size, terms=detached, **online)
            loss, detached = self._backward_and_step(
                loss, terms, batch_inputs, batch_labels, stream_size, stream
            )
            if detached is None:
                skipped = self._skip_nonfinite(loss, correct, stream_size, terms)
                continue
            finished.append((loss.detach(), detached))
        if not finished:
            return dataclasses.replace(skipped, **online)
        loss, detached = _mean_step(finished)
        self._count_for_trigger(stream_size, detached)
        return StepStats(loss, correct, stream_size, terms=detached, **online)

    def _forward_loss(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        replay: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[StepOutput, torch.Tensor, dict, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The training forward and its loss terms on the stream batch (``inputs``, ``labels``,
        on the device) plus the ``replay`` samples: (outputs, masked logits, terms, loss, the
        training batch's inputs and labels)."""
        stream_size = len(labels)
        batch_labels = labels
        if replay is not None:
            inputs = torch.cat([inputs, replay[0].to(self.device, non_blocking=True)])
            batch_labels = torch.cat([labels, replay[1].to(self.device, non_blocking=True).long()])
        self.adapter.set_mode(self.network, train=True)
        self.optimizer.zero_grad(set_to_none=True)

        with self.autocast():  # a no-op unless amp is set
            out = self.adapter.forward(self.network, inputs, train=True)
            # Labels were range-checked once for the whole dataset (OnlineSession): no sync here.
            self.seen |= classes_present(labels, self.num_classes, validate=False)
            # The batch-wise mask covers the classes of the stream batch and of replayed samples.
            mask = training_mask(
                self.logit_mask, batch_labels, self.seen, self.num_classes, validate=False
            )
            batch = TrainingBatch(
                inputs, batch_labels, stream_size, self.seen, self.known, self._teach(inputs), mask
            )
            logits = batch.masked(out.logits)
            method_terms = dict(self.adapter.loss_terms(self.network, out, batch))
            if "ce" not in method_terms:
                raise ValueError(
                    f"{type(self.adapter).__name__}.loss_terms returned {sorted(method_terms)}, "
                    'without the classification term "ce": start from super().loss_terms(...)'
                )
            # In the order the loss has always summed them: the classification term, the
            # forward's own, the method's others, then the mixins' (P's).
            terms = {"ce": method_terms.pop("ce")}
            if out.aux_loss is not None:
                terms["method"] = out.aux_loss
            terms.update(method_terms)
            terms.update(self.loss_terms(out, batch_labels))
            loss = torch.stack([t.reshape(()) for t in terms.values()]).sum()
        return out, logits, terms, loss, inputs, batch_labels

    def _backward_and_step(
        self,
        loss: torch.Tensor,
        terms: dict[str, torch.Tensor],
        inputs: torch.Tensor,
        batch_labels: torch.Tensor,
        stream_size: int,
        stream: StepOutput | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """Backward, the finite check, the gradient transforms, the optimiser step and
        ``after_step`` (with ``stream``, the observation, at the batch's own step): (the step's
        loss, its detached terms, or None when it was non-finite and so not taken). The extra
        backward's terms join ``terms`` in place, and the loss."""
        loss.backward()
        finite = self._finite(loss)
        if finite:
            # The method's own gradient work (DGR's reweighting, CoFiMA's Fisher sum), and terms
            # it backpropagates itself, one graph at a time (oLoRA's hard buffer): their
            # gradients accumulate into .grad, their values join the loss and its terms.
            extra = self.adapter.after_backward(self.network, self.autocast)
            if extra:
                terms.update(extra)
                loss = loss.detach() + torch.stack([t.reshape(()) for t in extra.values()]).sum()
                finite = self._finite(loss)
        if not finite:
            return loss, None
        self._nonfinite_streak = 0
        self.after_backward()
        self._record_gradient_norms()
        if self.still_masked_rows:
            with StillMaskedRows(self.adapter.classifier(self.network), self.optimizer):
                self.optimizer.step()
        else:
            self.optimizer.step()
        self.optimizer_steps += 1
        detached = _detached(terms)  # once: after_step's and the batch's means alike
        self._after_step(TrainedStep(inputs, batch_labels, stream_size, detached, stream))
        return loss, detached

    def _after_step(self, step: TrainedStep) -> None:
        """The adapter's ``after_step``, what it restarted dropped, then the mixins'."""
        restarted = list(self.adapter.after_step(self.network, step))
        if restarted:
            self._sync_parameters(restarted)
        self.after_step(step)

    def _finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss and every trained gradient are finite: one host sync, as GradScaler
        makes, so that a NaN/inf reaches neither the weights nor FGH's stored signals."""
        grads = [p.grad for _, p in self.named_parameters if p.grad is not None]
        finite = torch.isfinite(loss)
        if grads:
            finite = finite & torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()
        return bool(finite)

    def score_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        """A_online's score of a stream batch no step trains on (real-time mode's skipped
        batches): :meth:`predict_online` under the run's ``matmul_precision``, with its wall
        time (a device count and seconds)."""
        with matmul_precision(self.matmul_precision):
            return self._score_online(inputs, labels)

    def _score_online(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """:meth:`predict_online` and its wall time, between two device syncs (CUDA), so that
        the pass's time is told apart from training's (it is evaluation, not the method's cost)."""
        _synchronize(self.device)
        start = time.perf_counter()
        correct = self.predict_online(inputs, labels)
        _synchronize(self.device)
        return correct, time.perf_counter() - start

    @no_grad
    def predict_online(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """How many of the stream batch's samples the model as it stands predicts right, as
        evaluation would (eval mode, the evaluation view, classes seen before the batch): the
        A_online pass. Under no_grad and a forked RNG, so training goes on exactly as without
        it (the view's tensors are swapped back; eval mode updates no running statistics)."""
        inputs = inputs.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True).long()
        state = capture_rng_state(self.device)
        try:
            with self.evaluation_view(), self.autocast():
                self.adapter.set_mode(self.network, train=False)
                logits = self.adapter.forward(self.network, inputs, train=False).logits
        finally:
            restore_rng_state(state, self.device)
        return online_hits(logits, labels, self.seen)

    def _count_for_trigger(self, stream_size: int, terms: Mapping[str, torch.Tensor]) -> None:
        """The consolidation trigger counts the batch once, after its last finite step (with its
        steps' mean classification loss, if it reads it)."""
        self.trigger.observe(stream_size, terms["ce"] if self.trigger.needs_loss else None)

    def _consolidate(self, firing: int) -> None:
        """Before a step, when the trigger fired (``firing``: its index): the adapter
        consolidates, and what it restarted loses its optimiser and FGH state."""
        logger.info("consolidation %d at stream sample %d", firing, self.samples_seen)
        self.known = self.seen.clone()
        # The teacher takes the task-end state, before the method's boundary step.
        if self.adapter.consolidation.teacher:
            self.teacher = None  # the old snapshot's memory is free before the copy is made
            self.teacher = Teacher.take(self.network, self.known, firing)
        consolidated = self.adapter.consolidate(self.network, firing)
        if not isinstance(consolidated, Consolidated):
            raise TypeError(
                f"{type(self.adapter).__name__}.consolidate returned "
                f"{type(consolidated).__name__}: return Consolidated(restarted=[...]) "
                "(pilot_online.engine.adapter)"
            )
        self._sync_parameters(consolidated.restarted, feature_map=consolidated.feature_map)

    def _teach(self, inputs: torch.Tensor) -> StepOutput | None:
        """The teacher's outputs on the training batch (inside the forward's autocast), or None
        before the first firing and for methods without one."""
        return None if self.teacher is None else self.teacher.forward(self.adapter, inputs)

    def _skip_nonfinite(self, loss, correct, samples, terms) -> StepStats:
        self.skipped_nonfinite_steps += 1
        self._nonfinite_streak += 1
        bad = [f"loss term {name}" for name, t in terms.items() if not torch.isfinite(t).all()]
        bad = bad or [
            f"gradient of {name}"
            for name, p in self.named_parameters
            if p.grad is not None and not torch.isfinite(p.grad).all()
        ]
        self.optimizer.zero_grad(set_to_none=True)
        logger.warning("non-finite %s at sample %d: step skipped", bad, self.samples_seen)
        if self._nonfinite_streak > self.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"the loss or its gradients were non-finite for {self._nonfinite_streak} "
                f"consecutive steps ({', '.join(bad)}; stream sample {self.samples_seen}): "
                "training diverged. Lower "
                f"init_lr (now {self.config.get('init_lr')}) or the FGH gamma, or check the inputs "
                "for NaNs; raise max_nonfinite_steps to tolerate longer streaks"
            )
        detached = _detached(terms)
        return StepStats(loss.detach(), correct, samples, skipped=True, terms=detached)

    @no_grad
    def _record_gradient_norms(self) -> None:
        """Per-class gradient norm of the classifier rows, after reweighting (paper Sec. 5.1)."""
        fc = self.adapter.classifier(self.network)
        if fc.weight.grad is None:
            return
        norms = class_grad_norms(fc.weight, fc.bias)
        self._grad_norm_sum += norms
        if self._grad_trace is not None:
            # float32 on every device, so CPU and GPU results files hold the same precision.
            self._grad_trace.append(norms.to(torch.float32))

    def gradient_statistics(self, include_trace: bool = True) -> dict[str, np.ndarray]:
        """``mean``: g^j = mean over steps of ||g_t^j||; ``trace``: steps x classes, if kept
        (and ``include_trace``)."""
        steps = max(self.optimizer_steps, 1)
        stats = {"mean": (self._grad_norm_sum / steps).float().cpu().numpy()}
        if include_trace and self._grad_trace:
            stats["trace"] = torch.stack(self._grad_trace).float().cpu().numpy()
        return stats

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything training changed: trainable parameters and the network's buffers (not the
        frozen weights, which the network rebuilds identically), the adapter's extra state, the
        optimiser, counters and gradient statistics. Mixins add their components' state."""
        trace = self._grad_trace
        return {
            "parameters": {name: p.detach() for name, p in self.named_parameters},
            "buffers": dict(self.network.named_buffers()),
            "adapter": self.adapter.state_dict(self.network),
            "optimizer": self.optimizer.state_dict(),
            "seen": self.seen,
            "optimizer_steps": self.optimizer_steps,
            "samples_seen": self.samples_seen,
            "skipped_nonfinite_steps": self.skipped_nonfinite_steps,
            "nonfinite_streak": self._nonfinite_streak,
            "grad_norm_sum": self._grad_norm_sum,
            "grad_trace": None if trace is None else (torch.stack(trace) if trace else []),
            "query_cache": self.query_cache.state_dict(),
            "trigger": self.trigger.state_dict(),
            "known": self.known,
            "teacher": None if self.teacher is None else self.teacher.state_dict(self.network),
        }

    @no_grad
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a loop built from the same config and network.

        The adapter's extra state first: a method that added parameters at its firings rebuilds
        them there, and the loop adopts them (in the checkpoint's order) before any value loads."""
        self._evaluation = None
        self.adapter.load_state_dict(self.network, state["adapter"])
        self._sync_parameters(saved_names=state["parameters"])
        for kind, current in (
            ("parameters", dict(self.named_parameters)),
            ("buffers", dict(self.network.named_buffers())),
        ):
            saved = state[kind]
            if set(saved) != set(current):
                raise ValueError(
                    f"the checkpoint's trainable {kind} differ from the network's: "
                    f"missing {sorted(set(current) - set(saved))[:5]}, "
                    f"unexpected {sorted(set(saved) - set(current))[:5]}"
                )
            for name, tensor in current.items():
                if tensor.shape != saved[name].shape:
                    raise ValueError(
                        f"{kind[:-1]} {name} has shape {tuple(tensor.shape)} but "
                        f"{tuple(saved[name].shape)} in the checkpoint"
                    )
                tensor.copy_(saved[name])
        self.trigger.load_state_dict(state["trigger"])
        self.known.copy_(state["known"])
        teacher = state["teacher"]
        self.teacher = None if teacher is None else Teacher.from_state(self.network, teacher)
        self.optimizer.load_state_dict(state["optimizer"])
        self.seen.copy_(state["seen"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.samples_seen = int(state["samples_seen"])
        self.skipped_nonfinite_steps = int(state["skipped_nonfinite_steps"])
        self._nonfinite_streak = int(state["nonfinite_streak"])
        self._grad_norm_sum.copy_(state["grad_norm_sum"])
        trace = state["grad_trace"]
        if self._grad_trace is not None:
            self._grad_trace = [row.to(self.device) for row in trace] if len(trace) else []
        # Last, once the network is restored: the cache is valid for the query pass as it is now.
        # Only a filled cache needs the query pass (and so the evaluation derived here).
        query = None
        if state["query_cache"]["store"] is not None:
            query = self._derived_evaluation().query
        self.query_cache.load_state_dict(state["query_cache"], query.parameters if query else [])

    # -- evaluation ------------------------------------------------------------------------------
    @no_grad
    def predict(
        self,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        allowed: torch.Tensor,
        topk: int,
        sample_ids: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k predictions over ``batches`` with logits outside ``allowed`` masked out, under
        the run's ``matmul_precision``.

        ``sample_ids``: the test-sample index of each row of ``batches``, in order, given only when
        the test transforms are deterministic; with them, the query cache serves the method's
        frozen query pass (``engine/eval_cache.py``)."""
        with matmul_precision(self.matmul_precision), self.evaluation_view() as evaluation:
            query_pass = None if sample_ids is None else evaluation.query
            return self._predict(batches, allowed, topk, query_pass, sample_ids)

    def _derived_evaluation(self) -> Evaluation:
        """The adapter's :meth:`~MethodAdapter.evaluation` of the training state as it is now,
        derived in eval mode, without gradients, under a forked RNG; cached."""
        if self._evaluation is None:
            self.adapter.set_mode(self.network, train=False)
            state = capture_rng_state(self.device)
            try:
                with torch.no_grad():
                    evaluation = self.adapter.evaluation(self.network)
            finally:
                restore_rng_state(state, self.device)
            if not isinstance(evaluation, Evaluation):
                raise TypeError(
                    f"{type(self.adapter).__name__}.evaluation() returned "
                    f"{type(evaluation).__name__}; return Evaluation(view=..., query=...)"
                )
            self._evaluation = dataclasses.replace(evaluation, view=dict(evaluation.view))
        return self._evaluation

    @contextlib.contextmanager
    def evaluation_view(self) -> Iterator[Evaluation]:
        """The network as evaluation sees it (:meth:`MethodAdapter.evaluation`): the view's
        tensors swapped in, the training values put back on exit; yields the evaluation. It is
        derived in eval mode under a forked RNG, once per training state (cached until the next
        step, firing or restore), so evaluating never changes what training does next."""
        evaluation = self._derived_evaluation()
        view = evaluation.view
        if not view:
            yield evaluation
            return
        frozen_query = {id(p) for p in evaluation.query.parameters} if evaluation.query else set()
        tensors = {**dict(self.network.named_parameters()), **dict(self.network.named_buffers())}
        for name, value in view.items():
            target = tensors.get(name)
            if target is None:
                raise KeyError(
                    f"{type(self.adapter).__name__}.evaluation().view names {name!r}, which is no "
                    "parameter or buffer of the network"
                )
            if id(target) in frozen_query:
                raise ValueError(
                    f"{type(self.adapter).__name__}.evaluation().view overrides {name!r}, a "
                    "parameter of the frozen query pass, whose features the query cache keeps"
                )
            if value.shape != target.shape or value.dtype != target.dtype:
                raise ValueError(
                    f"{type(self.adapter).__name__}.evaluation().view[{name!r}] is "
                    f"{tuple(value.shape)} {value.dtype}; the network's is "
                    f"{tuple(target.shape)} {target.dtype}"
                )
        saved = {name: tensors[name].data for name in view}
        try:
            for name, value in view.items():
                tensors[name].data = value
            yield evaluation
        finally:
            for name, data in saved.items():
                tensors[name].data = data

    def _predict(
        self,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        allowed: torch.Tensor,
        topk: int,
        query_pass: QueryPass | None,
        sample_ids: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        self.adapter.set_mode(self.network, train=False)
        allowed = allowed.to(self.device)
        topk = max(1, min(topk, int(allowed.sum())))
        if query_pass is not None and not self.query_cache.usable(query_pass.parameters):
            query_pass = None
        preds, truths = [], []
        offset = 0
        for inputs, labels in batches:
            inputs = inputs.to(self.device)
            with self.autocast():
                out = self._predict_batch(inputs, query_pass, sample_ids, offset)
            offset += len(inputs)
            logits = mask_logits(out.logits.float(), allowed)
            preds.append(logits.topk(topk, dim=1).indices.cpu())
            truths.append(labels.cpu())
        if not preds:
            return np.zeros((0, topk), dtype=np.int64), np.zeros(0, dtype=np.int64)
        return torch.cat(preds).numpy(), torch.cat(truths).long().numpy()

    def _predict_batch(self, inputs, query_pass, sample_ids, offset) -> StepOutput:
        """One evaluation forward, through the query cache when ``query_pass`` is given."""
        if query_pass is None:
            return self.adapter.forward(self.network, inputs, train=False)
        ids = sample_ids[offset : offset + len(inputs)]
        if len(ids) != len(inputs):
            raise ValueError(
                f"the data source yielded more test samples than the {len(sample_ids)} "
                "indices it was asked for"
            )
        query = self.query_cache.get(
            ids, functools.partial(query_pass.features, inputs), self.device
        )
        return query_pass.forward(inputs, query, False)

    def autocast(self):
        """bf16 autocast when ``amp`` is ``"bf16"``; otherwise nothing at all."""
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


@contextlib.contextmanager
def matmul_precision(mode: str) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(mode)`` and cuDNN's TF32 switch (on unless
    ``"highest"``) for the block; both are process-wide, so they are put back after it: code
    that runs between our steps (PILOT's trainer, another seed's setup) sees its own settings.
    """
    check_choice("matmul_precision", mode, MATMUL_PRECISIONS)
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision(mode)
    torch.backends.cudnn.allow_tf32 = mode != "highest"
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


@contextlib.contextmanager
def deterministic_on_cpu(device: torch.device) -> Iterator[None]:
    """``torch.use_deterministic_algorithms`` for the block on a CPU device (elsewhere nothing;
    put back after it, as it is process-wide). Why: a gather with repeated indices
    (``prompts[idx]`` in PILOT's L2P prompt pool, every sample choosing the same prompts)
    backpropagates through ``index_put_`` with accumulation, which on the CPU adds rows with
    parallel atomics once the tensor has 32768 elements: the last bits of the gradient then
    differ between two runs with one seed. Deterministic mode adds them in a fixed order. Ops
    without a deterministic CPU kernel warn instead of failing (``warn_only``), and new tensors
    are not filled with NaN (``fill_uninitialized_memory``), which deterministic mode would do
    at a cost and to no end here."""
    if device.type != "cpu":
        yield
        return
    from torch.utils import deterministic as torch_deterministic

    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch_deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch_deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch_deterministic.fill_uninitialized_memory = before[2]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def online_hits(logits: torch.Tensor, labels: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Samples whose prediction over the classes ``seen`` before their batch is right (a device
    count). A class not yet seen cannot be predicted, so its samples count as wrong, and so does
    every sample of the stream's first batch, when nothing has been seen."""
    predicted = mask_logits(logits.detach().float(), seen).argmax(1)
    return ((predicted == labels) & seen[labels]).sum()


def _stream_rows(out: StepOutput, stream_size: int) -> StepOutput:
    """``out`` with its logits and features cut to the stream batch's rows (``extras`` whole)."""
    if out.logits.shape[0] == stream_size:
        return out
    return dataclasses.replace(
        out, logits=out.logits[:stream_size], features=out.features[:stream_size]
    )


def _detached(terms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in terms.items()}


def _mean_step(
    steps: list[tuple[torch.Tensor, dict[str, torch.Tensor]]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and terms of a batch's optimiser steps (``online_iter``), averaged: one step's
    own values as they are (no arithmetic, so ``online_iter`` 1 is bit for bit the single step);
    a term some steps lack averages over those that have it."""
    if len(steps) == 1:
        return steps[0]
    loss = torch.stack([loss for loss, _ in steps]).mean()
    names = dict.fromkeys(name for _, terms in steps for name in terms)
    terms = {
        name: torch.stack([t[name].reshape(()) for _, t in steps if name in t]).mean()
        for name in names
    }
    return loss, terms


def check_amp(amp: Any, device: torch.device) -> None:
    """A clear error for an ``amp`` the device cannot run."""
    if amp not in AMP_MODES:
        raise ValueError(f'amp={amp!r} is not one of null, "bf16"')
    if amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"amp: bf16 needs a GPU with bfloat16 support; {torch.cuda.get_device_name(device)} "
            "has none. Set amp to null"
        )

"""The loop mixins: each adds one mechanism to :class:`~pilot_online.engine.loop.OnlineLoop` by
overriding its hooks (and calling ``super()``); :func:`build_loop` composes the loop a config asks
for. The math lives in plain components under ``core/``
(:class:`PrototypeBank`, :class:`FineGrainedHypergradients`, :class:`ReservoirMemory`), testable
without a loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.fgh import FineGrainedHypergradients
from ..core.fgh_options import validate_options
from ..core.fgh_stats import AlphaStream
from ..core.lazy import nn, torch
from ..core.memory import ClassBalancedMemory, ReservoirMemory, make_memory
from ..core.rng import run_seed
from .loop import OnlineLoop, ParameterChange
from .replay import ReplayOptions

if TYPE_CHECKING:
    from ..core.prototypes import PrototypeBank
    from .adapter import MethodAdapter, StepOutput, TrainedStep


class PrototypeMixin:
    """Online-loop mixin: adds L_P (Eq. 2) to the loss and, after the optimiser step, folds the
    step's features (computed before the update, detached) into the prototypes (Eq. 1)."""

    prototypes: PrototypeBank

    def __init__(self: OnlineLoop, *args: Any, **kwargs: Any) -> None:
        from ..core.prototypes import PrototypeBank

        super().__init__(*args, **kwargs)
        layer = self.adapter.classifier(self.network)
        self.prototypes = PrototypeBank(
            self.num_classes,
            layer.in_features,
            device=layer.weight.device,
            dtype=layer.weight.dtype,
        )

    def loss_terms(self: OnlineLoop, out: StepOutput, labels: torch.Tensor) -> dict[str, Any]:
        terms = super().loss_terms(out, labels)
        terms["prototypes"] = self.prototypes.loss(self.adapter.classifier(self.network))
        return terms

    def after_step(self: OnlineLoop, step: TrainedStep) -> None:
        super().after_step(step)
        if step.stream is not None:  # the batch's own step: the stream batch, observed
            self.prototypes.update(step.stream.features, step.stream_labels, validate=False)

    def parameters_changed(self: OnlineLoop, change: ParameterChange) -> None:
        """A firing replaced the classifier (DER's wider head): its feature map moves the class
        means into the new feature space (:attr:`Consolidated.feature_map`); the counts stay."""
        super().parameters_changed(change)
        layer = self.adapter.classifier(self.network)
        feature_map = change.mapped_features(layer, "the online prototypes")
        if feature_map is None:
            return
        with torch.no_grad():
            means = feature_map(self.prototypes.means)
        self.prototypes.replace_means(means.to(layer.weight.dtype))

    def state_dict(self: OnlineLoop) -> dict[str, Any]:
        return {**super().state_dict(), "prototypes": self.prototypes.state_dict()}

    def load_state_dict(self: OnlineLoop, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.prototypes.load_state_dict(state["prototypes"])

    def report(self: OnlineLoop) -> dict[str, Any]:
        report = super().report()
        report["prototypes"] = {
            "classes": int(self.prototypes.seen.sum()),
            "samples": int(self.prototypes.counts.sum()),
        }
        return report


class FGHMixin:
    """Online-loop mixin: FGH reweights the gradients between backward and the optimiser step.

    ``granularity="class"`` covers the classifier layer only (the appendix algorithm); the other
    granularities cover every trainable parameter (Eq. 8). The report holds each group's
    alpha against the clamp (``alpha_bounds``: final and stream-averaged mean and fractions at
    each bound), which an :class:`~pilot_online.core.fgh_stats.AlphaStream` observes after every
    FGH step on the device and the report reads once.
    """

    fgh: FineGrainedHypergradients
    alpha_stream: AlphaStream

    def __init__(self: OnlineLoop, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = dict(self.config["fgh"])
        named = self.named_parameters
        if options.get("granularity") == "class":
            layer = {id(p) for p in self.adapter.classifier(self.network).parameters()}
            named = [(name, p) for name, p in named if id(p) in layer]
        self.fgh = FineGrainedHypergradients(named, **options)
        self.alpha_stream = AlphaStream(self.fgh)

    def after_backward(self: OnlineLoop) -> None:
        super().after_backward()
        self.fgh.step()
        self.alpha_stream.observe()

    def parameters_changed(self: OnlineLoop, change: ParameterChange) -> None:
        """Restarted parameters lose what FGH learned of them; a replacement takes its
        predecessor's place; parameters a method added join FGH's group (alpha 1 at their first
        gradient), except in the class-wise form, which covers the classifier alone."""
        super().parameters_changed(change)
        if change.restarted:
            self.fgh.reset_state(change.restarted)
        covered = {id(p) for g in self.fgh.param_groups for p in g["params"]}
        for _, old, new in change.replaced:
            if id(old) in covered:
                self.fgh.replace_parameter(old, new)
        if change.added and self.fgh.defaults["granularity"] != "class":
            self.fgh.extend_group(0, list(change.added))

    def state_dict(self: OnlineLoop) -> dict[str, Any]:
        fgh = {**self.fgh.state_dict(), "alpha_stream": self.alpha_stream.state_dict()}
        return {**super().state_dict(), "fgh": fgh}

    def load_state_dict(self: OnlineLoop, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.fgh.load_state_dict(state["fgh"])
        self.alpha_stream.load_state_dict(state["fgh"].get("alpha_stream"))

    def report(self: OnlineLoop) -> dict[str, Any]:
        report = super().report()
        alphas = {}
        for name, alpha in self.fgh.coefficients().items():
            alpha = alpha.float()
            alphas[name] = {
                "mean": alpha.mean().item(),
                "std": alpha.std(correction=0).item(),
                "min": alpha.min().item(),
                "max": alpha.max().item(),
            }
        report["fgh"] = {
            "options": validate_options(**self.config["fgh"]),
            "steps": self.fgh.num_steps,
            "skipped_nonfinite": int(self.fgh.num_skipped),
            "alpha": alphas,
            # Per FGH param group: the clamp, and the mean alpha and fractions of coefficients at
            # each bound, at the end ("final") and averaged over the stream's steps ("stream").
            "alpha_bounds": _host_numbers(self.alpha_stream.bounds()),
        }
        return report


def _host_numbers(value: Any) -> Any:
    """``value`` with every 0-d tensor read as a Python float (one read each, at report time)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, dict):
        return {key: _host_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_host_numbers(item) for item in value]
    return value


class ReplayMixin:
    """Online-loop mixin: experience replay from a memory of the stream (``er_memory``:
    ``core/memory.py``'s reservoir, class-balanced or herding memory).

    Each step draws ``er_batch_size`` stored samples (before this batch enters the memory), loads
    them through the training transforms (``OnlineLoop.sample_loader``, attached by the session)
    and trains on them beside the stream batch; the stream batch is then offered to the memory:
    before the forward pass, or, for herding, which ranks samples by their features, after the
    step with the stream batch's (pre-update) features; a skipped non-finite step then offers
    nothing. The memory holds dataset indices and labels (and herding, normalised features).

    With a keyed loader (``keyed = True``, as ``PilotDataSource.train_samples``), the next step's
    draw is made right after this step's batch is stored and handed to ``loader.prefetch``, so a
    worker loads it off the critical path; each draw is loaded keyed by the stream samples offered
    before its step, so its augmentations do not depend on the number of workers.
    """

    memory: ReservoirMemory | ClassBalancedMemory

    def __init__(self: OnlineLoop, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replay_options = options = ReplayOptions.of(self.config)
        self.memory = make_memory(
            options.er_memory,
            int(options.er_memory_size),
            self.num_classes,
            options.er_memory_per_class,
            seed=run_seed(self.config.get("seed", 0)),
        )
        self.replay_size = int(options.er_batch_size)
        # The next step's draw, made as soon as this step's batch is stored (the memory's
        # generator runs in the same order as drawing at the next step would), so that a keyed
        # loader's worker loads it while this step computes.
        self.next_draw: np.ndarray | None = None
        self._offered: tuple[np.ndarray, np.ndarray] | None = None  # herding: after the step

    def replay_batch(
        self: OnlineLoop,
        indices: np.ndarray | None,
        labels: torch.Tensor,
        repeat: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch's own draw (``repeat`` None), which then offers the stream batch to the
        memory; or the draw of its extra optimiser step ``repeat`` (``online_iter`` > 1): a fresh
        ``er_batch_size`` sample of the memory as it is before this batch (upstream Si-Blurry
        draws a new memory batch for each of its ``online_iter`` steps and stores the stream
        batch after them), loaded keyed by ``(repeat + 1) << 48 | samples_seen``, a key no
        batch's own draw (``samples_seen``) has."""
        replay = super().replay_batch(indices, labels, repeat)
        if repeat is not None:
            drawn = self.memory.sample(self.replay_size)[0]
            return self._with_memory_samples(replay, drawn, (repeat + 1) << 48 | self.samples_seen)
        if indices is None:
            raise ValueError(
                "experience replay needs each stream batch's dataset indices: call "
                "train_step(inputs, labels, indices)"
            )
        drawn, self.next_draw = self.next_draw, None
        if drawn is None:
            drawn = self.memory.sample(self.replay_size)[0]
        step = self.samples_seen  # unique per step: stream samples offered before it
        # Labels come from the data loader, on the host: no device sync.
        offered = np.asarray(indices), labels.detach().cpu().numpy()
        if self.memory_needs_features:
            self._offered = offered  # stored after the step, with its features
        else:
            self.memory.add(*offered)
        replay = self._with_memory_samples(replay, drawn, step)
        if not self.memory_needs_features:
            self._draw_next(step + len(offered[0]))
        return replay

    def _with_memory_samples(
        self: OnlineLoop,
        replay: tuple[torch.Tensor, torch.Tensor] | None,
        drawn: np.ndarray,
        key: int,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``replay`` followed by the memory samples ``drawn``, loaded through the training
        transforms (keyed by ``key`` where the loader takes keys: it may have prefetched them)."""
        if not len(drawn):
            return replay
        load = self.sample_loader
        if load is None:
            raise RuntimeError(
                "experience replay has no way to load memory samples: the session must call "
                "loop.attach_samples(data.train_samples)"
            )
        inputs, labels = load(drawn, key) if getattr(load, "keyed", False) else load(drawn)
        if replay is None:
            return inputs, labels
        return torch.cat([replay[0], inputs]), torch.cat([replay[1], labels])

    @property
    def memory_needs_features(self: OnlineLoop) -> bool:
        return bool(getattr(self.memory, "needs_features", False))

    @property
    def herding_features(self: OnlineLoop) -> str | None:
        """The extras entry herding ranks by (the method's ``Replay``), else None: the features.
        A memory-free method given replay (``allow_memory``) declares none."""
        declared = self.adapter.replay
        return None if declared is None else declared.herding_features

    def _draw_next(self: OnlineLoop, step: int) -> None:
        """With a keyed loader: the next step's draw, made now and prefetched (key ``step``)."""
        load = self.sample_loader
        if getattr(load, "keyed", False):
            self.next_draw = self.memory.sample(self.replay_size)[0]
            load.prefetch(self.next_draw, step)

    def after_step(self: OnlineLoop, step: TrainedStep) -> None:
        super().after_step(step)
        out = step.stream
        if self._offered is not None and out is not None:  # herding ranks it by its features
            indices, host_labels = self._offered
            self._offered = None
            key = self.herding_features
            features = out.features if key is None else out.extras[key][: step.stream_size]
            self.memory.add(indices, host_labels, features.detach().float().cpu().numpy())
            self._draw_next(self.samples_seen)

    def parameters_changed(self: OnlineLoop, change: ParameterChange) -> None:
        """A firing replaced the classifier by a wider one (DER): herding's stored features and
        class means move into the new feature space by the firing's feature map, as the
        prototypes do (:meth:`ClassBalancedMemory.map_features`), so that the next batch's
        features can join them."""
        super().parameters_changed(change)
        if not self.memory_needs_features or self.herding_features is not None:
            return  # no features, or the method's own space: never mapped
        layer = self.adapter.classifier(self.network)
        feature_map = change.mapped_features(layer, "the herding memory's stored features")
        if feature_map is None:
            return

        def mapping(rows: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                return feature_map(torch.from_numpy(rows)).numpy()

        self.memory.map_features(mapping)

    def state_dict(self: OnlineLoop) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "memory": self.memory.state_dict(),
            "next_draw": self.next_draw,
        }

    def load_state_dict(self: OnlineLoop, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.memory.load_state_dict(state["memory"])
        self.next_draw = state.get("next_draw")

    def report(self: OnlineLoop) -> dict[str, Any]:
        report = super().report()
        report["experience_replay"] = {
            "memory": self.replay_options.er_memory,
            "capacity": self.memory.capacity,
            "size": self.memory.size,
            "batch_size": self.replay_size,
            "stream_samples_offered": self.memory.num_seen,
            "class_histogram": self.memory.class_histogram(self.num_classes).tolist(),
        }
        return report


def build_loop(
    adapter: MethodAdapter,
    network: nn.Module,
    config: Mapping[str, Any],
    num_classes: int,
    device: torch.device | str = "cpu",
) -> OnlineLoop:
    """An :class:`OnlineLoop` with the mixins the config asks for: the paper's four ablation rows
    (base, + P, + FGH, + P + FGH) are four compositions of the same loop, and experience replay
    (``er_memory_size > 0``) composes with any of them."""
    mixins: list[type] = []
    if ReplayOptions.of(config).er_memory_size > 0:
        mixins.append(ReplayMixin)
    if config.get("online_prototypes"):
        mixins.append(PrototypeMixin)
    if config.get("fgh") is not None:
        mixins.append(FGHMixin)
    if not mixins:
        return OnlineLoop(adapter, network, config, num_classes, device)
    name = "".join(m.__name__.removesuffix("Mixin") for m in mixins) + "OnlineLoop"
    loop_cls = type(name, (*mixins, OnlineLoop), {})
    return loop_cls(adapter, network, config, num_classes, device)

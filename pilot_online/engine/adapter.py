"""The method-adapter contract: what the online loop needs to know about one PILOT method.

PILOT's networks disagree on their outputs (L2P and DualPrompt return a dict, CODA a tensor or a
``(logits, prompt_loss)`` tuple). An adapter normalises them into one :class:`StepOutput` and names
the classifier layer, so the loop, masking, optimiser, evaluation and logging exist once, in
``loop.py``. Porting a PILOT method online means writing one small subclass and registering it::

    @register_method("foo_online")
    class FooOnline(MethodAdapter):
        base_model_name = "foo"
        def build_network(self, args): ...
        def forward(self, network, x, train): ...
        def classifier(self, network): ...

What the engine keeps for a method, the method declares rather than codes: a replay memory
(:class:`Replay`), when its task-boundary step runs and whether a teacher is kept for it
(:class:`Consolidation`), its config keys and their rules (:class:`ConfigKey`). Beyond the three
required methods, the optional hooks are grouped by phase in the class body (step, boundary,
evaluation, state), as ``docs/porting.md``'s table lists them (``tests/test_contract_shape.py``).

Adapters import PILOT lazily (inside ``build_network``), so registering one needs no PILOT.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from ..core.lazy import F, nn, torch
from ..core.masks import mask_logits
from ..core.rng import run_seed
from .options import ConfigKey  # a port declares its config_keys with it, from here
from .replay import DECLARED_BY_REPLAY, Replay  # and its replay memory

#: The loop's autocast: ``with autocast():`` runs a forward under the run's ``amp`` (a no-op
#: without it), as :meth:`MethodAdapter.after_backward`'s own forwards must.
Autocast = Callable[[], AbstractContextManager]


@dataclass
class StepOutput:
    """One forward pass, normalised: logits over all classes, the features that feed the classifier
    (what prototypes average), the method's own loss term (0 when it has none), and ``extras``:
    method-specific tensors that only its own :meth:`MethodAdapter.loss_terms` reads."""

    logits: torch.Tensor
    features: torch.Tensor
    aux_loss: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class TrainingBatch:
    """One training step's batch, as a method's :meth:`MethodAdapter.loss_terms` sees it.

    The rows are the stream batch (the first ``stream_size``) and then any replayed samples.
    ``known`` is upstream's ``_known_classes`` online: the classes seen before the last
    consolidation firing (none before the first). ``teacher`` is the engine teacher's output on
    ``inputs`` (a frozen snapshot of the network taken at the last firing, run in eval mode
    without gradients) for a method whose :class:`Consolidation` keeps a teacher, once a firing
    has taken one; else None, as upstream's first task has no old network."""

    inputs: torch.Tensor
    labels: torch.Tensor
    stream_size: int
    #: Bool ``[C]``: classes seen so far, this batch's stream samples included.
    seen: torch.Tensor
    #: Bool ``[C]``: classes seen before the last consolidation firing (the teacher's classes).
    known: torch.Tensor
    teacher: StepOutput | None = None
    #: Bool ``[C]``: the loop's training logit mask (``logit_mask``: the batch's classes, or the
    #: seen ones), or None when nothing is masked.
    mask: torch.Tensor | None = None

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the classes outside :attr:`mask` at ``-inf`` (unchanged without one)."""
        return logits if self.mask is None else mask_logits(logits, self.mask)


@dataclass(frozen=True)
class TrainedStep:
    """One optimiser step, as :meth:`MethodAdapter.after_step` sees it after the update."""

    #: The batch the step trained on: the stream batch's ``stream_size`` rows, then any replayed.
    inputs: torch.Tensor
    labels: torch.Tensor
    stream_size: int
    #: The step's loss terms by name, detached (``"ce"``, the method's, the mixins').
    terms: Mapping[str, torch.Tensor]
    #: The stream batch's outputs before the update (logits and features cut to its rows;
    #: ``extras`` as the forward returned them) at the batch's own step, its observation; None at
    #: the extra steps ``online_iter`` > 1 takes before it.
    stream: StepOutput | None = None

    @property
    def stream_labels(self) -> torch.Tensor:
        """The stream batch's labels (the first ``stream_size`` of :attr:`labels`)."""
        return self.labels[: self.stream_size]


@dataclass(frozen=True)
class QueryPass:
    """A frozen first pass whose output selects what the second pass uses (prompts, a branch):
    a function of each image alone, so evaluation computes it once per test sample and keeps it
    (``engine/eval_cache.py``) while :attr:`parameters` stay unchanged."""

    #: Every parameter of the pass: the cache is valid while none of them changes, and an
    #: evaluation view may override none of them.
    parameters: list[nn.Parameter]
    #: ``features(x)``: the pass alone, one row per sample.
    features: Callable[[torch.Tensor], torch.Tensor]
    #: ``forward(x, query, train)``: the method's forward given the pass's rows; the method's
    #: ``forward(network, x, train)`` must equal ``forward(x, features(x), train)`` exactly.
    forward: Callable[[torch.Tensor, torch.Tensor, bool], StepOutput]


@dataclass(frozen=True)
class Evaluation:
    """What :meth:`MethodAdapter.evaluation` returns: how evaluation departs from the training
    forward, in two independent parts, each empty by default."""

    #: Tensors by the name of a network parameter or buffer (``named_parameters`` /
    #: ``named_buffers``), of the same shape and dtype, that evaluation uses in place of the
    #: training values (SLCA's aligned head, RanPAC's analytic one).
    view: Mapping[str, torch.Tensor] = field(default_factory=dict)
    #: The method's frozen, prompt-free query pass (L2P, DualPrompt, CODA, MVP, APER's frozen
    #: branch), whose rows evaluation caches per test sample (``engine/eval_cache.py``); None
    #: when the method has none.
    query: QueryPass | None = None


@dataclass(frozen=True)
class Consolidated:
    """What a firing's :meth:`MethodAdapter.consolidate` changed that the engine must follow,
    beyond the parameters it added or put under known names (the loop finds those itself)."""

    #: Parameters the method reset in place, whose optimiser and FGH state the loop drops
    #: (upstream starts a new optimiser at each task).
    restarted: Sequence[nn.Parameter] = ()
    #: For a firing that changed the features the classifier reads (DER adds a backbone, so the
    #: head reads wider features): rows of features as they were, ``[N, D_old]``, in the new
    #: space, ``[N, D_new]``, each row alike. The engine maps the online prototypes' class means
    #: and a herding memory's stored features with it, right after ``consolidate`` returns.
    #: Without it, a firing that replaces the classifier's weight is refused where those exist.
    feature_map: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class Consolidation:
    """When a method's task-boundary step (:meth:`MethodAdapter.consolidate`) runs, and what the
    engine keeps for it. A method that acts at upstream's task boundaries overrides
    ``consolidate`` and declares its trigger here."""

    #: The consolidation trigger (``core/triggers.py``: never, every_n_samples, new_classes,
    #: plateau) used when the config's ``consolidation`` is null.
    trigger: str = "never"
    #: Why the method is not itself without firings, or "" (``never`` is allowed):
    #: ``consolidation: "never"`` is then refused with this reason (iCaRL: "takes no teacher, so
    #: iCaRL would never distil").
    required: str = ""
    #: Whether the method distils from its own past: the loop then keeps a frozen snapshot of
    #: the network (``engine/teacher.py``: a deep copy, frozen, in eval mode, run through
    #: :meth:`MethodAdapter.forward` with ``train=False``), taken at each firing before
    #: ``consolidate`` runs (upstream's ``_old_network = self._network.copy().freeze()`` at a
    #: task end), on the loop's device, in every checkpoint, in ``doctor``'s memory and the FLOP
    #: model's passes; its outputs on each training batch reach
    #: :meth:`MethodAdapter.loss_terms` (``batch.teacher``).
    teacher: bool = False


#: Adapter members that the contract once had, with where each went: a subclass that still
#: defines one is refused when it is defined, as it would otherwise be silently ignored.
RETIRED_MEMBERS: Mapping[str, str] = {
    "memory_based": "declare replay = Replay()",
    "herding_features": "declare replay = Replay(herding_features=...)",
    "default_consolidation": "declare consolidation = Consolidation(trigger=...)",
    "needs_consolidation": "declare consolidation = Consolidation(required=...)",
    "keeps_teacher": "declare consolidation = Consolidation(teacher=True)",
    "observe": "move it into after_step(network, step): at the batch's own step, step.stream "
    "holds the stream batch's pre-update outputs and step.stream_labels its labels (None at "
    "online_iter's extra steps)",
    "extra_state": "rename it state_dict(network): torch's name, as the loop's components use",
    "load_extra_state": "rename it load_state_dict(network, state)",
    "train_forward_predicts": "delete it: A_online always scores with an eval-mode pass",
    "train_mode": "override set_mode(network, train) and handle train=True",
    "eval_mode": "override set_mode(network, train) and handle train=False",
    "map_prototypes": "return Consolidated(feature_map=...) from consolidate(): the engine maps "
    "the prototypes and the herding memory's features with it",
    "classification_loss": "return it as loss_terms(network, out, batch)['ce'] (the mask is "
    "batch.mask; batch.masked(logits) applies it)",
    "extra_backward": "override after_backward(network, autocast): it backpropagates the "
    "method's own terms and returns their values",
    "transform_gradients": "override after_backward(network, autocast): it edits .grad in place "
    "and returns {}",
    "trainable_parameters": "set requires_grad_(False) in build_network on what does not train; "
    "declare lr_scales = {name prefix: factor or config key} for what trains at another rate",
    "lr_scale": "declare lr_scales = {name prefix: factor or config key}",
    "removed_keys": "move it to the method's card: MethodCard(removed_keys=...) (a key's history "
    "is a tooling fact; resolve_config reads it there)",
    "evaluation_view": "override evaluation(network) and return Evaluation(view=...)",
    "query_pass": "override evaluation(network) and return Evaluation(query=QueryPass(...))",
    "backbone_types": "move it to the method's card: MethodCard(backbone_types=...) (which "
    "backbone names a config may name is a tooling fact; check-config reads it there)",
    "check_config": "move each rule to the key it is about: ConfigKey(..., check=...) for the "
    "value alone, cross_check=... for a rule that reads other keys (L2P's top_k <= size)",
    "backbone_kwargs": "delete it: the engine forces the config's pretrained, drop and drop_path "
    "on what PILOT's get_backbone branch hard-codes (engine/backbone_names.py: factory_overrides)",
}


@dataclass
class MethodAdapter:
    """Base class of the per-method adapters. Subclasses override the three methods marked below;
    what the tooling knows about a method is on its card (``engine/card.py``), not here."""

    # -- declared fields ---------------------------------------------------------------------------
    #: The upstream PILOT model name whose network we reuse (its factories check this name).
    base_model_name: ClassVar[str] = ""
    #: The replay memory the engine keeps for the method, with its defaults (:class:`Replay`), or
    #: None: a memory-free method refuses replay unless the config says ``allow_memory: true``.
    replay: ClassVar[Replay | None] = None
    #: Keys of the method's own config, with defaults; see :class:`ConfigKey`. As read from the
    #: class, it starts with the declared :class:`Replay`'s keys (``__init_subclass__`` puts them
    #: there), so every reader of a method's keys sees one table.
    config_keys: ClassVar[Mapping[str, ConfigKey]] = {}
    #: Whether the method learns by gradient steps. False (SimpleCIL's class means): the loop
    #: runs no backward pass and no optimiser step; the method learns in :meth:`after_step`.
    trains: ClassVar[bool] = True
    #: When the method's task-boundary step runs and what the engine keeps for it
    #: (:class:`Consolidation`): by default no trigger and no teacher.
    consolidation: ClassVar[Consolidation] = Consolidation()
    #: How fast what trains learns: factors on the config's ``init_lr`` by parameter-name prefix
    #: (the longest matching prefix wins; 1 elsewhere), each a number or the name of one of the
    #: method's config keys whose value is the factor (SLCA's slow learner:
    #: ``{"backbone.": "bcb_lrscale"}``). What trains is torch's rule: the parameters with
    #: ``requires_grad`` when the loop is built, in ``named_parameters`` order, then each one
    #: with ``requires_grad`` that a firing adds. The optimiser gets one group per distinct
    #: factor; a parameter the method freezes later keeps its place and its group.
    lr_scales: ClassVar[Mapping[str, float | str]] = {}
    args: dict = field(default_factory=dict)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        retired = [member for member in RETIRED_MEMBERS if member in vars(cls)]
        if retired:
            raise TypeError(
                f"{cls.__name__} defines {', '.join(retired)}, which the method contract no "
                f"longer reads: {'; '.join(f'{m}: {RETIRED_MEMBERS[m]}' for m in retired)}"
            )
        if "after_step" in vars(cls) and _parameter_count(vars(cls)["after_step"]) != 3:
            raise TypeError(
                f"{cls.__name__}.after_step takes (self, network, step) now: the batch's inputs, "
                "labels and terms are step.inputs, step.labels and step.terms, and the stream "
                "batch's observation (once observe) is step.stream at the batch's own step"
            )
        body = vars(cls).get("config_keys", {})
        inherited = [getattr(base, "config_keys", {}) for base in cls.__mro__[1:]]
        stated = [  # a table restated from a base class (MEMO's, DER's) passes
            key
            for key in DECLARED_BY_REPLAY
            if key in body and not any(body[key] is keys.get(key) for keys in inherited)
        ]
        if stated:
            raise TypeError(
                f"{cls.__name__}.config_keys states {', '.join(stated)}, whose defaults the "
                "method's Replay declares: replay = Replay(memory_size=..., memory=..., "
                "per_class=..., why=...)"
            )
        own = {k: v for k, v in cls.config_keys.items() if k not in DECLARED_BY_REPLAY}
        cls.config_keys = {**(cls.replay.config_keys() if cls.replay else {}), **own}
        _check_lr_scales(cls)

    # -- required: every port writes these three ---------------------------------------------------
    def build_network(self, args: dict) -> nn.Module:
        """Build the PILOT network (freezing what the method freezes)."""
        raise NotImplementedError

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        """One pass: logits, classifier features and the method's own loss term."""
        raise NotImplementedError

    def classifier(self, network: nn.Module) -> nn.Linear:
        """The final FC layer: prototypes are replayed through it, FGH's class mode reweights it."""
        raise NotImplementedError

    # -- step: every training step, in this order (docs/porting.md, When each hook runs) -----------
    def set_mode(self, network: nn.Module, train: bool) -> None:
        """Put the network in training (``train``) or evaluation mode, as ``Module.train(mode)``
        does: the loop calls it before every training step and every evaluation pass. A method
        whose frozen parts must not train (a query ViT, old branches, a fixed extractor) keeps
        them in eval mode here."""
        network.train(train)

    def loss_terms(
        self, network: nn.Module, out: StepOutput, batch: TrainingBatch
    ) -> dict[str, torch.Tensor]:
        """The training loss's terms, by name, summed into the step's loss with ``out.aux_loss``
        (logged as ``method``): ``"ce"``, the classification term, which every method returns
        (the plateau trigger reads it), then the method's own. They see the training forward's
        outputs ``out``, the inputs, labels and logit mask, the classes seen and known, and the
        teacher's outputs (:class:`TrainingBatch`). Called once per training step, inside the
        autocast of the forward.

        By default ``"ce"`` alone: cross-entropy of ``out.logits`` under the training mask. A
        method that weights samples or trains on other logits than it predicts with (MVP)
        returns its own ``"ce"``; one that adds terms (iCaRL's distillation, DER's auxiliary
        head, oLoRA's regulariser) adds them to ``super().loss_terms(...)``."""
        return {"ce": F.cross_entropy(batch.masked(out.logits), batch.labels)}

    def after_backward(self, network: nn.Module, autocast: Autocast) -> dict[str, torch.Tensor]:
        """The method's own work on the step's gradients, after the loop's ``loss.backward()``
        found the loss and gradients finite, and before FGH and the optimiser see them:

        - edit ``.grad`` in place: FGH then pairs and scales the edited gradients, so a method's
          reweighting composes with FGH as one product (DGR's per-class classifier weights);
        - read them (CoFiMA's Fisher sum): a non-finite step never gets here;
        - backpropagate loss terms of its own, one graph at a time (oLoRA's hard buffer: up to 4
          more batches, forwards under ``autocast()``): each ``backward`` accumulates into
          ``.grad``, so the gradient is the same as if the terms had been added to the loss,
          without one autograd graph over all their batches. Return their detached values by
          name: they join the step's loss and terms, and the step is skipped if they or the
          gradients are then non-finite.

        Nothing by default."""
        return {}

    def after_step(self, network: nn.Module, step: TrainedStep) -> Iterable[nn.Parameter]:
        """After each optimiser step (:class:`TrainedStep`: the batch it trained on, with its
        replayed rows, and its detached loss terms): the method's work that follows an update
        (LAE's EMA of the PET, MoS's adapter merge, oLoRA's plateau window and merge).

        At the batch's own step, ``step.stream`` holds the stream batch's outputs as they were
        before the update, and ``step.stream_labels`` its labels: the stream batch observed once,
        without replayed samples (SimpleCIL folds it into its class means, SLCA and RanPAC into
        their statistics). It is None at the extra steps ``online_iter`` > 1 takes first. A
        method that learns without gradients (``trains = False``) gets this call once per batch,
        after its forward, with no update before it.

        Returns the parameters the method restarted, whose optimiser and FGH state the loop then
        drops; none by default."""
        return ()

    # -- boundary: when the consolidation trigger fires --------------------------------------------
    def consolidate(self, network: nn.Module, firing: int) -> Consolidated:
        """The task-free stand-in for upstream's task-boundary step (freeze a first session, add
        an adapter, merge models, realign the classifier), run when the config's consolidation
        trigger fires (``firing``: 0 for the first). The loop calls it at the start of a step,
        before that step's batch is trained on (where upstream's next task would begin), so the
        network may still be in evaluation mode; it never receives a task id or a segment end.
        Returns what the engine must follow (:class:`Consolidated`): the parameters the method
        restarted, and the map of old features into new ones when the firing changed the
        features the classifier reads. A method that overrides it can be given any trigger; one
        that does not refuses every trigger but ``never``.

        It may add parameters (a new adapter per firing, as upstream adds one per task): each new
        one with ``requires_grad`` joins the optimiser (in the group of its factor in
        :attr:`lr_scales`), FGH and the checkpoint, where it stays after the method freezes it. A
        resume calls :meth:`load_state_dict` before any parameter is loaded, so a method
        rebuilds there the structure it had added (from a count in :meth:`state_dict`)."""
        return Consolidated()

    # -- evaluation: what evaluation predicts with -------------------------------------------------
    def evaluation(self, network: nn.Module) -> Evaluation:
        """What evaluation predicts with beyond the network as training left it
        (:class:`Evaluation`): a view of its tensors derived from the training state, and the
        method's frozen query pass, whose rows evaluation caches per test sample.

        Why the view: upstream evaluates right after its task-boundary step, and part of that
        step exists only for evaluation (SLCA and CoFiMA back up the head, align it, evaluate,
        recall it; RanPAC and FeCAM evaluate an analytic head). Online, the trigger fires at the
        next task's first batch, after the task-end evaluation, so evaluation derives that view
        itself. The loop asks lazily, at an evaluation, in eval mode, under ``torch.no_grad``
        and a forked RNG (draws here never disturb training's); it keeps the answer until the
        next training step, firing or restore, and puts the training values back after each
        evaluation: the training state changes only from the stream. Nothing by default."""
        return Evaluation()

    # -- state: checkpoints and the results file ---------------------------------------------------
    def state_dict(self, network: nn.Module) -> dict[str, Any]:
        """What a checkpoint must hold beyond the trainable parameters, the network's buffers and
        the loop's state: the method's own training state (oLoRA: its plateau detector, hard
        buffer and merged weights). Tensors and plain values only; none by default. Torch's
        name, as every component of the loop has it; it takes the network the state is of."""
        return {}

    def load_state_dict(self, network: nn.Module, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, into a freshly built ``network``."""
        if state:
            raise ValueError(
                f"{type(self).__name__} keeps no extra state but the checkpoint has {sorted(state)}"
            )

    def report(self) -> dict[str, Any]:
        """The method's entries for the results file's ``extra.diagnostics.method``; none by
        default."""
        return {}

    # -- helpers a port calls (not hooks) ----------------------------------------------------------
    def run_seed(self) -> int:
        """The run's integer seed, for draws a method makes itself (a firing's new layer):
        :func:`~pilot_online.core.rng.run_seed` of the config's ``seed``."""
        return run_seed(self.args.get("seed", 0))

    def pilot_args(self, args: dict, **overrides: Any) -> dict:
        """A copy of ``args`` in which PILOT's factories recognise the upstream method."""
        return {**args, "model_name": self.base_model_name, **overrides}

    def online_head(
        self,
        network: nn.Module,
        args: Mapping[str, Any],
        attr: str = "fc",
        in_features: int | None = None,
    ) -> nn.Linear:
        """Give ``network`` its online classifier: one ``nn.Linear(in_features, nb_classes)`` over
        every class of the stream, set as ``network.<attr>`` and returned.

        Why: PILOT builds heads in ``update_fc`` at task boundaries, which online training never
        reaches, so networks such as ``SimpleVitNet`` keep ``fc = None``. Call this in
        ``build_network`` instead; the head is what :meth:`classifier` returns (prototypes are
        replayed through it, FGH's class mode reweights its rows). ``in_features`` defaults to
        the network's ``feature_dim`` (PILOT's networks all define it); the head trains.
        """
        if "nb_classes" not in args:
            raise ValueError(
                "online_head needs args['nb_classes'] (the stream's class count, which the session "
                "sets); pass the resolved config to build_network"
            )
        if in_features is None:
            in_features = getattr(network, "feature_dim", None)
            if not isinstance(in_features, int):
                raise ValueError(
                    f"{type(network).__name__} has no integer feature_dim: pass "
                    "online_head(..., in_features=<width of the features the head reads>)"
                )
        head = nn.Linear(int(in_features), int(args["nb_classes"]))
        setattr(network, attr, head)
        return head


def _parameter_count(function: Any) -> int:
    """How many parameters ``function`` declares, through decorators (``functools.wraps``): a
    retired signature shows in it."""
    return len(inspect.signature(function).parameters)


def _check_lr_scales(cls: type[MethodAdapter]) -> None:
    """A method's ``lr_scales`` are prefixes with a positive factor or one of its config keys; the
    hook that returned them per parameter is refused with the fix."""
    if callable(vars(cls).get("lr_scales")):
        raise TypeError(
            f"{cls.__name__}.lr_scales is a method; declare the factors instead: lr_scales = "
            "{name prefix: factor or config key} (what trains is what has requires_grad)"
        )
    for prefix, factor in cls.lr_scales.items():
        if isinstance(factor, str):
            if factor not in cls.config_keys:
                raise TypeError(
                    f"{cls.__name__}.lr_scales[{prefix!r}] names {factor!r}, which is none of its "
                    f"config_keys ({', '.join(cls.config_keys) or 'none'})"
                )
        elif isinstance(factor, bool) or not (
            isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0
        ):
            raise TypeError(
                f"{cls.__name__}.lr_scales[{prefix!r}] is {factor!r}: a factor is a finite number "
                "> 0 or a config key's name (to freeze parameters, requires_grad_(False))"
            )


def lr_scale(adapter: MethodAdapter, name: str) -> float:
    """The factor on ``init_lr`` of the parameter ``name``: :attr:`MethodAdapter.lr_scales`'
    longest prefix of it (a config key's value where it names one), 1 if none."""
    prefixes = [prefix for prefix in adapter.lr_scales if name.startswith(prefix)]
    if not prefixes:
        return 1.0
    factor = adapter.lr_scales[max(prefixes, key=len)]
    return float(adapter.args[factor]) if isinstance(factor, str) else float(factor)


def trained_parameters(network: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters that train (``requires_grad``), by name, in ``named_parameters`` order:
    what the optimiser and FGH see."""
    return [(name, p) for name, p in network.named_parameters() if p.requires_grad]

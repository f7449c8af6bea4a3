"""A method's card: what the tooling knows about a method, kept apart from what training runs.

The adapter (``adapter.py``) is what the online loop calls. The card is what ``make_exps``,
``docs``, ``doctor``, the FLOP model, the paper's tables and the upstream tests read: the row name
in the paper, the ablation rows it can run, its smoke and paper settings, its memory and FLOP
facts, the keys it once had, and the upstream file it reproduces with every deliberate
difference. A method passes its card when it registers (``@register_method("foo_online",
card=MethodCard(...))``), and :func:`~pilot_online.engine.registry.method_card` hands it to the
tooling. The training loop and the session never read a card (``tests/test_card.py`` holds them
to it), so nothing in a card can change a run's numbers: config validation reads its removed keys,
accepted backbone names and FLOP counts, and can only refuse a config.

A card is not inherited: a subclass registered under another name is another method, with its own
card (``dataclasses.replace(PARENT_CARD, paper_name=...)`` when it shares most of one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The paper's ablation rows: base, + P, + FGH and + P + FGH (``engine.config.VARIANTS`` holds
#: what each sets).
ABLATION_ROWS: tuple[str, ...] = ("base", "p", "fgh_only", "fgh")

#: The training logit masks (``core.masks.LOGIT_MASKS``), restated so that a card is checked
#: without importing torch; ``tests/test_card.py`` holds the two equal.
_LOGIT_MASKS = ("batch", "seen", "none")


@dataclass(frozen=True)
class UpstreamDifference:
    """One deliberate difference between a port and upstream's ``models/<upstream_model>.py``.

    Written once, on the card (:attr:`MethodCard.upstream_differences`): the table in
    ``docs/upstream-differences.md`` is generated from these entries, and
    ``tests/test_upstream_<methods-file>.py`` must hold a ``test_difference_<key>`` that asserts
    the difference, so the docs, the code and the tests cannot drift apart."""

    key: str  # snake_case id; names the test that asserts it
    what: str  # what differs from upstream, in one sentence
    why: str  # why online training forces or chooses it, in one sentence


@dataclass(frozen=True)
class MethodCard:
    """The tooling's facts about one registered method (all optional)."""

    #: The method's row name in the paper's tables (``pilot-online report``), else the name its
    #: own paper gives it; "" = the registered name.
    paper_name: str = ""
    #: The name the method's own paper and the README give it, where ``paper_name`` shortens it
    #: (``Online-LoRA`` for ``oLoRA``); ``pilot-online methods`` shows both; "": none.
    full_name: str = ""
    #: The ablation rows (:data:`ABLATION_ROWS`) the method can run: ``make_exps`` writes configs,
    #: and ``tests/test_contract.py`` runs, only these. A method that P and FGH cannot act on
    #: (SimpleCIL, which trains nothing) lists ``("base",)``.
    variants: tuple[str, ...] = ABLATION_ROWS
    #: Values the smoke config (``exps/smoke_<short>_online.json``: CPU, 32 px, random weights)
    #: sets beyond the shared smoke template, e.g. shorter prompts for CI time.
    smoke_overrides: Mapping[str, Any] = field(default_factory=dict)
    #: The learning rate and training logit mask the generated paper configs use when the paper's
    #: hp_grid table has no row for the method; None: the shared ``DEFAULT_LR`` (5e-3) and
    #: ``"batch"``. ``docs/methods.md`` gives each one's reason.
    default_lr: float | None = None
    default_logit_mask: str | None = None
    #: The method's own keys that upstream's run scripts set per ``(dataset, stream)`` (oLoRA's
    #: window thresholds): ``make_exps`` writes them into the paper configs and ``reproduce`` sets
    #: them for the cell. None: no such keys.
    paper_settings: Callable[[str, str], Mapping[str, Any]] | None = None
    #: The PILOT model the port reproduces (``models/<upstream_model>.py``: the file a reviewer
    #: diffs against and ``tests/test_upstream_<methods-file>.py`` runs); None: the adapter's
    #: ``base_model_name`` (filled in at registration); "": none (a method from outside PILOT,
    #: such as MVP, that only reuses a PILOT network).
    upstream_model: str | None = None
    #: Every deliberate difference from upstream's code (:class:`UpstreamDifference`).
    upstream_differences: tuple[UpstreamDifference, ...] = ()
    #: Whether a firing changes the network's per-image compute: DER and MEMO add a branch per
    #: firing, FOSTER a boosting branch and a student, EASE and MOS an adapter (RanPAC and FeCAM
    #: stop training at their first). ``benchmarks/flops.py`` then counts the network after 0, 1
    #: and 2 firings, and the FLOP model's cost follows it task by task.
    grows: bool = False
    #: Bytes of training state kept outside the parameters and buffers (RanPAC's Gram matrix,
    #: FeCAM's covariances), as a function of the resolved config (``nb_classes`` included), for
    #: ``doctor``'s memory estimate; None: 0.
    state_bytes: Callable[[Mapping[str, Any]], int] | None = None
    #: Per-image FLOP counts of a method the package's table (``data/flops.json``) does not hold:
    #: an outside method measures them with ``pilot-online flops <name> --pilot-root <PILOT>``
    #: and pastes them here, so that ``doctor``, the FLOP model and real-time evaluation price it.
    #: None: the package table's counts.
    flops: Mapping[str, Any] | None = None
    #: Keys the method once had, each with what to do instead: ``resolve_config`` refuses a
    #: config that still sets one by name, with that fix, rather than as an unknown key.
    removed_keys: Mapping[str, str] = field(default_factory=dict)
    #: The exact ``backbone_type`` names the method accepts: those PILOT's ``get_backbone`` builds
    #: for its ``base_model_name`` (``engine/backbone_names.py``: ``pilot_backbones(...)``,
    #: ``PLAIN_VIT``). ``check-config`` refuses any other name and suggests only these; the first
    #: is the method's default (``make_exps`` writes it into the configs). Empty: any name.
    backbone_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [row for row in self.variants if row not in ABLATION_ROWS]
        if unknown or not self.variants:
            raise ValueError(
                f"MethodCard.variants must be a non-empty subset of {ABLATION_ROWS}, got "
                f"{self.variants!r}"
            )
        if self.default_logit_mask not in (None, *_LOGIT_MASKS):
            raise ValueError(
                f"MethodCard.default_logit_mask must be one of {_LOGIT_MASKS} or None, got "
                f"{self.default_logit_mask!r}"
            )
        keys = [d.key for d in self.upstream_differences]
        if len(set(keys)) != len(keys):
            raise ValueError(f"MethodCard.upstream_differences repeats a key: {keys}")
        for name in ("smoke_overrides", "removed_keys"):  # private copies
            object.__setattr__(self, name, dict(getattr(self, name)))
        if isinstance(self.backbone_types, str) or not all(
            isinstance(name, str) for name in self.backbone_types
        ):
            raise ValueError(
                f"MethodCard.backbone_types must be a tuple of backbone_type names, got "
                f"{self.backbone_types!r}"
            )
        object.__setattr__(self, "backbone_types", tuple(self.backbone_types))

    @property
    def upstream_file(self) -> str | None:
        """``models/<upstream_model>.py`` of the PILOT model the port reproduces, or None."""
        return f"models/{self.upstream_model}.py" if self.upstream_model else None

    def settings_for(self, dataset: str, stream: str) -> dict[str, Any]:
        """:attr:`paper_settings` for one cell (``{}`` without them)."""
        return dict(self.paper_settings(dataset, stream)) if self.paper_settings else {}

    def memory_bytes(self, args: Mapping[str, Any]) -> int:
        """:attr:`state_bytes` of the resolved config (0 without it)."""
        return int(self.state_bytes(args)) if self.state_bytes else 0

"""Experience replay as a component a method declares: its config keys (:class:`ReplayOptions`)
and a method's declaration (:class:`Replay`), which carries the method's own defaults for them.
The memory itself is ``core/memory.py``'s; the loop keeps it through ``engine/mixins.py``'s
``ReplayMixin``. This module imports no torch, so the key table is cheap to build.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.checks import boolean, check_choice, integer, optional
from ..core.memory import MEMORIES
from .options import ConfigKey, Options, option


@dataclass(frozen=True)
class ReplayOptions(Options):
    """Experience replay's config keys (``engine/config.py`` gathers every component's; a
    memory-based method's :class:`Replay` declares its own defaults for the memory's three)."""

    er_memory_size: int = option(
        ConfigKey(
            0,
            "experience-replay reservoir size; > 0 turns replay on (memory-based rows only)",
            check=integer(0),
        )
    )
    er_batch_size: int = option(
        ConfigKey(100, "memory samples replayed beside each stream batch", check=integer(1))
    )
    er_memory: str = option(
        ConfigKey(
            MEMORIES[0],
            "which memory replay keeps (core/memory.py): reservoir (the paper's ER, uniform over "
            "the stream), class_balanced (upstream's per-class quota, each share a uniform sample "
            "of its class) or herding (the same quota, each share chosen by online herding)",
            choices=MEMORIES,
        )
    )
    er_memory_per_class: int | None = option(
        ConfigKey(
            None,
            "class-balanced memories: null, a quota of er_memory_size // classes seen (upstream's "
            "fixed_memory false), or at most this many per class (fixed_memory true, "
            "memory_per_class)",
            check=optional(integer(1)),
        )
    )
    allow_memory: bool = option(
        ConfigKey(
            False,
            "let a memory-free row keep samples (experience replay on with er_memory_size)",
            check=boolean,
        )
    )


#: The online default kind of memory, which needs no per-class quota.
RESERVOIR = MEMORIES[0]
#: The keys whose defaults a method's :class:`Replay` declares (and its ``config_keys`` may not).
DECLARED_BY_REPLAY = ("er_memory_size", "er_memory", "er_memory_per_class")


@dataclass(frozen=True)
class Replay:
    """A method's declaration that it keeps training samples: the engine's replay memory, on by
    default for it, with the method's defaults for the memory's size, kind and per-class quota,
    as upstream's config sets ``memory_size``, ``fixed_memory`` and ``memory_per_class``. The
    adapter's ``config_keys`` then holds them (:meth:`config_keys`), first."""

    #: ``er_memory_size``'s default (the paper's ER row: 1,000 samples).
    memory_size: int = 1000
    #: ``er_memory``'s default (``core/memory.py``: reservoir, class_balanced, herding).
    memory: str = "reservoir"
    #: ``er_memory_per_class``'s default: None, a quota of the size over the classes seen.
    per_class: int | None = None
    #: Where the values come from, shown in the key reference.
    why: str = ""
    #: The ``StepOutput.extras`` entry (of the training forward) a herding memory ranks stream
    #: samples by, for a method whose firings move its classifier's features into a space no
    #: row-wise map reaches (FOSTER: the student's features, of one width at every firing); no
    #: firing maps them. None: ``out.features``, mapped by a firing's
    #: :attr:`~pilot_online.engine.adapter.Consolidated.feature_map`.
    herding_features: str | None = None

    def __post_init__(self) -> None:
        keys = ReplayOptions.keys()
        check_choice("Replay(memory=...)", self.memory, MEMORIES)
        keys["er_memory_size"].check("Replay(memory_size=...)", self.memory_size)
        keys["er_memory_per_class"].check("Replay(per_class=...)", self.per_class)
        if self.memory == RESERVOIR and self.per_class is not None:
            raise ValueError(
                f"Replay(per_class={self.per_class}) needs a class-balanced memory: a reservoir "
                'keeps no per-class quota; declare memory="class_balanced" or "herding"'
            )

    def config_keys(self) -> dict[str, ConfigKey]:
        """The memory's keys with this declaration's defaults; their checks are the online keys'
        own. A reservoir (the online default kind, with no per-class quota) states its size
        alone; a class-balanced or herding memory its kind and quota too."""
        keys = ReplayOptions.keys()
        source = f" ({self.why})" if self.why else ""
        defaults = {
            "er_memory_size": self.memory_size,
            "er_memory": self.memory,
            "er_memory_per_class": self.per_class,
        }
        docs = {"er_memory_size": f"replay memory size{source}"}
        return {
            key: ConfigKey(
                defaults[key],
                docs.get(key, keys[key].doc),
                choices=keys[key].choices,
                check=keys[key].check,
            )
            for key in DECLARED_BY_REPLAY
            if key == "er_memory_size" or self.memory != RESERVOIR
        }

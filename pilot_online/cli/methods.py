"""``pilot-online methods``: every registered method with its paper name, the ablation rows it
runs, its default consolidation trigger, its memory (and whether it distils from the engine
teacher) and its own config keys; a filter narrows the list. The names are the methods' own
cards' ``paper_name`` and ``full_name`` (``engine/card.py``): no table here to fall out of step.

Methods registered from outside the package (the ``pilot_online.methods`` entry point group,
``engine/registry.py``) are listed too, with the module they come from.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..engine.card import MethodCard
from ..engine.registry import get_method, list_methods, method_card

#: The paper's names of the ablation rows (``engine.config.VARIANTS``).
ROW_NAMES = {"base": "base", "p": "+P", "fgh_only": "+FGH", "fgh": "+P+FGH"}
HEADER = ("name", "paper name", "rows", "default trigger", "memory", "keys")


def memory_of(adapter: Any) -> str:
    """``herding 2000`` (the declared memory, its size and per-class cap), ``-`` without one;
    ``+ teacher`` for a method that distils from the engine teacher."""
    memory = "-"
    replay = adapter.replay
    if replay is not None:
        memory = f"{replay.memory} {replay.memory_size}"
        memory += f" ({replay.per_class}/class)" if replay.per_class else ""
    return memory + (" + teacher" if adapter.consolidation.teacher else "")


def paper_name_of(card: MethodCard) -> str:
    """``CODA``, or ``oLoRA (Online-LoRA)`` where the method's own paper names it in full;
    ``-`` for a method that declares no name."""
    names = list(dict.fromkeys(n for n in (card.paper_name, card.full_name) if n))
    if len(names) == 2:
        return f"{names[0]} ({names[1]})"
    return names[0] if names else "-"


def method_rows(pattern: str = "") -> list[dict[str, Any]]:
    """One record per registered method whose name, paper name or key names contain
    ``pattern`` (case-insensitive; "" matches all), sorted by name."""
    records = []
    for name in list_methods():
        adapter, card = get_method(name), method_card(name)
        keys = list(adapter.config_keys)
        haystack = " ".join([name, card.paper_name, card.full_name, *keys]).lower()
        if pattern.lower() not in haystack:
            continue
        records.append(
            {
                "name": name,
                "paper_name": paper_name_of(card),
                "rows": [ROW_NAMES.get(v, v) for v in card.variants],
                "default_trigger": adapter.consolidation.trigger,
                "memory": memory_of(adapter),
                "keys": keys,
                "module": adapter.__module__,
            }
        )
    return records


def format_methods(records: list[dict[str, Any]], with_keys: bool = False) -> str:
    """An aligned table (keys last, so long lists cannot misalign it); with ``with_keys``, each
    method's keys below it with their defaults and what they do."""
    lines = [
        (
            r["name"],
            r["paper_name"],
            ",".join(r["rows"]),
            r["default_trigger"],
            r["memory"],
            ", ".join(r["keys"]) or "-",
        )
        for r in records
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(HEADER[:-1])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    out = [fmt.format(*HEADER), fmt.format(*("-" * w for w in widths), "-" * len(HEADER[-1]))]
    for record, line in zip(records, lines):
        out.append(fmt.format(*line))
        if with_keys:
            specs = get_method(record["name"]).config_keys
            for key, spec in specs.items():
                out.append(f"    {key:<24} default {json.dumps(spec.default):<14} {spec.doc}")
    outside = [r for r in records if not r["module"].startswith("pilot_online.")]
    if outside:
        out.append("")  # below the table: where each outside method comes from
    for record in outside:
        out.append(
            f"{record['name']}: from {record['module']} (a pilot_online.methods entry point)"
        )
    return "\n".join(out)


def add_methods_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "pattern",
        nargs="?",
        default="",
        help="show the methods whose name, paper name or a key contains this (e.g. coda, prompt)",
    )
    parser.add_argument(
        "--keys", action="store_true", help="each key with its default and what it does"
    )


def run_methods(args: argparse.Namespace) -> int:
    records = method_rows(args.pattern)
    if not records:
        print(f"no method matches {args.pattern!r}; `pilot-online methods` lists them all")
        return 1
    print(format_methods(records, with_keys=args.keys))
    return 0

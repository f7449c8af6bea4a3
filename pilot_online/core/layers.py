"""The package's layers and the check that imports point one way.

    core <- engine <- methods <- pilot <- harness <- cli

A module may import its own layer and those to its left, never one to its right, and no two
modules may import each other, directly or round a circle. Every import counts: module level,
inside a function (lazy), under ``TYPE_CHECKING``. One more rule inside ``methods``: a method's
file takes nothing from another method's file but its adapter classes (``*Online``, to subclass
them) and its cards (``CARD``, to derive its own card from its parent's); the pieces ports
share (a distillation loss, difference records, a head) live in ``core`` or in the engine
component they belong to. ``tests/test_layers.py`` runs :func:`violations` over the package; a
contributor can run it on a draft the same way.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

PACKAGE = "pilot_online"
#: Left to right: a layer may import those before it.
LAYERS = ("core", "engine", "methods", "pilot", "harness", "cli")


def module_sources(root: Path) -> dict[str, str]:
    """``{dotted module name: source}`` of every ``.py`` file under the package folder ``root``."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = path.read_text(encoding="utf-8")
    return sources


def imports_of(module: str, tree: ast.Module, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that the parsed module ``tree`` imports, wherever the import
    statement sits. ``from X import name`` counts as importing ``X.name`` when that is a module."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                name = f"{target}.{alias.name}"
                found.add(name if name in known else target)
    return {m for m in found if m in known and m != module}


#: Leaf modules outside the layers that any layer may import (they import nothing).
LEAVES = (f"{PACKAGE}.version",)


def layer_of(module: str) -> int | None:
    """The index of ``module``'s layer in :data:`LAYERS` (a leaf: 0); ``None`` for the
    package's top, ``pilot_online/__init__.py``, which sits above every layer."""
    if module in LEAVES:
        return 0
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def import_graph(trees: Mapping[str, ast.Module], packages: set[str]) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over parsed ``trees`` (``packages``: the ``__init__``
    ones)."""
    known = set(trees)
    return {m: imports_of(m, t, m in packages, known) for m, t in trees.items()}


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected groups of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def borrowed_from_methods(module: str, tree: ast.Module) -> list[str]:
    """Names a method's file imports from another method's file that are neither adapter classes
    nor cards."""
    prefix = f"{PACKAGE}.methods."
    if not module.startswith(prefix):
        return []
    borrowed = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            target = ".".join([*module.split(".")[: -node.level], *filter(None, [node.module])])
        else:
            target = node.module or ""
        names = [a.name for a in node.names]
        if target == f"{PACKAGE}.methods":  # ``from . import other_method``
            borrowed += [f"{target}.{n}" for n in names]
        elif target.startswith(prefix) and target != module:
            borrowed += [f"{target}.{n}" for n in names if not n.endswith(("Online", "CARD"))]
    return borrowed


def violations(sources: Mapping[str, str], packages: set[str]) -> list[str]:
    """One line per import against the layers' order and per import circle; empty when clean.
    A package's ``__init__`` may import its own submodules (registering them), which is not a
    circle when they do not import it back."""
    trees = {module: ast.parse(source) for module, source in sources.items()}  # parsed once
    graph = import_graph(trees, packages)
    lines = []
    for module, targets in sorted(graph.items()):
        own = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if own is not None and (theirs is None or theirs > own):
                where = "the package's top" if theirs is None else LAYERS[theirs]
                lines.append(
                    f"{module} ({LAYERS[own]}) imports {target} ({where}): layers point "
                    f"{' <- '.join(LAYERS)}"
                )
    for group in circles(graph):
        lines.append(f"import circle: {' <-> '.join(group)}")
    for module, tree in sorted(trees.items()):
        for name in borrowed_from_methods(module, tree):
            lines.append(
                f"{module} imports {name}: a method takes only adapter classes and cards from "
                "another method's file; move shared pieces to core or the engine component they "
                "belong to"
            )
    return lines

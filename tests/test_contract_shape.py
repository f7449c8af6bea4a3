"""The method contract's shape: ``MethodAdapter``'s members, grouped by phase in its source, are
the ones ``docs/porting.md`` lists, in the same groups, and their number does not grow unnoticed.

Issue 35 set the goal: three required hooks, about 8 optional ones tagged with their phase, about
6 declared fields, counted over the contract's whole inheritance chain and the loop-level hooks
the mixins override. The ceilings below are where the contract stands; lower them as hooks fold."""

from __future__ import annotations

import ast
import re

from conftest import REPO

ADAPTER = REPO / "pilot_online" / "engine" / "adapter.py"
MIXINS = REPO / "pilot_online" / "engine" / "mixins.py"
PORTING = REPO / "docs" / "porting.md"
PHASES = ("build", "step", "boundary", "evaluation", "state")
#: The build phase's one hook is the required ``build_network``; how fast what it builds trains
#: is declared (``lr_scales``), so no optional hook is tagged build.
OPTIONAL_PHASES = ("step", "boundary", "evaluation", "state")
MAX_OPTIONAL_HOOKS = 9
MAX_DECLARED_FIELDS = 6
#: Distinct hook names a reader of the contract meets: the adapter's optional hooks and the
#: loop-level hooks the mixins override (which share the adapter's names where they share its
#: moment: loss_terms, after_backward, after_step, state_dict, load_state_dict, report).
MAX_HOOK_NAMES = 11


def source_groups() -> dict[str, list[str]]:
    """The class body's public members under each ``# -- <group>`` comment, in source order."""
    source = ADAPTER.read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MethodAdapter"]
    headings = [
        (number, re.match(r"\s*# -- ([a-z ]+)", line).group(1).strip())
        for number, line in enumerate(lines, start=1)
        if re.match(r"\s*# -- [a-z]", line) and cls.lineno < number <= cls.end_lineno
    ]
    groups: dict[str, list[str]] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            name, line = node.name, node.lineno
        elif isinstance(node, ast.AnnAssign) and "ClassVar" in ast.unparse(node.annotation):
            name, line = node.target.id, node.lineno
        else:
            continue
        if name.startswith("_"):
            continue
        above = [title for number, title in headings if number < line]
        assert above, f"{name} sits above every group heading"
        group = re.split(r"[:(]", above[-1])[0].strip()
        groups.setdefault(group, []).append(name)
    return groups


def documented_groups() -> dict[str, list[str]]:
    text = PORTING.read_text(encoding="utf-8")
    table = text.split("<!-- contract-table -->", 1)[1].split("\n\n", 1)[0]
    groups = {}
    for row in table.strip().splitlines()[2:]:
        group, members = (cell.strip() for cell in row.strip("|").split("|"))
        groups[re.split(r" \(", group)[0]] = re.findall(r"`(\w+)`", members)
    return groups


def test_the_porting_page_lists_the_contract_as_the_source_groups_it():
    documented = documented_groups()
    source = source_groups()
    assert documented.pop("helpers") == source.pop("helpers a port calls")
    assert documented == source


def test_three_required_hooks_and_every_optional_one_tagged_with_its_phase():
    groups = source_groups()
    assert groups["required"] == ["build_network", "forward", "classifier"]
    hooks = {k: v for k, v in groups.items() if k not in ("required", "declared fields")}
    hooks.pop("helpers a port calls")
    assert set(hooks) == set(OPTIONAL_PHASES) and set(OPTIONAL_PHASES) < set(PHASES)
    assert sum(map(len, hooks.values())) <= MAX_OPTIONAL_HOOKS
    assert len(groups["declared fields"]) <= MAX_DECLARED_FIELDS


def mixin_hooks() -> set[str]:
    """The loop-level hooks: public methods of ``OnlineLoop`` that a mixin in ``mixins.py``
    overrides (its ``__init__``, which builds the mixin's component, is not counted)."""
    from pilot_online.engine.loop import OnlineLoop

    tree = ast.parse(MIXINS.read_text(encoding="utf-8"))
    overridden = {
        node.name
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name.endswith("Mixin")
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }
    return {name for name in overridden if callable(getattr(OnlineLoop, name, None))}


def test_the_contract_is_its_whole_inheritance_chain():
    """Every public member of ``MethodAdapter``, over its MRO, is in a source group: no hook
    hides in a base class."""
    from pilot_online.engine.adapter import MethodAdapter

    listed = {name for names in source_groups().values() for name in names}
    public = {
        name
        for klass in MethodAdapter.__mro__[:-1]
        for name, value in vars(klass).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, classmethod))
    }
    assert public - {"args"} <= listed


def test_hook_names_over_the_adapter_and_the_loop_mixins():
    groups = source_groups()
    adapter_hooks = {name for group, names in groups.items() if group in PHASES for name in names}
    loop_hooks = mixin_hooks()
    # the shared moments have one name on both sides
    shared = {"loss_terms", "after_backward", "after_step", "state_dict", "load_state_dict"}
    assert shared | {"report"} <= loop_hooks & adapter_hooks
    assert len(adapter_hooks | loop_hooks) <= MAX_HOOK_NAMES, sorted(loop_hooks - adapter_hooks)

"""Config cases generated from each key's own definition (its ``choices`` and its check's
:class:`~pilot_online.core.checks.Spec`): the values at and just past each bound, a bool for an
integer, NaN and the infinities for a real, a wrong type, each choice and one that is not. Every
key of ``PILOT_KEYS``, ``ONLINE_KEYS`` and of every registered method is covered the day it is
defined; a removed bound or type check fails here. Refused values go through
``pilot-online check-config`` as JSON (``NaN``/``Infinity`` literals included)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pilot_online import get_method, list_methods
from pilot_online.core.checks import Check, Spec, description_of, spec_of
from pilot_online.core.fgh_options import validate_options
from pilot_online.engine.adapter import ConfigKey
from pilot_online.engine.config import (
    ONLINE_KEYS,
    PILOT_KEYS,
    ConfigError,
    load_json,
    resolve_config,
)
from pilot_online.engine.registry import method_card

ROOT = Path(__file__).resolve().parent.parent
WRONG_TYPE = {"integer": "1", "real": "0.5", "boolean": 1, "string": 1, "object": [], "list": "x"}


def base_config(method: str) -> dict[str, Any]:
    """A valid config for ``method``: its smoke config, or (for a method added without one) the
    CODA smoke config rewritten for it."""
    path = ROOT / "exps" / f"smoke_{method.removesuffix('_online')}_online.json"
    if path.is_file():
        return load_json(path)
    adapter = get_method(method)
    config = load_json(ROOT / "exps" / "smoke_coda_online.json")
    config.pop("prompt_param")
    config["model_name"] = method
    if method_card(method).backbone_types:
        config["backbone_type"] = method_card(method).backbone_types[0]
    if adapter.replay is not None:
        config["er_memory_size"] = 1000
    return config


def values(spec: Spec, example: Any) -> list[tuple[Any, bool, str]]:
    """``(value, accepted, why)`` for a check of ``spec``; ``example`` is a valid value (the
    key's default), used for a list's other entries."""
    cases: list[tuple[Any, bool, str]] = []
    if spec.kind == "optional":
        inner = values(spec_of(spec.item), example)
        return [(None, True, "null"), *(case for case in inner if case[0] is not None)]
    if spec.kind in ("integer", "real"):
        step = (lambda b, d: b + d) if spec.kind == "integer" else math.nextafter
        if spec.minimum is not None:
            inside = step(spec.minimum, 1 if spec.kind == "integer" else math.inf)
            lowest = inside if spec.exclusive_minimum else spec.minimum
            below = spec.minimum if spec.exclusive_minimum else step(spec.minimum, -math.inf)
            if spec.kind == "integer":
                below = spec.minimum - 1
            cases += [(lowest, True, "the lowest valid"), (below, False, "below the minimum")]
        if spec.maximum is not None:
            above = spec.maximum + 1 if spec.kind == "integer" else step(spec.maximum, math.inf)
            cases += [(spec.maximum, True, "the maximum"), (above, False, "above the maximum")]
        if spec.minimum is None and spec.maximum is None:
            cases += [(-3, True, "any number"), (7, True, "any number")]
        cases += [(True, False, "a bool"), (False, False, "a bool")]
        if spec.kind == "integer":
            valid = spec.minimum if spec.minimum is not None else spec.maximum
            cases.append((float(valid if valid is not None else 1), False, "a float"))
        else:
            cases += [(v, False, "not finite") for v in (math.nan, math.inf, -math.inf)]
    elif spec.kind == "boolean":
        cases += [(True, True, "true"), (False, True, "false"), (None, False, "null")]
        cases += [("false", False, "a string")]
    elif spec.kind == "string":
        cases.append(("", True, "a string"))
    elif spec.kind == "object":
        cases += [({}, True, "an object"), ({"1": 2}, True, "an object")]
    elif spec.kind == "list":
        item = spec_of(spec.item)
        entry = example[0] if isinstance(example, list) and example else None
        if entry is not None:
            cases.append(([entry], True, "one valid entry"))
            for value, accepted, why in values(item, entry):
                if value is not None or item.kind == "optional":
                    cases.append(([value], accepted, f"an entry: {why}"))
            if spec.distinct:
                cases.append(([entry, entry], False, "an entry twice"))
        if spec.min_length >= 1:
            cases.append(([], False, "too short"))
    if spec.kind in WRONG_TYPE:
        cases.append((WRONG_TYPE[spec.kind], False, "a wrong type"))
    if spec.kind in ("string", "object", "list"):
        cases.append((True, False, "a bool"))
    return cases


def key_cases() -> list[tuple[str, str, Any, bool, str]]:
    """``(method, key, value, accepted, why)`` for every checked key of every schema."""
    schemas: list[tuple[str, dict[str, ConfigKey]]] = [
        ("coda_online", PILOT_KEYS),
        ("coda_online", ONLINE_KEYS),
        *((m, get_method(m).config_keys) for m in list_methods()),
    ]
    cases = []
    for method, keys in schemas:
        for key, spec in keys.items():
            if spec.forced:
                continue
            if spec.choices is not None:
                cases += [(method, key, c, True, "a choice") for c in spec.choices]
                cases.append((method, key, "not-a-choice", False, "not a choice"))
            if spec.check is not None:
                for value, accepted, why in values(spec_of(spec.check), spec.default):
                    cases.append((method, key, value, accepted, why))
    return cases


CASES = key_cases()


def test_every_checked_key_generates_cases():
    """A key with a structured check or choices yields cases; only hand-written checks (and
    ``model_name`` and ``realtime_reference``, which the registry checks) yield none, and they
    are few and known."""
    schemas = {**PILOT_KEYS, **ONLINE_KEYS}
    covered = {key for _, key, *_ in CASES}
    uncovered = {k for k, s in schemas.items() if not s.forced and k not in covered}
    known = {"model_name", "realtime_reference", "dataset", "device", "fgh", "pretrained_path"}
    assert uncovered <= known, uncovered
    assert len(CASES) > 300, len(CASES)


def own_message(method: str, key: str, message: str) -> bool:
    """Whether a ConfigError comes from ``key``'s own check or choices (not a cross-key rule
    such as replay's ``er_memory_size must be > 0``)."""
    spec = {**PILOT_KEYS, **ONLINE_KEYS, **get_method(method).config_keys}[key]
    own = [f"unknown {key} ", f"{key}[", f"{key} lists "]
    if spec.check is not None:
        own.append(f"{key} must be {description_of(spec.check)}")
    return any(phrase in message for phrase in own)


@pytest.mark.parametrize(
    ("method", "key", "value", "accepted", "why"),
    CASES,
    ids=[f"{m}-{k}-{v!r}-{w}" for m, k, v, _, w in CASES],
)
def test_generated_key_case(method, key, value, accepted, why, tmp_path, capsys):
    """Refused: ``check-config`` exits 1 naming the key, with no traceback. Accepted: the key's
    own check passes (a cross-key rule, such as L2P's ``top_k <= size``, may still refuse)."""
    from pilot_online.cli.main import main

    config = {**base_config(method), key: value}
    if not accepted:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(config))
        assert main(["check-config", str(path)]) == 1, f"{key}={value!r} ({why}) was accepted"
        captured = capsys.readouterr()
        assert own_message(method, key, captured.out), captured.out
        assert "Traceback" not in captured.out + captured.err
        return
    try:
        resolve_config(config)
    except ConfigError as err:
        assert not own_message(method, key, str(err)), f"{key}={value!r} ({why}) refused: {err}"


#: FGH's real-valued options, each as a (partial) config ``"fgh"`` object holding one value.
FGH_REALS = {
    "gamma": lambda v: {"gamma": v},
    "eps": lambda v: {"eps": v},
    "clamp[0]": lambda v: {"clamp": [v, 10.0]},
    "clamp[1]": lambda v: {"clamp": [0.0, v]},
    "betas[0]": lambda v: {"betas": [v, 0.999]},
    "betas[1]": lambda v: {"betas": [0.9, v]},
}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True])
@pytest.mark.parametrize("option", list(FGH_REALS))
def test_fgh_real_options_refuse_non_finite_and_bools(option, value, tmp_path, capsys):
    """FGH's options live in ``core/fgh.py`` (not a ``ConfigKey``): each real one refuses NaN,
    both infinities and a bool, through ``check-config``; ``null`` is the clamp's no-bound."""
    from pilot_online.cli.main import main

    assert validate_options(**FGH_REALS[option](0.5 if option != "clamp[0]" else 0.0))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**base_config("coda_online"), "fgh": FGH_REALS[option](value)}))
    assert main(["check-config", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"fgh: {option.split('[')[0]}" in out, out


def test_cases_are_worked_out_by_hand():
    """The generator's values for three specs, written out: what the tests above rely on."""
    from pilot_online.core.checks import integer, list_of, optional, real

    def of(check: Check, example: Any = None) -> list:
        return [(v, ok) for v, ok, _ in values(spec_of(check), example)]

    bounds = [(1, True), (0, False), (3, True), (4, False)]
    assert of(integer(1, 3)) == [*bounds, (True, False), (False, False), (1.0, False), ("1", False)]
    drop = of(real(0, 1))
    assert drop[:4] == [(0, True), (-5e-324, False), (1, True), (1.0000000000000002, False)]
    assert [ok for _, ok in drop[4:]] == [False] * 6
    lr = of(real(positive=True))
    assert lr[:2] == [(5e-324, True), (0, False)]
    assert of(optional(integer(0)))[:3] == [(None, True), (0, True), (-1, False)]
    seeds = of(list_of(integer(0), "seeds", min_length=1, distinct=True), [1993])
    assert ([1993, 1993], False) in seeds and ([], False) in seeds and ([-1], False) in seeds


def test_configuration_page_states_each_keys_valid_values():
    """The configuration page's "valid" column is the record the definitions are held to: a bound
    removed from a key's definition (``drop``'s upper one, ``er_batch_size >= 1``) changes what
    its check says it accepts, and no longer matches the page. Keys the page does not list are
    test_docs's concern."""
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[3]
    checked = 0
    for key, spec in {**PILOT_KEYS, **ONLINE_KEYS}.items():
        if key not in rows or spec.forced:
            continue
        if spec.choices is not None:
            said = " or ".join("null" if c is None else f"`{c}`" for c in spec.choices)
        elif spec.check is not None and description_of(spec.check) != "valid":
            said = description_of(spec.check)
        else:
            continue
        assert rows[key] == said, f"docs/configuration.md says {key} is {rows[key]!r}: {said!r}"
        checked += 1
    assert checked >= 35, checked


def test_method_keys_are_recorded_as_defined():
    """docs/configuration.md's method-keys table is the record each method key's definition is
    held to: the generated cases above follow a key's own check, so a bound removed from it
    (``wt_lambda``'s [0, 1], ``ridge_holdout_every >= 2``) would pass them; it changes this
    table's line instead, which then no longer matches (``python scripts/make_docs.py``)."""
    from test_upstream_contract import make_docs

    docs = make_docs()
    page = docs.KEYS_PAGE.read_text(encoding="utf-8")
    assert docs.render_keys(page) == page, (
        "a method key changed its default or its valid values: review the change, then run "
        "`python scripts/make_docs.py` to record it in docs/configuration.md"
    )
    for name in list_methods():
        for key in get_method(name).config_keys:
            assert f"| `{key}` |" in page, key

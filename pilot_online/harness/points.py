"""Grid points: ``--grid`` and ``--set`` parsed, a point applied to a config, every point's
config planned and validated before any run starts. The sweep, the protocol's presets and
``reproduce`` all build their configs here."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

from ..engine.config import VARIANTS, ConfigError, resolve_config


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``["seed=[1993,1994]", "dataset=synthetic_small"]`` -> {key: JSON value or bare string}."""
    values: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ConfigError(f"--set {item!r}: write KEY=VALUE (e.g. seed=[1993,1994])")
        try:
            values[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            values[key.strip()] = value
    return values


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """``["init_lr=5e-5,5e-3", "fgh.gamma=0.1,1"]`` -> {key: [JSON-parsed values]}.

    Values are comma-separated scalars (numbers, true/false/null, bare strings)."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ConfigError(f"--grid {item!r}: write KEY=V1,V2 (e.g. init_lr=5e-5,5e-3)")
        parsed = []
        for value in values.split(","):
            try:
                parsed.append(json.loads(value))
            except json.JSONDecodeError:
                parsed.append(value)  # bare strings: clear, si_blurry, base...
        grid[key.strip()] = parsed
    return grid


def apply_point(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """The config of one grid point (``variant`` expands to a row of ``config.VARIANTS``;
    ``fgh.gamma`` sets a nested key; ``seed`` makes one run per seed)."""
    config = copy.deepcopy(base)
    for key, value in point.items():
        if key == "variant":
            if value not in VARIANTS:
                raise ConfigError(f"variant {value!r}: choose one of {', '.join(VARIANTS)}")
            config.update(copy.deepcopy(VARIANTS[value]))
        elif key.startswith("fgh."):
            if not config.get("fgh"):
                raise ConfigError(f"{key}: this grid point has no FGH (fgh is null)")
            config["fgh"][key.removeprefix("fgh.")] = value
        elif key == "seed":  # one run per seed: PILOT's trainer loops over a list
            config["seed"] = value if isinstance(value, list) else [value]
        else:
            config[key] = value
    return config


def point_name(point: dict[str, Any]) -> str:
    return "__".join(f"{k}-{v}" for k, v in point.items()) or "base"


def build_configs(
    base: dict[str, Any], grid: dict[str, list[Any]], out: Path, name_prefix: str = ""
) -> list[Path]:
    """Write and validate every grid point's config (all are checked before any run starts).

    ``name_prefix`` starts every point's name (config file and results prefix): the method in a
    per-method sweep (``harness/presets.py``)."""
    return write_configs(plan_configs(base, grid, out, name_prefix))


def write_configs(planned: dict[Path, dict[str, Any]]) -> list[Path]:
    """Write configs planned by :func:`plan_configs` to their paths."""
    for path, config in planned.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=4) + "\n")
    return list(planned)


def plan_configs(
    base: dict[str, Any], grid: dict[str, list[Any]], out: Path, name_prefix: str = ""
) -> dict[Path, dict[str, Any]]:
    """Every grid point's config, validated, by the path it is written to; nothing is written,
    so a dry run can list what a run would do and leave the disk as it was."""
    planned: dict[Path, dict[str, Any]] = {}
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        point = dict(zip(keys, values))
        if apply_point(base, {k: v for k, v in point.items() if k == "variant"}).get("fgh") is None:
            point = {k: v for k, v in point.items() if not k.startswith("fgh.")}  # no FGH: no axis
        config = apply_point(base, point)
        name = point_name(point)
        if name_prefix:
            name = f"{name_prefix}__{name}" if point else name_prefix
        path = out / "configs" / f"{name}.json"
        if path in planned:
            continue
        config["prefix"] = name
        config["results_dir"] = str((out / "results").resolve())
        resolve_config(config)
        planned[path] = config
    return planned

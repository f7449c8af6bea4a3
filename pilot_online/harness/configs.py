"""The configs of any registered method, built-in or from outside the package.

Why here and not in ``scripts/make_exps.py``: a method registered from outside (an entry point)
needs its configs too, from the same generator, without a checkout of this repository:
``pilot-online configs <name>`` writes them. ``scripts/make_exps.py`` writes the built-in
methods' into ``exps/`` (committed, so users diff them against upstream's) with these functions.

A method ``<short>_online`` gets

- ``smoke_<short>_online.json``: + P + FGH (where its card's ``variants`` allow) on the synthetic
  dataset at 32 px, random weights, CPU (:func:`smoke_config`; the card's ``smoke_overrides`` on
  top);
- its ablation configs ``<short>_online_<variant>[_blurry].json`` (the card's ``variants`` of
  base, p, fgh_only, fgh, x clear and Si-Blurry; CIFAR-100, 10 seeds), at the Best HP learning
  rate of its row in the paper's hp_grid table where it has one (``harness.protocol.HP_GRID``),
  else at the card's ``default_lr``, else at :data:`DEFAULT_LR`;
- where it has a hp_grid row, the row's learning-rate search ``<short>_online_hp_lr<lr>.json``.
"""

from __future__ import annotations

import copy
from typing import Any

from ..engine.config import VARIANTS
from ..engine.registry import get_method, method_card
from .protocol import FIXED_LRS, HP_GRID, method_short_name

#: The learning rate of the ablation configs of a method without a row in the paper's hp_grid
#: table (a method the paper did not tune, e.g. the APER family and SimpleCIL): the main tables'
#: fixed 5e-3 column (``engine.protocol.FIXED_LRS``), which PILOT's prompt configs also use. Other
#: learning rates: ``pilot-online sweep --grid init_lr=...``.
DEFAULT_LR: float = FIXED_LRS[-1]

#: L2P, DualPrompt and CODA's ablation configs run at 5e-3, the main tables' column, although
#: their hp_grid rows (searched with gamma too) exist; every other row with a hp_grid entry runs
#: at that row's Best HP (bold there), and each of its LRs is also a config,
#: ``<method>_online_hp_lr<lr>.json`` (the base row on VTAB). The main tables' other columns are
#: ``pilot-online sweep --grid init_lr=5e-5,5e-3``.
FIXED_LR_METHODS = ("coda", "l2p", "dualprompt")


def lr_grids() -> dict[str, tuple[list[float], float]]:
    """Short name -> (the hp_grid row's learning rates, its Best HP), for the searched rows."""
    return {
        method: (list(row.learning_rates), row.best_lr)
        for method, row in HP_GRID.items()
        if method not in FIXED_LR_METHODS
    }


#: Smoke-run replay memory: smaller than the paper's 1000 so that the 800-sample synthetic
#: stream fills it and reservoir replacement runs.
SMOKE_REPLAY = {"er_memory_size": 200, "er_batch_size": 50}

#: What every smoke config sets over its method's paper config: + P + FGH on the synthetic
#: dataset at 32 px, random weights, on the CPU.
SMOKE_TEMPLATE: dict[str, Any] = {
    "prefix": "smoke",
    "dataset": "synthetic_small",
    "init_cls": 4,
    "increment": 4,
    "device": [-1],
    "seed": [1993],
    "pretrained": False,
    "backbone_kwargs": {"img_size": 32},
    "num_workers": 0,
    "eval_batch_size": 100,
    "log_interval": 1,
}


def model_name(method: str) -> str:
    """The registered name of a short name: ``coda`` -> ``coda_online``."""
    return f"{method}_online"


def method_keys(name: str) -> dict:
    return {key: spec.default for key, spec in get_method(name).config_keys.items()}


def default_backbone(name: str) -> str:
    """The method's default ``backbone_type``: the first name of its card's table."""
    accepted = method_card(name).backbone_types
    if not accepted:
        raise ValueError(
            f"{name}'s card declares no backbone_types: set MethodCard(backbone_types=...) to the "
            "names PILOT builds for it (pilot_online/engine/backbone_names.py), the default first"
        )
    return accepted[0]


def paper_config(method: str, variant: str, blurry: bool) -> dict:
    name = model_name(method)
    row = copy.deepcopy(VARIANTS[variant])  # the paper's ablation row: P and FGH on or off
    stream = "si_blurry" if blurry else "clear"
    # The method's defaults, then what upstream's run scripts set for this stream and dataset.
    card = method_card(name)
    keys = {**method_keys(name), **card.settings_for("cifar224", stream)}
    grids = lr_grids()
    # No hp_grid row: the method's own declared default (its reason is in docs/methods.md), else
    # the main tables' fixed column.
    lr = grids[method][1] if method in grids else card.default_lr or DEFAULT_LR
    return {
        "prefix": variant + ("_blurry" if blurry else ""),
        "dataset": "cifar224",
        "memory_size": 0,
        "memory_per_class": 0,
        "fixed_memory": False,
        "shuffle": True,
        "init_cls": 10,
        "increment": 10,
        "model_name": name,
        "backbone_type": default_backbone(name),
        "device": ["0"],
        "seed": list(range(10)),
        "batch_size": 100,
        "init_lr": lr,
        "optimizer": "adam",
        "weight_decay": 0,
        "pretrained": True,
        "drop": 0.0,
        "drop_path": 0.0,
        **keys,
        "stream": stream,
        "si_blurry_n": 50,
        "si_blurry_m": 10,
        "online_prototypes": row["online_prototypes"],
        "fgh": row["fgh"],
        "logit_mask": card.default_logit_mask or "batch",
        **({"er_batch_size": 100} if "er_memory_size" in keys else {}),
    }


def smoke_variant(name: str) -> str:
    """+ P + FGH ("fgh"), or the method's first ablation row where it cannot run that one."""
    variants = method_card(name).variants
    return "fgh" if "fgh" in variants else variants[0]


def smoke_config(method: str) -> dict:
    """The paper's +P+FGH row (:func:`smoke_variant`) on the synthetic dataset at 32 px, random
    weights, CPU, with the method card's ``smoke_overrides``. ``method``: a short or registered
    name."""
    method = method_short_name(method)
    config = paper_config(method, smoke_variant(model_name(method)), blurry=False)
    config.update(copy.deepcopy(SMOKE_TEMPLATE))
    if "er_memory_size" in config:
        config.update(SMOKE_REPLAY)
    config.update(copy.deepcopy(dict(method_card(model_name(method)).smoke_overrides)))
    return config


def lr_grid_config(method: str, lr: float) -> dict:
    """One point of the paper's LR search: the base row on VTAB (10 tasks of 5 classes)."""
    config = paper_config(method, "base", blurry=False)
    config.update(prefix=f"hp_lr{lr:g}", dataset="vtab", init_cls=5, increment=5, init_lr=lr)
    return config


def method_configs(name: str) -> dict[str, dict]:
    """Every config of the registered method ``name`` by file name: its smoke config, its
    ablation configs (both streams) and, with a hp_grid row, its learning-rate search."""
    get_method(name)  # an unknown name raises, listing the registered ones
    method = method_short_name(name)
    configs = {f"smoke_{method}_online.json": smoke_config(method)}
    for variant in [v for v in VARIANTS if v in method_card(model_name(method)).variants]:
        for blurry in (False, True):
            configs[f"{method}_online_{variant}{'_blurry' if blurry else ''}.json"] = paper_config(
                method, variant, blurry
            )
    grid = lr_grids().get(method)
    for lr in grid[0] if grid else ():
        configs[f"{method}_online_hp_lr{lr:g}.json"] = lr_grid_config(method, lr)
    return configs

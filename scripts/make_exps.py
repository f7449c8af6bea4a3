"""Write exps/*.json: the paper's configurations and the offline smoke configs.

The configs are flat, PILOT-style JSON files (users diff them against upstream's exps/), so they are
committed; this script is their single source, and tests/test_config.py
(``test_exps_match_their_generator``) fails if they drift from it. Every config is validated with
``resolve_config`` (keys, and values against each option's choices) before anything is written.

Methods come from the registry (``pilot_online.list_methods()``): a newly registered adapter gets
its configs with no edit here. Each method ``<short>_online`` (the registered name minus
``_online``) gets

- ``smoke_<short>_online.json``: + P + FGH (where the adapter's ``variants`` allow) on the
  synthetic dataset at 32 px, random weights, CPU (:func:`smoke_config`; the adapter's
  ``smoke_overrides`` on top); and one Si-Blurry smoke config, ``smoke_coda_online_blurry.json``,
  with periodic evaluations (A_auc) (:func:`blurry_smoke_config`);
- its ablation configs ``<short>_online_<variant>[_blurry].json`` (the adapter's ``variants`` of
  base, p, fgh_only, fgh, x clear and Si-Blurry; CIFAR-100, 10 seeds), at the Best HP learning
  rate of its row in the paper's hp_grid table where it has one (``engine.protocol.HP_GRID``),
  else at :data:`DEFAULT_LR`;
- where it has a hp_grid row, the row's learning-rate search ``<short>_online_hp_lr<lr>.json``.

    python scripts/make_exps.py               # rewrite exps/
    python scripts/make_exps.py --smoke-only  # only the smoke configs
    python scripts/make_exps.py --check       # exit 1 if exps/ differs (with --smoke-only: smoke)
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # as a script: this checkout's package (tests import it as a module)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pilot_online.engine.registry import get_method, list_methods, method_card
from pilot_online.harness.protocol import FIXED_LRS, HP_GRID, method_short_name

EXPS = Path(__file__).resolve().parent.parent / "exps"

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


def short_names() -> list[str]:
    """Every built-in method's short name (the exps/ file prefix), in registry order; methods
    registered from outside the package (entry points) get no configs here."""
    built_in = [n for n in list_methods() if get_method(n).__module__.startswith("pilot_online.")]
    return [method_short_name(name) for name in built_in]


def method_keys(name: str) -> dict:
    return {key: spec.default for key, spec in get_method(name).config_keys.items()}


def default_backbone(name: str) -> str:
    """The method's default ``backbone_type``: the first name of its adapter's table."""
    adapter = get_method(name)
    if not adapter.backbone_types:
        raise SystemExit(
            f"{name} declares no backbone_types: set the adapter's backbone_types to the names "
            "PILOT builds for it (pilot_online/engine/backbone_names.py), the default first"
        )
    return adapter.backbone_types[0]


def paper_config(method: str, variant: str, blurry: bool) -> dict:
    from pilot_online.engine.config import VARIANTS

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


#: Stream samples between the Si-Blurry smoke config's periodic evaluations: 8 over its 800
#: (the synthetic stream), as Si-Blurry's protocol (every 1000 samples) gives 50 over CIFAR-100.
SMOKE_EVAL_PERIOD = 100


def blurry_smoke_config() -> dict:
    """CODA + P + FGH's smoke config on the Si-Blurry stream, with periodic evaluations: a run
    with A_auc and the accuracy-over-the-stream figure (``pilot-online figures --which
    accuracy``) in about a minute on the CPU."""
    config = smoke_config("coda")
    config.update(prefix="smoke_blurry", stream="si_blurry", eval_period=SMOKE_EVAL_PERIOD)
    return config


def smoke_configs() -> dict[str, dict]:
    """``smoke_<short>_online.json`` of every registered method, and the Si-Blurry smoke config
    ``smoke_coda_online_blurry.json``."""
    configs = {f"smoke_{method}_online.json": smoke_config(method) for method in short_names()}
    configs["smoke_coda_online_blurry.json"] = blurry_smoke_config()
    return configs


def all_configs() -> dict[str, dict]:
    configs = {}
    from pilot_online.engine.config import VARIANTS

    for method in short_names():
        for variant in [v for v in VARIANTS if v in method_card(model_name(method)).variants]:
            for blurry in (False, True):
                name = f"{method}_online_{variant}{'_blurry' if blurry else ''}.json"
                configs[name] = paper_config(method, variant, blurry)
    configs.update(smoke_configs())
    for method, (grid, _) in lr_grids().items():
        for lr in grid:
            configs[f"{method}_online_hp_lr{lr:g}.json"] = lr_grid_config(method, lr)
    # The paper configs run the appendix's FGH (engine.config.PAPER_FGH); the other named forms
    # (the main text's Eq. 8, the appendix algorithm with the clamp [0, 10]) are one "fgh" object
    # away, shown on CODA + P + FGH (docs/fgh.md).
    from pilot_online.engine.config import FGH_FORMS, PAPER_FGH

    for form, options in FGH_FORMS.items():
        if options != PAPER_FGH:
            other = paper_config("coda", "fgh", blurry=False)
            other.update(prefix=f"fgh_{form}", fgh=copy.deepcopy(options))
            configs[f"coda_online_fgh_{form}.json"] = other
    configs.update(scale_configs())
    configs.update(quickstart_configs())
    return configs


def scale_configs() -> dict[str, dict]:
    """``scale/<run>.json``: every run of the scale model's grid
    (``pilot_online/harness/scale/grid.py``), the method's paper config moved onto the shipped
    backbone and a scale benchmark."""
    from pilot_online.core import scale_backbone as backbone
    from pilot_online.harness.scale.grid import runs, scale_config

    keys = backbone.config_keys()
    return {
        f"scale/{run.name}.json": scale_config(
            paper_config(run.method, run.variant, run.stream == "si_blurry"), run, keys
        )
        for run in runs()
    }


def quickstart_configs() -> dict[str, dict]:
    """``quickstart_coda_online_{base,fgh}.json``: CODA and CODA + P + FGH on Split
    Fashion-MNIST (5 tasks of 2, the quickstart's quarter of the stream), the shipped backbone,
    the CPU, one seed: what ``make quickstart`` runs through PILOT's ``main.py``."""
    from pilot_online.core import scale_backbone as backbone

    configs = {}
    for variant in ("base", "fgh"):
        config = paper_config("coda", variant, blurry=False)
        config.update(
            prefix=f"quickstart_{variant}",
            dataset="fashion_mnist_quick",
            init_cls=2,
            increment=2,
            device=[-1],
            seed=[0],
            num_workers=0,
            **backbone.config_keys(),
        )
        configs[f"quickstart_coda_online_{variant}.json"] = config
    return configs


def render(config: dict) -> str:
    return json.dumps(config, indent=4) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report differences")
    parser.add_argument(
        "--smoke-only",
        action="store_true",
        help="only the smoke configs (smoke_<method>_online.json), one per registered method",
    )
    options = parser.parse_args()
    check = options.check
    from pilot_online.engine.config import resolve_config

    configs = smoke_configs() if options.smoke_only else all_configs()
    for config in configs.values():
        resolve_config(config)  # a bad key or value stops here, before any file is written
    stale = []
    for name, config in configs.items():
        path = EXPS / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = render(config)
        if not path.exists() or path.read_text() != text:
            stale.append(name)
            if not check:
                path.write_text(text)
    if check and stale:
        print(f"exps/ is out of date ({', '.join(stale)}): run python scripts/make_exps.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

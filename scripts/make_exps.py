"""Write exps/*.json: the paper's configurations and the offline smoke configs.

The configs are flat, PILOT-style JSON files (users diff them against upstream's exps/), so they are
committed; this script is their single source, and tests/test_config.py
(``test_exps_match_their_generator``) fails if they drift from it. Every config is validated with
``resolve_config`` (keys, and values against each option's choices) before anything is written.

    python scripts/make_exps.py          # rewrite exps/
    python scripts/make_exps.py --check  # exit 1 if exps/ differs
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pilot_online.engine.protocol import HP_GRID

EXPS = Path(__file__).resolve().parent.parent / "exps"

#: short name -> (model_name, backbone_type). Method keys come from the adapters' ``config_keys``
#: defaults (the paper's task-free settings), so configs and code cannot disagree.
METHODS = {
    "coda": ("coda_online", "vit_base_patch16_224_coda_prompt"),
    "l2p": ("l2p_online", "vit_base_patch16_224_l2p"),
    "dualprompt": ("dualprompt_online", "vit_base_patch16_224_dualprompt"),
    "mvp": ("mvp_online", "vit_base_patch16_224_l2p"),
    "finetune": ("finetune_online", "vit_base_patch16_224"),
    "linear_probe": ("linear_probe_online", "vit_base_patch16_224"),
    "er": ("er_online", "vit_base_patch16_224"),
    "er_linear_probe": ("er_linear_probe_online", "vit_base_patch16_224"),
    "olora": ("olora_online", "vit_base_patch16_224"),  # timm's plain ViT-B/16, as upstream oLoRA
    "convprompt": ("convprompt_online", "vit_base_patch16_224_dualprompt"),
}

#: The paper's hp_grid table (VTAB, clear, 5 classes per task) lives in
#: ``pilot_online.engine.protocol.HP_GRID``; ``pilot-online sweep --preset hp_grid`` runs it.
#: Here: the rows besides L2P, DualPrompt and CODA run their ablation configs at the table's Best
#: HP (bold there); L2P, DualPrompt and CODA's run at 5e-3, the main tables' column. Each LR of
#: those rows is also a config, ``<method>_online_hp_lr<lr>.json`` (the base row on VTAB); the
#: main tables' other columns are ``pilot-online sweep --grid init_lr=5e-5,5e-3``.
FIXED_LR_METHODS = ("coda", "l2p", "dualprompt")
LR_GRIDS = {
    method: (list(row.learning_rates), row.best_lr)
    for method, row in HP_GRID.items()
    if method not in FIXED_LR_METHODS
}

#: Smoke-run replay memory: smaller than the paper's 1000 so that the 800-sample synthetic
#: stream fills it and reservoir replacement runs.
SMOKE_REPLAY = {"er_memory_size": 200, "er_batch_size": 50}


def method_keys(model_name: str) -> dict:
    from pilot_online.engine.registry import get_method

    return {key: spec.default for key, spec in get_method(model_name).config_keys.items()}


def paper_config(method: str, variant: str, blurry: bool) -> dict:
    from pilot_online.engine.config import VARIANTS

    model_name, backbone = METHODS[method]
    row = copy.deepcopy(VARIANTS[variant])  # the paper's ablation row: P and FGH on or off
    keys = method_keys(model_name)
    return {
        "prefix": variant + ("_blurry" if blurry else ""),
        "dataset": "cifar224",
        "memory_size": 0,
        "memory_per_class": 0,
        "fixed_memory": False,
        "shuffle": True,
        "init_cls": 10,
        "increment": 10,
        "model_name": model_name,
        "backbone_type": backbone,
        "device": ["0"],
        "seed": list(range(10)),
        "batch_size": 100,
        "init_lr": LR_GRIDS[method][1] if method in LR_GRIDS else 0.005,
        "optimizer": "adam",
        "weight_decay": 0,
        "pretrained": True,
        "drop": 0.0,
        "drop_path": 0.0,
        **keys,
        "stream": "si_blurry" if blurry else "clear",
        "si_blurry_n": 50,
        "si_blurry_m": 10,
        "online_prototypes": row["online_prototypes"],
        "fgh": row["fgh"],
        "logit_mask": "batch",
        **({"er_batch_size": 100} if "er_memory_size" in keys else {}),
    }


def smoke_config(method: str) -> dict:
    """The paper's +P+FGH row on the synthetic dataset at 32 px, random weights, CPU."""
    config = paper_config(method, "fgh", blurry=False)
    config.update(
        {
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
    )
    if "er_memory_size" in config:
        config.update(SMOKE_REPLAY)
    return config


def lr_grid_config(method: str, lr: float) -> dict:
    """One point of the paper's LR search: the base row on VTAB (10 tasks of 5 classes)."""
    config = paper_config(method, "base", blurry=False)
    config.update(prefix=f"hp_lr{lr:g}", dataset="vtab", init_cls=5, increment=5, init_lr=lr)
    return config


def all_configs() -> dict[str, dict]:
    configs = {}
    from pilot_online.engine.config import VARIANTS

    for method in METHODS:
        for variant in VARIANTS:
            for blurry in (False, True):
                name = f"{method}_online_{variant}{'_blurry' if blurry else ''}.json"
                configs[name] = paper_config(method, variant, blurry)
        configs[f"smoke_{method}_online.json"] = smoke_config(method)
    for method, (grid, _) in LR_GRIDS.items():
        for lr in grid:
            configs[f"{method}_online_hp_lr{lr:g}.json"] = lr_grid_config(method, lr)
    appendix = paper_config("coda", "fgh", blurry=False)
    appendix.update(
        prefix="fgh_appendix",
        fgh={"gamma": 0.001, "granularity": "class", "direction": "adam", "apply": "grad"},
    )
    configs["coda_online_fgh_appendix.json"] = appendix
    return configs


def render(config: dict) -> str:
    return json.dumps(config, indent=4) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report differences")
    check = parser.parse_args().check
    from pilot_online.engine.config import resolve_config

    configs = all_configs()
    for config in configs.values():
        resolve_config(config)  # a bad key or value stops here, before any file is written
    stale = []
    EXPS.mkdir(exist_ok=True)
    for name, config in configs.items():
        path = EXPS / name
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

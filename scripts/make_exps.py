"""Write exps/*.json: the paper's configurations of every built-in method and the smoke configs.

The configs are flat, PILOT-style JSON files (users diff them against upstream's exps/), so they are
committed; this script is their single source, and tests/test_config.py
(``test_exps_match_their_generator``) fails if they drift from it. Every config is validated with
``resolve_config`` (keys, and values against each option's choices) before anything is written.

Methods come from the registry (``pilot_online.list_methods()``): a newly registered built-in
adapter gets its configs with no edit here. What each method gets (its smoke config, its ablation
configs, its learning-rate search) is ``pilot_online/harness/configs.py``, which also writes an
outside method's (``pilot-online configs <name>``). Beside them, exps/ holds one Si-Blurry smoke
config, ``smoke_coda_online_blurry.json``, with periodic evaluations (A_auc)
(:func:`blurry_smoke_config`), CODA + P + FGH in the FGH forms other than the paper's, the scale
model's grid (``scale/``) and the quickstart's two configs.

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

if __name__ == "__main__":  # as a script: this checkout's package (tests import it as a module)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pilot_online.engine.registry import get_method, list_methods
from pilot_online.harness.configs import method_configs, model_name, paper_config, smoke_config
from pilot_online.harness.protocol import method_short_name

EXPS = Path(__file__).resolve().parent.parent / "exps"


def short_names() -> list[str]:
    """Every built-in method's short name (the exps/ file prefix), in registry order; methods
    registered from outside the package (entry points) get no configs here: ``pilot-online
    configs <name>`` writes theirs."""
    built_in = [n for n in list_methods() if get_method(n).__module__.startswith("pilot_online.")]
    return [method_short_name(name) for name in built_in]


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
    for method in short_names():
        configs.update(method_configs(model_name(method)))
    configs.update(smoke_configs())
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

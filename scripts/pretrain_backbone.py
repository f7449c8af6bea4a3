"""Pretrain, resume and ship the scale model's backbone (``harness/scale/pretrain.py``).

    python scripts/pretrain_backbone.py                       # train (or resume) to the bar
    python scripts/pretrain_backbone.py --max-minutes 120     # one sitting; rerun to resume
    python scripts/pretrain_backbone.py --ship                # write the file and its record

Training writes ``checkpoint.pt`` to ``--workdir`` every 100 steps and at every check; rerunning
the same command resumes from it bit-identically. ``--ship`` takes the checkpoint that met the
bar, writes ``pilot_online/data/backbones/scale_vit.safetensors`` (fp16) and ``scale_vit.json``
(recipe, seed, torch version, threads, SHA-256, steps, time, and the probe and nearest-class-mean
accuracies on the ``fractal`` and ``fashion_mnist`` benchmarks against random initialisation and
raw pixels, measured on the fp16 weights that ship: probes fit on 6,000 of each benchmark's
training images and score on its test set). Regenerate and commit both only when the recipe
changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import sys
from pathlib import Path

import torch

from pilot_online.core import scale_backbone as backbone
from pilot_online.core.datasets import first_of_each_class, load_scale_dataset
from pilot_online.core.files import sha256
from pilot_online.harness.scale import probe
from pilot_online.harness.scale.pretrain import (
    Pretrainer,
    Recipe,
    backbone_state,
    build_vit,
    pretrain,
)
from pilot_online.pilot.backbones import load_vit_state_dict, read_state_dict

DEFAULT_WORKDIR = Path.home() / ".cache" / "pilot-online" / "pretrain"


#: Training images the record's probes fit on, per benchmark (its first ones of each class);
#: they score on the benchmark's whole test set.
PROBE_TRAIN_IMAGES = 6000


def first_per_class(data: dict, total: int) -> dict:
    """``data`` with its training set cut to its first ``total / classes`` images a class."""
    classes = int(data["train_y"].max()) + 1
    keep = first_of_each_class(data["train_y"], total // classes)
    return {**data, "train_x": data["train_x"][keep], "train_y": data["train_y"][keep]}


def ship(recipe: Recipe, workdir: Path, provisional: bool = False) -> dict:
    """Write the shipped file and its record from ``workdir``'s checkpoint, which must have met
    the bar, unless ``provisional`` (the record then says that it has not)."""
    from safetensors.torch import save_file

    saved = torch.load(workdir / "checkpoint.pt", map_location="cpu", weights_only=False)
    checks = saved["state"]["checks"]
    bar_met = bool(checks and checks[-1]["bar_met"])
    if not bar_met and not provisional:
        raise SystemExit(f"{workdir}/checkpoint.pt has not met the bar yet: train on first")
    model = Pretrainer(recipe)
    model.load_state_dict(saved["model"])
    backbone.FOLDER.mkdir(parents=True, exist_ok=True)
    save_file(backbone_state(model), str(backbone.WEIGHTS))
    backbone.WEIGHTS.chmod(0o644)
    shipped = build_vit(recipe)
    load_vit_state_dict(shipped, read_state_dict(backbone.WEIGHTS))
    torch.manual_seed(recipe.seed)
    random_init = build_vit(recipe)
    figures = {}
    for name in ("fractal", "fashion_mnist"):
        data = first_per_class(load_scale_dataset(name, recipe.img_size), PROBE_TRAIN_IMAGES)
        figures[name] = {
            what: dataclasses.asdict(probe.quality(model_, data))
            for what, model_ in (("pretrained", shipped), ("random_init", random_init))
        }
        figures[name]["raw_pixels"] = dataclasses.asdict(probe.quality(None, data))
        logging.info("%s: %s", name, json.dumps(figures[name]))
    record = {
        "file": backbone.CONFIG_NAME,
        "sha256": sha256(backbone.WEIGHTS),
        "bytes": backbone.WEIGHTS.stat().st_size,
        "recipe": dataclasses.asdict(recipe),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": saved["state"]["step"],
        "train_seconds": round(saved["state"]["seconds"]),
        "bar_met": bar_met,
        "checks": checks,
        "benchmarks": figures,
        "regenerate": backbone.REGENERATE,
    }
    backbone.RECORD.write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    parser.add_argument("--max-minutes", type=float, default=None, help="stop this sitting")
    parser.add_argument("--ship", action="store_true", help="write the file and its record")
    parser.add_argument(
        "--provisional",
        action="store_true",
        help="with --ship: ship the last checkpoint although it has not met the bar (recorded)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    recipe = Recipe()
    if args.ship:
        record = ship(recipe, args.workdir, args.provisional)
        print(json.dumps(record["benchmarks"], indent=2))
        return 0
    seconds = None if args.max_minutes is None else args.max_minutes * 60
    state = pretrain(recipe, args.workdir, max_seconds=seconds)
    last = state.checks[-1] if state.checks else {}
    if last.get("bar_met"):
        print(f"bar met at step {state.step} ({state.seconds / 60:.0f} min): now --ship")
    else:
        print(f"stopped at step {state.step}: rerun the same command to resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())

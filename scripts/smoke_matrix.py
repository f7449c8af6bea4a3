"""The smoke matrix: every method x {base, + P, + FGH, + P + FGH} x {clear, Si-Blurry}, via PILOT.

    PILOT_ROOT=/path/to/patched/LAMDA-PILOT python scripts/smoke_matrix.py [--out runs/smoke]

Each method's smoke config (synthetic data, 32 px, random weights, CPU) is swept with
``pilot-online sweep``; one AP/A_T table of all runs is printed at the end.

``--vit-depth 5`` builds shallower ViTs (deeper where a config places prompts in a later block:
ConvPrompt's ``prompt_layers``), as the suite's runs through ``main.py`` do: about twice as fast,
for a before/after comparison of two commits (``scripts/same_results.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

EXPS = Path(__file__).resolve().parent.parent / "exps"


def vit_depth_for(config: dict, minimum: int) -> int:
    """``minimum`` blocks, or deeper where ``config`` places prompts in a later block
    (ConvPrompt's ``prompt_layers``: 0-6). The suite's runs through main.py use it too."""
    return max([minimum, *(layer + 1 for layer in config.get("prompt_layers") or [])])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/smoke_matrix"))
    every = sorted(
        p.name[len("smoke_") : -len("_online.json")] for p in EXPS.glob("smoke_*_online.json")
    )
    parser.add_argument("--methods", default=",".join(every))
    parser.add_argument("--variants", default="base,p,fgh_only,fgh")
    parser.add_argument("--streams", default="clear,si_blurry")
    parser.add_argument("--vit-depth", type=int, default=None, help="default: the configs' own")
    args = parser.parse_args()
    status = 0
    for method in args.methods.split(","):
        config = EXPS / f"smoke_{method}_online.json"
        # The rows the method runs are those it has paper configs for: its card's variants as
        # make_exps wrote them (SimpleCIL, RanPAC and FeCAM: base alone). Read from exps/, not
        # the card, so that the script also drives an older checkout's package.
        variants = [
            v for v in args.variants.split(",") if (EXPS / f"{method}_online_{v}.json").is_file()
        ]
        skipped = sorted(set(args.variants.split(",")) - set(variants))
        if skipped:
            print(f"{method}: no {', '.join(skipped)} row (it has no such configs)", flush=True)
        if not variants:
            continue
        depth = []
        if args.vit_depth is not None:
            smoke = json.loads(config.read_text(encoding="utf-8"))
            depth = ["--grid", f"vit_depth={vit_depth_for(smoke, args.vit_depth)}"]
        status |= subprocess.call(
            [
                sys.executable,
                "-m",
                "pilot_online.cli",
                "sweep",
                "--config",
                str(config),
                "--grid",
                f"variant={','.join(variants)}",
                "--grid",
                f"stream={args.streams}",
                *depth,
                "--out",
                str(args.out / method),
            ]
        )
    if args.out.is_dir():
        subprocess.call([sys.executable, "-m", "pilot_online.cli", "report", str(args.out)])
    else:
        print(f"no run was made, so {args.out} holds no table", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())

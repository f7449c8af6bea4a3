"""The FLOP model: FLOPs per image of every registered method at 224 px, and the predicted time
of a whole CUB run beside the paper's time table.

Run ``python benchmarks/flops.py`` (PILOT is needed: ``--pilot-root``, default ``$PILOT_ROOT`` or
``../shared/LAMDA-PILOT``; only imported, never written). For each method (``--methods``, default
every registered one) it counts what ``pilot_online/harness/flop_count.py`` describes: the
network of the method's paper config (base row) at 224 px with random weights on the CPU, on
``--batch`` images, after 0, 1 and 2 firings for a network that grows.
It writes them, with the torch and timm versions, to the package data
``pilot_online/data/flops.json`` (``--no-write`` to leave it; ``--table-only`` to skip counting
and print from it), then prints the predicted GPU compute time of one CUB run (clear, 20 tasks,
batch 100, one evaluation per task, query cache on) per method at ``--tflops`` sustained
(default: an H100's bf16 peak at 40%, see ``pilot_online/cli/estimate.py``) beside the paper's
time table (one Quadro RTX 8000; oLoRA two), and checks the target: CODA + P + FGH <= 20 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FLOPS_JSON = ROOT / "pilot_online" / "data" / "flops.json"
#: The CODA + P + FGH target of issue 15 for a whole CUB run on an H100 (seconds).
TARGET_SECONDS = 20.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="", help="comma-separated (default: all registered)")
    parser.add_argument("--batch", type=int, default=1, help="images per counted pass")
    parser.add_argument("--classes", type=int, default=200, help="head size (CUB: 200)")
    parser.add_argument("--tflops", type=float, default=None, help="sustained TFLOP/s")
    parser.add_argument("--no-write", action="store_true", help="do not update flops.json")
    parser.add_argument("--table-only", action="store_true", help="print from flops.json only")
    parser.add_argument(
        "--pilot-root",
        default=os.environ.get("PILOT_ROOT") or str(ROOT.parent / "shared" / "LAMDA-PILOT"),
    )
    args = parser.parse_args(argv)
    if not args.table_only and not Path(args.pilot_root, "utils", "inc_net.py").is_file():
        parser.error(f"{args.pilot_root} is no PILOT checkout: pass --pilot-root or set PILOT_ROOT")
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import timm

    sys.dont_write_bytecode = True  # PILOT's tree stays untouched
    sys.path.insert(0, str(Path(args.pilot_root).resolve()))
    warnings.filterwarnings("ignore")
    from pilot_online.engine.registry import list_methods
    from pilot_online.harness.flop_count import count_method

    methods = [m.strip() for m in args.methods.split(",") if m.strip()] or list_methods()
    table: dict[str, Any] = {
        "note": (
            "FLOPs per image (torch.utils.flop_counter, 2 per multiply-add) of each method's "
            "PILOT network, ViT-B/16 at 224 px, base variant (P and FGH add no matrix products), "
            f"{args.classes}-class head; written by benchmarks/flops.py"
        ),
        "img_size": 224,
        "batch": args.batch,
        "classes": args.classes,
        "torch": torch.__version__,
        "timm": timm.__version__,
        "methods": {},
    }
    for method in methods:
        begin = time.perf_counter()
        table["methods"][method] = count_method(method, args.classes, args.batch)
        row = table["methods"][method]
        growth = row.get("by_firings")
        if growth:
            print(
                f"{method:24} grows: train "
                + " / ".join(f"{c['train_flops_per_image'] / 1e9:.1f}" for c in growth)
                + " GFLOP/img after 0/1/2 firings"
            )
        print(
            f"{method:24} train {row['train_flops_per_image'] / 1e9:7.1f} GFLOP/img  "
            f"test {row['test_flops_per_image'] / 1e9:6.1f}  query "
            f"{row['query_flops_per_image'] / 1e9:6.1f}  ({time.perf_counter() - begin:.0f} s)",
            flush=True,
        )
    return table


def paper_times() -> dict[tuple[str, str], int]:
    """Seconds per (paper method, row) of the paper's time table (the package's paper data)."""
    from pilot_online.harness.paper import time_consumption

    return {(r["method"], r["row"]): int(r["seconds"]) for r in time_consumption()["rows"]}


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m{int(seconds % 60):02d}s"
    if seconds >= 60:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{seconds:.1f}s"


def print_table(tflops: float | None) -> bool:
    from pilot_online.engine.registry import method_card
    from pilot_online.harness import estimate

    estimate.load_flops.cache_clear()
    sustained = tflops or estimate.DEFAULT_SUSTAINED_TFLOPS
    table = estimate.load_flops()
    size = estimate.DATASET_SIZES["cub"]
    print(
        f"\nPredicted GPU compute time of one CUB run (clear, 20 tasks, batch 100, one evaluation "
        f"per task, query cache on; {size.train} train / {size.test} test images) at "
        f"{sustained:.1f} TFLOP/s sustained"
        + (" (H100 bf16 peak 989.4 at 40%)" if tflops is None else "")
        + f"; FLOPs counted with torch {table['torch']}, timm {table['timm']}."
    )
    print("Paper: one Quadro RTX 8000 (oLoRA: two), whole run; P and FGH rows add no FLOPs here.")
    paper = paper_times()
    print(
        f"{'method':24} {'train TFLOP':>11} {'eval TFLOP':>10} {'predicted':>10} "
        f"{'paper base':>11} {'paper +P+FGH':>12}"
    )
    rows = estimate.predicted_time_table(sustained_tflops=sustained, dataset="cub")
    ok = True
    for row in rows:
        name = method_card(row["method"]).paper_name
        base, ours = paper.get((name, "base")), paper.get((name, "ours"))
        print(
            f"{row['method']:24} {row['train_tflop']:11.0f} {row['eval_tflop']:10.0f} "
            f"{duration(row['seconds']):>10} {duration(base) if base else 'n/a':>11} "
            f"{duration(ours) if ours else 'n/a':>12}"
        )
        if row["method"] == "coda_online":
            ok = row["seconds"] <= TARGET_SECONDS
            coda = row["seconds"]
    if "coda_online" in table["methods"]:
        print(
            f"target: CODA + P + FGH CUB run <= {TARGET_SECONDS:.0f} s on an H100: "
            f"{coda:.1f} s predicted, {'pass' if ok else 'FAIL'}"
        )
    return ok


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.table_only:
        table = measure(args)
        if not args.no_write:
            if FLOPS_JSON.is_file():  # keep counts of methods not measured this time
                old = json.loads(FLOPS_JSON.read_text(encoding="utf-8"))
                table["methods"] = {**old.get("methods", {}), **table["methods"]}
            FLOPS_JSON.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
            print(f"wrote {FLOPS_JSON.relative_to(ROOT)}")
    if not print_table(args.tflops):
        sys.exit(1)


if __name__ == "__main__":
    main()

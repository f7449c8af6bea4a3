"""Peak training memory of Online-LoRA against CODA-Prompt, on the same online loop.

Run ``python benchmarks/bench_memory.py`` (PILOT is needed for CODA's network: ``--pilot-root``,
default ``$PILOT_ROOT`` or ``../shared/LAMDA-PILOT``; it is only imported, never written). Each
(method, variant) runs in a fresh subprocess, because a process's peak resident set size
(``ru_maxrss``) cannot be reset. A worker builds the method's network from its smoke config
(``exps/smoke_<method>.json``: ViT-B/16, random weights, ``img_size`` 32 unless ``--img-size``),
records its peak memory after the build, runs ``--steps`` online steps on random batches of
``--batch-size`` images, and records the peak again. The table shows both peaks, their difference
(what training adds on top of the network) and each method's figures over CODA's.

On CPU the figure is the process's peak RSS (model weights, activations, optimiser state and the
allocator's slack all included); on CUDA (``--device cuda``) it is
``torch.cuda.max_memory_allocated``. A CPU run at 32 px says little about a GPU at 224 px, where
activations dominate: read the CPU ratios as a small-image indication only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("coda_online", "olora_online")
VARIANTS = {"base": {"online_prototypes": False, "fgh": None}, "p_fgh": {}}


def default_pilot_root() -> str:
    return os.environ.get("PILOT_ROOT") or str(ROOT.parent / "shared" / "LAMDA-PILOT")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--variants", nargs="+", default=["base"], choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=6, help="online steps (oLoRA's buffer: 4)")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--pilot-root", default=default_pilot_root())
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: default)")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "VARIANT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def worker(args: argparse.Namespace) -> dict:
    """One (method, variant) in this process: peak after the build, peak after training."""
    sys.dont_write_bytecode = True  # PILOT's tree stays untouched
    sys.path.insert(0, str(Path(args.pilot_root).resolve()))
    import torch

    from pilot_online.engine.config import load_json, resolve_config
    from pilot_online.engine.mixins import build_loop
    from pilot_online.engine.registry import get_method
    from pilot_online.pilot.backbones import timm_overrides

    method, variant = args.worker
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    raw = load_json(ROOT / "exps" / f"smoke_{method}.json")
    raw.update(VARIANTS[variant], backbone_kwargs={"img_size": args.img_size}, grad_trace=False)
    config = {**resolve_config(raw), "nb_classes": args.classes, "device": [device]}
    torch.manual_seed(0)
    adapter = get_method(method)(args=config)
    with timm_overrides(config["backbone_kwargs"]):
        network = adapter.build_network(config)
    loop = build_loop(adapter, network, config, args.classes, device)
    built = peak_bytes(device)
    if device.type == "cuda":
        built = int(torch.cuda.memory_allocated(device))  # what the network and loop hold
        torch.cuda.reset_peak_memory_stats(device)
    g = torch.Generator().manual_seed(0)
    size = (args.batch_size, 3, args.img_size, args.img_size)
    for _ in range(args.steps):
        inputs = torch.rand(size, generator=g)
        labels = torch.randint(0, args.classes, (args.batch_size,), generator=g)
        loop.train_step(inputs, labels)
    trained = peak_bytes(device)
    return {
        "method": method,
        "variant": variant,
        "trainable": sum(p.numel() for _, p in loop.named_parameters),
        "built": built,
        "peak": max(built, trained),
        "training": max(built, trained) - built,
        "report": loop.report().get("method", {}),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if "coda_online" in args.methods and not Path(args.pilot_root, "utils", "inc_net.py").is_file():
        sys.exit(
            f"CODA's network comes from PILOT, and {args.pilot_root} is no PILOT checkout: "
            "pass --pilot-root or set PILOT_ROOT (or run with --methods olora_online)"
        )
    rows = []
    for variant in args.variants:
        for method in args.methods:
            command = [sys.executable, __file__, "--worker", method, variant]
            for flag in ("steps", "batch_size", "classes", "img_size", "pilot_root", "device"):
                command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            command += ["--threads", str(args.threads)]
            env = dict(
                os.environ,
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            )
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if done.returncode != 0:
                sys.exit(f"{method} {variant} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    mib = 2**20
    what = "peak RSS" if args.device == "cpu" else "torch.cuda.max_memory_allocated"
    print(
        f"{what}, {args.steps} steps of {args.batch_size} images at {args.img_size} px, "
        f"{args.classes} classes, device {args.device}"
    )
    print(
        f"{'method':14} {'variant':8} {'trainable':>10} {'built MiB':>10} {'peak MiB':>9} "
        f"{'training MiB':>13} {'peak/CODA':>9} {'training/CODA':>13}"
    )
    for row in rows:
        coda = next(
            (r for r in rows if r["method"] == "coda_online" and r["variant"] == row["variant"]),
            None,
        )
        peak_ratio = f"{row['peak'] / coda['peak']:.2f}x" if coda else "n/a"
        train_ratio = (
            f"{row['training'] / coda['training']:.2f}x" if coda and coda["training"] else "n/a"
        )
        print(
            f"{row['method']:14} {row['variant']:8} {row['trainable']:>10} "
            f"{row['built'] / mib:>10.0f} {row['peak'] / mib:>9.0f} {row['training'] / mib:>13.0f} "
            f"{peak_ratio:>9} {train_ratio:>13}"
        )
        if row["report"]:
            print(f"    {row['method']} diagnostics: {json.dumps(row['report'])}")


if __name__ == "__main__":
    main()

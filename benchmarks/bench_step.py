"""Cost of a whole online training step with prototypes (P) and FGH, relative to the base step.

Run ``python benchmarks/bench_step.py --device cpu`` (or ``--device cuda``). It builds four
online loops with :func:`pilot_online.engine.mixins.build_loop` (the paper's ablation rows: base,
+ P, + FGH, + P + FGH) around the same adapter and identically initialised networks, feeds every
loop the same batches (random images ``[B, 3, 32, 32]``, labels in 10 classes), and times
``loop.train_step`` interleaved round-robin, so machine load hits every variant alike. It prints
steps/s and each variant's time relative to base: the paper claims P and FGH cost little.

Adapters (``--model``):

* ``vit``: the demo's :class:`pilot_online.cli.demo.ScaleViTAdapter` (the shipped scale-model
  ViT: width 768, 5 blocks, 32 px, frozen except its final norm and head; needs timm). Like the
  prompt methods, the trainable set is small next to the frozen forward pass.
* ``mlp``: a small torch MLP defined here, every weight trainable, so FGH covers all ~1.8 M
  parameters and its cost is visible next to a cheap forward pass (a worst case for FGH).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
import warnings
from collections.abc import Callable

import torch
from timing import add_device_arguments, interleaved_medians, setup_device  # benchmarks/timing.py
from torch import nn

from pilot_online.engine.adapter import MethodAdapter, StepOutput
from pilot_online.engine.config import ONLINE_KEYS
from pilot_online.engine.loop import OnlineLoop
from pilot_online.engine.mixins import build_loop

VARIANTS = {
    "base": {"online_prototypes": False, "fgh": None},
    "+P": {"online_prototypes": True, "fgh": None},
    "+FGH": {"online_prototypes": False, "fgh": {}},
    "+P+FGH": {"online_prototypes": True, "fgh": {}},
}


# --------------------------------------------------------------------------- timing


# --------------------------------------------------------------------------- the MLP adapter


class MLPNet(nn.Module):
    """Flattened pixels -> two ReLU layers (the features) -> a linear head."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, num_classes)


class MLPAdapter(MethodAdapter):
    """A fully trainable MLP behind the same adapter contract as the PILOT methods."""

    base_model_name = "mlp"

    def build_network(self, args: dict) -> nn.Module:
        return MLPNet(args["in_features"], args["hidden"], args["nb_classes"])

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = network.body(x)
        return StepOutput(network.head(features), features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.head


def make_adapter(model: str, config: dict) -> MethodAdapter:
    if model == "vit":
        from pilot_online.cli.demo import ScaleViTAdapter

        return ScaleViTAdapter(args=config)
    return MLPAdapter(args=config)


# --------------------------------------------------------------------------- loops


def make_config(variant: dict, args: argparse.Namespace) -> dict:
    """The online defaults plus this variant's P/FGH switches, as the demo builds them."""
    config = {key: spec.default for key, spec in ONLINE_KEYS.items()}
    config.update(
        variant,
        init_lr=args.lr,
        optimizer="adam",
        weight_decay=0.0,
        nb_classes=args.classes,
        in_features=3 * args.image_size**2,
        hidden=args.hidden,
    )
    if variant["fgh"] is not None:
        config["fgh"] = {
            "gamma": args.fgh_gamma,
            "granularity": args.fgh_granularity,
            "direction": args.fgh_direction,
        }
    return config


def make_loops(args: argparse.Namespace, device: torch.device) -> dict[str, OnlineLoop]:
    """One loop per variant, each around a network initialised from the same seed."""
    loops = {}
    for name, variant in VARIANTS.items():
        config = make_config(variant, args)
        adapter = make_adapter(args.model, config)
        torch.manual_seed(args.seed)
        network = adapter.build_network(config)
        loops[name] = build_loop(adapter, network, config, args.classes, device)
    return loops


def make_batches(args: argparse.Namespace, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, 3, args.image_size, args.image_size)
    return [
        (
            torch.rand(shape, generator=generator).to(device),
            torch.randint(args.classes, (args.batch,), generator=generator).to(device),
        )
        for _ in range(args.batches)
    ]


def step_function(loop: OnlineLoop, batches: list[tuple[torch.Tensor, ...]]) -> Callable[[], None]:
    """One ``train_step`` on the next batch (each loop walks the same batches in order)."""
    position = [0]

    def step() -> None:
        inputs, labels = batches[position[0] % len(batches)]
        position[0] += 1
        loop.train_step(inputs, labels)

    return step


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    has_timm = importlib.util.find_spec("timm") is not None
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(parser)
    parser.add_argument(
        "--model",
        choices=("vit", "mlp"),
        default="vit" if has_timm else "mlp",
        help="vit: the demo's timm ViT (default when timm is installed); mlp: a torch MLP",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed steps per variant (default: vit 5, mlp 20)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed steps per variant (one more runs to size the timing blocks)",
    )
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--batches", type=int, default=8, help="distinct batches cycled")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512, help="MLP width")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--fgh-gamma", type=float, default=1.0)
    parser.add_argument(
        "--fgh-granularity", choices=("element", "class", "global"), default="element"
    )
    parser.add_argument("--fgh-direction", choices=("grad", "adam"), default="grad")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 5 if args.model == "vit" else 20
    if args.repeats < 1 or args.warmup < 1 or args.batches < 1:
        parser.error("--repeats, --warmup and --batches must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    if args.model == "vit" and args.image_size != 32:
        parser.error("--model vit is built for 32 px images; drop --image-size")
    args.has_timm = has_timm
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # timm 0.6 calls torch.jit.script at import, which newer torch flags as deprecated: noise here.
    warnings.filterwarnings(
        "ignore", message=".*torch.jit.script.*deprecated", category=FutureWarning
    )
    if args.model == "vit" and not args.has_timm:
        print("bench_step: --model vit needs timm (pip install timm); skipped. Try --model mlp.")
        return
    device = setup_device(args)
    started = time.perf_counter()
    loops = make_loops(args, device)
    batches = make_batches(args, device)
    base = loops["base"]
    trainable = sum(p.numel() for _, p in base.named_parameters)
    total = sum(p.numel() for p in base.network.parameters())
    print(
        f"bench_step: device={device}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, model {args.model} ({trainable:,} of {total:,} parameters "
        f"trainable), batch {args.batch} x 3 x {args.image_size} x {args.image_size}, "
        f"{args.classes} classes"
    )
    print(
        f"FGH: gamma={args.fgh_gamma}, granularity={args.fgh_granularity}, direction="
        f"{args.fgh_direction}; Adam lr={args.lr}; median of {args.repeats} repeats after "
        f"{args.warmup} warm-up steps per variant"
    )
    fns = {name: step_function(loop, batches) for name, loop in loops.items()}
    times = interleaved_medians(fns, device, args.repeats, args.warmup)

    print(f"\n{'variant':<10}{'ms/step':>10}{'steps/s':>10}{'vs base':>10}")
    for name, seconds in times.items():
        print(
            f"{name:<10}{seconds * 1e3:>10.2f}{1 / seconds:>10.2f}{seconds / times['base']:>9.3f}x"
        )
    print("  vs base = variant time / base time (1.000x = no overhead)")
    print("\nkey ratios")
    for name in ("+P", "+FGH", "+P+FGH"):
        overhead = 100 * (times[name] / times["base"] - 1)
        ratio = times[name] / times["base"]
        print(f"  {name:<7} step time = {ratio:.3f} x base ({overhead:+.1f}%)")
    skipped = {name: loop.skipped_nonfinite_steps for name, loop in loops.items()}
    if any(skipped.values()):
        print(f"  warning: non-finite steps were skipped (not comparable): {skipped}")
    print(f"total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()

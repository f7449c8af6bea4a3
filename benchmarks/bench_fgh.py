"""Cost of FineGrainedHypergradients per optimizer step, relative to torch.optim.Adam.step().

Run ``python benchmarks/bench_fgh.py --device cpu`` (or ``--device cuda``). For each parameter set
(shaped like the paper's trainable sets: CODA-Prompt, L2P, and many small tensors) and each FGH
configuration, it times in the same process, interleaved round-robin so machine load hits every
variant alike:

* ``Adam``: ``adam.step()`` alone (the baseline);
* ``Adam+FGH``: ``fgh.step(); adam.step()`` with ``foreach=True`` and with ``foreach=False`` (the
  single-tensor reference path);
* ``FGH``: ``fgh.step()`` alone.

It prints the ratios (Adam + FGH) / Adam and the foreach speed-up over the reference, then the
memory FGH keeps: state bytes / trainable-parameter bytes (exactly 2.0 for element/grad/grad,
asserted) and, on CUDA, ``torch.cuda.max_memory_allocated`` deltas.

FGH runs with ``gamma=0``: the same kernels run as for any gamma (no branch skips the alpha update),
but alpha stays 1, so the fixed synthetic gradients are not rescaled from one repeat to the next
and cannot drift to inf or denormals (which would time a different arithmetic path).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from itertools import product

import torch
from timing import add_device_arguments, interleaved_medians, setup_device  # benchmarks/timing.py
from torch import nn

from pilot_online.core.fgh import FineGrainedHypergradients

NamedParams = list[tuple[str, nn.Parameter]]
CLASSIFIER_PREFIX = "fc."  # names of the classifier layer (the class granularity's group)


# --------------------------------------------------------------------------- timing


# --------------------------------------------------------------------------- parameter sets


def _params(shapes: dict[str, tuple[int, ...]], device: torch.device, seed: int) -> NamedParams:
    """Parameters of the given shapes, each with a fixed random gradient (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    named = []
    for name, shape in shapes.items():
        param = nn.Parameter(torch.randn(shape, generator=generator).to(device))
        param.grad = (1e-3 * torch.randn(shape, generator=generator)).to(device)
        named.append((name, param))
    return named


def param_sets(args: argparse.Namespace, device: torch.device) -> dict[str, NamedParams]:
    """The trainable sets: CODA-like, L2P-like, and many small tensors."""
    dim, classes = args.dim, args.classes
    head = {"fc.weight": (classes, dim), "fc.bias": (classes,)}
    coda: dict[str, tuple[int, ...]] = {}
    for layer in range(5):
        coda[f"prompt.e_p_{layer}"] = (args.coda_pool, args.coda_length, dim)
        coda[f"prompt.e_k_{layer}"] = (args.coda_pool, dim)
        coda[f"prompt.e_a_{layer}"] = (args.coda_pool, dim)
    l2p = {
        "prompt.prompt": (args.l2p_pool, args.l2p_length, dim),
        "prompt.prompt_key": (args.l2p_pool, dim),
    }
    small = {f"small.{i}": (args.small_size,) for i in range(args.small_count)}
    every = {"coda": {**coda, **head}, "l2p": {**l2p, **head}, "small": small}
    return {name: _params(every[name], device, args.seed) for name in args.sets}


def _nbytes(named: NamedParams) -> int:
    return sum(p.numel() * p.element_size() for _, p in named)


def state_bytes(fgh: FineGrainedHypergradients) -> int:
    """Bytes of every tensor FGH keeps between steps (alpha, previous signal, m, v, u)."""
    return sum(
        value.numel() * value.element_size()
        for fields in fgh.state.values()
        for value in fields.values()
        if isinstance(value, torch.Tensor)
    )


# --------------------------------------------------------------------------- variants


def make_variant(
    named: NamedParams,
    config: tuple[str, str, str] | None,
    foreach: bool,
    adam_foreach: bool | None,
) -> tuple[torch.optim.Adam, FineGrainedHypergradients | None]:
    """A fresh Adam over all of ``named`` and, unless ``config`` is None, an FGH for it.

    granularity="class" covers the classifier only, as the online loop's FGHMixin does.
    """
    adam = torch.optim.Adam([p for _, p in named], lr=1e-3, foreach=adam_foreach)
    if config is None:
        return adam, None
    granularity, direction, apply = config
    covered = named
    if granularity == "class":
        covered = [(n, p) for n, p in named if n.startswith(CLASSIFIER_PREFIX)]
    fgh = FineGrainedHypergradients(
        covered,
        gamma=0.0,
        granularity=granularity,
        direction=direction,
        apply=apply,
        foreach=foreach,
    )
    return adam, fgh


def _combined(adam: torch.optim.Adam, fgh: FineGrainedHypergradients) -> Callable[[], None]:
    def step() -> None:
        fgh.step()
        adam.step()

    return step


def time_config(
    named: NamedParams,
    config: tuple[str, str, str],
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, float]:
    """Seconds per step: Adam alone, Adam+FGH (foreach, reference), FGH alone."""
    adam, _ = make_variant(named, None, True, args.adam_foreach)
    adam_fe, fgh_fe = make_variant(named, config, True, args.adam_foreach)
    adam_ref, fgh_ref = make_variant(named, config, False, args.adam_foreach)
    assert fgh_fe is not None and fgh_ref is not None
    fns: dict[str, Callable[[], object]] = {
        "adam": adam.step,
        "combined_fe": _combined(adam_fe, fgh_fe),
        "combined_ref": _combined(adam_ref, fgh_ref),
    }
    if config[2] == "grad":
        fns["fgh_fe"] = fgh_fe.step
        fns["fgh_ref"] = fgh_ref.step
    times = interleaved_medians(fns, device, args.repeats, args.warmup)
    if config[2] != "grad":  # FGH's work happens inside adam.step() (its hooks)
        times["fgh_fe"] = times["combined_fe"] - times["adam"]
        times["fgh_ref"] = times["combined_ref"] - times["adam"]
    return times


def memory_config(
    named: NamedParams,
    config: tuple[str, str, str],
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, float]:
    """FGH state bytes after a few steps; on CUDA also allocated-memory deltas vs Adam alone."""
    out: dict[str, float] = {}
    for label, cfg in (("adam", None), ("fgh", config)):
        adam, fgh = make_variant(named, cfg, True, args.adam_foreach)
        adam.step()  # Adam's own state exists before we measure
        step = adam.step if fgh is None else _combined(adam, fgh)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(3 if device.type == "cuda" else 2):  # state is complete after 2
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            out[f"{label}_kept"] = torch.cuda.memory_allocated(device) - base
            out[f"{label}_peak"] = torch.cuda.max_memory_allocated(device) - base
        if fgh is not None:
            out["state"] = state_bytes(fgh)
        del adam, fgh
    return out


# --------------------------------------------------------------------------- main


def _csv(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"unknown choice(s) {bad or text!r}; valid, comma-separated: {', '.join(choices)}"
            )
        return items

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(parser)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant (>= 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sets", type=_csv(("coda", "l2p", "small")), default=["coda", "l2p", "small"]
    )
    parser.add_argument(
        "--granularities",
        type=_csv(("element", "class", "global")),
        default=["element", "class", "global"],
    )
    parser.add_argument("--directions", type=_csv(("grad", "adam")), default=["grad", "adam"])
    parser.add_argument("--applies", type=_csv(("grad",)), default=["grad"])
    parser.add_argument(
        "--adam-foreach",
        choices=("default", "true", "false"),
        default="default",
        help="torch.optim.Adam's foreach flag (default: torch's choice, single-tensor on CPU)",
    )
    parser.add_argument("--dim", type=int, default=768, help="embedding width D")
    parser.add_argument("--classes", type=int, default=100, help="classifier rows C")
    parser.add_argument("--coda-pool", type=int, default=100)
    parser.add_argument("--coda-length", type=int, default=8)
    parser.add_argument("--l2p-pool", type=int, default=10)
    parser.add_argument("--l2p-length", type=int, default=5)
    parser.add_argument("--small-count", type=int, default=200)
    parser.add_argument("--small-size", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 2:
        parser.error("--repeats must be >= 1 and --warmup >= 2 (FGH's first step is special)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    args.adam_foreach = {"default": None, "true": True, "false": False}[args.adam_foreach]
    return args


def report_timing(
    named: NamedParams,
    configs: list[tuple[str, str, str]],
    args: argparse.Namespace,
    device: torch.device,
) -> list[tuple[str, float, float]]:
    """Print the timing table of one parameter set; return (config, ratio, foreach speed-up)."""
    has_classifier = any(n.startswith(CLASSIFIER_PREFIX) for n, _ in named)
    print(
        f"{'gran/dir/apply':<22}{'Adam ms':>9}{'+FGH fe':>9}{'ratio':>7}{'+FGH ref':>10}"
        f"{'ratio':>7}{'FGH fe':>9}{'FGH ref':>9}{'fe speed-up':>13}"
    )
    rows = []
    for config in configs:
        label = "/".join(config)
        if config[0] == "class" and not has_classifier:
            print(f"{label:<22}  n/a (no classifier layer in this set)")
            continue
        t = {k: v * 1e3 for k, v in time_config(named, config, args, device).items()}
        ratio_fe, ratio_ref = t["combined_fe"] / t["adam"], t["combined_ref"] / t["adam"]
        speedup = t["fgh_ref"] / t["fgh_fe"] if t["fgh_fe"] > 0 else float("nan")
        print(
            f"{label:<22}{t['adam']:>9.3f}{t['combined_fe']:>9.3f}{ratio_fe:>7.2f}"
            f"{t['combined_ref']:>10.3f}{ratio_ref:>7.2f}{t['fgh_fe']:>9.3f}"
            f"{t['fgh_ref']:>9.3f}{speedup:>12.2f}x"
        )
        rows.append((label, ratio_fe, speedup))
    print(
        "  ms per optimizer step; ratio = (Adam + FGH) / Adam; fe = foreach=True, ref = "
        "foreach=False;\n  FGH = fgh.step() alone"
    )
    return rows


def report_memory(
    named: NamedParams,
    configs: list[tuple[str, str, str]],
    args: argparse.Namespace,
    device: torch.device,
) -> float:
    """Print the memory table of one parameter set; return element/grad/grad's state ratio."""
    has_classifier = any(n.startswith(CLASSIFIER_PREFIX) for n, _ in named)
    trainable = _nbytes(named)
    cuda = device.type == "cuda"
    header = f"{'memory: gran/dir/apply':<26}{'state MiB':>10}{'state/trainable':>17}"
    if cuda:
        header += f"{'kept MiB':>10}{'peak MiB':>10}{'Adam peak':>11}"
    print(header)
    element_ratio = float("nan")
    for config in configs:
        label = "/".join(config)
        if config[0] == "class" and not has_classifier:
            continue
        mem = memory_config(named, config, args, device)
        ratio = mem["state"] / trainable
        if config == ("element", "grad", "grad"):
            assert ratio == 2.0, f"element/grad/grad must keep exactly 2 floats, got {ratio}"
            element_ratio = ratio
        row = f"{label:<26}{mem['state'] / 2**20:>10.2f}{ratio:>16.4f}x"
        if cuda:
            row += (
                f"{mem['fgh_kept'] / 2**20:>10.2f}{mem['fgh_peak'] / 2**20:>10.2f}"
                f"{mem['adam_peak'] / 2**20:>11.2f}"
            )
        print(row)
    print(
        "  state/trainable: FGH's persistent state over ALL trainable bytes (class covers fc only)"
    )
    if cuda:
        print(
            "  kept/peak: torch.cuda allocated-memory deltas over 3 steps of Adam+FGH, counted "
            "from after\n  Adam's state exists; 'Adam peak' is the same for Adam alone"
        )
    return element_ratio


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = setup_device(args)
    started = time.perf_counter()
    print(
        f"bench_fgh: device={device}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, median of {args.repeats} repeats after {args.warmup} "
        f"warm-up calls, Adam foreach={args.adam_foreach}, FGH gamma=0 (see docstring)"
    )
    configs = list(product(args.granularities, args.directions, args.applies))
    summary = []
    for set_name, named in param_sets(args, device).items():
        numel = sum(p.numel() for _, p in named)
        print(
            f"\n== {set_name}: {len(named)} tensors, {numel:,} trainable scalars "
            f"({_nbytes(named) / 2**20:.1f} MiB) =="
        )
        rows = report_timing(named, configs, args, device)
        element_ratio = report_memory(named, configs, args, device)
        summary.append((set_name, rows, element_ratio))

    print("\nkey ratios (foreach path; ranges over the configurations above)")
    for set_name, rows, element_ratio in summary:
        if not rows:
            print(f"  {set_name:<6} nothing timed (no configuration applies to this set)")
            continue
        ratios = {label: ratio for label, ratio, _ in rows}
        speedups = [speedup for _, _, speedup in rows]
        parts = [
            f"(Adam+FGH)/Adam {min(ratios.values()):.2f}-{max(ratios.values()):.2f}",
            f"foreach speed-up over reference {min(speedups):.2f}-{max(speedups):.2f}",
        ]
        if "element/grad/grad" in ratios:
            parts[0] += f" (element/grad/grad {ratios['element/grad/grad']:.2f})"
        if not math.isnan(element_ratio):
            parts.append(f"element/grad/grad state = {element_ratio:.4f} x trainable bytes")
        print(f"  {set_name:<6} " + ";  ".join(parts))
    print(f"total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()

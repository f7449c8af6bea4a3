"""What P and FGH cost on each method's real PILOT network, and what the evaluation cache saves.

Run ``python benchmarks/overhead.py`` (CPU, 32 px) or ``python benchmarks/overhead.py --device cuda
--img-size 224 --batch-size 100``. PILOT is needed (``--pilot-root``, default ``$PILOT_ROOT`` or
``../shared/LAMDA-PILOT``; only imported, never written). For each method (``--methods``) it builds
the network from ``exps/smoke_<method>.json`` (ViT-B/16, random weights) and four online loops
around it (base, + P, + FGH, + P + FGH; the paper configs' FGH, ``engine.config.PAPER_FGH``:
class-wise on the classifier, Adam directions, gamma 1, no upper bound), then, in one
process and interleaved round-robin (``benchmarks/timing.py``), times:

- **step**: ``loop.train_step`` on the same random batches; images/s is batch / step;
- **eval**: ``loop.predict`` over ``--eval-images`` test images, the way the session runs it;
- **cache**: evaluation with the query cache (filled by an earlier evaluation, i.e. the second
  evaluation on) over evaluation without it; target <= 0.60;
- **upstream**: our base step over upstream PILOT's own training step for the same network
  (``models/<method>.py`` ``_init_train``: forward with ``train=True``, logits masked to the seen
  classes, cross-entropy plus the method's term, ``zero_grad``, ``backward``, Adam ``step``,
  ``loss.item()``); n/a for MVP and ConvPrompt, which PILOT does not have. On CPU CODA's
  ``train=True`` path crashes upstream (see ``methods/coda_prompt.py``): its upstream step runs
  ``train=False`` there, without the orthogonality penalty.

The four loops share one network (each has its own optimiser, FGH and prototype state): the
frozen ViT is the same tensors for every variant, so what differs is exactly what P and FGH add.

**Memory.** ``state`` is the bytes a variant keeps between steps: parameters and buffers,
gradients, the optimiser's state, FGH's state and the prototype bank, counted tensor by tensor.
On CUDA ``peak`` adds the step's transient peak (``torch.cuda.max_memory_allocated`` during a step
minus what was allocated before it). On the CPU no allocator statistic separates one loop's step
from the rest of the process (the peak resident set size only grows, and tracemalloc does not see
torch's allocator), so the CPU ``peak`` column is the state alone. FGH's own state must be exactly
what its form keeps: class-wise with Adam directions, 3 floats per classifier scalar (the
previous direction, m and v) and one alpha per class; element-wise on raw gradients, 2 floats per
trainable scalar (alpha and the previous gradient). A line says pass or fail.

**GPU options** (``--options``, default ``sdpa,bf16``): the base loop again with ``sdpa: true``
(on a copy of the network whose attention modules use ``scaled_dot_product_attention``) and with
``amp: "bf16"``, timed in the same round-robin, as ratios to base. ``pin_memory`` only changes
PILOT's DataLoader (``PilotDataSource``), which this benchmark does not use: not timed here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from timing import add_device_arguments, interleaved_medians, setup_device  # benchmarks/timing.py

from pilot_online.engine.config import PAPER_FGH
from pilot_online.engine.config import VARIANTS as PAPER_VARIANTS

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("l2p", "dualprompt", "coda", "mvp", "convprompt")
UPSTREAM = {"l2p", "dualprompt", "coda"}
#: The paper's four ablation rows, with the FGH the paper configs run (``engine.config``).
VARIANTS = {
    "base": PAPER_VARIANTS["base"],
    "+P": PAPER_VARIANTS["p"],
    "+FGH": PAPER_VARIANTS["fgh_only"],
    "+P+FGH": PAPER_VARIANTS["fgh"],
}


def expected_fgh_bytes(loop: Any) -> tuple[int, str]:
    """FGH's state for ``PAPER_FGH``, in float32 bytes, worked from its form (and how)."""
    if (PAPER_FGH["granularity"], PAPER_FGH["direction"]) == ("class", "adam"):
        fc = loop.adapter.classifier(loop.network)
        scalars = sum(p.numel() for p in fc.parameters() if p.requires_grad)
        classes = fc.weight.shape[0]
        return 4 * (3 * scalars + classes), f"4 x (3 x {scalars} classifier scalars + {classes})"
    trainable = sum(p.numel() for _, p in loop.named_parameters)
    return 8 * trainable, f"2 x 4 x {trainable} trainable scalars"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="stream batch (paper: 100)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--eval-images", type=int, default=48)
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--options", default="sdpa,bf16", help="GPU options to time ('' none)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--pilot-root",
        default=os.environ.get("PILOT_ROOT") or str(ROOT.parent / "shared" / "LAMDA-PILOT"),
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="build the network from this config instead of the smoke config (its backbone, "
        "weights and image size; e.g. a scale-model config: exps/scale/"
        "fashion_mnist_blurry_coda_base_lr0.005.json times the shipped ViT); --methods is then "
        "the config's method",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="also write each variant's figures here (the scale report reads it)",
    )
    add_device_arguments(parser)
    args = parser.parse_args(argv)
    if args.config is not None:
        from pilot_online.engine.config import load_json

        raw = load_json(args.config)
        args.methods = raw["model_name"].removesuffix("_online")
        args.img_size = int((raw.get("backbone_kwargs") or {}).get("img_size", args.img_size))
    args.methods = [m.strip().removesuffix("_online") for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if not Path(args.pilot_root, "utils", "inc_net.py").is_file():
        parser.error(f"{args.pilot_root} is no PILOT checkout: pass --pilot-root or set PILOT_ROOT")
    return args


def build(method: str, args: argparse.Namespace, device: torch.device):
    """The method's adapter, network and resolved config (random weights, seeded, unless
    ``--config`` names pretrained ones)."""
    from pilot_online import get_method
    from pilot_online.engine.config import load_json, resolve_config
    from pilot_online.pilot.backbones import run_overrides

    if args.config is None:
        raw = load_json(ROOT / "exps" / f"smoke_{method}_online.json")
        raw.update(backbone_kwargs={"img_size": args.img_size})
    else:  # its own backbone keys (pretrained_path, vit_depth, img_size), relative to the repo
        raw = load_json(args.config)
        if raw.get("pretrained_path") and not Path(raw["pretrained_path"]).is_absolute():
            raw["pretrained_path"] = str(ROOT / raw["pretrained_path"])
    raw.update(**VARIANTS["base"])
    config = {**resolve_config(raw), "nb_classes": args.classes, "nb_tasks": 1}
    adapter = get_method(config["model_name"])(args=config)
    torch.manual_seed(0)
    with run_overrides(config):
        network = adapter.build_network(config)
    return adapter, network.to(device), config


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def fgh_state_bytes(loop) -> int:
    fgh = getattr(loop, "fgh", None)
    return 0 if fgh is None else tensor_bytes(v for s in fgh.state.values() for v in s.values())


def state_bytes(loop) -> int:
    """Bytes kept between steps: network, gradients, optimiser, FGH and prototype state."""
    tensors = [*loop.network.state_dict().values()]
    tensors += [p.grad for _, p in loop.named_parameters]
    tensors += [v for s in loop.optimizer.state.values() for v in s.values()]
    bank = getattr(loop, "prototypes", None)
    if bank is not None:
        tensors += list(bank.buffers())
    fgh = getattr(loop, "fgh", None)
    if fgh is not None:
        tensors += [v for s in fgh.state.values() for v in s.values()]
    return tensor_bytes(tensors)


def upstream_step(method: str, adapter, network, config, device) -> Callable[[Any, Any], None]:
    """Upstream PILOT's ``_init_train`` inner loop for this network (see the module docstring)."""
    if method == "coda":
        params = [*network.prompt.parameters(), *network.fc.parameters()]
    else:
        params = [p for p in network.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=config["init_lr"])
    coda_train = device.type == "cuda"

    def step(inputs, labels) -> None:
        adapter.set_mode(network, train=True)
        if method == "coda":
            if coda_train:
                logits, prompt_loss = network(inputs, train=True)
            else:
                logits, prompt_loss = network(inputs, train=False), torch.zeros(())
            loss = F.cross_entropy(logits, labels) + prompt_loss.sum()
        else:
            out = network(inputs, task_id=0, train=True)
            loss = F.cross_entropy(out["logits"], labels)
            if config["pull_constraint"] and "reduce_sim" in out:
                loss = loss - config["pull_constraint_coeff"] * out["reduce_sim"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()

    return step


def step_peak(loop, batch, device) -> int:
    """CUDA: the transient bytes of one step above what was allocated before it."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loop.train_step(*batch)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def bench_method(method: str, args: argparse.Namespace, device: torch.device) -> list[str]:
    from pilot_online.engine.eval_cache import QueryCache
    from pilot_online.engine.mixins import build_loop
    from pilot_online.engine.session import ArrayDataSource

    adapter, network, config = build(method, args, device)
    loops = {
        name: build_loop(adapter, network, {**config, **variant}, args.classes, device)
        for name, variant in VARIANTS.items()
    }
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch_size, 3, args.img_size, args.img_size)
    batches = [
        (
            torch.rand(shape, generator=generator).to(device),
            torch.randint(args.classes, (args.batch_size,), generator=generator).to(device),
        )
        for _ in range(4)
    ]
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (args.eval_images, args.img_size, args.img_size, 3), np.uint8)
    labels = np.arange(args.eval_images) % args.classes
    data = ArrayDataSource(images[:1], labels[:1], images, labels, args.eval_batch_size)
    ids = np.arange(args.eval_images)
    allowed = torch.ones(args.classes, dtype=torch.bool)

    def stepper(fn):
        position = [0]

        def step() -> None:
            fn(*batches[position[0] % len(batches)])
            position[0] += 1

        return step

    def evaluator(loop, cache: bool):
        def evaluate() -> None:
            loop.predict(data.eval_batches(ids), allowed, 5, sample_ids=ids if cache else None)

        return evaluate

    options = {}
    if "sdpa" in args.options:
        from pilot_online.pilot.attention import use_sdpa

        fused = copy.deepcopy(network)
        use_sdpa(fused)
        options["base, sdpa"] = build_loop(adapter, fused, config, args.classes, device)
    if "bf16" in args.options:
        options["base, bf16"] = build_loop(
            adapter, network, {**config, "amp": "bf16"}, args.classes, device
        )
    steps = {name: stepper(loop.train_step) for name, loop in {**loops, **options}.items()}
    if method in UPSTREAM:
        steps["upstream"] = stepper(upstream_step(method, adapter, network, config, device))
    step_s = interleaved_medians(steps, device, args.repeats, args.warmup)

    base = loops["base"]
    base.query_cache = QueryCache("auto", device)
    has_query = adapter.evaluation(network).query is not None
    evals = {name: evaluator(loop, cache=has_query) for name, loop in {**loops, **options}.items()}
    if has_query:
        evals["base, no cache"] = evaluator(base, cache=False)
        evaluator(base, cache=True)()  # the first evaluation fills the cache
    eval_s = interleaved_medians(evals, device, args.repeats, 1)

    peaks = {
        name: state_bytes(loop) + step_peak(loop, batches[0], device)
        for name, loop in loops.items()
    }
    rows = []
    mib = 2**20
    args.records[method] = {
        "variants": {
            name: {
                "step_seconds": step_s[name],
                "step_ratio": step_s[name] / step_s["base"],
                "images_per_second": args.batch_size / step_s[name],
                "eval_seconds": eval_s[name],
                "state_bytes": peaks[name],
            }
            for name in VARIANTS
        },
        "upstream_step_seconds": step_s.get("upstream"),
    }
    for name in VARIANTS:
        rows.append(
            f"{method:11} {name:10} {step_s[name] * 1e3:9.1f} {step_s[name] / step_s['base']:7.3f} "
            f"{args.batch_size / step_s[name]:8.1f} {eval_s[name] * 1e3:9.1f} "
            f"{eval_s[name] / eval_s['base']:7.3f} {peaks[name] / mib:9.1f} "
            f"{peaks[name] / peaks['base']:7.3f}"
        )
    for name in options:
        rows.append(
            f"{method:11} {name:10} {step_s[name] * 1e3:9.1f} {step_s[name] / step_s['base']:7.3f} "
            f"{args.batch_size / step_s[name]:8.1f} {eval_s[name] * 1e3:9.1f} "
            f"{eval_s[name] / eval_s['base']:7.3f}"
        )
    fgh_bytes = fgh_state_bytes(loops["+FGH"])
    expected, why = expected_fgh_bytes(base)
    rows.append(
        f"    FGH state {fgh_bytes} bytes ({why} = {expected}): "
        f"{'pass' if fgh_bytes == expected else 'FAIL'}"
    )
    if has_query:
        ratio = eval_s["base"] / eval_s["base, no cache"]
        rows.append(
            f"    eval with / without the query cache (2nd evaluation on): {ratio:.3f} "
            f"({'pass' if ratio <= 0.60 else 'FAIL'}: target <= 0.60)"
        )
    else:
        rows.append("    no frozen query pass: no evaluation cache")
    if "upstream" in step_s:
        rows.append(
            f"    our base step / upstream PILOT's step: {step_s['base'] / step_s['upstream']:.3f}"
            f" ({step_s['upstream'] * 1e3:.1f} ms upstream)"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = setup_device(args)
    sys.dont_write_bytecode = True  # PILOT's tree stays untouched
    sys.path.insert(0, str(Path(args.pilot_root).resolve()))
    warnings.filterwarnings("ignore", category=FutureWarning)

    print(
        f"device {device}, {args.img_size} px, batch {args.batch_size}, {args.classes} classes, "
        f"eval {args.eval_images} images in batches of {args.eval_batch_size}, "
        f"threads {torch.get_num_threads()}, median of {args.repeats} interleaved repeats"
    )
    memory = "peak MiB" if device.type == "cuda" else "state MiB"
    print(
        f"{'method':11} {'variant':10} {'step ms':>9} {'x base':>7} {'img/s':>8} {'eval ms':>9} "
        f"{'x base':>7} {memory:>9} {'x base':>7}"
    )
    args.records = {}
    for method in args.methods:
        for row in bench_method(method, args, device):
            print(row, flush=True)
    if args.json is not None:
        setting = {
            "device": str(device),
            "img_size": args.img_size,
            "batch_size": args.batch_size,
            "classes": args.classes,
            "threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "torch": torch.__version__,
            "config": str(args.config) if args.config else None,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"setting": setting, "methods": args.records}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

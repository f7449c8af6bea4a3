"""Feature-level proxy for the paper's ablation: which FGH did the "+ ours" rows run?

The paper states FGH twice. The main text (Eq. 8, Algorithm 1) pairs raw gradients element by
element at gamma 1; the appendix algorithm, "the algorithm that we used for our experiments",
pairs Adam-normalised directions class by class on the classifier (weight row and bias entry
together), with gamma 1e-3 in its listing and a coefficient clamp it does not state. This script
measures the two on a problem that runs in seconds: a linear head (768 -> C, with bias, Adam, no
scheduler) trained online on Gaussian class clusters in 768-d (a stand-in for frozen ViT
features), streamed once through our real clear and Si-Blurry streams (``core.streams``), with the
batch-wise logit mask, the prototype loss (``core.prototypes.PrototypeBank``, Eq. 1-2) and
``core.fgh.FineGrainedHypergradients`` -- the components the online loop composes.

For each stream, LR (5e-3 and 5e-5, the paper's columns) and seed it runs the four ablation rows
(base, + P, + FGH, + P + FGH) for both forms (and the appendix form at the main text's gamma 1),
and prints AP and A_T (mean ± std over seeds) and how alpha sat against the clamp: its mean over
the stream's steps, and the fractions of coefficients at the clamp's lower and upper bounds,
averaged over the stream's steps (``core/fgh_stats.AlphaStream.bounds``). ``--gamma-sweep``
adds Fig. 3's sweep (+ P + FGH against gamma, Si-Blurry, LR 5e-5) for both forms.

    python benchmarks/fgh_proxy.py                       # the table: 5 seeds, about a minute
    python benchmarks/fgh_proxy.py --gamma-sweep --out runs/fgh_proxy   # + Fig. 3 results files
    pilot-online figures runs/fgh_proxy --which gamma --out runs/fgh_proxy/figures

``--out`` writes one results file per run in the results schema (``core.results``; model name
``fgh_proxy``), so ``pilot-online tables`` and ``pilot-online figures`` read them like PILOT runs.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pilot_online.core import metrics
from pilot_online.core.fgh import FineGrainedHypergradients
from pilot_online.core.fgh_stats import AlphaStream
from pilot_online.core.masks import mask_logits, training_mask
from pilot_online.core.prototypes import PrototypeBank
from pilot_online.core.results import build_results, write_results
from pilot_online.core.streams import Stream, clear_stream, si_blurry_stream
from pilot_online.engine.config import FGH_FORMS

#: The readings of the paper's FGH, as the configs write them (``engine.config.FGH_FORMS``): the
#: main text's Eq. 8, and the appendix algorithm with only alpha >= 0 ("nobound") or with our
#: former upper bound 10 ("clamp10"). Fig. 3's sweep runs each over gamma.
FORMS: dict[str, dict[str, Any]] = {
    "eq8": FGH_FORMS["eq8"],
    "clamp10": FGH_FORMS["appendix_clamp10"],
    "nobound": FGH_FORMS["appendix"],
}
#: The table's FGH rows (name: form_gamma): Eq. 8 at its gamma; the appendix algorithm with the
#: clamp [0, 10] at its listing's gamma 1e-3 and at the text's 1; and without an upper bound at
#: 1e-3, 0.1 (hp_grid's CODA value) and 1 (the text's default, hp_grid's other methods).
TABLE_FORMS: dict[str, dict[str, Any]] = {
    "eq8": FORMS["eq8"],
    "clamp10_g0.001": {**FORMS["clamp10"], "gamma": 1e-3},
    "clamp10_g1": {**FORMS["clamp10"], "gamma": 1.0},
    "nobound_g0.001": {**FORMS["nobound"], "gamma": 1e-3},
    "nobound_g0.1": {**FORMS["nobound"], "gamma": 0.1},
    "nobound_g1": {**FORMS["nobound"], "gamma": 1.0},
}
#: The paper's ablation rows: (prototypes, FGH).
ROWS = {
    "base": (False, False),
    "+ P": (True, False),
    "+ FGH": (False, True),
    "+ P + FGH": (True, True),
}
LRS = (5e-3, 5e-5)
STREAMS = ("clear", "si_blurry")
GAMMAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # the paper's Fig. 3 axis


@dataclass
class Data:
    """Gaussian class clusters: train/test features and labels."""

    train_x: torch.Tensor
    train_y: np.ndarray
    test_x: torch.Tensor
    test_y: np.ndarray


def make_data(args: argparse.Namespace, seed: int) -> Data:
    """Class means ``mean_scale * N(0, I)`` around a shared offset (ViT features share a large
    common component), samples ``mean + noise * N(0, I)``; the same seed gives the same data."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    dim, classes = args.dim, args.classes
    offset = args.offset * torch.randn(dim, generator=gen)
    means = offset + args.mean_scale * torch.randn(classes, dim, generator=gen)

    def draw(per_class: int) -> tuple[torch.Tensor, np.ndarray]:
        labels = torch.arange(classes).repeat_interleave(per_class)
        x = means[labels] + args.noise * torch.randn(labels.numel(), dim, generator=gen)
        return x, labels.numpy()

    train_x, train_y = draw(args.train_per_class)
    test_x, test_y = draw(args.test_per_class)
    return Data(train_x, train_y, test_x, test_y)


def make_stream(kind: str, labels: np.ndarray, args: argparse.Namespace, seed: int) -> Stream:
    """The run's stream: PILOT's clear split or Si-Blurry (N 50, M 10), ``args.tasks`` tasks."""
    if kind == "clear":
        step = args.classes // args.tasks
        return clear_stream(labels, init_cls=step, increment=step, batch_size=args.batch, seed=seed)
    return si_blurry_stream(
        labels, num_tasks=args.tasks, n=50, m=10, seed=seed, batch_size=args.batch
    )


def run_one(
    data: Data,
    stream: Stream,
    *,
    lr: float,
    prototypes: bool,
    fgh_options: dict[str, Any] | None,
    seed: int,
) -> dict[str, Any]:
    """One online pass; returns the accuracy matrix's metrics, alpha's clamp statistics, seconds."""
    torch.manual_seed(seed)
    classes, dim = int(data.train_y.max()) + 1, data.train_x.shape[1]
    head = nn.Linear(dim, classes)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    bank = PrototypeBank(classes, dim) if prototypes else None
    fgh = (
        FineGrainedHypergradients(head.named_parameters(), **fgh_options)
        if fgh_options is not None
        else None
    )
    alpha_stream = AlphaStream(fgh) if fgh is not None else None
    exposure = stream.exposure_task()
    exposure = np.concatenate([exposure, np.full(classes - exposure.size, -1)])
    labels_all = torch.from_numpy(data.train_y)
    seen = torch.zeros(classes, dtype=torch.bool)
    columns = []
    start = time.perf_counter()
    for batch in stream:
        index = torch.from_numpy(batch.indices.copy())  # the stream's arrays are read-only
        x, y = data.train_x[index], labels_all[index]
        seen[y] = True
        mask = training_mask("batch", y, seen, classes, validate=False)
        loss = F.cross_entropy(mask_logits(head(x), mask), y)
        if bank is not None:
            loss = loss + bank.loss(head)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if fgh is not None:
            fgh.step()
            alpha_stream.observe()
        opt.step()
        if bank is not None:
            bank.update(x, y, validate=False)
        if batch.last_in_task:
            allowed = torch.from_numpy((exposure >= 0) & (exposure <= batch.task))
            keep = allowed[torch.from_numpy(data.test_y)].numpy()
            with torch.no_grad():
                logits = mask_logits(head(data.test_x[keep]), allowed)
            columns.append(
                metrics.task_accuracies(
                    data.test_y[keep], logits.argmax(1).numpy(), exposure, stream.num_tasks
                )
            )
    while len(columns) < stream.num_tasks:  # a task whose last batch never came (empty task)
        columns.append(columns[-1] if columns else np.full(stream.num_tasks, np.nan))
    seconds = time.perf_counter() - start
    summary = metrics.summarize(metrics.accuracy_matrix(columns, stream.num_tasks))
    bounds = None
    if fgh is not None:
        (group,) = alpha_stream.bounds()
        bounds = {
            "clamp": group["clamp"],
            "coefficients": group["coefficients"],
            "final": {k: float(v) for k, v in group["final"].items()},
            "stream": {k: v if k == "steps" else float(v) for k, v in group["stream"].items()},
        }
    return {"metrics": summary, "alpha_bounds": bounds, "seconds": seconds, "steps": len(columns)}


def results_file(
    out: Path, run: dict[str, Any], stream: Stream, config: dict[str, Any], name: str
) -> None:
    """Write the run as a results file of our schema, so ``pilot-online figures`` draws it."""
    extra = {"diagnostics": {}}
    if run["alpha_bounds"] is not None:
        extra["diagnostics"]["fgh"] = {"alpha_bounds": [run["alpha_bounds"]]}
    results = build_results(
        config=config,
        stream=stream.to_dict(),
        metrics=run["metrics"],
        timing={
            "train_seconds": run["seconds"],
            "eval_seconds": 0.0,
            "samples_per_second": len(stream) / max(run["seconds"], 1e-9),
            "peak_memory_bytes": None,
        },
        counters={
            "optimizer_steps": stream.num_batches(),
            "samples_seen": len(stream),
            "skipped_nonfinite_steps": 0,
            "skipped_nonfinite_hypergradients": 0,
        },
        extra=extra,
    )
    write_results(out / f"{name}.results.json", results, overwrite=True)


def proxy_config(
    args: argparse.Namespace, kind: str, lr: float, prototypes: bool, fgh: dict | None, seed: int
) -> dict[str, Any]:
    """The run's config in PILOT's flat keys (what the results readers group by)."""
    return {
        "model_name": "fgh_proxy",
        "dataset": f"gauss{args.classes}x{args.dim}",
        "stream": kind,
        "init_lr": lr,
        "optimizer": "adam",
        "batch_size": args.batch,
        "seed": seed,
        "online_prototypes": prototypes,
        "fgh": fgh,
        "logit_mask": "batch",
    }


def _cell(values: list[float]) -> str:
    arr = np.array(values, dtype=float)
    return f"{arr.mean():6.2f} ± {arr.std():5.2f}"


def _alpha_cells(stream_stats: list[dict[str, Any]]) -> str:
    """Mean alpha and fractions at the bounds (stream averages, mean over seeds), and the largest
    alpha any seed's run reached."""
    means = [f"{np.mean([a[key] for a in stream_stats]):.3f}" for key in ("mean", "at_lo", "at_hi")]
    return " | ".join([*means, f"{max(a['max'] for a in stream_stats):.4g}"])


def table(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ablation table for both forms; returns one record per (stream, lr, row, form)."""
    records = []
    for kind in STREAMS:
        for lr in LRS:
            per: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for seed in range(args.seeds):
                data = make_data(args, seed)
                stream = make_stream(kind, data.train_y, args, seed)
                for row, (proto, with_fgh) in ROWS.items():
                    forms = list(TABLE_FORMS) if with_fgh else ["-"]
                    for form in forms:
                        options = TABLE_FORMS[form] if with_fgh else None
                        run = run_one(
                            data, stream, lr=lr, prototypes=proto, fgh_options=options, seed=seed
                        )
                        per.setdefault((row, form), []).append(run)
                        if args.out:
                            config = proxy_config(args, kind, lr, proto, options, seed)
                            tag = row.replace(" ", "").replace("+", "_") or "base"
                            name = f"{kind}_lr{lr:g}_{tag}_{form.replace('-', 'x')}_{seed}"
                            results_file(args.out / "table", run, stream, config, name)
            print(f"\n## {kind}, LR {lr:g} ({args.seeds} seeds)")
            print("| row | FGH form | AP | A_T | mean alpha | at lo | at hi | max alpha | s/run |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            for (row, form), runs in per.items():
                aps = [r["metrics"]["AP"] for r in runs]
                ats = [r["metrics"]["A_T"] for r in runs]
                secs = np.mean([r["seconds"] for r in runs])
                alpha = [r["alpha_bounds"]["stream"] for r in runs if r["alpha_bounds"]]
                stats = _alpha_cells(alpha) if alpha else "- | - | - | -"
                print(f"| {row} | {form} | {_cell(aps)} | {_cell(ats)} | {stats} | {secs:.2f} |")
                records.append(
                    {
                        "stream": kind,
                        "lr": lr,
                        "row": row,
                        "form": form,
                        "AP": aps,
                        "A_T": ats,
                        "alpha_stream": alpha,
                        "alpha_final": [
                            r["alpha_bounds"]["final"] for r in runs if r["alpha_bounds"]
                        ],
                        "seconds": secs,
                    }
                )
    return records


def gamma_sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Fig. 3 on the proxy: + P + FGH against gamma, every form of :data:`FORMS`, Si-Blurry,
    LR 5e-5 (the paper's Fig. 3 setting), ``args.sweep_seeds`` seeds, plus the + P row
    (gamma = 0) as the level. Returns one record per (form, gamma), ``"sweep": true``."""
    kind, lr = "si_blurry", 5e-5
    print(f"\n## gamma sweep: {kind}, LR {lr:g}, + P + FGH ({args.sweep_seeds} seeds)")
    print("| form | gamma | AP | mean alpha | at lo | at hi | max alpha |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    out = args.out / "gamma" if args.out else None
    seeds = {}  # seed -> (data, stream), made once
    for seed in range(args.sweep_seeds):
        data = make_data(args, seed)
        seeds[seed] = data, make_stream(kind, data.train_y, args, seed)
    records: list[dict[str, Any]] = []
    level = []  # the + P level (gamma = 0), printed and drawn
    for seed, (data, stream) in seeds.items():
        run = run_one(data, stream, lr=lr, prototypes=True, fgh_options=None, seed=seed)
        level.append(run["metrics"]["AP"])
        if out:
            config = proxy_config(args, kind, lr, True, None, seed)
            results_file(out, run, stream, config, f"p_{seed}")
    print(f"| + P | 0 | {_cell(level)} | - | - | - | - |")
    for form, options in FORMS.items():
        for gamma in GAMMAS:
            fgh = {**options, "gamma": gamma}
            runs = []
            for seed, (data, stream) in seeds.items():
                run = run_one(data, stream, lr=lr, prototypes=True, fgh_options=fgh, seed=seed)
                runs.append(run)
                if out:
                    config = proxy_config(args, kind, lr, True, fgh, seed)
                    results_file(out, run, stream, config, f"{form}_g{gamma:g}_{seed}")
            stats = _alpha_cells([r["alpha_bounds"]["stream"] for r in runs])
            aps = [r["metrics"]["AP"] for r in runs]
            print(f"| {form} | {gamma:g} | {_cell(aps)} | {stats} |")
            records.append(
                {"sweep": True, "stream": kind, "lr": lr, "row": "+ P + FGH", "form": form,
                 "gamma": gamma, "AP": aps}
            )  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per table cell")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--train-per-class", type=int, default=250)
    parser.add_argument("--test-per-class", type=int, default=20)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--mean-scale", type=float, default=0.35, help="class-mean spread")
    parser.add_argument("--offset", type=float, default=1.0, help="shared feature offset")
    parser.add_argument("--noise", type=float, default=1.0, help="within-class noise")
    parser.add_argument("--gamma-sweep", action="store_true", help="also run Fig. 3's sweep")
    parser.add_argument("--sweep-seeds", type=int, default=5)
    parser.add_argument("--no-table", action="store_true", help="skip the ablation table")
    parser.add_argument("--out", type=Path, default=None, help="write results files here")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the table's (and the sweep's) records"
    )
    args = parser.parse_args()
    for name in ("seeds", "classes", "tasks", "dim", "train_per_class", "test_per_class", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.classes % args.tasks:
        parser.error("--classes must be a multiple of --tasks (the clear split's increment)")
    torch.set_num_threads(1)
    start = time.perf_counter()
    records = [] if args.no_table else table(args)
    if args.gamma_sweep:
        records += gamma_sweep(args)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

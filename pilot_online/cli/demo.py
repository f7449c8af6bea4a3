"""Core-only demo: Split Fashion-MNIST streamed through the shipped scale-model ViT, base vs
+ P + FGH.

It uses the same loop, session, metrics and results file as the PILOT learners, with a plain timm
model instead of a PILOT network, so it runs without PILOT (``pilot-online demo``). The ViT is
the one ``make quickstart`` uses (``pilot_online/data/backbones/scale_vit.safetensors``, pretrained
here, 5 blocks, 32 px); it stays frozen except its final norm and head, which train online.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from ..core.datasets import first_of_each_class, load_scale_dataset
from ..core.progress import plural, progress_line
from ..core.streams import clear_stream
from ..engine.adapter import MethodAdapter, StepOutput
from ..engine.config import ONLINE_KEYS, VARIANTS
from ..engine.mixins import build_loop
from ..engine.session import ArrayDataSource, OnlineSession
from ..harness.report import variant_label

logger = logging.getLogger(__name__)

#: Split Fashion-MNIST: 5 tasks of 2 classes, as the quickstart's.
DEMO_DATASET = "fashion_mnist_quick"
TASK_CLASSES = 2


class ScaleViTAdapter(MethodAdapter):
    """The shipped scale-model ViT (timm) whose final norm and head train (not PILOT)."""

    base_model_name: ClassVar[str] = "timm_vit"

    def build_network(self, args: dict) -> nn.Module:
        from ..core import scale_backbone as backbone
        from ..harness.scale.pretrain import Recipe, build_vit
        from ..pilot.backbones import load_vit_state_dict, read_state_dict

        record = backbone.verify()
        network = build_vit(Recipe(**record["recipe"]), num_classes=args["nb_classes"])
        load_vit_state_dict(network, read_state_dict(backbone.WEIGHTS), str(backbone.WEIGHTS))
        network.requires_grad_(False)
        for module in (network.norm, network.head):
            module.requires_grad_(True)
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        x = (x - 0.5) / 0.25  # the normalisation the backbone was pretrained with
        features = network.forward_head(network.forward_features(x), pre_logits=True)
        return StepOutput(network.head(features), features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.head


def demo_data(train_per_class: int) -> dict[str, np.ndarray]:
    """The quickstart's Split Fashion-MNIST, its stream cut to ``train_per_class`` a class."""
    arrays = load_scale_dataset(DEMO_DATASET, 32)
    keep = first_of_each_class(arrays["train_y"], train_per_class)
    return {**arrays, "train_x": arrays["train_x"][keep], "train_y": arrays["train_y"][keep]}


#: Results-file name -> the paper's ablation row (``config.VARIANTS``) it runs.
DEMO_VARIANTS = {"base": "base", "p_fgh": "fgh"}


#: What the demo's two numbers mean, printed before it runs (paper Sec. 4.1).
DEFINITIONS = (
    "a[l][k]: accuracy (%) on task k's classes after training through task l (rows: after task "
    "l, columns: task k, as the accuracy_matrix figure draws it).\n"
    "AP (average performance, the paper's metric): the mean over task ends l of A_l, where A_l "
    "is the mean of a[l][k] over the tasks k seen so far.\n"
    "A_T: A_l after the last task (final average accuracy)."
)


def run_demo(
    train_per_class: int = 500, seed: int = 0, output: Path = Path("runs/demo")
) -> dict[str, dict]:
    """Run both variants on the same stream and print their accuracy matrices, AP and A_T, with
    a progress line (and the whole demo's ETA) after each task."""
    torch.manual_seed(seed)
    arrays = demo_data(train_per_class)
    stream = clear_stream(
        arrays["train_y"],
        init_cls=TASK_CLASSES,
        increment=TASK_CLASSES,
        batch_size=100,
        seed=seed,
    )
    data = ArrayDataSource(arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"])
    num_classes = int(arrays["train_y"].max()) + 1
    output.mkdir(parents=True, exist_ok=True)
    print(DEFINITIONS, flush=True)
    summaries = {}
    total_tasks, done_tasks, demo_start = (
        len(DEMO_VARIANTS) * stream.num_tasks,
        0,
        time.perf_counter(),
    )
    for name, row in DEMO_VARIANTS.items():
        torch.manual_seed(seed)
        variant = copy.deepcopy(VARIANTS[row])
        label = variant_label(variant)
        config = {key: spec.default for key, spec in ONLINE_KEYS.items()}
        config.update(
            variant,
            init_lr=5e-3,
            optimizer="adam",
            weight_decay=0.0,
            model_name="demo_timm_vit",
            dataset=DEMO_DATASET,
            seed=seed,
            nb_classes=num_classes,
            batch_size=100,
        )
        adapter = ScaleViTAdapter(args=config)
        loop = build_loop(adapter, adapter.build_network(config), config, num_classes, "cpu")
        path = output / f"demo_{name}_{seed}.results.json"
        path.unlink(missing_ok=True)  # the demo overwrites its own previous output
        session = OnlineSession(loop, stream, data, config, path, progress=False)
        start = time.perf_counter()
        print(f"\n{label}: training on {plural(stream.num_tasks, 'task')}...", flush=True)
        for task in range(stream.num_tasks):
            session.train_task(task)
            session.complete_task(task)
            done_tasks += 1
            elapsed = time.perf_counter() - demo_start
            print(
                f"  {progress_line(label, task + 1, stream.num_tasks, time.perf_counter() - start)}"
                f" | {progress_line('demo', done_tasks, total_tasks, elapsed)}",
                flush=True,
            )
        results = session.finish()
        summaries[label] = results
        matrix = np.array(results["metrics"]["accuracy_matrix"], dtype=float).T  # [after][task]
        print(f"{label}: accuracy matrix a[l][k] (rows: after task l, columns: task k)")
        print("  after \\ task " + " ".join(f"{k:>6}" for k in range(1, len(matrix) + 1)))
        for after, values in enumerate(matrix, start=1):
            cells = " ".join("    --" if np.isnan(v) else f"{v:6.1f}" for v in values)
            print(f"  {after:>12} {cells}")
        print(
            f"{label}: AP {results['metrics']['AP']:.2f}  A_T {results['metrics']['A_T']:.2f}  "
            f"({time.perf_counter() - start:.0f} s, results {path})"
        )
    print("\nvariant      AP      A_T   (AP: the paper's metric; A_T: after the last task)")
    for label, results in summaries.items():
        print(f"{label:<10} {results['metrics']['AP']:6.2f}  {results['metrics']['A_T']:6.2f}")
    return summaries

"""Core-only demo: the synthetic dataset streamed through a small timm ViT, base vs + P + FGH.

It uses the same loop, session, metrics and results file as the PILOT learners, with a plain timm
model instead of a PILOT network, so it runs without PILOT (``pilot-online demo``). The ViT has
random weights (nothing is downloaded) and stays frozen except its final norm and head, which train
online: a stand-in for a frozen pretrained backbone with a trainable classifier.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ..core.datasets import make_synthetic
from ..core.streams import clear_stream
from ..engine.adapter import MethodAdapter, StepOutput
from ..engine.config import ONLINE_KEYS, VARIANTS
from ..engine.loop import build_loop
from ..engine.session import ArrayDataSource, OnlineSession
from .report import variant_label

logger = logging.getLogger(__name__)


class TimmViTAdapter(MethodAdapter):
    """A 6-block ViT-Tiny (timm) at 32 px whose final norm and head train (not PILOT)."""

    base_model_name: ClassVar[str] = "timm_vit"

    def build_network(self, args: dict) -> nn.Module:
        from timm.models.vision_transformer import VisionTransformer

        network = VisionTransformer(
            img_size=32,
            patch_size=4,
            embed_dim=192,
            depth=6,
            num_heads=3,
            num_classes=args["nb_classes"],
        )
        network.requires_grad_(False)
        for module in (network.norm, network.head):
            module.requires_grad_(True)
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        x = (x - 0.5) / 0.25  # roughly standardised pixels: random patch embeddings need spread
        features = network.forward_head(network.forward_features(x), pre_logits=True)
        return StepOutput(network.head(features), features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.head


#: Results-file name -> the paper's ablation row (``config.VARIANTS``) it runs.
DEMO_VARIANTS = {"base": "base", "p_fgh": "fgh"}


def run_demo(
    train_per_class: int = 100, seed: int = 0, output: Path = Path("runs/demo")
) -> dict[str, dict]:
    """Run both variants on the same stream and print their accuracy matrices, AP and A_T."""
    torch.manual_seed(seed)
    arrays = make_synthetic(seed=seed, num_classes=50, train_per_class=train_per_class)
    stream = clear_stream(arrays["train_y"], init_cls=10, increment=10, batch_size=100, seed=seed)
    data = ArrayDataSource(arrays["train_x"], arrays["train_y"], arrays["test_x"], arrays["test_y"])
    num_classes = int(arrays["train_y"].max()) + 1
    output.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for name, row in DEMO_VARIANTS.items():
        torch.manual_seed(seed)
        variant = copy.deepcopy(VARIANTS[row])
        label = variant_label(variant)
        config = {key: spec.default for key, spec in ONLINE_KEYS.items()}
        config.update(
            variant,
            init_lr=1e-2,
            optimizer="adam",
            weight_decay=0.0,
            model_name="demo_timm_vit",
            dataset="synthetic",
            seed=seed,
            nb_classes=num_classes,
            batch_size=100,
        )
        adapter = TimmViTAdapter(args=config)
        loop = build_loop(adapter, adapter.build_network(config), config, num_classes, "cpu")
        path = output / f"demo_{name}_{seed}.results.json"
        path.unlink(missing_ok=True)  # the demo overwrites its own previous output
        session = OnlineSession(loop, stream, data, config, path, progress=False)
        start = time.perf_counter()
        results = session.run()
        summaries[label] = results
        matrix = results["metrics"]["accuracy_matrix"]
        print(f"\n{label}: accuracy matrix a[l][k] (rows: task l, columns: after task k)")
        for row in matrix:
            print("  " + " ".join("   -- " if v is None else f"{v:6.1f}" for v in row))
        print(
            f"{label}: AP {results['metrics']['AP']:.2f}  A_T {results['metrics']['A_T']:.2f}  "
            f"({time.perf_counter() - start:.0f} s, results {path})"
        )
    print("\nvariant      AP      A_T")
    for label, results in summaries.items():
        print(f"{label:<10} {results['metrics']['AP']:6.2f}  {results['metrics']['A_T']:6.2f}")
    return summaries

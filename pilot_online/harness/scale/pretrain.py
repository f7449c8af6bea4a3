"""Pretrain the scale model's backbone here, from images the project makes or may use.

The paper's methods need a pretrained ViT, and ViT-B/16 weights cannot be downloaded on the
machines this project is built on. This module trains a ViT of the family PILOT builds (width
768, 12 heads, fewer blocks, small images) from scratch on two sources:

- **formula-driven images** (``core/fractals.py``, after FractalDB), of the systems
  ``0 .. pretrain_classes - 1`` (the ``fractal`` benchmark's classes lie far outside): as
  unlabelled images under the same self-supervised target as Fashion-MNIST's (the shipped
  recipe), or supervised over their systems (FractalDB's way; measured: it pulled the features
  away from what a Fashion-MNIST probe needs, docs/scale-model.md);
- optionally, **unlabelled Fashion-MNIST**, the first half of the training split only (the
  benchmark streams the second half), self-supervised: by predicting each random crop's
  histograms of oriented gradients from its class token (HOG targets, as MaskFeat, Wei et al.,
  2022, predicts them), contrastively (SimCLR, Chen et al., 2020: two random crops and flips of
  an image are pulled together, other images pushed away) or by rotation prediction (Gidaris et
  al., 2018). No Fashion-MNIST label is read.

It is bit-identical for a given torch version and thread count: every batch is a pure function
of ``(seed, step)``, the model is seeded, and the recipe fixes the thread count. It resumes
bit-identically from its last checkpoint (model, optimiser, step and history, written
atomically), so a run can span sittings. It stops at a quality bar, not a clock
(:meth:`Recipe.bar_met`): every ``check_every`` steps it measures the probe and nearest class
mean on held-out *validation* systems and Fashion-MNIST's unlabelled half, against the same
architecture at random initialisation and raw pixels.

``scripts/pretrain_backbone.py`` is the command; ``pilot_online/data/backbones/`` holds the
shipped result and its record (recipe, seed, hash, figures).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...core import fashion_mnist, fractals
from . import probe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the backbone's weights (recorded beside the file)."""

    depth: int = 5
    img_size: int = 32
    patch_size: int = 16
    embed_dim: int = 768
    num_heads: int = 12
    pretrain_classes: int = 1000
    #: What the formula-driven images teach: "hog" (unlabelled, the Fashion-MNIST objective's
    #: HOG target and the decoder; needs ``fashion_objective`` "hog") or "classes" (1000-way
    #: cross-entropy over their systems).
    fractal_objective: str = "hog"
    batch_size: int = 128
    #: Share of each batch that is unlabelled Fashion-MNIST (0: none), and its objective:
    #: "hog" (HOG prediction; measured: the one that beat raw pixels' probe, docs/scale-model.md),
    #: "contrastive" (two views an image; the probe stayed below raw pixels' for 800 steps) or
    #: "rotation" (the probe fell below raw pixels' as it trained).
    fashion_share: float = 0.5
    fashion_objective: str = "hog"
    #: Weight of the Fashion-MNIST objective against the classes' cross-entropy (1000-way, about
    #: 5 when the HOG loss is under 1: measured, an even weight let the classes' gradients
    #: shape the features, and the Fashion-MNIST probe lagged).
    fashion_weight: float = 1.0
    temperature: float = 0.2
    #: Weight of reconstructing each Fashion-MNIST input from its class token through a linear
    #: decoder (0: off). Why: a class token that decodes linearly into the image's pixels gives
    #: a linear probe at least what a probe on the pixels has, before any other feature it adds.
    reconstruction_weight: float = 1.0
    lr: float = 5e-4
    weight_decay: float = 0.05
    warmup_steps: int = 50
    #: The cosine schedule's length; reaching it without meeting the bar is an error.
    max_steps: int = 3000
    clip_norm: float = 1.0
    check_every: int = 100
    threads: int = 2
    seed: int = 0
    #: The bar (points): probe and NCM on validation systems over random init, and the
    #: Fashion-MNIST probe over raw pixels.
    fractal_margin: float = 10.0
    fashion_margin: float = 1.0
    #: What the checks measure: validation systems, and Fashion-MNIST images of the unlabelled
    #: half for the probe's fit and its score.
    validation_classes: int = 50
    probe_train: int = 6000
    probe_test: int = 3000

    def __post_init__(self) -> None:
        if self.fractal_objective not in ("hog", "classes"):
            raise ValueError(f"fractal_objective {self.fractal_objective!r}: 'hog' or 'classes'")
        if self.fashion_objective not in ("hog", "contrastive", "rotation"):
            raise ValueError(
                f"fashion_objective {self.fashion_objective!r}: 'hog', 'contrastive' or 'rotation'"
            )
        if self.fractal_objective == "hog" and (
            self.fashion_objective != "hog" or self.fashion_share <= 0
        ):
            raise ValueError(
                "fractal_objective 'hog' shares the Fashion-MNIST HOG head and its targets' "
                "scale: set fashion_objective 'hog' and fashion_share > 0, or fractal_objective "
                "'classes'"
            )

    def bar_met(self, check: dict[str, Any]) -> bool:
        """Whether a check's figures meet the bar."""
        fractal, random_init = check["fractal"], check["fractal_random"]
        return (
            fractal["probe"] >= random_init["probe"] + self.fractal_margin
            and fractal["ncm"] >= random_init["ncm"] + self.fractal_margin
            and check["fashion"]["probe"] > check["fashion_pixels"]["probe"] + self.fashion_margin
        )


def build_vit(recipe: Recipe, num_classes: int = 0) -> nn.Module:
    """timm's ``VisionTransformer`` of the recipe's shape (what ``vit_depth`` makes PILOT build)."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=recipe.img_size,
        patch_size=recipe.patch_size,
        embed_dim=recipe.embed_dim,
        depth=recipe.depth,
        num_heads=recipe.num_heads,
        num_classes=num_classes,
    )


class Pretrainer(nn.Module):
    """The ViT with its class head over the systems, the Fashion-MNIST objective's head (a
    projection for the contrastive loss, SimCLR's two layers, or a 4-way rotation head) and a
    linear decoder of the image from the class token."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        torch.manual_seed(recipe.seed)
        classes = recipe.pretrain_classes if recipe.fractal_objective == "classes" else 0
        self.vit = build_vit(recipe, classes)
        if recipe.fashion_objective == "rotation":
            self.fashion_head: nn.Module = nn.Linear(recipe.embed_dim, 4)
        elif recipe.fashion_objective == "hog":  # zero: the first predictions are the mean
            self.fashion_head = nn.Linear(recipe.embed_dim, hog_size(recipe.img_size))
            nn.init.zeros_(self.fashion_head.weight)
            nn.init.zeros_(self.fashion_head.bias)
        else:
            self.fashion_head = nn.Sequential(
                nn.Linear(recipe.embed_dim, 512), nn.ReLU(), nn.Linear(512, 128)
            )
        self.decoder = nn.Linear(recipe.embed_dim, recipe.img_size * recipe.img_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit.forward_features(x)[:, 0]


#: HOG's cells (pixels a side) and orientation bins (unsigned, over 180 degrees), as Dalal and
#: Triggs; each cell's histogram is divided by the L2 norm of the 2 x 2 cells it starts.
HOG_CELL, HOG_BINS = 4, 9


def hog_size(img_size: int) -> int:
    return HOG_BINS * (img_size // HOG_CELL) ** 2


def hog(x: torch.Tensor) -> torch.Tensor:
    """Histograms of oriented gradients of grey images ``[N, 1, S, S]``: ``[N, bins * cells]``.
    Why a target: a linear probe on them beats one on raw pixels on Fashion-MNIST (86.7 against
    83.4, docs/scale-model.md), so a class token that predicts them linearly carries what a
    probe needs, and on held-out images too."""
    gx = F.conv2d(F.pad(x, (1, 1, 0, 0), mode="replicate"), x.new_tensor([[[[-1.0, 0.0, 1.0]]]]))
    gy = F.conv2d(
        F.pad(x, (0, 0, 1, 1), mode="replicate"), x.new_tensor([[[[-1.0], [0.0], [1.0]]]])
    )
    magnitude = torch.sqrt(gx**2 + gy**2)
    position = torch.atan2(gy, gx) % math.pi / math.pi * HOG_BINS  # [0, bins)
    low = position.floor()
    share = position - low
    low = low.long() % HOG_BINS
    hist = torch.zeros(x.shape[0], HOG_BINS, *x.shape[2:], dtype=x.dtype)
    hist.scatter_add_(1, low, magnitude * (1 - share))
    hist.scatter_add_(1, (low + 1) % HOG_BINS, magnitude * share)
    cells = F.avg_pool2d(hist, HOG_CELL) * HOG_CELL**2  # [N, bins, S / cell, S / cell]
    blocks = F.avg_pool2d(cells.pow(2).sum(1, keepdim=True), 2, 1)
    norm = F.pad(blocks, (0, 1, 0, 1), mode="replicate").sqrt() + 1e-3
    return (cells / norm).flatten(1)


def _rng(recipe: Recipe, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([recipe.seed, *key]))


#: SimCLR's crop: a share of the image's area and an aspect ratio, then resized back.
CROP_AREA = (0.35, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)


def _crop(image: np.ndarray, rng: np.random.Generator, size: int) -> torch.Tensor:
    """A random resized crop of one ``[S, S, 3]`` uint8 image, flipped half the time, as a
    normalised ``[3, size, size]`` tensor."""
    side = image.shape[0]
    area = rng.uniform(*CROP_AREA) * side * side
    ratio = math.exp(rng.uniform(math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])))
    h = min(side, max(2, round(math.sqrt(area / ratio))))
    w = min(side, max(2, round(math.sqrt(area * ratio))))
    top, left = rng.integers(0, side - h + 1), rng.integers(0, side - w + 1)
    x = probe.to_tensor(image[None, top : top + h, left : left + w])
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)[0]
    return x.flip(-1) if rng.random() < 0.5 else x


class Sources:
    """The batches of every step, as pure functions of ``(seed, step)``."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.unlabelled: np.ndarray | None = None
        if recipe.fashion_share > 0:
            images = fashion_mnist.load()["train_x"][fashion_mnist.PRETRAIN_HALF]  # labels unread
            self.unlabelled = fashion_mnist.resize(images, recipe.img_size)
        if recipe.fashion_objective == "hog" and self.unlabelled is not None:
            # Targets centred per feature and scaled by one spread over all (per-feature spreads
            # near 0 at the borders would blow crops' values up), from the first 5,000 images.
            sample = hog(probe.to_tensor(self.unlabelled[:5000])[:, :1])
            self.hog_mean, self.hog_std = sample.mean(0), sample.std()

    def hog_targets(self, views: torch.Tensor) -> torch.Tensor:
        """The standardised HOG of each view (grey channel)."""
        return (hog(views[:, :1]) - self.hog_mean) / self.hog_std

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(systems' images, their classes, Fashion-MNIST inputs, their targets)``: the
        targets are rotations (rotation), or each view's partner in the batch (contrastive:
        views ``i`` and ``i + n`` come from one image)."""
        recipe = self.recipe
        unlabelled = 0
        if self.unlabelled is not None:
            unlabelled = round(recipe.batch_size * recipe.fashion_share)
        rng = _rng(recipe, 1, step)
        classes = rng.integers(0, recipe.pretrain_classes, size=recipe.batch_size - unlabelled)
        images = fractals.render(classes, (3, step), recipe.seed, recipe.img_size)
        x_more = torch.empty(0, 3, recipe.img_size, recipe.img_size)
        y_more = torch.empty(0, dtype=torch.long)
        if unlabelled and recipe.fashion_objective == "rotation":
            picked = self.unlabelled[rng.integers(0, len(self.unlabelled), size=unlabelled)]
            flip = rng.random(unlabelled) < 0.5
            picked = np.where(flip[:, None, None, None], picked[:, :, ::-1], picked)
            turns = rng.integers(0, 4, size=unlabelled)
            picked = np.stack([np.rot90(p, k, axes=(0, 1)) for p, k in zip(picked, turns)])
            x_more, y_more = probe.to_tensor(picked), torch.from_numpy(turns)
        elif unlabelled:
            n = unlabelled // 2
            picked = self.unlabelled[rng.integers(0, len(self.unlabelled), size=n)]
            views = [_crop(image, rng, recipe.img_size) for image in picked]
            views += [_crop(image, rng, recipe.img_size) for image in picked]
            x_more = torch.stack(views)
            y_more = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
        return probe.to_tensor(images), torch.from_numpy(classes), x_more, y_more


def contrastive_loss(z: torch.Tensor, partners: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's NT-Xent: each view's partner against every other view of the batch."""
    z = F.normalize(z, dim=1)
    similarity = z @ z.T / temperature
    similarity = similarity.masked_fill(torch.eye(len(z), dtype=torch.bool), float("-inf"))
    return F.cross_entropy(similarity, partners)


def _lr(recipe: Recipe, step: int) -> float:
    """Linear warm-up, then a cosine to zero at ``max_steps``."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.max_steps - recipe.warmup_steps)
    return recipe.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def evaluation_sets(recipe: Recipe) -> dict[str, dict]:
    """What the stopping rule measures: held-out validation systems and the unlabelled half of
    Fashion-MNIST (whose labels the probe reads, to score; pretraining never does)."""
    split = fractals.FractalSplit(
        fractals.VALIDATION_FIRST_CLASS,
        recipe.validation_classes,
        100,
        40,
        recipe.img_size,
        recipe.seed,
    )
    fractal = fractals.make_split(split)
    data = fashion_mnist.load()
    half_x = data["train_x"][fashion_mnist.PRETRAIN_HALF]
    half_y = data["train_y"][fashion_mnist.PRETRAIN_HALF]
    rng = _rng(recipe, 2)
    order = rng.permutation(len(half_y))
    train = order[: recipe.probe_train]
    test = order[recipe.probe_train : recipe.probe_train + recipe.probe_test]
    fashion = {
        "train_x": fashion_mnist.resize(half_x[train], recipe.img_size),
        "train_y": half_y[train],
        "test_x": fashion_mnist.resize(half_x[test], recipe.img_size),
        "test_y": half_y[test],
    }
    return {"fractal": fractal, "fashion": fashion}


def _quality(model: nn.Module | None, data: dict) -> dict[str, float]:
    return dataclasses.asdict(probe.quality(model, data))


def baselines(recipe: Recipe, sets: dict[str, dict]) -> dict[str, Any]:
    """The same architecture at random initialisation (the recipe's seed) and raw pixels."""
    random_vit = Pretrainer(recipe).vit
    return {
        "fractal_random": _quality(random_vit, sets["fractal"]),
        "fashion_random": _quality(random_vit, sets["fashion"]),
        "fractal_pixels": _quality(None, sets["fractal"]),
        "fashion_pixels": _quality(None, sets["fashion"]),
    }


@dataclass
class State:
    """What a checkpoint holds besides the weights."""

    step: int = 0
    seconds: float = 0.0
    checks: list[dict[str, Any]] = field(default_factory=list)
    baselines: dict[str, Any] = field(default_factory=dict)


def _save_atomically(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def pretrain(
    recipe: Recipe,
    workdir: str | Path,
    max_seconds: float | None = None,
    stop_at_step: int | None = None,
) -> State:
    """Train (or resume) in ``workdir`` until the bar is met, ``max_steps`` (an error: the
    recipe does not reach its bar), or the end of this sitting: ``max_seconds`` of it, or step
    ``stop_at_step`` (resume later, bit-identically)."""
    torch.set_num_threads(recipe.threads)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt_path = workdir / "checkpoint.pt"
    model = Pretrainer(recipe)
    decayed = {n for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n}
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decayed]},
        {"params": [p for n, p in model.named_parameters() if n not in decayed]},
    ]
    groups[0]["weight_decay"], groups[1]["weight_decay"] = recipe.weight_decay, 0.0
    optimiser = torch.optim.AdamW(groups, lr=recipe.lr)
    state = State()
    if ckpt_path.exists():
        saved = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if saved["recipe"] != dataclasses.asdict(recipe):
            raise ValueError(
                f"{ckpt_path} was written by another recipe ({saved['recipe']}); use another "
                "workdir, or delete it to start over"
            )
        model.load_state_dict(saved["model"])
        optimiser.load_state_dict(saved["optimiser"])
        state = State(**saved["state"])
        logger.info("resumed at step %d (%.0f s so far)", state.step, state.seconds)
    sources = Sources(recipe)
    sets = evaluation_sets(recipe)
    if not state.baselines:
        state.baselines = baselines(recipe, sets)
        logger.info("baselines: %s", json.dumps(state.baselines))
    started = time.monotonic()
    since = state.seconds

    def checkpoint() -> None:
        state.seconds = since + time.monotonic() - started
        _save_atomically(
            {
                "recipe": dataclasses.asdict(recipe),
                "model": model.state_dict(),
                "optimiser": optimiser.state_dict(),
                "state": dataclasses.asdict(state),
            },
            ckpt_path,
        )

    model.train()
    while True:
        if (
            state.step
            and state.step % recipe.check_every == 0
            and (not state.checks or state.checks[-1]["step"] != state.step)
        ):
            check = {
                "step": state.step,
                "fractal": _quality(model.vit, sets["fractal"]),
                "fashion": _quality(model.vit, sets["fashion"]),
                **state.baselines,
            }
            check["bar_met"] = recipe.bar_met(check)
            state.checks.append(check)
            logger.info("check at step %d: %s", state.step, json.dumps(check))
            checkpoint()
            if check["bar_met"]:
                return state
        if state.step >= recipe.max_steps:
            raise RuntimeError(
                f"the recipe did not reach its bar in {recipe.max_steps} steps: last check "
                f"{json.dumps(state.checks[-1] if state.checks else {})}"
            )
        out_of_time = max_seconds is not None and time.monotonic() - started > max_seconds
        if out_of_time or state.step == stop_at_step:
            checkpoint()
            return state
        x, y, x_more, y_more = sources.batch(state.step)
        for group in optimiser.param_groups:
            group["lr"] = _lr(recipe, state.step)
        feats = model(torch.cat([x, x_more]))
        fashion_feats = feats[len(x) :]
        if recipe.fractal_objective == "classes":
            loss = F.cross_entropy(model.vit.head(feats[: len(x)]), y)
            target_inputs, target_feats = x_more, fashion_feats
        else:  # the systems' images are unlabelled inputs too
            loss = feats.new_zeros(())
            target_inputs, target_feats = torch.cat([x, x_more]), feats
        if len(x_more):
            if recipe.fashion_objective == "rotation":
                fashion_loss = F.cross_entropy(model.fashion_head(fashion_feats), y_more)
            elif recipe.fashion_objective == "hog":
                predicted = model.fashion_head(target_feats)
                fashion_loss = F.mse_loss(predicted, sources.hog_targets(target_inputs))
            else:
                out = model.fashion_head(fashion_feats)
                fashion_loss = contrastive_loss(out, y_more, recipe.temperature)
            loss = loss + recipe.fashion_weight * fashion_loss
            if recipe.reconstruction_weight:
                pixels = target_inputs[:, 0].flatten(1)  # the grey channel (three copies)
                decoded = model.decoder(target_feats)
                loss = loss + recipe.reconstruction_weight * F.mse_loss(decoded, pixels)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
        optimiser.step()
        state.step += 1
        if state.step % 50 == 0:
            logger.info(
                "step %d loss %.4f (lr %.2e)", state.step, loss.item(), _lr(recipe, state.step - 1)
            )
        if state.step % 100 == 0:
            checkpoint()


def backbone_state(model: Pretrainer) -> dict[str, torch.Tensor]:
    """The ViT's backbone tensors in fp16, timm's key names, without the pretraining heads."""
    return {
        key: value.detach().to(torch.float16).contiguous()
        for key, value in model.vit.state_dict().items()
        if not key.startswith("head.")
    }

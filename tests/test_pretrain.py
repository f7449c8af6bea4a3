"""The scale model's pretraining: bit-identical from its seed, and across a resume.

A tiny recipe (one block of width 48) runs the real code path: fractal batches and unlabelled
Fashion-MNIST under the HOG target, the checks, the checkpoint. Run A trains 6 steps in one
sitting; run B stops at step 3, and a second call resumes it from the checkpoint on disk.
Every weight and every optimiser moment must be equal bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pilot_online.harness.scale.pretrain import Recipe, Sources, _lr, contrastive_loss, pretrain

TINY = Recipe(
    depth=1,
    embed_dim=48,
    num_heads=3,
    pretrain_classes=10,
    batch_size=16,
    warmup_steps=2,
    max_steps=6,
    check_every=3,
    threads=1,
    validation_classes=5,
    probe_train=200,
    probe_test=100,
    fractal_margin=1000.0,  # never met: the run goes to max_steps
)


def final_state(workdir) -> dict:
    return torch.load(workdir / "checkpoint.pt", map_location="cpu", weights_only=False)


def test_a_resumed_run_is_bit_identical_to_one_sitting(tmp_path):
    with pytest.raises(RuntimeError, match="did not reach its bar in 6 steps"):
        pretrain(TINY, tmp_path / "a")
    state = pretrain(TINY, tmp_path / "b", stop_at_step=3)
    assert state.step == 3 and [c["step"] for c in state.checks] == [3]
    with pytest.raises(RuntimeError, match="did not reach its bar"):
        pretrain(TINY, tmp_path / "b")
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert a["state"]["step"] == b["state"]["step"] == 6
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    moments = zip(a["optimiser"]["state"].values(), b["optimiser"]["state"].values())
    for first, second in moments:
        assert torch.equal(first["exp_avg"], second["exp_avg"])
        assert torch.equal(first["exp_avg_sq"], second["exp_avg_sq"])
    # The checks are equal too: the same weights give the same probe and NCM figures.
    assert [c["fractal"] for c in a["state"]["checks"]] == [
        c["fractal"] for c in b["state"]["checks"]
    ]


def test_another_recipe_cannot_resume_a_checkpoint(tmp_path):
    pretrain(TINY, tmp_path, stop_at_step=1)
    with pytest.raises(ValueError, match="another recipe"):
        pretrain(dataclasses.replace(TINY, lr=1e-3), tmp_path)


def test_batches_are_pure_functions_of_the_step():
    sources = Sources(TINY)
    first, again, other = sources.batch(4), Sources(TINY).batch(4), sources.batch(5)
    for x, y in zip(first, again):
        assert torch.equal(x, y)
    assert not torch.equal(first[0], other[0])
    # Half of each batch is Fashion-MNIST: two views of each of 4 images, each view's target
    # its partner.
    assert len(first[2]) == TINY.batch_size // 2
    assert first[3].tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    rotation = Sources(
        dataclasses.replace(TINY, fashion_objective="rotation", fractal_objective="classes")
    ).batch(4)
    assert len(rotation[2]) == 8 and set(rotation[3].tolist()) <= {0, 1, 2, 3}


def test_the_contrastive_loss_worked_by_hand():
    # Two views a point: partners identical, the other pair orthogonal; temperature 1.
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    loss = contrastive_loss(z, torch.tensor([2, 3, 0, 1]), temperature=1.0)
    # Each row: partner similarity 1, two others 0 (self masked): -log(e / (e + 2)).
    assert loss.item() == pytest.approx(-math.log(math.e / (math.e + 2)))


def test_the_schedule_warms_up_then_follows_a_cosine():
    recipe = Recipe()
    assert _lr(recipe, 0) == pytest.approx(recipe.lr / recipe.warmup_steps)
    assert _lr(recipe, recipe.warmup_steps - 1) == pytest.approx(recipe.lr)
    middle = (recipe.warmup_steps + recipe.max_steps) // 2
    assert _lr(recipe, middle) == pytest.approx(recipe.lr / 2)
    assert _lr(recipe, recipe.max_steps) == pytest.approx(0.0)


def test_the_bar_is_the_issue_s():
    recipe = Recipe()
    check = {
        "fractal": {"probe": 40.0, "ncm": 30.0},
        "fractal_random": {"probe": 30.0, "ncm": 20.0},
        "fashion": {"probe": 82.0, "ncm": 70.0},
        "fashion_pixels": {"probe": 80.9, "ncm": 66.0},
    }
    assert recipe.bar_met(check)
    assert not recipe.bar_met({**check, "fractal": {"probe": 39.9, "ncm": 30.0}})
    assert not recipe.bar_met({**check, "fashion": {"probe": 81.8, "ncm": 70.0}})


def test_recipes_that_cannot_run_are_refused_before_any_work():
    with pytest.raises(ValueError, match="fractal_objective 'hog' shares the Fashion-MNIST"):
        Recipe(fashion_objective="contrastive")
    with pytest.raises(ValueError, match="fashion_objective 'moco'"):
        Recipe(fashion_objective="moco", fractal_objective="classes")
    assert Recipe(fashion_objective="rotation", fractal_objective="classes").fashion_share == 0.5


def test_hog_of_edges_worked_by_hand():
    """A vertical step edge has a horizontal gradient only (orientation 0: bin 0), a horizontal
    one a vertical gradient (90 degrees: 4.5 bins, split evenly between bins 4 and 5); cells
    away from the edge are empty, and a cell's histogram is divided by its 2 x 2 block's norm."""
    from pilot_online.harness.scale.pretrain import HOG_BINS, hog

    image = torch.zeros(1, 1, 8, 8)
    image[..., 4:] = 1.0  # columns 4..7 bright: the step between columns 3 and 4
    cells = hog(image).view(HOG_BINS, 2, 2)
    # Central differences: columns 3 and 4 each see a gradient of 1 (one step over 2 pixels is
    # 1 - 0), in all 4 rows of each cell: 4 pixels of magnitude 1 per cell, all in bin 0.
    assert torch.allclose(cells[1:], torch.zeros(HOG_BINS - 1, 2, 2))
    raw = torch.full((2, 2), 4.0)
    # Every cell's block (itself and its right and lower neighbours, clamped at the border) holds
    # two cells of 4 and two of 4: norm sqrt(mean of 16s) = 4.
    assert torch.allclose(cells[0], raw / (4.0 + 1e-3))
    flat = hog(image.transpose(-1, -2)).view(HOG_BINS, 2, 2)
    assert torch.allclose(flat[4], flat[5]) and flat[4].sum() > 0
    assert torch.allclose(flat[[0, 1, 2, 3, 6, 7, 8]], torch.zeros(7, 2, 2))

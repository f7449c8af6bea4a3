"""MVP (``mvp_online``) without PILOT: each loss against values worked out by hand, the closed-form
focal-loss gradients against per-sample backward passes, and the network on a tiny timm ViT."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pilot_online.core.mvp_losses import (
    feature_scales,
    focal_weights,
    gradient_dissimilarity,
    instance_logit_scale,
    key_contrastive_loss,
    logit_gradients,
)
from pilot_online.core.networks import MVPNet
from pilot_online.engine.adapter import trained_parameters
from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import get_method, list_methods
from pilot_online.harness.report import method_label
from pilot_online.methods.mvp import MVPOnline

EXPS = Path(__file__).resolve().parent.parent / "exps"


# -- core losses, by hand -------------------------------------------------------------------------
def test_instance_logit_scale_and_masked_cross_entropy():
    # 2 sigmoid(0) = 1; 2 sigmoid(-1) = 2 / (1 + e) = 0.537883 (upstream's initial mask value);
    # 2 sigmoid(ln 3) = 2 * 3/4 = 1.5.
    scale = instance_logit_scale(torch.tensor([0.0, -1.0, math.log(3.0)]))
    assert torch.allclose(scale, torch.tensor([1.0, 2 / (1 + math.e), 1.5]))
    # Raw logits [1, 1] masked by [1, 1.5] -> [1, 1.5]; CE for class 0 = log(1 + e^0.5) = 0.974077.
    masked = torch.tensor([[1.0, 1.0]]) * instance_logit_scale(torch.tensor([[0.0, math.log(3)]]))
    loss = F.cross_entropy(masked, torch.tensor([0]))
    assert loss.item() == pytest.approx(0.9740770, abs=1e-6)


def test_key_contrastive_loss_by_hand():
    # One sample: d = 0 -> P = e^0 = 1; key distances [0, ln 2] -> N = (1 + 2) / 2 = 1.5;
    # loss = -log(1.5 / 2.5 + 1e-6) = 0.510824.
    loss = key_contrastive_loss(
        torch.tensor([0.0]), torch.tensor([[0.0, math.log(2)]]), torch.tensor([1.0])
    )
    assert loss.item() == pytest.approx(0.5108240, abs=1e-6)
    # Mass divides every distance of its sample: [0, 2 ln 3] / 2 -> N = (1 + 3) / 2 = 2, P = 1:
    # -log(2/3 + 1e-6) = 0.405464.
    loss = key_contrastive_loss(
        torch.tensor([0.0]), torch.tensor([[0.0, 2 * math.log(3)]]), torch.tensor([2.0])
    )
    assert loss.item() == pytest.approx(0.4054636, abs=1e-6)
    # Two samples, each with its own key's mass: sample 1 (mass 2) d = 0, D = [0, 2 ln 3];
    # sample 2 (mass 1) d = ln 2, D = [0, 0]. P = (1 + 2) / 2 = 1.5, N = (1 + 3 + 1 + 1) / 4 = 1.5,
    # loss = -log(1.5 / 3 + 1e-6) = 0.693145.
    loss = key_contrastive_loss(
        torch.tensor([0.0, math.log(2)]),
        torch.tensor([[0.0, 2 * math.log(3)], [0.0, 0.0]]),
        torch.tensor([2.0, 1.0]),
    )
    assert loss.item() == pytest.approx(0.6931452, abs=1e-6)
    with pytest.raises(ValueError, match="query_distance"):
        key_contrastive_loss(torch.zeros(2), torch.zeros(2, 3), torch.ones(3))


def test_key_contrastive_loss_upstream_broadcasts_masses_over_the_batch():
    # The two-sample case above with upstream's pairing: d = [0, ln 2], masses [2, 1],
    # D = [[0, 2 ln 3], [0, 0]].
    # P = mean_ij exp(d_j / m_i): m = 2: [1, sqrt 2]; m = 1: [1, 2] -> (4 + sqrt 2) / 4.
    # N = mean_ijk exp(D_ik / m_j): row 1 over m = 2: [1, 3], over m = 1: [1, 9]; row 2: four 1s
    # -> 18 / 8 = 2.25. loss = -log(2.25 / (2.25 + P) + 1e-6).
    positive = (4 + math.sqrt(2)) / 4
    expected = -math.log(2.25 / (2.25 + positive) + 1e-6)
    loss = key_contrastive_loss(
        torch.tensor([0.0, math.log(2)]),
        torch.tensor([[0.0, 2 * math.log(3)], [0.0, 0.0]]),
        torch.tensor([2.0, 1.0]),
        pairing="upstream",
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert abs(expected - 0.6931452) > 0.1  # differs from the own-key pairing's value
    # One sample: the broadcast is the identity, both pairings agree (0.405464 above).
    one = [torch.tensor([0.0]), torch.tensor([[0.0, 2 * math.log(3)]]), torch.tensor([2.0])]
    assert key_contrastive_loss(*one, pairing="upstream").item() == pytest.approx(
        0.4054636, abs=1e-6
    )
    with pytest.raises(ValueError, match="own_key"):
        key_contrastive_loss(*one, pairing="batch")


def test_mvp_upstream_options_are_the_defaults():
    keys = MVPOnline.config_keys
    assert keys["gsf_reduction"].default == "upstream"
    assert keys["gsf_reduction"].choices == ("upstream", "sample")
    assert keys["key_loss_mass"].default == "upstream"
    assert keys["key_loss_mass"].choices == ("upstream", "own_key")


def test_gradient_dissimilarity_by_hand_with_logit_scale():
    # h1 = [1, 0], h2 = [1, 1], both label 0, logits [0, 0] (p = 1/2), scales s1 = [1, 1],
    # s2 = [2, 1]. (p - y) * s: sample 1 [-1/2, 1/2], sample 2 [-1, 1/2].
    # g1 = -1/2 h1 = [-1/2, 0]; g2 = -1 h2 = [-1, -1]; G_0 = (g1 + g2) / 2 = [-3/4, -1/2] ~ [3, 2].
    # cos(g1, G_0) = 3 / sqrt(13) = 0.832050; cos(g2, G_0) = 5 / sqrt(26) = 0.980581.
    features = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    logits = torch.zeros(2, 2)
    labels = torch.tensor([0, 0])
    scale = torch.tensor([[1.0, 1.0], [2.0, 1.0]])
    got = gradient_dissimilarity(features, logits, labels, scale)
    expected = torch.tensor([1 - 3 / math.sqrt(13), 1 - 5 / math.sqrt(26)])
    assert torch.allclose(got, expected, atol=1e-6)


def test_gradient_dissimilarity_matches_per_sample_backward():
    """The closed form equals upstream's procedure: one backward per sample through a copy of the
    head, reading row y_i of the weight gradient, against the batch-mean loss's row y_i."""
    torch.manual_seed(0)
    batch, dim, classes = 6, 5, 4
    head = nn.Linear(dim, classes)
    features = torch.randn(batch, dim)
    labels = torch.tensor([0, 1, 1, 3, 0, 3])
    scale = 2 * torch.sigmoid(torch.randn(batch, classes))
    allowed = torch.tensor([True, True, False, True])  # class 2 masked with -inf, as in training
    logits = (head(features) * scale).masked_fill(~allowed, float("-inf"))

    sample_grads = []
    for i in range(batch):
        head.zero_grad()
        z = (head(features[i : i + 1]) * scale[i : i + 1]).masked_fill(~allowed, float("-inf"))
        F.cross_entropy(z, labels[i : i + 1]).backward()
        sample_grads.append(head.weight.grad[labels[i]].clone())
    head.zero_grad()
    z = (head(features) * scale).masked_fill(~allowed, float("-inf"))
    F.cross_entropy(z, labels).backward()
    batch_grads = head.weight.grad[labels]
    expected = 1 - F.cosine_similarity(torch.stack(sample_grads), batch_grads, dim=1)

    got = gradient_dissimilarity(features, logits.detach(), labels, scale)
    assert torch.allclose(got, expected, atol=1e-5)
    # (p - y) is 0 on masked classes and -1 + p_y at the label.
    delta = logit_gradients(logits.detach(), labels)
    assert torch.all(delta[:, 2] == 0) and torch.all(delta[torch.arange(batch), labels] <= 0)


def test_focal_weights_by_hand():
    # alpha 0.5, gamma 2: 0.5 + 0.5 * [0, 1, 4] = [0.5, 1.0, 2.5]; alpha 0 -> plain CE weights.
    d = torch.tensor([0.0, 1.0, 2.0])
    assert torch.equal(focal_weights(d, 0.5, 2.0), torch.tensor([0.5, 1.0, 2.5]))
    assert torch.equal(focal_weights(d, 0.0, 2.0), torch.ones(3))


def test_feature_scales_by_hand():
    # W_0 = [1, 0], W_1 = [0, 1]; h_1 = [1, 1] (label 0): 1 - 1/sqrt(2) + 0.5 = 0.792893;
    # h_2 = [0, 2] (label 1): cos 1 -> 0.5 (the margin alone).
    weights = torch.eye(2)
    got = feature_scales(weights, torch.tensor([[1.0, 1.0], [0.0, 2.0]]), torch.tensor([0, 1]), 0.5)
    assert torch.allclose(got, torch.tensor([1.5 - 1 / math.sqrt(2), 0.5]))


# -- the adapter's training loss ------------------------------------------------------------------
class HeadOnly(nn.Module):
    """What ``classification_loss`` reads of the network: ``backbone.head``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.backbone = nn.Module()
        self.backbone.head = nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            self.backbone.head.weight.copy_(weight)
            self.backbone.head.bias.copy_(bias)


def mvp_args(**overrides) -> dict:
    args = {key: spec.default for key, spec in MVPOnline.config_keys.items()}
    args.update(overrides)
    return args


def step_output(network: HeadOnly, features: torch.Tensor):
    from pilot_online.engine.adapter import StepOutput

    return StepOutput(network.backbone.head(features), features)


def test_adaptive_feature_scaling_in_the_loss_by_hand():
    # W = I, b = 0, h = [2, 0], label 1: cos(W_1, h) = 0 -> divisor 1 + 0.5 = 1.5, h / 1.5 =
    # [4/3, 0], CE = log(1 + e^(4/3)) = 1.567296. Without AFS: log(1 + e^2) = 2.126928.
    network = HeadOnly(torch.eye(2), torch.zeros(2))
    out = step_output(network, torch.tensor([[2.0, 0.0]]))
    labels = torch.tensor([1])
    afs = MVPOnline(args=mvp_args(use_gsf=False))
    assert afs.weighted_cross_entropy(network, out, labels, None).item() == pytest.approx(
        1.5672959, abs=1e-5
    )
    plain = MVPOnline(args=mvp_args(use_gsf=False, use_afs=False))
    assert plain.weighted_cross_entropy(network, out, labels, None).item() == pytest.approx(
        math.log(1 + math.e**2), abs=1e-5
    )


@pytest.mark.parametrize(
    ("reduction", "expected"), [("sample", 0.4414451), ("upstream", 0.4945584)]
)
def test_focal_loss_weights_each_sample_by_hand(reduction, expected):
    # W = 0, b = [1, 0]: logits [1, 0] for both samples, p = [0.731059, 0.268941];
    # h1 = [1, 0] label 0, h2 = [0, 1] label 1.
    # CE = [log(1 + e^-1), log(1 + e)] = [0.313262, 1.313262].
    # (p - y): sample 1 [-0.268941, 0.268941], sample 2 [0.731059, -0.731059].
    # g1 = -0.268941 h1; G_0 = ([-0.268941, 0] + [0, 0.731059]) / 2 -> cos = 0.268941 / 0.778957
    # = 0.345258; g2 = -0.731059 h2; G_1 = ([0.268941, 0] + [0, -0.731059]) / 2 -> cos = 0.938508.
    # Weights (alpha 1/2, gamma 2): 0.5 + 0.5 * [0.654742^2, 0.061492^2] = [0.714344, 0.501891].
    # sample: (0.714344 * 0.313262 + 0.501891 * 1.313262) / 2 = 0.441445;
    # upstream (its code): mean(w) * mean(CE) = 0.608117 * 0.813262 = 0.494558.
    network = HeadOnly(torch.zeros(2, 2), torch.tensor([1.0, 0.0]))
    out = step_output(network, torch.eye(2))
    adapter = MVPOnline(args=mvp_args(use_afs=False, gsf_reduction=reduction))
    loss = adapter.weighted_cross_entropy(network, out, torch.tensor([0, 1]), None)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_classification_loss_applies_the_training_mask():
    # Class 2 masked: the loss is CE over classes 0-1 only: logits [0, 0] -> log 2.
    network = HeadOnly(torch.zeros(3, 2), torch.tensor([0.0, 0.0, 5.0]))
    out = step_output(network, torch.ones(1, 2))
    adapter = MVPOnline(args=mvp_args(use_afs=False, use_gsf=False))
    mask = torch.tensor([True, True, False])
    assert adapter.weighted_cross_entropy(network, out, torch.tensor([0]), mask).item() == (
        pytest.approx(math.log(2), abs=1e-6)
    )


# -- the network, on a tiny timm ViT --------------------------------------------------------------
def tiny_mvp(num_classes: int = 6, seed: int = 0) -> MVPNet:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    vit = VisionTransformer(
        img_size=32, patch_size=16, embed_dim=16, depth=6, num_heads=2, num_classes=num_classes
    )
    return MVPNet(vit, num_classes, pool_size=4, g_positions=(0, 1), g_length=2,
                  e_positions=(2, 3, 4), e_length=3)  # fmt: skip


def test_prompts_join_their_blocks_and_leave_after_them():
    network = tiny_mvp()
    seen = []
    for block in network.backbone.blocks:
        block.register_forward_hook(lambda m, inputs, output: seen.append(inputs[0].shape[1]))
    adapter = MVPOnline(args=mvp_args())
    adapter.forward(network, torch.rand(3, 3, 32, 32), train=False)
    # 5 tokens (CLS + 4 patches). Query pass: blocks 0-4 (all but the last), no prompts.
    # Prompted pass: G (2 tokens) at blocks 0-1, E (3 tokens) at 2-4, none at 5.
    assert seen == [5] * 5 + [7, 7, 8, 8, 8, 5]


def test_trainable_parameters_and_frozen_backbone():
    network = tiny_mvp()
    trainable = {name for name, _ in trained_parameters(network)}
    assert trainable == {
        "keys", "class_masks", "g_prompts", "e_prompts", "backbone.head.weight",
        "backbone.head.bias",
    }  # fmt: skip


def test_selection_is_per_sample_and_scaled_by_key_use():
    network = tiny_mvp()
    adapter = MVPOnline(args=mvp_args())
    images = torch.rand(5, 3, 32, 32)
    query = network.query(network.embed(images))
    with torch.no_grad():
        # Key 0 almost on sample 0's query (cosine distance ~1e-4, the others ~1); mask row k
        # holds k, so a sample's logit scale 2 sigmoid(k) names the key it chose.
        network.keys[0] = query[0] + 1e-2 * query[0].norm() * torch.randn_like(query[0]) / 4
        network.class_masks.copy_(torch.arange(4.0)[:, None].expand(4, 6))
    distance = network.key_distances(query)[0]
    assert 0 < distance[0] < 1e-2 and (distance[1:] > 0.1).all()
    out = adapter.forward(network, images, train=False)
    assert out.extras["logit_scale"][0, 0].item() == pytest.approx(1.0)  # 2 sigmoid(0): key 0
    assert torch.equal(network.key_counts, torch.zeros(4))  # evaluation counts nothing
    with torch.no_grad():
        network.key_counts[0] = 1e6  # mass 1e6 + 1: key 0's scaled distance now exceeds 2
    out = adapter.forward(network, images, train=True)
    assert out.extras["logit_scale"][0, 0] > 1.4  # 2 sigmoid(k) for a key k >= 1
    assert network.key_counts.sum() == 1e6 + 5  # training counts each sample's key once


def training_graph_nodes(loss: torch.Tensor) -> set[str]:
    """The names of every backward node of ``loss``'s graph."""
    names, stack, seen = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(parent for parent, _ in node.next_functions)
    return names


@pytest.mark.parametrize("use_contrastive", [True, False])
def test_samples_that_share_a_key_sum_their_gradients_in_index_order(use_contrastive):
    """Samples that choose the same key share its prompts, mask and key row, so their gradients
    add up. Indexing (``t[chosen]``) backpropagates through ``index_put_`` with accumulate, which
    on the CPU adds repeated indices with parallel atomics once a tensor has 32768 elements:
    sums that differ from run to run in the last bits (two MVP smoke runs with one seed did).
    ``index_select`` backpropagates through ``index_add_``, which adds in index order."""
    network = tiny_mvp()
    adapter = MVPOnline(args=mvp_args(use_contrastive=use_contrastive, use_mask=True))
    images, labels = torch.rand(5, 3, 32, 32), torch.randint(0, 6, (5,))
    out = adapter.forward(network, images, train=True)
    loss = adapter.weighted_cross_entropy(network, out, labels, None) + out.aux_loss
    nodes = training_graph_nodes(loss)
    assert "IndexBackward0" not in nodes
    assert "IndexSelectBackward0" in nodes


def test_evaluation_does_not_depend_on_batching():
    network = tiny_mvp()
    config = resolve_config(load_json(EXPS / "smoke_mvp_online.json"))
    loop = build_loop(MVPOnline(args=config), network, config, num_classes=6)
    images, labels = torch.rand(40, 3, 32, 32), torch.randint(0, 6, (40,))
    for start in range(0, 40, 20):
        loop.train_step(images[start : start + 20], labels[start : start + 20])
    test_x, test_y = torch.rand(30, 3, 32, 32), torch.randint(0, 6, (30,))
    allowed = torch.ones(6, dtype=torch.bool)
    whole, _ = loop.predict([(test_x, test_y)], allowed, topk=1)
    for size in (1, 7):
        parts = [(test_x[i : i + size], test_y[i : i + size]) for i in range(0, 30, size)]
        assert (loop.predict(parts, allowed, topk=1)[0] == whole).all()
    perm = torch.randperm(30)
    permuted, _ = loop.predict([(test_x[perm], test_y[perm])], allowed, topk=1)
    assert (permuted == whole[perm.numpy()]).all()


@pytest.mark.parametrize("variant", ["base", "p", "fgh_only", "fgh"])
def test_p_and_fgh_compose_with_mvp(variant):
    from pilot_online.engine.config import VARIANTS

    network = tiny_mvp()
    before = copy.deepcopy(network.state_dict())
    config = resolve_config({**load_json(EXPS / "smoke_mvp_online.json"), **VARIANTS[variant]})
    loop = build_loop(MVPOnline(args=config), network, config, num_classes=6)
    torch.manual_seed(1)
    for _ in range(3):
        stats = loop.train_step(torch.rand(12, 3, 32, 32), torch.randint(0, 6, (12,)))
        assert torch.isfinite(stats.loss) and not stats.skipped
    after = network.state_dict()
    for name in ("keys", "class_masks", "g_prompts", "e_prompts", "backbone.head.weight"):
        assert not torch.equal(before[name], after[name]), name
    assert torch.equal(before["backbone.blocks.0.attn.qkv.weight"],
                       after["backbone.blocks.0.attn.qkv.weight"])  # fmt: skip
    report = loop.report()
    assert ("prototypes" in report) == bool(config["online_prototypes"])
    assert ("fgh" in report) == (config["fgh"] is not None)
    if config["fgh"] is not None:  # the paper's FGH: class-wise, on the classifier's rows
        assert config["fgh"]["granularity"] == "class"
        assert set(report["fgh"]["alpha"]) == {"backbone.head.weight", "backbone.head.bias"}


# -- registration, configs, report ----------------------------------------------------------------
def test_registered_with_the_paper_row_name():
    assert "mvp_online" in list_methods()
    assert get_method("mvp_online") is MVPOnline
    assert method_label("mvp_online") == "MVP"
    assert method_label("coda_online") == "CODA"
    assert method_label("unknown_online") == "unknown_online"


def test_smoke_config_matches_the_batch_invariance_contract():
    config = load_json(EXPS / "smoke_mvp_online.json")
    assert config["model_name"] == "mvp_online" and config["dataset"] == "synthetic_small"
    assert config["backbone_kwargs"] == {"img_size": 32} and config["pretrained"] is False
    assert config["device"] == [-1]
    resolve_config(config)


def test_paper_configs_run_at_the_best_lr_of_the_papers_grid():
    # hp_grid (paper appendix): MVP's best LR on VTAB is 0.005 (bold there).
    assert load_json(EXPS / "mvp_online_fgh.json")["init_lr"] == 0.005


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"gsf_alpha": 1.5}, "gsf_alpha must be a number in \\[0, 1\\]"),
        ({"afs_margin": 0}, "afs_margin must be a number > 0"),
        ({"pos_e_prompt": [2, 2]}, "pos_e_prompt lists a block twice"),
        ({"len_e_prompt": 0}, "len_e_prompt must be a positive integer"),
        ({"gsf_reduction": "mean"}, "unknown gsf_reduction 'mean'.*upstream, sample"),
        ({"key_loss_mass": "batch"}, "unknown key_loss_mass 'batch'.*upstream, own_key"),
        ({"use_mask": "yes"}, "use_mask must be true or false"),
    ],
)
def test_bad_mvp_keys_are_config_errors(override, message):
    config = {**load_json(EXPS / "smoke_mvp_online.json"), **override}
    with pytest.raises(ConfigError, match=f"mvp_online: {message}"):
        resolve_config(config)


def test_prompt_positions_beyond_the_vit_are_rejected():
    from timm.models.vision_transformer import VisionTransformer

    vit = VisionTransformer(img_size=32, patch_size=16, embed_dim=16, depth=4, num_heads=2)
    with pytest.raises(ValueError, match="pos_e_prompt=\\[2, 3, 4\\] names blocks beyond"):
        MVPNet(vit, 6, e_positions=(2, 3, 4))

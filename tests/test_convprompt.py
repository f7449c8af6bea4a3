"""ConvPrompt without PILOT: the generator math (hand-computed values), its shapes at upstream's
sizes, and the online loop training all five generators at every step (test-double ViT)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pilot_online.core.conv_prompt import (
    ConvPromptGenerator,
    cosine_weights,
    generator_prefixes,
    mix_prefixes,
)
from pilot_online.core.networks import ConvPromptNet
from pilot_online.engine.config import PAPER_FGH, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import get_method, list_methods
from pilot_online.methods.convprompt import ConvPromptOnline


def test_generator_prefixes_by_hand():
    # One layer, one head, two generators, k = 2: each prefix is a single number,
    # sum(embedding * kernel) + bias ("valid" cross-correlation of a 2x2 map with a 2x2 kernel).
    embeddings = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]], [[[0.0, 1.0], [1.0, 0.0]]]])[None]
    identity, mixed = [[1.0, 0.0], [0.0, 1.0]], [[1.0, -1.0], [0.0, 2.0]]
    kernels = torch.tensor([[[identity, mixed]], [[identity, mixed]]])[None]  # [1, 2, 1, 2, 2, 2]
    biases = torch.tensor([[[0.5, -1.0]], [[0.0, 3.0]]])[None]  # [1, 2, 1, 2]
    out = generator_prefixes(embeddings, kernels, biases)
    assert out.shape == (1, 2, 1, 2, 1, 1)
    # key: 1 + 4 + 0.5 = 5.5 and 1 - 2 + 2 * 4 - 1 = 6; value: 0 + 0 + 0 = 0 and -1 + 0 + 3 = 2
    assert out.flatten().tolist() == [5.5, 6.0, 0.0, 2.0]


def test_generator_prefixes_slide_a_valid_window():
    # A 3x4 map and a 2x2 kernel of ones: each output is the sum of a 2x2 window.
    embeddings = torch.arange(12.0).reshape(1, 1, 1, 3, 4).repeat(1, 2, 1, 1, 1)
    kernels = torch.ones(1, 2, 1, 1, 2, 2)
    out = generator_prefixes(embeddings, kernels, torch.zeros(1, 2, 1, 1))
    # windows of [[0,1,2,3],[4,5,6,7],[8,9,10,11]]: 0+1+4+5 = 10, 14, 18; 4+5+8+9 = 26, 30, 34
    assert out[0, 0, 0, 0].tolist() == [[10.0, 14.0, 18.0], [26.0, 30.0, 34.0]]


def test_generator_prefixes_keep_layers_heads_and_generators_apart():
    gen = torch.Generator().manual_seed(0)
    embeddings = torch.randn(2, 2, 3, 4, 5, generator=gen)
    kernels = torch.randn(2, 2, 3, 4, 3, 3, generator=gen)
    biases = torch.randn(2, 2, 3, 4, generator=gen)
    out = generator_prefixes(embeddings, kernels, biases)
    assert out.shape == (2, 2, 3, 4, 2, 3)
    for layer, kv, head, g in [(0, 0, 0, 0), (1, 1, 2, 3), (1, 0, 1, 2), (0, 1, 2, 1)]:
        one = F.conv2d(
            embeddings[layer, kv, head][None, None], kernels[layer, kv, head, g][None, None]
        )
        expected = one[0, 0] + biases[layer, kv, head, g]
        torch.testing.assert_close(out[layer, kv, head, g], expected)


def test_generator_prefixes_reject_mismatched_kernels():
    with pytest.raises(ValueError, match=r"expected \[n, 2, h, p, k, k\]"):
        generator_prefixes(
            torch.zeros(1, 2, 3, 4, 4), torch.zeros(1, 2, 2, 5, 3, 3), torch.zeros(1, 2, 2, 5)
        )


def test_cosine_weights_by_hand():
    keys = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    queries = torch.tensor([[3.0, 4.0], [-2.0, 0.0]])
    # |(3, 4)| = 5: cosines 3/5 and 4/5; (-2, 0) points away from key 0 and across key 1.
    torch.testing.assert_close(
        cosine_weights(keys, queries), torch.tensor([[0.6, 0.8], [-1.0, 0.0]])
    )


def test_mix_prefixes_weights_generators_per_sample_in_prefix_layout():
    # [2 (kv), 2 (heads), 2 (generators), 1 (length), 1 (head dim)]
    prefixes = torch.tensor([[[1.0, 10.0], [2.0, 20.0]], [[3.0, 30.0], [4.0, 40.0]]])[
        ..., None, None
    ]
    weights = torch.tensor([[0.5, 1.0], [-1.0, 0.0]])
    out = mix_prefixes(weights, prefixes)
    assert out.shape == (2, 2, 1, 2, 1)  # [B, kv, length, heads, head dim]
    # sample 0: 0.5 * g0 + g1; sample 1: -g0
    assert out[0, :, 0, :, 0].tolist() == [[10.5, 21.0], [31.5, 42.0]]
    assert out[1, :, 0, :, 0].tolist() == [[-1.0, -2.0], [-3.0, -4.0]]


def test_generator_at_upstream_sizes():
    torch.manual_seed(0)
    generator = ConvPromptGenerator(
        num_layers=7, num_heads=12, head_dim=64, length=20, kernel_size=17, num_generators=5,
        embed_dim=768,
    )  # fmt: skip
    # Upstream's shared embedding: (20 + 16) x (64 + 16) per layer, key/value and head.
    assert generator.embeddings.shape == (7, 2, 12, 36, 80)
    assert generator.kernels.shape == (7, 2, 12, 5, 17, 17)
    assert generator.embeddings.abs().max() <= 1
    assert generator.kernels.abs().max() <= 1 / 17 and generator.biases.abs().max() <= 1 / 17
    torch.testing.assert_close(generator.keys @ generator.keys.T, torch.eye(5))  # orthonormal
    assert generator.keys.shape == (5, 192)  # matcher 768 -> 384 -> 192
    prefixes = generator.prefixes()
    assert prefixes.shape == (7, 2, 12, 5, 20, 64)
    prefix = generator.layer_prefix(prefixes, 3, torch.randn(4, 768))
    assert prefix.shape == (4, 2, 20, 12, 64)  # PILOT's PreT_Attention prefix layout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_generators": 0}, "num_generators must be a positive integer"),
        ({"kernel_size": 2.0}, "kernel_size must be a positive integer"),
        ({"embed_dim": 6}, "divisible by 4"),
        ({"num_generators": 3, "embed_dim": 8}, "at most 2"),
    ],
)
def test_generator_rejects_bad_sizes(kwargs, message):
    sizes = dict(
        num_layers=1, num_heads=1, head_dim=2, length=1, kernel_size=1, num_generators=1,
        embed_dim=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        ConvPromptGenerator(**{**sizes, **kwargs})


# -- the adapter on a test-double ViT ------------------------------------------------------------
class PrefixAttentionBlock(nn.Module):
    """A pre-norm block whose attention takes a ``[B, 2, l, h, d]`` key/value prefix (the layout of
    PILOT's ``PreT_Attention``); MLP omitted."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor, prompt: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if prompt is not None:
            prefix = prompt.permute(1, 0, 3, 2, 4)  # [2, B, h, l, d]
            k, v = torch.cat([prefix[0], k], dim=2), torch.cat([prefix[1], v], dim=2)
        return x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)


class TinyViT(nn.Module):
    """Patch embedding of 4-pixel patches from 3 x 4 x 4 images, CLS token, three blocks."""

    def __init__(self, dim: int = 32, heads: int = 2, depth: int = 3) -> None:
        super().__init__()
        self.embed_dim = dim
        self.patch_embed = nn.Sequential(nn.Unflatten(1, (3, 4, 4)), nn.Flatten(2))  # 3 x 16
        self.patch_embed.append(nn.Linear(16, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 4, dim))
        self.pos_drop = nn.Identity()
        self.blocks = nn.ModuleList(PrefixAttentionBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.requires_grad_(False)


def tiny_convprompt(num_classes: int = 4, generators: int = 4) -> ConvPromptNet:
    prompt = ConvPromptGenerator(
        num_layers=2, num_heads=2, head_dim=16, length=3, kernel_size=3,
        num_generators=generators, embed_dim=32,
    )  # fmt: skip
    return ConvPromptNet(TinyViT(), prompt, [0, 1], num_classes)


def test_registered_with_upstream_defaults():
    assert "convprompt_online" in list_methods()
    config = resolve_config(
        {
            "model_name": "convprompt_online",
            "dataset": "synthetic",
            "backbone_type": "vit_base_patch16_224_dualprompt",
        }
    )
    assert config["num_generators"] == 5  # the paper's five generators, at all times
    assert (config["length"], config["kernel_size"]) == (20, 17)
    assert config["prompt_layers"] == list(range(7))
    assert get_method("convprompt_online") is ConvPromptOnline


def test_network_rejects_layers_outside_the_backbone():
    prompt = ConvPromptGenerator(1, 2, 16, 3, 3, 2, 32)
    with pytest.raises(ValueError, match=r"distinct block indices in \[0, 3\)"):
        ConvPromptNet(TinyViT(), prompt, [3], 4)
    with pytest.raises(ValueError, match="2 layers"):
        ConvPromptNet(TinyViT(), ConvPromptGenerator(2, 2, 16, 3, 3, 2, 32), [0], 4)


def test_each_prompted_layer_adds_the_previous_layers_prefix():
    torch.manual_seed(0)
    network = tiny_convprompt()
    inputs, prompts = [], []

    def record(module, args, kwargs):
        inputs.append(args[0])
        prompts.append(kwargs["prompt"])

    for block in network.backbone.blocks:
        block.register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        network(torch.randn(5, 48))
        prefixes = network.prompt.prefixes()
        # Each layer's own prefix is weighted by the CLS token entering that block.
        own = [network.prompt.layer_prefix(prefixes, i, inputs[i][:, 0]) for i in range(2)]
    torch.testing.assert_close(prompts[0], own[0])
    torch.testing.assert_close(prompts[1], own[1] + own[0])  # upstream adds the previous layer's
    assert prompts[2] is None  # block 2 is not prompted
    assert not torch.allclose(own[0], own[1])


@pytest.mark.parametrize("variant", ["base", "p_fgh"])
def test_loop_trains_every_generator_at_every_step(variant):
    torch.manual_seed(0)
    adapter = ConvPromptOnline(args={})
    network = tiny_convprompt(num_classes=4, generators=5)
    config = {"init_lr": 1e-2, "online_prototypes": variant == "p_fgh"}
    config["fgh"] = PAPER_FGH if variant == "p_fgh" else None
    loop = build_loop(adapter, network, config, num_classes=4)
    frozen = {n: p.clone() for n, p in network.backbone.named_parameters()}
    generator = network.prompt
    for step in range(4):
        x, y = torch.randn(6, 48), torch.tensor([0, 1, 2, 3, step % 4, 1])
        before = generator.kernels.detach().clone()
        loop.train_step(x, y)
        # Gradients reach every generator's kernels and bias and every key (no per-task slice).
        grads = generator.kernels.grad.abs().sum(dim=(0, 1, 2, 4, 5))
        assert grads.shape == (5,) and bool((grads > 0).all()), (step, grads)
        assert bool((generator.biases.grad.abs().sum(dim=(0, 1, 2)) > 0).all())
        assert bool((generator.keys.grad.abs().sum(dim=1) > 0).all())
        moved = (generator.kernels.detach() - before).abs().sum(dim=(0, 1, 2, 4, 5))
        assert bool((moved > 0).all()), (step, moved)
    assert all(torch.equal(frozen[n], p) for n, p in network.backbone.named_parameters())


def test_predictions_do_not_depend_on_batch_composition():
    torch.manual_seed(0)
    adapter = ConvPromptOnline(args={})
    network = tiny_convprompt()
    network.eval()
    x = torch.randn(23, 48)
    with torch.no_grad():
        whole = adapter.forward(network, x, train=False).logits
        order = torch.randperm(23)
        permuted = adapter.forward(network, x[order], train=False).logits
        ones = torch.cat([adapter.forward(network, x[i : i + 1], False).logits for i in range(23)])
        sevens = torch.cat([adapter.forward(network, c, False).logits for c in x.split(7)])
    torch.testing.assert_close(permuted, whole[order])
    torch.testing.assert_close(ones, whole)
    torch.testing.assert_close(sevens, whole)
    assert torch.equal(ones.argmax(1), whole.argmax(1))

"""ConvPrompt online (``convprompt_online``): convolutional prompt generators, trained task-free.

Roy et al., CVPR 2024, "Convolutional Prompting meets Language Models for Continual Learning".
Written from a reading of the official code, CVIR/convprompt at commit 73ed2055 (``prompt.py``
``EPrompt``, ``vision_transformer.py`` ``forward_features``, ``engine.py`` ``train_one_epoch`` and
``train_and_evaluate``, ``attribute_matching.py``, ``configs/*_convprompt.py``); no code is copied.
PILOT has no ConvPrompt model: the network is PILOT's DualPrompt ViT
(``backbone/vit_dualprompt.py``, whose prefix attention matches upstream's), frozen, with our
generator (``core/conv_prompt.py``) feeding key/value prefixes to the ``prompt_layers`` blocks,
and a LayerNorm + linear head.

Kept from upstream: per prompted layer, shared embeddings convolved by ``k x k`` generators per
key/value and head; per-sample generator weights = cosine(key, matcher(CLS token entering that
layer)); each layer's prefix is added to the previous prompted layer's; block LayerNorms and the
final norm stay trainable; LayerNorm before the classifier.

Removed, because each needs task identity (README, "ConvPrompt", lists them with reasons): five new
generators per task and freezing the old ones; the language-model step that sets how many
generators a task gets; re-initialising keys by Gram-Schmidt at each task; the L1 anchors of the
shared embeddings and matcher to their task-start copies; one classifier head per task with old
heads frozen and the loss restricted to the current task's classes; the optimizer reset, per-task
cosine schedule and 0.005x LR for norms after the first task. Here five generators (paper
appendix) are trained at all times. Also not kept (not task-related, the shared loop has none):
gradient-norm clipping at 1.0 (upstream's CIFAR config).
"""

from __future__ import annotations

from typing import ClassVar

from ..core.checks import boolean, integer, list_of, text, within_vit_depth
from ..core.lazy import nn, torch
from ..engine.adapter import ConfigKey, MethodAdapter, StepOutput
from ..engine.backbone_names import pilot_backbones
from ..engine.card import MethodCard
from ..engine.registry import register_method

CARD = MethodCard(
    backbone_types=pilot_backbones("dualprompt"),
    paper_name="ConvPrompt",
    upstream_model="",  # CVIR/convprompt, not a PILOT model
)


@register_method("convprompt_online", card=CARD)
class ConvPromptOnline(MethodAdapter):
    base_model_name: ClassVar[str] = "dualprompt"  # PILOT's DualPrompt ViT and data transforms
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "prompt_layers": ConfigKey(
            [0, 1, 2, 3, 4, 5, 6],
            "ViT blocks that get generated prefixes (upstream: 0-6)",
            check=list_of(
                integer(0), "a list of distinct block indices", min_length=1, distinct=True
            ),
            cross_check=within_vit_depth("prompt_layers"),
        ),
        "length": ConfigKey(
            20,
            "prefix length per prompted layer, for keys and values (upstream)",
            check=integer(1),
        ),
        "kernel_size": ConfigKey(
            17,
            "generator kernel k; shared embeddings are (length+k-1) x (head_dim+k-1)",
            check=integer(1),
        ),
        "num_generators": ConfigKey(
            5,
            "prompt generators, all trained at all times (paper: 5; upstream adds 5 per task)",
            check=integer(1),
        ),
        "freeze": ConfigKey(
            ["blocks", "patch_embed", "cls_token", "pos_embed"],
            "frozen backbone prefixes (upstream's: the final norm stays trainable)",
            check=list_of(text, "a list of parameter-name prefixes"),
        ),
        "train_block_norms": ConfigKey(
            True, "keep norm1/norm2 of frozen blocks trainable, as upstream does", check=boolean
        ),
    }

    def build_network(self, args: dict) -> nn.Module:
        import timm
        from backbone import vit_dualprompt  # PILOT: registers its ViTs with timm

        from ..core.conv_prompt import ConvPromptGenerator
        from ..core.networks import ConvPromptNet

        # Prefix attention (PreT_Attention) in every block, and no prompt module of PILOT's own.
        vit = timm.create_model(
            args["backbone_type"],
            pretrained=args["pretrained"],
            num_classes=0,
            drop_rate=args["drop"],
            drop_path_rate=args["drop_path"],
            drop_block_rate=None,
            use_e_prompt=True,
            e_prompt_layer_idx=None,
            use_prefix_tune_for_e_prompt=True,
        )
        if not isinstance(vit.blocks[0].attn, vit_dualprompt.PreT_Attention):
            raise ValueError(
                f"backbone_type {args['backbone_type']!r} did not build PILOT's prefix-attention "
                "ViT: use a backbone/vit_dualprompt.py model, e.g. vit_base_patch16_224_dualprompt"
            )
        frozen = tuple(args["freeze"])
        for name, param in vit.named_parameters():
            block_norm = ".norm1." in name or ".norm2." in name
            if name.startswith(frozen) and not (args["train_block_norms"] and block_norm):
                param.requires_grad_(False)
        heads = vit.blocks[0].attn.num_heads
        prompt = ConvPromptGenerator(
            num_layers=len(args["prompt_layers"]),
            num_heads=heads,
            head_dim=vit.embed_dim // heads,
            length=args["length"],
            kernel_size=args["kernel_size"],
            num_generators=args["num_generators"],
            embed_dim=vit.embed_dim,
        )
        return ConvPromptNet(vit, prompt, list(args["prompt_layers"]), args["nb_classes"])

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        logits, features = network(x)
        return StepOutput(logits, features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc

"""The networks and layers of the methods PILOT has no network for, apart from their methods'
files: LoRA on a ViT's q and v (Online-LoRA), and the networks of Online-LoRA, MVP and
ConvPrompt around PILOT's ViTs, with COIL's transport state.

Why apart: PILOT keeps its networks (``utils/inc_net.py``, ``backbone/``) apart from its
learners (``models/``), and defining an ``nn.Module`` subclass imports torch. A method's file
imports its network here when it builds it, so registering or listing a method, or checking a
config, needs no torch (``core/lazy.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .checks import check_int
from .lazy import F, nn, no_grad, torch
from .lora import LORA_MERGES
from .prototypes import PrototypeBank

if TYPE_CHECKING:
    from .conv_prompt import ConvPromptGenerator


class LoRAQKV(nn.Module):
    """A fused ``qkv`` projection (``nn.Linear(d, 3d)``, timm's layout) plus rank-``r`` deltas on
    its q and v thirds: ``q += B_q A_q x``, ``v += B_v A_v x`` (k untouched, as upstream).

    ``A`` starts Kaiming-uniform and ``B`` at zero (LoRA's init), so a fresh adapter leaves the
    projection unchanged. :meth:`merge_` folds the adapter in and restarts it: ``merge="exact"``
    adds ``B A`` to the frozen weight; ``merge="upstream"`` adds the factors to frozen merged
    factors (buffers ``merged_*``, zero at first), which then act as ``q += B_m A_m x`` beside
    the trainable adapter, as upstream's ``w_As``/``w_Bs`` do.
    """

    def __init__(self, qkv: nn.Linear, rank: int, merge: str = "exact") -> None:
        super().__init__()
        rank = check_int("LoRA rank", rank, 1)
        if merge not in LORA_MERGES:
            raise ValueError(f"LoRA merge must be one of {LORA_MERGES}, got {merge!r}")
        self.merge = merge
        if qkv.out_features != 3 * qkv.in_features:
            raise ValueError(
                f"LoRAQKV wraps a fused qkv projection d -> 3d; got {qkv.in_features} -> "
                f"{qkv.out_features}"
            )
        self.qkv = qkv
        self.dim = qkv.in_features
        factory = {"device": qkv.weight.device, "dtype": qkv.weight.dtype}
        self.a_q = nn.Parameter(torch.empty(rank, self.dim, **factory))
        self.b_q = nn.Parameter(torch.empty(self.dim, rank, **factory))
        self.a_v = nn.Parameter(torch.empty(rank, self.dim, **factory))
        self.b_v = nn.Parameter(torch.empty(self.dim, rank, **factory))
        if merge == "upstream":  # frozen sums of the merged factors (checkpointed as buffers)
            for name in ("merged_a_q", "merged_a_v"):
                self.register_buffer(name, torch.zeros(rank, self.dim, **factory))
            for name in ("merged_b_q", "merged_b_v"):
                self.register_buffer(name, torch.zeros(self.dim, rank, **factory))
        self.reset_adapter()

    def lora_parameters(self) -> list[nn.Parameter]:
        """The trainable factors, in a fixed order (A_q, B_q, A_v, B_v)."""
        return [self.a_q, self.b_q, self.a_v, self.b_v]

    @no_grad
    def reset_adapter(self) -> None:
        """A fresh adapter (in place, so optimiser state keyed by the parameters stays valid)."""
        for a, b in ((self.a_q, self.b_q), (self.a_v, self.b_v)):
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            nn.init.zeros_(b)

    def delta_weight(self) -> torch.Tensor:
        """``[3d, d]``: what the adapter adds to the projection weight (zero rows for k)."""
        zeros = torch.zeros(self.dim, self.dim, device=self.a_q.device, dtype=self.a_q.dtype)
        return torch.cat([self.b_q @ self.a_q, zeros, self.b_v @ self.a_v])

    @no_grad
    def merge_(self) -> None:
        """Fold the adapter in (exact: W <- W + B A; upstream: A_m += A, B_m += B) and start a
        fresh one."""
        if self.merge == "exact":
            self.qkv.weight.add_(self.delta_weight().to(self.qkv.weight.dtype))
        else:
            self.merged_a_q.add_(self.a_q)
            self.merged_b_q.add_(self.b_q)
            self.merged_a_v.add_(self.a_v)
            self.merged_b_v.add_(self.b_v)
        self.reset_adapter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.dim, dim=-1)
        if self.merge == "upstream":
            q = q + (x @ self.merged_a_q.T) @ self.merged_b_q.T
            v = v + (x @ self.merged_a_v.T) @ self.merged_b_v.T
        q = q + (x @ self.a_q.T) @ self.b_q.T
        v = v + (x @ self.a_v.T) @ self.b_v.T
        return torch.cat([q, k, v], dim=-1)


def add_lora(
    vit: nn.Module, rank: int, blocks: Sequence[int] | None = None, merge: str = "exact"
) -> list[LoRAQKV]:
    """Freeze ``vit`` and wrap ``vit.blocks[i].attn.qkv`` with :class:`LoRAQKV` for each ``i`` in
    ``blocks`` (``None``: every block, upstream's default) and the given ``merge``. Returns the
    adapters in block order."""
    if not hasattr(vit, "blocks"):
        raise TypeError(f"add_lora needs a timm-style ViT with .blocks; got {type(vit).__name__}")
    count = len(vit.blocks)
    chosen = list(range(count)) if blocks is None else sorted(set(blocks))
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
    if bad or not chosen:
        raise ValueError(
            f"LoRA blocks must be distinct block indices in [0, {count - 1}] (or null for all), "
            f"got {blocks!r}"
        )
    vit.requires_grad_(False)
    adapters = []
    for i in chosen:
        attn = vit.blocks[i].attn
        if not isinstance(getattr(attn, "qkv", None), nn.Linear):
            raise TypeError(f"block {i} has no fused nn.Linear attn.qkv to adapt")
        attn.qkv = LoRAQKV(attn.qkv, rank, merge)
        adapters.append(attn.qkv)
    return adapters


class OLoRANet(nn.Module):
    """A frozen ViT with LoRA adapters on q and v, and a linear head over its pooled features."""

    def __init__(self, backbone: nn.Module, num_classes: int, adapters: list[LoRAQKV]) -> None:
        super().__init__()
        self.backbone = backbone
        self.fc = nn.Linear(backbone.num_features, num_classes)
        self.adapters = adapters  # a plain list: the modules are registered inside backbone

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.backbone(x)
        return self.fc(features), features


class MVPNet(nn.Module):
    """PILOT's ViT (frozen but for its head) with MVP's key pool, per-key class masks and prompts.

    The prompts, keys and masks live here, registered on the network, so the optimiser, FGH and
    checkpoints see them like any other parameter.
    """

    def __init__(
        self,
        vit: nn.Module,
        num_classes: int,
        pool_size: int = 10,
        g_positions: Sequence[int] = (0, 1),
        g_length: int = 5,
        e_positions: Sequence[int] = (2, 3, 4),
        e_length: int = 20,
        use_last_layer: bool = False,
    ) -> None:
        super().__init__()
        depth = len(vit.blocks)
        for name, positions in (("pos_g_prompt", g_positions), ("pos_e_prompt", e_positions)):
            if any(p >= depth for p in positions):
                raise ValueError(
                    f"{name}={list(positions)} names blocks beyond the ViT's {depth} blocks"
                )
        self.backbone = vit
        self.backbone.requires_grad_(False)
        self.backbone.head.requires_grad_(True)
        dim = vit.embed_dim
        self.g_positions, self.e_positions = tuple(g_positions), tuple(e_positions)
        self.query_depth = depth if use_last_layer else depth - 1
        self.keys = nn.Parameter(torch.randn(pool_size, dim))
        self.class_masks = nn.Parameter(torch.full((pool_size, num_classes), -1.0))
        self.g_prompts = nn.Parameter(torch.randn(len(g_positions), g_length, dim))
        self.e_prompts = nn.Parameter(torch.randn(pool_size, len(e_positions), e_length, dim))
        self.register_buffer("key_counts", torch.zeros(pool_size))

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Patch tokens with the CLS token and position embeddings (frozen)."""
        vit = self.backbone
        x = vit.patch_embed(images)
        x = torch.cat((vit.cls_token.expand(len(x), -1, -1), x), dim=1)
        return vit.pos_drop(x + vit.pos_embed)

    @no_grad
    def query(self, tokens: torch.Tensor) -> torch.Tensor:
        """The prompt-free CLS token after ``query_depth`` blocks (no final norm, as upstream)."""
        for block in self.backbone.blocks[: self.query_depth]:
            tokens = block(tokens)
        return tokens[:, 0]

    def key_distances(self, query: torch.Tensor) -> torch.Tensor:
        """``1 - cos(q_i, k_j)``, ``[B, pool]``."""
        return 1.0 - F.cosine_similarity(query[:, None], self.keys[None], dim=-1)

    def prompted_features(self, tokens: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The normed CLS token of the prompt-tuned pass, with sample ``i`` using E-prompt
        ``chosen[i]``: prompt tokens join the sequence before their block and leave after it."""
        length = tokens.shape[1]
        # index_select, not self.e_prompts[chosen]: indexing's backward is index_put_ with
        # accumulate, which on the CPU adds duplicate indices with parallel atomics (run-to-run
        # different float sums); index_select's backward (index_add_) sums in index order.
        e_prompts = self.e_prompts.index_select(0, chosen)  # [B, E layers, len, D]
        x = tokens
        for index, block in enumerate(self.backbone.blocks):
            extra = []
            if index in self.g_positions:
                g_prompt = self.g_prompts[self.g_positions.index(index)]
                extra.append(g_prompt.expand(len(x), -1, -1))
            if index in self.e_positions:
                extra.append(e_prompts[:, self.e_positions.index(index)])
            if extra:
                x = torch.cat((x, *extra), dim=1)
            x = block(x)[:, :length]
        return self.backbone.norm(x)[:, 0]


class ConvPromptNet(nn.Module):
    """A frozen prefix-attention ViT, the prompt generator, and a LayerNorm + linear classifier.

    ``forward`` returns ``(logits, features)``; ``features`` (the normalised CLS token) feed ``fc``.
    """

    def __init__(
        self,
        backbone: nn.Module,
        prompt: ConvPromptGenerator,
        prompt_layers: list[int],
        num_classes: int,
    ) -> None:
        super().__init__()
        depth = len(backbone.blocks)
        if len(set(prompt_layers)) != len(prompt_layers) or not all(
            isinstance(i, int) and 0 <= i < depth for i in prompt_layers
        ):
            raise ValueError(
                f"prompt_layers {prompt_layers!r} must be distinct block indices in [0, {depth})"
            )
        if len(prompt_layers) != prompt.num_layers:
            raise ValueError(
                f"the generator has {prompt.num_layers} layers, prompt_layers {len(prompt_layers)}"
            )
        self.backbone = backbone
        self.prompt = prompt
        self.layer_slot = {block: slot for slot, block in enumerate(sorted(prompt_layers))}
        dim = backbone.embed_dim
        self.fc_norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.fc.weight, std=0.02)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vit = self.backbone
        x = vit.patch_embed(x)
        x = torch.cat((vit.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = vit.pos_drop(x + vit.pos_embed)
        prefixes = self.prompt.prefixes()  # input-independent: once per pass
        previous = None
        for index, block in enumerate(vit.blocks):
            slot = self.layer_slot.get(index)
            if slot is None:
                x = block(x, prompt=None)
                continue
            current = self.prompt.layer_prefix(prefixes, slot, x[:, 0])
            x = block(x, prompt=current if previous is None else current + previous)
            previous = current
        features = self.fc_norm(vit.norm(x)[:, 0])
        return self.fc(features), features


class CoTransportState(nn.Module):
    """COIL's state, as buffers of the network (the loop checkpoints and restores them).

    ``class_means``: running means of each class's L2-normalised stream features (upstream's
    ``_extract_class_means`` averages normalised vectors too; it normalises the mean when it uses
    it, as :meth:`COILOnline.after_step` does). ``seen``: the loop's ``batch.seen`` as of the last
    step, so that ``known`` (set at a firing) is the loop's ``known``. At a firing the old classes'
    means and head rows are kept (``anchor_means``, ``anchor_rows``: upstream's task-end means and
    ``fc.weight``); ``transported`` marks the classes arrived since, whose rows the transport set,
    and ``new_branch`` holds the transported rows (upstream's ``_ot_new_branch``)."""

    def __init__(self, num_classes: int, feature_dim: int) -> None:
        super().__init__()
        self.class_means = PrototypeBank(num_classes, feature_dim)
        for name in ("seen", "known", "transported"):
            self.register_buffer(name, torch.zeros(num_classes, dtype=torch.bool))
        for name in ("anchor_means", "anchor_rows", "new_branch"):
            self.register_buffer(name, torch.zeros(num_classes, feature_dim))
        self.register_buffer("calibration", torch.ones(()))  # the last transport's gamma
        self.register_buffer("transports", torch.zeros((), dtype=torch.int64))

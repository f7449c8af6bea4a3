"""DualPrompt online (``dualprompt_online``): L2P's online adapter plus G-prompts.

Task-free changes (paper appendix): an E-prompt pool of 10 and a G-prompt of length 5, all used at
all times; no prompt mask by task id and no shared-pool copying. Test-time ``batchwise_prompt``
follows the L2P adapter (off by default: it would leak task identity).

Fixed here, without patching PILOT: ``EPrompt.forward`` (``backbone/prompt.py``) gathers the
selected prefixes as ``[L, 2, B, top_k, length, H, D]`` (layer, key/value, sample, ...) and reshapes
them to ``[L, B, 2, top_k * length, H, D]`` without moving the key/value axis (PILOT issue #29).
Reading the flat ``(key/value, sample)`` blocks two at a time, sample ``j`` gets blocks ``2j`` and
``2j + 1``. With per-sample selection these are prefixes chosen by other samples, so a prediction
depends on the rest of its batch; with the batch vote, the first half of the batch gets the key
prefix as key and value, the second half the value prefix. Only a batch of one is right. The
forward hook :func:`per_sample_prefix_prompts` replaces ``batched_prompt`` by the same gather laid
out ``[L, B, 2, ...]``: sample ``j`` gets exactly the key and value prefixes of ``prompt_idx[j]``,
in training and evaluation, with or without the vote, and gradients reach the same prompt entries.
The hook sits on our network only: upstream's ``dualprompt`` learner in the same checkout is
unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ..core.checks import boolean, integer, list_of, within_vit_depth
from ..core.lazy import nn
from ..engine.adapter import ConfigKey
from ..engine.backbone_names import pilot_backbones
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.differences import BATCH_LOGIT_MASK, NO_BATCH_VOTE_AT_EVALUATION
from ..engine.registry import register_method
from .l2p import L2POnline

BLOCKS = "a list of distinct block indices"

# In upstream exps/dualprompt.json's order (later duplicates keep their first position).
_HEAD = ("get_original_backbone", "global_pool", "head_type", "freeze")
DUALPROMPT_KEYS: dict[str, ConfigKey] = {
    **{key: L2POnline.config_keys[key] for key in _HEAD},
    "head_type": ConfigKey(
        "token", "what the head reads", choices=L2POnline.config_keys["head_type"].choices
    ),
    "use_g_prompt": ConfigKey(True, "general (task-shared) prompt", check=boolean),
    "g_prompt_length": ConfigKey(5, "G-prompt length (paper: 5)", check=integer(1)),
    "g_prompt_layer_idx": ConfigKey(
        [0, 1],
        "layers that get the G-prompt",
        check=list_of(integer(0), BLOCKS, distinct=True),
        cross_check=within_vit_depth("g_prompt_layer_idx"),
    ),
    "use_prefix_tune_for_g_prompt": ConfigKey(True, "prefix-tune the G-prompt", check=boolean),
    "use_e_prompt": ConfigKey(True, "expert prompt pool", check=boolean),
    "e_prompt_layer_idx": ConfigKey(
        [2, 3, 4],
        "layers that get E-prompts",
        check=list_of(integer(0), BLOCKS, distinct=True),
        cross_check=within_vit_depth("e_prompt_layer_idx"),
    ),
    "use_prefix_tune_for_e_prompt": ConfigKey(True, "prefix-tune the E-prompts", check=boolean),
    **{key: spec for key, spec in L2POnline.config_keys.items() if key not in _HEAD},
    "top_k": dataclasses.replace(  # L2P's key and its rule (top_k <= size), another default
        L2POnline.config_keys["top_k"],
        default=1,
        doc="E-prompts selected per sample (at most size)",
    ),
    "same_key_value": ConfigKey(False, "share prefix keys and values", check=boolean),
}


def per_sample_prefix_prompts(
    e_prompt: nn.Module, inputs: tuple[Any, ...], out: dict[str, Any]
) -> dict[str, Any]:
    """Forward hook on PILOT's ``EPrompt``: give each sample the key and value prefixes it selected.

    Re-gathers ``prompt[:, :, prompt_idx]`` (``[L, 2, B, top_k, length, H, D]``) and moves the
    sample axis before the key/value axis, where upstream only reshapes (see the module docstring).
    Prompt tuning (no prefixes) and the pool-free path are laid out correctly upstream and kept.
    """
    if not (e_prompt.prompt_pool and e_prompt.use_prefix_tune_for_e_prompt):
        return out
    selected = e_prompt.prompt[:, :, out["prompt_idx"]]
    layers, key_value, batch, top_k, length, heads, head_dim = selected.shape
    out["batched_prompt"] = selected.transpose(1, 2).reshape(
        layers, batch, key_value, top_k * length, heads, head_dim
    )
    return out


CARD = MethodCard(
    backbone_types=pilot_backbones("dualprompt"),
    paper_name="DualPrompt",
    upstream_differences=(
        BATCH_LOGIT_MASK,
        NO_BATCH_VOTE_AT_EVALUATION,
        UpstreamDifference(
            "per_sample_prefix_layout",
            "Each sample gets the key and value prefixes of the E-prompts it selected, where "
            "upstream's EPrompt reshapes without moving the key/value axis, so a sample reads "
            "other samples' prefixes (PILOT issue #29).",
            "Upstream's layout is right for a batch of one only: predictions would change with "
            "the batch size and order (the forward hook fixes it on our network alone).",
        ),
        UpstreamDifference(
            "no_task_prompt_slots",
            "E-prompts are selected by key matching at all times, where upstream's config trains "
            "task t on its own pool slot (`use_prompt_mask`) initialised from task t-1's "
            "(`shared_prompt_pool`).",
            "Both need the task identity and task starts, which a task-free stream never gives.",
        ),
    ),
)


@register_method("dualprompt_online", card=CARD)
class DualPromptOnline(L2POnline):
    base_model_name: ClassVar[str] = "dualprompt"
    config_keys: ClassVar[dict[str, ConfigKey]] = DUALPROMPT_KEYS

    def build_network(self, args: dict) -> nn.Module:
        """PILOT's DualPrompt network, with each sample's E-prompt prefixes laid out per sample."""
        network = super().build_network(args)
        self.prompt_pool(network).register_forward_hook(per_sample_prefix_prompts)
        return network

    def prompt_pool(self, network: nn.Module) -> nn.Module:
        return network.backbone.e_prompt

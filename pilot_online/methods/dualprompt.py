"""DualPrompt online (``dualprompt_online``): L2P's online adapter plus G-prompts.

Task-free changes (paper appendix): an E-prompt pool of 10 and a G-prompt of length 5, all used at
all times; no prompt mask by task id and no shared-pool copying. Test-time ``batchwise_prompt``
follows the L2P adapter (off by default: it would leak task identity).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from ..engine.adapter import ConfigKey
from ..engine.registry import register_method
from .l2p import PROMPT_POOL_KEYS, L2POnline

# In upstream exps/dualprompt.json's order (later duplicates keep their first position).
_HEAD = ("get_original_backbone", "global_pool", "head_type", "freeze")
DUALPROMPT_KEYS: dict[str, ConfigKey] = {
    **{key: PROMPT_POOL_KEYS[key] for key in _HEAD},
    "head_type": ConfigKey("token", "what the head reads"),
    "use_g_prompt": ConfigKey(True, "general (task-shared) prompt"),
    "g_prompt_length": ConfigKey(5, "G-prompt length (paper: 5)"),
    "g_prompt_layer_idx": ConfigKey([0, 1], "layers that get the G-prompt"),
    "use_prefix_tune_for_g_prompt": ConfigKey(True, "prefix-tune the G-prompt"),
    "use_e_prompt": ConfigKey(True, "expert prompt pool"),
    "e_prompt_layer_idx": ConfigKey([2, 3, 4], "layers that get E-prompts"),
    "use_prefix_tune_for_e_prompt": ConfigKey(True, "prefix-tune the E-prompts"),
    **{key: spec for key, spec in PROMPT_POOL_KEYS.items() if key not in _HEAD},
    "top_k": ConfigKey(1, "E-prompts selected per sample"),
    "same_key_value": ConfigKey(False, "share prefix keys and values"),
}


@register_method("dualprompt_online")
class DualPromptOnline(L2POnline):
    base_model_name: ClassVar[str] = "dualprompt"
    backbone_marker: ClassVar[str] = "_dualprompt"
    config_keys: ClassVar[dict[str, ConfigKey]] = DUALPROMPT_KEYS

    def prompt_pool(self, network: nn.Module) -> nn.Module:
        return network.backbone.e_prompt

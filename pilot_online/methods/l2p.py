"""L2P online (``l2p_online``): PILOT's PromptVitNet, trained task-free.

Task-free changes (paper appendix): a pool of 10 prompts used at all times, no prompt mask chosen by
task id, no shared-pool copying at task changes (``_init_prompt`` is never called).

``batchwise_prompt`` (a batch majority vote over selected prompts) stays on for training batches,
which are genuine stream batches. At test time it is off by default: PILOT's test batches are sorted
by class, so a batch vote would hand the model the task of the batch.
``batchwise_prompt_eval: true``
restores upstream behaviour for comparison.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

from ..core.checks import boolean, integer, list_of, real, text
from ..core.lazy import nn, no_grad, torch
from ..engine.adapter import ConfigKey, Evaluation, MethodAdapter, QueryPass, StepOutput
from ..engine.backbone_names import pilot_backbones
from ..engine.card import MethodCard
from ..engine.differences import BATCH_LOGIT_MASK, NO_BATCH_VOTE_AT_EVALUATION
from ..engine.registry import register_method

#: The prompt-pool options PILOT's ``backbone/prompt.py`` recognises (others leave the pool
#: uninitialised or the query undefined).
INITIALISERS = ("zero", "uniform")
EMBEDDING_KEYS = ("mean", "max", "mean_max", "cls")


def _top_k_within_pool(cfg: Mapping[str, Any]) -> None:
    """The prompts a sample selects come from the pool: ``top_k`` at most ``size``."""
    if cfg["top_k"] > cfg["size"]:
        raise ValueError(
            f"top_k={cfg['top_k']} prompts cannot be selected from a pool of size="
            f"{cfg['size']}: set top_k <= size"
        )


BACKBONE_PREFIXES = "a list of parameter-name prefixes"

PROMPT_POOL_KEYS: dict[str, ConfigKey] = {
    "get_original_backbone": ConfigKey(True, "frozen query ViT that selects prompts", forced=True),
    "global_pool": ConfigKey("token", "ViT pooling", choices=("token", "avg", "")),
    "head_type": ConfigKey(
        "prompt",
        "what the head reads: prompt | token | gap | token+prompt",
        choices=("prompt", "token", "gap", "token+prompt"),
    ),
    "freeze": ConfigKey(
        ["blocks", "patch_embed", "cls_token", "norm", "pos_embed"],
        "frozen backbone prefixes",
        check=list_of(text, BACKBONE_PREFIXES),
    ),
    "prompt_pool": ConfigKey(True, "use a prompt pool", check=boolean),
    "size": ConfigKey(10, "prompt pool size (paper: 10)", check=integer(1)),
    "length": ConfigKey(5, "prompt length", check=integer(1)),
    "top_k": ConfigKey(
        5,
        "prompts selected per sample (at most size)",
        check=integer(1),
        cross_check=_top_k_within_pool,
    ),
    "initializer": ConfigKey("uniform", "prompt initialiser", choices=INITIALISERS),
    "prompt_key": ConfigKey(True, "learnable prompt keys", check=boolean),
    "prompt_key_init": ConfigKey("uniform", "prompt-key initialiser", choices=INITIALISERS),
    "use_prompt_mask": ConfigKey(False, "task-id prompt masks need task identity", forced=True),
    "shared_prompt_pool": ConfigKey(False, "copying prompts at task changes", forced=True),
    "shared_prompt_key": ConfigKey(False, "copying keys at task changes", forced=True),
    "batchwise_prompt": ConfigKey(
        True, "batch majority-vote prompt selection in training", check=boolean
    ),
    "embedding_key": ConfigKey("cls", "query embedding", choices=EMBEDDING_KEYS),
    "predefined_key": ConfigKey("", "unused by PILOT", check=text),
    "pull_constraint": ConfigKey(True, "add the key-query pull constraint", check=boolean),
    "pull_constraint_coeff": ConfigKey(0.1, "weight of the pull constraint", check=real(0)),
}


CARD = MethodCard(
    backbone_types=pilot_backbones("l2p"),
    paper_name="L2P",
    upstream_differences=(BATCH_LOGIT_MASK, NO_BATCH_VOTE_AT_EVALUATION),
)


@register_method("l2p_online", card=CARD)
class L2POnline(MethodAdapter):
    base_model_name: ClassVar[str] = "l2p"
    config_keys: ClassVar[dict[str, ConfigKey]] = PROMPT_POOL_KEYS

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import PromptVitNet

        network = PromptVitNet(self.pilot_args(args), True)
        network.original_backbone.requires_grad_(False)
        frozen = tuple(args["freeze"])
        for name, param in network.backbone.named_parameters():
            if name.startswith(frozen):
                param.requires_grad_(False)
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        # PromptVitNet.forward, in two parts so that evaluation can reuse the query.
        return self._forward_from_query(network, x, self._query_features(network, x), train)

    def evaluation(self, network: nn.Module) -> Evaluation:
        """The frozen query pass, which evaluation caches per test sample."""
        query = QueryPass(
            list(network.original_backbone.parameters()),
            functools.partial(self._query_features, network),
            functools.partial(self._forward_from_query, network),
        )
        return Evaluation(query=query)

    @no_grad
    def _query_features(self, network: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The frozen original ViT's pre-logits, which select the prompts."""
        return network.original_backbone(x)["pre_logits"]

    def _forward_from_query(
        self, network: nn.Module, x: torch.Tensor, query: torch.Tensor, train: bool
    ) -> StepOutput:
        out = network.backbone(x, task_id=-1, cls_features=query, train=train)
        features = network.backbone.fc_norm(out["pre_logits"])
        aux = None
        if train and self.args["pull_constraint"] and "reduce_sim" in out:
            aux = -self.args["pull_constraint_coeff"] * out["reduce_sim"]
        return StepOutput(out["logits"], features, aux)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.backbone.head

    def prompt_pool(self, network: nn.Module) -> nn.Module:
        """The module that selects prompts (its ``batchwise_prompt`` flag is toggled for eval)."""
        return network.backbone.prompt

    def set_mode(self, network: nn.Module, train: bool) -> None:
        if train:
            network.backbone.train()
            network.original_backbone.eval()
            self.prompt_pool(network).batchwise_prompt = self.args["batchwise_prompt"]
        else:
            network.eval()
            self.prompt_pool(network).batchwise_prompt = (
                self.args["batchwise_prompt"] and self.args["batchwise_prompt_eval"]
            )

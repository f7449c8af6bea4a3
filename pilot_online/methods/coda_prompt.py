"""CODA-Prompt online (``coda_online``): PILOT's CodaPromptVitNet, trained task-free.

Task-free changes (paper appendix): 100 components, all trained at all times. The prompt is built
with ``n_tasks=1``, so its task slice ``[0:100]`` covers every component, and
``process_task_count`` (which re-initialises components at task changes) is never called.

PILOT's training path (``train=True``) crashes on CPU: the backbone creates ``prompt_loss`` as a
leaf that requires grad and adds to it in place. With one task, ``train=True`` and ``train=False``
select the same components and differ only in the orthogonality penalty, so we run the prompted
pass with ``train=False`` and compute that penalty here, on the parameters' own device (PILOT's
``ortho_penalty`` builds its identity matrix on the CPU).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from ..core.checks import integer, real
from ..core.lazy import nn, no_grad, torch
from ..engine.adapter import ConfigKey, Evaluation, MethodAdapter, QueryPass, StepOutput
from ..engine.backbone_names import pilot_backbones
from ..engine.card import MethodCard, UpstreamDifference
from ..engine.differences import BATCH_LOGIT_MASK
from ..engine.registry import register_method


def orthogonality_penalty(t: torch.Tensor) -> torch.Tensor:
    """mean((t t^T - I)^2), CODA's penalty, with I on ``t``'s device."""
    t = t.reshape(t.shape[0], -1)
    eye = torch.eye(t.shape[0], device=t.device, dtype=t.dtype)
    return ((t @ t.T - eye) ** 2).mean()


def _prompt_param(name: str, value: Any) -> list:
    """CODA's ``[components, length, mu]``: PILOT's ``CodaPrompt`` unpacks exactly three."""
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(
            f"{name} must be [components, prompt length, orthogonality weight], e.g. "
            f"[100, 8, 0.0], got {value!r}"
        )
    integer(1)(f"{name}[0] (components)", value[0])
    integer(1)(f"{name}[1] (prompt length)", value[1])
    real(0)(f"{name}[2] (orthogonality weight mu)", value[2])
    return list(value)


CARD = MethodCard(
    backbone_types=pilot_backbones("coda_prompt"),
    paper_name="CODA",
    full_name="CODA-Prompt",
    upstream_differences=(
        BATCH_LOGIT_MASK,
        UpstreamDifference(
            "one_task_all_components",
            "The prompt is built for one task, so every component trains at all times, where "
            "upstream gives each task its own slice of the components and freezes the earlier "
            "slices (`process_task_count`).",
            "Slices follow task starts, which a task-free stream never gives (paper appendix: "
            "100 components, all trained).",
        ),
        UpstreamDifference(
            "penalty_in_adapter",
            "The orthogonality penalty is added by the adapter, on the prompt's own device, to a "
            "prompted pass run with `train=False`; upstream adds it inside the backbone's "
            "`train=True` pass.",
            "Upstream's pass adds in place to a leaf tensor, which fails on the CPU; with one "
            "task both passes select the same components.",
        ),
    ),
)


@register_method("coda_online", card=CARD)
class CodaOnline(MethodAdapter):
    base_model_name: ClassVar[str] = "coda_prompt"
    config_keys: ClassVar[dict[str, ConfigKey]] = {
        "prompt_param": ConfigKey(
            [100, 8, 0.0],
            "[components (paper: 100), prompt length, orthogonality weight mu]",
            check=_prompt_param,
        ),
    }

    def build_network(self, args: dict) -> nn.Module:
        from utils.inc_net import CodaPromptVitNet

        network = CodaPromptVitNet(self.pilot_args(args, nb_tasks=1), True)
        network.backbone.requires_grad_(False)  # PILOT's optimiser only sees prompt + fc
        return network

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        # CodaPromptVitNet.forward(pen=True, train=False), in two parts so that evaluation can
        # reuse the query.
        return self._forward_from_query(network, x, self._query_features(network, x), train)

    def evaluation(self, network: nn.Module) -> Evaluation:
        """The frozen query pass, which evaluation caches per test sample."""
        query = QueryPass(
            list(network.backbone.parameters()),
            functools.partial(self._query_features, network),
            functools.partial(self._forward_from_query, network),
        )
        return Evaluation(query=query)

    @no_grad
    def _query_features(self, network: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The CLS token of the frozen backbone's prompt-free pass."""
        tokens, _ = network.backbone(x)
        return tokens[:, 0, :]

    def _forward_from_query(
        self, network: nn.Module, x: torch.Tensor, query: torch.Tensor, train: bool
    ) -> StepOutput:
        tokens, _ = network.backbone(x, prompt=network.prompt, q=query, train=False)
        features = tokens[:, 0, :]
        features = features.view(features.size(0), -1)
        logits = network.fc(features)
        mu = float(self.args["prompt_param"][2])
        aux = None
        if train and mu > 0:
            prompt = network.prompt
            aux = mu * sum(
                orthogonality_penalty(getattr(prompt, f"e_{kind}_{layer}"))
                for layer in prompt.e_layers
                for kind in ("k", "a", "p")
            )
        return StepOutput(logits, features, aux)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc

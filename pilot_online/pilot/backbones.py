"""Backbone options PILOT's factories have no key for, supplied without editing them.

PILOT builds its ViTs with ``timm.create_model(...)`` and fixed arguments. While a network is
built, :func:`timm_overrides` wraps ``timm.create_model`` so that every call also receives
``backbone_kwargs`` (e.g. ``{"img_size": 32}`` for 40x cheaper CPU runs), loads a local weights
file named by ``pretrained_path``, and turns a failed weights download into an error that says
what to do offline.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)


class WeightsUnavailableError(RuntimeError):
    """Pretrained weights could not be downloaded or read."""


def _pretrained_cfg_for(model_name: str) -> dict[str, Any]:
    """timm's pretrained config of the longest registered prefix of a PILOT backbone name
    (``vit_base_patch16_224_coda_prompt`` -> ``vit_base_patch16_224``)."""
    from timm.models import get_pretrained_cfg

    parts = model_name.split("_")
    for end in range(len(parts), 0, -1):
        cfg = get_pretrained_cfg("_".join(parts[:end]))
        if cfg:
            return dict(cfg)
    raise WeightsUnavailableError(f"timm knows no pretrained config for {model_name!r}")


@contextlib.contextmanager
def timm_overrides(
    backbone_kwargs: dict[str, Any] | None = None, pretrained_path: str | None = None
) -> Iterator[None]:
    """Within the block, ``timm.create_model`` gets ``backbone_kwargs`` and local weights."""
    import timm

    original = timm.create_model
    extra = dict(backbone_kwargs or {})

    def create_model(model_name: str, *args: Any, **kwargs: Any):
        kwargs.update(extra)
        pretrained = kwargs.get("pretrained", args[0] if args else False)
        if pretrained and pretrained_path:
            kwargs["pretrained_cfg"] = {**_pretrained_cfg_for(model_name), "file": pretrained_path}
        # A download fails with OSError (urllib's URLError is one); a bad local file with
        # whatever numpy or torch raise while reading it.
        failures = (OSError, ValueError, KeyError, RuntimeError) if pretrained_path else OSError
        try:
            return original(model_name, *args, **kwargs)
        except failures as err:
            if not pretrained:
                raise
            source = pretrained_path or "the timm download URL"
            raise WeightsUnavailableError(
                f"pretrained weights for {model_name!r} could not be loaded from {source}: {err}. "
                'Offline, set "pretrained_path" to the ViT npz that timm 0.6 caches (under '
                '$TORCH_HOME/hub/checkpoints), or set "pretrained": false for random weights'
            ) from err

    timm.create_model = create_model
    try:
        yield
    finally:
        timm.create_model = original

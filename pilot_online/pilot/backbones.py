"""Backbone options PILOT's factories have no key for, supplied without editing them.

PILOT builds its ViTs with ``timm.create_model(...)`` and fixed arguments. While a network is
built, :func:`timm_overrides` wraps ``timm.create_model`` so that every call also receives
``backbone_kwargs`` (e.g. ``{"img_size": 32}`` for 40x cheaper CPU runs), loads a local weights
file named by ``pretrained_path``, and turns a failed weights download into an error that says
what to do offline.

``pretrained_path`` takes the forms clusters hold (:data:`WEIGHT_SUFFIXES`):

- ``.npz``: the Google/Flax archive timm 0.6 downloads and caches; timm's (and PILOT's) own
  ``load_pretrained`` reads it, as before.
- ``.pth``/``.pt``/``.bin``: a ``torch.save`` of a timm ViT state dict (``vit_base_patch16_224``
  key names: ``blocks.0.attn.qkv.weight``, ...), optionally under ``"state_dict"``/``"model"``.
- ``.safetensors``: the same state dict as the Hugging Face cache holds it
  (``models--timm--vit_base_patch16_224.*/snapshots/*/model.safetensors``). Read by the
  format's own reader, the ``safetensors`` package (the ``safetensors`` install extra),
  imported only when such a file is given.

A state dict is loaded strictly by :func:`load_vit_state_dict`: every backbone weight of the
model must be in the file with its shape (``pos_embed`` is resized to the model's grid as timm
does), and every tensor of the file must be used. A missing, extra or mismatched key is an error
naming it, never a silent partial load. Expected gaps are listed in the log instead: what the
prompt ViTs add to timm's ViT (prompts, prompt keys) and a classifier head sized for the run's
``nb_classes`` rather than ImageNet's 1000.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..engine.backbone_names import factory_overrides
from ..engine.config import (
    NPZ_SUFFIXES,
    SAFETENSORS_SUFFIXES,
    TORCH_SUFFIXES,
    check_weights_suffix,
)

logger = logging.getLogger(__name__)


#: The weights of timm's ViT (``VisionTransformer``) that a pretrained file must provide.
BACKBONE_KEY = re.compile(
    r"(cls_token|dist_token|reg_token|pos_embed|patch_embed\.proj\.(weight|bias)"
    r"|blocks\.\d+\.(norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)"
    r"|blocks\.\d+\.ls[12]\.gamma|norm\.(weight|bias)|fc_norm\.(weight|bias))"
)
#: Classifier weights: loaded when their shape matches, else listed as sized for the run.
HEAD_KEY = re.compile(r"(head|head_dist)\.(weight|bias)")
#: Weights timm's own checkpoint filter drops (the representation layer of old 21k weights).
DROPPED_KEY = re.compile(r"pre_logits\..*")


class WeightsUnavailableError(RuntimeError):
    """Pretrained weights could not be downloaded or read."""


class WeightsMismatchError(WeightsUnavailableError):
    """A weights file does not fit the model: keys missing, unexpected or of another shape."""


#: The install extra that brings the ``safetensors`` package (setup.py).
SAFETENSORS_EXTRA = "safetensors"


def _safetensors() -> Any:
    """``safetensors.torch``, imported only when a ``.safetensors`` file is given (the
    ``safetensors`` extra); without it, an error naming the extra."""
    try:
        import safetensors.torch
    except ImportError:
        raise WeightsUnavailableError(
            "reading a .safetensors pretrained_path needs the safetensors package: pip install "
            f"'pilot-online[{SAFETENSORS_EXTRA}]' (or pip install safetensors), or point "
            "pretrained_path at a .pth/.npz file"
        ) from None
    return safetensors.torch


def _safetensors_error(path: Path, err: Exception) -> ValueError:
    return ValueError(f"{path} is not a readable safetensors file: {err}")


def weights_file_keys(path: str | Path) -> list[str]:
    """The tensor names a weights file holds, read cheaply (the safetensors header, the npz
    index; a torch file is loaded): for ``pilot-online doctor``."""
    path = Path(path)
    suffix = check_weights_suffix(path)
    if suffix in SAFETENSORS_SUFFIXES:
        reader = _safetensors()
        try:  # the header alone: no tensor is read
            with reader.safe_open(str(path), framework="pt") as handle:
                return list(handle.keys())
        except Exception as err:  # safetensors' own error type varies between its versions
            raise _safetensors_error(path, err) from None
    if suffix in NPZ_SUFFIXES:
        import numpy as np

        with np.load(path) as archive:
            return list(archive.files)
    return list(read_state_dict(path))


#: Tensors every ViT-B/16 weights file holds, by form (the first block's, the last block's).
REQUIRED_KEYS = {
    "npz": ("embedding/kernel", "cls", "Transformer/encoderblock_11/MlpBlock_3/Dense_1/kernel"),
    "state_dict": ("patch_embed.proj.weight", "cls_token", "blocks.11.mlp.fc2.weight"),
}


def missing_vit_keys(path: str | Path, depth: int | None = None) -> list[str]:
    """Keys a ViT-B/16 weights file must hold that ``path`` lacks (the npz archive may prefix
    them with ``opt/target/``); empty when it looks like one. ``depth`` (``vit_depth``): the
    file needs that many blocks, not 12."""
    keys = set(weights_file_keys(path))
    last = (depth or 12) - 1
    if Path(path).suffix.lower() in NPZ_SUFFIXES:
        required = [
            k.replace("encoderblock_11", f"encoderblock_{last}") for k in REQUIRED_KEYS["npz"]
        ]
        return [k for k in required if k not in keys and f"opt/target/{k}" not in keys]
    required = [k.replace("blocks.11.", f"blocks.{last}.") for k in REQUIRED_KEYS["state_dict"]]
    return [k for k in required if k not in keys]


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file, on the CPU (through the ``safetensors`` package)."""
    path = Path(path)
    reader = _safetensors()
    try:
        return reader.load_file(str(path), device="cpu")
    except Exception as err:  # a corrupt or truncated file: safetensors' own error type
        raise _safetensors_error(path, err) from None


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A ViT state dict from a ``.pth``/``.pt``/``.bin`` or ``.safetensors`` file."""
    path = Path(path)
    suffix = check_weights_suffix(path)
    if suffix in SAFETENSORS_SUFFIXES:
        state: Any = read_safetensors(path)
    elif suffix in TORCH_SUFFIXES:
        state = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path} is an npz archive: timm's npz loader reads it, not this one")
    # Training checkpoints wrap the weights; take them out of the usual wrappers.
    for wrapper in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(wrapper), Mapping):
            state = state[wrapper]
    if not isinstance(state, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise ValueError(
            f"{path} holds no state dict of tensors (got {type(state).__name__}): save "
            "model.state_dict() of a timm ViT"
        )
    return dict(state)


@dataclass
class LoadReport:
    """What :func:`load_vit_state_dict` did with each key."""

    loaded: list[str] = field(default_factory=list)
    resized: list[str] = field(default_factory=list)  # pos_embed to the model's grid
    added_by_model: list[str] = field(default_factory=list)  # prompts, prompt keys
    head_not_loaded: list[str] = field(default_factory=list)  # sized for nb_classes / absent
    dropped_from_file: list[str] = field(default_factory=list)  # file heads, pre_logits


def _prefix_tokens(model: nn.Module) -> int:
    if getattr(model, "no_embed_class", False):
        return 0
    return int(getattr(model, "num_prefix_tokens", getattr(model, "num_tokens", 1)))


def _resized_pos_embed(model: nn.Module, value: torch.Tensor, target: torch.Tensor):
    """``value`` resized to ``target`` as the model's own module resizes it when it loads
    weights (PILOT's ``vit_l2p`` also gives its prompt tokens the class token's embedding),
    else as timm does; None if it cannot be."""
    from timm.models import vision_transformer

    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if value.ndim != 3 or target.ndim != 3 or value.shape[-1] != target.shape[-1] or not grid:
        return None
    module = sys.modules.get(type(model).__module__)
    resize = getattr(module, "resize_pos_embed", vision_transformer.resize_pos_embed)
    try:
        resized = resize(value.float(), target, _prefix_tokens(model), grid)
    except (RuntimeError, ValueError, AssertionError):
        return None
    return resized if resized.shape == target.shape else None


@torch.no_grad()
def load_vit_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor], source: str = "the state dict"
) -> LoadReport:
    """Copy a timm ViT state dict into ``model``, strictly (see the module docstring).

    Raises :class:`WeightsMismatchError` naming every missing, unexpected and mismatched key
    before any weight is copied, so a failed load leaves ``model`` untouched.
    """
    own = model.state_dict()
    report = LoadReport()
    missing, mismatched, unexpected = [], [], []
    plan: dict[str, torch.Tensor] = {}
    for key, target in own.items():
        value = state.get(key)
        is_backbone = BACKBONE_KEY.fullmatch(key) is not None
        if HEAD_KEY.fullmatch(key):
            if value is not None and value.shape == target.shape:
                plan[key] = value
            else:
                report.head_not_loaded.append(key)
                if value is not None:
                    report.dropped_from_file.append(key)
        elif value is None:
            (missing if is_backbone else report.added_by_model).append(key)
        elif value.shape == target.shape:
            plan[key] = value
        elif (
            key == "pos_embed" and (resized := _resized_pos_embed(model, value, target)) is not None
        ):
            plan[key] = resized
            report.resized.append(f"{key} {tuple(value.shape)} -> {tuple(target.shape)}")
        else:
            mismatched.append(f"{key} (file {tuple(value.shape)}, model {tuple(target.shape)})")
    for key in state:
        if key in own:
            continue
        if HEAD_KEY.fullmatch(key) or DROPPED_KEY.fullmatch(key):
            report.dropped_from_file.append(key)
        else:
            unexpected.append(key)
    if missing or mismatched or unexpected:
        problems = []
        if missing:
            problems.append(f"missing from the file: {', '.join(missing)}")
        if mismatched:
            problems.append(f"of another shape: {', '.join(mismatched)}")
        if unexpected:
            problems.append(
                f"in the file but not in {type(model).__name__}: {', '.join(unexpected)}"
            )
        raise WeightsMismatchError(
            f"{source} does not fit {type(model).__name__} ({len(own)} tensors); keys "
            + "; ".join(problems)
            + ". pretrained_path needs a timm ViT state dict of the same architecture as "
            "backbone_type (e.g. vit_base_patch16_224's, keys such as blocks.0.attn.qkv.weight)"
        )
    for key, value in plan.items():
        own[key].copy_(value.to(own[key].dtype))
    report.loaded = sorted(plan)
    return report


def blocks_it_has(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the blocks past ``model``'s last, as timm's npz loader reads a file
    (it walks ``model.blocks``): MEMO's 11-block ``Generalized_Vit`` takes a 12-block file the
    same way from an npz or a state dict (its ``Specialized_Vit.last_block`` stays random in
    both, as upstream's)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return dict(state)
    depth = len(blocks)
    return {
        key: value
        for key, value in state.items()
        if not (match := re.match(r"blocks\.(\d+)\.", key)) or int(match.group(1)) < depth
    }


def log_load_report(report: LoadReport, source: str, model_name: str) -> None:
    """One info line of what was loaded and what was expected not to be."""
    logger.info(
        "%s: %d tensors loaded from %s%s%s%s%s",
        model_name,
        len(report.loaded),
        source,
        f"; resized: {', '.join(report.resized)}" if report.resized else "",
        f"; added by the model (kept as initialised): {', '.join(report.added_by_model)}"
        if report.added_by_model
        else "",
        f"; head sized for the run (not loaded): {', '.join(report.head_not_loaded)}"
        if report.head_not_loaded
        else "",
        f"; not used from the file: {', '.join(report.dropped_from_file)}"
        if report.dropped_from_file
        else "",
    )


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


def _without_pretrained(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The ``create_model`` arguments with ``pretrained`` off (we load the file ourselves)."""
    if "pretrained" in kwargs or not args:
        return args, {**kwargs, "pretrained": False}
    return (False, *args[1:]), kwargs


@contextlib.contextmanager
def timm_overrides(
    backbone_kwargs: dict[str, Any] | None = None,
    pretrained_path: str | None = None,
    config_pretrained: bool | None = None,
    depth: int | None = None,
) -> Iterator[None]:
    """Within the block, ``timm.create_model`` gets ``backbone_kwargs`` and local weights, and
    every ViT is built ``depth`` blocks deep (None: as its factory says, 12 for ViT-B).

    ``config_pretrained``: the config's ``pretrained``, so that a failed download the config did
    not ask for (PILOT's factory hard-codes ``pretrained=True``) names the engine's fix instead
    of advising the ``"pretrained": false`` that is already set."""
    import timm

    original = timm.create_model
    extra = dict(backbone_kwargs or {})
    suffix = check_weights_suffix(pretrained_path) if pretrained_path else None

    def create_model(model_name: str, *args: Any, **kwargs: Any):
        kwargs.update(extra)
        pretrained = kwargs.get("pretrained", args[0] if args else False)
        if pretrained and suffix is not None and suffix not in NPZ_SUFFIXES:
            # A state dict: build with random weights, then load it strictly ourselves (timm's
            # own loader would read it as npz, or drop mismatched keys without a word).
            plain_args, plain_kwargs = _without_pretrained(args, kwargs)
            model = original(model_name, *plain_args, **plain_kwargs)
            try:
                state = read_state_dict(pretrained_path)
            except (OSError, ValueError, RuntimeError) as err:
                raise WeightsUnavailableError(
                    f"pretrained weights for {model_name!r} could not be read from "
                    f"{pretrained_path}: {err}"
                ) from err
            for part in model if isinstance(model, tuple) else (model,):
                # PILOT's vit_memo is a pair (Generalized_Vit, Specialized_Vit); a model built
                # shallower than the file (vit_depth) takes its first blocks.
                report = load_vit_state_dict(
                    part, blocks_it_has(part, state), source=str(pretrained_path)
                )
                log_load_report(report, str(pretrained_path), type(part).__name__)
            return model
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
            if config_pretrained is False and not pretrained_path:
                raise WeightsUnavailableError(
                    f"pretrained weights for {model_name!r} could not be loaded from {source}: "
                    f'{err}. The config sets "pretrained": false, but PILOT\'s factory for this '
                    "backbone hard-codes pretrained=True and no rule of factory_overrides() in "
                    "pilot_online/engine/backbone_names.py covers this backbone_type: add its "
                    "get_backbone branch there (docs/porting.md)"
                ) from err
            raise WeightsUnavailableError(
                f"pretrained weights for {model_name!r} could not be loaded from {source}: {err}. "
                'Offline, set "pretrained_path" to the ViT weights: the npz that timm 0.6 caches '
                "(under $TORCH_HOME/hub/checkpoints), a torch.save'd timm state dict (.pth), or "
                'the Hugging Face cache\'s model.safetensors; or set "pretrained": false for '
                "random weights"
            ) from err

    timm.create_model = create_model
    try:
        with _patch_size(extra.get("img_size")), vit_depth(depth):
            yield
    finally:
        timm.create_model = original


def run_overrides(config: Mapping[str, Any]) -> contextlib.AbstractContextManager:
    """:func:`timm_overrides` as a run builds its networks: the keywords forced for its backbone
    (:func:`~pilot_online.engine.backbone_names.factory_overrides`), the config's weights file and
    ``vit_depth`` (the one place the three are read)."""
    return timm_overrides(
        factory_overrides(config),
        config.get("pretrained_path"),
        config.get("pretrained"),
        config.get("vit_depth"),
    )


#: PILOT 5240714's modules that define the ViT classes its factories build, each taking
#: ``depth`` (``backbone/``); timm's own ``VisionTransformer`` is the other.
PILOT_VIT_MODULES = (
    "backbone.vit_adapter",
    "backbone.vit_coda_promtpt",
    "backbone.vit_dualprompt",
    "backbone.vit_ease",
    "backbone.vit_l2p",
    "backbone.vit_lae",
    "backbone.vit_memo",
    "backbone.vit_mos",
    "backbone.vit_ssf",
    "backbone.vpt",
)


def vit_classes() -> list[type]:
    """Every ViT class a build may construct: timm's, and PILOT's where PILOT is importable
    (classes that define their own ``__init__`` with a ``depth`` parameter)."""
    from timm.models import vision_transformer

    modules = [vision_transformer]
    for name in PILOT_VIT_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:  # no PILOT on the path (the demo, plain timm): timm's ViT only
            continue
    found = []
    for module in modules:
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, nn.Module)
                and value.__module__ == module.__name__
                and "__init__" in vars(value)
                and "depth" in inspect.signature(value.__init__).parameters
            ):
                found.append(value)
    return found


@contextlib.contextmanager
def vit_depth(depth: int | None) -> Iterator[None]:
    """Within the block, every ViT class is built ``depth`` blocks deep, whatever depth its
    factory passes (None: unchanged).

    PILOT's factories and timm's pass ``depth=12`` together with the caller's kwargs, so a
    ``depth`` in ``backbone_kwargs`` is a duplicate keyword (a ``TypeError``). Overriding the
    constructor's argument instead sizes everything that follows the depth as the class itself
    does: the blocks, VPT's deep prompts, the adapters of APER, EASE and MOS, MEMO's
    generalized part (``depth - 1`` blocks) and its specialized block."""
    if depth is None:
        yield
        return
    originals = {cls: cls.__init__ for cls in vit_classes()}

    def deep(init: Any) -> Any:
        signature = inspect.signature(init)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind_partial(self, *args, **kwargs)
            bound.arguments["depth"] = depth
            init(*bound.args, **bound.kwargs)

        return __init__

    for cls, init in originals.items():
        cls.__init__ = deep(init)
    try:
        yield
    finally:
        for cls, init in originals.items():
            cls.__init__ = init


@contextlib.contextmanager
def _patch_size(img_size: Any) -> Iterator[None]:
    """Within the block, every timm ``PatchEmbed`` is built for ``img_size`` (None: unchanged).

    PILOT builds some ViTs without ``timm.create_model`` (VPT's ``VPT_ViT``, the AdaptFormer ViT
    of ``backbone/vit_adapter.py``), at 224 px, then loads a ``create_model`` ViT's weights into
    them; both size their position embedding from their ``PatchEmbed``, so forcing its
    ``img_size`` keeps every ViT of the network at the configured size (APER's ports)."""
    if img_size is None:
        yield
        return
    from timm.models.layers.patch_embed import PatchEmbed

    original = PatchEmbed.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["img_size"] = img_size  # img_size is PatchEmbed's first positional argument
        original(self, *args[1:], **kwargs)

    PatchEmbed.__init__ = init
    try:
        yield
    finally:
        PatchEmbed.__init__ = original

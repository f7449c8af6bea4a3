"""``sdpa: true``: the ViTs' attention through ``torch.nn.functional.scaled_dot_product_attention``.

timm 0.6.13 and PILOT's backbones compute attention by hand (``softmax(q k^T * scale) v``), which
materialises the ``[B, heads, N, N]`` matrix; SDPA picks a fused kernel (flash or memory-efficient
attention on CUDA). :func:`use_sdpa` swaps, on one network only, the ``forward`` of every
attention module it recognises for a function of ours computing the same thing, prefixes
included; PILOT's files are not touched. Recognised (by class name and attributes):

- ``Attention`` of timm and of PILOT's ``vit_l2p``/``vit_dualprompt`` (``forward(x, *args)``),
  and of ``vit_ssf`` (APER's SSF: a feature-wise scale and shift after ``qkv`` and ``proj``);
- ``PreT_Attention`` (``vit_dualprompt``: key/value prefixes ``[B, 2, length, heads, head_dim]``);
- CODA's ``Attention`` (``vit_coda_promtpt``: ``forward(x, register_hook, prompt=(pk, pv))``);
- the ``Attention`` of ``vit_adapter``, ``vit_ease`` and ``vit_mos`` (APER's adapter, RanPAC,
  FeCAM, EASE, MOS), with separate ``q_proj``, ``k_proj`` and ``v_proj``.

An attention module that does more inside its forward (LAE's prompts, prefixes and adapters in
``vit_lae``) is not recognised: such a method refuses ``sdpa: true`` in a ``cross_check`` of one
of its keys.

fp32 results match the hand-written attention to rounding (a different summation order), not
bit for bit; off by default.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def _ssf(module: nn.Module, which: int, x: torch.Tensor) -> torch.Tensor:
    """PILOT's SSF attention (``vit_ssf``, ``tuning_mode == "ssf"``) scales and shifts the
    ``qkv`` output (``which`` 1) and the ``proj`` output (2), feature-wise; others: ``x``."""
    if getattr(module, "tuning_mode", None) != "ssf":
        return x
    return x * getattr(module, f"ssf_scale_{which}") + getattr(module, f"ssf_shift_{which}")


def _split_heads(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    batch, tokens, width = x.shape
    heads = module.num_heads
    qkv = _ssf(module, 1, module.qkv(x))
    return qkv.reshape(batch, tokens, 3, heads, width // heads).permute(2, 0, 3, 1, 4).unbind(0)


def _attend(module: nn.Module, q, k, v, shape) -> torch.Tensor:
    dropout = module.attn_drop.p if module.training else 0.0
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=module.scale)
    out = out.transpose(1, 2).reshape(shape)
    return module.proj_drop(_ssf(module, 2, module.proj(out)))


def plain_forward(self: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
    q, k, v = _split_heads(self, x)
    return _attend(self, q, k, v, x.shape)


def split_forward(self: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
    """``vit_adapter``/``vit_ease``/``vit_mos``: q, k and v from three projections."""
    batch, tokens, width = x.shape
    heads = self.num_heads
    q, k, v = (
        getattr(self, f"{name}_proj")(x)
        .reshape(batch, tokens, heads, width // heads)
        .transpose(1, 2)
        for name in "qkv"
    )
    return _attend(self, q, k, v, x.shape)


def prefix_forward(self: nn.Module, x: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
    """PILOT's ``PreT_Attention``: key and value prefixes come first in the key/value sequence."""
    q, k, v = _split_heads(self, x)
    if prompt is not None:
        prefixes = prompt.permute(1, 0, 3, 2, 4)  # [2, B, heads, length, head_dim]
        k = torch.cat([prefixes[0], k], dim=2)
        v = torch.cat([prefixes[1], v], dim=2)
    return _attend(self, q, k, v, x.shape)


def coda_forward(
    self: nn.Module, x: torch.Tensor, register_hook: bool = False, prompt=None
) -> torch.Tensor:
    """CODA's ``Attention``: ``prompt = (pk, pv)``, each ``[B, length, dim]``."""
    if register_hook:
        raise ValueError("sdpa: true cannot save attention maps (register_hook); set sdpa false")
    batch, _, width = x.shape
    q, k, v = _split_heads(self, x)
    if prompt is not None:
        heads = self.num_heads
        pk, pv = (p.reshape(batch, -1, heads, width // heads).permute(0, 2, 1, 3) for p in prompt)
        k = torch.cat((pk, k), dim=2)
        v = torch.cat((pv, v), dim=2)
    return _attend(self, q, k, v, x.shape)


def _forward_for(module: nn.Module):
    name = type(module).__name__
    if any(hasattr(module, a) for a in ("add_prompt", "add_prefix", "adapt_module")):
        return None  # LAE's PET modules act inside the forward
    common = ("num_heads", "scale", "proj", "attn_drop")
    if name == "Attention" and all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj")):
        return split_forward if all(hasattr(module, a) for a in common) else None
    if not all(hasattr(module, a) for a in ("qkv", *common)):
        return None
    if name == "PreT_Attention":
        return prefix_forward
    if name == "Attention":
        return coda_forward if "attention_map" in vars(module) else plain_forward
    return None


#: (attention class, our forward) -> its subclass whose ``forward`` is ours.
_SDPA_CLASSES: dict[tuple[type, Any], type] = {}


def _sdpa_class(cls: type, forward) -> type:
    """``cls`` with ``forward`` replaced, same name, made once per (class, forward).

    A class, not ``module.forward = types.MethodType(forward, module)``: that bound method is a
    reference cycle (module -> its ``__dict__`` -> method -> module), so a network dropped at
    the end of a seed would keep its weights allocated until the garbage collector ran, and the
    next seed's peak memory would count them. A class attribute holds no module."""
    if getattr(cls, "_sdpa_forward", None) is not None:
        return cls  # swapped already
    key = (cls, forward)
    if key not in _SDPA_CLASSES:
        _SDPA_CLASSES[key] = type(
            cls.__name__,
            (cls,),
            {"forward": forward, "_sdpa_forward": forward, "__module__": cls.__module__},
        )
    return _SDPA_CLASSES[key]


def use_sdpa(network: nn.Module) -> int:
    """Route every recognised attention module of ``network`` through SDPA; returns how many."""
    swapped = 0
    for module in network.modules():
        forward = _forward_for(module)
        if forward is not None:
            module.__class__ = _sdpa_class(type(module), forward)
            swapped += 1
    if not swapped:
        raise ValueError("sdpa: true, but the network has no attention module sdpa knows")
    logger.info("sdpa: %d attention modules use scaled_dot_product_attention", swapped)
    return swapped

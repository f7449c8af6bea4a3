"""The ``backbone_type`` names PILOT's ``get_backbone`` (``utils/inc_net.py``, commit 5240714)
builds, per upstream model: data only, no PILOT import, so ``check-config`` can refuse a name
before a run instead of PILOT failing after setup.

Why a table: ``get_backbone`` dispatches on substrings (``"_ssf" in name``) and then on exact
names, so a name with the right substring can still build nothing. For the APER family
``vit_base_patch16_224_ssf`` passes the substring test, matches no exact name, and PILOT crashes
with ``UnboundLocalError``. The branches, read from upstream:

- any model: ``vit_base_patch16_224`` / ``pretrained_vit_b16_224`` and their ``_in21k`` twins
  build timm's plain ViT-B/16, with ``pretrained=True`` hard-coded (:func:`factory_overrides`
  forces the config's);
- ``_ssf``, ``_vpt``, ``_adapter`` (models ``aper_ssf``/``aper_vpt``/``aper_adapter``, also
  ``ranpac`` and ``fecam``): only ``pretrained_vit_b16_224_<kind>`` and
  ``pretrained_vit_b16_224_in21k_<kind>``;
- ``_l2p``, ``_dualprompt``, ``_coda_prompt`` (models ``l2p``, ``dualprompt``, ``coda_prompt``)
  and ``_lae`` (any model; ``backbone/vit_lae.py``):
  any name the matching ``backbone/vit_*.py`` registers with timm. The table keeps the ViT-B/16
  ones, the backbone the online ports are tested on (CODA's network hard-codes width 768, and
  the prompt layer indices assume 12 blocks); ``tests/test_contract.py`` checks that PILOT
  registers each;
- ``_memo`` (model ``memo``): any name holding it builds ``vit_base_patch16_224_memo``
  (``backbone/vit_memo.py``), so the table keeps that one name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: ViT-B/16's size, for memory estimates made without building it (``state_bytes``, the
#: engine teacher in ``doctor``): its parameters without a head (timm 0.6.13, 224 px) and its
#: feature width.
VIT_B16_PARAMETERS = 85_798_656
VIT_B16_WIDTH = 768
#: Blocks of the ViT-B/16 PILOT's factories build (``vit_depth`` builds fewer).
VIT_B16_BLOCKS = 12


def plain_vit_overrides(args: Mapping[str, Any]) -> dict[str, Any]:
    """What PILOT's factories hard-code on their ``timm.create_model`` calls for plain ViTs
    (``pretrained=True``, no dropout) replaced by the config's ``pretrained``, ``drop`` and
    ``drop_path``, so that ``"pretrained": false`` runs offline."""
    return {
        "pretrained": bool(args["pretrained"]),
        "drop_rate": float(args["drop"]),
        "drop_path_rate": float(args["drop_path"]),
    }


#: ``get_backbone`` branches (a substring of ``backbone_type``) whose ViT class copies its
#: weights from a ``timm.create_model(..., pretrained=True)`` it makes itself and sets its own
#: dropout: only ``pretrained`` is the config's.
PRETRAINED_ONLY_BRANCHES = ("_ease", "_mos")
#: Branches that pass the config's ``pretrained``, ``drop`` and ``drop_path`` themselves (and
#: build a second, query ViT with dropout off, which forcing the config's would change). The
#: ``_coda_prompt`` branch is not one: it passes ``pretrained`` alone, so the config's dropout is
#: forced on its one ViT as on a plain one.
CONFIG_PASSING_BRANCHES = ("_l2p", "_dualprompt")


def factory_overrides(args: Mapping[str, Any]) -> dict[str, Any]:
    """The ``timm.create_model`` keywords forced while a network is built for
    ``args["backbone_type"]``: what its ``get_backbone`` branch hard-codes (``pretrained=True``,
    no dropout) replaced by the config's, then the config's own ``backbone_kwargs`` on top.

    Why here, from the name: what a factory hard-codes is a fact of PILOT's branch, not of the
    method, so every method that builds through a branch (an outside one included) gets the same
    fix. A method that calls ``timm.create_model`` itself passes the config's values already, so
    forcing them again changes nothing."""
    name = str(args.get("backbone_type", ""))
    if any(branch in name for branch in CONFIG_PASSING_BRANCHES):
        forced: dict[str, Any] = {}
    elif any(branch in name for branch in PRETRAINED_ONLY_BRANCHES):
        forced = {"pretrained": bool(args["pretrained"])}
    else:
        forced = plain_vit_overrides(args)
    return {**forced, **(args.get("backbone_kwargs") or {})}


#: timm's plain ViT-B/16, built by the first branch of ``get_backbone`` whatever the model.
PLAIN_VIT: tuple[str, ...] = (
    "vit_base_patch16_224",
    "vit_base_patch16_224_in21k",
    "pretrained_vit_b16_224",
    "pretrained_vit_b16_224_in21k",
)


def _exact(kind: str) -> tuple[str, ...]:
    """The two names the APER branches (``_ssf``, ``_vpt``, ``_adapter``) compare against."""
    return (f"pretrained_vit_b16_224_{kind}", f"pretrained_vit_b16_224_in21k_{kind}")


def _registered(marker: str) -> tuple[str, ...]:
    """The ViT-B/16 names a prompt family's ``backbone/vit_*.py`` registers with timm."""
    return (f"vit_base_patch16_224{marker}", f"vit_base_patch16_224_in21k{marker}")


#: Upstream model name -> the ``backbone_type`` names ``get_backbone`` builds for it (beyond
#: :data:`PLAIN_VIT`, which every model gets).
PILOT_BACKBONES: dict[str, tuple[str, ...]] = {
    "aper_ssf": _exact("ssf"),
    "aper_vpt": _exact("vpt"),
    "aper_adapter": _exact("adapter"),
    "l2p": _registered("_l2p"),
    "dualprompt": _registered("_dualprompt"),
    "coda_prompt": _registered("_coda_prompt"),
    "lae": _registered("_lae"),
    "memo": ("vit_base_patch16_224_memo",),
}


def pilot_backbones(base_model_name: str) -> tuple[str, ...]:
    """The family names ``get_backbone`` builds for ``base_model_name`` (not the plain ViTs)."""
    try:
        return PILOT_BACKBONES[base_model_name]
    except KeyError:
        raise ValueError(
            f"no backbone table for PILOT model {base_model_name!r}; known: "
            f"{', '.join(PILOT_BACKBONES)}. Declare the card's backbone_types yourself"
        ) from None

"""``aper_adapter_online`` against upstream's own code (PILOT ``models/aper_adapter.py``): the APER
family's checks of ``test_upstream_aper_finetune.py`` (prototypes of ``replace_fc``, what
trains, the documented differences) on the adapter branch. Upstream freezes the adapter ViT by
the keys missing from its pre-trained checkpoint (``backbone/vit_adapter.py``), which random
weights cannot reproduce: test_aper.py checks what trains here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import requires_pilot
from test_upstream_aper_finetune import (
    assert_linear_head,
    assert_no_first_session_phase,
    assert_prototypes_are_upstreams_replace_fc,
    compare_with_upstream,
)

pytestmark = requires_pilot


@pytest.fixture(scope="module")
def aper(pilot_on_path: Path) -> Iterator[dict[str, Any]]:
    from models.aper_adapter import Learner

    yield compare_with_upstream("aper_adapter_online", Learner, tuned_rule=False)


def test_prototypes_are_upstreams_replace_fc(aper: dict[str, Any]) -> None:
    assert_prototypes_are_upstreams_replace_fc(aper)


def test_difference_linear_head(aper: dict[str, Any]) -> None:
    assert_linear_head(aper)


def test_difference_no_first_session_phase(aper: dict[str, Any]) -> None:
    assert_no_first_session_phase(aper)

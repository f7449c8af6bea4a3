"""``aper_ssf_online`` against upstream's own code (PILOT ``models/aper_ssf.py``): the APER
family's checks of ``test_upstream_aper_finetune.py`` (prototypes of ``replace_fc``, what
trains, the documented differences) on the ssf branch.
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
    assert_tuned_parameters_are_upstreams,
    compare_with_upstream,
)

pytestmark = requires_pilot


@pytest.fixture(scope="module")
def aper(pilot_on_path: Path) -> Iterator[dict[str, Any]]:
    from models.aper_ssf import Learner

    yield compare_with_upstream("aper_ssf_online", Learner)


def test_prototypes_are_upstreams_replace_fc(aper: dict[str, Any]) -> None:
    assert_prototypes_are_upstreams_replace_fc(aper)


def test_tuned_parameters_are_upstreams(aper: dict[str, Any]) -> None:
    assert_tuned_parameters_are_upstreams(aper)


def test_difference_linear_head(aper: dict[str, Any]) -> None:
    assert_linear_head(aper)


def test_difference_no_first_session_phase(aper: dict[str, Any]) -> None:
    assert_no_first_session_phase(aper)

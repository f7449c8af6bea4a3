"""Typed options (``engine/options.py``): a component declares its config keys as the fields of
a frozen dataclass and reads them back typed, with each default stated once."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import make_exps

from pilot_online.core.checks import integer
from pilot_online.engine.checkpointer import CheckpointOptions
from pilot_online.engine.config import ONLINE_KEYS, resolve_config
from pilot_online.engine.console import ConsoleOptions
from pilot_online.engine.eval_cache import QueryCacheOptions
from pilot_online.engine.evaluation import EvaluationOptions
from pilot_online.engine.live_log import LiveLogOptions
from pilot_online.engine.mixins import ReplayOptions
from pilot_online.engine.options import ConfigKey, Options, option
from pilot_online.engine.pixel_cache import PixelCacheOptions
from pilot_online.engine.scoring import RealtimeOptions

COMPONENTS = [
    CheckpointOptions,
    ConsoleOptions,
    EvaluationOptions,
    LiveLogOptions,
    RealtimeOptions,
    ReplayOptions,
    QueryCacheOptions,
    PixelCacheOptions,
]


@dataclasses.dataclass(frozen=True)
class Example(Options):
    steps: int = option(ConfigKey(3, "steps", check=integer(1)))
    name: str | None = option(ConfigKey(None, "a name"))


def test_keys_are_the_fields_in_order_and_of_falls_back_to_each_default():
    assert list(Example.keys()) == ["steps", "name"]
    assert Example.keys()["steps"].default == 3
    assert Example.of({}) == Example(steps=3, name=None)
    assert Example.of({"steps": 7, "other": 1}) == Example(steps=7, name=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Example.of({}).steps = 4


@pytest.mark.parametrize("component", COMPONENTS, ids=lambda c: c.__name__)
def test_each_components_keys_are_the_tables_own(component):
    """The key table holds each component's ConfigKey objects themselves, not copies, so the
    check and the doc that resolve_config and the docs use are the component's."""
    for name, key in component.keys().items():
        assert ONLINE_KEYS[name] is key


def test_options_of_a_resolved_config_are_its_values():
    config = make_exps().smoke_config("finetune")
    config.update(eval_period=500, log_interval=3, checkpoint_every=None)
    cfg = resolve_config(config)
    assert EvaluationOptions.of(cfg).eval_period == 500
    assert ConsoleOptions.of(cfg).log_interval == 3
    assert CheckpointOptions.of(cfg).checkpoint_every is None
    assert QueryCacheOptions.of(cfg).eval_query_cache == "auto"
    assert ReplayOptions.of({}).er_batch_size == 100  # a partial config: the key's default

"""Replay a method declares (``replay = Replay(...)``, with its defaults) without
subclassing ER: the class-balanced and herding memories in the loop, their config keys, and the
per-method defaults the generated configs take (the card's ``default_lr`` and
``default_logit_mask``).

Model: ``features = relu(body(x))`` with a frozen body, so the features the herding memory
receives are known by hand."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import TinyAdapter, TinyNet, make_exps, unit_config

from pilot_online.core.memory import ClassBalancedMemory, normalized
from pilot_online.engine import registry
from pilot_online.engine.adapter import ConfigKey, Replay
from pilot_online.engine.backbone_names import PLAIN_VIT
from pilot_online.engine.card import MethodCard
from pilot_online.engine.config import ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.methods.finetune import FinetuneOnline

C = 6
X = torch.randn(24, 5, generator=torch.Generator().manual_seed(3))
Y = torch.tensor([0, 0, 1, 1, 0, 1, 2, 2, 2, 3, 3, 3, 0, 4, 4, 5, 5, 1, 0, 2, 3, 4, 5, 5])


class Loader:
    def __call__(self, indices):
        index = torch.as_tensor(np.array(indices))
        return X[index], Y[index]


def make_loop(memory: str, **overrides):
    torch.manual_seed(0)
    settings = {"er_memory_size": 6, "er_batch_size": 2, "er_memory": memory, **overrides}
    cfg = unit_config(TinyAdapter, C, frozen_body=True, **settings)
    loop = build_loop(TinyAdapter(args=cfg), TinyNet(frozen_body=True), cfg, C)
    loop.attach_samples(Loader())
    return loop


def run(loop, batches=6):
    for i in range(batches):
        rows = np.arange(4 * i, 4 * i + 4)
        loop.train_step(X[rows], Y[rows], rows)


def test_herding_reads_each_stream_batchs_features_and_keeps_the_quota():
    loop = make_loop("herding")
    assert isinstance(loop.memory, ClassBalancedMemory) and loop.memory.needs_features
    run(loop)
    features = torch.relu(loop.network.body(X)).detach().numpy()  # the body never trains
    for c in range(C):
        mine = normalized(features[(Y == c).numpy()]).mean(0)
        np.testing.assert_allclose(loop.memory.means[c], mine, rtol=1e-5, atol=1e-6)
    assert loop.memory.quota == 1  # 6 // 6 classes
    assert loop.memory.class_histogram(C).tolist() == [1] * C
    report = loop.report()["experience_replay"]
    assert report["memory"] == "herding" and report["size"] == 6


def test_a_skipped_non_finite_step_offers_nothing_to_herding():
    loop = make_loop("herding")
    run(loop, 1)
    bad = X[4:8].clone()
    bad[0, 0] = float("nan")
    stats = loop.train_step(bad, Y[4:8], np.arange(4, 8))
    assert stats.skipped
    assert loop.memory.num_seen == 4  # the skipped batch was not offered
    loop.train_step(X[8:12], Y[8:12], np.arange(8, 12))
    assert loop.memory.num_seen == 8


def test_class_balanced_replay_through_the_loop():
    loop = make_loop("class_balanced", er_memory_per_class=1)
    run(loop, 2)  # classes 0-2 seen: quota min(1, 6 // 3) = 1
    assert loop.memory.class_histogram(C).tolist() == [1, 1, 1, 0, 0, 0]
    assert loop.memory.num_seen == 8


def test_herding_replay_resumes_bit_for_bit():
    loop = make_loop("herding", optimizer="adam")
    run(loop, 3)
    state = loop.state_dict()
    resumed = make_loop("herding", optimizer="adam")
    resumed.load_state_dict(state)
    rows = np.arange(12, 16)
    a, b = loop.train_step(X[rows], Y[rows], rows), resumed.train_step(X[rows], Y[rows], rows)
    assert torch.equal(a.loss, b.loss)
    for c in loop.memory.stored:
        assert loop.memory.stored[c].tolist() == resumed.memory.stored[c].tolist()


# -- config --------------------------------------------------------------------------------------
class Remembering(FinetuneOnline):
    """A throwaway memory-based method with declared herding replay and its own defaults."""

    replay: ClassVar[Replay | None] = Replay(300, memory="herding", per_class=20, why="a test")


@pytest.fixture
def remembering(monkeypatch):
    monkeypatch.setitem(registry._METHODS, "remembering_online", Remembering)
    card = MethodCard(default_lr=5e-5, default_logit_mask="seen", backbone_types=PLAIN_VIT)
    monkeypatch.setitem(registry._CARDS, "remembering_online", card)
    return "remembering_online"


def smoke(model_name: str, **changes) -> dict:
    config = make_exps().smoke_config("finetune")
    config.pop("er_batch_size", None)
    config.update(model_name=model_name, **changes)
    return config


def test_a_declared_memory_is_the_methods_default(remembering):
    cfg = resolve_config(smoke(remembering))
    assert (cfg["er_memory_size"], cfg["er_memory"], cfg["er_memory_per_class"]) == (
        300,
        "herding",
        20,
    )


def test_a_memory_based_method_without_memory_says_its_default(remembering):
    with pytest.raises(ConfigError, match=r"keeps a replay memory.*its default is 300"):
        resolve_config(smoke(remembering, er_memory_size=0))


def test_memory_keys_without_replay_or_with_the_reservoir_are_refused():
    with pytest.raises(ConfigError, match="er_memory is set but experience replay is off"):
        resolve_config(smoke("finetune_online", er_memory="herding"))
    with pytest.raises(ConfigError, match="er_memory_per_class is set but experience replay"):
        resolve_config(smoke("finetune_online", er_memory_per_class=5))
    with pytest.raises(ConfigError, match="quota of the class-balanced memories"):
        resolve_config(smoke("er_online", er_memory_per_class=5))
    with pytest.raises(ConfigError, match="er_memory"):
        resolve_config(smoke("er_online", er_memory="fifo"))
    with pytest.raises(ConfigError, match="er_memory_per_class"):
        resolve_config(smoke("er_online", er_memory="herding", er_memory_per_class=0))


def test_pilots_memory_keys_name_the_online_ones():
    with pytest.raises(ConfigError, match="er_memory_per_class"):
        resolve_config(smoke("er_online", memory_per_class=20))
    with pytest.raises(ConfigError, match="er_memory_size"):
        resolve_config(smoke("er_online", memory_size=2000))


def test_generated_configs_take_the_methods_own_defaults(remembering):
    config = make_exps().paper_config("remembering", "base", blurry=False)
    assert config["init_lr"] == 5e-5 and config["logit_mask"] == "seen"
    assert (config["er_memory"], config["er_memory_size"]) == ("herding", 300)
    resolve_config(config)  # and it is a valid config
    plain = make_exps().paper_config("finetune", "base", blurry=False)
    assert plain["logit_mask"] == "batch"  # no declared mask: the shared default


def test_replay_declares_its_keys_once():
    """The declaration is the one place: the class's config_keys start with its keys (a reservoir
    states its size alone), a subclass that changes the declaration gets the new defaults, and a
    config_keys that states a replay key itself is refused with the fix."""
    assert list(Remembering.config_keys)[:3] == [
        "er_memory_size",
        "er_memory",
        "er_memory_per_class",
    ]
    assert [k.default for k in Remembering.config_keys.values()][:3] == [300, "herding", 20]
    assert Remembering.config_keys["er_memory_size"].doc == "replay memory size (a test)"

    class Smaller(Remembering):
        replay: ClassVar[Replay | None] = Replay(50)

    assert {k: v.default for k, v in Smaller.config_keys.items()} == {"er_memory_size": 50}

    class Forgetting(Remembering):
        replay: ClassVar[Replay | None] = None

    assert Forgetting.config_keys == {}

    with pytest.raises(TypeError, match=r"states er_memory_size.*Replay\(memory_size="):

        class Restating(FinetuneOnline):
            replay: ClassVar[Replay | None] = Replay(300)
            config_keys: ClassVar[dict[str, ConfigKey]] = {"er_memory_size": ConfigKey(9, "x")}

    with pytest.raises(ValueError, match="reservoir keeps no per-class quota"):
        Replay(100, per_class=5)
    with pytest.raises(ValueError, match="fifo"):
        Replay(100, memory="fifo")

"""The baseline rows without PILOT: replay config rules, the ReplayMixin in the loop and session,
the fine-tuning / linear-probe adapters on a stand-in network, and the paper's row names.

Model: ``features = relu(body(x))``, ``logits = fc(features)`` over C classes. Expected values
come from the definitions (which classes a batch holds, cross-entropy written out, class means of
fixed features), never from the loop's own output.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pilot_online.core.streams import clear_stream
from pilot_online.engine.adapter import MethodAdapter, StepOutput
from pilot_online.engine.config import ConfigError, load_json, resolve_config
from pilot_online.engine.mixins import ReplayMixin, build_loop
from pilot_online.engine.registry import method_card
from pilot_online.engine.session import ArrayDataSource, OnlineSession
from pilot_online.harness.report import collect, format_table, variant_label
from pilot_online.methods.finetune import EROnline, FinetuneOnline
from pilot_online.methods.linear_probe import ERLinearProbeOnline, LinearProbeOnline

ROOT = Path(__file__).resolve().parent.parent
D_IN, HIDDEN, C = 5, 8, 6
ROWS = ("finetune_online", "linear_probe_online", "er_online", "er_linear_probe_online")


def smoke(row: str, **changes) -> dict:
    config = load_json(ROOT / "exps" / f"smoke_{row}.json")
    config.update(changes)
    return config


# -- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("row", ROWS)
def test_smoke_configs_resolve_with_the_paper_replay_settings(row):
    cfg = resolve_config(smoke(row))
    assert cfg["backbone_type"] == "vit_base_patch16_224" and cfg["pretrained"] is False
    assert cfg["backbone_kwargs"] == {"img_size": 32} and cfg["dataset"] == "synthetic_small"
    paper = resolve_config(load_json(ROOT / "exps" / f"{row}_base.json"))
    if row.startswith("er_"):
        assert (paper["er_memory_size"], paper["er_batch_size"]) == (1000, 100)  # the paper's
    else:
        assert paper["er_memory_size"] == 0  # memory-free: replay off


def test_paper_configs_run_at_the_best_learning_rate_of_hp_grid():
    best = {"finetune": 0.01, "linear_probe": 0.005, "er": 5e-5, "er_linear_probe": 0.01}
    for name, lr in best.items():
        assert load_json(ROOT / "exps" / f"{name}_online_fgh_blurry.json")["init_lr"] == lr


@pytest.mark.parametrize("row", ["finetune_online", "linear_probe_online", "coda_online"])
def test_replay_on_a_memory_free_row_needs_allow_memory(row):
    config = smoke("er_online", model_name=row) if row != "coda_online" else None
    if config is None:
        config = load_json(ROOT / "exps" / "smoke_coda_online.json")
    config.pop("er_batch_size", None)
    config["er_memory_size"] = 500
    with pytest.raises(ConfigError, match=r"memory-free.*allow_memory"):
        resolve_config(config)
    config["allow_memory"] = True
    assert resolve_config(config)["er_memory_size"] == 500


def test_er_rows_need_a_memory_and_stray_replay_keys_fail():
    with pytest.raises(ConfigError, match="er_memory_size must be > 0"):
        resolve_config(smoke("er_online", er_memory_size=0))
    with pytest.raises(ConfigError, match="er_batch_size is set but experience replay is off"):
        resolve_config(smoke("finetune_online", er_batch_size=10))
    with pytest.raises(ConfigError, match="er_memory_size must be a non-negative integer"):
        resolve_config(smoke("er_online", er_memory_size=-1))
    with pytest.raises(ConfigError, match="allow_memory must be true or false"):
        resolve_config(smoke("finetune_online", allow_memory="yes"))


def test_plain_vit_rows_name_the_backbones_they_accept():
    with pytest.raises(ConfigError, match="choose one of vit_base_patch16_224"):
        resolve_config(smoke("finetune_online", backbone_type="vit_base_patch16_224_l2p"))
    cfg = resolve_config(smoke("linear_probe_online", backbone_type="vit_base_patch16_224_in21k"))
    assert cfg["backbone_type"] == "vit_base_patch16_224_in21k"


# -- the replay mixin in the loop -----------------------------------------------------------------
class TinyNet(nn.Module):
    def __init__(self, frozen_body: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(D_IN, HIDDEN)
        self.fc = nn.Linear(HIDDEN, C)
        self.body.requires_grad_(not frozen_body)


class TinyAdapter(MethodAdapter):
    base_model_name = "tiny"

    def forward(self, network, x, train):
        features = torch.relu(network.body(x))
        return StepOutput(network.fc(features), features)

    def classifier(self, network):
        return network.fc


class GradRecorder:
    """Records the loss terms and gradients each step saw (calls super() in every hook)."""

    def __init__(self, *args, **kwargs) -> None:
        self.grads, self.batches = [], []
        super().__init__(*args, **kwargs)

    def loss_terms(self, out, labels):
        self.batches.append(labels.clone())
        return super().loss_terms(out, labels)

    def after_backward(self) -> None:
        super().after_backward()
        self.grads.append(self.network.fc.weight.grad.clone())


def replay_config(**changes) -> dict:
    config = {
        "optimizer": "sgd",
        "init_lr": 0.1,
        "logit_mask": "batch",
        "er_memory_size": 100,
        "er_batch_size": 3,
        "seed": 0,
    }
    config.update(changes)
    return config


def make_data(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    labels = np.repeat(np.arange(C), 4)  # 24 samples, 4 per class
    centers = 2 * torch.randn(C, D_IN, generator=generator)
    inputs = centers[labels] + torch.randn(len(labels), D_IN, generator=generator)
    return inputs, torch.as_tensor(labels)


class Loader:
    """The data source's ``train_samples``, recording what replay asked for."""

    def __init__(self, inputs, labels) -> None:
        self.inputs, self.labels, self.requests = inputs, labels, []

    def __call__(self, indices):
        self.requests.append(np.array(indices))
        index = torch.as_tensor(np.array(indices))
        return self.inputs[index], self.labels[index]


def make_replay_loop(config, mixins=(), frozen_body=False):
    torch.manual_seed(0)
    loop_cls = build_loop(TinyAdapter(), TinyNet(frozen_body), config, C).__class__
    if mixins:
        loop_cls = type("TestLoop", (*mixins, loop_cls), {})
    torch.manual_seed(0)
    return loop_cls(TinyAdapter(), TinyNet(frozen_body), config, C)


def test_build_loop_adds_replay_only_when_the_memory_is_on():
    assert isinstance(make_replay_loop(replay_config()), ReplayMixin)
    assert not isinstance(make_replay_loop(replay_config(er_memory_size=0)), ReplayMixin)


def test_mask_covers_stream_and_memory_classes_and_loss_is_their_mean_ce():
    inputs, labels = make_data()
    loop = make_replay_loop(replay_config(), mixins=(GradRecorder,))
    loader = Loader(inputs, labels)
    loop.attach_samples(loader)
    first = np.array([0, 1, 4, 5])  # classes 0 and 1
    second = np.array([8, 9, 12, 13])  # classes 2 and 3
    loop.train_step(inputs[first], labels[first], first)
    assert loader.requests == []  # nothing stored yet: the first step replays nothing
    before = copy.deepcopy(loop.network)
    stats = loop.train_step(inputs[second], labels[second], second)

    drawn = loader.requests[0]
    assert len(drawn) == 3 and set(drawn) <= set(first)  # drawn before this batch was stored
    memory_classes = set(labels[drawn].tolist())
    # fc rows get gradient exactly for classes in the stream batch or the memory batch.
    rows_with_grad = set(torch.nonzero(loop.grads[1].abs().sum(1) > 0).flatten().tolist())
    assert rows_with_grad == {2, 3} | memory_classes
    # The loss: CE over the 7 samples, logits masked to those classes, written out by hand.
    batch = np.concatenate([second, drawn])
    logits = before.fc(torch.relu(before.body(inputs[batch])))
    allowed = torch.zeros(C, dtype=torch.bool)
    allowed[list({2, 3} | memory_classes)] = True
    masked = logits.masked_fill(~allowed, float("-inf"))
    expected = -(masked.log_softmax(1)[torch.arange(7), labels[batch]]).mean()
    torch.testing.assert_close(stats.loss, expected.detach())
    assert loop.batches[1].tolist() == labels[batch].tolist()
    # Counters count stream samples only.
    assert stats.samples == 4 and loop.samples_seen == 8
    assert loop.memory.num_seen == 8 and loop.memory.size == 8


def test_without_replay_old_classes_get_no_gradient():
    # The contrast case: the same second batch, memory-free, leaves rows 0 and 1 untouched.
    inputs, labels = make_data()
    loop = make_replay_loop(replay_config(er_memory_size=0), mixins=(GradRecorder,))
    for index in (np.array([0, 1, 4, 5]), np.array([8, 9, 12, 13])):
        loop.train_step(inputs[index], labels[index], index)
    assert set(torch.nonzero(loop.grads[1].abs().sum(1) > 0).flatten().tolist()) == {2, 3}


def test_prototypes_average_stream_samples_only():
    inputs, labels = make_data()
    config = replay_config(online_prototypes=True, er_batch_size=8)
    loop = make_replay_loop(config, frozen_body=True)  # fixed features: means by hand
    loop.attach_samples(Loader(inputs, labels))
    stream = [np.array([0, 4, 1]), np.array([2, 5, 8]), np.array([3, 9, 10])]
    for index in stream:
        loop.train_step(inputs[index], labels[index], index)
    seen = np.concatenate(stream)
    features = torch.relu(loop.network.body(inputs[seen])).detach()
    for c in (0, 1, 2):
        expected = features[labels[seen] == c].mean(0)
        torch.testing.assert_close(loop.prototypes.means[c], expected)
    assert int(loop.prototypes.counts.sum()) == len(seen) == loop.samples_seen


def test_replay_needs_indices_and_a_loader():
    inputs, labels = make_data()
    loop = make_replay_loop(replay_config())
    with pytest.raises(ValueError, match="dataset indices"):
        loop.train_step(inputs[:2], labels[:2])
    loop.train_step(inputs[:2], labels[:2], np.array([0, 1]))  # empty memory: no load needed
    with pytest.raises(RuntimeError, match="attach_samples"):
        loop.train_step(inputs[2:4], labels[2:4], np.array([2, 3]))


# -- through a session: histogram in the results, determinism -----------------------------------
def run_session(tmp_path: Path, capacity: int, name: str) -> dict:
    generator = np.random.default_rng(0)
    train_y = np.repeat(np.arange(C), [5, 3, 4, 6, 2, 7])
    test_y = np.repeat(np.arange(C), 2)
    train_x = generator.integers(0, 255, (len(train_y), 4, 4, 3), dtype=np.uint8)
    test_x = generator.integers(0, 255, (len(test_y), 4, 4, 3), dtype=np.uint8)
    data = ArrayDataSource(train_x, train_y, test_x, test_y)

    class PixelAdapter(TinyAdapter):
        def forward(self, network, x, train):
            return super().forward(network, x.reshape(len(x), -1)[:, :D_IN], train)

    stream = clear_stream(train_y, init_cls=2, increment=2, batch_size=4, seed=0)
    config = replay_config(er_memory_size=capacity, online_prototypes=True)
    torch.manual_seed(0)
    loop = build_loop(PixelAdapter(), TinyNet(), config, C)
    session = OnlineSession(loop, stream, data, config, tmp_path / name, progress=False)
    for task in range(stream.num_tasks):
        session.train_task(task)
        session.evaluate_task_end(task)
    return session.write()


def test_results_report_memory_size_and_class_histogram(tmp_path):
    roomy = run_session(tmp_path, 100, "roomy.results.json")
    replay = roomy["extra"]["diagnostics"]["experience_replay"]
    # Capacity above the 27-sample stream: the memory holds the whole stream.
    assert replay["size"] == 27 and replay["class_histogram"] == [5, 3, 4, 6, 2, 7]
    assert roomy["counters"]["samples_seen"] == 27 and roomy["counters"]["optimizer_steps"] == 8
    assert roomy["extra"]["diagnostics"]["prototypes"]["samples"] == 27
    small = run_session(tmp_path, 5, "small.results.json")["extra"]["diagnostics"]
    assert small["experience_replay"]["size"] == 5
    assert sum(small["experience_replay"]["class_histogram"]) == 5


def test_same_seed_same_replay_run(tmp_path):
    first = run_session(tmp_path, 5, "a.results.json")
    second = run_session(tmp_path, 5, "b.results.json")
    assert first["metrics"] == second["metrics"]
    assert first["extra"]["diagnostics"] == second["extra"]["diagnostics"]


def test_array_source_train_samples_match_the_stream_batches():
    images = np.arange(5 * 2 * 2 * 3, dtype=np.uint8).reshape(5, 2, 2, 3)
    source = ArrayDataSource(images, np.arange(5), images[:1], np.arange(1))
    x, y = source.train_samples(np.array([3, 1]))
    bx, by = next(iter(source.train_batches([np.array([3, 1])])))
    assert torch.equal(x, bx) and y.tolist() == by.tolist() == [3, 1]


# -- the adapters on a stand-in for PILOT's SimpleVitNet ------------------------------------------
class PlainVit(nn.Module):
    """SimpleVitNet's shape: ``backbone`` (features) and ``fc`` (one nn.Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Dropout(0.5))
        self.fc = nn.Linear(HIDDEN, C)


@pytest.mark.parametrize("adapter_cls", [FinetuneOnline, EROnline])
def test_finetune_trains_backbone_and_fc(adapter_cls):
    network = PlainVit()
    adapter = adapter_cls(args={})
    loop = build_loop(adapter, network, {"optimizer": "sgd", "init_lr": 0.1}, C)
    before = copy.deepcopy(network)
    x, y = torch.randn(4, D_IN), torch.tensor([0, 1, 0, 1])
    loop.train_step(x, y, np.arange(4))
    assert not torch.equal(before.backbone[0].weight, network.backbone[0].weight)
    assert not torch.equal(before.fc.weight, network.fc.weight)


@pytest.mark.parametrize("adapter_cls", [LinearProbeOnline, ERLinearProbeOnline])
def test_linear_probe_trains_only_fc_and_keeps_the_backbone_deterministic(adapter_cls):
    network = PlainVit()
    network.backbone.requires_grad_(False)  # what build_network does to PILOT's backbone
    adapter = adapter_cls(args={})
    loop = build_loop(adapter, network, {"optimizer": "sgd", "init_lr": 0.1}, C)
    assert [n for n, _ in loop.named_parameters] == ["fc.weight", "fc.bias"]
    x = torch.randn(4, D_IN)
    adapter.set_mode(network, train=True)
    # The frozen backbone runs as a fixed extractor (eval: no dropout), the fc trains.
    assert not network.backbone.training and network.fc.training
    out = adapter.forward(network, x, train=True)
    torch.testing.assert_close(out.features, network.backbone(x))
    before = copy.deepcopy(network)
    loop.train_step(x, torch.tensor([0, 1, 0, 1]), np.arange(4))
    assert torch.equal(before.backbone[0].weight, network.backbone[0].weight)
    assert not torch.equal(before.fc.weight, network.fc.weight)


def test_plain_vit_rows_force_pilot_hard_coded_backbone_options():
    """PILOT's plain-ViT branch hard-codes ``pretrained=True`` and no dropout: the config's values
    are forced, the config's own ``backbone_kwargs`` on top."""
    from pilot_online.engine.backbone_names import factory_overrides

    args = {"pretrained": False, "drop": 0.1, "drop_path": 0.2, "backbone_kwargs": {"img_size": 32}}
    plain_vit = method_card("finetune_online").backbone_types[0]
    assert factory_overrides({**args, "backbone_type": plain_vit}) == {
        "pretrained": False,
        "drop_rate": 0.1,
        "drop_path_rate": 0.2,
        "img_size": 32,
    }
    assert EROnline.replay is not None and ERLinearProbeOnline.replay is not None
    assert FinetuneOnline.replay is None and LinearProbeOnline.replay is None


# -- report ---------------------------------------------------------------------------------------
def test_report_lists_the_paper_row_names_in_the_paper_order(tmp_path):
    results = run_session(tmp_path, 5, "er.results.json")
    folder = tmp_path / "table"
    folder.mkdir()
    for model_name in ("coda_online", "er_online", "finetune_online"):
        copy_ = json.loads(json.dumps(results))
        copy_["config"]["model_name"] = model_name
        path = folder / f"{model_name}.results.json"
        path.write_text(json.dumps(copy_))
    table = format_table(collect([folder])).splitlines()
    rows = table[2 : table.index("")]  # a blank line ends the table
    assert [line.split("  ")[0].strip() for line in rows] == ["Fine-tuning", "ER", "CODA"]


@pytest.mark.parametrize(
    ("config", "label"),
    [
        ({"model_name": "er_online", "er_memory_size": 1000}, "base"),
        ({"model_name": "coda_online", "er_memory_size": 1000, "allow_memory": True}, "+ ER"),
        (
            {"model_name": "er_linear_probe_online", "er_memory_size": 10, "online_prototypes": 1},
            "+ P",
        ),
    ],
)
def test_variant_label_marks_replay_added_to_a_memory_free_row(config, label):
    assert variant_label(config) == label


def test_cross_entropy_reference_matches_torch():
    # Guards the hand-written CE above: it is the definition F.cross_entropy implements.
    logits, target = torch.randn(3, 4), torch.tensor([0, 3, 1])
    manual = -(logits.log_softmax(1)[torch.arange(3), target]).mean()
    torch.testing.assert_close(manual, F.cross_entropy(logits, target))

"""``icarl_online``'s behaviour (``pilot_online/methods/icarl.py``) on a toy network of
``IncrementalNet``'s shape (``backbone`` -> features, ``fc`` -> logits), through the online loop:
the distillation term is upstream's ``_KD_loss`` worked out by hand, the teacher is taken at
firings only, the herding memory keeps upstream's quota and herding picks, a checkpoint keeps the
teacher and the memory, and bad keys are refused before any work.
(tests/test_upstream_icarl.py runs upstream's own code.)"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import raw_smoke_config, unit_config
from torch import nn

from pilot_online.engine.adapter import StepOutput, TrainingBatch
from pilot_online.engine.checkpoint import load_checkpoint, save_checkpoint
from pilot_online.engine.config import ConfigError, resolve_config
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.engine.teacher import distillation_loss
from pilot_online.harness.protocol import HP_GRID
from pilot_online.methods.icarl import ICaRLOnline

C = 6
#: Six stream batches of four: classes 0-1, 0-1, 2-3, 2-3, 4-5, 4-5. With two new classes per
#: firing, the trigger fires before batches 2 and 4 (each brings a third class since the last).
LABELS = torch.tensor([0, 1, 0, 1, 0, 1, 1, 0, 2, 3, 2, 3, 2, 3, 3, 2, 4, 5, 4, 5, 5, 4, 4, 5])
X = torch.randn(len(LABELS), 5, generator=torch.Generator().manual_seed(1))


class TinyIncremental(nn.Module):
    """``IncrementalNet`` at toy size: ``backbone`` gives the features, ``fc`` the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(5, 4), nn.Tanh())
        self.fc = nn.Linear(4, C)


def make_loop(**overrides):
    config = unit_config(
        ICaRLOnline,
        C,
        consolidation="new_classes",
        consolidation_new_classes=2,
        er_memory_size=6,
        er_batch_size=3,
        **overrides,
    )
    torch.manual_seed(0)
    loop = build_loop(ICaRLOnline(args=config), TinyIncremental(), config, C)
    loop.attach_samples(lambda indices: (X[torch.as_tensor(indices)], LABELS[indices]))
    return loop


def step(loop, i: int):
    rows = np.arange(4 * i, 4 * i + 4)
    return loop.train_step(X[rows], LABELS[rows], rows)


# -- the distillation term --------------------------------------------------------------------
def kd_by_hand(student, teacher, columns, temperature) -> float:
    """Upstream's ``_KD_loss(pred, soft, T)`` written out: ``-sum_i sum_j softmax(soft_i / T)_j *
    log_softmax(pred_i / T)_j / rows``, over ``columns`` only."""
    total = 0.0
    for s_row, t_row in zip(student, teacher):
        s = [s_row[j] / temperature for j in columns]
        t = [t_row[j] / temperature for j in columns]
        log_norm = math.log(sum(math.exp(v) for v in s))
        t_norm = sum(math.exp(v) for v in t)
        total += sum(math.exp(tv) / t_norm * (sv - log_norm) for sv, tv in zip(s, t))
    return -total / len(student)


STUDENT = [[1.0, 2.0, 9.0], [0.0, 1.0, -3.0]]
TEACHER = [[2.0, 0.0, 5.0], [1.0, 1.0, 7.0]]


@pytest.mark.parametrize(
    "known", [[True, True, False], [True, False, True]], ids=["prefix", "mask"]
)
@pytest.mark.parametrize("temperature", [2.0, 0.5])
def test_distillation_is_upstreams_kd_loss_over_the_known_classes(known, temperature):
    student = torch.tensor(STUDENT, requires_grad=True)
    value = distillation_loss(student, torch.tensor(TEACHER), torch.tensor(known), temperature)
    columns = [j for j, k in enumerate(known) if k]
    assert value.item() == pytest.approx(kd_by_hand(STUDENT, TEACHER, columns, temperature), 1e-6)
    value.backward()  # an unknown class's logit gets no gradient, as upstream's slice gives it
    unknown = [j for j, k in enumerate(known) if not k]
    assert torch.all(student.grad[:, unknown] == 0) and torch.all(student.grad[:, columns] != 0)


def test_the_term_reads_the_teacher_over_every_row_with_the_configs_temperature():
    adapter = ICaRLOnline(args={"T": 0.5})
    known = torch.tensor([True, True, False])
    out = StepOutput(torch.tensor(STUDENT), torch.zeros(2, 1))
    inputs = torch.zeros(2, 1)
    batch = TrainingBatch(inputs, torch.tensor([0, 2]), 1, known | True, known, None)
    assert set(adapter.loss_terms(None, out, batch)) == {"ce"}  # first task: no old network
    batch.teacher = StepOutput(torch.tensor(TEACHER), torch.zeros(2, 1))
    terms = adapter.loss_terms(None, out, batch)
    assert terms["kd"].item() == pytest.approx(kd_by_hand(STUDENT, TEACHER, [0, 1], 0.5), 1e-6)


# -- through the loop -------------------------------------------------------------------------
def test_the_teacher_is_taken_at_firings_only():
    loop = make_loop()
    states, teachers, terms = [], [], []
    for i in range(6):
        states.append(copy.deepcopy(loop.network.state_dict()))
        terms.append(set(step(loop, i).terms))
        teachers.append(loop.teacher)
    assert teachers[0] is None and teachers[1] is None
    assert terms[:2] == [{"ce"}, {"ce"}] and all("kd" in t for t in terms[2:])
    assert teachers[2] is teachers[3] and teachers[4] is teachers[5] is not teachers[2]
    for firing, before in ((0, 2), (1, 4)):  # the state before the firing's step, frozen
        teacher = teachers[before]
        assert teacher.firing == firing and not teacher.module.training
        for name, value in teacher.module.state_dict().items():
            assert torch.equal(value, states[before][name]), name
    assert teachers[2].classes.tolist() == [True, True, False, False, False, False]
    assert loop.known.tolist() == [True, True, True, True, False, False]


def herd_by_hand(vectors: np.ndarray, target: np.ndarray, count: int) -> list[int]:
    """Upstream's greedy herding rule, written out: each pick is the row whose addition brings
    the picked rows' mean nearest ``target`` (the first such row on ties)."""
    picked: list[int] = []
    for k in range(1, count + 1):
        total = vectors[picked].sum(0) if picked else np.zeros(vectors.shape[1])
        distances = [
            np.inf if i in picked else float(np.linalg.norm(target - (total + v) / k))
            for i, v in enumerate(vectors)
        ]
        picked.append(int(np.argmin(distances)))
    return picked


def unit(features: torch.Tensor) -> np.ndarray:
    v = features.detach().double().numpy()
    return v / (np.linalg.norm(v, axis=1, keepdims=True) + 1e-8)


def test_the_memory_keeps_upstreams_quota_and_herding_picks():
    """Capacity 6: 3 per class while two classes are seen (upstream's ``memory_size // total``),
    then 1 each of four, the old classes keeping their herding order's first (``_reduce_exemplar``
    keeps ``[:m]``). Each pick is herding over the class's stored exemplars and its batch samples,
    against the mean of every feature the class streamed (the training forward's, pre-update)."""
    loop = make_loop()
    features = {}  # row -> its normalised features when its step ran
    for i in range(2):
        rows = np.arange(4 * i, 4 * i + 4)
        with torch.no_grad():
            features.update(zip(rows.tolist(), unit(loop.network.backbone(X[rows]))))
        step(loop, i)
    assert loop.memory.class_histogram(C).tolist() == [3, 3, 0, 0, 0, 0]
    for c in (0, 1):
        first = [r for r in range(4) if LABELS[r] == c]  # both kept: the quota is 3
        second = [r for r in range(4, 8) if LABELS[r] == c]
        vectors = np.stack([features[r] for r in first + second])
        picks = herd_by_hand(vectors, vectors.mean(0), 3)
        assert loop.memory.stored[c].tolist() == [(first + second)[p] for p in picks]
    kept = {c: loop.memory.stored[c].tolist() for c in (0, 1)}
    step(loop, 2)  # classes 2 and 3: four classes share 6 slots
    assert loop.memory.class_histogram(C).tolist() == [1, 1, 1, 1, 0, 0]
    assert [loop.memory.stored[c].tolist() for c in (0, 1)] == [kept[0][:1], kept[1][:1]]


def test_a_fixed_quota_per_class_is_one_key_away():
    loop = make_loop(er_memory_per_class=2)  # upstream's fixed_memory true, memory_per_class 2
    for i in range(2):
        step(loop, i)
    assert loop.memory.class_histogram(C).tolist() == [2, 2, 0, 0, 0, 0]


def test_a_checkpoint_keeps_the_teacher_and_the_memory(tmp_path):
    loop = make_loop()
    for i in range(3):
        step(loop, i)
    path = tmp_path / "icarl.ckpt"
    save_checkpoint(path, loop.state_dict(), loop.config)
    resumed = make_loop()
    resumed.load_state_dict(load_checkpoint(path, resumed.config))
    assert resumed.teacher.firing == 0 and torch.equal(resumed.known, loop.known)
    for name, value in loop.teacher.module.state_dict().items():
        assert torch.equal(resumed.teacher.module.state_dict()[name], value), name
    for i in range(3, 6):  # the next firing, and the steps around it, bit for bit
        a, b = step(loop, i), step(resumed, i)
        assert torch.equal(a.loss, b.loss) and a.terms.keys() == b.terms.keys()
    for (name, p), q in zip(loop.network.named_parameters(), resumed.network.parameters()):
        assert torch.equal(p, q), name
    assert {c: v.tolist() for c, v in loop.memory.stored.items()} == {
        c: v.tolist() for c, v in resumed.memory.stored.items()
    }


# -- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"T": 0}, r"icarl_online: T must be"),
        ({"T": "2"}, r"icarl_online: T must be"),
        ({"consolidation": "never"}, r"takes no teacher"),
        ({"er_memory_size": 0}, r"keeps a replay memory \(replay = Replay\(\)\).*default is 2000"),
        ({"er_memory": "fifo"}, r"er_memory.*reservoir.*class_balanced.*herding"),
        ({"er_memory": "reservoir", "er_memory_per_class": 5}, r"er_memory_per_class is a quota"),
    ],
)
def test_bad_keys_are_refused_before_any_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config({**raw_smoke_config("icarl_online"), **overrides})


def test_the_defaults_are_upstreams_memory_and_ers_learning_rate():
    """Replay declared (no ER subclass): upstream's 2000, herding, ``fixed_memory: false``; the
    teacher at each ``new_classes`` firing; the LR of the paper's ER row (hp_grid Best HP), the
    whole-ViT method with a memory it searched; the generated paper configs use it."""
    from conftest import make_exps

    cfg = resolve_config(raw_smoke_config("icarl_online"))
    assert (cfg["er_memory"], cfg["er_memory_per_class"], cfg["T"]) == ("herding", None, 2.0)
    assert cfg["consolidation"] == "new_classes"
    assert ICaRLOnline.config_keys["er_memory_size"].default == 2000
    assert ICaRLOnline.replay is not None and ICaRLOnline.consolidation.teacher
    assert method_card("icarl_online").default_lr == HP_GRID["er"].best_lr == 5e-5
    paper = make_exps().paper_config("icarl", "base", blurry=True)
    assert (paper["init_lr"], paper["optimizer"], paper["logit_mask"]) == (5e-5, "adam", "batch")

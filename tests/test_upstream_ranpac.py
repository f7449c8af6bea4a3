"""``ranpac_online`` against upstream's own code (PILOT ``models/ranpac.py``,
``backbone/linears.py``, ``backbone/vit_ssf.py``).

The port claims upstream's statistics and head (``replace_fc``: ``G``, ``Q``, the ridge solve and
the ``CosineLinear`` on ``relu(f W_rand)``), upstream's ridge search (``optimise_ridge_parameter``)
on the same split, statistics taken in eval mode, the first session's cosine head, the whole SSF
ViT training in the first session, and evaluation with the analytic head from the start. Upstream's
``Learner`` runs here without its network (built with ``Learner.__new__``), on features of a
stand-in backbone that both sides share. The ``test_difference_*`` tests assert each difference
the card's ``upstream_differences`` declares; the two it shares with FeCAM are checked by helpers
that ``test_upstream_fecam.py`` runs on FeCAM.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from conftest import requires_pilot, smoke_config
from torch import nn

from pilot_online.core.cosine_head import attach_cosine_head
from pilot_online.engine.mixins import build_loop
from pilot_online.methods.ranpac import UNSEEN_LOGIT, FirstSessionAnalyticOnline, RanPACOnline

pytestmark = requires_pilot

DIM, M, CLASSES = 4, 6, 4
PLAIN = "vit_base_patch16_224"  # a backbone name without a PETL marker: the backbone trains whole


class Extractor(nn.Module):
    """What upstream's ``replace_fc`` calls on its model: ``eval``, ``extract_vector`` (RanPAC)
    and ``backbone`` (FeCAM), over our stand-in network's backbone."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def extract_vector(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)


def attached(method: type[FirstSessionAnalyticOnline], backbone: nn.Module, **overrides):
    """``method``'s adapter attached to a stand-in network (``backbone`` on DIM-d inputs, the
    first session's cosine head), with its loop."""
    short = method.__name__.removesuffix("Online").lower()
    keys = {"M": M} if method is RanPACOnline else {}
    config = smoke_config(f"{short}_online", num_classes=CLASSES, **keys, **overrides)
    network = nn.Module()
    network.backbone, network.feature_dim = backbone, DIM
    attach_cosine_head(network, DIM, CLASSES)
    adapter = method(args=config)
    torch.manual_seed(0)
    adapter.attach(network, config)
    return adapter, network, build_loop(adapter, network, config, num_classes=CLASSES)


def task_data(classes: tuple[int, ...], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(classes).repeat(n // len(classes))
    x = torch.randn(n, DIM, generator=g) + 2 * F.one_hot(y, DIM).float()
    return x, y


def loader(x: torch.Tensor, y: torch.Tensor, batch: int = 4) -> list[tuple]:
    """PILOT's ``(index, inputs, targets)`` batches."""
    return [(None, x[i : i + batch], y[i : i + batch]) for i in range(0, len(y), batch)]


def held_last(x: torch.Tensor, y: torch.Tensor, every: int = 5):
    """The stream reordered so that our held-out samples (every ``every``-th) come last: then
    upstream's split (fit on the first 80%, score on the last 20%) is ours."""
    held = torch.arange(len(y)) % every == every - 1
    order = torch.cat([torch.nonzero(~held).flatten(), torch.nonzero(held).flatten()])
    return x[order], y[order]


def upstream_ranpac(network: nn.Module, sigma: float = 1.0):
    """Upstream's ``Learner`` after ``setup_RP``, on our ``W_rand``, without its network."""
    from backbone.linears import CosineLinear
    from models.ranpac import Learner

    learner = Learner.__new__(Learner)
    fc = CosineLinear(M, CLASSES)
    fc.sigma.data.fill_(sigma)
    vars(learner).update(
        _device="cpu",
        args={"nb_classes": CLASSES, "M": M},
        W_rand=network.W_rand.clone(),
        Q=torch.zeros(M, CLASSES),
        G=torch.zeros(M, M),
        _network=SimpleNamespace(fc=fc),
    )
    return learner


def stream(loop, x: torch.Tensor, y: torch.Tensor, batch: int = 4) -> None:
    for i in range(0, len(y), batch):
        loop.train_step(x[i : i + batch], y[i : i + batch])


# -- the claims ---------------------------------------------------------------------------------
def test_statistics_and_head_equal_upstreams_replace_fc(pilot_on_path) -> None:
    """Two tasks; upstream's ``replace_fc`` after each, ours over the stream. ``G`` and ``Q``
    agree; with upstream's ridge of the second task, our solve is its head, and our logits its
    ``CosineLinear``'s (sigma carried over from the first session)."""
    adapter, network, loop = attached(
        RanPACOnline, nn.Identity(), tune_first_session=False, consolidation_new_classes=2
    )
    with torch.no_grad():
        network.fc_sigma.fill_(1.3)
    upstream = upstream_ranpac(network, sigma=1.3)
    model = Extractor(nn.Identity())
    for classes, seed in (((0, 1), 0), ((2, 3), 1)):
        x, y = task_data(classes, 10, seed)
        stream(loop, x, y)
        upstream.replace_fc(loader(x, y), model, None)
    assert loop.trigger.firings == [10]
    torch.testing.assert_close(adapter.stats["gram"].float(), upstream.G, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adapter.stats["cross"].float(), upstream.Q, rtol=1e-5, atol=1e-5)
    x2, y2 = task_data((2, 3), 10, 1)
    h = F.relu(x2 @ upstream.W_rand)
    ridge = upstream.optimise_ridge_parameter(h, F.one_hot(y2, CLASSES).float())
    head = adapter.solve(float(ridge))["analytic_weight"]
    theirs = upstream._network.fc.weight.data
    torch.testing.assert_close(head, theirs, rtol=1e-4, atol=1e-5)
    queries = torch.randn(5, DIM, generator=torch.Generator().manual_seed(9))
    network.analytic_weight.copy_(head)
    network.analytic_seen.fill_(True)  # every class has statistics now
    logits = adapter.forward(network, queries, train=False).logits
    expected = upstream._network.fc(F.relu(queries @ upstream.W_rand))["logits"]
    torch.testing.assert_close(logits, expected.detach(), rtol=1e-4, atol=1e-5)


def test_the_firing_solves_upstreams_replace_fc_with_its_own_ridge(pilot_on_path) -> None:
    """The head a firing writes (and the ridge it keeps) is upstream's ``replace_fc`` on the
    first task, ridge search included: no ridge is handed in. The task's samples are given to
    upstream with our held-out ones last (``held_last``), where its ridge split is ours; ``G`` and
    ``Q`` are sums, the same in any order."""
    adapter, network, loop = attached(
        RanPACOnline, nn.Identity(), tune_first_session=False, consolidation_new_classes=2
    )
    x1, y1 = task_data((0, 1), 10, 21)
    x2, y2 = task_data((2, 3), 10, 22)
    stream(loop, x1, y1)
    loop.train_step(x2[:4], y2[:4])  # new classes: the firing, on the first task's statistics
    assert loop.trigger.firings == [10]
    upstream = upstream_ranpac(network)
    xs, ys = held_last(x1, y1)
    upstream.replace_fc(loader(xs, ys), Extractor(nn.Identity()), None)
    features = F.relu(xs @ upstream.W_rand)
    ridge = float(upstream.optimise_ridge_parameter(features, F.one_hot(ys, CLASSES).float()))
    assert ridge != 1.0  # not the grid's middle, what a firing without held-out samples takes
    assert adapter.ridge == ridge
    torch.testing.assert_close(
        network.analytic_weight, upstream._network.fc.weight.data, rtol=1e-4, atol=1e-5
    )


def test_evaluation_before_the_first_firing_is_upstreams_analytic_head(pilot_on_path) -> None:
    """In the first session, before any firing, evaluation predicts with the analytic head of the
    samples so far: upstream's ``replace_fc`` and ``CosineLinear`` after its first task (the
    stream reordered for upstream so that both hold out the same samples)."""
    adapter, network, loop = attached(RanPACOnline, nn.Identity(), consolidation_new_classes=2)
    x, y = task_data((0, 1), 10, 2)
    stream(loop, x, y)
    assert loop.trigger.firings == [] and adapter.trains and loop.optimizer_steps == 3
    upstream = upstream_ranpac(network, sigma=float(network.fc_sigma.detach()))
    upstream.replace_fc(loader(*held_last(x, y)), Extractor(nn.Identity()), None)
    queries = torch.randn(5, DIM, generator=torch.Generator().manual_seed(3))
    with loop.evaluation_view():
        logits = adapter.forward(network, queries, train=False).logits
    expected = upstream._network.fc(F.relu(queries @ upstream.W_rand))["logits"].detach()
    torch.testing.assert_close(logits[:, :2], expected[:, :2], rtol=1e-4, atol=1e-5)  # its task
    assert not network.analytic_weight.any()  # training's head: solved at a firing only


def test_statistics_are_taken_in_eval_mode_as_upstreams_replace_fc(pilot_on_path) -> None:
    """A backbone with dropout: the first step's statistics are those of upstream's
    ``replace_fc`` (``model.eval()``) on the backbone as it was before the step."""
    torch.manual_seed(4)
    backbone = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.5))
    adapter, network, loop = attached(
        RanPACOnline, backbone, backbone_type=PLAIN, consolidation_new_classes=2
    )
    before = copy.deepcopy(backbone)
    x, y = task_data((0, 1), 4, 5)
    loop.train_step(x, y)
    assert loop.optimizer_steps == 1 and not torch.equal(backbone[0].weight, before[0].weight)
    upstream = upstream_ranpac(network)
    upstream.replace_fc(loader(x, y), Extractor(before), None)
    torch.testing.assert_close(adapter.stats["gram"].float(), upstream.G, rtol=1e-5, atol=1e-5)


def test_first_session_head_equals_upstreams_cosine_linear(pilot_on_path) -> None:
    """``SimpleVitNet``'s first-session head (``CosineLinear``, learnable sigma) and ours: logits
    and the gradients of rows and sigma."""
    from backbone.linears import CosineLinear

    upstream = CosineLinear(DIM, CLASSES)
    network = nn.Module()
    ours = attach_cosine_head(network, DIM, CLASSES)
    with torch.no_grad():
        upstream.sigma.fill_(0.8)
        ours.weight.copy_(upstream.weight)
        network.fc_sigma.fill_(0.8)
    x, y = task_data((0, 1, 2, 3), 8, 6)
    theirs = upstream(x)["logits"]
    torch.testing.assert_close(ours(x), theirs, rtol=0, atol=1e-6)
    F.cross_entropy(theirs, y).backward()
    F.cross_entropy(ours(x), y).backward()
    torch.testing.assert_close(ours.weight.grad, upstream.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(network.fc_sigma.grad, upstream.sigma.grad, rtol=1e-5, atol=1e-7)


def test_the_ssf_vit_trains_whole_as_upstream(pilot_on_path) -> None:
    """Upstream's ``get_backbone`` freezes nothing of the SSF ViT and its optimiser takes every
    parameter: the first session trains all of ``vit_ssf.VisionTransformer``, SSF and ViT."""
    from backbone import vit_ssf

    vit = vit_ssf.VisionTransformer(
        img_size=32, patch_size=16, embed_dim=24, depth=1, num_heads=2, num_classes=0
    )
    upstream_trained = {n for n, p in vit.named_parameters() if p.requires_grad}
    assert any("ssf_scale" in n for n in upstream_trained)
    assert any(n.endswith("qkv.weight") for n in upstream_trained)
    _, network, _ = attached(
        RanPACOnline, vit, backbone_type="pretrained_vit_b16_224_ssf", consolidation_new_classes=2
    )
    ours = {n.removeprefix("backbone.") for n, p in network.named_parameters() if p.requires_grad}
    assert ours == upstream_trained | {"fc.weight", "fc_sigma"}


# -- the declared differences (the first two shared with FeCAM) -----------------------------------
def check_first_session_until_first_firing(method: type[FirstSessionAnalyticOnline]) -> None:
    """The backbone and the head train at every step until the trigger's first firing (a class
    beyond the first 2), then nothing trains; upstream trains ``tuned_epoch`` epochs."""
    torch.manual_seed(7)
    backbone = nn.Linear(DIM, DIM)
    adapter, network, loop = attached(
        method, backbone, backbone_type=PLAIN, consolidation_new_classes=2
    )
    x, y = task_data((0, 1), 8, 8)
    stream(loop, x, y)
    assert loop.optimizer_steps == 2 and adapter.trains and loop.trigger.firings == []
    frozen = [p.detach().clone() for p in network.parameters()]
    x2, y2 = task_data((2, 3), 8, 9)
    stream(loop, x2, y2)
    assert loop.trigger.firings == [8] and loop.optimizer_steps == 2 and not adapter.trains
    assert all(torch.equal(a, b) for a, b in zip(frozen, network.parameters()))


def check_statistics_from_the_first_step(
    method: type[FirstSessionAnalyticOnline], statistic: str, upstream_statistic
) -> None:
    """After a first session of two steps, the statistics hold each step's features from the
    backbone as it was at that step; upstream's ``replace_fc`` passes the task again through the
    final backbone. ``upstream_statistic(backbone, x, y)``: upstream's value of ``statistic``."""
    torch.manual_seed(10)
    backbone = nn.Linear(DIM, DIM)
    adapter, _, loop = attached(method, backbone, backbone_type=PLAIN, consolidation_new_classes=2)
    x, y = task_data((0, 1), 8, 11)
    first = copy.deepcopy(backbone)
    loop.train_step(x[:4], y[:4])
    second = copy.deepcopy(backbone)
    loop.train_step(x[4:], y[4:])
    ours = adapter.stats[statistic].float()
    per_step = upstream_statistic(first, x[:4], y[:4]) + upstream_statistic(second, x[4:], y[4:])
    torch.testing.assert_close(ours, per_step, rtol=1e-5, atol=1e-5)
    final = upstream_statistic(backbone, x, y)
    assert not torch.allclose(ours, final, rtol=1e-3, atol=1e-3)


def check_unseen_classes_below_seen(method: type[FirstSessionAnalyticOnline]) -> None:
    """After classes 0 and 1 (no firing yet), evaluation scores classes 2 and 3 with
    ``UNSEEN_LOGIT`` plus the first session's head: below both seen classes."""
    adapter, network, loop = attached(method, nn.Identity(), consolidation_new_classes=2)
    x, y = task_data((0, 1), 8, 14)
    stream(loop, x, y)
    queries = torch.randn(5, DIM, generator=torch.Generator().manual_seed(15))
    with loop.evaluation_view():
        logits = adapter.forward(network, queries, train=False).logits
    expected = UNSEEN_LOGIT + network.fc(queries).detach()[:, 2:]
    torch.testing.assert_close(logits[:, 2:], expected)
    assert logits[:, 2:].max() < logits[:, :2].min()


def test_difference_first_session_until_first_firing(pilot_on_path) -> None:
    check_first_session_until_first_firing(RanPACOnline)


def test_difference_unseen_classes_below_seen(pilot_on_path) -> None:
    check_unseen_classes_below_seen(RanPACOnline)


def test_difference_statistics_from_the_first_step(pilot_on_path) -> None:
    w_rand = {}

    def upstream_gram(backbone: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        learner = upstream_ranpac(SimpleNamespace(W_rand=w_rand["W"]))
        learner.replace_fc(loader(x, y), Extractor(backbone), None)
        return learner.G

    torch.manual_seed(0)  # attached() seeds 0 before W_rand is drawn
    w_rand["W"] = torch.randn(DIM, M)
    check_statistics_from_the_first_step(RanPACOnline, "gram", upstream_gram)


def test_difference_ridge_from_held_out_statistics(pilot_on_path) -> None:
    """Our ridge is upstream's ``optimise_ridge_parameter`` on the whole stream so far with every
    5th sample held out (reordered last), not on the last 20% of the current task."""
    adapter, network, loop = attached(
        RanPACOnline, nn.Identity(), tune_first_session=False, consolidation_new_classes=2
    )
    x1, y1 = task_data((0, 1), 10, 12)
    x2, y2 = task_data((2, 3), 10, 13)
    x, y = torch.cat([x1, x2]), torch.cat([y1, y2])
    stream(loop, x, y)
    upstream = upstream_ranpac(network)
    xs, ys = held_last(x, y)
    h = F.relu(xs @ upstream.W_rand)
    whole = float(upstream.optimise_ridge_parameter(h, F.one_hot(ys, CLASSES).float()))
    assert adapter.select() == whole
    assert torch.equal(adapter.stats["n_ho"], torch.tensor(4.0, dtype=torch.float64))


def test_difference_w_rand_drawn_at_build(pilot_on_path) -> None:
    """``W_rand`` exists (a buffer) before any statistics, as upstream's ``setup_RP`` would draw
    it at its first boundary: the same draw from the same random state."""
    from models.ranpac import Learner

    torch.manual_seed(0)
    adapter, network, _ = attached(RanPACOnline, nn.Identity(), consolidation_new_classes=2)
    assert "W_rand" in dict(network.named_buffers()) and adapter.samples == 0
    learner = Learner.__new__(Learner)
    vars(learner).update(
        _device="cpu",
        args={"M": M, "nb_classes": CLASSES},
        _network=SimpleNamespace(fc=nn.Linear(DIM, CLASSES)),
    )
    torch.manual_seed(0)  # the state attached() draws from
    learner.setup_RP()
    torch.testing.assert_close(network.W_rand, learner.W_rand, rtol=0, atol=0)

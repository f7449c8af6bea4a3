"""``ease_online`` against upstream's own code (PILOT ``models/ease.py``, ``backbone/vit_ease.py``,
``backbone/linears.py``).

The port claims upstream's proxy head (``EaseCosineLinear`` with its learnable sigma), upstream's
adapter forward (``forward_train`` for the active subspace, ``forward_proto`` / ``forward_test``
for every subspace), and upstream's prototype complement and prediction (``solve_sim_reset``, then
``forward_reweight``). Each runs here on a tiny ``vit_ease.VisionTransformer`` (32 px, 2 blocks,
width 24) or on the same class means, next to ours. The ``test_difference_*`` tests assert each
difference the card's ``upstream_differences`` declares.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from conftest import classification_term, requires_pilot, stream_step
from torch import nn

from pilot_online import get_method
from pilot_online.core.cosine_head import attach_cosine_head
from pilot_online.core.masks import mask_logits
from pilot_online.engine.adapter import StepOutput
from pilot_online.methods.ease import EaseOnline, complemented_prototypes, reweighted_logits

pytestmark = requires_pilot

WIDTH, CLASSES = 24, 6


def tiny_vit(dropout: float = 0.0) -> nn.Module:
    """Upstream's ``vit_ease.VisionTransformer`` as PILOT's ``get_backbone`` configures it, tiny,
    with three adapter sets: two frozen in ``adapter_list`` (``add_adapter_to_list``, upstream's
    ``after_task``) and the current one. Up-projections are drawn (upstream starts them at zero,
    which would make every subspace the same)."""
    from backbone import vit_ease
    from easydict import EasyDict

    config = EasyDict(
        ffn_adapt=True,
        ffn_option="parallel",
        ffn_adapter_layernorm_option="none",
        ffn_adapter_init_option="lora",
        ffn_adapter_scalar="0.1",
        ffn_num=8,
        d_model=WIDTH,
        vpt_on=False,
        vpt_num=0,
        _device="cpu",
    )
    torch.manual_seed(0)
    vit = vit_ease.VisionTransformer(
        img_size=32, patch_size=16, embed_dim=WIDTH, depth=2, num_heads=2, num_classes=0,
        global_pool=False, drop_path_rate=0.0, tuning_config=config,
    )  # fmt: skip
    vit.add_adapter_to_list()
    vit.add_adapter_to_list()
    for adapters in (*vit.adapter_list, vit.cur_adapter):
        for adapter in adapters:
            nn.init.normal_(adapter.up_proj.weight, std=0.5)
            adapter.dropout = dropout
    return vit.eval()


def ours_on(vit: nn.Module, **args) -> tuple[EaseOnline, nn.Module]:
    """Our adapter on a network whose subspaces are the very adapter sets of ``vit``."""
    adapter = get_method("ease_online")(
        args={"alpha": 0.1, "nb_classes": CLASSES, "adapter_dropout": 0.0, "seed": 0, **args}
    )
    network = nn.Module()
    network.backbone, network.out_dim = vit, WIDTH
    network.subspaces = nn.ModuleList([*vit.adapter_list, vit.cur_adapter])
    from pilot_online.core.prototypes import PrototypeBank

    network.class_means = nn.ModuleList(PrototypeBank(CLASSES, WIDTH) for _ in range(3))
    attach_cosine_head(network, WIDTH, CLASSES)
    adapter.opened_at = [0, 1]
    return adapter, network


def images(n: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_proxy_head_equals_upstreams_ease_cosine_linear(pilot_on_path) -> None:
    """Logits and the gradients of rows and sigma: ``EaseCosineLinear`` and ours, same state."""
    from backbone.linears import EaseCosineLinear

    upstream = EaseCosineLinear(WIDTH, CLASSES)
    network = nn.Module()
    ours = attach_cosine_head(network, WIDTH, CLASSES)
    with torch.no_grad():
        upstream.sigma.fill_(1.7)
        ours.weight.copy_(upstream.weight)
        network.fc_sigma.copy_(upstream.sigma)
    x = torch.randn(7, WIDTH, generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 1, 2, 3, 4, 5, 0])
    theirs_logits, ours_logits = upstream(x)["logits"], ours(x)
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=0, atol=1e-6)
    F.cross_entropy(theirs_logits, labels).backward()
    F.cross_entropy(ours_logits, labels).backward()
    torch.testing.assert_close(ours.weight.grad, upstream.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(network.fc_sigma.grad, upstream.sigma.grad, rtol=1e-5, atol=1e-7)
    assert list(ours.parameters()) == [ours.weight]  # FGH's class-wise rows: the weight alone


def test_adapter_forward_equals_upstreams_forward_train_and_forward_test(pilot_on_path) -> None:
    """Training: the active (current) set's features are ``forward_train``'s; evaluation: every
    subspace's are ``forward_test``'s concatenation, each one ``forward_proto(adapt_index=i)``'s."""
    vit = tiny_vit()
    adapter, network = ours_on(vit)
    x = images()
    with torch.no_grad():
        train = adapter.forward(network, x, train=True)
        test = adapter.forward(network, x, train=False)
        torch.testing.assert_close(train.features, vit.forward_train(x), rtol=0, atol=1e-6)
        concatenated = vit.forward(x, test=True)
        torch.testing.assert_close(
            test.extras["subspaces"], concatenated.view(len(x), 3, WIDTH).transpose(0, 1)
        )
        for index in range(3):
            proto = vit.forward_proto(x, adapt_index=index)
            torch.testing.assert_close(test.extras["subspaces"][index], proto, rtol=0, atol=1e-6)
            if index < 2:
                frozen = train.extras["frozen"][index]
                torch.testing.assert_close(frozen, proto, rtol=0, atol=1e-6)
    assert not torch.allclose(test.extras["subspaces"][0], test.extras["subspaces"][2])


def upstream_learner(tasks: int, per_task: int, means: torch.Tensor):
    """Upstream's ``Learner`` (built without its network) holding what ``solve_sim_reset`` reads
    after ``replace_fc`` of the last task of a clear stream: class c of task t has its real mean
    in subspaces 0..t (``fc.weight``'s blocks)."""
    from backbone.linears import EaseCosineLinear
    from models.ease import Learner

    fc = EaseCosineLinear(tasks * WIDTH, tasks * per_task)
    fc.reset_parameters_to_zero()
    for c in range(tasks * per_task):
        for s in range(c // per_task + 1):
            fc.weight.data[c, s * WIDTH : (s + 1) * WIDTH] = means[s, c]
    learner = Learner.__new__(Learner)
    vars(learner).update(
        _cur_task=tasks - 1,
        _network=SimpleNamespace(fc=fc, out_dim=WIDTH),
        _total_classes=tasks * per_task,
        _known_classes=(tasks - 1) * per_task,
        _device="cpu",
        init_cls=per_task,
        inc=per_task,
        moni_adam=False,
        use_init_ptm=False,
        adapter_num=-1,
    )
    return learner


def test_complement_and_prediction_equal_upstreams_solve_sim_reset_and_forward_reweight(
    pilot_on_path,
) -> None:
    """Three tasks of two classes: upstream's ``solve_sim_reset`` fills the old classes' blocks
    in the newer subspaces; ours synthesises the same means from the same real ones. Then the
    prediction: ``forward_reweight`` on upstream's filled head against our logits from the banks
    (class c's home subspace is its task's)."""
    tasks, per_task = 3, 2
    means = torch.randn(tasks, CLASSES, WIDTH, generator=torch.Generator().manual_seed(4))
    learner = upstream_learner(tasks, per_task, means)
    learner.solve_sim_reset()
    filled = learner._network.fc.weight.data.view(CLASSES, tasks, WIDTH).transpose(0, 1)
    task = torch.arange(CLASSES) // per_task
    counts = (torch.arange(tasks)[:, None] <= task[None]).long() * 3  # real: s <= task(c)
    ours = complemented_prototypes(means * counts[..., None].bool(), counts, task)
    torch.testing.assert_close(ours, filled, rtol=1e-5, atol=1e-6)
    features = torch.randn(tasks, 4, WIDTH, generator=torch.Generator().manual_seed(5))
    theirs = learner._network.fc.forward_reweight(
        torch.cat(list(features), dim=1),
        cur_task=tasks - 1,
        alpha=0.1,
        init_cls=per_task,
        inc=per_task,
        out_dim=WIDTH,
    )["logits"]
    # Our prediction from running banks: bank s holds the samples since subspace s opened.
    adapter, network = ours_on(tiny_vit())
    for s, bank in enumerate(network.class_means):
        bank.means.copy_(means[s] * counts[s, :, None].bool())
        bank.counts.copy_(counts[s])  # every sample of a task-t class: banks 0..t
    banks_counts = torch.stack([b.counts for b in network.class_means])
    trained = torch.cat([banks_counts[:-1] - banks_counts[1:], banks_counts[-1:]])
    assert trained.argmax(0).tolist() == task.tolist()  # the home subspace is the task's
    logits = adapter.prototype_logits(network, features)
    torch.testing.assert_close(logits, theirs.detach(), rtol=1e-5, atol=1e-6)


# -- the declared differences ------------------------------------------------------------------
def test_difference_proxy_head_over_every_class(pilot_on_path) -> None:
    """Upstream's proxy head covers the task's classes with targets shifted by the known ones
    (``aux_targets``); ours covers every class and the batch mask leaves the task's: the same
    loss on the same rows."""
    from backbone.linears import EaseCosineLinear

    network = nn.Module()
    ours = attach_cosine_head(network, WIDTH, CLASSES)
    upstream = EaseCosineLinear(WIDTH, 2)  # the second task's two classes, 2 and 3
    with torch.no_grad():
        upstream.weight.copy_(ours.weight[2:4])
    assert ours.out_features == CLASSES and upstream.out_features == 2
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(6))
    labels = torch.tensor([2, 3, 3, 2])
    theirs = F.cross_entropy(upstream(x)["logits"], labels - 2)
    batch = torch.zeros(CLASSES, dtype=torch.bool)
    batch[labels] = True
    loss = classification_term(
        get_method("ease_online")(), network, StepOutput(ours(x), x), labels, batch
    )
    torch.testing.assert_close(loss, theirs.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.isclose(F.cross_entropy(ours(x), labels), theirs)  # unmasked: not theirs
    assert mask_logits(ours(x), batch)[:, [0, 1, 4, 5]].max() < -1e30


def test_difference_running_class_means(pilot_on_path) -> None:
    """The active subspace's class means average the training forward's features (adapter
    dropout on); upstream's ``replace_fc`` takes ``forward_proto`` in eval mode afterwards."""
    vit = tiny_vit(dropout=0.5)
    adapter, network = ours_on(vit)
    x, labels = images(6), torch.tensor([0, 0, 0, 1, 1, 1])
    adapter.set_mode(network, train=True)
    torch.manual_seed(3)
    out = adapter.forward(network, x, train=True)
    adapter.after_step(network, stream_step(out, labels, x))
    active = network.class_means[2].means
    torch.testing.assert_close(active[0], out.features[:3].mean(0).detach())
    vit.eval()
    with torch.no_grad():
        upstream = vit.forward_proto(x, adapt_index=2)
        frozen = vit.forward_proto(x, adapt_index=0)
    assert not torch.allclose(active[0], upstream[:3].mean(0), atol=1e-4)
    # The frozen subspaces' means are upstream's (no dropout there: eval-mode passes).
    torch.testing.assert_close(network.class_means[0].means[1], frozen[3:].mean(0))


def test_difference_home_subspace_by_majority(pilot_on_path) -> None:
    """Class 0 trains 2 samples while subspace 0 is active and 4 after subspace 1 opened: its
    home is subspace 1 (weight 1 there), where upstream's class ranges put it in task 0. Class 1
    (4 samples, then 1) keeps home 0: there ours is upstream's."""
    from backbone.linears import EaseCosineLinear

    adapter, network = ours_on(tiny_vit())
    network.subspaces = network.subspaces[:2]
    means = torch.randn(2, CLASSES, WIDTH, generator=torch.Generator().manual_seed(7))
    network.class_means[0].means[:2] = means[0, :2]
    network.class_means[0].counts[:2] = torch.tensor([6, 5])  # bank 0: every sample
    network.class_means[1].means[:2] = means[1, :2]
    network.class_means[1].counts[:2] = torch.tensor([4, 1])
    features = torch.randn(2, 3, WIDTH, generator=torch.Generator().manual_seed(8))
    logits = adapter.prototype_logits(network, features)
    home = torch.tensor([1, 0, 0, 0, 0, 0])
    expected = reweighted_logits(features, means, home, 0.1)
    torch.testing.assert_close(logits[:, :2], expected[:, :2])
    head = EaseCosineLinear(2 * WIDTH, 2)  # upstream: classes 0 and 1 are task 0's
    head.weight.data = torch.cat([means[0, :2], means[1, :2]], dim=1)
    theirs = head.forward_reweight(
        torch.cat(list(features), dim=1), cur_task=1, alpha=0.1, init_cls=2, inc=2, out_dim=WIDTH
    )["logits"]
    assert not torch.allclose(logits[:, 0], theirs[:, 0].detach(), atol=1e-4)
    torch.testing.assert_close(logits[:, 1], theirs[:, 1].detach(), rtol=1e-5, atol=1e-6)


def test_difference_unseen_classes_score_with_the_proxy_head(pilot_on_path) -> None:
    """Classes 4 and 5 have no mean anywhere: they score the cosine of the newest subspace's
    feature with their proxy-head rows (upstream's head would have no row for them yet)."""
    adapter, network = ours_on(tiny_vit())
    for bank in network.class_means:
        bank.means[:4] = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(16))
        bank.counts[:4] = 2
    features = torch.randn(3, 5, WIDTH, generator=torch.Generator().manual_seed(17))
    logits = adapter.prototype_logits(network, features)
    rows = F.normalize(network.fc.weight[4:].detach(), dim=1)
    torch.testing.assert_close(logits[:, 4:], F.normalize(features[-1], dim=1) @ rows.T)


def test_difference_seeded_new_subspace(pilot_on_path) -> None:
    """Upstream's ``get_new_adapter`` draws from the global random stream; ours, at a firing,
    from the run's seed and the firing: the same set whatever was drawn before."""
    vit = tiny_vit()
    drawn = []
    for seed in (10, 11):
        torch.manual_seed(seed)
        vit.get_new_adapter()
        drawn.append(vit.cur_adapter[0].down_proj.weight.detach().clone())
    assert not torch.equal(drawn[0], drawn[1])
    ours = []
    for seed in (10, 11):
        adapter, network = ours_on(tiny_vit())
        torch.manual_seed(seed)
        adapter.consolidate(network, 2)
        ours.append(network.subspaces[-1][0].down_proj.weight.detach().clone())
        assert len(network.subspaces) == 4
    torch.testing.assert_close(ours[0], ours[1], rtol=0, atol=0)
    bound = 1 / math.sqrt(WIDTH)  # kaiming_uniform(a=sqrt(5)): upstream's LoRA init range
    assert float(ours[0].abs().max()) <= bound
    np.testing.assert_array_equal(network.subspaces[-1][0].up_proj.weight.detach().numpy(), 0)

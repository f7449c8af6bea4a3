"""The method contract: what every registered method must do, checked for each one the registry
holds, so a new adapter file gets these tests with no other edit.

Per method, on its smoke config (32 px, random weights, PILOT's network from the patched copy):

- its ``backbone_type`` names are ones PILOT's ``get_backbone`` builds for its upstream model;
- its smoke config passes ``pilot-online check-config``;
- it builds, with a linear online head over every class that reads the features it returns;
- evaluation does not depend on batching: each sample's logits are the same alone, in batches of
  7 and 256 and in a permuted order, to 1e-5 absolute (CPU matmuls round per batch shape, ~1e-6),
  with equal top-3 predictions; in training mode too, without the prompt vote or dropout;
- one step of the base row and of + P + FGH learns something (the classifier, or the buffers
  of a method that trains nothing), with a finite loss; + P + FGH reports its prototypes and FGH
  coefficients;
- a checkpoint round trip (``engine/checkpoint.py``) after the + P + FGH step: a loop rebuilt from
  the file on a freshly built network takes the same next step as the loop that wrote it (the
  same loss bit for bit; the same parameters to rounding);
- two runs through PILOT's ``main.py`` on the tiny stream, (clear, base) and (Si-Blurry,
  + P + FGH), with test_pilot_integration.py's end-to-end checks.

``test_a_new_method_is_one_file`` proves the promise behind all this: it copies the
package, adds one adapter file, and runs this suite on the new method alone.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    REPO,
    TinyAdapter,
    TinyNet,
    build_network,
    contract_runs,
    copy_pilot,
    raw_smoke_config,
    requires_pilot,
    smoke_config,
    vit_depth_for_tests,
)
from test_batch_invariance import NUM_CLASSES, NUM_TEST_IMAGES, evaluate
from test_pilot_integration import check_online_run

from pilot_online import get_method, list_methods
from pilot_online.engine.adapter import trained_parameters
from pilot_online.engine.checkpoint import load_checkpoint, save_checkpoint
from pilot_online.engine.config import VARIANTS
from pilot_online.engine.mixins import build_loop
from pilot_online.engine.registry import method_card
from pilot_online.engine.session import ArrayDataSource

METHODS = list_methods()
#: Each method's runs through ``main.py`` (conftest's ``contract_runs``).
MAIN_RUNS = [
    pytest.param(name, variant, stream, id=f"{name}-{variant}-{stream}")
    for name in METHODS
    for variant, stream in contract_runs(name)
]
#: Absolute tolerance of batch invariance (fp32 on the CPU: different batch shapes round apart).
ATOL = 1e-5


def scaled_atol(reference: torch.Tensor) -> float:
    """ATOL relative to the values' scale: float32 rounding grows with magnitude, and some
    methods' logits are large by design (RanPAC's ridge head over random-projection features)."""
    return ATOL * max(1.0, float(reference.abs().max()))


# -- without a network ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", METHODS)
def test_smoke_config_passes_check_config(name, tmp_path, capsys):
    from pilot_online.cli.main import main

    path = tmp_path / f"smoke_{name}.json"
    path.write_text(json.dumps(raw_smoke_config(name)))
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out == f"ok      {path}\n"


@requires_pilot
@pytest.mark.parametrize("name", METHODS)
def test_backbone_types_are_names_pilot_builds(pilot_on_path, name):
    """Each ``backbone_types`` name is one ``get_backbone`` compares against (the plain ViTs and
    the APER family's exact names), or a ViT that PILOT's prompt backbones register with timm."""
    import timm
    from backbone import (  # noqa: F401 (registration)
        vit_coda_promtpt,
        vit_dualprompt,
        vit_l2p,
        vit_lae,
    )

    source = (pilot_on_path / "utils" / "inc_net.py").read_text()
    body = source[source.index("def get_backbone(") :]
    body = body[: re.search(r"\n(?=\S)", body).start()]  # to the next top-level statement
    registered = set(timm.list_models())
    names = method_card(name).backbone_types
    assert names, f"{name}'s card declares no backbone_types"
    unbuilt = [n for n in names if f'"{n}"' not in body and n not in registered]
    assert not unbuilt, f"{name}: PILOT's get_backbone builds none of {unbuilt}"


# -- errors that name the fix -----------------------------------------------------------------
def test_a_head_pilot_never_builds_is_refused_before_training():
    """PILOT builds heads in update_fc, never called online: ``SimpleVitNet.fc`` stays None. A
    port that returns it fails when the loop is built, with the helper that fixes it named."""

    class Headless(TinyAdapter):
        def classifier(self, network):
            return None

    with pytest.raises(ValueError, match=r"classifier\(\) returned None.*self\.online_head"):
        build_loop(Headless(), TinyNet(), {}, 6)
    adapter = TinyAdapter()
    network = TinyNet()
    network.fc = None
    head = adapter.online_head(network, {"nb_classes": 6}, in_features=8)
    assert network.fc is head and (head.in_features, head.out_features) == (8, 6)
    build_loop(adapter, network, {}, 6)  # the fixed port builds


def test_hard_coded_pretrained_weights_name_the_adapter_fix(monkeypatch, tmp_path):
    """PILOT's plain-ViT factory asks for weights whatever the config says: offline, the error
    says so and names where the engine's rule goes, not the ``"pretrained": false`` already set."""
    import timm

    from pilot_online.pilot.backbones import WeightsUnavailableError, timm_overrides

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(key, "http://127.0.0.1:9")  # closed loopback port: no network
    with pytest.raises(WeightsUnavailableError) as caught, timm_overrides(config_pretrained=False):
        timm.create_model("vit_tiny_patch16_224", pretrained=True)  # as PILOT hard-codes it
    message = str(caught.value)
    assert 'The config sets "pretrained": false' in message
    assert "factory_overrides()" in message and 'set "pretrained": false' not in message


# -- on the method's network, built once per method --------------------------------------------
Built = tuple  # (adapter, network, config)


@pytest.fixture(scope="module", params=METHODS)
def built(request, pilot_on_path) -> Built:
    """The method's adapter, network and resolved smoke config (tests run grouped by method,
    so one network is alive at a time), with the tests' ViT depth (as the runs through
    ``main.py``): the contract is about the method's plumbing, which 5 blocks exercise as 12 do."""
    depth = vit_depth_for_tests(raw_smoke_config(request.param))
    config = smoke_config(request.param, num_classes=NUM_CLASSES, vit_depth=depth)
    adapter = get_method(request.param)(args=config)
    return adapter, build_network(adapter, config), config


@pytest.fixture(scope="module")
def sample_images() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(NUM_TEST_IMAGES, 32, 32, 3), dtype=np.uint8)


def test_builds_with_an_online_head(built, sample_images):
    adapter, network, config = built
    assert config["backbone_type"] in method_card(config["model_name"]).backbone_types
    head = adapter.classifier(network)
    assert isinstance(head, torch.nn.Linear) and head.out_features == NUM_CLASSES
    trainable = dict(trained_parameters(network))
    assert bool(trainable) == adapter.trains
    adapter.set_mode(network, train=False)
    with torch.no_grad():
        out = adapter.forward(network, ArrayDataSource._to_tensor(sample_images[:3]), train=False)
    assert out.logits.shape == (3, NUM_CLASSES)
    assert out.features.shape == (3, head.in_features)
    assert torch.isfinite(out.logits).all()


def test_eval_predictions_do_not_depend_on_batching(built, sample_images):
    adapter, network, config = built
    identity = np.arange(NUM_TEST_IMAGES)
    reference, reference_logits = evaluate(adapter, network, config, sample_images, 1, identity)
    spread = (reference_logits - reference_logits[:1]).abs().max()
    # A method that trains nothing starts from an empty head (SimpleCIL: zero class means): its
    # logits are all zero before it sees data; its features are compared in training mode below.
    if adapter.trains:
        assert spread > 100 * ATOL, "degenerate test: every sample has the same logits"
    for batch_size in (7, 256):
        preds, logits = evaluate(adapter, network, config, sample_images, batch_size, identity)
        np.testing.assert_array_equal(preds, reference, err_msg=f"eval_batch_size {batch_size}")
        torch.testing.assert_close(
            logits, reference_logits, rtol=0, atol=scaled_atol(reference_logits)
        )
    order = np.random.default_rng(1).permutation(NUM_TEST_IMAGES)
    for batch_size in (7, 256):
        preds, logits = evaluate(adapter, network, config, sample_images, batch_size, order)
        np.testing.assert_array_equal(preds, reference[order], err_msg="permuted test order")
        torch.testing.assert_close(
            logits, reference_logits[order], rtol=0, atol=scaled_atol(reference_logits)
        )


def test_train_mode_logits_do_not_depend_on_batching(built, sample_images):
    """The batch-independent training path: no prompt vote, no dropout."""
    _, network, config = built
    assert config["drop"] == 0 and config["drop_path"] == 0, "dropout would differ per call"
    adapter = get_method(config["model_name"])(args={**config, "batchwise_prompt": False})
    adapter.set_mode(network, train=True)
    x = ArrayDataSource._to_tensor(sample_images)
    order = torch.from_numpy(np.random.default_rng(2).permutation(NUM_TEST_IMAGES))
    # A training forward may update method state by design (MVP counts key use): every call
    # starts from the same state, so only batch composition differs between the calls.
    state = {name: value.clone() for name, value in network.state_dict().items()}

    def forward(inputs: torch.Tensor):
        network.load_state_dict(state)
        return adapter.forward(network, inputs, train=True)

    with torch.no_grad():
        whole = forward(x)
        permuted = forward(x[order])
        split = [forward(chunk) for chunk in x[order].split([3, 6])]
    network.load_state_dict(state)
    for name in ("logits", "features"):
        reference = getattr(whole, name)[order]
        atol = scaled_atol(reference)
        torch.testing.assert_close(getattr(permuted, name), reference, rtol=0, atol=atol)
        in_chunks = torch.cat([getattr(out, name) for out in split])
        torch.testing.assert_close(in_chunks, reference, rtol=0, atol=atol)


# The training batches: 4 images of classes 0-3, then 4 of classes 2-5 (replay replays them).
STEP_IMAGES = ArrayDataSource._to_tensor(
    np.random.default_rng(3).integers(0, 256, size=(8, 32, 32, 3), dtype=np.uint8)
)
STEP_LABELS = torch.tensor([0, 1, 2, 3, 2, 3, 4, 5])


def smoke_row(config: dict) -> str:
    """+ P + FGH, or base for a method whose card cannot run it (SimpleCIL)."""
    return "fgh" if "fgh" in method_card(config["model_name"]).variants else "base"


def make_loop(adapter, network, config: dict, variant: str):
    """A loop for ``variant`` (a VARIANTS row) with a sample loader over the step images."""
    loop = build_loop(adapter, network, {**config, **VARIANTS[variant]}, NUM_CLASSES)
    loop.attach_samples(lambda indices: (STEP_IMAGES[indices], STEP_LABELS[indices]))
    return loop


def take_step(loop, step: int):
    indices = np.arange(4 * step, 4 * step + 4)
    return loop.train_step(STEP_IMAGES[indices], STEP_LABELS[indices], indices)


def test_one_step_of_the_base_row(built):
    adapter, network, config = copy.deepcopy(built)  # the tests after it start from ``built``
    loop = make_loop(adapter, network, config, "base")
    before = {k: v.clone() for k, v in network.state_dict().items()}
    stats = take_step(loop, 0)
    assert not stats.skipped and torch.isfinite(stats.loss), stats
    assert_learned(adapter, network, before)
    report = loop.report()
    assert "fgh" not in report and "prototypes" not in report


def test_p_fgh_steps_and_a_checkpoint_round_trip(built, tmp_path):
    """+ P + FGH (or the method's own row where it cannot run it): a step, a checkpoint, and the
    second step taken twice, by the loop that wrote the checkpoint and by a loop rebuilt from it
    on a freshly built network: the loss agrees bit for bit; parameters, buffers and logits to
    rounding (1e-5 relative)."""
    adapter, network, config = copy.deepcopy(built)  # the tests after it start from ``built``
    variant = smoke_row(config)
    resolved = {**config, **VARIANTS[variant]}
    loop = make_loop(adapter, network, config, variant)
    before = {k: v.clone() for k, v in network.state_dict().items()}
    stats = take_step(loop, 0)
    assert not stats.skipped and torch.isfinite(stats.loss), stats
    assert_learned(adapter, network, before)
    path = tmp_path / "method.ckpt.pt"
    save_checkpoint(path, loop.state_dict(), resolved)

    fresh_adapter = get_method(config["model_name"])(args=config)
    fresh = make_loop(fresh_adapter, build_network(fresh_adapter, config), config, variant)
    fresh.load_state_dict(load_checkpoint(path, resolved))
    first, second = take_step(loop, 1), take_step(fresh, 1)  # replay (if any) replays step 0
    assert not first.skipped and torch.equal(first.loss, second.loss)
    # The update itself may differ in the last bits: PILOT's prompt gathers accumulate their
    # gradients over duplicate indices in a thread-dependent order on the CPU.
    ours, theirs = fresh.network.state_dict(), network.state_dict()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-7, msg=key)
    x = STEP_IMAGES[:3]
    adapter.set_mode(network, train=False), fresh_adapter.set_mode(fresh.network, train=False)
    with torch.no_grad():
        expected = adapter.forward(network, x, train=False).logits
        logits = fresh_adapter.forward(fresh.network, x, train=False).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=ATOL)
    report = loop.report()
    if variant == "fgh":
        assert report["prototypes"]["samples"] == 8 and report["fgh"]["steps"] == 2
        assert report == fresh.report()


# One stream of 12 images in batches of 4, cut into segments two ways: the first cut evaluates
# (and could checkpoint) after 8 samples, the second only at the end. The second batch brings
# classes 2 and 3: with new_classes every 2, the trigger fires before it (sample 4), away from
# the segment end, so a method told about segment ends would consolidate once more in one cut.
SEGMENT_LABELS = np.array([0, 1, 0, 1, 2, 3, 2, 0, 1, 2, 3, 0], dtype=np.int64)
SEGMENT_IMAGES = np.random.default_rng(4).integers(0, 256, size=(12, 32, 32, 3), dtype=np.uint8)
SEGMENT_CUTS = ([8, 4], [12])  # the second: the one_segment fixture's


def train_segmented(built: Built, sizes: list[int], eval_period: int | None = None):
    """A copy of the built method trained on the 12-image stream cut into segments of ``sizes``
    (the session evaluates at every segment end, and a checkpoint would read the state there;
    with ``eval_period``, also every that many samples), with the consolidation trigger, if the
    method has one, firing at the same samples."""
    from pilot_online.core.streams import Stream
    from pilot_online.engine.session import OnlineSession

    adapter, network, config = copy.deepcopy(built)  # one copy: cross-references kept
    variant = smoke_row(config)
    config = {**config, **VARIANTS[variant], "eval_period": eval_period}
    if adapter.consolidation.trigger != "never":
        config.update(consolidation="new_classes", consolidation_new_classes=2)
    loop = build_loop(adapter, network, config, NUM_CLASSES)
    torch.manual_seed(0)  # the same random draws (oLoRA's fresh adapter at a plateau) in both
    tasks = np.split(np.arange(len(SEGMENT_LABELS)), np.cumsum(sizes)[:-1])
    stream = Stream("clear", tasks, SEGMENT_LABELS, batch_size=4, seed=0, params={})
    test_x, test_y = SEGMENT_IMAGES[:4], SEGMENT_LABELS[:4]
    data = ArrayDataSource(SEGMENT_IMAGES, SEGMENT_LABELS, test_x, test_y, eval_batch_size=4)
    session = OnlineSession(loop, stream, data, config, progress=False)
    for task in range(stream.num_tasks):
        session.train_task(task)
        session.complete_task(task)
        loop.state_dict()
    return loop


@pytest.fixture(scope="module")
def one_segment(built: Built):
    """The 12-image stream as one segment, evaluated at its end: ``train_segmented(built,
    [12])``, made once per method from that method's ``built`` (never from another test's)."""
    return train_segmented(built, [12])


def test_training_does_not_depend_on_segment_ends(built, one_segment):
    """No method reads a task id or a segment end: the same stream cut into segments of other
    lengths (evaluations and checkpoints at other steps) trains the same weights, with the
    consolidation trigger (if the method has one) firing at the same stream samples."""
    a, b = train_segmented(built, SEGMENT_CUTS[0]), one_segment
    assert a.optimizer_steps == b.optimizer_steps and a.samples_seen == b.samples_seen == 12
    assert a.trigger.firings == b.trigger.firings
    if a.adapter.consolidation.trigger != "never":
        assert a.trigger.firings == [4]
    # To rounding: PILOT's prompt gathers (L2P, DualPrompt) accumulate their gradients in a
    # thread-dependent order on the CPU, and Adam's first steps magnify it to about 4e-6.
    ours, theirs = a.network.state_dict(), b.network.state_dict()
    for key in [key for key in theirs if not torch.equal(ours[key], theirs[key])]:
        torch.testing.assert_close(
            ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )
    # The method's own state too: an extra consolidation at a segment end that leaves the
    # weights alone (RanPAC's and FeCAM's statistics, EASE's subspaces) still shows here.
    assert_same_state(
        a.adapter.state_dict(a.network), b.adapter.state_dict(b.network), "state_dict()"
    )


def assert_same_state(ours: object, theirs: object, where: str = "") -> None:
    """Equal nested training state (dicts, lists, tensors, numbers), tensors to rounding."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), where
        torch.testing.assert_close(
            ours, theirs, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}: {m}"
        )
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and set(ours) == set(theirs), where
        for key in theirs:
            assert_same_state(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), where
        for index, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_state(a, b, f"{where}[{index}]")
    elif isinstance(theirs, np.ndarray):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5, err_msg=where)
    else:
        assert ours == theirs, where


def test_training_does_not_depend_on_evaluations(built, one_segment):
    """Evaluation reads the training state and never writes it: the same stream evaluated after
    every batch (``eval_period`` 4, so every evaluation view is derived, used and dropped) and
    only at its end trains the same weights and the same method state (``state_dict``), with
    the same firings. A method that aligned, merged or drew random numbers for an evaluation in
    its training state fails here."""
    plain, evaluated = one_segment, train_segmented(built, [12], eval_period=4)
    assert evaluated.trigger.firings == plain.trigger.firings
    assert_same_state(
        evaluated.network.state_dict(), plain.network.state_dict(), "network.state_dict()"
    )
    assert_same_state(
        evaluated.adapter.state_dict(evaluated.network),
        plain.adapter.state_dict(plain.network),
        "adapter.state_dict()",
    )


def assert_learned(adapter, network, before: dict) -> None:
    """The step changed the network: the classifier's trainable parameters, or (a method that
    trains nothing) its buffers."""
    after = network.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the step changed nothing in the network"
    if adapter.trains:
        names = {id(p): n for n, p in network.named_parameters()}
        head = adapter.classifier(network)
        assert {names[id(p)] for p in head.parameters() if p.requires_grad} <= changed


# -- through PILOT's main.py ---------------------------------------------------------------------
@requires_pilot
@pytest.mark.parametrize(("name", "variant", "stream"), MAIN_RUNS)
def test_runs_through_pilot_main(pilot_main_run, name, variant, stream):
    report, results = pilot_main_run(name, variant, stream)
    assert results["config"]["model_name"] == name
    check_online_run(report, results, name, variant, stream)


# -- the promise: one file ----------------------------------------------------------------------
#: The porting page's example adapters: this test runs each, so the walk-throughs stay true.
PORTING_PAGE = REPO / "docs" / "porting.md"
EXAMPLE_MARKER = "<!-- contract-test: methods/"
WALKTHROUGH_MARKER = "<!-- walkthrough -->"


def porting_examples() -> list[tuple[str, str, str, str]]:
    """(file name, method name, source, walk-through) of each adapter docs/porting.md walks
    through: the first ``python`` block after each ``contract-test`` marker, and the first
    ``bash`` block after the next ``walkthrough`` marker, before the next example."""
    page = PORTING_PAGE.read_text(encoding="utf-8")
    sections = page.split(EXAMPLE_MARKER)[1:]
    assert sections, f"{PORTING_PAGE} lost its contract-test examples"
    examples = []
    for section in sections:
        file_name = section.split(" ", 1)[0].strip()
        source = section.split("```python\n", 1)[1].split("```", 1)[0]
        method = re.search(r'@register_method\("([a-z0-9_]+)"', source).group(1)
        assert WALKTHROUGH_MARKER in section, f"{PORTING_PAGE}: {method} has no walk-through"
        after = section.split(WALKTHROUGH_MARKER, 1)[1]
        commands = after.split("```bash\n", 1)[1].split("```", 1)[0]
        examples.append((file_name, method, source, commands))
    return examples


def fresh_clone(destination: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked and not ignored), copied."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


@requires_pilot
# Named by file, not by method: the walk-through's ``-k <method>`` must not select this test.
@pytest.mark.parametrize("example", porting_examples(), ids=lambda example: example[0])
def test_a_new_method_is_one_file(tmp_path, example):
    """In a copy of a fresh clone, save one of the porting page's examples as
    ``methods/<file>`` (nothing else), and run its walk-through exactly as written: configs,
    check-config, this suite on the new method alone (collected for every contract test and
    passing them all) and, where the page runs one, a run through a patched PILOT copy's
    ``main.py``."""
    file_name, method, source, commands = example
    clone = fresh_clone(tmp_path / "work" / "checkout")
    copy_pilot(tmp_path / "work" / "shared" / "LAMDA-PILOT")  # the page's ../shared, pristine
    (clone / "pilot_online" / "methods" / file_name).write_text(source)  # the one file

    env = {k: v for k, v in os.environ.items() if k != "PILOT_ROOT"}  # the page sets it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(clone), env.get("PYTHONPATH")]))
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert re.search(rf"ok\s+exps/smoke_{method}\.json", output), output[-3000:]
    if "main.py" in commands:
        results = list((clone / ".pilot" / "logs").rglob("*.results.json"))
        assert len(results) == 1, sorted((clone / ".pilot").rglob("*.json"))[:10]
        assert json.loads(results[0].read_text())["config"]["model_name"] == method
    per_method = [  # this module's tests that take a method (``name`` or ``built``)
        name
        for name, value in globals().items()
        if name.startswith("test_")
        and inspect.isfunction(value)
        and {"name", "built"} & set(inspect.signature(value).parameters)
    ]
    expected = len(per_method) + 1  # test_runs_through_pilot_main runs twice: both streams
    assert re.search(rf"\b{expected} passed\b", output), output[-3000:]
    assert "skipped" not in output, output[-3000:]

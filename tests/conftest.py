"""Shared test fixtures, doubles and the PILOT policy of the suite (tests import helpers with
``from conftest import ...``).

Doubles: ``TinyNet``/``TinyAdapter``, a two-layer model behind the adapter contract, and
``VectorSource``, a DataSource over in-memory vectors; with them the loop and the session run
without PILOT or images.

PILOT: the tests that need a real LAMDA-PILOT checkout (commit 5240714) take it from
``PILOT_ROOT``; CI's ``.ci/run`` sets it to ``../shared/LAMDA-PILOT`` when unset. They copy that
tree and patch the copy, never the original: the session records every file under
``PILOT_ROOT`` at its start and fails if any was added, removed or changed at its end.

Without ``PILOT_ROOT`` those tests are skipped with a reason that says how to enable them, unless
``PILOT_ONLINE_REQUIRE_PILOT=1`` (set by ``.ci/run``): then each such skip is a failure, so CI can
never pass while silently skipping the PILOT tests.

Upstream execution: a ``tests/test_upstream_<methods-file>.py`` module run whole with PILOT fails
at its last teardown if none of its tests called a function of the ``models/<name>.py`` its ports
claim (the section at the end of this file).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from pilot_online.engine.adapter import MethodAdapter, StepOutput, TrainedStep, TrainingBatch
from pilot_online.engine.registry import load_builtin_methods

#: tests/upstream_watch.py: a test_upstream_<stem>.py module must run the PILOT code it claims.
pytest_plugins = ["upstream_watch"]

# Every built-in method registered now, before a test swaps the registry for a scratch copy (the
# registry imports them on first use, which inside a scratch copy would register them there).
load_builtin_methods()

REQUIRE_PILOT_FLAG = "PILOT_ONLINE_REQUIRE_PILOT"
REQUIRE_PILOT = os.environ.get(REQUIRE_PILOT_FLAG, "") not in ("", "0")
ENABLE_PILOT_TESTS = (
    "point it at a LAMDA-PILOT checkout (commit 5240714), e.g. "
    "`PILOT_ROOT=../shared/LAMDA-PILOT make test`, to run the PILOT tests"
)
# Every skip for a missing PILOT (here and in test_patching.py) starts with these words.
PILOT_SKIP_PREFIX = "PILOT_ROOT is not set"
PILOT_SKIP_REASON = f"{PILOT_SKIP_PREFIX}: {ENABLE_PILOT_TESTS}"

# Absolute, so that subprocesses started in other folders see the same checkout.
PILOT_ROOT = os.path.abspath(os.environ["PILOT_ROOT"]) if os.environ.get("PILOT_ROOT") else None
if PILOT_ROOT:
    os.environ["PILOT_ROOT"] = PILOT_ROOT

requires_pilot = pytest.mark.skipif(not PILOT_ROOT, reason=PILOT_SKIP_REASON)

# --------------------------------------------------------------------------------------------
# The device fixture: the CPU always, CUDA too where there is one, so that `make test` on a GPU
# machine exercises the CUDA paths; PILOT_ONLINE_TEST_DEVICE=cpu|cuda forces one.

DEVICE_FLAG = "PILOT_ONLINE_TEST_DEVICE"
DEVICE_CHOICES = ("cpu", "cuda")
FORCED_DEVICE = os.environ.get(DEVICE_FLAG, "").strip().lower()


def devices_under_test() -> list[str]:
    """The devices the ``device`` fixture gives: the forced one, else cpu (+ cuda if present)."""
    if FORCED_DEVICE:
        return [FORCED_DEVICE]
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture(params=devices_under_test())
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """A device to run the test on (ids ``cpu``/``cuda``); a forced ``cuda`` without CUDA fails."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.fail(
            f"{DEVICE_FLAG}=cuda but torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}): run on a machine with a "
            f"CUDA GPU and a CUDA build of torch, or unset {DEVICE_FLAG}",
            pytrace=False,
        )
    yield torch.device(request.param)


def copy_pilot(destination: Path) -> Path:
    """A writable copy of ``PILOT_ROOT`` (without .git, logs, data and bytecode) at
    ``destination``; the original may be read-only, and its modes must not follow the copy."""
    shutil.copytree(
        PILOT_ROOT,
        destination,
        ignore=shutil.ignore_patterns(".git", "logs", "data", "__pycache__"),
    )
    for folder, _, files in os.walk(destination):
        for path in [folder, *(os.path.join(folder, name) for name in files)]:
            os.chmod(path, os.stat(path).st_mode | stat.S_IWUSR)
    return destination


@pytest.fixture(scope="session")
def pilot(tmp_path_factory) -> Path:
    """A patched copy of PILOT, shared by the whole session (tests must not edit it)."""
    if not PILOT_ROOT:
        pytest.skip(PILOT_SKIP_REASON)
    from pilot_online.pilot.patching import apply

    root = copy_pilot(tmp_path_factory.mktemp("pilot") / "LAMDA-PILOT")
    apply(root)
    return root


#: PILOT's top-level packages, dropped from ``sys.modules`` when a test module is done with them.
PILOT_TOP_LEVEL = ("models", "utils", "backbone", "trainer")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pilot_on_path(pilot: Path) -> Iterator[Path]:
    """The patched PILOT copy importable for one test module (for building PILOT networks in
    process); its top-level modules are dropped afterwards."""
    sys.path.insert(0, str(pilot))
    try:
        yield pilot
    finally:
        sys.path.remove(str(pilot))
        for name in [m for m in sys.modules if m.split(".")[0] in PILOT_TOP_LEVEL]:
            del sys.modules[name]


def load_script(name: str) -> Any:
    """``scripts/<name>.py`` as a module, loaded once per session."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def make_exps() -> Any:
    """``scripts/make_exps.py`` as a module: the one source of every method's smoke config (the
    committed ``exps/`` copies are checked against it by test_config.py)."""
    return load_script("make_exps")


#: The ViT depth of the runs through PILOT's main.py (``tiny_config``): the scale model's, the
#: shallowest every family builds (CODA's prompt layers 0-4, DualPrompt's e-prompts in blocks 2-4;
#: tests/test_weights.py builds each family at it). The methods' code does not depend on the
#: depth; the suite's time does. Networks built in-process keep the smoke configs' 12 blocks.
TEST_VIT_DEPTH = 5


def vit_depth_for_tests(config: dict[str, Any]) -> int:
    """:data:`TEST_VIT_DEPTH`, or deeper where the config places prompts in a later block
    (ConvPrompt's ``prompt_layers``: 0-6): ``scripts/smoke_matrix.py``'s rule."""
    return load_script("smoke_matrix").vit_depth_for(config, TEST_VIT_DEPTH)


def raw_smoke_config(method: str) -> dict[str, Any]:
    """A registered method's smoke config as ``scripts/make_exps.py`` writes it (unresolved)."""
    return make_exps().smoke_config(method)


def classification_term(
    adapter: MethodAdapter,
    network: nn.Module,
    out: StepOutput,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The adapter's classification term (``loss_terms``' ``"ce"``) on a training batch's outputs
    ``out`` and ``labels`` under the logit ``mask``, as a step before any firing computes it:
    no teacher, the batch's classes seen, none known."""
    classes = out.logits.shape[1]
    seen = torch.zeros(classes, dtype=torch.bool, device=labels.device)
    seen[labels] = True
    batch = TrainingBatch(out.logits, labels, len(labels), seen, torch.zeros_like(seen), mask=mask)
    return adapter.loss_terms(network, out, batch)["ce"]


def stream_step(
    out: StepOutput, labels: torch.Tensor, inputs: torch.Tensor | None = None
) -> TrainedStep:
    """The batch's own step as ``after_step`` gets it from the loop, on a stream batch with no
    replayed rows: ``out`` its pre-update outputs, ``labels`` its labels (``inputs`` stand-ins
    of the batch's length when the test has none)."""
    if inputs is None:
        inputs = torch.zeros(len(labels), 1)
    return TrainedStep(inputs, labels, len(labels), {}, out)


def smoke_config(method: str, num_classes: int = 8, **overrides: Any) -> dict[str, Any]:
    """The smoke config of ``method`` (``exps/smoke_<short>_online.json``, from its generator:
    32 px, random weights) resolved, with ``overrides``."""
    from pilot_online.engine.config import resolve_config

    config = resolve_config({**raw_smoke_config(method), **overrides})
    config.update(nb_classes=num_classes, nb_tasks=2)
    return config


def build_network(adapter: MethodAdapter, config: dict[str, Any], build=None) -> nn.Module:
    """The method's network as ``OnlineLearner`` builds it, with seeded random weights (needs
    ``pilot_on_path``)."""
    from pilot_online.pilot.backbones import run_overrides

    torch.manual_seed(0)
    with run_overrides(config):
        return (build or adapter.build_network)(config)


#: Methods whose contract runs through ``main.py`` share one driver process.
MAIN_RUNS_PER_PROCESS = 4


def contract_runs(method: str) -> list[tuple[str, str]]:
    """(variant, stream) of a method's runs through ``main.py`` in the contract suite: without
    and with P + FGH, one per stream (a method that cannot run + P + FGH, SimpleCIL, runs its
    base row on both streams)."""
    from pilot_online.engine.registry import method_card

    variants = method_card(f"{method.removesuffix('_online')}_online").variants
    return [("base", "clear"), ("p_fgh" if "fgh" in variants else "base", "si_blurry")]


@pytest.fixture(scope="session")
def pilot_main_run(pilot: Path, tmp_path_factory, request):
    """``run(method, variant, stream) -> (report, results)``: one run through PILOT's ``main.py``
    (test_pilot_integration.py's driver) on the tiny stream, made once per session. The contract
    suite and the method files' own checks read the same runs, so CI pays for each once."""
    from test_pilot_integration import run_drivers, tiny_config

    from pilot_online.engine.registry import list_methods

    runs: dict[tuple[str, str, str], tuple[dict, dict] | str] = {}
    # The methods whose contract runs this session will ask for (a `-k` selection: its own).
    selected = {
        item.callspec.params["name"].removesuffix("_online")
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_runs_through_pilot_main"
    }
    methods = [name.removesuffix("_online") for name in list_methods()]

    def run(method: str, variant: str, stream: str) -> tuple[dict, dict]:
        key = (method.removesuffix("_online"), variant, stream)
        if key not in runs:
            keys = [key]
            if key[0] in methods and (variant, stream) in contract_runs(key[0]):
                # With the contract runs of this method and the next ones, in one process
                # (PILOT's imports paid once per batch; the contract suite asks in this order).
                later = [m for m in methods[methods.index(key[0]) + 1 :] if m in selected]
                batch = [key[0], *later[: MAIN_RUNS_PER_PROCESS - 1]]
                keys += [(name, *other) for name in batch for other in contract_runs(name)]
            keys = [k for k in dict.fromkeys(keys) if k not in runs]
            made = []
            for name, run_variant, run_stream in keys:
                folder = tmp_path_factory.mktemp(f"{name}-{run_variant}-{run_stream}")
                config = tiny_config(name, run_variant, run_stream, folder / "results")
                # Checkpoints are the round-trip and resume tests' subject, not these runs'.
                config["checkpoint_every"] = None
                made.append((config, folder))
            runs.update(zip(keys, run_drivers(pilot, made), strict=True))
        if isinstance(runs[key], str):  # that run failed: its output and traceback
            pytest.fail(runs[key], pytrace=False)
        return runs[key]

    return run


def import_pot(why: str) -> Any:
    """POT (``ot``), which upstream's COIL and DUCT import and our Sinkhorn is checked against.
    A test that claims upstream's code or POT's numbers fails without it, never skips or
    stands in its own Sinkhorn: POT is in the ``test`` extra that ``make test`` installs."""
    try:
        import ot
    except ImportError:
        pytest.fail(
            f"{why}, but POT is not installed: pip install -e '.[test]' (or pip install pot)"
        )
    return ot


def unit_config(adapter_cls: type[MethodAdapter], num_classes: int, **overrides: Any) -> dict:
    """A method's own key defaults plus the loop settings its tiny-network tests use: plain SGD
    at 0.1 without weight decay or logit mask, seed 3, no gradient trace; ``overrides`` last."""
    cfg = {key: spec.default for key, spec in adapter_cls.config_keys.items()}
    cfg.update(
        nb_classes=num_classes,
        seed=[3],
        optimizer="sgd",
        init_lr=0.1,
        weight_decay=0.0,
        logit_mask="none",
        grad_trace=False,
    )
    cfg.update(overrides)
    return cfg


def build_smoke_method(name: str, **overrides: Any) -> tuple[MethodAdapter, nn.Module, dict]:
    """(adapter, network, config) of a registered method from its smoke config."""
    from pilot_online.engine.registry import get_method

    config = smoke_config(name, **overrides)
    adapter = get_method(name)(args=config)
    return adapter, build_network(adapter, config), config


def package_root() -> str:
    """The folder holding the ``pilot_online`` these tests imported: this checkout, or the
    temporary copy test_contract.py's throwaway-adapter test points ``PYTHONPATH`` at."""
    import pilot_online

    return str(Path(pilot_online.__file__).resolve().parent.parent)


def offline_env(tmp_path: Path) -> dict[str, str]:
    """The environment for a PILOT subprocess: no network (a closed loopback proxy), an empty
    weights cache, and this checkout first on the import path."""
    env = dict(os.environ, TORCH_HOME=str(tmp_path / "torch-home"), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root(), env.get("PYTHONPATH")]))
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env[key] = "http://127.0.0.1:9"
    return env


class TinyNet(nn.Module):
    """``features = relu(body(x))``, ``logits = fc(features)``."""

    def __init__(
        self, d_in: int = 5, hidden: int = 8, num_classes: int = 6, frozen_body: bool = False
    ) -> None:
        super().__init__()
        self.body = nn.Linear(d_in, hidden)
        self.fc = nn.Linear(hidden, num_classes)
        if frozen_body:
            self.body.requires_grad_(False)


class TinyAdapter(MethodAdapter):
    """The adapter contract over :class:`TinyNet`; ``fc`` is the classifier."""

    base_model_name = "tiny"

    def build_network(self, args: dict) -> nn.Module:
        return TinyNet(frozen_body=bool(args.get("frozen_body", False)))

    def forward(self, network: nn.Module, x: torch.Tensor, train: bool) -> StepOutput:
        features = torch.relu(network.body(x))
        return StepOutput(network.fc(features), features)

    def classifier(self, network: nn.Module) -> nn.Linear:
        return network.fc


class VectorSource:
    """A DataSource over in-memory vectors; ``requests`` records the test indices of each
    evaluation."""

    def __init__(self, train_x, train_y, test_x, test_y, eval_batch_size: int = 4) -> None:
        self.train_x, self.train_y = train_x, torch.as_tensor(np.array(train_y))
        self.test_x, self.test_y = test_x, torch.as_tensor(np.array(test_y))
        self.test_labels = np.asarray(test_y)
        self.eval_batch_size = eval_batch_size
        self.requests: list[np.ndarray] = []

    def train_batches(self, batches):
        for indices in batches:
            index = torch.from_numpy(np.array(indices))  # a copy: stream arrays are read-only
            yield self.train_x[index], self.train_y[index]

    def eval_batches(self, indices):
        self.requests.append(np.array(indices))
        for start in range(0, len(indices), self.eval_batch_size):
            index = torch.from_numpy(np.array(indices[start : start + self.eval_batch_size]))
            yield self.test_x[index], self.test_y[index]


# --------------------------------------------------------------------------------------------
# PILOT policy hooks


def pilot_tree_snapshot(root: str) -> dict[str, tuple[int, str]]:
    """Every path under ``root`` except .git's insides: (mode, SHA-256 of the bytes or link
    target). Catches edits, new files (e.g. a ``__pycache__`` from importing the original) and
    deletions."""
    snapshot: dict[str, tuple[int, str]] = {}
    for folder, folders, files in os.walk(root):
        folders[:] = [name for name in folders if name != ".git"]
        for name in [*folders, *files]:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                digest = os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            else:
                digest = ""
            snapshot[os.path.relpath(path, root)] = (info.st_mode, digest)
    return snapshot


def pilot_tree_changes(before: dict, after: dict) -> list[str]:
    """Readable lines naming each path added, removed or changed between two snapshots."""
    added = [f"added   {p}" for p in sorted(after.keys() - before.keys())]
    removed = [f"removed {p}" for p in sorted(before.keys() - after.keys())]
    kept = sorted(before.keys() & after.keys())
    changed = [f"changed {p}" for p in kept if before[p] != after[p]]
    return added + removed + changed


_snapshot_key = pytest.StashKey[dict]()
_changes_key = pytest.StashKey[list]()
_pilot_skips_key = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    if FORCED_DEVICE and FORCED_DEVICE not in DEVICE_CHOICES:
        raise pytest.UsageError(
            f"{DEVICE_FLAG}={FORCED_DEVICE!r} is not a test device: set it to one of "
            f"{', '.join(DEVICE_CHOICES)}, or unset it to test the CPU and CUDA when available"
        )
    if PILOT_ROOT and not os.path.isfile(os.path.join(PILOT_ROOT, "main.py")):
        raise pytest.UsageError(
            f"PILOT_ROOT={PILOT_ROOT} is not a LAMDA-PILOT checkout (no main.py there): "
            f"{ENABLE_PILOT_TESTS}, or unset PILOT_ROOT to skip them"
        )
    config.stash[_pilot_skips_key] = 0


def pytest_sessionstart(session: pytest.Session) -> None:
    if PILOT_ROOT:
        session.config.stash[_snapshot_key] = pilot_tree_snapshot(PILOT_ROOT)


def _skipped_for_missing_pilot(report: pytest.TestReport) -> bool:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return PILOT_SKIP_PREFIX in reason


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Count skips for a missing PILOT; under ``PILOT_ONLINE_REQUIRE_PILOT`` make them failures."""
    report = yield
    if report.skipped and _skipped_for_missing_pilot(report):
        item.config.stash[_pilot_skips_key] += 1
        if REQUIRE_PILOT:
            report.outcome = "failed"
            report.longrepr = (
                f"{REQUIRE_PILOT_FLAG} is set (as in .ci/run), so this PILOT test may not be "
                f"skipped, but {PILOT_SKIP_PREFIX}: {ENABLE_PILOT_TESTS}"
            )
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session if any test wrote into ``PILOT_ROOT`` instead of a copy."""
    before = session.config.stash.get(_snapshot_key, None)
    if before is None:
        return
    changes = pilot_tree_changes(before, pilot_tree_snapshot(PILOT_ROOT))
    session.config.stash[_changes_key] = changes
    if changes and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    changes = config.stash.get(_changes_key, [])
    if changes:
        terminalreporter.section("PILOT_ROOT was modified", sep="!", red=True)
        terminalreporter.line(
            f"the tests must patch copies of PILOT_ROOT ({PILOT_ROOT}), never the original:"
        )
        for line in changes[:50]:
            terminalreporter.line(f"  {line}")
    skipped = config.stash.get(_pilot_skips_key, 0)
    if skipped and not REQUIRE_PILOT:
        terminalreporter.section("PILOT tests skipped", sep="-", yellow=True)
        terminalreporter.line(f"{skipped} tests skipped because {PILOT_SKIP_REASON}.")

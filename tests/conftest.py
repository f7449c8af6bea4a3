"""Shared test fixtures and doubles (tests import them with ``from conftest import ...``).

Doubles: ``TinyNet``/``TinyAdapter``, a two-layer model behind the adapter contract, and
``VectorSource``, a DataSource over in-memory vectors; with them the loop and the session run
without PILOT or images.

PILOT: the tests that need a real LAMDA-PILOT checkout (commit 5240714) take it from
``PILOT_ROOT``; CI's ``.ci/run`` sets it to ``../shared/LAMDA-PILOT`` when unset. They copy that
tree and patch the copy, never the original.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pilot_online.engine.adapter import MethodAdapter, StepOutput

PILOT_ROOT = os.environ.get("PILOT_ROOT")
requires_pilot = pytest.mark.skipif(
    not PILOT_ROOT,
    reason="PILOT_ROOT is not set: point it at a LAMDA-PILOT checkout (commit 5240714), e.g. "
    "`PILOT_ROOT=../shared/LAMDA-PILOT make test`, to run the PILOT tests",
)


def copy_pilot(destination: Path) -> Path:
    """A copy of ``PILOT_ROOT`` (without .git, logs and data) at ``destination``."""
    shutil.copytree(PILOT_ROOT, destination, ignore=shutil.ignore_patterns(".git", "logs", "data"))
    return destination


@pytest.fixture(scope="session")
def pilot(tmp_path_factory) -> Path:
    """A patched copy of PILOT, shared by the whole session (tests must not edit it)."""
    if not PILOT_ROOT:
        pytest.skip(requires_pilot.kwargs["reason"])
    from pilot_online.pilot.patching import apply

    root = copy_pilot(tmp_path_factory.mktemp("pilot") / "LAMDA-PILOT")
    apply(root)
    return root


def offline_env(tmp_path: Path) -> dict[str, str]:
    """The environment for a PILOT subprocess: no network (a closed loopback proxy), an empty
    weights cache, and this checkout first on the import path."""
    env = dict(os.environ, TORCH_HOME=str(tmp_path / "torch-home"), PYTHONUNBUFFERED="1")
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
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

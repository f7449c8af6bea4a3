"""Bit-identical training on the CPU: the loop's step runs under torch's deterministic algorithms
(``engine/loop.py``: ``deterministic_on_cpu``).

Why: a gather with repeated indices backpropagates through ``index_put_`` with accumulation,
which on the CPU adds the repeated rows with parallel atomics once the tensor has 32768 elements.
PILOT's L2P prompt pool gathers ``self.prompt[idx]`` (10 prompts of 5 x 768 = 38400 elements),
every sample choosing the same prompts under the batch-wise vote: two L2P smoke runs with one
seed then differed in the last bits of their gradient diagnostics (checked)."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyAdapter, TinyNet, unit_config

from pilot_online.engine.loop import OnlineLoop, deterministic_on_cpu


def repeated_gather_gradients(repeats: int = 6) -> list[torch.Tensor]:
    """The gradient of ``prompts[idx]`` (L2P's gather: a [10, 5, 768] pool, 100 samples of 5
    prompts each), taken ``repeats`` times on the same inputs, at two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randn(10, 5, 768, generator=generator, requires_grad=True)
        idx = torch.randint(0, 10, (100, 5), generator=generator)
        weights = torch.randn(100, 5, 5, 768, generator=generator)
        gradients = []
        for _ in range(repeats):
            prompts.grad = None
            (prompts[idx] * weights).sum().backward()
            gradients.append(prompts.grad.clone())
        return gradients
    finally:
        torch.set_num_threads(threads)


def test_a_repeated_gather_has_one_gradient_under_the_steps_context():
    """Fails without the context: at two threads the six gradients differ in the last bits."""
    with deterministic_on_cpu(torch.device("cpu")):
        gradients = repeated_gather_gradients()
    assert all(torch.equal(gradients[0], g) for g in gradients[1:])


def test_the_context_is_the_steps_and_is_put_back():
    before = torch.are_deterministic_algorithms_enabled()
    seen = []

    class Recording(TinyAdapter):
        def forward(self, network, x, train):
            seen.append(torch.are_deterministic_algorithms_enabled())
            return super().forward(network, x, train)

    loop = OnlineLoop(Recording(), TinyNet(), unit_config(Recording, 6), 6)
    loop.train_step(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]))
    assert seen == [True]
    assert torch.are_deterministic_algorithms_enabled() == before


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_other_devices_keep_their_own_settings(device):
    """On a GPU the documented nondeterminism stands (docs/gpu.md): nothing is switched."""
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic_on_cpu(torch.device(device)):
        assert torch.are_deterministic_algorithms_enabled() == before

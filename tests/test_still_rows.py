"""``still_masked_rows``: masked classifier rows keep their weights and Adam moments.

Worked by hand: after one Adam step on every row, a second step whose gradient is zero on rows
2 and 3 moves those rows by ``lr * m / (sqrt(v) + eps)`` with torch's Adam (momentum alone), and
not at all with the key on; rows 0 and 1 step identically either way.
"""

from __future__ import annotations

import torch
from torch import nn

from pilot_online.engine.loop import StillMaskedRows


def two_steps(still: bool) -> tuple[nn.Linear, torch.optim.Adam]:
    torch.manual_seed(0)
    head = nn.Linear(3, 4)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        logits = head(torch.ones(5, 3))
        if step == 1:  # the batch mask shuts out classes 2 and 3
            logits = logits[:, :2]
        logits.logsumexp(1).sum().backward()
        if still:
            with StillMaskedRows(head, optimizer):
                optimizer.step()
        else:
            optimizer.step()
    return head, optimizer


def test_masked_rows_stay_still_with_their_moments():
    moving, _ = two_steps(still=False)
    still, kept = two_steps(still=True)
    torch.manual_seed(0)
    first = nn.Linear(3, 4)
    first_adam = torch.optim.Adam(first.parameters(), lr=0.1)
    first(torch.ones(5, 3)).logsumexp(1).sum().backward()
    first_adam.step()  # after step 1, the state both runs share
    # Torch's Adam moves the masked rows on momentum alone: m = 0.9 m1, v = 0.999 v1.
    m1 = first_adam.state[first.weight]["exp_avg"][2:]
    v1 = first_adam.state[first.weight]["exp_avg_sq"][2:]
    m, v = 0.9 * m1 / (1 - 0.9**2), 0.999 * v1 / (1 - 0.999**2)
    expected = first.weight[2:] - 0.1 * m / (v.sqrt() + 1e-8)
    assert torch.allclose(moving.weight[2:], expected, atol=1e-6)
    assert not torch.allclose(moving.weight[2:], first.weight[2:])
    # With the key: rows 2 and 3 and their moments are those after step 1, exactly.
    assert torch.equal(still.weight[2:], first.weight[2:])
    assert torch.equal(still.bias[2:], first.bias[2:])
    assert torch.equal(kept.state[still.weight]["exp_avg"][2:], m1)
    assert torch.equal(kept.state[still.weight]["exp_avg_sq"][2:], v1)
    # The rows the batch trains step as torch's Adam steps them.
    assert torch.equal(still.weight[:2], moving.weight[:2])

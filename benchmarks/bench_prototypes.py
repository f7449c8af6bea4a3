"""Cost of the online prototypes (paper Eq. 1-2) per step, against a naive per-sample loop.

Run ``python benchmarks/bench_prototypes.py --device cpu`` (or ``--device cuda``). For each class
count C it times, in the same process and interleaved round-robin:

* ``PrototypeBank.update`` (vectorised Eq. 1) and ``PrototypeBank.loss`` + backward (Eq. 2
  through the classifier), as the online loop calls them;
* the same two steps written naively in this script: Eq. 1 applied one sample at a time
  (``p <- (k p + f) / (k + 1)``) and Eq. 2 as a loop over the seen classes;
* a forward/backward of the classifier alone, ``Linear(D, C)`` with cross-entropy on one batch:
  the smallest piece of a real training step (ViT-B's head), so the prototype overhead relative
  to it is an upper bound on the overhead relative to a whole step.

Before timing, both implementations process the same batches and must agree (``torch.allclose``
on means, equal counts, close losses and classifier gradients).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import add_device_arguments, interleaved_medians, setup_device  # benchmarks/timing.py
from torch import nn

from pilot_online.core.prototypes import PrototypeBank

Batch = tuple[torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------- timing


# --------------------------------------------------------------------------- the naive baseline


class NaivePrototypes:
    """Eq. 1 and Eq. 2 written the obvious way: a Python loop over samples, then over classes."""

    def __init__(self, num_classes: int, feature_dim: int, device: torch.device) -> None:
        self.means = torch.zeros(num_classes, feature_dim, device=device)
        self.counts = [0] * num_classes

    @torch.no_grad()
    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Eq. 1 per sample: p_y <- (k_y p_y + f) / (k_y + 1); k_y <- k_y + 1."""
        for feature, label in zip(features, labels.tolist()):
            count = self.counts[label]
            self.means[label] = (count * self.means[label] + feature) / (count + 1)
            self.counts[label] = count + 1

    def loss(self, classifier: nn.Module) -> torch.Tensor:
        """Eq. 2 per seen class j: -log softmax over the seen classes of fc(p_j), at j; mean."""
        seen = [label for label, count in enumerate(self.counts) if count > 0]
        if not seen:
            return torch.zeros((), device=self.means.device)
        seen_index = torch.tensor(seen, device=self.means.device)
        terms = []
        for position, label in enumerate(seen):
            logits = classifier(self.means[label].unsqueeze(0))[0, seen_index]
            terms.append(-torch.log_softmax(logits, dim=0)[position])
        return torch.stack(terms).mean()


# --------------------------------------------------------------------------- checks and steps


def make_batches(
    count: int, batch: int, num_classes: int, dim: int, device: torch.device, seed: int
) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, dim, generator=generator).to(device),
            torch.randint(num_classes, (batch,), generator=generator).to(device),
        )
        for _ in range(count)
    ]


def _classifier_grads(classifier: nn.Linear, loss: torch.Tensor) -> list[torch.Tensor]:
    classifier.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in classifier.parameters()]


def verify(
    num_classes: int, dim: int, batches: list[Batch], classifier: nn.Linear, device: torch.device
) -> None:
    """Both implementations, fed the same batches, give the same means, counts, loss, grads."""
    bank = PrototypeBank(num_classes, dim, device=device)
    naive = NaivePrototypes(num_classes, dim, device)
    for features, labels in batches:
        bank.update(features, labels)
        naive.update(features, labels)
        if not torch.allclose(bank.means, naive.means, rtol=1e-5, atol=1e-6):
            worst = (bank.means - naive.means).abs().max().item()
            raise AssertionError(f"C={num_classes}: means differ (max abs difference {worst:g})")
        if bank.counts.tolist() != naive.counts:
            raise AssertionError(f"C={num_classes}: counts differ")
    bank_loss, naive_loss = bank.loss(classifier), naive.loss(classifier)
    if not torch.allclose(bank_loss, naive_loss, rtol=1e-5, atol=1e-6):
        raise AssertionError(f"C={num_classes}: loss {bank_loss.item()} != {naive_loss.item()}")
    for ours, theirs in zip(
        _classifier_grads(classifier, bank_loss), _classifier_grads(classifier, naive_loss)
    ):
        if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6):
            raise AssertionError(f"C={num_classes}: classifier gradients differ")


def _cycle(batches: list[Batch]) -> Callable[[], Batch]:
    """A function returning the next batch, round and round (each variant gets its own)."""
    position = [0]

    def next_batch() -> Batch:
        batch = batches[position[0] % len(batches)]
        position[0] += 1
        return batch

    return next_batch


def step_functions(
    num_classes: int, dim: int, batches: list[Batch], device: torch.device
) -> dict[str, Callable[[], object]]:
    """The timed calls. Banks are pre-filled with every batch once, so all classes are seen."""
    classifier = nn.Linear(dim, num_classes).to(device)
    bank = PrototypeBank(num_classes, dim, device=device)
    naive = NaivePrototypes(num_classes, dim, device)
    for features, labels in batches:
        bank.update(features, labels)
        naive.update(features, labels)
    next_bank, next_naive, next_fc = _cycle(batches), _cycle(batches), _cycle(batches)

    def bank_update() -> None:
        bank.update(*next_bank(), validate=False)  # as the online loop calls it

    def naive_update() -> None:
        naive.update(*next_naive())

    def backward(loss: torch.Tensor) -> None:
        classifier.zero_grad(set_to_none=True)
        loss.backward()

    def fc_step() -> None:
        features, labels = next_fc()
        backward(F.cross_entropy(classifier(features), labels))

    return {
        "bank_update": bank_update,
        "naive_update": naive_update,
        "bank_loss": lambda: backward(bank.loss(classifier)),
        "naive_loss": lambda: backward(naive.loss(classifier)),
        "fc": fc_step,
    }


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_arguments(parser)
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per variant")
    parser.add_argument(
        "--classes",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[100, 200],
        help="comma-separated class counts C",
    )
    parser.add_argument("--dim", type=int, default=768, help="feature width D (ViT-B: 768)")
    parser.add_argument("--batch", type=int, default=100, help="samples per online step")
    parser.add_argument("--batches", type=int, default=8, help="distinct batches cycled")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.batches < 1 or min(args.classes) < 1:
        parser.error("--repeats, --batches and --classes must be >= 1, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = setup_device(args)
    started = time.perf_counter()
    print(
        f"bench_prototypes: device={device}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, D={args.dim}, batch {args.batch}, median of "
        f"{args.repeats} repeats after {args.warmup} warm-up calls"
    )
    results = {}
    for num_classes in args.classes:
        batches = make_batches(
            args.batches, args.batch, num_classes, args.dim, device, args.seed + num_classes
        )
        torch.manual_seed(args.seed)
        verify(num_classes, args.dim, batches, nn.Linear(args.dim, num_classes).to(device), device)
        fns = step_functions(num_classes, args.dim, batches, device)
        results[num_classes] = interleaved_medians(fns, device, args.repeats, args.warmup)
    print("verified: PrototypeBank and the naive loop give allclose means, losses and grads\n")

    print(
        f"{'C':>5}  {'update ms':>9} {'naive':>8} {'speed-up':>9}  {'loss+bwd ms':>11} "
        f"{'naive':>8} {'speed-up':>9}  {'total speed-up':>14}"
    )
    for num_classes, t in results.items():
        t = {k: v * 1e3 for k, v in t.items()}
        ours, theirs = t["bank_update"] + t["bank_loss"], t["naive_update"] + t["naive_loss"]
        print(
            f"{num_classes:>5}  {t['bank_update']:>9.3f} {t['naive_update']:>8.3f} "
            f"{t['naive_update'] / t['bank_update']:>8.1f}x  {t['bank_loss']:>11.3f} "
            f"{t['naive_loss']:>8.3f} {t['naive_loss'] / t['bank_loss']:>8.1f}x  "
            f"{theirs / ours:>13.1f}x"
        )
    print("  speed-up = naive / PrototypeBank; loss+bwd = Eq. 2 forward and backward through fc\n")

    print(f"{'C':>5}  {'fc fwd+bwd ms':>13}  {'update+loss ms':>14}  {'(update+loss)/fc':>16}")
    for num_classes, t in results.items():
        t = {k: v * 1e3 for k, v in t.items()}
        ours = t["bank_update"] + t["bank_loss"]
        print(f"{num_classes:>5}  {t['fc']:>13.3f}  {ours:>14.3f}  {ours / t['fc']:>15.2f}x")
    print(
        f"  fc = Linear({args.dim}, C) + cross-entropy, forward and backward on one batch of "
        f"{args.batch}: the\n  classifier alone, a small fraction of a ViT-B step"
    )

    print("\nkey ratios")
    for num_classes, t in results.items():
        ours = t["bank_update"] + t["bank_loss"]
        print(
            f"  C={num_classes}: PrototypeBank is "
            f"{(t['naive_update'] + t['naive_loss']) / ours:.1f}x faster than the naive loop; "
            f"update+loss costs {ours / t['fc']:.2f}x the classifier's own forward/backward"
        )
    print(f"total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()

"""ConvPrompt's prompt generators (Roy et al., CVPR 2024), as plain tensor math.

Each prompted layer owns a *shared embedding* per key/value and attention head, a
``(length + k - 1) x (head_dim + k - 1)`` matrix. A prompt generator is a ``k x k`` convolution
kernel (plus bias) per layer, key/value and head; convolving the shared embedding ("valid", stride
1) gives that generator's ``length x head_dim`` prefix. A sample's prefix is the sum of the
generators' prefixes weighted by the cosine similarity between each generator's key and a small
MLP ("matcher") of the sample's query token. The convolutions do not depend on the input, so all
of them run once per forward pass as one grouped convolution (:func:`generator_prefixes`); only the
weighting (:func:`mix_prefixes`) is per sample.

Shapes: ``n`` prompted layers, ``h`` heads, ``p`` generators, ``l`` prompt length, ``d`` head dim,
``k`` kernel size, ``B`` batch. The key/value axis has size 2 (0 = key, 1 = value).
"""

from __future__ import annotations

from .lazy import F, nn, torch


def generator_prefixes(
    embeddings: torch.Tensor, kernels: torch.Tensor, biases: torch.Tensor
) -> torch.Tensor:
    """Every generator's prefix: ``conv2d(embeddings[i, kv, h], kernels[i, kv, h, g]) + bias``.

    ``embeddings`` ``[n, 2, h, l + k - 1, d + k - 1]``, ``kernels`` ``[n, 2, h, p, k, k]``,
    ``biases`` ``[n, 2, h, p]`` -> ``[n, 2, h, p, l, d]``. One grouped convolution: each
    (layer, key/value, head) map is one group with ``p`` output channels.
    """
    n, two, heads, rows, cols = embeddings.shape
    pool, size = kernels.shape[3], kernels.shape[-1]
    if kernels.shape != (n, two, heads, pool, size, size) or biases.shape != kernels.shape[:4]:
        raise ValueError(
            f"kernels {tuple(kernels.shape)} / biases {tuple(biases.shape)} do not match "
            f"embeddings {tuple(embeddings.shape)}: expected [n, 2, h, p, k, k] and [n, 2, h, p]"
        )
    groups = n * two * heads
    out = F.conv2d(
        embeddings.reshape(1, groups, rows, cols),
        kernels.reshape(groups * pool, 1, size, size),
        biases.reshape(groups * pool),
        groups=groups,
    )
    return out.reshape(n, two, heads, pool, rows - size + 1, cols - size + 1)


def cosine_weights(keys: torch.Tensor, queries: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``[B, p]`` cosine similarities between queries ``[B, c]`` and generator keys ``[p, c]``
    (unnormalised: upstream weights generators by the raw cosine, not a softmax)."""
    keys = keys * torch.rsqrt((keys * keys).sum(-1, keepdim=True).clamp_min(eps))
    queries = queries * torch.rsqrt((queries * queries).sum(-1, keepdim=True).clamp_min(eps))
    return queries @ keys.T


def mix_prefixes(weights: torch.Tensor, prefixes: torch.Tensor) -> torch.Tensor:
    """One layer's per-sample prefix: ``sum_g weights[b, g] * prefixes[kv, h, g]``.

    ``weights`` ``[B, p]``, ``prefixes`` ``[2, h, p, l, d]`` -> ``[B, 2, l, h, d]``, the prefix
    layout of PILOT's DualPrompt attention (``PreT_Attention``).
    """
    return torch.einsum("bg,khgld->bklhd", weights, prefixes)


class ConvPromptGenerator(nn.Module):
    """The trainable part of ConvPrompt: shared embeddings, generators, keys and the matcher.

    Initialised as upstream does: embeddings uniform in [-1, 1]; kernels and biases as
    ``nn.Conv2d(1, 1, k)`` does (uniform in +-1/k); keys orthonormal (upstream's Gram-Schmidt of
    the first task's keys, here done once for all generators); matcher ``c -> c/2 -> c/4``.
    Random draws use torch's global generator, which PILOT seeds per run.
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        length: int,
        kernel_size: int,
        num_generators: int,
        embed_dim: int,
    ) -> None:
        super().__init__()
        for name, value in {
            "num_layers": num_layers,
            "num_heads": num_heads,
            "head_dim": head_dim,
            "length": length,
            "kernel_size": kernel_size,
            "num_generators": num_generators,
        }.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ConvPrompt {name} must be a positive integer, got {value!r}")
        if embed_dim % 4 or embed_dim < 4:
            raise ValueError(f"the matcher needs embed_dim divisible by 4, got {embed_dim}")
        if num_generators > embed_dim // 4:
            raise ValueError(
                f"{num_generators} generators cannot have orthonormal keys of size "
                f"{embed_dim // 4}: use at most {embed_dim // 4}"
            )
        pad = kernel_size - 1
        shape = (num_layers, 2, num_heads, length + pad, head_dim + pad)
        self.embeddings = nn.Parameter(torch.empty(shape).uniform_(-1, 1))
        bound = 1 / kernel_size  # nn.Conv2d's default: 1 / sqrt(fan_in), fan_in = k * k
        pool = (num_layers, 2, num_heads, num_generators)
        self.kernels = nn.Parameter(
            torch.empty(*pool, kernel_size, kernel_size).uniform_(-bound, bound)
        )
        self.biases = nn.Parameter(torch.empty(pool).uniform_(-bound, bound))
        key_dim = embed_dim // 4
        basis, _ = torch.linalg.qr(torch.randn(key_dim, num_generators))
        self.keys = nn.Parameter(basis.T.contiguous())
        self.matcher = nn.Sequential(
            nn.Linear(embed_dim, embed_dim // 2), nn.ReLU(), nn.Linear(embed_dim // 2, key_dim)
        )

    @property
    def num_layers(self) -> int:
        return self.embeddings.shape[0]

    def prefixes(self) -> torch.Tensor:
        """``[n, 2, h, p, l, d]``: all generators' prefixes (input-independent; once per pass)."""
        return generator_prefixes(self.embeddings, self.kernels, self.biases)

    def weights(self, queries: torch.Tensor) -> torch.Tensor:
        """``[B, p]``: each generator's weight for each sample's query token ``[B, c]``."""
        return cosine_weights(self.keys, self.matcher(queries))

    def layer_prefix(
        self, prefixes: torch.Tensor, layer: int, queries: torch.Tensor
    ) -> torch.Tensor:
        """``[B, 2, l, h, d]``: layer ``layer``'s prefix for queries ``[B, c]``."""
        return mix_prefixes(self.weights(queries), prefixes[layer])

    def extra_repr(self) -> str:
        n, _, h, p, k, _ = self.kernels.shape
        return f"layers={n}, heads={h}, generators={p}, kernel={k}x{k}"


__all__ = [
    "ConvPromptGenerator",
    "cosine_weights",
    "generator_prefixes",
    "mix_prefixes",
]

"""MVP's loss terms (Moon et al., ICCV 2023, the Si-Blurry paper) as pure tensor functions.

MVP trains a linear head ``z = (W h + b) * s`` on prompted features ``h``, where ``s`` is an
instance-wise logit mask chosen through the sample's prompt key. Its four parts are:

- the instance-wise logit mask ``s = 2 sigmoid(m)`` (:func:`instance_logit_scale`);
- the contrastive visual prompt tuning loss on the key pool (:func:`key_contrastive_loss`);
- the gradient-similarity-based focal loss: samples whose classifier gradient disagrees with the
  batch's get more weight (:func:`gradient_dissimilarity`, :func:`focal_weights`);
- adaptive feature scaling: features far from their class row are shrunk before the head
  (:func:`feature_scales`).

Torch only, so each term is testable on tiny tensors. The per-sample gradients of the focal loss
come in closed form from the logit gradients (``softmax - onehot``): no backward pass per sample.
"""

from __future__ import annotations

from .lazy import F, torch


def instance_logit_scale(mask_parameters: torch.Tensor) -> torch.Tensor:
    """``2 sigmoid(m)``: a multiplicative logit mask in (0, 2) (1 when ``m = 0``)."""
    return 2.0 * torch.sigmoid(mask_parameters)


#: How the key loss pairs distances with use counts: upstream's broadcast, or each sample's own.
KEY_LOSS_MASSES = ("upstream", "own_key")


def key_contrastive_loss(
    query_distance: torch.Tensor,
    key_distances: torch.Tensor,
    mass: torch.Tensor,
    eps: float = 1e-6,
    pairing: str = "own_key",
) -> torch.Tensor:
    """Contrastive prompt-key loss ``-log(N / (P + N) + eps)``.

    ``query_distance[i]`` is ``1 - cos(q_i, k_{s_i})`` (sample ``i``'s query to its selected key),
    ``key_distances[i, j]`` is ``1 - cos(k_{s_i}, k_j)``, and ``mass[i]`` is the selected key's
    use count plus one. Heavily used keys (large mass) are pushed less.

    ``pairing="own_key"``: each sample with its own key's mass, ``P = mean_i exp(d_i / mass_i)``
    pulls queries to their keys, ``N = mean_ij exp(D_ij / mass_i)`` pushes keys apart.
    ``pairing="upstream"``: upstream's 2023 code divides ``[B]`` distances by ``[B, 1]`` masses
    and ``[B, 1, P]`` by ``[B, 1]``, which broadcasts every sample's distances against every
    sample's mass: ``P = mean_ij exp(d_j / mass_i)``, ``N = mean_ijk exp(D_ik / mass_j)``.
    """
    if query_distance.dim() != 1 or key_distances.dim() != 2 or mass.shape != query_distance.shape:
        raise ValueError(
            "expected query_distance [B], key_distances [B, P] and mass [B]; got "
            f"{tuple(query_distance.shape)}, {tuple(key_distances.shape)}, {tuple(mass.shape)}"
        )
    if pairing not in KEY_LOSS_MASSES:
        raise ValueError(f"key-loss pairing must be one of {KEY_LOSS_MASSES}, got {pairing!r}")
    mass = mass.to(query_distance.dtype)
    if pairing == "own_key":
        positive = torch.exp(query_distance / mass).mean()
        negative = torch.exp(key_distances / mass[:, None]).mean()
    else:
        positive = torch.exp(query_distance[None, :] / mass[:, None]).mean()
        negative = torch.exp(key_distances[:, None, :] / mass[None, :, None]).mean()
    return -torch.log(negative / (positive + negative) + eps)


def logit_gradients(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``d CE_i / d z_i = softmax(z_i) - onehot(y_i)`` for every sample (``-inf`` logits give 0)."""
    delta = torch.softmax(logits, dim=1)
    return delta - F.one_hot(labels, logits.shape[1]).to(delta.dtype)


def gradient_dissimilarity(
    features: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    logit_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``1 - cos(g_i, G_{y_i})`` per sample, in [0, 2], without a backward pass per sample.

    For the head ``z_i = (W h_i + b) * s_i`` and ``CE_i``, the gradient of row ``c`` of ``W`` is
    ``(p_ic - y_ic) s_ic h_i``. ``g_i`` is that row-``y_i`` gradient of sample ``i`` alone and
    ``G = (1/B) sum_j`` of all samples' gradients (the batch-mean loss's gradient), read at the same
    row ``y_i``: the quantities upstream obtains with one backward per sample.
    """
    delta = logit_gradients(logits, labels)
    if logit_scale is not None:
        delta = delta * logit_scale
    batch_grad = delta.T @ features / len(labels)  # [C, D]
    sample_grad = delta.gather(1, labels[:, None]) * features  # [B, D]
    return 1.0 - F.cosine_similarity(sample_grad, batch_grad[labels], dim=1)


def focal_weights(dissimilarity: torch.Tensor, alpha: float, gamma: float) -> torch.Tensor:
    """Per-sample loss weights ``(1 - alpha) + alpha * dissimilarity ** gamma``."""
    return (1.0 - alpha) + alpha * dissimilarity.pow(gamma)


def feature_scales(
    class_weights: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, margin: float
) -> torch.Tensor:
    """Adaptive feature scaling divisors ``1 - cos(W_{y_i}, h_i) + margin`` (in [margin, 2 +
    margin]): features pointing away from their class row are shrunk more before the head."""
    return 1.0 - F.cosine_similarity(class_weights[labels], features, dim=1) + margin

"""Per-sample test-time objectives in NumPy (no autograd): entropy, the shortcut-resistant
entropy E_SR and the sample-wise feature alignment l_SWA of the paper."""

from __future__ import annotations

import numpy as np


def softmax_entropy(scores: np.ndarray) -> np.ndarray:
    """Entropy (nats) of softmax(scores) per row. scores: [B, K] -> [B]."""
    shifted = scores - scores.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    log_p = shifted - log_z
    return -(np.exp(log_p) * log_p).sum(axis=1)


def shortcut_resistant_scores(
    logits: np.ndarray,
    reference_norm: np.ndarray | None,
    center: np.ndarray | None,
    eps: float = 1e-8,
) -> np.ndarray:
    """s(o) = (r / (||o|| + eps)) o - c per row.

    logits: [B, K]; reference_norm: [B] (r = ||o_bar||, the norm both sides are rescaled to;
    None = no rescaling); center: [K] output centre (None = no decentring).
    """
    scores = logits
    if reference_norm is not None:
        norms = np.linalg.norm(logits, axis=1)
        scores = logits * (reference_norm / (norms + eps))[:, None]
    if center is not None:
        scores = scores - center[None, :]
    return scores


def sample_wise_alignment(
    features: np.ndarray,
    mean: np.ndarray,
    second_moment: np.ndarray,
    source_mean: np.ndarray,
    source_std: np.ndarray,
    rho: float,
    eps: float = 1e-8,
) -> np.ndarray:
    """l_SWA per row: the distance of the moments *as this sample would update them* to the
    source moments.

    m_hat = rho m + (1 - rho) h, q_hat = rho q + (1 - rho) h^2,
    sigma_hat = sqrt(max(q_hat - m_hat^2, 0) + eps),
    l = ||m_hat - m_s||^2 + ||sigma_hat - sigma_s||^2.
    features: [B, F]; mean, second_moment, source_mean, source_std: [F]. Returns [B].
    rho is the weight of the history (DESIGN section 4).
    """
    m_hat = rho * mean[None, :] + (1.0 - rho) * features
    q_hat = rho * second_moment[None, :] + (1.0 - rho) * features * features
    sigma_hat = np.sqrt(np.maximum(q_hat - m_hat * m_hat, 0.0) + eps)
    return ((m_hat - source_mean) ** 2).sum(axis=1) + ((sigma_hat - source_std) ** 2).sum(axis=1)

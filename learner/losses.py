"""PPO losses for asynchronous, compacted rollouts (docs/design.md §2.4).

For trainable tokens M of the whole global batch (every rank), with the
learner's weights at the step's start as the proximal policy pi_prox and the
actors' sampling distribution mu:

    rho = pi_theta / pi_prox
    w   = min(pi_prox / mu, C_is)          (is_mode "truncate"; no gradient)
    l   = -w * min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
    L   = sum_t c_t * l_t

with the loss weight c_t of each token passed in (:func:`loss_weights`):
1/|M| on M and 0 elsewhere (``loss_norm = "token"``); 1/(n_s * S) on
segment s's n_s tokens, S the segments with any (``"segment"``, an
ablation: a rollout's weight grows with its segment count); or 1/(n_r * R)
on rollout r's n_r tokens, R the rollouts with any (``"rollout"``, an
ablation: every rollout weighs the same whatever its segment count, so each
of a long rollout's tokens weighs less). ``is_mode="mask"`` gives w = 0 to
tokens whose pi_prox/mu leaves [1/C_is, C_is] (kept tokens keep w);
``"off"`` sets w = 1. Dividing by the global count |M| (not per sequence,
not per rank) is what makes a rollout that compacted more often weigh no
more per token, and 1 rank equal 8. The value loss is token-normalised the
same way in every mode.
"""

from __future__ import annotations

import torch


def importance_weights(logp_prox: torch.Tensor, logp_behav: torch.Tensor, is_cap: float,
                       is_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, affected): the behaviour correction pi_prox/mu, and which tokens the
    cap truncated or masked."""
    raw = torch.exp(logp_prox.detach() - logp_behav.detach())
    if is_mode == "truncate":
        affected = raw > is_cap
        return torch.clamp(raw, max=is_cap), affected
    if is_mode == "mask":
        affected = (raw > is_cap) | (raw < 1.0 / is_cap)
        return torch.where(affected, torch.zeros_like(raw), raw), affected
    if is_mode == "off":
        return torch.ones_like(raw), torch.zeros_like(raw, dtype=torch.bool)
    raise ValueError(f"is_mode must be 'truncate', 'mask' or 'off', not {is_mode!r}")


def loss_weights(segment_lengths: torch.Tensor, loss_norm: str, num_tokens: float,
                 num_segments: float, rollout_tokens: float, num_rollouts: float
                 ) -> torch.Tensor:
    """c_t for the trainable tokens of segments of ``segment_lengths`` (in
    order), all of one rollout with ``rollout_tokens`` trainable tokens in
    all: 1/|M| (``"token"``; |M| = ``num_tokens``, the global batch's),
    1/(n_s * S) (``"segment"``; S = ``num_segments``, the global batch's
    segments with any trainable token) or 1/(n_r * R) (``"rollout"``; n_r =
    ``rollout_tokens``, R = ``num_rollouts``, the global batch's rollouts
    with any trainable token)."""
    lengths = segment_lengths.long()
    if loss_norm == "token":
        return torch.full((int(lengths.sum()),), 1.0 / num_tokens)
    if loss_norm == "segment":
        per_segment = 1.0 / (lengths.clamp(min=1).double() * num_segments)
        return torch.repeat_interleave(per_segment, lengths).float()
    if loss_norm == "rollout":
        return torch.full((int(lengths.sum()),), 1.0 / (max(rollout_tokens, 1) * num_rollouts))
    raise ValueError(f"loss_norm must be 'token', 'segment' or 'rollout', not {loss_norm!r}")


def policy_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_cap: float = 2.0,
    is_mode: str = "truncate",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(sum_t c_t * l_t, stats), ``weights`` the c_t (0: not in the loss).
    Stats are local means over this call's tokens in the loss:
    ``clipfrac``, ``approx_kl`` (pi_prox to pi_theta, the k3 estimator),
    ``is_weight_mean``, ``is_affected_frac`` (truncated or masked)."""
    mask = weights > 0
    advantages = advantages.detach()
    log_ratio = logp - logp_prox.detach()
    ratio = torch.exp(log_ratio)
    weight, affected = importance_weights(logp_prox, logp_behav, is_cap, is_mode)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -weight * torch.minimum(unclipped, clipped)
    # where, not only the product: a padded position's l may be anything
    loss = torch.where(mask, per_token * weights, torch.zeros_like(per_token)).sum()
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        stats = {
            "clipfrac": ((clipped < unclipped) & mask).sum() / count,
            "approx_kl": torch.where(mask, (ratio - 1) - log_ratio, 0.0).sum() / count,
            "is_weight_mean": torch.where(mask, weight, 0.0).sum() / count,
            "is_affected_frac": (affected & mask).sum() / count,
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    weights: torch.Tensor,
    value_clip: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, sum_t c_t * 0.5 * max((V - G)^2, (V_clip - G)^2),
    ``weights`` the c_t (0: not in the loss). Stats: ``clipfrac``
    (explained variance is a statistic of the whole batch:
    :func:`residual_moments`)."""
    mask = weights > 0
    returns, old_values = returns.detach(), old_values.detach()
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    plain_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(plain_error, clipped_error)
    loss = torch.where(mask, per_token * weights, torch.zeros_like(per_token)).sum()
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        stats = {"clipfrac": ((clipped_error > plain_error) & mask).sum() / count}
    return loss, stats


def residual_moments(returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor
                     ) -> dict[str, float]:
    """Sums over the masked tokens of G, G^2, G - V and (G - V)^2 (V the old
    values): summed over micro-batches and ranks, they give the explained
    variance of the whole batch (:func:`explained_variance`); a mean of
    per-micro-batch ratios would not (a micro-batch of one rollout has
    returns of almost no variance)."""
    target = returns.detach()[mask.bool()].double()
    residual = target - old_values.detach()[mask.bool()].double()
    return {"return_sum": target.sum().item(), "return_square_sum": (target ** 2).sum().item(),
            "residual_sum": residual.sum().item(),
            "residual_square_sum": (residual ** 2).sum().item()}


def explained_variance(moments: dict[str, float], count: float) -> float:
    """1 - Var[G - V] / Var[G] over ``count`` tokens from their
    :func:`residual_moments`; 0 when the returns do not vary."""
    if count < 2:
        return 0.0
    variance = moments["return_square_sum"] / count - (moments["return_sum"] / count) ** 2
    residual = moments["residual_square_sum"] / count - (moments["residual_sum"] / count) ** 2
    # a relative floor: the moments' float64 rounding, not a variance
    if variance <= 1e-12 * moments["return_square_sum"] / count:
        return 0.0
    return 1.0 - residual / variance

"""Advantages for compacted rollouts: cross-trajectory GAE (docs/design.md §2.3).

Within each segment, over its trainable tokens in order, with critic values V:

    delta_i = r_i + gamma * V_{i+1} - V_i     (V after the segment's last token is 0)
    A_loc_i = sum_l (gamma * lam)^l * delta_{i+l}          (within the segment)

where the segment's last trainable token gets r = R (the rollout's final
reward) and every token may add a per-token reward (e.g. a KL penalty). Then
each segment is discounted by the trainable tokens after it in its rollout:

    A_i = (gamma * lam) ** N_{>s} * A_loc_i,   N_{>s} = sum of n_j over later segments j

With a segment-length-adaptive lambda (``lam`` per segment: :func:`adaptive_lambdas`,
lambda_s = 1 - 1/(alpha * n_s)) each segment's local GAE uses its own
gamma*lambda_s and the discount is the product over the later segments:

    A_i = prod_{j later} (gamma * lambda_j) ** n_j * A_loc_i

which is the fixed-lambda form when every lambda_j is the same.
``mode="independent"`` skips that discount (the ablation). Value targets are
the local returns A_loc + V. ``"grpo"`` (the ablation without a critic's
credit) gives every token of a rollout (R - mean) / (std + eps) over the
rollouts of its group in the batch (the replay serves a group whole:
docs/replay.md, "Groups"), each rollout counted once.
``"grpo_segments"`` takes the group's mean and std over its segments
instead, each carrying its rollout's reward, so that a rollout that
compacted k times counts 2k + 1 times in them (its k + 1 execution
segments and k summaries): GRPO as frameworks that train
each segment as a sample run it (the bias the paper names).
:func:`advantages_and_returns` is the one entry point for the four.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

import torch

#: Group-relative advantages divide by the group's reward std plus this.
GRPO_EPSILON = 1e-6

AdvantageMode = Literal["cross", "independent", "grpo", "grpo_segments"]
ADVANTAGE_MODES = ("cross", "independent", "grpo", "grpo_segments")


def adaptive_lambdas(segment_lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """[S] lambda_s = 1 - 1/(alpha * n_s) of segments of ``n_s`` trainable
    tokens (clipped at 0; an empty segment's is 1, it has no tokens to
    discount): a long segment bootstraps little, a short one much."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, not {alpha}")
    n = segment_lengths.double()
    lam = 1.0 - 1.0 / (alpha * n.clamp(min=1.0))
    return torch.where(n > 0, lam.clamp(min=0.0), torch.ones_like(lam))


def advantages_and_returns(
    mode: AdvantageMode,
    values: torch.Tensor,
    segment_lengths: torch.Tensor,
    segment_rollout: torch.Tensor,
    rewards: torch.Tensor,
    groups: Sequence[str],
    gamma: float,
    lam: float | torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    segments_per_rollout: torch.Tensor | None = None,
    factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [T], returns [T]) of the trainable tokens of some of a
    batch's rollouts (a rank's share), concatenated segment by segment, each
    rollout's segments together. ``segment_rollout`` [S] indexes the batch's
    ``rewards`` [R] and ``groups`` [R] (grpo's groups span the whole batch);
    ``token_rewards`` [T], the environment's per-step rewards on the trainable
    tokens, join the final reward in GAE's per-token rewards (grpo compares
    final rewards only); the returns are the local returns whatever the mode.
    ``lam``: one lambda, or [S] one per segment (:func:`adaptive_lambdas`);
    ``segments_per_rollout`` [R], the batch's segments of each rollout
    (``"grpo_segments"`` only); ``factors`` [S], the segments'
    :func:`cross_trajectory_factors` where the caller has them already."""
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"mode must be one of {', '.join(ADVANTAGE_MODES)}, not {mode!r}")
    rollouts, local = torch.unique_consecutive(segment_rollout, return_inverse=True)
    if len(rollouts) != len(torch.unique(segment_rollout)):
        raise ValueError("each rollout's segments must be consecutive")
    advantages, returns = cross_trajectory_gae(
        values, segment_lengths, local, rewards[rollouts], gamma, lam,
        "independent" if mode == "independent" else "cross", token_rewards, factors)
    if mode in ("grpo", "grpo_segments"):
        counts = segments_per_rollout if mode == "grpo_segments" else None
        per_rollout = group_relative(rewards, groups, counts)[segment_rollout]
        advantages = torch.repeat_interleave(per_rollout, segment_lengths.long()).to(
            advantages.dtype)
    return advantages, returns


def group_relative(rewards: torch.Tensor, groups: Sequence[str],
                   counts: torch.Tensor | None = None) -> torch.Tensor:
    """[R] (R - mean) / (std + eps) over the rollouts of each one's group
    (``groups[r]``), each rollout counted ``counts[r]`` times in its group's
    mean and std (None: once)."""
    members_of: dict[str, list[int]] = defaultdict(list)
    for index, name in enumerate(groups):
        members_of[name].append(index)
    result = torch.zeros(len(rewards), dtype=torch.float64)
    for members in members_of.values():
        group = rewards[members].double()
        weight = (torch.ones(len(members), dtype=torch.float64) if counts is None
                  else counts[members].double())
        mean = (weight * group).sum() / weight.sum()
        std = (((weight * (group - mean) ** 2).sum() / weight.sum()).sqrt()
               if len(members) > 1 else torch.tensor(0.0, dtype=torch.float64))
        result[members] = (group - mean) / (std + GRPO_EPSILON)
    return result


def _segment_ids(segment_lengths: torch.Tensor) -> torch.Tensor:
    """[T] index of the segment each token belongs to."""
    return torch.repeat_interleave(
        torch.arange(len(segment_lengths), device=segment_lengths.device), segment_lengths)


def discounted_suffix_sum(x: torch.Tensor, segment_ids: torch.Tensor,
                          discount: float | torch.Tensor) -> torch.Tensor:
    """y_i = sum_{l>=0} discount^l x_{i+l}, summing only within i's segment
    (``discount``: one number, or [T] each token's, the same within a segment).

    A log-depth doubling scan: after the step of span k, y_i covers
    x_i .. x_{i+2k-1} (clipped at the segment's end), so ceil(log2(longest
    segment)) vectorised steps suffice. Only powers of ``discount`` <= 1
    appear: no overflow however long the segments are."""
    y = x.clone()
    span = 1
    longest = int(torch.bincount(segment_ids).max()) if len(segment_ids) else 0
    factor = discount
    while span < longest:
        same = segment_ids[span:] == segment_ids[:-span]
        scale = factor if isinstance(factor, float) else factor[:-span]
        y[:-span] = y[:-span] + torch.where(same, scale * y[span:], torch.zeros_like(y[span:]))
        span *= 2
        factor = factor * factor
    return y


def cross_trajectory_gae(
    values: torch.Tensor,
    segment_lengths: torch.Tensor,
    segment_rollout: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    mode: str = "cross",
    token_rewards: torch.Tensor | None = None,
    factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [T], returns [T]) for trainable tokens concatenated rollout
    by rollout, segment by segment. ``segment_lengths`` [S] counts trainable
    tokens per segment (0 allowed), ``segment_rollout`` [S] is non-decreasing
    in 0..R-1, ``rewards`` [R] the final rewards, ``lam`` one lambda or [S]
    one per segment; ``factors`` [S], :func:`cross_trajectory_factors` of
    these segments if the caller has them. Computed in float64 and returned
    in ``values``' dtype."""
    if mode not in ("cross", "independent"):
        raise ValueError(f"mode must be 'cross' or 'independent', not {mode!r}")
    if int(segment_lengths.sum()) != len(values):
        raise ValueError("segment_lengths must sum to the number of values")
    if len(segment_rollout) != len(segment_lengths):
        raise ValueError("one rollout index per segment")
    if len(segment_rollout) and bool((segment_rollout[1:] < segment_rollout[:-1]).any()):
        raise ValueError("segment_rollout must be non-decreasing")
    if isinstance(lam, torch.Tensor) and lam.shape != segment_lengths.shape:
        raise ValueError("one lambda per segment")
    lengths = segment_lengths.long()
    v = values.detach().double()
    segment_ids = _segment_ids(lengths)
    ends = torch.cumsum(lengths, 0)  # exclusive end offset of each segment

    r = torch.zeros_like(v) if token_rewards is None else token_rewards.detach().double().clone()
    nonempty = lengths > 0
    last = ends[nonempty] - 1
    r[last] += rewards.detach().double()[segment_rollout[nonempty].long()]

    next_v = torch.zeros_like(v)
    if len(v) > 1:
        same = segment_ids[1:] == segment_ids[:-1]
        next_v[:-1] = torch.where(same, v[1:], torch.zeros_like(v[1:]))
    delta = r + gamma * next_v - v
    per_segment = isinstance(lam, torch.Tensor)
    # gamma * lambda of each segment (per token), or the one of every segment
    gamma_lam = gamma * lam.double() if per_segment else gamma * lam
    local = discounted_suffix_sum(delta, segment_ids, gamma_lam[segment_ids] if per_segment
                                  else gamma_lam)
    returns = local + v

    if mode == "cross":
        if factors is None:
            factors = cross_trajectory_factors(lengths, segment_rollout, gamma_lam)
        advantages = local * torch.repeat_interleave(factors, lengths)
    else:
        advantages = local
    return advantages.to(values.dtype), returns.to(values.dtype)


def cross_trajectory_factors(segment_lengths: torch.Tensor, segment_rollout: torch.Tensor,
                             gamma_lam: float | torch.Tensor) -> torch.Tensor:
    """[S] float64 discount of each segment's local advantages by the
    trainable tokens after it in its rollout: (gamma*lam) ** N_{>s}, or with
    ``gamma_lam`` [S] one per segment, prod over the later segments j of
    (gamma * lambda_j) ** n_j. ``segment_rollout`` [S] non-decreasing."""
    lengths = segment_lengths.long()
    if not len(lengths):
        return torch.zeros(0, dtype=torch.float64)
    rollout = segment_rollout.long()
    if isinstance(gamma_lam, torch.Tensor):
        return _later_segments_product(gamma_lam.double(), lengths, rollout)
    # N_{>s}: trainable tokens of later segments in the same rollout
    ends = torch.cumsum(lengths, 0)
    rollout_end = torch.zeros(int(rollout.max()) + 1, dtype=torch.long, device=lengths.device)
    rollout_end.scatter_reduce_(0, rollout, ends, reduce="amax")
    later = rollout_end[rollout] - ends
    return torch.pow(torch.tensor(gamma_lam, dtype=torch.float64), later.double())


def _later_segments_product(gamma_lam: torch.Tensor, lengths: torch.Tensor,
                            rollout: torch.Tensor) -> torch.Tensor:
    """[S] prod over the later segments j of the same rollout of
    (gamma * lambda_j) ** n_j: sums of n_j log(gamma * lambda_j) after each
    segment, a zero factor counted apart (its log is -inf)."""
    zero = (lengths > 0) & (gamma_lam == 0)
    logs = torch.where((lengths > 0) & ~zero, lengths.double() * torch.log(gamma_lam),
                       torch.zeros_like(gamma_lam))

    def later_sum(x: torch.Tensor) -> torch.Tensor:
        # suffix[s] = sum_{j >= s} x_j over all segments (suffix[S] = 0); the
        # later part of s's rollout ends where the next rollout begins
        suffix = torch.cat([torch.flip(torch.cumsum(torch.flip(x, [0]), 0), [0]),
                            torch.zeros(1, dtype=x.dtype, device=x.device)])
        index = torch.arange(len(x), device=x.device)
        end = torch.zeros(int(rollout.max()) + 1, dtype=torch.long, device=x.device)
        end.scatter_reduce_(0, rollout, index + 1, reduce="amax")
        return suffix[index + 1] - suffix[end[rollout]]

    return torch.where(later_sum(zero.double()) > 0, torch.zeros_like(logs),
                       torch.exp(later_sum(logs)))

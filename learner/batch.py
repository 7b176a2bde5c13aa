"""From a replay ``Batch`` to training sequences, checked, and split over ranks.

Every segment is one sequence. Its trainable tokens are those the actor
sampled in it (the loss mask), minus summary tokens when ``train_summary``
is off. Whole rollouts go to one rank (its advantages need all its
segments); rollouts are spread so that ranks get similar token counts, and
minibatches are cut the same way whatever the number of ranks, so that 1
rank and N ranks see the same minibatches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocol import Batch


class BatchError(ValueError):
    """A batch the learner refuses before any update."""


@dataclass
class Sequence:
    tokens: torch.Tensor
    """int64 [L]"""
    trainable: torch.Tensor
    """bool [L]: tokens in the loss."""
    behaviour_logprobs: torch.Tensor
    """float32 [L]: the actor's log-probability of each sampled token."""
    rollout: int
    """Index of its rollout in the batch."""
    segment_type: str


@dataclass
class TrainBatch:
    sequences: list[Sequence]
    """Rollout by rollout, segment by segment."""
    rewards: torch.Tensor
    """float64 [R]"""
    task_ids: list[str]
    """[R], for group-relative advantages."""
    successes: list[bool]
    compactions: list[int]

    @property
    def num_rollouts(self) -> int:
        return len(self.rewards)

    def rollout_tokens(self) -> list[int]:
        counts = [0] * self.num_rollouts
        for sequence in self.sequences:
            counts[sequence.rollout] += len(sequence.tokens)
        return counts

    def minibatches(self, count: int) -> list[list[int]]:
        """Rollout indices of each minibatch: contiguous, equal in rollouts."""
        size = math.ceil(self.num_rollouts / count)
        return [list(range(i, min(i + size, self.num_rollouts)))
                for i in range(0, self.num_rollouts, size)]

    def assign(self, rollouts: list[int], world_size: int) -> list[list[int]]:
        """Split ``rollouts`` over ranks, largest first to the least loaded."""
        tokens = self.rollout_tokens()
        shares: list[list[int]] = [[] for _ in range(world_size)]
        loads = [0] * world_size
        for rollout in sorted(rollouts, key=lambda r: (-tokens[r], r)):
            rank = loads.index(min(loads))
            shares[rank].append(rollout)
            loads[rank] += tokens[rollout]
        return [sorted(share) for share in shares]


def to_train_batch(batch: Batch, train_summary: bool) -> TrainBatch:
    """Convert and check: every rollout ends with a final segment carrying a
    finite reward, and each segment's arrays agree (the codec checked the
    wire; this guards what the learner relies on)."""
    sequences: list[Sequence] = []
    rewards, task_ids, successes, compactions = [], [], [], []
    for index, rollout in enumerate(batch.rollouts):
        if not rollout.segments or not rollout.segments[-1].final:
            raise BatchError(f"rollout {rollout.rollout_id} has no final segment")
        final = rollout.segments[-1]
        if final.reward is None or not math.isfinite(final.reward):
            raise BatchError(f"rollout {rollout.rollout_id} has no finite reward")
        for segment in rollout.segments:
            tokens = torch.from_numpy(segment.tokens.numpy().astype("int64"))
            mask = torch.from_numpy(segment.loss_mask.numpy().astype(bool))
            logprobs = torch.from_numpy(segment.logprobs.numpy().copy())
            if not len(tokens) == len(mask) == len(logprobs):
                raise BatchError(f"rollout {rollout.rollout_id}: segment arrays disagree")
            if mask[:1].any():
                raise BatchError(f"rollout {rollout.rollout_id}: a trainable first token "
                                 "has no context to be predicted from")
            if not train_summary and segment.segment_type == "summary":
                mask = torch.zeros_like(mask)
            sequences.append(Sequence(tokens, mask, logprobs, index, segment.segment_type))
        rewards.append(final.reward)
        task_ids.append(final.task_id)
        successes.append(bool(final.stats.success) if final.stats else final.reward > 0)
        compactions.append(final.stats.compactions if final.stats else
                           sum(s.segment_type == "summary" for s in rollout.segments))
    return TrainBatch(sequences, torch.tensor(rewards, dtype=torch.float64), task_ids,
                      successes, compactions)

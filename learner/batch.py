"""From a replay ``Batch`` to training sequences, checked, and split over ranks.

Every segment is one sequence, except that a summary segment whose prompt
is the execution segment before it (the window it summarises, as the actors
emit them) shares that sequence: one forward pass covers both, ~40 % fewer
tokens per step at the local default; each keeps its own advantages and
loss weights (``segment_lengths``). The trainable tokens are those the actor
sampled (the loss mask), minus summary tokens when ``train_summary`` is off.
Whole rollouts go to one rank (its advantages need all its segments);
rollouts are spread so that ranks get similar token counts, and minibatches
are cut the same way whatever the number of ranks, so that 1 rank and N
ranks see the same minibatches.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from protocol import Batch


class BatchError(ValueError):
    """A batch the learner refuses before any update."""


@dataclass
class TrainSequence:
    """The learner's unit of training: one forward pass over a segment, or
    over consecutive segments that share their prompt (``share_prefixes``)."""

    tokens: torch.Tensor
    """int64 [L]"""
    trainable: torch.Tensor
    """bool [L]: tokens in the loss."""
    behaviour_logprobs: torch.Tensor
    """float32 [L]: the actor's log-probability of each sampled token."""
    rollout: int
    """Index of its rollout in the batch."""
    segment_type: str
    """Of its last segment."""
    segment_lengths: list[int]
    """Trainable tokens of each segment it holds, in order (their trainable
    tokens come in that order too): one entry, or an execution segment's
    and the summary segment that shares it."""
    token_rewards: torch.Tensor | None = None
    """float64 [L]: the environment's per-step rewards (``Segment.token_rewards``);
    None where the segments carry none."""
    versions: torch.Tensor | None = None
    """int32 [L]: the policy version that sampled each token (-1 off sampled
    tokens, ``Segment.versions``); what the rollout viewer shows as lag."""


@dataclass
class TrainBatch:
    sequences: list[TrainSequence]
    """Rollout by rollout, segment by segment."""
    rewards: torch.Tensor
    """float64 [R]"""
    task_ids: list[str]
    """[R], the tasks played."""
    successes: list[bool]
    compactions: list[int]
    tags: list[dict[str, str]]
    """[R], the tasks' labels (``RolloutStats.tags``)."""
    infos: list[dict[str, str | bool | float]]
    """[R], the environments' last ``info`` (``RolloutStats.info``)."""
    groups: list[str]
    """[R], whom group-relative advantages compare each rollout with: the
    rollouts of its ``Segment.group`` (one actor incarnation's), or, without
    one, of its task."""
    group_sizes: list[int]
    """[R], G of each rollout's group (``GroupTag.size``); 0 without one."""
    actors: list[str]
    """[R], the actor that played each rollout (its segments' ``sender_id``),
    which the rollout viewer names."""

    @property
    def num_rollouts(self) -> int:
        return len(self.rewards)

    def grouped_rollouts(self) -> dict[bool, int]:
        """Rollouts with a group, by whether all G of their group are in the
        batch: what ``advantage = grpo`` assumes of each group."""
        present = Counter(group for group, size in zip(self.groups, self.group_sizes, strict=True)
                          if size)
        counts = {True: 0, False: 0}
        for group, size in zip(self.groups, self.group_sizes, strict=True):
            if size:
                counts[present[group] == size] += 1
        return counts

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


def microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of the sequences of these lengths per micro-batch, so that
    each micro-batch padded to its longest sequence (rows x longest tokens)
    fits in ``budget`` tokens; a sequence longer than that goes alone.
    Longest first, each filled before the next is opened: similar lengths
    share a micro-batch, so little of it is padding."""
    groups: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        # the first of a micro-batch is its longest
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def to_train_batch(batch: Batch, train_summary: bool, share_prefixes: bool = True
                   ) -> TrainBatch:
    """Convert and check: every rollout ends with a final segment carrying a
    finite reward, and each segment's arrays agree (the codec checked the
    wire; this guards what the learner relies on). With ``share_prefixes``,
    a summary segment that extends the execution segment before it is
    merged into that sequence."""
    sequences: list[TrainSequence] = []
    rewards, task_ids, successes, compactions, actors = [], [], [], [], []
    tags: list[dict[str, str]] = []
    infos: list[dict[str, str | bool | float]] = []
    groups: list[str] = []
    group_sizes: list[int] = []
    for index, rollout in enumerate(batch.rollouts):
        if not rollout.segments or not rollout.segments[-1].final:
            raise BatchError(f"rollout {rollout.rollout_id} has no final segment")
        final = rollout.segments[-1]
        if final.reward is None or not math.isfinite(final.reward):
            raise BatchError(f"rollout {rollout.rollout_id} has no finite reward")
        previous: TrainSequence | None = None
        for segment in rollout.segments:
            tokens = torch.from_numpy(segment.tokens.numpy().astype("int64"))
            mask = torch.from_numpy(segment.loss_mask.numpy().astype(bool))
            logprobs = torch.from_numpy(segment.logprobs.numpy().copy())
            versions = torch.from_numpy(segment.versions.numpy().astype("int32"))
            if not len(tokens) == len(mask) == len(logprobs) == len(versions):
                raise BatchError(f"rollout {rollout.rollout_id}: segment arrays disagree")
            if mask[:1].any():
                raise BatchError(f"rollout {rollout.rollout_id}: a trainable first token "
                                 "has no context to be predicted from")
            step_rewards = (None if segment.token_rewards is None else
                            torch.from_numpy(segment.token_rewards.numpy().astype("float64")))
            if step_rewards is not None and len(step_rewards) != len(tokens):
                raise BatchError(f"rollout {rollout.rollout_id}: segment arrays disagree")
            if not train_summary and segment.segment_type == "summary":
                mask = torch.zeros_like(mask)
                step_rewards = None
            count = int(mask.sum())
            if share_prefixes and previous is not None and shares_prefix(
                    previous.segment_type, previous.tokens, segment.segment_type, tokens, mask):
                _merge(previous, segment.segment_type, tokens, mask, logprobs, versions,
                       step_rewards, count)
                previous = None  # a sequence holds one summary at most
                continue
            previous = TrainSequence(tokens, mask, logprobs, index, segment.segment_type, [count],
                                     step_rewards, versions)
            sequences.append(previous)
        rewards.append(final.reward)
        task_ids.append(final.task_id)
        successes.append(bool(final.stats.success) if final.stats else final.reward > 0)
        compactions.append(final.stats.compactions if final.stats else
                           sum(s.segment_type == "summary" for s in rollout.segments))
        tags.append(dict(final.stats.tags) if final.stats else {})
        infos.append(dict(final.stats.info) if final.stats else {})
        groups.append(repr(("task", final.task_id) if final.group is None
                           else ("group", final.sender_id, final.incarnation, final.group.id)))
        group_sizes.append(0 if final.group is None else final.group.size)
        actors.append(final.sender_id)
    return TrainBatch(sequences, torch.tensor(rewards, dtype=torch.float64), task_ids,
                      successes, compactions, tags, infos, groups, group_sizes, actors)


def _merge(previous: TrainSequence, segment_type: str, tokens: torch.Tensor, mask: torch.Tensor,
           logprobs: torch.Tensor, versions: torch.Tensor, step_rewards: torch.Tensor | None,
           count: int) -> None:
    """Extend ``previous`` by the segment that continues it (its tokens
    start with ``previous``'s): the sequence is trained once, its prefix
    shared."""
    n = len(previous.tokens)
    previous.tokens = tokens
    previous.trainable = torch.cat([previous.trainable, mask[n:]])
    previous.behaviour_logprobs = torch.cat([previous.behaviour_logprobs, logprobs[n:]])
    if previous.versions is not None:
        previous.versions = torch.cat([previous.versions, versions[n:]])
    if step_rewards is not None or previous.token_rewards is not None:
        earlier = (previous.token_rewards if previous.token_rewards is not None
                   else torch.zeros(n, dtype=torch.float64))
        later = (step_rewards[n:] if step_rewards is not None
                 else torch.zeros(len(tokens) - n, dtype=torch.float64))
        previous.token_rewards = torch.cat([earlier, later])
    previous.segment_type = segment_type
    previous.segment_lengths.append(count)


def shares_prefix(previous_type: str, previous_tokens: torch.Tensor, segment_type: str,
                  tokens: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether a segment (``tokens``, its loss ``mask``) goes into the
    sequence before it (``previous_type``, ``previous_tokens``) under
    ``share_prefixes``: a summary segment whose prompt is that execution
    sequence, whole, with tokens after it. None of the prompt may be in the
    loss, since the merged sequence keeps the earlier sequence's mask there.
    The rollout viewer (deploy/viewer.py) cuts held-out episodes by it too."""
    if previous_type != "execution" or segment_type != "summary":
        return False
    n = len(previous_tokens)
    return (len(tokens) > n and not mask[:n].any()
            and torch.equal(tokens[:n], previous_tokens))

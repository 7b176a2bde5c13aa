"""What the learner trained with, kept for the rollout viewer
(``compactionrl view``, docs/running.md "Looking at a run"): a few rollouts of
some steps, each trained token with the advantage, importance weight, loss
weight, version lag and behaviour log-probability the loss used, each segment
with its type and cross-trajectory factor. They are taken where the step
computes them (:meth:`learner.ppo.PPOTrainer.step`), never recomputed later.

Bounded whatever the run's length: once step T is reached, the steps kept
are the multiples of the smallest power of two s with T // s <= ``most_steps``
(:func:`kept_stride`), so a run keeps at most ``most_steps`` files spread from
its start to its end (early, middle and late), each of ``rollouts`` rollouts
(by default 64 steps of 2 rollouts: a few MB at the local default's size).
Rank 0 keeps them in every run (``compactionrl view`` reads them); what it
costs a step is bench/samples.py's.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from learner.batch import TrainBatch, TrainSequence
from learner.config import LearnerConfig
from learner.losses import importance_weights


class Share(Protocol):
    """What is read of the trainer's share of a minibatch (learner.ppo.Share,
    which imports this module)."""

    sequences: list[TrainSequence]
    global_tokens: float
    loss_weights: list[torch.Tensor]


class ShareValues(Protocol):
    """What is read of a share's advantage side (learner.ppo.ShareValues)."""

    advantages: list[torch.Tensor]
    factors: torch.Tensor


class StartValues(Protocol):
    """What is read of a share's start values (learner.ppo.StartValues)."""

    logp_prox: list[torch.Tensor]
    values: ShareValues

#: The folder of a run that holds the samples.
SAMPLES_FOLDER = "samples"
#: One file per kept step.
SAMPLE_FILE = re.compile(r"step-(\d+)\.json")


@dataclass
class TrainedSequence:
    """One sequence as the loss saw it: its tokens, and per trained token
    (in order) what the loss used."""

    tokens: list[int]
    trainable: list[int]
    """Positions of the trained tokens."""
    segment_types: list[str]
    segment_lengths: list[int]
    """Trained tokens of each segment the sequence holds (one, or an
    execution segment and the summary that extends it)."""
    factors: list[float]
    """Each segment's (gamma*lambda)^N_>s (0 for a segment with no trained token)."""
    advantage: list[float]
    is_weight: list[float]
    loss_weight: list[float]
    behaviour_logprob: list[float]
    versions: list[int]
    """The policy version that sampled each trained token: the step's
    version less it is the token's lag."""


@dataclass
class TrainedRollout:
    """One rollout of a step, sequence by sequence."""

    task_id: str
    reward: float
    success: bool
    compactions: int
    tags: dict[str, str]
    info: dict[str, str | bool | float]
    """The environment's last ``info`` (``RolloutStats.info``)."""
    sequences: list[TrainedSequence] = field(default_factory=list)
    actor: str = ""
    """The actor that played it (``TrainBatch.actors``); none is named of a
    rollout made by hand (tests, bench/samples.py)."""


def kept_stride(step: int, most_steps: int) -> int:
    """The smallest power of two s such that at most ``most_steps`` of the
    steps 1 .. ``step`` are multiples of s."""
    stride = 1
    while step // stride > most_steps:
        stride *= 2
    return stride


def rounded(values: list[float]) -> list[float]:
    """Four significant digits: what a colour shows, a tenth of the bytes."""
    return [float(f"{value:.4g}") for value in values]


def trained_rollouts(batch: TrainBatch, shares: list[Share], starts: list[StartValues | None],
                     count: int, config: LearnerConfig) -> list[TrainedRollout]:
    """``count`` of a rank's rollouts (of ``shares``, with the step's
    ``starts``: None for a share with nothing trained), spread over their
    compaction counts from fewest to most, each token as the loss used it."""
    held = sorted({s.rollout for share in shares for s in share.sequences},
                  key=lambda r: (batch.compactions[r], r))
    picks = sorted({held[round(i * (len(held) - 1) / max(count - 1, 1))]
                    for i in range(min(count, len(held)))})
    kept = {r: TrainedRollout(batch.task_ids[r], float(batch.rewards[r]), batch.successes[r],
                              batch.compactions[r], batch.tags[r], batch.infos[r],
                              actor=batch.actors[r])
            for r in picks}
    for share, start in zip(shares, starts, strict=True):
        if start is None:
            continue  # nothing trained: no advantages were computed
        first = 0
        for i, sequence in enumerate(share.sequences):
            segments = len(sequence.segment_lengths)
            if sequence.rollout in kept:
                kept[sequence.rollout].sequences.append(trained_sequence(
                    sequence, share.loss_weights[i], start.values.advantages[i],
                    start.logp_prox[i], start.values.factors[first:first + segments].tolist(),
                    config))
            first += segments
    return [kept[r] for r in picks]


def trained_sequence(sequence: TrainSequence, loss_weights: torch.Tensor,
                     advantages: torch.Tensor, logp_prox: torch.Tensor, factors: list[float],
                     config: LearnerConfig) -> TrainedSequence:
    """One sequence's trained tokens with what the loss used: its advantages,
    pi_prox/mu capped as the loss caps it, and its loss weights c_t."""
    trained = sequence.trainable
    weight, _ = importance_weights(logp_prox.float().cpu(), sequence.behaviour_logprobs,
                                   config.is_cap, config.is_mode)
    versions = (sequence.versions if sequence.versions is not None
                else torch.full_like(sequence.tokens, -1))
    types = ["execution"] * (len(sequence.segment_lengths) - 1) + [sequence.segment_type]
    return TrainedSequence(
        tokens=sequence.tokens.tolist(), trainable=trained.nonzero().flatten().tolist(),
        segment_types=types, segment_lengths=list(sequence.segment_lengths),
        factors=rounded(factors), advantage=rounded(advantages[trained].tolist()),
        is_weight=rounded(weight[trained].tolist()),
        loss_weight=rounded(loss_weights[trained].tolist()),
        behaviour_logprob=rounded(sequence.behaviour_logprobs[trained].tolist()),
        versions=versions[trained].tolist())


@dataclass
class SampleRecorder:
    """Writes a step's sampled rollouts to ``folder`` and keeps the bound."""

    folder: Path
    rollouts: int = 2
    """Rollouts kept of each kept step (rank 0's first ones)."""
    most_steps: int = 64

    def wants(self, step: int) -> bool:
        return step % kept_stride(step, self.most_steps) == 0

    def record(self, step: int, version: int, rollouts: list[TrainedRollout]) -> None:
        """Write step ``step``'s rollouts (whole, then renamed), then drop the
        files the bound no longer keeps."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step-{step:07d}.json"
        partial = path.with_suffix(".partial")
        # vars, not dataclasses.asdict: asdict deep-copies every list, the
        # most of what recording cost a step (bench/samples.py)
        partial.write_text(json.dumps({"step": step, "version": version, "rollouts": [
            {**vars(r), "sequences": [vars(q) for q in r.sequences]} for r in rollouts]}))
        os.replace(partial, path)
        stride = kept_stride(step, self.most_steps)
        for kept in self.folder.iterdir():
            match = SAMPLE_FILE.fullmatch(kept.name)
            if match and int(match.group(1)) % stride:
                kept.unlink(missing_ok=True)


def read_samples(run_dir: Path) -> list[dict]:
    """The kept steps of a run, in step order (a file cut short is skipped)."""
    steps = []
    for path in sorted((run_dir / SAMPLES_FOLDER).glob("step-*.json")):
        try:
            steps.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return steps

"""One learner step: importance-corrected PPO with a critic over one batch.

1. Cut the batch into minibatches of whole rollouts (the same cut for any
   number of ranks) and give each rank whole rollouts of each minibatch.
2. With the weights at the step's start: log pi_prox of every token and the
   critic's values (no gradient). With one minibatch (the default) its first
   update already runs at those weights, so they are taken from that update's
   own forward passes instead: one forward pass per model less each step
   (the policy's only, when the share is cut into micro-batches: the
   advantages need every old value before the first value loss).
3. Advantages (cross-trajectory GAE, independent GAE, or group-relative) and
   value targets, per rollout.
4. ``ppo_epochs`` passes over the minibatches: the policy loss and the
   clipped value loss with each token's loss weight c_t passed to them
   (:func:`learner.losses.loss_weights`: 1/|M|, |M| the minibatch's
   trainable tokens over all ranks, or per segment for the ablation), one
   optimizer step each. What the step reports is summed in a
   :class:`StepStatistics`.

The step is planned before it starts (:class:`StepPlan`: shares,
micro-batches, global counts, epochs, fused or not). Each share's advantage
side is computed once, where its old values are (:func:`share_values`):
advantages, returns, each segment's cross-trajectory factor and whether it
is a summary, which the loss, the step's statistics and the sampled
rollouts read. In a fused step (one minibatch) the first update takes from
its own passes, which run at the step's start weights, what the step's
start would otherwise compute (log pi_prox, and with one micro-batch the old
values) and returns the share's :class:`StartValues`, complete. The losses
of a pass and their backward are :meth:`PPOTrainer._losses`, in the paper's
order.

The critic is a model of its own (each model has its loss and optimizer) or,
with ``critic = "value_head"``, a head on the policy: one pass gives log-
probabilities and values, the loss is the policy loss plus
``value_loss_coef`` times the value loss, and one optimizer moves the body
at ``lr`` and the head at ``critic_lr``.

With ``max_tokens_per_microbatch``, each rank's share of a minibatch goes
through the models in micro-batches of whole sequences within that budget,
their gradients accumulated: every loss term is already divided by the
minibatch's global count, so the sum over micro-batches is the update of the
whole share. Every rank runs the same number of forward and backward passes
per model and minibatch (ranks agree on the largest count of micro-batches;
one with fewer, or none, runs dummy sequences), so FSDP's collectives always
match.

Usage::

    trainer = PPOTrainer(policy, critic, config.learner)
    metrics = trainer.step(to_train_batch(batch, config.learner.train_summary))

    # the same step, spelled out:
    plan = trainer.plan(train_batch)
    known = [trainer.start_values(share, train_batch, plan.fused) for share in plan.shares]
    starts = [trainer.update(share, *start, train_batch, statistics)
              for share, start in zip(plan.shares, known)]
    for _ in range(plan.epochs - 1):
        starts = [trainer.update(share, start.logp_prox, start.values, train_batch, statistics)
                  for share, start in zip(plan.shares, starts)]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from learner.advantages import (
    adaptive_lambdas,
    advantages_and_returns,
    cross_trajectory_factors,
)
from learner.batch import TrainBatch, TrainSequence, microbatches
from learner.collectives import all_reduce_floats, world
from learner.config import LearnerConfig, memory_switches
from learner.losses import (
    explained_variance,
    loss_weights,
    policy_loss,
    residual_moments,
    value_loss,
)
from learner.models import (
    Critic,
    is_value_head,
    pad,
    token_logprobs,
    token_logprobs_and_values,
    token_values,
)
from learner.samples import TrainedRollout, trained_rollouts
from ops.summary import COMPACTION_BUCKETS, compaction_bucket


@dataclass(frozen=True)
class Share:
    """One rank's share of one minibatch (whole rollouts), cut before the
    step starts: its sequences in micro-batches (as many on every rank; an
    empty one runs a dummy sequence), the minibatch's trainable tokens over
    every rank, and each sequence's [L] loss weights c_t (0 off its
    trainable tokens: :func:`learner.losses.loss_weights`)."""

    sequences: list[TrainSequence]
    groups: list[list[int]]
    global_tokens: float
    loss_weights: list[torch.Tensor]


@dataclass(frozen=True)
class StepPlan:
    """A step, decided before it starts: this rank's share of each minibatch,
    the epochs over them, and whether it is *fused* (one minibatch: its first
    update runs at the step's start weights, so that update's own passes give
    log pi_prox, and with one micro-batch the old values too, instead of
    passes of their own)."""

    shares: list[Share]
    epochs: int
    fused: bool


@dataclass(frozen=True)
class ShareValues:
    """A share's old values (the critic's at the step's start weights) and
    its advantage side, computed once from them (:func:`share_values`)."""

    old_values: list[torch.Tensor]
    """Per sequence, [L]."""
    advantages: list[torch.Tensor]
    """Per sequence, [L] (zero off its trainable tokens; whitened where configured)."""
    returns: list[torch.Tensor]
    """Per sequence, [L]: the value targets."""
    factors: torch.Tensor
    """[S] float64 (gamma*lambda)^{N_>s} of every segment, in order, under the
    run's gamma and lambda, whatever the advantage mode applies."""
    is_summary: torch.Tensor
    """[S] bool: the segment is a summary."""
    trained: torch.Tensor
    """[S] bool: the segment has trainable tokens."""


@dataclass(frozen=True)
class StartValues:
    """What the step's start weights give a share: per sequence [L] log
    pi_prox, and its :class:`ShareValues`."""

    logp_prox: list[torch.Tensor]
    values: ShareValues


@dataclass(frozen=True)
class Rows:
    """One micro-batch's per-token [B, L] rows, on the models' device: what
    the loss compares the new policy and values with."""

    trainable: torch.Tensor
    behaviour: torch.Tensor
    prox: torch.Tensor | None
    """log pi_prox; None: the pass's own log-probabilities (a fused step's first update)."""
    advantages: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    weights: torch.Tensor


@dataclass(frozen=True)
class Losses:
    """One pass's loss terms (0 for a side not evaluated) and their statistics."""

    policy: torch.Tensor
    value: torch.Tensor
    policy_stats: dict[str, torch.Tensor]
    value_stats: dict[str, torch.Tensor]


@dataclass
class StepStatistics:
    """Sums over a step's forward passes and updates. The first group is
    summed over ranks too (each rank's losses are already divided by global
    counts); ``updates`` and ``policy_grad_norm`` are the same on every rank.
    :meth:`metrics` makes the step's metrics of them."""

    tokens: float = 0.0
    """Trainable tokens in the loss, each epoch's again."""
    policy_loss: float = 0.0
    value_loss: float = 0.0
    clipfrac: float = 0.0
    """This and the next four: token-weighted sums of the losses' local means."""
    approx_kl: float = 0.0
    is_weight_mean: float = 0.0
    is_affected_frac: float = 0.0
    value_clipfrac: float = 0.0
    return_sum: float = 0.0
    """This and the next three: :func:`learner.losses.residual_moments`."""
    return_square_sum: float = 0.0
    residual_sum: float = 0.0
    residual_square_sum: float = 0.0
    summary_factor_sum: float = 0.0
    """This and the next three: :meth:`add_factors`."""
    summary_segments: float = 0.0
    execution_factor_sum: float = 0.0
    execution_segments: float = 0.0
    updates: int = 0
    policy_grad_norm: float = 0.0
    loss_weights: list[float] = field(default_factory=lambda: [0.0] * len(COMPACTION_BUCKETS))
    """The loss weights c_t of the rollouts in each compaction bucket
    (:data:`ops.summary.COMPACTION_BUCKETS`), summed over the step's
    minibatches: :meth:`add_loss_weights`."""

    #: Fields that are the same on every rank: not summed over ranks.
    RANK_INVARIANT = ("updates", "policy_grad_norm")

    def add_pass(self, tokens: float, policy: torch.Tensor, value: torch.Tensor,
                 policy_stats: dict[str, torch.Tensor], value_stats: dict[str, torch.Tensor],
                 moments: dict[str, float]) -> None:
        self.tokens += tokens
        self.policy_loss += policy.item()
        self.value_loss += value.item()
        for name, mean in {**policy_stats,
                           **{f"value_{k}": v for k, v in value_stats.items()}}.items():
            setattr(self, name, getattr(self, name) + float(mean) * tokens)
        for name, total in moments.items():
            setattr(self, name, getattr(self, name) + total)

    def add_share(self, share: Share, values: ShareValues, compactions: list[int]) -> None:
        """What a step reports of one share, once: the cross-trajectory
        factors of its segments with trainable tokens, summed by segment
        type, and its loss weights by compaction bucket (each minibatch's
        sum to 1 over the ranks: what the loss normalisation gives rollouts
        that compacted more, docs/learner.md "Loss weight by compaction count")."""
        factors = values.factors[values.trained]
        is_summary = values.is_summary[values.trained]
        self.summary_factor_sum += float(factors[is_summary].sum())
        self.summary_segments += int(is_summary.sum())
        self.execution_factor_sum += float(factors[~is_summary].sum())
        self.execution_segments += int((~is_summary).sum())
        for sequence, weights in zip(share.sequences, share.loss_weights, strict=True):
            bucket = compaction_bucket(compactions[sequence.rollout])
            self.loss_weights[COMPACTION_BUCKETS.index(bucket)] += float(weights.sum())

    def summed_over_ranks(self) -> StepStatistics:
        """One all-reduce for every sum of the step."""
        names = [f.name for f in dataclasses.fields(self)
                 if f.name not in (*self.RANK_INVARIANT, "loss_weights")]
        totals = all_reduce_floats([getattr(self, name) for name in names] + self.loss_weights)
        return dataclasses.replace(self, **dict(zip(names, totals, strict=False)),
                                   loss_weights=totals[len(names):])

    def metrics(self, epochs: int) -> dict[str, float]:
        """Per update (losses, gradient norm), per token (the rest), the
        explained variance of the whole batch, and the batch's tokens."""
        updates, tokens = max(self.updates, 1), max(self.tokens, 1.0)
        per_token = ("clipfrac", "approx_kl", "is_weight_mean", "is_affected_frac",
                     "value_clipfrac")
        return {
            "losses/policy_loss": self.policy_loss / updates,
            "losses/value_loss": self.value_loss / updates,
            **({"losses/policy_grad_norm": self.policy_grad_norm / updates}
               if self.policy_grad_norm else {}),
            **{f"losses/{name}": getattr(self, name) / tokens for name in per_token},
            "losses/value_explained_variance": explained_variance(
                {name: getattr(self, name) for name in ("return_sum", "return_square_sum",
                                                        "residual_sum", "residual_square_sum")},
                self.tokens),
            "tokens": self.tokens / epochs,
            **{f"advantages/{name}": getattr(self, name)
               for name in ("summary_factor_sum", "summary_segments", "execution_factor_sum",
                            "execution_segments")},
            **{f"loss_weight/{bucket}": total
               for bucket, total in zip(COMPACTION_BUCKETS, self.loss_weights, strict=True)},
        }


def _segments(sequences: list[TrainSequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """[S] trainable tokens and rollout index of each segment (a sequence
    may hold two), in order."""
    return (torch.tensor([n for s in sequences for n in s.segment_lengths], dtype=torch.long),
            torch.tensor([s.rollout for s in sequences for _ in s.segment_lengths],
                         dtype=torch.long))


# -------------------------------------------------------------------- advantages


def share_values(config: LearnerConfig, batch: TrainBatch, sequences: list[TrainSequence],
                 old_values: list[torch.Tensor]) -> ShareValues:
    """A share's advantage side from its ``old_values`` (per sequence [L]),
    computed once: the advantage mode's advantages and returns over the
    trainable tokens (learner.advantages), laid back into each sequence, and
    each segment's factor. Whitening is collective: every rank calls this,
    an empty share too."""
    lengths, rollout_of = _segments(sequences)
    lam = (adaptive_lambdas(lengths, config.lam_alpha) if config.lam_mode == "adaptive"
           else config.lam)
    factors = cross_trajectory_factors(lengths, rollout_of, config.gamma * lam)
    advantages, returns = (_gae(config, batch, sequences, old_values, lengths, rollout_of, lam,
                                factors) if sequences else ([], []))
    if config.whiten_advantages:
        advantages = _whiten(sequences, advantages)
    # A sequence of two segments holds an execution segment, then its summary.
    is_summary = torch.tensor([i == len(s.segment_lengths) - 1 and s.segment_type == "summary"
                               for s in sequences for i in range(len(s.segment_lengths))],
                              dtype=torch.bool)
    return ShareValues(old_values, advantages, returns, factors, is_summary, lengths > 0)


def _gae(config: LearnerConfig, batch: TrainBatch, sequences: list[TrainSequence],
         values: list[torch.Tensor], lengths: torch.Tensor, rollout_of: torch.Tensor,
         lam: float | torch.Tensor, factors: torch.Tensor
         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The advantage mode's advantages and returns over the sequences'
    trainable tokens, laid back into each sequence."""
    flat_values = torch.cat([v[s.trainable] for s, v in zip(sequences, values, strict=True)])
    step_rewards = (torch.cat([s.token_rewards[s.trainable] if s.token_rewards is not None
                               else torch.zeros(int(s.trainable.sum()), dtype=torch.float64)
                               for s in sequences])
                    if any(s.token_rewards is not None for s in sequences) else None)
    segments_per_rollout = None
    if config.advantage == "grpo_segments":  # the whole batch's: its groups span it
        segments_per_rollout = torch.zeros(len(batch.rewards), dtype=torch.float64)
        for sequence in batch.sequences:
            segments_per_rollout[sequence.rollout] += len(sequence.segment_lengths)
    flat_adv, flat_ret = advantages_and_returns(
        config.advantage, flat_values.double(), lengths, rollout_of, batch.rewards,
        batch.groups, config.gamma, lam, step_rewards, segments_per_rollout, factors)
    advantages, returns, offset = [], [], 0
    for sequence in sequences:
        n = sum(sequence.segment_lengths)
        adv = torch.zeros(len(sequence.tokens), dtype=torch.float64)
        ret = torch.zeros(len(sequence.tokens), dtype=torch.float64)
        adv[sequence.trainable] = flat_adv[offset: offset + n]
        ret[sequence.trainable] = flat_ret[offset: offset + n]
        advantages.append(adv.float())
        returns.append(ret.float())
        offset += n
    return advantages, returns


def _whiten(sequences: list[TrainSequence], advantages: list[torch.Tensor]) -> list[torch.Tensor]:
    """The trainable tokens' advantages less their mean over every rank,
    over their standard deviation."""
    picked = [a[s.trainable].double() for s, a in zip(sequences, advantages, strict=True)]
    flat = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.float64)
    count, total, squares = all_reduce_floats([len(flat), flat.sum().item(),
                                         (flat ** 2).sum().item()])
    mean = total / max(count, 1)
    std = max((squares / max(count, 1) - mean ** 2), 0.0) ** 0.5 + 1e-8
    return [torch.where(s.trainable, (a - mean) / std, a)
            for s, a in zip(sequences, advantages, strict=True)]


# -------------------------------------------------------------------- the trainer

class PPOTrainer:
    def __init__(self, policy: nn.Module, critic: Critic | None, config: LearnerConfig) -> None:
        """``critic`` None: ``policy`` carries a value head (``critic = "value_head"``)."""
        self.policy = policy
        self.critic = critic
        self.config = config
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if critic is None:
            named = list(policy.named_parameters())
            self.policy_optimizer = torch.optim.AdamW([
                {"params": [p for n, p in named if not is_value_head(n)]},
                {"params": [p for n, p in named if is_value_head(n)], "lr": config.critic_lr},
            ], lr=config.lr)
        else:
            self.policy_optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr)
            self.critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=config.critic_lr)
        self.rank, self.world_size = world()
        self.device = next(policy.parameters()).device
        """Where the models compute; batches are built on the CPU and moved here."""
        self.chunk_tokens, self.microbatch_tokens = memory_switches(
            config, self.device.type == "cuda")
        """The memory switches as this device uses them (``"auto"`` resolved)."""

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.policy_optimizer, self.critic_optimizer) if o is not None]

    # ------------------------------------------------------------------ the plan

    def plan(self, batch: TrainBatch) -> StepPlan:
        """This rank's share of each minibatch, its micro-batches and the
        minibatch's global counts (collective: every rank plans)."""
        shares = [self._share(batch, batch.assign(minibatch, self.world_size)[self.rank])
                  for minibatch in batch.minibatches(self.config.minibatches)]
        return StepPlan(shares, self.config.ppo_epochs, fused=len(shares) == 1)

    def _share(self, batch: TrainBatch, rollouts: list[int]) -> Share:
        chosen = set(rollouts)
        sequences = [s for s in batch.sequences if s.rollout in chosen]
        # a rollout's sequences are all in one share (it is chosen by rollout)
        rollout_tokens: dict[int, int] = {}
        for sequence in sequences:
            rollout_tokens[sequence.rollout] = (rollout_tokens.get(sequence.rollout, 0)
                                                + int(sequence.trainable.sum()))
        local_tokens = sum(rollout_tokens.values())
        local_segments = sum(n > 0 for s in sequences for n in s.segment_lengths)
        local_rollouts = sum(n > 0 for n in rollout_tokens.values())
        global_tokens, global_segments, global_rollouts = all_reduce_floats(
            [local_tokens, local_segments, local_rollouts])
        weights = []
        for sequence in sequences:
            row = torch.zeros(len(sequence.tokens))
            if global_tokens:
                row[sequence.trainable] = loss_weights(
                    torch.tensor(sequence.segment_lengths), self.config.loss_norm,
                    global_tokens, global_segments, rollout_tokens[sequence.rollout],
                    global_rollouts)
            weights.append(row)
        return Share(sequences, self._microbatches(sequences), global_tokens, weights)

    def _microbatches(self, sequences: list[TrainSequence]) -> list[list[int]]:
        """Micro-batches of ``sequences`` within the token budget, as many as
        on the rank with the most (FSDP's collectives run once per pass)."""
        budget = self.microbatch_tokens
        if budget == 0:
            # One pass on every rank: the ranks need not agree on a grouping.
            return [list(range(len(sequences)))]
        groups = microbatches([len(s.tokens) for s in sequences], budget)
        count = int(all_reduce_floats([len(groups)], dist.ReduceOp.MAX)[0])
        return groups + [[] for _ in range(count - len(groups))]

    @torch.no_grad()
    def start_values(self, share: Share, batch: TrainBatch, fused: bool
                     ) -> tuple[list[torch.Tensor] | None, ShareValues | None]:
        """What the step's start weights give ``share`` before any update:
        (log pi_prox, its :class:`ShareValues`), each None where a ``fused``
        step's first update takes it from its own passes instead. The old
        values are taken here when the share takes several micro-batches,
        since the advantages need every old value before the first value
        loss (a value head's pass gives log pi_prox with them)."""
        want_values = not fused or len(share.groups) > 1
        want_prox = not fused or (want_values and self.critic is None)
        logp, values = [], []
        for group in share.groups:
            group_logp, group_values = self._evaluate(self._ids(share.sequences, group),
                                                      want_prox, want_values)
            logp.append(group_logp)
            values.append(group_values)
        prox = _unpad(share.sequences, share.groups, logp) if want_prox else None
        return prox, (share_values(self.config, batch, share.sequences,
                                   _unpad(share.sequences, share.groups, values))
                      if want_values else None)

    def _evaluate(self, ids: torch.Tensor, logp: bool, values: bool
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """[B, L] log-probabilities and values of ``ids``, those asked for:
        the value side's one interface (a value head gives both from one
        pass, or neither; a critic model its values, the policy its
        log-probabilities)."""
        chunk = self.chunk_tokens
        if self.critic is None:
            return token_logprobs_and_values(self.policy, ids, chunk) if values else (None, None)
        return (token_logprobs(self.policy, ids, chunk) if logp else None,
                token_values(self.critic, ids) if values else None)

    def _ids(self, sequences: list[TrainSequence], group: list[int]) -> torch.Tensor:
        return pad([sequences[i].tokens for i in group]).to(self.device)

    # ------------------------------------------------------------------ the step

    def step(self, batch: TrainBatch, value_only: bool = False,
             sample: Callable[[list[TrainedRollout]], None] | None = None,
             sampled_rollouts: int = 2) -> dict[str, float]:
        """One PPO step on ``batch``; ``value_only`` (the critic's warm-up):
        the critic learns, the policy does not move (its losses are still
        measured). ``sample`` is given ``sampled_rollouts`` of this rank's
        rollouts as the loss saw them (:mod:`learner.samples`)."""
        plan = self.plan(batch)
        known = [self.start_values(share, batch, plan.fused) for share in plan.shares]
        statistics = StepStatistics()
        starts = [self.update(share, *start, batch, statistics, value_only)
                  for share, start in zip(plan.shares, known, strict=True)]
        for share, start in zip(plan.shares, starts, strict=True):
            if start is not None:
                statistics.add_share(share, start.values, batch.compactions)
        for _ in range(plan.epochs - 1):
            starts = [None if start is None else self.update(
                share, start.logp_prox, start.values, batch, statistics, value_only)
                for share, start in zip(plan.shares, starts, strict=True)]
        if sample is not None:
            sample(trained_rollouts(batch, plan.shares, starts, sampled_rollouts, self.config))
        return statistics.summed_over_ranks().metrics(plan.epochs)

    def update(self, share: Share, prox: list[torch.Tensor] | None,
               values: ShareValues | None, batch: TrainBatch, statistics: StepStatistics,
               value_only: bool = False) -> StartValues | None:
        """One optimizer step on ``share``: a training pass per micro-batch,
        then one step of every optimizer. ``prox`` and ``values`` None: a
        fused step's first update, whose passes run at the step's start
        weights, takes them from its passes. Returns the share's start values,
        complete; None when its minibatch has no trainable tokens on any rank
        (nothing to train, nor to report)."""
        if share.global_tokens == 0:
            return None
        logps = []
        for group in share.groups:
            values, logp = self._train_pass(share, prox, values, group, batch, statistics,
                                            value_only)
            logps.append(logp)
        self._step_optimizers(statistics, value_only)
        return StartValues(_unpad(share.sequences, share.groups, logps) if prox is None
                           else prox, values)

    def _train_pass(self, share: Share, prox: list[torch.Tensor] | None,
                    values: ShareValues | None, group: list[int], batch: TrainBatch,
                    statistics: StepStatistics, value_only: bool
                    ) -> tuple[ShareValues, torch.Tensor]:
        """Forward and backward over one micro-batch; returns the share's
        values (computed from this pass's when it is a fused step's first, of
        one micro-batch) and the pass's log-probabilities, detached."""
        ids = self._ids(share.sequences, group)
        logp, new_values = self._evaluate(ids, self.critic is None, True)
        if values is None:  # one micro-batch: this pass's values are the old ones
            values = share_values(self.config, batch, share.sequences,
                                  _unpad(share.sequences, share.groups, [new_values.detach()]))
        rows = self._rows(share, prox, values, group, ids)
        logp, losses = self._losses(ids, logp, new_values, rows, share.global_tokens, value_only)
        statistics.add_pass(float(rows.trainable.sum()), losses.policy, losses.value,
                            losses.policy_stats, losses.value_stats,
                            residual_moments(rows.returns, rows.old_values, rows.trainable))
        return values, logp.detach()

    def _losses(self, ids: torch.Tensor, logp: torch.Tensor | None, values: torch.Tensor,
                rows: Rows, global_tokens: float, value_only: bool
                ) -> tuple[torch.Tensor, Losses]:
        """A pass's losses and their backward, in the paper's order
        (docs/design.md §2.4):

        1. ratios pi_theta / pi_prox, and importance weights min(pi_prox / mu, is_cap);
        2. the advantages, fixed at the step's start;
        3. the clipped policy loss, each token weighted by its c_t
           (``loss_norm``: 1/|M| over every rank, or per segment);
        4. the clipped value loss against the returns, over the same |M|.

        A value head (``logp`` from the same pass): one backward of the
        policy loss plus ``value_loss_coef`` times the value loss (in the
        warm-up that alone). A critic model: the value loss's backward first,
        so that the critic's activations are freed before the policy's
        forward, then the policy loss's (only measured in the warm-up). FSDP
        averages gradients over ranks: scaling each loss by the world size
        makes that average the sum the global token count normalises.
        Returns the policy's log-probabilities and the losses."""
        value, value_stats = value_loss(values, rows.old_values, rows.returns,
                                        rows.trainable / global_tokens, self.config.value_clip)
        if self.critic is not None:
            (value * self.world_size).backward()
            with torch.no_grad() if value_only else contextlib.nullcontext():
                logp, _ = self._evaluate(ids, True, False)
        prox = logp.detach() if rows.prox is None else rows.prox
        policy, policy_stats = policy_loss(
            logp, prox, rows.behaviour, rows.advantages, rows.weights, self.config.clip_low,
            self.config.clip_high, self.config.is_cap, self.config.is_mode)
        coef = self.config.value_loss_coef
        if self.critic is None:
            total = coef * value if value_only else policy + coef * value
            (total * self.world_size).backward()
        elif not value_only:
            (policy * self.world_size).backward()
        return logp, Losses(policy, value, policy_stats, value_stats)

    def _rows(self, share: Share, prox: list[torch.Tensor] | None, values: ShareValues,
              group: list[int], ids: torch.Tensor) -> Rows:
        """The micro-batch's rows, padded to its ids."""

        def stacked(per_sequence: list[torch.Tensor]) -> torch.Tensor:
            return _stack([per_sequence[i] for i in group], ids.shape).to(self.device)

        return Rows(trainable=stacked([s.trainable for s in share.sequences]),
                    behaviour=stacked([s.behaviour_logprobs for s in share.sequences]),
                    prox=None if prox is None else stacked(prox),
                    advantages=stacked(values.advantages),
                    old_values=stacked(values.old_values), returns=stacked(values.returns),
                    weights=stacked(share.loss_weights))

    def _step_optimizers(self, statistics: StepStatistics, value_only: bool) -> None:
        """Clip the gradients and step every optimizer. In a value head's
        warm-up the value loss reached the shared body too: only the head moves."""
        if value_only and self.critic is None:
            for name, parameter in self.policy.named_parameters():
                if not is_value_head(name):
                    parameter.grad = None
        if self.config.max_grad_norm > 0:
            # With a value head, the policy's parameters include the head, so one
            # norm is taken over the body and both heads.
            norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(),
                                                  self.config.max_grad_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            statistics.policy_grad_norm += float(norm)
            if self.critic is not None:
                torch.nn.utils.clip_grad_norm_(self.critic.parameters(),
                                               self.config.max_grad_norm)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        statistics.updates += 1


def _unpad(sequences: list[TrainSequence], groups: list[list[int]], outputs: list[torch.Tensor]
           ) -> list[torch.Tensor]:
    """Per sequence, in order, its [L] row of its micro-batch's [B, L'] output, on the CPU."""
    rows = {index: output[row, : len(sequences[index].tokens)]
            for group, output in zip(groups, (o.cpu() for o in outputs), strict=True)
            for row, index in enumerate(group)}
    return [rows[index] for index in range(len(sequences))]


def _stack(rows: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """Right-pad per-sequence [L] tensors to ``shape`` (zeros for the dummy)."""
    out = torch.zeros(shape, dtype=torch.float32)
    for row, values in enumerate(rows):
        out[row, : len(values)] = values.float()
    return out

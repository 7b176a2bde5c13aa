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
micro-batches, global counts, epochs, fused or not). In a fused step (one
minibatch) what step 2 computes is left out of :class:`StartValues` (log
pi_prox, and with one micro-batch the old values) and the first update
returns it complete from its own forward passes, which run at the step's
start weights. The loss of a pass is :func:`minibatch_losses`, in the
paper's order.

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
    starts = [trainer.start_values(share, train_batch, plan.fused) for share in plan.shares]
    for _ in range(plan.epochs):
        starts = [trainer.update(share, start, train_batch, statistics)
                  for share, start in zip(plan.shares, starts)]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from learner.advantages import (
    adaptive_lambdas,
    advantages_and_returns,
    cross_trajectory_factors,
)
from learner.batch import TrainBatch, TrainSequence, microbatches
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
class StartValues:
    """What the step's start weights give a share, per sequence [L]: log
    pi_prox, the old values, and the advantages and returns from them. A
    field is None only in a fused step, until its first update returns them
    complete from its own passes."""

    logp_prox: list[torch.Tensor] | None
    old_values: list[torch.Tensor] | None
    advantages: list[torch.Tensor] | None
    returns: list[torch.Tensor] | None


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


def minibatch_losses(logp: torch.Tensor | None, values: torch.Tensor | None, rows: Rows,
                     config: LearnerConfig, global_tokens: float) -> Losses:
    """The loss of one pass over a minibatch's tokens, in the paper's order
    (docs/design.md §2.4), for the sides evaluated (a critic model's pass
    takes the values, then the policy, to free its activations first):

    1. ratios pi_theta / pi_prox, and importance weights min(pi_prox / mu, is_cap);
    2. the advantages, fixed at the step's start;
    3. the clipped policy loss, each token weighted by its c_t
       (``loss_norm``: 1/|M| over every rank, or per segment);
    4. the clipped value loss against the returns, over the same |M|.
    """
    zero = torch.zeros((), device=rows.trainable.device)
    policy, policy_stats = zero, {}
    if logp is not None:
        prox = logp.detach() if rows.prox is None else rows.prox
        policy, policy_stats = policy_loss(
            logp, prox, rows.behaviour, rows.advantages, rows.weights,
            config.clip_low, config.clip_high, config.is_cap, config.is_mode)
    value, value_stats = zero, {}
    if values is not None:
        value, value_stats = value_loss(values, rows.old_values, rows.returns,
                                        rows.trainable / global_tokens, config.value_clip)
    return Losses(policy, value, policy_stats, value_stats)


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

    def add_factors(self, factors: torch.Tensor, is_summary: torch.Tensor) -> None:
        """The cross-trajectory factors of the step's segments with trainable
        tokens (``factors`` [S]; ``is_summary`` [S] bool), summed by segment type."""
        self.summary_factor_sum += float(factors[is_summary].sum())
        self.summary_segments += int(is_summary.sum())
        self.execution_factor_sum += float(factors[~is_summary].sum())
        self.execution_segments += int((~is_summary).sum())

    def summed_over_ranks(self) -> StepStatistics:
        names = [f.name for f in dataclasses.fields(self) if f.name not in self.RANK_INVARIANT]
        totals = _all_reduce([getattr(self, name) for name in names])
        return dataclasses.replace(self, **dict(zip(names, totals, strict=True)))

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
        }


def weight_by_compactions(shares: list[Share], compactions: list[int]) -> dict[str, float]:
    """``loss_weight/<bucket>``: the loss weights c_t of the rollouts in each
    compaction bucket (:data:`ops.summary.COMPACTION_BUCKETS`), summed over the
    minibatches and the ranks; each minibatch's sum to 1. What the loss
    normalisation gives rollouts that compacted more (docs/learner.md, "Loss
    weight by compaction count")."""
    totals = [0.0] * len(COMPACTION_BUCKETS)
    for share in shares:
        for sequence, weights in zip(share.sequences, share.loss_weights, strict=True):
            bucket = compaction_bucket(compactions[sequence.rollout])
            totals[COMPACTION_BUCKETS.index(bucket)] += float(weights.sum())
    return {f"loss_weight/{bucket}": total
            for bucket, total in zip(COMPACTION_BUCKETS, _all_reduce(totals), strict=True)}


def _segments(sequences: list[TrainSequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """[S] trainable tokens and rollout index of each segment (a sequence
    may hold two), in order."""
    return (torch.tensor([n for s in sequences for n in s.segment_lengths], dtype=torch.long),
            torch.tensor([s.rollout for s in sequences for _ in s.segment_lengths],
                         dtype=torch.long))


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _collective_device() -> torch.device:
    """NCCL reduces only tensors on the GPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    if _world()[1] > 1:
        dist.all_reduce(tensor, op)
    return tensor.tolist()


# -------------------------------------------------------------------- advantages


def sequence_advantages(config: LearnerConfig, batch: TrainBatch, sequences: list[TrainSequence],
                        values: list[torch.Tensor]
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence, [L] advantages and returns (zero off the trainable
    tokens). Whitening is collective: every rank calls this, an empty share too."""
    advantages, returns = _gae(config, batch, sequences, values) if sequences else ([], [])
    if config.whiten_advantages:
        advantages = _whiten(sequences, advantages)
    return advantages, returns


def _gae(config: LearnerConfig, batch: TrainBatch, sequences: list[TrainSequence],
         values: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The advantage mode's advantages and returns over the sequences'
    trainable tokens (learner.advantages), laid back into each sequence."""
    flat_values = torch.cat([v[s.trainable] for s, v in zip(sequences, values, strict=True)])
    lengths, rollout_of = _segments(sequences)
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
        batch.task_ids, config.gamma, segment_lambda(config, lengths), step_rewards,
        segments_per_rollout)
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


def segment_lambda(config: LearnerConfig, lengths: torch.Tensor) -> float | torch.Tensor:
    """GAE's lambda: the configured one, or [S] one per segment of these lengths."""
    return (adaptive_lambdas(lengths, config.lam_alpha)
            if config.lam_mode == "adaptive" else config.lam)


def segment_factors(config: LearnerConfig, sequences: list[TrainSequence]) -> torch.Tensor:
    """[S] (gamma*lambda)^{N_>s} of every segment of ``sequences``, in order."""
    lengths, rollout_of = _segments(sequences)
    return cross_trajectory_factors(lengths, rollout_of,
                                    config.gamma * segment_lambda(config, lengths))


def cross_factors(config: LearnerConfig, sequences: list[TrainSequence]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The factor (gamma*lambda)^{N_>s} (per-segment lambdas: their
    product) of each segment with trainable tokens, under this run's gamma
    and lambda, whatever the advantage mode applies, and whether it is a summary."""
    lengths, _ = _segments(sequences)
    # A sequence of two segments holds an execution segment, then its summary.
    is_summary = torch.tensor([i == len(s.segment_lengths) - 1 and s.segment_type == "summary"
                               for s in sequences for i in range(len(s.segment_lengths))],
                              dtype=torch.bool)
    kept = lengths > 0
    return segment_factors(config, sequences)[kept], is_summary[kept]


def _whiten(sequences: list[TrainSequence], advantages: list[torch.Tensor]) -> list[torch.Tensor]:
    """The trainable tokens' advantages less their mean over every rank,
    over their standard deviation."""
    picked = [a[s.trainable].double() for s, a in zip(sequences, advantages, strict=True)]
    flat = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.float64)
    count, total, squares = _all_reduce([len(flat), flat.sum().item(),
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
        self.rank, self.world_size = _world()
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
        global_tokens, global_segments, global_rollouts = _all_reduce(
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
        count = int(_all_reduce([len(groups)], dist.ReduceOp.MAX)[0])
        return groups + [[] for _ in range(count - len(groups))]

    @torch.no_grad()
    def start_values(self, share: Share, batch: TrainBatch, fused: bool) -> StartValues:
        """What the step's start weights give ``share``: everything, or in a
        ``fused`` step only what its first update cannot take from its own
        passes: the old values (and advantages) when the share takes several
        micro-batches, since the advantages need every old value before the
        first value loss (a value head's pass gives log pi_prox with them)."""
        want_values = not fused or len(share.groups) > 1
        want_prox = not fused or (want_values and self.critic is None)
        logp, values = [], []
        for group in share.groups:
            group_logp, group_values = self._evaluate(self._ids(share.sequences, group),
                                                      want_prox, want_values)
            logp.append(group_logp)
            values.append(group_values)
        prox = _unpad(share.sequences, share.groups, logp) if want_prox else None
        if not want_values:
            return StartValues(prox, None, None, None)
        return self._with_old_values(prox, share, batch,
                                     _unpad(share.sequences, share.groups, values))

    def _with_old_values(self, prox: list[torch.Tensor] | None, share: Share, batch: TrainBatch,
                         values: list[torch.Tensor]) -> StartValues:
        """Start values with ``values`` as the old values, and the advantages
        and returns from them (on the CPU: small, sequential per rollout;
        collective when whitened, so every rank calls it, an empty share too)."""
        advantages, returns = sequence_advantages(self.config, batch, share.sequences, values)
        return StartValues(prox, values, advantages, returns)

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
        starts = [self.start_values(share, batch, plan.fused) for share in plan.shares]
        statistics = StepStatistics()
        for share in plan.shares:
            statistics.add_factors(*cross_factors(self.config, share.sequences))
        for _ in range(plan.epochs):
            starts = [self.update(share, start, batch, statistics, value_only)
                      for share, start in zip(plan.shares, starts, strict=True)]
        if sample is not None:
            factors = [segment_factors(self.config, share.sequences) for share in plan.shares]
            sample(trained_rollouts(batch, plan.shares, starts, factors, sampled_rollouts,
                                    self.config))
        return (statistics.summed_over_ranks().metrics(plan.epochs)
                | weight_by_compactions(plan.shares, batch.compactions))

    def update(self, share: Share, start: StartValues, batch: TrainBatch,
               statistics: StepStatistics, value_only: bool = False) -> StartValues:
        """One optimizer step on ``share``: a training pass per micro-batch,
        then one step of every optimizer. Returns the start values complete
        (a fused step's first update takes what is missing from its passes)."""
        if share.global_tokens == 0:
            return start
        logps = []
        for group in share.groups:
            start, logp = self._train_pass(share, start, group, batch, statistics, value_only)
            logps.append(logp)
        if start.logp_prox is None:  # the passes ran at the step's start weights
            start = dataclasses.replace(start, logp_prox=_unpad(share.sequences, share.groups,
                                                                logps))
        self._step_optimizers(statistics, value_only)
        return start

    def _train_pass(self, share: Share, start: StartValues, group: list[int], batch: TrainBatch,
                    statistics: StepStatistics, value_only: bool
                    ) -> tuple[StartValues, torch.Tensor]:
        """Forward and backward over one micro-batch; returns the start values
        (with the old values of this pass when it is a fused step's first, of
        one micro-batch) and its log-probabilities, detached. A value head: one forward gives
        both, one backward takes the policy loss plus ``value_loss_coef``
        times the value loss (in the warm-up that alone). A critic model: its
        forward and backward first (its activations are freed before the
        policy's forward), then the policy's (only measured in the warm-up).
        FSDP averages gradients over ranks: scaling each loss by the world
        size makes that average the sum the global token count normalises."""
        ids = self._ids(share.sequences, group)
        head = self.critic is None
        logp, values = self._evaluate(ids, head, True)
        if start.old_values is None:  # one micro-batch: this pass's values are the old ones
            start = self._with_old_values(start.logp_prox, share, batch, _unpad(
                share.sequences, share.groups, [values.detach()]))
        rows = self._rows(share, start, group, ids)
        losses = minibatch_losses(logp, values, rows, self.config, share.global_tokens)
        if head:
            coef = self.config.value_loss_coef
            loss = coef * losses.value if value_only else losses.policy + coef * losses.value
            (loss * self.world_size).backward()
        else:
            (losses.value * self.world_size).backward()
            with torch.no_grad() if value_only else contextlib.nullcontext():
                logp, _ = self._evaluate(ids, True, False)
            policy_losses = minibatch_losses(logp, None, rows, self.config, share.global_tokens)
            losses = dataclasses.replace(losses, policy=policy_losses.policy,
                                         policy_stats=policy_losses.policy_stats)
            if not value_only:
                (losses.policy * self.world_size).backward()
        statistics.add_pass(float(rows.trainable.sum()), losses.policy, losses.value,
                            losses.policy_stats, losses.value_stats,
                            residual_moments(rows.returns, rows.old_values, rows.trainable))
        return start, logp.detach()

    def _rows(self, share: Share, start: StartValues, group: list[int], ids: torch.Tensor
              ) -> Rows:
        """The micro-batch's rows, padded to its ids."""

        def stacked(per_sequence: list[torch.Tensor]) -> torch.Tensor:
            return _stack([per_sequence[i] for i in group], ids.shape).to(self.device)

        return Rows(trainable=stacked([s.trainable for s in share.sequences]),
                    behaviour=stacked([s.behaviour_logprobs for s in share.sequences]),
                    prox=None if start.logp_prox is None else stacked(start.logp_prox),
                    advantages=stacked(start.advantages), old_values=stacked(start.old_values),
                    returns=stacked(start.returns), weights=stacked(share.loss_weights))

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

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

The fused step (one minibatch): what step 2 computes is left out
(``_Prepared.logp_prox`` and, with one micro-batch, ``old_values`` are None)
and the first update takes it from its own forward passes, which run at the
step's start weights.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
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


@dataclass
class _Prepared:
    """One rank's share of one minibatch, with what the step's start fixed.
    ``logp_prox`` None: the first update takes it from its own policy
    passes; ``old_values`` None: from its own critic passes, and the
    advantages and returns with them (on every rank, an empty share too,
    since computing advantages can be collective)."""

    sequences: list[TrainSequence]
    groups: list[list[int]]
    """Indices into ``sequences`` of each micro-batch; as many on every rank
    (an empty one runs a dummy sequence)."""
    logp_prox: list[torch.Tensor] | None = None
    old_values: list[torch.Tensor] | None = None
    advantages: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None


@dataclass
class _Pass:
    """One micro-batch of an update: its sequences (indices into
    ``part.sequences``), their padded token ids, and the minibatch's
    per-token loss weights and global trainable-token count."""

    part: _Prepared
    group: list[int]
    ids: torch.Tensor
    policy_weights: list[torch.Tensor]
    global_tokens: float


@dataclass
class _Rows:
    """A micro-batch's per-token [B, L] rows, on the models' device."""

    trainable: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    weights: torch.Tensor


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
    flat_adv, flat_ret = advantages_and_returns(
        config.advantage, flat_values.double(), lengths, rollout_of, batch.rewards,
        batch.task_ids, config.gamma, segment_lambda(config, lengths), step_rewards)
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


def cross_factors(config: LearnerConfig, sequences: list[TrainSequence]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The factor (gamma*lambda)^{N_>s} (per-segment lambdas: their
    product) of each segment with trainable tokens, under this run's gamma
    and lambda, whatever the advantage mode applies, and whether it is a summary."""
    lengths, rollout_of = _segments(sequences)
    # A sequence of two segments holds an execution segment, then its summary.
    is_summary = torch.tensor([i == len(s.segment_lengths) - 1 and s.segment_type == "summary"
                               for s in sequences for i in range(len(s.segment_lengths))],
                              dtype=torch.bool)
    factors = cross_trajectory_factors(lengths, rollout_of,
                                       config.gamma * segment_lambda(config, lengths))
    kept = lengths > 0
    return factors[kept], is_summary[kept]


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

    # ------------------------------------------------------------------ preparation

    @torch.no_grad()
    def _prepare(self, batch: TrainBatch, rollouts: list[int], fused: bool = False
                 ) -> _Prepared:
        """``rollouts``' sequences in micro-batches, and what the step's start
        fixes: everything, or in a ``fused`` step only the old values (and
        advantages), and only when the share takes several micro-batches (the
        advantages need every old value before the first value loss; a value
        head's pass gives log pi_prox with them)."""
        chosen = set(rollouts)
        sequences = [s for s in batch.sequences if s.rollout in chosen]
        groups = self._microbatches(sequences)
        part = _Prepared(sequences, groups)
        want_values = not fused or len(groups) > 1
        want_prox = not fused or (want_values and self.critic is None)
        logp, values = [], []
        for group in groups:
            group_logp, group_values = self._evaluate(self._ids(sequences, group), want_prox,
                                                      want_values)
            logp.append(group_logp)
            values.append(group_values)
        if want_prox:
            part.logp_prox = _unpad(sequences, groups, logp)
        if want_values:
            self._fix_values(part, batch, _unpad(sequences, groups, values))
        return part

    def _fix_values(self, part: _Prepared, batch: TrainBatch, values: list[torch.Tensor]
                    ) -> None:
        """The share's old values, and its advantages and returns from them
        (computed on the CPU: small, sequential per rollout)."""
        part.old_values = values
        part.advantages, part.returns = sequence_advantages(self.config, batch,
                                                            part.sequences, values)

    def _evaluate(self, ids: torch.Tensor, logp: bool, values: bool
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """[B, L] log-probabilities and values of ``ids``, those asked for
        (a value head gives both from one pass, or neither)."""
        chunk = self.chunk_tokens
        if self.critic is None:
            return token_logprobs_and_values(self.policy, ids, chunk) if values else (None, None)
        return (token_logprobs(self.policy, ids, chunk) if logp else None,
                token_values(self.critic, ids) if values else None)

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

    def _ids(self, sequences: list[TrainSequence], group: list[int]) -> torch.Tensor:
        return pad([sequences[i].tokens for i in group]).to(self.device)

    # ------------------------------------------------------------------ the step

    def step(self, batch: TrainBatch, value_only: bool = False) -> dict[str, float]:
        """One PPO step on ``batch``; ``value_only`` (the critic's warm-up):
        the critic learns, the policy does not move (its losses are still
        measured)."""
        shares = [batch.assign(m, self.world_size)[self.rank]
                  for m in batch.minibatches(self.config.minibatches)]
        fused = len(shares) == 1
        prepared = [self._prepare(batch, share, fused) for share in shares]
        statistics = StepStatistics()
        for part in prepared:
            statistics.add_factors(*cross_factors(self.config, part.sequences))
        for _ in range(self.config.ppo_epochs):
            for part in prepared:
                self._update(part, statistics, batch, value_only)
        return statistics.summed_over_ranks().metrics(self.config.ppo_epochs)

    def _policy_weights(self, part: _Prepared, tokens: float, segments: float
                        ) -> list[torch.Tensor]:
        """Per sequence, [L] loss weight c_t of each token (0 off its
        trainable tokens): learner.losses.loss_weights over its segments."""
        weights = []
        for sequence in part.sequences:
            row = torch.zeros(len(sequence.tokens))
            row[sequence.trainable] = loss_weights(torch.tensor(sequence.segment_lengths),
                                                   self.config.loss_norm, tokens, segments)
            weights.append(row)
        return weights

    def _update(self, part: _Prepared, statistics: StepStatistics, batch: TrainBatch,
                value_only: bool = False) -> None:
        """One optimizer step on ``part``: per micro-batch, the value loss
        and the policy loss with the minibatch's global counts in their
        weights (:meth:`_value_head_pass` or :meth:`_critic_model_pass`),
        then one step of every optimizer."""
        local_tokens = sum(int(s.trainable.sum()) for s in part.sequences)
        local_segments = sum(n > 0 for s in part.sequences for n in s.segment_lengths)
        global_tokens, global_segments = _all_reduce([local_tokens, local_segments])
        if global_tokens == 0:
            return
        policy_weights = self._policy_weights(part, global_tokens, global_segments)
        taking_prox = part.logp_prox is None
        logp_prox: list[torch.Tensor] = []
        one_pass = self._value_head_pass if self.critic is None else self._critic_model_pass
        for group in part.groups:
            logp = one_pass(_Pass(part, group, self._ids(part.sequences, group), policy_weights,
                                  global_tokens), statistics, batch, value_only)
            if taking_prox:
                logp_prox.append(logp.detach())
        if taking_prox:
            part.logp_prox = _unpad(part.sequences, part.groups, logp_prox)
        self._step_optimizers(statistics, value_only)

    def _value_head_pass(self, one: _Pass, statistics: StepStatistics, batch: TrainBatch,
                         value_only: bool) -> torch.Tensor:
        """A value head: one forward gives the log-probabilities and the
        values, one backward takes both losses (the value loss scaled by
        ``value_loss_coef``; in the warm-up only it). Returns the log-probabilities."""
        logp, values = self._evaluate(one.ids, True, True)
        rows = self._rows(one, batch, values)
        v_loss, v_stats = value_loss(values, rows.old_values, rows.returns,
                                     rows.trainable / one.global_tokens, self.config.value_clip)
        p_loss, p_stats = self._policy_loss(one, rows, logp)
        coef = self.config.value_loss_coef
        loss = coef * v_loss if value_only else p_loss + coef * v_loss
        # FSDP averages the gradients over ranks; scaling the loss by the world
        # size makes that average the sum that the global token count normalises.
        (loss * self.world_size).backward()
        statistics.add_pass(float(rows.trainable.sum()), p_loss, v_loss, p_stats, v_stats,
                            residual_moments(rows.returns, rows.old_values, rows.trainable))
        return logp

    def _critic_model_pass(self, one: _Pass, statistics: StepStatistics, batch: TrainBatch,
                           value_only: bool) -> torch.Tensor:
        """A critic model: its forward and backward first (its activations
        are freed before the policy's forward), then the policy's (only
        measured in the warm-up). Returns the log-probabilities."""
        _, values = self._evaluate(one.ids, False, True)
        rows = self._rows(one, batch, values)
        v_loss, v_stats = value_loss(values, rows.old_values, rows.returns,
                                     rows.trainable / one.global_tokens, self.config.value_clip)
        (v_loss * self.world_size).backward()
        with torch.no_grad() if value_only else contextlib.nullcontext():
            logp, _ = self._evaluate(one.ids, True, False)
        p_loss, p_stats = self._policy_loss(one, rows, logp)
        if not value_only:
            (p_loss * self.world_size).backward()
        statistics.add_pass(float(rows.trainable.sum()), p_loss, v_loss, p_stats, v_stats,
                            residual_moments(rows.returns, rows.old_values, rows.trainable))
        return logp

    def _rows(self, one: _Pass, batch: TrainBatch, values: torch.Tensor) -> _Rows:
        """The micro-batch's per-token rows, padded to its ids. A fused first
        update with one micro-batch takes the old values (and so the
        advantages) from this pass's ``values``."""
        part = one.part
        if part.old_values is None:
            self._fix_values(part, batch, _unpad(part.sequences, part.groups, [values.detach()]))
        return _Rows(*(_stack([rows[i] for i in one.group], one.ids.shape).to(self.device)
                       for rows in ([s.trainable for s in part.sequences],
                                    [s.behaviour_logprobs for s in part.sequences],
                                    part.advantages, part.old_values, part.returns,
                                    one.policy_weights)))

    def _policy_loss(self, one: _Pass, rows: _Rows, logp: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped policy loss of the pass. Until the first update of the
        step fixed log pi_prox, the policy is at the step's start weights:
        its own log-probabilities are pi_prox."""
        if one.part.logp_prox is None:
            prox = logp.detach()
        else:
            prox = _stack([one.part.logp_prox[i] for i in one.group],
                          one.ids.shape).to(self.device)
        config = self.config
        return policy_loss(logp, prox, rows.behaviour, rows.advantages, rows.weights,
                           config.clip_low, config.clip_high, config.is_cap, config.is_mode)

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

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
4. ``ppo_epochs`` passes over the minibatches: policy loss normalised by the
   minibatch's trainable tokens over all ranks (or per segment, for the
   ablation), clipped value loss, one optimizer step each.

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

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from learner.advantages import cross_trajectory_gae
from learner.batch import Sequence, TrainBatch, microbatches
from learner.config import LearnerConfig
from learner.losses import explained_variance, policy_loss, residual_moments, value_loss
from learner.models import (
    Critic,
    is_value_head,
    pad,
    token_logprobs,
    token_logprobs_and_values,
    token_values,
)

#: Group-relative advantages divide by the group's reward std plus this.
GRPO_EPSILON = 1e-6


@dataclass
class _Prepared:
    """One rank's share of one minibatch, with what the step start fixed.
    In a fused step ``logp_prox`` starts empty and ``prox_fixed`` false, and
    with one micro-batch the values, advantages and returns as well: the
    first update fills them from its own forward passes (on every rank, an
    empty share too, since computing advantages can be collective)."""

    sequences: list[Sequence]
    groups: list[list[int]]
    """Indices into ``sequences`` of each micro-batch; as many on every rank
    (an empty one runs a dummy sequence)."""
    logp_prox: list[torch.Tensor] = field(default_factory=list)
    old_values: list[torch.Tensor] = field(default_factory=list)
    advantages: list[torch.Tensor] = field(default_factory=list)
    returns: list[torch.Tensor] = field(default_factory=list)
    prox_fixed: bool = True
    values_fixed: bool = True


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

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.policy_optimizer, self.critic_optimizer) if o is not None]

    # ------------------------------------------------------------------ preparation

    @torch.no_grad()
    def _prepare(self, batch: TrainBatch, rollouts: list[int], fused: bool = False
                 ) -> _Prepared:
        chosen = set(rollouts)
        sequences = [s for s in batch.sequences if s.rollout in chosen]
        groups = self._microbatches(sequences)
        values_fixed = not fused or len(groups) > 1
        # a value head's pass gives the log-probabilities too
        part = _Prepared(sequences, groups, values_fixed=values_fixed,
                         prox_fixed=not fused or (values_fixed and self.critic is None))
        logp, values = [], []
        for group in groups:
            group_logp, group_values = self._evaluate(self._ids(sequences, group),
                                                      part.prox_fixed, part.values_fixed)
            logp.append(group_logp)
            values.append(group_values)
        if part.prox_fixed:
            part.logp_prox = _unpad(sequences, groups, logp)
        if part.values_fixed:
            # advantages are computed on the CPU (small, sequential per rollout)
            part.old_values = _unpad(sequences, groups, values)
            part.advantages, part.returns = self._advantages(batch, sequences, part.old_values)
        return part

    def _evaluate(self, ids: torch.Tensor, logp: bool, values: bool
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """[B, L] log-probabilities and values of ``ids``, those asked for
        (a value head gives both from one pass, or neither)."""
        chunk = self.config.logprob_chunk_tokens
        if self.critic is None:
            return token_logprobs_and_values(self.policy, ids, chunk) if values else (None, None)
        return (token_logprobs(self.policy, ids, chunk) if logp else None,
                token_values(self.critic, ids) if values else None)

    def _microbatches(self, sequences: list[Sequence]) -> list[list[int]]:
        """Micro-batches of ``sequences`` within the token budget, as many as
        on the rank with the most (FSDP's collectives run once per pass)."""
        budget = self.config.max_tokens_per_microbatch
        if budget == 0:
            return [list(range(len(sequences)))]  # one pass everywhere, no need to agree
        groups = microbatches([len(s.tokens) for s in sequences], budget)
        count = int(_all_reduce([len(groups)], dist.ReduceOp.MAX)[0])
        return groups + [[] for _ in range(count - len(groups))]

    def _ids(self, sequences: list[Sequence], group: list[int]) -> torch.Tensor:
        return pad([sequences[i].tokens for i in group]).to(self.device)

    def _advantages(self, batch: TrainBatch, sequences: list[Sequence],
                    values: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sequence, [L] advantages and returns (zero off the trainable
        tokens). Whitening is collective: every rank calls this, an empty share too."""
        advantages, returns = self._gae(batch, sequences, values) if sequences else ([], [])
        if self.config.whiten_advantages:
            advantages = self._whiten(sequences, advantages)
        return advantages, returns

    def _gae(self, batch: TrainBatch, sequences: list[Sequence], values: list[torch.Tensor]
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        local_rollout = {r: i for i, r in enumerate(dict.fromkeys(s.rollout for s in sequences))}
        flat_values = torch.cat([v[s.trainable] for s, v in zip(sequences, values, strict=True)])
        # per segment (a sequence may hold two), in order
        lengths = torch.tensor([n for s in sequences for n in s.segment_lengths])
        segment_rollouts = [s.rollout for s in sequences for _ in s.segment_lengths]
        rollout_of = torch.tensor([local_rollout[r] for r in segment_rollouts])
        rewards = batch.rewards[list(local_rollout)]
        mode = "independent" if self.config.advantage == "independent" else "cross"
        flat_adv, flat_ret = cross_trajectory_gae(flat_values.double(), lengths, rollout_of,
                                                  rewards, self.config.gamma, self.config.lam,
                                                  mode)
        if self.config.advantage == "grpo":
            group = _group_relative(batch)
            flat_adv = torch.repeat_interleave(group[segment_rollouts], lengths)
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

    def _whiten(self, sequences: list[Sequence], advantages: list[torch.Tensor]
                ) -> list[torch.Tensor]:
        picked = [a[s.trainable].double() for s, a in zip(sequences, advantages, strict=True)]
        flat = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.float64)
        count, total, squares = _all_reduce([len(flat), flat.sum().item(),
                                             (flat ** 2).sum().item()])
        mean = total / max(count, 1)
        std = max((squares / max(count, 1) - mean ** 2), 0.0) ** 0.5 + 1e-8
        return [torch.where(s.trainable, (a - mean) / std, a)
                for s, a in zip(sequences, advantages, strict=True)]

    # ------------------------------------------------------------------ the step

    def step(self, batch: TrainBatch) -> dict[str, float]:
        shares = [batch.assign(m, self.world_size)[self.rank]
                  for m in batch.minibatches(self.config.minibatches)]
        fused = len(shares) == 1
        prepared = [self._prepare(batch, share, fused) for share in shares]
        sums: dict[str, float] = defaultdict(float)
        for _ in range(self.config.ppo_epochs):
            for part in prepared:
                self._update(part, sums, batch)
        names = sorted(sums)
        totals = dict(zip(names, _all_reduce([sums[n] for n in names]), strict=True))
        updates = max(totals.pop("updates", 1.0) / self.world_size, 1.0)
        tokens = totals.pop("tokens", 0.0)
        metrics = {name: value / max(tokens, 1.0) for name, value in totals.items()
                   if name.startswith("token_")}
        metrics = {name.removeprefix("token_"): value for name, value in metrics.items()}
        metrics.update({name: value / updates for name, value in totals.items()
                        if name.startswith("losses/")})
        metrics["losses/value_explained_variance"] = explained_variance(
            {name.removeprefix("moments/"): value for name, value in totals.items()
             if name.startswith("moments/")}, tokens)
        metrics["tokens"] = tokens / self.config.ppo_epochs
        return metrics

    def _weighted(self, part: _Prepared, tokens: float, segments: float) -> list[torch.Tensor]:
        """Advantages times each token's loss weight: 1/|M| (token
        normalisation) or 1/(n_s * number of segments) (segment normalisation)."""
        if self.config.loss_norm == "token":
            return [a / tokens for a in part.advantages]
        weighted = []
        for sequence, advantages in zip(part.sequences, part.advantages, strict=True):
            sizes = torch.tensor(sequence.segment_lengths, dtype=torch.float32)
            per_token = torch.zeros_like(advantages)
            per_token[sequence.trainable] = torch.repeat_interleave(
                1.0 / (sizes.clamp(min=1) * segments), sizes.long())
            weighted.append(advantages * per_token)
        return weighted

    def _update(self, part: _Prepared, sums: dict[str, float], batch: TrainBatch) -> None:
        config = self.config
        local_tokens = sum(int(s.trainable.sum()) for s in part.sequences)
        local_segments = sum(n > 0 for s in part.sequences for n in s.segment_lengths)
        global_tokens, global_segments = _all_reduce([local_tokens, local_segments])
        if global_tokens == 0:
            return
        weighted: list[torch.Tensor] | None = None
        logp_prox: list[torch.Tensor] = []
        for group in part.groups:
            ids = self._ids(part.sequences, group)
            # The critic first: a fused first update with one micro-batch
            # takes the old values (and so the advantages) from this pass.
            logp, values = self._evaluate(ids, self.critic is None, True)
            if not part.values_fixed:
                part.old_values = _unpad(part.sequences, part.groups, [values.detach()])
                part.advantages, part.returns = self._advantages(batch, part.sequences,
                                                                 part.old_values)
                part.values_fixed = True
            if weighted is None:
                weighted = self._weighted(part, global_tokens, global_segments)
            trainable, behaviour, advantages, old_values, returns = (
                _stack([rows[i] for i in group], ids.shape).to(self.device) for rows in (
                    [s.trainable for s in part.sequences],
                    [s.behaviour_logprobs for s in part.sequences],
                    weighted, part.old_values, part.returns))
            trainable = trainable.bool()
            v_loss, v_stats = value_loss(values, old_values, returns, trainable, global_tokens,
                                         config.value_clip)
            if logp is None:  # a critic model: its backward before the policy's forward
                # losses are already divided by the global count; FSDP averages over ranks
                (v_loss * self.world_size).backward()
                logp, _ = self._evaluate(ids, True, False)
            if part.prox_fixed:
                prox = _stack([part.logp_prox[i] for i in group], ids.shape).to(self.device)
            else:  # the policy is at the step's start weights until this update's step
                logp_prox.append(logp.detach())
                prox = logp.detach()
            # The normalisation is folded into the advantages (l is linear in A for
            # A scaled by a positive weight), so the loss is a plain sum.
            p_loss, p_stats = policy_loss(logp, prox, behaviour, advantages, trainable, 1.0,
                                          config.clip_low, config.clip_high, config.is_cap,
                                          config.is_mode)
            loss = p_loss if self.critic is not None else p_loss + config.value_loss_coef * v_loss
            (loss * self.world_size).backward()

            n = float(trainable.sum())
            sums["tokens"] += n
            sums["losses/policy_loss"] += p_loss.item()
            sums["losses/value_loss"] += v_loss.item()
            for name, value in residual_moments(returns, old_values, trainable).items():
                sums[f"moments/{name}"] += value
            for name, value in {**p_stats,
                                **{f"value_{k}": v for k, v in v_stats.items()}}.items():
                sums[f"token_losses/{name}"] += float(value) * n
        if not part.prox_fixed:
            part.logp_prox = _unpad(part.sequences, part.groups, logp_prox)
            part.prox_fixed = True
        if config.max_grad_norm > 0:
            # with a value head, one norm over the body and both heads
            norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), config.max_grad_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            sums["losses/policy_grad_norm"] += float(norm)
            if self.critic is not None:
                torch.nn.utils.clip_grad_norm_(self.critic.parameters(), config.max_grad_norm)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sums["updates"] += 1


def _unpad(sequences: list[Sequence], groups: list[list[int]], outputs: list[torch.Tensor]
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


def _group_relative(batch: TrainBatch) -> torch.Tensor:
    """[R] (reward - mean of its task's rewards) / (std + eps), one value per rollout."""
    groups: dict[str, list[int]] = defaultdict(list)
    for index, task in enumerate(batch.task_ids):
        groups[task].append(index)
    advantages = torch.zeros(batch.num_rollouts, dtype=torch.float64)
    for members in groups.values():
        rewards = batch.rewards[members]
        std = rewards.std(unbiased=False) if len(members) > 1 else torch.tensor(0.0)
        advantages[members] = (rewards - rewards.mean()) / (std + GRPO_EPSILON)
    return advantages

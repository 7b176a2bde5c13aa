"""Trainers as tests compare them: plain SGD in place of AdamW, and the
modules a trainer trains."""

from __future__ import annotations

import torch

from learner.ppo import PPOTrainer


def plain_sgd(ppo: PPOTrainer) -> PPOTrainer:
    """``ppo`` with SGD in place of AdamW, over the same parameter groups (a
    value head's at critic_lr): a parameter then moves by its group's lr
    times its gradient, so two runs whose gradients differ by rounding end
    up within lr times that rounding (AdamW's m / (sqrt(v) + 1e-8) would
    turn the rounding of a near-zero gradient into a step of up to lr)."""
    ppo.policy_optimizer, ppo.critic_optimizer = (
        None if optimizer is None else torch.optim.SGD(
            [{"params": group["params"], "lr": group["lr"]} for group in optimizer.param_groups])
        for optimizer in (ppo.policy_optimizer, ppo.critic_optimizer))
    return ppo


def trained_modules(ppo: PPOTrainer) -> list[torch.nn.Module]:
    """The policy (with its value head, if it has one) and a critic model."""
    return [ppo.policy] if ppo.critic is None else [ppo.policy, ppo.critic]

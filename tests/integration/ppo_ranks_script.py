"""Run by torchrun in tests: PPO steps on the tiny model with FSDP2 over gloo,
then rank 0 writes the full policy and critic parameters.

    torchrun --nproc_per_node N tests/integration/ppo_ranks_script.py MODEL OUT STEPS
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from learner.batch import to_train_batch
from learner.config import LearnerConfig
from learner.models import load_critic, load_policy, shard
from learner.ppo import PPOTrainer
from protocol.synthetic import synthetic_batch


def main() -> None:
    model, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    # Whitening's all-reduce is joined by a rank with an empty share: 7 rollouts
    # in 4 minibatches (the last has one rollout), then 1 rollout (one
    # minibatch: a fused step) on 2 ranks.
    config = LearnerConfig(minibatches=4, ppo_epochs=2, whiten_advantages=True)
    trainer = PPOTrainer(shard(load_policy(model)), shard(load_critic(model)), config)
    for step in range(steps):
        rollouts = 7 if step % 2 == 0 else 1
        trainer.step(to_train_batch(synthetic_batch(rollouts=rollouts, seed=step), True))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {f"policy.{k}": v for k, v in get_model_state_dict(trainer.policy,
                                                               options=options).items()}
    state.update({f"critic.{k}": v for k, v in get_model_state_dict(trainer.critic,
                                                                    options=options).items()})
    if dist.get_rank() == 0:
        save_file({k: v.contiguous().clone() for k, v in state.items()}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Run by torchrun in tests: jobs of PPO steps with FSDP2 over gloo, one
after another in one process group (a launch costs each rank a fresh
interpreter). After each job rank 0 writes the full policy and critic
parameters to its ``out``, and each step's metrics to ``out`` with the
suffix .json.

    torchrun --nproc_per_node N tests/programs/ppo_ranks.py JOBS

JOBS: a JSON list of ``{"model": DIR, "out": FILE, "steps": N, "changes":
{...}}``, ``changes`` being learner settings that replace those of ``CONFIG``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from learner.batch import TrainBatch, to_train_batch
from learner.config import LearnerConfig
from learner.models import Sharding, load_critic, load_policy
from learner.ppo import PPOTrainer
from protocol.synthetic import synthetic_batch
from tests.processes import leave_process_group
from tests.trainers import plain_sgd

#: Whitening's all-reduce is joined by a rank with an empty share: 7 rollouts
#: in 4 minibatches (the last has one rollout), then 1 rollout (one
#: minibatch: a fused step) on 2 ranks.
CONFIG = LearnerConfig(minibatches=4, ppo_epochs=2, whiten_advantages=True)


def batches(steps: int) -> list[TrainBatch]:
    return [to_train_batch(synthetic_batch(rollouts=7 if step % 2 == 0 else 1, seed=step), True)
            for step in range(steps)]


def train(model: str, out: str, steps: int, changes: dict) -> None:
    """One job: ``steps`` PPO steps from the model at ``model``, from seed 0."""
    config = dataclasses.replace(CONFIG, **changes)
    torch.manual_seed(0)
    # Double, and plain SGD in place of AdamW: the test compares parameters,
    # which SGD moves by lr times the gradient, so two runs differ by lr times
    # their gradients' rounding differences; AdamW's m / (sqrt(v) + 1e-8)
    # would turn rounding noise in a near-zero gradient element into a step
    # of up to lr. The optimizer is elementwise on each shard: the gradients
    # are what 1 and 2 ranks may compute differently.
    sharding = Sharding(torch.device("cpu"),
                        activation_checkpointing=config.activation_checkpointing)
    value_head = config.critic == "value_head"
    trainer = PPOTrainer(load_policy(model, torch.float64, sharding, value_head),
                         None if value_head else load_critic(model, torch.float64, sharding),
                         config)
    plain_sgd(trainer)
    metrics = [trainer.step(batch) for batch in batches(steps)]
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {}
    for name in ("policy", "critic"):
        if (module := getattr(trainer, name)) is not None:
            state.update({f"{name}.{k}": v
                          for k, v in get_model_state_dict(module, options=options).items()})
    if dist.get_rank() == 0:
        save_file({k: v.contiguous().clone() for k, v in state.items()}, out)
        Path(out).with_suffix(".json").write_text(json.dumps(metrics))
    dist.barrier()  # the next job's collectives start once this one is written


def main() -> None:
    dist.init_process_group("gloo")
    for job in json.loads(sys.argv[1]):
        train(job["model"], job["out"], job["steps"], job.get("changes", {}))
    leave_process_group()  # after rank 0 has written


if __name__ == "__main__":
    main()

"""Policy and critic models, sharding, and per-token log-probabilities and values."""

from __future__ import annotations

import os

import torch
from torch import nn


class Critic(nn.Module):
    """The policy's transformer body with a scalar head: V(prefix) at every position."""

    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids).last_hidden_state
        # a fresh tensor, not a view: FSDP2 hooks the module's output for backward
        return self.head(hidden).squeeze(-1).clone()


def load_policy(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def load_critic(path: str, dtype: torch.dtype = torch.float32) -> Critic:
    """A critic initialised from the policy's weights (its own copy)."""
    policy = load_policy(path, dtype)
    return Critic(policy.model, policy.config.hidden_size).to(dtype)


def shard(model: nn.Module, device: torch.device | None = None, bf16: bool = False
          ) -> nn.Module:
    """FSDP2 on ``device``: each transformer layer its own unit, then the rest;
    with ``bf16``, parameters are cast to bf16 for compute and gradients
    reduced in fp32. FSDP averages gradients over ranks; the trainer
    multiplies its losses by the world size to turn that into the sum it needs
    (gloo has no pre-multiplied reduce for ``set_gradient_divide_factor``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device is not None:
        model.to(device)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    body = model.body if isinstance(model, Critic) else model.model
    for layer in body.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def placement(device: str) -> tuple[str, torch.device]:
    """The process-group backend and this rank's device for ``learner.device``:
    NCCL and ``cuda:LOCAL_RANK`` on GPU, gloo and the CPU otherwise."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def pad(sequences: list[torch.Tensor]) -> torch.Tensor:
    """Right-padded [B, L] ids; a [1, 2] dummy when empty (every rank runs the
    same number of passes: FSDP collectives must match).

    No attention mask goes with them: under the causal mask no real token
    attends to a pad on its right, and without a padding mask SDPA keeps its
    fused causal kernel (~20 % faster here). Outputs at pad positions are
    garbage and never read."""
    if not sequences:
        return torch.zeros(1, 2, dtype=torch.long)
    ids = torch.zeros(len(sequences), max(len(s) for s in sequences), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
    return ids


def token_logprobs(policy: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] log-probability of each token given the ones before it (0 at position 0)."""
    logits = policy(input_ids=ids).logits[:, :-1].float()
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(chosen[:, :1]), chosen], dim=1)


def token_values(critic: Critic, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] value of the state each token is sampled from (the critic's
    output at the position before it; 0 at position 0)."""
    values = critic(ids).float()
    return torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], dim=1)

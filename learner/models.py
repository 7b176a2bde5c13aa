"""Policy and critic models, sharding, and per-token log-probabilities and values."""

from __future__ import annotations

import functools
import os
from types import MethodType
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


class Critic(nn.Module):
    """The policy's transformer body with a scalar head: V(prefix) at every position."""

    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, use_cache=False).last_hidden_state
        # a fresh tensor, not a view: FSDP2 hooks the module's output for backward
        return self.head(hidden).squeeze(-1).clone()


def load_policy(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    # a method of the model, so that shard() can have FSDP2 gather the
    # parameters for it as it does for forward
    policy.chunked_token_logprobs = MethodType(_chunked_token_logprobs, policy)
    return policy


def load_critic(path: str, dtype: torch.dtype = torch.float32) -> Critic:
    """A critic initialised from the policy's weights (its own copy)."""
    policy = load_policy(path, dtype)
    return Critic(policy.model, policy.config.hidden_size).to(dtype)


def _body(model: nn.Module) -> nn.Module:
    """The transformer body (embeddings, decoder layers, final norm) of a policy or critic."""
    return model.body if isinstance(model, Critic) else model.model


def checkpoint_layers(model: nn.Module) -> None:
    """Keep only each decoder layer's input for backward and recompute the
    layer there (torch's non-reentrant checkpoint). The layer's ``forward``
    is wrapped in place rather than the module (``checkpoint_wrapper``), so
    parameter names, which checkpoints and the engines' weight loading go by,
    stay as they are; applied before ``fully_shard``, the checkpoint runs
    between FSDP2's unshard and reshard of the layer, as a wrapped module's
    would."""
    for layer in _body(model).layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def shard(model: nn.Module, device: torch.device | None = None, bf16: bool = False,
          activation_checkpointing: Literal["auto", "on", "off"] = "off") -> nn.Module:
    """FSDP2 on ``device``: each transformer layer its own unit, then the rest;
    with ``bf16``, parameters are cast to bf16 for compute and gradients
    reduced in fp32. FSDP averages gradients over ranks; the trainer
    multiplies its losses by the world size to turn that into the sum it needs
    (gloo has no pre-multiplied reduce for ``set_gradient_divide_factor``).
    ``activation_checkpointing``: "on", "off", or "auto" (on on a GPU)."""
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if device is not None:
        model.to(device)
    on_gpu = next(model.parameters()).device.type == "cuda"
    if activation_checkpointing == "on" or (activation_checkpointing == "auto" and on_gpu):
        checkpoint_layers(model)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    for layer in _body(model).layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if hasattr(model, "chunked_token_logprobs"):
        register_fsdp_forward_method(model, "chunked_token_logprobs")
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


def token_logprobs(policy: nn.Module, ids: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """[B, L] log-probability of each token given the ones before it (0 at
    position 0). With ``chunk_tokens``, the float32 logits exist for that
    many positions at a time (the same values, :class:`_ChunkedLogprobs`);
    with 0, for all of ``ids`` at once."""
    if chunk_tokens:
        chosen = policy.chunked_token_logprobs(ids, chunk_tokens)
    else:
        logits = policy(input_ids=ids, use_cache=False).logits[:, :-1].float()
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(chosen[:, :1]), chosen], dim=1)


def _chunked_token_logprobs(policy: nn.Module, ids: torch.Tensor, chunk_tokens: int
                            ) -> torch.Tensor:
    """[B, L - 1] log-probability of tokens 1.. of ``ids``, the output layer
    applied ``chunk_tokens`` positions at a time. Bound to each policy as
    ``chunked_token_logprobs`` (see load_policy). For causal LMs whose logits
    are ``lm_head(last hidden state)`` with no bias or scaling (Qwen2, Llama)."""
    hidden = policy.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    return _ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]),
                                  policy.get_output_embeddings().weight, ids[:, 1:],
                                  chunk_tokens)


class _ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[target] per row of ``hidden`` [N, H],
    ``chunk`` rows at a time, in the shape of ``targets`` (N elements; a
    tensor of its own, not a view, as FSDP2 wants a module's output).
    Forward keeps nothing of a chunk but its results; backward computes the
    chunk's logits again. Per chunk the operations are those of the whole
    pass (logits in the weights' dtype, then float32; the log-softmax
    gradient, rounded back to the weights' dtype), so values and gradients
    differ from it by rounding only: sums over rows in another order."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, hidden: torch.Tensor,
                weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        flat_out, targets = out.view(-1), targets.reshape(-1)
        for start in range(0, len(targets), chunk):
            rows = slice(start, start + chunk)
            logp = torch.log_softmax(F.linear(hidden[rows], weight).float(), dim=-1)
            flat_out[rows] = logp.gather(-1, targets[rows, None])[:, 0]
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        grad = grad.reshape(-1)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        for start in range(0, len(targets), ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            # d log_softmax(x)_t / dx = onehot(t) - softmax(x); softmax as
            # exp(log_softmax), as autograd's log-softmax backward takes it
            grad_logits = torch.log_softmax(F.linear(hidden[rows], weight).float(), dim=-1)
            grad_logits.exp_().mul_(-grad[rows, None])
            grad_logits.scatter_add_(1, targets[rows, None], grad[rows, None])
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[rows] = grad_logits @ weight
            grad_weight.addmm_(grad_logits.t(), hidden[rows])
        return grad_hidden, grad_weight, None, None


def token_values(critic: Critic, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] value of the state each token is sampled from (the critic's
    output at the position before it; 0 at position 0)."""
    values = critic(ids).float()
    return torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], dim=1)

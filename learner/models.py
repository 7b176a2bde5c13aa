"""Policy and critic models, sharding, and per-token log-probabilities and values.

The critic is either a model of its own (:class:`Critic`: the policy's body,
copied, with a scalar head; the paper's choice) or a value head on the
policy's own body (:func:`load_policy` with ``value_head``): a linear layer
``value_head`` at the policy's root, trained with the policy's loss plus the
value loss and left out of everything the engines and the export receive
(:func:`is_value_head`)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import MethodType
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from learner.chunked_logprobs import ChunkedLogprobs
from learner.config import SHARED_GPU_RANKS_ENV
from learner.families import ModelFamily, body_of, family_of, layers_of


class Critic(nn.Module):
    """The policy's transformer body with a scalar head: V(prefix) at every
    position. ``family``: the policy's (where the body's layers are, and
    under what name the files hold the body)."""

    def __init__(self, body: nn.Module, hidden_size: int, family: ModelFamily) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        self.family = family
        self.reset_head()

    def reset_head(self) -> None:
        _zero_value_head(self.head)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, use_cache=False).last_hidden_state
        # a fresh tensor, not a view: FSDP2 hooks the module's output for backward
        return self.head(hidden).squeeze(-1).clone()


#: Name of the value head a policy carries when the critic shares its body.
VALUE_HEAD = "value_head"


def is_value_head(name: str) -> bool:
    """Whether the parameter ``name`` of a policy belongs to its value head:
    no file, engine or export has it."""
    return name.split(".", 1)[0] == VALUE_HEAD


def engine_parameters(policy: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The named parameters of ``policy`` that an engine (and the export)
    has: all but a value head's; tied ones once."""
    return [(name, parameter) for name, parameter in policy.named_parameters()
            if not is_value_head(name)]


def _zero_value_head(head: nn.Linear) -> None:
    """A zero head: the first values are 0 whatever the body."""
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)


@dataclass(frozen=True)
class Sharding:
    """How :func:`load_policy` and :func:`load_critic` shard a model (the
    arguments of :func:`shard`)."""

    device: torch.device
    bf16: bool = False
    activation_checkpointing: Literal["auto", "on", "off"] = "off"


def load_policy(path: str, dtype: torch.dtype = torch.float32,
                sharding: Sharding | None = None, value_head: bool = False,
                trust_remote_code: bool = False) -> nn.Module:
    """The causal LM in the HF folder ``path``, its parameters in ``dtype``.
    Without ``sharding``, this process holds the whole model. With it, the
    model is built on the meta device, sharded, and each rank reads only its
    shards from the safetensors files (:func:`_load_shards`): no rank ever
    holds a full copy. ``value_head``: with a zero value head at its root
    (:func:`token_logprobs_and_values`). ``trust_remote_code``: run the
    folder's own model code (``actors.engine.trust_remote_code``)."""
    if sharding is None:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                      trust_remote_code=trust_remote_code)
        family_of(policy)  # refused here, before any training, if unknown
        if value_head:
            _add_value_head(policy)
        return with_policy_methods(policy)
    policy = _policy_on_meta(path, dtype, trust_remote_code)
    if value_head:
        with torch.device("meta"):
            _add_value_head(policy)
    return _load_shards(policy, path, sharding)


def _add_value_head(policy: nn.Module) -> None:
    """A value head at the root of ``policy``, in its dtype: in FSDP2's root
    unit, with the output layer (which is also what the whole model's forward
    leaves unsharded last)."""
    head = nn.Linear(policy.config.hidden_size, 1, dtype=next(policy.parameters()).dtype)
    _zero_value_head(head)
    policy.add_module(VALUE_HEAD, head)


def load_critic(path: str, dtype: torch.dtype = torch.float32,
                sharding: Sharding | None = None, trust_remote_code: bool = False) -> Critic:
    """A critic whose body starts from the policy's weights in ``path`` (its
    own copy) and whose head starts at zero; ``sharding`` as for
    :func:`load_policy`."""
    if sharding is None:
        policy = load_policy(path, dtype, trust_remote_code=trust_remote_code)
        return Critic(body_of(policy), policy.config.hidden_size, family_of(policy)).to(dtype)
    policy = _policy_on_meta(path, dtype, trust_remote_code)
    with torch.device("meta"):
        critic = Critic(body_of(policy), policy.config.hidden_size, family_of(policy)).to(dtype)
    return _load_shards(critic, path, sharding)


#: Methods every policy gets (see :func:`with_policy_methods`).
POLICY_METHODS = ("chunked_token_logprobs", "logprobs_and_values")


def with_policy_methods(policy: nn.Module) -> nn.Module:
    """``policy`` with the :data:`POLICY_METHODS` the learner's log-probabilities
    call. Public for a causal LM of a known family built other than by
    transformers (bench/gpu_parts/learner_part.py's plain-torch Qwen2)."""
    # methods of the model, so that shard() can have FSDP2 gather the
    # parameters for them as it does for forward
    policy.chunked_token_logprobs = MethodType(_chunked_token_logprobs, policy)
    policy.logprobs_and_values = MethodType(_logprobs_and_values, policy)
    return policy


def _policy_on_meta(path: str, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    """The policy of ``path``'s config with every parameter and buffer on the
    meta device: shapes only, no memory, no initialisation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), dtype=dtype,
            trust_remote_code=trust_remote_code)
    family_of(policy)  # refused here, before any memory is given to it, if unknown
    # the mode from_pretrained leaves a model in, as the unsharded load does
    # (the trainer never switches it: PPO trains the policy it sampled with)
    return with_policy_methods(policy.eval())


def _load_shards(model: nn.Module, path: str, sharding: Sharding) -> nn.Module:
    """Shard ``model`` (on the meta device), give each rank memory for its
    shards only, and fill them from the safetensors files of ``path``.

    The files are read with torch.distributed.checkpoint's Hugging Face
    reader: every rank reads just the slices of its shards (safetensors
    slices of a memory-mapped file) and converts them to the parameters'
    dtype as it copies them in; nothing passes through rank 0 or the
    network. A tied output layer is the embedding's parameter, read once.
    Parameters must be named in the files as in the model (Qwen2, Llama:
    transformers renames nothing for them); a name missing from the files is
    an error, except the critic's head and a value head, which start at zero."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    shard(model, sharding.device, sharding.bf16, sharding.activation_checkpointing)
    model.to_empty(device=sharding.device)
    # Non-persistent buffers (the rotary embedding's inverse frequencies) are
    # in no file and to_empty left them uninitialised: transformers computes
    # them in its own weight initialisation, which from_pretrained runs too.
    body = model.body if isinstance(model, Critic) else body_of(model)
    for module in model.modules():
        if module._non_persistent_buffers_set:
            body._init_weights(module)
    if isinstance(model, Critic):
        model.reset_head()
    elif hasattr(model, VALUE_HEAD):
        _zero_value_head(getattr(model, VALUE_HEAD))
    dcp.load(_file_tensors(model), storage_reader=HuggingFaceStorageReader(path))
    return model


def _file_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` that the HF files hold, under their names
    there: the critic's body is the policy's ``model``; its head, like a
    policy's value head, is in no file; tied parameters appear once, under
    their first name."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if isinstance(model, Critic):
            if not name.startswith("body."):
                continue
            name = f"{model.family.body}." + name.removeprefix("body.")
        elif is_value_head(name):
            continue
        tensors[name] = tensor
    return tensors


def _layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a policy or critic (:class:`ModelFamily`)."""
    if isinstance(model, Critic):
        return getattr(model.body, model.family.layers)
    return layers_of(model)


def checkpoint_layers(model: nn.Module) -> None:
    """Keep only each decoder layer's input for backward and recompute the
    layer there (torch's non-reentrant checkpoint). The layer's ``forward``
    is wrapped in place rather than the module (``checkpoint_wrapper``), so
    parameter names, which checkpoints and the engines' weight loading go by,
    stay as they are; applied before ``fully_shard``, the checkpoint runs
    between FSDP2's unshard and reshard of the layer, as a wrapped module's
    would."""
    for layer in _layers(model):
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def shard(model: nn.Module, device: torch.device | None = None, bf16: bool = False,
          activation_checkpointing: Literal["auto", "on", "off"] = "off") -> nn.Module:
    """FSDP2 on ``device``: each transformer layer its own unit, then the rest;
    with ``bf16``, parameters are cast to bf16 for compute and gradients
    reduced in fp32 (the parameters, FSDP2's master weights, stay in their
    dtype). FSDP averages gradients over ranks; the trainer
    multiplies its losses by the world size to turn that into the sum it needs
    (gloo has no pre-multiplied reduce for ``set_gradient_divide_factor``).
    ``activation_checkpointing``: "on", "off", or "auto" (on on a GPU).
    A model on the meta device stays there (sharded shapes only), for
    :func:`_load_shards` to materialise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if device is None:
        device = next(model.parameters()).device
    elif not next(model.parameters()).is_meta:
        model.to(device)
    if activation_checkpointing == "on" or (activation_checkpointing == "auto"
                                            and device.type == "cuda"):
        checkpoint_layers(model)
    # the mesh on the device asked for (FSDP2's default is CUDA whenever CUDA
    # is present): a meta model is materialised there
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for method in POLICY_METHODS:
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    return model


def placement(device: str, memory_fraction: float = 1.0) -> tuple[str, torch.device]:
    """The process-group backend and this rank's device for ``learner.device``:
    NCCL and ``cuda:LOCAL_RANK`` on GPU, gloo and the CPU otherwise. On a GPU
    an engine shares, this rank's caching allocator is capped at
    ``memory_fraction`` of it (:func:`memory_cap`)."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        if (cap := memory_cap(local_rank, os.environ.get(SHARED_GPU_RANKS_ENV, ""),
                              memory_fraction)) is not None:
            torch.cuda.set_per_process_memory_fraction(cap, local_rank)
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def memory_cap(local_rank: int, shared_ranks: str, memory_fraction: float) -> float | None:
    """The share of its GPU this learner rank may allocate: ``memory_fraction``
    where an engine shares the GPU (``local_rank`` is in ``shared_ranks``,
    comma-separated), None (no cap) elsewhere. Without the cap the learner
    could take the memory vLLM freed after profiling, or that a restarted
    engine needs at its start."""
    shared = {int(rank) for rank in shared_ranks.split(",") if rank.strip()}
    return memory_fraction if local_rank in shared else None


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
    many positions at a time (the same values, :class:`ChunkedLogprobs`);
    with 0, for all of ``ids`` at once."""
    if chunk_tokens:
        chosen = policy.chunked_token_logprobs(ids, chunk_tokens)
    else:
        logits = policy(input_ids=ids, use_cache=False).logits[:, :-1].float()
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return _after_start(chosen)


def _after_start(chosen: torch.Tensor) -> torch.Tensor:
    """[B, L]: the log-probabilities of tokens 1.., and 0 for token 0."""
    return torch.cat([torch.zeros_like(chosen[:, :1]), chosen], dim=1)


def _before_each(values: torch.Tensor) -> torch.Tensor:
    """[B, L]: at each position the value at the one before (the state its
    token is sampled from), 0 at position 0."""
    return torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], dim=1)


def token_logprobs_and_values(policy: nn.Module, ids: torch.Tensor, chunk_tokens: int = 0
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] log-probabilities (as :func:`token_logprobs`) and values (as
    :func:`token_values`) of a policy with a value head, from one pass
    through its body."""
    chosen, values = policy.logprobs_and_values(ids, chunk_tokens)
    return _after_start(chosen), _before_each(values.float())


def _chunked_token_logprobs(policy: nn.Module, ids: torch.Tensor, chunk_tokens: int
                            ) -> torch.Tensor:
    """[B, L - 1] log-probability of tokens 1.. of ``ids``, the output layer
    applied ``chunk_tokens`` positions at a time. Bound to each policy as
    ``chunked_token_logprobs`` (see load_policy). For causal LMs whose logits
    are the output layer's plain product with the last hidden state, as
    :func:`learner.families.family_of` checks at load."""
    hidden = body_of(policy)(input_ids=ids, use_cache=False).last_hidden_state
    return _chosen_logprobs(policy, hidden, ids, chunk_tokens)


def _logprobs_and_values(policy: nn.Module, ids: torch.Tensor, chunk_tokens: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, L - 1] log-probability of tokens 1.., [B, L] value head output at
    every position) from one pass through the body. Bound to each policy as
    ``logprobs_and_values``; for a policy with a value head."""
    hidden = body_of(policy)(input_ids=ids, use_cache=False).last_hidden_state
    # fresh tensors, not views: FSDP2 hooks the method's outputs for backward
    values = getattr(policy, VALUE_HEAD)(hidden)[..., 0].clone()
    return _chosen_logprobs(policy, hidden, ids, chunk_tokens), values


def _chosen_logprobs(policy: nn.Module, hidden: torch.Tensor, ids: torch.Tensor,
                     chunk_tokens: int) -> torch.Tensor:
    """[B, L - 1] log-probability of tokens 1.. of ``ids`` from the body's
    last hidden states ``hidden`` [B, L, H]: all logits at once (0), or
    ``chunk_tokens`` positions at a time (:class:`ChunkedLogprobs`)."""
    weight = policy.get_output_embeddings().weight
    hidden = hidden[:, :-1]
    if not chunk_tokens:
        logits = F.linear(hidden, weight).float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, ids[:, 1:],
                                  chunk_tokens)


def token_values(critic: Critic, ids: torch.Tensor) -> torch.Tensor:
    """[B, L] value of the state each token is sampled from (the critic's
    output at the position before it; 0 at position 0)."""
    return _before_each(critic(ids).float())

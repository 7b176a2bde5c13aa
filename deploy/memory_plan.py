"""The memory arithmetic of a GPU plan: what one learner rank and one engine
need, from the model's shape (its ``config.json``) and the configuration.
``compactionrl up --plan`` prints it per process and refuses a plan whose
learner rank does not fit its GPU, naming the fix.

The figures are estimates from first principles, not measurements:

- a learner rank keeps its shard of the float32 master parameters, their
  float32 gradients and AdamW's two moments: 16 bytes per parameter over
  ``nproc`` ranks, for the policy and for the critic (a model of its own, or
  a value head of ``hidden + 1`` parameters);
- FSDP2 gathers in bf16 a decoder layer and prefetches the next, and holds
  each model's root unit (the embeddings, the policy's output layer);
- activations of one forward pass of ``tokens`` (the micro-batch budget, or
  else the rank's whole share of a minibatch): with activation checkpointing
  each layer's bf16 input plus one layer's working set, without it every
  layer's working set (``ACTIVATION_WIDTH`` values per token of width
  ``hidden``, and three of ``intermediate`` for the MLP);
- the policy's float32 logits, their log-softmax and its gradient for the
  positions of one log-probability chunk (or of the whole pass);
- ``RESERVE_BYTES`` for what the arithmetic leaves out: the CUDA context,
  NCCL's buffers, the allocator's fragmentation.

An engine holds its bf16 weights (divided by tensor parallel) and gives the
rest of its ``gpu_memory_utilization`` share, less vLLM's activation
profile (``ENGINE_ACTIVATION_FRACTION`` of the GPU, an estimate), to the KV
cache; the episodes need their windows' KV at once
(``concurrent_episodes * (context_tokens + max_turn_tokens)``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.config import ActorConfig
    from learner.config import LearnerConfig
    from replay.config import ReplayConfig

GIB = 2**30
#: Bytes per parameter a learner rank keeps of its shard: float32 master
#: weights (4), float32 gradients (4), AdamW's two float32 moments (8).
STATE_BYTES_PER_PARAMETER = 16
#: bf16 values per token and layer a decoder layer's forward keeps for its
#: backward, in units of ``hidden`` (norm inputs, q, k, v, attention output,
#: the residual adds), besides the MLP's three of ``intermediate``.
ACTIVATION_WIDTH = 8
#: What the arithmetic leaves out on a learner GPU: CUDA context, NCCL
#: buffers, allocator fragmentation.
RESERVE_BYTES = 4 * GIB
#: vLLM's profiled activation peak, as a share of the GPU (an estimate: the
#: engine measures its own when it starts).
ENGINE_ACTIVATION_FRACTION = 0.05


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a decoder-only model (Qwen2, Llama)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, folder: str | Path) -> ModelShape | None:
        """The shape in ``folder/config.json``; None where there is none."""
        path = Path(folder) / "config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        return cls(config["num_hidden_layers"], config["hidden_size"],
                   config["intermediate_size"], config["num_attention_heads"],
                   config.get("num_key_value_heads", config["num_attention_heads"]),
                   config["vocab_size"], bool(config.get("tie_word_embeddings", False)))

    @property
    def kv_width(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def layer_parameters(self) -> int:
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_width
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        output = 0 if self.tied else self.embedding_parameters
        return (self.layers * self.layer_parameters + self.embedding_parameters + output
                + self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 keys and values of every layer, for one token."""
        return 2 * self.layers * self.kv_width * 2


@dataclass(frozen=True)
class LearnerRankMemory:
    """Bytes one learner rank needs at its peak, by what holds them."""

    states: int
    gathered: int
    activations: int
    logits: int
    tokens: int
    """Tokens of the forward pass the activations are counted for."""

    @property
    def total(self) -> int:
        return self.states + self.gathered + self.activations + self.logits + RESERVE_BYTES

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB = states {self.states / GIB:.1f} + gathered "
                f"{self.gathered / GIB:.1f} + activations {self.activations / GIB:.1f} "
                f"({self.tokens} tokens a pass) + logits {self.logits / GIB:.1f} + reserve "
                f"{RESERVE_BYTES / GIB:.0f}")


def pass_tokens(learner: LearnerConfig, actors: ActorConfig, replay: ReplayConfig,
                microbatch_tokens: int) -> int:
    """Tokens of one forward pass on a rank: the micro-batch budget, or else
    the rank's share of a minibatch with every rollout's segments filling
    their windows."""
    if microbatch_tokens:
        return microbatch_tokens
    rollouts = math.ceil(replay.rollouts_per_batch / (learner.minibatches * learner.nproc))
    segments = actors.compaction.max_compactions + 1 if actors.compaction.enabled else 1
    return rollouts * segments * actors.compaction.context_tokens


def learner_rank_memory(shape: ModelShape, learner: LearnerConfig, tokens: int,
                        chunk_tokens: int) -> LearnerRankMemory:
    """The peak of one rank of ``learner.nproc`` training ``shape`` with
    forward passes of ``tokens`` and log-probabilities ``chunk_tokens``
    positions at a time (0: all at once)."""
    critic_model = learner.critic == "model"
    policy = shape.parameters
    critic = (policy - (0 if shape.tied else shape.embedding_parameters) + shape.hidden + 1
              if critic_model else shape.hidden + 1)
    bodies = 2 if critic_model else 1
    states = STATE_BYTES_PER_PARAMETER * (policy + critic) // learner.nproc
    # bf16: a decoder layer computing and the next prefetched, and each
    # model's root unit (embeddings; the policy's output layer if untied)
    roots = shape.embedding_parameters * (1 if shape.tied else 2) + (
        shape.embedding_parameters if critic_model else 0)
    gathered = 2 * (bodies * 2 * shape.layer_parameters + roots)
    working_set = tokens * (ACTIVATION_WIDTH * shape.hidden + 3 * shape.intermediate) * 2
    checkpointed = learner.activation_checkpointing != "off"  # "auto" is on on a GPU
    per_body = (shape.layers * tokens * shape.hidden * 2 + working_set if checkpointed
                else shape.layers * working_set)
    rows = chunk_tokens if chunk_tokens else tokens
    logits = 3 * rows * shape.vocab * 4
    return LearnerRankMemory(states, gathered, bodies * per_body, logits, tokens)


@dataclass(frozen=True)
class EngineMemory:
    weights: int
    kv_tokens: int
    """Tokens the KV cache holds."""
    needed_tokens: int
    """Tokens the episodes' windows hold at once."""

    window_tokens: int
    """Tokens one episode's window holds at most (context and a turn)."""

    def describe(self) -> str:
        short = (f" (short: {self.kv_tokens // self.window_tokens} episodes' full windows fit; "
                 "lower actors.concurrent_episodes, or vLLM preempts)"
                 if self.kv_tokens < self.needed_tokens else "")
        return (f"weights {self.weights / GIB:.1f} GiB a GPU; KV for {self.kv_tokens:,} tokens, "
                f"the episodes' windows {self.needed_tokens:,}{short}")


def engine_memory(shape: ModelShape, actors: ActorConfig, gpu_bytes: int,
                  utilization: float) -> EngineMemory:
    """What one engine of ``actors.engine.tensor_parallel`` GPUs, each of
    ``gpu_bytes`` with the share ``utilization``, holds."""
    tp = max(1, actors.engine.tensor_parallel)
    weights = 2 * shape.parameters // tp
    free = gpu_bytes * (utilization - ENGINE_ACTIVATION_FRACTION) - weights
    kv_tokens = max(0, int(free * tp // shape.kv_bytes_per_token))
    window = actors.compaction.context_tokens if actors.compaction.enabled \
        else actors.engine.max_model_len
    per_episode = window + actors.sampling.max_turn_tokens
    return EngineMemory(weights, kv_tokens, actors.concurrent_episodes * per_episode,
                        per_episode)


def memory_problems(learner_memory: LearnerRankMemory | None, budget_bytes: int) -> list[str]:
    """The refusal of a learner rank that does not fit ``budget_bytes``
    (its GPU, or its share of a shared one), naming the fixes."""
    if learner_memory is None or learner_memory.total <= budget_bytes:
        return []
    return [f"a learner rank needs about {learner_memory.describe()}, more than the "
            f"{budget_bytes / GIB:.1f} GiB it has (deploy/memory_plan.py): set "
            "learner.critic = \"value_head\" (no critic model: its states and activations), "
            "raise learner.nproc (states are sharded over the ranks), or lower "
            "learner.max_tokens_per_microbatch or learner.logprob_chunk_tokens"]

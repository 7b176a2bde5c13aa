"""The memory arithmetic of a GPU plan: what one learner rank and one engine
need, from the model's shape (:mod:`deploy.model_shapes`: its
``config.json`` or a known family) and the configuration.
``compactionrl up --plan`` prints it per process and refuses a learner rank
that does not fit its GPU, or an engine whose KV cache cannot hold one
``max_model_len`` sequence, naming only the fixes the configuration does
not have yet, each with what it alone would leave.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from learner.config import CHECKPOINT_BYTES_PER_PARAMETER, HOST_STAGING_SHARE, memory_switches

if TYPE_CHECKING:
    from actors.config import ActorConfig
    from deploy.model_shapes import ModelShape
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
#: The smallest log-probability chunk a refusal suggests: with a 152k
#: vocabulary its float32 logits are 1.7 GiB, small beside a 7B rank's
#: states, so smaller chunks save little and add passes over the output layer.
MIN_LOGPROB_CHUNK_TOKENS = 1024
#: The largest engine share a refusal suggests: what is left of the GPU
#: holds the CUDA context and NCCL's buffers outside vLLM's accounting.
MAX_ENGINE_UTILIZATION = 0.95


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

    def to_json(self) -> dict[str, int]:
        """The figures in bytes, as ``up --plan --json`` prints them."""
        return {"total_bytes": self.total, "states_bytes": self.states,
                "gathered_bytes": self.gathered, "activations_bytes": self.activations,
                "logits_bytes": self.logits, "reserve_bytes": RESERVE_BYTES,
                "pass_tokens": self.tokens}


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


def trained_parameters(shape: ModelShape, learner: LearnerConfig) -> tuple[int, int]:
    """Parameters of the policy and of the value side (a critic model: the
    policy's body with a value head; else the policy's value head)."""
    policy = shape.parameters
    critic = (policy - (0 if shape.tied else shape.embedding_parameters) + shape.hidden + 1
              if learner.critic == "model" else shape.hidden + 1)
    return policy, critic


def learner_rank_memory(shape: ModelShape, learner: LearnerConfig, tokens: int,
                        chunk_tokens: int) -> LearnerRankMemory:
    """The peak of one rank of ``learner.nproc`` training ``shape`` with
    forward passes of ``tokens`` and log-probabilities ``chunk_tokens``
    positions at a time (0: all at once)."""
    critic_model = learner.critic == "model"
    policy, critic = trained_parameters(shape, learner)
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
class LearnerHostMemory:
    """Host memory a learner node needs beyond its processes, for checkpoints
    and exports (the checkpoint rule itself: learner/checkpoint.py)."""

    staging: int
    """A background save's copy of the node's ranks' states."""
    export: int
    """Rank 0's gather of the policy in bf16 for an export (its node's)."""

    @property
    def background(self) -> int:
        """The node memory under which ``auto`` saves in the background."""
        return math.ceil(self.staging / HOST_STAGING_SHARE)

    def describe(self) -> str:
        return (f"a learner node's host memory: background checkpoints copy its states, "
                f"{self.staging / GIB:.1f} GiB, and need {self.background / GIB:.0f} GiB of it "
                f"(with less, learner.async_checkpoint = \"auto\" saves synchronously); an "
                f"export gathers {self.export / GIB:.1f} GiB on rank 0's")

    def to_json(self) -> dict[str, int]:
        return {"staging_bytes": self.staging, "background_bytes": self.background,
                "export_bytes": self.export}


def learner_host_memory(shape: ModelShape, learner: LearnerConfig) -> LearnerHostMemory:
    """What one of ``learner.nnodes`` nodes holds on the host for checkpoints
    of ``shape`` (every trained parameter's weight and moments, the node's
    share) and for an export (the policy in bf16)."""
    policy, critic = trained_parameters(shape, learner)
    return LearnerHostMemory(CHECKPOINT_BYTES_PER_PARAMETER * (policy + critic) // learner.nnodes,
                             2 * policy)


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

    def to_json(self) -> dict[str, int]:
        """The figures in bytes and tokens, as ``up --plan --json`` prints them."""
        return {"weights_bytes": self.weights, "kv_tokens": self.kv_tokens,
                "needed_tokens": self.needed_tokens, "window_tokens": self.window_tokens}


def engine_memory(shape: ModelShape, actors: ActorConfig, gpu_bytes: int,
                  utilization: float) -> EngineMemory:
    """What one engine of ``actors.engine.tensor_parallel`` GPUs, each of
    ``gpu_bytes`` with the share ``utilization``, holds."""
    tp = max(1, actors.engine.tensor_parallel)
    weights = 2 * shape.parameters // tp
    free = gpu_bytes * (utilization - ENGINE_ACTIVATION_FRACTION) - weights
    kv_tokens = max(0, int(free * tp // shape.kv_bytes_per_token))
    per_episode = actors.window_tokens()
    return EngineMemory(weights, kv_tokens, actors.concurrent_episodes * per_episode,
                        per_episode)


def learner_need(shape: ModelShape, learner: LearnerConfig, actors: ActorConfig,
                 replay: ReplayConfig) -> LearnerRankMemory:
    """The peak of one rank of ``learner`` on a GPU, its memory switches
    resolved as the learner resolves them there."""
    chunk, microbatch = memory_switches(learner, on_gpu=True)
    return learner_rank_memory(shape, learner, pass_tokens(learner, actors, replay, microbatch),
                               chunk)


#: How a fix that places the learner but leaves the actors no GPU says so.
NO_ENGINE = "but no GPU is left for an engine"


@dataclass(frozen=True)
class Widening:
    """``nproc`` ranks on the learner's GPU type, with the other settings the
    plan then needs to place every process (the GPU lists, fewer actors)."""

    nproc: int
    changes: str
    """Every setting it takes, as the user writes them, ``learner.nproc`` first."""
    places_actors: bool
    """Whether an engine's GPUs are left for the actors (``changes`` lowers
    ``actors.count`` where fewer fit than asked)."""


@dataclass(frozen=True)
class Fix:
    """One change a refusal suggests, and what it does alone."""

    change: str
    """As the user writes it: ``learner.nproc = 8``."""
    effect: str
    """What the process has with it: ``38.2 GiB a rank``."""
    fits: bool
    """Whether this change alone makes the process fit."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The learner fields it sets (empty for a change of placement)."""


def learner_fixes(shape: ModelShape, learner: LearnerConfig, actors: ActorConfig,
                  replay: ReplayConfig, budget_bytes: int, wider: Sequence[Widening]
                  ) -> list[Fix]:
    """The memory switches ``learner`` does not have yet, each with what a
    rank needs once it is set (those that fit first, then the least need);
    more ranks, ``wider``, where its type has more GPUs than ``learner.nproc``
    (a fix that leaves no engine's GPUs for the actors does not fit)."""
    chunk, microbatch = memory_switches(learner, on_gpu=True)
    # a sequence longer than the budget goes alone, so a budget below the
    # longest segment bounds nothing more
    segment = (actors.compaction.context_tokens if actors.compaction.enabled
               else actors.engine.max_model_len)
    settings: list[tuple[str, dict[str, Any], bool]] = []
    if learner.critic == "model":
        settings.append(('learner.critic = "value_head"', {"critic": "value_head"}, True))
    if learner.activation_checkpointing == "off":
        settings.append(('learner.activation_checkpointing = "on"',
                         {"activation_checkpointing": "on"}, True))
    if microbatch == 0 or microbatch > segment:
        settings.append((f"learner.max_tokens_per_microbatch = {segment}",
                         {"max_tokens_per_microbatch": segment}, True))
    if chunk == 0 or chunk > MIN_LOGPROB_CHUNK_TOKENS:
        settings.append((f"learner.logprob_chunk_tokens = {MIN_LOGPROB_CHUNK_TOKENS}",
                         {"logprob_chunk_tokens": MIN_LOGPROB_CHUNK_TOKENS}, True))
    if wider:
        widening = _fewest_ranks(shape, learner, actors, replay, budget_bytes, wider)
        settings.append((widening.changes, {"nproc": widening.nproc}, widening.places_actors))
    needs = sorted((learner_need(shape, replace(learner, **fields), actors, replay).total,
                    change, fields, places) for change, fields, places in settings)
    return [Fix(change, _rank_effect(total, places), total <= budget_bytes and places, fields)
            for total, change, fields, places in needs]


def _fewest_ranks(shape: ModelShape, learner: LearnerConfig, actors: ActorConfig,
                  replay: ReplayConfig, budget_bytes: int, wider: Sequence[Widening]
                  ) -> Widening:
    """The fewest ranks of ``wider`` (in rising order) whose rank fits
    ``budget_bytes``, or the most there are where none does."""
    return next((w for w in wider if learner_need(shape, replace(learner, nproc=w.nproc),
                                                  actors, replay).total <= budget_bytes),
                wider[-1])


def _rank_effect(total: int, places_actors: bool) -> str:
    """What a learner fix leaves: a rank's need, and the actors without GPUs where so."""
    return f"{total / GIB:.1f} GiB a rank" + ("" if places_actors else f", {NO_ENGINE}")


def _together(shape: ModelShape, learner: LearnerConfig, actors: ActorConfig,
              replay: ReplayConfig, budget_bytes: int, switches: Sequence[Fix],
              wider: Sequence[Widening]) -> Fix:
    """Every switch at once, with the fewest more ranks that then fit (not
    necessarily the count a switch alone needs), and what else they change."""
    merged = {key: value for fix in switches for key, value in fix.settings.items()
              if key != "nproc"}
    changes = [fix.change for fix in switches if "nproc" not in fix.settings]
    both, places = replace(learner, **merged), True
    if wider and learner_need(shape, both, actors, replay).total > budget_bytes:
        widening = _fewest_ranks(shape, both, actors, replay, budget_bytes, wider)
        both, places = replace(both, nproc=widening.nproc), widening.places_actors
        changes.append(widening.changes)
    total = learner_need(shape, both, actors, replay).total
    return Fix("these together: " + ", ".join(changes), _rank_effect(total, places),
               total <= budget_bytes and places)


def learner_memory_problems(shape: ModelShape, learner: LearnerConfig, actors: ActorConfig,
                            replay: ReplayConfig, budget_bytes: int,
                            wider: Sequence[Widening] = (), placements: Sequence[Fix] = ()
                            ) -> list[str]:
    """The refusal of a learner rank that does not fit ``budget_bytes`` (its
    GPU, or its share of a shared one), naming only the fixes the
    configuration does not have: its memory switches and more ranks
    (:func:`learner_fixes`), and ``placements`` (GPUs where it fits)."""
    need = learner_need(shape, learner, actors, replay)
    if need.total <= budget_bytes:
        return []
    switches = learner_fixes(shape, learner, actors, replay, budget_bytes, wider)
    fixes = [*placements, *switches]
    if len(switches) > 1 and not any(fix.fits for fix in fixes):
        fixes.append(_together(shape, learner, actors, replay, budget_bytes, switches, wider))
    return [f"a learner rank needs about {need.describe()}, more than the "
            f"{budget_bytes / GIB:.1f} GiB it has (deploy/memory_plan.py): "
            + describe_fixes(fixes)]


def engine_memory_problems(shape: ModelShape, actors: ActorConfig, gpu_bytes: int,
                           utilization: float, doubled: Sequence[str] | None = ()
                           ) -> list[str]:
    """The refusal of an engine whose KV cache cannot hold one sequence of
    ``actors.engine.max_model_len`` (vLLM refuses to start it), naming the
    fixes the configuration does not have. ``doubled``: the other settings
    twice the tensor parallel needs for every actor to get its GPUs (the GPU
    list, fewer actors); None where no engine of twice the GPUs is left."""
    memory = engine_memory(shape, actors, gpu_bytes, utilization)
    longest = actors.engine.max_model_len
    if memory.kv_tokens >= longest:
        return []
    engine = actors.engine
    options = [(", ".join([f"actors.engine.tensor_parallel = {2 * engine.tensor_parallel}",
                           *(doubled or ())]),
                replace(engine, tensor_parallel=2 * engine.tensor_parallel), utilization,
                doubled is not None)]
    # a share below the engine's own is co-location's, which this setting does not raise
    if utilization == engine.gpu_memory_utilization < MAX_ENGINE_UTILIZATION:
        options.append((f"actors.engine.gpu_memory_utilization = {MAX_ENGINE_UTILIZATION}",
                        replace(engine, gpu_memory_utilization=MAX_ENGINE_UTILIZATION),
                        MAX_ENGINE_UTILIZATION, True))
    fixes = []
    for change, changed, share, places in options:
        kv = engine_memory(shape, replace(actors, engine=changed), gpu_bytes, share).kv_tokens
        fixes.append(Fix(change, f"KV for {kv:,} tokens" + ("" if places else f", {NO_ENGINE}"),
                         kv >= longest and places))
    return [f"an engine holds {memory.weights / GIB:.1f} GiB of weights a GPU and KV for "
            f"{memory.kv_tokens:,} tokens, fewer than actors.engine.max_model_len = {longest:,}"
            " (vLLM refuses to start it; deploy/memory_plan.py): " + describe_fixes(fixes)]


def describe_fixes(fixes: Sequence[Fix]) -> str:
    """The fixes as a refusal names them, those that fit first."""
    if not fixes:
        return ("no switch is left to turn in this configuration: GPUs with more memory, or a "
                "smaller model")
    ordered = sorted(fixes, key=lambda fix: not fix.fits)
    return "fixes the configuration does not have yet: " + "; ".join(
        f"{fix.change} ({fix.effect}{': fits' if fix.fits else ''})" for fix in ordered)

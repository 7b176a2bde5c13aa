"""Configuration of the learner (the ``[learner]`` section): docs/design.md §2.3-2.4."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocol.bounds import bound_problems, bounded

#: What ``"auto"`` is on a GPU for the two memory switches: long sequences
#: must not run out of memory with the default settings (a 32k-token share
#: of a 150k vocabulary is 19 GB of float32 logits at once). 4,096 positions
#: of such logits are 2.5 GB; 16,384 tokens per pass keep a 7B model's
#: checkpointed layer inputs near 3 GB. On the CPU both are off: memory is
#: not what limits a run there.
AUTO_LOGPROB_CHUNK_TOKENS = 4096
AUTO_MAX_TOKENS_PER_MICROBATCH = 16384

#: The learner's local ranks whose GPU an engine shares (co-location), as
#: ``up`` sets it from the device plan: comma-separated, absent for none.
SHARED_GPU_RANKS_ENV = "COMPACTIONRL_SHARED_GPU_RANKS"


#: Bytes a checkpoint holds per trained parameter: the fp32 weight and
#: AdamW's two moments (no gradient).
CHECKPOINT_BYTES_PER_PARAMETER = 12
#: The share of a learner host's memory a background save may copy the
#: host's states into (``async_checkpoint = "auto"``): the rest holds the
#: ranks' processes, rank 0's gather of an export and the page cache the
#: writes go through.
HOST_STAGING_SHARE = 0.5

@dataclass
class TrackingConfig:
    """Experiment tracking by the learner's rank 0 (learner/tracking/)."""

    backends: list[Literal["wandb", "tensorboard"]] = field(default_factory=list)
    """Where to record the run; empty (the default): nowhere but Prometheus."""
    project: str = "compactionrl"
    """The W&B project (the run is named after ``run.name``)."""
    wandb_mode: Literal["online", "offline"] = "online"
    """``offline``: W&B writes files only (``wandb sync`` uploads them later)."""
    samples_every: int = bounded(10, ge=1)
    """A table of sampled rollouts every this many steps."""
    samples: int = bounded(4, ge=1)
    """Rollouts in each table."""

    def validate(self, section: str = "tracking") -> list[str]:
        return bound_problems(self, section)


@dataclass
class LearnerConfig:
    """PPO with a critic, cross-trajectory GAE, token-level normalisation."""

    nproc: int = bounded(1, ge=1)
    """Ranks torchrun starts on each node (FSDP2 shards over all ranks of all
    nodes)."""
    nnodes: int = bounded(1, ge=1)
    """Nodes of the learner, each running `compactionrl learner` with the same
    configuration but learner.node_rank. 1: torchrun --standalone."""
    node_rank: int = 0
    """This node's place, 0 .. nnodes - 1. Node 0 holds global rank 0, which
    binds the control socket and the weight store the actors dial, and the
    rendezvous: pass it per node (--learner.node_rank; Slurm's SLURM_NODEID,
    a StatefulSet pod's ordinal)."""
    rdzv_endpoint: str = ""
    """HOST:PORT of the rendezvous on node 0, reachable from every node
    (torchrun's static rendezvous: master address and port). Needed when
    nnodes > 1."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: one GPU per rank (LOCAL_RANK) with NCCL when CUDA is there, else
    the CPU with gloo."""
    gpus: list[int] = field(default_factory=list)
    """GPUs of the ranks `compactionrl up` starts, one per rank (it sets
    their CUDA_VISIBLE_DEVICES). Empty: the first nproc GPUs. Elsewhere
    (torchrun by hand, a pod) the visible GPUs decide."""
    weight_transport: Literal["auto", "gloo", "nccl", "ipc"] = "auto"
    """How weights reach the engines. auto chooses from the device plan
    (deploy/device_plan.py): gloo when the learner is on the CPU, ipc when a
    learner rank and an engine share a GPU, nccl otherwise; ipc on the CPU
    stages weights in shared memory (every engine on the learner's host). A
    configuration that would put two NCCL ranks on one GPU is refused at load
    time, naming the fix."""
    gpu_memory_fraction: float = bounded(
        0.5, gt=0, lt=1, why="it splits a shared GPU between the learner and an engine")
    """Co-location only (a learner rank and an engine on one GPU): the share
    of that GPU's memory kept for the learner rank. The engine there gets
    gpu_memory_utilization = 1 - this (or actors.engine's, if lower), and
    starts first: vLLM measures free memory while it starts."""
    mixed_precision: Literal["bf16", "off"] = "bf16"
    """On GPU, FSDP2 computes in bf16 and reduces gradients in fp32 (master
    weights stay fp32). Ignored on CPU, which trains in fp32."""
    activation_checkpointing: Literal["auto", "on", "off"] = "auto"
    """Keep only each decoder layer's input for backward and recompute the
    layer there (policy and critic): activation memory of one layer instead
    of all, for a second forward pass of each layer. auto: on on GPU, off on
    the CPU."""
    logprob_chunk_tokens: int | Literal["auto"] = bounded("auto", ge=0)
    """Positions whose [positions, vocabulary] float32 logits exist at once
    when computing log-probabilities; backward computes each chunk's again.
    The same values as without (0 = off: the logits of a whole forward pass
    at once). auto: ``AUTO_LOGPROB_CHUNK_TOKENS`` on GPU, off on the CPU."""
    max_tokens_per_microbatch: int | Literal["auto"] = bounded("auto", ge=0)
    """Token budget of one forward pass, padding included: each rank's share
    of a minibatch is cut into micro-batches of whole sequences within it
    (a longer sequence alone), their gradients accumulated into one update
    that equals the update without the cut (0 = off: the whole share at
    once). auto: ``AUTO_MAX_TOKENS_PER_MICROBATCH`` on GPU, off on the CPU."""
    critic: Literal["model", "value_head"] = "model"
    """model: the critic is a model of its own, the policy's body copied with
    a scalar head (the paper's choice). value_head: a scalar head on the
    policy's own body; one forward and backward pass per micro-batch serves
    both, the body trained on the policy loss plus value_loss_coef times the
    value loss (a second model's parameters, gradients and AdamW state
    saved). The head never reaches the engines or the export."""
    value_loss_coef: float = bounded(0.5, ge=0)
    """value_head only: weight of the value loss in the shared body's loss
    (with a critic model, each model has its own loss)."""
    lr: float = bounded(1e-4, gt=0)
    """Policy learning rate (AdamW)."""
    critic_lr: float = bounded(1e-4, gt=0)
    """Critic learning rate (AdamW); with a value head, the head's (the
    shared body follows lr)."""
    gamma: float = bounded(1.0, ge=0, le=1)
    """Discount of the GAE."""
    lam: float = bounded(0.999, ge=0, le=1)
    """lambda of the GAE with lam_mode = "fixed"; (gamma*lam)^N_{>s} discounts
    early segments."""
    lam_mode: Literal["fixed", "adaptive"] = "fixed"
    """fixed: one lambda (``lam``); adaptive: each segment's own, lambda_s =
    1 - 1/(lam_alpha * n_s) of its n_s trainable tokens (the paper's), in its
    GAE and in the discount of the segments before it."""
    lam_alpha: float = bounded(1.5, gt=0)
    """alpha of the adaptive lambda (the paper: 1.5)."""
    critic_warmup_steps: int = bounded(0, ge=0)
    """Value-only updates on the first batches: the critic (a value head
    alone, without the shared body) learns while the policy, its version and
    the actors' weights stay put."""
    advantage: Literal["cross", "independent", "grpo", "grpo_segments"] = "cross"
    """cross: cross-trajectory GAE; independent: each segment alone; grpo:
    group-relative outcome advantage, each rollout counted once in its
    group's statistics; grpo_segments: the same with each segment counted
    (ablations; formulas in learner/advantages.py)."""
    loss_norm: Literal["token", "segment", "rollout"] = "token"
    """token: mean over all trainable tokens of the global batch; segment: mean
    per segment, then over segments; rollout: mean per rollout, then over
    rollouts, each rollout weighing the same whatever its segment count
    (ablations; formulas in learner/losses.py and docs/learner.md)."""
    train_summary: bool = True
    """False: summary tokens stay in the context but are masked out of the loss."""
    share_prefixes: bool = True
    """Train a summary segment and the window it summarises (its prompt, the
    execution segment before it) as one sequence: the same losses, fewer
    tokens through the models."""
    clip_low: float = bounded(0.2, ge=0, lt=1, why="the ratio's lower bound is 1 - clip_low")
    """epsilon_low of the PPO ratio clip."""
    clip_high: float = bounded(0.2, ge=0)
    """epsilon_high of the PPO ratio clip."""
    is_cap: float = bounded(2.0, ge=1, why="it caps pi_prox/mu")
    """C_is: cap of the behaviour importance weight pi_prox / mu."""
    is_mode: Literal["truncate", "mask", "off"] = "truncate"
    """truncate: min(w, C_is); mask: drop tokens with w outside [1/C_is, C_is]; off: w = 1."""
    value_clip: float = bounded(0.2, ge=0)
    """Clip range of the critic's value update."""
    ppo_epochs: int = bounded(1, ge=1)
    """Passes over each batch."""
    minibatches: int = bounded(1, ge=1)
    """Optimizer steps per epoch."""
    max_grad_norm: float = bounded(1.0, ge=0)
    """Gradient clipping (0 = off)."""
    whiten_advantages: bool = False
    """Off by default: a batch mean would favour discounted early segments."""
    max_steps: int = bounded(50, ge=1)
    """Learner steps (policy versions) of a run."""
    checkpoint_every: int = bounded(10, ge=1)
    """Steps between checkpoints (and one at shutdown)."""
    async_checkpoint: Literal["auto", "on", "off"] = "auto"
    """Write checkpoints in the background, training stalled only while the
    state is copied to CPU memory (one pinned copy for the run). ``auto``: on
    GPU (the copy leaves the device, the slow write overlaps training) where
    the copy of a host's states fits ``HOST_STAGING_SHARE`` of its memory
    (its cgroup's limit: a pod's ``limits.memory``), else synchronous; off on
    the CPU, where the state is in memory already and the copy only adds
    (bench/checkpoint.py measured the background save stalling 1.2x the
    synchronous one there)."""
    keep_last: int = bounded(3, ge=1)
    """Complete checkpoints kept, the newest; older ones are removed after
    each save (a 7B checkpoint is ~180 GB: docs/deploy.md)."""
    keep_every: int = bounded(0, ge=0)
    """Also keep every checkpoint whose step is a multiple of this (0: none),
    for evaluating or resuming from points along the run."""
    export_every: int = bounded(0, ge=0)
    """An HF export beside every checkpoint whose step is a multiple of this,
    into ``exports/step-N`` of the run folder (0: only the final ``export``)."""
    export_timeout_s: float = bounded(3600.0, gt=0)
    """How long the other ranks wait for rank 0 to write the HF export at the
    end (on a process group of its own: the usual collective timeout, 10
    minutes on NCCL, does not apply). A rank 0 that dies ends the wait at
    once; this bounds a hung one. An hour writes a 70B model's 140 GB of bf16
    at 40 MB/s."""
    control_address: str = "tcp://127.0.0.1:5557"
    """Where actors reach rank 0's control socket (membership, weight
    announcements): the address it advertises."""
    control_bind: str = ""
    """Where rank 0's control socket listens ("" = ``control_address``)."""
    weight_store_address: str = "127.0.0.1:5558"
    """HOST:PORT where actors reach the weight groups' rendezvous store on rank 0
    (protocol/weights_store.py; CURVE-authenticated with ``transport.curve``)."""
    weight_store_bind: str = ""
    """HOST:PORT where the store listens ("" = ``weight_store_address``)."""
    weight_bucket_bytes: int = bounded(0, ge=0)
    """Broadcast bucket size (0 = one broadcast per tensor, the fast choice on gloo)."""
    replay_timeout_s: float = bounded(300.0, gt=0)
    """How long rank 0 waits for the replay to answer its ``learner_hello``, or to come back
    once its connection dropped (a restart under ``compactionrl up`` takes seconds; a frozen
    replay's connection drops after the transport's liveness), before the learner stops."""
    weight_timeout_s: float = bounded(30.0, gt=0)
    """Bound on forming a broadcast group and on each broadcast: a dead actor
    fails that publication after this long, never hangs the learner."""
    member_backoff_s: float = bounded(10.0, gt=0)
    """How long publications leave out a member that made a weight
    generation fail (it never joined, or a lane it alone held failed),
    doubled with each next failure in a row; a publication that reaches it
    forgives them (learner/members.py)."""
    member_failures_allowed: int = bounded(5, ge=1)
    """Failed generations in a row after which a member is left out until
    it restarts: each costs rank 0 up to ``weight_timeout_s``, so a member
    that never joins costs at most this many deadlines per incarnation."""
    publish_every: int = bounded(1, ge=1)
    """Optimiser steps between weight publications (at most the replay's
    max_staleness + 1, or actors generate stale tokens before each one)."""
    late_joiner: Literal["immediate", "next_publication"] = "immediate"
    """immediate: an actor that joins gets the current weights at the next
    step boundary; next_publication: it waits for the regular one (either
    way it never generates with weights older than max_staleness)."""
    metrics_port: int = 9102
    """Prometheus port of rank 0 (0 = off)."""

    def validate(self, section: str = "learner") -> list[str]:
        problems = bound_problems(self, section)
        if self.nnodes >= 1 and not 0 <= self.node_rank < self.nnodes:
            problems.append(f"{section}.node_rank = {self.node_rank} must be in 0 .. "
                            f"{self.nnodes - 1} (nnodes = {self.nnodes})")
        if self.nnodes > 1:
            rdzv_host, _, rdzv_port = self.rdzv_endpoint.rpartition(":")
            if not rdzv_host or not rdzv_port.isdigit() or not 0 < int(rdzv_port) < 65536:
                problems.append(f"{section}.rdzv_endpoint = {self.rdzv_endpoint!r}: a learner on "
                                f"{self.nnodes} nodes needs node 0's HOST:PORT, reachable from "
                                "every node")
        for name in ("weight_store_address", "weight_store_bind"):
            value = getattr(self, name)
            host, _, port = value.rpartition(":")
            if (value or name == "weight_store_address") and (not host or not port.isdigit()):
                problems.append(f"{section}.{name} = {value!r} must be HOST:PORT")
        return problems


def memory_switches(config: LearnerConfig, on_gpu: bool) -> tuple[int, int]:
    """``(logprob_chunk_tokens, max_tokens_per_microbatch)`` as a learner on
    a GPU (``on_gpu``) or the CPU uses them: ``"auto"`` resolved, 0 = off."""
    def resolved(value: int | str, on: int) -> int:
        return (on if on_gpu else 0) if value == "auto" else int(value)

    return (resolved(config.logprob_chunk_tokens, AUTO_LOGPROB_CHUNK_TOKENS),
            resolved(config.max_tokens_per_microbatch, AUTO_MAX_TOKENS_PER_MICROBATCH))

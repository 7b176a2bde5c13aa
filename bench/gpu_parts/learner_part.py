"""Part 6 of the GPU check: Qwen2-shaped policies written in plain torch,
and the learner's own PPO step over them (:class:`learner.ppo.PPOTrainer`,
its critic :class:`learner.models.Critic` around the same body), sharded by
the learner's :func:`learner.models.shard` on a process group of one rank:
its time, memory, MFU and HFU."""

from __future__ import annotations

import gc
import math
import tempfile
import time
from collections import namedtuple
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

# The learner's own sharding, log-probabilities and PPO step, from the
# checkout (installed, or PYTHONPATH=.): what the learner part times is what
# the learner runs, not a copy that can drift (copies did: one returned one
# log-probability fewer per row, one backpropagated both losses at once where
# the learner frees the critic's activations before the policy's forward).
# They bring the learner package's own dependencies (numpy and msgspec for
# protocol, prometheus_client for ops), which a GPU machine with torch alone
# lacks unless they are carried as wheels (docs/deploy.md, "The GPU check").
try:
    from learner.batch import TrainBatch, TrainSequence
    from learner.config import LearnerConfig
    from learner.families import FAMILIES
    from learner.models import Critic, shard, token_logprobs, with_policy_methods
    from learner.ppo import PPOTrainer
except ModuleNotFoundError as missing:
    _package = (missing.name or "").partition(".")[0]
    LEARNER_UNAVAILABLE: str | None = (
        f"skipped: the project's learner package is not importable ({missing}); run from the "
        "checkout's root with PYTHONPATH=." if _package in ("learner", "protocol", "ops")
        else f"skipped: {_package}, which the learner package needs, is not installed "
             f"({missing}); carry it as a wheel (docs/deploy.md, \"The GPU check\")")
else:
    LEARNER_UNAVAILABLE = None

from gpu_parts.common import (
    MODELS,
    Qwen2Shape,
    manifest,
    numel,
    synchronize,
)

#: NVIDIA's H200 SXM datasheet gives 1,979 TFLOP/s bf16 "with sparsity"; dense
#: (what a PPO step runs) is half. MFU divides by this (``--peak-tflops`` for
#: another device; the device's name is in the report).
H200_BF16_DENSE_PEAK_FLOPS = 989.5e12
LEARNER_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b")
#: The dry run's stand-in for each of them: seconds on a CPU.
DRY_RUN_LEARNER_SHAPE = Qwen2Shape(2, 64, 128, 512, 4, 2, tied=True)
ROPE_THETA = 1_000_000.0  # Qwen2.5's config.json
RMS_EPS = 1e-6  # idem
INIT_STD = 0.02  # idem (initializer_range)
POLICY_LR, CRITIC_LR = 1e-6, 5e-6  # deploy/configs/gpu-*.toml
SEED = 1234

SWITCHES = ("checkpointing", "chunked_logprobs", "microbatches")
#: All on, as deploy/configs/gpu-*.toml run the learner; all on with the
#: critic as a value head on the policy ("value_head": learner.critic's
#: option) instead of a model of its own; each switch off in turn; all off.
#: In this order, so that a run cut short by --budget-s has the first.
SWITCH_SETS: dict[str, frozenset[str]] = {
    "all": frozenset(SWITCHES),
    "all_value_head": frozenset(SWITCHES) | {"value_head"},
    **{f"no_{switch}": frozenset(SWITCHES) - {switch} for switch in SWITCHES},
    "none": frozenset(),
}
FLOP_FORMULA = (
    "model FLOPs (MFU) per trained token: 6*(N_policy + N_critic - vocab*hidden) "
    "+ 2*6*layers*hidden*seq (forward and backward of both models; the critic's embedding "
    "is a lookup, not a matmul; attention causal: a token's q.k and weighted sum of v span "
    "seq/2 positions on average, 2*2*hidden*seq/2 per layer forward, three times that with "
    "backward); with a value head, one body: 6*(N_policy + hidden + 1) + 6*layers*hidden*seq. "
    "Hardware FLOPs (HFU): the model FLOPs plus what the switches compute again: "
    "with checkpointing, every layer's forward once more, 2*N_layers + 2*layers*hidden*seq per "
    "body (N_layers: the decoder layers' parameters); with chunked_logprobs, the output "
    "layer's logits once more, 2*vocab*hidden; with microbatches (several passes), the "
    "forward that gives the old values before them (the advantages need every old value "
    "before the first value loss: learner/ppo.py), the critic's 2*(N_critic - vocab*hidden) "
    "+ 2*layers*hidden*seq, or with a value head the policy's and its head's "
    "2*(N_policy + hidden + 1) + 2*layers*hidden*seq")


@dataclass(frozen=True)
class LearnerPlan:
    lengths: tuple[int, ...]  # tokens per sequence, ascending
    sequences: int  # per PPO step; "microbatches" puts one in each pass, else all in one
    chunk_tokens: int  # positions per log-softmax chunk when "chunked_logprobs" is on
    precision_sequences: int  # of lengths[0] tokens, for the bf16-vs-fp32 log-prob error
    steps: int  # timed PPO steps after one warm-up


#: On a GPU: the lengths the issue asks for; 4096 as deploy/configs/gpu-*.toml.
GPU_PLAN = LearnerPlan((2048, 8192, 16384), sequences=2, chunk_tokens=4096,
                       precision_sequences=4, steps=3)
DRY_RUN_PLAN = LearnerPlan((64, 128, 256), sequences=2, chunk_tokens=32,
                           precision_sequences=2, steps=1)


class RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()  # in float32 and back, as transformers' Qwen2RMSNorm
        normed = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + RMS_EPS)
        return self.weight * normed.to(x.dtype)


def rotary(length: int, head_dim: int, dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] of Qwen2's rotary embedding."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device),
                         ROPE_THETA ** -exponents)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.heads, self.kv_heads = shape.heads, shape.kv_heads
        self.head_dim = shape.hidden // shape.heads
        q, kv = shape.heads * self.head_dim, shape.kv_heads * self.head_dim
        self.q_proj = nn.Linear(shape.hidden, q)
        self.k_proj = nn.Linear(shape.hidden, kv)
        self.v_proj = nn.Linear(shape.hidden, kv)
        self.o_proj = nn.Linear(q, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def split(projection: nn.Linear, heads: int) -> torch.Tensor:
            return projection(x).view(batch, length, heads, self.head_dim).transpose(1, 2)

        q = rotate(split(self.q_proj, self.heads), cos, sin)
        k = rotate(split(self.k_proj, self.kv_heads), cos, sin)
        v = split(self.v_proj, self.kv_heads)
        # each KV head serves heads / kv_heads query heads, repeated as
        # transformers' repeat_kv does (SDPA keeps its fused causal kernels)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden)
        self.post_attention_layernorm = RMSNorm(shape.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


#: What the bodies and the causal LM return, as transformers' outputs are
#: read (``.last_hidden_state``, ``.logits``); named tuples, so that FSDP2
#: finds the tensors in them to hook for backward.
BodyOutput = namedtuple("BodyOutput", "last_hidden_state")
CausalLMOutput = namedtuple("CausalLMOutput", "logits")


class Body(nn.Module):
    """Qwen2's transformer body: embeddings, decoder layers, final norm."""

    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.head_dim = shape.hidden // shape.heads
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.hidden)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> BodyOutput:
        """Called as the learner calls transformers' bodies; ``use_cache`` is
        accepted for that and means nothing here (there is no cache)."""
        x = self.embed_tokens(input_ids)
        cos, sin = rotary(input_ids.shape[1], self.head_dim, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return BodyOutput(self.norm(x))


class Qwen2ForCausalLM(nn.Module):
    """A tied Qwen2 causal LM, its parameters under transformers' names (so
    ``manifest`` lists them): the output layer is the embedding. Named as
    transformers' class, which is how learner/families.py knows its family
    (body ``model``, layers ``model.layers``), and with the learner's policy
    methods (:func:`learner.models.with_policy_methods`), so that the
    learner's functions take it as they take a loaded policy. With
    ``value_head``, a scalar head on its body as well (the learner's
    ``critic = "value_head"``)."""

    def __init__(self, shape: Qwen2Shape, value_head: bool = False) -> None:
        super().__init__()
        self.model = Body(shape)
        if value_head:
            self.value_head = nn.Linear(shape.hidden, 1)
        with_policy_methods(self)

    def get_output_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> CausalLMOutput:
        hidden = self.model(input_ids=input_ids, use_cache=use_cache).last_hidden_state
        return CausalLMOutput(F.linear(hidden, self.model.embed_tokens.weight))


def critic_model(shape: Qwen2Shape) -> Critic:
    """The learner's critic: a body of the policy's shape (its own copy) with
    a scalar head."""
    qwen2 = next(family for family in FAMILIES if family.name == "qwen2")
    return Critic(Body(shape), shape.hidden, qwen2)


def build(kind: Callable[..., nn.Module], shape: Qwen2Shape, device: str,
          **options: bool) -> nn.Module:
    """Random float32 weights (the learner's master copy), allocated once on
    ``device``. The same seed for both kinds: the critic's body starts as the
    policy's, as the learner's critic does. ``options``: of ``kind``."""
    with torch.device("meta"):
        model = kind(shape, **options)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(SEED)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            elif name.endswith("bias"):
                parameter.zero_()
            else:
                parameter.normal_(0.0, INIT_STD, generator=generator)
    return model


def learner_config(switches: frozenset[str], chunk_tokens: int, length: int) -> LearnerConfig:
    """The learner's settings for a switch set: deploy/configs/gpu-*.toml's
    learning rates, the critic a model or a value head, and the memory
    switches as the learner reads them; "microbatches" is a token budget
    of one sequence, so that each goes through the models alone."""
    return LearnerConfig(
        lr=POLICY_LR, critic_lr=CRITIC_LR,
        critic="value_head" if "value_head" in switches else "model",
        activation_checkpointing="on" if "checkpointing" in switches else "off",
        logprob_chunk_tokens=chunk_tokens if "chunked_logprobs" in switches else 0,
        max_tokens_per_microbatch=length if "microbatches" in switches else 0)


def random_ids(shape: Qwen2Shape, sequences: int, length: int,
               generator: torch.Generator) -> torch.Tensor:
    """[sequences, length] token ids drawn at random."""
    return torch.randint(shape.vocab, (sequences, length), generator=generator)


def random_batch(shape: Qwen2Shape, sequences: int, length: int, seed: int) -> TrainBatch:
    """Random token ids, each sequence a rollout of one execution segment
    trained on every token after the first, with behaviour log-probabilities
    near the uniform distribution's (importance weights near 1, some capped)
    and a random reward."""
    generator = torch.Generator().manual_seed(seed)
    ids = random_ids(shape, sequences, length, generator)
    trainable = torch.arange(length) > 0
    behaviour = -math.log(shape.vocab) + 0.1 * torch.randn(sequences, length,
                                                            generator=generator)
    rows = [TrainSequence(tokens, trainable.clone(), torch.where(trainable, logprobs, 0.0),
                          rollout, "execution", [length - 1])
            for rollout, (tokens, logprobs) in enumerate(zip(ids, behaviour, strict=True))]
    return TrainBatch(rows, torch.rand(sequences, generator=generator, dtype=torch.float64),
                      [f"task-{n}" for n in range(sequences)], [False] * sequences,
                      [0] * sequences, [{} for _ in range(sequences)],
                      [{} for _ in range(sequences)], [f"task-{n}" for n in range(sequences)],
                      [0] * sequences, ["actor-0"] * sequences)


def flop_count(shape: Qwen2Shape, lengths: tuple[int, ...]) -> dict[str, Any]:
    """Model FLOPs per trained token of one PPO step, and what the switches
    recompute (FLOP_FORMULA). The policy's tied embedding counts once:
    looking it up costs nothing, using it as the output layer is a matmul of
    2*vocab*hidden per token forward."""
    specs = manifest(shape)
    n_policy = sum(numel(size) for _, size in specs)
    n_critic = n_policy + shape.hidden + 1  # the value head
    n_layers = sum(numel(size) for name, size in specs if ".layers." in name)
    dense = 6 * (n_policy + n_critic - shape.vocab * shape.hidden)
    dense_value_head = 6 * (n_policy + shape.hidden + 1)
    # per layer and token, forward: q.k over seq/2 positions on average
    # (causal) and the weighted sum of v, 2*hidden*seq/2 FLOPs each; backward
    # twice that
    attention_forward = {length: 2 * shape.layers * shape.hidden * length for length in lengths}
    attention = {length: 3 * forward for length, forward in attention_forward.items()}
    checkpointing = {str(length): 2 * n_layers + attention_forward[length] for length in lengths}
    old_values = {
        "critic": {str(length): 2 * (n_critic - shape.vocab * shape.hidden) + forward
                   for length, forward in attention_forward.items()},
        "value_head": {str(length): 2 * (n_policy + shape.hidden + 1) + forward
                       for length, forward in attention_forward.items()}}
    return {"formula": FLOP_FORMULA, "n_policy": n_policy, "n_critic": n_critic,
            "n_layers": n_layers, "dense_per_token": dense,
            "attention_per_token_per_model": {str(k): v for k, v in attention.items()},
            "per_token": {str(k): dense + 2 * v for k, v in attention.items()},
            "per_token_value_head": {str(k): dense_value_head + v
                                     for k, v in attention.items()},
            "recomputed_per_token": {"checkpointing_per_body": checkpointing,
                                     "chunked_logprobs": 2 * shape.vocab * shape.hidden,
                                     "old_values_forward": old_values}}


def flops_per_token(flops: dict[str, Any], length: int,
                    switches: frozenset[str]) -> dict[str, int]:
    """A case's model FLOPs per trained token (MFU's numerator) and its
    hardware FLOPs (HFU's: with what its switches compute again)."""
    seq, value_head = str(length), "value_head" in switches
    model = flops["per_token_value_head" if value_head else "per_token"][seq]
    recomputed = flops["recomputed_per_token"]
    hardware = model
    if "checkpointing" in switches:  # one body with a value head, else two
        hardware += (1 if value_head else 2) * recomputed["checkpointing_per_body"][seq]
    if "chunked_logprobs" in switches:
        hardware += recomputed["chunked_logprobs"]
    # Both plans take two sequences a step: this switch makes two passes, and
    # the old values need a forward of their own before them.
    if "microbatches" in switches:
        hardware += recomputed["old_values_forward"][
            "value_head" if value_head else "critic"][seq]
    return {"model": model, "hardware": hardware}


def release(device: str) -> None:
    gc.collect()  # FSDP's hooks keep modules in reference cycles
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> dict[str, int | None]:
    if device != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def precision_and_export(name: str, shape: Qwen2Shape, device: str, plan: LearnerPlan,
                         out: Path) -> dict[str, Any]:
    """The policy's log-probabilities on random tokens with float32 parameters
    and compute, then the same module sharded with bf16 compute (the
    learner's); then every parameter gathered whole (``full_tensor``), cast
    to bf16 as the engines load it, and written with ``torch.save``. The
    errors are over tokens 1.. of each sequence: the learner's log-probability
    of token 0 is a 0 it sets, not one the model computes."""
    policy = build(Qwen2ForCausalLM, shape, device)
    ids = random_ids(shape, plan.precision_sequences, plan.lengths[0],
                     torch.Generator().manual_seed(SEED)).to(device)
    with torch.no_grad():
        reference = token_logprobs(policy, ids, 0)[:, 1:]
        shard(policy, bf16=True)
        bf16 = token_logprobs(policy, ids, 0)[:, 1:]
        chunked = token_logprobs(policy, ids, plan.chunk_tokens)[:, 1:]
        error = (bf16 - reference).abs()
        result: dict[str, Any] = {
            "logprob_error": {
                "sequences": plan.precision_sequences, "length": plan.lengths[0],
                "max_abs": error.max().item(), "mean_abs": error.mean().item(),
                "fp32_mean_logprob": reference.mean().item(),
                "chunked_vs_whole_bf16_max_abs": (chunked - bf16).abs().max().item()}}
        del reference, bf16, chunked, error
        # FSDP2 leaves the root's parameters whole after a forward without
        # backward; shard them again, so that every parameter is gathered
        policy.reshard()
        synchronize(device)
        start = time.perf_counter()
        full = {key: parameter.full_tensor().to(torch.bfloat16)
                for key, parameter in policy.named_parameters()}
        synchronize(device)
        gathered = time.perf_counter()
        path = out / f"export-{name}.pt"
        torch.save({key: tensor.cpu() for key, tensor in full.items()}, path)
        exported = time.perf_counter()
    result["export"] = {"tensors": len(full), "dtype": "bfloat16",
                        "gather_seconds": gathered - start,
                        "export_seconds": exported - gathered, "bytes": path.stat().st_size}
    path.unlink()  # gigabytes, and only its time and size are wanted
    return result


def run_case(shape: Qwen2Shape, length: int, switches: frozenset[str], plan: LearnerPlan,
             device: str) -> dict[str, Any]:
    """Fresh models and the learner's trainer with its optimizers (so that
    the peak is this case's alone), one warm-up step (it also allocates
    AdamW's state), then ``plan.steps``, each :meth:`PPOTrainer.step` whole:
    its passes in the learner's order, its advantages and its statistics."""
    config = learner_config(switches, plan.chunk_tokens, length)

    def sharded(model: nn.Module) -> nn.Module:
        return shard(model, bf16=True, activation_checkpointing=config.activation_checkpointing)

    value_head = config.critic == "value_head"
    policy = sharded(build(Qwen2ForCausalLM, shape, device, value_head=value_head))
    critic = None if value_head else sharded(build(critic_model, shape, device))
    trainer = PPOTrainer(policy, critic, config)
    batch = random_batch(shape, plan.sequences, length, SEED + length)
    times = []
    for _ in range(plan.steps + 1):
        synchronize(device)
        start = time.perf_counter()
        trainer.step(batch)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return {"outcome": "ok", "step_seconds": median(times[1:]), "warmup_seconds": times[0],
            "step_seconds_each": times[1:], **peak_memory(device)}


def learner_case(shape: Qwen2Shape, length: int, switches: frozenset[str], plan: LearnerPlan,
                 device: str, deadline: float) -> dict[str, Any]:
    """run_case, or why it has no figures: skipped, does not fit, failed."""
    if time.monotonic() > deadline:
        return {"outcome": "skipped", "error": "past --budget-s"}
    release(device)  # the previous case's models, and its peak
    try:
        return run_case(shape, length, switches, plan, device)
    except torch.cuda.OutOfMemoryError as error:
        return {"outcome": "does_not_fit", **peak_memory(device),
                "error": str(error).splitlines()[0]}
    except Exception as error:  # one lent run: keep what the other cases measure
        return {"outcome": "error", "error": f"{type(error).__name__}: {error}"}


def model_phase(name: str, shape: Qwen2Shape, device: str, plan: LearnerPlan, out: Path,
                deadline: float) -> dict[str, Any]:
    """precision_and_export, or why it has no figures."""
    if time.monotonic() > deadline:
        return {"logprob_error": None, "export": None, "error": "skipped: past --budget-s"}
    release(device)
    try:
        return {**precision_and_export(name, shape, device, plan, out), "error": None}
    except Exception as error:  # one lent run: keep what the cases measure
        return {"logprob_error": None, "export": None,
                "error": f"{type(error).__name__}: {error}"}


def utilization(flops: dict[str, Any], case: dict[str, Any], switches: frozenset[str],
                peak_flops: float | None) -> dict[str, Any]:
    """A measured case's tokens/s, FLOPs per token, MFU (model FLOPs) and
    HFU (hardware FLOPs) against ``peak_flops``; only a GPU's time against a
    GPU's peak means anything, so without a peak no utilization."""
    tokens_per_second = case["tokens_per_step"] / case["step_seconds"]
    per_token = flops_per_token(flops, case["length"], switches)
    return {"tokens_per_second": tokens_per_second, "flops_per_token": per_token,
            **{key: (per_token[kind] * tokens_per_second / peak_flops if peak_flops else None)
               for key, kind in (("mfu", "model"), ("hfu", "hardware"))}}


def fit(cases: list[dict[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    """Per switch set: the lengths that fit, those that did not, the first of those."""
    result = {}
    for set_name in SWITCH_SETS:
        mine = [c for c in cases if c["model"] == name and c["switches"] == set_name]
        unfit = [c["length"] for c in mine if c["outcome"] == "does_not_fit"]
        result[set_name] = {"fits": [c["length"] for c in mine if c["outcome"] == "ok"],
                            "does_not_fit": unfit, "first_unfit_length": min(unfit, default=None)}
    return result


def learner_part(names: list[str], device: str, plan: LearnerPlan, out: Path,
                 deadline: float, peak_flops: float) -> dict[str, Any]:
    """Per model its FLOP count, log-prob error and export; per switch set,
    model and length (in that order, the likeliest cut by --budget-s last)
    a case: step time, MFU, peak memory, or does not fit. Whatever starts
    after ``deadline`` (time.monotonic()) is skipped and says so."""
    shapes = {name: DRY_RUN_LEARNER_SHAPE if device == "cpu" else MODELS[name]
              for name in names}
    models = {name: {"model": name, "shape": asdict(shape),
                     "flops": flop_count(shape, plan.lengths)} for name, shape in shapes.items()}
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        if device == "cuda":
            torch.cuda.set_device(0)
        # FSDP2 needs a process group: here one of a single rank
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                                store=dist.FileStore(f"{folder}/store", 1))
        try:
            for name, shape in shapes.items():
                models[name].update(model_phase(name, shape, device, plan, out, deadline))
                print(f"learner {name}: bf16 log-prob error {models[name]['logprob_error']}, "
                      f"export {models[name]['export']}, error {models[name]['error']}",
                      flush=True)
            for set_name, switches in SWITCH_SETS.items():
                for name, shape in shapes.items():
                    for length in plan.lengths:
                        case = {"model": name, "switches": set_name, "on": sorted(switches),
                                "length": length, "sequences": plan.sequences,
                                "tokens_per_step": plan.sequences * length,
                                "passes": plan.sequences if "microbatches" in switches else 1,
                                **learner_case(shape, length, switches, plan, device,
                                               deadline)}
                        if case["outcome"] == "ok":
                            case.update(utilization(models[name]["flops"], case, switches,
                                                    peak_flops if device == "cuda" else None))
                        print(f"learner {name} {set_name} {length}: " + ", ".join(
                            f"{key} {case[key]}" for key in ("outcome", "step_seconds", "mfu",
                                                             "hfu", "peak_allocated_bytes",
                                                             "error")
                            if case.get(key) is not None), flush=True)
                        cases.append(case)
        finally:
            dist.destroy_process_group()
    for name, model in models.items():
        model["fit"] = fit(cases, name)
    failed = sum(model["error"] is not None and not model["error"].startswith("skipped")
                 for model in models.values()) + sum(c["outcome"] == "error" for c in cases)
    return {"plan": asdict(plan), "switch_sets": {k: sorted(v) for k, v in SWITCH_SETS.items()},
            "precision": "float32 parameters, bf16 compute (FSDP2 MixedPrecisionPolicy: "
                         "param bf16, reduce float32), AdamW",
            "peak_flops": peak_flops if device == "cuda" else None,
            "models": list(models.values()), "cases": cases, "errors": failed}

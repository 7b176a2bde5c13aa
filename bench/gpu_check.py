"""The GPU check: what a co-located weight push costs on one GPU, whether
NCCL accepts two ranks on the same GPU, and what the learner's PPO step costs
on one GPU. Standard library and torch only (the GPU machine it is written
for has torch with CUDA and none of this project's dependencies), so it
imports nothing of ours, not even transformers: the models are written here.

It measures, on GPU 0:

1. **A push by CUDA IPC** between two processes, as vLLM's ``ipc``
   weight-transfer engine does it: the sender holds the weights on the GPU
   and, per push, exports one IPC handle per tensor
   (``torch.multiprocessing.reductions.reduce_tensor``) and sends the
   handles over a local pipe; the receiver opens each handle
   (``rebuild_cuda_tensor``) and copies into its own pre-allocated tensor, a
   device-to-device copy with no host round trip, then acknowledges. A push
   is timed from the first export to the acknowledgement, for bf16 manifests
   shaped like Qwen2.5-0.5B, -1.5B and -7B (their real layer counts, sizes,
   heads and tied embeddings); median of ``--pushes`` after one warm-up. The
   baseline is the same copies inside the sender (``local_copy_seconds``).
   Every tensor is ``randn`` from a seed of its own. The receiver's tensors
   are zeroed before each push and, after the last, both sides compute a
   checksum: per tensor, the sum of its raw 16-bit words weighted by position
   ((index mod 65521) + 1), mod 2**64, over every element; per model, the
   SHA-256 of (name, shape, checksum) over the manifest.
2. **NCCL with two ranks on one GPU**: two processes on cuda:0 join one NCCL
   group through a ``FileStore`` and broadcast; whether it is refused, and the
   text (recent NCCL says "Duplicate GPU detected"). A rank that has not
   answered after ``--nccl-timeout`` seconds is killed and recorded as a hang.
3. **The learner part**: random Qwen2.5-0.5B- and -1.5B-shaped policies
   (tied) and critics (the body again, with a scalar head), written here in
   plain torch (RMSNorm, rotary embeddings, grouped-query attention by SDPA
   with its causal kernels, SwiGLU), float32 parameters with bf16 compute
   under FSDP2 on a process group of one rank, as the learner runs them. A
   PPO step on random token ids: clipped-ratio policy loss and value loss,
   backward, gradient clipping, AdamW. For 2k, 8k and 16k tokens per
   sequence (two sequences a step) and each set of the learner's memory
   switches (all on, each one off, none: per-layer activation checkpointing,
   chunked log-softmax recomputed in backward, one sequence per pass; and
   all on with the critic as a value head on the policy, no critic model): step
   time (median after a warm-up), tokens/s, MFU against the H200's dense
   bf16 peak with the FLOP count written out, the peak of allocated memory,
   and per switch set the first length that does not fit (CUDA out of
   memory). Per model: the bf16 log-probabilities' error against float32 on
   the same tokens, and the time to gather every parameter whole
   (``full_tensor``) and to write them (``torch.save``). ``--budget-s``
   skips what would start after that many seconds (it says so).
4. Versions of torch, CUDA and NCCL, the device and its memory.

On the GPU machine, one command (about six minutes on an H200 by estimate,
as it has never run on one; the default ``--budget-s`` of 420 keeps it under
eight; 7B's push peaks at about 32 GB)::

    python bench/gpu_check.py --json --out gpu_check

It prints one JSON object as its last line and writes it to
``gpu_check/gpu_check.json``. ``--parts`` runs some of the parts only.

``--dry-run`` runs the same code on CPU in seconds: manifests scaled down
(hidden, intermediate and vocabulary sizes divided by 32, about 1000x fewer
parameters), CPU tensors passed as shared memory by the same reductions,
gloo instead of NCCL (which on CPU is not refused: it says so), and for the
learner part a tiny model (hidden 64, 2 layers, vocabulary 512) at 64, 128
and 256 tokens, without MFU or memory figures. Its figures say nothing about
a GPU; no GPU figure is claimed anywhere unless this ran on one.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.reductions import reduce_tensor
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

try:
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )
except ImportError:  # torch before 2.6, which the GPU machine may have, names FSDP2 so
    from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

DTYPE = torch.bfloat16
DRY_RUN_DIVISOR = 32
WEIGHT_PERIOD = 65521  # checksum weights are (index mod this) + 1
CHUNK = WEIGHT_PERIOD * 1024  # elements per checksum step (bounds its memory)


@dataclass(frozen=True)
class Qwen2Shape:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    tied: bool


#: From each model's config.json on the Hugging Face hub.
MODELS = {
    "qwen2.5-0.5b": Qwen2Shape(24, 896, 4864, 151936, 14, 2, tied=True),
    "qwen2.5-1.5b": Qwen2Shape(28, 1536, 8960, 151936, 12, 2, tied=True),
    "qwen2.5-7b": Qwen2Shape(28, 3584, 18944, 152064, 28, 4, tied=False),
}

Manifest = list[tuple[str, tuple[int, ...]]]


def manifest(model: Qwen2Shape, divisor: int = 1) -> Manifest:
    """(name, shape) of every parameter, as ``named_parameters()`` lists them
    (a tied ``lm_head`` is not a parameter of its own)."""
    hidden, inter, vocab = (model.hidden // divisor, model.intermediate // divisor,
                            model.vocab // divisor)
    head_dim = hidden // model.heads
    q, kv = model.heads * head_dim, model.kv_heads * head_dim
    specs: Manifest = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(model.layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "self_attn.q_proj.weight", (q, hidden)), (p + "self_attn.q_proj.bias", (q,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, q)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    specs.append(("model.norm.weight", (hidden,)))
    if not model.tied:
        specs.append(("lm_head.weight", (vocab, hidden)))
    return specs


def numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def digest(specs: Manifest, tensors: list[torch.Tensor]) -> str:
    """SHA-256 over (name, shape, position-weighted word sum mod 2**64)."""
    device = tensors[0].device
    longest = min(CHUNK, max(t.numel() for t in tensors))
    weights = torch.arange(longest, dtype=torch.int64, device=device) % WEIGHT_PERIOD + 1
    sha = hashlib.sha256()
    for (name, shape), tensor in zip(specs, tensors, strict=True):
        words = tensor.reshape(-1).view(torch.int16)
        total = 0
        for start in range(0, words.numel(), CHUNK):
            part = words[start:start + CHUNK].to(torch.int64)
            total += int((part * weights[:part.numel()]).sum().item())  # wraps mod 2**64
        sha.update(f"{name}:{shape}:{total % 2**64}\n".encode())
    return sha.hexdigest()


# -- the receiver (its own process) ----------------------------------------------------

def receiver(conn: Connection, device: str) -> None:
    """Serve commands from the sender until ``stop``."""
    if device == "cuda":
        torch.cuda.set_device(0)
    specs: Manifest = []
    buffers: list[torch.Tensor] = []
    while True:
        command, payload = conn.recv()
        if command == "alloc":
            specs = payload
            buffers = [torch.empty(shape, dtype=DTYPE, device=device) for _, shape in specs]
        elif command == "clear":
            for buffer in buffers:
                buffer.zero_()
            synchronize(device)
        elif command == "push":  # [(rebuild function, its arguments)] in manifest order
            for buffer, (rebuild, args) in zip(buffers, payload, strict=True):
                source = rebuild(*args)  # opens the IPC handle (CPU: maps shared memory)
                buffer.copy_(source)
                del source
            synchronize(device)
            del payload
        elif command == "checksum":
            conn.send(digest(specs, buffers))
            continue
        elif command == "free":
            specs, buffers = [], []
            if device == "cuda":
                torch.cuda.empty_cache()
        elif command == "stop":
            conn.send("ok")
            return
        conn.send("ok")


def request(conn: Connection, command: str, payload: Any = None) -> Any:
    conn.send((command, payload))
    return conn.recv()


# -- the sender (this process) ---------------------------------------------------------

def deterministic(index: int, shape: tuple[int, ...], device: str) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(1000 + index)
    return torch.randn(shape, generator=generator, dtype=DTYPE, device=device)


def local_copy_seconds(tensors: list[torch.Tensor], device: str, repeats: int) -> float:
    """Median time of the same copies within one process (the baseline)."""
    scratch = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        for target, source in zip(scratch, tensors, strict=True):
            target.copy_(source)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return median(times[1:])


def push_model(conn: Connection, name: str, specs: Manifest, device: str,
               pushes: int) -> dict[str, Any]:
    tensors = [deterministic(i, shape, device) for i, (_, shape) in enumerate(specs)]
    synchronize(device)
    sent = digest(specs, tensors)
    request(conn, "alloc", specs)
    times = []
    for _ in range(pushes + 1):  # the first is the warm-up
        request(conn, "clear")
        start = time.perf_counter()
        request(conn, "push", [reduce_tensor(t) for t in tensors])
        times.append(time.perf_counter() - start)
        if device == "cuda":
            torch.cuda.ipc_collect()  # release what the receiver has let go of
    received = request(conn, "checksum")
    request(conn, "free")
    local = local_copy_seconds(tensors, device, pushes)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    params = sum(t.numel() for t in tensors)
    del tensors
    if device == "cuda":
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    seconds = median(times[1:])
    return {"model": name, "tensors": len(specs), "params": params, "bytes": nbytes,
            "seconds": seconds, "gbps": nbytes / seconds / 1e9,
            "warmup_seconds": times[0], "local_copy_seconds": local,
            "vs_local_copy": seconds / local, "checksum_equal": sent == received,
            "checksum": sent}


def ipc_pushes(models: list[str], device: str, divisor: int,
               pushes: int) -> list[dict[str, Any]]:
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    process = context.Process(target=receiver, args=(child, device), daemon=True)
    process.start()
    child.close()
    try:
        results = []
        for name in models:
            result = push_model(conn, name, manifest(MODELS[name], divisor), device, pushes)
            print(f"ipc push {name}: {result['params']:,} params, {result['bytes']:,} bytes, "
                  f"{result['seconds'] * 1e3:.2f} ms ({result['gbps']:.1f} GB/s; local copy "
                  f"{result['local_copy_seconds'] * 1e3:.2f} ms), checksum "
                  f"{'equal' if result['checksum_equal'] else 'DIFFERS'}", flush=True)
            results.append(result)
        request(conn, "stop")
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
    return results


# -- two ranks on one device -----------------------------------------------------------

def shared_device_rank(rank: int, folder: str, backend: str, device: str,
                       conn: Connection) -> None:
    """One rank: join a 2-rank group on ``device`` 0 and broadcast from rank 0."""
    os.dup2(os.open(f"{folder}/rank{rank}.log", os.O_WRONLY | os.O_CREAT), 2)
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    report: dict[str, Any] = {"rank": rank, "outcome": "ok", "error": None}
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.FileStore(f"{folder}/store", 2), rank=rank,
                                world_size=2, timeout=timedelta(seconds=30))
        tensor = torch.full((1024,), float(rank + 1), device=device)
        dist.broadcast(tensor, src=0)
        synchronize(device)
        if not bool((tensor == 1).all()):
            report.update(outcome="error", error="the broadcast delivered wrong values")
    except Exception as error:  # the refusal is what this records
        report.update(outcome="error", error=f"{type(error).__name__}: {error}")
    conn.send(report)
    conn.close()
    os._exit(0)  # no teardown: it can hang after a failed collective


def shared_device_check(device: str, timeout: float) -> dict[str, Any]:
    backend = "nccl" if device == "cuda" else "gloo"
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        pipes, processes = [], []
        for rank in (0, 1):
            conn, child = context.Pipe(duplex=False)
            process = context.Process(target=shared_device_rank, daemon=True,
                                      args=(rank, folder, backend, device, child))
            process.start()
            child.close()
            pipes.append(conn)
            processes.append(process)
        reports: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(reports) < 2 and time.monotonic() < deadline:
            for rank, conn in enumerate(pipes):
                if rank not in reports and conn.poll(0.05):
                    try:
                        reports[rank] = conn.recv()
                    except EOFError:
                        reports[rank] = {"rank": rank, "outcome": "error", "error":
                                         f"exited with code {processes[rank].exitcode} "
                                         "before reporting"}
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        ranks = []
        for rank in (0, 1):
            report = reports.get(rank, {"rank": rank, "outcome": "hang", "error": "hang"})
            with open(f"{folder}/rank{rank}.log", errors="replace") as log:
                report["stderr_tail"] = log.read()[-2000:]
            ranks.append(report)
    errors = [r["error"] for r in ranks if r["outcome"] == "error"]
    hung = any(r["outcome"] == "hang" for r in ranks)
    return {"backend": backend, "refused": bool(errors),
            "outcome": "refused" if errors else "hang" if hung else "ran",
            "error": errors[0] if errors else "hang" if hung else None, "ranks": ranks}


# -- the learner part: Qwen2-shaped policy and critic, a PPO step under FSDP2 ----------

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
CLIP = 0.2  # learner.clip_low and clip_high's default
POLICY_LR, CRITIC_LR = 1e-6, 5e-6  # deploy/configs/gpu-*.toml
MAX_GRAD_NORM = 1.0  # learner.max_grad_norm's default
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
FLOP_FORMULA = ("per token: 6*(N_policy + N_critic - vocab*hidden) + 2*12*layers*hidden*seq "
                "(forward and backward of both models; the critic's embedding is a lookup, "
                "not a matmul; the attention term counts the whole seq x seq score matrix, as "
                "PaLM's MFU does, though causal kernels compute about half of it; "
                "recomputation by the switches is not counted); with a value head, "
                "6*(N_policy + hidden + 1) + 12*layers*hidden*seq (one body)")


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


class Body(nn.Module):
    """Qwen2's transformer body: embeddings, decoder layers, final norm."""

    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.head_dim = shape.hidden // shape.heads
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        cos, sin = rotary(ids.shape[1], self.head_dim, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Policy(nn.Module):
    """A tied Qwen2 causal LM, its parameters under transformers' names (so
    ``manifest`` lists them): the output layer is the embedding. With
    ``value_head``, a scalar head on its body as well (the learner's
    ``critic = "value_head"``)."""

    def __init__(self, shape: Qwen2Shape, value_head: bool = False) -> None:
        super().__init__()
        self.model = Body(shape)
        if value_head:
            self.value_head = nn.Linear(shape.hidden, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.model(ids), self.model.embed_tokens.weight)

    def chunked_token_logprobs(self, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        """[B, L - 1] log-probability of tokens 1.. of ``ids``, the output layer
        applied ``chunk`` positions at a time (as the learner's)."""
        return self._logprobs(self.model(ids), ids, chunk)

    def logprobs_and_values(self, ids: torch.Tensor, chunk: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L - 1] log-probabilities (in chunks, or all logits at once with
        ``chunk`` 0) and [B, L] values, from one pass through the body."""
        hidden = self.model(ids)
        return self._logprobs(hidden, ids, chunk), self.value_head(hidden)[..., 0].clone()

    def _logprobs(self, hidden: torch.Tensor, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        hidden, weight = hidden[:, :-1], self.model.embed_tokens.weight
        if not chunk:
            logits = F.linear(hidden, weight).float()
            return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        return ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, ids[:, 1:],
                                     chunk)


class Critic(nn.Module):
    """The policy's body (its own copy) with a scalar head, as the learner's."""

    def __init__(self, shape: Qwen2Shape) -> None:
        super().__init__()
        self.body = Body(shape)
        self.head = nn.Linear(shape.hidden, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # a fresh tensor, not a view: FSDP2 hooks the module's output for backward
        return self.head(self.body(ids)).squeeze(-1).clone()


class ChunkedLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[target] per row of ``hidden`` [N, H],
    ``chunk`` rows at a time, in the shape of ``targets``: the learner's
    ``_ChunkedLogprobs`` (learner/models.py), copied because this script
    imports nothing of the project. Forward keeps nothing of a chunk but its
    results; backward computes the chunk's logits again."""

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
            # d log_softmax(x)_t / dx = onehot(t) - softmax(x)
            grad_logits = torch.log_softmax(F.linear(hidden[rows], weight).float(), dim=-1)
            grad_logits.exp_().mul_(-grad[rows, None])
            grad_logits.scatter_add_(1, targets[rows, None], grad[rows, None])
            grad_logits = grad_logits.to(weight.dtype)
            grad_hidden[rows] = grad_logits @ weight
            grad_weight.addmm_(grad_logits.t(), hidden[rows])
        return grad_hidden, grad_weight, None, None


def build(kind: type[Policy] | type[Critic], shape: Qwen2Shape, device: str,
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


def shard(model: nn.Module, checkpointing: bool) -> nn.Module:
    """As learner.models.shard: checkpoint each layer's forward (wrapped in
    place, before sharding), then FSDP2 with each layer a unit of its own and
    bf16 compute over float32 parameters, gradients reduced in float32."""
    body = model.model if isinstance(model, Policy) else model.body
    if checkpointing:
        for layer in body.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in body.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if isinstance(model, Policy):  # FSDP2 gathers the tied output layer for them too
        for method in ("chunked_token_logprobs", "logprobs_and_values"):
            register_fsdp_forward_method(model, method)
    return model


def token_logprobs(policy: nn.Module, ids: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """[B, L - 1] log-probability of tokens 1.. of ``ids``; with ``chunk_tokens``,
    float32 logits exist for that many positions at a time."""
    if chunk_tokens:
        return policy.chunked_token_logprobs(ids, chunk_tokens)
    logits = policy(ids)[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def random_batch(shape: Qwen2Shape, sequences: int, length: int, device: str,
                 seed: int) -> dict[str, torch.Tensor]:
    """Token ids drawn at random, old log-probabilities near the uniform
    distribution's (ratios near 1, some clipped), random advantages and returns."""
    generator = torch.Generator().manual_seed(seed)
    per_token = (sequences, length - 1)
    batch = {
        "ids": torch.randint(shape.vocab, (sequences, length), generator=generator),
        "old_logprobs": -math.log(shape.vocab) + 0.1 * torch.randn(per_token,
                                                                   generator=generator),
        "advantages": torch.randn(per_token, generator=generator),
        "returns": torch.randn(per_token, generator=generator),
    }
    return {key: value.to(device) for key, value in batch.items()}


def ppo_step(policy: nn.Module, critic: nn.Module | None,
             optimizers: list[torch.optim.Optimizer], batch: dict[str, torch.Tensor],
             switches: frozenset[str], chunk_tokens: int) -> None:
    """One optimizer step of both models (or of the policy and its value
    head, ``critic`` None) over the batch: clipped-ratio policy loss and
    value loss, each divided by the step's token count (as the learner
    divides by |M|, so passes add up to the whole batch's gradient)."""
    ids = batch["ids"]
    per_pass = 1 if "microbatches" in switches else len(ids)
    chunk = chunk_tokens if "chunked_logprobs" in switches else 0
    count = batch["advantages"].numel()
    for start in range(0, len(ids), per_pass):
        rows = slice(start, start + per_pass)
        if critic is None:
            logp, values = policy.logprobs_and_values(ids[rows], chunk)
        else:
            logp, values = token_logprobs(policy, ids[rows], chunk), critic(ids[rows])
        ratio = torch.exp(logp - batch["old_logprobs"][rows])
        advantages = batch["advantages"][rows]
        policy_loss = -torch.minimum(ratio * advantages,
                                     ratio.clamp(1 - CLIP, 1 + CLIP) * advantages).sum()
        values = values[:, :-1].float()  # V of the state before each token
        value_loss = 0.5 * (values - batch["returns"][rows]).square().sum()
        ((policy_loss + value_loss) / count).backward()
    for model in (policy, critic):
        if model is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def flop_count(shape: Qwen2Shape, lengths: tuple[int, ...]) -> dict[str, Any]:
    """Model FLOPs per trained token of one PPO step (FLOP_FORMULA). The
    policy's tied embedding counts once: looking it up costs nothing, using it
    as the output layer is a matmul of 2*vocab*hidden per token forward."""
    n_policy = sum(numel(size) for _, size in manifest(shape))
    n_critic = n_policy + shape.hidden + 1  # the value head
    dense = 6 * (n_policy + n_critic - shape.vocab * shape.hidden)
    dense_value_head = 6 * (n_policy + shape.hidden + 1)
    # per layer and token, forward: q.k over seq positions and the weighted
    # sum of v, 2*seq*hidden FLOPs each; backward twice that
    attention = {length: 12 * shape.layers * shape.hidden * length for length in lengths}
    return {"formula": FLOP_FORMULA, "n_policy": n_policy, "n_critic": n_critic,
            "dense_per_token": dense,
            "attention_per_token_per_model": {str(k): v for k, v in attention.items()},
            "per_token": {str(k): dense + 2 * v for k, v in attention.items()},
            "per_token_value_head": {str(k): dense_value_head + v
                                     for k, v in attention.items()}}


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
    to bf16 as the engines load it, and written with ``torch.save``."""
    policy = build(Policy, shape, device)
    ids = random_batch(shape, plan.precision_sequences, plan.lengths[0], device, SEED)["ids"]
    with torch.no_grad():
        reference = token_logprobs(policy, ids, 0)
        shard(policy, checkpointing=False)
        bf16 = token_logprobs(policy, ids, 0)
        chunked = token_logprobs(policy, ids, plan.chunk_tokens)
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
    """Fresh models and optimizers (so that the peak is this case's alone),
    one warm-up step (it also allocates AdamW's state), then ``plan.steps``."""
    checkpointing = "checkpointing" in switches
    if "value_head" in switches:  # one model, the head at the critic's rate
        policy = shard(build(Policy, shape, device, value_head=True), checkpointing)
        critic = None
        named = list(policy.named_parameters())
        optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW([
            {"params": [p for n, p in named if not n.startswith("value_head.")]},
            {"params": [p for n, p in named if n.startswith("value_head.")], "lr": CRITIC_LR},
        ], lr=POLICY_LR)]
    else:
        policy = shard(build(Policy, shape, device), checkpointing)
        critic = shard(build(Critic, shape, device), checkpointing)
        optimizers = [torch.optim.AdamW(policy.parameters(), lr=POLICY_LR),
                      torch.optim.AdamW(critic.parameters(), lr=CRITIC_LR)]
    batch = random_batch(shape, plan.sequences, length, device, SEED + length)
    times = []
    for _ in range(plan.steps + 1):
        synchronize(device)
        start = time.perf_counter()
        ppo_step(policy, critic, optimizers, batch, switches, plan.chunk_tokens)
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
                            flops = models[name]["flops"]["per_token_value_head" if "value_head"
                                                          in switches else "per_token"]
                            per_token = flops[str(length)]
                            case["tokens_per_second"] = (case["tokens_per_step"]
                                                         / case["step_seconds"])
                            # only a GPU's time against a GPU's peak means anything
                            case["mfu"] = (per_token * case["tokens_per_second"] / peak_flops
                                           if device == "cuda" else None)
                        print(f"learner {name} {set_name} {length}: " + ", ".join(
                            f"{key} {case[key]}" for key in ("outcome", "step_seconds", "mfu",
                                                             "peak_allocated_bytes", "error")
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


# -- the whole check -------------------------------------------------------------------

def environment(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "nccl": None, "device": "cpu", "device_memory_bytes": None}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        facts.update(device=properties.name, device_memory_bytes=properties.total_memory,
                     nccl=".".join(map(str, torch.cuda.nccl.version())))
    return facts


PARTS = ("ipc", "nccl", "learner")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, scaled-down manifests and models, gloo: the same code in "
                             "seconds")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--out", type=Path,
                        help="folder for gpu_check.json (the report) and the learner part's "
                             "export, which is deleted once timed (default: a temporary one)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="pushed by CUDA IPC")
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes after a warm-up")
    parser.add_argument("--nccl-timeout", type=float, default=60.0,
                        help="seconds before the shared-device ranks count as hung")
    parser.add_argument("--learner-models", nargs="+", choices=LEARNER_MODELS,
                        default=list(LEARNER_MODELS))
    parser.add_argument("--lengths", nargs="+", type=int,
                        help="tokens per sequence of the learner part "
                             f"(default {GPU_PLAN.lengths}; dry run {DRY_RUN_PLAN.lengths})")
    parser.add_argument("--learner-steps", type=int,
                        help="timed PPO steps after a warm-up "
                             f"(default {GPU_PLAN.steps}; dry run {DRY_RUN_PLAN.steps})")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="learner work that would start after this many seconds from "
                             "the start is skipped (recorded as skipped)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_PEAK_FLOPS / 1e12,
                        help="the device's dense bf16 peak, for MFU (default: an H200's)")
    args = parser.parse_args(argv)
    if args.pushes < 1 or (args.learner_steps is not None and args.learner_steps < 1):
        parser.error("--pushes and --learner-steps must be at least 1")
    if args.lengths and min(args.lengths) < 2:
        parser.error("--lengths must be at least 2 tokens")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a "
              "GPU machine, or pass --dry-run for the CPU version", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:  # tiny shapes gain nothing from threads; on busy cores, OpenMP's
        torch.set_num_threads(1)  # waiting threads made the dry run several times slower
    facts = environment(device)
    print(f"{'DRY RUN (CPU, gloo, scaled-down manifests and models): ' if args.dry_run else ''}"
          f"torch {facts['torch']}, CUDA {facts['cuda']}, NCCL {facts['nccl']}, "
          f"device {facts['device']} ({facts['device_memory_bytes']} bytes)", flush=True)
    report: dict[str, Any] = {"dry_run": args.dry_run, **facts, "ipc_push": None,
                              "nccl_shared_gpu": None, "learner": None}
    if "ipc" in args.parts:
        report["ipc_push"] = ipc_pushes(args.models, device,
                                        DRY_RUN_DIVISOR if args.dry_run else 1, args.pushes)
    if "nccl" in args.parts:
        shared = report["nccl_shared_gpu"] = shared_device_check(device, args.nccl_timeout)
        print(f"two ranks of one {shared['backend']} group on one {device} device: "
              f"{shared['outcome']}{': ' + shared['error'] if shared['error'] else ''}")
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        if "learner" in args.parts:
            plan = DRY_RUN_PLAN if args.dry_run else GPU_PLAN
            plan = LearnerPlan(**{**asdict(plan), "steps": args.learner_steps or plan.steps,
                                  "lengths": tuple(sorted(args.lengths or plan.lengths))})
            try:
                report["learner"] = learner_part(args.learner_models, device, plan, out,
                                                 started + args.budget_s,
                                                 args.peak_tflops * 1e12)
            except Exception as error:  # one lent run: keep the other parts' figures
                report["learner"] = {"errors": 1, "error": f"{type(error).__name__}: {error}"}
            report["learner"]["budget_s"] = args.budget_s
        report["seconds"] = time.monotonic() - started
        if args.out:
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
    intact = all(push["checksum_equal"] for push in report["ipc_push"] or [])
    return 0 if intact and not (report["learner"] or {}).get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check: whether the project's own weight transfer holds on a GPU
(what a GPU run puts at risk), what a co-located weight push costs on one
GPU, whether NCCL accepts two ranks on the same GPU, and what the learner's
PPO step costs on one GPU.

The GPU machine it is written for has torch with CUDA and none of this
project's dependencies. Parts 4 to 7 are standard library and torch only:
their models are written here, not imported from transformers, and the
learner part imports the learner's own torch-only modules from this
checkout (its chunked log-softmax and its PPO losses). Parts 1 to 3
run the project's ``protocol`` package from the checkout (``PYTHONPATH``
names the checkout's root where the project is not installed), which needs
pyzmq and msgspec: they are carried to the machine as wheels (docs/deploy.md,
"The GPU check"); without them those parts report ``skipped: pyzmq/msgspec
not installed`` and the rest runs.

It measures, on GPU 0, the project's transfer first:

1. **The project's ipc channel** (``project_ipc``): protocol/weights_ipc.py
   between this process (rank 0, as learner rank 0) and an engine's process,
   joined through the project's rendezvous store: a bf16 Qwen2.5-0.5B-shaped
   manifest in 64 MiB buckets, one warm-up and ``--pushes`` publications,
   each of tensors of its own (seeded per publication and tensor); the
   receiver loads every tensor into zeroed parameters of its own. Per
   publication, every tensor's checksum on both sides (below), compared one
   by one; the median push (``send`` to the last acknowledgement) and GB/s.
2. **The receive-ahead loader under separate streams**
   (``receive_ahead_streams``): the same channel, 21 publications of a
   quarter-sized manifest in 4 MiB buckets, received as
   actors/weight_transfer.py receives them under vLLM: a thread draws
   ``RECEIVE_AHEAD`` tensors ahead (``protocol.weights.received_ahead``, its
   ``hand_over`` to the consumer's stream), and the loader copies each into
   its parameter on a CUDA stream of its own, spending ~50 us on that stream
   before each copy (``torch.cuda._sleep``) as vLLM's repacking does, so that
   a receive buffer released too early would be reused under a pending copy.
   Every publication's checksums compared.
3. **A receiver SIGKILLed in the middle of an NCCL broadcast**
   (``nccl_receiver_killed``): a weight group (protocol/weights_collective.py)
   of a sender and two receivers, each a process of its own, loading as in
   2. The first publication forms the group; in the second, one receiver
   kills itself after its first tensor. The sender (as learner/publisher.py)
   abandons a generation that failed and publishes again to the survivor
   alone in a new one. Reported: whether the sender survived, the time from
   the death to its failure against the deadline (10 s here), the failure's
   text, and whether the publication before the death and the one after it
   reached the receivers intact. NCCL refuses two ranks of one communicator
   on one GPU ("Duplicate GPU detected", part 5), so each member gets a host
   id of its own (``NCCL_HOSTID``) and the bytes go through NCCL's socket
   transport over loopback, as between hosts. Then again as the group was
   built before issue 38's fix (``before_fix``): with
   ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` as torchrun sets it (a failed
   collective tears the process down) and NCCL's own timeout equal to the
   deadline, instead of 2 (``CleanUpOnly``, scoped to building that group)
   and ten times the deadline; the fix's other half, deadlines counted from
   enqueue, is no setting and stays. Expected: the sender dies there
   (``sender_exitcode``); on an H200 over the socket transport it did not,
   within the check's window (docs/weights.md, "Run on an H200"). On gloo
   (the dry run) the variable is NCCL's, so ``before_fix`` is skipped.
4. **A push by CUDA IPC** (``ipc_push``) between two processes, as vLLM's
   ``ipc`` weight-transfer engine does it: the sender holds the weights on
   the GPU and, per push, exports one IPC handle per tensor
   (``torch.multiprocessing.reductions.reduce_tensor``) and sends the
   handles over a local pipe; the receiver opens each handle
   (``rebuild_cuda_tensor``) and copies into its own pre-allocated tensor, a
   device-to-device copy with no host round trip, then acknowledges. A push
   is timed from the first export to the acknowledgement, for bf16 manifests
   shaped like Qwen2.5-0.5B, -1.5B and -7B (their real layer counts, sizes,
   heads and tied embeddings); median of ``--pushes`` after one warm-up. The
   baseline is the same copies inside the sender (``local_copy_seconds``).
   The receiver's tensors are zeroed before each push and, after the last,
   both sides compute a digest: the SHA-256 of (name, shape, checksum) over
   the manifest. A tensor's checksum (all parts) is the sum of its raw 16-bit
   words weighted by position ((index mod 65521) + 1), mod 2**64.
5. **NCCL with two ranks on one GPU** (``nccl_shared_gpu``): two processes on
   cuda:0 join one NCCL group through a ``FileStore`` and broadcast; whether
   it is refused, and the text (recent NCCL says "Duplicate GPU detected"). A
   rank that has not answered after ``--nccl-timeout`` seconds is killed and
   recorded as a hang.
6. **The learner part** (``learner``): random Qwen2.5-0.5B- and
   -1.5B-shaped policies (tied) and critics (the body again, with a scalar
   head), written here in plain torch (RMSNorm, rotary embeddings,
   grouped-query attention by SDPA with its causal kernels, SwiGLU), float32
   parameters with bf16 compute under FSDP2 on a process group of one rank,
   as the learner runs them. A PPO step on random token ids: clipped-ratio
   policy loss and value loss, backward, gradient clipping, AdamW. For 2k, 8k
   and 16k tokens per sequence (two sequences a step) and each set of the
   learner's memory switches (all on, each one off, none: per-layer
   activation checkpointing, chunked log-softmax recomputed in backward, one
   sequence per pass; and all on with the critic as a value head on the
   policy, no critic model): step time (median after a warm-up), tokens/s,
   the peak of allocated memory, per switch set the first length that does
   not fit (CUDA out of memory), and two utilizations against the H200's
   dense bf16 peak, with the FLOP count written out (``FLOP_FORMULA``):

   - MFU, model FLOPs per token: 6*(N_policy + N_critic - vocab*hidden) for
     forward and backward of both models (the critic's embedding is a
     lookup, not a matmul) plus 2*6*layers*hidden*seq for causal attention
     (a token attends to seq/2 positions on average: q.k and the weighted sum
     of v are 2*2*hidden*seq/2 per layer forward, three times that with
     backward); with a value head, one body: 6*(N_policy + hidden + 1) +
     6*layers*hidden*seq.
   - HFU, hardware FLOPs per token: the model FLOPs plus what the switches
     compute again in backward: with per-layer checkpointing, every layer's
     forward once more, 2*N_layers + 2*layers*hidden*seq per body (N_layers:
     the decoder layers' parameters); with the chunked log-softmax, the
     output layer's logits once more, 2*vocab*hidden.

   Per model: the bf16 log-probabilities' error against float32 on the same
   tokens, and the time to gather every parameter whole (``full_tensor``)
   and to write them (``torch.save``). ``--budget-s`` skips what would start
   after that many seconds (it says so).
7. Versions of torch, CUDA and NCCL, the device and its memory.

Every process a part starts is killed with its process group when the part
ends, and every wait is bounded. The member processes of parts 1 to 3 are
forked from a fork server that imported torch and the project's protocol
once (and never touches CUDA).

On the GPU machine, after installing the carried wheels (docs/deploy.md), one
command (273 s of its own on an H200 with the default ``--budget-s`` of 270,
measured on 2026-12-04, docs/weights.md "Run on an H200"; 7B's push peaks at
about 32 GB)::

    python bench/gpu_check.py --json --out gpu_check

It prints one JSON object as its last line and writes it to
``gpu_check/gpu_check.json``; it exits 1 if a checksum differs, the sender
did not survive the receiver's death with the fix, or the learner part
failed. ``--parts`` runs some of the parts only.

``--dry-run`` runs the same code on CPU in seconds: manifests scaled down
(hidden, intermediate and vocabulary sizes divided by 32, about 1000x fewer
parameters; the project's buckets 64 KiB, 6 receive-ahead publications),
CPU tensors passed as shared memory by the same reductions, the project's
ipc channel on its CPU twin (staging files under /dev/shm), gloo instead of
NCCL (which on CPU is not refused: it says so), no streams, and for the
learner part a tiny model (hidden 64, 2 layers, vocabulary 512) at 64, 128
and 256 tokens, without MFU or memory figures. Its figures say nothing about
a GPU; no GPU figure is claimed anywhere unless this ran on one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import json
import math
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from multiprocessing.process import BaseProcess
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

# The learner's own kernel and losses, torch only (learner/chunked_logprobs.py,
# learner/losses.py), from the checkout (installed, or PYTHONPATH=.): what the
# learner part times is what the learner runs, not a copy that can drift.
try:
    from learner.chunked_logprobs import ChunkedLogprobs
    from learner.losses import policy_loss, value_loss
except ModuleNotFoundError as missing:
    LEARNER_UNAVAILABLE: str | None = (
        f"skipped: the project's learner package is not importable ({missing}); run from the "
        "checkout's root with PYTHONPATH=.")
else:
    LEARNER_UNAVAILABLE = None

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


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    """Per tensor of 16-bit elements: the sum of its raw words weighted by
    position ((index mod 65521) + 1), mod 2**64."""
    device = tensors[0].device
    longest = min(CHUNK, max(t.numel() for t in tensors))
    weights = torch.arange(longest, dtype=torch.int64, device=device) % WEIGHT_PERIOD + 1
    sums = []
    for tensor in tensors:
        words = tensor.reshape(-1).view(torch.int16)
        total = 0
        for start in range(0, words.numel(), CHUNK):
            part = words[start:start + CHUNK].to(torch.int64)
            total += int((part * weights[:part.numel()]).sum().item())  # wraps mod 2**64
        sums.append(total % 2**64)
    return sums


def digest(specs: Manifest, tensors: list[torch.Tensor]) -> str:
    """SHA-256 over (name, shape, checksum) of every tensor."""
    sha = hashlib.sha256()
    for (name, shape), total in zip(specs, checksums(tensors), strict=True):
        sha.update(f"{name}:{shape}:{total}\n".encode())
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

def deterministic(index: int, shape: tuple[int, ...], device: str,
                  seed: int = 1000) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed + index)
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


# -- the project's weight transfer (protocol/weights*.py) ------------------------------

@dataclass(frozen=True)
class TransferPlan:
    divisor: int  # the 0.5B manifest's hidden, intermediate and vocabulary sizes divided by this
    bucket_bytes: int  # learner.weight_bucket_bytes
    pushes: int  # publications after a first (a warm-up, checked as well); the killed
    # receiver's scenario counts its own (publish_through_a_death)
    deadline_s: float  # learner.weight_timeout_s


TRANSFER_MODEL = "qwen2.5-0.5b"
#: Per part: the ipc channel on the whole 0.5B manifest in 64 MiB buckets (16
#: of them, so that both staging buffers alternate); the receive-ahead loader
#: and the killed receiver on a quarter of its sizes (62 MB) in 4 MiB buckets,
#: enough buckets for a death in the middle and few bytes for many pushes.
#: The dry run: the sizes divided by 32, 64 KiB buckets (about as many),
#: fewer receive-ahead pushes (a busy CPU's seconds in the test suite).
GPU_TRANSFER = {"project_ipc": TransferPlan(1, 64 << 20, 5, 30.0),
                "receive_ahead_streams": TransferPlan(4, 4 << 20, 20, 30.0),
                "nccl_receiver_killed": TransferPlan(4, 4 << 20, 0, 10.0)}
DRY_RUN_TRANSFER = {"project_ipc": TransferPlan(DRY_RUN_DIVISOR, 64 << 10, 5, 30.0),
                    "receive_ahead_streams": TransferPlan(DRY_RUN_DIVISOR, 64 << 10, 5, 30.0),
                    "nccl_receiver_killed": TransferPlan(DRY_RUN_DIVISOR, 64 << 10, 0, 5.0)}
#: actors/weight_transfer.py's RECEIVE_AHEAD: tensors drawn ahead of vLLM's loader.
RECEIVE_AHEAD = 4
#: GPU cycles (about 50 us on an H200) the emulated loader spends on its own
#: stream before each copy, as vLLM's repacking does: its copies lag behind
#: the receiving thread, so that a receive buffer released too early would be
#: reused under them.
LOADER_LAG_CYCLES = 100_000
#: Seconds a member process may take to start (a fork, a CUDA context).
STARTUP_S = 60.0
#: The killed-receiver scenario: the doomed member dies after its first tensor
#: of the second publication (the first forms the group, NCCL's communicator
#: included, so that the death is not mistaken for a slow start).
KILLED_IN_PUBLICATION = 2
MAX_PUBLICATIONS = 4
#: What torchrun sets for every rank: a failed collective ends the process.
TORCHRUN_ERROR_HANDLING = "3"


def protocol_unavailable() -> str | None:
    """Why the project's weight transfer cannot run here, or None. The GPU
    machine has torch but none of the project's dependencies: pyzmq and
    msgspec come as wheels (docs/deploy.md, "The GPU check")."""
    try:
        import protocol.weights_collective  # noqa: F401
        import protocol.weights_ipc  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name == "protocol":
            return ("skipped: the project's protocol package is not importable (run from the "
                    "checkout's root with PYTHONPATH=.)")
        missing = "pyzmq/msgspec" if error.name in ("zmq", "msgspec") else error.name
        return f"skipped: {missing} not installed ({error})"
    return None


def kill_tree(process: BaseProcess, grace_s: float = 2.0) -> None:
    """End ``process`` and whatever it started, after at most ``grace_s`` for
    it to exit by itself: a member leads a process group of its own
    (``os.setpgrp`` first thing), so the group is killed, then the process."""
    if process.pid is None:
        return
    process.join(grace_s)
    for kill in (lambda: os.killpg(process.pid, signal.SIGKILL), process.kill):
        try:
            kill()
        except ProcessLookupError:  # gone, or not yet a group leader
            pass
    process.join(10)


def weight_manifest(specs: Manifest, bucket_bytes: int) -> Any:
    """The project's manifest of ``specs``, every tensor bf16 on the wire."""
    from protocol.messages import TensorSpec, WeightManifest

    return WeightManifest(tensors=[TensorSpec(name, "bfloat16", shape) for name, shape in specs],
                          bucket_bytes=bucket_bytes)


def publication(specs: Manifest, number: int, device: str) -> list[torch.Tensor]:
    """Publication ``number``'s tensors: seeds of its own, so that a stale
    copy of an earlier one never passes for it."""
    return [deterministic(i, shape, device, seed=1000 + 100_000 * number)
            for i, (_, shape) in enumerate(specs)]


def mismatched(specs: Manifest, sent: list[int], received: list[int]) -> list[str]:
    """Names of the tensors whose checksums differ (the first five)."""
    return [name for (name, _), a, b in zip(specs, sent, received, strict=True) if a != b][:5]


def load(received: Iterator[tuple[str, torch.Tensor]], destinations: list[torch.Tensor],
         stream: torch.cuda.Stream | None) -> None:
    """As vLLM's loader: copy each received tensor into its parameter, on
    ``stream`` (None: the current one), lagging by ``LOADER_LAG_CYCLES`` on a
    GPU. The receive-ahead iterator hands each tensor over to the stream
    current where it is drawn (``protocol.weights.hand_over``): inside."""
    if stream is None:
        for destination, (_, tensor) in zip(destinations, received, strict=True):
            destination.copy_(tensor)
        return
    stream.wait_stream(torch.cuda.current_stream())  # the destinations' zeroing
    with torch.cuda.stream(stream):
        for destination, (_, tensor) in zip(destinations, received, strict=True):
            torch.cuda._sleep(LOADER_LAG_CYCLES)
            destination.copy_(tensor)


def dying_after(received: Iterator[tuple[str, torch.Tensor]], count: int,
                conn: Connection) -> Iterator[tuple[str, torch.Tensor]]:
    """``received``, until ``count`` tensors have been taken: then this
    process tells when and SIGKILLs itself, in the middle of a publication."""
    for index, item in enumerate(received):
        if index == count:
            conn.send({"dying_at": time.monotonic()})
            os.kill(os.getpid(), signal.SIGKILL)
        yield item


def receive_and_load(channel: Any, order: dict[str, Any], device: str,
                     conn: Connection) -> dict[str, Any]:
    """Members: receive the publication ``order`` describes into fresh zeroed
    parameters, through the receive-ahead thread if ``order["ahead"]``, with
    the loader on a stream of its own if ``order["side_stream"]`` (on a
    GPU); its checksums, or the failure (the channel is aborted then)."""
    specs = order["specs"]
    destinations = [torch.zeros(shape, dtype=DTYPE, device=device) for _, shape in specs]
    stream = torch.cuda.Stream() if order["side_stream"] and device == "cuda" else None
    received = channel.receive(weight_manifest(specs, order["bucket_bytes"]), order["ahead"])
    if order.get("die_after") is not None:
        received = dying_after(received, order["die_after"], conn)
    started = time.perf_counter()
    try:
        load(received, destinations, stream)
        synchronize(device)
    except RuntimeError as error:  # TransferFailed, or a generation that did not form
        return {"error": f"{type(error).__name__}: {error}", "failed_at": time.monotonic()}
    return {"error": None, "load_s": time.perf_counter() - started,
            "checksums": checksums(destinations)}


#: What member processes need, imported once by the fork server that starts them.
MEMBER_MODULES = ["torch", "torch.distributed", "torch.distributed.fsdp",
                  "torch.utils.checkpoint", "protocol.weights", "protocol.weights_ipc",
                  "protocol.weights_collective"]


@contextlib.contextmanager
def member_context() -> Iterator[Any]:
    """Where member processes start: a fork server that has imported torch
    and the project's protocol once, so that each member starts in a
    fraction of a second instead of the seconds torch's import takes (a
    dry run starts four on a CPU that may be busy). It never touches CUDA,
    so its forks can. Stopped on leaving."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(MEMBER_MODULES)
    try:
        yield context
    finally:
        # private, and the only way to end the server before this process
        # ends: it closes the server's pipe, and the server exits on reading EOF
        forkserver._forkserver._stop()


def run_member(log: str, target: Callable[..., None], conn: Connection, *args: Any) -> None:
    """A member process: ``target(conn, *args)`` in a process group of its
    own (``kill_tree`` ends it whole), with no core file if it is torn down,
    and its stderr (torch's and NCCL's messages) in ``log``, whose tail goes
    into the report."""
    os.setpgrp()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 2)
    target(conn, *args)


def member_process(context: Any, log: Path, target: Callable[..., None],
                   *args: Any) -> tuple[BaseProcess, Connection]:
    """``target`` started in a member process, and this end of its pipe."""
    conn, child = context.Pipe()
    process = context.Process(target=run_member, args=(str(log), target, child, *args),
                              daemon=True)
    process.start()
    child.close()
    return process, conn


def tail(log: Path, chars: int = 1500) -> str:
    """The end of a member's stderr."""
    return log.read_text(errors="replace")[-chars:] if log.is_file() else ""


def answer(conn: Connection, process: BaseProcess, within_s: float) -> dict[str, Any]:
    """The member's next report, waiting at most ``within_s``."""
    if not conn.poll(within_s):
        return {"error": f"no report within {within_s:g} s"}
    try:
        return conn.recv()
    except EOFError:
        process.join(5)
        return {"error": f"exited with code {process.exitcode}", "exitcode": process.exitcode,
                "exited_at": time.monotonic()}


# -- the project's ipc channel, and its receive-ahead loader, between two processes ----

def ipc_member(conn: Connection, port: int, device: str, timeout_s: float) -> None:
    """Rank 1 of an ipc generation in a process of its own (an engine on the
    learner's GPU): for each order from the pipe, receive and load that
    publication and report its checksums; None ends it."""
    if device == "cuda":
        torch.cuda.set_device(0)
    from protocol.weights import connect_store
    from protocol.weights_backends import join_channel

    conn.send({"error": None})  # started: from here on the channel's deadline holds
    channel = join_channel(connect_store("127.0.0.1", port, timeout_s), 1, 2, 1, "ipc",
                           timeout_s)
    while (order := conn.recv()) is not None:
        conn.send(receive_and_load(channel, order, device, conn))
    channel.abort()
    os._exit(0)  # no teardown of mappings and sockets: nothing is left to say


def ipc_publications(channel: Any, member: tuple[BaseProcess, Connection], plan: TransferPlan,
                     device: str, loader: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: ``plan.pushes`` + 1 publications through ``channel``, each
    loaded by the member as ``loader`` says (ahead, side_stream); per
    publication, every tensor's checksum on both sides."""
    specs = manifest(MODELS[TRANSFER_MODEL], plan.divisor)
    project_manifest = weight_manifest(specs, plan.bucket_bytes)
    process, conn = member
    push_s, load_s, wrong = [], [], {}
    for number in range(plan.pushes + 1):  # the first is a warm-up
        tensors = publication(specs, number, device)
        synchronize(device)
        sent = checksums(tensors)
        conn.send({"specs": specs, "bucket_bytes": plan.bucket_bytes, **loader})
        started = time.perf_counter()
        channel.send(project_manifest, tensors)  # returns once the member acknowledged all
        push_s.append(time.perf_counter() - started)
        report = answer(conn, process, plan.deadline_s)
        if report["error"]:
            raise RuntimeError(f"publication {number}: {report['error']}")
        load_s.append(report["load_s"])
        if names := mismatched(specs, sent, report["checksums"]):
            wrong[number] = names
        del tensors
    nbytes = 2 * sum(numel(shape) for _, shape in specs)
    seconds = median(push_s[1:])
    return {"error": None, "model": TRANSFER_MODEL, "divisor": plan.divisor,
            "tensors": len(specs), "bytes": nbytes, "bucket_bytes": plan.bucket_bytes,
            "pushes": plan.pushes + 1, "push_s": seconds, "gbps": nbytes / seconds / 1e9,
            "warmup_push_s": push_s[0], "load_s": median(load_s[1:]),
            "checksums_match": not wrong, "mismatched": wrong, **loader}


def project_ipc_parts(context: Any, device: str, plans: dict[str, TransferPlan],
                      parts: list[str]) -> dict[str, dict[str, Any]]:
    """The project's ipc channel (protocol/weights_ipc.py) from this process,
    rank 0 as learner rank 0 is, to an engine's process on the same device:
    ``project_ipc`` loads on the current stream as the publications come;
    ``receive_ahead_streams`` draws ``RECEIVE_AHEAD`` tensors ahead in a
    thread and loads on a stream of its own, as actors/weight_transfer.py
    does under vLLM. A part that fails says why, with the member's stderr."""
    from protocol.weights import host_store
    from protocol.weights_backends import join_channel

    timeout_s = plans["project_ipc"].deadline_s
    loaders = {"project_ipc": {"ahead": 0, "side_stream": False},
               "receive_ahead_streams": {"ahead": RECEIVE_AHEAD, "side_stream": True}}
    results: dict[str, dict[str, Any]] = {}
    store = host_store(0, timeout_s=timeout_s)
    member: tuple[BaseProcess, Connection] | None = None
    channel = None
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "member.log"
        try:
            member = member_process(context, log, ipc_member, store.port, device, timeout_s)
            started = answer(member[1], member[0], STARTUP_S)
            if started["error"]:
                raise RuntimeError(f"the member did not start: {started['error']}")
            channel = join_channel(store, 1, 2, 0, "ipc", timeout_s)
            for part in (part for part in loaders if part in parts):
                try:
                    results[part] = ipc_publications(channel, member, plans[part], device,
                                                     loaders[part])
                except Exception as error:  # one lent run: keep the other part's figures
                    results[part] = {"error": f"{type(error).__name__}: {error}"}
        except Exception as error:  # idem: the channel never formed
            results = {part: {"error": f"{type(error).__name__}: {error}"} for part in parts}
        finally:
            if channel is not None:
                channel.abort()
            if member is not None:
                with contextlib.suppress(OSError):  # a member that died closed its end
                    member[1].send(None)
                kill_tree(member[0])
            store.close()
        for result in results.values():
            if result["error"]:
                result["member_stderr_tail"] = tail(log)
    return results


# -- a weight group with a receiver SIGKILLed in the middle of a broadcast -------------

def build_groups_as_before_the_fix() -> None:
    """In this process, make protocol/weights_collective.py build its NCCL
    group as it did before issue 38's fix: with the error handling torchrun
    sets (3: a failed collective tears the process down) and NCCL's own
    timeout equal to the project's deadline. The fix's other half, deadlines
    counted from enqueue, stays: it is not a setting."""
    from protocol import weights_collective

    weights_collective.nccl_error_handling = functools.partial(
        weights_collective.nccl_error_handling, TORCHRUN_ERROR_HANDLING)
    weights_collective.nccl_watchdog_timeout_s = lambda deadline_s: deadline_s


def send_publication(channel: Any, order: dict[str, Any], device: str) -> dict[str, Any]:
    """Rank 0: publication ``order["number"]``; its checksums, and when it
    failed if it did (the channel is aborted then)."""
    specs = order["specs"]
    tensors = publication(specs, order["number"], device)
    synchronize(device)
    sent = checksums(tensors)
    started = time.monotonic()
    try:
        channel.send(weight_manifest(specs, order["bucket_bytes"]), tensors)
    except RuntimeError as error:  # TransferFailed
        return {"error": f"{type(error).__name__}: {error}", "failed_at": time.monotonic(),
                "checksums": sent}
    return {"error": None, "push_s": time.monotonic() - started, "checksums": sent}


def group_member(conn: Connection, role: str, port: int, backend: str, device: str,
                 deadline_s: float, before_fix: bool) -> None:
    """One member of a weight group (protocol/weights_collective.py) in a
    process of its own. ``sender`` is rank 0: it publishes what each order
    says and abandons a generation that failed, as learner/publisher.py does;
    the others receive and load as actors/weight_transfer.py does (tensors
    drawn ahead, the loader on a stream of its own), and an order with
    ``die_after`` kills this process in the middle. None ends it."""
    if backend == "nccl":
        # NCCL refuses two ranks of one communicator on one GPU ("Duplicate
        # GPU detected", the nccl_shared_gpu part). A host id of its own makes
        # each process a host to NCCL: the bytes go through its socket
        # transport over loopback, as they go between the learner's host and
        # an actor's.
        os.environ.update(NCCL_HOSTID=f"gpu-check-{role}", NCCL_SOCKET_IFNAME="lo",
                          NCCL_IB_DISABLE="1")
        os.environ.setdefault("NCCL_DEBUG", "WARN")  # its reasons, in the stderr tails
        torch.cuda.set_device(0)
    if before_fix:
        build_groups_as_before_the_fix()
    from protocol.weights import abandon_generation, connect_store
    from protocol.weights_backends import join_channel

    store = connect_store("127.0.0.1", port, deadline_s)
    conn.send({"error": None})
    channel = None
    while (order := conn.recv()) is not None:
        try:
            if channel is None or channel.generation != order["generation"]:
                channel = None  # leave the previous generation first
                channel = join_channel(store, order["generation"], order["world_size"],
                                       order["rank"], backend, deadline_s)
            report = (send_publication(channel, order, device) if role == "sender"
                      else receive_and_load(channel, order, device, conn))
        except RuntimeError as error:  # a generation that did not form
            report = {"error": f"{type(error).__name__}: {error}", "failed_at": time.monotonic()}
        if report["error"] and role == "sender":
            abandon_generation(store, order["generation"])
        conn.send(report)
    os._exit(0)  # no teardown: it can hang on a group whose peer died


def collect(members: dict[str, tuple[BaseProcess, Connection]], roles: list[str],
            within_s: float) -> dict[str, dict[str, Any]]:
    """The next report of each of ``roles``, waiting at most ``within_s`` in
    all; one that exits first is reported with its exit code."""
    deadline = time.monotonic() + within_s
    waiting = {members[role][1]: role for role in roles}
    reports: dict[str, dict[str, Any]] = {}
    while waiting and (left := deadline - time.monotonic()) > 0:
        for conn in wait_for(list(waiting), timeout=left):
            role = waiting.pop(conn)
            reports[role] = answer(conn, members[role][0], 0)
    for role in waiting.values():
        reports[role] = {"error": f"no report within {within_s:g} s"}
    return reports


def publish_through_a_death(members: dict[str, tuple[BaseProcess, Connection]],
                            plan: TransferPlan) -> list[dict[str, Any]]:
    """Publications until the sender has published again after a failure,
    to the survivor alone in a new generation, or is gone: the doomed member
    dies in publication ``KILLED_IN_PUBLICATION``. Each publication: its
    number, generation, size and every member's report."""
    specs = manifest(MODELS[TRANSFER_MODEL], plan.divisor)
    ranks = {"sender": 0, "survivor": 1, "doomed": 2}
    alive, generation, history = set(ranks), 1, []
    for number in range(1, MAX_PUBLICATIONS + 1):
        roles = [role for role in ranks if role in alive]
        for role in roles:
            doomed = role == "doomed" and number == KILLED_IN_PUBLICATION
            # a member torn down since its last report: collect reports its exit
            with contextlib.suppress(OSError):
                members[role][1].send({
                    "number": number, "generation": generation, "world_size": len(ranks),
                    "rank": ranks[role], "specs": specs, "bucket_bytes": plan.bucket_bytes,
                    "ahead": RECEIVE_AHEAD, "side_stream": True,
                    "die_after": 1 if doomed else None})
        # a join and a broadcast each fail within the deadline
        reports = collect(members, roles, 2 * plan.deadline_s + 10)
        history.append({"number": number, "generation": generation,
                        "world_size": len(ranks), "reports": reports})
        alive -= {role for role, report in reports.items()
                  if "dying_at" in report or "exitcode" in report}
        sender_failed = reports["sender"]["error"] is not None
        if "sender" not in alive or generation > 1 and not sender_failed:
            break  # the sender is gone, or it reached the survivor again
        if sender_failed:
            if number < KILLED_IN_PUBLICATION:
                break  # it failed before any death: the report says so
            generation += 1  # as the learner forms the next one without the dead member
            ranks = {"sender": 0, "survivor": 1}
    return history


def killed_receiver_summary(history: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``publish_through_a_death`` saw: whether the sender survived, how
    long after the death it failed, whether the publication before the death
    and the one after reached their receivers intact."""
    by_role = {role: [(h["number"], h["reports"][role]) for h in history
                      if role in h["reports"]] for role in ("sender", "survivor", "doomed")}
    died_at = next((r["dying_at"] for _, r in by_role["doomed"] if "dying_at" in r), None)
    failure = next(((n, r) for n, r in by_role["sender"] if r["error"]), None)
    ended_at = failure and (failure[1].get("failed_at") or failure[1].get("exited_at"))
    first, last = history[0]["reports"], history[-1]
    republished = last["generation"] > 1 and last["reports"]["sender"]["error"] is None
    intact = [first[role].get("checksums") == first["sender"].get("checksums")
              for role in ("survivor", "doomed")]
    return {
        "sender_survived": all("exitcode" not in r for _, r in by_role["sender"]),
        "sender_exitcode": next((r["exitcode"] for _, r in by_role["sender"]
                                 if "exitcode" in r), None),
        "receiver_died": died_at is not None, "killed_in_publication": KILLED_IN_PUBLICATION,
        "failed_in_publication": failure and failure[0],
        "failure": failure and failure[1]["error"],
        "failed_within_s": ended_at - died_at if ended_at and died_at else None,
        "survivor_failure": next((r["error"] for _, r in by_role["survivor"] if r["error"]),
                                 None),
        "first_publication_checksums_match": first["sender"]["error"] is None and all(intact),
        "republished": republished,
        "republish_generation": last["generation"] if republished else None,
        "republish_checksums_match": republished and last["reports"].get(
            "survivor", {}).get("checksums") == last["reports"]["sender"]["checksums"],
        "publications": [{"number": h["number"], "generation": h["generation"],
                          "world_size": h["world_size"],
                          **{role: "died" if "dying_at" in r else r["error"] or "ok"
                             for role, r in h["reports"].items()}} for h in history]}


def receiver_killed(context: Any, backend: str, device: str, plan: TransferPlan,
                    before_fix: bool) -> dict[str, Any]:
    """One weight group of a sender and two receivers, each a process of its
    own, the rendezvous store in this one; a receiver SIGKILLs itself in the
    middle of a publication (``publish_through_a_death``). With each
    member's stderr tail: the reason NCCL or torch gave, if any."""
    from protocol.weights import host_store
    from protocol.weights_collective import nccl_watchdog_timeout_s

    store = host_store(0, timeout_s=plan.deadline_s)
    members: dict[str, tuple[BaseProcess, Connection]] = {}
    with tempfile.TemporaryDirectory() as folder:
        logs = {role: Path(folder) / f"{role}.log" for role in ("sender", "survivor", "doomed")}
        try:
            for role, log in logs.items():
                members[role] = member_process(context, log, group_member, role, store.port,
                                               backend, device, plan.deadline_s,
                                               before_fix and role == "sender")
            started = collect(members, list(members), STARTUP_S)
            if failed := {role: r["error"] for role, r in started.items() if r["error"]}:
                summary: dict[str, Any] = {"error": f"members did not start: {failed}"}
            else:
                summary = {"error": None, **killed_receiver_summary(
                    publish_through_a_death(members, plan))}
        finally:
            for _, conn in members.values():
                with contextlib.suppress(OSError):  # a member that died closed its end
                    conn.send(None)
            for process, _ in members.values():
                kill_tree(process)
            store.close()
        tails = {role: tail(log) for role, log in logs.items()}
    watchdog_s = plan.deadline_s if before_fix else nccl_watchdog_timeout_s(plan.deadline_s)
    return {**summary, "backend": backend, "deadline_s": plan.deadline_s,
            "watchdog_timeout_s": watchdog_s if backend == "nccl" else None,
            "stderr_tails": tails}


def nccl_receiver_killed(context: Any, device: str, plan: TransferPlan) -> dict[str, Any]:
    """The killed receiver with the weight group as the project builds it
    and, on NCCL, as it was built before the fix (``before_fix``)."""
    backend = "nccl" if device == "cuda" else "gloo"

    def variant(before_fix: bool) -> dict[str, Any]:
        try:
            return receiver_killed(context, backend, device, plan, before_fix)
        except Exception as error:  # one lent run: keep the other variant's figures
            return {"error": f"{type(error).__name__}: {error}"}

    result = variant(before_fix=False)
    result["before_fix"] = (variant(before_fix=True) if backend == "nccl" else
                            {"skipped": "gloo: the NCCL error handling the fix scopes is not "
                                        "involved"})
    return result


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
FLOP_FORMULA = (
    "model FLOPs (MFU) per trained token: 6*(N_policy + N_critic - vocab*hidden) "
    "+ 2*6*layers*hidden*seq (forward and backward of both models; the critic's embedding "
    "is a lookup, not a matmul; attention causal: a token's q.k and weighted sum of v span "
    "seq/2 positions on average, 2*2*hidden*seq/2 per layer forward, three times that with "
    "backward); with a value head, one body: 6*(N_policy + hidden + 1) + 6*layers*hidden*seq. "
    "Hardware FLOPs (HFU): the model FLOPs plus what the switches compute again in backward: "
    "with checkpointing, every layer's forward once more, 2*N_layers + 2*layers*hidden*seq per "
    "body (N_layers: the decoder layers' parameters); with chunked_logprobs, the output "
    "layer's logits once more, 2*vocab*hidden")


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
    distribution's (ratios near 1, some clipped), random advantages, returns
    and old values."""
    generator = torch.Generator().manual_seed(seed)
    per_token = (sequences, length - 1)
    batch = {
        "ids": torch.randint(shape.vocab, (sequences, length), generator=generator),
        "old_logprobs": -math.log(shape.vocab) + 0.1 * torch.randn(per_token,
                                                                   generator=generator),
        "advantages": torch.randn(per_token, generator=generator),
        "returns": torch.randn(per_token, generator=generator),
        "old_values": torch.randn(per_token, generator=generator),
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
    weights = torch.full_like(batch["advantages"], 1.0 / batch["advantages"].numel())
    for start in range(0, len(ids), per_pass):
        rows = slice(start, start + per_pass)
        if critic is None:
            logp, values = policy.logprobs_and_values(ids[rows], chunk)
        else:
            logp, values = token_logprobs(policy, ids[rows], chunk), critic(ids[rows])
        values = values[:, :-1].float()  # V of the state before each token
        old = batch["old_logprobs"][rows]  # pi_prox and mu alike: importance weights of 1
        p_loss, _ = policy_loss(logp, old, old, batch["advantages"][rows], weights[rows])
        v_loss, _ = value_loss(values, batch["old_values"][rows], batch["returns"][rows],
                               weights[rows])
        (p_loss + v_loss).backward()
    for model in (policy, critic):
        if model is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


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
    attention = {length: 6 * shape.layers * shape.hidden * length for length in lengths}
    checkpointing = {str(length): 2 * n_layers + 2 * shape.layers * shape.hidden * length
                     for length in lengths}
    return {"formula": FLOP_FORMULA, "n_policy": n_policy, "n_critic": n_critic,
            "n_layers": n_layers, "dense_per_token": dense,
            "attention_per_token_per_model": {str(k): v for k, v in attention.items()},
            "per_token": {str(k): dense + 2 * v for k, v in attention.items()},
            "per_token_value_head": {str(k): dense_value_head + v
                                     for k, v in attention.items()},
            "recomputed_per_token": {"checkpointing_per_body": checkpointing,
                                     "chunked_logprobs": 2 * shape.vocab * shape.hidden}}


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


# -- the whole check -------------------------------------------------------------------

def environment(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "nccl": None, "device": "cpu", "device_memory_bytes": None}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        facts.update(device=properties.name, device_memory_bytes=properties.total_memory,
                     nccl=".".join(map(str, torch.cuda.nccl.version())))
    return facts


#: The project's weight transfer first: it is what a GPU run puts at risk.
TRANSFER_PARTS = ("project_ipc", "receive_ahead_streams", "nccl_receiver_killed")
PARTS = (*TRANSFER_PARTS, "ipc", "nccl", "learner")


def transfer_parts(device: str, parts: list[str],
                   plans: dict[str, TransferPlan]) -> dict[str, dict[str, Any] | None]:
    """Each transfer part's report (None: not asked for), or why it has none."""
    reports: dict[str, dict[str, Any] | None] = dict.fromkeys(TRANSFER_PARTS)
    wanted = [part for part in TRANSFER_PARTS if part in parts]
    if not wanted:
        return reports
    if why := protocol_unavailable():
        return {**reports, **{part: {"error": why} for part in wanted}}
    on_ipc = [part for part in wanted if part != "nccl_receiver_killed"]
    with member_context() as context:
        if on_ipc:
            try:
                reports.update(project_ipc_parts(context, device, plans, on_ipc))
            except Exception as error:  # one lent run: keep the other parts' figures
                reports.update({part: {"error": f"{type(error).__name__}: {error}"}
                                for part in on_ipc})
        if "nccl_receiver_killed" in wanted:
            reports["nccl_receiver_killed"] = nccl_receiver_killed(
                context, device, plans["nccl_receiver_killed"])
    for part in wanted:
        print(f"{part}: " + json.dumps(reports[part])[:1000], flush=True)
    return reports


def transfers_intact(reports: dict[str, dict[str, Any] | None]) -> bool:
    """Whether every transfer part that ran delivered every checksum intact
    and, with the project's fix, the sender survived the receiver's death and
    reached the survivor again (before the fix, its death is what is shown)."""
    ran = {part: report for part, report in reports.items()
           if report is not None and not str(report.get("error")).startswith("skipped")}
    if any(report.get("error") for report in ran.values()):
        return False
    killed = ran.pop("nccl_receiver_killed", None)
    if killed and not (killed["sender_survived"] and killed["republish_checksums_match"]
                       and killed["first_publication_checksums_match"]):
        return False
    return all(report["checksums_match"] for report in ran.values())


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
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
    parser.add_argument("--pushes", type=int, default=5,
                        help="timed pushes after a warm-up (ipc and project_ipc)")
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
    parser.add_argument("--budget-s", type=float, default=270.0,
                        help="learner work that would start after this many seconds from "
                             "the start is skipped (recorded as skipped)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_PEAK_FLOPS / 1e12,
                        help="the device's dense bf16 peak, for MFU (default: an H200's)")
    args = parser.parse_args(argv)
    if args.pushes < 1 or (args.learner_steps is not None and args.learner_steps < 1):
        parser.error("--pushes and --learner-steps must be at least 1")
    if args.lengths and min(args.lengths) < 2:
        parser.error("--lengths must be at least 2 tokens")
    return args


def learner_report(args: argparse.Namespace, device: str, out: Path,
                   started: float) -> dict[str, Any]:
    if LEARNER_UNAVAILABLE:
        return {"errors": 0, "skipped": LEARNER_UNAVAILABLE, "budget_s": args.budget_s}
    plan = DRY_RUN_PLAN if args.dry_run else GPU_PLAN
    plan = LearnerPlan(**{**asdict(plan), "steps": args.learner_steps or plan.steps,
                          "lengths": tuple(sorted(args.lengths or plan.lengths))})
    try:
        report = learner_part(args.learner_models, device, plan, out, started + args.budget_s,
                              args.peak_tflops * 1e12)
    except Exception as error:  # one lent run: keep the other parts' figures
        report = {"errors": 1, "error": f"{type(error).__name__}: {error}"}
    report["budget_s"] = args.budget_s
    return report


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_arguments(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a "
              "GPU machine, or pass --dry-run for the CPU version", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:  # tiny shapes gain nothing from threads; on busy cores, OpenMP's
        torch.set_num_threads(1)  # waiting threads made the dry run several times slower
    else:  # the ipc channel stages on the current device
        torch.cuda.set_device(0)
    facts = environment(device)
    print(f"{'DRY RUN (CPU, gloo, scaled-down manifests and models): ' if args.dry_run else ''}"
          f"torch {facts['torch']}, CUDA {facts['cuda']}, NCCL {facts['nccl']}, "
          f"device {facts['device']} ({facts['device_memory_bytes']} bytes)", flush=True)
    plans = DRY_RUN_TRANSFER if args.dry_run else GPU_TRANSFER
    plans = {**plans, "project_ipc": replace(plans["project_ipc"], pushes=args.pushes)}
    report: dict[str, Any] = {"dry_run": args.dry_run, **facts,
                              **transfer_parts(device, args.parts, plans), "ipc_push": None,
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
            report["learner"] = learner_report(args, device, out, started)
        report["seconds"] = time.monotonic() - started
        if args.out:
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
    intact = all(push["checksum_equal"] for push in report["ipc_push"] or [])
    intact = intact and transfers_intact({part: report[part] for part in TRANSFER_PARTS})
    return 0 if intact and not (report["learner"] or {}).get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())

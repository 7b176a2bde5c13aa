"""The GPU check: what a co-located weight push costs on one GPU, and whether
NCCL accepts two ranks on the same GPU. Standard library and torch only (the
GPU machine it is written for has torch with CUDA and none of this project's
dependencies), so it imports nothing of ours.

It measures, between two processes on GPU 0:

1. **A push by CUDA IPC**, as vLLM's ``ipc`` weight-transfer engine does it:
   the sender holds the weights on the GPU and, per push, exports one IPC
   handle per tensor (``torch.multiprocessing.reductions.reduce_tensor``) and
   sends the handles over a local pipe; the receiver opens each handle
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
3. Versions of torch, CUDA and NCCL, the device and its memory.

On the GPU machine, one command (about a minute; 7B peaks at about 32 GB)::

    python bench/gpu_check.py --json > gpu_check.json

``--dry-run`` runs the same code on CPU in seconds: manifests scaled down
(hidden, intermediate and vocabulary sizes divided by 32, about 1000x fewer
parameters), CPU tensors passed as shared memory by the same reductions, and
gloo instead of NCCL (which on CPU is not refused: it says so). Its figures
say nothing about a GPU; no GPU figure is claimed anywhere unless this ran on
one. With ``--json`` the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

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


# -- the whole check -------------------------------------------------------------------

def environment(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "nccl": None, "device": "cpu", "device_memory_bytes": None}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        facts.update(device=properties.name, device_memory_bytes=properties.total_memory,
                     nccl=".".join(map(str, torch.cuda.nccl.version())))
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, scaled-down manifests, gloo: the same code in seconds")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes after a warm-up")
    parser.add_argument("--nccl-timeout", type=float, default=60.0,
                        help="seconds before the shared-device ranks count as hung")
    args = parser.parse_args(argv)
    if args.pushes < 1:
        parser.error("--pushes must be at least 1")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); run it on a "
              "GPU machine, or pass --dry-run for the CPU version", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    started = time.monotonic()
    facts = environment(device)
    print(f"{'DRY RUN (CPU, gloo, scaled-down manifests): ' if args.dry_run else ''}"
          f"torch {facts['torch']}, CUDA {facts['cuda']}, NCCL {facts['nccl']}, "
          f"device {facts['device']} ({facts['device_memory_bytes']} bytes)", flush=True)
    pushes = ipc_pushes(args.models, device, DRY_RUN_DIVISOR if args.dry_run else 1,
                        args.pushes)
    shared = shared_device_check(device, args.nccl_timeout)
    print(f"two ranks of one {shared['backend']} group on one {device} device: "
          f"{shared['outcome']}{': ' + shared['error'] if shared['error'] else ''}")
    report = {"dry_run": args.dry_run, **facts, "ipc_push": pushes, "nccl_shared_gpu": shared,
              "seconds": time.monotonic() - started}
    if args.json:
        print(json.dumps(report))
    return 0 if all(p["checksum_equal"] for p in pushes) else 1


if __name__ == "__main__":
    sys.exit(main())

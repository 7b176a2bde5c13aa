"""Parts 4 and 5 of the GPU check: a push by CUDA IPC between two processes
as vLLM's ``ipc`` engine does it, against the same copies in one process;
and whether NCCL accepts two ranks on one GPU."""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

from gpu_parts.common import (
    DTYPE,
    MODELS,
    Manifest,
    deterministic,
    digest,
    manifest,
    synchronize,
)

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

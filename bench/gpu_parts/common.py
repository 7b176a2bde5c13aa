"""What the GPU check's parts share: the manifests of Qwen2.5-shaped
models, the checksum both sides of a transfer compute, the tensors a
publication carries, the receivers' loading, and the member processes of
parts 1 to 3 (forked from a server that imported torch and the project's
protocol once)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

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


def deterministic(index: int, shape: tuple[int, ...], device: str,
                  seed: int = 1000) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed + index)
    return torch.randn(shape, generator=generator, dtype=DTYPE, device=device)


# -- the project's weight transfer (protocol/weights*.py) ------------------------------

@dataclass(frozen=True)
class TransferPlan:
    divisor: int  # the 0.5B manifest's hidden, intermediate and vocabulary sizes divided by this
    bucket_bytes: int  # learner.weight_bucket_bytes
    pushes: int  # publications after a first (a warm-up, checked as well)
    deadline_s: float  # learner.weight_timeout_s


TRANSFER_MODEL = "qwen2.5-0.5b"
#: Per part: the ipc channel on the whole 0.5B manifest in 64 MiB buckets (16
#: of them, so that both staging buffers alternate); the receive-ahead loader
#: on a quarter of its sizes (62 MB) in 4 MiB buckets, few bytes for many
#: pushes. The dry run: the sizes divided by 32, 64 KiB buckets (about as
#: many), fewer receive-ahead pushes (a busy CPU's seconds in the test suite).
GPU_TRANSFER = {"project_ipc": TransferPlan(1, 64 << 20, 5, 30.0),
                "receive_ahead_streams": TransferPlan(4, 4 << 20, 20, 30.0)}
DRY_RUN_TRANSFER = {"project_ipc": TransferPlan(DRY_RUN_DIVISOR, 64 << 10, 5, 30.0),
                    "receive_ahead_streams": TransferPlan(DRY_RUN_DIVISOR, 64 << 10, 5, 30.0)}
#: actors/weight_transfer.py's RECEIVE_AHEAD: tensors drawn ahead of vLLM's loader.
RECEIVE_AHEAD = 4
#: GPU cycles (about 50 us on an H200) the emulated loader spends on its own
#: stream before each copy, as vLLM's repacking does: its copies lag behind
#: the receiving thread, so that a receive buffer released too early would be
#: reused under them.
LOADER_LAG_CYCLES = 100_000
#: Seconds a member process may take to start (a fork, a CUDA context).
STARTUP_S = 60.0


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

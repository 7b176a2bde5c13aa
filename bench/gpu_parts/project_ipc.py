"""Parts 1 and 2 of the GPU check: the project's ipc channel
(protocol/weights_ipc.py) between this process, as learner rank 0, and an
engine's process, and its receive-ahead loader under separate streams."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from statistics import median
from typing import Any

import torch

from gpu_parts.common import (
    MODELS,
    RECEIVE_AHEAD,
    STARTUP_S,
    TRANSFER_MODEL,
    TransferPlan,
    answer,
    checksums,
    kill_tree,
    manifest,
    member_process,
    mismatched,
    numel,
    publication,
    receive_and_load,
    synchronize,
    tail,
    weight_manifest,
)

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

"""A plain weight receiver: an actor of the learner's control socket that
joins each announced group generation and receives every publication, on
the transport announced, through the project's own transfer code (``protocol.weights``), without a
vLLM engine. With ``--die-in`` it SIGKILLs itself after the first bucket of
that version: a receiver dying in the middle of a bucketed broadcast; with
``--die-after-join``, once it has joined its first group generation, before
its first broadcast; with ``--stall-join``, it waits ``STALL_S``
(heartbeating on, as an actor whose engine is stuck does) before it joins
its first group generation: a member that holds its lane's join back; with
``--never-join``, it heartbeats and never joins any (an engine that refuses
every group, as every GPU engine did before issue 73).

    python -m tests.programs.weight_receiver --control ADDR --actor-id ID
        [--dtype bfloat16] [--die-in VERSION | --die-after-join | --stall-join | --never-join]

Prints one line per publication: ``received VERSION TENSORS DTYPES``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import zmq

from protocol import (
    EngineInfo,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    MemberWelcome,
    WeightsAnnounce,
    WeightsLoaded,
)
from protocol.weights import WeightChannel, connect_store, dtype_name
from protocol.weights_backends import join_channel
from tests.protocol_clients import ControlClient

HEARTBEAT_S = 0.5
#: How long ``--stall-join`` holds its join back.
STALL_S = 12.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", required=True)
    parser.add_argument("--actor-id", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--die-in", type=int, default=None)
    parser.add_argument("--die-after-join", action="store_true")
    parser.add_argument("--stall-join", action="store_true")
    parser.add_argument("--never-join", action="store_true")
    args = parser.parse_args()
    client = ControlClient(zmq.Context(), args.control, args.actor_id)
    engine = EngineInfo(device="cpu", dtype=args.dtype, tensor_parallel=1, model="receiver")
    client.send(Hello, engine=engine, capacity=1)
    group: WeightChannel | None = None
    joined = -1
    joins = 0
    last_beat = 0.0

    def heartbeat() -> None:
        """(Also asked by a join whether to give it up: never.)"""
        nonlocal last_beat
        if time.monotonic() - last_beat > HEARTBEAT_S:
            client.send(Heartbeat, active_rollouts=0, stall_seconds={}, credit_ledger=0,
                        credits_seen=0)
            last_beat = time.monotonic()

    while True:
        heartbeat()
        if not client.socket.poll(100):
            continue
        message = client.receive()
        if isinstance(message, MemberWelcome):
            print(f"registered at version {message.policy_version}", flush=True)
            continue
        if isinstance(message, Error) and message.code != ErrorCode.DEAD_INCARNATION:
            client.send(Hello, engine=engine, capacity=1)  # a restarted learner
            continue
        if not isinstance(message, WeightsAnnounce):
            continue
        if args.never_join:
            print(f"not joining for version {message.version}", flush=True)
            continue
        info = message.group
        began = time.perf_counter()
        try:
            if info.generation != joined:
                if args.stall_join and joins == 0:
                    print(f"stalling the join of version {message.version}", flush=True)
                    stall_until = time.monotonic() + STALL_S
                    while time.monotonic() < stall_until:
                        heartbeat()
                        time.sleep(0.1)
                # heartbeating while it joins, as an actor does while its engine joins
                group = join_channel(connect_store(info.master_addr, info.master_port,
                                                   info.timeout_s), info.generation,
                                     info.world_size, info.rank, info.backend, info.timeout_s,
                                     heartbeat)
                joined, joins = info.generation, joins + 1
                if args.die_after_join and joins == 1:
                    print(f"dying after the join of version {message.version}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            dtypes = set()
            count = 0
            for _, tensor in group.receive(message.manifest):
                count += 1
                dtypes.add(dtype_name(tensor.dtype))
                if message.version == args.die_in:
                    print(f"dying in version {message.version}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
        except RuntimeError as exc:  # TransferFailed, or a generation that did not form
            print(f"failed {message.version}: {exc}", flush=True)
            joined = -1
            continue
        print(f"received {message.version} {count} {','.join(sorted(dtypes))}", flush=True)
        client.send(WeightsLoaded, version=message.version,
                    seconds=time.perf_counter() - began)


if __name__ == "__main__":
    main()

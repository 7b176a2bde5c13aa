"""A host on the run's network without the run's keys: it knows every
service address and tries each socket, without CURVE and with a key pair of
its own, then tries to join weight-group generations through the store.
Prints one JSON object: per attempt, the replies it got (all must be 0) and
how it ended.

    python tests/programs/intruder.py --replay HOST:PORT --replay-learner HOST:PORT \\
        --control HOST:PORT --store HOST:PORT --key DIR/intruder.key_secret \\
        --server-key DIR/server.key
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import zmq

from protocol import EngineInfo, Hello, LearnerHello, Stamp, encode
from protocol.transport import CurveConfig, TransportConfig, connect_dealer
from protocol.weights import StoreClient, connect_store
from protocol.weights_backends import join_channel

#: How long each attempt waits for a reply that must not come.
SILENCE_S = 3.0
#: How long each store call waits for an answer or a group.
STORE_TIMEOUT_S = 2.0
ENGINE = EngineInfo(device="cpu", dtype="bfloat16", tensor_parallel=1, model="m")


def _socket_attempt(context: zmq.Context, address: str, transport: TransportConfig,
                    message: bytes) -> dict:
    dealer = connect_dealer(context, address, transport)
    try:
        sent = bool(dealer.poll(int(SILENCE_S * 1000), zmq.POLLOUT))
        if sent:
            dealer.send(message, zmq.NOBLOCK)
        replies = 0
        end = time.monotonic() + SILENCE_S
        while (left := end - time.monotonic()) > 0:
            if dealer.poll(int(left * 1000), zmq.POLLIN):
                dealer.recv()
                replies += 1
        return {"replies": replies, "sent": sent}
    finally:
        dealer.close(linger=0)


def _store_call(host: str, port: int, transport: TransportConfig,
                call: Callable[[StoreClient], object]) -> str | None:
    """One call through a store client of its own (a client answers one call
    at a time, so calls that shared one would wait out each other's silence):
    None if it was answered, else the error it raised."""
    store = connect_store(host, port, STORE_TIMEOUT_S, transport)
    try:
        call(store)
        return None
    except RuntimeError as exc:  # DistStoreError: no answer, or a join that timed out
        return str(exc)[:200]
    finally:
        store.close()


def _join(store: StoreClient, generation: int, rank: int) -> None:
    join_channel(store, generation, 3, rank, "gloo", STORE_TIMEOUT_S)


def _store_attempts(host: str, port: int, transport: TransportConfig) -> dict:
    """Read the store, and join generations 1..4 as every rank a small group
    could give an actor, all at once: each must fail (no group, so no tensor)."""
    reads: list[Callable[[StoreClient], object]] = [
        lambda store: store.num_keys(), lambda store: store.get("weights/1/rank_0")]
    joins = [functools.partial(_join, generation=generation, rank=rank)
             for generation in range(1, 5) for rank in (1, 2)]
    with ThreadPoolExecutor(max_workers=len(reads) + len(joins)) as pool:
        errors = list(pool.map(lambda call: _store_call(host, port, transport, call),
                               [*reads, *joins]))
    read_errors, join_errors = errors[:len(reads)], errors[len(reads):]
    return {"replies": read_errors.count(None), "joined": join_errors.count(None),
            "read_errors": sorted({e for e in read_errors if e}),
            "join_errors": sorted({e for e in join_errors if e})}


def _raw_bytes(host: str, port: int) -> int:
    """Bytes a plain TCP client reads from the store's port: the ZeroMQ
    greeting at most, never an answer (it speaks no CURVE)."""
    with socket.create_connection((host, port), timeout=SILENCE_S) as raw:
        raw.sendall(b"GET weights\r\n\r\n")
        raw.settimeout(SILENCE_S)
        received = 0
        try:
            while chunk := raw.recv(4096):
                received += len(chunk)
        except (TimeoutError, ConnectionResetError):  # silence, or dropped for garbage
            pass
    return received


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("replay", "replay-learner", "control", "store"):
        parser.add_argument(f"--{name}", required=True, help="HOST:PORT")
    parser.add_argument("--key", required=True, help="the intruder's own secret key")
    parser.add_argument("--server-key", required=True, help="the run's public server key")
    args = parser.parse_args()
    stamp = Stamp("intruder", 1)
    hello = encode(Hello(**stamp.next(), engine=ENGINE, capacity=1, token=bytes(16)))
    learner_hello = encode(LearnerHello(**stamp.next()))
    transports = {
        "no CURVE": TransportConfig(),
        "its own key": TransportConfig(curve=CurveConfig(
            enabled=True, client_secret_key=args.key, server_public_key=args.server_key)),
    }
    host, _, port = args.store.rpartition(":")
    context = zmq.Context()
    # Every attempt waits out its own silence: they run at once, each with a
    # socket (or store client) of its own, so the whole takes the longest one.
    attempts: dict[str, Callable[[], dict]] = {}
    for why, transport in transports.items():
        for target, address, message in (("replay", args.replay, hello),
                                         ("replay-learner", args.replay_learner, learner_hello),
                                         ("control", args.control, hello)):
            attempts[f"{target} / {why}"] = functools.partial(
                _socket_attempt, context, f"tcp://{address}", transport, message)
        attempts[f"store / {why}"] = functools.partial(_store_attempts, host, int(port),
                                                       transport)
    attempts["store / plain TCP"] = lambda: {"bytes": _raw_bytes(host, int(port))}
    try:
        with ThreadPoolExecutor(max_workers=len(attempts)) as pool:
            running = {what: pool.submit(attempt) for what, attempt in attempts.items()}
            results = {what: future.result() for what, future in running.items()}
    finally:
        context.destroy(linger=0)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

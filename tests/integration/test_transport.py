"""Socket helpers on real ZeroMQ sockets over loopback."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import zmq

from protocol import EngineInfo, Hello, Welcome, decode, encode
from protocol.messages import Stamp
from protocol.transport import (
    Authenticator,
    CurveConfig,
    TransportConfig,
    bind_router,
    connect_dealer,
    generate_keys,
)
from tests.processes import run_command
from tests.protocol_clients import dealer

ROOT = Path(__file__).parents[2]
RECEIVE_TIMEOUT_MS = 3000
#: How long to wait for a message that must not arrive.
SILENCE_MS = 1500


def _hello(stamp: Stamp) -> Hello:
    return Hello(**stamp.next(), capacity=2, token=bytes(16),
                 engine=EngineInfo(device="cpu", dtype="bfloat16", tensor_parallel=1, model="m"))


def _receive(socket: zmq.Socket, timeout_ms: int) -> list[bytes] | None:
    if socket.poll(timeout_ms, zmq.POLLIN):
        return socket.recv_multipart()
    return None


def _endpoint(socket: zmq.Socket) -> str:
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


def test_dealer_router_round_trip(context: zmq.Context) -> None:
    config = TransportConfig()
    router = bind_router(context, "tcp://127.0.0.1:*", config)
    client = connect_dealer(context, _endpoint(router), config)
    client.send(encode(_hello(Stamp("actor-1", 1))))
    identity, frame = _receive(router, RECEIVE_TIMEOUT_MS)
    # the client presents no routing id: the ROUTER names the connection (00 + 4 bytes)
    assert len(identity) == 5 and identity[0] == 0 and isinstance(decode(frame), Hello)
    welcome = Welcome(**Stamp("replay", 0).next(), run_id="run", policy_version=3,
                      heartbeat_interval_s=1.0, heartbeat_liveness=5, max_staleness=2,
                      rollouts_per_batch=8, credits=4, credit_ledger=1, credits_total=4,
                      max_message_bytes=1 << 20, vocab_size=1000, stale_grace=0)
    router.send_multipart([identity, encode(welcome)])
    [reply] = _receive(client, RECEIVE_TIMEOUT_MS)
    assert decode(reply) == welcome


def test_router_refuses_to_send_to_an_unknown_peer(context: zmq.Context) -> None:
    router = bind_router(context, "tcp://127.0.0.1:*", TransportConfig())
    with pytest.raises(zmq.ZMQError) as info:
        router.send_multipart([b"nobody", b"x"])
    assert info.value.errno == zmq.EHOSTUNREACH


def test_frames_over_the_size_cap_never_arrive(context: zmq.Context) -> None:
    config = TransportConfig(max_message_bytes=64 * 1024)
    router = bind_router(context, "tcp://127.0.0.1:*", config)
    big = connect_dealer(context, _endpoint(router), TransportConfig())
    big.send(b"\0" * (128 * 1024))
    assert _receive(router, SILENCE_MS) is None
    small = connect_dealer(context, _endpoint(router), TransportConfig())
    small.send(b"ok")
    assert _receive(router, RECEIVE_TIMEOUT_MS)[1] == b"ok"


def test_a_peer_presenting_a_routing_id_in_use_is_not_heard_and_takes_nothing_over(
        context: zmq.Context) -> None:
    """No ROUTER_HANDOVER: a second connection that presents the routing id
    of a live one (an impostor, or a client of another make that sets one)
    is ignored by ZeroMQ; the first connection keeps sending and receiving."""
    router = bind_router(context, "tcp://127.0.0.1:*", TransportConfig())
    first = dealer(context, _endpoint(router), routing_id=b"actor-1/5f0c")
    first.send(b"first")
    assert _receive(router, RECEIVE_TIMEOUT_MS) == [b"actor-1/5f0c", b"first"]
    impostor = dealer(context, _endpoint(router), routing_id=b"actor-1/5f0c")
    impostor.send(b"impostor")
    assert _receive(router, SILENCE_MS) is None
    router.send_multipart([b"actor-1/5f0c", b"reply"])
    assert _receive(first, RECEIVE_TIMEOUT_MS) == [b"reply"]
    assert _receive(impostor, SILENCE_MS) is None
    first.send(b"again")
    assert _receive(router, RECEIVE_TIMEOUT_MS) == [b"actor-1/5f0c", b"again"]


def _send_unless_refused(dealer: zmq.Socket, frame: bytes) -> None:
    """Send unless the server has refused the handshake already: a refusal
    is a protocol error, after which libzmq drops the connection's pipe (a
    blocking send would then wait forever; measured: one send queued at 0.1 s,
    the next 49 every 0.1 s refused with EAGAIN)."""
    with contextlib.suppress(zmq.Again):
        dealer.send(frame, zmq.NOBLOCK)


def test_curve_admits_only_authorized_keys(context: zmq.Context,
                                           curve: tuple[CurveConfig, Path]) -> None:
    curve_config, intruder_secret = curve
    secure = TransportConfig(curve=curve_config)
    with Authenticator(context, curve_config):
        router = bind_router(context, "tcp://127.0.0.1:*", secure)
        address = _endpoint(router)

        plain = connect_dealer(context, address, TransportConfig())
        _send_unless_refused(plain, b"no keys")
        intruder_config = CurveConfig(**{**vars(curve_config),
                                         "client_secret_key": str(intruder_secret)})
        intruder = connect_dealer(context, address, TransportConfig(curve=intruder_config))
        _send_unless_refused(intruder, b"wrong key")
        assert _receive(router, SILENCE_MS) is None

        member = connect_dealer(context, address, secure)
        member.send(b"right key")
        assert _receive(router, RECEIVE_TIMEOUT_MS)[1] == b"right key"
        assert _receive(router, SILENCE_MS) is None


def test_generated_secret_keys_are_private(tmp_path: Path) -> None:
    paths = generate_keys(tmp_path, ["server", "client-0"])
    for _public, secret in paths.values():
        assert secret.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in (tmp_path / "authorized").iterdir()) == ["client-0.key"]


#: A program that prints the routing id the first peer without one gets from
#: a ROUTER made by ``bind_router``, in a fresh process.
FIRST_ANONYMOUS_ID = """
import zmq
from protocol.transport import TransportConfig, bind_router
context = zmq.Context()
router = bind_router(context, "tcp://127.0.0.1:*", TransportConfig())
peer = context.socket(zmq.DEALER)
peer.connect(router.last_endpoint)
peer.send(b"x")
print(router.recv_multipart()[0].hex())
context.destroy(linger=0)
"""


def test_bind_router_numbers_anonymous_peers_from_an_unguessable_start() -> None:
    """libzmq counts the routing ids of peers that present none from
    ``rand()``, which nothing seeds: unseeded, every process gives its first
    anonymous peer the same id, which a peer can present first to make
    libzmq abort (tests/faults/test_hostile_input.py). ``bind_router`` seeds
    it, so two fresh processes start their counts apart (equal by chance
    with probability 2**-32)."""
    first = []
    for _ in range(2):
        result = run_command([sys.executable, "-c", FIRST_ANONYMOUS_ID], timeout=60,
                             env={"PYTHONPATH": str(ROOT)})
        assert result.returncode == 0, result.stderr[-2000:]
        first.append(result.stdout.strip())
    assert first[0] != first[1] and all(id_.startswith("00") for id_ in first), first

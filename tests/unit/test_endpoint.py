"""Both sides of a link (protocol/endpoint.py), over real ZeroMQ pairs: the
rules every service shares, dispatch by message type, and a client's
registration, dropping and disconnect counting."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from protocol import (
    BatchRequest,
    Error,
    ErrorCode,
    Heartbeat,
    Message,
    ProtocolError,
    Stamp,
    decode,
    encode,
)
from protocol.endpoint import (
    MESSAGES_PER_PASS,
    ClientEndpoint,
    Received,
    ServerEndpoint,
    read_reply,
)
from tests.hostile_frames import nested_under_a_key


@pytest.fixture
def pair() -> Iterator[tuple[ServerEndpoint, zmq.Socket, list]]:
    """An endpoint on a ROUTER, a DEALER named ``client`` connected to it,
    and the refusals the endpoint counted."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind("inproc://endpoint")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"client")
    dealer.connect("inproc://endpoint")
    refused: list[tuple[ErrorCode, Message | None]] = []
    endpoint = ServerEndpoint(router, Stamp("server", 1), 1 << 20,
                              lambda code, message: refused.append((code, message)))
    yield endpoint, dealer, refused
    dealer.close(linger=0)
    router.close(linger=0)
    context.term()


def received(endpoint: ServerEndpoint) -> list[Received]:
    assert endpoint.socket.poll(5000)
    return list(endpoint.receive())


def reply(dealer: zmq.Socket) -> Message:
    assert dealer.poll(5000)
    return decode(dealer.recv())


def test_a_message_goes_to_the_handler_of_its_type(pair) -> None:
    endpoint, dealer, refused = pair
    stamp = Stamp("client", 1)
    dealer.send(encode(BatchRequest(**stamp.next(), size=2, policy_version=3)))
    handled = []
    for message in received(endpoint):
        endpoint.dispatch({BatchRequest: handled.append}, message)
    [one] = handled
    assert (one.identity, one.message.size) == (b"client", 2) and not refused


def test_a_pass_takes_a_bounded_share_of_a_flood_and_leaves_the_rest_queued(pair) -> None:
    """A peer faster than its messages are handled cannot hold the caller's
    loop in one pass: each takes at most MESSAGES_PER_PASS, the rest wait."""
    endpoint, dealer, _ = pair
    stamp = Stamp("client", 1)
    flood = 2 * MESSAGES_PER_PASS + 3
    for _ in range(flood):
        dealer.send(encode(BatchRequest(**stamp.next(), size=2, policy_version=3)))
    assert endpoint.socket.poll(5000)
    passes = []
    while endpoint.socket.poll(1000):
        passes.append(len(list(endpoint.receive())))
    assert passes == [MESSAGES_PER_PASS, MESSAGES_PER_PASS, 3]


def test_a_type_the_table_lacks_is_refused_as_unexpected_naming_its_seq(pair) -> None:
    endpoint, dealer, refused = pair
    heartbeat = Heartbeat(**Stamp("client", 1, first_seq=41).next(), active_rollouts=0,
                          stall_seconds={}, credit_ledger=0, credits_seen=0)
    dealer.send(encode(heartbeat))
    for message in received(endpoint):
        endpoint.dispatch({BatchRequest: lambda _: None}, message)
    error = reply(dealer)
    assert isinstance(error, Error)
    assert (error.code, error.ref_seq) == (ErrorCode.UNEXPECTED, 41)
    assert refused == [(ErrorCode.UNEXPECTED, heartbeat)]


@pytest.mark.parametrize("frames, code, ref_seq", [
    ([b"\xc1"], ErrorCode.MALFORMED, None),
    ([b"a", b"b"], ErrorCode.MALFORMED, None),
], ids=["not-msgpack", "two-frames"])
def test_a_frame_that_breaks_a_rule_is_refused_before_any_handler(
        pair, frames: list[bytes], code: ErrorCode, ref_seq: int | None) -> None:
    endpoint, dealer, refused = pair
    dealer.send_multipart(frames)
    assert received(endpoint) == []
    error = reply(dealer)
    assert (error.code, error.ref_seq) == (code, ref_seq)
    assert [c for c, _ in refused] == [code]


def test_a_reply_to_a_peer_that_has_gone_is_counted_not_raised(pair) -> None:
    endpoint, _, _ = pair
    undelivered = []
    endpoint.undelivered = lambda: undelivered.append(1)
    endpoint.send_frame(b"nobody", b"frame")
    assert undelivered == [1]


# --------------------------------------------------------------------------- client side


async def _client_scenario() -> None:
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"client")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    link = ClientEndpoint(dealer, 1 << 20)
    server, client = Stamp("server", 1), Stamp("client", 1)
    errors: list[Error] = []
    dropped: list[ProtocolError] = []
    tasks = [asyncio.create_task(link.serve({Error: errors.append}, dropped.append)),
             asyncio.create_task(link.register(
                 lambda: Heartbeat(**client.next(), active_rollouts=0, stall_seconds={},
                                   credit_ledger=0, credits_seen=0), retry_s=0.05))]
    disconnects: list[None] = []
    tasks.append(asyncio.create_task(link.count_disconnects(lambda: disconnects.append(None))))
    try:
        # Hello is retried until welcomed ...
        hellos = [await router.recv_multipart() for _ in range(2)]
        assert all(identity == b"client" for identity, _ in hellos)
        link.welcomed()
        await asyncio.sleep(0.05)
        while await router.poll(100):  # one retry may have been on its way
            await router.recv_multipart()
        assert not await router.poll(200)
        # ... and again once forgotten
        link.forgotten()
        identity, frame = await router.recv_multipart()
        assert isinstance(decode(frame), Heartbeat)
        link.welcomed()

        # a reply goes to its handler; what cannot be taken is dropped, told why
        error = Error(**server.next(), code=ErrorCode.FULL, text="full", ref_seq=3)
        await router.send_multipart([b"client", encode(error)])
        await router.send_multipart([b"client", b"\xc1"])
        await router.send_multipart([b"client", encode(BatchRequest(
            **server.next(), size=1, policy_version=0))])
        bomb = nested_under_a_key(msgspec.msgpack.decode(encode(error)))
        await router.send_multipart([b"client", bomb])
        for _ in range(100):
            if len(dropped) == 3:
                break
            await asyncio.sleep(0.01)
        assert [(e.code, e.ref_seq) for e in errors] == [(ErrorCode.FULL, 3)]
        assert [(d.code, d.ref_seq) for d in dropped] == [(ErrorCode.MALFORMED, None),
                                                          (ErrorCode.UNEXPECTED, 1),
                                                          (ErrorCode.MALFORMED, 0)]

        # the server going away is a disconnect, counted
        router.close(linger=0)
        for _ in range(200):
            if disconnects:
                break
            await asyncio.sleep(0.01)
        assert disconnects
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        dealer.close(linger=0)
        router.close(linger=0)
        context.term()


def test_a_client_registers_until_welcomed_and_drops_what_it_cannot_take() -> None:
    asyncio.run(asyncio.wait_for(_client_scenario(), 60))


def test_a_read_reply_is_returned_once_handled_and_nothing_for_a_dropped_frame() -> None:
    """A client waiting for a reply takes it from the read, not from a
    handler's state: the message its handler was given, or None."""
    stamp = Stamp("server", 1)
    error = Error(**stamp.next(), code=ErrorCode.FULL, text="full", ref_seq=3)
    handled: list[Error] = []
    dropped: list[ProtocolError] = []
    assert read_reply(encode(error), 1 << 20, {Error: handled.append}, dropped.append) == error
    assert handled == [error]
    unexpected = encode(BatchRequest(**stamp.next(), size=1, policy_version=0))
    for frame in (b"\xc1", unexpected):
        assert read_reply(frame, 1 << 20, {Error: handled.append}, dropped.append) is None
    assert [d.code for d in dropped] == [ErrorCode.MALFORMED, ErrorCode.UNEXPECTED]
    assert handled == [error]
